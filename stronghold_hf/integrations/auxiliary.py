"""Inference-only models a Trainer runs next to the trained one, each given a forward-only window.

TRL's reference model (DPO, KTO, GRPO), a reward model, a distillation teacher: the Trainer
prepares them through ``accelerator.prepare_model(..., evaluation_mode=True)``. A full copy on
the device would undo the point of offloading, so `AuxiliaryModels.prepare` offloads each one
with its own window, frozen: it costs its stored bytes on the host and a window on the device,
like the trained model. Anything else, or a model without repeated blocks, is placed on the
device the way the Trainer would without STRONGHOLD (the accelerator has placement off for the
trained model's sake, see [Note: evaluation-mode prepare] in ``trainer.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..config import StrongholdConfig
from ..window import get_engine, offload_model

_hf_logger = logging.getLogger("transformers.trainer")


class AuxiliaryModels:
    """The inference-only models this trainer gave their own window."""

    def __init__(self):
        self._models: list[torch.nn.Module] = []

    def __contains__(self, model: Any) -> bool:
        return any(model is m for m in self._models)

    def prepare(self, model: Any, prepare_model: Callable, device_placement: bool | None, evaluation_mode: bool, *,
                config: StrongholdConfig, device: torch.device):
        """``accelerator.prepare_model`` (the original, ``prepare_model``) for a model that is not
        the trained one; ``config`` is the trained model's, ``device`` where the Trainer runs."""
        placement = True if device_placement is None else device_placement
        if not isinstance(model, torch.nn.Module) or not evaluation_mode:
            return prepare_model(model, device_placement=placement, evaluation_mode=evaluation_mode)
        if get_engine(model) is None:
            window = config.window_size if config.window_size != "auto" else 2  # no backward to probe with
            # Under resident="auto" a model the trainer runs next to the trained one streams: it is
            # prepared first, and the budget belongs to the model that trains.
            aux_cfg = config.replace(window_size=window, shard_cpu_state=False, check_fit=False,
                                     **({"resident": False} if config.resident == "auto" else {}))
            model.requires_grad_(False)  # never trained: no gradients, no masters beyond its dtype
            try:
                try:
                    offload_model(model, aux_cfg, device=device)
                except ValueError:
                    if aux_cfg.block_classes is None:
                        raise
                    # block_classes named the trained model's layers; this one may be another architecture
                    offload_model(model, aux_cfg.replace(block_classes=None), device=device)
            except ValueError as exc:  # nothing to window (no repeated blocks)
                _hf_logger.warning(f"STRONGHOLD: {type(model).__name__} (inference only) is placed on the device whole, "
                                   f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters: {exc}")
                return prepare_model(model, device_placement=placement, evaluation_mode=evaluation_mode)
            _hf_logger.info(f"STRONGHOLD: {type(model).__name__} (inference only) streams through its own window of "
                            f"{window} blocks")
            self._models.append(model)
        return prepare_model(model, device_placement=False, evaluation_mode=True)
