"""LoRA on an offloaded base against plain PEFT: tokens/s, host bytes, device peak.

Why: fine-tuning a huge base with adapters is the common case after pretraining. With
STRONGHOLD the frozen base only streams its stored bytes (no master, no gradient, no Adam),
so host memory per base parameter is its dtype's size, and only the adapters pay the CPU
optimizer. This runs, in one process and interleaved (these machines drift by +-30%), a PEFT
LoRA model trained plainly (``torch.optim.AdamW``) and the same model under
``offload_model`` + ``engine.build_optimizer``, on the same batches.

Reported per variant: median step time, tokens/s; for the offloaded one the ledger's host
bytes (and per base parameter), device peak (engine buffers) and the window. For plain PEFT
the device footprint of its weights and adapter state is reported for comparison (everything
is on the device there).

Output: one JSON line per round, then the summary (the last line) with
``ratio_offload_vs_plain`` (tokens/s).

    python benchmarks/bench_lora.py                 # CPU, ~1 min on 2 cores
    python benchmarks/bench_lora.py --device cuda --n_embd 2048 --n_layer 24 --seq 512 --batch 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "cuda" not in " ".join(sys.argv[1:]):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_step.py, [Note: OpenMP wait policy]

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()


def build(args) -> torch.nn.Module:
    import peft

    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_embd=args.n_embd, n_layer=args.n_layer,
                                  n_head=max(1, args.n_embd // 64), n_positions=max(64, args.seq), bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["c_attn", "c_proj", "c_fc"],
                           lora_dropout=0.0, fan_in_fan_out=True)
    return peft.get_peft_model(model, lora).train()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n_embd", type=int, default=384)
    ap.add_argument("--n_layer", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steps per round and variant (the first is not counted)")
    args = ap.parse_args(argv)
    from stronghold_hf import StrongholdConfig, offload_model

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # torch.cuda helpers want an index (torch 2.11)
    plain = build(args).to(device)
    offloaded = build(args)
    base_params = sum(p.numel() for n, p in offloaded.named_parameters() if "lora_" not in n and ".h." in n)
    engine = offload_model(offloaded, StrongholdConfig(window_size=args.window), device=device)
    opt_plain = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-4)
    opt_off = engine.build_optimizer(lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device) for _ in range(8)]

    def step(model, opt, clip, ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip()
        opt.step()
        opt.zero_grad()

    variants = {
        "plain_peft": (plain, opt_plain, lambda: torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)),
        "stronghold_lora": (offloaded, opt_off, lambda: engine.clip_grad_norm_(1.0)),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            model, opt, clip = variants[name]
            for i in range(args.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(model, opt, clip, batches[(r * args.steps + i) % len(batches)])
                if name == "stronghold_lora":
                    engine.synchronize()  # a step's CPU work is charged to that step
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i:
                    times[name].append(time.perf_counter() - t0)
        print(json.dumps({"round": r, **{k: round(statistics.median(v), 4) for k, v in times.items() if v}}), flush=True)
    tokens = args.batch * args.seq
    med = {k: statistics.median(v) for k, v in times.items()}
    stats = engine.memory_stats()
    host = stats["pinned_host_bytes"] + stats["pageable_host_bytes"]
    plain_device = sum(p.numel() * p.element_size() for p in plain.parameters()) + sum(
        v.numel() * v.element_size() for s in opt_plain.state.values() for v in s.values() if torch.is_tensor(v))
    summary = {
        "summary": True, "device": args.device, "n_embd": args.n_embd, "n_layer": args.n_layer, "rank": args.rank,
        "tokens_per_s": {k: round(tokens / v, 1) for k, v in med.items()},
        "ratio_offload_vs_plain": round(med["plain_peft"] / med["stronghold_lora"], 3),
        "base_params_offloaded": base_params,
        "adapter_params": stats["offloaded_trainable_params"],
        "stronghold_host_bytes": host,
        "stronghold_host_bytes_per_base_param": round(host / max(base_params, 1), 3),
        "stronghold_device_peak_bytes": stats["device_peak_bytes"],
        "stronghold_window_size": engine.window_size,
        "plain_device_bytes_weights_and_state": plain_device,
    }
    print(json.dumps(summary), flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
