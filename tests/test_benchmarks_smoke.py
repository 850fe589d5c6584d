"""The benchmarks still run: each one's --smoke mode, as a subprocess, ends in a JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_bench_undo_smoke():
    """The speculation undo's benchmark: the native one-pass kernel against the torch undo, and
    a miss's rollback and redo apart against fused."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_undo.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads([ln for ln in proc.stdout.splitlines() if ln.strip()][-1])
    assert summary["summary"] is True
    for key in ("undo_native_fp32_grad_ms", "undo_torch_fp32_grad_ms", "speedup_fp32_grad", "speedup_bf16_grad",
                "miss_apart_fp32_grad_ms", "miss_fused_fp32_grad_ms", "miss_fused_speedup_bf16_grad_paired"):
        assert isinstance(summary[key], (int, float)) and summary[key] > 0, key


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


@pytest.mark.slow  # two ranks under torchrun
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


def test_allocator_trace_summary_finds_the_peak_and_who_allocated_it():
    """benchmarks/cuda_memory.py reads the allocator's history on a GPU run; its replay is
    checked here on a hand-made trace: frees count at ``free_requested`` (as allocated_bytes
    does), a block from before the trace lowers the count, and the live set at the peak is
    grouped by the innermost frame outside torch."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cuda_memory import summarize_trace

    def frames(*where):
        return [{"filename": f, "line": 1, "name": "f"} for f in where]

    engine = frames("/x/site-packages/torch/nn/functional.py", "/repo/stronghold_hf/memory.py")
    model = frames("/x/site-packages/transformers/models/gpt2/modeling_gpt2.py", "/repo/stronghold_hf/window.py")
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": engine},
        {"action": "free_requested", "addr": 99, "size": 40, "frames": []},  # allocated before the trace
        {"action": "free_completed", "addr": 99, "size": 40, "frames": []},
        {"action": "alloc", "addr": 2, "size": 50, "frames": model},
        {"action": "alloc", "addr": 3, "size": 32 << 20, "frames": []},
        {"action": "free_requested", "addr": 2, "size": 50, "frames": model},
        {"action": "alloc", "addr": 4, "size": 10, "frames": model},
        {"action": "free_requested", "addr": 3, "size": 32 << 20, "frames": []},
        {"action": "free_completed", "addr": 3, "size": 32 << 20, "frames": []},
        {"action": "free_completed", "addr": 2, "size": 50, "frames": model},
    ]
    s = summarize_trace(trace)
    assert s["peak_bytes_over_start"] == 100 - 40 + 50 + (32 << 20)
    assert s["bytes_over_start_at_end"] == 100 - 40 + 10
    assert s["live_at_peak_by_category"] == {"engine": 100, "model": 50, "no_python_frame": 32 << 20, "other": 0}
    top = s["live_at_peak_top"]
    assert top[0]["category"] == "no_python_frame" and "cuBLAS" in top[0]["note"]
    assert top[1]["where"].startswith("stronghold_hf/memory.py:1")
    assert top[2]["where"].startswith("transformers/models/gpt2/modeling_gpt2.py:1")


def test_gpu_summary_lists_every_target_and_why_one_did_not_run(tmp_path):
    """scripts/gpu_summary.py ends scripts/gpu_check.sh: every #34 target met or unmet with its
    number, and a piece that timed out, was skipped or never ran leaves "unmet (not run: why)"."""
    (tmp_path / "pieces.tsv").write_text(
        "setup\tok\t12\t\npytest_gpu\tfailed (exit 1)\t50\t\nstep_gpt2_fp32\tok\t55\t\n"
        "step_gpt2_bf16\ttimed out after 65s\t70\t\ntrain\tok\t80\t\nmemory\tskipped\t0\t20s of the 465s left, needs 35s\n")
    (tmp_path / "gpu_tests.txt").write_text("..F.\nFAILED tests/test_gpu.py::x\n1 failed, 16 passed, 626 deselected in 38.9s\n")
    step = {"bench": "step", "summary": True, "ratio_to_bound": 0.8,
            "ratio_to_bound_by_variant": {"offload_auto": 0.8, "offload_w1": 0.9}}
    (tmp_path / "step_gpt2_fp32.jsonl").write_text('{"bench": "step", "config": true}\n' + json.dumps(step) + "\n")
    (tmp_path / "step_gpt2_bf16.jsonl").write_text('{"bench": "step", "config": true}\n')  # killed before its summary
    train = {"bench": "train", "summary": True, "ratio_stronghold_vs_plain": 0.41, "peers": {
        "deepspeed_zero2_offload": {"ratio_ours_vs_peer": None, "skipped": "deepspeed is not importable"},
        "fsdp2_cpu_offload": {"ratio_ours_vs_peer": 1.94, "skipped": None}}}
    (tmp_path / "train.jsonl").write_text(json.dumps(train) + "\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("target ")]

    def verdict(start: str) -> str:
        return next(ln for ln in out.splitlines() if ln.startswith("target " + start)).split("  ")[-1].strip()

    assert verdict("streamed GPT-2-medium fp32 W=1") == "met (0.900)"
    assert verdict("streamed GPT-2-medium fp32 auto") == "unmet (0.800)"
    assert verdict("streamed GPT-2-medium bf16 W=1") == (
        "unmet (not run: bench_step GPT-2-medium bf16 timed out after 65s)")
    assert verdict("streamed Llama-3.2-1B fp32 auto") == (
        "unmet (not run: bench_step Llama-3.2-1B fp32 is not in this run)")
    assert "deepspeed is not importable" in verdict("bench_train: tokens/s vs ZeRO-Offload")
    assert verdict("bench_train: tokens/s vs FSDP2") == "met (1.940)"
    assert "targets met: 2/26" in out and len(lines) == 26
    assert verdict("bench_host") == "unmet (not run: bench_host (host work per block, width 32) is not in this run)"
    assert verdict("#35 bench_step all resident") == (
        "unmet (not run: bench_step budgets GPT-2-medium bf16 is not in this run)")
    assert "tests failed = 1\n" in out  # the pytest piece's number
    assert "20s of the 465s left, needs 35s" in out
    targets = json.loads((tmp_path / "targets.json").read_text())["targets"]
    assert [t["met"] for t in targets].count(True) == 2


def test_gpu_summary_judges_the_split_targets(tmp_path):
    """#35's targets in scripts/gpu_summary.py, from the flat split_<budget>_* numbers: all against
    plain, half and quarter against their bound, the order of the budgets, and Twin-Flow's best."""
    (tmp_path / "pieces.tsv").write_text("split_step\tok\t70\t\nsplit_train\tok\t40\t\n")
    step = {"bench": "step", "summary": True, "split_all_ratio_vs_plain": 0.98, "split_half_ratio_to_bound": 0.9,
            "split_quarter_ratio_to_bound": 0.8, "split_all_tokens_per_s": 400.0, "split_half_tokens_per_s": 300.0,
            "split_quarter_tokens_per_s": 310.0, "split_streamed_tokens_per_s": 200.0,
            "split_all_ratio_vs_twinflow": 1.2, "split_half_ratio_vs_twinflow": 0.9, "split_quarter_ratio_vs_twinflow": None,
            "peers": {"twinflow": {"skipped": None}}}
    train = {"bench": "train", "summary": True, "split_all_ratio_vs_plain": 0.95, "split_half_ratio_to_bound": 0.86,
             "split_quarter_ratio_to_bound": 0.85, "split_all_tokens_per_s": 400.0, "split_half_tokens_per_s": 300.0,
             "split_quarter_tokens_per_s": 250.0, "split_streamed_tokens_per_s": 260.0}
    (tmp_path / "split_step.jsonl").write_text(json.dumps(step) + "\n")
    (tmp_path / "split_train.jsonl").write_text(json.dumps(train) + "\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    verdicts = {ln[len("target "):].rsplit("  ", 1)[0].strip(): ln.rsplit("  ", 1)[-1].strip()
                for ln in proc.stdout.splitlines() if ln.startswith("target #35")}
    assert len(verdicts) == 13

    def verdict(start: str) -> str:
        return next(v for name, v in verdicts.items() if name.startswith(start))

    assert verdict("#35 bench_step all resident") == "met (0.980)"
    assert verdict("#35 bench_train all resident") == "unmet (0.950)"
    assert verdict("#35 bench_step half budget") == "met (0.900)"
    assert verdict("#35 bench_step quarter budget") == "unmet (0.800)"
    assert verdict("#35 bench_train quarter budget") == "met (0.850)"
    assert verdict("#35 bench_step tokens/s fall") == "unmet (0.968)"  # quarter ran faster than half
    assert verdict("#35 bench_step never below streamed") == "met (1.500)"
    assert verdict("#35 bench_train tokens/s fall") == "unmet (0.962)"
    assert verdict("#35 bench_train never below streamed") == "unmet (0.962)"  # quarter under streamed
    assert verdict("#35 bench_step all budget: tokens/s vs Twin-Flow") == "met (1.200)"
    assert verdict("#35 bench_step half budget: tokens/s vs Twin-Flow") == "unmet (0.900)"
    assert verdict("#35 bench_step quarter budget: tokens/s vs Twin-Flow").startswith("unmet (not run: ")


