"""`StrongholdTrainer` and `StrongholdSeq2SeqTrainer`: the HF Trainer with ``--stronghold``.

Without the flag both classes are their bases, untouched (every override starts with
``if not self._stronghold_on: return super()...``). With it:

* incompatible options (another optimizer, DeepSpeed, FSDP, ``torch_compile``) are refused
  before anything is built; the fit estimate runs on the sequence length actually trained
  (the arguments, else the dataset, else the first batch), then `offload_model` places the
  model (resident parts on ``args.device``, blocks in CPU RAM);
* accelerate is built with ``device_placement=False`` and prepares the model in
  *evaluation mode*: autocast is applied, but it neither moves the model nor wraps it in DDP
  (DDP would register every offloaded parameter; the engine all-reduces gradients itself,
  see ``distributed.py``);
* the optimizer is the engine's (CPU Adam + device AdamW) with Trainer's hyperparameters and
  decay/no-decay groups; clipping is the engine's exact global clip;
* checkpoints are written into a staging folder and renamed into place, so an interrupted
  save never leaves a ``checkpoint-N`` that resume would take for a good one; optimizer
  state is always loaded onto the CPU.

The behaviour lives in `_StrongholdTrainerMixin`, which goes in front of any Trainer class:
`StrongholdTrainer` and `StrongholdSeq2SeqTrainer` here, ``class MySFT(StrongholdTrainer,
SFTTrainer)`` in user code, and the classes ``python -m stronghold_hf`` builds on the fly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Seq2SeqTrainer, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..config import StrongholdConfig
from ..optim.hybrid import StrongholdOptimizer, remap_cpu_state
from ..window import WindowEngine, get_engine, offload_model
from .arguments import ENV_FLAG, config_for_training, refuse_incompatible_options, settings_from_env

logger = logging.getLogger("stronghold_hf")
_hf_logger = logging.getLogger("transformers.trainer")  # where Trainer logs its own "Saving ..." lines

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
_STAGING_DIR = ".stronghold-staging"

#: Argument fields that give the trained (encoder) sequence length, first match wins:
#: scripts' own ``max_seq_length``/``block_size``, TRL's ``max_length``, seq2seq ``max_source_length``.
_SEQ_LEN_FIELDS = ("max_seq_length", "max_length", "block_size", "max_source_length")
_DECODER_LEN_FIELDS = ("max_target_length", "generation_max_length")
#: How many leading examples of a map-style dataset the fit check reads for their length.
_PEEK_EXAMPLES = 32


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


def _positive_int_field(args: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@contextlib.contextmanager
def _rng_untouched():
    """Restores the host RNGs, so a dataset whose ``__getitem__`` draws randomness (random
    crops, masking) is read without shifting what the training run draws later."""
    py_state = random.getstate()
    np = sys.modules.get("numpy")  # only if the process uses it already
    np_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            if np_state is not None:
                np.random.set_state(np_state)


def _dataset_lengths(dataset: Any, encoder_decoder: bool) -> tuple[int | None, int | None]:
    """The longest ``input_ids`` (and, for encoder-decoder models, ``labels``) among the first
    examples of a map-style dataset; ``(None, None)`` when that cannot be read without
    iterating (an iterable dataset) or the examples carry no ``input_ids``."""
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return None, None
    try:
        count = min(len(dataset), _PEEK_EXAMPLES)
    except TypeError:  # no __len__: iterable in all but name
        return None, None
    seq = dec = 0
    with _rng_untouched():
        for i in range(count):
            example = dataset[i]
            ids = example.get("input_ids") if isinstance(example, Mapping) else None
            if ids is None:
                return None, None
            seq = max(seq, len(ids))
            labels = example.get("labels") if encoder_decoder else None
            if labels is not None and hasattr(labels, "__len__"):
                dec = max(dec, len(labels))
    return (seq or None), (dec or None)


def _trained_lengths(args: Any, dataset: Any, encoder_decoder: bool) -> tuple[int | None, int | None]:
    """``(sequence length, decoder length)`` the run trains with: from the arguments' length
    fields when set, else from the dataset's first examples, else ``(None, None)``."""
    seq = _positive_int_field(args, _SEQ_LEN_FIELDS)
    dec = _positive_int_field(args, _DECODER_LEN_FIELDS) if encoder_decoder else None
    if seq is None:
        seq, data_dec = _dataset_lengths(dataset, encoder_decoder)
        dec = dec or data_dec
    return seq, dec


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


