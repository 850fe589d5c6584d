"""Fine-tuning with frozen bases: head-only, full, and PEFT LoRA, through the user's entry points.

A frozen offloaded parameter streams its stored bytes only: no gradient buffer, no gradient
copy, no norm work, no Adam state, no fp32 master. These tests train each case next to plain
training (the untouched model, the plain Trainer, plain PEFT) and read the host bytes off the
engine's ledger.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Trainer, TrainingArguments

from stronghold_hf import StrongholdConfig, StrongholdTrainer, StrongholdTrainingArguments, get_engine, offload_model
from test_trainer import COMMON, TinyDataset
from tiny_models import batch, tiny_model

peft = pytest.importorskip("peft")


def _freeze_body(model):
    for p in model.transformer.h.parameters():
        p.requires_grad_(False)
    return model


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("family, dtype", [("gpt2", torch.float32), ("llama", torch.bfloat16)])
def test_frozen_body_costs_only_its_stored_bytes(family, dtype):
    if family == "gpt2":
        model = tiny_model("gpt2", n_layer=4, n_embd=128, n_head=2)
        body = model.transformer.h
    else:  # RMSNorm upcasts, so a bf16 body runs under CPU autocast
        model = tiny_model("llama", num_hidden_layers=4, hidden_size=128, intermediate_size=256)
        body = model.model.layers
    for p in body.parameters():
        p.requires_grad_(False)
    body.to(dtype)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    opt = engine.build_optimizer(lr=1e-3)  # CPU Adam for the embeddings, final norm and head only
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
        model(**batch(family, seed=0)).loss.backward()
    opt.step()
    engine.synchronize()
    stats = engine.memory_stats()
    outside = [u for u in engine.units if u.kind != "block"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert stats["offloaded_trainable_params"] == trainable == sum(u.layout.grad_numel for u in outside)
    # The frozen body: its stored bytes on the host, no master, no gradient, no Adam state.
    for b in engine.blocks:
        assert b.host.master_flat is None and b.grads.grad_flat is None and b.host.image_trainable is None
        stored = sum(p.numel() * p.element_size() for p in b.params)
        assert stored <= b.host.image_frozen.numel() <= stored + 64 * len(b.params)
    # Only the trainable parameters outside the blocks send gradients and keep Adam state.
    assert stats["d2h_bytes"] == 4 * trainable
    assert stats["optimizer_state_bytes"] == 8 * trainable + 4 * sum(len(u.layout.trainable) for u in outside)
    assert engine.grad_queue.max_bytes == 0  # no block has a gradient buffer


def test_head_only_training_with_every_block_frozen_matches_trainer(tmp_path):
    ref = _freeze_body(tiny_model("gpt2"))
    model = copy.deepcopy(ref)
    Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "a"), **COMMON),
            train_dataset=TinyDataset("gpt2")).train()
    t = StrongholdTrainer(model=model, args=StrongholdTrainingArguments(output_dir=str(tmp_path / "b"), stronghold=True,
                                                                        stronghold_window_size="1", **COMMON),
                          train_dataset=TinyDataset("gpt2"))
    t.train()
    ref_t = [h for h in t.state.log_history if "loss" in h]
    stats = t.stronghold_engine.memory_stats()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    backwards = COMMON["max_steps"] * COMMON["gradient_accumulation_steps"]
    assert ref_t and stats["d2h_bytes"] == 4 * trainable * backwards  # only what is outside the body
    assert stats["offloaded_trainable_params"] == trainable and stats["device_optimizer_bytes"] == 0
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")


def _lora(model, seed=0):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0,
                          fan_in_fan_out=True, init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


def test_lora_trains_like_plain_peft_and_merges_like_it(tmp_path):
    base = tiny_model("gpt2", n_layer=3)
    ref = _lora(copy.deepcopy(base))
    model = _lora(copy.deepcopy(base))
    args = dict(COMMON, max_steps=3)
    t_ref = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "a"), **args),
                    train_dataset=TinyDataset("gpt2"))
    t_ref.train()
    t = StrongholdTrainer(model=model, args=StrongholdTrainingArguments(output_dir=str(tmp_path / "b"), stronghold=True,
                                                                        stronghold_window_size="1", **args),
                          train_dataset=TinyDataset("gpt2"))
    t.train()
    assert _losses(t) == pytest.approx(_losses(t_ref), rel=1e-4)
    engine = t.stronghold_engine
    stats = engine.memory_stats()
    # Only the adapters have masters, gradients and Adam state; the base streams its bytes.
    lora_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert stats["offloaded_trainable_params"] == lora_params
    n_tensors = sum(1 for n, _ in model.named_parameters() if "lora_" in n)
    assert stats["optimizer_state_bytes"] == 8 * lora_params + 4 * n_tensors  # moments + a step count each
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-4, msg=lambda m: f"{n}: {m}")
    merged_ref = ref.merge_and_unload()
    merged = model.merge_and_unload()
    sd, sd_ref = merged.state_dict(), merged_ref.state_dict()
    assert sd.keys() == sd_ref.keys()
    for k, v in sd_ref.items():
        torch.testing.assert_close(sd[k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    b = batch("gpt2", seed=3)
    with torch.no_grad():  # the merged weights reached the masters: the offloaded forward uses them
        torch.testing.assert_close(merged(**b).logits, merged_ref(**b).logits, rtol=1e-4, atol=1e-5)


def test_lora_on_an_offloaded_bf16_base_keeps_the_base_in_bf16():
    base = tiny_model("llama")
    base.to(torch.bfloat16)
    torch.manual_seed(0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()  # adapters in fp32, base in bf16: the usual QLoRA-style split
    engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype="fp32"), device="cpu")
    assert get_engine(model) is engine
    frozen = [e for b in engine.blocks for e in b.layout.entries if not e.trainable]
    assert frozen and all(e.device_dtype == torch.bfloat16 for e in frozen)
    opt = engine.build_optimizer(lr=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss0 = model(**batch("llama", seed=0)).loss
    loss0.backward()
    opt.step()
    engine.synchronize()
    assert torch.isfinite(loss0)


def test_lora_on_a_mixture_of_experts_router_trains_like_plain_peft_in_tiles():
    """LoRA on every linear map of a Mixtral, its router's bare weight included: PEFT puts
    torch's parametrization class over the router's for each forward, while sequence tiling
    has its own class over it (tiling.py; the attention tiling's probe runs the block first);
    the router's call is left whole and keeps PEFT's class, and three steps with sequence and
    attention tiling in tiles of 4 tokens match plain PEFT."""
    import transformers as T

    from test_more_families import _losses as three_steps

    torch.manual_seed(0)
    config = T.MixtralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=64, vocab_size=128, num_local_experts=4, num_experts_per_tok=2)
    base = peft.get_peft_model(T.AutoModelForCausalLM.from_config(config),
                               peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert any(type(m).__name__ == "ParamWrapper" for m in base.modules())  # LoRA on the router's parameter
    base.train()
    reference = copy.deepcopy(base)
    want = three_steps(reference, torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2,
                                                    weight_decay=0.01), "AutoModelForCausalLM")
    model = copy.deepcopy(base)
    engine = offload_model(model, StrongholdConfig(window_size=1, sequence_tiling=True, attention_tiling=True, tile_tokens=4), device="cpu")
    got = three_steps(model, engine.build_optimizer(lr=1e-2, weight_decay=0.01), "AutoModelForCausalLM")
    engine.close()
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


class _Labelled(torch.utils.data.Dataset):
    """Sequences with one class label each (right-padded; the classifier reads the last real token)."""

    def __init__(self, n: int = 16, num_labels: int = 3):
        self.items = []
        for i in range(n):
            b = batch("llama", seed=i, batch_size=1)
            self.items.append({"input_ids": b["input_ids"][0], "attention_mask": b["attention_mask"][0],
                               "labels": torch.tensor(i % num_labels)})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_lora_for_sequence_classification_trains_its_head_and_saves_like_plain_peft(tmp_path):
    """The usual PEFT fine-tune of a classifier: LoRA with ``task_type="SEQ_CLS"``, which also
    trains a copy of the new head (PEFT's ``modules_to_save``), through the Trainer. Same losses
    and weights as the plain Trainer; the saved adapter holds the trained head and the adapters,
    and loads onto a fresh base to the same logits."""
    from transformers import AutoModelForSequenceClassification

    config = tiny_model("llama").config
    config.num_labels, config.pad_token_id = 3, 0

    def classifier():
        torch.manual_seed(0)
        base = AutoModelForSequenceClassification.from_config(config)
        torch.manual_seed(1)
        return peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                                                         target_modules=["q_proj", "v_proj"], init_lora_weights=False))

    ref, model = classifier(), classifier()
    t_ref = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "a"), **COMMON), train_dataset=_Labelled())
    t_ref.train()
    t = StrongholdTrainer(model=model, args=StrongholdTrainingArguments(output_dir=str(tmp_path / "b"), stronghold=True,
                                                                        stronghold_window_size="1", **COMMON),
                          train_dataset=_Labelled())
    t.train()
    assert _losses(t) == pytest.approx(_losses(t_ref), rel=1e-4)
    head = [n for n, p in model.named_parameters() if p.requires_grad and "modules_to_save" in n]
    assert head, "PEFT did not make the head trainable"
    stats = t.stronghold_engine.memory_stats()
    assert stats["offloaded_trainable_params"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-4, msg=lambda m: f"{n}: {m}")
    untrained = classifier().base_model.model.score.original_module.weight.detach().clone()
    assert not torch.allclose(model.base_model.model.score.modules_to_save["default"].weight.detach(), untrained)

    t.save_model(str(tmp_path / "adapter"))
    t_ref.save_model(str(tmp_path / "adapter_ref"))
    b = {k: v for k, v in batch("llama", seed=5).items() if k != "labels"}
    logits = {}
    for name in ("adapter", "adapter_ref"):
        torch.manual_seed(0)
        fresh = AutoModelForSequenceClassification.from_config(config)
        loaded = peft.PeftModel.from_pretrained(fresh, str(tmp_path / name)).eval()
        with torch.no_grad():
            logits[name] = loaded(**b).logits
    torch.testing.assert_close(logits["adapter"], logits["adapter_ref"], rtol=1e-4, atol=1e-5)
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits["adapter"], ref(**b).logits, rtol=1e-4, atol=1e-5)


class _AdaLoraAllocation:
    """What PEFT asks of a training loop with AdaLoRA: ``update_and_allocate`` right after each
    optimizer step, which reads every adapter's ``p * p.grad`` (its importance)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class AdaLoraAllocation(TrainerCallback):
            def on_optimizer_step(self, args, state, control, model=None, **kwargs):
                model.base_model.update_and_allocate(state.global_step)

        return AdaLoraAllocation()


def test_adalora_reads_the_gradients_after_the_step_and_allocates_ranks_like_plain_peft(tmp_path):
    """torch leaves ``.grad`` in place after ``optimizer.step()``, and AdaLoRA's rank allocation
    reads it there (as does any callback's ``on_optimizer_step``): the engine's step leaves the
    host gradients on show, so the same ranks are pruned and the adapters train alike. (Without
    clipping: the engine's ``.grad`` is the gradient before the clip coefficient.)"""
    def adalora(model):
        config = peft.AdaLoraConfig(init_r=6, target_r=2, tinit=1, tfinal=2, deltaT=1, total_step=6,
                                    target_modules=["c_attn"], task_type="CAUSAL_LM")
        return peft.get_peft_model(model, config)

    untrained = adalora(tiny_model("gpt2", n_layer=3))  # its adapters start random: one draw for both runs
    args = dict(COMMON, max_steps=6, max_grad_norm=0.0)
    runs = {}
    for name, (trainer_cls, args_cls, extra) in {
            "plain": (Trainer, TrainingArguments, {}),
            "stronghold": (StrongholdTrainer, StrongholdTrainingArguments,
                           dict(stronghold=True, stronghold_window_size="1"))}.items():
        model = copy.deepcopy(untrained)
        t = trainer_cls(model=model, args=args_cls(output_dir=str(tmp_path / name), **args, **extra),
                        train_dataset=TinyDataset("gpt2"), callbacks=[_AdaLoraAllocation()])
        t.train()
        runs[name] = (t, model)
    (t_ref, ref), (t, model) = runs["plain"], runs["stronghold"]
    assert get_engine(model) is not None
    assert _losses(t) == pytest.approx(_losses(t_ref), rel=1e-4)
    masks = {n: p.detach() == 0 for n, p in ref.named_parameters() if "lora_E" in n}
    assert any(m.any() for m in masks.values())  # the allocation pruned ranks in the plain run
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("unfrozen, vocab", [("model.embed_tokens", 4096), ("model.layers.0", 128)])
def test_unfreezing_after_offload_is_refused_before_the_forward_and_loses_nothing(tmp_path, unfrozen, vocab):
    """Gradual unfreezing on one Trainer: a parameter frozen when the model was offloaded has no
    gradient layout, master or Adam state. Unfrozen before a second ``train()``, it would crash
    a pieced vocabulary's backward, or take a gradient the clip norm never sees. The next
    training forward refuses it by name, and the weights are the first run's."""
    model = tiny_model("llama", vocab_size=vocab)
    model.get_submodule(unfrozen).requires_grad_(False)
    args = StrongholdTrainingArguments(output_dir=str(tmp_path), stronghold=True, stronghold_window_size="1",
                                       **dict(COMMON, max_steps=2))
    t = StrongholdTrainer(model=model, args=args, train_dataset=TinyDataset("llama"))
    t.train()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.get_submodule(unfrozen).requires_grad_(True)
    with pytest.raises(RuntimeError, match=rf"{unfrozen}\.\S+ .* was frozen when the model was offloaded and requires "
                                           r"grad now.*before the Trainer is built"):
        t.train()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), trained[n]), n
    model.get_submodule(unfrozen).requires_grad_(False)  # frozen again: training goes on
    with torch.no_grad():
        model(**batch("llama", seed=0))  # and a forward without a graph never checks
    model.get_submodule(unfrozen).requires_grad_(True)
    with torch.no_grad():
        model(**batch("llama", seed=0))
    # A new Trainer on the same (offloaded) model is refused when it builds its optimizer.
    t = StrongholdTrainer(model=model, args=args, train_dataset=TinyDataset("llama"))
    with pytest.raises(ValueError, match=r"was frozen when the model was offloaded.*before the first Trainer is built"):
        t.train()
