"""Parameters are always safe to touch: reading gives the current value, writing reaches the
masters, and `engine.close()` gives back an ordinary model.

This is what logging, EMA, weight-tying checks and PEFT's ``merge_and_unload`` do between
steps; on the old engine each of them crashed the process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from stronghold_hf import StrongholdConfig, get_engine, offload_model
from tiny_models import batch, tiny_model


def _train(model, opt, steps, family="gpt2", engine=None, autocast=False):
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch(family, seed=step)).loss
        loss.backward()
        if engine is not None:
            engine.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def _trained_pair(family="gpt2", steps=2):
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), steps, family)
    _train(model, engine.build_optimizer(lr=1e-2), steps, family, engine)
    engine.synchronize()
    return ref, model, engine


def test_reading_parameters_between_steps_gives_their_values():
    ref, model, engine = _trained_pair()
    total = sum(p.detach().double().sum() for p in model.parameters())
    total_ref = sum(p.detach().double().sum() for p in ref.parameters())
    assert float(total) == pytest.approx(float(total_ref), rel=1e-4)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.shape == q.shape and p.dtype == q.dtype, name
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-3, msg=lambda m: f"{name}: {m}")
    # EMA-style read of every parameter into a copy, and weight-norm logging.
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.isfinite(v).all() for v in ema.values())
    assert float(torch.stack([p.detach().norm() for p in model.parameters()]).norm()) > 0


def test_gradients_are_readable_and_plain_clipping_works():
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), engine.build_optimizer(lr=1e-2)
    for step in range(2):
        for m in (ref, model):
            m(**batch("gpt2", seed=step)).loss.backward()
            # What users write in a plain loop: torch's clip over model.parameters().
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    engine.synchronize()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-4, atol=1e-3, msg=lambda m: f"{k}: {m}")


def test_a_plain_torch_optimizer_over_model_parameters_trains():
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 3, "llama")
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 3, "llama")
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-4, atol=1e-3, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("param_dtype", [None, "bf16"])
@pytest.mark.parametrize("how", ["inplace", "data_inplace", "data_assign"])
def test_writes_between_steps_reach_the_masters(param_dtype, how):
    family = "llama"
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype=param_dtype), device="cpu")
    opt = engine.build_optimizer(lr=1e-2)
    _train(model, opt, 1, family, engine, autocast=param_dtype is not None)
    engine.synchronize()
    target = model.model.layers[1].mlp.up_proj.weight
    expected = target.detach().clone() + 0.5
    with torch.no_grad():
        if how == "inplace":
            target.add_(0.5)
        elif how == "data_inplace":  # PEFT's merge: weight.data += delta
            target.data += 0.5
            if param_dtype is not None:
                engine.mark_parameters_changed()  # a .data alias bumps no version counter
        else:  # PEFT's safe merge: weight.data = new tensor
            target.data = target.data + 0.5
    torch.testing.assert_close(model.state_dict()["model.layers.1.mlp.up_proj.weight"], expected)
    # The next forward computes with the written value: compare with a plain model holding it.
    plain = tiny_model(family)
    plain.load_state_dict(model.state_dict())
    b = batch(family, seed=9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype is not None):
        got, want = model(**b).loss, plain(**b).loss
    tol = 2e-2 if param_dtype else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=0)
    assert engine.blocks[1].params[0].data_ptr() == engine.blocks[1].host.param_views[0].data_ptr()


def test_state_dict_and_named_parameters_between_steps():
    ref, model, engine = _trained_pair("t5")
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]
    sd = model.state_dict()
    assert sd.keys() == ref.state_dict().keys()
    assert all(v.device.type == "cpu" for v in sd.values())


def test_close_gives_back_an_ordinary_model(tmp_path):
    ref, model, engine = _trained_pair("llama")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    returned = engine.close(device="cpu")
    assert returned is model and get_engine(model) is None and engine.closed
    assert engine.close() is model  # idempotent
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    for p in model.parameters():
        assert p.untyped_storage().nbytes() >= p.numel() * p.element_size()
    b = batch("llama", seed=5)
    plain = tiny_model("llama")
    plain.load_state_dict(expected)
    torch.testing.assert_close(model(**b).loss, plain(**b).loss, rtol=1e-6, atol=0)
    model(**b).loss.backward()  # an ordinary module: plain autograd, no hooks left
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, expected[k]), k
    # The model can be offloaded again.
    again = offload_model(model, StrongholdConfig(window_size=2), device="cpu")
    torch.testing.assert_close(model(**b).loss, plain(**b).loss, rtol=1e-6, atol=0)
    again.close()


def test_close_keeps_the_stored_dtype_of_frozen_parameters():
    model = tiny_model("gpt2")
    for p in model.transformer.h[0].parameters():
        p.requires_grad_(False)
    model.transformer.h[1].to(torch.bfloat16)
    for p in model.transformer.h[1].parameters():
        p.requires_grad_(False)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    assert model.transformer.h[1].mlp.c_fc.weight.dtype == torch.bfloat16  # stored bytes only, no fp32 master
    engine.close()
    assert model.transformer.h[1].mlp.c_fc.weight.dtype == torch.bfloat16
    assert model.transformer.h[0].mlp.c_fc.weight.dtype == torch.float32
