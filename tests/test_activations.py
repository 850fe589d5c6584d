"""Checkpointed activations on the host (``offload_activations``), on the CPU path.

With gradient checkpointing each block keeps its input for backward. With offload on, the
input leaves the device during forward and comes back one block ahead of its backward; the
ledger counts the inputs the engine holds on the device, so the CPU run shows the device peak
flat with depth (and growing with depth when offload is off). Training stays exact.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import transformers as T

from stronghold_hf import StrongholdConfig, activations, offload_model
from stronghold_hf.testing import simulated_device
from child_rss import CHECKPOINTS_CHILD
from tiny_models import VOCAB, batch, engine_losses, tiny_model

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


def test_a_shared_position_bias_stays_on_the_device_without_a_false_alarm():
    """[Note: a saved tensor that is not contiguous] LongT5 hands every block the same position
    bias, a permuted (not contiguous) [1, heads, s, s] view. It stays on the device, once, rather
    than a copy per block on the host, and it is not counted as an input that should have left:
    at 12 tokens it is the only input large enough to offload, and offload_activations=True
    used to raise "none of the 1 checkpointed inputs left the device" although gradient
    checkpointing was on. Training matches the untouched model."""
    cfg = T.AutoConfig.for_model("longt5", vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2,
                                 num_heads=2, d_kv=16, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    torch.manual_seed(0)
    ref = T.AutoModelForSeq2SeqLM.from_config(cfg).train()
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=True), device="cpu")
    stayed = []
    pack = activations.ActivationStore._pack

    def watched_pack(self, t):
        saved = pack(self, t)
        if (isinstance(saved, activations.SavedInput) and not t.is_contiguous()
                and saved.nbytes >= activations.MIN_OFFLOAD_BYTES):
            stayed.append(saved.host is None)
        return saved

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(activations.ActivationStore, "_pack", watched_pack)
        losses = _train(model, engine, "t5", seq=12)
    assert stayed and all(stayed)  # the bias was saved, large enough, and kept on the device
    assert losses == pytest.approx(_train_ref(ref, "t5", seq=12), rel=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=4e-4, msg=lambda m: f"{name}: {m}")
    assert engine.memory_stats()["promises_broken"] == 0


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


def _activation_peak(layers, offload, window_size=2, **config):
    model = _checkpointed("llama", num_hidden_layers=layers, hidden_size=64, intermediate_size=128)
    engine = offload_model(model, StrongholdConfig(window_size=window_size, offload_activations=offload, **config),
                           device="cpu")
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


def test_no_device_checkpoints_keeps_none_at_the_turn_and_trains_the_same():
    """device_checkpoints=0: the inputs at the end of the forward leave too (the longest
    contexts: GiBs each); at most the one being recomputed and the one on its way back are on
    the device, against the window's four at the turn by default, and the training is the same."""
    one = 2 * 32 * 64 * 4  # one checkpointed input: batch 2 x 32 tokens x hidden 64, fp32
    default, stats = _activation_peak(8, True, window_size=4)
    none_kept, stats0 = _activation_peak(8, True, window_size=4, device_checkpoints=0)
    assert none_kept <= 2 * one < default, (none_kept, default)
    assert stats0["activation_host_bytes"] == 8 * one and stats["activation_host_bytes"] == (8 - 4) * one
    ref = _checkpointed("llama")
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=True, device_checkpoints=0),
                           device="cpu")
    assert _train(model, engine, "llama") == pytest.approx(_train_ref(ref, "llama"), rel=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=4e-4, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="device_checkpoints=-1"):
        StrongholdConfig(device_checkpoints=-1)


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


# ---------------------------------------------------------------------- checkpoints beyond RAM
def _disk_run(tmp_path, family="llama", layers=8, disk=True, reentrant=False, steps=3, **kw):
    """Trains a checkpointed model with its inputs offloaded, on to a file or not; returns the
    losses, the trained parameters and the ledger's activation keys (the engine closed)."""
    torch.manual_seed(0)
    shape = {"num_hidden_layers": layers, "hidden_size": 64, "intermediate_size": 128} if family == "llama" else {
        "n_layer": layers}
    model = _checkpointed(family, reentrant, **shape)
    config = StrongholdConfig(window_size=2, offload_activations=True, **(
        dict(nvme_path=str(tmp_path), nvme_activations=True) if disk else {}), **kw)
    engine = offload_model(model, config, device="cpu")
    losses = engine_losses(model, engine, family, lr=LR, steps=steps, seq=32)
    stats = {k: v for k, v in engine.memory_stats().items() if k.startswith("activation_")}
    params = [p.detach().clone() for p in model.parameters()]
    engine.close()
    return losses, params, stats


