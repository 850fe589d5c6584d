"""`offload_model` and `WindowEngine`: the handle that composes the engine and answers its API.

``offload_model(model, config)`` finds the model's units (``discovery.py``: the blocks, the
large parameter groups outside them, the resident rest), gives each its host buffers and
device slot (``unit.py``), and hands them to the schedule (``schedule.py``), which installs
the hooks that slide the window. The step coordinator (``stepping.py``) keeps the state of
the optimizer step. This module composes those parts and answers the public API
(``memory_stats``, ``build_optimizer``, ``clip_grad_norm_``, ``full_state_dict``, ``close``);
it decides nothing about residency itself. docs/design.md draws the flow.

Between steps every unit is on the host and its parameters point at their host memory, so
they are always safe to read and write (unit_host.py, [Note: parameters always point at real
memory]). By default nothing but the window lives on the device: with
``StrongholdConfig(offload_non_block=False)`` the parameters outside the blocks stay there
instead, stepped by a device AdamW (the first version's behaviour).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import torch
from torch import nn

from . import distributed, read_guard
from .activations import ActivationStore
from .auto_window import AutoWindowProbe
from .checkpointing import CheckpointWatch
from .config import DEFAULT_WINDOW_SIZE, StrongholdConfig
from .discovery import describe, find_block_stacks, plan_units, unit_device_dtype
from .grads import GradientQueue
from .hooks import in_backward, install_module_hooks
from .ledger import MemoryLedger
from .distributed import DataParallel
from . import memory
from .memory import GRAD_ALIGN, DeviceSlotPool, HostAllocator, element_size, layout_block
from .optim import quant8
from .param_watch import ParametersOutside
from .promises import Promises
from .schedule import Phase, WindowSchedule
from .split import TRAINABLE_EXTRA_BYTES, DeviceSplit, choose_split, cuda_budget_bytes
from .state_dict import install_state_dict_hooks
from .stats import EngineStats
from .stepping import StepCoordinator
from .tiling import SequenceTiling
from .transfer import FetchStaging, TransferContext
from .unit import Residency, Unit
from .workers import HostWorker

logger = logging.getLogger("stronghold_hf")

_ENGINE_ATTR = "_stronghold_engine"
_DEVICE_ATTR = "_stronghold_compute_device"

#: Set by `stronghold_hf.testing.simulated_device`: the pinning stand-in of the CPU test mode.
_simulated_pinning = None


def _trainable_compute_numel(spec, dtype: torch.dtype | None) -> tuple[int, int]:
    """(trainable elements whose device copy is not fp32, its element size) of one unit."""
    trainable = [p for _, p in spec.params if p.requires_grad]
    if not trainable:
        return 0, 0
    c = element_size(dtype or trainable[0].dtype)
    return (sum(p.numel() for p in trainable), c) if c != 4 else (0, 0)


def keep_host_image(config: StrongholdConfig, specs, dtypes, shards: int, compute_grads: bool) -> bool:
    """``config.host_image`` resolved: ``"auto"`` keeps the pinned compute-dtype image unless
    the host's available memory (plus the model's own parameters, which the host buffers
    replace) would not hold the engine's host state with it. The state is counted as the
    estimator counts it (estimate.py). A log line says when it drops the image."""
    if config.host_image != "auto":
        return bool(config.host_image)
    from .estimate import ADAM_STATE_BYTES, _lean_adam_bytes

    image = sum(n * c for n, c in (_trainable_compute_numel(s, d) for s, d in zip(specs, dtypes))) // shards
    if not image:
        return True
    available = memory.available_host_bytes()
    if available is None:
        return True
    trainable = [p for s in specs for _, p in s.params if p.requires_grad]
    adam = sum(_lean_adam_bytes(p.numel()) if config.host_memory == "lean" else ADAM_STATE_BYTES * p.numel()
               for p in trainable)
    grads = 4 * sum(p.numel() for p in trainable) - (image * shards if compute_grads else 0)  # bf16 units: 2 B
    frozen = sum(p.numel() * p.element_size() for s in specs for _, p in s.params if not p.requires_grad)
    state = (4 * sum(p.numel() for p in trainable) + adam + grads) / shards + frozen
    freed = sum(p.numel() * p.element_size() for s in specs for _, p in s.params)  # replaced by the host buffers
    if state + image <= 0.9 * (available + freed):
        return True
    logger.info(
        "stronghold: host_image=\"auto\" drops the pinned compute-dtype image (%.2f GB): the host state needs "
        "%.2f GB with it and %.2f GB are available; fetches convert the fp32 masters instead.",
        image / 1e9, (state + image) / 1e9, (available + freed) / 1e9)
    return False


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
        self.split = self._choose_split(whole_plan)
        plan = whole_plan
        if self.split.kept_param_ids:
            plan = plan_units(model, stacks, offload_non_block=config.offload_non_block,
                              keep=self.split.kept_param_ids)
        specs = list(plan.units)
        block_specs = [s for s in specs if s.kind == "block"]
        self.ledger = MemoryLedger()
        self.stats = EngineStats()
        self.transfer = TransferContext(device, self.ledger, self.stats)
        self.host = HostAllocator(self.ledger, pin=config.pin_memory, pinning=_simulated_pinning,
                                  max_pinned_bytes=config.max_pinned_bytes)
        window_size, probe_first_step = self._initial_window_size(len(block_specs), len(plan.sequence))
        self.pool = DeviceSlotPool(capacity=window_size + 1)
        if self.dp is not None:
            # Ranks start from rank 0's weights, as DDP does; unit weights go through the host
            # group before each rank keeps its shard of them.
            self.dp.broadcast_([p.data for s in specs for _, p in s.params])
        # Lean host memory: pieces start on the 8-bit moments' blocks (memory.layout_block).
        grad_align = quant8.BLOCK if config.host_memory == "lean" else GRAD_ALIGN
        dtypes = [unit_device_dtype(s, config.param_dtype) for s in specs]
        # bf16 host gradients need CPU Adam's kernels, which read them (unit_grads.py, [Note: host
        # gradients in the compute dtype]). "auto" arrives resolved from the Trainer and the
        # accelerate plugin; on its own it means fp32, since the gradients may be read by an
        # optimizer the user built over model.parameters(), which wants fp32 ones.
        compute_grads = config.host_grads == "compute" and config.offload_optimizer
        shards = self.dp.shards if self.dp is not None else 1
        # Masters on disk (nvme_masters): the file is made before the units, which write their
        # initial masters straight into it ([Note: masters on disk], unit_host.py); no image then.
        self.disk_masters = self._disk_masters(specs, dtypes, shards, grad_align) if config.nvme_masters else None
        self.host_image = False if self.disk_masters is not None else keep_host_image(config, specs, dtypes, shards,
                                                                                      compute_grads)
        # Without the image, one ring serves every unit (sized below, allocated at the first fetch).
        staging = None if self.host_image else FetchStaging(self.transfer, self.host.allocate, 0)
        self.units: list[Unit] = [
            Unit(s, device=device, param_dtype=d, host=self.host, transfer=self.transfer,
                 pool=self.pool if s.kind != "resident" else None, ledger=self.ledger, dp=self.dp,
                 grad_align=grad_align, fetch_staging=staging, compute_grads=compute_grads,
                 disk_masters=self.disk_masters)
            for s, d in zip(specs, dtypes)
        ]
        converted = [self._shard_bytes(u) for u in self.units if u.host.fetch_staging is not None]
        self.fetch_staging = staging if converted else None
        if self.fetch_staging is not None:  # the largest block: larger units go through in pieces
            blocks = [self._shard_bytes(u) for u in self.units
                      if u.host.fetch_staging is not None and u.kind == "block"]
            self.fetch_staging.buffer_bytes = max(blocks or converted)
        self.blocks = [u for u in self.units if u.kind == "block"]
        self._unit_of_param = {id(p): u for u in self.units for p in u.params}
        self._resident_parameters = ParametersOutside(model, self._unit_of_param)
        inline = config.host_worker == "inline" or (config.host_worker == "auto" and not self.transfer.is_async
                                                    and device.type == "cpu")
        self.worker = HostWorker(config.resolved_cpu_threads(), inline=inline)
        streamed = [u for u in self.units if u.kind != "resident"]
        resident = [u for u in self.units if u.kind == "resident" and u.trainable]
        # Pinned staging of the largest block's gradient shard: larger units cross in pieces (grads.py).
        blocks = [self._shard_bytes(u) for u in streamed if u.kind == "block"]
        # One lane more per trainable unit used at several positions: it keeps its lane between
        # its backward uses (WindowSlots.release), and the blocks still have K.
        uses = {i: plan.sequence.count(i) for i in set(plan.sequence)}
        parked_lanes = sum(1 for u in streamed if u.trainable and uses.get(u.index, 0) > 1)
        self.grad_queue = GradientQueue(config.grad_buffers + parked_lanes,
                                        max((u.layout.trainable_bytes for u in streamed), default=0), device=device,
                                        host=self.host, transfer=self.transfer, ledger=self.ledger,
                                        staging_bytes=max(blocks or [self._shard_bytes(u) for u in streamed] or [0]))
        resident_queue = None
        if resident:
            # A resident unit keeps its lane for the whole backward: one lane each, of their size.
            resident_queue = GradientQueue(len(resident), max(u.layout.trainable_bytes for u in resident),
                                           device=device, host=self.host, transfer=self.transfer, ledger=self.ledger,
                                           staging_bytes=max(self._shard_bytes(u) for u in resident))
        speculative = "off" if inline and config.speculative_step == "auto" else config.speculative_step
        self.coordinator = StepCoordinator(units=self.units, worker=self.worker, stats=self.stats, dp=self.dp,
                                           device=device, speculative_step=speculative,
                                           device_parameters=self.resident_parameters)
        self._move_resident_parts(model, device)
        if self.dp is not None:
            self.dp.broadcast_([p.data for p in self.resident_parameters()])
        self.schedule = WindowSchedule(model, plan, self.units, window_size=window_size, pool=self.pool,
                                       grad_queue=self.grad_queue, resident_queue=resident_queue,
                                       coordinator=self.coordinator, transfer=self.transfer, worker=self.worker,
                                       stats=self.stats, dp=self.dp, device=device)
        self.schedule.window_choice = getattr(self, "_cpu_choice", None)
        if probe_first_step:
            cap = None
            if config.gpu_memory is not None:  # the budget's rest, and the slots the plan counted already
                split = self.split
                slot = max(u.slot_bytes for u in self.units if u.kind != "resident")
                cap = split.budget - split.resident_bytes - split.streamed_bytes + (window_size + 1) * slot
            self.schedule.probe = AutoWindowProbe(self.blocks, device, window_bytes_cap=cap)
        self.schedule.activations = ActivationStore(transfer=self.transfer, ledger=self.ledger, host=self.host,
                                                    device=device, offload=config.offload_activations)
        self.promises = Promises()
        self.schedule.checkpoint_watch = CheckpointWatch(model, {id(u.module): u for u in self.blocks}, self.promises)
        first_position = {u: min(ps) for u, ps in self.schedule.positions_of.items()}
        # The order the next forward needs the units in: the resident unit (the model's forward
        # starts with it), then by first position. CPU updates run in this order.
        self.update_order = sorted(self.units, key=lambda u: (u.kind != "resident",
                                                              first_position.get(u.index, len(self.units) + u.index)))
        self._closed = False
        from . import lifecycle
        lifecycle.register(self)  # threads and process groups stopped before interpreter exit
        self._handles: list[Any] = install_module_hooks(self.schedule, model, plan, self.units)
        if self.dp is not None:
            self.schedule.average_resident_grads = self.dp.resident_grad_averaging(self.resident_parameters)
        self._handles.append(self.schedule.checkpoint_watch)  # removing it gives back the checkpoint functions
        for u in self.units:
            self._handles.extend(install_state_dict_hooks(self.schedule, self.coordinator, u))
        self._gathered = 0  # depth of gathered_parameters() contexts
        for u in self.units:
            read_guard.register(u.params, self, u.index)
            if u.sharded or u.host.masters_on_disk:
                u.read_guard.guard()  # a shard: a read between steps is refused with the fix; on disk: mapped
        self._device_reporting = _report_compute_device(model, device)
        self.chunked_loss = None
        # "auto": not when the split keeps everything on the device (the model trains as plain).
        if config.chunked_loss is True or (config.chunked_loss == "auto" and self.units):
            from .chunked_loss import ChunkedLoss

            self.chunked_loss = ChunkedLoss.install(model, config.loss_chunk_tokens, promises=self.promises)
        setattr(model, _ENGINE_ATTR, self)
        stats = self.memory_stats()
        logger.info(
            "stronghold: %d blocks (%s) and %d units outside them, window_size=%d, %.1f MB per slot on %s, "
            "%d offloaded parameters (%d trainable), host_memory=%s, host_image=%s: host %.2f GB before optimizer state (%.1f "
            "B/offloaded param), %d parameters left on the device", len(self.blocks), describe(block_specs), len(self.units) - len(self.blocks), self.window_size,
            stats["slot_bytes"] / 1e6, device, stats["offloaded_params"], stats["offloaded_trainable_params"],
            config.host_memory, self.host_image, (stats["pinned_host_bytes"] + stats["pageable_host_bytes"]) / 1e9, stats["host_bytes_per_param"],
            sum(p.numel() for p in self.resident_parameters()),
        )
        if not self.split.streams_everything:
            logger.info("stronghold: %s: %s", self.split.reason, ", ".join(self.split.resident))

    @staticmethod
    def _shard_bytes(u: Unit) -> int:
        return u.layout.shard_numel * (element_size(u.layout.grad_dtype) if u.trainable else 0)

    # ------------------------------------------------------------------ setup
    def _initial_window_size(self, num_blocks: int, sequence_length: int) -> tuple[int, bool]:
        """The window size to start with, and whether the first step is probed (``"auto"`` on CUDA)."""
        ws = self.config.window_size
        if sequence_length == 0:
            return 0, False  # the split keeps everything on the device: no window
        if num_blocks == 0:  # every block is resident; a few units outside them stream: nothing to probe
            return (max(1, min(DEFAULT_WINDOW_SIZE if ws == "auto" else int(ws), sequence_length)), False)
        if ws == "auto":
            if self.device.type == "cuda":
                # The first training step runs with the default; auto_window.py then decides.
                return max(1, min(DEFAULT_WINDOW_SIZE, sequence_length)), True
            from .planner import choose_window_for_cpu

            self._cpu_choice = choose_window_for_cpu(num_blocks)
            logger.info("stronghold: %s", self._cpu_choice.reason)
            ws = self._cpu_choice.window_size
        elif ws > sequence_length:
            warnings.warn(
                f"stronghold: window_size={ws} is larger than the model's {sequence_length} streamed units "
                f"({num_blocks} blocks); using window_size={sequence_length} (every unit resident, nothing to slide).",
                stacklevel=4,
            )
        return max(1, min(int(ws), sequence_length)), False

    def _choose_split(self, plan) -> DeviceSplit:
        """``config.resident`` within the device budget: ``gpu_memory``, or on CUDA the free
        memory less the reserve; the smallest budget of all ranks under data parallelism, so
        that every rank keeps the same units."""
        config = self.config
        budget = config.gpu_memory
        if budget is None and self.device.type == "cuda" and config.resident == "auto":
            budget = cuda_budget_bytes(self.device, self.model)
        if budget is not None and self.dp is not None:
            budget = self.dp.min_int(int(budget))
        in_units = {id(p) for u in plan.units for _, p in u.params}
        outside = [p for p in self.model.parameters() if id(p) not in in_units]
        base = sum(p.numel() * (p.element_size() + (TRAINABLE_EXTRA_BYTES if p.requires_grad else 0)) for p in outside)
        ws = config.window_size if isinstance(config.window_size, int) else DEFAULT_WINDOW_SIZE
        split = choose_split(plan, resident=config.resident, budget=budget, window_size=min(ws, len(plan.sequence)),
                             grad_buffers=config.grad_buffers, param_dtype=config.param_dtype, base_bytes=base,
                             explicit=config.gpu_memory is not None)
        logger.info("stronghold: device/host split: %s", split.reason)
        return split

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
        """The memory ledger: every byte this engine allocated, and its traffic so far.

        ``device_bytes``/``device_peak_bytes``: unit slots and gradient lanes on the compute
        device (activations are autograd's, counted apart in ``activation_*`` when checkpointed
        inputs are offloaded). ``pinned_host_bytes``/``pageable_host_bytes``: arenas, staging,
        and the CPU optimizer's state. ``device_optimizer_bytes``: optimizer state on the
        device (0 unless ``offload_non_block=False``). ``offloaded_trainable_params``: trainable
        parameters whose master and optimizer state live on the host (by default every
        trainable parameter of the model). ``blocks_resident``, ``grads_in_flight``: right now.
        ``h2d_bytes``, ``d2h_bytes``, ``fetches``: cumulative. ``host_bytes_per_param``: host
        bytes over offloaded parameters. ``host_image_bytes``: the pinned compute-dtype image
        (``host_image``); ``fetch_staging_bytes``: the ring that replaces it when dropped;
        ``grad_staging_bytes``: the pinned buffers gradients land in from the device.
        ``nvme_ring_bytes``, ``nvme_file_bytes``, ``nvme_read_bytes``, ``nvme_written_bytes``:
        the NVMe tier's host ring, its file on disk, and its traffic (0 without ``nvme_path``).
        ``nvme_masters_file_bytes``, ``nvme_masters_read_bytes`` (fetches),
        ``nvme_masters_written_bytes`` (writes outside the step), ``nvme_masters_scratch_bytes``
        (the buffer fetches read into): the masters on disk (0 without ``nvme_masters``).
        The device/host split (``StrongholdConfig.resident``, split.py; the kept units' names
        are ``engine.split.resident``): ``split_resident_units``, ``split_resident_blocks``,
        ``split_resident_params``, ``split_resident_bytes`` (their parameters, gradients and
        Adam state as planned), ``split_budget_bytes`` (0: none). Every parameter left on the
        device (the split's, or outside the units): ``device_parameter_bytes`` and
        ``device_grad_bytes`` now, and its Adam state in ``device_optimizer_bytes``."""
        self.transfer.collect_timings()
        out: dict[str, float] = dict(self.ledger.snapshot())
        opt_bytes = self.coordinator.optimizer_state_bytes()
        out["optimizer_state_bytes"] = opt_bytes
        out["pageable_host_bytes"] += opt_bytes
        out["device_optimizer_bytes"] = self.coordinator.device_optimizer_state_bytes()
        out["blocks_resident"] = len(self.pool.in_use)
        out["grads_in_flight"] = self.grad_queue.busy
        offloaded = sum(e.numel for u in self.units for e in u.layout.entries)
        trainable = sum(e.numel for u in self.units for e in u.layout.entries if e.trainable)
        out["offloaded_params"] = offloaded
        out["offloaded_trainable_params"] = trainable
        out["model_trainable_params"] = sum(p.numel() for p in self.optimizer_parameters())
        out["host_bytes_per_param"] = (out["pinned_host_bytes"] + out["pageable_host_bytes"]) / max(offloaded, 1)
        out["window_size"] = self.window_size
        # Forward positions the window slides over (blocks and streamed units; a tied embedding
        # counts at both ends), and whether a resident unit visits once per step besides: a
        # training step fetches 2 x positions - W + resident units (the turn is free).
        out["sequence_length"] = len(self.schedule.sequence)
        out["resident_units"] = len(self.schedule.resident_units)
        streamed = [u for u in self.units if u.kind != "resident"]
        out["slot_bytes"] = max((u.slot_bytes for u in streamed), default=0)
        out["window_bound_bytes"] = sum(sorted((u.slot_bytes for u in streamed), reverse=True)[: self.window_size + 1])
        out["resident_unit_bytes"] = sum(u.slot_bytes for u in self.schedule.resident_units)
        queue = self.schedule.gradients.resident_queue
        out["resident_grad_bytes"] = queue.max_bytes * queue.num_lanes if queue is not None else 0
        out["grad_buffer_bytes"] = self.grad_queue.max_bytes
        out["grad_lanes"] = self.grad_queue.num_lanes  # K, plus one per unit used at several positions
        # The pinned compute-dtype image of trainable parameters (0 with fp32 compute, where the
        # masters cross, or with host_image=False), and the staging ring that replaces it.
        out["host_image_bytes"] = sum(u.host.image_trainable.numel() for u in self.units
                                      if u.host.image_trainable is not None and not u.layout.masters_in_image)
        out["fetch_staging_bytes"] = self.fetch_staging.allocated_bytes if self.fetch_staging is not None else 0
        out["grad_staging_bytes"] = sum(q.staging_allocated_bytes for q in (self.grad_queue, queue)
                                        if q is not None)
        # The NVMe tier (nvme.py): its ring of host buffers (counted in pageable_host_bytes), the
        # file on disk (not host memory), and the bytes read and written so far.
        nvme = getattr(self.coordinator.optimizer, "nvme", None)
        out["nvme_ring_bytes"] = nvme.ring_bytes if nvme is not None else 0
        out["nvme_file_bytes"] = nvme.file_bytes if nvme is not None else 0
        out["nvme_read_bytes"] = nvme.read_bytes if nvme is not None else 0
        out["nvme_written_bytes"] = nvme.written_bytes if nvme is not None else 0
        # nvme_masters: the masters' file, and what fetches and writes outside the step moved
        # (an update's masters travel with its moments, in the tier's counts above).
        disk = self.disk_masters
        out["nvme_masters_file_bytes"] = disk.file_bytes if disk is not None else 0
        out["nvme_masters_read_bytes"] = disk.read_bytes if disk is not None else 0
        out["nvme_masters_written_bytes"] = disk.written_bytes if disk is not None else 0
        out["nvme_masters_scratch_bytes"] = self.fetch_staging.scratch_bytes if self.fetch_staging is not None else 0
        # The device/host split (split.py): what it keeps on the device, and what that holds now.
        split = self.split
        out["split_resident_units"] = len(split.resident)
        out["split_resident_blocks"] = split.resident_blocks
        out["split_resident_params"] = split.resident_params
        out["split_resident_bytes"] = split.resident_bytes
        out["split_budget_bytes"] = split.budget or 0
        kept = self.resident_parameters()
        out["device_parameter_bytes"] = sum(p.numel() * p.element_size() for p in kept)
        out["device_grad_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in kept if p.grad is not None)
        # What the first step checked (promises.py): promise_<name> 1.0 held, 0.0 not; absent until checked.
        out.update(self.promises.stats())
        out.update(self.schedule.checkpoint_watch.stats())
        return out

    def _disk_masters(self, specs, dtypes, shards: int, grad_align: int):
        """The file of the fp32 masters (``nvme_masters``), one extent per unit with a trainable
        shard, sized by the layouts the units will compute."""
        from .nvme import DiskMasters
        from .swap import SwapDirectory

        numels = {}
        for s, d in zip(specs, dtypes):
            n = layout_block(s.fqn, list(s.params), d, shards, grad_align).shard_numel
            if n:
                numels[s.index] = n
        directory = SwapDirectory(self.config.nvme_path)
        try:
            return DiskMasters(directory, numels, io_threads=self.config.nvme_io_threads)
        except BaseException:
            directory.remove()  # a full disk: nothing of this engine is left behind
            raise

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

    def read_barrier(self, index: int) -> None:
        """A guarded parameter of unit ``index`` is about to be read (read_guard.py): its CPU
        update finishes first (a speculative update the step has not validated is undone, so the
        read sees what the last ``step()`` produced); a shard this rank holds is refused."""
        u = self.units[index]
        self.coordinator.wait_update(u, forward=False)
        if u.host.masters_on_disk and not u.sharded and u.state is Residency.ON_HOST:
            u.host.materialize()  # the value, mapped from the file
        elif u.sharded and u.state is Residency.ON_HOST:
            if self.schedule.gathering or self._gathered:
                return  # the values are being assembled (full_state_dict, gathered_parameters)
            raise RuntimeError(
                f"stronghold: with sharded CPU state (data parallel) this rank holds only a shard of the parameters "
                f"of {u.fqn} between steps, so reading one here would give a placeholder, not its value. Read whole "
                "values with engine.full_state_dict() (on every rank), or inside `with "
                "engine.gathered_parameters(params):` entered on every rank (modifier_rank=r writes rank r's changes "
                "back), or use StrongholdConfig(shard_cpu_state=False)."
            )
        u.read_guard.unguard()

    @contextlib.contextmanager
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
        finishes pending updates."""
        self.schedule.evict_all()
        self.coordinator.synchronize()
        if params is None:
            units = list(self.units)
            on_device = self.resident_parameters()
        else:
            params = list(params)
            chosen = {self.unit_of(p).index for p in params if self.is_offloaded(p)}
            units = [u for u in self.units if u.index in chosen]
            on_device = [p for p in params if not self.is_offloaded(p)]
        gathered = []
        self._gathered += 1
        try:
            for u in units:  # the same order on every rank: each full_values is a collective
                u.read_guard.unguard()
                if u.host.masters_on_disk and not u.sharded:
                    assert u.state is Residency.ON_HOST, f"{u.fqn}: gathered while resident"
                    u.host.materialize()  # a write is taken into the file at the next fetch
                elif u.sharded:
                    values = u.host.full_values()
                    with torch.no_grad():
                        for e, p, v in zip(u.layout.entries, u.params, values):
                            if e.trainable:
                                p.data = v
                    gathered.append(u)
            yield
        finally:
            self._gathered -= 1
            with torch.no_grad():
                for u in units:
                    trainable = [(k, p) for k, (e, p) in enumerate(zip(u.layout.entries, u.params)) if e.trainable]
                    if modifier_rank is not None and self.dp is not None:
                        self.dp.broadcast_([p.data for _, p in trainable], src=modifier_rank)
                    if u in gathered:
                        if modifier_rank is not None:
                            for k, p in trainable:
                                u.host.write_value(k, p.data.to(torch.float32))
                            u.host.image_stale = not u.layout.masters_in_image
                        for p, view in zip(u.params, u.host.param_views):
                            p.data = view
                        u.read_guard.guard()
                if modifier_rank is not None and self.dp is not None and on_device:
                    # Parameters left on the device (the split's resident units) are whole on
                    # every rank already: rank r's changes reach the others the same way.
                    self.dp.broadcast_([p.data for p in on_device], src=modifier_rank)

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
        self.evict_all()
        self.schedule.gathering = True
        try:
            return self.model.state_dict()
        finally:
            self.schedule.gathering = False

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
    config = StrongholdConfig.from_any(config)
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"offload_model: device {device} is not supported; use 'cuda' or 'cpu'.")
    engine = WindowEngine(model, config, device)
    engine._handles.append(SequenceTiling.install(model, config.sequence_tiling, config.tile_tokens, config.block_classes))
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
