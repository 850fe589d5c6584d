"""The GPU promises, asserted on CPU through the engine's memory ledger.

On a CPU-only machine the device and the host are the same memory, so only the ledger
(every buffer the engine allocates, booked on CPU and CUDA alike) can show that device
memory does not grow with depth, that at most ``W + 1`` slots and ``K`` gradient buffers
exist, that the forward/backward turn moves nothing, and what the host pays per parameter.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.testing import simulated_device
from tiny_models import batch, tiny_model


def _train(model, engine, steps=2, seed=0, probe=None):
    opt = engine.build_optimizer(lr=1e-3)
    for step in range(steps):
        loss = model(**batch("gpt2", seed=seed + step, seq=16)).loss
        loss.backward()
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    engine.synchronize()
    return opt


def _gpt2(layers, width=64, **kw):
    return tiny_model("gpt2", n_layer=layers, n_embd=width, n_head=2, **kw)


def device_bound(stats, lanes):
    """Everything the engine may hold on the device at once: W+1 slots of the largest streamed
    units, K lanes, the resident unit and its own gradient buffer."""
    return (stats["window_bound_bytes"] + lanes * stats["grad_buffer_bytes"] + stats["rest_unit_bytes"]
            + stats["rest_grad_bytes"])


@pytest.mark.parametrize("window_size", [1, 2])
def test_device_peak_does_not_grow_with_depth(window_size):
    peaks = {}
    for layers in (4, 16):
        model = _gpt2(layers)
        engine = offload_model(model, StrongholdConfig(window_size=window_size, grad_buffers=2), device="cpu")
        _train(model, engine)
        stats = engine.memory_stats()
        peaks[layers] = stats["device_peak_bytes"]
        # The bound, from the layout: W+1 slots and K gradient buffers, plus the resident unit
        # (what is too small to stream) and its gradient, nothing else.
        assert stats["device_peak_bytes"] <= device_bound(stats, lanes=2), (layers, stats)
        assert stats["device_optimizer_bytes"] == 0 and engine.resident_parameters() == []
        assert stats["offloaded_trainable_params"] == stats["model_trainable_params"]
        assert stats["device_bytes"] == 0, "everything is back on the host between steps"
    assert peaks[16] <= 1.10 * peaks[4], peaks


def test_resident_and_in_flight_bounds_hold_at_every_hook():
    window, lanes = 2, 1
    model = _gpt2(8)
    engine = offload_model(model, StrongholdConfig(window_size=window, grad_buffers=lanes), device="cpu")
    seen = []

    def observe(*_args, **_kwargs):
        s = engine.memory_stats()
        seen.append((s["slots_in_use"], s["grads_in_flight"]))

    for b in engine.blocks:
        b.module.register_forward_pre_hook(lambda m, a: observe())
        b.module.register_forward_hook(lambda m, a, o: observe())
        b.module.register_full_backward_pre_hook(lambda m, g: observe())
        b.module.register_full_backward_hook(lambda m, gi, go: observe())
    _train(model, engine, steps=2)
    assert max(r for r, _ in seen) <= window + 1
    assert max(g for _, g in seen) <= lanes
    assert engine.grad_queue.peak_in_flight <= lanes
    assert max(r for r, _ in seen) >= window, "the window really slides"


@pytest.mark.parametrize("window_size", [1, 2, 3])
@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_each_block_crosses_once_per_direction_and_the_turn_is_free(window_size, grad_ckpt):
    """Per step: N fetches for forward, N - W for backward (the last W are resident at the turn),
    and one of the resident unit (the embeddings and the head, too small here to stream)."""
    layers = 6
    model = _gpt2(layers)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = offload_model(model, StrongholdConfig(window_size=window_size), device="cpu")
    opt = engine.build_optimizer(lr=1e-3)
    for step in range(3):
        before = engine.memory_stats()["fetches"]
        model(**batch("gpt2", seed=step, seq=16)).loss.backward()
        opt.step()
        opt.zero_grad()
        assert engine.memory_stats()["fetches"] - before == 2 * layers - window_size + 1
    # Every byte that crossed is a unit image or a gradient buffer (and, while the engine
    # speculates, each gradient's 4-byte squared norm).
    stats = engine.memory_stats()
    resident = engine.schedule.resident_unit
    assert stats["sequence_length"] == layers and resident is not None
    assert stats["h2d_bytes"] == 3 * ((2 * layers - window_size) * engine.blocks[0].slot_bytes + resident.slot_bytes)
    grad_bytes = 3 * (layers * engine.blocks[0].layout.grad_numel + resident.layout.grad_numel) * 4
    assert grad_bytes <= stats["d2h_bytes"] <= grad_bytes + 3 * (layers + 1) * 4



def test_the_per_period_traffic_is_the_ledgers_since_the_last_reset():
    """``engine.stats`` (what the Trainer logs every ``logging_steps`` and resets) reads its
    traffic from the ledger: after a reset it is 0, and over a step it is exactly the bytes the
    ledger booked in that step, in both directions."""
    layers = 4
    model = _gpt2(layers)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    opt = engine.build_optimizer(lr=1e-3)
    for step in range(2):
        engine.stats.reset()
        assert engine.stats.as_dict()["h2d_bytes"] == 0 and engine.stats.as_dict()["d2h_bytes"] == 0
        before = engine.memory_stats()
        model(**batch("gpt2", seed=step, seq=16)).loss.backward()
        opt.step()
        opt.zero_grad()
        after, period = engine.memory_stats(), engine.stats.as_dict()
        assert period["h2d_bytes"] == after["h2d_bytes"] - before["h2d_bytes"] > 0
        assert period["d2h_bytes"] == after["d2h_bytes"] - before["d2h_bytes"] > 0

def test_frozen_blocks_move_no_gradients():
    model = _gpt2(4)
    for p in model.transformer.h.parameters():
        p.requires_grad_(False)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    opt = engine.build_optimizer(lr=1e-3)
    model(**batch("gpt2", seed=0)).loss.backward()
    opt.step()
    stats = engine.memory_stats()
    # Only the trainable parameters outside the blocks (embeddings, final norm) send gradients
    # and keep Adam state; the frozen blocks stream their bytes and get no gradient buffer.
    resident = engine.schedule.resident_unit
    trainable = resident.layout.grad_numel
    assert stats["d2h_bytes"] == 4 * trainable and stats["offloaded_trainable_params"] == trainable
    assert stats["optimizer_state_bytes"] == 8 * trainable + 4 * len(resident.layout.trainable)
    assert stats["device_peak_bytes"] <= 2 * stats["slot_bytes"] + stats["rest_unit_bytes"] + \
        stats["rest_grad_bytes"]
    assert engine.grad_queue.max_bytes == 0


def _staging(engine):
    queues = [engine.grad_queue, engine.schedule.gradients.resident_queue]
    return sum(q._num_lanes * (q.staging_bytes + 64) for q in queues if q is not None and q.max_bytes)


def _host_bytes_per_param(stats, staging):
    return (stats["pinned_host_bytes"] + stats["pageable_host_bytes"] - staging) / stats["offloaded_params"]


@pytest.mark.parametrize("family, param_dtype, host_grads, budget", [
    ("gpt2", None, "auto", 16.0), ("llama", "bf16", "auto", 18.0), ("llama", "bf16", "compute", 16.0)])
def test_host_bytes_per_parameter(family, param_dtype, host_grads, budget):
    """16 B/param with fp32 compute (master 4 + grad 4 + Adam 8), 18 with bf16 and fp32 host
    gradients (+ the bf16 image; offload_model's "auto"), 16 with bf16 gradients ("compute")."""
    kw = dict(n_layer=4, n_embd=128, n_head=2) if family == "gpt2" else dict(num_hidden_layers=4, hidden_size=128,
                                                                          intermediate_size=256)
    model = tiny_model(family, **kw)
    engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype=param_dtype, host_grads=host_grads),
                           device="cpu")
    opt = engine.build_optimizer(lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype is not None):
        model(**batch(family, seed=0, seq=16)).loss.backward()
    opt.step()
    engine.synchronize()
    stats = engine.memory_stats()
    assert stats["offloaded_params"] == sum(p.numel() for p in model.parameters())  # everything is on the host
    staging = _staging(engine)  # K pinned staging buffers (and the resident unit's one), bounded
    per_param = _host_bytes_per_param(stats, staging)
    assert budget - 0.2 <= per_param <= budget + 0.2, stats  # + 64-byte alignment of each buffer
    assert staging <= 2 * stats["slot_bytes"] + stats["rest_grad_bytes"] + 3 * 4096


