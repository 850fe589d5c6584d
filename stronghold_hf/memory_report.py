"""``engine.memory_stats()``: the memory ledger with what each part of the engine holds.

The ledger (``ledger.py``) counts every byte the engine allocates, device and host, as it
happens; this is the report a user (and a memory test) reads, assembled on demand from the
ledger and from the parts that know the rest: the step coordinator (the optimizer's state),
the schedule (the window, the gradient queues, what the checkpointed calls did), the units
(their layouts and host images), the fetch staging ring, the NVMe tiers, the device/host
split, and the promises checked at the first step. Its keys are public API (docs/config.md);
`MemoryReport.stats` documents each.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .param_watch import ParametersOutside
from .promises import Promises
from .schedule import WindowSchedule
from .split import DeviceSplit
from .stepping import StepCoordinator
from .transfer import FetchStaging, TransferContext
from .ledger import MemoryLedger

logger = logging.getLogger("stronghold_hf")


class MemoryReport:
    """The parts `stats` reads, held from the engine's construction on."""

    def __init__(self, *, model: nn.Module, ledger: MemoryLedger, transfer: TransferContext,
                 coordinator: StepCoordinator, schedule: WindowSchedule, fetch_staging: FetchStaging | None,
                 disk_masters, split: DeviceSplit, device_parameters: ParametersOutside, promises: Promises) -> None:
        self.model = model
        self.ledger = ledger
        self.transfer = transfer
        self.coordinator = coordinator
        self.schedule = schedule
        self.fetch_staging = fetch_staging
        self.disk_masters = disk_masters
        self.split = split
        self.device_parameters = device_parameters
        self.promises = promises

    def log_start(self, config, *, blocks: str, num_blocks: int, outside: int, device: torch.device,
                  host_image: bool, window_size: int) -> None:
        """The engine's line in the log once it is built (at INFO): what streams (``blocks``: the
        block classes described, ``outside``: units outside them), the slot, the host bytes
        before optimizer state, and what the split keeps on the device."""
        stats = self.stats()
        logger.info(
            "stronghold: %d blocks (%s) and %d units outside them, window_size=%d, %.1f MiB per slot on %s, "
            "%d offloaded parameters (%d trainable), host_memory=%s, host_image=%s: host %.2f GiB before optimizer "
            "state (%.1f B/offloaded param), %d parameters left on the device", num_blocks, blocks, outside,
            window_size, stats["slot_bytes"] / 2**20,
            device, stats["offloaded_params"], stats["offloaded_trainable_params"], config.host_memory, host_image,
            (stats["pinned_host_bytes"] + stats["pageable_host_bytes"]) / 2**30, stats["host_bytes_per_param"],
            sum(p.numel() for p in self.device_parameters.get()),
        )
        if not self.split.streams_everything:
            logger.info("stronghold: %s: %s", self.split.reason, ", ".join(self.split.resident))

    def stats(self) -> dict[str, float]:
        """The memory ledger: every byte this engine allocated, and its traffic so far.

        ``device_total_peak_bytes``: the one figure for the device, everything the engine
        holds there at its peak: the window's peak (``device_peak_bytes``), the parameters it
        leaves on the device with their gradients (``device_parameter_bytes``, a full gradient
        per trainable one) and Adam state (``device_optimizer_bytes``), and the checkpointed
        inputs it keeps there (``activation_device_peak_bytes``). Autograd's other activations
        and the loss are the model's; on CUDA ``device_allocator_peak_bytes`` is the
        allocator's peak for the process, which includes them (0 on a CPU device).
        ``device_bytes``/``device_peak_bytes``: the window's part, unit slots, gradient lanes
        and the rest units on the compute device. ``pinned_host_bytes``/``pageable_host_bytes``: arenas, staging,
        and the CPU optimizer's state. ``device_optimizer_bytes``: optimizer state on the
        device (the split's resident units', and everything outside the blocks with
        ``offload_non_block=False``). ``offloaded_trainable_params``: trainable
        parameters whose master and optimizer state live on the host (by default every
        trainable parameter of the model). ``slots_in_use``, ``grads_in_flight``: right now.
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
        ``device_grad_bytes`` now, and its Adam state in ``device_optimizer_bytes`` (0 when
        everything streams)."""
        schedule = self.schedule
        units = schedule.units
        grad_queue, resident_queue = schedule.gradients.grad_queue, schedule.gradients.resident_queue
        window_size = schedule.slots.window_size
        self.transfer.collect_timings()
        out: dict[str, float] = dict(self.ledger.snapshot())
        opt_bytes = self.coordinator.optimizer_state_bytes()
        out["optimizer_state_bytes"] = opt_bytes
        out["pageable_host_bytes"] += opt_bytes
        out["device_optimizer_bytes"] = self.coordinator.device_optimizer_state_bytes()
        out["slots_in_use"] = len(schedule.slots.pool.in_use)
        out["grads_in_flight"] = grad_queue.busy
        offloaded = sum(e.numel for u in units for e in u.layout.entries)
        trainable = sum(e.numel for u in units for e in u.layout.entries if e.trainable)
        out["offloaded_params"] = offloaded
        out["offloaded_trainable_params"] = trainable
        out["model_trainable_params"] = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        out["host_bytes_per_param"] = (out["pinned_host_bytes"] + out["pageable_host_bytes"]) / max(offloaded, 1)
        out["window_size"] = window_size
        # Forward positions the window slides over (blocks and streamed units; a tied embedding
        # counts at both ends), and whether a rest unit visits once per step besides: a
        # training step fetches 2 x positions - W + rest units (the turn is free).
        out["sequence_length"] = len(schedule.sequence)
        out["rest_units"] = len(schedule.rest_units)
        streamed = [u for u in units if u.kind != "rest" and u.vocab_pieces is None]
        out["vocab_piece_bytes"] = max((u.vocab_pieces.piece_bytes for u in units if u.vocab_pieces is not None),
                                       default=0)
        out["slot_bytes"] = max((u.slot_bytes for u in streamed), default=0)
        out["window_bound_bytes"] = sum(sorted((u.slot_bytes for u in streamed), reverse=True)[: window_size + 1])
        out["rest_unit_bytes"] = sum(u.slot_bytes for u in schedule.rest_units)
        out["rest_grad_bytes"] = (resident_queue.max_bytes * resident_queue.num_lanes
                                      if resident_queue is not None else 0)
        out["grad_buffer_bytes"] = grad_queue.max_bytes
        out["grad_lanes"] = grad_queue.num_lanes  # K, plus one per unit used at several positions
        # The pinned compute-dtype image of trainable parameters (0 with fp32 compute, where the
        # masters cross, or with host_image=False), and the staging ring that replaces it.
        out["host_image_bytes"] = sum(u.host.image_trainable.numel() for u in units
                                      if u.host.image_trainable is not None and not u.layout.masters_in_image)
        staging = self.fetch_staging
        out["fetch_staging_bytes"] = staging.allocated_bytes if staging is not None else 0
        out["grad_staging_bytes"] = sum(q.staging_allocated_bytes for q in (grad_queue, resident_queue)
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
        out["nvme_masters_scratch_bytes"] = staging.scratch_bytes if staging is not None else 0
        # The device/host split (split.py): what it keeps on the device, and what that holds now.
        split = self.split
        out["split_resident_units"] = len(split.resident)
        out["split_resident_blocks"] = split.resident_blocks
        out["split_resident_params"] = split.resident_params
        out["split_resident_bytes"] = split.resident_bytes
        out["split_budget_bytes"] = split.budget or 0
        kept = self.device_parameters.get()
        out["device_parameter_bytes"] = sum(p.numel() * p.element_size() for p in kept)
        out["device_grad_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in kept if p.grad is not None)
        # One figure for everything the engine holds on the device at its peak: the window's
        # peak, the parameters it leaves there with a full gradient each (trainable ones) and
        # their Adam state, and the checkpointed inputs it keeps on the device. On CUDA the
        # allocator's peak for the process (activations and the loss included) stands next to it.
        full_grads = sum(p.numel() * p.element_size() for p in kept if p.requires_grad)
        out["device_total_peak_bytes"] = (out["device_peak_bytes"] + out["device_parameter_bytes"] + full_grads
                                          + out["device_optimizer_bytes"] + out["activation_device_peak_bytes"])
        device = self.transfer.device
        out["device_allocator_peak_bytes"] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0)
        # What the first step checked (promises.py): promise_<name> 1.0 held, 0.0 not; absent until checked.
        out.update(self.promises.stats())
        out.update(schedule.checkpoint_watch.stats())
        return out
