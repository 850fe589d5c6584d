"""The chunked LM-head loss against plain transformers: same loss, same gradients, less memory.

Every parity test trains an untouched deep copy of the same model (same seed, fp32) next to
the one with `ChunkedLoss` installed, as FSDP2's ``test_fully_shard_training.py`` does, and
compares the loss and every parameter gradient. The memory promise is measured from outside,
by the peak RSS of a child process (STYLE.md, "Memory tests measured from outside").
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
import transformers as T
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from stronghold_hf.chunked_loss import (
    MAX_VOCAB_PIECES,
    ChunkedLoss,
    HeadTransform,
    _Phase,
    analyse_causal_lm,
    chunked_linear_cross_entropy,
    resolve_chunk_tokens,
)
from live_casts import LiveCasts
from tiny_models import FAMILIES, VOCAB, tiny_config

CHUNK = 5  # tokens per chunk: a 2 x 12 batch runs several chunks and a ragged last one
_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=64, max_position_embeddings=64)
# Families tiny_models does not have, and the head transform each one's forward applies.
_EXTRA = {
    "mistral": {},
    "cohere": dict(logit_scale=3.0),                     # logits * logit_scale
    "granite": dict(logits_scaling=0.25),                # logits / logits_scaling
    "falcon_h1": dict(lm_head_multiplier=2.0, mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_n_groups=1,
                      mamba_d_state=8, mamba_chunk_size=4, head_dim=16),  # logits * lm_head_multiplier
}
_OVERRIDES = {
    "llama": dict(tie_word_embeddings=False),
    # A cap near the logits' size, so tanh is far from the identity.
    "gemma2": dict(final_logit_softcapping=0.3),
}
EXPECTED_TRANSFORM = {
    "gemma2": HeadTransform.softcap(0.3),
    "cohere": HeadTransform.scale(3.0),
    "granite": HeadTransform.divide(0.25),
    "falcon_h1": HeadTransform.scale(2.0),
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one thread is as fast, and immune to OpenMP spin-waits when other
    processes share the two cores (a parity test then takes 10 s instead of 0.2 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def causal_lm(family: str, seed: int = 0):
    if family in FAMILIES:
        cfg = tiny_config(family, **_OVERRIDES.get(family, {}))
    else:
        cfg = T.AutoConfig.for_model(family, vocab_size=VOCAB, **_SMALL, **_EXTRA[family])
        for name, value in list(vars(cfg).items()):  # no dropout, so two models agree
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
                setattr(cfg, name, 0.0)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def make_batch(seed: int = 1, batch_size: int = 2, seq: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100  # padding
    labels[:, :4] = -100      # a masked prompt
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def pair(family: str):
    model = causal_lm(family)
    return model, copy.deepcopy(model)


def step(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out


def assert_close(got, want, name=""):
    """1e-5 relative, elementwise. An element near zero may differ by 1e-6 of the tensor's scale
    (the chunks sum the same products in another order), and a gradient that is zero in exact
    arithmetic (a key projection's bias) by float noise, 1e-9."""
    atol = max(1e-6 * float(want.abs().max()), 1e-9) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_same_grads(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None, name
        assert_close(p.grad, q.grad, name)


# ---------------------------------------------------------------------------------------------
# The function alone
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pieces", [None, 1, 7], ids=["whole", "one-row-pieces", "7-row-pieces"])
@pytest.mark.parametrize("transform", [HeadTransform(), HeadTransform.softcap(0.7), HeadTransform.divide(0.5)],
                         ids=["none", "softcap", "divide"])
def test_function_matches_hf_loss(transform, pieces):
    """Whole, and over vocabulary pieces (an online log-sum-exp, a ragged last piece of 40 rows
    in 7s): HF's loss and gradients to fp32 rounding in every labelling HF accepts."""
    torch.manual_seed(0)
    weight = torch.randn(40, 16, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    hidden = torch.randn(2, 9, 16)[:, 2:, :].requires_grad_()  # a slice, as logits_to_keep gives
    assert not hidden.is_contiguous()
    labels = torch.randint(0, 40, (2, 7))
    labels[0, :3] = -100
    shift = torch.randint(0, 40, (2, 7))
    shift[1, 4:] = -100
    fives = labels.clamp(min=0)
    fives[1, 1:3] = 5
    cases = [(labels, {}), (labels, dict(num_items_in_batch=11)), (labels, dict(num_items_in_batch=torch.tensor(11))),
             (labels, dict(shift_labels=shift)), (fives, dict(ignore_index=5))]
    for labels, kwargs in cases:
        ref = ForCausalLMLoss(transform(F.linear(hidden, weight, bias)), labels, 40, **kwargs)
        ref_grads = torch.autograd.grad(ref, (hidden, weight, bias))
        loss = chunked_linear_cross_entropy(hidden, weight, bias, labels, transform=transform, chunk_tokens=3,
                                            vocab_piece_rows=pieces, **kwargs)
        grads = torch.autograd.grad(loss, (hidden, weight, bias))
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
        for got, want in zip(grads, ref_grads):
            assert_close(got, want)


def test_function_edge_cases():
    torch.manual_seed(0)
    hidden = torch.randn(1, 6, 8)
    weight = torch.randn(20, 8, requires_grad=True)
    ignored = torch.full((1, 6), -100)
    # All ignored: HF's mean is 0/0 = nan and its gradients are zeros; the sum over
    # num_items_in_batch is 0.
    assert torch.isnan(ForCausalLMLoss(F.linear(hidden, weight), ignored, 20))
    nan = chunked_linear_cross_entropy(hidden, weight, None, ignored)
    assert torch.isnan(nan)
    assert not torch.autograd.grad(nan, weight)[0].any()
    zero = chunked_linear_cross_entropy(hidden, weight, None, ignored, num_items_in_batch=4)
    assert zero.item() == 0.0
    zero.backward()
    assert weight.grad is not None and not weight.grad.any()
    # Only what needs a gradient gets one: a frozen head (LoRA) and a hidden without grad.
    labels = torch.randint(0, 20, (1, 6))
    frozen = weight.detach()
    h = hidden.clone().requires_grad_()
    chunked_linear_cross_entropy(h, frozen, None, labels, chunk_tokens=2).backward()
    want = torch.autograd.grad(ForCausalLMLoss(F.linear(h, frozen), labels, 20), h)[0]
    assert_close(h.grad, want)
    with pytest.raises(ValueError, match="labels have shape"):
        chunked_linear_cross_entropy(hidden, weight, None, labels[:, :4])


def test_saved_tensors_are_version_checked():
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    loss = chunked_linear_cross_entropy(hidden, weight, None, torch.randint(0, 20, (1, 4)))
    with torch.no_grad():
        weight.mul_(2)  # an optimizer step before backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_chunk_tokens():
    assert resolve_chunk_tokens("auto", 32000) == 1048
    assert resolve_chunk_tokens("auto", 128256) == 261
    assert resolve_chunk_tokens("auto", 10**7) == 128
    assert resolve_chunk_tokens("auto", 10) == 8192
    assert resolve_chunk_tokens(7, 32000) == 7
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        ChunkedLoss.install(causal_lm("llama"), chunk_tokens=0)
    for bad in (2.5, True, "big"):
        with pytest.raises(TypeError, match="int >= 1 or 'auto'"):
            resolve_chunk_tokens(bad, 32000)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

FAMILY_IDS = ["gpt2", "llama", "qwen2", "opt", "gpt_neox", "mistral", "gemma2", "cohere", "granite", "falcon_h1"]


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_parity_with_plain_hf(family):
    model, reference = pair(family)
    plan, reason = analyse_causal_lm(model)
    assert plan is not None, reason
    assert plan.transform == EXPECTED_TRANSFORM.get(family, HeadTransform()), reason
    chunked = ChunkedLoss.install(model, chunk_tokens=CHUNK)
    assert chunked.models == [model]
    batch = make_batch()
    shift = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:].clone()
    shift[1, 2] = 7  # differs from the shifted labels: shift_labels must win
    variants = [
        {},
        dict(num_items_in_batch=13),                    # gradient accumulation, int
        dict(num_items_in_batch=torch.tensor(13)),      # ... and a 0-dim tensor
        dict(shift_labels=shift),
    ]
    for extra in variants:
        out = step(model, **batch, **extra)
        ref = step(reference, **batch, **extra)
        assert out.logits is None
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-7)
        assert_same_grads(model, reference)


class _Shapes(TorchDispatchMode):
    """The shapes of every tensor the ops dispatched while active produce."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_vocabulary_pieces_keep_logits_a_chunk_by_piece_tile(family):
    """A head larger than ``piece_numel`` makes each chunk's logits 9 vocabulary rows at a time:
    no [tokens, vocab] tile exists in forward or backward (the unpieced path, checked the same
    way, makes them), and loss and gradients are plain HF's (an untied head, Gemma2's
    soft-capping, GPT-2's tied embedding)."""
    model, reference = pair(family)
    hidden = model.get_output_embeddings().weight.shape[1]
    batch = make_batch()
    tiles = {}
    for pieces in (False, True):
        chunked = ChunkedLoss.install(model, chunk_tokens=CHUNK, piece_numel=9 * hidden if pieces else None)
        assert chunked._heads[0].piece_rows(model.get_output_embeddings().weight) == (9 if pieces else None)
        with _Shapes() as seen:
            out = step(model, **batch)
        ref = step(reference, **batch)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-7)
        assert_same_grads(model, reference)
        # [rows, vocab] or [rows, piece] tiles of a chunk (a [1, vocab] sum is the tied embedding's backward).
        tiles[pieces] = {s for s in seen.shapes if len(s) == 2 and s[-1] in (VOCAB, 9) and 1 < s[0] <= CHUNK}
        chunked.remove()
    assert (CHUNK, VOCAB) in tiles[False]  # the check sees a whole-vocabulary tile where there is one
    assert all(s[-1] == 9 for s in tiles[True]) and (CHUNK, 9) in tiles[True], tiles[True]


