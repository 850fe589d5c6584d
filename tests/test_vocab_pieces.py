"""No unit bigger than a block: a vocabulary-sized weight read in row pieces (vocab_pieces.py).

With ``StrongholdConfig(vocab_pieces=True)`` an embedding or LM head larger than the largest
block never crosses whole: the embedding sends the rows a batch uses, the head one piece of
rows at a time, and each piece's gradient goes to the host when the piece is done. Each test
trains next to an untouched copy (plain torch AdamW, global clipping), and reads the device
promises off the ledger: slots, lanes and staging sized by a block, a device peak that does
not grow with the vocabulary.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers as T

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.testing import simulated_device
from test_non_block_units import FAMILIES, _device_bound, _lm_loss, _pair, _train_both
from test_trainer import trainer_log
from tiny_models import batch, engine_losses, logged_losses, tiny_model

BIG_VOCAB = dict(vocab_size=1024)  # 1024 x 32: about three blocks of the tiny models


def _largest_block(engine) -> int:
    return max(sum(p.numel() for p in u.params) for u in engine.units if u.kind == "block")


def _pieced(engine):
    return [u for u in engine.units if u.vocab_pieces is not None]


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole-logits", "chunked-loss"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "t5", "qwen2", "opt"])
def test_parity_with_the_vocabulary_in_pieces(family, chunk):
    """GPT-2's tied embedding (used at both ends), Llama's and Qwen2's untied pair, T5's shared
    embedding (encoder, decoder and head), OPT's tied decoder embedding: trained like plain HF,
    through the head's own forward (whole logits, a piece of columns at a time) and through the
    chunked loss (pieces outermost)."""
    config = dict(window_size=1, vocab_pieces=True, **({"loss_chunk_tokens": chunk} if chunk else {}))
    ref, model, engine = _pair(lambda: tiny_model(family, **BIG_VOCAB, **FAMILIES[family]), **config)
    pieced = _pieced(engine)
    assert pieced and all(u.params[0].numel() > _largest_block(engine) for u in pieced)
    _train_both(ref, model, engine, _lm_loss(family))
    stats = engine.memory_stats()
    # Nothing on the device is sized by the vocabulary: slots, lanes and staging follow the
    # largest block; a piece is at most a block's rows.
    block_slot = max(u.slot_bytes for u in engine.units if u.kind == "block")
    assert stats["slot_bytes"] == block_slot
    assert stats["grad_buffer_bytes"] <= block_slot
    assert 0 < stats["vocab_piece_bytes"] <= block_slot
    assert stats["device_peak_bytes"] <= _device_bound(stats) + stats["vocab_piece_bytes"]
    assert stats["device_bytes"] == 0
    assert engine.stats.as_dict()["late_gradients"] == 0
    for u in pieced:
        assert u.state.value == "on_host"  # never fetched whole
    head = model.get_output_embeddings().weight
    head_unit = engine.unit_of(head)
    if head_unit.vocab_pieces is not None:
        # The head's pieces cross once in forward and once in backward per step, whatever the
        # number of chunks (the embedding's rows cross as rows, not as pieces).
        assert head_unit.vocab_pieces.fetches == 3 * 2 * len(head_unit.vocab_pieces.bounds)


def test_every_piece_starts_on_an_aligned_column_and_is_no_larger_than_a_block():
    """[Note: aligned pieces]: a piece's logits start at a multiple of 64 columns (a block's rows
    as they come put every piece after the first mid cache line, a slower GEMM), still within a
    block. The engine's pieces, and the rule at real sizes."""
    from stronghold_hf.chunked_loss import PIECE_ROW_ALIGN, vocab_piece_rows

    model = tiny_model("llama", vocab_size=4000, tie_word_embeddings=False)
    engine = offload_model(model, StrongholdConfig(window_size=1, vocab_pieces=True), device="cpu")
    try:
        largest = _largest_block(engine)
        assert largest // 32 % PIECE_ROW_ALIGN  # the block's own row count is not aligned here
        for u in _pieced(engine):
            pieces = u.vocab_pieces
            assert len(pieces.bounds) > 2
            assert all(v0 % PIECE_ROW_ALIGN == 0 for v0, _ in pieces.bounds)
            assert pieces.rows_per_piece * pieces.width <= largest
            assert pieces.bounds[-1][1] == 4000
    finally:
        engine.close()
    # GPT-2 at 128 wide (1,549 rows a block), Llama-3-8B (53,250), a tiny block (9 rows: as is),
    # and a vocabulary of more than MAX_VOCAB_PIECES blocks (its floor, rounded up).
    assert vocab_piece_rows(8192, 128, 198_272) == 1536
    assert vocab_piece_rows(128_256, 4096, 218_112_000) == 53_248
    assert vocab_piece_rows(500, 32, 300) == 9
    assert vocab_piece_rows(100_000, 32, 12_000) == 1600


