"""`StrongholdPlugin` and `prepare_stronghold` in a ``no_trainer``-style accelerate loop."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator

from stronghold_hf import StrongholdConfig, StrongholdPlugin, prepare_stronghold
from tiny_models import batch, tiny_model


def _loop(model, optimizer, accelerator, steps=3, accum=2):
    losses = []
    for step in range(steps * accum):
        with accelerator.accumulate(model):
            loss = model(**batch("gpt2", seed=step)).loss
            accelerator.backward(loss)
            losses.append(loss.item())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return losses


def _train_next_to_plain_accelerate(config):
    """The same loop with plain accelerate and with `prepare_stronghold(config)`: the same
    losses and weights. Returns the engine (open)."""
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    acc_ref = Accelerator(cpu=True, gradient_accumulation_steps=2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref, opt_ref = acc_ref.prepare(ref, opt_ref)
    losses_ref = _loop(ref, opt_ref, acc_ref)

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt, engine = prepare_stronghold(acc, model, dict(lr=1e-2, weight_decay=0.1), config=config)
    losses = _loop(model, opt, acc)
    assert losses == pytest.approx(losses_ref, rel=1e-4)
    for k, v in acc_ref.unwrap_model(ref).state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-4, atol=6e-4, msg=lambda m: f"{k}: {m}")
    return engine


def test_prepare_stronghold_matches_plain_accelerate():
    engine = _train_next_to_plain_accelerate(StrongholdConfig(window_size=1))
    assert engine.resident_blocks() == []
    engine.close()


def test_plugin_reads_environment(monkeypatch):
    monkeypatch.setenv("STRONGHOLD", "1")
    monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", "4")
    monkeypatch.setenv("STRONGHOLD_CONFIG", '{"cpu_threads": 2}')
    plugin = StrongholdPlugin()
    assert plugin.enabled is True
    assert plugin.stronghold_config.window_size == 4 and plugin.stronghold_config.cpu_threads == 2
    assert StrongholdPlugin(enabled=False).enabled is False


def test_plugin_refuses_bad_environment(monkeypatch):
    monkeypatch.setenv("STRONGHOLD", "maybe")
    with pytest.raises(ValueError, match="STRONGHOLD"):
        StrongholdPlugin()
    monkeypatch.setenv("STRONGHOLD", "1")
    monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", "0")
    with pytest.raises(ValueError, match="window_size"):
        StrongholdPlugin()


def test_a_split_through_the_plugins_environment_matches_plain_accelerate(monkeypatch):
    """``STRONGHOLD_CONFIG='{"resident": 2}'`` under accelerate: two blocks stay on the device,
    stepped by the device AdamW with accelerate's accumulation and clipping, the rest streams."""
    monkeypatch.setenv("STRONGHOLD", "1")
    monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", "1")
    monkeypatch.setenv("STRONGHOLD_CONFIG", '{"resident": 2}')
    engine = _train_next_to_plain_accelerate(StrongholdPlugin().stronghold_config)
    assert engine.split.resident_blocks == 2 and len(engine.blocks) == 1
    engine.close()


@pytest.mark.parametrize("masters_on_disk", [False, True], ids=["ram", "nvme_masters"])
def test_save_state_and_load_state_keep_every_weight_and_resume_exactly(tmp_path, masters_on_disk):
    """``accelerator.save_state`` (and ``save_model``) of an offloaded (tied) GPT-2 writes every weight, and
    ``load_state`` in a fresh loop resumes it bit for bit. The parameters are views into their
    unit's host buffer: accelerate's safetensors cleaning used to keep one tensor per unit (and
    drop the rest with a warning), and safetensors' ``load_model`` refused the views. With the
    masters on disk, ``state_dict()`` read the tied weight once per module, as two tensors: both
    names were saved, and ``load_state`` refused the file."""
    from safetensors.torch import load_file

    disk = dict(nvme_path=str(tmp_path / "nvme"), nvme_masters=True) if masters_on_disk else {}

    def start():
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model, optimizer, engine = prepare_stronghold(accelerator, tiny_model("gpt2"), dict(lr=1e-2, weight_decay=0.1),
                                                      config=StrongholdConfig(window_size=1, **disk))
        return accelerator, model, optimizer, engine

    accelerator, model, optimizer, engine = start()
    _loop(model, optimizer, accelerator, steps=2)
    accelerator.save_state(str(tmp_path / "state"))
    tail = _loop(model, optimizer, accelerator, steps=2)
    state = engine.full_state_dict()
    tied = state["lm_head.weight"], state["transformer.wte.weight"]
    assert tied[0].data_ptr() == tied[1].data_ptr()  # one storage under both names, as in a plain tied model
    want = {k: v.clone() for k, v in state.items()}
    accelerator.save_model(model, str(tmp_path / "model"))
    engine.close()
    saved = load_file(str(tmp_path / "state" / "model.safetensors"))
    # Every weight, the tied head once (as accelerate saves a plain tied model); save_model too.
    assert set(saved) == set(want) - {"lm_head.weight"}
    final = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert set(final) == set(saved) and all(torch.equal(v, want[k]) for k, v in final.items())

    accelerator, model, optimizer, engine = start()
    accelerator.load_state(str(tmp_path / "state"))
    assert _loop(model, optimizer, accelerator, steps=2) == tail
    got = engine.full_state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    engine.close()
