"""`StrongholdTrainer` against the plain HF `Trainer` on the same seed and data (CPU)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers
from transformers import HfArgumentParser, Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from stronghold_hf import (
    StrongholdSeq2SeqTrainer,
    StrongholdSeq2SeqTrainingArguments,
    StrongholdTrainer,
    StrongholdTrainingArguments,
)
from tiny_models import batch, is_seq2seq, tiny_model

ADAM_SLACK = 0.02 * 1e-2 * 4  # see test_step.py: Adam amplifies rounding noise of ~0 gradients


class TinyDataset(torch.utils.data.Dataset):
    def __init__(self, family: str, n: int = 16, padded: bool = True):
        self.items = []
        for i in range(n):
            b = batch(family, seed=i, batch_size=1)
            item = {k: v[0] for k, v in b.items()}
            if not padded:
                item["attention_mask"] = torch.ones_like(item["attention_mask"])
                if "labels" in item and not is_seq2seq(family):
                    item["labels"] = item["input_ids"].clone()
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


COMMON = dict(
    per_device_train_batch_size=2, per_device_eval_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
    learning_rate=1e-2, weight_decay=0.1, warmup_steps=1, lr_scheduler_type="linear", max_grad_norm=1.0,
    logging_steps=1, report_to=[], seed=0, save_strategy="no", use_cpu=True, dataloader_num_workers=0,
    disable_tqdm=True,
)


def _classes(family):
    if is_seq2seq(family):
        return Seq2SeqTrainer, Seq2SeqTrainingArguments, StrongholdSeq2SeqTrainer, StrongholdSeq2SeqTrainingArguments
    return Trainer, TrainingArguments, StrongholdTrainer, StrongholdTrainingArguments


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "t5", "opt", "qwen2"])
def test_trainer_parity(family, tmp_path):
    base_t, base_a, sh_t, sh_a = _classes(family)
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    t_ref = base_t(model=ref, args=base_a(output_dir=str(tmp_path / "ref"), **COMMON), train_dataset=TinyDataset(family))
    t_ref.train()
    args = sh_a(output_dir=str(tmp_path / "sh"), stronghold=True, stronghold_window_size="1", **COMMON)
    t = sh_t(model=model, args=args, train_dataset=TinyDataset(family))
    t.train()
    assert _losses(t) == pytest.approx(_losses(t_ref), rel=1e-4)
    norms = [h["grad_norm"] for h in t.state.log_history if "grad_norm" in h]
    norms_ref = [h["grad_norm"] for h in t_ref.state.log_history if "grad_norm" in h]
    assert norms == pytest.approx(norms_ref, rel=1e-4)
    sd, sd_ref = model.state_dict(), ref.state_dict()
    for k, v in sd_ref.items():
        torch.testing.assert_close(sd[k], v, rtol=1e-4, atol=ADAM_SLACK, msg=lambda m: f"{k}: {m}")
    logged = [h for h in t.state.log_history if "loss" in h][-1]
    for key in ("stronghold_window_size", "stronghold_h2d_GBps", "stronghold_d2h_GBps", "stronghold_blocked_ms",
                "stronghold_cpu_adam_ms"):
        assert key in logged
    assert logged["stronghold_window_size"] == 1


def test_without_flag_is_bitwise_trainer(tmp_path):
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "a"), **COMMON), train_dataset=TinyDataset("gpt2")).train()
    t = StrongholdTrainer(model=model, args=StrongholdTrainingArguments(output_dir=str(tmp_path / "b"), **COMMON),
                          train_dataset=TinyDataset("gpt2"))
    t.train()
    assert t.stronghold_engine is None
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_gradient_checkpointing_and_eval(tmp_path):
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    kw = dict(COMMON, gradient_checkpointing=True)
    t_ref = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "a"), **kw),
                    train_dataset=TinyDataset("llama"), eval_dataset=TinyDataset("llama", n=8))
    t_ref.train()
    t = StrongholdTrainer(model=model, args=StrongholdTrainingArguments(output_dir=str(tmp_path / "b"), stronghold=True, **kw),
                          train_dataset=TinyDataset("llama"), eval_dataset=TinyDataset("llama", n=8))
    t.train()
    assert _losses(t) == pytest.approx(_losses(t_ref), rel=1e-4)
    assert t.evaluate()["eval_loss"] == pytest.approx(t_ref.evaluate()["eval_loss"], rel=1e-4)
    pred, pred_ref = t.predict(TinyDataset("llama", n=4)), t_ref.predict(TinyDataset("llama", n=4))
    torch.testing.assert_close(torch.as_tensor(pred.predictions), torch.as_tensor(pred_ref.predictions), rtol=1e-3, atol=1e-3)
    assert t.stronghold_engine.resident_blocks() == []


def test_seq2seq_predict_with_generate(tmp_path):
    ref = tiny_model("t5")
    model = copy.deepcopy(ref)
    kw = dict(COMMON, predict_with_generate=True, generation_max_length=6)
    t_ref = Seq2SeqTrainer(model=ref, args=Seq2SeqTrainingArguments(output_dir=str(tmp_path / "a"), **kw))
    t = StrongholdSeq2SeqTrainer(model=model, args=StrongholdSeq2SeqTrainingArguments(
        output_dir=str(tmp_path / "b"), stronghold=True, **kw))
    data = TinyDataset("t5", n=4)
    out, out_ref = t.predict(data), t_ref.predict(data)
    assert (out.predictions == out_ref.predictions).all()


def test_save_model_loads_without_stronghold(tmp_path):
    model = tiny_model("gpt2")
    t = StrongholdTrainer(model=model, args=StrongholdTrainingArguments(output_dir=str(tmp_path), stronghold=True, **COMMON),
                          train_dataset=TinyDataset("gpt2"))
    t.train()
    t.save_model(str(tmp_path / "final"))
    assert not any(name.startswith(".stronghold") for name in os.listdir(tmp_path / "final"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def _resume_args(tmp_path, name, **extra):
    kw = dict(COMMON, max_steps=6, save_strategy="steps", save_steps=3, **extra)
    return StrongholdTrainingArguments(output_dir=str(tmp_path / name), stronghold=True, **kw)


def test_resume_matches_uninterrupted(tmp_path):
    full = tiny_model("gpt2")
    StrongholdTrainer(model=full, args=_resume_args(tmp_path, "full"), train_dataset=TinyDataset("gpt2")).train()
    # Same run, stopped after the checkpoint at step 3, then resumed in a fresh trainer.
    first = tiny_model("gpt2")
    StrongholdTrainer(model=first, args=_resume_args(tmp_path, "split"), train_dataset=TinyDataset("gpt2")).train()
    ckpt = tmp_path / "split" / "checkpoint-3"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "scheduler.pt").is_file()
    resumed = tiny_model("gpt2", seed=123)  # different init: everything must come from the checkpoint
    t = StrongholdTrainer(model=resumed, args=_resume_args(tmp_path, "resumed"), train_dataset=TinyDataset("gpt2"))
    t.train(resume_from_checkpoint=str(ckpt))
    for k, v in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    opt_state = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    assert opt_state["stronghold_format"] == 1 and opt_state["cpu"]["state"]


def test_interrupted_checkpoint_leaves_previous_usable(tmp_path, monkeypatch):
    args = _resume_args(tmp_path, "crash")
    t = StrongholdTrainer(model=tiny_model("gpt2"), args=args, train_dataset=TinyDataset("gpt2"))
    original = StrongholdTrainer._save_optimizer_and_scheduler
    calls = {"n": 0}

    def crash_on_second(self, output_dir):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (simulated)")
        return original(self, output_dir)

    monkeypatch.setattr(StrongholdTrainer, "_save_optimizer_and_scheduler", crash_on_second)
    with pytest.raises(OSError, match="simulated"):
        t.train()
    out = tmp_path / "crash"
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-3")
    assert not (out / "checkpoint-6").exists()
    monkeypatch.setattr(StrongholdTrainer, "_save_optimizer_and_scheduler", original)
    t2 = StrongholdTrainer(model=tiny_model("gpt2"), args=_resume_args(tmp_path, "crash"), train_dataset=TinyDataset("gpt2"))
    t2.train(resume_from_checkpoint=True)
    assert t2.state.global_step == 6


def test_command_line_flags(tmp_path):
    parser = HfArgumentParser(StrongholdTrainingArguments)
    base = ["--output_dir", str(tmp_path)]
    (a,) = parser.parse_args_into_dataclasses(base + ["--stronghold", "--stronghold_window_size", "auto"])
    assert a.stronghold and a.stronghold_config_resolved.window_size == "auto"
    (a,) = parser.parse_args_into_dataclasses(base + ["--stronghold", "--stronghold_window_size", "3"])
    assert a.stronghold_config_resolved.window_size == 3
    (a,) = parser.parse_args_into_dataclasses(base + ["--stronghold", "--stronghold_config", '{"window_size": 2}'])
    assert a.stronghold_config_resolved.window_size == 2
    cfg_file = tmp_path / "sh.json"
    cfg_file.write_text(json.dumps({"window_size": 4, "cpu_threads": 1}))
    (a,) = parser.parse_args_into_dataclasses(base + ["--stronghold_config", str(cfg_file), "--stronghold_window_size", "2"])
    assert a.stronghold_config_resolved.window_size == 2 and a.stronghold_config_resolved.cpu_threads == 1


def test_env_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("STRONGHOLD", "1")
    monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", "4")
    a = StrongholdTrainingArguments(output_dir=str(tmp_path))
    assert a.stronghold and a.stronghold_config_resolved.window_size == 4


@pytest.mark.parametrize("argv, match", [
    (["--stronghold", "--stronghold_window_size", "0"], "stronghold_window_size"),
    (["--stronghold", "--stronghold_window_size", "big"], "stronghold_window_size"),
    (["--stronghold", "--stronghold_config", '{"windw": 1}'], "windw"),
    (["--stronghold", "--fsdp", "full_shard"], "--fsdp"),
])
def test_bad_arguments_refused_at_parse_time(argv, match, tmp_path):
    parser = HfArgumentParser(StrongholdTrainingArguments)
    with pytest.raises(ValueError, match=match):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)] + argv)


def test_deepspeed_refused(tmp_path):
    with pytest.raises(ValueError, match="--deepspeed"):
        StrongholdTrainingArguments(output_dir=str(tmp_path), stronghold=True, deepspeed={"zero_optimization": {"stage": 2}})


def test_custom_optimizer_refused_before_training(tmp_path):
    model = tiny_model("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="builds its own optimizer"):
        StrongholdTrainer(model=model, args=StrongholdTrainingArguments(output_dir=str(tmp_path), stronghold=True),
                          optimizers=(opt, None))
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters()), "nothing was offloaded"


def test_run_that_cannot_fit_is_refused_before_allocation(tmp_path, monkeypatch):
    import stronghold_hf.estimate as est

    monkeypatch.setattr(est, "available_cpu_memory_bytes", lambda: 1 << 10)  # a 1 KiB machine
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="(?i)cpu"):
        StrongholdTrainer(model=model, args=StrongholdTrainingArguments(output_dir=str(tmp_path), stronghold=True))
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters()), "nothing was offloaded"
    # check_fit=False lets the user override the estimate.
    StrongholdTrainer(model=model, args=StrongholdTrainingArguments(
        output_dir=str(tmp_path), stronghold=True, stronghold_config={"check_fit": False}))


def test_bf16_trainer_on_cpu_with_layernorm_model(tmp_path):
    """CPU autocast keeps LayerNorm in the input dtype, so device copies stay fp32 on CPU."""
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    kw = dict(COMMON, bf16=True)
    t_ref = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "a"), **kw), train_dataset=TinyDataset("gpt2"))
    t_ref.train()
    t = StrongholdTrainer(model=model, args=StrongholdTrainingArguments(output_dir=str(tmp_path / "b"), stronghold=True, **kw),
                          train_dataset=TinyDataset("gpt2"))
    t.train()
    assert all(b.layout.grad_dtype == torch.float32 for b in t.stronghold_engine.blocks)
    # Same weights, same autocast: only reassociation separates the two runs.
    assert _losses(t) == pytest.approx(_losses(t_ref), rel=1e-3)
