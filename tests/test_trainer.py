"""`StrongholdTrainer` against the plain HF `Trainer` on the same seed and data (CPU)."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
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
    # Four keys by default, beside the loss (log_metrics="all": test_the_full_set_of_keys_on_request).
    assert {k for k in logged if k.startswith("stronghold_")} == {
        "stronghold_window_size", "stronghold_device_peak_GiB", "stronghold_host_bytes_per_param", "stronghold_waits_ms"}
    # The ledger in the logs: 16 B per offloaded parameter with fp32 compute, plus bounded staging.
    assert 16.0 <= logged["stronghold_host_bytes_per_param"] < 24.0
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


def test_checkpoints_on_nvme_through_the_command_line(tmp_path):
    """``--stronghold_config '{"nvme_path": ..., "nvme_activations": true}'`` with
    ``--gradient_checkpointing``: the checkpointed inputs go through the file, and the run
    trains as the plain Trainer does."""
    ref = tiny_model("llama", hidden_size=64, intermediate_size=128)
    model = copy.deepcopy(ref)
    kw = dict(COMMON, gradient_checkpointing=True)
    t_ref = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "a"), **kw),
                    train_dataset=TinyDataset("llama"))
    t_ref.train()
    argv = ["--output_dir", str(tmp_path / "b"), "--stronghold", "--stronghold_window_size", "1", "--stronghold_config",
            json.dumps({"nvme_path": str(tmp_path / "nvme"), "nvme_activations": True})]
    for key, value in kw.items():
        argv += ["--report_to", "none"] if key == "report_to" else [f"--{key}", str(value)]
    (args,) = HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses(argv)
    t = StrongholdTrainer(model=model, args=args, train_dataset=TinyDataset("llama"))
    t.train()
    assert _losses(t) == pytest.approx(_losses(t_ref), rel=1e-4)
    assert t.stronghold_engine.memory_stats()["activation_disk_peak_bytes"] > 0


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


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    """``--load_best_model_at_end``: evaluation and saving every 2 steps, and "best" made the
    *highest* eval loss (``--greater_is_better``), so the best checkpoint is the first one and
    not the trained model; at the end the Trainer loads it into the offloaded model, which then
    evaluates as that checkpoint did, exactly as the plain Trainer's model."""
    argv = ["--use_cpu", "--max_steps", "8", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4",
            "--learning_rate", "0.05", "--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "steps",
            "--save_steps", "2", "--save_total_limit", "2", "--load_best_model_at_end", "--metric_for_best_model",
            "loss", "--greater_is_better", "true", "--report_to", "none", "--seed", "0", "--disable_tqdm", "true"]
    runs = {}
    for name, trainer_class, args_class, extra in [
            ("plain", Trainer, TrainingArguments, []),
            ("stronghold", StrongholdTrainer, StrongholdTrainingArguments, ["--stronghold", "--stronghold_window_size", "1"])]:
        (args,) = HfArgumentParser(args_class).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path / name), *argv, *extra])
        trainer = trainer_class(model=tiny_model("gpt2"), args=args, train_dataset=TinyDataset("gpt2"),
                                eval_dataset=TinyDataset("gpt2", n=8))
        trainer.train()
        evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        runs[name] = (evals, trainer.state.best_model_checkpoint, trainer.evaluate()["eval_loss"])
    (evals, best, final), (ref_evals, ref_best, ref_final) = runs["stronghold"], runs["plain"]
    assert evals == pytest.approx(ref_evals, rel=1e-4)
    assert max(evals) > evals[-1], "the last checkpoint is the best: nothing to restore"
    assert os.path.basename(best) == os.path.basename(ref_best)
    assert final == pytest.approx(max(evals), rel=1e-5) and final == pytest.approx(ref_final, rel=1e-4)


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
    assert not (out / ".stronghold-staging").exists()
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
    import stronghold_hf.estimate.api as est  # where estimate_for_model looks it up

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


# ---------------------------------------------------------------------------- start-up items
def _info_lines(logger_names=("transformers", "stronghold_hf")):
    """Collects INFO+ records of the given loggers (transformers does not propagate to root)."""
    import logging

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect(level=logging.INFO)
    loggers = [logging.getLogger(n) for n in logger_names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)

    def restore():
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)

    return records, restore


