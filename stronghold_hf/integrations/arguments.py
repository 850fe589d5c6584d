"""`StrongholdTrainingArguments`: the ``--stronghold`` flags on top of `TrainingArguments`.

The fields parse with `HfArgumentParser`, so any HF example script gets ``--stronghold``,
``--stronghold_window_size auto|N`` and ``--stronghold_config '{...}'|path.json``. Each field
left unset falls back to its ``STRONGHOLD_*`` environment variable, so ``STRONGHOLD=1
accelerate launch script.py`` turns it on without touching the script, and a flag given on
the command line always beats the environment.

[Note: why the fields default to None] `HfArgumentParser` gives a ``bool`` field an argparse
default of its own (``False``), so a ``default_factory`` that reads the environment is never
called from the command line and ``STRONGHOLD=1`` would silently do nothing. The fields
therefore default to ``None`` ("not given") and ``__post_init__`` resolves ``None`` from the
environment, which works the same from the command line and from Python.

Environment rules (one reader for the Trainer, the accelerate plugin and the launcher):

* ``STRONGHOLD``: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``, any case,
  surrounding spaces ignored; anything else is a ``ValueError`` naming the variable.
* ``STRONGHOLD_WINDOW_SIZE``: ``auto`` or an int >= 1.
* ``STRONGHOLD_CONFIG``: a JSON object or the path of a JSON file (`StrongholdConfig` keys).
* A variable that is unset or empty (``STRONGHOLD=``) counts as not given.

Everything is validated in ``__post_init__``, before a model or an accelerator exists.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import Seq2SeqTrainingArguments, TrainingArguments

from ..config import StrongholdConfig, parse_window_size

ENV_FLAG = "STRONGHOLD"
ENV_WINDOW_SIZE = "STRONGHOLD_WINDOW_SIZE"
ENV_CONFIG = "STRONGHOLD_CONFIG"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

#: ``--optim`` values with AdamW semantics. The engine always steps with its own AdamW (CPU
#: Adam for offloaded units), so anything else would be silently replaced. The 8-bit names
#: select lean host memory: the same AdamW with blockwise 8-bit moments.
EXACT_OPTIMS = ("adamw_torch", "adamw_torch_fused")
LEAN_OPTIMS = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_torch_8bit")
SUPPORTED_OPTIMS = EXACT_OPTIMS + LEAN_OPTIMS


def _optim_name(args: Any) -> str | None:
    optim = getattr(args, "optim", None)
    return str(getattr(optim, "value", optim)) if optim is not None else None


def config_for_training(config: StrongholdConfig, args: Any) -> StrongholdConfig:
    """``config`` as the training arguments ``args`` ask: ``host_memory="lean"`` when
    ``--optim`` names an 8-bit AdamW, and ``host_grads="auto"`` resolved to ``"fp32"`` when
    ``gradient_accumulation_steps`` is above 1 (bf16 host gradients would widen at the first
    accumulation anyway; fp32 from the start skips that), ``"compute"`` otherwise."""
    changes: dict[str, Any] = {}
    if _optim_name(args) in LEAN_OPTIMS and config.host_memory != "lean":
        changes["host_memory"] = "lean"
    if config.host_grads == "auto":
        steps = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        changes["host_grads"] = "fp32" if steps > 1 else "compute"
    return config.replace(**changes) if changes else config


def _env_value(name: str) -> str | None:
    raw = os.environ.get(name)
    return raw.strip() if raw is not None and raw.strip() else None


def env_flag(name: str = ENV_FLAG) -> bool | None:
    """Reads a boolean environment variable: ``None`` when unset or empty, else True/False.

    Refuses anything that is neither true (1/true/yes/on) nor false (0/false/no/off).
    """
    value = _env_value(name)
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(
        f"Environment variable {name}={os.environ[name]!r} is not a boolean; use one of "
        f"{'/'.join(sorted(_TRUE))} to turn it on or {'/'.join(sorted(_FALSE))} to turn it off "
        "(any case), or leave it unset."
    )


def env_window_size() -> str | None:
    """``STRONGHOLD_WINDOW_SIZE`` as given (``"auto"`` or digits), validated; ``None`` when unset."""
    value = _env_value(ENV_WINDOW_SIZE)
    if value is not None:
        try:
            parse_window_size(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"Environment variable {ENV_WINDOW_SIZE}={os.environ[ENV_WINDOW_SIZE]!r} is not a valid window_size; "
                "use \"auto\" or an int >= 1 (the number of blocks kept on the device), or leave it unset."
            ) from None
    return value


def env_config() -> str | None:
    """``STRONGHOLD_CONFIG`` (a JSON object or a JSON file path), validated; ``None`` when unset."""
    value = _env_value(ENV_CONFIG)
    if value is not None:
        try:
            StrongholdConfig.from_any(value)
        except (TypeError, ValueError) as err:
            raise type(err)(f"Environment variable {ENV_CONFIG}: {err}") from None
    return value


def _check_json_object(value: Any) -> None:
    """Refuses ``--stronghold_config '{...}'`` that is not valid JSON, naming the option
    (TrainingArguments parses it into a dict next, and would raise a bare JSONDecodeError)."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"--stronghold_config is not valid JSON ({err}): {value!r}. Pass a JSON object, "
                             "for example '{\"window_size\": 2}', or the path of a JSON file.") from None


