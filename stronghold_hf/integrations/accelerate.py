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

import collections
import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import StrongholdConfig
from ..window import WindowEngine, get_engine, offload_model
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
    model, engine = _offload_for_accelerate(accelerator, model, plugin, config)
    return model, _optimizer_for_accelerate(accelerator, engine, param_groups, optimizer_kwargs), engine


def _offload_for_accelerate(accelerator, model: torch.nn.Module, plugin: StrongholdPlugin | None = None,
                            config: StrongholdConfig | dict | str | None = None) -> tuple[torch.nn.Module, WindowEngine]:
    """`prepare_stronghold`'s model half: offloads ``model`` and prepares it with accelerate,
    without placement or DDP; the engine's optimizer comes from `_optimizer_for_accelerate`."""
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
    # Autocast and compile only: no placement (it would pull every block onto the device) and
    # no DDP (the engine averages gradients itself).
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    _route_clip_grad_norm(accelerator, engine)
    _settle_before_end_training(accelerator, engine)
    _save_and_load_state_through_the_engine(accelerator, model, engine)
    return model, engine


def _optimizer_for_accelerate(accelerator, engine: WindowEngine, param_groups: list | None,
                              optimizer_kwargs: dict[str, Any] | None):
    """`prepare_stronghold`'s optimizer half: the engine's, inside accelerate's wrapper."""
    optimizer = engine.build_optimizer(param_groups, **(optimizer_kwargs or {}))
    return accelerator.prepare_optimizer(optimizer, device_placement=False)


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


def _save_and_load_state_through_the_engine(accelerator, model: torch.nn.Module, engine: WindowEngine) -> None:
    """``accelerator.save_state``/``save_model``/``load_state`` of the offloaded model. Its
    parameters are views into their unit's host buffer: accelerate's safetensors cleaning keeps
    one name per shared storage (it saved one tensor per unit and dropped the rest, with a
    warning only), and safetensors' ``load_model`` refuses views that do not cover their
    storage. ``get_state_dict`` (which both saves read) gives whole values with storages of
    their own (gathered under sharded state: on every rank, as accelerate calls it); the load
    hook has the model's ``load_state_dict`` read the file."""
    original = accelerator.get_state_dict

    def get_state_dict(m, unwrap: bool = True):
        if m is model and not engine.closed:
            return _own_storages(engine.full_state_dict())
        return original(m, unwrap=unwrap)

    def load_hook(models, input_dir) -> None:
        for i, m in enumerate(models):
            if m is model and not engine.closed:
                models[i] = _LoadThrough(model)

    accelerator.get_state_dict = get_state_dict
    accelerator.register_load_state_pre_hook(load_hook)


def _own_storages(state: dict[str, torch.Tensor]) -> collections.OrderedDict:
    """``state`` with each tensor that is a view of a larger storage copied into one of its own;
    names that shared one tensor (tied weights) share its copy, as they shared the original. An
    ``OrderedDict``, as ``state_dict()`` returns: accelerate then drops a tied duplicate before
    safetensors sees it, as it does for a plain model."""
    copies: dict[tuple, torch.Tensor] = {}
    out = collections.OrderedDict()
    for name, t in state.items():
        if t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0:
            out[name] = t
            continue
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key not in copies:
            copies[key] = t.detach().clone()
        out[name] = copies[key]
    return out