@pytest.mark.parametrize("family,reentrant", [("llama", False), ("gpt2", True)])
def test_checkpoints_on_disk_train_bit_identically(tmp_path, family, reentrant):
    """nvme_activations: the inputs go through a file and come back; the same bits as in RAM."""
    in_ram = _disk_run(tmp_path, family, disk=False, reentrant=reentrant)
    on_disk = _disk_run(tmp_path, family, disk=True, reentrant=reentrant)
    assert on_disk[0] == in_ram[0]
    assert all(torch.equal(a, b) for a, b in zip(on_disk[1], in_ram[1]))
    assert in_ram[2]["activation_disk_peak_bytes"] == 0 and on_disk[2]["activation_disk_peak_bytes"] > 0
    assert os.listdir(tmp_path) == []  # the engine's file and directory go with it


def test_with_the_file_the_host_holds_a_ring_and_the_disk_grows_with_depth(tmp_path):
    """The promise: host bytes for checkpoints do not grow with depth (a ring of DISK_RING + 2
    inputs), the file does (one input per offloaded position); in RAM the host grows instead."""
    one = 2 * 32 * 64 * 4  # batch 2 x 32 tokens x hidden 64, fp32
    page_up = -(-one // 4096) * 4096
    host, disk = {}, {}
    for layers in (8, 16):
        stats = _disk_run(tmp_path, layers=layers, steps=2)[2]
        host[layers], disk[layers] = stats["activation_host_bytes"], stats["activation_disk_peak_bytes"]
    # How many ring buffers a run makes depends on how fast its writes land, never on depth.
    assert max(host.values()) <= (activations.DISK_RING + 2) * (page_up + 4096), host
    assert disk[8] == (8 - 2) * page_up and disk[16] == (16 - 2) * page_up, disk
    in_ram = _disk_run(tmp_path, layers=16, disk=False, steps=2)[2]["activation_host_bytes"]
    assert in_ram >= (16 - 2) * one > 2 * host[16]


def test_checkpoints_on_disk_under_delayed_copies_and_a_retained_graph(tmp_path):
    """Copies that land late (the simulated GPU) and a second backward over the same graph,
    which reads every input back from the file again."""
    with simulated_device(0.002):
        ref = _checkpointed("llama", num_hidden_layers=4, hidden_size=64, intermediate_size=128)
        model = copy.deepcopy(ref)
        engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=True, nvme_path=str(tmp_path),
                                                       nvme_activations=True), device="cpu")
        assert engine.transfer.mode == "delayed"
        b = batch("llama", seed=0, seq=32)
        for m in (ref, model):
            loss = m(**b).loss
            loss.backward(retain_graph=True)
            loss.backward()
        engine.synchronize()
        assert engine.memory_stats()["activation_disk_peak_bytes"] > 0
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        engine.close()


def test_auto_goes_to_disk_only_when_the_host_would_not_hold_them(tmp_path, monkeypatch):
    """nvme_activations="auto" (offload_model alone): the host's available memory less the
    reserve decides, at the first offloaded input; without nvme_path nothing goes to disk."""
    for available, expected in ((1 << 40, 0), (0, 1)):
        monkeypatch.setattr(activations, "available_host_bytes", lambda: available)
        stats = _disk_run(tmp_path, disk=False, steps=1, nvme_path=str(tmp_path), cpu_reserve=0)[2]
        assert bool(stats["activation_disk_peak_bytes"]) == bool(expected), (available, stats)
    assert StrongholdConfig(offload_activations=True).nvme_activations == "auto"
    monkeypatch.setattr(activations, "available_host_bytes", lambda: 0)
    assert _disk_run(tmp_path, disk=False, steps=1)[2]["activation_disk_peak_bytes"] == 0


def test_nvme_activations_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="nvme_activations=True needs nvme_path"):
        StrongholdConfig(nvme_activations=True)
    with pytest.raises(ValueError, match="offload_activations=False"):
        StrongholdConfig(nvme_activations=True, nvme_path="/tmp/x", offload_activations=False)
    with pytest.raises(ValueError, match="nvme_activations='yes'"):
        StrongholdConfig(nvme_activations="yes")


def test_checkpoints_on_disk_peak_rss_measured_from_outside(tmp_path):
    """The same promise measured from outside (a child process per variant, peak RSS over a
    step): with the file the host's growth is at least 9 of the 15 offloaded inputs smaller
    (the ring keeps up to DISK_RING + 2 of them)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    growth = {}
    for variant in ('{"on_disk": false}', '{"on_disk": true}'):
        out = subprocess.run([sys.executable, "-c", CHECKPOINTS_CHILD, variant, str(tmp_path)], capture_output=True,
                             text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        one, kib = map(int, out.stdout.split()[-2:])
        growth[variant] = kib * 1024
    in_ram, on_disk = growth['{"on_disk": false}'], growth['{"on_disk": true}']
    print(f"peak RSS growth, one step: inputs in RAM {in_ram / 2**20:.0f} MiB, on disk {on_disk / 2**20:.0f} MiB "
          f"(one input {one / 2**20:.0f} MiB)")
    assert in_ram - on_disk >= 9 * one, (in_ram, on_disk, one)
