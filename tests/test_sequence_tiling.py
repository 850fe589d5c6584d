"""Sequence tiling (``tiling.py``) against the untiled model, on the CPU path.

The per-token submodules of each block (the MLP, norms that save a normalised copy) run in
tiles of ``tile_tokens`` tokens in forward and backward. Parity is against the same training
with ``sequence_tiling=False``: to fp32 rounding in fp32; in bf16, tiling adds no error beyond
bf16's own (each tile's weight gradient is rounded to bf16 before the fp32 sum, and a last-bit
difference flips later bf16 roundings, so bit-level parity is not a bf16 property). The tiny
models have dropout off (tiny_models.py): with dropout a tile draws its own mask, as the docs
say. Then the probe (what it tiles, what it refuses and why), the ``"auto"`` rules, ``close()``,
the Trainer and launcher routes, and the memory, measured from outside.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf import tiling
from stronghold_hf.tiled_function import tiled_forward
from stronghold_hf.tiling import SequenceTiling, probe, resolve_tile_tokens, tiled_modules
from live_casts import LiveCasts
from tiny_models import batch, engine_losses, logged_losses, plain_and_stronghold_trainers, tiny_config, tiny_model

FAMILIES = ["llama", "qwen2", "mistral", "gemma2", "gpt2", "bert", "t5"]
SEQ = 16  # T5's decoder gets 8 tokens (tiny_models.batch): enough for the probe
LR = 1e-2
ADAM_SLACK = 0.02 * LR * 4  # test_trainer.py: Adam turns rounding noise of ~0 gradients into lr-sized steps
_SITE = "_stronghold_tile_site"

#: What the probe tiles in each family's blocks, by class: MLPs (T5's whole feed-forward layer,
#: BERT's intermediate, the rest of BERT's MLP takes two tensors) and the norms written in
#: torch, which save a normalised copy. LayerNorm kernels, bare projections and attention: never.
TILED_CLASSES = {
    "llama": {"LlamaRMSNorm", "LlamaMLP"},
    "qwen2": {"Qwen2RMSNorm", "Qwen2MLP"},
    "mistral": {"MistralRMSNorm", "MistralMLP"},
    "gemma2": {"Gemma2RMSNorm", "Gemma2MLP"},
    "gpt2": {"GPT2MLP"},
    "bert": {"BertIntermediate"},
    "t5": {"T5LayerNorm", "T5LayerFF"},
}


def _model(family: str, checkpointing: bool = False) -> nn.Module:
    model = tiny_model(family)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _autocast(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _train(model, family, *, steps=2, bf16=False, seq=SEQ, **config):
    """Losses of ``steps`` steps with the engine's optimizer, and the tiled modules' counts of
    tiled calls (read before ``close``, which gives the model back)."""
    engine = offload_model(model, StrongholdConfig(window_size=1, **config), device="cpu")
    losses = engine_losses(model, engine, family, lr=LR, steps=steps, seq=seq, bf16=bf16)
    calls = {name: site.calls for name, site in tiled_modules(model).items()}
    engine.close()
    return losses, calls


# ---------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------


#: Every family with and without checkpointing; the quick run takes one setting each (both for
#: Llama), the rest is marked slow.
_QUICK = {("llama", False), ("llama", True), ("qwen2", True), ("mistral", False), ("gemma2", True), ("gpt2", False),
          ("bert", True), ("t5", True)}
_PARITY = [pytest.param(f, c, id=f"{f}-{'checkpointed' if c else 'plain'}",
                        marks=() if (f, c) in _QUICK else pytest.mark.slow)
           for f in FAMILIES for c in (False, True)]


@pytest.mark.parametrize("family, checkpointing", _PARITY)
def test_fp32_parity_across_tile_counts(family, checkpointing):
    base = _model(family, checkpointing)
    reference = copy.deepcopy(base)
    want, untiled = _train(reference, family, sequence_tiling=False)
    assert untiled == {}
    for tiles in (1, 3, 5):  # 5 divides neither 16 nor T5's 8 decoder tokens
        model = copy.deepcopy(base)
        got, calls = _train(model, family, sequence_tiling=True, tile_tokens=tiles)
        assert calls and all(calls.values()), calls  # every tiled module ran in tiles
        assert got == pytest.approx(want, rel=1e-5), tiles
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=ADAM_SLACK,
                                       msg=lambda m: f"tile_tokens={tiles} {name}: {m}")


def test_under_checkpointing_a_tiled_mlp_runs_forward_as_often_as_a_whole_one(monkeypatch):
    """[Note: the input saved first] With checkpointing (transformers' default, non-reentrant),
    the backward's recompute of a block stops once its last saved tensor is packed again; the
    tiled MLP's input is saved before its tiles are computed, so the recompute stops there and
    the MLP's tiles run forward twice per step (the forward, the backward's tile by tile), as
    a whole MLP does (the forward, the recompute), not three times. The losses are the same."""
    tokens = []
    forward = LlamaMLP.forward
    monkeypatch.setattr(LlamaMLP, "forward", lambda self, x: (tokens.append(x.shape[-2]), forward(self, x))[1])
    base = _model("llama", checkpointing=True)
    runs = {}
    for tiles in (None, 5):
        config = dict(sequence_tiling=True, tile_tokens=tiles) if tiles else dict(sequence_tiling=False)
        model = copy.deepcopy(base)
        engine = offload_model(model, StrongholdConfig(window_size=1, **config), device="cpu")
        opt, losses = engine.build_optimizer(lr=LR), []
        for step in range(2):
            tokens.clear()  # the first step's count has the probe's runs too
            loss = model(**batch("llama", seed=step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        calls = {name: site.calls for name, site in tiled_modules(model).items()}
        engine.close()
        runs[tiles] = (losses, sum(tokens), calls)
    (whole, whole_tokens, _), (tiled, tiled_tokens, calls) = runs[None], runs[5]
    assert any(n for name, n in calls.items() if "mlp" in name), calls  # the MLPs ran in tiles
    assert tiled_tokens == whole_tokens == 3 * 2 * 12, (tiled_tokens, whole_tokens)  # blocks x 2 x tokens
    assert tiled == pytest.approx(whole, rel=1e-5)


def _grads(base, family, tiles, bf16):
    model = copy.deepcopy(base)
    if tiles:
        SequenceTiling.install(model, True, tiles)
    with _autocast(bf16):
        loss = model(**batch(family, seed=0, seq=SEQ)).loss
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_tiling_adds_no_error_beyond_bf16s(family):
    base = _model(family)
    exact, plain, tiled = (_grads(base, family, None, False), _grads(base, family, None, True),
                           _grads(base, family, 3, True))

    def error(grads):  # over all parameters at once: a ~0 gradient's relative noise means nothing
        return (sum((grads[n] - g).square().sum() for n, g in exact.items()) /
                sum(g.square().sum() for g in exact.values())).sqrt().item()

    assert error(tiled) <= 1.5 * error(plain) + 1e-3, (error(tiled), error(plain))
    # The engine under autocast, with checkpointing: the losses of each step.
    checkpointed = _model(family, checkpointing=True)
    want, _ = _train(copy.deepcopy(checkpointed), family, bf16=True, sequence_tiling=False)
    got, calls = _train(copy.deepcopy(checkpointed), family, bf16=True, sequence_tiling=True, tile_tokens=5)
    assert calls and all(calls.values())
    assert got == pytest.approx(want, rel=1e-2)


def test_dropout_tile_masks_are_replayed_in_backward():
    """With dropout, a tile draws its own mask (same in distribution, not the untiled mask), and
    the backward's recompute must see that same mask: the bias gradient of ``dropout(Wx + b)``
    is the output gradient summed where the forward kept a value, times 1 / (1 - p)."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train()
    x = torch.randn(2, 10, 8, requires_grad=True)
    y = tiled_forward(lambda t: layer(t), 3, True, x, *layer.parameters())
    g = torch.randn_like(y)
    before_backward = torch.get_rng_state()
    kept = (y != 0).float()
    assert 0.2 < kept.mean() < 0.8
    y.backward(g)
    torch.testing.assert_close(layer[0].bias.grad, (g * kept).sum((0, 1)) * 2)
    torch.testing.assert_close(x.grad, (g * kept * 2) @ layer[0].weight)
    assert torch.equal(torch.get_rng_state(), before_backward)  # the replay leaves the caller's stream alone