def test_device_peak_does_not_grow_with_the_vocabulary():
    """The strict bound on a vocabulary of many blocks: the same device peak at 1k and 8k rows
    (8k x 32 is about 28 blocks), where streaming it whole grows it with the vocabulary."""
    peaks = {}
    for vocab in (1024, 8192):
        for pieces in (False, True):
            ref, model, engine = _pair(lambda: tiny_model("llama", vocab_size=vocab, tie_word_embeddings=False),
                                       window_size=1, vocab_pieces=pieces, loss_chunk_tokens=5)
            _train_both(ref, model, engine, _lm_loss("llama"), steps=2)
            stats = engine.memory_stats()
            peaks[vocab, pieces] = stats["device_peak_bytes"]
            if pieces:
                block_slot = max(u.slot_bytes for u in engine.units if u.kind == "block")
                # W + 1 block slots, the lanes (block-sized), the rest unit and its lane, one piece.
                bound = (2 * block_slot + stats["grad_lanes"] * block_slot + stats["rest_unit_bytes"]
                         + stats["rest_grad_bytes"] + block_slot)
                assert stats["device_peak_bytes"] <= bound, (vocab, stats["device_peak_bytes"], bound)
    assert peaks[8192, True] == peaks[1024, True]
    assert peaks[8192, False] > 4 * peaks[1024, False]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_parity_under_delayed_copies(family):
    """The GPU-like mode: pieces are copied into device buffers and their gradients come back
    through pinned staging, on copy threads."""
    with simulated_device(0.002):
        ref, model, engine = _pair(lambda: tiny_model(family, **BIG_VOCAB, **FAMILIES[family]), window_size=2,
                                   vocab_pieces=True, loss_chunk_tokens=5)
        assert engine.transfer.mode == "delayed" and _pieced(engine)
        _train_both(ref, model, engine, _lm_loss(family), steps=2)
        # Its slot is never allocated (a slot is at a unit's first whole fetch), as the blocks' are.
        assert all(u.slot is None for u in _pieced(engine))
        assert all(b.slot is not None and not b.holds_device_storage for b in engine.blocks)


def _trains_as_the_whole_unit(make, config: dict, check=None, **train) -> None:
    """The same model trained with the unit whole and in pieces (`engine_losses` with ``train``):
    the same losses and weights. ``check(model, engine, pieces)`` looks at each before training."""
    runs = []
    for pieces in (False, True):
        model = make()
        engine = offload_model(model, StrongholdConfig(vocab_pieces=pieces, **config), device="cpu")
        assert bool(_pieced(engine)) == pieces
        if check is not None:
            check(model, engine, pieces)
        losses = engine_losses(model, engine, model.config.model_type, lr=1e-2, **train)
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    assert runs[1][0] == pytest.approx(runs[0][0], rel=1e-5)
    for name, value in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_gradient_accumulation_and_bf16_match_the_whole_unit():
    """Two micro-batches per step under bf16 autocast: the pieces give the losses and weights
    the engine gives with the unit whole."""
    _trains_as_the_whole_unit(lambda: tiny_model("gpt2", **BIG_VOCAB), dict(window_size=1, loss_chunk_tokens=5),
                              bf16=True, micro_batches=2)


def test_bf16_whole_logits_give_the_whole_units_gradients():
    """[Note: one rounding of the input gradient] bf16 device copies under autocast, the head
    over the whole logits (no chunked loss): its input's gradient is rounded once to bf16, as
    the whole head's one product is, not once per piece; so every gradient of the model is the
    whole unit's (rounding each piece's product gave 0.3% off before the head, the bf16 step)."""
    grads = {}
    for pieces in (False, True):
        model = tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)
        engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype=torch.bfloat16, chunked_loss=False,
                                                       vocab_pieces=pieces), device="cpu")
        assert bool(_pieced(engine)) == pieces
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch("llama", seed=0)).loss.backward()
        engine.synchronize()
        grads[pieces] = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        engine.close()
    for name, whole in grads[False].items():
        off = ((grads[True][name] - whole).norm() / whole.norm()).item()
        assert off < 5e-4, (name, off)


