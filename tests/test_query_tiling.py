"""Attention tiling (``query_tiling.py``): each causal block runs whole in query tiles, against
the keys and values of the tokens before, through its own cache; on the CPU path.

Parity is against the same training with ``attention_tiling=False``, to fp32 rounding, with and
without checkpointing, with the mask the model builds (padding) and with none (the tiles then
get a lower-right causal one). Blocks that are not causal, or whose calls this cannot cut (T5's
position bias and cross-attention), run whole and say why. Then the config, the Trainer route,
``close()``, and the memory of a wide block, measured from outside.
"""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.query_tiling import QueryTiling, installed
from tiny_models import batch, engine_losses, logged_losses, plain_and_stronghold_trainers, tiny_model

LR = 1e-2
ADAM_SLACK = 0.02 * LR * 4  # test_trainer.py: Adam turns rounding noise of ~0 gradients into lr-sized steps
SEQ = 16


def _unpadded(family: str, seed: int) -> dict:
    b = batch(family, seed=seed, seq=SEQ)
    b["attention_mask"] = torch.ones_like(b["input_ids"])
    b["labels"] = b["input_ids"].clone()
    return b


def _train(model, family, *, padded: bool, steps: int = 2, **config):
    """Losses of ``steps`` steps with the engine's optimizer, and the tiled calls."""
    engine = offload_model(model, StrongholdConfig(window_size=1, **config), device="cpu")
    losses = engine_losses(model, engine, family, lr=LR, steps=steps, seq=SEQ,
                           batches=None if padded else (lambda step: _unpadded(family, step)))
    tiling = installed(model)
    calls, verdicts = (0, {}) if tiling is None else (tiling.calls, dict(tiling.verdicts))
    engine.close()
    return losses, calls, verdicts


CAUSAL = [("llama", False, False), ("llama", True, True), ("qwen2", True, False), ("mistral", False, True),
          ("gemma2", True, True), ("gpt2", False, True), ("gpt2", True, False)]


@pytest.mark.parametrize("family, checkpointing, padded", CAUSAL,
                         ids=[f"{f}-{'ckpt' if c else 'plain'}-{'padded' if p else 'unpadded'}" for f, c, p in CAUSAL])
def test_causal_blocks_in_query_tiles_match_them_whole(family, checkpointing, padded):
    base = tiny_model(family)
    if checkpointing:
        base.gradient_checkpointing_enable()
    reference = copy.deepcopy(base)
    want, calls, _ = _train(reference, family, padded=padded, attention_tiling=False)
    assert calls == 0
    for tiles in (3, 5):  # 5 does not divide 16
        model = copy.deepcopy(base)
        got, calls, verdicts = _train(model, family, padded=padded, attention_tiling=True, tile_tokens=tiles)
        blocks = len(verdicts)
        assert blocks == 3 and set(verdicts.values()) == {None}, verdicts  # every block proven causal
        # Each block's call in tiles, each step (and again in each recompute when checkpointed).
        assert calls == 2 * blocks * (2 if checkpointing else 1)
        assert got == pytest.approx(want, rel=1e-5), tiles
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=ADAM_SLACK,
                                       msg=lambda m: f"tile_tokens={tiles} {name}: {m}")


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_blocks_that_are_not_causal_or_cannot_be_cut_run_whole(family, caplog):
    base = tiny_model(family)
    want, _, _ = _train(copy.deepcopy(base), family, padded=True, attention_tiling=False)
    with caplog.at_level(logging.INFO, logger="stronghold_hf"):
        got, calls, verdicts = _train(copy.deepcopy(base), family, padded=True, attention_tiling=True, tile_tokens=4)
    assert calls == 0 and verdicts and all(isinstance(v, str) for v in verdicts.values())
    assert got == pytest.approx(want, rel=1e-6)
    said = [r.getMessage() for r in caplog.records if "attention tiling" in r.getMessage()]
    assert said and all("runs whole" in line for line in said)
    if family == "bert":  # bidirectional: its first tile would see the later tokens
        assert "not causal" in " ".join(said)
    else:  # T5: its first block returns its position bias too; the others take it, per token
        assert "position_bias" in " ".join(said) and "returned tuple" in " ".join(said)


