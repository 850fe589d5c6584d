"""Optimizers for offloaded training: `CPUAdam`, AdamW over fp32 master weights in CPU memory."""

from .cpu_adam import DEFAULT_CHUNK_NUMEL, CPUAdam

__all__ = ["CPUAdam", "DEFAULT_CHUNK_NUMEL"]
