"""`StrongholdTrainer` and `StrongholdSeq2SeqTrainer`: the HF Trainer with ``--stronghold``.

Without the flag both classes are their bases, untouched (every override starts with
``if not self._stronghold_on: return super()...``). With it:

* incompatible options (another optimizer, DeepSpeed, FSDP, ``torch_compile``) are refused
  before anything is built; the fit check runs (``fit_check.py``), then `offload_model` places
  the model (resident parts on ``args.device``, blocks in CPU RAM);
* accelerate is built with ``device_placement=False`` and prepares the model in
  *evaluation mode*: autocast is applied, but it neither moves the model nor wraps it in DDP
  (DDP would register every offloaded parameter; the engine all-reduces gradients itself,
  see ``distributed.py``); inference-only models next to it get their own window
  (``auxiliary.py``);
* the optimizer is the engine's (CPU Adam + device AdamW) with Trainer's hyperparameters and
  decay/no-decay groups; clipping is the engine's exact global clip;
* checkpoints are staged and renamed into place, optimizer state is loaded onto the CPU and
  re-cut for the run's layout (``checkpoints.py``);
* each logging step carries the engine's ``stronghold_*`` figures (``run_log.py``).

The behaviour lives in `_StrongholdTrainerMixin`, which goes in front of any Trainer class:
`StrongholdTrainer` and `StrongholdSeq2SeqTrainer` here, ``class MySFT(StrongholdTrainer,
SFTTrainer)`` in user code, and the classes ``python -m stronghold_hf`` builds on the fly. It
holds the Trainer's hooks only; each delegates to the object or module that owns the concern.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from transformers import Seq2SeqTrainer, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..config import StrongholdConfig
from ..optim.hybrid import StrongholdOptimizer
from ..window import WindowEngine, get_engine, offload_model
from . import checkpoints
from .arguments import ENV_FLAG, config_for_training, refuse_incompatible_options, settings_from_env
from .auxiliary import AuxiliaryModels
from .fit_check import FitCheck
from .run_log import RunLog

logger = logging.getLogger("stronghold_hf")


def stronghold_settings(args) -> tuple[bool, StrongholdConfig]:
    """The flag and config from stronghold arguments, else from the ``STRONGHOLD_*`` environment.

    Arguments that carry the stronghold fields (`StrongholdTrainingArguments`, or any config
    with `StrongholdArgumentsMixin`) were resolved and validated when they were built. Any
    other arguments (plain `TrainingArguments`, TRL's ``SFTConfig``...) take the environment,
    checked here against the options STRONGHOLD cannot run with.
    """
    if hasattr(args, "stronghold_config_resolved"):
        return bool(args.stronghold), args.stronghold_config_resolved
    on, cfg = settings_from_env()
    # args=None: the Trainer class builds its own defaults later, which use none of the refused options.
    if on and args is not None:
        refuse_incompatible_options(args, flag=f"{ENV_FLAG}=1")
        cfg = config_for_training(cfg, args)
    return on, cfg


def _named_call_arguments(trainer: Any, pos: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name, bound against the Trainer class behind the mixin.

    Trainer classes disagree on positions (``SFTTrainer(model, args, ...)``,
    ``DPOTrainer(model, ref_model, args, ...)``), so ``model``, ``args`` and ``optimizers``
    are found by name. A ``def __init__(self, *args, extra=None, **kwargs)`` pass-through says
    nothing, so the first ``__init__`` after the mixin that names an ``args`` parameter is used.
    """
    mro = type(trainer).__mro__
    for cls in mro[mro.index(_StrongholdTrainerMixin) + 1:]:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        try:
            sig = inspect.signature(init)
        except (TypeError, ValueError):
            continue
        param = sig.parameters.get("args")
        if param is None or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        accepted = kwargs
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            # Keywords this signature lacks belong to the subclasses in between (extra options).
            accepted = {k: v for k, v in kwargs.items() if k in sig.parameters}
        try:
            bound = sig.bind_partial(trainer, *pos, **accepted)
        except TypeError:
            break  # the call does not fit this signature; let the Trainer's own __init__ report it
        named = {}
        for name, value in bound.arguments.items():
            kind = sig.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            elif kind is not inspect.Parameter.VAR_POSITIONAL:
                named[name] = value
        return named
    return dict(kwargs)


def _with_low_precision_copies(cfg: StrongholdConfig, args: Any) -> StrongholdConfig:
    """Low-precision device copies halve PCIe traffic on CUDA, where autocast runs norms in
    fp32. CPU autocast does not (a bf16 LayerNorm weight next to an fp32 residual stream
    fails), so on CPU the copies stay in the model's dtype."""
    if cfg.param_dtype is None and args.device.type == "cuda" and (args.bf16 or args.fp16):
        return cfg.replace(param_dtype=torch.bfloat16 if args.bf16 else torch.float16)
    return cfg


def _carries_engine(model: Any) -> bool:
    """Whether ``model`` or a module inside it (a PEFT wrapper's base) has a STRONGHOLD engine."""
    if not isinstance(model, torch.nn.Module):
        return False
    return get_engine(model) is not None or any(get_engine(m) is not None for m in model.modules())



class _StrongholdTrainerMixin:
    """The stronghold behaviour, in front of any `transformers.Trainer` class.

    Where the settings come from: arguments built with the stronghold fields
    (`StrongholdTrainingArguments`, `StrongholdSeq2SeqTrainingArguments`, or a TRL config
    declared as ``@dataclass class C(StrongholdArgumentsMixin, SFTConfig)``) carry them, with
    the command line beating the environment. Any other arguments (plain `TrainingArguments`,
    ``SFTConfig``, ``DPOConfig``...) read the ``STRONGHOLD``, ``STRONGHOLD_WINDOW_SIZE`` and
    ``STRONGHOLD_CONFIG`` environment variables; unset means off. So
    ``class MySFTTrainer(StrongholdTrainer, SFTTrainer)`` with ``args=SFTConfig(...)`` trains
    with STRONGHOLD when the process runs with ``STRONGHOLD=1``.

    What it holds, with STRONGHOLD on: ``stronghold_engine`` (the `WindowEngine`),
    ``_stronghold_fit`` (`FitCheck`), ``_stronghold_log`` (`RunLog`) and
    ``_stronghold_auxiliary`` (`AuxiliaryModels`); ``_stronghold_config`` is the run's config
    once the fit check has settled its ``"auto"`` choices.
    """

    stronghold_engine: WindowEngine | None = None

    def __init__(self, *pos, **kwargs):
        named = _named_call_arguments(self, pos, kwargs)
        on, cfg = stronghold_settings(named.get("args"))
        self._stronghold_on = on
        self._stronghold_auxiliary = AuxiliaryModels()
        self._stronghold_fit: FitCheck | None = None
        if on:
            if named.get("model") is None:
                raise ValueError("STRONGHOLD needs a model instance; model_init (hyperparameter search) is not supported.")
            optimizers = named.get("optimizers") or (None, None)
            if (optimizers[0] is not None and not isinstance(optimizers[0], StrongholdOptimizer)) or named.get(
                "optimizer_cls_and_kwargs"
            ) is not None:
                raise ValueError(
                    "STRONGHOLD builds its own optimizer (CPU Adam for offloaded blocks); do not pass "
                    "optimizers=(...) or optimizer_cls_and_kwargs. Set learning_rate/weight_decay/adam_* in "
                    "the arguments instead."
                )
            # Set before the parent's __init__: TRL trainers prepare their reference and reward
            # models in there (see create_accelerator_and_postprocess).
            args = named.get("args")
            self._stronghold_config = cfg if args is None else _with_low_precision_copies(cfg, args)
        super().__init__(*pos, **kwargs)
        if on:
            args = self.args  # the Trainer's defaults when none were given
            cfg = _with_low_precision_copies(self._stronghold_config, args)
            self._stronghold_fit = FitCheck(self.model, args, cfg)
            if cfg.check_fit:
                cfg = self._stronghold_fit.at_start(self.train_dataset)  # may turn activation offload on
            self._stronghold_config = cfg
            engine = get_engine(self.model)
            self.stronghold_engine = engine if engine is not None else offload_model(self.model, cfg, device=args.device)
            # Whether the backward now running ends an accumulation window (then a step follows
            # and the engine may start CPU updates during it): the Trainer sets sync_gradients
            # for each micro-batch before its forward. accelerate's fp16 GradScaler unscales the
            # gradients in place before the step, which a speculative update cannot allow for.
            self.stronghold_engine.coordinator.step_signal = (
                lambda: self.accelerator.sync_gradients and self.accelerator.scaler is None)
            self._stronghold_log = RunLog(self.stronghold_engine)
            self._stronghold_log.announce()
            if getattr(args, "sync_ref_model", False) and self.stronghold_engine.dp is not None and \
                    self.stronghold_engine.dp.sharded:
                raise ValueError(
                    "sync_ref_model=True mixes the trained weights into the reference model between steps, but with "
                    "sharded CPU state (the default under data parallelism) each rank holds only a shard of them. "
                    "Set STRONGHOLD_CONFIG='{\"shard_cpu_state\": false}' (or StrongholdConfig(shard_cpu_state=False)), "
                    "or sync_ref_model=False."
                )

    def _move_model_to_device(self, model, device):
        if getattr(self, "_stronghold_on", False):
            return  # the engine places the model (also with plain TrainingArguments + STRONGHOLD=1)
        return super()._move_model_to_device(model, device)

    def training_step(self, model, inputs, *args, **kwargs):
        fit = getattr(self, "_stronghold_fit", None)
        if fit is not None and fit.pending:  # before this batch's forward allocates
            activations = self.stronghold_engine.schedule.activations
            if fit.on_first_batch(inputs):
                activations.offload = True
            if fit.activations_to_disk:
                activations.send_to_disk()
        return super().training_step(model, inputs, *args, **kwargs)

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
            def prepare_model_for_stronghold(model, device_placement=None, evaluation_mode=False):
                auxiliary = model in self._stronghold_auxiliary
                if not auxiliary and (model is getattr(self, "model", None) or _carries_engine(model)):
                    return prepare_model(model, device_placement=False, evaluation_mode=True)
                return self._stronghold_auxiliary.prepare(
                    model, prepare_model, device_placement, evaluation_mode,
                    config=self._stronghold_config, device=self.args.device)

            accelerator.prepare_model = prepare_model_for_stronghold
            prepare_data_loader = accelerator.prepare_data_loader

            # Placement is off in the accelerator only for the trained model's sake; batches still
            # go to the device, as without STRONGHOLD (TRL's DPO precomputes reference log-probs
            # from a prepared loader and feeds its batches straight to the reference model).
            def prepare_data_loader_on_device(data_loader, device_placement=None, **kw):
                return prepare_data_loader(data_loader, device_placement=True if device_placement is None
                                           else device_placement, **kw)

            accelerator.prepare_data_loader = prepare_data_loader_on_device

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

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        engine = self.stronghold_engine
        if (isinstance(self, Seq2SeqTrainer) and engine is not None and engine.dp is not None and engine.dp.sharded
                and engine.dp.world > 1):
            # Every block use all-gathers across ranks, so every rank must run as many decoder
            # steps as the longest generation: what synced_gpus does for ZeRO-3 and FSDP.
            gen_kwargs.setdefault("synced_gpus", True)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._stronghold_on and self.stronghold_engine is not None:
            self._stronghold_log.add_to(logs, self.state.global_step)
        return super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ training lifecycle
    def train(self, *args, **kwargs):
        try:
            result = super().train(*args, **kwargs)
        except BaseException:
            # The run's own error is the one to see: a cleanup that fails after it (a pass cut
            # off mid-backward leaves lanes in use) is logged, not raised over it.
            try:
                self._end_of_training()
            except Exception as cleanup_error:  # noqa: BLE001
                logger.error("stronghold: cleaning up after the failed run failed too: %r", cleanup_error)
            raise
        self._end_of_training()
        return result

    def _end_of_training(self) -> None:
        if self._stronghold_on and self.stronghold_engine is not None:
            # No engine thread outlives training, and the process group holds none of the
            # engine's tensors (lifecycle.py); later steps restart the threads on demand.
            # The engine stays open: the model is still offloaded and usable.
            self.stronghold_engine.shutdown_workers()
            if self.args.should_log:
                self._stronghold_log.finish(self.state.global_step)
        if self._stronghold_on and self.args.should_save:
            checkpoints.remove_staging(self._get_output_dir(trial=None))

    # ------------------------------------------------------------------ checkpoints (checkpoints.py)
    def _save_checkpoint(self, model, trial) -> None:
        if not self._stronghold_on:
            return super()._save_checkpoint(model, trial)
        self.stronghold_engine.synchronize()
        run_dir = super()._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        with checkpoints.staged_checkpoint(run_dir, name, writer=self.args.should_save,
                                           barrier=self.accelerator.wait_for_everyone) as staging_run:
            self._stronghold_output_dir_override = staging_run  # where _get_output_dir sends the Trainer
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._stronghold_output_dir_override = None
        if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(staging_run):
            self.state.best_model_checkpoint = self.state.best_model_checkpoint.replace(staging_run, run_dir, 1)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()  # no rank goes on before the checkpoint is in place

    def _get_output_dir(self, trial) -> str:
        override = getattr(self, "_stronghold_output_dir_override", None)
        return override if override else super()._get_output_dir(trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        engine = self.stronghold_engine
        if not self._stronghold_on or engine is None or engine.dp is None or not engine.dp.sharded:
            return super().save_model(output_dir, _internal_call)
        # Sharded CPU state: every rank contributes its shard of the weights (a collective),
        # rank 0 writes them.
        state_dict = engine.full_state_dict()
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self._stronghold_on:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.stronghold_engine.synchronize()
        if getattr(self, "_stronghold_output_dir_override", None) or not self.args.should_save:
            # Inside a checkpoint, whose whole folder is staged already; or a rank that writes nothing.
            return super()._save(output_dir, state_dict)
        with checkpoints.files_moved_into(output_dir) as staging:
            super()._save(staging, state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self.stronghold_engine
        if not self._stronghold_on or engine is None or engine.dp is None or not engine.dp.sharded:
            return super()._save_optimizer_and_scheduler(output_dir)
        checkpoints.save_optimizer_shard(output_dir, self.optimizer, self.lr_scheduler, engine.dp,
                                         writer=self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if not self._stronghold_on or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        checkpoints.load_optimizer_and_scheduler(checkpoint, self.optimizer, self.lr_scheduler,
                                                 self.stronghold_engine.dp)


class StrongholdTrainer(_StrongholdTrainerMixin, Trainer):
    """`transformers.Trainer`, plus STRONGHOLD working-window offloading with ``--stronghold``.

    With `StrongholdTrainingArguments` the ``--stronghold*`` fields decide (unset fields read
    the ``STRONGHOLD*`` environment variables); with any other arguments the environment
    alone does. That makes it a base for other Trainers too, for example TRL's::

        class MySFTTrainer(StrongholdTrainer, SFTTrainer):  # StrongholdTrainer first
            pass

        trainer = MySFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds)  # run with STRONGHOLD=1

    or declare the config with the flags: ``@dataclass class MySFTConfig(StrongholdArgumentsMixin,
    SFTConfig): pass`` (``from stronghold_hf import StrongholdArgumentsMixin``) and pass ``--stronghold``. Without STRONGHOLD on, it is the plain Trainer.
    """


class StrongholdSeq2SeqTrainer(_StrongholdTrainerMixin, Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` (``predict_with_generate``), plus ``--stronghold``."""
