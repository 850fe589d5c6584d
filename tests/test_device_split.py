"""What fits stays resident: the device/host split (``StrongholdConfig(resident, gpu_memory)``).

A resident unit keeps its parameters, gradients and Adam state on the device, stepped by the
device AdamW; the rest streams. Each split must train like an untouched copy with torch AdamW,
keep the device within ``gpu_memory``, cut the traffic and the CPU Adam work as it grows,
and let a checkpoint written under one split resume under another. The CPU device stands in
for the GPU: with a ``gpu_memory`` budget the same split is chosen there.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments

from stronghold_hf import StrongholdConfig, StrongholdTrainer, StrongholdTrainingArguments, get_engine, offload_model
from test_non_block_units import BIG_VOCAB, _lm_loss, _pair, _train_both
from test_trainer import COMMON, TinyDataset
from tiny_models import batch, tiny_model

WHOLE = "1GB"  # far more than any tiny model needs: everything stays on the device

FAMILIES = {
    "gpt2": dict(**BIG_VOCAB),  # tied wte / lm_head, streamed as one unit used at both ends
    "llama": dict(tie_word_embeddings=False, **BIG_VOCAB),
    "t5": {},
    "bert": {},
}


@pytest.mark.parametrize("split", [dict(resident=1), dict(resident=2), dict(gpu_memory=WHOLE)],
                         ids=["one-block", "two-blocks", "whole"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parity_in_every_split(family, split):
    ref, model, engine = _pair(lambda: tiny_model(family, **FAMILIES[family]), window_size=1, **split)
    stats = engine.memory_stats()
    if "resident" in split:
        assert stats["split_resident_blocks"] == split["resident"]
    else:
        assert engine.units == [] and stats["offloaded_params"] == 0  # nothing streams
    _train_both(ref, model, engine, _lm_loss(family))
    stats = engine.memory_stats()
    kept = stats["split_resident_params"]
    assert kept > 0 and stats["offloaded_trainable_params"] == stats["model_trainable_params"] - kept


def test_one_device_figure_counts_the_resident_units_and_their_state():
    """``device_total_peak_bytes`` is everything the engine holds on the device: with nothing
    resident it is the window's peak; with one block resident it adds that block's fp32
    parameters, their gradients and both Adam moments (16 B per parameter) after a step."""
    for ref, model, engine in (streamed_pair := _pair(lambda: tiny_model("llama"), window_size=1, resident=False),
                               _pair(lambda: tiny_model("llama"), window_size=1, resident=1)):
        _train_both(ref, model, engine, _lm_loss("llama"), steps=1)
    streamed = streamed_pair[2]
    s, r = streamed.memory_stats(), engine.memory_stats()
    assert s["device_total_peak_bytes"] == s["device_peak_bytes"] > 0
    kept = r["split_resident_params"]
    assert kept > 0 and r["device_optimizer_bytes"] >= 8 * kept  # two fp32 moments, and the step counts
    assert r["device_total_peak_bytes"] == (r["device_peak_bytes"] + r["device_parameter_bytes"]
                                            + 4 * kept + r["device_optimizer_bytes"])
    assert r["device_total_peak_bytes"] - r["device_peak_bytes"] >= 16 * kept
    assert r["device_allocator_peak_bytes"] == 0  # a CPU device has no allocator to ask


def test_everything_streams_on_a_cpu_device_unless_given_a_budget():
    _, _, engine = _pair(lambda: tiny_model("gpt2"), window_size=1)
    stats = engine.memory_stats()
    assert engine.split.streams_everything and stats["split_resident_units"] == 0
    assert stats["split_budget_bytes"] == 0 and engine.resident_parameters() == []
    _, _, off = _pair(lambda: tiny_model("gpt2"), window_size=1, resident=False, gpu_memory=WHOLE)
    assert off.split.streams_everything


def _budget_range(make):
    """Budgets from below the all-streamed window to above the whole model."""
    streamed = offload_model(make(), StrongholdConfig(window_size=1, resident=False), device="cpu")
    whole = offload_model(make(), StrongholdConfig(window_size=1, gpu_memory=WHOLE), device="cpu")
    low, high = streamed.split.streamed_bytes, whole.split.resident_bytes
    assert streamed.split.streams_everything and whole.units == []
    return [low] + [int(low + (high - low) * f) for f in (0.2, 0.4, 0.6, 0.8)] + [int(high * 1.05)]


def test_auto_keeps_what_fits_and_the_device_stays_within_gpu_memory():
    make = lambda: tiny_model("gpt2", n_layer=4, **BIG_VOCAB)  # noqa: E731
    kept, h2d = [], []
    for budget in _budget_range(make):
        model = make()
        engine = offload_model(model, StrongholdConfig(window_size=1, gpu_memory=budget), device="cpu")
        opt = engine.build_optimizer(lr=1e-2)
        for step in range(2):
            model(**batch("gpt2", seed=step)).loss.backward()
            engine.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)  # keeps the resident gradients: the peak holds them
        engine.synchronize()
        stats = engine.memory_stats()
        assert stats["device_total_peak_bytes"] <= budget, (budget, stats)
        kept.append(stats["split_resident_params"])
        h2d.append(stats["h2d_bytes"])
    assert kept[0] == 0 and kept == sorted(kept) and kept[-1] == sum(p.numel() for p in make().parameters())
    assert len(set(kept)) >= 4  # the budgets in between keep something in between
    assert h2d == sorted(h2d, reverse=True) and h2d[-1] == 0


def test_auto_keeps_the_small_rest_and_the_tied_embedding_before_the_blocks():
    make = lambda: tiny_model("gpt2", n_layer=4, **BIG_VOCAB)  # noqa: E731
    budgets = _budget_range(make)
    engine = offload_model(make(), StrongholdConfig(window_size=1, gpu_memory=budgets[2]), device="cpu")
    resident = engine.split.resident
    assert any(name.startswith("<non-block parameters") for name in resident) and "transformer.wte" in resident
    blocks = [name for name in resident if name.startswith("transformer.h.")]
    assert blocks == [f"transformer.h.{i}" for i in range(len(blocks))]  # the first in forward order


def test_traffic_and_cpu_adam_fall_with_the_resident_share():
    make = lambda: tiny_model("gpt2", n_layer=4)  # noqa: E731
    per_step, cpu_adam, device_state = [], [], []
    for resident in range(5):
        model = make()
        engine = offload_model(model, StrongholdConfig(window_size=1, resident=resident), device="cpu")
        opt = engine.build_optimizer(lr=1e-2)
        for step in range(2):
            model(**batch("gpt2", seed=step)).loss.backward()
            opt.step()
            opt.zero_grad()
        engine.synchronize()
        stats = engine.memory_stats()
        per_step.append((stats["h2d_bytes"] + stats["d2h_bytes"]) / 2)
        cpu_adam.append(stats["offloaded_trainable_params"])
        device_state.append(stats["device_optimizer_bytes"])
    assert all(a > b for a, b in zip(per_step, per_step[1:])), per_step
    assert all(a > b for a, b in zip(cpu_adam, cpu_adam[1:])), cpu_adam
    assert all(a < b for a, b in zip(device_state, device_state[1:])), device_state


def _state_by_name(opt) -> dict[str, dict[str, torch.Tensor]]:
    sd = opt.state_dict()
    out = {}
    for i, name in enumerate(sd["cpu_names"] or []):
        if i in sd["cpu"]["state"]:
            out[name] = sd["cpu"]["state"][i]
    for j, (name, _, _) in enumerate(sd["device_pieces"]):
        if j in sd["device"]["state"]:
            out[name] = sd["device"]["state"][j]
    return out


@pytest.mark.parametrize("before, after", [(dict(resident=False), dict(resident=2)),
                                           (dict(resident=2), dict(resident=False)),
                                           (dict(gpu_memory=WHOLE), dict(resident=1))],
                         ids=["streamed-to-two", "two-to-streamed", "whole-to-one"])
def test_a_checkpoint_resumes_under_another_split_bit_for_bit(before, after):
    """The Adam state of every parameter moves between CPU Adam and the device AdamW unchanged,
    and training goes on as it would have."""
    ref = tiny_model("gpt2", n_layer=3, **BIG_VOCAB)
    first = copy.deepcopy(ref)
    engine = offload_model(first, StrongholdConfig(window_size=1, **before), device="cpu")
    opt = engine.build_optimizer(lr=1e-2, weight_decay=0.01)
    for step in range(4):
        if step == 2:
            saved_state, saved_weights = opt.state_dict(), engine.full_state_dict()
            second = copy.deepcopy(ref)
            second.load_state_dict(saved_weights)
            engine2 = offload_model(second, StrongholdConfig(window_size=1, **after), device="cpu")
            opt2 = engine2.build_optimizer(lr=1e-2, weight_decay=0.01)
            assert not opt2.layout_matches(saved_state)
            opt2.load_state_dict(saved_state)
            want, got = _state_by_name(opt), _state_by_name(opt2)
            assert want.keys() == got.keys() and len(want) == sum(1 for _ in ref.parameters())
            for name, st in want.items():
                assert float(got[name]["step"]) == float(st["step"]) == 2
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(got[name][key].cpu().reshape(-1), st[key].reshape(-1)), (name, key)
        for m, e, o in [(first, engine, opt)] + ([(second, engine2, opt2)] if step >= 2 else []):
            m(**batch("gpt2", seed=step)).loss.backward()
            e.clip_grad_norm_(1.0)
            o.step()
            o.zero_grad()
    engine.synchronize()
    engine2.synchronize()
    a, b = engine.full_state_dict(), engine2.full_state_dict()
    for k in a:  # the global norm sums in another order under another split: Adam's slack only
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=0.02 * 1e-2 * 2, msg=lambda m: f"{k}: {m}")


def test_an_old_checkpoint_under_another_split_is_refused_by_name():
    _, _, engine = _pair(lambda: tiny_model("gpt2"), window_size=1)
    opt = engine.build_optimizer(lr=1e-2)
    model = engine.model
    model(**batch("gpt2", seed=0)).loss.backward()
    opt.step()
    state = opt.state_dict()
    for key in ("cpu_names", "device_pieces"):
        del state[key]  # what a checkpoint of the previous release holds
    _, _, other = _pair(lambda: tiny_model("gpt2"), window_size=1, resident=2)
    opt2 = other.build_optimizer(lr=1e-2)
    with pytest.raises(ValueError, match="param group|parameter"):
        opt2.load_state_dict(state)


@pytest.mark.parametrize("config, match", [
    (dict(resident=-1), "resident"), (dict(resident="yes"), "resident"), (dict(resident=1.5), "resident"),
    (dict(gpu_memory="lots"), "gpu_memory"), (dict(gpu_memory=0), "gpu_memory"),
])
def test_bad_split_settings_are_refused_by_name(config, match):
    with pytest.raises(ValueError, match=match):
        StrongholdConfig(**config)


def test_a_fixed_split_that_does_not_fit_the_budget_is_refused_before_anything_moves():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match=r"resident=3.*gpu_memory allows"):
        offload_model(model, StrongholdConfig(window_size=1, resident=3, gpu_memory=4096), device="cpu")
    assert get_engine(model) is None and all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_a_budget_below_the_streamed_window_is_refused_by_name():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match=r"gpu_memory=4096\) is below what streaming alone needs"):
        offload_model(model, StrongholdConfig(window_size=1, gpu_memory=4096), device="cpu")
    assert get_engine(model) is None


def test_bf16_trainable_blocks_stream_under_auto_and_are_refused_by_count():
    make = lambda: tiny_model("gpt2").to(torch.bfloat16)  # noqa: E731
    engine = offload_model(make(), StrongholdConfig(window_size=1, gpu_memory=WHOLE), device="cpu")
    assert engine.split.resident_blocks == 0 and len(engine.blocks) == 3
    with pytest.raises(ValueError, match="not fp32"):
        offload_model(make(), StrongholdConfig(window_size=1, resident=1), device="cpu")


def test_lora_on_a_frozen_base_with_resident_blocks():
    peft = pytest.importorskip("peft")

    def make():
        base = tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                              task_type="CAUSAL_LM")
        return peft.get_peft_model(base, cfg)

    ref, model, engine = _pair(make, window_size=1, resident=2)
    assert engine.split.resident_blocks == 2
    _train_both(ref, model, engine, _lm_loss("llama"))
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)


def test_the_nvme_tier_of_the_streamed_part_is_bit_identical(tmp_path):
    def train(**extra):
        model = tiny_model("gpt2", n_layer=3)
        engine = offload_model(model, StrongholdConfig(window_size=1, resident=1, **extra), device="cpu")
        opt = engine.build_optimizer(lr=1e-2)
        for step in range(3):
            model(**batch("gpt2", seed=step)).loss.backward()
            engine.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        return engine.full_state_dict()

    ram, disk = train(), train(nvme_path=str(tmp_path))
    for k in ram:
        assert torch.equal(ram[k], disk[k]), k


def test_close_gives_back_a_plain_model_from_any_split():
    for split in (dict(resident=1), dict(gpu_memory=WHOLE)):
        ref, model, engine = _pair(lambda: tiny_model("gpt2"), window_size=1, **split)
        _train_both(ref, model, engine, _lm_loss("gpt2"), steps=1)
        engine.close()
        assert get_engine(model) is None
        torch.testing.assert_close(model(**batch("gpt2", seed=5)).loss, ref(**batch("gpt2", seed=5)).loss,
                                   rtol=1e-4, atol=1e-5)


def _args(tmp_path, name, config=None, **extra):
    argv = ["--output_dir", str(tmp_path / name)]
    if config is not None:
        argv += ["--stronghold", "--stronghold_window_size", "1", "--stronghold_config", json.dumps(config)]
    for key, value in {**COMMON, **extra}.items():
        if key == "report_to":
            argv += ["--report_to", "none"]
        else:
            argv += [f"--{key}", str(value)]
    (args,) = HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses(argv)
    return args


def test_trainer_command_line_split_matches_plain_and_resumes_under_another(tmp_path):
    """``--stronghold_config '{"gpu_memory": ...}'`` keeps the whole model resident and trains like
    the plain Trainer; a checkpoint it writes resumes under ``{"resident": 1}``."""
    plain = Trainer(model=tiny_model("gpt2"), args=TrainingArguments(output_dir=str(tmp_path / "plain"), **COMMON),
                    train_dataset=TinyDataset("gpt2"))
    plain.train()
    whole = StrongholdTrainer(model=tiny_model("gpt2"), train_dataset=TinyDataset("gpt2"),
                              args=_args(tmp_path, "whole", {"gpu_memory": WHOLE}, save_strategy="steps",
                                         save_steps=2))
    whole.train()
    assert whole.stronghold_engine.units == []
    fit = whole._stronghold_fit.estimate(seq_len=16, batch_size=2)  # the start-up fit check counts the same split
    assert fit.resident_params_on_gpu == sum(p.numel() for p in tiny_model("gpt2").parameters())
    assert fit.cpu_master_bytes == 0 and "whole model" in fit.split
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(whole) == pytest.approx(losses(plain), rel=1e-5)
    resumed = StrongholdTrainer(model=tiny_model("gpt2"), train_dataset=TinyDataset("gpt2"),
                                args=_args(tmp_path, "resumed", {"resident": 1}))
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert resumed.stronghold_engine.split.resident_blocks == 1
    assert losses(resumed) == pytest.approx(losses(whole), rel=1e-5)


@pytest.mark.parametrize("param_dtype", [None, "bf16"])
def test_the_estimator_counts_the_split_as_the_ledger_does(param_dtype):
    """Host bytes fall by what the split keeps, and the GPU side holds it with its AdamW state,
    as the engine allocates them (within 5%, as for an everything-streamed run)."""
    from stronghold_hf.estimate import estimate_for_model
    from test_memory_ledger import _train_one_step

    dtype = "fp32" if param_dtype is None else "bf16"
    make = lambda: tiny_model("llama", num_hidden_layers=4, hidden_size=128, intermediate_size=256,  # noqa: E731
                              vocab_size=4096, tie_word_embeddings=False)
    common = dict(seq_len=16, batch_size=2, dtype=dtype, gpu_memory_bytes=1 << 40, cpu_memory_bytes=1 << 40,
                  window_size=3, grad_buffers=1)
    streamed = estimate_for_model(make(), **common)
    est = estimate_for_model(make(), resident=2, **common)
    assert est.resident_units == 2 and streamed.resident_units == 0
    assert est.cpu_bytes_needed < streamed.cpu_bytes_needed and est.gpu_split_bytes > 0
    stats, _ = _train_one_step(make(), StrongholdConfig(window_size=3, param_dtype=param_dtype, grad_buffers=1,
                                                        host_grads="compute", resident=2))
    ledger_host = stats["pinned_host_bytes"] + stats["pageable_host_bytes"]
    estimated = est.cpu_bytes_needed - est.cpu_process_bytes
    assert abs(estimated - ledger_host) <= 0.05 * ledger_host, (estimated, ledger_host)
    device = stats["device_peak_bytes"] + stats["device_parameter_bytes"] + stats["device_grad_bytes"] + stats[
        "device_optimizer_bytes"]
    autocast_copy = est.gpu_split_bytes - stats["split_resident_bytes"]  # 16-bit compute: autocast's weight copies
    assert autocast_copy == (2 * stats["split_resident_params"] if param_dtype else 0)
    assert abs(est.gpu_engine_bytes - autocast_copy - device) <= 0.05 * device, (est.gpu_engine_bytes, device)
    auto = estimate_for_model(make(), resident="auto", **common)
    assert auto.resident_params_on_gpu == sum(p.numel() for p in make().parameters()) and auto.cpu_master_bytes == 0


def test_a_whole_resident_model_computes_its_loss_as_plain_training_does():
    """``chunked_loss="auto"``: with the whole model on the device the head is not recomputed
    and the logits are whole, as in plain training; asked for, the chunks stay."""
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1, gpu_memory=WHOLE, loss_chunk_tokens=4), device="cpu")
    assert engine.chunked_loss is None and model(**batch("gpt2", seed=0)).logits is not None
    streamed = offload_model(tiny_model("gpt2"), StrongholdConfig(window_size=1, resident=1), device="cpu")
    assert streamed.chunked_loss is not None
    chunked = tiny_model("gpt2")
    forced = offload_model(chunked, StrongholdConfig(window_size=1, gpu_memory=WHOLE, chunked_loss=True,
                                                     loss_chunk_tokens=4), device="cpu")
    assert forced.chunked_loss is not None and chunked(**batch("gpt2", seed=0)).logits is None


def test_a_partly_kept_group_counts_each_parameter_where_it_is():
    """A bf16 norm weight next to its fp32 bias: the fp32 part of the small rest can stay while the
    other streams; every parameter is either in a unit or on the device, never both."""
    model = tiny_model("gpt2")
    model.transformer.ln_f.weight.data = model.transformer.ln_f.weight.data.to(torch.bfloat16)
    engine = offload_model(model, StrongholdConfig(window_size=1, gpu_memory=WHOLE), device="cpu")
    for p in model.parameters():
        assert engine.is_offloaded(p) != (id(p) in engine.split.kept_param_ids)
    stats = engine.memory_stats()
    assert stats["split_resident_params"] == sum(p.numel() for p in engine.resident_parameters())
    assert "not fp32 stream" in engine.split.reason  # says why the bf16 one is not resident


def test_every_block_resident_with_a_streamed_head_and_the_default_window():
    """Only the untied LM head streams; window_size="auto" has no block to choose by."""
    make = lambda: tiny_model("llama", tie_word_embeddings=False, **BIG_VOCAB)  # noqa: E731
    whole = offload_model(make(), StrongholdConfig(gpu_memory=WHOLE), device="cpu").split.resident_bytes
    ref, model, engine = _pair(make, gpu_memory=int(whole * 0.95))
    assert engine.blocks == [] and [u.fqn for u in engine.units] == ["lm_head"]
    _train_both(ref, model, engine, _lm_loss("llama"))


def test_nvme_path_with_the_whole_model_resident_is_unused_not_refused(tmp_path):
    ref, model, engine = _pair(lambda: tiny_model("gpt2"), window_size=1, gpu_memory=WHOLE, nvme_path=str(tmp_path))
    opt = _train_both(ref, model, engine, _lm_loss("gpt2"), steps=2)
    assert opt.nvme is None and engine.memory_stats()["nvme_file_bytes"] == 0


def test_auto_leaves_the_trained_shapes_activations_room_on_the_gpu():
    """A GPT-2 1.5B shape at 8 x 2048 tokens with checkpointing on a 24 GiB GPU fits streamed; the
    split fills only what the activations leave, so the run still fits, and the Trainer hands that
    budget to the engine."""
    from transformers import GPT2Config

    from stronghold_hf.estimate import estimate

    config = GPT2Config(n_embd=1600, n_layer=48, n_head=25, n_positions=2048)
    common = dict(seq_len=2048, batch_size=8, gpu_memory_bytes=24 << 30, cpu_memory_bytes=512 << 30,
                  gradient_checkpointing=True)
    streamed = estimate(config, resident=False, **common)
    auto = estimate(config, resident="auto", **common)
    assert streamed.fits and auto.fits and 0 < auto.resident_units
    assert auto.gpu_bytes_needed <= 24 << 30 and auto.resident_budget_bytes < (24 << 30) - (2 << 30)
    assert auto.cpu_bytes_needed < streamed.cpu_bytes_needed
