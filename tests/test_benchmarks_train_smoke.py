"""The training benchmarks run end to end (``--smoke``) and end with their documented summary line.

The three scripts start together, each in its own process, so that the interpreter and
library imports (most of each run) overlap; the test takes well under a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

CASES = {
    "bench_step.py": (
        "ratio_offload_vs_plain", "ratio_offload_vs_plain_paired", "ratios_by_window", "tokens_per_s",
        "median_step_s", "stats_per_step", "cpu_adam_hidden_fraction", "target_ratio_cpu", "meets_target",
        "bound", "ratio_to_bound", "ratio_to_bound_by_variant", "peers",
    ),
    "bench_train.py": (
        "ratio_stronghold_vs_plain", "ratio_stronghold_vs_zero_offload", "ratio_stronghold_vs_fsdp2_offload",
        "tokens_per_s", "peak_memory_bytes", "skipped", "failed",
        "bound", "ratio_to_bound", "ratio_to_bound_by_variant", "peers",
    ),
    "bench_max_model.py": (
        "max_params_plain", "max_params_stronghold", "max_params_zero_offload",
        "ratio_max_stronghold_vs_zero_offload", "skipped", "reason",
    ),
}


def _run_side_by_side(runs: dict[str, list[str]]) -> dict[str, tuple[int, str, str]]:
    """Starts each benchmark script with its arguments at once (offline, this checkout first on
    the path) and returns each one's (return code, stdout, stderr)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = {name: subprocess.Popen([sys.executable, str(BENCH / name), *args], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in runs.items()}
    out = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        out[name] = (proc.returncode, stdout, stderr)
    return out


@pytest.fixture(scope="module")
def smoke_runs():
    # bench_step runs the Llama path and the default ("auto") window next to W=1, the variants
    # and shape family scripts/gpu_check.sh measures; bench_train stays on GPT-2.
    extra = {"bench_step.py": ["--model", "llama-smoke", "--windows", "1,auto"]}
    return _run_side_by_side({name: ["--smoke", *extra.get(name, [])] for name in CASES})


def _json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_smoke_summary(smoke_runs, name):
    rc, stdout, stderr = smoke_runs[name]
    assert rc == 0, f"{name} --smoke exited {rc}:\n{stderr[-2000:]}"
    lines = _json_lines(stdout)  # every stdout line is JSON
    summary = lines[-1]
    assert summary.get("summary") is True, summary
    missing = [k for k in CASES[name] if k not in summary]
    assert not missing, f"{name}: summary lacks {missing}: {summary}"


def _assert_bound(bound: dict, step_s: float) -> None:
    """The overlap bound's four terms are positive numbers; the bound is their max, over the step."""
    terms = ("compute_s", "cpu_adam_s", "h2d_s", "d2h_s")
    assert all(isinstance(bound[k], (int, float)) and bound[k] > 0 for k in terms), bound
    assert bound["bound_s"] == max(bound[k] for k in terms) and bound["limited_by"] in terms
    assert bound["h2d_bytes_per_step"] > 0 and bound["d2h_bytes_per_step"] > 0
    assert bound["h2d_gb_per_s"] > 0 and bound["d2h_gb_per_s"] > 0 and bound["link_kind"] == "memcpy"
    assert bound["ratio_to_bound"] == pytest.approx(bound["bound_s"] / step_s, rel=0.02, abs=2e-3)


def _assert_peers_skipped_on_cpu(peers: dict, names) -> None:
    """No peer runs on a CPU: each is reported, with nulls and the reason."""
    assert set(peers) == set(names)
    for peer in peers.values():
        assert peer["tokens_per_s"] is None and peer["ratio_ours_vs_peer"] is None
        assert isinstance(peer["skipped"], str) and peer["skipped"]


def test_step_smoke_values(smoke_runs):
    lines = _json_lines(smoke_runs["bench_step.py"][1])
    summary = lines[-1]
    assert summary["ratio_offload_vs_plain"] > 0
    assert summary["stats_per_step"]["h2d_bytes"] > 0 and summary["stats_per_step"]["d2h_bytes"] > 0
    assert summary["stats_per_step"]["cpu_adam_s"] > 0
    variants = [row["variant"] for row in lines if "variant" in row]
    assert variants == ["plain", "offload_w1", "offload_auto"]
    assert summary["model"] == "llama-smoke" and set(summary["ratios_by_window"]) == {"1", "auto"}
    assert set(summary["ratio_to_bound_by_variant"]) == {"offload_w1", "offload_auto"}
    assert all(r > 0 for r in summary["ratio_to_bound_by_variant"].values())
    assert summary["bound"]["compute_s"] == summary["median_step_s"]["plain"]
    _assert_bound(summary["bound"], summary["median_step_s"]["offload_w1"])
    assert summary["ratio_to_bound"] == summary["bound"]["ratio_to_bound"]
    _assert_peers_skipped_on_cpu(summary["peers"], ["zero_offload"])
    assert summary["ratio_offload_vs_zero_offload"] is None