def resolve_stronghold_config(config: Any, window_size: Any) -> StrongholdConfig:
    """One place that merges ``stronghold_config`` with an explicit ``stronghold_window_size``."""
    resolved = StrongholdConfig.from_any(config)
    if window_size is not None and window_size != "":
        resolved = resolved.replace(window_size=parse_window_size(window_size, field_name="stronghold_window_size"))
    return resolved


def settings_from_env() -> tuple[bool, StrongholdConfig]:
    """``(on, config)`` from the ``STRONGHOLD_*`` variables alone (plain `TrainingArguments`, TRL configs)."""
    return bool(env_flag()), resolve_stronghold_config(env_config(), env_window_size())


def refuse_incompatible_options(args: Any, *, flag: str) -> None:
    """Refuses training options that STRONGHOLD replaces or cannot run under, naming the fix.

    ``flag`` names how STRONGHOLD was turned on (``--stronghold`` or ``STRONGHOLD=1``). Reads
    only raw fields, so it works before and after ``TrainingArguments.__post_init__``.
    """
    if getattr(args, "deepspeed", None):
        raise ValueError(
            f"{flag} cannot be combined with --deepspeed: both own parameter placement and the "
            "optimizer step (DeepSpeed partitions and offloads parameters itself, STRONGHOLD streams "
            "blocks through a working window). Drop one of the two."
        )
    if getattr(args, "fsdp", None):
        raise ValueError(
            f"{flag} cannot be combined with --fsdp: FSDP shards and gathers parameters itself, "
            "which conflicts with STRONGHOLD's working window. Use STRONGHOLD alone (data parallel "
            "still works under accelerate launch/torchrun), or drop it."
        )
    optim = _optim_name(args)
    if optim is not None and optim not in SUPPORTED_OPTIMS:
        raise ValueError(
            f"{flag} trains with its own AdamW (CPU Adam for the offloaded units); --optim {optim} is not "
            f"supported. Use --optim {', '.join(EXACT_OPTIMS)} (fp32 moments) or {', '.join(LEAN_OPTIMS)} (8-bit "
            "moments, host_memory=\"lean\"); learning_rate, weight_decay and adam_beta1/adam_beta2/adam_epsilon are "
            f"honoured. Or drop {flag} to train with {optim}."
        )
    if getattr(args, "torch_compile", False) or getattr(args, "torch_compile_backend", None) or getattr(
        args, "torch_compile_mode", None
    ):
        raise ValueError(
            f"{flag} cannot be combined with --torch_compile: offloaded block parameters give their "
            "storage back after each use and get it refilled before the next (every step), which "
            "invalidates what torch.compile captured and can crash the process. Drop --torch_compile "
            "(and --torch_compile_backend/--torch_compile_mode)."
        )