#: The engine's Python calls per block on the training thread, `bench_host --smoke` (see below).
HOST_CALLS_BUDGET = {"cpu_default": 345, "gpu_default": 290}


def test_bench_host_smoke(tmp_path):
    """The host-work benchmark: plain's CPU time per block, the engine's extra in the GPU
    configuration (speculation forced on), the GPU default and the CPU default, their ratios,
    the extra aten ops and the engine's Python calls per block, as numbers; and gpu_check's summary reads its line as the #41
    target's value (it used to say "printed no summary line")."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_host.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.strip()]
    summary = rows[-1]
    assert summary["bench"] == "host" and summary["summary"] is True and summary["plain_us_per_block"] > 0
    (tmp_path / "pieces.tsv").write_text("host\tok\t7\t\n")
    (tmp_path / "host.jsonl").write_text(proc.stdout)
    report = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    line = next(ln for ln in report.stdout.splitlines() if ln.startswith("target bench_host"))
    assert f"({summary['gpu_config_ratio_paired']:.3f})" in line, line
    for variant in ("gpu_config", "gpu_default", "cpu_default"):
        for key in ("extra_us_per_block", "ratio", "ratio_paired", "extra_ops_per_block"):
            assert isinstance(summary[f"{variant}_{key}"], (int, float)), (variant, key)
    # The engine's own ops per block on the training thread: a handful, not one per parameter.
    assert summary["gpu_config_extra_ops_per_block"] < 12, summary
    # The engine's Python per block, counted: a budget a change that adds per-block work must
    # argue for. The CPU default runs everything on this thread, so its count is the same in
    # every run (387 before this round's trims, 335 after); with the worker thread a task still
    # running adds a few calls (a wait), so the GPU default's budget has room for that (303
    # before, 251 after). The GPU configuration's count also depends on how many blocks a pass
    # speculated before its norm crossed the clip, which the worker's pace decides: not held.
    assert summary["cpu_default_engine_calls_per_block"] <= HOST_CALLS_BUDGET["cpu_default"], summary
    assert summary["gpu_default_engine_calls_per_block"] <= HOST_CALLS_BUDGET["gpu_default"], summary


@pytest.mark.slow  # four children, one after another
def test_bench_long_smoke():
    """The long-context benchmark: bytes per token of each variant over the sweep, the tiled
    step's cost, and that "auto" tiles nothing at a short length."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_long.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "long" and set(summary["bytes_per_token"]) == {"plain", "untiled", "tiled", "attention"}
    assert all(isinstance(v, float) and v > 0 for v in summary["bytes_per_token"].values()), summary
    assert summary["tiled_calls"] > 0 and summary["auto_tiled_calls"] == 0
    assert summary["tiled_over_untiled_paired"] > 0
