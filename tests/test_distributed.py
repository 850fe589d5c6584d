"""Data parallel on gloo: 2 processes equal 1 process with the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "dp_train.py")


def _run(cmd, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_two_process_gloo_matches_single_process(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    single.mkdir()
    multi.mkdir()
    _run([sys.executable, SCRIPT, str(single), "4"])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533", SCRIPT, str(multi), "2"])
    ref = torch.load(single / "rank0.pt", weights_only=True)
    r0 = torch.load(multi / "rank0.pt", weights_only=True)
    r1 = torch.load(multi / "rank1.pt", weights_only=True)
    assert r0["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    for k, v in ref["state"].items():
        assert torch.equal(r0["state"][k], r1["state"][k]), f"ranks diverged at {k}"
        torch.testing.assert_close(r0["state"][k], v, rtol=1e-4, atol=2e-4, msg=lambda m: f"{k}: {m}")