def test_trainer_through_hf_argument_parser(tmp_path):
    """The user's path: ``--stronghold --stronghold_config '{"vocab_pieces": true}'``."""
    from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments

    items = [{k: v[0] for k, v in batch("gpt2", seed=i, batch_size=1, seq=16).items()} for i in range(8)]
    argv = ["--per_device_train_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e-2", "--logging_steps",
            "1", "--report_to", "none", "--use_cpu", "--save_strategy", "no", "--seed", "0",
            "--dataloader_num_workers", "0", "--disable_tqdm", "true"]
    (args,) = T.HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "sh"), "--stronghold", "--stronghold_config", '{"vocab_pieces": true}', *argv])
    (plain_args,) = T.HfArgumentParser(T.TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "plain"), *argv])
    assert args.stronghold_config_resolved.vocab_pieces is True
    reference = tiny_model("gpt2", **BIG_VOCAB)
    model = copy.deepcopy(reference)
    plain = T.Trainer(model=reference, args=plain_args, train_dataset=items)
    plain.train()
    with trainer_log() as messages:  # on its own logger: transformers' may not propagate to caplog's root
        trainer = StrongholdTrainer(model=model, args=args, train_dataset=items)
    trainer.train()
    engine = trainer.stronghold_engine
    start = next(m for m in messages if m.startswith("STRONGHOLD is on"))
    rows = engine.unit_of(model.transformer.wte.weight).vocab_pieces.rows_per_piece
    assert start.endswith(f"; transformer.wte in {-(-1024 // rows)} pieces of {rows} rows")
    assert [u.fqn for u in _pieced(engine)] == ["transformer.wte"]
    assert logged_losses(trainer) == pytest.approx(logged_losses(plain), rel=1e-4)
    trainer.save_model(str(tmp_path / "saved"))
    loaded = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    for (name, p), (_, q) in zip(loaded.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-3, msg=lambda m: f"{name}: {m}")


def test_lora_on_a_frozen_base_with_the_vocabulary_in_pieces():
    peft = pytest.importorskip("peft")

    def make():
        base = tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)
        torch.manual_seed(1)
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0,
                              init_lora_weights=False)
        return peft.get_peft_model(base, cfg)

    ref, model, engine = _pair(make, window_size=1, vocab_pieces=True, loss_chunk_tokens=5)
    assert {u.fqn.rsplit(".", 1)[-1] for u in _pieced(engine)} >= {"embed_tokens", "base_layer"}
    assert all(not u.trainable for u in _pieced(engine))
    _train_both(ref, model, engine, _lm_loss("llama"))


def test_generate_reads_the_pieces():
    ref, model, engine = _pair(lambda: tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB), window_size=1,
                               vocab_pieces=True)
    _train_both(ref, model, engine, _lm_loss("llama"), steps=1)
    ids = batch("llama", seed=5)["input_ids"][:1, :6]
    for m in (ref, model):
        m.eval()
        m.generation_config.pad_token_id = 0
    with torch.no_grad():
        expected = ref.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)


@pytest.mark.parametrize("family", ["bert", "distilbert", "deberta-v2"])
def test_a_masked_lm_head_with_its_bias_is_read_in_pieces(family):
    """BERT's MLM decoder: the weight tied to the word embeddings, and a [vocab] bias that the
    prediction head registers too; both cross in pieces, and train like plain HF."""
    ref, model, engine = _pair(lambda: tiny_model(family, **BIG_VOCAB), window_size=1, vocab_pieces=True)
    (unit,) = _pieced(engine)
    assert len(unit.params) == 2 and unit.vocab_pieces.bias is unit.params[1]
    _train_both(ref, model, engine, _lm_loss(family))
    assert unit.vocab_pieces.fetches > 0 and engine.stats.as_dict()["late_gradients"] == 0


