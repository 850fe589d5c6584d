"""The NVMe tier (nvme.py, ``StrongholdConfig(nvme_path=DIR)``): Adam moments on disk.

A temporary directory plays the NVMe drive. Training must be bit-identical to keeping the
moments in RAM (exact and lean, fp32 and bf16, speculation and its undo, accumulation,
clipping, sharded state), through the user's entry points (``offload_model``, the Trainer
from ``HfArgumentParser``, checkpoints that resume either way); the ledger shows the state
gone from the host and the ring that replaces it, a child process's peak RSS shows it from
outside; a full disk, a stale directory, I/O errors and cleanup behave as documented.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from transformers import HfArgumentParser

from stronghold_hf import StrongholdConfig, StrongholdTrainer, StrongholdTrainingArguments, offload_model, swap
from child_rss import llama_steps_child, saved_bytes_per_unit
from test_trainer import COMMON, TinyDataset
from tiny_models import batch, tiny_model

BF16 = torch.bfloat16


def _train(model, family, steps=3, bf16=False, accumulate=1, max_norm=0.5, **config):
    dtype = dict(param_dtype=BF16) if bf16 else {}
    engine = offload_model(model, StrongholdConfig(window_size=1, **dtype, **config), device="cpu")
    opt = engine.build_optimizer(lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            with torch.autocast("cpu", dtype=BF16, enabled=bf16):
                loss = model(**batch(family, seed=step * accumulate + micro)).loss
            loss.backward()
        engine.clip_grad_norm_(max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    stats = {**engine.memory_stats(), **engine.stats.as_dict()}
    saved = opt.state_dict()
    engine.close()
    return losses, state, stats, saved["cpu"]["state"], saved


def _assert_identical(ram, disk):
    assert ram[0] == disk[0]
    for k, v in ram[1].items():
        assert torch.equal(disk[1][k], v), k
    assert ram[3].keys() == disk[3].keys()  # the optimizer state saves the same entries, bit for bit
    for i, st in ram[3].items():
        for key, value in st.items():
            assert torch.equal(disk[3][i][key], value), (i, key)


#: (family, config overrides, _train keywords): what the disk tiers must train bit-identically.
PARITY_CASES = [
    ("llama", {}, {}),
    ("gpt2", dict(n_inner=128), dict(host_memory="lean")),  # 32 x 128 MLP weights: 8-bit moments
    ("t5", {}, dict(bf16=True)),
    ("llama", {}, dict(bf16=True, speculative_step="on", max_norm=1e3)),
    ("qwen2", {}, dict(speculative_step="on", max_norm=1e-3)),  # every step clips: each guess is undone
    ("bert", {}, dict(accumulate=2)),
]
PARITY_IDS = ["llama-exact", "gpt2-lean", "t5-bf16", "llama-speculative", "qwen2-speculation-undone", "bert-accumulate"]


@pytest.mark.parametrize("family,overrides,config", PARITY_CASES, ids=PARITY_IDS)
def test_moments_on_disk_train_bit_identically(family, overrides, config, tmp_path):
    ref = tiny_model(family, **overrides)
    ram = _train(copy.deepcopy(ref), family, **config)
    disk = _train(copy.deepcopy(ref), family, nvme_path=str(tmp_path), **config)
    _assert_identical(ram, disk)
    stats = disk[2]
    if config.get("speculative_step") == "on":
        assert stats["speculated_blocks"] > 0
        assert (stats["speculation_misses"] > 0) == (config["max_norm"] < 1)
    assert stats["nvme_file_bytes"] > 0 and stats["nvme_read_bytes"] > 0 and stats["nvme_written_bytes"] > 0
    assert os.listdir(tmp_path) == []  # close() removed the engine's directory


@pytest.mark.parametrize("nvme_masters", [False, True], ids=["moments", "masters-too"])
def test_an_fp16_overflow_skips_the_step_on_disk_too(tmp_path, nvme_masters):
    """Clean step, a step whose gradient overflows (skipped: no unit's state is read or
    written), clean step: the same weights and state as the RAM tier's."""
    def run(**config):
        model = tiny_model("gpt2")
        engine = offload_model(model, StrongholdConfig(window_size=1, **config), device="cpu")
        opt = engine.build_optimizer(lr=1e-2, fp16_loss_scaling=True)
        written = []
        for step in range(3):
            engine.scale_loss(model(**batch("gpt2", seed=step)).loss).backward()
            if step == 1:
                engine.blocks[1].params[0].grad.view(-1)[0] = float("inf")
            engine.clip_grad_norm_(1.0)
            opt.step()
            engine.synchronize()
            assert opt.last_step_skipped == (step == 1)
            written.append(engine.memory_stats()["nvme_written_bytes"])
            opt.zero_grad()
        state = ({k: v.clone() for k, v in engine.full_state_dict().items()}, opt.state_dict()["cpu"]["state"])
        if config:
            opt.nvme.wait_for_writes()
            assert written[1] == written[0] < written[2]  # the skipped step wrote nothing
        engine.close()
        return state

    ram, disk = run(), run(nvme_path=str(tmp_path), nvme_masters=nvme_masters)
    for k, v in ram[0].items():
        assert torch.equal(disk[0][k], v), k
    for i, st in ram[1].items():
        for key, value in st.items():
            assert torch.equal(disk[1][i][key], value), (i, key)


