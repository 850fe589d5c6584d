"""Training-step throughput of the window engine against plain training, in a plain loop.

Why: `offload_model` adds work to every step: fetching each block into its slot (twice: for
forward and for backward), packing and shipping its gradients, and a CPU Adam update per
block that runs in worker threads, pipelined with the next forward. This benchmark measures
what that costs on the step, with no Trainer in between, on the same GPT-2 and the same
batches:

  plain       the model on ``--device``, ``torch.optim.AdamW(fused=True)``,
              ``torch.nn.utils.clip_grad_norm_(1.0)``
  offload_wN  a deepcopy under ``offload_model(copy, StrongholdConfig(window_size=N))``,
              ``engine.build_optimizer(...)``, ``engine.clip_grad_norm_(1.0)``; one variant per
              ``--windows`` entry (``offload_auto`` for ``auto``, the default config)
  zero_offload  DeepSpeed ZeRO-Offload, with ``--peers zero_offload`` (below)
  offload_wN_nb_off  the same with ``offload_non_block=False`` (embeddings and head on the
              device with a device AdamW, the first version), with ``--non_block on,off``;
              the summary's ``ratio_non_block_on_vs_off_paired`` is tokens/s with everything
              outside the blocks offloaded over tokens/s without (target >= 0.95)
  offload_wN_vocab_whole  the same with ``StrongholdConfig(vocab_pieces=False)``, with
              ``--vocab_pieces on,off``; the summary's ``ratio_vocab_whole_over_pieces_paired``
              is its tokens/s over the first offloaded variant's (above 1: pieces are slower)
  offload_wN_control  the first offloaded variant again, with ``--control``: the summary's
              ``ratio_control_paired`` is its tokens/s over the first's, the same code against
              itself, so how far this run's paired ratios stray by noise alone

Method. All variants live in ONE process (these shared machines drift by about +-30% from
minute to minute, shared/NOTES.md), are warmed up, then run in interleaved blocks of
``--block_steps`` steps, with the order rotating every round. The first step of each block is
not counted: for the offloaded variants it has no previous step's updates to wait for, so it
would flatter them. After a block the engine is drained (``engine.synchronize()``, untimed):
the last step's updates overlap with the *next* step in steady state, and the first counted
step of the next block pays for the updates of the step before it, so each counted step
carries exactly one step of CPU Adam. Reported per variant: medians of the counted steps,
tokens/s from the median, per-phase medians (forward, backward, clip, step), and for the
offloaded variants the engine's counters per step (``engine.stats.as_dict()``) and

    cpu_adam_hidden_fraction = 1 - blocked_s / cpu_adam_s   (both per step)

where ``blocked_s`` is the time the training thread waited on unfinished CPU updates (and,
on CUDA, on gradient copies), ``cpu_adam_s`` the time the workers spent updating. A fraction
of 1 means the training thread never waited; it says nothing about how much the workers
slowed the training thread down by sharing its cores (compare the phase times for that).

The overlap bound. An offloaded step cannot be faster than the slowest of four things it
overlaps: plain's step on the device (``compute_s``, plain's median step in this run), the CPU
Adam work for the offloaded parameters (``cpu_adam_s``: `CPUAdam` stepping that many fp32
parameters in this process after the run, with the bf16 copy-out under ``--precision bf16``),
and the bytes each way per step (the engine's ``h2d_bytes``/``d2h_bytes`` counters) over the
bandwidth of one pinned copy each way measured in this run (``h2d_s``, ``d2h_s``; on CPU the
"copy" is a memcpy and its bandwidth is that). ``bound_s`` is their max and ``ratio_to_bound``
= bound_s / the variant's median step (1.0: everything hidden; #34's target on a GPU: 0.85).

The device/host split (#35, ``--budgets all,half,quarter,streamed``): the window variants stream
everything (``resident=False``, what #34 measures; on CUDA the default config would otherwise
keep what fits). ``--budgets`` adds one variant per device budget, on the window of
``--windows[0]``: ``split_all`` (``resident="auto"``, ``gpu_memory`` twice plain's model-state
bytes: the whole model stays), ``split_half`` and ``split_quarter`` (``gpu_memory`` = that share
of plain's 16 B/param: fp32 parameters, gradients and two Adam moments); ``streamed`` is the
first window variant itself. Each budget prints a flat row (and flat ``split_<budget>_*`` keys in
the summary): step, tokens/s, ``resident_share`` (parameters kept over trainable, from
``memory_stats()``'s ``split_*`` keys), the bound *of that split* (the same four terms, on what
still streams: its bytes each way and CPU Adam on its ``offloaded_trainable_params``; plain's
compute) and the ratio to it, the ratio to plain, and with ``--peers twinflow`` the ratio to
Twin-Flow. A budget the engine refuses (below what streaming alone needs) prints nulls and why.

Twin-Flow (``--peers twinflow``, with ``--budgets``; CUDA and ``deepspeed``): DeepSpeed ZeRO-3 with
``offload_optimizer: {device: cpu, ratio: r}`` (ZeRO-Offload++: the share ``r`` of the optimizer
state is stepped by CPU Adam, the rest on the device), one engine per ``--twinflow_ratios`` entry.
At each budget the fastest ratio whose model states fit it (`twinflow_device_bytes`, an
estimate) is the peer.

Peers (``--peers zero_offload``, the default): DeepSpeed ZeRO-2 with ``offload_optimizer:
cpu`` (ZeRO-Offload), driven through ``deepspeed.initialize`` with a config dict, interleaved
with the other variants. It needs CUDA and an importable ``deepspeed`` (never a dependency:
scripts/build_gpu_wheels.sh carries it to the GPU machine); otherwise ``peers.zero_offload``
is reported with nulls and the reason.

Output: one JSON object per line; the LAST line is the summary, with
``ratio_offload_vs_plain`` (tokens/s of ``offload_{--windows[0]}`` over plain; target on CPU
>= 0.85), ``ratios_by_window``, ``stats_per_step``, ``cpu_adam_hidden_fraction``, ``bound``
(the terms above for the first offloaded variant), ``ratio_to_bound``,
``ratio_to_bound_by_variant`` and ``peers`` (tokens/s, median step, ``ratio_ours_vs_peer``).

    python benchmarks/bench_step.py --quick          # CPU, < 3 min on 2 cores
    python benchmarks/bench_step.py --smoke          # seconds, tiny model (CI)
    python benchmarks/bench_step.py --device cuda --model gpt2-medium-like --seq 512 --batch 8 --windows 1,2,4
    python benchmarks/bench_step.py --device cuda --model llama-3.2-1b-like --windows auto,1 --precision bf16
    python benchmarks/bench_step.py --quick --budgets all,half,quarter,streamed
    python benchmarks/bench_step.py --device cuda --model gpt2-medium-like --precision bf16 --windows auto \
        --budgets all,half,quarter,streamed --peers twinflow
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

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

import torch  # noqa: E402

#: GPT-2 shapes. "bench-small" is the CPU default: wide enough that GEMMs dominate Python
#: overhead, small enough that a CPU step takes well under a second on 2 idle cores. The
#: vocabulary is cut to 8192 so that the resident head (identical in both variants) does not
#: dilute the ratio; the gpt2-* presets keep GPT-2's 50257.
PRESETS: dict[str, dict[str, int]] = {
    "smoke": dict(n_embd=64, n_layer=2, n_head=2, vocab_size=256, seq=32, batch=2),
    # examples/run_clm.py with no arguments: 4 x 128 GPT-2, the 8192-token embedded tokenizer,
    # block_size 128, batch 8.
    "embedded-default": dict(n_embd=128, n_layer=4, n_head=4, vocab_size=8192, seq=128, batch=8),
    "bench-small": dict(n_embd=384, n_layer=6, n_head=6, vocab_size=8192, seq=128, batch=4),
    "bench-medium": dict(n_embd=512, n_layer=8, n_head=8, vocab_size=8192, seq=128, batch=4),
    "gpt2-small-like": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, seq=512, batch=8),
    "gpt2-medium-like": dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, seq=512, batch=8),
    "gpt2-large-like": dict(n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, seq=512, batch=8),
    # Llama-3.2-1B's shapes (1.24 B parameters, tied embeddings, GQA 32/8, SwiGLU 8192), and a
    # tiny model of the same family for CPU runs of the Llama path.
    "llama-3.2-1b-like": dict(arch="llama", n_embd=2048, n_layer=16, n_head=32, n_kv_head=8, ffn=8192,
                              vocab_size=128256, seq=512, batch=8),
    "llama-smoke": dict(arch="llama", n_embd=64, n_layer=2, n_head=4, n_kv_head=2, ffn=128, vocab_size=256,
                        seq=32, batch=2),
}

SUMMARY_KEYS = (
    "ratio_offload_vs_plain", "ratio_offload_vs_plain_paired", "ratios_by_window", "tokens_per_s", "stats_per_step",
    "cpu_adam_hidden_fraction", "first_block_ready_fraction", "forward_stall_fraction", "speculation",
    "bound", "ratio_to_bound", "ratio_to_bound_by_variant", "peers", "target_ratio_cpu", "meets_target",
)
#: The overlap bound's terms, each in seconds per step (see `overlap_bound`).
BOUND_TERMS = ("compute_s", "cpu_adam_s", "h2d_s", "d2h_s")


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------------------- model and data
def build_model(shape: dict, seed: int = 0):
    """GPT-2 (or, with ``arch="llama"``, Llama) of ``shape``, with cheap random weights.

    Built under transformers' ``no_init_weights`` and filled from one tiled block of N(0, 0.02)
    values (norm weights 1, biases 0): the per-module init of a billion parameters takes
    20-40 s on a few cores (shared/gpu: 43 s in bench_estimate), and a step's time does not
    depend on what the weights are. Deterministic in ``seed``."""
    import transformers
    from transformers.initialization import no_init_weights

    transformers.logging.set_verbosity_error()
    if shape.get("arch", "gpt2") == "llama":
        cfg = transformers.AutoConfig.for_model(
            "llama", hidden_size=shape["n_embd"], num_hidden_layers=shape["n_layer"],
            num_attention_heads=shape["n_head"], num_key_value_heads=shape.get("n_kv_head", shape["n_head"]),
            intermediate_size=shape.get("ffn", 4 * shape["n_embd"]), vocab_size=shape["vocab_size"],
            max_position_embeddings=max(shape["seq"], 64), tie_word_embeddings=True, rope_theta=500000.0,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
    else:
        cfg = transformers.AutoConfig.for_model(
            "gpt2", n_embd=shape["n_embd"], n_layer=shape["n_layer"], n_head=shape["n_head"],
            n_positions=max(shape["seq"], 64), vocab_size=shape["vocab_size"], bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.tie_weights()  # no_init_weights skips init_weights, which ties them
    g = torch.Generator().manual_seed(seed)
    tile = torch.randn(1 << 20, generator=g) * 0.02  # fp32 [2**20]
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied weight is listed once
            flat = p.view(-1)
            if p.dim() == 1:
                flat.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            src = tile.roll(int(torch.randint(0, tile.numel(), (1,), generator=g)))  # tensors do not start alike
            for off in range(0, flat.numel(), src.numel()):
                n = min(src.numel(), flat.numel() - off)
                flat[off : off + n].copy_(src[:n])
    model.train()
    return model


def make_batches(shape: dict[str, int], n: int, device: torch.device, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g)  # int64 [b, s]
        out.append({"input_ids": ids.to(device), "labels": ids.to(device)})
    return out


# ---------------------------------------------------------------------------- variants
@dataclass
class Variant:
    name: str
    step: Callable[[dict], dict[str, float]]  # one training step -> phase seconds
    drain: Callable[[], None] = lambda: None  # finish asynchronous work (untimed)
    engine: object = None
    window_size: int | None = None
    steps: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)  # median counted step per round
    phases: dict[str, list[float]] = field(default_factory=dict)
    counters: list[dict[str, float]] = field(default_factory=list)  # per block, per step
    losses: list[float] = field(default_factory=list)


def _sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


def plain_variant(base, device: torch.device, precision: str, lr: float, max_norm: float) -> Variant:
    model = copy.deepcopy(base).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    sync = _sync_fn(device)

    def step(b: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        with _autocast(device, precision):
            loss = model(**b).loss
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        sync()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "clip": t3 - t2, "step": t4 - t3, "loss": float(loss.detach())}

    return Variant("plain", step)


def offload_variant(base, device: torch.device, precision: str, lr: float, window_size: int | str, cpu_threads: int | None,
                    speculative: str, max_norm: float, non_block: bool = True, host_worker: str = "auto",
                    resident: bool | str = False, gpu_memory: int | None = None, name: str | None = None,
                    vocab_pieces: bool | None = None) -> Variant:
    """``resident=False`` (the default here): everything streams, which is what the window
    variants measure (#34); the `--budgets` variants pass ``resident="auto"`` and a ``gpu_memory``."""
    from stronghold_hf import StrongholdConfig, offload_model

    model = copy.deepcopy(base)
    cfg = StrongholdConfig(
        window_size=window_size, cpu_threads=cpu_threads, speculative_step=speculative,
        param_dtype=torch.bfloat16 if precision == "bf16" else None, offload_non_block=non_block,
        host_worker=host_worker, resident=resident, gpu_memory=gpu_memory,
        **({} if vocab_pieces is None else {"vocab_pieces": vocab_pieces}),  # None: the engine's default (pieces)
    )
    engine = offload_model(model, cfg, device=device)
    opt = engine.build_optimizer(lr=lr, weight_decay=0.01)
    # This loop steps after every backward and clips only through the engine: what the Trainer
    # tells the engine, so "auto" may speculate.
    engine.coordinator.step_signal = lambda: True
    sync = _sync_fn(device)

    def step(b: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        with _autocast(device, precision):
            loss = model(**b).loss
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        engine.clip_grad_norm_(max_norm)
        sync()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "clip": t3 - t2, "step": t4 - t3, "loss": float(loss.detach())}

    suffix = (("" if speculative == "auto" else f"_spec_{speculative}") + ("" if non_block else "_nb_off")
              + ("_vocab_whole" if vocab_pieces is False else ""))
    if name is None:
        name = ("offload_auto" if window_size == "auto" else f"offload_w{window_size}") + suffix
    v = Variant(name, step, drain=engine.synchronize, engine=engine, window_size=window_size)
    return v


def peer_skip_reason(peer: str, device: torch.device) -> str | None:
    """Why a peer system cannot run here (None: it can)."""
    import importlib.util

    if peer in ("zero_offload", "twinflow"):
        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not importable (never a dependency of stronghold_hf; scripts/build_gpu_wheels.sh carries it)"
        if device.type != "cuda":
            return f"DeepSpeed {'ZeRO-Offload' if peer == 'zero_offload' else 'Twin-Flow (ZeRO-3)'} needs a CUDA device"
        return None
    raise ValueError(f"unknown peer {peer!r}; use one of {PEERS}")


def _deepspeed_variant(name: str, zero: dict, base, device: torch.device, precision: str, lr: float,
                       max_norm: float, batch: int) -> tuple[Variant | None, str | None]:
    """A DeepSpeed engine with ``zero`` as its ``zero_optimization``: (variant, None), or (None,
    why not). Driven through ``deepspeed.initialize`` and a config dict only; DeepSpeed is never
    a dependency of this project."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        os.environ.setdefault(key, value)
    try:
        import deepspeed

        model = copy.deepcopy(base)
        cfg = {
            "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": max_norm,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
            "zero_optimization": zero,
            "bf16": {"enabled": precision == "bf16"},
            "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as err:  # a broken DeepSpeed install must not cost the other variants their run
        return None, f"deepspeed.initialize failed: {type(err).__name__}: {err}"[:300]
    sync = _sync_fn(device)

    def step(b: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        loss = engine(**b).loss
        sync()
        t1 = time.perf_counter()
        engine.backward(loss)
        sync()
        t2 = time.perf_counter()
        engine.step()  # clips (gradient_clipping) and steps DeepSpeedCPUAdam
        sync()
        t3 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "clip": 0.0, "step": t3 - t2, "loss": float(loss.detach())}

    return Variant(name, step), None


def zero_offload_variant(base, device: torch.device, precision: str, lr: float, max_norm: float,
                         batch: int) -> tuple[Variant | None, str | None]:
    """DeepSpeed ZeRO-2 with the optimizer on the CPU (ZeRO-Offload): (variant, None), or
    (None, why not)."""
    reason = peer_skip_reason("zero_offload", device)
    if reason is not None:
        return None, reason
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    return _deepspeed_variant("zero_offload", zero, base, device, precision, lr, max_norm, batch)


def twinflow_variant(base, device: torch.device, precision: str, lr: float, max_norm: float, batch: int,
                     ratio: float, params: int) -> tuple[Variant | None, str | None]:
    """DeepSpeed ZeRO-3 with the optimizer offloaded at Twin-Flow's ``ratio`` (ZeRO-Offload++):
    that share of the optimizer state is stepped by CPU Adam, the rest stays on the device and is
    stepped there. (variant, None), or (None, why not).

    DeepSpeed splits by *sub-group* (stage3.py: sub-group ``i`` goes to the CPU when
    ``i >= int((1 - ratio) * n_groups)``), and the default ``sub_group_size`` of 1e9 elements makes a
    model under a billion parameters one group: every ratio above 0 would then put it all on
    the CPU. A twentieth of the model per group gives the ratio 5 % steps."""
    reason = peer_skip_reason("twinflow", device)
    if reason is not None:
        return None, reason
    zero = {"stage": 3, "sub_group_size": max(1_000_000, params // 20),
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": ratio}}
    return _deepspeed_variant(f"twinflow_r{ratio:g}", zero, base, device, precision, lr, max_norm, batch)


def twinflow_device_bytes(params: int, ratio: float, precision: str) -> int:
    """Twin-Flow's device bytes for the model states, estimated: the compute-dtype parameters and
    gradients of ZeRO-3 on one rank, and for the ``1 - ratio`` share stepped on the device an fp32
    master, gradient and two Adam moments (16 B/param)."""
    compute = 2 if precision == "bf16" else 4
    return int(params * (2 * compute + PLAIN_STATE_BYTES * (1.0 - ratio)))


#: Other systems `--peers` can run next to ours (none is a dependency). ``twinflow`` runs only
#: with ``--budgets``: one ZeRO-3 engine per ``--twinflow_ratios`` entry, the best that fits each budget.
PEERS = ("zero_offload", "twinflow")
#: What ``--peers`` runs unless told: the split's peer is asked for by name.
DEFAULT_PEERS = ("zero_offload",)

# ---------------------------------------------------------------------------- the device/host split (#35)
#: ``--budgets`` names, from the largest device budget to none.
BUDGETS = ("all", "half", "quarter", "streamed")
#: Plain training's model-state bytes per parameter: the fp32 parameter, its gradient, two Adam moments.
PLAIN_STATE_BYTES = 16


def budget_bytes(budget: str, params: int) -> int | None:
    """``gpu_memory`` for a ``--budgets`` entry: ``all`` twice plain's model-state bytes (the whole
    model fits, whatever the window and lanes take), ``half`` and ``quarter`` of them, and
    ``streamed`` none (``resident=False``)."""
    plain = PLAIN_STATE_BYTES * params
    return {"all": 2 * plain + (256 << 20), "half": plain // 2, "quarter": plain // 4, "streamed": None}[budget]


def split_rows(budgets: list[str], names: dict[str, str], refused: dict[str, str], rows: dict[str, dict],
               stats: dict[str, dict], bounds: dict[str, dict], params: int, twinflow: dict[str, dict],
               precision: str) -> tuple[list[dict], dict]:
    """One flat row per budget, and the same numbers as flat ``split_<budget>_*`` summary keys.

    The bound of a split is `overlap_bound` on what still streams there: its bytes each way (the
    engine's counters), CPU Adam on its ``offloaded_trainable_params``, and plain's step. With the
    whole model resident it is plain's step alone."""
    out, flat = [], {}
    for b in budgets:
        name = names.get(b)
        r, st, bd = rows.get(name), stats.get(name), bounds.get(name)
        cap = budget_bytes(b, params)
        row = {
            "budget_bytes": cap or 0,
            "step_s": r["median_step_s"] if r else None,
            "tokens_per_s": r["tokens_per_s"] if r else None,
            "ratio_vs_plain": r["ratio_vs_plain"] if r else None,
            "ratio_vs_plain_paired": r["ratio_vs_plain_paired"]["median"] if r else None,
            "resident_share": (round(st["split_resident_params"] / st["model_trainable_params"], 4)
                               if st and st["model_trainable_params"] else None),
            "rest_units": st["split_resident_units"] if st else None,
            "resident_bytes": st["split_resident_bytes"] if st else None,
            "offloaded_params": st["offloaded_trainable_params"] if st else None,
        }
        row["bound_s"] = bd["bound_s"] if bd else None
        row.update({f"bound_{term}": bd[term] if bd else None for term in BOUND_TERMS})
        row["ratio_to_bound"] = bd["ratio_to_bound"] if bd else None
        row["h2d_bytes_per_step"] = bd["h2d_bytes_per_step"] if bd else None
        row["d2h_bytes_per_step"] = bd["d2h_bytes_per_step"] if bd else None
        if b != "streamed":
            # Twin-Flow's best ratio among those whose model states fit this budget (estimated).
            fits = {rt: t for rt, t in twinflow.items()
                    if t["tokens_per_s"] is not None and twinflow_device_bytes(params, float(rt), precision) <= cap}
            best = max(fits, key=lambda rt: fits[rt]["tokens_per_s"], default=None)
            row["twinflow_best_ratio"] = float(best) if best is not None else None
            row["twinflow_tokens_per_s"] = fits[best]["tokens_per_s"] if best is not None else None
            row["ratio_vs_twinflow"] = (round(row["tokens_per_s"] / row["twinflow_tokens_per_s"], 3)
                                        if row["tokens_per_s"] and row["twinflow_tokens_per_s"] else None)
        out.append({"bench": "step", "split": b, "variant": name, "refused": refused.get(b), **row})
        flat.update({f"split_{b}_{k}": v for k, v in row.items()})
        if b in refused:
            flat[f"split_{b}_error"] = f"refused: {refused[b]}"  # as bench_train.py reports it
    return out, flat


# ---------------------------------------------------------------------------- the overlap bound
def measure_link_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """Bytes per second of one copy each way: pinned host <-> device on CUDA (the library's own
    `measure_link`, CUDA events on a side stream), a host memcpy on CPU (what the engine's
    copies are there)."""
    if device.type == "cuda":
        from stronghold_hf.planner import measure_link

        link = measure_link(device, nbytes=nbytes, repeats=repeats)
        return {"kind": "pinned", "nbytes": nbytes, "h2d_bytes_per_s": link.h2d_bytes_per_s,
                "d2h_bytes_per_s": link.d2h_bytes_per_s}
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    bw = nbytes / statistics.median(times)
    return {"kind": "memcpy", "nbytes": nbytes, "h2d_bytes_per_s": bw, "d2h_bytes_per_s": bw}


def measure_cpu_adam(numel: int, *, bf16_copy: bool, threads: int | None = None, max_numel: int = 256 << 20,
                     repeats: int = 3) -> dict:
    """Seconds of one `CPUAdam` step over ``numel`` fp32 parameters (with a bf16 copy-out of
    each, as the engine writes its bf16 host image, when ``bf16_copy``), on ``threads`` threads
    (default: this thread's team, which is the engine's worker team by default).

    The kernel streams 28 B/param (32 with the copy) from and to memory, so its time is linear
    in the count: above ``max_numel`` it is measured on ``max_numel`` (far larger than any
    cache) and scaled, which keeps the host RAM this costs to ~4.5 GB."""
    from stronghold_hf import CPUAdam

    measured = max(1, min(numel, max_numel))
    chunk = 1 << 24
    sizes = [chunk] * (measured // chunk) + ([measured % chunk] if measured % chunk else [])
    params = [torch.zeros(n) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = CPUAdam(params, lr=1e-4, weight_decay=0.01)
    if bf16_copy:
        for p in params:
            opt.register_copy_out(p, torch.empty(p.shape, dtype=torch.bfloat16))
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        opt.step()  # creates the state
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    per_param = statistics.median(times) / measured
    return {"s_per_param": per_param, "measured_params": measured, "threads": threads or before,
            "kernel": opt.kernel, "bf16_copy": bf16_copy}


def overlap_bound(step_s: float, compute_s: float, offloaded_params: int, h2d_bytes: float, d2h_bytes: float,
                  link: dict, adam: dict) -> dict:
    """The fastest an offloaded step can be if every transfer and the CPU Adam work hide
    behind compute (or behind each other): the max of plain's compute time per step, the CPU
    Adam time for the offloaded parameters, and the bytes each way over the measured
    bandwidth. ``ratio_to_bound`` = bound / measured step (1.0: nothing left to overlap)."""
    terms = {
        "compute_s": compute_s,
        "cpu_adam_s": adam["s_per_param"] * offloaded_params,
        "h2d_s": h2d_bytes / link["h2d_bytes_per_s"],
        "d2h_s": d2h_bytes / link["d2h_bytes_per_s"],
    }
    bound = max(terms.values())
    return {
        **{k: round(v, 5) for k, v in terms.items()},
        "bound_s": round(bound, 5), "limited_by": max(terms, key=terms.get), "step_s": round(step_s, 5),
        "ratio_to_bound": round(bound / step_s, 3),
        "h2d_bytes_per_step": int(h2d_bytes), "d2h_bytes_per_step": int(d2h_bytes),
        "h2d_gb_per_s": round(link["h2d_bytes_per_s"] / 1e9, 2), "d2h_gb_per_s": round(link["d2h_bytes_per_s"] / 1e9, 2),
        "link_kind": link["kind"], "offloaded_params": offloaded_params,
        "cpu_adam_measured_params": adam["measured_params"], "cpu_adam_threads": adam["threads"],
        "cpu_adam_kernel": adam["kernel"],
    }


# ---------------------------------------------------------------------------- measurement
_COUNTERS = ("h2d_bytes", "d2h_bytes", "h2d_s", "d2h_s", "blocked_s", "cpu_adam_s", "fetches_on_demand",
             "forward_stall_s", "update_total_s", "first_block_ready_s", "speculative_update_s", "rollback_s",
             "speculated_blocks", "speculation_hits", "speculation_misses", "steps")


def run_block(v: Variant, batches: list[dict], start: int, n: int, record: bool) -> None:
    """``n`` steps of one variant; the first is not counted (see the module docstring)."""
    engine = v.engine
    if engine is not None:
        engine.stats.reset()
    blocked_counted = stall_counted = 0.0
    counted: list[float] = []
    for k in range(n):
        b = batches[(start + k) % len(batches)]
        if engine is not None and k == 1:
            s = engine.stats.as_dict()
            blocked_counted, stall_counted = -s["blocked_s"], -s["forward_stall_s"]  # waits from step 1 on
        t0 = time.perf_counter()
        ph = v.step(b)
        dt = time.perf_counter() - t0
        if record and k >= 1:
            counted.append(dt)
            v.steps.append(dt)
            v.losses.append(ph.pop("loss"))
            for key, val in ph.items():
                v.phases.setdefault(key, []).append(val)
    if counted:
        v.round_medians.append(statistics.median(counted))
    if engine is not None:
        s = engine.stats.as_dict()
        blocked_counted += s["blocked_s"]
        stall_counted += s["forward_stall_s"]
    v.drain()
    if engine is not None and record and n >= 2:
        # Updates of all n steps have finished now; copies were made by all n steps.
        s = engine.stats.as_dict()
        row = {k: s[k] / n for k in _COUNTERS if k not in ("blocked_s", "forward_stall_s")}
        row["blocked_s"] = blocked_counted / (n - 1)
        row["forward_stall_s"] = stall_counted / (n - 1)
        row["step_s"] = statistics.median(counted)
        v.counters.append(row)


def measure(variants: list[Variant], batches: list[dict], warmup: int, rounds: int, block_steps: int,
            deadline: float | None = None) -> int:
    """Warm-up, then interleaved rounds; stops early (after >= 1 round) past ``deadline``. Returns rounds run."""
    for v in variants:
        run_block(v, batches, 0, warmup, record=False)
    pos = warmup
    for r in range(rounds):
        if r > 0 and deadline is not None and time.monotonic() > deadline:
            return r
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            run_block(v, batches, pos, block_steps, record=True)
        pos += block_steps
    return rounds


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _paired(a: Variant, b: Variant | None) -> float | None:
    """Median over rounds of tokens/s of ``a`` over tokens/s of ``b`` (each round's medians)."""
    if b is None or not a.round_medians:
        return None
    return round(_median([tb / ta for ta, tb in zip(a.round_medians, b.round_medians)]), 3)


def report(v: Variant, tokens_per_step: int, device: torch.device, plain_v: Variant | None = None,
           plain: dict | None = None, params: int | None = None) -> dict:
    med = _median(v.steps)
    row = {
        "bench": "step", "variant": v.name, "device": str(device), "params": params, "window_size": v.window_size,
        "tokens_per_s": round(tokens_per_step / med, 1), "median_step_s": round(med, 4),
        "min_step_s": round(min(v.steps), 4), "steps_measured": len(v.steps),
        "phase_median_s": {k: round(_median(x), 4) for k, x in v.phases.items()},
        "final_loss": round(v.losses[-1], 4) if v.losses else None,
    }
    if v.engine is not None:
        row["window_chosen"] = v.engine.window_size  # what "auto" picked
    if plain is not None:
        row["ratio_vs_plain"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3)
        # The same comparison within each round (robust to drift between rounds).
        paired = [p / o for p, o in zip(plain_v.round_medians, v.round_medians)]
        row["ratio_vs_plain_paired"] = {
            "median": round(_median(paired), 3), "min": round(min(paired), 3), "max": round(max(paired), 3),
        }
    if v.counters:
        keys = v.counters[0].keys()
        per_step = {k: _median([c[k] for c in v.counters]) for k in keys}
        row["stats_per_step"] = {k: (int(x) if k.endswith("_bytes") else round(x, 4)) for k, x in per_step.items()}
        adam = per_step["cpu_adam_s"] + per_step["speculative_update_s"]
        row["cpu_adam_hidden_fraction"] = round(1.0 - per_step["blocked_s"] / adam, 3) if adam > 0 else None
        total = per_step["update_total_s"]
        # How soon the next forward can start: block 0's update over all of the step's CPU work.
        row["first_block_ready_fraction"] = round(per_step["first_block_ready_s"] / total, 3) if total > 0 else None
        row["forward_stall_fraction"] = round(per_step["forward_stall_s"] / per_step["step_s"], 3)
        spec_steps = sum(c["speculation_hits"] + c["speculation_misses"] for c in v.counters)
        misses = sum(c["speculation_misses"] for c in v.counters)
        row["speculation"] = {
            "speculated_blocks_per_step": round(per_step["speculated_blocks"], 2),
            "miss_rate": round(misses / spec_steps, 3) if spec_steps else None,
            # Update work moved into backward, minus what was undone and redone on misses.
            "net_time_saved_s_per_step": round(per_step["speculative_update_s"] - 2 * per_step["rollback_s"], 4),
        }
    return row


# ---------------------------------------------------------------------------- CLI
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--model", default=None, choices=sorted(PRESETS), help="shape preset (default: bench-small, smoke with --smoke)")
    p.add_argument("--n_embd", type=int)
    p.add_argument("--n_layer", type=int)
    p.add_argument("--n_head", type=int)
    p.add_argument("--vocab_size", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--windows", default="2",
                   help="comma-separated window sizes, one offloaded variant each (e.g. 1,2,4; auto: the default config)")
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help="other systems to run next to ours: zero_offload (DeepSpeed ZeRO-2 with the optimizer on "
                        "the CPU), twinflow (with --budgets: DeepSpeed ZeRO-3 with Twin-Flow's offload ratio, one "
                        "engine per --twinflow_ratios entry), or none. DeepSpeed needs CUDA and deepspeed, else the "
                        "peer is reported skipped with the reason")
    p.add_argument("--budgets", default="",
                   help="comma-separated device budgets, one split variant each, from " + ",".join(BUDGETS) +
                        ": all (resident=auto, the whole model fits), half and quarter (gpu_memory = that share of "
                        "plain's 16 B/param), streamed (resident=False: the first --windows variant)")
    p.add_argument("--twinflow_ratios", default="0.25,0.5,0.75,1.0",
                   help="Twin-Flow offload ratios to run with --peers twinflow (the best that fits each budget is reported)")
    p.add_argument("--bound", choices=["on", "off"], default="on",
                   help="measure the overlap bound (pinned copies each way, CPU Adam on the offloaded count)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: autocast for both variants and bf16 device copies of the offloaded blocks")
    p.add_argument("--cpu_threads", type=int, default=None, help="StrongholdConfig.cpu_threads (default: auto)")
    p.add_argument("--speculative", default="auto", help="StrongholdConfig.speculative_step of the offloaded variants; "
                   "a comma-separated list (auto,off) adds one variant per value for the first window")
    p.add_argument("--non_block", default="on", help="StrongholdConfig.offload_non_block of the offloaded variants: "
                   "on (default), or on,off to add a variant with the parameters outside the blocks on the device")
    p.add_argument("--vocab_pieces", default="on", help="the offloaded variants read a vocabulary larger than a "
                   "block in pieces, as the engine does by default; on,off: also the first window's variant with "
                   "StrongholdConfig(vocab_pieces=False) (its name ends in _vocab_whole); the summary's "
                   "ratio_vocab_whole_over_pieces_paired is its tokens/s over the variant's with pieces")
    p.add_argument("--control", action="store_true",
                   help="also run the first offloaded variant's engine a second time (its name ends in _control); "
                   "the summary's ratio_control_paired is its tokens/s over the first's: the same code against "
                   "itself, how far a paired ratio of this run strays by noise alone")
    p.add_argument("--host_worker", default="auto", choices=["auto", "thread", "inline"],
                   help="StrongholdConfig.host_worker of the offloaded variants (thread: overlap as on a GPU)")
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="global clip (HF's default 1.0)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the training thread")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    p.add_argument("--block_steps", type=int, default=None, help="steps per variant per round (first one not counted)")
    p.add_argument("--steps", type=int, default=None, help="counted steps per variant (sets --rounds from --block_steps)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--time_budget_s", type=float, default=None,
                   help="start no new round after this many seconds (from start-up); the summary still comes")
    p.add_argument("--quick", action="store_true", help="the README's CPU numbers: bench-small, 6 rounds x 4 steps")
    p.add_argument("--smoke", action="store_true", help="tiny model, a few seconds (CI)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also write a torch.profiler table per variant (2 steps each) into DIR")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and args.device.index is None:
        # torch.cuda helpers want an index (torch 2.11 raised "Expected a torch.device with a
        # specified index" for a bare "cuda" in set_per_process_memory_fraction).
        args.device = torch.device("cuda", 0)
    if args.precision == "bf16" and args.device.type == "cpu":
        # GPT-2's nn.LayerNorm gets bf16 weights (the offloaded blocks' bf16 device copies) and an
        # fp32 input: CUDA autocast runs layer_norm in fp32, CPU autocast does not, and the CPU
        # kernel refuses ("mixed dtype (CPU): expect parameter to have scalar type of Float").
        p.error("--precision bf16 needs --device cuda: on the CPU, bf16 block copies of GPT-2's LayerNorm "
                "fail under CPU autocast (mixed dtype)")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine")
    if args.device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: use cpu or cuda")
    try:
        args.windows = [w.strip() if w.strip() == "auto" else int(w) for w in str(args.windows).split(",") if w.strip()]
    except ValueError:
        p.error(f"--windows {args.windows!r}: use comma-separated ints or auto, e.g. 1,2,4 or auto,1")
    if not args.windows or min((w for w in args.windows if w != "auto"), default=1) < 1:
        p.error("--windows needs at least one window size (auto or an int >= 1)")
    args.peers = [x.strip() for x in str(args.peers).split(",") if x.strip() and x.strip() != "none"]
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        p.error(f"--peers: unknown {unknown}; use {','.join(PEERS)} or none")
    args.budgets = [b.strip() for b in str(args.budgets).split(",") if b.strip()]
    unknown = sorted(set(args.budgets) - set(BUDGETS))
    if unknown:
        p.error(f"--budgets: unknown {unknown}; use a comma-separated subset of {','.join(BUDGETS)}")
    args.budgets = [b for b in BUDGETS if b in args.budgets]  # largest first
    try:
        args.twinflow_ratios = [float(x) for x in str(args.twinflow_ratios).split(",") if x.strip()]
    except ValueError:
        p.error(f"--twinflow_ratios {args.twinflow_ratios!r}: use comma-separated numbers in [0, 1]")
    if any(not 0.0 <= r <= 1.0 for r in args.twinflow_ratios):
        p.error("--twinflow_ratios: each ratio is in [0, 1] (DeepSpeed's offload_optimizer.ratio)")
    preset = args.model or ("smoke" if args.smoke else "bench-small")
    shape = dict(PRESETS[preset])
    for k in ("n_embd", "n_layer", "n_head", "vocab_size", "seq", "batch"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    if shape["n_embd"] % shape["n_head"]:
        p.error(f"n_embd={shape['n_embd']} is not divisible by n_head={shape['n_head']}; pass --n_head")
    args.preset, args.shape = preset, shape
    mode = "smoke" if args.smoke else "quick" if args.quick else "default"
    warmup, rounds, block = {"smoke": (1, 2, 3), "quick": (2, 6, 4), "default": (3, 10, 4)}[mode]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.block_steps = block if args.block_steps is None else args.block_steps
    if args.block_steps < 2:
        p.error("--block_steps must be >= 2 (the first step of each block is not counted)")
    if args.steps is not None:
        rounds = max(1, -(-args.steps // (args.block_steps - 1)))
    args.rounds = rounds if args.rounds is None else args.rounds
    args.mode = mode
    if args.smoke and args.threads is None:
        # Tiny GEMMs with a 2-thread OpenMP team on a busy 2-core box spend most of their time in
        # barriers waiting for a descheduled thread (about 40x slower here); one thread is stable.
        args.threads = 1
    return args


def profile_variants(variants: list[Variant], batches: list[dict], out_dir: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for v in variants:
        v.step(batches[0])
        with profile(activities=acts) as prof:
            for b in batches[:2]:
                v.step(b)
            v.drain()
        path = os.path.join(out_dir, f"profile_{v.name}.txt")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        emit({"bench": "step", "profile": v.name, "path": path})


def main(argv=None) -> int:
    t_start = time.monotonic()
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, shape = args.device, args.shape
    base = build_model(shape)
    n_params = sum(p.numel() for p in base.parameters())
    batches = make_batches(shape, 4, device)
    tokens = shape["batch"] * shape["seq"]
    meta = {
        "bench": "step", "config": True, "device": str(device), "model": args.preset, **shape, "params": n_params,
        "precision": args.precision, "windows": args.windows, "warmup": args.warmup, "rounds": args.rounds,
        "block_steps": args.block_steps, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    emit(meta)

    variants = [plain_variant(base, device, args.precision, args.lr, args.max_grad_norm)]
    modes = [m.strip() for m in args.speculative.split(",") if m.strip()]
    for w in args.windows:
        variants.append(offload_variant(base, device, args.precision, args.lr, w, args.cpu_threads, modes[0],
                                        args.max_grad_norm, host_worker=args.host_worker))
    for mode in modes[1:]:
        variants.append(offload_variant(base, device, args.precision, args.lr, args.windows[0], args.cpu_threads, mode,
                                        args.max_grad_norm))
    if "off" in [m.strip() for m in args.non_block.split(",")]:
        variants.append(offload_variant(base, device, args.precision, args.lr, args.windows[0], args.cpu_threads,
                                        modes[0], args.max_grad_norm, non_block=False))
    if "off" in [m.strip() for m in args.vocab_pieces.split(",")]:
        variants.append(offload_variant(base, device, args.precision, args.lr, args.windows[0], args.cpu_threads,
                                        modes[0], args.max_grad_norm, host_worker=args.host_worker, vocab_pieces=False))
    if args.control:
        variants.append(offload_variant(base, device, args.precision, args.lr, args.windows[0], args.cpu_threads,
                                        modes[0], args.max_grad_norm, host_worker=args.host_worker,
                                        name=variants[1].name + "_control"))
    # The device/host split (#35): one variant per budget, the window of --windows[0]; "streamed"
    # is the first window variant itself (resident=False), so it is not run twice.
    split_names: dict[str, str] = {}
    split_refused: dict[str, str] = {}
    for b in args.budgets:
        if b == "streamed":
            split_names[b] = variants[1].name
            continue
        try:
            variants.append(offload_variant(base, device, args.precision, args.lr, args.windows[0], args.cpu_threads,
                                            modes[0], args.max_grad_norm, host_worker=args.host_worker,
                                            resident="auto", gpu_memory=budget_bytes(b, n_params), name=f"split_{b}"))
            split_names[b] = f"split_{b}"
        except ValueError as err:  # a budget below what streaming alone needs is refused by the engine
            split_refused[b] = str(err)
            emit({"bench": "step", "split": b, "skipped": True, "reason": str(err)})
    peer_skipped: dict[str, str] = {}
    if "zero_offload" in args.peers:
        zero, reason = zero_offload_variant(base, device, args.precision, args.lr, args.max_grad_norm, shape["batch"])
        if zero is not None:
            variants.append(zero)
        else:
            peer_skipped["zero_offload"] = reason
            emit({"bench": "step", "peer": "zero_offload", "skipped": True, "reason": reason})
    twinflow_names: dict[str, str] = {}  # ratio (as printed) -> variant name
    if "twinflow" in args.peers:
        reason = None if args.budgets else "Twin-Flow is the split's peer: it runs with --budgets"
        for ratio in args.twinflow_ratios if reason is None else []:
            tf, reason = twinflow_variant(base, device, args.precision, args.lr, args.max_grad_norm, shape["batch"],
                                          ratio, n_params)
            if tf is None:
                break
            variants.append(tf)
            twinflow_names[f"{ratio:g}"] = tf.name
        if reason is not None:
            peer_skipped["twinflow"] = reason
            emit({"bench": "step", "peer": "twinflow", "skipped": True, "reason": reason})
    del base
    if args.profile:
        profile_variants(variants, batches, args.profile)
    deadline = None if args.time_budget_s is None else t_start + args.time_budget_s
    rounds_run = measure(variants, batches, args.warmup, args.rounds, args.block_steps, deadline)

    plain = report(variants[0], tokens, device, params=n_params)
    emit(plain)
    rows = [report(v, tokens, device, variants[0], plain, params=n_params) for v in variants[1:]]
    engine_stats = {v.name: v.engine.memory_stats() for v in variants if v.engine}
    offloaded = {name: st["offloaded_trainable_params"] for name, st in engine_stats.items()}
    nb_paired = _paired(variants[1], next((v for v in variants if v.name.endswith("_nb_off")), None))
    whole = next((v for v in variants if v.name.endswith("_vocab_whole")), None)
    whole_paired = _paired(whole, variants[1]) if whole is not None else None
    control = next((v for v in variants if v.name.endswith("_control")), None)
    control_paired = _paired(control, variants[1]) if control is not None else None
    for v in variants[1:]:
        if v.engine is not None:
            v.engine.close()
    del variants
    ours = [r for r in rows if r["variant"] in offloaded]
    peer_rows = {r["variant"]: r for r in rows if r["variant"] not in offloaded}
    bounds: dict[str, dict] = {}
    if args.bound == "on":
        # After the run and with the engines closed: the copies and the CPU Adam step have
        # the machine to themselves, as the bound assumes of each.
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        link = measure_link_bandwidth(device, nbytes=(256 << 20) if device.type == "cuda" else (64 << 20))
        adam = measure_cpu_adam(max(max(offloaded.values()), 1), bf16_copy=args.precision == "bf16", threads=args.cpu_threads)
        emit({"bench": "step", "measured_for_bound": True, "link": link, "cpu_adam": adam})
        for r in ours:
            st = r["stats_per_step"]
            bounds[r["variant"]] = overlap_bound(r["median_step_s"], plain["median_step_s"], offloaded[r["variant"]],
                                                 st["h2d_bytes"], st["d2h_bytes"], link, adam)
            r["bound"] = bounds[r["variant"]]
    for row in rows:
        emit(row)
    by_name = {r["variant"]: r for r in rows}
    twinflow = {rt: {"tokens_per_s": by_name[n]["tokens_per_s"] if n in by_name else None}
                for rt, n in twinflow_names.items()}
    budget_rows, split_flat = split_rows(args.budgets, split_names, split_refused, by_name, engine_stats, bounds,
                                         n_params, twinflow, args.precision)
    for row in budget_rows:
        emit(row)
    twinflow_flat = {f"twinflow_r{rt}_tokens_per_s": t["tokens_per_s"] for rt, t in twinflow.items()}
    twinflow_flat.update({f"twinflow_r{rt}_device_bytes_est": twinflow_device_bytes(n_params, float(rt), args.precision)
                          for rt in twinflow})
    first = rows[0]
    peers = {}
    for peer in args.peers:
        if peer == "twinflow" and twinflow_names:
            # The split's peer is compared per budget (split_<budget>_ratio_vs_twinflow); here, its fastest ratio.
            best = max((n for n in twinflow_names.values() if n in peer_rows),
                       key=lambda n: peer_rows[n]["tokens_per_s"], default=None)
            peer_rows["twinflow"] = peer_rows[best] if best else None
        if peer_rows.get(peer):
            pr = peer_rows[peer]
            peers[peer] = {"tokens_per_s": pr["tokens_per_s"], "median_step_s": pr["median_step_s"],
                           "ratio_ours_vs_peer": round(first["tokens_per_s"] / pr["tokens_per_s"], 3),
                           "ours": first["variant"], "skipped": None}
        else:
            peers[peer] = {"tokens_per_s": None, "median_step_s": None, "ratio_ours_vs_peer": None,
                           "ours": first["variant"], "skipped": peer_skipped.get(peer, "not run")}
    summary = {
        "bench": "step", "summary": True, "device": str(device), "model": args.preset, "params": n_params,
        "precision": args.precision, "mode": args.mode, "window_size": first["window_size"],
        "window_chosen": first.get("window_chosen"), "rounds_run": rounds_run,
        "ratio_offload_vs_plain": first["ratio_vs_plain"],
        "ratio_offload_vs_plain_paired": first["ratio_vs_plain_paired"]["median"],
        "ratios_by_window": {str(r["window_size"]): r["ratio_vs_plain"] for r in ours
                             if r["variant"].startswith("offload_") and "_spec_" not in r["variant"]
                             and not r["variant"].endswith(("_nb_off", "_vocab_whole", "_control"))},
        "ratios_by_variant": {r["variant"]: r["ratio_vs_plain_paired"]["median"] for r in rows},
        "tokens_per_s": {r["variant"]: r["tokens_per_s"] for r in [plain, *rows]},
        "median_step_s": {r["variant"]: r["median_step_s"] for r in [plain, *rows]},
        "stats_per_step": first.get("stats_per_step"),
        "cpu_adam_hidden_fraction": first.get("cpu_adam_hidden_fraction"),
        "first_block_ready_fraction": first.get("first_block_ready_fraction"),
        "forward_stall_fraction": first.get("forward_stall_fraction"),
        "speculation": {r["variant"]: r.get("speculation") for r in rows if "speculation" in r},
        "ratio_non_block_on_vs_off_paired": nb_paired,
        "ratio_vocab_whole_over_pieces_paired": whole_paired,
        "ratio_control_paired": control_paired,
        "bound": bounds.get(first["variant"]),
        "ratio_to_bound": bounds[first["variant"]]["ratio_to_bound"] if first["variant"] in bounds else None,
        "ratio_to_bound_by_variant": {name: b["ratio_to_bound"] for name, b in bounds.items()},
        "peers": peers,
        "ratio_offload_vs_zero_offload": peers.get("zero_offload", {}).get("ratio_ours_vs_peer"),
        "target_ratio_cpu": 0.85,
        "meets_target": bool(first["ratio_vs_plain"] >= 0.85) if device.type == "cpu" else None,
        "budgets": args.budgets, "plain_state_bytes": PLAIN_STATE_BYTES * n_params,
        **split_flat, **twinflow_flat,
    }
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