def test_train_smoke_values(smoke_runs):
    lines = _json_lines(smoke_runs["bench_train.py"][1])
    summary = lines[-1]
    assert summary["ratio_stronghold_vs_plain"] > 0
    assert summary["ratio_stronghold_vs_zero_offload"] is None or "deepspeed_zero2_offload" in summary["tokens_per_s"]
    runs = {row["variant"]: row for row in lines if "tokens_per_s" in row and "variant" in row}
    assert set(runs) >= {"plain", "stronghold_w1"}
    assert runs["stronghold_w1"]["window_size"] == 1
    _assert_bound(summary["bound"], runs["stronghold_w1"]["median_step_s"])
    assert summary["bound"]["compute_s"] == pytest.approx(runs["plain"]["median_step_s"], abs=1e-4)
    assert summary["ratio_to_bound_by_variant"] == {"stronghold_w1": summary["ratio_to_bound"]}
    _assert_peers_skipped_on_cpu(summary["peers"], ["deepspeed_zero2_offload", "deepspeed_zero3_offload",
                                                    "fsdp2_cpu_offload"])
    # Same seed, data and hyperparameters: the offloaded Trainer reaches the same loss.
    assert runs["stronghold_w1"]["loss"] == pytest.approx(runs["plain"]["loss"], rel=1e-4)


def test_max_model_smoke_values(smoke_runs):
    lines = _json_lines(smoke_runs["bench_max_model.py"][1])
    summary = lines[-1]
    assert summary["skipped"] is True and summary["smoke_probe_ok"] is True
    bounds = summary["estimator"]
    assert 1 <= bounds["stronghold_pred_layers"] <= bounds["cpu_bound_layers"]
    probe = next(row for row in lines if row.get("probe"))
    assert probe["ok"] and probe["params"] > 0 and probe["tokens_per_s"] > 0


# ---------------------------------------------------------------------------- the device/host split (#35)
#: 12 tiny blocks: half and a quarter of plain's bytes then keep some blocks next to the window.
SPLIT_ARGS = ["--smoke", "--n_layer", "12", "--budgets", "all,half,quarter,streamed"]
SPLIT_RUNS = {
    "bench_step.py": [*SPLIT_ARGS, "--windows", "1", "--peers", "twinflow"],
    "bench_train.py": [*SPLIT_ARGS, "--variants", "plain", "--peers", "none"],
}
#: Numbers each budget has in both summaries (bench_step adds its paired ratio and Twin-Flow's).
SPLIT_KEYS = ("tokens_per_s", "step_s", "ratio_vs_plain", "resident_share", "budget_bytes", "resident_bytes",
              "offloaded_params", "bound_s", "bound_compute_s", "bound_cpu_adam_s", "bound_h2d_s", "bound_d2h_s",
              "ratio_to_bound")


@pytest.fixture(scope="module")
def split_runs():
    out = {}
    for name, (rc, stdout, stderr) in _run_side_by_side(SPLIT_RUNS).items():
        assert rc == 0, f"{name} {SPLIT_RUNS[name]} exited {rc}:\n{stderr[-2000:]}"
        out[name] = _json_lines(stdout)
    return out


@pytest.mark.parametrize("name", sorted(SPLIT_RUNS))
def test_split_budgets_print_flat_numbers(split_runs, name):
    """``--budgets`` on CPU: every budget's step, resident share, bound and ratios are numbers in
    the summary; the whole model stays at "all", nothing at "streamed", and the resident share
    and the CPU Adam term of the bound move with the budget."""
    summary = split_runs[name][-1]
    assert summary["budgets"] == ["all", "half", "quarter", "streamed"]
    for b in summary["budgets"]:
        for key in SPLIT_KEYS:
            value = summary[f"split_{b}_{key}"]
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (b, key, value)
        assert summary[f"split_{b}_tokens_per_s"] > 0 and summary[f"split_{b}_ratio_to_bound"] > 0
        assert summary[f"split_{b}_bound_s"] == max(summary[f"split_{b}_bound_{t}"]
                                                    for t in ("compute_s", "cpu_adam_s", "h2d_s", "d2h_s"))
    share = [summary[f"split_{b}_resident_share"] for b in summary["budgets"]]
    assert share[0] == 1.0 and share[-1] == 0.0 and share == sorted(share, reverse=True), share
    assert 0.0 < share[2] < share[1] < 1.0, share  # half and quarter keep some blocks, not all
    # What streams sets the bound's host terms: none with everything resident, most when streamed.
    assert summary["split_all_offloaded_params"] == 0 and summary["split_all_bound_cpu_adam_s"] == 0.0
    assert summary["split_all_bound_s"] == summary["split_all_bound_compute_s"]
    adam = [summary[f"split_{b}_bound_cpu_adam_s"] for b in summary["budgets"]]
    assert adam == sorted(adam), adam
    assert summary["split_half_budget_bytes"] == 8 * summary["params"]
    assert summary["split_streamed_budget_bytes"] == 0


def test_split_step_rows_and_the_twinflow_peer_on_cpu(split_runs):
    """bench_step prints one flat row per budget; Twin-Flow, which needs CUDA and DeepSpeed, is
    reported skipped with the reason and leaves its comparison null."""
    lines = split_runs["bench_step.py"]
    rows = {r["split"]: r for r in lines if "split" in r and "skipped" not in r}
    assert list(rows) == ["all", "half", "quarter", "streamed"]
    assert all(not isinstance(v, (dict, list)) for r in rows.values() for v in r.values())  # flat
    assert rows["streamed"]["variant"] == "offload_w1" and rows["all"]["variant"] == "split_all"
    summary = lines[-1]
    assert isinstance(summary["peers"]["twinflow"]["skipped"], str)
    assert summary["split_half_ratio_vs_twinflow"] is None and summary["split_half_twinflow_tokens_per_s"] is None
    assert isinstance(summary["split_half_ratio_vs_plain_paired"], float)