def test_a_cache_the_model_passes_is_filled_as_without_tiling():
    """use_cache in training (the model makes a cache and fills it): the tiled blocks leave each
    layer's whole keys and values in it, and the loss and gradients are the untiled ones."""
    base = tiny_model("llama")
    ids = _unpadded("llama", 0)

    def run(model):
        out = model(input_ids=ids["input_ids"], labels=ids["labels"], use_cache=True)
        out.loss.backward()
        return out

    reference = copy.deepcopy(base)
    want = run(reference)
    model = copy.deepcopy(base)
    tiling = QueryTiling.install(model, 5)
    got = run(model)
    assert tiling.calls == 3 and set(tiling.verdicts.values()) == {None}
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-6)
    assert isinstance(got.past_key_values, DynamicCache) and got.past_key_values.get_seq_length() == SEQ
    for layer in range(3):
        for mine, theirs in zip(_kv(got.past_key_values, layer), _kv(want.past_key_values, layer)):
            torch.testing.assert_close(mine, theirs.detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _kv(cache, layer: int):
    entry = cache.layers[layer]
    return entry.keys, entry.values


class _CountsEvalCalls(nn.Module):
    """A block's MLP, wrapped: its eval-mode calls (the probes') counted in a number and a buffer."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.eval_calls = 0
        self.register_buffer("eval_calls_seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if not self.training:
            self.eval_calls += 1
            self.eval_calls_seen += 1
        return self.mlp(x)


def test_the_probes_leave_each_block_as_they_found_it():
    """Both probes run a block's modules in eval mode: what those calls change (a number, a
    buffer) is put back, and each submodule's own mode too (one the user put in eval stays)."""
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp = _CountsEvalCalls(layer.mlp)
        layer.self_attn.eval()
    _, calls, verdicts = _train(model, "llama", padded=False, steps=1, attention_tiling=True,
                                sequence_tiling=True, tile_tokens=4)
    assert calls > 0 and set(verdicts.values()) == {None}  # probed, and run in query tiles
    for layer in model.model.layers:
        assert layer.mlp.eval_calls == 0 and int(layer.mlp.eval_calls_seen) == 0
        assert layer.training and layer.mlp.training and not layer.self_attn.training


def test_config_validation_close_and_copies():
    with pytest.raises(ValueError, match="attention_tiling='yes'; use True"):
        StrongholdConfig(attention_tiling="yes")
    with pytest.raises(ValueError, match="tile_tokens=0"):
        QueryTiling(0)
    model = tiny_model("llama")
    plain_class = type(model.model.layers[0])
    engine = offload_model(model, StrongholdConfig(window_size=1, attention_tiling=True, tile_tokens=4), device="cpu")
    assert installed(model) is not None and type(model.model.layers[0]) is not plain_class
    assert type(model.model.layers[0]).__name__ == plain_class.__name__  # the same name in reprs and logs
    engine.close()
    assert installed(model) is None and type(model.model.layers[0]) is plain_class
    # Copies and pickles are of the plain class.
    tiling = QueryTiling.install(model, 4)
    assert installed(model) is tiling
    clone = copy.deepcopy(model)
    assert type(clone.model.layers[0]) is plain_class and installed(clone) is None
    assert type(pickle.loads(pickle.dumps(model)).model.layers[1]) is plain_class
    tiling.remove()
    tiling.remove()  # idempotent
    assert installed(model) is None and type(model.model.layers[2]) is plain_class


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {k: v[0] for k, v in _unpadded("llama", i).items()}


_ARGS = ["--per_device_train_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e-3", "--use_cpu",
         "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true",
         "--seed", "0", "--dataloader_num_workers", "0"]