@pytest.mark.parametrize("model_type", ["xlm-roberta", "camembert"])
def test_a_head_that_registers_its_bias_before_the_weight_is_read_in_pieces(model_type):
    """XLM-R's and CamemBERT's tied MLM head registers the [vocab] bias before the weight (XLM-R's
    real vocabulary is 250k rows): the unit is still the weight with its bias, read in pieces."""
    def make():
        config = T.AutoConfig.for_model(model_type, vocab_size=2048, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        torch.manual_seed(0)
        return T.AutoModelForMaskedLM.from_config(config).train()

    ref, model, engine = _pair(make, window_size=1)
    (unit,) = _pieced(engine)
    assert [tuple(p.shape) for p in unit.params] == [(2048, 32), (2048,)]
    assert unit.vocab_pieces.bias is unit.params[1]
    ids = [torch.randint(3, 2048, (2, 12), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    _train_both(ref, model, engine, lambda m, step: m(input_ids=ids[step], labels=ids[step]).loss)
    assert unit.vocab_pieces.fetches > 0


def test_a_causal_head_with_a_bias_is_read_in_pieces_by_the_chunked_loss():
    """Phi's LM head has a bias: its pieces cross with the weight's in the chunked loss."""
    def make():
        torch.manual_seed(0)
        cfg = T.AutoConfig.for_model("phi", vocab_size=1024, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attention_dropout=0.0)
        return T.AutoModelForCausalLM.from_config(cfg).train()

    ref, model, engine = _pair(make, window_size=1, vocab_pieces=True, loss_chunk_tokens=5)
    head = engine.unit_of(model.lm_head.weight)
    assert head.vocab_pieces is not None and head.vocab_pieces.bias is model.lm_head.bias
    _train_both(ref, model, engine, _lm_loss("llama"))
    assert engine.promises.stats()["promise_chunked_loss"] == 1.0


def test_masters_on_disk_are_read_in_pieces(tmp_path):
    """nvme_masters: the pieces read the rows from the masters mapped from the file (fp32); a
    tied GPT-2 trains like plain. A Llama in bf16 (rows from the image) trains as with its
    vocabulary whole."""
    ref, model, engine = _pair(lambda: tiny_model("gpt2", **BIG_VOCAB), window_size=1, vocab_pieces=True,
                               nvme_path=str(tmp_path / "fp32"), nvme_masters=True)
    assert [u.fqn for u in _pieced(engine)] == ["transformer.wte"] and engine.unit_of(model.lm_head.weight).host.masters_on_disk
    _train_both(ref, model, engine, _lm_loss("gpt2"), steps=2)
    _trains_as_the_whole_unit(lambda: tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB),
                              dict(window_size=1, loss_chunk_tokens=5, nvme_path=str(tmp_path / "bf16"), nvme_masters=True,
                                   param_dtype=torch.bfloat16), bf16=True)


def test_units_that_cannot_be_pieced_stream_whole_and_say_why(caplog):
    """An embedding that renormalizes its rows in place (max_norm) needs them all: it streams
    whole, and the log says why."""
    model = tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)
    model.model.embed_tokens.max_norm = 1.0
    with caplog.at_level("INFO", logger="stronghold_hf"):
        engine = offload_model(model, StrongholdConfig(window_size=1, vocab_pieces=True), device="cpu")
    assert [u.fqn for u in _pieced(engine)] == ["lm_head"]
    assert "model.embed_tokens streams whole (vocab_pieces: an embedding with max_norm" in caplog.text


class _MatmulHead(torch.nn.Linear):
    """A head that multiplies by its weight itself, not through ``F.linear``."""

    def forward(self, x):
        return x @ self.weight.T


def _liger_like(model):
    """What Liger's patched forward does: the body, then the loss from ``hidden`` and
    ``lm_head.weight`` directly, never calling the head module."""
    import types

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = torch.nn.functional.linear(hidden, self.lm_head.weight).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return T.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    model.forward = types.MethodType(forward, model)
    return model


@pytest.mark.parametrize("use", ["matmul-head", "liger-like"])
def test_another_use_of_the_weight_gets_it_lent_whole_and_trains_like_plain(use, caplog):
    """A head that does ``x @ self.weight.T``, and a forward that reads ``lm_head.weight``
    outside the head (Liger's loss): the unit is lent whole to the device for that forward and
    its backward (booked in the ledger, said once in the log), goes back to its pieces at the
    end of the backward, and training is plain training's."""
    ref = tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)
    if use == "matmul-head":
        old = ref.lm_head
        ref.lm_head = _MatmulHead(old.in_features, old.out_features, bias=False)
        ref.lm_head.weight = old.weight
    else:
        _liger_like(ref)
    model = copy.deepcopy(ref)
    if use == "liger-like":
        _liger_like(model)  # bound to the copy
    engine = offload_model(model, StrongholdConfig(window_size=1, vocab_pieces=True), device="cpu")
    pieces = engine.unit_of(model.lm_head.weight).vocab_pieces
    assert pieces is not None
    whole = sum(p.numel() * p.element_size() for p in pieces.unit.params)

    def loss(m, step):
        booked = engine.ledger.device_bytes
        out = m(**batch("llama", seed=step)).loss
        if m is model:
            assert pieces.lent and engine.ledger.device_bytes - booked >= whole  # held whole until its backward ends
        return out

    with caplog.at_level("WARNING", logger="stronghold_hf"):
        _train_both(ref, model, engine, loss, steps=3)
    assert not pieces.lent and engine.stats.as_dict()["late_gradients"] == 0
    said = [r.message for r in caplog.records if "lent whole" in r.message]
    assert len(said) == 1 and ("in the forward of its module" if use == "matmul-head" else "outside its modules") in said[0]
    with torch.no_grad():  # a forward without gradients gives the copy back at its end
        model(**batch("llama", seed=9))
    assert not pieces.lent


def _penalty(m, step):
    head = m.get_output_embeddings().weight
    return m(**batch("llama", seed=step)).loss + 1e-2 * head.pow(2).mean()


def _embedded_outside(m, step):
    b = batch("llama", seed=step)
    embeds = torch.nn.functional.embedding(b["input_ids"], m.get_input_embeddings().weight)
    return m(inputs_embeds=embeds, labels=b["labels"]).loss


