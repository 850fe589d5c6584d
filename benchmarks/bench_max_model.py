"""The largest GPT-2 that trains under a GPU memory cap: plain, STRONGHOLD, DeepSpeed ZeRO-Offload.

Why: STRONGHOLD's headline claim (Sun et al., SC'22) is model size: with the blocks'
parameters, gradients and Adam state in CPU RAM, the GPU only holds the working window and
the activations, so the largest trainable model is bounded by host RAM, not by the card.
This benchmark measures that bound on real hardware: for each system it searches the largest
number of layers (hidden ``--hidden``, ``--heads`` heads, sequence ``--seq``, batch
``--batch``) that trains for ``--steps`` optimizer steps under a per-process GPU memory cap
(``torch.cuda.set_per_process_memory_fraction(cap / total)``, so a "32 GB card" can be
emulated on a larger one with ``--gpu_memory 32GB``).

Systems
  plain         the model on the GPU, ``torch.optim.AdamW(fused=True)``, a plain loop
  stronghold    ``offload_model(model, StrongholdConfig(window_size=--window_size))`` and the
                engine's optimizer (CPU Adam), same loop
  zero_offload  DeepSpeed ZeRO-2 with ``offload_optimizer: cpu`` (ZeRO-Offload); only when
                `deepspeed` is importable (never a dependency)
  zero3_offload DeepSpeed ZeRO-3 with parameter and optimizer offload (opt-in via --systems)

Method.
* Every probe runs in its own SUBPROCESS with a timeout: a CUDA OOM can leave the caching
  allocator and cuBLAS handles unusable, so one failure must not poison the next probe. A
  probe passes when all steps finish; a CUDA OOM (or an allocator/cuBLAS allocation
  failure) is a clean "does not fit"; a timeout or crash also counts as "does not fit" and
  says so.
* Host RAM bounds the search: `stronghold_hf.estimate.estimate` gives the largest layer count
  whose CPU side (16 B per offloaded parameter + staging + process allowance) fits
  ``--cpu_memory`` (default 90% of the available RAM; 48 GiB with ``--quick``, so that one
  probe stays short). No probe goes above it, so no probe can push the host into swap or the
  OOM killer. The estimator's GPU-side prediction is where each search starts; it then
  gallops (10% of the start) to bracket the edge and bisects to one layer.
* Models are built on the meta device and materialised with ``to_empty`` and a tiled random
  fill (0.02-scaled; norms 1, biases 0): initialising billions of parameters with the
  per-module init would take longer than the probe.
* ``--time_budget_s`` stops the search; a system whose bracket is still open reports
  ``"exact": false`` (its max is then a lower bound).

Output: one JSON line per probe and per system, the LAST line a summary with
``max_params_plain``, ``max_params_stronghold``, ``max_params_zero_offload`` and
``ratio_max_stronghold_vs_zero_offload`` (null when DeepSpeed is absent). Without CUDA it
prints one ``"skipped": true`` summary ("needs CUDA") and exits 0; ``--smoke`` then also
validates the arguments, the estimator bound and one tiny CPU probe.

    python benchmarks/bench_max_model.py --quick --gpu_memory 32GB     # GPU, about 2 min
    python benchmarks/bench_max_model.py --gpu_memory 32GB             # GPU, full size
    python benchmarks/bench_max_model.py --smoke                       # anywhere, seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

SYSTEMS = ("plain", "stronghold", "zero_offload", "zero3_offload")
SUMMARY_KEYS = (
    "max_params_plain", "max_params_stronghold", "max_params_zero_offload", "ratio_max_stronghold_vs_zero_offload",
    "ratio_max_stronghold_vs_plain", "max_layers",
)
GPT2_VOCAB = 50257


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- model
def gpt2_config(opts, n_layer: int):
    import transformers

    return transformers.AutoConfig.for_model(
        "gpt2", n_embd=opts.hidden, n_layer=n_layer, n_head=opts.heads, n_positions=opts.seq,
        vocab_size=opts.vocab_size, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


def fast_model(cfg, device: torch.device):
    """The model on ``device`` without the per-module init: meta build, ``to_empty``, tiled fill."""
    import transformers
    from transformers.initialization import no_init_weights

    transformers.logging.set_verbosity_error()
    with torch.device("meta"), no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = model.to_empty(device=device)
    g = torch.Generator(device="cpu").manual_seed(0)
    tile = (torch.randn(1 << 20, generator=g) * 0.02).to(device)  # fp32 [2**20]
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.view(-1)
            if p.dim() == 1:
                flat.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            for off in range(0, flat.numel(), tile.numel()):
                n = min(tile.numel(), flat.numel() - off)
                flat[off : off + n].copy_(tile[:n])
        for _, buf in model.named_buffers():  # GPT-2 has none in transformers 5.x; be safe
            buf.zero_()
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    model.train()
    return model


# ---------------------------------------------------------------------------- one probe (subprocess)
def _is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return any(s in text for s in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED"))


def _rss_peak() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def probe_main(opts) -> int:
    """The probe subprocess: one JSON line (see `probe`)."""
    print(json.dumps(probe(opts, opts._probe, opts._layers)), flush=True)
    return 0


def probe(opts, system: str, n_layer: int) -> dict:
    """Trains ``system`` with ``n_layer`` layers for ``opts.steps`` steps; the verdict and numbers."""
    device = opts.device
    out = {"probe": True, "system": system, "layers": n_layer}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        if opts.gpu_memory_bytes:
            torch.cuda.set_per_process_memory_fraction(min(1.0, opts.gpu_memory_bytes / total), device)
        out["gpu_total_bytes"] = total
    t0 = time.perf_counter()
    try:
        cfg = gpt2_config(opts, n_layer)
        model = fast_model(cfg, device if system == "plain" else torch.device("cpu"))
        out["params"] = sum(p.numel() for p in model.parameters())
        if opts.gradient_checkpointing:
            # transformers 5.x renamed it; the old name warns.
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        step = _make_step(system, model, opts)
        out["build_s"] = round(time.perf_counter() - t0, 2)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, opts.vocab_size, (opts.batch, opts.seq), generator=g).to(device)  # int64 [b, s]
        times = []
        for _ in range(opts.steps):
            t = time.perf_counter()
            step(ids)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out.update(ok=True, step_times=[round(x, 4) for x in times])
        steady = times[1:] or times
        out["tokens_per_s"] = round(opts.batch * opts.seq / statistics.median(steady), 1)
    except Exception as err:  # noqa: BLE001 - the verdict is the point of the probe
        out.update(ok=False, reason="oom" if _is_oom(err) else "error", error=f"{type(err).__name__}: {str(err)[:300]}")
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    out["peak_rss_bytes"] = _rss_peak()
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def _make_step(system: str, model, opts):
    device = opts.device
    amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16) if opts.precision == "bf16" else None

    def fwd(ids):
        if amp is None:
            return model(input_ids=ids, labels=ids).loss
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids).loss

    if system == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")

        def step(ids):
            fwd(ids).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step
    if system == "stronghold":
        from stronghold_hf import StrongholdConfig, offload_model

        cfg = StrongholdConfig(window_size=opts.window_size, param_dtype=torch.bfloat16 if opts.precision == "bf16" else None)
        engine = offload_model(model, cfg, device=device)
        opt = engine.build_optimizer(lr=1e-4, weight_decay=0.01)

        def step(ids):
            fwd(ids).backward()
            engine.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            engine.synchronize()  # a probe must prove the whole step, CPU updates included

        return step
    if system in ("zero_offload", "zero3_offload"):
        import deepspeed

        zero: dict = {"stage": 2 if system == "zero_offload" else 3,
                      "offload_optimizer": {"device": "cpu", "pin_memory": True}}
        if system == "zero3_offload":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        ds_cfg = {
            "train_micro_batch_size_per_gpu": opts.batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "zero_optimization": zero, "bf16": {"enabled": opts.precision == "bf16"},
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)

        def step(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()

        return step
    raise ValueError(f"unknown system {system!r}")


def _probe_cmd(opts, system: str, n_layer: int) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--_probe", system, "--_layers", str(n_layer),
           "--device", str(opts.device), "--hidden", str(opts.hidden), "--heads", str(opts.heads),
           "--seq", str(opts.seq), "--batch", str(opts.batch), "--vocab_size", str(opts.vocab_size),
           "--steps", str(opts.steps), "--window_size", str(opts.window_size), "--precision", opts.precision,
           "--cpu_memory", str(opts.cpu_memory_bytes)]
    if opts.gpu_memory_bytes:
        cmd += ["--gpu_memory", str(opts.gpu_memory_bytes)]
    if not opts.gradient_checkpointing:
        cmd.append("--no_gradient_checkpointing")
    return cmd


def run_probe(opts, system: str, n_layer: int, timeout: float) -> dict:
    env = dict(os.environ)
    if system.startswith("zero"):
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(_probe_cmd(opts, system, n_layer), capture_output=True, text=True, env=env,
                              timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return {"probe": True, "system": system, "layers": n_layer, "ok": False, "reason": "timeout",
                "wall_s": round(time.perf_counter() - t0, 1)}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"probe"')]
    if not lines:
        tail = " | ".join((proc.stderr or "").strip().splitlines()[-3:])
        reason = "killed (host OOM?)" if proc.returncode in (-9, 137) else "crash"
        return {"probe": True, "system": system, "layers": n_layer, "ok": False, "reason": reason,
                "returncode": proc.returncode, "error": tail[-400:], "wall_s": round(time.perf_counter() - t0, 1)}
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------- estimator bounds
def _largest(fits, hint: int, cap: int) -> int:
    """Largest ``L`` in ``[0, cap]`` with ``fits(L)``, assuming monotonicity, starting at ``hint``.

    The byte counts are linear in the layer count, so ``hint`` (a linear extrapolation) is
    usually the answer: two estimator calls confirm it; otherwise bisect.
    """
    lo, hi = 0, cap + 1  # fits(lo) assumed, not fits(hi) assumed
    guess = max(1, min(cap, hint))
    if fits(guess):
        if guess == cap or not fits(guess + 1):
            return guess
        lo, guess = guess + 1, (guess + 1 + hi) // 2
    else:
        hi, guess = guess, guess // 2
    while hi - lo > 1:
        if fits(guess):
            lo = guess
        else:
            hi = guess
        guess = (lo + hi) // 2
    return lo


def estimator_bounds(opts) -> dict:
    """From `stronghold_hf.estimate`: the CPU-RAM bound on layers and each system's predicted max."""
    from stronghold_hf.estimate import estimate

    gpu_cap = opts.gpu_memory_bytes or opts.gpu_total_bytes
    assert gpu_cap, "estimator_bounds needs a GPU size (the cap or the card's total)"

    def est(n_layer: int):
        return estimate(
            gpt2_config(opts, n_layer), seq_len=opts.seq, batch_size=opts.batch, dtype=opts.precision,
            gpu_memory_bytes=gpu_cap,
            cpu_memory_bytes=opts.cpu_memory_bytes, gradient_checkpointing=opts.gradient_checkpointing,
            window_size=opts.window_size, cpu_reserve=opts.cpu_reserve, gpu_reserve=opts.gpu_reserve,
        )

    e1, e2 = est(1), est(2)
    per_layer_cpu = max(1, e2.cpu_bytes_needed - e1.cpu_bytes_needed)
    hint = int((opts.cpu_memory_bytes - e1.cpu_bytes_needed) // per_layer_cpu) + 1
    cap = max(1, 4 * hint + 8)
    cpu_bound = _largest(lambda n: bool(est(n).cpu_fits), hint, cap)
    stronghold_pred = _largest(lambda n: bool(est(n).fits), cpu_bound, cpu_bound)
    per_layer_plain = max(1, e2.plain_gpu_bytes_needed - e1.plain_gpu_bytes_needed)
    plain_hint = max(1, int((gpu_cap - e1.plain_gpu_bytes_needed) // per_layer_plain) + 1)
    plain_pred = _largest(lambda n: bool(est(n).plain_fits), max(1, plain_hint), max(1, 2 * plain_hint + 4))
    return {
        "cpu_bound_layers": cpu_bound, "stronghold_pred_layers": stronghold_pred, "plain_pred_layers": plain_pred,
        "params_per_layer": (e2.total_params - e1.total_params), "params_at_1_layer": e1.total_params,
        "cpu_bytes_per_layer": per_layer_cpu,
    }


# ---------------------------------------------------------------------------- search
class Search:
    """Galloping then bisection for one system, bounded by ``upper`` and the time budget."""

    def __init__(self, opts, system: str, start: int, upper: int, deadline: float) -> None:
        self.opts, self.system, self.upper, self.deadline = opts, system, upper, deadline
        self.lo, self.hi = 0, upper + 1  # largest pass, smallest fail (upper+1: not probed, bound)
        self.best: dict | None = None
        self.start = max(1, min(start, upper))
        self.step = max(1, math.ceil(0.1 * self.start))
        self.probes = 0

    def next_layers(self) -> int | None:
        if self.hi - self.lo <= 1:
            return None
        if self.probes == 0:
            return self.start
        if self.lo > 0 and self.hi > self.upper:  # only passes so far: gallop up
            n, self.step = min(self.upper, self.lo + self.step), self.step * 2
            return n
        if self.lo == 0 and self.hi <= self.upper:  # only fails so far: gallop down
            n, self.step = max(1, self.hi - self.step), self.step * 2
            return n
        return (self.lo + self.hi) // 2

    def run(self) -> dict:
        while True:
            n = self.next_layers()
            remaining = self.deadline - time.monotonic()
            if n is None or remaining < self.opts.min_probe_s:
                break
            res = run_probe(self.opts, self.system, n, min(self.opts.probe_timeout, remaining))
            self.probes += 1
            emit({"bench": "max_model", **res})
            if res.get("ok"):
                self.lo = n
                if self.best is None or n > self.best["layers"]:
                    self.best = res
            else:
                self.hi = min(self.hi, n)
        exact = self.hi - self.lo <= 1
        limited_by = None
        if exact and self.hi == self.upper + 1:
            limited_by = "cpu_ram_bound (estimator)"
        elif exact:
            limited_by = "gpu_memory (probed)"
        return {
            "bench": "max_model", "system": self.system, "max_layers": self.lo or None,
            "max_params": self.best["params"] if self.best else None,
            "tokens_per_s": self.best.get("tokens_per_s") if self.best else None,
            "peak_gpu_bytes": self.best.get("peak_gpu_bytes") if self.best else None,
            "peak_rss_bytes": self.best.get("peak_rss_bytes") if self.best else None,
            "exact": exact, "first_fail_layers": self.hi if self.hi <= self.upper else None,
            "upper_bound_layers": self.upper, "limited_by": limited_by, "probes": self.probes,
        }


# ---------------------------------------------------------------------------- CLI
def parse_args(argv=None) -> argparse.Namespace:
    from stronghold_hf.estimate import available_cpu_memory_bytes, parse_memory

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default); cpu only for --smoke probes")
    p.add_argument("--gpu_memory", default=None, help="GPU memory cap, e.g. 32GB (binary units); default: the whole card")
    p.add_argument("--cpu_memory", default=None, help="host RAM the search may use (default 90%% of available; 48GB with --quick)")
    p.add_argument("--cpu_reserve", default="0", help="host memory the estimator's bound keeps free (default 0: "
                   "--cpu_memory is already what the search may use); a size or auto, as StrongholdConfig's")
    p.add_argument("--gpu_reserve", default=None, help="device memory the estimator's bound keeps free (default auto, "
                   "as StrongholdConfig's: the CUDA context and fragmentation; 0 with --smoke, whose caps are nominal)")
    p.add_argument("--hidden", type=int, default=None, help="n_embd (default 2048)")
    p.add_argument("--heads", type=int, default=None, help="n_head (default 16)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; 512 with --quick)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 4; 2 with --quick)")
    p.add_argument("--vocab_size", type=int, default=GPT2_VOCAB)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps a probe must finish")
    p.add_argument("--window_size", type=int, default=2, help="STRONGHOLD window")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--no_gradient_checkpointing", dest="gradient_checkpointing", action="store_false",
                   help="gradient checkpointing is on by default for every system (activations would otherwise "
                        "bound STRONGHOLD long before host RAM does)")
    p.add_argument("--systems", default="plain,stronghold,zero_offload", help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--probe_timeout", type=float, default=None, help="seconds per probe (default 600; 75 with --quick)")
    p.add_argument("--time_budget_s", type=float, default=None,
                   help="whole run, from start-up (default 3600; 110 with --quick); no probe starts past it")
    p.add_argument("--min_probe_s", type=float, default=15.0, help="do not start a probe with less budget left")
    p.add_argument("--quick", action="store_true", help="seq 512, batch 2, 48 GiB host RAM, about 2 minutes")
    p.add_argument("--smoke", action="store_true", help="validate arguments and run one tiny CPU probe (CI)")
    p.add_argument("--_probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_layers", type=int, default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    q = opts.quick
    opts.hidden = opts.hidden or (64 if opts.smoke else 2048)
    opts.heads = opts.heads or (2 if opts.smoke else 16)
    opts.seq = opts.seq or (32 if opts.smoke else 512 if q else 1024)
    opts.batch = opts.batch or (2 if opts.smoke or q else 4)
    if opts.smoke:
        # Small enough that the estimator's bounds stay at a few dozen tiny layers (each bound
        # is a search over models built on the meta device: thousands of layers take minutes).
        opts.vocab_size = min(opts.vocab_size, 256)
        # (The host side counts the process's own 2 GiB before any layer.)
        opts.gpu_memory = opts.gpu_memory or "100MB"
        opts.cpu_memory = opts.cpu_memory or "2080MB"
        opts.gpu_reserve = opts.gpu_reserve or "0"
    opts.gpu_reserve = opts.gpu_reserve or "auto"
    if opts.hidden % opts.heads:
        p.error(f"--hidden {opts.hidden} is not divisible by --heads {opts.heads}")
    for name in ("seq", "batch", "steps", "window_size", "vocab_size"):
        if getattr(opts, name) < 1:
            p.error(f"--{name} must be >= 1")
    try:
        for name in ("cpu_reserve", "gpu_reserve"):
            value = getattr(opts, name)
            setattr(opts, name, value if value == "auto" else parse_memory(value))
        opts.gpu_memory_bytes = parse_memory(opts.gpu_memory) if opts.gpu_memory else None
        if opts.cpu_memory:
            opts.cpu_memory_bytes = parse_memory(opts.cpu_memory)
        else:
            avail = available_cpu_memory_bytes() or 0
            opts.cpu_memory_bytes = int(0.9 * avail)
            if q:
                opts.cpu_memory_bytes = min(opts.cpu_memory_bytes, 48 * 2**30)
    except ValueError as err:
        p.error(str(err))
    systems = [s.strip() for s in opts.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"--systems: unknown {unknown}; choose from {','.join(SYSTEMS)}")
    opts.system_list = systems
    opts.probe_timeout = opts.probe_timeout or (75.0 if q else 600.0)
    opts.time_budget_s = opts.time_budget_s or (110.0 if q else 3600.0)
    opts.device = torch.device(opts.device)
    if opts.device.type == "cuda" and opts.device.index is None:
        # torch.cuda.set_device and set_per_process_memory_fraction want an index: on torch 2.11
        # a bare "cuda" raised "Expected a torch.device with a specified index" in every probe.
        opts.device = torch.device("cuda", 0)
    if opts.device.type not in ("cpu", "cuda"):
        p.error(f"--device {opts.device}: use cuda (or cpu with --smoke)")
    opts.gpu_total_bytes = None
    opts.mode = "smoke" if opts.smoke else "quick" if q else "default"
    return opts


def _skipped_summary(opts, reason: str, **extra) -> dict:
    return {"bench": "max_model", "summary": True, "skipped": True, "reason": reason, "mode": opts.mode,
            **{k: None for k in SUMMARY_KEYS}, **extra}


def main(argv=None) -> int:
    t_start = time.monotonic()
    opts = parse_args(argv)
    if opts._probe:
        return probe_main(opts)
    if opts.smoke:
        # Arguments parsed; the estimator bound and one tiny probe run on the CPU. The probe
        # runs in this process (a second interpreter would double the smoke's time, which is
        # mostly imports); its subprocess command line is checked by parsing it back.
        opts.device = torch.device("cpu")
        bounds = estimator_bounds(opts)
        cmd = _probe_cmd(opts, "stronghold", 2)
        back = parse_args(cmd[2:])
        assert (back._probe, back._layers, back.hidden, back.seq, back.cpu_memory_bytes) == (
            "stronghold", 2, opts.hidden, opts.seq, opts.cpu_memory_bytes), cmd
        res = probe(opts, "stronghold", 2)
        emit({"bench": "max_model", **res})
        ok = bool(res.get("ok"))
        emit(_skipped_summary(opts, "smoke: arguments, estimator bound and one tiny CPU probe only", smoke_probe_ok=ok,
                              estimator=bounds))
        return 0 if ok else 1
    if opts.device.type != "cuda" or not torch.cuda.is_available():
        emit(_skipped_summary(opts, "skipped: needs CUDA (this benchmark measures GPU memory; run it on a GPU machine)"))
        return 0
    opts.gpu_total_bytes = torch.cuda.get_device_properties(opts.device).total_memory
    bounds = estimator_bounds(opts)
    emit({"bench": "max_model", "config": True, "gpu": torch.cuda.get_device_name(opts.device),
          "gpu_total_bytes": opts.gpu_total_bytes, "gpu_memory_cap_bytes": opts.gpu_memory_bytes,
          "cpu_memory_bytes": opts.cpu_memory_bytes, "hidden": opts.hidden, "heads": opts.heads, "seq": opts.seq,
          "batch": opts.batch, "vocab_size": opts.vocab_size, "precision": opts.precision,
          "gradient_checkpointing": opts.gradient_checkpointing, "window_size": opts.window_size,
          "steps": opts.steps, "mode": opts.mode, "estimator": bounds})

    deadline = t_start + opts.time_budget_s  # the whole run, imports and estimator included
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    # STRONGHOLD first (the headline), then plain, then DeepSpeed; each gets a share of what is left.
    order = []
    for system in ("stronghold", "plain", "zero_offload", "zero3_offload"):
        if system not in opts.system_list:
            continue
        if system.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
            skipped[system] = "deepspeed is not importable (never a dependency of stronghold_hf)"
            emit({"bench": "max_model", "system": system, "skipped": True, "reason": skipped[system]})
            continue
        order.append(system)
    for system in order:
        upper = bounds["cpu_bound_layers"]
        if system == "plain":
            start, upper = bounds["plain_pred_layers"], max(upper, 2 * bounds["plain_pred_layers"] + 2)
        elif system == "stronghold":
            start = bounds["stronghold_pred_layers"]
        else:
            start = min(upper, 2 * bounds["plain_pred_layers"] + 1)
        # Leave each later system a share of the budget.
        later = len(order) - order.index(system) - 1
        share = deadline if later == 0 else time.monotonic() + (deadline - time.monotonic()) / (later + 1) * 1.5
        res = Search(opts, system, start, upper, min(deadline, share)).run()
        results[system] = res
        emit(res)

    def mp(system: str) -> int | None:
        return results.get(system, {}).get("max_params")

    def ratio(a: int | None, b: int | None) -> float | None:
        return round(a / b, 3) if a and b else None

    emit({
        "bench": "max_model", "summary": True, "skipped": False, "mode": opts.mode,
        "gpu_memory_cap_bytes": opts.gpu_memory_bytes, "cpu_memory_bytes": opts.cpu_memory_bytes,
        "max_params_plain": mp("plain"), "max_params_stronghold": mp("stronghold"),
        "max_params_zero_offload": mp("zero_offload"), "max_params_zero3_offload": mp("zero3_offload"),
        "ratio_max_stronghold_vs_zero_offload": ratio(mp("stronghold"), mp("zero_offload")),
        "ratio_max_stronghold_vs_plain": ratio(mp("stronghold"), mp("plain")),
        "max_layers": {s: r.get("max_layers") for s, r in results.items()},
        "exact": {s: r.get("exact") for s, r in results.items()},
        "tokens_per_s": {s: r.get("tokens_per_s") for s, r in results.items()},
        "skipped_systems": skipped,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
