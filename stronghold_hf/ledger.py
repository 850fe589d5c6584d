"""The memory ledger: every byte the engine allocates, on the device and on the host.

Why it exists: the product's promise is that device memory does not grow with depth and
that the host holds a known number of bytes per parameter. On a CPU-only machine the device
and the host are the same memory, so ``torch.cuda.max_memory_allocated`` cannot be asked,
and a test that only trains would never notice a gradient buffer that outlives its block.
The engine therefore books each of its buffers here when it allocates it and when it frees
it (slots, gradient buffers, host arenas, staging), on CPU and CUDA alike. The CPU tests
assert the GPU invariants on these numbers; ``scripts/gpu_check.sh`` checks on a real GPU
that they agree with ``torch.cuda.max_memory_allocated``.

What is *not* booked with the device bytes: tensors autograd allocates on its own
(activations, a gradient that arrives after its unit left, see ``schedule.py``) and
parameters the engine leaves on the device (``offload_non_block=False``). The checkpointed
block inputs are booked apart (``activation_*``, see ``activations.py``). The CPU optimizer's state is added by
`WindowEngine.memory_stats` from the optimizer itself.
"""

from __future__ import annotations

import threading


class MemoryLedger:
    """Thread-safe counters; one per engine. Sizes in bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.device_bytes = 0
        self.device_peak_bytes = 0
        self.pinned_host_bytes = 0
        self.pageable_host_bytes = 0
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.fetches = 0
        # Checkpointed block inputs the engine holds on the device (activations.py), and the
        # host buffers they are offloaded into.
        self.activation_device_bytes = 0
        self.activation_device_peak_bytes = 0
        self.activation_host_bytes = 0
        # The part of the checkpoint file (nvme_activations) in use, and its peak.
        self.activation_disk_bytes = 0
        self.activation_disk_peak_bytes = 0

    # ------------------------------------------------------------------ device
    def device_alloc(self, nbytes: int) -> None:
        with self._lock:
            self.device_bytes += nbytes
            if self.device_bytes > self.device_peak_bytes:
                self.device_peak_bytes = self.device_bytes

    def device_free(self, nbytes: int) -> None:
        with self._lock:
            self.device_bytes -= nbytes
            assert self.device_bytes >= 0, "ledger: more device bytes freed than allocated"

    def reset_peak(self) -> None:
        with self._lock:
            self.device_peak_bytes = self.device_bytes
            self.activation_device_peak_bytes = self.activation_device_bytes

    # ------------------------------------------------------------------ activations
    def activation_alloc(self, nbytes: int) -> None:
        with self._lock:
            self.activation_device_bytes += nbytes
            if self.activation_device_bytes > self.activation_device_peak_bytes:
                self.activation_device_peak_bytes = self.activation_device_bytes

    def activation_free(self, nbytes: int) -> None:
        with self._lock:
            self.activation_device_bytes -= nbytes
            assert self.activation_device_bytes >= 0, "ledger: more activation bytes freed than held"

    def set_activation_disk_bytes(self, nbytes: int) -> None:
        with self._lock:
            self.activation_disk_bytes = nbytes
            self.activation_disk_peak_bytes = max(self.activation_disk_peak_bytes, nbytes)

    def set_activation_host_bytes(self, nbytes: int) -> None:
        with self._lock:
            self.activation_host_bytes = nbytes

    # ------------------------------------------------------------------ host
    def host_alloc(self, nbytes: int, *, pinned: bool) -> None:
        with self._lock:
            if pinned:
                self.pinned_host_bytes += nbytes
            else:
                self.pageable_host_bytes += nbytes

    def host_free(self, nbytes: int, *, pinned: bool) -> None:
        with self._lock:
            if pinned:
                self.pinned_host_bytes -= nbytes
            else:
                self.pageable_host_bytes -= nbytes

    # ------------------------------------------------------------------ traffic
    def count_h2d(self, nbytes: int, *, fetch: bool) -> None:
        with self._lock:
            self.h2d_bytes += nbytes
            self.fetches += int(fetch)

    def count_d2h(self, nbytes: int) -> None:
        with self._lock:
            self.d2h_bytes += nbytes

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "device_bytes": self.device_bytes,
                "device_peak_bytes": self.device_peak_bytes,
                "pinned_host_bytes": self.pinned_host_bytes,
                "pageable_host_bytes": self.pageable_host_bytes,
                "h2d_bytes": self.h2d_bytes,
                "d2h_bytes": self.d2h_bytes,
                "fetches": self.fetches,
                "activation_device_bytes": self.activation_device_bytes,
                "activation_device_peak_bytes": self.activation_device_peak_bytes,
                "activation_host_bytes": self.activation_host_bytes,
                "activation_disk_bytes": self.activation_disk_bytes,
                "activation_disk_peak_bytes": self.activation_disk_peak_bytes,
            }