class _LoadThrough(torch.nn.Module):
    """What safetensors' ``load_model`` loads an offloaded model through, in accelerate's
    ``load_state``: a ``state_dict`` with the model's names and its sharing (tied weights), each
    on a one-element tensor of its own (the model's own are views safetensors refuses, and under
    sharded state ``state_dict()`` is refused), and the model's ``load_state_dict``, which
    writes each value where the engine keeps it (state_dict.py: under sharded state, each rank
    its pieces of the full tensors)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "target", model)  # not a submodule: nothing of it is this module's

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        standins: dict[int, torch.Tensor] = {}  # by parameter (or buffer) object: no value is read
        out = {}
        for prefix, m in self.target.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            for name, t in m._parameters.items():
                if t is not None:
                    out[dot + name] = standins.setdefault(id(t), torch.zeros(1))
            for name, t in m._buffers.items():
                if t is not None and name not in m._non_persistent_buffers_set:
                    out[dot + name] = standins.setdefault(id(t), torch.zeros(1))
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.target.load_state_dict(state_dict, strict=strict)


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


# ---------------------------------------------------------------------------- unchanged loops
#: Models `patch_accelerate` has offloaded through ``Accelerator.prepare`` (the launcher reads it).
prepared_models = 0


@contextlib.contextmanager
def patch_accelerate() -> Iterator[None]:
    """While active, ``Accelerator.prepare`` offloads an unchanged ``no_trainer`` script's model
    (HF's ``run_clm_no_trainer.py``, under ``python -m stronghold_hf`` or ``accelerate launch -m
    stronghold_hf``) and trains it with STRONGHOLD. The script's AdamW gives the engine's
    optimizer its groups and settings, and a learning-rate scheduler built on it drives the
    engine's instead. The model and its optimizer may come in one call,
    ``prepare(model, optimizer, ...)``, or apart (``prepare(model)``, then ``prepare(optimizer)``,
    then the scheduler): a model not offloaded yet is offloaded when it comes, before accelerate
    could place it on the device, and the optimizer over its parameters is swapped when it
    comes. Other calls (a Trainer's own, whose model is offloaded already, dataloaders) are
    accelerate's."""
    from accelerate import Accelerator

    original = Accelerator.prepare
    swapped: list[tuple[torch.optim.Optimizer, torch.optim.Optimizer]] = []  # (script's optimizer, the engine's)
    awaiting: list[WindowEngine] = []  # engines of models prepared without their optimizer

    @functools.wraps(original)
    def prepare(self, *args, device_placement=None):
        models = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
        optimizers = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
        fresh = len(models) == 1 and get_engine(args[models[0]]) is None
        if fresh and len(optimizers) == 1:
            return _prepare_through_stronghold(self, original, args, models[0], optimizers[0], device_placement, swapped)
        if fresh and not optimizers:
            return _prepare_model_alone(self, original, args, models[0], device_placement, awaiting)
        theirs = [i for i in optimizers if _awaiting_engine(args[i], awaiting) is not None]
        if not models and len(theirs) == 1:
            return _prepare_optimizer_alone(self, original, args, theirs[0], device_placement, awaiting, swapped)
        _retarget_schedulers(args, swapped)
        return original(self, *args, device_placement=device_placement)

    Accelerator.prepare = prepare
    try:
        yield
    finally:
        Accelerator.prepare = original


def _prepare_the_rest(accelerator, original, args: tuple, out: list, done: set[int], device_placement) -> tuple:
    """``out`` with accelerate's own preparation of every argument not in ``done``; a tuple,
    or the one object when one argument was given, as ``Accelerator.prepare`` returns."""
    rest = [i for i in range(len(args)) if i not in done]
    if rest:
        prepared = original(accelerator, *[args[i] for i in rest], device_placement=device_placement)
        for i, p in zip(rest, prepared if len(rest) > 1 else (prepared,)):
            out[i] = p
    return tuple(out) if len(out) > 1 else out[0]


def _prepare_through_stronghold(accelerator, original, args: tuple, at_model: int, at_optimizer: int,
                                device_placement, swapped: list) -> Any:
    global prepared_models
    theirs = args[at_optimizer]
    model, optimizer, _ = prepare_stronghold(accelerator, args[at_model], param_groups=adamw_groups(theirs))
    _swap(theirs, optimizer.optimizer, args, swapped)  # the engine's, inside accelerate's AcceleratedOptimizer
    out = list(args)
    out[at_model], out[at_optimizer] = model, optimizer
    prepared_models += 1
    return _prepare_the_rest(accelerator, original, args, out, {at_model, at_optimizer}, device_placement)


def _prepare_model_alone(accelerator, original, args: tuple, at_model: int, device_placement,
                         awaiting: list) -> Any:
    """``prepare(model, ...)`` without its optimizer: the model is offloaded now (accelerate
    would place it on the device whole); its optimizer is swapped when it is prepared."""
    global prepared_models
    model, engine = _offload_for_accelerate(accelerator, args[at_model])
    awaiting.append(engine)
    out = list(args)
    out[at_model] = model
    prepared_models += 1
    return _prepare_the_rest(accelerator, original, args, out, {at_model}, device_placement)


def _awaiting_engine(optimizer: torch.optim.Optimizer, awaiting: list) -> WindowEngine | None:
    """The engine of a model prepared alone that ``optimizer`` (the script's) steps, if any."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return next((e for e in awaiting if not e.closed and any(e.is_offloaded(p) for p in params)), None)


def _prepare_optimizer_alone(accelerator, original, args: tuple, at_optimizer: int, device_placement,
                             awaiting: list, swapped: list) -> Any:
    """``prepare(optimizer, ...)`` after ``prepare(model)``: the engine's optimizer with the
    script's groups stands in for it."""
    theirs = args[at_optimizer]
    engine = _awaiting_engine(theirs, awaiting)
    optimizer = _optimizer_for_accelerate(accelerator, engine, adamw_groups(theirs), None)
    awaiting.remove(engine)
    _swap(theirs, optimizer.optimizer, args, swapped)
    out = list(args)
    out[at_optimizer] = optimizer
    return _prepare_the_rest(accelerator, original, args, out, {at_optimizer}, device_placement)


def _swap(theirs: torch.optim.Optimizer, mine: torch.optim.Optimizer, args: tuple, swapped: list) -> None:
    """The engine's optimizer ``mine`` stands in for the script's ``theirs``: schedulers built
    on it, in ``args`` or prepared later, drive ``mine``."""
    for group, their_group in zip(mine.param_groups, theirs.param_groups):
        if "initial_lr" in their_group:  # a scheduler built on theirs set it
            group["initial_lr"] = their_group["initial_lr"]
    swapped.append((theirs, mine))  # theirs kept alive: matched by identity, never by a reused id
    _retarget_schedulers(args, swapped)


def _retarget_schedulers(args: tuple, swapped: list) -> None:
    """Schedulers in ``args`` built on a script's optimizer that the engine's stands in for
    drive the engine's instead."""
    for a in args:
        if not isinstance(a, torch.optim.lr_scheduler.LRScheduler):
            continue
        mine = next((m for t, m in swapped if a.optimizer is t), None)
        if mine is not None:
            a.optimizer = mine  # it sets each group's lr by position: the groups correspond
            _mark_steps_for_schedulers(mine)


def _mark_steps_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """What a scheduler built on ``optimizer`` would have done to its ``step``: a wrapper that
    notes each call, so torch's check that ``optimizer.step()`` ran before ``scheduler.step()``
    sees ours and does not warn that the step was replaced."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def noted_step(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    noted_step._wrapped_by_lr_sched = True
    optimizer.step = noted_step


def adamw_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The groups of a script's ``torch.optim.AdamW`` (or ``Adam`` without weight decay) as the
    engine's optimizer takes them; any other optimizer is refused, naming the fix."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise ValueError(f"stronghold: the script prepares a {name} optimizer; STRONGHOLD steps the offloaded "
                         "parameters with AdamW (on the CPU). Use torch.optim.AdamW, or run with STRONGHOLD=0.")
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    groups = []
    for g in optimizer.param_groups:
        if g.get("amsgrad") or g.get("maximize"):
            raise ValueError(f"stronghold: {name}(amsgrad=True or maximize=True) is not what the engine's AdamW "
                             "computes. Drop those options, or run with STRONGHOLD=0.")
        if not (decoupled or g.get("decoupled_weight_decay")) and g["weight_decay"]:
            raise ValueError(f"stronghold: {name}(weight_decay={g['weight_decay']}) adds L2 decay to the gradient; "
                             "the engine's AdamW decays the weights (decoupled). Use torch.optim.AdamW, or run with "
                             "STRONGHOLD=0.")
        groups.append({"params": list(g["params"]), "lr": float(g["lr"]), "betas": tuple(float(b) for b in g["betas"]),
                       "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])})
    return groups
