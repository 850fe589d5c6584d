"""Data parallelism on torch.distributed (NCCL on GPU, gloo on CPU), without DDP.

DDP registers every parameter and buckets them by storage, which cannot work for offloaded
parameters whose storage comes and goes. The engine communicates itself, with the process
group that ``accelerate launch`` / ``torchrun`` set up, in the places FSDP2's
``_fsdp_collectives.py`` does:

* **sharded CPU state** (the default, ZeRO-Offload's partition): each rank keeps masters,
  gradients and Adam state for one shard of every block's trainable region. A fetch copies
  the local shard to the device and all-gathers the block there; a flush reduce-scatters
  the gradient on the device and copies only the local shard to the host. Host memory per
  rank falls as ``1/world``; the link carries ``1/world`` of each block each way.
* **replicated CPU state** (``StrongholdConfig(shard_cpu_state=False)``): every rank keeps the
  whole state; a flush all-reduces the gradient on the device. Less communication, ``world``
  times the host memory.
* resident gradients (embeddings, heads) are all-reduced at the end of backward, every rank
  the same list (an unused parameter contributes zeros, as in DDP with unused parameters);
* scalars the ranks must agree on (the global gradient norm, the overflow verdict, the auto
  window size) are all-reduced.

[Note: collectives on the right backend] Device tensors go through the default group (NCCL on
CUDA). Tensors that live on the host (the initial broadcast of block weights, the gather of a
full state dict) go through a gloo group made for them: NCCL cannot take CPU tensors. On a
CPU-only run the default group is gloo and is used for both.

[Note: collective order] Every rank must issue the same collectives in the same order. The
engine issues them only at points every rank reaches in the same order: the use of a block
(its all-gather, when a forward or backward needs it, never at a prefetch, whose timing
depends on the local CPU updates), a flush (a block's backward done, an eviction for room,
the end of backward), the end of backward, and the step's norm.

[Note: the process group's last reference] A gloo collective runs on one of the process
group's worker threads (``pt_gloo_runloop``), and a synchronous call returns as soon as the
work is marked complete: the worker thread still holds the work, and with it the tensors it
was handed, until it comes round to dropping them (measured: in about 40% of calls on a busy
2-core machine). A tensor made in Python carries its Python object, and the C++ reference
that goes from 2 to 1 must release that object, which takes the GIL. While the interpreter
runs, the thread waits for the GIL and carries on. Once ``Py_FinalizeEx`` has begun, a thread
that takes the GIL is made to exit with ``pthread_exit`` from inside the work's ``noexcept``
destructor, and the forced unwind ends in ``std::terminate``: "terminate called without an
active exception" and SIGABRT, after training had finished (issue #36). The engine therefore
hands each collective fresh aliases (``detach()``: new tensors on the same storage) that only
the process group and a weak reference know, so the alias dies exactly when the group lets go
of it; `DataParallel.settle` waits for that, with the GIL released, before anything tears the
group down (``lifecycle.py`` orders the rest).
"""

from __future__ import annotations

import logging
import time
import weakref

import torch
import torch.distributed as dist

logger = logging.getLogger("stronghold_hf")

#: How long `DataParallel.settle` waits for the process group to drop the engine's tensors. A
#: gloo worker drops them within microseconds; NCCL's watchdog within its polling interval.
SETTLE_TIMEOUT_S = 10.0


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


