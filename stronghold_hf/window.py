"""The working window: hooks that slide ``W`` resident blocks over the model, and `offload_model`.

Schedule over the global block sequence ``0..N-1`` (all stacks, encoder before decoder):

* **forward** of block ``i``: its CPU update (if any) must be done; make it resident and
  prefetch ``i+1..i+W``; blocks already passed are evicted when a slot is needed. The last
  ``W`` blocks of a differentiable pass stay resident: backward needs them first, so
  nothing moves at the turn.
* **backward** of a use of block ``i`` (pre-backward node on its outputs): make it resident,
  give its trainable parameters a gradient lane (``grads.py``), prefetch ``i-1..i-W``. When
  the block's last pending use is done (post-backward node on its inputs), its lane is
  flushed to the host and the block is evicted: gradients drain during backward.
* **after the backward** (an autograd engine callback): late gradients are flushed, every
  block is evicted, the folds are awaited, and each trainable parameter's ``.grad`` is its
  fp32 host gradient.

Residency is counted per use (``hooks.BlockUse``): a block may run several times in one step
(two forwards and one backward; ALBERT's shared group at every layer), or be recomputed by
gradient checkpointing inside backward. At most ``W + 1`` blocks hold device storage at any
time (the `DeviceSlotPool` enforces it) and at most ``K`` gradient lanes exist, so device
memory does not grow with depth; `memory_stats()` shows it on CPU as well as on CUDA.

Between steps every block is on the host and its parameters point at their host memory, so
they are always safe to read and write (block.py, [Note: parameters always point at real
memory]). A backward that raises half-way is noticed at the next call into the engine and
rolled back: its device gradients are dropped, and gradients it already folded are removed.
"""

from __future__ import annotations

import enum
import logging
import warnings
from typing import Any

import torch
from torch import nn

from . import distributed
from .auto_window import AutoWindowProbe
from .block import OffloadedBlock, Residency
from .config import DEFAULT_WINDOW_SIZE, StrongholdConfig
from .discovery import build_block_specs, describe, find_block_stacks
from .grads import GradientQueue
from .hooks import BlockUse, current_graph_task, in_backward, wrap_differentiable
from .ledger import MemoryLedger
from .distributed import DataParallel
from .memory import DeviceSlotPool, HostAllocator, element_size
from .state_dict import install_state_dict_hooks
from .stats import EngineStats
from .stepping import StepCoordinator
from .transfer import TransferContext
from .workers import HostWorker

logger = logging.getLogger("stronghold_hf")

_ENGINE_ATTR = "_stronghold_engine"

