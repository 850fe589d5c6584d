"""Resuming holds the optimizer's state once (#43, item 4; transformers #17258).

A full ``torch.load`` of the checkpoint would hold the saved state while the optimizer holds
its own. The engine maps the file (`mapped_checkpoint.py`) and copies it into the host state
a tensor at a time, or into the NVMe tier a unit at a time, giving the file's pages back as
it goes. Measured from outside, in child processes through the Trainer: the peak-RSS growth
of resuming and taking one step stays within the training run's own growth plus one largest
unit's state, in the exact, lean and NVMe tiers (moments, and masters too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from child_rss import RESUME_CHILD

#: One block's fp32 master and two fp32 moments: the most the load may hold beyond training.
STATE_BYTES_PER_PARAM = 12


def _peak_growth(config: dict, phase: str, out) -> tuple[int, int]:
    # Every allocation of 64 KiB or more is its own mapping, returned on free: the peak follows
    # the live tensors, not the heap's history (which varies by tens of MiB from run to run).
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, "-c", RESUME_CHILD, json.dumps(config), phase, str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    block, kib = map(int, proc.stdout.split()[-2:])
    return block, kib * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("tier", ["nvme"] + [pytest.param(t, marks=pytest.mark.slow) for t in ("exact", "lean", "nvme_masters")])
def test_resume_holds_the_optimizer_state_once(tmp_path, tier):
    config = {"host_memory": "lean"} if tier == "lean" else {}
    if tier.startswith("nvme"):
        config.update(nvme_path=str(tmp_path / "nvme"), nvme_masters=tier == "nvme_masters")
    _, trained = _peak_growth(config, "train", tmp_path)
    assert (tmp_path / "checkpoint-2" / "optimizer.pt").is_file()
    block, resumed = _peak_growth(config, "resume", tmp_path)
    one_unit = block * STATE_BYTES_PER_PARAM
    print(f"{tier}: training grew the peak RSS by {trained / 2**20:.0f} MiB, resuming and one step by "
          f"{resumed / 2**20:.0f} MiB (one block's state: {one_unit / 2**20:.0f} MiB)")
    assert resumed <= trained + one_unit


def test_a_mapped_checkpoint_gives_pages_back_and_keeps_its_values(tmp_path):
    import torch

    from stronghold_hf.mapped_checkpoint import MappedCheckpoint

    saved = {"big": torch.arange(300_000, dtype=torch.float32), "small": torch.ones(3)}
    torch.save(saved, tmp_path / "new.pt")
    torch.save(saved, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    mapped = MappedCheckpoint(str(tmp_path / "new.pt"))
    copy = mapped.state["big"].clone()
    mapped.release(mapped.state["big"])
    if sys.platform.startswith("linux"):
        assert mapped.released_bytes >= 300_000 * 4 - 2 * 4096  # every whole page inside the tensor
    assert torch.equal(mapped.state["big"], saved["big"]) and torch.equal(copy, saved["big"])  # read again from the file
    before = mapped.released_bytes
    own = torch.zeros(300_000)
    mapped.release(own)  # not the file's: left alone
    assert mapped.released_bytes == before and own.abs().sum() == 0
    legacy = MappedCheckpoint(str(tmp_path / "legacy.pt"))  # torch cannot map it: read whole
    legacy.release(legacy.state["big"])
    assert legacy.released_bytes == 0 and torch.equal(legacy.state["big"], saved["big"])
