"""``window_size="auto"``: measure the first training step, then let the planner choose ``W``.

The first step runs with `DEFAULT_WINDOW_SIZE`. Meanwhile this probe records, per block, the
forward time (pre- to post-forward hook) and the backward time (pre- to post-backward node,
which includes the recompute under gradient checkpointing), with CUDA events on the GPU and
``perf_counter`` on the CPU. After that backward it measures the host<->device bandwidth
with pinned buffers and the device memory left, hands everything to
`planner.choose_window`, resizes the slot pool, and logs the choice in one line.

Reading CUDA event times synchronises once; that happens at start-up only, never on the
hot path. On a CPU-only device there is no link to hide, and `choose_window_for_cpu`
decides (and says why) at construction.
"""

from __future__ import annotations

import logging
import time

import torch

from .planner import BlockProfile, WindowChoice, choose_window, choose_window_for_cpu, measure_link

logger = logging.getLogger("stronghold_hf")

#: Device bytes kept free beyond what the first step used: allocator fragmentation and
#: kernels' workspaces that the first step may not have exercised.
HEADROOM_BYTES = 512 << 20


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start


class AutoWindowProbe:
    """Records one training step's per-block times; `finish` returns the planner's choice."""

    def __init__(self, blocks: list, device: torch.device, window_bytes_cap: int | None = None) -> None:
        self.blocks = blocks  # the block units, indices 0..N-1
        self.device = device
        # The most the window's slots may hold: with gpu_memory given, what the device/host
        # split left of it (split.py); None: the free device memory decides alone.
        self.window_bytes_cap = window_bytes_cap
        self.clock = _Clock(device)
        n = len(blocks)
        self.fwd_start: list = [None] * n
        self.fwd_end: list = [None] * n
        self.bwd_start: list = [None] * n
        self.bwd_end: list = [None] * n
        self.active = False
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def pre_forward(self, index: int) -> None:
        if torch.is_grad_enabled():
            self.active = True
            self.fwd_start[index] = self.clock.mark()

    def post_forward(self, index: int) -> None:
        if self.active and self.fwd_start[index] is not None:
            self.fwd_end[index] = self.clock.mark()

    def pre_backward(self, index: int) -> None:
        if self.active and self.bwd_start[index] is None:
            self.bwd_start[index] = self.clock.mark()

    def post_backward(self, index: int) -> None:
        if self.active and self.bwd_start[index] is not None:
            self.bwd_end[index] = self.clock.mark()

    def complete(self) -> bool:
        return self.active and all(x is not None for x in self.fwd_end) and all(x is not None for x in self.bwd_end)

    def finish(self) -> WindowChoice:
        device = self.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # start-up only: event times need it
        profiles = [
            BlockProfile(
                b.fqn,
                self.clock.seconds(self.fwd_start[b.index], self.fwd_end[b.index]),
                self.clock.seconds(self.bwd_start[b.index], self.bwd_end[b.index]),
                b.slot_bytes,
            )
            for b in self.blocks
        ]
        if device.type != "cuda":
            return choose_window_for_cpu(len(self.blocks))
        link = measure_link(device)
        free, _total = torch.cuda.mem_get_info(device)
        cached_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        # The first step's activations and temporaries must still fit next to a larger window.
        step_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
        # The gradient lanes are already counted in the first step's peak (they are K buffers
        # whatever W is); what grows with W is one slot per extra block.
        budget = max(0, free + cached_free - step_extra - HEADROOM_BYTES)
        if self.window_bytes_cap is not None:
            budget = min(budget, max(0, self.window_bytes_cap))
        slot_bytes = max(b.slot_bytes for b in self.blocks)
        return choose_window(profiles, link, device_bytes_free=budget, slot_bytes=slot_bytes)
