"""The memory ledger at several depths, and device bytes against vocabulary, sequence and depth.

Why: the product's promise is that device memory does not grow with depth and that the host
pays a known number of bytes per parameter. This trains a GPT-2 of a fixed width at several
depths for a few steps and prints, per depth, what the engine's ledger booked
(``engine.memory_stats()``): the device peak, the host bytes per offloaded parameter (and
without the bounded staging), and the blocks fetched per step (``2 N - W`` when the turn is
free). On CUDA it also records ``torch.cuda.max_memory_allocated`` over the same steps, and
optionally trains the deepest model under a per-process memory cap of a third of its blocks.

Three sweeps (``--sweeps vocab,seq,depth``) then train a Llama-shaped causal LM (untied
head, gradient checkpointing) at each point, once with the engine (default config:
everything outside the blocks offloaded, the chunked loss, checkpointed inputs offloaded) and
once plainly, and record for each the *device bytes*: for the engine, what its ledger owns
(window, gradient lanes, resident units) plus the checkpointed inputs it holds plus every
other tensor autograd saves for backward; for plain training, parameters, gradients and AdamW
state (16 B/param) plus the tensors autograd saves. Saved tensors are measured with a
saved-tensor hook (parameters and views of them excluded); the recompute inside backward is
the same for both and not counted. ``benchmarks/plot_results.py --memory`` draws them.

Output: one JSON line per depth and per sweep point, then a summary line (the last line) with
``device_peak_ratio_deep_vs_shallow``, the sweeps' engine/plain ratios and, on CUDA,
``ledger_vs_cuda_peak_max_rel_diff``.

    python benchmarks/bench_memory.py                      # CPU: 4, 16, 64 blocks, width 64, and the sweeps
    python benchmarks/bench_memory.py --device cuda --width 1024 --depths 4,16,64 --cap_third
    python benchmarks/bench_memory.py --sweeps none        # the depth rows only
    python benchmarks/bench_memory.py --depths "" --sweeps vocab --vocab_pieces off  # the vocabulary whole
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from stronghold_hf import StrongholdConfig, offload_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_memory import record_allocations, write_json  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB = 128


def build(depth: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=width, n_layer=depth, n_head=max(1, width // 64),
                                  n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).train()


def run_depth(depth: int, args) -> dict:
    device = _device(args.device)
    model = build(depth, args.width)
    engine = offload_model(model, StrongholdConfig(resident=False, window_size=args.window, grad_buffers=args.grad_buffers),
                           device=device)
    opt = engine.build_optimizer(lr=1e-4)
    g = torch.Generator().manual_seed(0)
    fetches = []
    cuda = device.type == "cuda"
    losses = []

    def step() -> None:
        ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g).to(device)
        before = engine.memory_stats()["fetches"]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        fetches.append(engine.memory_stats()["fetches"] - before)
        losses.append(loss.item())

    first_step = None
    if cuda:
        # [Note: first step apart] The first step in a process allocates what libraries keep for
        # good: a cuBLAS workspace per (thread, stream), 32 MiB each on Hopper, for the forward's
        # thread and autograd's backward thread. The H200 run of 2026-12-04 counted those in
        # its first (4-block) row only: 145 MB there, then 101 MB at 16 blocks. It is measured
        # here apart; the rows compare steady-state steps.
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        engine.synchronize()
        torch.cuda.synchronize()
        first_step = torch.cuda.max_memory_allocated() - base
        fetches.clear()
        losses.clear()
        torch.cuda.reset_peak_memory_stats()
        engine.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    # Autograd's saved tensors (activations; no checkpointing in these rows) are not the
    # engine's and grow with depth: measured with a saved-tensor hook, as in the sweeps.
    saved = SavedBytes(model.parameters())
    recorder = record_allocations() if cuda and args.record else contextlib.nullcontext({})
    with recorder as recorded, saved.context():
        for _ in range(args.steps):
            step()
        engine.synchronize()
    stats = engine.memory_stats()
    queues = [engine.grad_queue, engine.schedule.gradients.resident_queue]
    staging = sum(q._num_lanes * q.staging_bytes for q in queues if q is not None and q.max_bytes)
    host = stats["pinned_host_bytes"] + stats["pageable_host_bytes"]
    row = {
        "depth": depth, "width": args.width, "window_size": engine.window_size, "grad_buffers": args.grad_buffers,
        "offloaded_params": stats["offloaded_params"],
        "device_peak_bytes": stats["device_peak_bytes"],
        "device_bound_bytes": (stats["window_bound_bytes"] + args.grad_buffers * stats["grad_buffer_bytes"]
                               + stats["rest_unit_bytes"] + stats["rest_grad_bytes"]),
        "host_bytes": host, "host_bytes_per_param": host / stats["offloaded_params"],
        "host_bytes_per_param_without_staging": (host - staging) / stats["offloaded_params"],
        "pinned_host_bytes": stats["pinned_host_bytes"], "staging_bytes": staging,
        "fetches_per_step": fetches,
        "expected_fetches_per_step": 2 * stats["sequence_length"] - engine.window_size + stats["rest_units"],
        "losses_finite": all(math.isfinite(x) for x in losses),
        "saved_activation_peak_bytes": saved.peak,
    }
    if cuda:
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
        largest = max(p.numel() * p.element_size() for p in model.transformer.h.parameters())
        # What the allocator should hold at its peak: the ledger's buffers, autograd's saved
        # tensors, and one weight gradient before AccumulateGrad adds it into its lane.
        expected = stats["device_peak_bytes"] + saved.peak + largest
        row.update({
            "cuda_first_step_max_allocated_bytes": first_step,
            "cuda_max_allocated_bytes": measured,
            "ledger_vs_cuda_rel_diff": abs(measured - stats["device_peak_bytes"]) / max(stats["device_peak_bytes"], 1),
            "largest_block_param_bytes": largest,
            "expected_cuda_bytes": expected,
            "unexplained_bytes": measured - expected,
            "unexplained_vs_ledger": (measured - expected) / max(stats["device_peak_bytes"], 1),
        })
        if "summary" in recorded:
            summary = recorded["summary"]
            row["allocator_at_peak"] = {"by_category": summary["live_at_peak_by_category"],
                                        "top": summary["live_at_peak_top"][:6]}
            write_json(f"bench_memory_allocator_depth{depth}.json", {"row": dict(row), "allocator_at_peak": summary})
    engine.close()
    return row


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # torch.cuda helpers want an index (torch 2.11)
    return device


def run_capped(depth: int, args) -> dict:
    """Trains a model whose blocks total 3x the memory the process may allocate on the GPU."""
    model = build(depth, args.width)
    blocks = sum(p.numel() * p.element_size() for p in model.transformer.h.parameters())
    engine = offload_model(model, StrongholdConfig(resident=False, window_size=args.window), device=_device(args.device))
    torch.cuda.synchronize()
    cap = blocks // 3 + torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    out = {"capped": True, "depth": depth, "block_bytes": blocks, "cap_bytes": cap}
    try:
        opt = engine.build_optimizer(lr=1e-4)
        ids = torch.randint(0, VOCAB, (args.batch, args.seq)).cuda()
        losses = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            engine.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.update(trained=True, losses=losses, blocks_over_cap=blocks / cap,
                   device_peak_bytes=engine.memory_stats()["device_peak_bytes"])
    except torch.cuda.OutOfMemoryError as err:
        out.update(trained=False, error=str(err)[:300])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        engine.close()
    return out


# ---------------------------------------------------------------------------- the sweeps
class SavedBytes:
    """Peak bytes of the tensors autograd saves for backward while the context is active
    (distinct storages; parameters and views of them excluded: those are the weights)."""

    def __init__(self, params) -> None:
        self.params = list(params)
        self.live: dict[int, list] = {}  # storage pointer -> [nbytes, references]
        self.current = self.peak = 0

    def _pack(self, t):
        key = t.untyped_storage().data_ptr()
        # A weight, or a view of one (``weight.t()``): where the parameter's data is now (an
        # offloaded parameter's data is its unit's device slot while resident).
        weights = {p.untyped_storage().data_ptr() for p in self.params}
        if key in weights or not t.is_floating_point():
            return t
        entry = self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        holder = _Holder(t)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Holder) else x

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor) -> None:
        self.tensor = tensor


def build_llama(layers: int, vocab: int, hidden: int, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 128), max_position_embeddings=16384,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _measure(model, ids, steps, engine=None):
    params = list(model.parameters())
    saved = SavedBytes(params)
    opt = engine.build_optimizer(lr=1e-4) if engine is not None else torch.optim.AdamW(params, lr=1e-4)
    for _ in range(steps):
        with saved.context():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        if engine is not None:
            engine.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
    return saved.peak, loss.item()


def sweep_point(kind: str, value: int, layers: int, vocab: int, seq: int, args) -> dict:
    device = _device(args.device)
    model = build_llama(layers, vocab, args.sweep_hidden)
    ref = copy.deepcopy(model).to(device)
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    engine = offload_model(model, StrongholdConfig(resident=False, window_size=args.window, grad_buffers=args.grad_buffers,
                                                   offload_activations=True, vocab_pieces=args.vocab_pieces == "on"),
                           device=device)
    engine_saved, engine_loss = _measure(model, ids, args.steps, engine)
    stats = engine.memory_stats()
    engine.close()
    plain_saved, plain_loss = _measure(ref, ids, args.steps)
    n = sum(p.numel() for p in ref.parameters())
    state = sum(16 * p.numel() if p.dtype == torch.float32 else 18 * p.numel() for p in ref.parameters())
    row = {
        "sweep": kind, kind: value, "layers": layers, "vocab": vocab, "seq": seq, "hidden": args.sweep_hidden,
        "params": n,
        "vocab_pieces": args.vocab_pieces, "slot_bytes": stats["slot_bytes"],
        "vocab_piece_bytes": stats["vocab_piece_bytes"],
        "engine_owned_bytes": stats["device_peak_bytes"],
        "engine_checkpoint_bytes": stats["activation_device_peak_bytes"],
        "engine_saved_bytes": engine_saved,
        "engine_device_bytes": stats["device_peak_bytes"] + stats["activation_device_peak_bytes"] + engine_saved,
        "plain_state_bytes": state, "plain_saved_bytes": plain_saved,
        "plain_device_bytes": state + plain_saved,
        "losses": [engine_loss, plain_loss],
    }
    row["engine_vs_plain"] = row["engine_device_bytes"] / row["plain_device_bytes"]
    return row


def run_sweeps(args) -> list[dict]:
    rows = []
    plan = []
    if "vocab" in args.sweeps:
        plan += [("vocab", v, args.sweep_layers, v, args.sweep_seq) for v in _ints(args.vocab_sweep)]
    if "seq" in args.sweeps:
        plan += [("seq", s, args.sweep_layers, args.sweep_vocab, s) for s in _ints(args.seq_sweep)]
    if "depth" in args.sweeps:
        plan += [("depth", d, d, args.sweep_vocab, args.sweep_seq) for d in _ints(args.depth_sweep)]
    for kind, value, layers, vocab, seq in plan:
        row = sweep_point(kind, value, layers, vocab, seq, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _growth(rows: list[dict], kind: str, key: str) -> float | None:
    points = [r for r in rows if r["sweep"] == kind]
    if len(points) < 2:
        return None
    return points[-1][key] / points[0][key]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--depths", default="4,16,64")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--grad_buffers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--cap_third", action="store_true", help="CUDA: also train the deepest model under a cap of 1/3")
    ap.add_argument("--record", choices=["on", "off"], default="on",
                    help="CUDA: record the allocator's history over each depth's steps and write what it held at "
                         "its peak, by who allocated it, to $STRONGHOLD_DIAG_DIR (benchmarks/cuda_memory.py)")
    ap.add_argument("--sweeps", default="vocab,seq,depth", help="which sweeps to run: vocab,seq,depth or none")
    ap.add_argument("--sweep_hidden", type=int, default=128)
    ap.add_argument("--sweep_layers", type=int, default=4)
    ap.add_argument("--sweep_vocab", type=int, default=32000)
    ap.add_argument("--sweep_seq", type=int, default=1024)
    ap.add_argument("--vocab_sweep", default="4096,16384,32768,65536,131072")
    ap.add_argument("--seq_sweep", default="512,1024,2048,4096,8192")
    ap.add_argument("--depth_sweep", default="2,4,8,16,32")
    ap.add_argument("--vocab_pieces", choices=["on", "off"], default="on",
                    help="on (the engine's default): the sweeps' engine reads a vocabulary larger than a block in row "
                    "pieces (vocab_pieces.py); off: it streams such a unit whole")
    args = ap.parse_args(argv)
    args.record = args.record == "on"
    rows = []
    for depth in [int(x) for x in args.depths.split(",") if x]:
        row = run_depth(depth, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    sweeps = run_sweeps(args) if args.sweeps != "none" else []
    summary = {
        "summary": True, "device": args.device, "width": args.width,
        "sweeps": {
            kind: {
                "points": [r[kind] for r in sweeps if r["sweep"] == kind],
                "engine_device_bytes": [r["engine_device_bytes"] for r in sweeps if r["sweep"] == kind],
                "engine_owned_bytes": [r["engine_owned_bytes"] for r in sweeps if r["sweep"] == kind],
                "plain_device_bytes": [r["plain_device_bytes"] for r in sweeps if r["sweep"] == kind],
                "engine_growth": _growth(sweeps, kind, "engine_device_bytes"),
                "engine_owned_growth": _growth(sweeps, kind, "engine_owned_bytes"),
                "plain_growth": _growth(sweeps, kind, "plain_device_bytes"),
            }
            for kind in ("vocab", "seq", "depth") if any(r["sweep"] == kind for r in sweeps)
        },
        "device_peak_bytes_by_depth": {r["depth"]: r["device_peak_bytes"] for r in rows},
        "device_peak_ratio_deep_vs_shallow": rows[-1]["device_peak_bytes"] / rows[0]["device_peak_bytes"] if rows else None,
        "host_bytes_per_param_by_depth": {r["depth"]: round(r["host_bytes_per_param"], 3) for r in rows},
        "host_bytes_per_param_without_staging_by_depth": {
            r["depth"]: round(r["host_bytes_per_param_without_staging"], 3) for r in rows},
        "fetches_per_step_by_depth": {r["depth"]: r["fetches_per_step"][-1] for r in rows},
        "turn_is_free": all(r["fetches_per_step"][-1] == r["expected_fetches_per_step"] for r in rows),
        "peak_within_bound": all(r["device_peak_bytes"] <= r["device_bound_bytes"] for r in rows),
    }
    if args.device.startswith("cuda"):
        summary["ledger_vs_cuda_peak_max_rel_diff"] = max(r["ledger_vs_cuda_rel_diff"] for r in rows)
        # What is left once autograd's saved tensors and one weight gradient are counted:
        # ~0 if the ledger misses none of the engine's buffers.
        summary["unexplained_vs_ledger_max_abs"] = max(abs(r["unexplained_vs_ledger"]) for r in rows)
        summary["cuda_bytes_by_depth"] = {r["depth"]: {k: r[k] for k in (
            "cuda_first_step_max_allocated_bytes", "cuda_max_allocated_bytes", "saved_activation_peak_bytes",
            "largest_block_param_bytes", "unexplained_bytes")} for r in rows}
        if args.cap_third:
            capped = run_capped(max(int(x) for x in args.depths.split(",")), args)
            print(json.dumps(capped), flush=True)
            summary["capped_run"] = {k: capped.get(k) for k in ("trained", "blocks_over_cap", "device_peak_bytes")}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