def test_staging_folder_removed_and_not_logged(tmp_path):
    records, restore = _info_lines()
    try:
        t = StrongholdTrainer(model=tiny_model("gpt2"), args=_resume_args(tmp_path, "run"), train_dataset=TinyDataset("gpt2"))
        t.train()
        t.save_model(str(tmp_path / "final"))
    finally:
        restore()
    out = tmp_path / "run"
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-6"]
    assert not [line for line in records if ".stronghold" in line], "a staging folder name reached the INFO log"
    saves = [line for line in records if line.startswith("Saving model checkpoint to")]
    assert saves == [f"Saving model checkpoint to {out / 'checkpoint-3'}", f"Saving model checkpoint to {out / 'checkpoint-6'}",
                     f"Saving model checkpoint to {tmp_path / 'final'}"]


def test_staging_folder_removed_when_a_save_fails(tmp_path, monkeypatch):
    def fail(self, output_dir):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(StrongholdTrainer, "_save_optimizer_and_scheduler", fail)
    t = StrongholdTrainer(model=tiny_model("gpt2"), args=_resume_args(tmp_path, "run"), train_dataset=TinyDataset("gpt2"))
    with pytest.raises(OSError, match="simulated"):
        t.train()
    assert os.listdir(tmp_path / "run") == []


class _LongDataset(torch.utils.data.Dataset):
    """Causal-LM examples of a given length (ids only: cheap even when long)."""

    def __init__(self, seq: int, n: int = 4, draws_randomness: bool = False):
        self.seq, self.n, self.draws = seq, n, draws_randomness

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.draws:
            torch.rand(1)  # e.g. random masking in the dataset itself
            __import__("random").random()
        ids = torch.arange(self.seq) % 90 + 3
        return {"input_ids": ids, "labels": ids.clone()}


class _IterableLongDataset(torch.utils.data.IterableDataset):
    def __init__(self, seq: int, n: int = 8):
        self.inner = _LongDataset(seq, n)

    def __iter__(self):
        return (self.inner[i] for i in range(len(self.inner)))


GPU_CAP = 5 * 2**29  # simulated device memory: the 2 GiB reserve + room for short sequences
#: SDPA (what tiny Llama runs) stores no s x s scores: 64k tokens at batch 2 exceed the cap, 4k fit.


@pytest.fixture
def gpu_cap(monkeypatch):
    """The fit check sees a GPU of `GPU_CAP` bytes (this machine has none, so it would skip it)."""
    import stronghold_hf.estimate as est

    real = est.estimate_for_model

    def capped(model, **kwargs):
        return real(model, **{**kwargs, "gpu_memory_bytes": GPU_CAP})

    monkeypatch.setattr(est, "estimate_for_model", capped)
    return real


def _long_context_llama():
    return tiny_model("llama", max_position_embeddings=131072)  # as on Llama 3


def _fit_args(tmp_path, cls=StrongholdTrainingArguments, **extra):
    return cls(output_dir=str(tmp_path), stronghold=True, **dict(COMMON, max_steps=1, **extra))


def test_fit_check_uses_the_trained_length_not_max_position_embeddings(tmp_path, gpu_cap):
    model = _long_context_llama()
    at_max = gpu_cap(model, seq_len=131072, batch_size=2, gpu_memory_bytes=GPU_CAP)
    assert not at_max.fits, "the test needs a cap that max_position_embeddings would exceed"
    t = StrongholdTrainer(model=model, args=_fit_args(tmp_path), train_dataset=_LongDataset(12))
    assert t.stronghold_engine is not None
    t.stronghold_engine.close()
    model = _long_context_llama()
    with pytest.raises(ValueError, match="does not fit.*GPU memory"):
        StrongholdTrainer(model=model, args=_fit_args(tmp_path), train_dataset=_LongDataset(65536))
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters()), "nothing was offloaded"


def test_fit_check_prefers_the_length_in_the_arguments(tmp_path, gpu_cap):
    from dataclasses import dataclass

    @dataclass
    class ArgsWithLength(StrongholdTrainingArguments):
        max_length: int = 65536  # as TRL's SFTConfig.max_length

    with pytest.raises(ValueError, match="does not fit.*GPU memory"):
        StrongholdTrainer(model=_long_context_llama(), args=_fit_args(tmp_path, ArgsWithLength),
                          train_dataset=_LongDataset(12))


