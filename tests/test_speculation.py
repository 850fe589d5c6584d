"""Speculative CPU updates during backward: exact in every case, and they earn their keep.

A speculating engine starts each block's CPU Adam as soon as its gradient reaches the host,
guessing that the step will neither clip nor overflow, and validates the guess at
``optimizer.step()``. Each test trains an untouched copy next to it and compares losses,
gradient norms and final weights, for the cases where the guess holds and where it misses.
"""

from __future__ import annotations

import copy

import pytest
import torch

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.optim import cpu_adam as cpu_adam_module, undo_native
from stronghold_hf.optim.cpu_adam import CPUAdam
from stronghold_hf.speculation import SpeculationPolicy, undo_adamw_
from stronghold_hf.testing import simulated_device
from tiny_models import batch, tiny_model

LR = 1e-2
SLACK = 0.02 * LR * 4  # Adam turns rounding noise of ~0 gradients into lr-sized steps (test_step.py)


def _pair(family, mode, steps, *, max_norm, accum=1, window_size=1, **cfg):
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=window_size, speculative_step=mode, **cfg), device="cpu")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    opt = engine.build_optimizer(lr=LR, weight_decay=0.1)
    for step in range(steps):
        for micro in range(accum):
            b = batch(family, seed=10 * step + micro)
            loss_ref, loss = ref(**b).loss / accum, model(**b).loss / accum
            assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-4)  # the suite's parity tolerance
            loss_ref.backward()
            loss.backward()
        if max_norm is not None:
            n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            n = engine.clip_grad_norm_(max_norm)
            assert float(n) == pytest.approx(float(n_ref), rel=1e-4)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    engine.synchronize()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-4, atol=SLACK, msg=lambda m: f"{k}: {m}")
    return engine


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_speculation_without_clipping_hits_and_is_exact(family):
    engine = _pair(family, "on", 4, max_norm=1e6)
    stats = engine.stats.as_dict()
    assert stats["speculated_blocks"] >= 4 * engine.num_blocks - (1 if family == "t5" else 0)
    assert stats["speculation_hits"] == 4 and stats["speculation_misses"] == 0
    assert stats["rollback_s"] == 0.0 or family == "t5"  # T5's late relative-bias gradient undoes block 0


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_speculation_with_active_clipping_rolls_back_and_is_exact(family, monkeypatch):
    """The first step knows no limit yet: every block is speculated, the step clips, each is
    rolled back and redone (in one fused pass: the redo reads the gradients the speculative
    update read). Its norm was far over ``max_norm`` (more than 1.25 times), so "on" does not
    speculate in the steps after it: no update is started only to be undone."""
    fused = []
    redo_groups = CPUAdam.redo_groups
    monkeypatch.setattr(CPUAdam, "redo_groups", lambda self, *a, **k: fused.append(redo_groups(self, *a, **k)) or fused[-1])
    engine = _pair(family, "on", 4, max_norm=0.05)
    if undo_native.native_undo_error() is None and cpu_adam_module.native_kernel_error() is None:
        assert fused and all(fused), fused  # every rolled-back block was redone in the same pass
    stats = engine.stats.as_dict()
    assert stats["speculation_misses"] == 1 and stats["speculation_hits"] == 0
    assert stats["rollback_s"] > 0
    assert stats["speculated_blocks"] <= len(engine.units) + 1  # the first step's, not four steps' worth


def test_speculation_under_gradient_accumulation_is_exact():
    """A plain loop cannot tell the engine which backward ends the window: the first
    micro-batch is speculated, the second one's gradient undoes it, the step redoes it."""
    engine = _pair("gpt2", "on", 3, max_norm=1e6, accum=2)
    assert engine.stats.as_dict()["rollback_s"] > 0


def test_speculation_with_delayed_copies_is_exact():
    with simulated_device(0.002):
        engine = _pair("gpt2", "on", 3, max_norm=1e6, window_size=2)
    assert engine.transfer.mode == "delayed" and engine.stats.as_dict()["speculation_hits"] == 3