class DataParallel:
    """The engine's communication with the other ranks (see the module docstring)."""

    def __init__(self, device: torch.device, *, sharded: bool) -> None:
        self.device = device
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.sharded = sharded
        backend = dist.get_backend()
        # [Note: collectives on the right backend]
        self.host_group = None if backend == "gloo" else dist.new_group(backend="gloo")
        # Aliases of this engine's tensors a process group may still hold ([Note: the process group's last reference]).
        self._handed: list[weakref.ref] = []

    @property
    def shards(self) -> int:
        return self.world if self.sharded else 1

    @property
    def shard_rank(self) -> int:
        return self.rank if self.sharded else 0

    # ------------------------------------------------------------------ blocks
    def all_gather_(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """``full`` [world * n] on the device; ``local`` is this rank's chunk of it (in place)."""
        dist.all_gather_into_tensor(*self._hand(full, local))

    def reduce_gradient_(self, lane: torch.Tensor, shard_numel: int) -> torch.Tensor:
        """Averages a flat device gradient across ranks; returns the part this rank keeps."""
        if not self.sharded:
            dist.all_reduce(*self._hand(lane))
            return lane.div_(self.world)
        local = lane[self.rank * shard_numel : (self.rank + 1) * shard_numel]
        dist.reduce_scatter_tensor(*self._hand(local, lane))
        return local.div_(self.world)

    # ------------------------------------------------------------------ resident parameters
    def average_resident_grads_(self, params: list[torch.nn.Parameter]) -> None:
        """One flat all-reduce over the trainable resident parameters' gradients (mean)."""
        if not params:
            return
        grads = []
        for p in params:
            if p.grad is None:  # unused on this rank: zeros, so every rank sends the same layout
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(*self._hand(flat))
        flat.div_(self.world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def resident_grad_averaging(self, params):
        """A function to call from inside a backward (the schedule calls it when the backward
        reaches the model's outputs): it queues, once per backward, the average of the gradients
        of ``params()`` (the parameters the engine leaves on the device: resident units of the
        split, everything outside the blocks with ``offload_non_block=False``, adapters attached
        later) at the end of that backward, as DDP would. Every training backward averages, with
        zeros for a parameter that got no gradient, so every rank issues the same collective;
        and it is queued on the outermost backward, never once per reentrant checkpoint."""
        pending = {"task": None}

        def average() -> None:
            pending["task"] = None
            self.average_resident_grads_([p for p in params() if p.requires_grad])

        def queue() -> None:
            task = torch._C._current_graph_task_id()
            if pending["task"] != task:
                pending["task"] = task
                torch.autograd.Variable._execution_engine.queue_callback(average)

        return queue

    def broadcast_(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Rank ``src``'s values everywhere; host tensors through the host group."""
        for t in tensors:
            group = self.host_group if (t.device.type == "cpu" and self.host_group is not None) else None
            dist.broadcast(*self._hand(t), src=src, group=group)

    def all_gather_host_(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Like `all_gather_` for host tensors (a full state dict)."""
        dist.all_gather_into_tensor(*self._hand(full, local), group=self.host_group)

    # ------------------------------------------------------------------ agreement
    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum across ranks of a device tensor (the squared gradient norm)."""
        dist.all_reduce(*self._hand(t))
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place element-wise maximum across ranks of a device tensor (a flag per block)."""
        dist.all_reduce(*self._hand(t), op=dist.ReduceOp.MAX)
        return t

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(*self._hand(t), op=dist.ReduceOp.MIN)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.host_group)

    # ------------------------------------------------------------------ teardown
    def _hand(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Aliases of ``tensors`` for one collective, watched until the process group drops
        them ([Note: the process group's last reference]). Those it dropped already are forgotten."""
        aliases = tuple(t.detach() for t in tensors)
        self._handed = [r for r in self._handed if r() is not None]
        self._handed.extend(weakref.ref(a) for a in aliases)
        return aliases

    def held_by_group(self) -> int:
        """How many tensors of the engine's collectives a process group still holds."""
        self._handed = [r for r in self._handed if r() is not None]
        return len(self._handed)

    def settle(self, timeout: float = SETTLE_TIMEOUT_S) -> bool:
        """Waits until the process groups hold no tensor of the engine's collectives any more,
        sleeping (the GIL released: dropping the last one takes it) in between. Local, no
        collective: safe on one rank alone, also after an error. Returns False on timeout."""
        deadline = time.monotonic() + timeout
        while self.held_by_group():
            if time.monotonic() > deadline:
                logger.debug("stronghold: the process group still holds %d tensor(s) of the engine's collectives "
                             "after %.0f s", len(self._handed), timeout)
                return False
            time.sleep(1e-4)
        return True

    def close(self) -> None:
        """After the engine's last collective: `settle`, then gives back the gloo group it
        made for host tensors. Dropping the last reference here, in Python, lets pybind
        release the GIL while the group joins its worker threads (``lifecycle.py``)."""
        self.settle()
        group, self.host_group = self.host_group, None
        if group is not None:
            if is_initialized() and group in _registered_groups():
                dist.destroy_process_group(group)
            del group  # the last reference: the group's threads are joined now, not at interpreter exit


def _registered_groups() -> list:
    """Every process group torch.distributed knows (its registry is private: the default group
    alone where that registry is not found)."""
    from torch.distributed import distributed_c10d as c10d

    groups = list(getattr(getattr(c10d, "_world", None), "pg_map", None) or ())
    return groups or ([dist.group.WORLD] if is_initialized() else [])