def test_fit_check_waits_for_the_first_batch_of_an_iterable_dataset(tmp_path, gpu_cap):
    model = _long_context_llama()
    forwards = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    t = StrongholdTrainer(model=model, args=_fit_args(tmp_path), train_dataset=_IterableLongDataset(65536))
    with pytest.raises(ValueError, match="does not fit.*GPU memory"):
        t.train()
    assert forwards == [], "the check must run before the first forward"
    t = StrongholdTrainer(model=_long_context_llama(), args=_fit_args(tmp_path), train_dataset=_IterableLongDataset(12))
    t.train()
    assert t.state.global_step == 1


def test_fit_check_reads_the_dataset_without_moving_the_rngs(tmp_path):
    import random

    def draws_after(cls, args):
        cls(model=tiny_model("gpt2"), args=args, train_dataset=_LongDataset(12, draws_randomness=True))
        return torch.rand(3), random.random()

    plain = draws_after(Trainer, TrainingArguments(output_dir=str(tmp_path), **COMMON))
    ours = draws_after(StrongholdTrainer, StrongholdTrainingArguments(output_dir=str(tmp_path), stronghold=True, **COMMON))
    assert torch.equal(ours[0], plain[0]) and ours[1] == plain[1]


@contextlib.contextmanager
def trainer_log():
    """The messages transformers' Trainer logger writes at INFO inside the block (a list)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    trainer_logger = logging.getLogger("transformers.trainer")
    level = trainer_logger.level
    trainer_logger.addHandler(handler)
    trainer_logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        trainer_logger.removeHandler(handler)
        trainer_logger.setLevel(level)


def test_start_line_says_stronghold_is_on(tmp_path):
    with trainer_log() as messages:
        StrongholdTrainer(model=tiny_model("gpt2"), args=StrongholdTrainingArguments(
            output_dir=str(tmp_path), stronghold=True, stronghold_window_size="2", **COMMON), train_dataset=TinyDataset("gpt2"))
    lines = [m for m in messages if "STRONGHOLD is on" in m]
    assert len(lines) == 1
    assert "3 blocks, window of 2" in lines[0] and "parameters offloaded" in lines[0] and "GiB of host memory" in lines[0]


def test_inference_only_models_prepared_next_to_the_trained_one_get_their_own_window(tmp_path, monkeypatch):
    """What TRL does with a reference model, a reward model or a teacher:
    ``accelerator.prepare_model(m, evaluation_mode=True)``. With STRONGHOLD on, such a model
    streams through its own frozen window; one without repeated blocks, and any model prepared
    for training, is placed on the device as without STRONGHOLD."""
    from stronghold_hf import get_engine

    t = StrongholdTrainer(model=tiny_model("gpt2"), args=StrongholdTrainingArguments(
        output_dir=str(tmp_path), stronghold=True, stronghold_window_size="1", **COMMON), train_dataset=TinyDataset("gpt2"))
    placements = []
    original = type(t.accelerator).prepare_model

    def recording(accelerator, model, device_placement=None, evaluation_mode=False):
        placements.append((type(model).__name__, device_placement))
        return original(accelerator, model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    monkeypatch.setattr(type(t.accelerator), "prepare_model", recording)
    # create_accelerator_and_postprocess bound the original; rebuild the wrapper over the recorder
    t.create_accelerator_and_postprocess()

    reference = tiny_model("gpt2", seed=1)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    assert t.accelerator.prepare_model(reference, evaluation_mode=True) is reference
    engine = get_engine(reference)
    assert engine is not None and engine is not t.stronghold_engine
    assert not any(p.requires_grad for p in reference.parameters())
    assert engine.memory_stats()["offloaded_trainable_params"] == 0
    with torch.no_grad():
        out = reference(**batch("gpt2", seed=0)).logits
    ref_copy = tiny_model("gpt2", seed=1)
    with torch.no_grad():
        torch.testing.assert_close(out, ref_copy(**batch("gpt2", seed=0)).logits)
    for k, v in reference.state_dict().items():
        assert torch.equal(v, before[k]), k

    reward_head = torch.nn.Linear(8, 1)  # no repeated blocks: placed whole
    t.accelerator.prepare_model(reward_head, evaluation_mode=True)
    trained_elsewhere = tiny_model("gpt2", seed=2)  # prepared for training: placed, not windowed
    t.accelerator.prepare_model(trained_elsewhere)
    assert get_engine(reward_head) is None and get_engine(trained_elsewhere) is None
    t.accelerator.prepare_model(t.model)  # the trained model: never placed by accelerate
    # Data loaders still deliver on the device (TRL feeds prepared batches straight to a reference model).
    loader = t.accelerator.prepare_data_loader(torch.utils.data.DataLoader(TinyDataset("gpt2", n=4), batch_size=2))
    assert loader.device == t.args.device
    assert placements == [("GPT2LMHeadModel", False), ("Linear", True), ("GPT2LMHeadModel", True),
                          ("GPT2LMHeadModel", False)]


def test_an_inference_only_model_of_another_architecture_ignores_the_trained_models_block_classes(tmp_path):
    from stronghold_hf import get_engine

    args = StrongholdTrainingArguments(output_dir=str(tmp_path), stronghold=True, stronghold_window_size="1",
                                       stronghold_config={"block_classes": ["GPT2Block"]}, **COMMON)
    t = StrongholdTrainer(model=tiny_model("gpt2"), args=args, train_dataset=TinyDataset("gpt2"))
    teacher = tiny_model("llama")
    t.accelerator.prepare_model(teacher, evaluation_mode=True)
    engine = get_engine(teacher)
    assert engine is not None and engine.num_blocks == 3 and engine.blocks[0].fqn == "model.layers.0"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_full_set_of_keys_on_request_and_one_summary_at_the_end(tmp_path):
    """A run says what it did (#43): one start line, the full set of keys with
    ``--stronghold_config '{"log_metrics": "all"}'``, in binary units, and one summary line when
    training ends, naming the device."""
    (args,) = HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses(args=[
        "--output_dir", str(tmp_path), "--stronghold", "--stronghold_config", '{"log_metrics": "all"}',
        "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "2", "--use_cpu",
        "--report_to", "none", "--save_strategy", "no"])
    trainer_logger = logging.getLogger("transformers.trainer")  # transformers' loggers do not propagate
    handler, level = _Lines(), trainer_logger.level
    trainer_logger.addHandler(handler)
    trainer_logger.setLevel(logging.INFO)
    try:
        t = StrongholdTrainer(model=tiny_model("gpt2"), args=args, train_dataset=TinyDataset("gpt2"))
        t.train()
    finally:
        trainer_logger.removeHandler(handler)
        trainer_logger.setLevel(level)
    logged = [h for h in t.state.log_history if "loss" in h][-1]
    for key in ("stronghold_h2d_GiBps", "stronghold_d2h_GiBps", "stronghold_cpu_adam_ms", "stronghold_pinned_host_GiB",
                "stronghold_pageable_host_GiB", "stronghold_fetches", "stronghold_host_blocks",
                "stronghold_promises_broken", "stronghold_device_peak_GiB", "stronghold_waits_ms"):
        assert key in logged, key
    assert logged["stronghold_promises_broken"] == 0
    assert not any(k.endswith(("_MiB", "_GBps")) for k in logged)  # one unit system
    lines = handler.lines
    starts = [ln for ln in lines if ln.startswith("STRONGHOLD is on")]
    ends = [ln for ln in lines if ln.startswith("STRONGHOLD done")]
    assert len(starts) == 1 and len(ends) == 1, lines
    assert "cpu (no GPU" in starts[0] and "GiB" in starts[0] and " GB " not in starts[0]
    assert "device peak" in ends[0] and "B per offloaded parameter" in ends[0] and "fetches per step" in ends[0]
    # A tiny model's peak (a few MiB) is said in significant digits, not rounded to nothing.
    assert t.stronghold_engine.memory_stats()["device_total_peak_bytes"] > 0 and "device peak 0.00 GiB" not in ends[0]


def test_a_failed_runs_own_error_is_the_one_raised_when_cleaning_up_after_it_fails_too(tmp_path, monkeypatch):
    """A run cut off mid-pass can leave the engine in a state its cleanup trips over; the user
    sees the run's error (the cleanup's is logged), not the cleanup's."""

    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise ValueError("the run's own error")

    args = StrongholdTrainingArguments(output_dir=str(tmp_path), stronghold=True, **dict(COMMON, max_steps=2))
    t = StrongholdTrainer(model=tiny_model("gpt2"), args=args, train_dataset=TinyDataset("gpt2"), callbacks=[Boom()])

    def broken_cleanup():
        raise AssertionError("the cleanup's error")

    monkeypatch.setattr(t.stronghold_engine, "shutdown_workers", broken_cleanup)
    with pytest.raises(ValueError, match="the run's own error"):
        t.train()
