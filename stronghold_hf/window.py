"""The working window: hooks that slide ``W`` resident blocks over the model, and `offload_model`.

Schedule over the global block sequence ``0..N-1`` (all stacks, encoder before decoder):

* forward of block ``i``: wait for ``i`` to be resident, prefetch ``i+W``; afterwards evict
  ``i`` unless it is one of the last ``W`` blocks of a forward that will be followed by
  backward (those are needed first, so nothing moves at the turn);
* backward of block ``i`` (detected by an autograd node on the block's outputs): wait for
  ``i``, prefetch ``i-W``; once the gradients w.r.t. the block's inputs exist (an autograd node
  on its inputs), pack its parameter gradients, start their device-to-host copy, evict;
* after the whole backward (an autograd engine callback): fold every gradient into the fp32
  masters' ``.grad`` and release everything.

At most ``W + 1`` blocks hold device storage at any time: the window plus the prefetch. The
`DeviceSlotPool` enforces it. Blocks visited out of order (``generate()`` restarting the
decoder, a model that skips a layer) are fetched on demand, so the result is always correct;
only the overlap is lost.

Gradient checkpointing needs nothing special: transformers 5.x checkpoints ``forward`` inside
the module call, so our hooks run once per forward, and the recompute inside backward happens
after the block was made resident by its pre-backward node. If hooks *do* fire inside backward
(older transformers, user-applied checkpointing), ``_in_backward()`` recognises the recompute
and only keeps the block resident.
"""

from __future__ import annotations

import enum
import logging
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .auto_window import AutoWindowProbe
from .block import BlockState, OffloadedBlock
from . import distributed
from .config import DEFAULT_WINDOW_SIZE, StrongholdConfig
from .discovery import build_block_specs, describe, find_block_stacks
from .memory import DeviceSlotPool, HostArena, can_pin
from .stepping import StepMixin
from .transfer import TransferContext

logger = logging.getLogger("stronghold_hf")

_ENGINE_ATTR = "_stronghold_engine"


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _CallInBackward(torch.autograd.Function):
    """Identity on some tensors; its backward calls ``callback`` when their gradients are ready.

    On a block's *outputs* it marks the start of that block's backward (pre-backward); on its
    *inputs* it runs once the block's backward is complete (post-backward).
    """

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


_PreBackward = _PostBackward = _CallInBackward


def _wrap_grad_tensors(fn: type[torch.autograd.Function], callback, tree: Any) -> tuple[Any, bool]:
    leaves, spec = tree_flatten(tree)
    idx = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not idx:
        return tree, False
    outs = fn.apply(callback, *[leaves[k] for k in idx])
    for k, o in zip(idx, outs):
        leaves[k] = o
    return tree_unflatten(leaves, spec), True