@pytest.mark.parametrize("pieces", [None, 9], ids=["whole", "pieces"])
def test_bf16_backward_keeps_one_chunk_of_cast_rows_alive(pieces):
    """[Note: autocast's cache in backward] Under bf16 autocast the backward casts each chunk's
    fp32 rows to bf16 for the head's matmul; the casts die with their chunk instead of staying in
    autocast's cache to the end (the hidden states over again, in bf16)."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 40, 16, requires_grad=True)
    weight = torch.randn(96, 16, requires_grad=True)
    labels = torch.randint(0, 96, (2, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_linear_cross_entropy(hidden, weight, None, labels, chunk_tokens=CHUNK, vocab_piece_rows=pieces)
    # A chunk's rows ([<= CHUNK, 16]), not the weight's casts (96 or 9 rows), which are meant to stay.
    with LiveCasts(lambda out: out.dim() == 2 and out.shape[1] == 16 and out.shape[0] <= CHUNK) as casts:
        loss.backward()
    assert len(casts.refs) >= 10  # one per chunk: 78 rows in chunks of 5
    assert casts.most_alive <= 2, casts.most_alive


def test_vocabulary_pieces_are_at_most_max_vocab_pieces():
    """Blocks smaller than a vocabulary row's worth each would make a one-row tile per row; the
    pieces are capped at MAX_VOCAB_PIECES (a 96-row head: pieces of 2 rows, not 96 of 1)."""
    model = causal_lm("llama")
    head = model.get_output_embeddings().weight
    chunked = ChunkedLoss.install(model, chunk_tokens=CHUNK, piece_numel=head.shape[1])
    assert chunked._heads[0].piece_rows(head) == -(-VOCAB // MAX_VOCAB_PIECES) == 2
    chunked.remove()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bf16_autocast_is_close(family):
    model, reference = pair(family)
    ChunkedLoss.install(model, chunk_tokens=CHUNK)
    batch = make_batch()
    losses = []
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(**batch)
        out.loss.backward()  # outside autocast: the recompute must bring back the forward's
        losses.append(out.loss)
    # Not exact: bf16 logits round, and chunks sum the head's gradient in another order.
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=0)
    g, r = model.lm_head.weight.grad, reference.lm_head.weight.grad
    assert F.cosine_similarity(g.flatten(), r.flatten(), dim=0) > 0.99


def test_eval_no_grad_generate_and_tuples_are_untouched():
    model, reference = pair("llama")
    ChunkedLoss.install(model, chunk_tokens=CHUNK)
    batch = make_batch()
    with torch.no_grad():  # training mode, but nothing to differentiate: real logits
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits)
    model.eval(), reference.eval()
    out, ref = model(**batch), reference(**batch)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss)
    prompt = batch["input_ids"][:1, :5]
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kw), reference.generate(prompt, **kw))
    model.train(), reference.train()
    out = model(**batch, return_dict=False)
    ref = reference(**batch, return_dict=False)
    assert isinstance(out, tuple) and out[1] is None and len(out) == len(ref)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-7)


def test_two_forwards_one_backward():
    model, reference = pair("gpt2")
    ChunkedLoss.install(model, chunk_tokens=CHUNK)
    first, second = make_batch(1), make_batch(2)
    for m in (model, reference):
        (m(**first).loss + 0.5 * m(**second).loss).backward()
    assert_same_grads(model, reference)


class DoublingLlamaForCausalLM(T.LlamaForCausalLM):
    """Doubles its logits for a reason no config attribute explains."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits * 2
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_transform_not_understood_falls_back(caplog):
    torch.manual_seed(0)
    model = DoublingLlamaForCausalLM(tiny_config("llama"))
    model.train()
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="stronghold_hf"):
        chunked = ChunkedLoss.install(model, chunk_tokens=CHUNK)
    lines = [r.getMessage() for r in caplog.records if r.name == "stronghold_hf"]
    assert len(lines) == 1, lines
    assert "DoublingLlamaForCausalLM" in lines[0] and "plain" in lines[0] and "`2`" in lines[0]
    assert chunked.models == []
    out, ref = step(model, **make_batch()), step(reference, **make_batch())
    assert out.logits is not None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(model, reference)