def _head_on_base(m, step):
    """A base model's hidden states times the embedding's transpose, the loss computed outside."""
    b = batch("llama", seed=step)
    hidden = m.model(input_ids=b["input_ids"]).last_hidden_state
    logits = hidden @ m.get_input_embeddings().weight.T
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b["input_ids"].flatten())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("use", [_penalty, _embedded_outside, _head_on_base], ids=["penalty", "embedding", "head"])
def test_a_use_with_gradients_outside_the_forward_trains_like_plain(use, tied):
    """The weight used outside the model's forward, as it is there (its host value): a weight
    penalty on the head, ``F.embedding`` before calling the model, a head ``h @ E.T`` on the
    base model's output. Its gradient is added into the host gradient whole, as a whole unit's
    would be (no vocabulary-sized lane), and training matches plain."""
    ref, model, engine = _pair(lambda: tiny_model("llama", tie_word_embeddings=tied, **BIG_VOCAB), window_size=1)
    assert _pieced(engine)
    _train_both(ref, model, engine, use)
    assert engine.stats.as_dict()["late_gradients"] >= 3
    stats = engine.memory_stats()  # no vocabulary-sized lane: the device bound of the parity test holds
    assert stats["grad_buffer_bytes"] <= max(u.slot_bytes for u in engine.units if u.kind == "block")
    assert stats["device_peak_bytes"] <= _device_bound(stats) + stats["vocab_piece_bytes"]


def test_the_estimator_counts_pieces_as_the_engine_holds_them():
    """``estimate --vocab_pieces true``: the slot and lanes are a block's, the vocabulary is one
    piece outside the window, and the estimate still bounds what the ledger measures."""
    from stronghold_hf.estimate import estimate_for_model

    measured = {}
    for pieces in (False, True):
        e = estimate_for_model(tiny_model("llama", vocab_size=8192, tie_word_embeddings=False), seq_len=12, batch_size=2,
                               window_size=1, vocab_pieces=pieces)
        ref, model, engine = _pair(lambda: tiny_model("llama", vocab_size=8192, tie_word_embeddings=False),
                                   window_size=1, vocab_pieces=pieces, loss_chunk_tokens=5)
        _train_both(ref, model, engine, _lm_loss("llama"), steps=2)
        stats = engine.memory_stats()
        assert e.gpu_slot_bytes == stats["slot_bytes"]
        assert stats["device_peak_bytes"] <= e.gpu_engine_bytes
        measured[pieces] = (e, stats, max(u.slot_bytes for u in engine.units if u.kind == "block"))
    (whole, _, _), (pieced, stats, block_slot) = measured[False], measured[True]
    assert pieced.gpu_slot_bytes == block_slot < whole.gpu_slot_bytes
    # fp32: the piece, the next one on its way (on a GPU), and the piece's gradient sum.
    assert pieced.gpu_vocab_piece_bytes == 3 * stats["vocab_piece_bytes"]
    assert pieced.gpu_engine_bytes < whole.gpu_engine_bytes / 10
    # Without the option, the estimate says it exists.
    assert any("vocab_pieces=True" in note for note in whole.notes)
    assert not any("vocab_pieces=True" in note for note in pieced.notes)


