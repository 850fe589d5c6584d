"""The accelerate side: `StrongholdPlugin` and `prepare_stronghold` for ``no_trainer`` loops.

accelerate has no third-party plugin registry (its kwargs handlers are matched by exact
class, ``DistributedType`` is closed, and ``accelerate config`` rejects unknown yaml keys),
so STRONGHOLD plugs in the way accelerate's own plugins read their settings: from
environment variables, which ``accelerate launch`` passes through to every process::

    STRONGHOLD=1 STRONGHOLD_WINDOW_SIZE=4 accelerate launch train.py

`StrongholdPlugin` is a dataclass modelled on accelerate's FSDP/DeepSpeed plugins: each
field falls back to its ``STRONGHOLD_*`` variable in ``__post_init__``.

`prepare_stronghold` replaces ``accelerator.prepare(model, optimizer)`` for the model: it
offloads the model, builds the engine's optimizer, and lets accelerate add autocast and the
gradient-accumulation/gradient-scaler logic, but neither device placement nor DDP (the
engine places the model and averages gradients itself). It also routes
``accelerator.clip_grad_norm_(model.parameters(), ...)`` to the engine's exact global clip,
and has ``accelerator.end_training()``, which destroys the process group, stop the engine's
threads and settle its collectives first (lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import StrongholdConfig
from ..window import WindowEngine, offload_model
from .arguments import env_config, env_flag, env_window_size, resolve_stronghold_config


@dataclass
class StrongholdPlugin:
    """STRONGHOLD settings for accelerate scripts; unset fields read ``STRONGHOLD_*`` env vars."""

    enabled: bool | None = field(default=None, metadata={"help": "Turn STRONGHOLD on (env: STRONGHOLD)."})
    window_size: int | str | None = field(default=None, metadata={"help": "'auto' or an int (env: STRONGHOLD_WINDOW_SIZE)."})
    config: dict | str | StrongholdConfig | None = field(
        default=None, metadata={"help": "StrongholdConfig as dict/JSON/path (env: STRONGHOLD_CONFIG)."}
    )
    stronghold_config: StrongholdConfig = field(init=False)

    def __post_init__(self) -> None:
        # The same readers as StrongholdTrainingArguments: one set of rules for every entry point.
        if self.enabled is None:
            self.enabled = bool(env_flag())
        if self.window_size is None:
            self.window_size = env_window_size()
        if self.config is None:
            self.config = env_config()
        self.stronghold_config = resolve_stronghold_config(self.config, self.window_size)


def prepare_stronghold(
    accelerator,
    model: torch.nn.Module,
    optimizer_kwargs: dict[str, Any] | None = None,
    *,
    param_groups: list | None = None,
    config: StrongholdConfig | dict | str | None = None,
    plugin: StrongholdPlugin | None = None,
) -> tuple[torch.nn.Module, Any, WindowEngine]:
    """Offloads ``model`` and returns ``(model, optimizer, engine)`` ready for an accelerate loop.

    ``optimizer_kwargs`` are AdamW's (``lr``, ``betas``, ``eps``, ``weight_decay``);
    ``param_groups`` may be Trainer-style decay/no-decay groups of model parameters. Use
    ``accelerator.backward(loss)``, ``accelerator.accumulate(model)``, and either
    ``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` or
    ``engine.clip_grad_norm_(max_norm)`` (the same exact global clip).
    """
    if plugin is None:
        plugin = StrongholdPlugin(config=config) if config is not None else StrongholdPlugin()
    dynamo = getattr(accelerator.state, "dynamo_plugin", None)
    if dynamo is not None and str(getattr(dynamo.backend, "value", dynamo.backend)).upper() != "NO":
        raise ValueError(
            f"prepare_stronghold cannot compile the model (accelerate dynamo backend {dynamo.backend}): "
            "offloaded block parameters give their storage back after each use and get it refilled "
            "before the next, which invalidates what torch.compile captured. Launch without "
            "--dynamo_backend (or with --dynamo_backend no)."
        )
    cfg = plugin.stronghold_config
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if cfg.param_dtype is None and mp in ("bf16", "fp16") and accelerator.device.type == "cuda":  # see trainer.py
        cfg = cfg.replace(param_dtype=torch.bfloat16 if mp == "bf16" else torch.float16)
    if cfg.host_grads == "auto":  # the engine's CPU Adam steps: bf16 host gradients unless they accumulate
        cfg = cfg.replace(host_grads="fp32" if accelerator.gradient_accumulation_steps > 1 else "compute")
    engine = offload_model(model, cfg, device=accelerator.device)
    # accelerator.accumulate() sets sync_gradients before each micro-batch: a step follows the
    # backward only when it is True, which is when the engine may update during backward.
    engine.coordinator.step_signal = lambda: accelerator.sync_gradients and accelerator.scaler is None
    optimizer = engine.build_optimizer(param_groups, **(optimizer_kwargs or {}))
    # Autocast and compile only: no placement (it would pull every block onto the device) and
    # no DDP (the engine averages gradients itself).
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    optimizer = accelerator.prepare_optimizer(optimizer, device_placement=False)
    _route_clip_grad_norm(accelerator, engine)
    _settle_before_end_training(accelerator, engine)
    return model, optimizer, engine


def _route_clip_grad_norm(accelerator, engine: WindowEngine) -> None:
    original = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        params = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        if not any(engine.is_offloaded(p) for p in params):
            return original(params, max_norm, norm_type=norm_type)
        if accelerator.scaler is not None:
            accelerator.unscale_gradients()
            engine.invalidate_grad_norms()
        return engine.clip_grad_norm_(max_norm, norm_type=norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_


def _settle_before_end_training(accelerator, engine: WindowEngine) -> None:
    """``end_training()`` destroys the process group: the engine's threads stop and the group
    lets go of the engine's tensors before that (distributed.py, [Note: the process group's
    last reference]). The engine stays usable on one process; its threads restart on demand."""
    original = accelerator.end_training

    def end_training():
        if not engine.closed:
            engine.shutdown_workers()
        return original()

    accelerator.end_training = end_training