#: Set by `stronghold_hf.testing.simulated_device`: the pinning stand-in of the CPU test mode.
_simulated_pinning = None


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class WindowEngine:
    """The handle `offload_model` returns. It owns the blocks, the transfers, the hooks and the step."""

    def __init__(self, model: nn.Module, config: StrongholdConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        specs = build_block_specs(model, find_block_stacks(model, config.block_classes))
        if not any(s.params for s in specs):
            raise ValueError(f"{type(model).__name__}: the discovered blocks ({describe(specs)}) own no parameters to offload.")
        self.ledger = MemoryLedger()
        self.stats = EngineStats()
        self.transfer = TransferContext(device, self.ledger, self.stats)
        self.host = HostAllocator(self.ledger, pin=config.pin_memory, pinning=_simulated_pinning,
                                  max_pinned_bytes=config.max_pinned_bytes)
        self.window_choice = None
        self._probe: AutoWindowProbe | None = None
        self.window_size = self._initial_window_size(len(specs))
        self.pool = DeviceSlotPool(capacity=self.window_size + 1)
        # Data parallel whenever a process group exists (a group of one too: the same code path).
        self.dp = None
        if distributed.is_initialized():
            shard = config.shard_cpu_state
            self.dp = DataParallel(device, sharded=distributed.world_size() > 1 if shard is None else shard)
        if self.dp is not None:
            # Ranks start from rank 0's weights, as DDP does; block weights go through the host
            # group before each rank keeps its shard of them.
            self.dp.broadcast_([p.data for s in specs for _, p in s.params])
        self.blocks = [
            OffloadedBlock(s, device=device, param_dtype=config.param_dtype, host=self.host, transfer=self.transfer,
                           pool=self.pool, ledger=self.ledger, dp=self.dp)
            for s in specs
        ]
        self._gathering = False  # inside full_state_dict(): every rank is gathering
        self._block_param_ids = {id(p): b for b in self.blocks for p in b.params}
        self.worker = HostWorker(config.resolved_cpu_threads())
        max_grad_bytes = max(b.grad_nbytes_device for b in self.blocks)
        max_shard_bytes = max(b.layout.shard_numel * (element_size(b.layout.grad_dtype) if b.trainable else 0)
                              for b in self.blocks)
        self.grad_queue = GradientQueue(config.grad_buffers, max_grad_bytes, device=device, host=self.host,
                                        transfer=self.transfer, ledger=self.ledger, worker=self.worker,
                                        staging_bytes=max_shard_bytes)
        self.coordinator = StepCoordinator(self)
        self._move_resident_parts(model, device)
        if self.dp is not None:
            self.dp.broadcast_([p.data for p in self.resident_parameters()])
        self.phase = Phase.IDLE
        self._backward_task: int | None = None  # graph task whose end-of-backward callback is queued
        self._forward_stack: list[tuple[OffloadedBlock, BlockUse | None]] = []
        self._prefetched: set[int] = set()  # fetched ahead of need (a fetch at need counts as on demand)
        self._closed = False
        if getattr(self, "_auto_pending", False):
            self._probe = AutoWindowProbe(self)
        self._handles: list[Any] = []
        self._block_entries = 0  # block forwards entered (outside backward), for the check below
        self._entries_at_model_start = 0
        self._warned_no_block_ran = False
        self._install_hooks()
        setattr(model, _ENGINE_ATTR, self)
        stats = self.memory_stats()
        logger.info(
            "stronghold: %d blocks (%s), window_size=%d, %.1f MB per block on %s, %d offloaded parameters "
            "(%d trainable), host %.2f GB (%.1f B/offloaded param), %d resident parameters",
            len(self.blocks), describe(specs), self.window_size, max(b.slot_bytes for b in self.blocks) / 1e6, device,
            stats["offloaded_params"], stats["offloaded_trainable_params"],
            (stats["pinned_host_bytes"] + stats["pageable_host_bytes"]) / 1e9, stats["host_bytes_per_param"],
            sum(p.numel() for p in self.resident_parameters()),
        )

    # ------------------------------------------------------------------ setup
    def _initial_window_size(self, num_blocks: int) -> int:
        ws = self.config.window_size
        if ws == "auto":
            if self.device.type == "cuda":
                # The first training step runs with the default; auto_window.py then decides.
                self._auto_pending = True
                ws = DEFAULT_WINDOW_SIZE
            else:
                from .planner import choose_window_for_cpu

                self.window_choice = choose_window_for_cpu(num_blocks)
                logger.info("stronghold: %s", self.window_choice.reason)
                ws = self.window_choice.window_size
        elif ws > num_blocks:
            warnings.warn(
                f"stronghold: window_size={ws} is larger than the model's {num_blocks} blocks; using "
                f"window_size={num_blocks} (every block resident, nothing to slide).",
                stacklevel=4,
            )
        return max(1, min(int(ws), num_blocks))

    def _apply_window_choice(self) -> None:
        probe, self._probe = self._probe, None
        self._auto_pending = False
        choice = probe.finish()
        self.window_choice = choice
        self.window_size = max(1, min(choice.window_size, self.num_blocks))
        if self.dp is not None:  # every rank runs the same schedule: the smallest choice wins
            self.window_size = self.dp.min_int(self.window_size)
        self.pool.resize(self.window_size + 1)
        (logger.info if choice.hidden else logger.warning)("stronghold: %s", choice.reason)

    def _move_resident_parts(self, model: nn.Module, device: torch.device) -> None:
        with torch.no_grad():
            for p in model.parameters():
                if id(p) not in self._block_param_ids and p.device != device:
                    p.data = p.data.to(device)
            for module in model.modules():
                for name, buf in list(module._buffers.items()):
                    if buf is not None and buf.device != device:
                        module._buffers[name] = buf.to(device)

    def _install_hooks(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._on_model_forward_start))
        self._handles.append(self.model.register_forward_hook(self._on_model_forward_end))
        for b in self.blocks:
            m = b.module
            self._handles.append(m.register_forward_pre_hook(self._make_pre_forward(b), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._make_post_forward(b), with_kwargs=True))
            self._handles.extend(install_state_dict_hooks(self, b))
            for k, (e, p) in enumerate(zip(b.layout.entries, b.params)):
                if e.trainable:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._make_touched_hook(b, k)))

    @staticmethod
    def _make_touched_hook(b: OffloadedBlock, k: int):
        def hook(param):
            b.grad_touched[k] = True

        return hook

    # ------------------------------------------------------------------ public queries
    def resident_parameters(self) -> list[nn.Parameter]:
        """Parameters that stay on the device (embeddings, final norm, heads, tied weights)."""
        seen: set[int] = set()
        out = []
        for p in self.model.parameters():
            if id(p) not in self._block_param_ids and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def master_parameters(self) -> list[nn.Parameter]:
        """The fp32 CPU masters of the trainable offloaded parameters (what CPU Adam steps)."""
        return [m for b in self.blocks for m in b.masters if m is not None]

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """What a plain torch optimizer can step: every trainable parameter of the model.

        Between steps an offloaded parameter *is* its fp32 host master and its ``.grad`` the
        fp32 host gradient, so ``torch.optim.AdamW(engine.optimizer_parameters())`` trains
        (synchronously, on the host); `build_optimizer` is the overlapped CPU Adam path."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def optimizer_target(self, param: nn.Parameter) -> nn.Parameter:
        return param

    def is_offloaded(self, param: nn.Parameter) -> bool:
        return id(param) in self._block_param_ids

    def block_of(self, param: nn.Parameter) -> OffloadedBlock:
        return self._block_param_ids[id(param)]

    def resident_blocks(self) -> list[int]:
        return [b.index for b in self.blocks if b.holds_device_storage]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def memory_stats(self) -> dict[str, float]:
        """The memory ledger: every byte this engine allocated, and its traffic so far.

        ``device_bytes``/``device_peak_bytes``: slots and gradient lanes on the compute
        device (activations and the resident parameters are not the engine's).
        ``pinned_host_bytes``/``pageable_host_bytes``: arenas, staging, and the CPU
        optimizer's state. ``blocks_resident``, ``grads_in_flight``: right now.
        ``h2d_bytes``, ``d2h_bytes``, ``fetches``: cumulative. ``host_bytes_per_param``: host
        bytes over offloaded parameters."""
        self.transfer.collect_timings()
        out: dict[str, float] = dict(self.ledger.snapshot())
        opt_bytes = self.coordinator.optimizer_state_bytes()
        out["optimizer_state_bytes"] = opt_bytes
        out["pageable_host_bytes"] += opt_bytes
        out["blocks_resident"] = len(self.pool.in_use)
        out["grads_in_flight"] = self.grad_queue.busy
        offloaded = sum(e.numel for b in self.blocks for e in b.layout.entries)
        trainable = sum(e.numel for b in self.blocks for e in b.layout.entries if e.trainable)
        out["offloaded_params"] = offloaded
        out["offloaded_trainable_params"] = trainable
        out["host_bytes_per_param"] = (out["pinned_host_bytes"] + out["pageable_host_bytes"]) / max(offloaded, 1)
        out["window_size"] = self.window_size
        out["slot_bytes"] = max(b.slot_bytes for b in self.blocks)
        out["grad_buffer_bytes"] = self.grad_queue.max_bytes
        return out

    def reset_peak_memory_stats(self) -> None:
        self.ledger.reset_peak()

    # ------------------------------------------------------------------ residency
    def _fetch(self, b: OffloadedBlock) -> None:
        self.coordinator.wait_update(b, forward=self.phase is not Phase.BACKWARD)  # it writes what the fetch reads
        b.begin_fetch()

    def _release(self, b: OffloadedBlock) -> None:
        """Ships a block's gradients (if it has a lane) and evicts it."""
        if b.lane is not None:
            self._flush(b)
        if b.state is not Residency.ON_HOST:
            b.evict()

    def _evict_idle(self, keep: set[int]) -> None:
        for idx in sorted(self.pool.in_use):
            b = self.blocks[idx]
            if idx not in keep and b.holds == 0:
                self._release(b)  # a lane goes with it: a collective, at the same point on every rank

    def _turn_kept(self, i: int) -> set[int]:
        """Blocks of the tail this differentiable pass already ran: backward needs them first."""
        n = self.num_blocks
        return {j for j in range(max(0, n - self.window_size), i) if self.blocks[j].pending_backward > 0}

    def _make_resident(self, b: OffloadedBlock, direction: int) -> None:
        """Slides the window to ``b``: evicts what is not wanted, fetches ``b``, prefetches ahead."""
        i, w, n = b.index, self.window_size, self.num_blocks
        ahead = list(range(i + 1, min(n, i + w + 1))) if direction > 0 else list(range(i - 1, max(-1, i - w - 1), -1))
        keep = {i, *ahead}
        if direction > 0:
            keep |= self._turn_kept(i)
        keep |= {j for j in self.pool.in_use if self.blocks[j].holds > 0}
        self._evict_idle(keep)
        if b.state is Residency.ON_HOST:
            if self.pool.full:  # everything left is held or wanted: free the farthest wanted one
                self._make_room(b)
            if b.index not in self._prefetched:
                self.stats.add("fetches_on_demand", 1)
            self._fetch(b)
        self._prefetched.discard(b.index)
        for j in ahead:
            if self.pool.full:
                break
            nb = self.blocks[j]
            if nb.state is Residency.ON_HOST and not self.coordinator.update_pending(nb):
                self._fetch(nb)
                self._prefetched.add(j)

    def _make_room(self, b: OffloadedBlock) -> None:
        # Only blocks without a gradient lane, prefetches first: whether the pool is full depends
        # on how far this rank prefetched, and under data parallelism flushing a lane is a
        # collective, and a gathered block evicted on one rank only would be gathered again by
        # that rank alone. Without prefetches in the pool, the residents are the same everywhere.
        idle = [j for j in self.pool.in_use if self.blocks[j].holds == 0 and self.blocks[j].lane is None]
        fetching = [j for j in idle if self.blocks[j].state is Residency.FETCHING]
        candidates = fetching or idle
        if not candidates:
            raise RuntimeError(
                f"stronghold: no device slot for block {b.fqn}: all {self.pool.capacity} slots are held by blocks "
                f"{sorted(self.pool.in_use)} whose forward or backward is still running. Raise window_size."
            )
        self._release(self.blocks[max(candidates, key=lambda j: abs(j - b.index))])

    # ------------------------------------------------------------------ forward hooks
    def _on_model_forward_start(self, module, args) -> None:
        self._entries_at_model_start = self._block_entries

    def _on_model_forward_end(self, module, args, output) -> None:
        # A training forward that entered no block used the block weights some other way (a
        # container's contents called directly, `block.forward(...)` bypassing hooks): nothing
        # was streamed, and on a GPU those weights are host memory. Said once, plainly.
        if (self._block_entries == self._entries_at_model_start and torch.is_grad_enabled() and module.training
                and not self._warned_no_block_ran):
            self._warned_no_block_ran = True
            logger.warning(
                "stronghold: a training forward of %s ran none of its %d offloaded blocks (%s ... %s) through their "
                "forward, so their weights were not streamed (on a GPU they are host memory). If the model calls "
                "its layers some other way, pass StrongholdConfig(block_classes=[...]) naming the layer class the "
                "forward calls.", type(module).__name__, self.num_blocks, self.blocks[0].fqn, self.blocks[-1].fqn)

    def _make_pre_forward(self, b: OffloadedBlock):
        def hook(module, args, kwargs):
            return self._pre_forward(b, args, kwargs)

        return hook

    def _make_post_forward(self, b: OffloadedBlock):
        def hook(module, args, kwargs, output):
            return self._post_forward(b, output)

        return hook

    def _pre_forward(self, b: OffloadedBlock, args, kwargs):
        if in_backward():
            return self._pre_forward_in_backward(b, args, kwargs)
        self._block_entries += 1
        self._settle()
        if self._forward_stack:  # a previous forward raised inside a block: its holds are stale
            for stale, _ in self._forward_stack:
                stale.forward_holds = 0
            self._forward_stack.clear()
        if self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD
        self._make_resident(b, direction=+1)
        b.forward_holds += 1
        b.wait_resident()
        if self._probe is not None:
            self._probe.pre_forward(b.index)
        use = None
        if torch.is_grad_enabled():
            use = BlockUse(self, b.index)
            (args, kwargs), _ = wrap_differentiable(use.post_backward, (args, kwargs))
        self._forward_stack.append((b, use))
        return args, kwargs

    def _post_forward(self, b: OffloadedBlock, output):
        if in_backward():
            return self._post_forward_in_backward(b, output)
        entry = self._forward_stack.pop() if self._forward_stack else (b, None)
        use = entry[1] if entry[0] is b else None
        b.forward_holds = max(0, b.forward_holds - 1)
        if self._probe is not None:
            self._probe.post_forward(b.index)
        if use is not None:
            output, wrapped = wrap_differentiable(use.pre_backward, output)
            if wrapped:
                b.pending_backward += 1
            else:
                use.done = True  # nothing downstream differentiates through this call
        if b.index == self.num_blocks - 1:
            # End of a pass over the sequence: only the tail a backward will need stays.
            self._evict_idle(self._turn_kept(self.num_blocks))
        return output

    def _pre_forward_in_backward(self, b: OffloadedBlock, args, kwargs):
        """A forward inside backward: gradient checkpointing recomputing the block.

        No forward hold is taken: the block's backward hold already keeps it resident, and a
        non-reentrant checkpoint may stop the recompute early (an internal exception once the
        last saved tensor is repacked), so the post-hook that would release it may never run."""
        if b.backward_holds == 0:
            # Reentrant checkpointing: the original forward ran under no_grad, so this
            # recompute starts the block's backward; its post-backward node goes on the
            # recomputed inputs.
            use = BlockUse(self, b.index)
            use.done = True  # never pending: it is created inside its own backward
            self._begin_backward_use(b, use)
            if torch.is_grad_enabled():
                (args, kwargs), _ = wrap_differentiable(use.post_backward, (args, kwargs))
        else:
            b.wait_resident()
        return args, kwargs

    def _post_forward_in_backward(self, b: OffloadedBlock, output):
        return output

    # ------------------------------------------------------------------ backward hooks
    def _on_pre_backward(self, use: BlockUse) -> None:
        self._begin_backward_use(self.blocks[use.block_index], use)

    def _begin_backward_use(self, b: OffloadedBlock, use: BlockUse) -> None:
        self._enter_backward()
        use.backward_started = True
        b.backward_holds += 1
        # Blocks later in the sequence whose post-backward never ran (their inputs needed no
        # gradient) are done by now: everything downstream of b's outputs has run.
        for j in sorted(self.pool.in_use):
            later = self.blocks[j]
            if j > b.index and later.backward_holds > 0 and later.forward_holds == 0:
                later.backward_holds = 0
                if later.pending_backward == 0:
                    self._release(later)
        self._make_resident(b, direction=-1)
        b.wait_resident()
        if b.trainable and b.lane is None:
            lane = self.grad_queue.acquire(b.index, b.layout.padded_grad_numel, b.layout.grad_dtype)
            b.attach_lane(lane)
        if self._probe is not None:
            self._probe.pre_backward(b.index)

    def _on_post_backward(self, use: BlockUse) -> None:
        b = self.blocks[use.block_index]
        if self._probe is not None:
            self._probe.post_backward(b.index)
        if use.backward_started:
            use.backward_started = False
            b.backward_holds = max(0, b.backward_holds - 1)
        if not use.done:
            use.done = True
            b.pending_backward = max(0, b.pending_backward - 1)
        if b.holds == 0 and b.pending_backward == 0:
            self._release(b)

    def _on_use_dropped(self, use: BlockUse) -> None:
        """A graph was freed before its backward ran: that use will never need the block."""
        use.done = True
        b = self.blocks[use.block_index]
        b.pending_backward = max(0, b.pending_backward - 1)

    def _enter_backward(self) -> None:
        task = current_graph_task()
        if self._backward_task == task:
            return
        if self.phase is Phase.BACKWARD and self._backward_task is not None:
            self._abort_backward()  # an earlier backward raised and never finished
        self.phase = Phase.BACKWARD
        self._backward_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        for b in self.blocks:
            if b.trainable:
                # From here on autograd owns .grad; gradients that arrive after a block left
                # the device land in fresh tensors (late gradients), never in host buffers.
                b.take_exposed_grads()
                b.valid_at_pass_start = list(b.grad_valid)
                b.flushes_this_pass = 0
        self.coordinator.begin_backward_pass()

    def _flush(self, b: OffloadedBlock) -> None:
        """Sends ``b``'s lane to the host; the fold adds (or copies) it into the fp32 gradient.

        Under data parallelism the lane is reduced across ranks first, on the device (a
        reduce-scatter with sharded CPU state, so only this rank's shard crosses the link), and
        every trainable parameter counts as touched: another rank may have produced a gradient
        this one did not, and every rank must issue the same collectives ([Note: collective
        order] in distributed.py)."""
        lane = b.lane
        touched = b.collect_into_lane()
        b.lane = None
        if self.dp is not None:
            touched = [k for k, e in enumerate(b.layout.entries) if e.trainable]
        elif not touched:
            self.grad_queue.discard(lane)
            return
        if b.spec is not None:
            # More gradient for a block already updated speculatively (a late gradient, another
            # micro-batch): undo that update before the fold changes what it read.
            self.coordinator.undo_speculation(b)
        local = b.local_params(touched)
        accumulate = [b.grad_valid[k] for k in local]
        fresh = b.flushes == 0 and not any(b.grad_valid)
        send = lane.device_buffer
        if self.dp is not None:
            send = self.dp.reduce_gradient_(lane.device_buffer, b.layout.shard_numel)
        # Squared norm of a gradient that is the block's whole gradient for this step (this
        # rank's shard of it), on the device while the buffer is read anyway (global clipping
        # needs it; see stepping.py).
        b.device_sq_norm = torch.linalg.vector_norm(send, dtype=torch.float32).square() if fresh else None
        partial_norm = self.coordinator.partial_norm if self.coordinator.speculating else None

        def fold(staged, sq_norm, b=b, t=local, a=accumulate):
            b.fold(staged, t, a)
            if partial_norm is not None and sq_norm is not None:
                partial_norm.add(sq_norm)

        self.grad_queue.flush(lane, fold, label=b.fqn, send=send,
                              sq_norm=b.device_sq_norm if partial_norm is not None else None)
        for k in local:
            b.grad_valid[k] = True
        b.flushes += 1
        b.flushes_this_pass += 1
        if self.coordinator.speculating and b.pending_backward == 0 and not b.spec_blocked:
            self.coordinator.speculate(b)

    @staticmethod
    def _late_params(b: OffloadedBlock) -> list[int]:
        return [k for k, (e, p) in enumerate(zip(b.layout.entries, b.params))
                if e.trainable and p.grad is not None and p.grad is not b.grad_views[k]]

    def _flush_late_grads(self, b: OffloadedBlock) -> None:
        """Gradients autograd produced after ``b`` left the device (T5's relative bias, whose
        gradient arrives through every later block): one more flush that accumulates. Under
        data parallelism it runs on every rank where any rank has one (a flush is a collective)."""
        late = self._late_params(b)
        lane = self.grad_queue.acquire(b.index, b.layout.padded_grad_numel, b.layout.grad_dtype)
        b.lane = lane
        with torch.no_grad():
            for k in late:
                e, p = b.layout.entries[k], b.params[k]
                lane.device_view(e.grad_offset, e.numel, e.shape).add_(p.grad.to(device=self.device, dtype=lane.dtype))
                p.grad = None
                b.grad_touched[k] = True
        for k, e in enumerate(b.layout.entries):
            if e.trainable and k not in late:
                b.grad_touched[k] = False
        self._flush(b)

    def _finish_backward(self) -> None:
        """Autograd's end-of-backward callback: every gradient reaches the host, every block leaves."""
        self._backward_task = None
        for b in self.blocks:
            b.backward_holds = 0
            if b.lane is not None:
                self._flush(b)
        late = [b for b in self.blocks if b.trainable and self._late_params(b)]
        if self.dp is not None:  # which blocks have late gradients is the ranks' union
            flags = torch.zeros(self.num_blocks, dtype=torch.int32, device=self.device)
            for b in late:
                flags[b.index] = 1
            late = [self.blocks[i] for i in self.dp.max_(flags).nonzero().flatten().tolist()]
        for b in late:
            self._flush_late_grads(b)
        for b in self.blocks:
            if b.state is not Residency.ON_HOST and b.holds == 0:
                self._release(b)
        self.grad_queue.drain()
        self.grad_queue.release_device_buffers()
        self.coordinator.speculating = False
        self.transfer.collect_timings()
        if self.dp is not None:
            self.dp.average_resident_grads_([p for p in self.resident_parameters() if p.requires_grad])
        for b in self.blocks:
            if b.trainable:
                b.expose_grads()
        self.phase = Phase.IDLE if not self._forward_stack else Phase.FORWARD
        if self._probe is not None and self._probe.complete():
            self._apply_window_choice()

    def _abort_backward(self) -> None:
        """A backward raised half-way: drop its gradients, keep what earlier backwards left."""
        self._backward_task = None
        for b in self.blocks:
            b.backward_holds = 0
            if not self._forward_stack:
                b.forward_holds = 0
            if b.lane is not None:
                b.collect_into_lane()
                lane, b.lane = b.lane, None
                self.grad_queue.discard(lane)
            for k, e in enumerate(b.layout.entries):
                if e.trainable and b.params[k].grad is not None and b.params[k].grad is not b.grad_views[k]:
                    b.params[k].grad = None  # a late gradient of the failed pass
        self.grad_queue.drain()
        self.grad_queue.release_device_buffers()
        self.coordinator.speculating = False
        for b in self.blocks:
            if b.spec is not None:
                self.coordinator.undo_speculation(b)  # the step it guessed will not come
            b.spec_blocked = False
            if b.state is not Residency.ON_HOST and b.holds == 0:
                b.evict()
            if not b.trainable or not b.flushes_this_pass:
                continue
            before = b.valid_at_pass_start
            if any(before):
                # Part of this pass was added onto gradients accumulated earlier; the sum can
                # no longer be split. Refuse to step on it until the user zeroes them.
                b.grads_poisoned = True
            b.grad_valid = list(before)
            b.flushes_this_pass = 0
            if not any(before):
                b.flushes = 0
                b.device_sq_norm = None
        for b in self.blocks:
            if b.trainable:
                b.expose_grads()
        self.phase = Phase.IDLE
        logger.warning("stronghold: a backward pass raised before it finished; its gradients were discarded.")

    def _settle(self) -> None:
        """Called at every entry from outside backward: finishes a backward that raised."""
        if self.phase is Phase.BACKWARD and not in_backward():
            self._abort_backward()

    def evict_all(self) -> None:
        """Returns every idle block to the host (before saving, between phases)."""
        self._settle()
        self._evict_idle(keep=set())

    def settle_for_host_access(self) -> None:
        """Before the host reads or writes masters: no update in flight, no block resident."""
        self.evict_all()
        self.coordinator.synchronize()

    def mark_parameters_changed(self) -> None:
        """Tells the engine that offloaded parameters were written behind its back (through a
        ``.data`` alias, which bumps no version counter); the next fetch re-derives the
        compute-dtype copies. Not needed with fp32 compute, where the master is what travels."""
        for b in self.blocks:
            if not b.layout.masters_in_image:
                b.image_stale = True

    # ------------------------------------------------------------------ state dict
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with every offloaded weight whole (fp32 masters for trainable
        ones). With sharded CPU state this gathers the shards: call it on every rank."""
        self.evict_all()
        self._gathering = True
        try:
            return self.model.state_dict()
        finally:
            self._gathering = False

    # ------------------------------------------------------------------ step (delegates)
    def build_optimizer(self, params=None, **adamw_kwargs):
        """One `torch.optim.Optimizer` for the whole model: CPU Adam on the masters of the
        offloaded blocks (on the host worker, pipelined with the next forward) and a device
        AdamW on the resident parameters. ``params`` may be None (all trainable parameters), a
        list of model parameters, or Trainer-style param-group dicts.
        ``fp16_loss_scaling=True`` adds one global dynamic loss scaler (use `scale_loss`)."""
        from .optim.hybrid import build_optimizer

        return build_optimizer(self, params, **adamw_kwargs)

    @property
    def optimizer(self):
        return self.coordinator.optimizer

    @property
    def scaler(self):
        return self.coordinator.scaler

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.coordinator.scale_loss(loss)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.coordinator.clip_grad_norm_(max_norm, norm_type)

    def global_grad_norm(self) -> torch.Tensor:
        return self.coordinator.global_grad_norm()

    def invalidate_grad_norms(self) -> None:
        for b in self.blocks:
            b.device_sq_norm = None

    @property
    def last_grad_norm(self):
        return self.coordinator.last_grad_norm

    def synchronize(self) -> None:
        """Waits for every in-flight CPU update (before reading masters outside the engine)."""
        self.coordinator.synchronize()

    def shutdown_workers(self) -> None:
        """Finishes pending work and joins the host worker (restarted on demand)."""
        self.coordinator.synchronize()
        self.grad_queue.drain()
        self.worker.shutdown()

    # ------------------------------------------------------------------ lifecycle
    def close(self, device: str | torch.device | None = None) -> nn.Module:
        """Finishes pending work, removes the hooks and gives back an ordinary model.

        Every offloaded parameter becomes a plain tensor of its original dtype on ``device``
        (default: the engine's device) holding the trained value; ``.grad`` is kept.
        Afterwards `get_engine(model)` is None and the model is an ordinary ``nn.Module``
        (forward, ``save_pretrained``, ``.to()`` all work). Idempotent."""
        if self._closed:
            return self.model
        target = torch.device(device) if device is not None else self.device
        if self.phase is Phase.BACKWARD and in_backward():
            raise RuntimeError("stronghold: engine.close() cannot run inside a backward pass.")
        self._settle()
        for b in self.blocks:
            b.forward_holds = b.backward_holds = 0
        self._forward_stack.clear()
        self.evict_all()
        self.shutdown_workers()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for b in self.blocks:  # with sharded state, gathering is collective: every rank closes
            b.restore_parameters(target, b.full_values())
        if target != self.device:
            self._move_resident_parts(self.model, target)
        self.transfer.close()
        self.host.release_all()
        if getattr(self.model, _ENGINE_ATTR, None) is self:
            delattr(self.model, _ENGINE_ATTR)
        self._closed = True
        return self.model

    @property
    def closed(self) -> bool:
        return self._closed


def offload_model(model: nn.Module, config: StrongholdConfig | dict | None = None,
                  device: str | torch.device | None = None) -> WindowEngine:
    """Applies working-window offloading to ``model`` in place and returns the engine.

    Parameter objects keep their identity. Block parameters live on the host (fp32 masters
    for trainable ones, the stored bytes for frozen ones) and visit the device in a window
    of ``W`` blocks; everything else moves to ``device`` (default: CUDA when available, else
    CPU). `WindowEngine.close` undoes it.
    """
    if getattr(model, _ENGINE_ATTR, None) is not None:
        raise ValueError(
            f"{type(model).__name__} is already offloaded by stronghold; offload_model must be called once per model."
        )
    dispatched = next((name or type(model).__name__ for name, m in model.named_modules() if hasattr(m, "_hf_hook")), None)
    if dispatched is not None:
        raise ValueError(
            f"{type(model).__name__} carries accelerate dispatch hooks (on {dispatched}): it was loaded with "
            "device_map=... or passed through cpu_offload/dispatch_model, which move weights on their own. Load it "
            "without device_map (on the CPU); STRONGHOLD then streams its blocks to the GPU itself."
        )
    config = StrongholdConfig.from_any(config)
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"offload_model: device {device} is not supported; use 'cuda' or 'cpu'.")
    return WindowEngine(model, config, device)


def get_engine(model: nn.Module) -> WindowEngine | None:
    """The engine that offloads ``model`` (or a model wrapping it), or None."""
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is None:
        inner = getattr(model, "module", None)  # accelerate/DDP wrappers
        engine = getattr(inner, _ENGINE_ATTR, None) if isinstance(inner, nn.Module) else None
    return engine
