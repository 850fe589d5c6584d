"""stronghold_hf: STRONGHOLD-style working-window offloading and CPU Adam for Hugging Face models.

Public names (see docs/ for the user guide and docs/design.md for how it works):

* ``offload_model(model, config)`` -> `WindowEngine`; ``get_engine(model)``; `StrongholdConfig`
* optimizers: `CPUAdam`, `StrongholdOptimizer`; `DynamicLossScaler`
* Trainer: `StrongholdTrainingArguments`, `StrongholdSeq2SeqTrainingArguments`,
  `StrongholdTrainer`, `StrongholdSeq2SeqTrainer`; `StrongholdArgumentsMixin` adds the
  ``--stronghold`` fields to other configs (``class C(StrongholdArgumentsMixin, SFTConfig)``)
* accelerate: `StrongholdPlugin`, ``prepare_stronghold(accelerator, model, ...)``
* will it fit: the `estimate` module (``estimate.estimate(config, ...)``, its CLI) and
  ``estimate_for_model(model, ...)``

Command lines: ``python -m stronghold_hf SCRIPT [ARGS...]`` runs an unchanged training script
with STRONGHOLD on for every ``transformers.Trainer`` it builds; ``python -m
stronghold_hf.estimate`` prints the memory estimate.

The Trainer and accelerate integrations import lazily (they are listed by ``dir()`` all the
same), so ``import stronghold_hf`` and the estimate CLI stay fast.
"""

from .config import StrongholdConfig
from .optim import CPUAdam
from .optim.hybrid import StrongholdOptimizer
from .scaler import DynamicLossScaler
from .window import WindowEngine, get_engine, offload_model

_LAZY = {
    "StrongholdTrainingArguments": ".integrations.arguments",
    "StrongholdSeq2SeqTrainingArguments": ".integrations.arguments",
    "StrongholdArgumentsMixin": ".integrations.arguments",
    "StrongholdTrainer": ".integrations.trainer",
    "StrongholdSeq2SeqTrainer": ".integrations.trainer",
    "StrongholdPlugin": ".integrations.accelerate",
    "prepare_stronghold": ".integrations.accelerate",
    # The submodule itself: the import system binds `stronghold_hf.estimate` to the module as
    # soon as anything imports it, so a function under that name would change with import order.
    "estimate": None,
    "estimate_for_model": ".estimate",
}

__all__ = [
    "StrongholdConfig",
    "offload_model",
    "get_engine",
    "WindowEngine",
    "CPUAdam",
    "StrongholdOptimizer",
    "DynamicLossScaler",
    *_LAZY,
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        if _LAZY[name] is None:
            return importlib.import_module(f".{name}", __name__)  # binds itself on the package
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stronghold_hf' has no attribute {name!r}")


def __dir__() -> list[str]:
    # Lists the lazy names before their first use, for dir(), help() and tab completion.
    return sorted(set(globals()) | set(__all__))
