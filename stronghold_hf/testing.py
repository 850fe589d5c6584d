"""Test modes that make a CPU-only machine behave like a GPU one.

On a machine without CUDA the "device" and the host are the same memory, and copies are
synchronous, so a missing wait or a buffer reused too early cannot show. `simulated_device`
makes every engine built inside it run its copies on background threads with an injected
delay, completing through the same events and waits as CUDA streams (``transfer.py``), delays
every task of the host worker (CPU Adam updates, gradient folds) by the same amount, and
books its transfer buffers as pinned, optionally refusing past a byte count (``memory.py``),
so the pageable fallback runs too. The parity tests run under it in CI.

The environment variable ``STRONGHOLD_SIMULATE_COPY_DELAY_MS`` turns the delayed copies on
for a whole process (for example a full test run).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import transfer, window
from .memory import SimulatedPinning


@contextlib.contextmanager
def simulated_device(copy_delay_s: float = 0.002, *, pin_fail_after_bytes: int | None = None) -> Iterator[SimulatedPinning]:
    """Engines built inside run with delayed background copies and simulated pinning."""
    pinning = SimulatedPinning(pin_fail_after_bytes)
    saved = transfer._simulated_copy_delay_s, window._simulated_pinning
    transfer._simulated_copy_delay_s, window._simulated_pinning = copy_delay_s, pinning
    try:
        yield pinning
    finally:
        transfer._simulated_copy_delay_s, window._simulated_pinning = saved