def test_fp16_overflow_undoes_the_speculation_and_skips_everywhere():
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1, speculative_step="on"), device="cpu")
    opt = engine.build_optimizer(lr=LR, fp16_loss_scaling=True)
    for step in range(2):  # clean steps first, so speculation is running
        engine.scale_loss(model(**batch("gpt2", seed=step)).loss).backward()
        opt.step()
        opt.zero_grad()
    engine.synchronize()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.cpu_optimizer.state.items()}
    scale = engine.scaler.scale
    engine.scale_loss(model(**batch("gpt2", seed=7)).loss * float("inf")).backward()
    opt.step()
    engine.synchronize()
    assert opt.last_step_skipped and engine.scaler.scale == scale * 0.5
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")
    for p, s in opt.cpu_optimizer.state.items():
        for key, value in s.items():
            torch.testing.assert_close(value, state_before[id(p)][key], rtol=1e-5, atol=1e-9)


def test_auto_speculates_only_after_clean_steps():
    clipped = _pair("gpt2", "auto", 3, max_norm=0.05, window_size=1)
    assert clipped.stats.as_dict()["speculated_blocks"] == 0  # a plain loop never vouches for the step
    model = tiny_model("gpt2")
    # The host worker as on a GPU (on a CPU device "auto" runs host work inline and never speculates).
    engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="thread"), device="cpu")
    opt = engine.build_optimizer(lr=LR)
    engine.coordinator.step_signal = lambda: True  # what the Trainer and prepare_stronghold provide
    for max_norm in (0.05, 1e6, 1e6, 1e6):
        model(**batch("gpt2", seed=0)).loss.backward()
        engine.clip_grad_norm_(max_norm)
        opt.step()
        opt.zero_grad()
    stats = engine.stats.as_dict()
    # Step 1 has no history, step 2 follows a clipped step; steps 3 and 4 speculate and hit.
    assert stats["speculation_hits"] == 2 and stats["speculation_misses"] == 0
    assert engine.coordinator.policy.miss_rate == 0.0


def test_in_place_gradient_changes_after_speculation_are_refused():
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1, speculative_step="on"), device="cpu")
    opt = engine.build_optimizer(lr=LR)
    model(**batch("gpt2", seed=0)).loss.backward()
    engine.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # scales the host gradients in place
    with pytest.raises(RuntimeError, match="speculative"):
        opt.step()


def test_undo_inverts_a_cpu_adam_step():
    torch.manual_seed(0)
    params = [torch.randn(1000), torch.randn(37)]
    grads = [torch.randn_like(p) for p in params]
    opt = CPUAdam([{"params": params}], lr=1e-2, weight_decay=0.1)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()  # a first step creates the state
    saved = [p.clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    for g in grads:
        g.mul_(0.5)
    opt.step(inv_loss_scale=0.25)
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    undo_adamw_(params, grads, [opt.state[p] for p in params], hyper, grad_mul=0.25)
    for p, s, before in zip(params, saved, state):
        torch.testing.assert_close(p, s, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], before[key], rtol=1e-5, atol=1e-9)


def test_trainer_speculates_on_the_last_micro_batch_and_matches_plain_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments
    from test_trainer import COMMON, TinyDataset

    kw = dict(COMMON, max_grad_norm=1e6, max_steps=5)  # no clipping: the guess holds from step 2 on
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    t_ref = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "a"), **kw),
                    train_dataset=TinyDataset("gpt2"))
    t_ref.train()
    t = StrongholdTrainer(model=model, args=StrongholdTrainingArguments(output_dir=str(tmp_path / "b"), stronghold=True,
                                                                        stronghold_window_size="1",
                                                                        stronghold_config={"host_worker": "thread"}, **kw),
                          train_dataset=TinyDataset("gpt2"))
    t.train()
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert losses == pytest.approx([h["loss"] for h in t_ref.state.log_history if "loss" in h], rel=1e-4)
    policy = t.stronghold_engine.coordinator.policy
    assert policy.hits == 4 and policy.misses == 0  # accumulation: only the window's last micro-batch speculates
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-4, atol=SLACK, msg=lambda m: f"{k}: {m}")


