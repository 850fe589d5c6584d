"""Masters on disk (``StrongholdConfig(nvme_path=DIR, nvme_masters=True)``): the fp32 masters
of the offloaded units live in a file from ``offload_model`` on, read by every fetch and by
every update (with the moments, through the NVMe tier's ring).

Training must be bit-identical to the RAM tier (exact and lean, fp32 and bf16, speculation
and its undo, accumulation, clipping, sharded state); the parameters stay safe to touch
between steps (reads see the value, writes reach the masters, ``state_dict`` and
``load_state_dict`` work, ``close`` gives an ordinary model); the masters are gone from the
host (the ledger, and a child's peak RSS). The Trainer's checkpoints with the
masters on disk are tested with the moments' (test_nvme.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os

import pytest
import torch

from stronghold_hf import StrongholdConfig, offload_model
from child_rss import llama_steps_child, saved_bytes_per_unit
from test_nvme import PARITY_CASES, PARITY_IDS, _assert_identical, _train
from tiny_models import batch, tiny_model


@pytest.mark.parametrize("family,overrides,config", PARITY_CASES, ids=PARITY_IDS)
def test_masters_on_disk_train_bit_identically(family, overrides, config, tmp_path):
    ref = tiny_model(family, **overrides)
    ram = _train(copy.deepcopy(ref), family, **config)
    disk = _train(copy.deepcopy(ref), family, nvme_path=str(tmp_path), nvme_masters=True, **config)
    _assert_identical(ram, disk)
    stats = disk[2]
    if config.get("speculative_step") == "on":
        assert stats["speculated_blocks"] > 0
        assert (stats["speculation_misses"] > 0) == (config["max_norm"] < 1)
    assert stats["nvme_masters_file_bytes"] >= 4 * stats["offloaded_trainable_params"]
    assert stats["nvme_masters_read_bytes"] > 0  # fetches read the masters from the file
    assert stats["host_image_bytes"] == 0
    assert os.listdir(tmp_path) == []  # close() removed the engine's directory


def test_a_fetch_waits_for_its_units_write_back(tmp_path, monkeypatch):
    """Slow writes: each update's write-back is still in flight when the next forward fetches
    the unit, which must read what the update wrote, not the step before."""
    import time

    from stronghold_hf import swap

    real_io = swap.StateFile._io

    def slow_io(self, write, view, offset):
        if write:
            time.sleep(0.02)
        return real_io(self, write, view, offset)

    ref = tiny_model("llama")
    ram = _train(copy.deepcopy(ref), "llama", max_norm=1e3)
    monkeypatch.setattr(swap.StateFile, "_io", slow_io)
    disk = _train(copy.deepcopy(ref), "llama", max_norm=1e3, nvme_path=str(tmp_path), nvme_masters=True)
    _assert_identical(ram, disk)


def test_sharded_masters_on_disk(tmp_path):
    import torch.distributed as dist

    from test_distributed import _port

    ref = tiny_model("qwen2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        ram = _train(copy.deepcopy(ref), "qwen2", shard_cpu_state=True)
        disk = _train(copy.deepcopy(ref), "qwen2", shard_cpu_state=True, nvme_path=str(tmp_path), nvme_masters=True)
    finally:
        dist.destroy_process_group()
    _assert_identical(ram, disk)


def _host_bytes(ref, **config):
    _, _, stats, _, _ = _train(copy.deepcopy(ref), "llama", steps=2, **config)
    return stats


def test_the_masters_leave_the_host_in_the_ledger(tmp_path):
    """Against the moments alone on disk, the host holds 4 B/param less (the masters), less
    the ring's larger buffers and one block's read scratch; neither of those grows with depth."""
    shallow, deep = (tiny_model("llama", num_hidden_layers=n, hidden_size=64, intermediate_size=256) for n in (4, 8))
    added = {}
    for name, ref in (("shallow", shallow), ("deep", deep)):
        moments = _host_bytes(ref, nvme_path=str(tmp_path))
        masters = _host_bytes(ref, nvme_path=str(tmp_path), nvme_masters=True)
        trainable = moments["offloaded_trainable_params"]
        host = {k: s["pinned_host_bytes"] + s["pageable_host_bytes"] for k, s in (("m", moments), ("d", masters))}
        extra = (masters["nvme_ring_bytes"] - moments["nvme_ring_bytes"]) + masters["nvme_masters_scratch_bytes"]
        assert host["m"] - host["d"] >= 4 * trainable - extra - 64 * 1024  # allocator alignment
        assert masters["nvme_masters_scratch_bytes"] > 0
        # The device side is untouched: the same window, the same fetches.
        assert masters["device_peak_bytes"] == moments["device_peak_bytes"]
        assert masters["fetches"] == moments["fetches"]
        added[name] = (host["d"], extra, trainable)
    # Depth adds gradients on the host (4 B/param), not masters; ring and scratch stay the same.
    assert added["deep"][1] == added["shallow"][1]
    grown = added["deep"][0] - added["shallow"][0]
    assert grown <= 4.2 * (added["deep"][2] - added["shallow"][2])


def test_parameters_stay_safe_to_touch_between_steps(tmp_path):
    """Reads see the value (mapped from the file; after ``engine.synchronize()`` too), an in-place write and a ``.data``
    replacement reach the masters, ``state_dict`` and ``load_state_dict`` round-trip, and
    ``close`` gives an ordinary model: all as with the masters in RAM."""
    ref = tiny_model("llama")

    def run(**config):
        model = copy.deepcopy(ref)
        engine = offload_model(model, StrongholdConfig(window_size=1, **config), device="cpu")
        opt = engine.build_optimizer(lr=1e-2)
        seen = []
        for step in range(3):
            model(**batch("llama", seed=step)).loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 2:
                engine.synchronize()  # the update done: the parameter must still read its value, not a placeholder
            w = model.model.layers[1].mlp.up_proj.weight
            seen.append(float(w.detach().double().sum()))  # a read between steps (waits for the update)
            if step == 0:
                with torch.no_grad():
                    w.mul_(0.5)  # in place
                    model.model.layers[0].self_attn.q_proj.weight.data = torch.ones_like(
                        model.model.layers[0].self_attn.q_proj.weight)
            if step == 1:
                sd = {k: v.clone() for k, v in model.state_dict().items()}
                sd["model.layers.1.mlp.down_proj.weight"].fill_(0.01)
                model.load_state_dict(sd)
        with torch.no_grad():
            model.eval()
            logits = model(**batch("llama", seed=9)).logits
            model.train()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        engine.close()
        closed = {k: v.clone() for k, v in model.state_dict().items()}
        return seen, logits, state, closed

    ram = run()
    disk = run(nvme_path=str(tmp_path), nvme_masters=True)
    assert ram[0] == disk[0]
    assert torch.equal(ram[1], disk[1])
    for a, b in ((ram[2], disk[2]), (ram[3], disk[3])):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert os.listdir(tmp_path) == []


def test_a_full_disk_is_an_error_at_offload(tmp_path, monkeypatch):
    """The masters are written by offload_model: a disk that cannot hold them fails it, naming
    the bytes, before anything is trained, and leaves no directory behind."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"storing the fp32 masters needs .* GB \(\d+ bytes\) in .*which has 0.00 GB free"):
        offload_model(model, StrongholdConfig(window_size=1, nvme_path=str(tmp_path), nvme_masters=True), device="cpu")
    assert os.listdir(tmp_path) == []


