"""Tiny configs of several model families, built offline from configs (no hub)."""

from __future__ import annotations

import torch
import transformers as T

VOCAB = 96

_NO_DROPOUT = dict(
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, dropout=0.0, attention_dropout=0.0,
    activation_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, dropout_rate=0.0,
    hidden_dropout=0.0, classifier_dropout=0.0,
)

FAMILIES: dict[str, tuple[type, dict]] = {
    "gpt2": (T.AutoModelForCausalLM, dict(n_embd=32, n_layer=3, n_head=2, n_positions=64)),
    "llama": (T.AutoModelForCausalLM, dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                           num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)),
    "bert": (T.AutoModelForMaskedLM, dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=64)),
    "t5": (T.AutoModelForSeq2SeqLM, dict(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16,
                                         decoder_start_token_id=0, pad_token_id=0)),
    "bart": (T.AutoModelForSeq2SeqLM, dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                           decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                           max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                           decoder_start_token_id=2, forced_eos_token_id=None)),
    "opt": (T.AutoModelForCausalLM, dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, ffn_dim=64,
                                         word_embed_proj_dim=32, max_position_embeddings=64, pad_token_id=1)),
    "qwen2": (T.AutoModelForCausalLM, dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                           num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)),
    "mistral": (T.AutoModelForCausalLM, dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                             num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)),
    "gpt_neox": (T.AutoModelForCausalLM, dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                              intermediate_size=64, max_position_embeddings=64)),
    "distilbert": (T.AutoModelForMaskedLM, dict(dim=32, n_layers=3, n_heads=2, hidden_dim=64, max_position_embeddings=64)),
    # Mixture of experts: experts a batch never routes to get no gradient at all.
    "mixtral": (T.AutoModelForCausalLM, dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                             num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64,
                                             num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": (T.AutoModelForCausalLM, dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, head_dim=16,
                                            num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)),
    "deberta-v2": (T.AutoModelForMaskedLM, dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                                intermediate_size=64, max_position_embeddings=64)),
    "falcon": (T.AutoModelForCausalLM, dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2)),
}


def tiny_config(family: str, **overrides):
    auto, kw = FAMILIES[family]
    cfg = T.AutoConfig.for_model(family, vocab_size=VOCAB, **kw)
    for k, v in _NO_DROPOUT.items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    if getattr(cfg, "bos_token_id", None) is not None and cfg.bos_token_id >= VOCAB:
        cfg.bos_token_id = 0
    if getattr(cfg, "eos_token_id", None) is not None and cfg.eos_token_id >= VOCAB:
        cfg.eos_token_id = 0
    return cfg


def tiny_model(family: str, seed: int = 0, **overrides):
    auto, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = auto.from_config(tiny_config(family, **overrides))
    model.train()
    return model


def is_seq2seq(family: str) -> bool:
    return FAMILIES[family][0] is T.AutoModelForSeq2SeqLM


def batch(family: str, seed: int, batch_size: int = 2, seq: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0  # some padding, so masks are exercised
    if is_seq2seq(family):
        labels = torch.randint(3, VOCAB, (batch_size, seq // 2), generator=g)
        return dict(input_ids=ids, attention_mask=mask, labels=labels)
    labels = ids.clone()
    labels[mask == 0] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def engine_losses(model, engine, family: str, *, lr: float, steps: int = 2, seq: int = 12,
                  bf16: bool = False, batches=None, micro_batches: int = 1) -> list[float]:
    """``steps`` steps of the engine's optimizer on `batch`es (``batches(i)``: others; clipping
    at 1.0, bf16 autocast on request; ``micro_batches`` backward passes of ``loss / micro_batches``
    per step), then a synchronize; the losses."""
    opt = engine.build_optimizer(lr=lr)
    losses = []
    for step in range(steps):
        for i in range(step * micro_batches, (step + 1) * micro_batches):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(**(batch(family, seed=i, seq=seq) if batches is None else batches(i))).loss
            loss = loss / micro_batches if micro_batches > 1 else loss
            loss.backward()
            losses.append(loss.item())
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    engine.synchronize()
    return losses


def plain_and_stronghold_trainers(tmp_path, stronghold_config: str, argv: list[str], dataset, family: str = "llama"):
    """The user's path for a `StrongholdConfig` option: ``--stronghold --stronghold_config JSON``
    through ``HfArgumentParser``, next to the plain ``Trainer`` on the same ``argv``, model and
    data; both trained. Returns the stronghold arguments, the two trainers and the stronghold
    trainer's model."""
    import copy

    from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments

    (args,) = T.HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "sh"), "--stronghold", "--stronghold_config", stronghold_config, *argv])
    (plain_args,) = T.HfArgumentParser(T.TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "plain"), *argv])
    reference = tiny_model(family)
    model = copy.deepcopy(reference)
    plain = T.Trainer(model=reference, args=plain_args, train_dataset=dataset)
    plain.train()
    trainer = StrongholdTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    return args, plain, trainer, model


def logged_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]