def test_fp16_scaled_loss_with_speculation_is_exact():
    """The flushed norms are of the scaled gradient: the pass must not think it will clip (and
    skip its speculative updates) when only the scale is large; a skipped one is applied."""
    results = []
    for mode in ("off", "on"):
        model = tiny_model("gpt2")
        engine = offload_model(model, StrongholdConfig(window_size=1, speculative_step=mode), device="cpu")
        opt = engine.build_optimizer(lr=LR, fp16_loss_scaling=True)
        for step in range(4):
            engine.scale_loss(model(**batch("gpt2", seed=step)).loss).backward()
            engine.clip_grad_norm_(1e3)
            opt.step()
            opt.zero_grad()
        engine.synchronize()
        results.append((model.state_dict(), engine.stats.as_dict()))
    (ref, _), (got, stats) = results
    assert stats["speculation_hits"] >= 2
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_a_skipped_step_after_speculation_undoes_exactly():
    """Speculated, then no step: zero_grad(set_to_none=False) must undo with the gradient the
    update read, before it zeroes it."""
    results = []
    for mode in ("off", "on"):
        model = tiny_model("gpt2")
        engine = offload_model(model, StrongholdConfig(window_size=1, speculative_step=mode), device="cpu")
        opt = engine.build_optimizer(lr=LR)
        for step in range(3):
            model(**batch("gpt2", seed=step)).loss.backward()
            if step == 1:
                opt.zero_grad(set_to_none=False)  # this step is dropped
                continue
            opt.step()
            opt.zero_grad()
        engine.synchronize()
        results.append(model.state_dict())
    for k, v in results[0].items():
        # Undo rounding on ~0 gradients stays far below the 1e-2 an undo with a zeroed gradient gives.
        torch.testing.assert_close(results[1][k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")


def test_a_missed_speculation_leaves_no_image_to_refresh():
    """A miss undoes the speculative update and redoes it; the redo's copy-out rewrites the
    compute-dtype image, so the next forward's fetches convert nothing on the training thread
    (on the H200 a stale flag left after the redo cost 91 ms of copies per step)."""
    model = tiny_model("llama", num_hidden_layers=4)
    engine = offload_model(model, StrongholdConfig(window_size=1, speculative_step="on", param_dtype="bf16"),
                           device="cpu")
    assert engine.host_image
    opt = engine.build_optimizer(lr=LR)
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch("llama", seed=step)).loss
        loss.backward()
        for group in opt.param_groups:  # a new learning rate after the backward: every speculative update misses
            group["lr"] = LR / (step + 2)
        engine.clip_grad_norm_(1e6)
        opt.step()
        opt.zero_grad()
    engine.synchronize()
    stats = engine.stats.as_dict()
    assert stats["speculation_misses"] >= 2 and stats["rollback_s"] > 0
    assert stats["image_refreshes"] == 0



def test_a_tensor_learning_rate_filled_in_place_reaches_every_block_and_misses_the_guess():
    """A scheduler that fills a tensor lr in place (the user's group keeps the same tensor):
    the step sees the new value, every block is updated with it, and a speculative update made
    with the old one is not taken for a hit; matches torch's AdamW stepping the same lrs."""
    model = tiny_model("llama", num_hidden_layers=3)
    ref = copy.deepcopy(model)
    engine = offload_model(model, StrongholdConfig(window_size=1, speculative_step="on"), device="cpu")
    opt = engine.build_optimizer(lr=torch.tensor(LR))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    misses = 0
    for step in range(3):
        for m in (model, ref):
            m(**batch("llama", seed=step)).loss.backward()
        lr = LR / (step + 2)
        for group in opt.param_groups:
            group["lr"].fill_(lr)
        for group in opt_ref.param_groups:
            group["lr"] = lr
        engine.clip_grad_norm_(1e6)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        misses = engine.stats.as_dict()["speculation_misses"]
    engine.synchronize()
    assert all(float(g["lr"]) == pytest.approx(LR / 4) for g in opt.cpu_optimizer.param_groups)
    assert misses >= 1
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-4, atol=SLACK, msg=lambda m: f"{k}: {m}")