def test_bf16_backward_keeps_one_tile_of_cast_input_alive():
    """[Note: autocast's cache in backward] Under bf16 autocast the recompute casts each fp32
    input tile to bf16 for the MLP's first matmul; the casts die with their tile instead of
    staying in autocast's cache to the end of the module's backward (the input over again in
    bf16), and the gradients are those of the untiled MLP under the same autocast."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(2, 30, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tiled_forward(lambda t: mlp(t), 3, False, x, *mlp.parameters())
    g = torch.randn_like(y)
    with LiveCasts(lambda out: out.dim() == 3) as casts:  # an input tile's cast, not a weight's
        y.backward(g)
    assert len(casts.refs) == 10 and casts.most_alive <= 2, (len(casts.refs), casts.most_alive)
    want = [t.grad.clone() for t in (x, *mlp.parameters())]
    for t in (x, *mlp.parameters()):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mlp(x).backward(g)
    for got, ref in zip(want, (x.grad, *(p.grad for p in mlp.parameters()))):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# The probe
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_tiles_mlps_and_norms_never_attention(family):
    model = tiny_model(family)
    SequenceTiling.install(model, True, 4)
    model(**batch(family, seed=0, seq=SEQ)).loss.backward()
    found = tiled_modules(model)
    assert {site.cls.__name__ for site in found.values()} == TILED_CLASSES[family]
    for name, site in found.items():
        assert site.calls == 1, name
        inside = list(model.get_submodule(name).modules())
        # No attention runs in tiles: neither the module nor anything it holds.
        assert not any("attention" in type(m).__name__.lower() or "attn" in type(m).__name__.lower()
                       for m in inside), name
        assert not any(_SITE in m.__dict__ for m in inside[1:]), name  # the outermost wins


def test_probe_on_llama_names_what_it_tiles(caplog):
    model = tiny_model("llama")
    SequenceTiling.install(model, True, 4)
    with caplog.at_level(logging.INFO, logger="stronghold_hf"):
        model(**batch("llama", seed=0, seq=SEQ)).loss.backward()
        model(**batch("llama", seed=1, seq=SEQ)).loss.backward()
    layers = model.config.num_hidden_layers
    # The final norm beside the blocks is judged too ([Note: tiling outside the blocks]).
    assert set(tiled_modules(model)) == {f"model.layers.{i}.{n}" for i in range(layers)
                                         for n in ("input_layernorm", "post_attention_layernorm", "mlp")} | {"model.norm"}
    lines = [r.getMessage() for r in caplog.records if "sequence tiling" in r.getMessage()]
    assert len(lines) == 2, lines  # once each, though every block was judged
    assert ("tiles input_layernorm (LlamaRMSNorm), post_attention_layernorm (LlamaRMSNorm), mlp (LlamaMLP); "
            "per-token with nothing to save (left as they are): self_attn.q_proj") in lines[0]
    assert "outside the blocks: tiles model.norm (LlamaRMSNorm)" in lines[1]
    # Tiled, the final norm keeps its input for backward, not its fp32 copy and normalized values.
    norm = model.model.norm
    x = torch.randn(2, SEQ, model.config.hidden_size, requires_grad=True)

    weights = {p.untyped_storage().data_ptr() for p in norm.parameters()}

    def saved_bytes(run) -> int:  # what backward keeps, by storage, the norm's weight aside
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return sum(n for ptr, n in storages.items() if ptr not in weights)

    assert saved_bytes(lambda: norm(x)) == x.nbytes
    assert saved_bytes(lambda: type(norm).__mro__[1].forward(norm, x)) >= 2 * x.nbytes  # its plain forward


class _CausalMean(nn.Module):
    """Mixes tokens, yet is called with one [..., s, h] tensor, as a per-token module is."""

    def forward(self, x):
        counts = torch.arange(1, x.shape[-2] + 1, dtype=x.dtype, device=x.device)
        return x.cumsum(-2) / counts[:, None]


class _AddPosition(nn.Module):
    """Per-token rows that read their position in the input: a tile would restart it."""

    def forward(self, x):
        return x * torch.arange(x.shape[-2], dtype=x.dtype, device=x.device)[:, None].exp()


def _run(module):
    return lambda t: module(t)


def test_probe_verdicts():
    torch.manual_seed(0)
    x = torch.randn(2, 12, 16)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    assert not probe(lambda t: mha(t, t, t, need_weights=False)[0], mha, x).per_token
    verdict = probe(_run(_CausalMean()), _CausalMean(), x)
    assert not verdict.per_token and "changes with other tokens" in verdict.reason
    verdict = probe(_run(_AddPosition()), _AddPosition(), x)
    assert not verdict.per_token and "split" in verdict.reason
    linear = nn.Linear(16, 16)
    verdict = probe(_run(linear), linear, x)
    assert verdict.per_token and not verdict.tiled and verdict.saved_bytes_per_token == 0
    cfg = tiny_config("llama", hidden_size=16, intermediate_size=64)
    mlp = LlamaMLP(cfg)
    verdict = probe(_run(mlp), mlp, x)
    # silu's input, its output, up's output and the product: four fp32 rows of 64 per token.
    assert verdict.tiled and verdict.saved_bytes_per_token == 4 * 64 * 4
    norm = LlamaRMSNorm(16)
    verdict = probe(_run(norm), norm, x)
    assert verdict.tiled and verdict.saved_bytes_per_token >= 16 * 4  # the normalised copy
    mlp.train()
    probe(_run(mlp), mlp, x)
    assert mlp.training and mlp.down_proj.training  # eval only for the probe


class _Capacity(nn.Module):
    """Per-token in eval, and in training up to ``capacity`` tokens per call: the rows past it
    are dropped (zero), as capacity-routed experts drop tokens. Its eval forward sets
    ``capacity`` to the call's tokens, as NLLB-MoE's router does."""

    def __init__(self, capacity):
        super().__init__()
        self.capacity = capacity
        self.proj = nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        if not self.training:
            self.capacity = x.shape[-2]
        kept = (torch.arange(x.shape[-2], device=x.device) < self.capacity).to(x.dtype)[:, None]
        return torch.tanh(self.proj(x)) * kept


class _BatchStats(nn.Module):
    """Per-token in eval (running statistics); in training, normalised by the call's tokens."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x):
        return self.norm(self.proj(x).reshape(-1, x.shape[-1])).reshape(x.shape)