def test_trainer_through_hf_argument_parser(tmp_path):
    args, plain, trainer, model = plain_and_stronghold_trainers(
        tmp_path, '{"attention_tiling": true, "tile_tokens": 6}', _ARGS, _Data())
    assert args.stronghold_config_resolved.attention_tiling is True
    plain_losses = logged_losses(plain)
    tiling = installed(model)
    assert tiling is not None and tiling.calls == 3 * 3, tiling.verdicts  # three blocks, three steps
    losses = logged_losses(trainer)
    assert len(losses) == 3 and losses == pytest.approx(plain_losses, rel=1e-4)


# ---------------------------------------------------------------------------------------------
# Memory, measured from outside
# ---------------------------------------------------------------------------------------------

S, HIDDEN, HEADS = 4096, 1024, 16

#: One forward and backward of a wide Llama layer at S tokens (fp32, GQA 4:1), its peak RSS
#: (VmHWM) reset to the resident memory first.
_CHILD = rf"""
import ctypes, json, sys
import torch
from transformers import LlamaConfig, LlamaModel
from stronghold_hf.query_tiling import QueryTiling

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=16, hidden_size={HIDDEN}, intermediate_size={HIDDEN}, num_hidden_layers=1,
                  num_attention_heads={HEADS}, num_key_value_heads={HEADS // 4}, max_position_embeddings={S})
model = LlamaModel(cfg)
if json.loads(sys.argv[1])["attention_tiling"]:
    QueryTiling.install(model, 512)


def step(n):
    x = torch.randn(1, n, {HIDDEN}, requires_grad=True)
    model(inputs_embeds=x).last_hidden_state.sum().backward()


def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


step(1024)  # lazy initialisation, outside the measurement
ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
before = kib("VmRSS")
step({S})
print(0, kib("VmHWM") - before)
"""