def test_a_head_lent_whole_holds_its_gradient_only_while_it_crosses_and_the_estimator_counts_it():
    """TRL's fused LM head reads the head whole: the lent copy's gradient is on the device only
    while it crosses (gone by the blocks' backward), and ``estimate --head_lent_whole`` bounds
    the ledger's peak where the pieces' estimate would not."""
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    from stronghold_hf.estimate import estimate_for_model

    def fused():
        m = tiny_model("llama", vocab_size=8192, tie_word_embeddings=False)
        add_fused_lm_head(m)
        return m

    ref, model, engine = _pair(fused, window_size=1)
    head = model.get_output_embeddings().weight
    whole = head.numel() * head.element_size()
    at_first_block = []

    def in_first_block_backward(grad):
        at_first_block.append((head.grad is None, engine.ledger.device_bytes))

    def on_first_block(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(in_first_block_backward)

    model.model.layers[0].register_forward_hook(on_first_block)
    _train_both(ref, model, engine, lambda m, step: m(**batch("llama", seed=step), fused_lm_head=True).loss, steps=2)
    peak = engine.memory_stats()["device_peak_bytes"]
    engine.close()
    assert len(at_first_block) == 2
    # The lent copy is there (the blocks' slots and lanes beside it); its gradient is not.
    assert all(dropped and whole < held < 2 * whole for dropped, held in at_first_block), at_first_block
    assert peak >= 2 * whole  # the gradient was booked while it crossed
    shape = dict(seq_len=12, batch_size=2, window_size=1)
    pieced = estimate_for_model(fused(), **shape)
    lent = estimate_for_model(fused(), head_lent_whole=True, **shape)
    assert pieced.gpu_engine_bytes < peak <= lent.gpu_engine_bytes, (pieced.gpu_engine_bytes, peak, lent.gpu_engine_bytes)
    assert lent.gpu_head_lent_whole_bytes == 2 * whole and any("lent whole" in n for n in lent.notes)


def test_a_resume_matches_the_uninterrupted_run(tmp_path):
    """Checkpoints hold the unit whole (one optimizer entry, one tensor): stopped at step 3 and
    resumed in a fresh Trainer, the run ends where the uninterrupted one does."""
    from stronghold_hf import StrongholdTrainer
    from test_trainer import TinyDataset, _resume_args

    def run(name, model, resume=None):
        args = _resume_args(tmp_path, name, stronghold_config={"vocab_pieces": True})
        trainer = StrongholdTrainer(model=model, args=args, train_dataset=TinyDataset("gpt2"))
        trainer.train(resume_from_checkpoint=resume)
        assert _pieced(trainer.stronghold_engine)
        return model

    full = run("full", tiny_model("gpt2", **BIG_VOCAB))
    run("first", tiny_model("gpt2", **BIG_VOCAB))
    resumed = run("resumed", tiny_model("gpt2", seed=123, **BIG_VOCAB), str(tmp_path / "first" / "checkpoint-3"))
    for k, v in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_a_model_that_scales_the_embedded_rows_in_place_trains_like_plain():
    """CTRL's forward does ``inputs_embeds *= sqrt(d_model)`` on the embedding's output: the rows
    the pieced embedding returns are a tensor of their own (an autograd function's output that
    is a view may not be written in place)."""
    def make():
        torch.manual_seed(0)
        config = T.CTRLConfig(n_embd=32, n_layer=2, n_head=2, dff=64, vocab_size=2048, n_positions=64,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return T.CTRLLMHeadModel(config).train()

    ref, model, engine = _pair(make, window_size=1)
    assert [u.fqn for u in _pieced(engine)] == ["transformer.w"]
    ids = [torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    _train_both(ref, model, engine, lambda m, step: m(input_ids=ids[step], labels=ids[step]).loss)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_resized_embeddings_train_in_pieces_and_a_resize_after_offload_is_refused_by_name(family):
    """run_clm's ``resize_token_embeddings(len(tokenizer))`` (here padded to a multiple of 64, the
    new rows from HF's mean resizing) before the engine: the resized units are read in pieces and
    train like plain HF, tied (GPT-2) or not (Llama). After the engine laid them out, the resize
    is refused at the next forward, naming the parameter and the fix."""
    untied = {} if family == "gpt2" else {"tie_word_embeddings": False}

    def make():
        model = tiny_model(family, vocab_size=1000, **untied)
        model.resize_token_embeddings(1030, pad_to_multiple_of=64)
        return model

    ref, model, engine = _pair(make, window_size=1)
    assert model.get_input_embeddings().weight.shape[0] == 1088
    assert {u.fqn for u in _pieced(engine)} == {n.rsplit(".", 1)[0] for n, p in model.named_parameters()
                                                if p.shape[0] == 1088}
    _train_both(ref, model, engine, _lm_loss(family))

    late = tiny_model(family, vocab_size=1000, **untied)
    engine = offload_model(late, StrongholdConfig(window_size=1), device="cpu")
    try:
        late.resize_token_embeddings(1100)
        name = next(n for n, _ in late.named_parameters())  # the input embedding comes first
        ids = torch.randint(0, 1100, (2, 8))
        with pytest.raises(ValueError, match=rf"parameter {name} was given shape \(1100, 32\), its unit was laid out "
                                             rf"for \(1000, 32\)\. Change shapes before offload_model"):
            late(input_ids=ids, labels=ids)
    finally:
        engine.close()


@pytest.mark.parametrize("host_image", [True, False], ids=["image", "no-image"])
def test_bf16_compute_reads_the_image_or_converts_the_masters(host_image):
    """``param_dtype=bf16``: an untied head's pieces cross in bf16, from the pinned image or,
    with ``host_image=False``, converted from the fp32 masters; both train as the whole unit does."""

    def check(model, engine, pieces):
        assert (engine.unit_of(model.lm_head.weight).host.image_trainable is not None) == host_image

    _trains_as_the_whole_unit(lambda: tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB),
                              dict(window_size=1, param_dtype=torch.bfloat16, host_image=host_image,
                                   loss_chunk_tokens=5), check, bf16=True)


def test_a_head_calling_f_linear_by_keyword_is_read_in_pieces():
    class KeywordHead(torch.nn.Linear):
        def forward(self, x):
            return torch.nn.functional.linear(input=x, weight=self.weight)

    def make():
        model = tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)
        head = KeywordHead(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        head.weight = model.lm_head.weight
        model.lm_head = head
        return model

    ref, model, engine = _pair(make, window_size=1, vocab_pieces=True)
    _train_both(ref, model, engine, _lm_loss("llama"), steps=2)
    assert engine.unit_of(model.lm_head.weight).vocab_pieces.fetches > 0


def test_a_sweep_that_stopped_part_way_leaves_no_stale_piece_ahead():
    """[Note: piece prefetch] in the GPU-like mode: a fetch starts the next piece's copy; a
    sweep that stops after its first piece leaves that copy behind, and the next sweep, after
    the weight changed, reads the new values and frees the old copy."""
    with simulated_device(0.001):
        model = tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)
        engine = offload_model(model, StrongholdConfig(window_size=1, vocab_pieces=True), device="cpu")
        pieces = engine.unit_of(model.lm_head.weight).vocab_pieces
        assert len(pieces.bounds) > 2
        pieces.fetch(0)
        pieces.release(0)  # piece 1 is on its way; the sweep stops here
        with torch.no_grad():
            model.lm_head.weight.mul_(2)  # a write between steps
        expected = model.lm_head.weight.detach().clone()
        for k, (r0, r1) in enumerate(pieces.bounds):
            assert torch.equal(pieces.fetch(k), expected[r0:r1]), k
            pieces.release(k)
        assert engine.memory_stats()["device_bytes"] == 0


def test_the_padding_row_gets_no_gradient_as_in_f_embedding():
    """Inputs that contain the padding id: F.embedding gives its row no gradient, and neither do
    the rows sent back from the device (Llama with ``pad_token_id=0``, OPT's padding row 1)."""
    for family, pad in (("llama", 0), ("opt", 1)):
        def loss(m, step, pad=pad, family=family):
            b = batch(family, seed=step)
            b["input_ids"][:, :3] = pad
            return m(**b).loss

        overrides = dict(pad_token_id=pad, **({"tie_word_embeddings": False} if family == "llama" else {}))
        ref, model, engine = _pair(lambda: tiny_model(family, **BIG_VOCAB, **overrides), window_size=1,
                                   vocab_pieces=True)
        embed = model.get_input_embeddings()
        assert embed.padding_idx == pad and engine.unit_of(embed.weight).vocab_pieces is not None
        _train_both(ref, model, engine, loss, steps=2)


@pytest.mark.parametrize(("family", "delayed"), [("llama", False), ("gpt2", False), ("llama", True)],
                         ids=["llama", "gpt2-tied", "llama-delayed-copies"])
def test_trl_fused_lm_head_reads_the_weight_lent_whole_and_trains_like_plain(family, delayed):
    """TRL's GRPO and RLOO call the model with ``fused_lm_head=True``, which multiplies by
    ``lm_head.weight`` outside the head: for that forward and its backward the unit is lent
    whole to the device, its gradient is added into the host gradient a piece at a time, and
    it goes back to its pieces at the end of the backward (or of a forward without gradients,
    as TRL's reference log-probs). Losses and weights are plain training's."""
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    ref = tiny_model(family, **BIG_VOCAB, **FAMILIES[family])
    model = copy.deepcopy(ref)
    add_fused_lm_head(ref)
    add_fused_lm_head(model)
    with simulated_device(0.001) if delayed else contextlib.nullcontext():  # delayed: real copies, pinned staging
        engine = offload_model(model, StrongholdConfig(window_size=1, vocab_pieces=True), device="cpu")
        pieces = engine.unit_of(model.get_output_embeddings().weight).vocab_pieces
        assert pieces is not None and engine.transfer.mode == ("delayed" if delayed else "sync")
        _train_fused(ref, model, engine, pieces, family)


def _train_fused(ref, model, engine, pieces, family):
    """Three steps of TRL's fused loss on both, a forward without gradients before each."""

    def fused_loss(m, step):
        with torch.no_grad():  # the reference log-probs: no graph, the copy goes back at once
            m(**batch(family, seed=100 + step), fused_lm_head=True)
        assert not pieces.lent
        booked = engine.ledger.device_bytes
        loss = m(**batch(family, seed=step), fused_lm_head=True).loss
        if m is model:
            assert pieces.lent  # until the end of the backward that reads it
            whole = sum(p.numel() * p.element_size() for p in pieces.unit.params)
            assert engine.ledger.device_bytes - booked >= whole  # the device holds it whole meanwhile: booked
        return loss

    _train_both(ref, model, engine, fused_loss, steps=3)
    assert not pieces.lent and engine.stats.as_dict()["late_gradients"] == 0
    # The model's own path reads the pieces again.
    b = batch(family, seed=7)
    torch.testing.assert_close(model(**b).loss, ref(**b).loss, rtol=1e-5, atol=0)


def test_a_saved_tensor_hook_that_reads_the_weight_keeps_the_lent_copy_for_the_backward(caplog):
    """A saved-tensor hook runs inside the forward with gradients off. One that only asks
    where the weights' storage is (``untyped_storage()``, as bench_memory's does) lends nothing;
    one that reads the head's values lends it for the forward's backward too, since the forward
    began with gradients on, and training is plain training's."""
    seen = []
    for reads, lends in ((False, False), (True, True)):
        ref = tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)
        model = copy.deepcopy(ref)
        engine = offload_model(model, StrongholdConfig(window_size=1, vocab_pieces=True), device="cpu")
        pieces = engine.unit_of(model.lm_head.weight).vocab_pieces
        params = list(model.parameters())

        def pack(t, reads=reads, model=model, params=params):
            seen.append(torch.is_grad_enabled())
            if reads:
                model.lm_head.weight.sum()
            else:
                {p.untyped_storage().data_ptr() for p in params}
            return t

        def loss(m, step, model=model, pieces=pieces, lends=lends):
            if m is not model:
                return m(**batch("llama", seed=step)).loss
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = m(**batch("llama", seed=step)).loss
            assert pieces.lent == lends
            return out

        caplog.clear()
        with caplog.at_level("WARNING", logger="stronghold_hf"):
            _train_both(ref, model, engine, loss, steps=2)
        assert not pieces.lent and engine.stats.as_dict()["late_gradients"] == 0
        assert any("lent whole" in r.message for r in caplog.records) == lends
    assert seen and not any(seen)  # the hooks ran with gradients off