def test_probe_refuses_capacity_routing_and_leaves_the_module_as_it_was():
    """Modules that are per-token in eval but not in training (an expert capacity that drops
    the tokens past it, batch norm's statistics over the call's tokens) are not tiled; and
    whatever the probe's calls set (a number, a buffer, running statistics) is put back."""
    torch.manual_seed(0)
    x = torch.randn(2, 12, 16)
    module = _Capacity(capacity=64)
    module.train()
    verdict = probe(_run(module), module, x)
    assert not verdict.per_token and "copies of one token" in verdict.reason
    assert module.capacity == 64 and int(module.calls) == 0 and module.training
    roomy = _Capacity(capacity=10**6)  # never binds: per-token
    assert probe(_run(roomy), roomy, x).per_token and roomy.capacity == 10**6
    stats = _BatchStats()
    mean, batches = stats.norm.running_mean.clone(), int(stats.norm.num_batches_tracked)
    verdict = probe(_run(stats), stats, x)
    assert not verdict.per_token and "statistics over the tokens" in verdict.reason
    assert torch.equal(stats.norm.running_mean, mean) and int(stats.norm.num_batches_tracked) == batches


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = LlamaRMSNorm(8)
        self.mix = _CausalMean()
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x):
        return x + self.mlp(self.mix(self.norm(x)))


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_any_model_unproven_and_observed_modules_stay_untiled(caplog):
    torch.manual_seed(0)
    model = _Stack()
    reference = copy.deepcopy(model)
    model.layers[1].mlp.register_forward_hook(lambda *args: None)  # someone watches it: tiles would show
    SequenceTiling.install(model, True, 3)
    x = torch.randn(2, 10, 8, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="stronghold_hf"):
        y = model(x)
    assert set(tiled_modules(model)) == {"layers.0.norm", "layers.0.mlp", "layers.1.norm"}
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "mix (_CausalMean): a token's output changes with other tokens' inputs" in said
    assert "mlp (Sequential): hooks observe it" in said
    x_ref = x.detach().clone().requires_grad_()
    y_ref = reference(x_ref)
    torch.testing.assert_close(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")


def test_mixture_of_experts_watched_by_its_router_recorder_stays_untiled(caplog):
    model = tiny_model("mixtral")
    SequenceTiling.install(model, True, 4)
    with caplog.at_level(logging.INFO, logger="stronghold_hf"):
        model(**batch("mixtral", seed=0, seq=SEQ), output_router_logits=True).loss.backward()
    assert {site.cls.__name__ for site in tiled_modules(model).values()} == {"MixtralRMSNorm"}
    assert "(MixtralSparseMoeBlock): hooks observe it" in caplog.text


# ---------------------------------------------------------------------------------------------
# When it tiles
# ---------------------------------------------------------------------------------------------


def _swapped(model):
    return [name for name, m in model.named_modules() if _SITE in m.__dict__]


def test_auto_and_one_tile_leave_the_model_alone(monkeypatch):
    model = tiny_model("llama")
    classes = [type(m) for m in model.model.layers.modules()]
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")  # "auto", "auto"
    model(**batch("llama", seed=0, seq=SEQ)).loss.backward()
    assert _swapped(model) == [] and [type(m) for m in model.model.layers.modules()] == classes
    engine.close()
    # A sequence of one tile is not tiled (nothing probed either); one token more is.
    for tiles, tiled in ((SEQ, False), (SEQ - 1, True)):
        model = tiny_model("llama")
        _, calls = _train(model, "llama", steps=1, sequence_tiling=True, tile_tokens=tiles)
        assert bool(calls) is tiled and all(calls.values())
    # "auto" tiles what is longer than AUTO_MIN_SEQUENCE, decided per call from its length.
    monkeypatch.setattr(tiling, "AUTO_MIN_SEQUENCE", 12)
    model = tiny_model("llama")
    engine = offload_model(model, StrongholdConfig(window_size=1, tile_tokens=4), device="cpu")
    model(**batch("llama", seed=0, seq=12)).loss.backward()
    assert _swapped(model) == []
    model(**batch("llama", seed=0, seq=SEQ)).loss.backward()
    calls = {name: site.calls for name, site in tiled_modules(model).items()}
    assert calls and set(calls.values()) == {1}
    model(**batch("llama", seed=0, seq=12)).loss.backward()
    assert {site.calls for site in tiled_modules(model).values()} == {1}  # short again: untiled
    engine.close()


def test_tile_tokens_rule_and_config_validation():
    assert resolve_tile_tokens(7, 10**9) == 7
    assert resolve_tile_tokens("auto", 4096 * 2 * 4) == 256 * 2**20 // (4096 * 8)  # 8192 tokens
    assert resolve_tile_tokens("auto", 1) == tiling.AUTO_TILE_MAX
    assert resolve_tile_tokens("auto", 10**9) == tiling.AUTO_TILE_MIN
    for bad in (dict(sequence_tiling="yes"), dict(sequence_tiling=1), dict(tile_tokens=0), dict(tile_tokens=True),
                dict(tile_tokens="8")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            StrongholdConfig(**bad)
    cfg = StrongholdConfig.from_any('{"sequence_tiling": true, "tile_tokens": 8}')
    assert cfg.sequence_tiling is True and cfg.tile_tokens == 8
    assert StrongholdConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------------------------------
# Giving the model back
# ---------------------------------------------------------------------------------------------


def test_names_identity_and_close(tmp_path):
    model = tiny_model("llama")
    keys, names = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    params, classes = list(model.parameters()), [type(m) for m in model.modules()]
    engine = offload_model(model, StrongholdConfig(window_size=1, sequence_tiling=True, tile_tokens=4), device="cpu")
    model(**batch("llama", seed=0, seq=SEQ)).loss.backward()
    assert tiled_modules(model)
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    assert all(p is q for p, q in zip(model.parameters(), params))
    model.load_state_dict(model.state_dict())  # strict: the same keys
    tiled = model.model.layers[0].mlp
    assert isinstance(tiled, LlamaMLP) and type(tiled) is not LlamaMLP and "LlamaMLP(" in repr(model)
    engine.close()
    assert [type(m) for m in model.modules()] == classes and _swapped(model) == []
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)


def test_copies_are_plain_and_remove_is_idempotent():
    model = tiny_model("llama")
    handle = SequenceTiling.install(model, True, 4)
    model(**batch("llama", seed=0, seq=SEQ)).loss.backward()
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert _swapped(copied) == [] and type(copied.model.layers[0].mlp) is LlamaMLP
        torch.testing.assert_close(copied(**batch("llama", seed=1, seq=SEQ)).loss,
                                   model(**batch("llama", seed=1, seq=SEQ)).loss)
    with pytest.raises(ValueError, match="already has sequence tiling"):
        SequenceTiling.install(model, True, 4)
    handle.remove()
    handle.remove()
    assert _swapped(model) == [] and type(model.model.layers[0].mlp) is LlamaMLP


# ---------------------------------------------------------------------------------------------
# Through the Trainer and the launcher
# ---------------------------------------------------------------------------------------------


class _Data(torch.utils.data.Dataset):
    def __init__(self, family="llama", n=8):
        self.items = [{k: v[0] for k, v in batch(family, seed=i, batch_size=1, seq=SEQ).items()} for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


_ARGS = ["--per_device_train_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e-2", "--logging_steps", "1",
         "--report_to", "none", "--use_cpu", "--save_strategy", "no", "--seed", "0", "--dataloader_num_workers", "0",
         "--disable_tqdm", "true"]


def test_trainer_through_hf_argument_parser(tmp_path):
    args, plain, trainer, model = plain_and_stronghold_trainers(
        tmp_path, '{"sequence_tiling": true, "tile_tokens": 4}', _ARGS, _Data())
    assert args.stronghold_config_resolved.sequence_tiling is True
    assert args.stronghold_config_resolved.tile_tokens == 4
    calls = {name: site.calls for name, site in tiled_modules(model).items()}
    assert calls and all(c == 3 for c in calls.values())  # one tiled call per step
    assert logged_losses(trainer) == pytest.approx(logged_losses(plain), rel=1e-4)


_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch, transformers
from stronghold_hf.tiling import tiled_modules
from tiny_models import batch, tiny_model

items = [{{k: v[0] for k, v in batch("llama", seed=i, batch_size=1, seq=16).items()}} for i in range(4)]
args = transformers.TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=2, max_steps=2, use_cpu=True,
                                      report_to=[], save_strategy="no", disable_tqdm=True)
model = tiny_model("llama")
trainer = transformers.Trainer(model=model, args=args, train_dataset=items)
trainer.train()
json.dump({{"trainer": type(trainer).__name__, "calls": {{n: s.calls for n, s in tiled_modules(model).items()}}}},
          open(os.path.join(sys.argv[1], "seen.json"), "w"))
"""


@pytest.mark.slow  # a child that imports and trains: about 10 s
def test_launcher_takes_it_from_the_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", STRONGHOLD_CONFIG='{"sequence_tiling": true, "tile_tokens": 8}',
               STRONGHOLD_WINDOW_SIZE="1")
    out = subprocess.run([sys.executable, "-m", "stronghold_hf", str(script), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["trainer"] == "StrongholdTrainer"
    assert seen["calls"] and set(seen["calls"].values()) == {2}


# ---------------------------------------------------------------------------------------------
# Memory, measured from outside
# ---------------------------------------------------------------------------------------------

S, HIDDEN, FFN = 4096, 64, 4096

#: One step at S tokens, its peak RSS (VmHWM) reset to the resident memory first: a peak of
#: ``ru_maxrss`` from before (imports, the warm-up) would hide tens of MiB of the tiled step.
_CHILD = rf"""
import ctypes, json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from stronghold_hf import StrongholdConfig, offload_model

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size={HIDDEN}, intermediate_size={FFN}, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, max_position_embeddings={S}, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="inline", **json.loads(sys.argv[1])),
                       device="cpu")
