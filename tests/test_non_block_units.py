"""Nothing but the window on the device: embeddings, heads, norms and their optimizer state.

Every trainable parameter outside the blocks keeps its fp32 master, gradient and Adam state on
the host, stepped by CPU Adam like a block. Large groups (an embedding, an LM head; a tied
embedding is one unit used at both ends) stream through the window; the small rest is the
resident unit, on the device from the model's forward to the end of its backward. Each test
trains next to an untouched copy with plain torch AdamW and global clipping, and reads the
device promises off the ledger.
"""

from __future__ import annotations

import copy
import pytest
import torch
import transformers as T

from stronghold_hf import StrongholdConfig, get_engine, offload_model
from stronghold_hf.testing import simulated_device
from stronghold_hf.unit import Residency
from tiny_models import batch, tiny_model

LR = 1e-2
BIG_VOCAB = dict(vocab_size=1024)  # 1024 x 32 embedding: larger than half a block, so it streams


def _device_bound(stats):
    return (stats["window_bound_bytes"] + stats["grad_lanes"] * stats["grad_buffer_bytes"] + stats["rest_unit_bytes"]
            + stats["rest_grad_bytes"])


def _pair(make, **config):
    ref = make()
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(**config), device="cpu")
    return ref, model, engine


def _train_both(ref, model, engine, loss_fn, steps=3, max_norm=1.0):
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    opt = engine.build_optimizer(lr=LR, weight_decay=0.01)
    for step in range(steps):
        loss_ref, loss = loss_fn(ref, step), loss_fn(model, step)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
        loss_ref.backward()
        loss.backward()
        torch.testing.assert_close(engine.clip_grad_norm_(max_norm), torch.nn.utils.clip_grad_norm_(ref.parameters(),
                                                                                                     max_norm),
                                   rtol=1e-5, atol=1e-6)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    engine.synchronize()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        # Adam turns ~1e-10 gradient noise in a mathematically-zero gradient (a key bias) into
        # lr-sized steps: weights are compared within a few percent of the 3-step distance.
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=0.02 * LR * steps,
                                   msg=lambda m: f"{name}: {m}")
    return opt


def _lm_loss(family):
    return lambda m, step: m(**batch(family, seed=step)).loss