def test_the_pieces_gradients_cross_through_the_lanes_staging():
    """Under real copies (the simulated device), the head's piece gradients cross through the
    gradient lanes' pinned staging: the host holds no buffer more than with the vocabulary
    whole, and training is the same."""
    pinned = {}
    with simulated_device(0.001):
        for pieces in (False, True):
            ref, model, engine = _pair(lambda: tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB),
                                       window_size=1, vocab_pieces=pieces)
            assert bool(_pieced(engine)) == pieces and engine.transfer.mode == "delayed"
            _train_both(ref, model, engine, _lm_loss("llama"), steps=2)
            pinned[pieces] = engine.memory_stats()["pinned_host_bytes"]
            if pieces:
                assert _pieced(engine)[-1].vocab_pieces.grad_queue is engine.grad_queue
            engine.close()
    assert pinned[True] <= pinned[False], pinned


def test_a_steps_peak_rss_does_not_grow_with_the_vocabulary_read_in_pieces():
    """Measured from outside, in children, under real copies (the lanes' pinned staging): once
    the engine's buffers exist, a step's peak RSS (the device side is host memory here) is the
    same at 16k and 128k tokens of vocabulary with the pieces; streamed whole, the slot, the
    lanes and the gradient grow with it (the control: the measurement sees such growth)."""
    from child_rss import VOCAB_STEP_CHILD, peak_rss_growth

    step = {}
    for vocab in ("16000", "128000"):
        unit, growth = peak_rss_growth(VOCAB_STEP_CHILD, ('{}',), args=(vocab,))
        step[vocab] = growth['{}']
    unit_small, unit_large = 16000 * 128 * 4, unit
    whole_config = '{"vocab_pieces": false}'
    _, growth = peak_rss_growth(VOCAB_STEP_CHILD, (whole_config,), args=("128000",))
    whole = growth[whole_config]
    print(f"a step's peak RSS growth, pieces: {step['16000'] / 2**20:.1f} MiB at 16k, {step['128000'] / 2**20:.1f} "
          f"MiB at 128k; whole at 128k: {whole / 2**20:.1f} MiB")
    assert step["128000"] - step["16000"] < 0.1 * (unit_large - unit_small), step
    assert step["128000"] < unit_large / 2  # less than half of one vocabulary unit, in all
    assert whole - step["128000"] > 2 * unit_large  # a slot, two lanes, and more


