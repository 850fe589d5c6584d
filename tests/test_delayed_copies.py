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


def _grads_match_reference(window_size=1):
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=window_size), device="cpu")
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
    monkeypatch.setattr(TransferContext, "host_wait", lambda self, event: None)
    with simulated_device(0.02):
        ok, _ = _grads_match_reference()
    assert not ok


def test_the_environment_variable_turns_it_on(monkeypatch):
    monkeypatch.setenv("STRONGHOLD_SIMULATE_COPY_DELAY_MS", "1")
    ok, engine = _grads_match_reference()
    assert ok and engine.transfer.mode == "delayed"
    monkeypatch.setenv("STRONGHOLD_SIMULATE_COPY_DELAY_MS", "soon")
    with pytest.raises(ValueError, match="STRONGHOLD_SIMULATE_COPY_DELAY_MS"):
        offload_model(tiny_model("gpt2"), StrongholdConfig(window_size=1), device="cpu")