def test_the_ring_is_bounded_and_replaces_the_state_in_the_ledger(tmp_path):
    ref = tiny_model("llama", num_hidden_layers=6, intermediate_size=128)
    ram = _train(copy.deepcopy(ref), "llama")[2]
    disk = _train(copy.deepcopy(ref), "llama", nvme_path=str(tmp_path), nvme_ring_buffers=3)[2]
    trainable = ram["offloaded_trainable_params"]
    moments = ram["optimizer_state_bytes"]
    assert moments >= 8 * trainable  # two fp32 moments (and 4 B of step count per tensor)
    assert disk["optimizer_state_bytes"] < 0.02 * moments  # only the step counts stay
    assert disk["nvme_file_bytes"] >= 8 * trainable  # page-aligned regions on disk
    # Three buffers, each the size of the largest unit's moments (page-aligned pieces).
    largest_unit = max(u.layout.trainable_bytes for u in offload_model(copy.deepcopy(ref), StrongholdConfig(),
                                                                     device="cpu").units) * 2
    assert disk["nvme_ring_bytes"] <= 3 * (largest_unit + 4096 * 8)
    assert disk["pageable_host_bytes"] - ram["pageable_host_bytes"] == pytest.approx(
        disk["nvme_ring_bytes"] - (ram["optimizer_state_bytes"] - disk["optimizer_state_bytes"]), abs=4096)
    # Three steps: every unit's state written once a step, and read once a step but the first
    # (nothing on disk yet), plus the next step's first units read ahead (at most ring - 1 of
    # them; on a loaded machine a read-ahead taken back for a unit needed sooner is read again,
    # still within the ring's size).
    assert disk["nvme_written_bytes"] == 3 * disk["nvme_file_bytes"]
    ahead = disk["nvme_read_bytes"] - 2 * disk["nvme_file_bytes"]
    assert 0 <= ahead <= disk["nvme_ring_bytes"]


def _state_by_name(saved: dict) -> dict[str, dict[str, torch.Tensor]]:
    """An optimizer ``state_dict``'s CPU state put back together per parameter name from its
    CPU pieces (whole parameters, or the segments of one)."""
    parts: dict[str, list] = {}
    for name, (_, _, first, _), (_, st) in zip(saved["cpu_names"], saved["cpu_pieces"], sorted(saved["cpu"]["state"].items())):
        parts.setdefault(name, []).append((first, st))
    by_name = {}
    for name, pieces in parts.items():
        pieces.sort(key=lambda t: t[0])
        by_name[name] = {key: pieces[0][1][key] if key == "step" else torch.cat([st[key].reshape(-1) for _, st in pieces])
                         for key in pieces[0][1]}
    return by_name