def test_the_embedding_rows_gradient_crosses_through_the_lanes_in_whole_rows(monkeypatch):
    """Under real copies, the embedding's rows' gradient (512 tokens: larger than a lane's
    staging, a block's gradient) crosses through a lane in parts of whole rows, each added at
    its rows' ids, with the padding row left out; training is plain training's."""
    from stronghold_hf import vocab_pieces

    parts = []
    add = vocab_pieces._add_row_part
    monkeypatch.setattr(vocab_pieces, "_add_row_part", lambda *a: (parts.append(a[-1].numel()), add(*a))[1])
    with simulated_device(0.001):
        ref, model, engine = _pair(lambda: tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB),
                                   window_size=1, vocab_pieces=True)
        embed = engine.unit_of(model.get_input_embeddings().weight)
        assert embed.vocab_pieces is not None and embed.vocab_pieces.grad_queue is engine.grad_queue
        staging = engine.grad_queue.staging_bytes
        width = model.config.hidden_size

        def loss(m, step):
            b = batch("llama", seed=step, batch_size=2, seq=256)
            b["input_ids"][:, :8] = 0  # the padding row among them
            return m(**b).loss

        _train_both(ref, model, engine, loss, steps=2)
    assert 2 * 256 * width * 4 > staging and len(parts) > 2  # more than one part per backward
    assert all(n % width == 0 for n in parts) and sum(parts) == 2 * 2 * 256 * width