FAMILIES = {
    "gpt2": {},  # tied wte / lm_head
    "llama": dict(tie_word_embeddings=False),
    "t5": {},  # one shared embedding for encoder, decoder and head
    "bert": {},  # MLM decoder tied to the word embeddings
    "bart": {},
    "opt": {},
    "qwen2": {},
    "gpt_neox": {},  # untied embed_out
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parity_with_streamed_embeddings_and_heads(family):
    ref, model, engine = _pair(lambda: tiny_model(family, **BIG_VOCAB, **FAMILIES[family]), window_size=1)
    kinds = {u.kind for u in engine.units}
    assert "streamed" in kinds, [(u.fqn, u.kind) for u in engine.units]
    _train_both(ref, model, engine, _lm_loss(family))
    stats = engine.memory_stats()
    # Every trainable parameter's master and Adam state live on the host; none on the device.
    assert stats["offloaded_trainable_params"] == stats["model_trainable_params"]
    assert stats["device_optimizer_bytes"] == 0 and engine.resident_parameters() == []
    assert stats["device_bytes"] == 0, "between steps everything is on the host"
    assert stats["device_peak_bytes"] <= _device_bound(stats)
    # Every unit's gradient left the device through its lane (a late gradient would mean a
    # weight was used while its unit was not resident: on a GPU, a host tensor in a device op).
    # T5's relative-attention bias is exempt: in block 0, its gradient may arrive through later
    # blocks after block 0's backward is done, depending on autograd's order.
    if family != "t5":
        assert engine.stats.as_dict()["late_gradients"] == 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_head_larger_than_a_block_makes_its_logits_a_block_of_vocabulary_at_a_time(family):
    """The engine's chunked loss reads a head larger than the largest block in pieces of at
    most a block's worth of vocabulary rows (the logits a [chunk, piece] tile), and trains like plain
    HF (GPT-2's tied embedding, Llama's untied head)."""
    ref, model, engine = _pair(lambda: tiny_model(family, **BIG_VOCAB), window_size=1, loss_chunk_tokens=5)
    head = model.get_output_embeddings().weight
    largest_block = max(sum(p.numel() for p in u.params) for u in engine.units if u.kind == "block")
    assert head.numel() > largest_block
    (chunked_head,) = engine.chunked_loss._heads
    rows = chunked_head.piece_rows(head)
    block_rows = largest_block // head.shape[1]  # a block's rows, cut to a multiple of 64: [Note: aligned pieces]
    assert rows == block_rows - block_rows % 64 and rows < head.shape[0]
    _train_both(ref, model, engine, _lm_loss(family))
    assert engine.promises.stats()["promise_chunked_loss"] == 1.0  # the chunked (pieced) path ran


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_parity_under_delayed_copies(family):
    with simulated_device(0.002):
        ref, model, engine = _pair(lambda: tiny_model(family, **BIG_VOCAB, **FAMILIES[family]), window_size=2)
        assert engine.transfer.mode == "delayed"
        _train_both(ref, model, engine, _lm_loss(family), steps=2)


def test_tied_embedding_is_one_unit_used_at_both_ends():
    """Streamed whole (``vocab_pieces=False``; in pieces: test_vocab_pieces.py)."""
    model = tiny_model("gpt2", n_layer=4, **BIG_VOCAB)
    engine = offload_model(model, StrongholdConfig(window_size=1, vocab_pieces=False), device="cpu")
    tied = engine.unit_of(model.lm_head.weight)
    assert tied is engine.unit_of(model.transformer.wte.weight) and tied.kind == "streamed"
    seq = engine.schedule.sequence
    assert seq[0] == tied.index and seq[-1] == tied.index and len(seq) == 4 + 2
    opt = engine.build_optimizer(lr=LR)
    for step in range(2):
        before = engine.memory_stats()["fetches"]
        model(**batch("gpt2", seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
        stats = engine.memory_stats()
        # Each position crosses once per forward and once per backward, minus the W the turn
        # finds resident; the resident unit once.
        assert stats["fetches"] - before == 2 * len(seq) - 1 + stats["rest_units"]
    assert engine.stats.as_dict()["late_gradients"] == 0


def test_a_tied_embedding_crosses_once_per_step():
    """Streamed whole (``vocab_pieces=False``): its lane stays on the device between the head's
    backward and the embedding's, so the summed gradient crosses once, and its norm is the
    device's (no host pass at clip)."""
    ref, model, engine = _pair(lambda: tiny_model("gpt2", n_layer=4, **BIG_VOCAB), window_size=1, vocab_pieces=False)
    tied = engine.unit_of(model.lm_head.weight)
    crossings = []
    flush = engine.schedule.gradients.flush
    engine.schedule.gradients.flush = lambda u: (crossings.append(u.index), flush(u))[1]
    _train_both(ref, model, engine, _lm_loss("gpt2"), steps=2)
    assert crossings.count(tied.index) == 2  # one per step
    for u in engine.units:
        if u.trainable:
            assert crossings.count(u.index) == 2, u.fqn
    stats = engine.memory_stats()
    assert stats["grad_lanes"] == 2 + 1  # K, plus the tied unit's
    assert stats["device_peak_bytes"] <= _device_bound(stats)


def test_device_peak_does_not_grow_with_depth_with_streamed_units():
    peaks = {}
    for layers in (4, 16):
        model = tiny_model("llama", num_hidden_layers=layers, tie_word_embeddings=False, **BIG_VOCAB)
        engine = offload_model(model, StrongholdConfig(window_size=2), device="cpu")
        opt = engine.build_optimizer(lr=LR)
        for step in range(2):
            model(**batch("llama", seed=step)).loss.backward()
            engine.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        stats = engine.memory_stats()
        peaks[layers] = stats["device_peak_bytes"]
        assert stats["device_peak_bytes"] <= _device_bound(stats)
    assert peaks[16] == peaks[4], peaks


def test_classification_head_and_pooler_train_like_plain():
    def make():
        torch.manual_seed(0)
        cfg = T.BertConfig(vocab_size=1024, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
        return T.BertForSequenceClassification(cfg).train()

    def loss_fn(m, step):
        b = batch("bert", seed=step)
        b["labels"] = torch.tensor([step % 3, (step + 1) % 3])
        return m(**b).loss

    ref, model, engine = _pair(make, window_size=1)
    resident = {p for u in engine.schedule.rest_units for p in u.params}
    assert model.classifier.weight in resident and model.bert.pooler.dense.weight in resident
    _train_both(ref, model, engine, loss_fn)


def test_lora_with_a_frozen_streamed_embedding():
    peft = pytest.importorskip("peft")

    def make():
        base = tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)
        torch.manual_seed(1)
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                              init_lora_weights=False)
        return peft.get_peft_model(base, cfg)

    ref, model, engine = _pair(make, window_size=1)
    embed = engine.unit_of(model.get_input_embeddings().weight)
    assert embed.kind == "streamed" and not embed.trainable
    assert embed.host.master_flat is None and embed.grads.grad_flat is None  # its stored bytes only
    stored = model.get_input_embeddings().weight.numel() * 4
    assert stored <= embed.host.image_frozen.numel() <= stored + 64
    _train_both(ref, model, engine, _lm_loss("llama"))
    stats = engine.memory_stats()
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert stats["offloaded_trainable_params"] == lora == stats["model_trainable_params"]


def test_offload_non_block_false_keeps_them_on_the_device():
    ref, model, engine = _pair(lambda: tiny_model("gpt2", **BIG_VOCAB), window_size=1, offload_non_block=False)
    assert {u.kind for u in engine.units} == {"block"}
    assert model.transformer.wte.weight in engine.resident_parameters()
    _train_both(ref, model, engine, _lm_loss("gpt2"))
    stats = engine.memory_stats()
    outside = sum(p.numel() for p in engine.resident_parameters())
    assert stats["offloaded_trainable_params"] == stats["model_trainable_params"] - outside
    assert stats["device_optimizer_bytes"] == 8 * outside + 4 * len(engine.resident_parameters())


def test_a_head_read_directly_inside_the_model_forward_is_resident():
    """Liger's fused loss and TRL's fused LM head read ``lm_head.weight`` without calling the
    head: streamed whole (``vocab_pieces=False``; in pieces it is lent whole:
    test_vocab_pieces.py), the unit must be resident from the backbone's end to the model's
    end, and its gradient must go through a lane like any other (no late gradient)."""
    ref = tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)
    model = copy.deepcopy(ref)
    seen = []

    def fused_forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weight = self.lm_head.weight
        engine = get_engine(self)
        if engine is not None:
            seen.append(engine.unit_of(weight).state)
        logits = torch.nn.functional.linear(hidden[:, :-1], weight).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return T.modeling_outputs.CausalLMOutput(loss=loss)

    for m in (ref, model):
        m.forward = fused_forward.__get__(m)
    engine = offload_model(model, StrongholdConfig(window_size=1, vocab_pieces=False), device="cpu")
    _train_both(ref, model, engine, _lm_loss("llama"), steps=2)
    assert seen and all(state is Residency.ON_DEVICE for state in seen)
    assert engine.stats.as_dict()["late_gradients"] == 0


def test_model_device_is_the_compute_device_and_close_restores_the_class():
    model = tiny_model("llama", **BIG_VOCAB)
    cls = type(model)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    assert type(model) is not cls and isinstance(model, cls) and type(model).__name__ == cls.__name__
    assert model.device == engine.device and model.model.device == engine.device
    assert next(model.parameters()).device.type == "cpu"  # the host master
    engine.close()
    assert type(model) is cls and get_engine(model) is None
