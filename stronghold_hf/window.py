"""`offload_model` and `WindowEngine`: the handle that composes the engine and answers its API.

``offload_model(model, config)`` finds the model's units (``discovery.py``: the blocks, the
large parameter groups outside them, the resident rest), gives each its host buffers and
device slot (``unit.py``), and hands them to the schedule (``schedule.py``), which installs
the hooks that slide the window. The step coordinator (``stepping.py``) keeps the state of
the optimizer step. This module composes those parts, with the choices made before them (the
device/host split, ``split.py``; the window size; the host-memory choices,
``host_choices.py``), and answers the public API, each answer delegated to the part that owns
it (``memory_stats``: ``memory_report.py``; ``full_state_dict`` and ``gathered_parameters``:
``host_reads.py``; ``build_optimizer``, ``clip_grad_norm_``: the coordinator), and ``close``;
it decides nothing about residency itself. docs/design.md draws the flow.

Between steps every unit is on the host and its parameters point at their host memory, so
they are always safe to read and write (unit_host.py, [Note: parameters always point at real
memory]). By default nothing but the window lives on the device: with
``StrongholdConfig(offload_non_block=False)`` the parameters outside the blocks stay there
instead, stepped by a device AdamW (the first version's behaviour).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from . import distributed, read_guard, vocab_routing
from .activations import ActivationStore
from .auto_window import AutoWindowProbe
from .checkpointing import CheckpointWatch
from .config import StrongholdConfig, host_reserve_bytes
from .discovery import describe, find_block_stacks, plan_units, refuse_16bit_layer_norm_on_cpu, unit_device_dtype
from .distributed import DataParallel
from .grads import gradient_queues
from .hooks import in_backward, install_module_hooks
from .host_choices import choose_host_memory
from .host_reads import HostReads
from .ledger import MemoryLedger
from .memory import DeviceSlotPool, HostAllocator, total_host_bytes
from .memory_report import MemoryReport
from .param_watch import ParametersOutside
from .promises import Promises
from .schedule import Phase, WindowSchedule
from .planner import initial_window_size
from .split import split_for_model
from .state_dict import install_state_dict_hooks
from .stats import EngineStats
from .stepping import StepCoordinator
from .query_tiling import QueryTiling
from .tiling import SequenceTiling
from .transfer import FetchStaging, TransferContext
from .unit import Unit
from .vocab_pieces import VocabularyPieces, piece_rows, why_not_pieced
from .workers import HostWorker

logger = logging.getLogger("stronghold_hf")

_ENGINE_ATTR = "_stronghold_engine"
_DEVICE_ATTR = "_stronghold_compute_device"

#: Set by `stronghold_hf.testing.simulated_device`: the pinning stand-in of the CPU test mode.
_simulated_pinning = None


class WindowEngine:
    """The handle `offload_model` returns. It composes the units, the schedule and the step."""

    def __init__(self, model: nn.Module, config: StrongholdConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        stacks = find_block_stacks(model, config.block_classes)
        whole_plan = plan_units(model, stacks, offload_non_block=config.offload_non_block)
        if not any(s.params for s in whole_plan.blocks):
            raise ValueError(f"{type(model).__name__}: the discovered blocks ({describe(list(whole_plan.blocks))}) own "
                             "no parameters to offload.")
        # Data parallel whenever a process group exists (a group of one too: the same code path).
        self.dp = None
        if distributed.is_initialized():
            shard = config.shard_cpu_state
            self.dp = DataParallel(device, sharded=distributed.world_size() > 1 if shard is None else shard)
        # The device/host split (split.py): what stays on the device is in no unit.
        self.split = split_for_model(model, whole_plan, config, device, self.dp)
        plan = whole_plan
        if self.split.kept_param_ids:
            plan = plan_units(model, stacks, offload_non_block=config.offload_non_block,
                              keep=self.split.kept_param_ids)
        specs = list(plan.units)
        block_specs = [s for s in specs if s.kind == "block"]
        if device.type == "cpu" and config.param_dtype in (torch.bfloat16, torch.float16):
            refuse_16bit_layer_norm_on_cpu(block_specs, config.param_dtype)
        self.ledger = MemoryLedger()
        self.stats = EngineStats(traffic=self.ledger)  # traffic: read from the ledger, booked once
        self.transfer = TransferContext(device, self.ledger, self.stats)
        self.host = HostAllocator(self.ledger, pin=config.pin_memory, pinning=_simulated_pinning,
                                  max_pinned_bytes=config.max_pinned_bytes)
        window_size, probe_first_step, first_choice = initial_window_size(config.window_size, device, len(block_specs),
                                                                          len(plan.sequence))
        self.pool = DeviceSlotPool(capacity=window_size + 1)
        if self.dp is not None:
            # Ranks start from rank 0's weights, as DDP does; unit weights go through the host
            # group before each rank keeps its shard of them.
            self.dp.broadcast_([p.data for s in specs for _, p in s.params])
        dtypes = [unit_device_dtype(s, config.param_dtype) for s in specs]
        # How the units keep their host state (host_choices.py): the masters' file is made here.
        choices = choose_host_memory(config, specs, dtypes, self.dp.shards if self.dp is not None else 1)
        self.disk_masters = choices.disk_masters
        self.host_image = choices.host_image
        # Without the image, one ring serves every unit (sized below, allocated at the first fetch).
        staging = None if self.host_image else FetchStaging(self.transfer, self.host.allocate, 0)
        self.units: list[Unit] = [
            Unit(s, device=device, param_dtype=d, host=self.host, transfer=self.transfer,
                 pool=self.pool if s.kind != "rest" else None, ledger=self.ledger, dp=self.dp,
                 grad_align=choices.grad_align, fetch_staging=staging, compute_grads=choices.compute_grads,
                 disk_masters=self.disk_masters)
            for s, d in zip(specs, dtypes)
        ]
        converted = [u.layout.shard_bytes for u in self.units if u.host.fetch_staging is not None]
        self.fetch_staging = staging if converted else None
        if self.fetch_staging is not None:  # the largest block: larger units go through in pieces
            blocks = [u.layout.shard_bytes for u in self.units
                      if u.host.fetch_staging is not None and u.kind == "block"]
            self.fetch_staging.buffer_bytes = max(blocks or converted)
        self.blocks = [u for u in self.units if u.kind == "block"]
        # Vocabulary-sized units read in row pieces, outside the window (vocab_pieces.py).
        pieced = self._units_read_in_pieces(config)
        plan = plan.without_positions_of({u.index for u in pieced})
        self._unit_of_param = {id(p): u for u in self.units for p in u.params}
        self._resident_parameters = ParametersOutside(model, self._unit_of_param)
        inline = config.host_worker == "inline" or (config.host_worker == "auto" and not self.transfer.is_async
                                                    and device.type == "cpu")
        self.worker = HostWorker(config.resolved_cpu_threads(), inline=inline)
        streamed = [u for u in self.units if u.kind != "rest" and u not in pieced]
        self.grad_queue, resident_queue = gradient_queues(
            streamed, [u for u in self.units if u.kind == "rest" and u.trainable], plan.sequence,
            grad_buffers=config.grad_buffers, device=device, host=self.host, transfer=self.transfer, ledger=self.ledger)
        speculative = "off" if inline and config.speculative_step == "auto" else config.speculative_step
        self.coordinator = StepCoordinator(units=self.units, worker=self.worker, stats=self.stats, dp=self.dp,
                                           device=device, speculative_step=speculative,
                                           device_parameters=self._resident_parameters.get)
        self._move_resident_parts(model, device)
        if self.dp is not None:
            self.dp.broadcast_([p.data for p in self.resident_parameters()])
        self.schedule = WindowSchedule(model, plan, self.units, window_size=window_size, pool=self.pool,
                                       grad_queue=self.grad_queue, resident_queue=resident_queue,
                                       coordinator=self.coordinator, transfer=self.transfer, worker=self.worker,
                                       stats=self.stats, dp=self.dp, device=device)
        self.schedule.window_choice = first_choice
        if probe_first_step:
            cap = None
            if config.gpu_memory is not None:  # the budget's rest, and the slots the plan counted already
                split = self.split
                slot = max(u.slot_bytes for u in streamed)
                cap = split.budget - split.resident_bytes - split.streamed_bytes + (window_size + 1) * slot
            self.schedule.probe = AutoWindowProbe(self.blocks, device, window_bytes_cap=cap)
        self.schedule.activations = ActivationStore(
            transfer=self.transfer, ledger=self.ledger, host=self.host, device=device,
            offload=config.offload_activations, on_disk=config.nvme_activations, nvme_path=config.nvme_path,
            io_threads=config.nvme_io_threads, host_reserve=host_reserve_bytes(config.cpu_reserve, total_host_bytes()))
        self.schedule.checkpoint_tail = None if config.device_checkpoints == "auto" else config.device_checkpoints
        self.promises = Promises()
        self.schedule.checkpoint_watch = CheckpointWatch(model, {id(u.module): u for u in self.blocks}, self.promises)
        first_position = {u: min(ps) for u, ps in self.schedule.positions_of.items()}
        # The order the next forward needs the units in: the rest unit (the model's forward
        # starts with it), then by first position. CPU updates run in this order.
        self.update_order = sorted(self.units, key=lambda u: (u.kind != "rest",
                                                              first_position.get(u.index, len(self.units) + u.index)))
        self._closed = False
        from . import lifecycle
        lifecycle.register(self)  # threads and process groups stopped before interpreter exit
        self._handles: list[Any] = install_module_hooks(self.schedule, model, plan,
                                                        [u for u in self.units if u not in pieced])
        for u in pieced:
            rows = piece_rows(*u.layout.entries[0].shape, self._largest_block_numel())
            u.vocab_pieces = VocabularyPieces(u, rows, transfer=self.transfer, ledger=self.ledger, host=self.host,
                                              coordinator=self.coordinator, worker=self.worker,
                                              enter_backward=self.schedule.enter_backward,
                                              grad_queue=self.grad_queue)
            self._handles.extend(vocab_routing.install(u.vocab_pieces))
        self.schedule.vocab_pieces = [u.vocab_pieces for u in pieced]
        if self.dp is not None:
            self.schedule.average_resident_grads = self.dp.resident_grad_averaging(self._resident_parameters.get)
        self._handles.append(self.schedule.checkpoint_watch)  # removing it gives back the checkpoint functions
        # Reads between steps and whole values (host_reads.py): the units' read barrier.
        self.reads = HostReads(model, self.units, schedule=self.schedule, coordinator=self.coordinator, dp=self.dp,
                               unit_of_param=self._unit_of_param, device_parameters=self._resident_parameters)
        for u in self.units:
            self._handles.extend(install_state_dict_hooks(u, schedule=self.schedule, coordinator=self.coordinator,
                                                          reads=self.reads))
        for u in self.units:
            read_guard.register(u.params, self.reads, u.index)
            if u.sharded or u.host.masters_on_disk:
                u.read_guard.guard()  # a shard: a read between steps is refused with the fix; on disk: mapped
            if u.vocab_pieces is not None:
                u.read_guard.pin()  # a use outside the pieces' routing is lent the unit whole (vocab_pieces.py)
        self._device_reporting = _report_compute_device(model, device)
        self.chunked_loss = None
        # "auto": not when the split keeps everything on the device (the model trains as plain).
        if config.chunked_loss is True or (config.chunked_loss == "auto" and self.units):
            from .chunked_loss import ChunkedLoss

            self.chunked_loss = ChunkedLoss.install(model, config.loss_chunk_tokens, promises=self.promises,
                                                    piece_numel=self._largest_block_numel() or None)
            for u in pieced:
                self.chunked_loss.read_in_pieces(u.vocab_pieces)
        setattr(model, _ENGINE_ATTR, self)
        self.memory_report = MemoryReport(model=model, ledger=self.ledger, transfer=self.transfer,
                                          coordinator=self.coordinator, schedule=self.schedule,
                                          fetch_staging=self.fetch_staging, disk_masters=self.disk_masters,
                                          split=self.split, device_parameters=self._resident_parameters,
                                          promises=self.promises)
        self.memory_report.log_start(config, blocks=describe(block_specs), num_blocks=len(self.blocks),
                                     outside=len(self.units) - len(self.blocks), device=device,
                                     host_image=self.host_image, window_size=self.window_size)

    def _largest_block_numel(self) -> int:
        return max((sum(p.numel() for p in u.params) for u in self.blocks), default=0)

    def _units_read_in_pieces(self, config: StrongholdConfig) -> list[Unit]:
        """With ``vocab_pieces``, the units larger than a block that cross in row pieces; each
        other unit that is larger than a block says once why it streams whole."""
        if not config.vocab_pieces:
            return []
        largest = self._largest_block_numel()
        pieced = []
        for u in self.units:
            reason = why_not_pieced(u, largest)
            if reason is None:
                u.pool = None  # never in a window slot
                pieced.append(u)
            elif u.kind == "streamed" and sum(p.numel() for p in u.params) > largest:
                logger.info("stronghold: %s streams whole (vocab_pieces: %s)", u.fqn, reason)
        return pieced

    # ------------------------------------------------------------------ setup
    def _move_resident_parts(self, model: nn.Module, device: torch.device) -> None:
        with torch.no_grad():
            for p in model.parameters():
                if id(p) not in self._unit_of_param and p.device != device:
                    p.data = p.data.to(device)
            for module in model.modules():
                for name, buf in list(module._buffers.items()):
                    if buf is not None and buf.device != device:
                        module._buffers[name] = buf.to(device)

    # ------------------------------------------------------------------ public queries
    @property
    def window_size(self) -> int:
        return self.schedule.window_size

    @property
    def window_choice(self):
        """The `planner.WindowChoice` behind ``window_size="auto"`` (None for a fixed size)."""
        return self.schedule.window_choice

    @property
    def phase(self) -> Phase:
        return self.schedule.phase

    @property
    def _probe(self):  # the auto-window probe of the first step (tests swap it)
        return self.schedule.probe

    @_probe.setter
    def _probe(self, probe) -> None:
        self.schedule.probe = probe

    def resident_parameters(self) -> list[nn.Parameter]:
        """Parameters the engine leaves on the device, stepped by a device AdamW: the units the
        device/host split keeps (``StrongholdConfig.resident``, split.py; none on a CPU device by
        default); everything outside the blocks with ``offload_non_block=False``; and parameters
        added to the model after `offload_model` (adapters attached later). Worked out again
        only when a parameter or module was registered since (param_watch.py)."""
        return list(self._resident_parameters.get())

    def master_parameters(self) -> list[nn.Parameter]:
        """The fp32 CPU masters of the trainable offloaded parameters (what CPU Adam steps)."""
        return [m for u in self.units for m in u.host.masters if m is not None]

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """What a plain torch optimizer can step: every trainable parameter of the model.

        Between steps an offloaded parameter *is* its fp32 host master and its ``.grad`` the
        fp32 host gradient, so ``torch.optim.AdamW(engine.optimizer_parameters())`` trains
        (synchronously, on the host); `build_optimizer` is the overlapped CPU Adam path."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def optimizer_target(self, param: nn.Parameter) -> nn.Parameter:
        return param

    def is_offloaded(self, param: nn.Parameter) -> bool:
        return id(param) in self._unit_of_param

    def unit_of(self, param: nn.Parameter) -> Unit:
        return self._unit_of_param[id(param)]

    block_of = unit_of

    def resident_blocks(self) -> list[int]:
        """Indices of the units holding device storage right now (blocks and units outside them)."""
        return [u.index for u in self.units if u.holds_device_storage]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def memory_stats(self) -> dict[str, float]:
        """The memory ledger: every byte this engine allocated, and its traffic so far (the keys
        are documented at `memory_report.MemoryReport.stats`)."""
        return self.memory_report.stats()

    def reset_peak_memory_stats(self) -> None:
        self.ledger.reset_peak()

    # ------------------------------------------------------------------ residency (delegates)
    def evict_all(self) -> None:
        """Returns every idle unit to the host (before saving, between phases)."""
        self.schedule.evict_all()

    def settle_for_host_access(self) -> None:
        """Before the host reads or writes masters: no update in flight, no unit resident."""
        self.schedule.evict_all()
        self.coordinator.synchronize()

    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        """Whole parameters on every rank for the body of the ``with`` (DeepSpeed's
        ``GatheredParameters``): every rank must enter it, with the same ``params``.

        ``params``: the parameters to gather (their units are gathered whole), default all.
        Inside, each offloaded trainable parameter holds its whole fp32 value in host memory;
        reads see it. ``modifier_rank=r``: on exit, rank ``r``'s values (changed in place or
        through ``.data``) are broadcast and written into every rank's masters; otherwise
        changes are dropped. Parameters the engine leaves on the device (the split's resident
        units) are whole everywhere: with ``modifier_rank=r`` rank ``r``'s values are broadcast,
        without it a change stays on the rank that made it. Outside data parallelism it only
        finishes pending updates (host_reads.py)."""
        return self.reads.gathered_parameters(params, modifier_rank)

    def mark_parameters_changed(self) -> None:
        """Tells the engine that offloaded parameters were written behind its back (through a
        ``.data`` alias, which bumps no version counter); the next fetch re-derives the
        compute-dtype copies. Not needed with fp32 compute, where the master is what travels."""
        for u in self.units:
            if not u.layout.masters_in_image:
                u.host.image_stale = True

    # ------------------------------------------------------------------ state dict
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with every offloaded weight whole (fp32 masters for trainable
        ones). With sharded CPU state this gathers the shards: call it on every rank."""
        return self.reads.full_state_dict()

    # ------------------------------------------------------------------ step (delegates)
    def build_optimizer(self, params=None, **adamw_kwargs):
        """One `torch.optim.Optimizer` for the whole model: CPU Adam on the masters of the
        offloaded blocks (on the host worker, pipelined with the next forward) and a device
        AdamW on parameters left on the device, if any. ``params`` may be None (all trainable parameters), a
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
        self.schedule.settle()
        return self.coordinator.clip_grad_norm_(max_norm, norm_type)

    def global_grad_norm(self) -> torch.Tensor:
        self.schedule.settle()
        return self.coordinator.global_grad_norm()

    def invalidate_grad_norms(self) -> None:
        for u in self.units:
            u.grads.device_norm = None

    @property
    def last_grad_norm(self):
        return self.coordinator.last_grad_norm

    def synchronize(self) -> None:
        """Waits for every in-flight CPU update. Not needed before reading parameters: a read
        waits for its own unit's update by itself (read_guard.py)."""
        self.coordinator.synchronize()

    def shutdown_workers(self) -> None:
        """Finishes pending work and stops every thread the engine started: the host worker,
        the fetch conversion thread, the simulated copy threads and the NVMe I/O pools (each
        restarts on demand); then waits until the process group holds no tensor of the
        engine's collectives (distributed.py, [Note: the process group's last reference]).
        Local: safe on one rank alone. The end of ``Trainer.train()`` and `close` call it, and
        lifecycle.py at interpreter exit for engines never closed."""
        nvme = getattr(self.coordinator.optimizer, "nvme", None)
        try:
            self.coordinator.synchronize()
            self.schedule.gradients.drain()
            if nvme is not None:
                nvme.flush()  # its read-ahead for the next step ends: no I/O starts after this
        finally:  # a failed task re-raises above; the threads stop all the same
            self.worker.shutdown()
            if self.fetch_staging is not None:
                self.fetch_staging.close()
            self.transfer.stop_threads()
            for disk in (nvme, self.disk_masters):
                if disk is not None:
                    disk.file.stop_threads()
            self.schedule.activations.stop_threads()
            if self.dp is not None:
                self.dp.settle()

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
        self.schedule.settle()
        self.schedule.reset_holds()
        self.evict_all()
        self.shutdown_workers()
        nvme = getattr(self.coordinator.optimizer, "nvme", None)
        if nvme is not None:
            nvme.close()  # the swap file is scratch: removed with the engine
        self.schedule.activations.close()  # the checkpoint file too
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.chunked_loss is not None:
            self.chunked_loss.remove()
            self.chunked_loss = None
        for u in self.units:
            read_guard.unregister(u.params)
        for u in self.units:  # with sharded state, gathering is collective: every rank closes
            u.restore_parameters(target, u.host.full_values())
        if self.disk_masters is not None:  # the masters are in the parameters now: the files go
            self.disk_masters.close()
            self.disk_masters.directory.remove()
        _stop_reporting_compute_device(self._device_reporting)
        if target != self.device:
            self._move_resident_parts(self.model, target)
        if self.fetch_staging is not None:
            self.fetch_staging.close()
        self.transfer.close()
        self.host.release_all()
        if self.dp is not None:  # after the last collective (full_values above)
            self.dp.close()
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

    Parameter objects keep their identity. Every parameter lives on the host (fp32 masters
    for trainable ones, the stored bytes for frozen ones) and visits the device with its unit:
    blocks and large groups (embeddings, heads) in a window of ``W``, the small rest for each
    forward and its backward. Buffers move to ``device`` (default: CUDA when available, else
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
    on_meta = next((name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
    if on_meta is not None:
        raise ValueError(
            f"{type(model).__name__} has tensors on the meta device ({on_meta}, ...): they hold no values to train "
            "or stream. Build the model with its weights (from_pretrained, or from_config outside init_empty_weights "
            "and torch.device('meta')) on the CPU, then offload it."
        )
    config = StrongholdConfig.from_any(config)
    try:
        device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError as err:
        raise ValueError(f"offload_model: device {device!r} is not a device ({err}); use 'cuda' or 'cpu'.") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"offload_model: device {device} is not supported; use 'cuda' or 'cpu'.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"offload_model: device {device} was asked for, but torch sees no CUDA device (torch "
                         f"{torch.__version__}, CUDA build: {torch.version.cuda is not None}); use device='cpu' or "
                         "install a CUDA build of torch on a machine with a GPU.")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    engine = WindowEngine(model, config, device)
    tiling = SequenceTiling.install(model, config.sequence_tiling, config.tile_tokens, config.block_classes)
    engine._handles.append(tiling)
    if config.attention_tiling:
        # Its probe runs the block whole on a few tokens: the sequence tiling's own probes, which
        # judge the block's submodules at their first long call, must not take it for that call.
        engine._handles.append(QueryTiling.install(model, config.tile_tokens, config.block_classes,
                                                   around_probe=tiling.probing))
    return engine


def get_engine(model: nn.Module) -> WindowEngine | None:
    """The engine that offloads ``model`` (or a model wrapping it), or None."""
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is None:
        inner = getattr(model, "module", None)  # accelerate/DDP wrappers
        engine = getattr(inner, _ENGINE_ATTR, None) if isinstance(inner, nn.Module) else None
    return engine


# ---------------------------------------------------------------------------- model.device
_REPORTING_CLASSES: dict[type, type] = {}


def _reported_device(self):
    device = self.__dict__.get(_DEVICE_ATTR)
    if device is not None:
        return device
    return super(type(self), self).device


def _reporting_class(cls: type) -> type:
    sub = _REPORTING_CLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {
            "device": property(_reported_device, doc=cls.device.__doc__),
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
            "_stronghold_original": cls,
        })
        _REPORTING_CLASSES[cls] = sub
    return sub


def _report_compute_device(model: nn.Module, device: torch.device) -> list[tuple[nn.Module, type]]:
    """Makes ``model.device`` (and that of every Hugging Face model inside) the compute device.

    transformers' ``PreTrainedModel.device`` is the device of the first parameter. Every
    parameter now lives on the host between steps, so it would say ``cpu`` on a GPU run, and
    ``generate()``, pipelines and TRL would build their inputs there. Each such model's class
    is swapped for a subclass of the same name whose ``device`` property answers the engine's
    device; `WindowEngine.close` swaps it back."""
    swapped = []
    for m in model.modules():
        cls = type(m)
        if not isinstance(getattr(cls, "device", None), property) or "_stronghold_original" in cls.__dict__:
            continue
        m.__class__ = _reporting_class(cls)
        m.__dict__[_DEVICE_ATTR] = device
        swapped.append((m, cls))
    return swapped


def _stop_reporting_compute_device(swapped: list[tuple[nn.Module, type]]) -> None:
    for m, cls in swapped:
        m.__dict__.pop(_DEVICE_ATTR, None)
        m.__class__ = cls
