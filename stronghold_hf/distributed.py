"""Data parallelism on torch.distributed (NCCL on GPU, gloo on CPU), without DDP.

DDP registers every parameter and buckets them by storage, which cannot work for offloaded
parameters whose storage is empty most of the time. The engine therefore reduces gradients
itself, with the process group that ``accelerate launch`` / ``torchrun`` already set up:

* an offloaded block's gradient is averaged across ranks while it is still on the device,
  packed in one flat buffer, right before its device-to-host copy (so on GPU the reduction
  overlaps with the backward of the blocks before it, and PCIe carries reduced bytes);
* resident gradients are averaged in one flat buffer at the end of backward;
* at start-up every rank takes rank 0's weights, as DDP does, so ranks start identical.

Every rank then applies the same update to the same masters: ranks never diverge.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def average_(tensor: torch.Tensor) -> None:
    """In-place mean across ranks."""
    if world_size() == 1:
        return
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    tensor.div_(world_size())


def average_grads_(grads: list[torch.Tensor]) -> None:
    """Averages a list of gradients through one flat buffer (one collective)."""
    if world_size() == 1 or not grads:
        return
    flat = _flatten_dense_tensors(grads)
    average_(flat)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def broadcast_from_rank0_(tensors: list[torch.Tensor]) -> None:
    if world_size() == 1:
        return
    for t in tensors:
        dist.broadcast(t, src=0)