class WindowEngine(StepMixin):
    """The handle `offload_model` returns. It owns the blocks, the transfers and the hooks."""

    def __init__(self, model: nn.Module, config: StrongholdConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        stacks = find_block_stacks(model, config.block_classes)
        specs = build_block_specs(model, stacks)
        if not any(s.params for s in specs):
            raise ValueError(f"{type(model).__name__}: the discovered blocks ({describe(specs)}) own no parameters to offload.")
        if config.pin_memory and not can_pin() and device.type != "cpu":
            warnings.warn("stronghold: pin_memory=True ignored, CUDA is not available.", stacklevel=3)
        self.transfer = TransferContext(device)
        self.arena = HostArena(pin=config.pin_memory)
        self.window_size = self._initial_window_size(len(specs))
        self.pool = DeviceSlotPool(capacity=self.window_size + 1, slot_bytes=0)
        self.blocks = [
            OffloadedBlock(s, device=device, param_dtype=config.param_dtype, arena=self.arena, transfer=self.transfer, pool=self.pool)
            for s in specs
        ]
        self.pool.slot_bytes = max(b.slot_bytes for b in self.blocks)
        self._block_of_module = {id(b.module): b for b in self.blocks}
        self._block_param_ids = {id(p): b for b in self.blocks for p in b.params}
        self._move_resident_parts(model, device)
        if distributed.world_size() > 1:
            # Ranks start from rank 0's weights and average every gradient (see distributed.py).
            distributed.broadcast_from_rank0_(
                [b.master_flat for b in self.blocks] + [p.data for p in self.resident_parameters()]
            )
            for b in self.blocks:
                b.refresh_host_copy()
                b.grad_reducer = distributed.average_
        self.phase = Phase.IDLE
        self._keep_for_backward = False
        self._callback_queued = False
        self._backward_started: set[int] = set()
        self._post_backward_attached: set[int] = set()
        self._want_device_norms = True
        self._init_stepping()
        if getattr(self, "_auto_pending", False):
            self._probe = AutoWindowProbe(self)
        self._handles: list[Any] = []
        self._install_hooks()
        setattr(model, _ENGINE_ATTR, self)
        logger.info(
            "stronghold: %d blocks (%s), window_size=%d, %.1f MB per block on %s, %d resident parameters",
            len(self.blocks), describe(specs), self.window_size, self.pool.slot_bytes / 1e6, device,
            sum(p.numel() for p in self.resident_parameters()),
        )

    # ------------------------------------------------------------------ setup
    def _initial_window_size(self, num_blocks: int) -> int:
        ws = self.config.window_size
        self.window_choice = None
        self._probe: AutoWindowProbe | None = None
        if ws == "auto":
            if self.device.type == "cuda":
                # The first training step runs with the default; auto_window.py then decides.
                ws = DEFAULT_WINDOW_SIZE
                self._auto_pending = True
            else:
                from .planner import choose_window_for_cpu

                self.window_choice = choose_window_for_cpu(num_blocks)
                logger.info("stronghold: %s", self.window_choice.reason)
                ws = self.window_choice.window_size
        return max(1, min(int(ws), num_blocks))

    def _apply_window_choice(self) -> None:
        probe, self._probe = self._probe, None
        self._auto_pending = False
        choice = probe.finish()
        self.window_choice = choice
        self.window_size = max(1, min(choice.window_size, self.num_blocks))
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
        for b in self.blocks:
            m = b.module
            self._handles.append(m.register_forward_pre_hook(self._make_pre_forward(b), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._make_post_forward(b), with_kwargs=True))
            self._handles.append(m.register_state_dict_post_hook(self._make_state_dict_hook(b)))
            self._handles.append(m._register_load_state_dict_pre_hook(self._make_load_pre_hook(b)))
            self._handles.append(m.register_load_state_dict_post_hook(self._make_load_post_hook(b)))

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
        """The fp32 CPU masters of all offloaded block parameters."""
        return [m for b in self.blocks for m in b.masters]

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """What an optimizer must update: the CPU masters for blocks, live parameters for the rest."""
        return [m for m in self.master_parameters() if m.requires_grad] + [
            p for p in self.resident_parameters() if p.requires_grad
        ]

    def optimizer_target(self, param: nn.Parameter) -> nn.Parameter:
        """Maps a model parameter to the tensor the optimizer steps (its master, or itself)."""
        block = self._block_param_ids.get(id(param))
        return param if block is None else block.master_of(param)

    def is_offloaded(self, param: nn.Parameter) -> bool:
        return id(param) in self._block_param_ids

    def resident_blocks(self) -> list[int]:
        return [b.index for b in self.blocks if b.holds_device_storage]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def stats(self):
        return self.transfer.stats

    # ------------------------------------------------------------------ window moves
    def _ensure_resident(self, b: OffloadedBlock, *, on_demand_ok: bool = True) -> None:
        if b.state is BlockState.D2H_IN_FLIGHT:
            b.finish_grads()
        if b.state is BlockState.ON_CPU:
            self.transfer.stats.fetches_on_demand += 1
            self._make_room(keep={b.index})
            self._wait_update(b)
            b.begin_fetch()
        b.wait_resident()

    def _make_room(self, keep: set[int]) -> None:
        """Frees slots of blocks outside ``keep`` until one slot is available."""
        if len(self.pool.in_use) < self.pool.capacity:
            return
        for idx in sorted(self.pool.in_use, key=lambda j: -abs(j - min(keep))):
            if idx in keep:
                continue
            self._release(self.blocks[idx])
            if len(self.pool.in_use) < self.pool.capacity:
                return

    def _release(self, b: OffloadedBlock) -> None:
        """Evicts a resident block, shipping its gradients first if it has any."""
        if b.state is BlockState.H2D_IN_FLIGHT:
            b.wait_resident()
        if b.state is BlockState.ON_DEVICE:
            if b.has_device_grads():
                self._wait_update(b)  # the master grads may still be read by its last update
                b.offload_grads_and_evict(want_norm=self._want_device_norms)
            else:
                b.evict()

    def _slide(self, wanted: list[int]) -> None:
        """Evicts residents outside ``wanted``, then starts fetches for the wanted blocks.

        A prefetch never blocks on an unfinished CPU update: that block is skipped now and
        retried at the next hook (or fetched on demand), so the device is never starved
        waiting for an update it does not need yet.
        """
        wanted_set = set(wanted)
        for idx in list(self.pool.in_use):
            if idx not in wanted_set:
                self._release(self.blocks[idx])
        self._prefetch(wanted)

    def _prefetch(self, indices) -> None:
        for idx in indices:
            b = self.blocks[idx]
            ticket = self._pending_updates.get(idx)
            if ticket is not None and not ticket.done():
                continue
            if b.state is BlockState.D2H_IN_FLIGHT:
                b.finish_grads()
            if b.state is BlockState.ON_CPU and len(self.pool.in_use) < self.pool.capacity:
                self._wait_update(b)
                b.begin_fetch()

    # ------------------------------------------------------------------ hooks
    def _make_pre_forward(self, b: OffloadedBlock):
        def hook(module, args, kwargs):
            return self._pre_forward(b, args, kwargs)

        return hook

    def _make_post_forward(self, b: OffloadedBlock):
        def hook(module, args, kwargs, output):
            return self._post_forward(b, output)

        return hook

    def _pre_forward(self, b: OffloadedBlock, args, kwargs):
        if _in_backward():
            # A recompute (checkpointing whose hooks fire inside backward). The block is
            # mid-backward: keep it resident, attach the post-backward node if the original
            # forward could not (reentrant checkpointing runs forward under no_grad).
            if b.index not in self._backward_started:
                self._pre_backward(b)
            self._ensure_resident(b)
            if b.index not in self._post_backward_attached and torch.is_grad_enabled():
                (args, kwargs), attached = _wrap_grad_tensors(_PostBackward, self._post_backward_cb(b), (args, kwargs))
                if attached:
                    self._post_backward_attached.add(b.index)
            return args, kwargs
        if self.phase is not Phase.FORWARD or b.index == 0:
            self._begin_forward()
        grad_mode = torch.is_grad_enabled()
        self._keep_for_backward = grad_mode and any(p.requires_grad for p in b.params)
        hi = min(b.index + self.window_size, len(self.blocks) - 1)
        self._slide(list(range(b.index, hi + 1)))
        self._ensure_resident(b)
        if self._probe is not None:
            self._probe.pre_forward(b.index)
        if self._keep_for_backward:
            (args, kwargs), attached = _wrap_grad_tensors(_PostBackward, self._post_backward_cb(b), (args, kwargs))
            if attached:
                self._post_backward_attached.add(b.index)
        return args, kwargs

    def _post_forward(self, b: OffloadedBlock, output):
        if _in_backward():
            return output
        if self._probe is not None:
            self._probe.post_forward(b.index)
        keep = self._keep_for_backward and b.index >= len(self.blocks) - self.window_size
        if self._keep_for_backward:
            output, _ = _wrap_grad_tensors(_PreBackward, self._pre_backward_cb(b), output)
        if not keep:
            self._release(b)
            hi = min(b.index + 1 + self.window_size, len(self.blocks))
            self._prefetch(range(b.index + 1, hi))
        return output

    def _begin_forward(self) -> None:
        if self.phase is Phase.BACKWARD:
            # A forward started while a backward's callback has not run (backward raised, or
            # the graph was dropped). Settle the gradients we have so nothing leaks.
            self._finish_backward()
        self.phase = Phase.FORWARD
        self._backward_started.clear()
        self._post_backward_attached.clear()

    def _pre_backward_cb(self, b: OffloadedBlock):
        ref = weakref.ref(self)
        return lambda: ref() is not None and ref()._pre_backward(b)

    def _post_backward_cb(self, b: OffloadedBlock):
        ref = weakref.ref(self)
        return lambda: ref() is not None and ref()._post_backward(b)

    def _pre_backward(self, b: OffloadedBlock) -> None:
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        if b.index in self._backward_started:
            return
        self._backward_started.add(b.index)
        # Blocks after ``b`` have finished their backward; ship anything they still hold.
        for idx in sorted(j for j in self.pool.in_use if j > b.index):
            self._release(self.blocks[idx])
        lo = max(0, b.index - self.window_size)
        self._slide(list(range(b.index, lo - 1, -1)))
        self._ensure_resident(b)
        if self._probe is not None:
            self._probe.pre_backward(b.index)

    def _post_backward(self, b: OffloadedBlock) -> None:
        if self._probe is not None:
            self._probe.post_backward(b.index)
        if b.state is BlockState.ON_DEVICE:
            self._release(b)

    def _finish_backward(self) -> None:
        """Runs once per backward, after autograd finished: every gradient reaches the masters."""
        self._callback_queued = False
        for b in self.blocks:
            if b.state in (BlockState.ON_DEVICE, BlockState.H2D_IN_FLIGHT):
                self._release(b)
            if b.has_device_grads():  # gradients autograd produced after the block was shipped
                if b.state is BlockState.D2H_IN_FLIGHT:
                    b.finish_grads()
                self._wait_update(b)
                b.offload_late_grads(want_norm=self._want_device_norms)
        for b in self.blocks:
            if b.state is BlockState.D2H_IN_FLIGHT:
                b.finish_grads()
        if distributed.world_size() > 1:
            distributed.average_grads_(self._resident_grads())
        self.phase = Phase.IDLE
        self._backward_started.clear()
        self._post_backward_attached.clear()
        if self._probe is not None and self._probe.complete():
            self._apply_window_choice()

    # ------------------------------------------------------------------ state dict
    def _make_state_dict_hook(self, b: OffloadedBlock):
        def hook(module, state_dict, prefix, local_metadata):
            self._wait_update(b)
            for name, master in zip(b.names, b.masters):
                key = prefix + name
                if key in state_dict:
                    state_dict[key] = master.detach()
            return None

        return hook

    def _make_load_pre_hook(self, b: OffloadedBlock):
        def hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
            self._wait_update(b)
            loaded = []
            for name, master in zip(b.names, b.masters):
                key = prefix + name
                if key in state_dict:
                    value = state_dict.pop(key)
                    if value.shape != master.shape:
                        error_msgs.append(f"size mismatch for {key}: copying {tuple(value.shape)} into {tuple(master.shape)}")
                        continue
                    with torch.no_grad():
                        master.copy_(value)
                    loaded.append(key)
            b._loaded_keys = loaded
            if loaded and b.state is BlockState.ON_DEVICE:
                b.refresh_host_copy()
                with torch.no_grad():
                    self._release(b)

        return hook

    def _make_load_post_hook(self, b: OffloadedBlock):
        def hook(module, incompatible_keys):
            loaded = set(getattr(b, "_loaded_keys", ()))
            incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded]
            b._loaded_keys = []

        return hook

    # ------------------------------------------------------------------ lifecycle
    def evict_all(self) -> None:
        """Returns every block to the host (for example before saving or between phases)."""
        for b in self.blocks:
            self._release(b)
            if b.state is BlockState.D2H_IN_FLIGHT:
                b.finish_grads()
        self.phase = Phase.IDLE

    def close(self) -> None:
        """Finishes pending updates, joins the worker threads and removes the hooks."""
        self.shutdown_workers()
        for h in self._handles:
            h.remove()
        self._handles.clear()


def offload_model(model: nn.Module, config: StrongholdConfig | dict | None = None, device: str | torch.device | None = None) -> WindowEngine:
    """Applies working-window offloading to ``model`` in place and returns the engine.

    Parameter objects keep their identity: block parameters become views into a device slot
    whose storage is empty while the block is evicted; their values live in fp32 masters on
    the CPU. Everything else moves to ``device`` (default: CUDA when available, else CPU).
    """
    if getattr(model, _ENGINE_ATTR, None) is not None:
        raise ValueError(
            f"{type(model).__name__} is already offloaded by stronghold; offload_model must be called once per model."
        )
    config = StrongholdConfig.from_any(config)
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"offload_model: device {device} is not supported; use 'cuda' or 'cpu'.")
    return WindowEngine(model, config, device)


def get_engine(model: nn.Module) -> WindowEngine | None:
    engine = getattr(model, _ENGINE_ATTR, None)
    return engine