def test_pinning_budget_and_pageable_fallback():
    """Transfer buffers are pinned while the budget allows, then pageable; failures fall back."""
    model = _gpt2(4)
    with simulated_device(0.0):
        engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
        _train(model, engine, steps=1)
    full = engine.memory_stats()
    assert full["pinned_host_bytes"] > 0
    # Only transfer buffers are pinned: the images (4 B/param here) and the K staging buffers.
    images = sum(b.host.image_trainable.numel() + (b.host.image_frozen.numel() if b.host.image_frozen is not None else 0)
                 for b in engine.units)
    assert full["pinned_host_bytes"] <= images + _staging(engine) + 16 * 4096 * 8

    model = _gpt2(4)
    limit = 2 * engine.blocks[0].slot_bytes + 4 * 4096
    with simulated_device(0.0):
        capped = offload_model(model, StrongholdConfig(window_size=1, max_pinned_bytes=limit), device="cpu")
        _train(model, capped, steps=1)
    stats = capped.memory_stats()
    assert 0 < stats["pinned_host_bytes"] <= limit
    assert stats["pageable_host_bytes"] > full["pageable_host_bytes"]

    model = _gpt2(4)
    with simulated_device(0.0, pin_fail_after_bytes=engine.blocks[0].slot_bytes + 3 * 4096), pytest.warns(
            UserWarning, match="pageable"):
        failing = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
        _train(model, failing, steps=1)
    assert 0 < failing.memory_stats()["pinned_host_bytes"] < full["pinned_host_bytes"]


