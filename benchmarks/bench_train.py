"""HF Trainer throughput and peak memory: plain, ``--stronghold``, DeepSpeed ZeRO-Offload, FSDP2.

Why: `bench_step.py` measures the engine in a bare loop; this measures what a user of the
Trainer gets, with accelerate, the LR scheduler, logging and the Trainer's own clip in the
loop. Same GPT-2 shapes and random-token data as `bench_step.py` (no hub, no tokenizer).

Variants
  plain                    `transformers.Trainer`, default optimizer (``adamw_torch_fused``)
  stronghold_auto          `StrongholdTrainer` with ``--stronghold`` and window_size ``auto``
  stronghold_w1/_w2        the same with a fixed window of 1 and 2 blocks (these stream everything:
                           ``resident=False``, what #34 measures)
  split_<budget>           with ``--budgets all,half,quarter,streamed`` (#35): window auto, and
                           ``resident="auto"`` with ``gpu_memory`` twice, half or a quarter of
                           plain's 16 B/param (``resident=False`` for streamed); the summary's flat
                           ``split_<budget>_*`` numbers: tokens/s, the step, the resident share,
                           the bound of that split and the ratios to it and to plain
  deepspeed_zero2_offload  ``--deepspeed`` ZeRO-2 with ``offload_optimizer: cpu``   } only when
  deepspeed_zero3_offload  ZeRO-3 with ``offload_param`` and ``offload_optimizer: cpu`` } `deepspeed` imports
  fsdp2_cpu_offload        FSDP2 (``fully_shard`` on every block and the root) with
                           ``CPUOffloadPolicy``, in a 1-process group (gloo on CPU), applied
                           before the Trainer sees the model: accelerate ignores ``--fsdp``
                           with ``use_cpu`` (it falls back to DDP), so its own FSDP2 path
                           cannot run here

Method. plain and the stronghold variants run in THIS process, in ``--rounds`` rounds with
the order rotating each round (A B C D, B C D A, ...), each time on a fresh deepcopy of the
same initial model. A callback records the wall clock at every ``on_step_end``; the
intervals are the step times, and the first ``--skip`` of each run are dropped (warm-up:
allocator, thread pools, the first CPU Adam wait). Medians over all rounds are reported.
DeepSpeed and FSDP2 need a process group and leave global state behind, so they run in a
subprocess each round (the same callback, the same skip).

Peak memory. On CUDA: ``torch.cuda.max_memory_allocated`` per run, in-process. On CPU the
peak RSS of a process never goes down, so each variant also runs once in its own subprocess
for ``--memory_steps`` steps and reports its peak RSS (``VmHWM``; not ``ru_maxrss``, which a
spawned child inherits from its parent, see `peak_rss_bytes`) (``--memory subprocess``, the
default; ``--memory none`` skips it). That peak includes the
interpreter, torch and transformers (reported alone as ``rss_baseline_bytes``, measured
after the imports) and the initial model, identical in every variant.

Peers. ``--peers zero2,zero3,fsdp2`` (the default) picks the systems run next to ours, each in
a subprocess per round; ``--variants`` picks among plain and the STRONGHOLD variants. DeepSpeed
is driven through ``TrainingArguments(deepspeed=<config dict>)`` only; it needs CUDA and an
importable ``deepspeed`` (never a dependency), else it is reported skipped with the reason.

The overlap bound (as in bench_step.py): per STRONGHOLD variant, the max of plain's median step
(``compute_s``), `CPUAdam` stepping the offloaded parameter count in this process
(``cpu_adam_s``), and the bytes each way per step (the engine's ledger counters, read at every
``on_step_end`` and averaged over the timed steps) over one pinned copy's bandwidth each way
(a memcpy's on CPU); ``ratio_to_bound`` = bound / the variant's median step.

Output: one JSON object per line (``"skipped": true`` with a reason for variants that cannot
run here); the LAST line is the summary, with ``ratio_stronghold_vs_plain`` (tokens/s of
stronghold_auto over plain), ``ratio_stronghold_vs_zero_offload`` (over ZeRO-2 offload;
null when DeepSpeed is absent), ``bound``, ``ratio_to_bound``, ``ratio_to_bound_by_variant``
and ``peers`` (per peer: tokens/s, median step, ``ratio_ours_vs_peer`` or the reason it did
not run).

    python benchmarks/bench_train.py --quick                      # CPU, < 5 min on 2 cores
    python benchmarks/bench_train.py --smoke                      # seconds (CI)
    python benchmarks/bench_train.py --device cuda --quick --model_size gpt2-medium-like
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# [Note: OpenMP wait policy] On a CPU run, libgomp's default is to spin at every barrier while
# the process has no more threads than cores. With other processes on the cores, a spinning
# team waits out the scheduler's time slices of a descheduled partner at every parallel
# region: plain training measured ~4x slower here (median 4.7 s vs 1.3 s per step), while a
# process running STRONGHOLD's CPU Adam workers (more threads than cores, so libgomp likely
# throttles its spinning) escaped. PASSIVE (sleep at once) puts every variant under the same policy; it
# must be set before torch loads. Set OMP_WAIT_POLICY yourself to override it.
if "cuda" not in " ".join(sys.argv[1:]):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_step import (  # noqa: E402
    BOUND_TERMS, BUDGETS, PRESETS, budget_bytes, build_model, emit, measure_cpu_adam, measure_link_bandwidth,
    overlap_bound,
)

IN_PROCESS = ("plain", "stronghold_auto", "stronghold_w1", "stronghold_w2")
#: The device/host split (#35), one per ``--budgets`` entry: in-process, like the window variants.
SPLIT = tuple(f"split_{b}" for b in BUDGETS)
SUBPROCESS = ("deepspeed_zero2_offload", "deepspeed_zero3_offload", "fsdp2_cpu_offload")
ALL_VARIANTS = IN_PROCESS + SPLIT + SUBPROCESS
#: ``--peers`` names -> the variant each one runs (every peer runs in a subprocess).
PEERS = {"zero2": "deepspeed_zero2_offload", "zero3": "deepspeed_zero3_offload", "fsdp2": "fsdp2_cpu_offload"}
SUMMARY_KEYS = (
    "ratio_stronghold_vs_plain", "ratio_stronghold_vs_zero_offload", "ratio_stronghold_vs_fsdp2_offload",
    "tokens_per_s", "peak_memory_bytes", "skipped", "bound", "ratio_to_bound", "ratio_to_bound_by_variant", "peers",
)
_WINDOW = {"stronghold_auto": "auto", "stronghold_w1": "1", "stronghold_w2": "2"}


def _rss_now() -> int:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak RSS: ``VmHWM`` of /proc/self/status, else ``ru_maxrss``.

    [Note: ru_maxrss after spawn] ``getrusage(RUSAGE_SELF).ru_maxrss`` of a child started by
    `subprocess` is at least the *parent's* peak RSS: Python spawns with vfork, and execve
    folds the high-water mark of the mm it leaves (the parent's) into the child's. Every
    child of a 1.6 GB parent then reports 1.6 GB. ``VmHWM`` belongs to the child's own mm.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- data
class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token ids; labels are the inputs (causal LM)."""

    def __init__(self, vocab_size: int, seq: int, n: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (n, seq), generator=g)  # int64 [n, s]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# ---------------------------------------------------------------------------- availability
