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