@pytest.mark.parametrize("config", [
    {}, dict(host_memory="lean"), dict(speculative_step="on", max_norm=1e-3), dict(nvme_masters=True),
    dict(nvme_masters=True, bf16=True, host_memory="lean"),
], ids=["exact", "lean", "speculation-undone", "masters-too", "masters-bf16-lean"])
def test_a_vocabulary_larger_than_a_block_streams_its_state_in_block_sized_segments(config, tmp_path):
    """An untied 8,192-row vocabulary (262k elements a matrix) next to blocks of about 10k: the
    embedding and the head are stepped and streamed in segments of at most a block's elements,
    so the ring is three blocks' state, not three heads'; training and the optimizer state (put
    back together per parameter) are bit for bit the RAM tier's."""
    ref = tiny_model("llama", vocab_size=8192, tie_word_embeddings=False)
    ram_config = {k: v for k, v in config.items() if k != "nvme_masters"}
    ram = _train(copy.deepcopy(ref), "llama", **ram_config)
    disk = _train(copy.deepcopy(ref), "llama", nvme_path=str(tmp_path), nvme_ring_buffers=3, **config)
    assert disk[0] == ram[0]
    for k, v in ram[1].items():
        assert torch.equal(disk[1][k], v), k
    ram_state, disk_state = _state_by_name(ram[4]), _state_by_name(disk[4])
    assert disk_state.keys() == ram_state.keys()
    for name, st in ram_state.items():
        for key, value in st.items():
            assert torch.equal(disk_state[name][key], value), (name, key)
    assert len(disk[4]["cpu_pieces"]) > len(ram[4]["cpu_pieces"])  # more CPU pieces: the segments
    block, vocab = sum(p.numel() for p in ref.model.layers[0].parameters()), 8192 * 32
    per_element = 8 + (4 if config.get("nvme_masters") else 0)  # fp32 moments (8-bit ones are smaller), masters
    ring = disk[2]["nvme_ring_bytes"]
    assert ring <= 3 * (per_element * block + 64 * 4096)  # three blocks' state, with page padding
    assert ring < per_element * vocab  # less than one unsegmented head's state


@pytest.mark.parametrize("first, second", [("segments", "ram"), ("ram", "segments-masters")])
def test_segmented_state_resumes_under_the_other_layout(first, second, tmp_path):
    """Two steps, the model and optimizer saved, one more step in a new engine of the other
    layout: the same weights as three uninterrupted steps (the checkpoint names each segment
    by its element range, and the loading optimizer re-cuts it)."""
    import io

    configs = {"ram": {}, "segments": dict(nvme_path=str(tmp_path / "a")),
               "segments-masters": dict(nvme_path=str(tmp_path / "b"), nvme_masters=True)}

    def run(model, steps, start=0, load=None, **config):
        engine = offload_model(model, StrongholdConfig(window_size=1, **config), device="cpu")
        opt = engine.build_optimizer(lr=1e-2, weight_decay=0.1)
        if load is not None:
            model.load_state_dict(load[0])
            opt.load_state_dict(load[1])
        losses = []
        for step in range(start, start + steps):
            loss = model(**batch("llama", seed=step)).loss
            loss.backward()
            engine.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)  # what a Trainer checkpoint writes
        buf.seek(0)
        out = losses, {k: v.clone() for k, v in engine.full_state_dict().items()}, torch.load(buf, weights_only=False)
        engine.close()
        return out

    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    ref = tiny_model("llama", vocab_size=8192, tie_word_embeddings=False)
    whole = run(copy.deepcopy(ref), 3)
    part = run(copy.deepcopy(ref), 2, **configs[first])
    rest = run(copy.deepcopy(ref), 1, start=2, load=part[1:], **configs[second])
    assert part[0] + rest[0] == whole[0]
    for k, v in whole[1].items():
        assert torch.equal(rest[1][k], v), k