def skip_reason(variant: str, device: torch.device) -> str | None:
    if variant.startswith("deepspeed"):
        if importlib.util.find_spec("deepspeed") is None:
            return ("deepspeed is not importable (it is never a dependency of stronghold_hf; pip install deepspeed, "
                    "or scripts/build_gpu_wheels.sh for the GPU machine)")
        if device.type != "cuda":
            return "DeepSpeed ZeRO-Offload through the Trainer needs a CUDA device"
    if variant == "fsdp2_cpu_offload":
        if not torch.distributed.is_available():
            return "torch.distributed is not available in this torch build"
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401
        except ImportError as err:
            return f"FSDP2 (torch.distributed.fsdp.fully_shard) is not available: {err}"
    return None


# ---------------------------------------------------------------------------- one Trainer run
def _timer_callback(device: torch.device):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall clock at the end of every optimizer step (device synchronised), and under
        STRONGHOLD the engine's cumulative bytes each way (the ledger's counters) at that moment."""

        def __init__(self) -> None:
            self.marks: list[float] = []
            self.traffic: list[tuple[int, int]] = []  # (h2d_bytes, d2h_bytes) at each mark

        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())
            from stronghold_hf import get_engine

            engine = get_engine(kwargs["model"]) if kwargs.get("model") is not None else None
            if engine is not None:
                stats = engine.memory_stats()
                self.traffic.append((stats["h2d_bytes"], stats["d2h_bytes"]))

    return StepTimer()


def _common_args(opts, out_dir: str, steps: int) -> dict:
    return dict(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=opts.shape["batch"], learning_rate=1e-4,
        weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=steps,
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0,
        use_cpu=opts.device.type == "cpu", bf16=opts.precision == "bf16",
    )


def _deepspeed_config(stage: int) -> dict:
    zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    }


def _apply_fsdp2(model, device: torch.device):
    """1-process group + ``fully_shard`` with CPU offload on every block and the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not dist.is_initialized():
        # No RANK/WORLD_SIZE env: accelerate keeps treating this as one plain process.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    mesh = init_device_mesh(device.type, (1,))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers  # GPT-2, Llama
    for block in blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def run_variant(variant: str, base, opts, steps: int) -> dict:
    """Trains ``variant`` for ``steps`` steps on a deepcopy of ``base``; returns times and memory."""
    import transformers
    from transformers import Trainer, TrainingArguments

    from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments

    transformers.logging.set_verbosity_error()
    device = opts.device
    model = copy.deepcopy(base)
    data = RandomTokens(opts.shape["vocab_size"], opts.shape["seq"], n=opts.shape["batch"] * steps)
    # Checkpoints are off; the Trainer still writes its output directory. Removed at the end (or
    # when the object is collected, if training raises).
    scratch = tempfile.TemporaryDirectory(prefix=f"bench_train_{variant}_")
    out_dir = scratch.name
    common = _common_args(opts, out_dir, steps)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if variant == "plain":
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=data)
    elif variant in _WINDOW or variant in SPLIT:
        # The window variants stream everything (resident=False: what #34 measures; on CUDA the
        # default would keep what fits); a split variant keeps what fits its budget (#35).
        budget = variant[len("split_"):] if variant in SPLIT else "streamed"
        cap = budget_bytes(budget, sum(p.numel() for p in base.parameters()))
        split = {"resident": False} if cap is None else {"resident": "auto", "gpu_memory": cap}
        args = StrongholdTrainingArguments(**common, stronghold=True, stronghold_window_size=_WINDOW.get(variant, "auto"),
                                           stronghold_config=split)
        trainer = StrongholdTrainer(model=model, args=args, train_dataset=data)
    elif variant.startswith("deepspeed"):
        stage = 2 if "zero2" in variant else 3
        trainer = Trainer(model=model, args=TrainingArguments(**common, deepspeed=_deepspeed_config(stage)), train_dataset=data)
    elif variant == "fsdp2_cpu_offload":
        model = _apply_fsdp2(model, device)

        class FSDP2Trainer(Trainer):
            # The sharded parameters live on the CPU (CPUOffloadPolicy); neither the Trainer
            # nor accelerate may move the model.
            def _move_model_to_device(self, model, device):
                return None

            def _build_accelerator_args(self, **kwargs):
                out = super()._build_accelerator_args(**kwargs)
                out["device_placement"] = False
                return out

        # adamw_torch (foreach): the fused CPU kernel does not take DTensor parameters.
        trainer = FSDP2Trainer(model=model, args=TrainingArguments(**common, optim="adamw_torch"), train_dataset=data)
    else:
        raise ValueError(f"unknown variant {variant!r}; use one of {ALL_VARIANTS}")
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # stdout stays JSON lines only
    timer = _timer_callback(device)
    trainer.add_callback(timer)
    trainer.train()
    marks = timer.marks
    step_times = [b - a for a, b in zip(marks, marks[1:])]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {"variant": variant, "step_times": step_times, "loss": logs[-1]["loss"] if logs else None}
    engine = getattr(trainer, "stronghold_engine", None)
    if engine is not None:
        result["window_size"] = engine.window_size
        stats = engine.memory_stats()
        result["offloaded_params"] = stats["offloaded_trainable_params"]
        result["resident_share"] = (round(stats["split_resident_params"] / stats["model_trainable_params"], 4)
                                    if stats["model_trainable_params"] else None)
        result["split_budget_bytes"] = stats["split_budget_bytes"]
        result["split_resident_bytes"] = stats["split_resident_bytes"]
        if len(timer.traffic) >= 2:
            # Bytes each way per step, over the step intervals that are timed (after --skip).
            first = min(opts.skip, len(timer.traffic) - 2)
            (h0, d0), (h1, d1) = timer.traffic[first], timer.traffic[-1]
            n = len(timer.traffic) - 1 - first
            result["h2d_bytes_per_step"], result["d2h_bytes_per_step"] = (h1 - h0) / n, (d1 - d0) / n
        result["stronghold_metrics"] = {k: v for k, v in (logs[-1] if logs else {}).items() if k.startswith("stronghold_")}
        engine.close()
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        result["peak_memory_kind"] = "cuda_max_memory_allocated"
    del trainer, model
    gc.collect()
    scratch.cleanup()
    return result