def test_reset_peak_memory_stats():
    model = _gpt2(4)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    _train(model, engine, steps=1)
    assert engine.memory_stats()["device_peak_bytes"] > 0
    engine.reset_peak_memory_stats()
    assert engine.memory_stats()["device_peak_bytes"] == 0


def _train_one_step(model, config):
    engine = offload_model(model, config, device="cpu")
    opt = engine.build_optimizer(lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.param_dtype is not None):
        model(**batch("llama", seed=0, seq=16)).loss.backward()
    opt.step()
    engine.synchronize()
    stats = engine.memory_stats()
    stats["streamed_units"] = sum(u.kind == "streamed" for u in engine.units)
    engine.close()
    return stats, opt


@pytest.mark.parametrize("host_memory", ["exact", "lean"])
@pytest.mark.parametrize("vocab", [96, 4096])  # small: the embeddings are resident; large: they stream
def test_estimator_agrees_with_the_ledger(vocab, host_memory):
    """The fits/does-not-fit estimate matches what the engine really allocates: host bytes, and
    the device bytes the engine owns (window, gradient lanes, resident units)."""
    from stronghold_hf.estimate import estimate_for_model

    # host_image=False under the simulated device, where the fetch staging ring is real memory.
    for param_dtype, host_image in ((None, True), ("bf16", True), ("bf16", False)):
        model = tiny_model("llama", num_hidden_layers=4, hidden_size=128, intermediate_size=256, vocab_size=vocab,
                           tie_word_embeddings=False)
        est = estimate_for_model(model, seq_len=16, batch_size=2, dtype="fp32" if param_dtype is None else "bf16",
                                 gpu_memory_bytes=1 << 40, cpu_memory_bytes=1 << 40, window_size=3, grad_buffers=1,
                                 host_memory=host_memory, host_image=host_image)
        with simulated_device() if not host_image else contextlib.nullcontext():
            stats, opt = _train_one_step(model, StrongholdConfig(window_size=3, param_dtype=param_dtype, grad_buffers=1,
                                                                 host_memory=host_memory, host_image=host_image,
                                                                 host_grads="compute"))
        assert (stats["streamed_units"] > 0) == (vocab > 96)
        assert (stats["host_image_bytes"] > 0) == (param_dtype is not None and host_image)
        assert (stats["fetch_staging_bytes"] > 0) == (not host_image)
        ledger_host = stats["pinned_host_bytes"] + stats["pageable_host_bytes"]
        estimated = est.cpu_bytes_needed - est.cpu_process_bytes
        assert abs(estimated - ledger_host) <= 0.05 * ledger_host, (param_dtype, estimated, ledger_host)
        if host_memory == "lean":
            assert any("exp_avg_q" in st for st in opt.cpu_optimizer.state.values())
        ledger_device = stats["device_peak_bytes"]
        assert abs(est.gpu_engine_bytes - ledger_device) <= 0.05 * ledger_device, (param_dtype, est.gpu_engine_bytes,
                                                                                   ledger_device)