_FIELD_HELP = {
    "stronghold": "Train with STRONGHOLD working-window offloading and CPU Adam. `--stronghold` alone or "
    "`--stronghold true` turns it on, `--stronghold false` off; when not given, the environment variable "
    "STRONGHOLD (1/true/yes/on or 0/false/no/off) decides, and it is off when that is unset.",
    "stronghold_window_size": "Blocks kept on the device: 'auto' or an int >= 1; overrides the config's "
    "window_size (env: STRONGHOLD_WINDOW_SIZE).",
    "stronghold_config": "StrongholdConfig as a dict, a JSON string or a path to a JSON file "
    "(env: STRONGHOLD_CONFIG).",
}


@dataclass
class StrongholdArgumentsMixin:
    """The three stronghold fields and their validation, for any `TrainingArguments` subclass.

    ``@dataclass class MyConfig(StrongholdArgumentsMixin, SFTConfig): pass`` gives a TRL
    config the same ``--stronghold`` flags (the mixin must come first).
    """

    # nargs/const make a bare ``--stronghold`` mean True, as for HF's own bool flags, which
    # HfArgumentParser only sets up by itself for a bool field with a non-None default.
    stronghold: bool | None = field(
        default=None, metadata={"help": _FIELD_HELP["stronghold"], "nargs": "?", "const": True}
    )
    stronghold_window_size: str | None = field(default=None, metadata={"help": _FIELD_HELP["stronghold_window_size"]})
    stronghold_config: dict | str | None = field(default=None, metadata={"help": _FIELD_HELP["stronghold_config"]})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # TrainingArguments parses the JSON strings of these fields into dicts in __post_init__.
        valid = getattr(cls, "_VALID_DICT_FIELDS", None)
        if valid is not None and "stronghold_config" not in valid:
            cls._VALID_DICT_FIELDS = [*valid, "stronghold_config"]

    def __post_init__(self) -> None:
        self._fill_stronghold_from_environment()
        if self.stronghold:
            # Before TrainingArguments.__post_init__, which would already import DeepSpeed or set
            # up FSDP for a combination refused anyway.
            refuse_incompatible_options(self, flag="--stronghold")
        _check_json_object(self.stronghold_config)
        super().__post_init__()  # type: ignore[misc]
        # Always validate, even with the flag off: a typo in the config should not wait for the
        # day someone turns the flag on.
        self._stronghold_resolved = config_for_training(
            resolve_stronghold_config(self.stronghold_config, self.stronghold_window_size), self)

    def _fill_stronghold_from_environment(self) -> None:
        if self.stronghold is None:
            self.stronghold = bool(env_flag())
        elif not isinstance(self.stronghold, bool):
            raise TypeError(f"stronghold={self.stronghold!r} must be a bool (pass --stronghold to enable).")
        if self.stronghold_window_size is None:
            self.stronghold_window_size = env_window_size()
        elif isinstance(self.stronghold_window_size, int) and not isinstance(self.stronghold_window_size, bool):
            self.stronghold_window_size = str(self.stronghold_window_size)
        if self.stronghold_config is None:
            self.stronghold_config = env_config()

    @property
    def stronghold_config_resolved(self) -> StrongholdConfig:
        """The validated `StrongholdConfig` these arguments describe."""
        return self._stronghold_resolved

    @property
    def place_model_on_device(self) -> bool:  # type: ignore[override]
        # The engine places the model itself: resident parts on the device, blocks in CPU RAM.
        if self.stronghold:
            return False
        return super().place_model_on_device  # type: ignore[misc]


@dataclass
class StrongholdTrainingArguments(StrongholdArgumentsMixin, TrainingArguments):
    """`TrainingArguments` plus ``--stronghold``, ``--stronghold_window_size`` and ``--stronghold_config``."""


@dataclass
class StrongholdSeq2SeqTrainingArguments(StrongholdArgumentsMixin, Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` (``predict_with_generate`` and friends) plus the stronghold flags."""