def test_replaced_forward_is_not_analysed():
    model = causal_lm("llama")

    def liger_like_forward(self, *args, **kwargs):  # binds its own forward, wrapping nothing
        return type(self).forward(self, *args, **kwargs)

    model.forward = types.MethodType(liger_like_forward, model)
    plan, reason = analyse_causal_lm(model)
    assert plan is None and "LlamaForCausalLM" in reason and "replaced" in reason


def test_trl_fused_head_wrapper_keeps_the_chunked_path():
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    model, reference = pair("llama")
    add_fused_lm_head(model)  # a functools.wraps wrapper around the class forward
    ChunkedLoss.install(model, chunk_tokens=CHUNK)
    batch = make_batch()
    out, ref = step(model, **batch), step(reference, **batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(model, reference)
    fused = model(**batch, fused_lm_head=True)  # TRL's own chunked path: left alone
    torch.testing.assert_close(fused.loss, ref.loss, rtol=1e-5, atol=1e-6)


def test_peft_wrapper():
    from peft import LoraConfig, get_peft_model

    base, base_ref = pair("qwen2")
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(3)
    model = get_peft_model(base, lora)
    torch.manual_seed(3)
    reference = get_peft_model(base_ref, lora)
    chunked = ChunkedLoss.install(model, chunk_tokens=CHUNK)
    assert chunked.models == [base]
    batch = make_batch()
    out, ref = step(model, **batch), step(reference, **batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(model, reference)


class OwnLossLlamaForCausalLM(T.LlamaForCausalLM):
    """Computes its loss itself when ``own_loss`` is set: a path the source analysis cannot rule out."""

    own_loss = ""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            if self.own_loss == "logsumexp":  # runs on the empty logits: only the hook can notice
                loss = logits.logsumexp(-1).mean()
            elif self.own_loss == "cross_entropy":  # fails on the empty logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            else:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_loss_computed_another_way_raises(caplog):
    torch.manual_seed(0)
    model = OwnLossLlamaForCausalLM(tiny_config("llama"))
    model.train()
    reference = copy.deepcopy(model)
    chunked = ChunkedLoss.install(model, chunk_tokens=CHUNK)
    assert chunked.models == [model]
    model.own_loss = "logsumexp"
    with pytest.raises(RuntimeError, match=r"StrongholdConfig\(chunked_loss=False\)"):
        model(**make_batch())
    assert chunked._heads[0].phase is _Phase.IDLE and chunked._heads[0].hidden is None
    # A loss that fails on the empty logits raises its own error; the log line says why.
    model.own_loss = "cross_entropy"
    with caplog.at_level(logging.WARNING, logger="stronghold_hf"), pytest.raises(ValueError, match="batch_size"):
        model(**make_batch())
    assert any("chunked_loss=False" in r.getMessage() for r in caplog.records)
    assert chunked._heads[0].phase is _Phase.IDLE and chunked._heads[0].hidden is None
    model.own_loss = ""
    out, ref = step(model, **make_batch()), step(reference, **make_batch())
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(model, reference)


def test_raising_forward_leaves_nothing_armed(caplog):
    model, reference = pair("llama")
    chunked = ChunkedLoss.install(model, chunk_tokens=CHUNK)
    state = chunked._heads[0]
    batch = make_batch()
    bad = dict(batch, labels=batch["labels"].clone())
    bad["labels"][1, 5] = VOCAB + 3  # raises inside the chunked loss, after the head was captured
    with caplog.at_level(logging.WARNING, logger="stronghold_hf"), pytest.raises((IndexError, RuntimeError)):
        model(**bad)
    assert state.phase is _Phase.IDLE and state.hidden is None and state.labels is None
    assert not caplog.records  # the loss ran: nothing to blame on the shrunk head
    with pytest.raises(IndexError):  # raises in the embedding, before the head
        model(input_ids=torch.full((1, 4), VOCAB + 1), labels=torch.zeros(1, 4, dtype=torch.long))
    assert state.phase is _Phase.IDLE
    out, ref = step(model, **batch), step(reference, **batch)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-7)


def test_remove_restores_plain_behaviour():
    model, reference = pair("opt")
    head = model.get_output_embeddings()
    chunked = ChunkedLoss.install(model, chunk_tokens=CHUNK)
    with pytest.raises(ValueError, match="already has a chunked loss"):
        ChunkedLoss.install(model)
    step(model, **make_batch())
    chunked.remove()
    chunked.remove()  # idempotent
    assert "_loss_function" not in model.__dict__ and model.loss_function is ForCausalLMLoss
    assert not model._forward_pre_hooks and not model._forward_hooks and not head._forward_pre_hooks
    out, ref = step(model, **make_batch()), step(reference, **make_batch())
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss)
    # A loss_function the instance set itself comes back as it was.
    model.loss_function = ForCausalLMLoss
    ChunkedLoss.install(model).remove()
    assert model.__dict__["_loss_function"] is ForCausalLMLoss


