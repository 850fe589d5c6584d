"""The one summary at the end of scripts/gpu_check.sh: every piece as a number, every target of
issues #34 ("Fast on a real GPU") and #35 ("What fits stays resident") as met or unmet.

    python scripts/gpu_summary.py DETAILS_DIR        # prints the block; writes DETAILS_DIR/targets.json

DETAILS_DIR holds what gpu_check.sh wrote: ``pieces.tsv`` (one line per piece: id, status,
seconds, note) and each piece's output (``<id>.jsonl``, ``gpu_tests.txt``). A piece that did not
run, failed, or printed no summary line leaves its targets "unmet (not run: <why>)", never a
guess. The targets:

* streamed, W=1 and ``auto``, fp32 and bf16, a GPT-2-medium and a Llama-3.2-1B shape:
  ``ratio_to_bound`` >= 0.85 (bench_step: the bound is the max of plain's step, the CPU Adam
  time, and the bytes each way over the pinned bandwidth, all measured in the same run);
* tokens/s >= 2x DeepSpeed ZeRO-Offload's (bench_step's bf16 runs and bench_train);
* tokens/s >= 1.5x FSDP2 with CPUOffloadPolicy (bench_train).

#35's, from the ``--budgets all,half,quarter,streamed`` runs (``split_step``: bench_step, GPT-2-medium
bf16, with Twin-Flow; ``split_train``: bench_train, GPT-2-small bf16), each from the flat
``split_<budget>_*`` numbers of their summary lines:

* the whole model resident ("all"): tokens/s >= 0.97x plain, in bench_step and in bench_train;
* half and a quarter of plain's 16 B/param: ``ratio_to_bound`` of that split >= 0.85;
* tokens/s fall monotonically with the budget: the smallest ratio of a budget's tokens/s to the
  next smaller one's (all/half, half/quarter, quarter/streamed) >= 1.0;
* never below everything streamed: the smallest ratio of a budget's tokens/s to streamed's >= 1.0;
* at all, half and a quarter: tokens/s >= DeepSpeed Twin-Flow's at its best ratio that fits.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SHAPES = {"gpt2": "GPT-2-medium", "llama": "Llama-3.2-1B"}
BOUND_TARGET, ZERO_TARGET, FSDP2_TARGET = 0.85, 2.0, 1.5
#: #35: the whole model resident against plain; a partial split against its bound; the order of budgets.
ALL_TARGET, SPLIT_BOUND_TARGET, ORDER_TARGET, TWINFLOW_TARGET = 0.97, 0.85, 1.0, 1.0
#: bench_step's and bench_train's ``--budgets``, largest first.
BUDGETS = ("all", "half", "quarter", "streamed")
SPLIT_PIECES = {"split_step": "bench_step", "split_train": "bench_train"}
#: #41: the engine's extra host work per block, over plain training's own, at most.
HOST_TARGET = 0.30

#: piece id (its output is <id>.jsonl) -> what it is
PIECES = {
    "pytest_gpu": "pytest -m gpu",
    "host": "bench_host (host work per block, width 32)",
    "long": "bench_long --longest (Llama-3.2-1B shape)",
    "long_attention": "bench_long --longest, attention tiling, up to 128k (Llama-3.2-1B shape)",
    "step_gpt2_fp32": "bench_step GPT-2-medium fp32",
    "step_gpt2_bf16": "bench_step GPT-2-medium bf16",
    "step_llama_bf16": "bench_step Llama-3.2-1B bf16",
    "step_llama_fp32": "bench_step Llama-3.2-1B fp32",
    "split_step": "bench_step budgets GPT-2-medium bf16",
    "train": "bench_train (Trainer, GPT-2-small)",
    "split_train": "bench_train budgets (Trainer, GPT-2-small)",
    "memory": "bench_memory (ledger vs allocator)",
    "estimate": "bench_estimate (estimator vs allocator)",
    "max_model": "bench_max_model --quick",
    "nvme": "bench_nvme",
    "fetch": "bench_fetch",
}


def read_pieces(details: Path) -> dict[str, dict]:
    pieces = {}
    path = details / "pieces.tsv"
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            parts = line.split("\t")
            if len(parts) >= 3:
                pieces[parts[0]] = {"status": parts[1], "seconds": parts[2], "note": parts[3] if len(parts) > 3 else ""}
    return pieces


def last_summary(path: Path) -> dict | None:
    """The piece's summary line (bench_estimate's only line), or None."""
    if not path.exists():
        return None
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    summaries = [r for r in rows if r.get("summary") is True or r.get("part") == "summary"]
    if summaries:
        return summaries[-1]
    only = rows[0] if len(rows) == 1 else {}
    return only if only and not only.get("config") else None  # bench_estimate prints one line, its result


def pytest_counts(path: Path) -> dict | None:
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    if not lines:
        return None
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1]):
        counts["error" if kind.startswith("error") else kind] += int(n)
    return counts


class Report:
    def __init__(self, details: Path) -> None:
        self.details = details
        self.pieces = read_pieces(details)
        self.summaries = {pid: last_summary(details / f"{pid}.jsonl") for pid in PIECES if pid != "pytest_gpu"}
        self.tests = pytest_counts(details / "gpu_tests.txt")

    def why_missing(self, pid: str) -> str:
        """Why piece ``pid`` has no usable summary."""
        info = self.pieces.get(pid)
        if info is None:
            return f"{PIECES.get(pid, pid)} is not in this run"
        if info["status"] != "ok":
            return f"{PIECES.get(pid, pid)} {info['status']}" + (f": {info['note']}" if info["note"] else "")
        return f"{PIECES.get(pid, pid)} printed no summary line"

    def value(self, pid: str, *keys) -> tuple[float | None, str | None]:
        """(number, None) from the piece's summary along ``keys``, or (None, why not)."""
        summary = self.summaries.get(pid)
        if summary is None:
            return None, self.why_missing(pid)
        node = summary
        for k in keys:
            if not isinstance(node, dict) or node.get(k) is None:
                return None, f"{PIECES[pid]}: no {'.'.join(map(str, keys))} in its summary" + self._skip_note(summary, keys)
            node = node[k]
        if isinstance(node, bool) or not isinstance(node, (int, float)):
            return None, f"{PIECES[pid]}: {'.'.join(map(str, keys))} is not a number ({node!r})"
        return float(node), None

    @staticmethod
    def _skip_note(summary: dict, keys) -> str:
        """The peer's recorded reason, when a peer's number is what is missing; the engine's, when
        a split budget did not run (``split_<budget>_error``)."""
        budget = keys[0].split("_")[1] if keys and str(keys[0]).startswith("split_") else None
        if budget and summary.get(f"split_{budget}_error"):
            return f" ({summary[f'split_{budget}_error'][:160]})"
        if len(keys) >= 2 and keys[0] == "peers":
            peer = (summary.get("peers") or {}).get(keys[1]) or {}
            if peer.get("skipped"):
                return f" ({peer['skipped']})"
        return ""

    def targets(self) -> list[dict]:
        rows = []

        def add(name: str, pid: str, keys: tuple, threshold: float) -> None:
            value, why = self.value(pid, *keys)
            rows.append({"target": name, "threshold": threshold, "value": value,
                         "met": value is not None and value >= threshold, "why_not_run": why})

        for shape, label in SHAPES.items():
            for precision in ("fp32", "bf16"):
                for variant, w in (("offload_w1", "W=1"), ("offload_auto", "auto")):
                    add(f"streamed {label} {precision} {w}: ratio_to_bound >= {BOUND_TARGET}",
                        f"step_{shape}_{precision}", ("ratio_to_bound_by_variant", variant), BOUND_TARGET)
        for shape, label in SHAPES.items():
            add(f"{label} bf16 bench_step: tokens/s vs ZeRO-Offload >= {ZERO_TARGET}x",
                f"step_{shape}_bf16", ("peers", "zero_offload", "ratio_ours_vs_peer"), ZERO_TARGET)
        add(f"bench_train: tokens/s vs ZeRO-Offload (Trainer) >= {ZERO_TARGET}x",
            "train", ("peers", "deepspeed_zero2_offload", "ratio_ours_vs_peer"), ZERO_TARGET)
        add(f"bench_train: tokens/s vs FSDP2 CPUOffloadPolicy >= {FSDP2_TARGET}x",
            "train", ("peers", "fsdp2_cpu_offload", "ratio_ours_vs_peer"), FSDP2_TARGET)
        # #41: the engine's host work per block at most 0.3 of plain's, in the GPU configuration.
        value, why = self.value("host", "gpu_config_ratio_paired")
        rows.append({"target": f"bench_host: host work per block <= {HOST_TARGET} of plain's (gpu_config, paired)",
                     "threshold": HOST_TARGET, "value": value, "met": value is not None and value <= HOST_TARGET,
                     "why_not_run": why})
        rows += self.split_targets()
        return rows

    def split_targets(self) -> list[dict]:
        """#35's targets (see the module docstring)."""
        rows = []

        def row(name: str, threshold: float, value: float | None, why: str | None) -> None:
            rows.append({"target": name, "threshold": threshold, "value": value,
                         "met": value is not None and value >= threshold, "why_not_run": why})

        for pid, bench in SPLIT_PIECES.items():
            row(f"#35 {bench} all resident: tokens/s vs plain >= {ALL_TARGET}x", ALL_TARGET,
                *self.value(pid, "split_all_ratio_vs_plain"))
        for pid, bench in SPLIT_PIECES.items():
            for b in ("half", "quarter"):
                row(f"#35 {bench} {b} budget: ratio_to_bound >= {SPLIT_BOUND_TARGET}", SPLIT_BOUND_TARGET,
                    *self.value(pid, f"split_{b}_ratio_to_bound"))
        for pid, bench in SPLIT_PIECES.items():
            tps, why = self.split_tokens(pid)
            monotone = min(tps[a] / tps[b] for a, b in zip(BUDGETS, BUDGETS[1:])) if tps else None
            row(f"#35 {bench} tokens/s fall with the budget (min ratio to the next) >= {ORDER_TARGET}", ORDER_TARGET,
                round(monotone, 3) if monotone is not None else None, why)
            floor = min(tps[b] / tps["streamed"] for b in BUDGETS[:-1]) if tps else None
            row(f"#35 {bench} never below streamed (min ratio) >= {ORDER_TARGET}", ORDER_TARGET,
                round(floor, 3) if floor is not None else None, why)
        for b in ("all", "half", "quarter"):
            value, why = self.value("split_step", f"split_{b}_ratio_vs_twinflow")
            if value is None and why and "no split_" in why:
                why += self._twinflow_note()
            row(f"#35 bench_step {b} budget: tokens/s vs Twin-Flow's best ratio >= {TWINFLOW_TARGET}x",
                TWINFLOW_TARGET, value, why)
        return rows

    def split_tokens(self, pid: str) -> tuple[dict[str, float] | None, str | None]:
        """tokens/s at every budget of a ``--budgets`` piece, or (None, why not)."""
        out = {}
        for b in BUDGETS:
            value, why = self.value(pid, f"split_{b}_tokens_per_s")
            if value is None or value <= 0:
                return None, why or f"{PIECES[pid]}: split_{b}_tokens_per_s is {value!r}"
            out[b] = value
        return out, None

    def _twinflow_note(self) -> str:
        """Why Twin-Flow has no number: the peer's recorded reason, or that no ratio fit the budget."""
        summary = self.summaries.get("split_step") or {}
        skipped = ((summary.get("peers") or {}).get("twinflow") or {}).get("skipped")
        return f" ({skipped})" if skipped else " (no Twin-Flow ratio ran, or none fits this budget)"

    def piece_rows(self) -> list[dict]:
        """Each piece with its status, seconds and one headline number."""
        headline = {
            "step_gpt2_fp32": ("ratio_to_bound",), "step_gpt2_bf16": ("ratio_to_bound",),
            "step_llama_bf16": ("ratio_to_bound",), "step_llama_fp32": ("ratio_to_bound",),
            "train": ("ratio_stronghold_vs_plain",), "split_step": ("split_all_ratio_vs_plain",),
            "split_train": ("split_all_ratio_vs_plain",), "memory": ("unexplained_vs_ledger_max_abs",),
            "estimate": ("measured_vs_estimate",), "max_model": ("max_params_stronghold",),
            "nvme": ("ratio_of_disk_bound",), "fetch": ("convert_vs_h2d",),
            "host": ("gpu_config_ratio_paired",), "long": ("longest_tokens",),
            "long_attention": ("longest_tokens",),
        }
        rows = []
        for pid, label in PIECES.items():
            info = self.pieces.get(pid, {"status": "not in this run", "seconds": "-", "note": ""})
            if pid == "pytest_gpu":
                c = self.tests
                number, what = (c["failed"] + c["error"], "tests failed") if c else (None, "tests failed")
            else:
                what = headline[pid][0]
                number, _ = self.value(pid, *headline[pid])
                model = (self.summaries.get(pid) or {}).get("model") or (self.summaries.get(pid) or {}).get("model_size")
                if model:
                    what = f"[{model}] {what}"  # the shape that ran (the --cpu dry run uses tiny ones)
            rows.append({"piece": pid, "label": label, "status": info["status"], "seconds": info["seconds"],
                         "number": number, "what": what, "note": info.get("note", "")})
        return rows


def _fmt(x: float | int | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if isinstance(x, int) or abs(x) >= 1000 else f"{x:.3f}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    details = Path(argv[0])
    report = Report(details)
    pieces, targets = report.piece_rows(), report.targets()
    out = ["", "==================== #34/#35 GPU check: summary ===================="]
    for p in pieces:
        note = f"   ({p['note']})" if p["note"] else ""
        out.append(f"piece  {p['label']:<42} {p['status']:<22} {p['seconds']:>5} s   {p['what']} = {_fmt(p['number'])}{note}")
    if report.tests:
        c = report.tests
        out.append(f"tests  passed {c['passed']}, failed {c['failed']}, errors {c['error']}, skipped {c['skipped']}")
    out.append("")
    for t in targets:
        if t["value"] is None:
            verdict = f"unmet (not run: {t['why_not_run']})"
        else:
            verdict = ("met" if t["met"] else "unmet") + f" ({_fmt(t['value'])})"
        out.append(f"target {t['target']:<80} {verdict}")
    met = sum(t["met"] for t in targets)
    out.append(f"targets met: {met}/{len(targets)}")
    print("\n".join(out))
    (details / "targets.json").write_text(json.dumps({"pieces": pieces, "targets": targets}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