def test_bad_settings_are_refused_early(tmp_path):
    with pytest.raises(ValueError, match="nvme_masters=True needs nvme_path"):
        StrongholdConfig(nvme_masters=True)
    with pytest.raises(ValueError, match="nvme_masters=True keeps no compute-dtype image"):
        StrongholdConfig(nvme_path=str(tmp_path), nvme_masters=True, host_image=True)
    with pytest.raises(ValueError, match="nvme_masters='yes'"):
        StrongholdConfig(nvme_path=str(tmp_path), nvme_masters="yes")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_estimator_agrees_with_the_ledger(dtype, tmp_path):
    """``estimate --nvme_masters``: the host bytes it counts (gradients, the ring of masters
    and moments, the staging ring and the read scratch) are what the engine allocates."""
    from stronghold_hf.estimate import estimate_for_model
    from stronghold_hf.testing import simulated_device
    from test_memory_ledger import _train_one_step

    model = tiny_model("llama", num_hidden_layers=4, hidden_size=128, intermediate_size=256, vocab_size=4096,
                       tie_word_embeddings=False)
    est = estimate_for_model(model, seq_len=16, batch_size=2, dtype=dtype, gpu_memory_bytes=1 << 40,
                             cpu_memory_bytes=1 << 40, window_size=3, grad_buffers=1, nvme=True, nvme_masters=True,
                             nvme_memory_bytes=1 << 40)
    assert est.nvme_masters and est.cpu_master_bytes == 0
    with simulated_device():  # fetches convert through the pinned staging ring, as on a GPU
        stats, _ = _train_one_step(model, StrongholdConfig(
            window_size=3, param_dtype=None if dtype == "fp32" else torch.bfloat16, grad_buffers=1,
            host_grads="compute", nvme_path=str(tmp_path), nvme_masters=True))
    ledger_host = stats["pinned_host_bytes"] + stats["pageable_host_bytes"]
    estimated = est.cpu_bytes_needed - est.cpu_process_bytes
    assert abs(estimated - ledger_host) <= 0.05 * ledger_host, (estimated, ledger_host)
    assert est.nvme_bytes_needed <= stats["nvme_file_bytes"] + stats["nvme_masters_file_bytes"]