# ---------------------------------------------------------------------------- subprocess worker
def _worker_cmd(opts, variant: str, steps: int) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", variant, "--_worker_steps", str(steps),
           "--device", str(opts.device), "--precision", opts.precision, "--model_size", opts.preset]
    for k in ("n_embd", "n_layer", "n_head", "vocab_size", "seq", "batch"):
        cmd += [f"--{k}", str(opts.shape[k])]
    if opts.threads:
        cmd += ["--threads", str(opts.threads)]
    return cmd


def run_worker(opts, variant: str, steps: int) -> dict:
    """Runs one variant in a fresh process; returns its result dict or an ``error``."""
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if variant.startswith("deepspeed"):
        # The DeepSpeed integration initialises its process group from the environment.
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
    try:
        timeout = opts.worker_timeout
        if getattr(opts, "deadline", None) is not None:
            timeout = max(5.0, min(timeout, opts.deadline - time.monotonic() + 5.0))
        proc = subprocess.run(_worker_cmd(opts, variant, steps), capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"variant": variant, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def worker_main(opts) -> int:
    import transformers  # noqa: F401  (counted in the baseline, like in every variant)
    import stronghold_hf.integrations.trainer  # noqa: F401

    baseline = _rss_now()
    base = build_model(opts.shape)
    result = run_variant(opts._worker, base, opts, opts._worker_steps)
    if opts.device.type == "cpu":
        result["peak_memory_bytes"] = peak_rss_bytes()
        result["peak_memory_kind"] = "cpu_peak_rss_subprocess"
        result["rss_baseline_bytes"] = baseline
    print(json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------- the device/host split (#35)
def split_summary(budgets: list[str], rows: dict[str, dict], bounds: dict[str, dict], failed: dict[str, str]) -> dict:
    """Flat ``split_<budget>_*`` numbers, as bench_step.py prints them: tokens/s, the step, the
    resident share, the bound of that split (its terms on what still streams) and the ratios to
    it and to plain. A budget that did not run has nulls, and ``split_<budget>_error`` says why."""
    out: dict = {}
    plain = rows.get("plain")
    for b in budgets:
        r, bd = rows.get(f"split_{b}"), bounds.get(f"split_{b}")
        out[f"split_{b}_tokens_per_s"] = r["tokens_per_s"] if r else None
        out[f"split_{b}_step_s"] = r["median_step_s"] if r else None
        out[f"split_{b}_ratio_vs_plain"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3) if r and plain else None
        out[f"split_{b}_resident_share"] = r.get("resident_share") if r else None
        out[f"split_{b}_budget_bytes"] = r.get("split_budget_bytes") if r else None
        out[f"split_{b}_resident_bytes"] = r.get("split_resident_bytes") if r else None
        out[f"split_{b}_offloaded_params"] = r.get("offloaded_params") if r else None
        out[f"split_{b}_bound_s"] = bd["bound_s"] if bd else None
        out.update({f"split_{b}_bound_{term}": bd[term] if bd else None for term in BOUND_TERMS})
        out[f"split_{b}_ratio_to_bound"] = bd["ratio_to_bound"] if bd else None
        if f"split_{b}" in failed:
            out[f"split_{b}_error"] = failed[f"split_{b}"]
    return out


# ---------------------------------------------------------------------------- CLI and driver
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--model_size", default=None, choices=sorted(PRESETS),
                   help="GPT-2 shape preset from bench_step.py (default bench-small; smoke with --smoke)")
    for k in ("n_embd", "n_layer", "n_head", "vocab_size", "seq", "batch"):
        p.add_argument(f"--{k}", type=int, help=f"override the preset's {k}")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: --bf16 for every variant")
    p.add_argument("--variants", default=",".join(IN_PROCESS),
                   help="comma-separated subset of " + ",".join(ALL_VARIANTS) + " (the peers also come from --peers)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help="other systems next to ours, each in a subprocess: zero2 (DeepSpeed ZeRO-2 with the optimizer "
                        "on the CPU), zero3 (ZeRO-3, parameters offloaded too), fsdp2 (FSDP2 CPUOffloadPolicy), or none. "
                        "DeepSpeed needs CUDA and `deepspeed`; without them it is reported skipped with the reason")
    p.add_argument("--budgets", default="",
                   help="comma-separated device budgets, one StrongholdTrainer variant (split_<budget>) each, from "
                        + ",".join(BUDGETS) + ": all (resident=auto, the whole model fits), half and quarter "
                        "(gpu_memory = that share of plain's 16 B/param), streamed (resident=False)")
    p.add_argument("--bound", choices=["on", "off"], default="on",
                   help="measure the overlap bound (pinned copies each way, CPU Adam on the offloaded count)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument("--skip", type=int, default=None, help="step intervals dropped at the start of each run (warm-up)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    p.add_argument("--memory", choices=["subprocess", "none"], default=None,
                   help="CPU peak RSS per variant from a subprocess (default: subprocess, none with --smoke)")
    p.add_argument("--memory_steps", type=int, default=3)
    p.add_argument("--worker_timeout", type=int, default=600, help="seconds per subprocess run")
    p.add_argument("--time_budget_s", type=float, default=None,
                   help="start no new run after this many seconds (from start-up); the summary still comes")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--quick", action="store_true", help="the README's CPU numbers (< 5 min on 2 cores)")
    p.add_argument("--smoke", action="store_true", help="tiny model, plain + stronghold_w1 only, seconds (CI)")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_worker_steps", type=int, default=3, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    opts.device = torch.device(opts.device)
    if opts.device.type == "cuda" and opts.device.index is None:
        opts.device = torch.device("cuda", 0)  # torch.cuda helpers want an index (torch 2.11)
    if opts.device.type not in ("cpu", "cuda"):
        p.error(f"--device {opts.device}: use cpu or cuda")
    if opts.precision == "bf16" and opts.device.type == "cpu":
        # GPT-2's nn.LayerNorm gets bf16 weights (the offloaded blocks' bf16 device copies) and an
        # fp32 input: CUDA autocast runs layer_norm in fp32, CPU autocast does not, and the CPU
        # kernel refuses ("mixed dtype (CPU): expect parameter to have scalar type of Float").
        p.error("--precision bf16 needs --device cuda: on the CPU, bf16 block copies of GPT-2's LayerNorm "
                "fail under CPU autocast (mixed dtype)")
    if opts.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine")
    preset = opts.model_size or ("smoke" if opts.smoke else "bench-small")
    shape = dict(PRESETS[preset])
    for k in shape:
        if getattr(opts, k, None) is not None:
            shape[k] = getattr(opts, k)
    opts.preset, opts.shape = preset, shape
    variants = [v.strip() for v in opts.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(ALL_VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {','.join(ALL_VARIANTS)}")
    peers = [x.strip() for x in opts.peers.split(",") if x.strip() and x.strip() != "none"]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        p.error(f"--peers: unknown {unknown}; choose from {','.join(PEERS)} or none")
    budgets = [b.strip() for b in opts.budgets.split(",") if b.strip()]
    unknown = sorted(set(budgets) - set(BUDGETS))
    if unknown:
        p.error(f"--budgets: unknown {unknown}; use a comma-separated subset of {','.join(BUDGETS)}")
    opts.budgets = [b for b in BUDGETS if b in budgets]  # largest first
    if opts.smoke and opts.variants == p.get_default("variants"):
        variants = ["plain", "stronghold_w1"]  # the peers (subprocesses) only report skipped/unavailable
    variants += [f"split_{b}" for b in opts.budgets if f"split_{b}" not in variants]
    variants += [PEERS[x] for x in peers if PEERS[x] not in variants]
    opts.peer_variants = [v for v in variants if v in SUBPROCESS]
    opts.variant_list = variants
    mode = "smoke" if opts.smoke else "quick" if opts.quick else "default"
    steps, skip, rounds = {"smoke": (4, 1, 1), "quick": (8, 2, 2), "default": (12, 2, 3)}[mode]
    opts.steps = steps if opts.steps is None else opts.steps
    opts.skip = skip if opts.skip is None else opts.skip
    opts.rounds = rounds if opts.rounds is None else opts.rounds
    if opts.steps < opts.skip + 2:
        p.error(f"--steps {opts.steps} leaves no step interval after --skip {opts.skip}")
    opts.memory = opts.memory or ("none" if opts.smoke else "subprocess")
    if opts.smoke and opts.threads is None:
        opts.threads = 1  # tiny GEMMs on a busy 2-core box: see bench_step.py
    opts.mode = mode
    return opts


def main(argv=None) -> int:
    t_start = time.monotonic()
    opts = parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts._worker:
        return worker_main(opts)
    device, shape = opts.device, opts.shape
    tokens = shape["batch"] * shape["seq"]
    emit({"bench": "train", "config": True, "device": str(device), "model_size": opts.preset, **shape,
          "precision": opts.precision, "steps": opts.steps, "skip": opts.skip, "rounds": opts.rounds,
          "memory": opts.memory, "torch_threads": torch.get_num_threads(),
          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "torch": torch.__version__})

    skipped: dict[str, str] = {}
    runnable = []
    for v in opts.variant_list:
        reason = skip_reason(v, device)
        if reason:
            skipped[v] = reason
            emit({"bench": "train", "variant": v, "skipped": True, "reason": reason})
        elif opts.smoke and v in SUBPROCESS:
            skipped[v] = "not run by --smoke (runs in a subprocess; use --quick)"
            emit({"bench": "train", "variant": v, "skipped": True, "reason": skipped[v]})
        else:
            runnable.append(v)

    base = build_model(shape)
    n_params = sum(p.numel() for p in base.parameters())
    times: dict[str, list[float]] = {v: [] for v in runnable}
    run_medians: dict[str, list[float]] = {v: [] for v in runnable}  # one per round: drift and pairing
    extra: dict[str, dict] = {v: {} for v in runnable}
    failed: dict[str, str] = {}
    deadline = None if opts.time_budget_s is None else t_start + opts.time_budget_s
    opts.deadline = deadline
    truncated: list[str] = []
    for r in range(opts.rounds):
        order = runnable[r % len(runnable):] + runnable[: r % len(runnable)] if runnable else []
        for v in order:
            if v in failed:
                continue
            # Round 0 of the in-process variants always runs, so the headline ratio exists.
            if deadline is not None and time.monotonic() > deadline and not (r == 0 and v in IN_PROCESS + SPLIT):
                truncated.append(f"round {r}: {v}")
                continue
            try:
                res = run_variant(v, base, opts, opts.steps) if v in IN_PROCESS + SPLIT else run_worker(opts, v, opts.steps)
            except ValueError as err:  # a split budget below what streaming alone needs is refused by the engine
                res = {"variant": v, "error": f"refused: {err}"}
            if "error" in res:
                failed[v] = res["error"]
                continue
            times[v] += res["step_times"][opts.skip:]
            run_medians[v].append(statistics.median(res["step_times"][opts.skip:]))
            info = extra[v]
            for key in ("window_size", "stronghold_metrics", "loss", "peak_memory_kind", "rss_baseline_bytes",
                        "offloaded_params", "h2d_bytes_per_step", "d2h_bytes_per_step", "resident_share",
                        "split_budget_bytes", "split_resident_bytes"):
                if key in res:
                    info[key] = res[key]
            if "peak_memory_bytes" in res:
                info["peak_memory_bytes"] = max(info.get("peak_memory_bytes", 0), res["peak_memory_bytes"])
    if opts.memory == "subprocess" and device.type == "cpu":
        for v in runnable:
            if deadline is not None and time.monotonic() > deadline:
                extra[v]["memory_error"] = "not measured: --time_budget_s exhausted"
                continue
            if v in IN_PROCESS + SPLIT and v not in failed and times[v]:
                res = run_worker(opts, v, opts.memory_steps)
                if "error" in res:
                    extra[v]["memory_error"] = res["error"]
                else:
                    extra[v].update({k: res[k] for k in ("peak_memory_bytes", "peak_memory_kind", "rss_baseline_bytes")})

    rows: dict[str, dict] = {}
    for v in runnable:
        if v in failed:
            emit({"bench": "train", "variant": v, "failed": True, "error": failed[v]})
            continue
        if not times[v]:
            emit({"bench": "train", "variant": v, "failed": True, "error": "not run: --time_budget_s exhausted"})
            failed[v] = "not run: --time_budget_s exhausted"
            continue
        med = statistics.median(times[v])
        row = {"bench": "train", "variant": v, "device": str(device), "params": n_params,
               "tokens_per_s": round(tokens / med, 1), "median_step_s": round(med, 4),
               "steps_measured": len(times[v]), "run_median_step_s": [round(x, 4) for x in run_medians[v]],
               "peak_memory_bytes": extra[v].get("peak_memory_bytes"), **{
                   k: val for k, val in extra[v].items() if k != "peak_memory_bytes"}}
        rows[v] = row
        emit(row)

    def tps(v: str) -> float | None:
        return rows[v]["tokens_per_s"] if v in rows else None

    sh_name = next((v for v in ("stronghold_auto", "stronghold_w2", "stronghold_w1") if v in rows), None)

    def ratio(other: str) -> float | None:
        if sh_name is None or tps(other) is None:
            return None
        return round(tps(sh_name) / tps(other), 3)

    def paired(other: str) -> float | None:
        """Median over rounds of (other's run median / stronghold's run median): robust to drift."""
        if sh_name is None or other not in rows or len(run_medians[other]) != len(run_medians[sh_name]):
            return None
        return round(statistics.median(o / s for o, s in zip(run_medians[other], run_medians[sh_name])), 3)

    bounds: dict[str, dict] = {}
    measured = [v for v in rows if "h2d_bytes_per_step" in rows[v] and "offloaded_params" in rows[v]]
    if opts.bound == "on" and "plain" in rows and measured and not (
            deadline is not None and time.monotonic() > deadline + 10):
        # In this process, after every run: the copies and the CPU Adam step have the machine
        # to themselves, as the bound assumes of each.
        link = measure_link_bandwidth(device, nbytes=(256 << 20) if device.type == "cuda" else (64 << 20))
        adam = measure_cpu_adam(max(1, max(rows[v]["offloaded_params"] for v in measured)),
                                bf16_copy=opts.precision == "bf16", threads=opts.threads)
        emit({"bench": "train", "measured_for_bound": True, "link": link, "cpu_adam": adam})
        for v in measured:
            r = rows[v]
            bounds[v] = overlap_bound(r["median_step_s"], rows["plain"]["median_step_s"], r["offloaded_params"],
                                      r["h2d_bytes_per_step"], r["d2h_bytes_per_step"], link, adam)
            emit({"bench": "train", "variant": v, "bound": bounds[v]})
    peers = {}
    for v in opts.peer_variants:
        peers[v] = {"tokens_per_s": tps(v), "median_step_s": rows[v]["median_step_s"] if v in rows else None,
                    "ratio_ours_vs_peer": ratio(v), "ours": sh_name,
                    "skipped": None if v in rows else skipped.get(v) or failed.get(v) or "not run"}

    emit({
        "bench": "train", "summary": True, "device": str(device), "model_size": opts.preset, "params": n_params,
        "precision": opts.precision, "mode": opts.mode, "stronghold_variant": sh_name,
        "ratio_stronghold_vs_plain": ratio("plain"),
        "ratio_stronghold_vs_plain_paired": paired("plain"),
        "ratio_stronghold_vs_zero_offload": ratio("deepspeed_zero2_offload"),
        "ratio_stronghold_vs_zero3_offload": ratio("deepspeed_zero3_offload"),
        "ratio_stronghold_vs_fsdp2_offload": ratio("fsdp2_cpu_offload"),
        "tokens_per_s": {v: r["tokens_per_s"] for v, r in rows.items()},
        "peak_memory_bytes": {v: r["peak_memory_bytes"] for v, r in rows.items()},
        "skipped": skipped, "failed": failed, "not_run_for_time": truncated,
        "bound": bounds.get(sh_name),
        "ratio_to_bound": bounds[sh_name]["ratio_to_bound"] if sh_name in bounds else None,
        "ratio_to_bound_by_variant": {v: b["ratio_to_bound"] for v, b in bounds.items()},
        "peers": peers,
        "budgets": opts.budgets,
        **split_summary(opts.budgets, rows, bounds, failed),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