def test_on_keeps_speculating_just_over_the_clip_norm_and_stops_within_the_pass():
    """Each step is clipped by a little (its norm 1.1 times ``max_norm``), so "on" speculates in
    the next. The middle step's loss is ten times larger: its first fold already exceeds the
    last step's ``max_norm`` and the pass stops speculating; the step after it speculates
    again. Every speculated block is rolled back and redone exactly."""
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1, speculative_step="on"), device="cpu")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    opt = engine.build_optimizer(lr=LR, weight_decay=0.1)
    speculated = []
    for step, scale in enumerate((1.0, 10.0, 1.0)):
        before = engine.stats.as_dict()["speculated_blocks"]
        b = batch("gpt2", seed=step)
        (ref(**b).loss * scale).backward()
        (model(**b).loss * scale).backward()
        max_norm = float(engine.global_grad_norm()) / 1.1
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        engine.clip_grad_norm_(max_norm)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        speculated.append(engine.stats.as_dict()["speculated_blocks"] - before)
        assert engine.coordinator.policy.should_speculate()  # 1.1 <= 1.25: the next step speculates
    assert speculated[0] >= engine.num_blocks and speculated[2] >= engine.num_blocks, speculated
    assert speculated[1] == 0, speculated  # inline, the first fold crossed the limit
    engine.synchronize()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-4, atol=SLACK, msg=lambda m: f"{k}: {m}")


def test_on_does_not_speculate_right_after_a_step_far_over_the_clip_norm():
    policy = SpeculationPolicy("on")
    assert policy.should_speculate()  # no step yet
    policy.record_step(clean=False, speculated=True, hit=False, norm_ratio=1.2)
    assert policy.should_speculate()  # a little over: the next may not clip
    policy.record_step(clean=False, speculated=True, hit=False, norm_ratio=1.6)
    assert not policy.should_speculate()  # far over: the next nearly always clips too
    policy.record_step(clean=True, speculated=False, hit=False, norm_ratio=None)  # not clipped at all
    assert policy.should_speculate()
    assert not SpeculationPolicy("off").should_speculate()


def test_auto_speculates_only_with_a_margin_below_the_clip_norm():
    policy = SpeculationPolicy("auto")
    policy.record_step(clean=True, speculated=False, hit=False, norm_ratio=0.95)
    assert not policy.should_speculate()  # just under max_norm: the next step may well clip
    policy.record_step(clean=True, speculated=False, hit=False, norm_ratio=0.5)
    assert policy.should_speculate()
    policy.record_step(clean=True, speculated=False, hit=False, norm_ratio=None)  # not clipped at all
    assert policy.should_speculate()
    policy.record_step(clean=False, speculated=False, hit=False, norm_ratio=1.5)
    assert not policy.should_speculate()


def test_the_step_tells_the_policy_how_close_to_the_clip_norm_it_was():
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="thread"), device="cpu")
    opt = engine.build_optimizer(lr=LR)
    for ratio in (0.9, 0.5):
        model(**batch("gpt2", seed=0)).loss.backward()
        engine.clip_grad_norm_(float(engine.global_grad_norm()) / ratio)
        opt.step()
        opt.zero_grad()
        assert engine.coordinator.policy.last_norm_ratio == pytest.approx(ratio, rel=1e-3)
        assert engine.coordinator.policy.should_speculate() is (ratio <= 0.8)
    model(**batch("gpt2", seed=1)).loss.backward()
    opt.step()  # not clipped: no ratio
    assert engine.coordinator.policy.last_norm_ratio is None
