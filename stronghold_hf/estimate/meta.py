"""A model from a config, on the meta device: exact parameter counts, nothing allocated.

The estimator prices a model before anyone has the memory to build it: `load_config` reads a
model type or a local config with run_clm-style overrides, and `build_meta_model` builds it
under ``torch.device("meta")`` with the first Auto class that takes the config. It knows
nothing of bytes; api.py hands the model to the byte model.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

_AUTO_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "masked_lm": "AutoModelForMaskedLM",
    "seq2seq_lm": "AutoModelForSeq2SeqLM",
    "model": "AutoModel",
}


@contextlib.contextmanager
def _skip_init():
    # On meta, torch.nn.init calls still run (slowly, through the meta reference kernels):
    # about half the build time of a GPT-2 block. transformers' no_init_weights turns them
    # off; it also skips init_weights, whose only work on meta is tying, redone below.
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        yield
        return
    with no_init_weights():
        yield


def _auto_classes(config: Any, auto_class: Any) -> list[Any]:
    import transformers

    if auto_class is not None:
        if isinstance(auto_class, str):
            name = _AUTO_CLASSES.get(auto_class, auto_class)
            if not hasattr(transformers, name):
                raise ValueError(f"auto_class={auto_class!r} is unknown; use one of {sorted(_AUTO_CLASSES)} or a class.")
            return [getattr(transformers, name)]
        return [auto_class]
    order = ["causal_lm", "masked_lm", "seq2seq_lm", "model"]
    if getattr(config, "is_encoder_decoder", False):
        # BART/T5 also map to a CausalLM class that is the decoder alone; count both stacks.
        order.remove("seq2seq_lm")
        order.insert(0, "seq2seq_lm")
    return [getattr(transformers, _AUTO_CLASSES[k]) for k in order]


def build_meta_model(config: Any, auto_class: Any = None) -> nn.Module:
    """The model for ``config`` on the meta device (no memory), trying Auto classes in order."""
    errors = []
    for cls in _auto_classes(config, auto_class):
        try:
            with torch.device("meta"), _skip_init():
                model = cls.from_config(config)
        except ValueError as err:  # "Unrecognized configuration class ... for this kind of AutoModel"
            errors.append(f"{getattr(cls, '__name__', cls)}: {str(err).splitlines()[0]}")
            continue
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        return model
    raise ValueError(f"No Auto class builds {type(config).__name__}: " + "; ".join(errors))


def load_config(model_type: str | None = None, config_name: str | None = None, config_overrides: str | None = None) -> Any:
    """A config from a model type or a local config dir/json, with run_clm-style ``k=v,k=v`` overrides."""
    from transformers import AutoConfig

    if config_name:
        config = AutoConfig.from_pretrained(config_name)
        if config_overrides:
            config.update_from_string(config_overrides)
        return config
    if not model_type:
        raise ValueError("give a model_type (e.g. gpt2) or a config_name (a local config dir or json file)")
    # Overrides go to the constructor, so that what it derives follows them (T5's
    # num_decoder_layers defaults to num_layers); update_from_string parses the types.
    base = AutoConfig.for_model(model_type)
    if not config_overrides:
        return base
    probe = AutoConfig.for_model(model_type)
    probe.update_from_string(config_overrides)
    keys = [kv.split("=", 1)[0].strip() for kv in config_overrides.split(",") if kv.strip()]
    return AutoConfig.for_model(model_type, **{k: getattr(probe, k) for k in keys})
