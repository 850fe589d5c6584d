"""Checkpointed activations on the host (``offload_activations``), on the CPU path.

With gradient checkpointing each block keeps its input for backward. With offload on, the
input leaves the device during forward and comes back one block ahead of its backward; the
ledger counts the inputs the engine holds on the device, so the CPU run shows the device peak
flat with depth (and growing with depth when offload is off). Training stays exact.
"""

from __future__ import annotations

import copy

import pytest
import torch

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.testing import simulated_device
from tiny_models import batch, engine_losses, tiny_model

LR = 1e-2


def _checkpointed(family, reentrant=False, **kw):
    model = tiny_model(family, **kw)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def _train(model, engine, family, steps=2, seq=16):
    return engine_losses(model, engine, family, lr=LR, steps=steps, seq=seq)


def _train_ref(model, family, steps=2, seq=16):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(steps):
        loss = model(**batch(family, seed=step, seq=seq)).loss
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_offloaded_checkpoints_train_exactly(family, reentrant):
    ref = _checkpointed(family, reentrant, **({"num_layers": 3, "num_decoder_layers": 3} if family == "t5" else {}))
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=True), device="cpu")
    losses = _train(model, engine, family)
    assert losses == pytest.approx(_train_ref(ref, family), rel=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=4e-4, msg=lambda m: f"{name}: {m}")
    stats = engine.memory_stats()
    assert stats["activation_host_bytes"] > 0 and stats["activation_device_bytes"] == 0


def test_offloaded_checkpoints_under_delayed_copies():
    with simulated_device(0.002):
        ref = _checkpointed("llama", num_hidden_layers=4)
        model = copy.deepcopy(ref)
        engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=True), device="cpu")
        assert engine.transfer.mode == "delayed"
        losses = _train(model, engine, "llama")
    assert losses == pytest.approx(_train_ref(ref, "llama"), rel=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=4e-4, msg=lambda m: f"{name}: {m}")


def _activation_peak(layers, offload):
    model = _checkpointed("llama", num_hidden_layers=layers, hidden_size=64, intermediate_size=128)
    engine = offload_model(model, StrongholdConfig(window_size=2, offload_activations=offload), device="cpu")
    _train(model, engine, "llama", steps=2, seq=32)
    stats = engine.memory_stats()
    return stats["activation_device_peak_bytes"], stats


def test_the_activation_device_peak_is_flat_with_depth_when_offloaded():
    shallow, stats4 = _activation_peak(4, True)
    deep, stats16 = _activation_peak(16, True)
    assert shallow > 0 and deep <= 1.2 * shallow, (shallow, deep)
    one = 2 * 32 * 64 * 4  # one checkpointed input: batch 2 x 32 tokens x hidden 64, fp32
    assert deep <= (2 + 2) * one  # the W kept at the turn, plus one on its way back
    assert stats16["activation_host_bytes"] >= (16 - 2) * one


def test_without_offload_the_ledger_shows_the_peak_growing_with_depth():
    shallow, _ = _activation_peak(4, False)
    deep, stats = _activation_peak(16, False)
    assert deep >= 3.5 * shallow, (shallow, deep)
    assert stats["activation_host_bytes"] == 0


def test_nothing_is_counted_without_checkpointing():
    model = tiny_model("llama")
    engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=True), device="cpu")
    _train(model, engine, "llama", steps=1)
    stats = engine.memory_stats()
    assert stats["activation_device_peak_bytes"] == 0 and stats["activation_host_bytes"] == 0


def test_a_retained_graph_unpacks_offloaded_inputs_twice():
    ref = _checkpointed("gpt2", n_layer=4)
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=True), device="cpu")
    b = batch("gpt2", seed=0)
    for m in (ref, model):
        loss = m(**b).loss
        loss.backward(retain_graph=True)
        loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_auto_stays_off_on_a_cpu_device():
    model = _checkpointed("llama", num_hidden_layers=4)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    assert engine.config.offload_activations == "auto"
    _train(model, engine, "llama", steps=1)
    assert engine.memory_stats()["activation_host_bytes"] == 0


def test_config_rejects_other_values():
    with pytest.raises(ValueError, match="offload_activations"):
        StrongholdConfig(offload_activations="yes")
