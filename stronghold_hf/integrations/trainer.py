"""`StrongholdTrainer` and `StrongholdSeq2SeqTrainer`: the HF Trainer with ``--stronghold``.

Without the flag both classes are their bases, untouched (every override starts with
``if not self._stronghold_on: return super()...``). With it:

* the fit estimate runs before anything is allocated, then `offload_model` places the model
  (resident parts on ``args.device``, blocks in CPU RAM);
* accelerate is built with ``device_placement=False`` and prepares the model in
  *evaluation mode*: autocast (and compile) are applied, but it neither moves the model nor
  wraps it in DDP (DDP would register every offloaded parameter; the engine all-reduces
  gradients itself, see ``distributed.py``);
* the optimizer is the engine's (CPU Adam + device AdamW) with Trainer's hyperparameters and
  decay/no-decay groups; clipping is the engine's exact global clip;
* checkpoints are written into a staging folder and renamed into place, so an interrupted
  save never leaves a ``checkpoint-N`` that resume would take for a good one; optimizer
  state is always loaded onto the CPU.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from typing import Any

import torch
from transformers import Seq2SeqTrainer, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..config import StrongholdConfig
from ..optim.hybrid import StrongholdOptimizer
from ..window import WindowEngine, get_engine, offload_model
from .arguments import env_flag, resolve_stronghold_config

logger = logging.getLogger("stronghold_hf")

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
_STAGING_DIR = ".stronghold-staging"
_ADAMW_OPTIMS = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused", "adamw_anyprecision", "adamw"}


def stronghold_settings(args) -> tuple[bool, StrongholdConfig]:
    """Reads the flag and config from Stronghold arguments, or from ``STRONGHOLD_*`` env vars."""
    if hasattr(args, "stronghold_config_resolved"):
        return bool(args.stronghold), args.stronghold_config_resolved
    on = env_flag("STRONGHOLD")
    cfg = resolve_stronghold_config(os.environ.get("STRONGHOLD_CONFIG"), os.environ.get("STRONGHOLD_WINDOW_SIZE"))
    if on and (getattr(args, "deepspeed", None) or getattr(args, "fsdp", None)):
        raise ValueError("STRONGHOLD=1 cannot be combined with --deepspeed or --fsdp; both own parameter placement.")
    return on, cfg


class _StrongholdTrainerMixin:
    """The stronghold behaviour shared by `StrongholdTrainer` and `StrongholdSeq2SeqTrainer`."""

    stronghold_engine: WindowEngine | None = None

    def __init__(self, model=None, args=None, *pos, **kwargs):
        on, cfg = stronghold_settings(args) if args is not None else (env_flag("STRONGHOLD"), StrongholdConfig())
        self._stronghold_on = on
        if on:
            if model is None:
                raise ValueError("--stronghold needs a model instance; model_init (hyperparameter search) is not supported.")
            optimizers = kwargs.get("optimizers") or (pos[5] if len(pos) > 5 else (None, None))
            if optimizers and optimizers[0] is not None and not isinstance(optimizers[0], StrongholdOptimizer):
                raise ValueError(
                    "--stronghold builds its own optimizer (CPU Adam for offloaded blocks); do not pass "
                    "optimizers=(...). Set learning_rate/weight_decay/adam_* in the arguments instead."
                )
            optim_name = str(getattr(args.optim, "value", args.optim))
            if optim_name not in _ADAMW_OPTIMS:
                raise ValueError(
                    f"--stronghold trains with AdamW semantics (CPU Adam); --optim {optim_name} is not supported. "
                    "Use the default --optim adamw_torch(_fused)."
                )
            # Low-precision device copies halve PCIe traffic on CUDA, where autocast runs norms in
            # fp32. CPU autocast does not (a bf16 LayerNorm weight next to an fp32 residual
            # stream fails), so on CPU the copies stay in the model's dtype.
            if cfg.param_dtype is None and args.device.type == "cuda" and (args.bf16 or args.fp16):
                cfg = cfg.replace(param_dtype=torch.bfloat16 if args.bf16 else torch.float16)
            self._stronghold_config = cfg
        super().__init__(model, args, *pos, **kwargs)
        if on:
            if cfg.check_fit:
                self._check_fits()
            engine = get_engine(self.model)
            self.stronghold_engine = engine if engine is not None else offload_model(self.model, cfg, device=self.args.device)
            self._stronghold_log_t0 = time.perf_counter()
            self._stronghold_log_steps = 0

    def _move_model_to_device(self, model, device):
        if getattr(self, "_stronghold_on", False):
            return  # the engine places the model (also with plain TrainingArguments + STRONGHOLD=1)
        return super()._move_model_to_device(model, device)

    # ------------------------------------------------------------------ start-up checks
    def _check_fits(self) -> None:
        try:
            from ..estimate import estimate_for_model
        except ImportError:  # pragma: no cover - estimator is part of the package
            return
        seq_len = getattr(getattr(self.model, "config", None), "max_position_embeddings", None) or 512
        est = estimate_for_model(
            self.model,
            seq_len=int(seq_len),
            batch_size=self.args.per_device_train_batch_size,
            dtype="bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32",
            gradient_checkpointing=bool(self.args.gradient_checkpointing),
            window_size=None if self._stronghold_config.window_size == "auto" else int(self._stronghold_config.window_size),
        )
        est.raise_if_not_fits()

    # ------------------------------------------------------------------ accelerate
    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        if self._stronghold_on:
            args["device_placement"] = False  # the engine owns placement
        return args

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self._stronghold_on:
            accelerator = self.accelerator
            prepare_model = accelerator.prepare_model

            # [Note: evaluation-mode prepare] Trainer calls accelerator.prepare(model, optimizer).
            # For a stronghold model we want autocast from accelerate, but neither device placement
            # (it would pull every block onto the GPU) nor DDP (it registers every parameter and
            # would all-reduce empty offloaded ones). evaluation_mode=True is accelerate's switch
            # for exactly "autocast and compile only".
            def prepare_model_without_placement(model, device_placement=None, evaluation_mode=False):
                return prepare_model(model, device_placement=False, evaluation_mode=True)

            accelerator.prepare_model = prepare_model_without_placement

    # ------------------------------------------------------------------ optimizer and clipping
    def create_optimizer(self, model=None):
        if not self._stronghold_on:
            return super().create_optimizer(model)
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(opt_model))
            groups = [
                {"params": [p for n, p in opt_model.named_parameters() if n in decay and p.requires_grad],
                 "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in opt_model.named_parameters() if n not in decay and p.requires_grad],
                 "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]
            self.optimizer = self.stronghold_engine.build_optimizer(
                groups, lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
            )
        return self.optimizer

    def _clip_grad_norm(self, model):
        if not self._stronghold_on:
            return super()._clip_grad_norm(model)
        if self.accelerator.scaler is not None:
            self.accelerator.unscale_gradients()  # fp16: accelerate's scaler owns the scale here
            self.stronghold_engine.invalidate_grad_norms()
        return self.stronghold_engine.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if not self._stronghold_on:
            return super()._get_grad_norm(model, grad_norm)
        if grad_norm is None:
            grad_norm = self.stronghold_engine.global_grad_norm()
        return float(grad_norm)

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._stronghold_on and "loss" in logs and self.stronghold_engine is not None:
            logs.update(self._stronghold_metrics())
        return super().log(logs, *args, **kwargs)

    def _stronghold_metrics(self) -> dict[str, float]:
        engine = self.stronghold_engine
        stats = engine.stats
        now = time.perf_counter()
        wall = max(now - self._stronghold_log_t0, 1e-9)
        steps = max(1, self.state.global_step - self._stronghold_log_steps)
        out = {
            "stronghold_window_size": engine.window_size,
            "stronghold_h2d_GBps": round(stats.h2d_bytes / wall / 1e9, 3),
            "stronghold_d2h_GBps": round(stats.d2h_bytes / wall / 1e9, 3),
            "stronghold_blocked_ms": round(1e3 * stats.blocked_s / steps, 3),
            "stronghold_cpu_adam_ms": round(1e3 * stats.cpu_adam_s / steps, 3),
        }
        stats.reset()
        self._stronghold_log_t0, self._stronghold_log_steps = now, self.state.global_step
        return out

    # ------------------------------------------------------------------ training lifecycle
    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._stronghold_on and self.stronghold_engine is not None:
                # No worker threads outlive training; later steps restart them on demand.
                self.stronghold_engine.shutdown_workers()

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial) -> None:
        if not self._stronghold_on:
            return super()._save_checkpoint(model, trial)
        self.stronghold_engine.synchronize()
        run_dir = super()._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        staging_root = os.path.join(run_dir, _STAGING_DIR)
        os.makedirs(staging_root, exist_ok=True)
        staging_run = tempfile.mkdtemp(prefix=f"{name}-", dir=staging_root)
        self._stronghold_output_dir_override = staging_run
        try:
            super()._save_checkpoint(model, trial)
        except BaseException:
            shutil.rmtree(staging_run, ignore_errors=True)
            raise
        finally:
            self._stronghold_output_dir_override = None
        written = os.path.join(staging_run, name)
        if self.args.should_save and os.path.isdir(written):
            self._fix_paths_after_staging(written, staging_run, run_dir)
            _atomic_replace_dir(written, final)
        shutil.rmtree(staging_run, ignore_errors=True)
        if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(staging_run):
            self.state.best_model_checkpoint = self.state.best_model_checkpoint.replace(staging_run, run_dir, 1)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _fix_paths_after_staging(self, written: str, staging_run: str, run_dir: str) -> None:
        state_file = os.path.join(written, "trainer_state.json")
        if not os.path.isfile(state_file):
            return
        with open(state_file, encoding="utf-8") as fh:
            text = fh.read()
        if staging_run in text:
            state = json.loads(text.replace(staging_run, run_dir))
            with open(state_file, "w", encoding="utf-8") as fh:
                json.dump(state, fh, indent=2, sort_keys=True)

    def _get_output_dir(self, trial) -> str:
        override = getattr(self, "_stronghold_output_dir_override", None)
        return override if override else super()._get_output_dir(trial)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if not self._stronghold_on or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        opt_file = os.path.join(checkpoint, OPTIMIZER_NAME)
        sched_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if not (os.path.isfile(opt_file) and os.path.isfile(sched_file)):
            return
        # CPU Adam state belongs in CPU RAM whatever the world size: map it there directly.
        self.optimizer.load_state_dict(torch.load(opt_file, map_location="cpu", weights_only=True))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.lr_scheduler.load_state_dict(torch.load(sched_file, map_location="cpu", weights_only=True))

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self._stronghold_on:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.stronghold_engine.synchronize()
        os.makedirs(output_dir, exist_ok=True)
        # Write next to the destination, then move each file in with an atomic rename.
        staging = tempfile.mkdtemp(prefix=".stronghold-save-", dir=output_dir)
        try:
            super()._save(staging, state_dict)
            for entry in os.listdir(staging):
                os.replace(os.path.join(staging, entry), os.path.join(output_dir, entry))
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _atomic_replace_dir(src: str, dst: str) -> None:
    """Moves a finished directory into place; an existing ``dst`` is swapped out, then removed."""
    if os.path.exists(dst):
        old = f"{dst}.old-{os.getpid()}"
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


class StrongholdTrainer(_StrongholdTrainerMixin, Trainer):
    """`transformers.Trainer`, plus STRONGHOLD working-window offloading with ``--stronghold``."""


class StrongholdSeq2SeqTrainer(_StrongholdTrainerMixin, Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` (``predict_with_generate``), plus ``--stronghold``."""
