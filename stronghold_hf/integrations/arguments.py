"""`StrongholdTrainingArguments`: the ``--stronghold`` flags on top of `TrainingArguments`.

The fields parse with `HfArgumentParser`, so any HF example script gets ``--stronghold``,
``--stronghold_window_size auto|N`` and ``--stronghold_config '{...}'|path.json``. Each
field falls back to its ``STRONGHOLD_*`` environment variable, so ``STRONGHOLD=1
accelerate launch script.py`` turns it on without touching the script. Everything is
validated in ``__post_init__``, before a model or an accelerator exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from transformers import Seq2SeqTrainingArguments, TrainingArguments

from ..config import StrongholdConfig, parse_window_size

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_flag(name: str, default: bool = False) -> bool:
    """Reads a boolean environment variable, refusing values that are neither true nor false."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"Environment variable {name}={raw!r} is not a boolean; use 1/0, true/false, yes/no.")


def _env_window_size() -> str | None:
    return os.environ.get("STRONGHOLD_WINDOW_SIZE") or None


def _env_config() -> str | None:
    return os.environ.get("STRONGHOLD_CONFIG") or None


def resolve_stronghold_config(config: Any, window_size: Any) -> StrongholdConfig:
    """One place that merges ``stronghold_config`` with an explicit ``stronghold_window_size``."""
    resolved = StrongholdConfig.from_any(config)
    if window_size is not None and window_size != "":
        resolved = resolved.replace(window_size=parse_window_size(window_size, field_name="stronghold_window_size"))
    return resolved


class _StrongholdArgsMixin:
    """Validation shared by the Trainer and Seq2SeqTrainer argument classes."""

    def _validate_stronghold(self) -> None:
        if not isinstance(self.stronghold, bool):
            raise TypeError(f"stronghold={self.stronghold!r} must be a bool (pass --stronghold to enable).")
        # Always validate, even with the flag off: a typo in the config should not wait for the
        # day someone turns the flag on.
        self._stronghold_resolved = resolve_stronghold_config(self.stronghold_config, self.stronghold_window_size)
        if isinstance(self.stronghold_window_size, int) and not isinstance(self.stronghold_window_size, bool):
            self.stronghold_window_size = str(self.stronghold_window_size)

    def _refuse_conflicting_backends(self) -> None:
        # Runs before TrainingArguments.__post_init__, which would already import DeepSpeed
        # or set up FSDP for a combination we refuse anyway.
        if not self.stronghold:
            return
        if self.deepspeed:
            raise ValueError(
                "--stronghold cannot be combined with --deepspeed: both own parameter placement and the "
                "optimizer step (DeepSpeed partitions and offloads parameters itself, STRONGHOLD streams "
                "blocks through a working window). Drop one of the two flags."
            )
        if self.fsdp:
            raise ValueError(
                "--stronghold cannot be combined with --fsdp: FSDP shards and gathers parameters itself, "
                "which conflicts with STRONGHOLD's working window. Use --stronghold alone (data parallel "
                "still works under accelerate launch/torchrun), or drop --stronghold."
            )

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


_FIELD_HELP = {
    "stronghold": "Train with STRONGHOLD working-window offloading and CPU Adam (env: STRONGHOLD=1).",
    "stronghold_window_size": "Blocks kept on the device: 'auto' or an int >= 1; overrides the config's "
    "window_size (env: STRONGHOLD_WINDOW_SIZE).",
    "stronghold_config": "StrongholdConfig as a dict, a JSON string or a path to a JSON file "
    "(env: STRONGHOLD_CONFIG).",
}


@dataclass
class StrongholdTrainingArguments(_StrongholdArgsMixin, TrainingArguments):
    """`TrainingArguments` plus ``--stronghold``, ``--stronghold_window_size`` and ``--stronghold_config``."""

    stronghold: bool = field(default_factory=lambda: env_flag("STRONGHOLD"), metadata={"help": _FIELD_HELP["stronghold"]})
    stronghold_window_size: str | None = field(
        default_factory=_env_window_size, metadata={"help": _FIELD_HELP["stronghold_window_size"]}
    )
    stronghold_config: dict | str | None = field(default_factory=_env_config, metadata={"help": _FIELD_HELP["stronghold_config"]})

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["stronghold_config"]

    def __post_init__(self) -> None:
        self._refuse_conflicting_backends()
        super().__post_init__()
        self._validate_stronghold()


@dataclass
class StrongholdSeq2SeqTrainingArguments(_StrongholdArgsMixin, Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` (``predict_with_generate`` and friends) plus the stronghold flags."""

    stronghold: bool = field(default_factory=lambda: env_flag("STRONGHOLD"), metadata={"help": _FIELD_HELP["stronghold"]})
    stronghold_window_size: str | None = field(
        default_factory=_env_window_size, metadata={"help": _FIELD_HELP["stronghold_window_size"]}
    )
    stronghold_config: dict | str | None = field(default_factory=_env_config, metadata={"help": _FIELD_HELP["stronghold_config"]})

    _VALID_DICT_FIELDS = Seq2SeqTrainingArguments._VALID_DICT_FIELDS + ["stronghold_config"]

    def __post_init__(self) -> None:
        self._refuse_conflicting_backends()
        super().__post_init__()
        self._validate_stronghold()
