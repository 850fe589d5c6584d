"""The CPU mode that behaves like a GPU: copies land late, so a missing wait shows.

`simulated_device` runs every copy on a background thread after a delay and completes it
through an event, as CUDA streams do. These tests show the mode has teeth: remove one wait
from the engine and the numbers (or the run) go wrong; keep it and training is exact.
"""

from __future__ import annotations

import copy

import pytest
import torch

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.testing import simulated_device
from stronghold_hf.transfer import TransferContext
from tiny_models import batch, tiny_model


def _grads_match_reference(window_size=1, d2h_delay=None):
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=window_size), device="cpu")
    if d2h_delay is not None:
        engine.transfer._d2h_thread.delay_s = d2h_delay  # gradients land well after the host work starts
    b = batch("gpt2", seed=0)
    ref(**b).loss.backward()
    model(**b).loss.backward()
    return all(
        torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7) for p, q in zip(model.parameters(), ref.parameters())
    ), engine


def test_with_every_wait_the_result_is_exact():
    with simulated_device(0.005):
        ok, engine = _grads_match_reference()
    assert ok and engine.transfer.mode == "delayed"


def test_a_missing_fetch_wait_gives_wrong_numbers(monkeypatch):
    monkeypatch.setattr(TransferContext, "device_wait", lambda self, event: None)
    with simulated_device(0.02):
        try:
            ok, _ = _grads_match_reference()
        except RuntimeError:  # a copy into a slot that was already freed is reported too
            ok = False
    assert not ok


def test_a_missing_gradient_wait_gives_wrong_numbers(monkeypatch):
    # Host work is delayed like the copies, so the gradient copies are made slower still: a
    # fold that does not wait then reads its staging buffer before the gradient is in it.
    monkeypatch.setattr(TransferContext, "host_wait", lambda self, event: None)
    with simulated_device(0.02):
        ok, _ = _grads_match_reference(d2h_delay=0.2)
    assert not ok


def test_with_every_wait_slow_gradient_copies_are_exact():
    with simulated_device(0.02):
        ok, _ = _grads_match_reference(d2h_delay=0.2)
    assert ok


def test_the_environment_variable_turns_it_on(monkeypatch):
    monkeypatch.setenv("STRONGHOLD_SIMULATE_COPY_DELAY_MS", "1")
    ok, engine = _grads_match_reference()
    assert ok and engine.transfer.mode == "delayed"
    monkeypatch.setenv("STRONGHOLD_SIMULATE_COPY_DELAY_MS", "soon")
    with pytest.raises(ValueError, match="STRONGHOLD_SIMULATE_COPY_DELAY_MS"):
        offload_model(tiny_model("gpt2"), StrongholdConfig(window_size=1), device="cpu")


@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradients_larger_than_a_block_cross_the_staging_in_pieces(accumulate):
    """A 64k-parameter untied vocabulary against 9k-parameter blocks: the pinned gradient
    staging is sized by a block, the embedding's and head's gradients cross in pieces (each
    next piece started by the fold), copies land late, and training is exact: the same
    weights as on the synchronous CPU path, with and without accumulation."""
    ref = tiny_model("llama", vocab_size=2000, tie_word_embeddings=False)

    def train(model):
        engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
        opt = engine.build_optimizer(lr=1e-2)
        for step in range(2):
            for micro in range(accumulate):
                model(**batch("llama", seed=2 * step + micro)).loss.backward()
            opt.step()
            opt.zero_grad()
        state = {k: v.clone() for k, v in engine.full_state_dict().items()}
        return state, engine.memory_stats()

    plain, _ = train(copy.deepcopy(ref))
    with simulated_device(0.002):
        piecewise, stats = train(copy.deepcopy(ref))
    for k, v in plain.items():
        assert torch.equal(piecewise[k], v), k
    block = sum(p.numel() for p in ref.model.layers[0].parameters()) * 4  # fp32 gradient bytes
    assert ref.lm_head.weight.numel() * 4 > 6 * block
    assert 0 < stats["grad_staging_bytes"] <= 2 * (block + 64 * 16 + 64)  # K = 2 lanes of a block, not of the head