def test_a_fetch_under_late_copies_reads_the_masters_it_needs(tmp_path):
    """The simulated device: fetches convert on their own thread, copies land late."""
    from stronghold_hf.testing import simulated_device

    ref = tiny_model("llama")
    with simulated_device():
        ram = _train(copy.deepcopy(ref), "llama", bf16=True)
        disk = _train(copy.deepcopy(ref), "llama", bf16=True, nvme_path=str(tmp_path), nvme_masters=True)
    _assert_identical(ram, disk)


# ------------------------------------------------------------------------------ measured from outside
# A 28 M-parameter body: 48 blocks of hidden 192 (0.59 M each), a 0.4 M untied vocabulary. Many
# small blocks: what a window holds besides (slots, the ring, one block's read scratch) is a
# few blocks, as it is for a real model's 32 to 80. Measured from before offload_model: with
# the masters on disk the engine never allocates them.
_CHILD = llama_steps_child(layers=48, hidden=192, since="offload")


def test_masters_on_disk_save_four_bytes_per_parameter_of_peak_rss(tmp_path):
    """From outside, child by child: offload_model and two steps with the moments on disk,
    against the same with the masters there too. The children use a fixed mmap threshold, so
    what the engine frees (the model's own tensors, a unit's transient buffers at offload)
    goes back to the system and the peak is what is alive, not the heap's history."""
    moments = json.dumps({"nvme_path": str(tmp_path)})
    masters = json.dumps({"nvme_path": str(tmp_path), "nvme_masters": True})
    body, per_param = saved_bytes_per_unit(_CHILD, moments, masters, "body params, offload and two steps",
                                           env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert body > 25e6
    assert per_param >= 0.7 * 4
    assert os.listdir(tmp_path) == []


def test_a_depthwise_convolution_weight_trains_with_its_master_on_disk_or_sharded(tmp_path):
    """Mamba's depthwise convolution weight is ``[channels, 1, kernel]``: the placeholder its
    master points at between updates (on disk, or kept by another rank) must be recognised
    whatever the stride of that size-1 dimension; it used to be refused by CPU Adam as "not a
    contiguous dense tensor". Both train bit-identically to the RAM tier, and a weight written
    between steps reaches the master."""
    import torch.distributed as dist
    import transformers as T

    from test_distributed import _port
    from test_more_families import _losses as three_steps

    torch.manual_seed(0)
    ref = T.MambaForCausalLM(T.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=128, state_size=4))
    assert any(p.dim() == 3 and p.shape[1] == 1 for p in ref.parameters())

    def train(**config):
        model = copy.deepcopy(ref)
        engine = offload_model(model, StrongholdConfig(window_size=1, **config), device="cpu")
        optimizer = engine.build_optimizer(lr=1e-2, weight_decay=0.01)
        losses = three_steps(model, optimizer, "AutoModelForCausalLM")
        conv = model.backbone.layers[0].mixer.conv1d.weight
        # A write between steps, taken in at the next fetch (sharded: inside gathered_parameters).
        gathered = engine.gathered_parameters([conv], modifier_rank=0) if config.get("shard_cpu_state") else None
        with gathered or contextlib.nullcontext(), torch.no_grad():
            conv.copy_(torch.full_like(conv, 0.5))
        losses += three_steps(model, optimizer, "AutoModelForCausalLM")
        engine.close()
        return losses, {k: v.clone() for k, v in model.state_dict().items()}

    ram = train()
    disk = train(nvme_path=str(tmp_path), nvme_masters=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        sharded = train(shard_cpu_state=True)
    finally:
        dist.destroy_process_group()
    for other in (disk, sharded):
        assert other[0] == ram[0]
        for k, v in ram[1].items():
            assert torch.equal(other[1][k], v), k
