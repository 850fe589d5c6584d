"""Plots from the benchmarks' JSON-lines output (bench_step, bench_train, bench_max_model).

Why: the JSON lines are the record; a plot is how a reader compares systems at a glance.
Every input file is read line by line, and each line is classified by its ``bench`` field:

  throughput_vs_size.png  tokens/s against parameter count, one line per variant, from every
                          bench_step/bench_train row that has ``params`` (pass runs at
                          several ``--model``/``--n_embd`` sizes)
  max_model_size.png      largest trainable model per system (bench_max_model summaries)
  cpu_tokens_per_s.png    bar chart of tokens/s per variant of each CPU run (one group per file)
  memory_sweeps.png       device bytes against vocabulary, sequence length and depth, the
                          engine next to plain training (bench_memory rows with ``sweep``)
  lean_loss_curves.png    train loss of exact and lean host memory (bench_lean rows)

matplotlib is not a dependency of stronghold_hf (``pip install matplotlib``, or the ``plots``
extra). A plot with no data is skipped with a message.

    python benchmarks/plot_results.py results/*.jsonl --out docs/img
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict


def _require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(
            "plot_results.py needs matplotlib, which is not a dependency of stronghold_hf: "
            "pip install matplotlib  (or pip install -e '.[plots]')"
        )
    return plt


def read_lines(paths: list[str]) -> list[tuple[str, dict]]:
    """(file, object) for every JSON object line; other lines (logs) are ignored."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    out.append((path, obj))
    return out


def _label(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def throughput_rows(lines):
    """bench_step/bench_train variant rows with params and tokens/s."""
    return [(p, o) for p, o in lines if o.get("bench") in ("step", "train") and "variant" in o
            and o.get("tokens_per_s") and o.get("params") and not o.get("skipped")]


def plot_throughput_vs_size(plt, lines, out_dir: str) -> str | None:
    rows = throughput_rows(lines)
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for _, o in rows:
        series[f'{o["bench"]}:{o["variant"]} ({o.get("device", "?")})'].append((o["params"], o["tokens_per_s"]))
    if not any(len(pts) >= 1 for pts in series.values()):
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p / 1e6 for p, _ in pts], [t for _, t in pts], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (millions, log scale)")
    ax.set_ylabel("tokens / s")
    ax.set_title("Training throughput vs model size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "throughput_vs_size.png")


def plot_max_model(plt, lines, out_dir: str) -> str | None:
    summaries = [(p, o) for p, o in lines if o.get("bench") == "max_model" and o.get("summary") and not o.get("skipped")]
    if not summaries:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    systems = ["plain", "stronghold", "zero_offload", "zero3_offload"]
    width = 0.8 / len(summaries)
    for k, (path, o) in enumerate(summaries):
        vals = [(o.get(f"max_params_{s}") or 0) / 1e9 for s in systems]
        xs = [i + k * width for i in range(len(systems))]
        cap = o.get("gpu_memory_cap_bytes")
        label = _label(path) + (f" (GPU cap {cap / 2**30:.0f} GiB)" if cap else "")
        bars = ax.bar(xs, vals, width=width, label=label)
        for bar, v in zip(bars, vals):
            ax.annotate("n/a" if v == 0 else f"{v:.2f}B", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + width * (len(summaries) - 1) / 2 for i in range(len(systems))], systems)
    ax.set_ylabel("largest trainable model (billion parameters)")
    ax.set_title("Max model size per system")
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "max_model_size.png")