# ---------------------------------------------------------------------------------------------
# Memory, measured from outside
# ---------------------------------------------------------------------------------------------

_CHILD = r"""
import resource, sys
import torch, transformers as T
from stronghold_hf.chunked_loss import ChunkedLoss

torch.manual_seed(0)
cfg = T.AutoConfig.for_model("llama", vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
model = T.AutoModelForCausalLM.from_config(cfg).train()
if sys.argv[1] == "chunked":
    ChunkedLoss.install(model, chunk_tokens="auto")
warm = torch.randint(0, 32000, (1, 16))
model(input_ids=warm, labels=warm).loss.backward()  # lazy initialisation, outside the measurement
ids = torch.randint(0, 32000, (1, 4096))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model(input_ids=ids, labels=ids).loss.backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(after - before)
"""


def _peak_rss_growth_kib(*modes: str) -> list[int]:
    """Runs one child per mode at once (they mostly import) and returns each one's growth."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env) for mode in modes]
    growth = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-2000:]
        growth.append(int(out.strip().splitlines()[-1]))
    return growth


def test_peak_rss_of_a_training_step():
    plain, chunked = _peak_rss_growth_kib("plain", "chunked")
    # The plain step holds [4096, 32000] fp32 logits (500 MiB), their log-softmax and
    # gradients; the chunked one about 1048 rows of each at a time.
    print(f"peak RSS growth of one step, 1 x 4096 tokens, vocab 32000: plain {plain / 1024:.0f} MiB, "
          f"chunked {chunked / 1024:.0f} MiB")
    assert chunked <= plain / 2, (plain, chunked)


def test_one_chunk_for_every_token_runs_the_plain_path():
    """When a single chunk would hold all the tokens, chunking saves nothing and its backward
    recompute would cost a head matmul: the plain path runs and returns real logits."""
    model, reference = pair("llama")
    batch = make_batch()
    rows = batch["input_ids"].numel()
    ChunkedLoss.install(model, chunk_tokens=rows)
    out, ref = model(**batch), reference(**batch)
    assert out.logits is not None and out.logits.shape == ref.logits.shape
    torch.testing.assert_close(out.loss, ref.loss)
    model2, _ = pair("llama")
    ChunkedLoss.install(model2, chunk_tokens=rows - 1)
    assert model2(**batch).logits is None  # two chunks: chunked


def test_the_loss_builds_no_tensor_from_host_data(monkeypatch):
    """Each tensor built from Python data on a GPU is a pageable copy and a host sync: the
    chunked loss has none per chunk (it had two, through torch.unravel_index)."""
    hidden = torch.randn(3, 40, 16)[:, 4:, :]  # a slice: rows are gathered, not reshaped
    weight, labels = torch.randn(VOCAB, 16), torch.randint(0, VOCAB, (3, 36))
    expected = chunked_linear_cross_entropy(hidden, weight, None, labels, chunk_tokens=8)
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    got = chunked_linear_cross_entropy(hidden, weight, None, labels, chunk_tokens=8)
    assert made == [] and torch.equal(got, expected)
    plain = F.cross_entropy((hidden @ weight.T)[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(got, plain)
