"""The engine's host-memory choices, made once from the config, the units and the machine.

Before any unit allocates, the engine settles how its host state is kept (docs/design.md,
"Host, per unit"): where a unit's pieces start (on the 8-bit moments' blocks with
``host_memory="lean"``), whether bf16 units keep bf16 host gradients (``host_grads``), whether
the fp32 masters go to a file (``nvme_masters``; the file is made here, before the units write
their initial masters into it), and whether the pinned compute-dtype image is kept
(``host_image``; ``"auto"`` asks the machine's available memory, `keep_host_image`). Each is a
policy of the config against the machine; the units only receive the answers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import memory
from .config import StrongholdConfig
from .memory import GRAD_ALIGN, element_size, layout_block
from .optim import quant8

logger = logging.getLogger("stronghold_hf")


@dataclass(frozen=True)
class HostChoices:
    """How the units keep their host state."""

    grad_align: int  # where a unit's pieces start (memory.layout_block)
    compute_grads: bool  # bf16 host gradients for bf16 units (unit_grads.py)
    disk_masters: object | None  # nvme.DiskMasters: the masters' file (nvme_masters), or None
    host_image: bool  # keep the pinned compute-dtype image (otherwise fetches convert the masters)


def choose_host_memory(config: StrongholdConfig, specs, dtypes, shards: int) -> HostChoices:
    """The choices for units ``specs`` (computing in ``dtypes``) over ``shards`` ranks."""
    # Lean host memory: pieces start on the 8-bit moments' blocks (memory.layout_block).
    grad_align = quant8.BLOCK if config.host_memory == "lean" else GRAD_ALIGN
    # bf16 host gradients need CPU Adam's kernels, which read them (unit_grads.py, [Note: host
    # gradients in the compute dtype]). "auto" arrives resolved from the Trainer and the
    # accelerate plugin; on its own it means fp32, since the gradients may be read by an
    # optimizer the user built over model.parameters(), which wants fp32 ones.
    compute_grads = config.host_grads == "compute" and config.offload_optimizer
    # Masters on disk: the file is made before the units, which write their initial masters
    # straight into it (unit_host.py, [Note: masters on disk]); no image then.
    disk = _disk_masters(config, specs, dtypes, shards, grad_align) if config.nvme_masters else None
    image = False if disk is not None else keep_host_image(config, specs, dtypes, shards, compute_grads)
    return HostChoices(grad_align=grad_align, compute_grads=compute_grads, disk_masters=disk, host_image=image)


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
    estimator counts it (estimate/). A log line says when it drops the image."""
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


def _disk_masters(config: StrongholdConfig, specs, dtypes, shards: int, grad_align: int):
    """The file of the fp32 masters (``nvme_masters``), one extent per unit with a trainable
    shard, sized by the layouts the units will compute."""
    from .nvme import DiskMasters
    from .swap import SwapDirectory

    numels = {}
    for s, d in zip(specs, dtypes):
        n = layout_block(s.fqn, list(s.params), d, shards, grad_align).shard_numel
        if n:
            numels[s.index] = n
    directory = SwapDirectory(config.nvme_path)
    try:
        return DiskMasters(directory, numels, io_threads=config.nvme_io_threads)
    except BaseException:
        directory.remove()  # a full disk: nothing of this engine is left behind
        raise