def plot_cpu_bars(plt, lines, out_dir: str) -> str | None:
    groups: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for path, o in throughput_rows(lines):
        if o.get("device") == "cpu":
            groups[f'{_label(path)} ({o["bench"]})'].append((o["variant"], o["tokens_per_s"]))
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4.2), squeeze=False)
    for ax, (name, rows) in zip(axes[0], sorted(groups.items())):
        names, vals = [r[0] for r in rows], [r[1] for r in rows]
        bars = ax.bar(range(len(rows)), vals, color=["#777777" if n == "plain" else "#3b75af" for n in names])
        plain = dict(rows).get("plain")
        for bar, v in zip(bars, vals):
            text = f"{v:.0f}" + (f"\n{v / plain:.2f}x" if plain else "")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=7)
        ax.set_title(name, fontsize=8)
        ax.set_ylabel("tokens / s (CPU)")
        ax.set_ylim(0, max(vals) * 1.25)
    fig.suptitle("CPU throughput per variant (medians, one interleaved run each)", fontsize=9)
    return _save(fig, out_dir, "cpu_tokens_per_s.png")


def plot_memory_sweeps(plt, lines, out_dir: str) -> str | None:
    rows = [obj for _, obj in lines if "sweep" in obj and "engine_device_bytes" in obj]
    kinds = [k for k in ("vocab", "seq", "depth") if any(r["sweep"] == k for r in rows)]
    if not kinds:
        return None
    titles = {"vocab": "vocabulary size", "seq": "sequence length (tokens)", "depth": "blocks"}
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        points = sorted((r for r in rows if r["sweep"] == kind), key=lambda r: r[kind])
        x = [r[kind] for r in points]
        mib = 2**20
        ax.plot(x, [r["plain_device_bytes"] / mib for r in points], "o-", color="tab:red", label="plain HF")
        ax.plot(x, [r["engine_device_bytes"] / mib for r in points], "o-", color="tab:blue", label="stronghold")
        ax.plot(x, [r["engine_owned_bytes"] / mib for r in points], "s--", color="tab:blue", alpha=0.6,
                label="stronghold: window + lanes + resident")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(titles[kind])
        ax.set_ylabel("device MiB")
        first = points[0]
        fixed = {k: first[k] for k in ("vocab", "seq", "layers", "hidden") if k != ("layers" if kind == "depth" else kind)}
        ax.set_title(", ".join(f"{k} {v}" for k, v in fixed.items()), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Device bytes: parameters, optimizer state and saved activations (bench_memory.py)", fontsize=9)
    return _save(fig, out_dir, "memory_sweeps.png")


def plot_lean_loss_curves(plt, lines, out_dir: str) -> str | None:
    """Train-loss curves of exact and lean host memory, one panel per run length (bench_lean.py)."""
    rows = [obj for _, obj in lines if obj.get("bench") == "lean" and "train_loss" in obj]
    lengths = sorted({r["max_steps"] for r in rows})
    if not lengths:
        return None
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.6 * len(lengths), 3.6), squeeze=False)
    colors = {"exact": "tab:blue", "lean": "tab:orange"}
    for ax, steps in zip(axes[0], lengths):
        for r in (r for r in rows if r["max_steps"] == steps):
            ax.plot(r["steps"], r["train_loss"], "-", color=colors.get(r["mode"]),
                    label=f"{r['mode']} ({r['optim']}): eval loss {r['eval_loss']:.4f}")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_title(f"run_clm embedded default, {steps} steps", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("fp32 vs 8-bit Adam moments on the host (bench_lean.py)", fontsize=9)
    return _save(fig, out_dir, "lean_loss_curves.png")


def _save(fig, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="JSON-lines files written by the benchmarks")
    p.add_argument("--out", default="docs/img", help="output folder (default docs/img)")
    args = p.parse_args(argv)
    missing = [f for f in args.files if not os.path.isfile(f)]
    if missing:
        p.error(f"no such file(s): {missing}")
    plt = _require_matplotlib()
    lines = read_lines(args.files)
    for name, fn in (("throughput_vs_size", plot_throughput_vs_size), ("max_model_size", plot_max_model),
                     ("cpu_tokens_per_s", plot_cpu_bars), ("memory_sweeps", plot_memory_sweeps),
                     ("lean_loss_curves", plot_lean_loss_curves)):
        path = fn(plt, lines, args.out)
        print(f"{name}: {path}" if path else f"{name}: skipped (no matching lines in the inputs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
