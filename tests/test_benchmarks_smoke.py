"""The benchmarks still run: each one's --smoke mode, as a subprocess, ends in a JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_cpu_adam_smoke():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_cpu_adam.py"), "--smoke"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    rows = [json.loads(ln) for ln in lines]  # every line is one JSON object
    summary = rows[-1]
    assert summary["summary"] is True
    for key in ("ratio_vs_torch_fused", "ratio_vs_bound", "ratio_vs_deepspeed", "ratio_bf16_copy_vs_deepspeed_bf16", "mparams_per_s"):
        assert key in summary, key
    assert summary["ratio_vs_torch_fused"] > 0 and summary["ratio_vs_bound"] > 0
    assert {"cpu_adam", "torch_fused", "cpu_adam_bf16_copy"} <= summary["mparams_per_s"].keys()
    assert any(r.get("study") == "gil" for r in rows)


def test_bench_memory_shows_depth_independent_device_peak():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_memory.py"), "--depths", "4,12", "--width", "32",
         "--steps", "2", "--seq", "8", "--sweep_hidden", "64", "--sweep_seq", "64", "--sweep_vocab", "1024",
         "--vocab_sweep", "512,4096", "--seq_sweep", "64,256", "--depth_sweep", "2,8"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["device_peak_ratio_deep_vs_shallow"] == 1.0
    assert summary["turn_is_free"] and summary["peak_within_bound"]
    assert all(v <= 16.05 for v in summary["host_bytes_per_param_without_staging_by_depth"].values())
    # The sweeps: the engine's device bytes do not grow with depth; plain training's do.
    depth = summary["sweeps"]["depth"]
    assert depth["engine_growth"] < 1.1 < depth["plain_growth"]
    for kind in ("vocab", "seq"):
        sweep = summary["sweeps"][kind]
        assert all(e < p for e, p in zip(sweep["engine_device_bytes"], sweep["plain_device_bytes"])), sweep


def test_bench_lora_smoke():
    import pytest

    pytest.importorskip("peft")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_lora.py"), "--n_embd", "64", "--n_layer", "2", "--vocab",
         "256", "--seq", "16", "--batch", "2", "--rounds", "1", "--steps", "2"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ratio_offload_vs_plain"] > 0
    assert 0 < summary["adapter_params"] < summary["base_params_offloaded"]


def test_bench_dp_host_bytes_fall_with_world():
    import pytest

    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_dp.py"), "--worlds", "1,2", "--n_layer", "2", "--n_embd",
         "64", "--seq", "16", "--rounds", "1", "--steps", "2"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["host_ratio_vs_world1"]["2"] == pytest.approx(0.5, abs=0.05)


def test_bench_nvme_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_nvme.py"), "--nvme_path", str(tmp_path), "--disk_mb", "16",
         "--layers", "2", "--hidden", "64", "--seq", "16", "--steps", "2"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.strip()]
    assert [r["part"] for r in rows] == ["disk", "engine", "engine", "engine", "summary"]
    assert [r["tier"] for r in rows[1:4]] == ["ram", "nvme", "nvme_masters"]
    assert rows[0]["read_gb_per_s"] > 0 and rows[0]["write_gb_per_s"] > 0
    summary = rows[-1]
    assert summary["state_bytes_per_step"] > 0 and summary["ratio_of_disk_bound"] > 0
    # The masters move with the moments (12 B/param against 8), and fetches read them.
    assert summary["masters_state_bytes_per_step"] > summary["state_bytes_per_step"]
    assert summary["masters_fetch_read_bytes_per_step"] > 0
    assert list(tmp_path.iterdir()) == []  # the benchmark's files are gone too