def test_sharded_state_on_disk(tmp_path):
    """A process group of one takes the sharded path: each rank's shard has its own file."""
    import torch.distributed as dist

    from test_distributed import _port

    ref = tiny_model("qwen2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        ram = _train(copy.deepcopy(ref), "qwen2", shard_cpu_state=True)
        disk = _train(copy.deepcopy(ref), "qwen2", shard_cpu_state=True, nvme_path=str(tmp_path))
    finally:
        dist.destroy_process_group()
    _assert_identical(ram, disk)


# ------------------------------------------------------------------------------ the Trainer
def _trainer(tmp_path, name, nvme_dir=None, nvme_masters=False, **extra):
    argv = ["--output_dir", str(tmp_path / name), "--stronghold", "--stronghold_window_size", "1"]
    if nvme_dir is not None:
        argv += ["--stronghold_config", json.dumps({"nvme_path": str(nvme_dir), "nvme_masters": nvme_masters})]
    (args,) = HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses(argv)
    for k, v in {**COMMON, **extra}.items():
        setattr(args, k, v)
    # An untied vocabulary of 8,192 rows, larger than a block: its state streams in segments.
    model = tiny_model("llama", vocab_size=8192, tie_word_embeddings=False)
    return StrongholdTrainer(model=model, args=args, train_dataset=TinyDataset("llama", n=24))


@pytest.mark.parametrize("nvme_masters", [False, True], ids=["moments", "masters-too"])
def test_trainer_checkpoints_resume_from_the_nvme_state(tmp_path, nvme_masters):
    from transformers import AutoModelForCausalLM

    swap = tmp_path / "nvme"
    ram = _trainer(tmp_path, "ram", max_steps=6, save_strategy="steps", save_steps=3)
    ram.train()
    full = _trainer(tmp_path, "full", swap, nvme_masters, max_steps=6, save_strategy="steps", save_steps=3)
    full.train()
    stats = full.stronghold_engine.memory_stats()
    assert stats["nvme_file_bytes"] > 0 and (stats["nvme_masters_file_bytes"] > 0) == nvme_masters
    assert len(torch.load(tmp_path / "full" / "checkpoint-3" / "optimizer.pt", weights_only=True)["cpu_pieces"]) > len(
        torch.load(tmp_path / "ram" / "checkpoint-3" / "optimizer.pt", weights_only=True)["cpu_pieces"])  # segments
    ckpt = tmp_path / "full" / "checkpoint-3"
    resumed = _trainer(tmp_path, "resumed", swap, nvme_masters, max_steps=6)
    resumed.train(resume_from_checkpoint=str(ckpt))
    in_ram = _trainer(tmp_path, "in_ram", max_steps=6)  # the same HF checkpoint format: the RAM tier resumes it
    in_ram.train(resume_from_checkpoint=str(ckpt))
    expected = ram.stronghold_engine.full_state_dict()
    for run in (full, resumed, in_ram):
        for k, v in run.stronghold_engine.full_state_dict().items():
            assert torch.equal(v, expected[k]), k
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)["cpu"]["state"]
    assert all(s["exp_avg"].numel() > 0 for s in saved.values())
    # The HF checkpoint written from the disk tier loads in plain HF, as the RAM tier's does.
    plain = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    for k, v in AutoModelForCausalLM.from_pretrained(tmp_path / "ram" / "checkpoint-3").state_dict().items():
        assert torch.equal(plain[k], v), k


# ------------------------------------------------------------------------------ disk, directory, errors
def test_a_full_disk_is_an_error_before_training(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    model = tiny_model("llama")
    engine = offload_model(model, StrongholdConfig(window_size=1, nvme_path=str(tmp_path)), device="cpu")
    with pytest.raises(ValueError, match=r"needs .* GB \(\d+ bytes\) in .*which has 0.00 GB free"):
        engine.build_optimizer(lr=1e-3)
    engine.close()


def test_io_errors_surface_with_the_file_name(tmp_path, monkeypatch):
    model = tiny_model("llama")
    engine = offload_model(model, StrongholdConfig(window_size=1, nvme_path=str(tmp_path), host_worker="inline"),
                           device="cpu")
    opt = engine.build_optimizer(lr=1e-3)
    model(**batch("llama", seed=0)).loss.backward()
    opt.step()  # the first step reads nothing (fresh state) and writes every unit
    opt.zero_grad()

    def broken(write, view, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(opt.nvme.file, "_io", broken)
    model(**batch("llama", seed=1)).loss.backward()
    with pytest.raises(RuntimeError, match="NVMe tier I/O on .*adam_state.bin failed"):
        opt.step()
        engine.synchronize()


_KILLED_CHILD = r"""
import os, sys
import torch
from stronghold_hf import StrongholdConfig, offload_model
sys.path.insert(0, sys.argv[2])
from tiny_models import batch, tiny_model
model = tiny_model("llama")
engine = offload_model(model, StrongholdConfig(window_size=1, nvme_path=sys.argv[1]), device="cpu")
opt = engine.build_optimizer(lr=1e-3)
model(**batch("llama", seed=0)).loss.backward()
opt.step()
engine.synchronize()
os._exit(0)  # as a killed run: no close, no exit handlers
"""


def test_a_stale_directory_is_removed_and_a_live_one_kept(tmp_path, caplog):
    tests_dir = os.path.dirname(__file__)
    subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(tmp_path), tests_dir], check=True, timeout=300,
                   env=dict(os.environ, HF_HUB_OFFLINE="1"))
    (stale,) = os.listdir(tmp_path)
    assert stale.startswith(swap.SWAP_PREFIX)
    live = offload_model(tiny_model("llama"), StrongholdConfig(window_size=1, nvme_path=str(tmp_path)), device="cpu")
    live.build_optimizer(lr=1e-3)
    (mine,) = os.listdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="stronghold_hf"):
        other = offload_model(tiny_model("llama"), StrongholdConfig(window_size=1, nvme_path=str(tmp_path)),
                              device="cpu")
        other.build_optimizer(lr=1e-3)
    assert stale not in os.listdir(tmp_path) and mine in os.listdir(tmp_path)  # two engines, two directories
    assert len(os.listdir(tmp_path)) == 2
    assert any("removed the stale NVMe swap directory" in r.getMessage() and stale in r.getMessage()
               for r in caplog.records)
    other.close()
    live.close()
    assert os.listdir(tmp_path) == []