def _is_auxiliary(trainer: Any, model: Any) -> bool:
    return any(model is m for m in trainer._stronghold_auxiliary)


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
    """

    stronghold_engine: WindowEngine | None = None
    _stronghold_auxiliary: list[torch.nn.Module]  # inference-only models given their own window

    def __init__(self, *pos, **kwargs):
        named = _named_call_arguments(self, pos, kwargs)
        on, cfg = stronghold_settings(named.get("args"))
        self._stronghold_on = on
        self._stronghold_auxiliary = []
        self._stronghold_pending_fit: tuple[int | None, int | None] | None = None
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
            # models in there (see _prepare_auxiliary_model).
            args = named.get("args")
            self._stronghold_config = cfg if args is None else _with_low_precision_copies(cfg, args)
        super().__init__(*pos, **kwargs)
        if on:
            args = self.args  # the Trainer's defaults when none were given
            cfg = self._stronghold_config = _with_low_precision_copies(self._stronghold_config, args)
            if cfg.check_fit:
                self._check_fits()  # may turn activation offload on (offload_activations="auto")
            cfg = self._stronghold_config
            engine = get_engine(self.model)
            self.stronghold_engine = engine if engine is not None else offload_model(self.model, cfg, device=args.device)
            # Whether the backward now running ends an accumulation window (then a step follows
            # and the engine may start CPU updates during it): the Trainer sets sync_gradients
            # for each micro-batch before its forward. accelerate's fp16 GradScaler unscales the
            # gradients in place before the step, which a speculative update cannot allow for.
            self.stronghold_engine.coordinator.step_signal = (
                lambda: self.accelerator.sync_gradients and self.accelerator.scaler is None)
            self._stronghold_log_t0 = time.perf_counter()
            self._stronghold_log_steps = 0
            self._log_stronghold_on()
            if getattr(args, "sync_ref_model", False) and self.stronghold_engine.dp is not None and \
                    self.stronghold_engine.dp.sharded:
                raise ValueError(
                    "sync_ref_model=True mixes the trained weights into the reference model between steps, but with "
                    "sharded CPU state (the default under data parallelism) each rank holds only a shard of them. "
                    "Set STRONGHOLD_CONFIG='{\"shard_cpu_state\": false}' (or StrongholdConfig(shard_cpu_state=False)), "
                    "or sync_ref_model=False."
                )

    def _log_stronghold_on(self) -> None:
        """One line at start, through transformers' logger so it shows at the Trainer's verbosity."""
        engine = self.stronghold_engine
        mem = engine.memory_stats()
        _hf_logger.info(
            f"STRONGHOLD is on: window_size={engine.window_size} of {engine.num_blocks} blocks, "
            f"{mem['offloaded_params'] / 1e6:.1f} M offloaded parameters ({mem['offloaded_trainable_params'] / 1e6:.1f} M "
            f"trainable), host_memory={engine.config.host_memory} ("
            f"{'8-bit' if engine.config.host_memory == 'lean' else 'fp32'} Adam moments), host {(mem['pinned_host_bytes'] + mem['pageable_host_bytes']) / 2**30:.2f} GiB before optimizer "
            f"state ({mem['pinned_host_bytes'] / 2**30:.2f} GiB pinned), CPU Adam threads={engine.worker.num_threads}, "
            f"device {engine.device}; device/host split: {engine.split.reason}"
        )

    def _move_model_to_device(self, model, device):
        if getattr(self, "_stronghold_on", False):
            return  # the engine places the model (also with plain TrainingArguments + STRONGHOLD=1)
        return super()._move_model_to_device(model, device)

    # ------------------------------------------------------------------ start-up checks
    def _estimate(self, **shape: Any):
        from ..estimate import estimate_for_model

        cfg = self._stronghold_config
        window = cfg.window_size
        return estimate_for_model(
            self.model,
            dtype="bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32",
            gradient_checkpointing=bool(self.args.gradient_checkpointing),
            window_size=None if window == "auto" else int(window),
            grad_buffers=cfg.grad_buffers, offload_non_block=cfg.offload_non_block, chunked_loss=cfg.chunked_loss,
            offload_activations=cfg.offload_activations, loss_chunk_tokens=cfg.loss_chunk_tokens,
            host_memory=cfg.host_memory, host_image=cfg.host_image, host_grads=cfg.host_grads,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps, resident=cfg.resident,
            resident_budget_bytes=cfg.gpu_memory, **_nvme_estimate_args(cfg), **shape,
        )

    def _adopt_activation_offload(self, est) -> None:
        """``offload_activations="auto"``: the fit check decides (on when only that makes it fit)."""
        if self._stronghold_config.offload_activations != "auto" or not est.offload_activations:
            return
        _hf_logger.info("STRONGHOLD: checkpointed activations go to host memory (they would not fit on the device)")
        if self.stronghold_engine is None:
            self._stronghold_config = self._stronghold_config.replace(offload_activations=True)
        else:
            self.stronghold_engine.schedule.activations.offload = True

    def _adopt_split(self, est) -> None:
        """``resident="auto"`` without ``gpu_memory``: the engine gets the budget the fit check
        found for the model once this run's activations are counted (the engine alone only
        knows a fixed reserve), or streams everything when only that fits."""
        cfg = self._stronghold_config
        if cfg.resident != "auto" or cfg.gpu_memory is not None or est.gpu_memory_bytes is None:
            return
        if est.resident_units and est.resident_budget_bytes:
            _hf_logger.info(f"STRONGHOLD: the device/host split fills {est.resident_budget_bytes / 2**30:.2f} GiB of "
                            f"the device, what this run's activations leave: {est.split}")
            self._stronghold_config = cfg.replace(gpu_memory=est.resident_budget_bytes)
        else:
            self._stronghold_config = cfg.replace(resident=False)

    def _check_fits(self) -> None:
        """Refuses a run that cannot fit, before the engine allocates anything.

        The activations are estimated at the sequence length actually trained, never at the
        model's ``max_position_embeddings`` (131072 on Llama 3, which would refuse runs that
        fit). When neither the arguments nor a map-style dataset tell it, the host side is
        checked now (it does not depend on the length) and the device side at the first
        batch, with the memory measured now, before the engine took its share.
        """
        seq_len, decoder_len = _trained_lengths(self.args, self.train_dataset, self._is_encoder_decoder())
        if seq_len is not None:
            est = self._estimate(seq_len=seq_len, decoder_seq_len=decoder_len,
                                 batch_size=self.args.per_device_train_batch_size)
            est.raise_if_not_fits()
            self._adopt_activation_offload(est)
            self._adopt_split(est)
            return
        est = self._estimate(seq_len=1, batch_size=1)
        dataclasses.replace(est, gpu_fits=None).raise_if_not_fits()
        self._stronghold_pending_fit = (est.gpu_memory_bytes, est.cpu_memory_bytes)

    def _check_fits_on_batch(self, inputs: Any) -> None:
        gpu_memory, cpu_memory = self._stronghold_pending_fit
        self._stronghold_pending_fit = None
        # Trainers that build their batch inside training_step (TRL's GRPO gets a list of raw
        # rows and generates first) give nothing to size it by here.
        tokens = None
        if isinstance(inputs, Mapping):
            tokens = inputs.get("input_ids")
            if tokens is None:
                tokens = inputs.get("inputs_embeds")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            logger.warning("STRONGHOLD fit check skipped: the training batch has no input_ids to size it by.")
            return
        decoder = inputs.get("labels") if self._is_encoder_decoder() else None
        est = self._estimate(
            seq_len=int(tokens.shape[1]), batch_size=int(tokens.shape[0]),
            decoder_seq_len=int(decoder.shape[-1]) if isinstance(decoder, torch.Tensor) and decoder.dim() >= 2 else None,
            gpu_memory_bytes=gpu_memory, cpu_memory_bytes=cpu_memory,
        )
        est.raise_if_not_fits()
        self._adopt_activation_offload(est)

    def _is_encoder_decoder(self) -> bool:
        return bool(getattr(getattr(self.model, "config", None), "is_encoder_decoder", False))

    def training_step(self, model, inputs, *args, **kwargs):
        if getattr(self, "_stronghold_pending_fit", None) is not None:
            self._check_fits_on_batch(inputs)  # before this batch's forward allocates anything
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
                auxiliary = _is_auxiliary(self, model)
                if not auxiliary and (model is getattr(self, "model", None) or _carries_engine(model)):
                    return prepare_model(model, device_placement=False, evaluation_mode=True)
                return self._prepare_auxiliary_model(model, prepare_model, device_placement, evaluation_mode)

            accelerator.prepare_model = prepare_model_for_stronghold
            prepare_data_loader = accelerator.prepare_data_loader

            # Placement is off in the accelerator only for the trained model's sake; batches still
            # go to the device, as without STRONGHOLD (TRL's DPO precomputes reference log-probs
            # from a prepared loader and feeds its batches straight to the reference model).
            def prepare_data_loader_on_device(data_loader, device_placement=None, **kw):
                return prepare_data_loader(data_loader, device_placement=True if device_placement is None
                                           else device_placement, **kw)

            accelerator.prepare_data_loader = prepare_data_loader_on_device

    def _prepare_auxiliary_model(self, model, prepare_model, device_placement, evaluation_mode):
        """A model the trainer runs next to the trained one: TRL's reference model (DPO, KTO,
        GRPO), a reward model, a distillation teacher.

        Prepared for inference only (``evaluation_mode=True``), it gets its own forward-only
        window, frozen, so it costs its stored bytes on the host and a window on the device,
        like the trained model: a full copy on the GPU would undo the point of offloading.
        Anything else, or a model without repeated blocks, is placed on the device the way the
        Trainer would without STRONGHOLD (the accelerator here has placement off)."""
        placement = True if device_placement is None else device_placement
        if not isinstance(model, torch.nn.Module) or not evaluation_mode:
            return prepare_model(model, device_placement=placement, evaluation_mode=evaluation_mode)
        if get_engine(model) is None:
            cfg = self._stronghold_config
            window = cfg.window_size if cfg.window_size != "auto" else 2  # no backward to probe with
            # Under resident="auto" a model the trainer runs next to the trained one streams: it is
            # prepared first, and the budget belongs to the model that trains.
            aux_cfg = cfg.replace(window_size=window, shard_cpu_state=False, check_fit=False,
                                  **({"resident": False} if cfg.resident == "auto" else {}))
            model.requires_grad_(False)  # never trained: no gradients, no masters beyond its dtype
            try:
                try:
                    offload_model(model, aux_cfg, device=self.args.device)
                except ValueError:
                    if aux_cfg.block_classes is None:
                        raise
                    # block_classes named the trained model's layers; this one may be another architecture
                    offload_model(model, aux_cfg.replace(block_classes=None), device=self.args.device)
            except ValueError as exc:  # nothing to window (no repeated blocks)
                _hf_logger.warning(f"STRONGHOLD: {type(model).__name__} (inference only) is placed on the device whole, "
                                   f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters: {exc}")
                return prepare_model(model, device_placement=placement, evaluation_mode=evaluation_mode)
            _hf_logger.info(f"STRONGHOLD: {type(model).__name__} (inference only) streams through its own window of "
                            f"{window} blocks")
            self._stronghold_auxiliary.append(model)
        return prepare_model(model, device_placement=False, evaluation_mode=True)

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
        if self._stronghold_on and "loss" in logs and self.stronghold_engine is not None:
            logs.update(self._stronghold_metrics())
        return super().log(logs, *args, **kwargs)

    def _stronghold_metrics(self) -> dict[str, float]:
        engine = self.stronghold_engine
        stats = engine.stats
        now = time.perf_counter()
        wall = max(now - self._stronghold_log_t0, 1e-9)
        steps = max(1, self.state.global_step - self._stronghold_log_steps)
        mem = engine.memory_stats()  # the ledger (and, on CUDA, the copy times measured by events)
        counters = stats.as_dict()
        out = {
            "stronghold_window_size": engine.window_size,
            "stronghold_h2d_GBps": round(counters["h2d_bytes"] / wall / 1e9, 3),
            "stronghold_d2h_GBps": round(counters["d2h_bytes"] / wall / 1e9, 3),
            "stronghold_blocked_ms": round(1e3 * counters["blocked_s"] / steps, 3),
            "stronghold_cpu_adam_ms": round(1e3 * counters["cpu_adam_s"] / steps, 3),
            "stronghold_forward_stall_ms": round(1e3 * counters["forward_stall_s"] / steps, 3),
            "stronghold_device_peak_MiB": round(mem["device_peak_bytes"] / 2**20, 3),
            "stronghold_pinned_host_GiB": round(mem["pinned_host_bytes"] / 2**30, 4),
            "stronghold_pageable_host_GiB": round(mem["pageable_host_bytes"] / 2**30, 4),
            "stronghold_host_bytes_per_param": round(mem["host_bytes_per_param"], 3),
            "stronghold_fetches": mem["fetches"],
            # Speculative updates during backward (speculation.py): how many blocks, how often the
            # guess missed since training began, the update time moved into backward and the
            # rollback time paid for misses, per step.
            "stronghold_speculated_blocks": round(counters["speculated_blocks"] / steps, 2),
            "stronghold_speculation_miss_rate": round(engine.coordinator.policy.miss_rate, 3),
            "stronghold_speculative_update_ms": round(1e3 * counters["speculative_update_s"] / steps, 3),
            "stronghold_rollback_ms": round(1e3 * counters["rollback_s"] / steps, 3),
            # Waits that blocked the training or autograd thread, per step (stats.py), and the
            # promises the first step found broken (promises.py; the warning names each).
            "stronghold_host_blocks": round(counters["host_blocks"] / steps, 2),
            "stronghold_promises_broken": mem["promises_broken"],
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
                # No engine thread outlives training, and the process group holds none of the
                # engine's tensors (lifecycle.py); later steps restart the threads on demand.
                # The engine stays open: the model is still offloaded and usable.
                self.stronghold_engine.shutdown_workers()
            if self._stronghold_on and self.args.should_save:
                # Each checkpoint empties its own staging folder; the root goes with training,
                # also when a save failed half-way (its partial folder is in there).
                shutil.rmtree(os.path.join(self._get_output_dir(trial=None), _STAGING_DIR), ignore_errors=True)

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial) -> None:
        if not self._stronghold_on:
            return super()._save_checkpoint(model, trial)
        self.stronghold_engine.synchronize()
        run_dir = super()._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        # One staging folder for every rank (each writes its RNG state and, with sharded CPU
        # state, its optimizer shard there); rank 0 moves it into place once all have written.
        staging_run = os.path.join(run_dir, _STAGING_DIR, name)
        if self.args.should_save:
            shutil.rmtree(staging_run, ignore_errors=True)  # left by a save that was interrupted
            os.makedirs(staging_run, exist_ok=True)
            _hf_logger.info(f"Saving model checkpoint to {final}")
        self.accelerator.wait_for_everyone()
        self._stronghold_output_dir_override = staging_run
        try:
            with _transformers_info_silenced():  # its lines would name the staging folder
                super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()
        except BaseException:
            if self.args.should_save:
                shutil.rmtree(staging_run, ignore_errors=True)
            raise
        finally:
            self._stronghold_output_dir_override = None
        written = os.path.join(staging_run, name)
        if self.args.should_save and os.path.isdir(written):
            self._fix_paths_after_staging(written, staging_run, run_dir)
            _atomic_replace_dir(written, final)
        if self.args.should_save:
            shutil.rmtree(staging_run, ignore_errors=True)
        if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(staging_run):
            self.state.best_model_checkpoint = self.state.best_model_checkpoint.replace(staging_run, run_dir, 1)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()  # no rank goes on before the checkpoint is in place

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        engine = self.stronghold_engine
        if not self._stronghold_on or engine is None or engine.dp is None or not engine.dp.sharded:
            return super().save_model(output_dir, _internal_call)
        # Sharded CPU state: every rank contributes its shard of the weights (a collective),
        # rank 0 writes them.
        state_dict = engine.full_state_dict()
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self.stronghold_engine
        if not self._stronghold_on or engine is None or engine.dp is None or not engine.dp.sharded:
            return super()._save_optimizer_and_scheduler(output_dir)
        # Each rank's CPU Adam state covers its own shard: one file per rank. Rank 0 may not have
        # created the folder yet (it writes the weights first): every rank makes sure it exists.
        dp = engine.dp
        os.makedirs(output_dir, exist_ok=True)
        torch.save(self.optimizer.state_dict(), os.path.join(output_dir, _optimizer_shard_name(dp.rank, dp.world)))
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

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
        sched_file = os.path.join(checkpoint, SCHEDULER_NAME)
        dp = self.stronghold_engine.dp
        sharded = dp is not None and dp.sharded
        own = os.path.join(checkpoint, _optimizer_shard_name(dp.rank, dp.world) if sharded else OPTIMIZER_NAME)
        shard_files = sorted(f for f in os.listdir(checkpoint) if f.startswith("optimizer-rank"))
        if not os.path.isfile(sched_file):
            return
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        if os.path.isfile(own) and (sharded or not shard_files):
            # CPU Adam state belongs in CPU RAM whatever the world size: map it there directly.
            state = torch.load(own, map_location="cpu", weights_only=True)
            if sharded and not inner.layout_matches(state):
                # Another device/host split: a parameter this rank now keeps whole on the device
                # may have been sharded across every rank's file.
                state = self._optimizer_state_for_this_layout(checkpoint, shard_files or [OPTIMIZER_NAME])
        elif shard_files or os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            state = self._optimizer_state_for_this_layout(checkpoint, shard_files or [OPTIMIZER_NAME])
        else:
            return
        self.optimizer.load_state_dict(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.lr_scheduler.load_state_dict(torch.load(sched_file, map_location="cpu", weights_only=True))

    def _optimizer_state_for_this_layout(self, checkpoint: str, files: list[str]) -> dict[str, Any]:
        """The checkpoint's optimizer state, re-cut for this run's data-parallel layout.

        A checkpoint written by W ranks with sharded CPU state holds W files, each with the
        Adam state of that rank's shard of every block and the map of what it covers
        (``cpu_pieces``). Resuming with another number of processes, or without sharding, takes
        from every file the elements this rank now keeps, one file at a time."""
        worlds = {f.rsplit("-of-", 1)[-1].split(".")[0] for f in files if f.startswith("optimizer-rank")}
        dp = self.stronghold_engine.dp
        layout = (f"{dp.world} process(es) with {'sharded' if dp.sharded else 'replicated'} CPU state"
                  if dp is not None else "one process")
        if len(worlds) > 1 or (worlds and len(files) != int(next(iter(worlds)))):
            raise ValueError(f"Checkpoint {checkpoint} holds an incomplete or mixed set of optimizer shards "
                             f"({files}); it cannot be resumed with {layout}.")
        paths = [os.path.join(checkpoint, f) for f in files]
        first = torch.load(paths[0], map_location="cpu", weights_only=True, mmap=True)  # memory-mapped: cheap
        if "cpu_pieces" not in first:
            raise ValueError(
                f"Checkpoint {checkpoint} holds CPU optimizer state for another data-parallel layout ({files[0]}) "
                f"and was written before checkpoints recorded what each shard covers; resume it with the layout "
                f"that wrote it, not {layout}, or start the optimizer afresh from its weights "
                "(--model_name_or_path <checkpoint>)."
            )
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        if "cpu_names" in first:  # state by parameter name ([Note: state by parameter name], optim/hybrid.py)
            del first

            def written():  # one file at a time, memory-mapped: a rank never holds them all
                for path in paths:
                    yield torch.load(path, map_location="cpu", weights_only=True, mmap=True)

            state = inner.recut(written())
            _hf_logger.info(f"STRONGHOLD: optimizer state of {checkpoint} ({len(files)} file(s)) re-cut for {layout} "
                            "and this device/host split")
            return state
        # Resident parameters, the loss scale and the public groups are the same on every rank.
        shared = {key: first[key] for key in ("device", "scaler", "param_groups")}
        del first
        mine = self.optimizer.state_dict()  # this layout's groups and pieces, with no state yet
        if mine["cpu"] is not None:
            def saved():
                # One file's CPU state at a time (memory-mapped): a rank never holds them all.
                for path in paths:
                    written = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                    if written["cpu"] is not None:  # a writer rank that kept no piece of any block
                        yield written["cpu_pieces"], written["cpu"]["state"]
                    del written

            shapes = [p.shape for g in inner.cpu_optimizer.param_groups for p in g["params"]]
            mine["cpu"]["state"] = remap_cpu_state(mine["cpu_pieces"], shapes, saved())
        mine.update(shared)
        _hf_logger.info(f"STRONGHOLD: optimizer state of {checkpoint} ({len(files)} file(s)) re-cut for {layout}")
        return mine

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self._stronghold_on:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.stronghold_engine.synchronize()
        if getattr(self, "_stronghold_output_dir_override", None) or not self.args.should_save:
            # Inside a checkpoint, whose whole folder is staged already; or a rank that writes nothing.
            return super()._save(output_dir, state_dict)
        os.makedirs(output_dir, exist_ok=True)
        _hf_logger.info(f"Saving model checkpoint to {output_dir}")
        # Write next to the destination, then move each file in with an atomic rename.
        staging = tempfile.mkdtemp(prefix=".stronghold-save-", dir=output_dir)
        try:
            with _transformers_info_silenced():
                super()._save(staging, state_dict)
            for entry in os.listdir(staging):
                os.replace(os.path.join(staging, entry), os.path.join(output_dir, entry))
        finally:
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _transformers_info_silenced():
    """Holds transformers' INFO lines back while it writes into a staging folder.

    Those lines ("Saving model checkpoint to ...", "Model weights saved in ...") would name
    the temporary folder; the Trainer logs the final path itself instead. Warnings still pass.
    """
    hf_root = logging.getLogger("transformers")
    level = hf_root.level
    if hf_root.getEffectiveLevel() <= logging.INFO:
        hf_root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        hf_root.setLevel(level)


def _optimizer_shard_name(rank: int, world: int) -> str:
    return f"optimizer-rank{rank}-of-{world}.pt"


def _atomic_replace_dir(src: str, dst: str) -> None:
    """Moves a finished directory into place; an existing ``dst`` is swapped out, then removed."""
    if os.path.exists(dst):
        old = f"{dst}.old-{os.getpid()}"
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def _nvme_estimate_args(cfg) -> dict[str, Any]:
    """With ``nvme_path`` the moments (and with ``nvme_masters`` the masters) are on disk: the fit
    check counts the ring, and the disk's free space."""
    if cfg.nvme_path is None:
        return dict(nvme=False, nvme_masters=False)
    import shutil

    probe = cfg.nvme_path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:  # created at the first step
        probe = os.path.dirname(probe)
    return dict(nvme=True, nvme_memory_bytes=shutil.disk_usage(probe).free, nvme_ring_buffers=cfg.nvme_ring_buffers,
                nvme_masters=cfg.nvme_masters)


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
