"""The estimator's activations against what a training step really holds, measured from outside.

The estimator models the attention that runs (SDPA here: no ``s x s`` scores saved), one
layer's recompute and backward on top of what the layers keep, and the loss and a layer's
backward not holding memory at the same time (estimate/counts.py, budget.py). A child process
trains a two-layer model of each family at several sequence lengths, with and without
gradient checkpointing, on the CPU "device", where every activation is host memory: the
growth of its peak RSS from one length to the next must be what the estimate's activation
peak grows by, within 10%. Differences between lengths, so that what does not depend on the
length (the engine's buffers, the lanes' untouched pages, a position embedding's gradient)
drops out. The same holds with the blocks in query tiles (``attention_tiling``), where on the
CPU each tile materializes its causal mask (counts.lower_right_mask_bytes).
"""

from __future__ import annotations

import json

import pytest

from child_rss import activation_config, activation_peak_kib
from stronghold_hf.estimate import estimate

LENGTHS = (1024, 4096, 8192, 16384)


def _estimated_peak(family: str, seq: int, checkpointing: bool, tile: int | None = None) -> int:
    tiling = {} if tile is None else dict(attention_tiling=True, tile_tokens=tile, device="cpu")
    e = estimate(activation_config(family), seq_len=seq, batch_size=1, dtype="fp32", gpu_memory_bytes=2**40,
                 cpu_memory_bytes=2**40, gradient_checkpointing=checkpointing, resident=False,
                 auto_class="causal_lm", offload_activations=False, **tiling)
    assert e.attn_implementation == "sdpa" and e.tile_tokens == (tile if tile and tile < seq else None)
    return e.gpu_activation_peak_bytes


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])  # a second family: -m slow
@pytest.mark.parametrize("checkpointing", [pytest.param(False, marks=pytest.mark.slow), True])
def test_activation_peak_grows_as_measured_within_ten_percent(family, checkpointing):
    measured = {s: kib * 1024 for s, kib in activation_peak_kib(family, LENGTHS, checkpointing).items()}
    estimated = {s: _estimated_peak(family, s, checkpointing) for s in LENGTHS}
    base = LENGTHS[0]
    for s in LENGTHS[1:]:
        grew, predicted = measured[s] - measured[base], estimated[s] - estimated[base]
        assert grew > 0
        assert abs(predicted / grew - 1) <= 0.10, (family, checkpointing, s, grew / 2**20, predicted / 2**20)


TILED_LENGTHS = (2048, 8192, 16384)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tile"), [("llama", 1024), ("qwen2", 2048)])
def test_attention_tiled_peak_grows_as_measured_within_ten_percent(family, tile):
    """Query tiles of 1024 and 2048 tokens: the peak is a tile's causal mask (bool and additive
    while the tile runs forward, additive in its backward) beside the whole-length gradients,
    or the loss, whichever is larger; the estimate follows it."""
    config = json.dumps({"attention_tiling": True, "tile_tokens": tile})
    measured = {s: kib * 1024 for s, kib in activation_peak_kib(family, TILED_LENGTHS, True, config).items()}
    estimated = {s: _estimated_peak(family, s, True, tile) for s in TILED_LENGTHS}
    base = TILED_LENGTHS[0]
    for s in TILED_LENGTHS[1:]:
        grew, predicted = measured[s] - measured[base], estimated[s] - estimated[base]
        assert grew > 0
        assert abs(predicted / grew - 1) <= 0.10, (family, tile, s, grew / 2**20, predicted / 2**20)


def _saved_per_layer(family: str, dtype, seq: int) -> int:
    """Bytes autograd saves for one layer's backward (layer 0 of a two-layer model), by storage:
    parameters aside, and what layer 1 saves too (the model's rotary cos and sin) aside."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(activation_config(family)).to(dtype)
    model.train()
    # What runs under checkpointing. Without it a training forward builds a DynamicCache, whose K
    # and V copies change a fused-QKV layer's saved bytes by +-2 kv per token (docs/estimate.md).
    model.config.use_cache = False
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    saved: list[dict[int, int]] = [{}, {}]
    current: list[int | None] = [None]

    def pack(t):
        if current[0] is not None:
            saved[current[0]][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda *_: current.__setitem__(0, None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(0, 512, (1, seq)))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shared = saved[0].keys() & saved[1].keys()
    return sum(n for ptr, n in saved[0].items() if ptr not in weights and ptr not in shared)


@pytest.mark.parametrize(("family", "dtype"), [("llama", "fp32"), ("llama", "bf16"), ("qwen2", "bf16"), ("gpt2", "fp32")])
def test_a_layers_saved_bytes_are_what_autograd_saves(family, dtype):
    """The estimator's per-layer saved bytes (one layer more, all else equal) against the
    tensors autograd really keeps for a layer's backward, counted by storage with saved-tensor
    hooks: the RMS norms' fp32 copies, RoPE keeping nothing per layer, SDPA's output being the
    output projection's input."""
    import torch

    seq = 1024
    measured = _saved_per_layer(family, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], seq)

    def full(layers: int) -> int:
        fields = activation_config(family).to_dict()
        fields.pop("layer_types", None)  # per layer (Qwen2's sliding window): made again for the new count
        fields["n_layer" if family == "gpt2" else "num_hidden_layers"] = layers
        config = type(activation_config(family))(**fields)
        return estimate(config, seq_len=seq, batch_size=1, dtype=dtype, gpu_memory_bytes=2**40,
                        cpu_memory_bytes=2**40, resident=False, auto_class="causal_lm").block_activation_bytes_full

    estimated = full(3) - full(2)
    assert abs(estimated / measured - 1) <= 0.03, (family, dtype, measured / seq, estimated / seq)
