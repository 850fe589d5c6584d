"""The README's "what fits where" table, from the estimator (stronghold_hf.estimate).

For each model and machine it tries the host tiers from the fastest to the largest (exact
fp32 Adam state in RAM, 8-bit moments, 8-bit moments on NVMe, masters and moments on NVMe) and
prints the first that fits with the machine's reserve left free (StrongholdConfig's
``cpu_reserve``/``gpu_reserve``, "auto"), with the option that selects it and the memory it
needs. All runs: bf16, batch 1, 4,096 tokens, gradient checkpointing, a full fine-tune.

    python scripts/fits_table.py            # the markdown table
    python scripts/fits_table.py --json     # one JSON object per row
"""

from __future__ import annotations

import argparse
import json
import sys

import transformers

from stronghold_hf.estimate import estimate

GIB = 1 << 30

MODELS = {
    "Llama-3.2-1B": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)),
    "Llama-3-8B": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                  num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)),
    "Qwen2.5-14B": ("qwen2", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                                   num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)),
    "Llama-3-70B": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                                   num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)),
}

#: (model, GPU GiB, RAM GiB, NVMe GiB or None): a laptop GPU, desktops, a workstation, a server.
MACHINES = [
    ("Llama-3.2-1B", 8, 32, None),
    ("Llama-3-8B", 24, 64, 1024),
    ("Llama-3-8B", 24, 192, None),
    ("Qwen2.5-14B", 24, 256, None),
    ("Llama-3-70B", 80, 256, 2048),
]

#: The tiers in the order tried, fastest first, each with the options that select it.
TIERS = [
    ("exact", "`--stronghold`", dict(host_memory="exact", nvme=False, nvme_masters=False)),
    ("lean", "`host_memory=\"lean\"`", dict(host_memory="lean", nvme=False, nvme_masters=False)),
    ("lean, moments on NVMe", "`host_memory=\"lean\", nvme_path=DIR`",
     dict(host_memory="lean", nvme=True, nvme_masters=False)),
    ("lean, masters and moments on NVMe", "`host_memory=\"lean\", nvme_path=DIR, nvme_masters=True`",
     dict(host_memory="lean", nvme=True, nvme_masters=True)),
]


def row(name: str, gpu_gib: int, ram_gib: int, nvme_gib: int | None) -> dict:
    model_type, overrides = MODELS[name]
    config = transformers.AutoConfig.for_model(model_type, **overrides)
    for tier, option, kwargs in TIERS:
        if kwargs["nvme"] and nvme_gib is None:
            continue
        e = estimate(config, seq_len=4096, batch_size=1, dtype="bf16", gpu_memory_bytes=gpu_gib * GIB,
                     cpu_memory_bytes=ram_gib * GIB, gradient_checkpointing=True, auto_class="causal_lm",
                     nvme_memory_bytes=None if nvme_gib is None else nvme_gib * GIB, **kwargs)
        if e.fits:
            break
    return {"model": name, "params_b": round(e.total_params / 1e9, 2), "gpu_gib": gpu_gib, "ram_gib": ram_gib,
            "nvme_gib": nvme_gib, "fits": e.fits, "tier": tier if e.fits else None, "option": option if e.fits else None,
            "gpu_needed_gib": round(e.gpu_bytes_needed / GIB, 1), "ram_needed_gib": round(e.cpu_bytes_needed / GIB, 1),
            "nvme_needed_gib": round(e.nvme_bytes_needed / GIB, 1), "plain_gpu_gib": round(e.plain_gpu_bytes_needed / GIB, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [row(*m) for m in MACHINES]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print("| model | GPU | RAM | NVMe | fits with | GPU needed | RAM needed | plain training needs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        disk = f"{r['nvme_gib'] // 1024} TB" if r["nvme_gib"] else "–"
        how = f"{r['tier']}: {r['option']}" if r["fits"] else "does not fit"
        print(f"| {r['model']} ({r['params_b']} B) | {r['gpu_gib']} GB | {r['ram_gib']} GB | {disk} | {how} "
              f"| {r['gpu_needed_gib']} GiB | {r['ram_needed_gib']} GiB"
              + (f" + {r['nvme_needed_gib']} GiB disk" if r["nvme_needed_gib"] else "")
              + f" | {r['plain_gpu_gib']} GiB of GPU |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
