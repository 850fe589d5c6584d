"""CUDA checks: parity, the peak-memory bound of the window, and delay injection.

Skipped without CUDA (see conftest.py). ``scripts/gpu_check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import copy

import pytest
import torch

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.transfer import TransferContext
from tiny_models import batch, tiny_model

pytestmark = pytest.mark.gpu


def _cuda_batch(family, seed, **kw):
    return {k: v.cuda() for k, v in batch(family, seed, **kw).items()}


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
@pytest.mark.parametrize("window_size", [1, 2])
def test_cuda_parity(family, window_size):
    ref = tiny_model(family).cuda()
    model = copy.deepcopy(ref).cpu()
    engine = offload_model(model, StrongholdConfig(window_size=window_size), device="cuda")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = engine.build_optimizer(lr=1e-2, weight_decay=0.1)
    for step in range(3):
        b = _cuda_batch(family, step)
        loss_ref, loss = ref(**b).loss, model(**b).loss
        torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-5)
        loss_ref.backward()
        loss.backward()
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        n = engine.clip_grad_norm_(1.0)
        torch.testing.assert_close(n, n_ref, rtol=1e-4, atol=1e-6)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    sd, sd_ref = model.state_dict(), ref.state_dict()
    for k, v in sd_ref.items():
        torch.testing.assert_close(sd[k].cuda().float(), v.float(), rtol=1e-4, atol=6e-4, msg=lambda m: f"{k}: {m}")
    engine.close()


def test_peak_memory_bound():
    """Peak device memory <= resident part + the window's slots + the step's activations."""
    family, window_size = "gpt2", 1
    kw = dict(n_embd=256, n_layer=8, n_head=4)
    b = _cuda_batch(family, 0, batch_size=2, seq=32)
    # Activations of the plain model, measured: its peak minus its parameters and gradients.
    plain = tiny_model(family, **kw).cuda()
    param_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    plain(**b).loss.backward()
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated() - base - param_bytes  # grads: same size as params
    del plain
    torch.cuda.empty_cache()

    model = tiny_model(family, **kw)
    engine = offload_model(model, StrongholdConfig(window_size=window_size), device="cuda")
    resident = sum(p.numel() * p.element_size() for p in engine.resident_parameters())
    slot = engine.pool.slot_bytes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for step in range(2):
        model(**_cuda_batch(family, step, batch_size=2, seq=32)).loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # W+1 parameter slots, the same again for the gradients of resident blocks and their
    # packed copy in flight, the resident gradients, the activations, 8 MiB of allocator slack.
    bound = 3 * (window_size + 1) * slot + resident + max(activations, 0) + (8 << 20)
    all_blocks = sum(b.slot_bytes for b in engine.blocks)
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB"
    assert peak < param_bytes + activations, "offloading must use less than plain training"
    assert engine.pool.peak_in_use <= window_size + 1
    assert all_blocks > 3 * (window_size + 1) * slot  # the model is big enough for this to mean something
    engine.close()


def test_delay_injection_exposes_no_missing_waits(monkeypatch):
    """A long GPU sleep before every copy: results must not change if every wait is in place."""
    sleep_cycles = 20_000_000  # ~10 ms on a modern GPU
    orig_h2d, orig_d2h = TransferContext.copy_h2d, TransferContext.copy_d2h

    def slow_h2d(self, block_index, dst, src, after):
        with torch.cuda.stream(self.h2d_stream):
            torch.cuda._sleep(sleep_cycles)  # the copy lands late: compute must wait for its event
        return orig_h2d(self, block_index, dst, src, after)

    def slow_d2h(self, block_index, host_dst, device_src):
        torch.cuda._sleep(sleep_cycles)  # the gradient is packed late: the D2H copy must wait
        return orig_d2h(self, block_index, host_dst, device_src)

    ref = tiny_model("gpt2").cuda()
    model = copy.deepcopy(ref).cpu()
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cuda")
    monkeypatch.setattr(TransferContext, "copy_h2d", slow_h2d)
    monkeypatch.setattr(TransferContext, "copy_d2h", slow_d2h)
    b = _cuda_batch("gpt2", 0)
    loss_ref, loss = ref(**b).loss, model(**b).loss
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    loss_ref.backward()
    loss.backward()
    for name, p in ref.named_parameters():
        target = engine.optimizer_target(dict(model.named_parameters())[name])
        torch.testing.assert_close(target.grad.cuda(), p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    engine.close()


def test_auto_window_measures_and_chooses(caplog):
    model = tiny_model("gpt2", n_embd=256, n_layer=6, n_head=4)
    engine = offload_model(model, StrongholdConfig(window_size="auto"), device="cuda")
    opt = engine.build_optimizer(lr=1e-3)
    with caplog.at_level("INFO", logger="stronghold_hf"):
        for step in range(2):
            model(**_cuda_batch("gpt2", step)).loss.backward()
            opt.step()
            opt.zero_grad()
    assert engine.window_choice is not None
    assert 1 <= engine.window_size <= engine.num_blocks
    assert any("window_size=" in r.getMessage() for r in caplog.records)
    engine.close()


def test_bf16_on_cuda_trains():
    model = tiny_model("llama")
    engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype="bf16"), device="cuda")
    opt = engine.build_optimizer(lr=1e-2)
    losses = []
    for step in range(4):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**_cuda_batch("llama", 0)).loss
        loss.backward()
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    engine.close()