@pytest.mark.slow  # two children of a 1024-wide layer at 4096 tokens: about 25 s
def test_peak_rss_of_a_wide_block_in_query_tiles():
    from child_rss import peak_rss_growth

    _, growth = peak_rss_growth(_CHILD, ('{"attention_tiling": false}', '{"attention_tiling": true}'),
                                env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    whole, tiled = growth.values()
    # Whole, the layer keeps for backward its norms' outputs, Q, K, V and their rotated copies,
    # the attention output and the MLP's four tensors, then their gradients (about 76 KB a
    # token here, fp32, width 1024, the test's input and output included); in query tiles the
    # block's input, K, V and their gradients stay whole (about 43 KB a token, measured; 0.57x,
    # and 0.49x at 8192 tokens in tiles of 1024).
    print(f"peak RSS growth of one step of a {HIDDEN}-wide layer at {S} tokens: whole {whole / 2**20:.0f} MiB, "
          f"in query tiles {tiled / 2**20:.0f} MiB ({tiled / whole:.2f}x)")
    assert tiled <= 0.75 * whole, (whole, tiled)


def test_bf16_autocast_with_checkpointing_stays_within_bf16s_error():
    base = tiny_model("llama")
    base.gradient_checkpointing_enable()
    runs = {}
    for tiled in (False, True):
        model = copy.deepcopy(base)
        engine = offload_model(model, StrongholdConfig(window_size=1, attention_tiling=tiled, tile_tokens=5), device="cpu")
        runs[tiled] = engine_losses(model, engine, "llama", lr=LR, steps=2, seq=SEQ, bf16=True)
        if tiled:
            assert installed(model).calls == 2 * 3 * 2
        engine.close()
    assert runs[True] == pytest.approx(runs[False], rel=1e-2)


def test_the_estimator_counts_query_tiles_and_the_checkpoints_kept(capsys):
    """Llama-3-8B at 256k tokens on 24 GB (#42's first target): attention tiling and no
    checkpointed input kept at the turn each lower the GPU need, the second by exactly the
    inputs the turn no longer keeps; the CLI takes both."""
    import json

    import transformers

    from stronghold_hf.estimate import estimate, main

    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=1 << 20)
    config = transformers.AutoConfig.for_model("llama", **shape)
    seq = 256 * 1024

    def run(**kw):
        return estimate(config, seq_len=seq, batch_size=1, dtype="bf16", gpu_memory_bytes=24 << 30,
                        cpu_memory_bytes=192 << 30, gradient_checkpointing=True, host_memory="lean",
                        auto_class="causal_lm", window_size=2, offload_activations=True, **kw)

    plain, tiled, lean = run(), run(attention_tiling=True), run(attention_tiling=True, device_checkpoints=0)
    assert tiled.gpu_bytes_needed < 0.7 * plain.gpu_bytes_needed
    assert "K and V" in tiled.gpu_bounded_by and "Q, K, V" in plain.gpu_bounded_by
    one_input = seq * 4096 * 2  # a checkpointed input: bf16, hidden 4096
    assert tiled.gpu_activation_peak_bytes - lean.gpu_activation_peak_bytes == 2 * one_input  # the W = 2 at the turn
    assert lean.gpu_fits and not plain.gpu_fits
    # An encoder's blocks are not causal: the engine's probe leaves them whole, and so does the count.
    bert = transformers.BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024)
    whole, asked = (estimate(bert, seq_len=512, batch_size=1, gpu_memory_bytes=8 << 30, cpu_memory_bytes=64 << 30,
                             auto_class="masked_lm", tile_tokens=64, attention_tiling=on) for on in (False, True))
    assert asked.gpu_bytes_needed == whole.gpu_bytes_needed
    assert any("not causal" in note for note in asked.notes)
    main(["--model_type", "llama", "--config_overrides", ",".join(f"{k}={v}" for k, v in shape.items()),
          "--seq_len", str(seq), "--batch_size", "1", "--dtype", "bf16", "--gpu_memory", "24GB", "--cpu_memory",
          "192GB", "--gradient_checkpointing", "--host_memory", "lean", "--window_size", "2",
          "--attention_tiling", "true", "--device_checkpoints", "0"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["gpu_bytes_needed"] == lean.gpu_bytes_needed


def test_the_estimator_counts_the_causal_mask_where_torch_materializes_it():
    """A query tile's lower-right causal mask costs nothing where a kernel takes it as a flag
    (CUDA's flash attention in bf16) and ``tile x s`` bytes of a bool mask and its float copy
    where torch builds it (the CPU: the float copy is what SDPA saves for backward, checked here
    on the op itself), the float copy alone in the tile's backward."""
    import torch.nn.functional as F
    import transformers
    from torch.nn.attention.bias import causal_lower_right

    from stronghold_hf.estimate import estimate
    from stronghold_hf.estimate.counts import lower_right_mask_bytes

    t, s = 64, 256
    q = torch.randn(1, 2, t, 32, requires_grad=True)
    kv = [torch.randn(1, 1, s, 32, requires_grad=True) for _ in range(2)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        F.scaled_dot_product_attention(q, *kv, attn_mask=causal_lower_right(t, s), enable_gqa=True)
    assert any(x.shape == (t, s) and x.dtype == torch.float32 for x in saved)  # the CPU's mask, materialized

    assert lower_right_mask_bytes("cpu", 4, 2, 1, 32) == 5 and lower_right_mask_bytes("cpu", 2, 32, 8, 128) == 3
    assert lower_right_mask_bytes("cuda", 2, 32, 8, 128) == 0  # flash, grouped heads and all
    assert lower_right_mask_bytes("cuda", 4, 32, 32, 128) == 0  # memory-efficient, no grouped heads
    assert lower_right_mask_bytes("cuda", 4, 32, 8, 128) == 5 + 2 * 32 * 4  # the math kernel's scores too

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1 << 15)
    seq, tile = 16384, 1024

    def layer_peak(device):
        return estimate(config, seq_len=seq, batch_size=1, dtype="fp32", gpu_memory_bytes=1 << 40,
                        cpu_memory_bytes=1 << 40, gradient_checkpointing=True, auto_class="causal_lm",
                        attention_tiling=True, tile_tokens=tile, device=device).gpu_layer_peak_bytes

    # fp32 with grouped heads on CUDA is the math kernel's too: compare the CPU with the same
    # model whose heads are not grouped on CUDA (no mask).
    assert layer_peak("cpu") - layer_peak("cuda") == tile * seq * (5 - (5 + 2 * 2 * 4))
    ungrouped = transformers.LlamaConfig(**{**config.to_diff_dict(), "num_key_value_heads": 2})
    cpu, cuda = (estimate(ungrouped, seq_len=seq, batch_size=1, dtype="fp32", gpu_memory_bytes=1 << 40,
                          cpu_memory_bytes=1 << 40, gradient_checkpointing=True, auto_class="causal_lm",
                          attention_tiling=True, tile_tokens=tile, device=d).gpu_layer_peak_bytes for d in ("cpu", "cuda"))
    # Forward, a tile holds the bool mask and its float copy (5 B a pair); its backward only the
    # float copy, beside the whole-length gradients: here the backward is the larger.
    assert cpu - cuda == tile * seq * 4
    from stronghold_hf.estimate import main

    with pytest.raises(SystemExit):  # the CLI names the choices
        main(["--model_type", "llama", "--seq_len", "64", "--batch_size", "1", "--gpu_memory", "8GB",
              "--cpu_memory", "8GB", "--device", "tpu"])
    with pytest.raises(ValueError, match="device='tpu'"):
        estimate(config, seq_len=seq, batch_size=1, gpu_memory_bytes=1 << 40, cpu_memory_bytes=1 << 40,
                 auto_class="causal_lm", device="tpu")


def test_the_tiles_join_the_key_prefix_in_place_with_cats_gradients():
    """A tile attends to a view of the whole-length key and value buffers, not to a copy of the
    prefix; the join's gradients are ``torch.cat``'s, split between the prefix and the tile."""
    from stronghold_hf.query_tiling import _TileCache

    keys, values = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
    new_k, new_v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    with torch.no_grad():  # the forward's pass: a view of the buffers, the tile written into them
        k, v = _TileCache(keys, values, 4, 10).update(new_k, new_v)
    assert k.data_ptr() == keys.data_ptr() and k.shape[-2] == 7 and torch.equal(keys[..., 4:7, :], new_k)
    # With grad (the backward's pass): the prefix as a leaf over the buffer, the tile's own keys
    # from the graph; the same gradients as a cat, and still no copy.
    prefix = keys[..., :4, :].detach().requires_grad_()
    own = new_k.clone().requires_grad_()
    joined, _ = _TileCache(keys, values, 4, 10, prefix, values[..., :4, :].detach().requires_grad_()).update(
        own, new_v.clone().requires_grad_())
    assert joined.data_ptr() == keys.data_ptr()
    weight = torch.randn(1, 2, 7, 4)
    (joined * weight).sum().backward()
    ref_prefix, ref_own = prefix.detach().clone().requires_grad_(), new_k.clone().requires_grad_()
    (torch.cat([ref_prefix, ref_own], dim=-2) * weight).sum().backward()
    assert torch.equal(prefix.grad, ref_prefix.grad) and torch.equal(own.grad, ref_own.grad)
    # The first tile (nothing before it), with grad: its own keys, as the attention made them.
    first, _ = _TileCache(None, None, 0, 10).update(own, new_v)
    assert first is own


def test_a_retained_graph_runs_its_backward_twice_as_untiled():
    """``backward(retain_graph=True)`` then ``backward()`` through query-tiled blocks: the tiles'
    in-place joins leave the saved keys and values reading as unmodified, and the gradients
    (twice the step's) are the untiled engine's."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (1, 16))
    grads = {}
    for tiled in (False, True):
        model = transformers.LlamaForCausalLM(cfg)
        model.load_state_dict(base.state_dict())
        engine = offload_model(model, StrongholdConfig(window_size=1, attention_tiling=tiled, tile_tokens=4), device="cpu")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(retain_graph=True)
        loss.backward()
        engine.synchronize()
        grads[tiled] = {n: p.grad.clone() for n, p in model.named_parameters()}
        engine.close()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