def test_bad_settings_are_refused_early():
    with pytest.raises(ValueError, match="nvme_path needs offload_optimizer=True"):
        StrongholdConfig(nvme_path="/tmp/x", offload_optimizer=False)
    with pytest.raises(ValueError, match="nvme_ring_buffers=1; use an int >= 2"):
        StrongholdConfig(nvme_ring_buffers=1)
    with pytest.raises(ValueError, match="nvme_path=''"):
        StrongholdConfig(nvme_path="")


# ------------------------------------------------------------------------------ measured from outside
# A 39 M-parameter body: 24 blocks of hidden 320 (1.6 M each), a 0.6 M untied vocabulary.
_CHILD = llama_steps_child(layers=24, hidden=320, since="step")


def test_moments_on_disk_save_eight_bytes_per_parameter_of_peak_rss(tmp_path):
    """Two steps (the second reads the state back): the RAM tier's growth of peak RSS against
    the NVMe tier's, child by child."""
    disk = json.dumps({"nvme_path": str(tmp_path)})
    body, per_param = saved_bytes_per_unit(_CHILD, "{}", disk, "body params, two steps")
    assert body > 38e6
    assert per_param >= 0.7 * 8
    assert os.listdir(tmp_path) == []  # the child's normal exit removed its files


_VOCAB_CHILD = llama_steps_child(layers=2, hidden=256, since="step", vocab=32000)


def test_segments_keep_a_head_sized_ring_out_of_peak_rss(tmp_path):
    """An untied 32,000-row vocabulary (8.2 M parameters a matrix) next to blocks of 1.05 M,
    moments on disk, two steps: peak RSS with one region per unit (a ring of three buffers of
    the head's moments) against segments (three of a block's), child by child. Which buffers
    the embedding's and the head's regions land in depends on the I/O's timing, so in two steps
    the whole-unit ring fills two or three of its buffers: the bound is two buffers' difference."""
    from child_rss import peak_rss_growth

    whole = json.dumps({"nvme_path": str(tmp_path), "whole_units": True})
    segments = json.dumps({"nvme_path": str(tmp_path)})
    # Every allocation of 64 KiB or more its own mapping, returned on free: the peak follows the
    # live buffers, not the heap's history (glibc raises its threshold after a large free).
    _, growth = peak_rss_growth(_VOCAB_CHILD, (whole, segments), env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    head, block = 32000 * 256, 4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256
    buffer_difference = 8 * (head - block // 1024 * 1024)
    saved = growth[whole] - growth[segments]
    print(f"peak RSS growth: one region per unit {growth[whole] / 2**20:.0f} MiB, segments "
          f"{growth[segments] / 2**20:.0f} MiB; a buffer differs by {buffer_difference / 2**20:.0f} MiB")
    assert saved >= 0.7 * 2 * buffer_difference, (saved, buffer_difference)


def test_the_trainer_fit_check_counts_the_ring_instead_of_the_moments(tmp_path, monkeypatch):
    import stronghold_hf.estimate.api as est  # where estimate_for_model looks it up

    monkeypatch.setattr(est, "available_cpu_memory_bytes", lambda: 1 << 10)  # a 1 KiB machine
    with pytest.raises(ValueError, match=r"(?s)Adam 0.00 GiB.*NVMe ring .*GiB.*\)\.") as refused:
        _trainer(tmp_path, "disk", tmp_path / "nvme")
    assert "moves the Adam moments" not in str(refused.value)  # already on disk: not suggested again
    with pytest.raises(ValueError, match=r"StrongholdConfig\(nvme_path=DIR\) on a fast local disk moves the Adam"):
        _trainer(tmp_path, "ram")