warm = torch.randint(0, 128, (1, 64))
model(input_ids=warm, labels=warm).loss.backward()  # lazy initialisation, outside the measurement
ids = torch.randint(0, 128, (1, {S}))


def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
before = kib("VmRSS")
model(input_ids=ids, labels=ids).loss.backward()
print(0, kib("VmHWM") - before)
"""


def test_peak_rss_of_a_wide_mlp_block():
    from child_rss import peak_rss_growth

    _, growth = peak_rss_growth(_CHILD, ('{"sequence_tiling": false}', '{"sequence_tiling": true, "tile_tokens": 256}'))
    plain, tiled = growth.values()
    # Untiled, the MLP saves four [s, ffn] fp32 tensors for backward (silu's input and output,
    # up's output, the product): 256 MiB here, plus as much again in its backward's transients.
    # Tiled, it keeps its [s, 64] input and one tile's worth of those.
    mlp_saved = 4 * S * FFN * 4
    print(f"peak RSS growth of one step, 1 x {S} tokens, MLP {HIDDEN} -> {FFN}: untiled {plain / 2**20:.0f} MiB, "
          f"tiled {tiled / 2**20:.0f} MiB (the untiled MLP saves {mlp_saved / 2**20:.0f} MiB)")
    assert plain - tiled >= 0.9 * mlp_saved, (plain, tiled)
