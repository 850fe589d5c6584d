"""Issue #42's long-context verdicts, from the estimator: Llama-3-8B, bf16, batch 1, gradient
checkpointing, lean host, SDPA, sequence tiling "auto", on three machines. For each: the
verdict at the target length, what bounds it, and the longest sequence that fits; the RAM it
needs with the checkpointed activations in an NVMe file (``nvme_activations``); then the
same with the attention block tiled too (``StrongholdConfig(attention_tiling=True)``: each
block in query tiles of 8192 tokens, query_tiling.py).

    python scripts/long_context.py          # one JSON object per machine
"""

from __future__ import annotations

import json
import sys

import transformers

from stronghold_hf.estimate import estimate

GIB = 1 << 30
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                 max_position_embeddings=4 * 1024 * 1024)
#: (name, target tokens, GPU GiB, RAM GiB)
MACHINES = [("24 GB GPU, 192 GB RAM", 256 * 1024, 24, 192),
            ("80 GB GPU (H100), 1 TB RAM", 1024 * 1024, 80, 1024),
            ("141 GB GPU (H200), 1.5 TB RAM", 2048 * 1024, 141, 1536)]


def run(config, seq: int, gpu: int, ram: int, **projection):
    return estimate(config, seq_len=seq, batch_size=1, dtype="bf16", gpu_memory_bytes=gpu * GIB,
                    cpu_memory_bytes=ram * GIB, gradient_checkpointing=True, host_memory="lean",
                    auto_class="causal_lm", **projection)


def longest(config, gpu: int, ram: int, **projection) -> int:
    lo, hi = 1024, 16 * 1024 * 1024  # tokens, in steps of 1024
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        lo, hi = (mid, hi) if run(config, mid, gpu, ram, **projection).fits else (lo, mid)
    return lo


def main() -> int:
    config = transformers.AutoConfig.for_model("llama", **LLAMA3_8B)
    for name, target, gpu, ram in MACHINES:
        e = run(config, target, gpu, ram)
        print(json.dumps({"machine": name, "target_tokens": target, "fits": e.fits,
                          "gpu_needed_gib": round(e.gpu_bytes_needed / GIB, 1),
                          "ram_needed_gib": round(e.cpu_bytes_needed / GIB, 1),
                          "bounded_by": e.gpu_bounded_by, "layer_largest_tensor": e.layer_largest_tensor,
                          "layer_peak_gib": round(e.gpu_layer_peak_bytes / GIB, 1),
                          "checkpoints_offloaded": e.offload_activations, "mlp_tile_tokens": e.tile_tokens,
                          "attention": e.attn_implementation,
                          "longest_that_fits_tokens": longest(config, gpu, ram),
                          # The host side with the checkpoints in an NVMe file (nvme_path,
                          # nvme_activations=True; "auto" does it when the RAM would not hold them).
                          "checkpoints_on_nvme_4tb": {
                              "ram_needed_gib": round((d := run(config, target, gpu, ram, nvme_memory_bytes=4 << 40,
                                                                nvme_activations=True)).cpu_bytes_needed / GIB, 1),
                              "checkpoints_on_nvme": d.nvme_activations,
                              "nvme_needed_gib": round(d.nvme_bytes_needed / GIB, 1),
                              "cpu_fits": d.cpu_fits},
                          # The attention block tiled too: attention_tiling=True.
                          "with_attention_tiling": {
                              "fits": (p := run(config, target, gpu, ram, attention_tiling=True)).fits,
                              "gpu_needed_gib": round(p.gpu_bytes_needed / GIB, 1),
                              "bounded_by": p.gpu_bounded_by, "layer_largest_tensor": p.layer_largest_tensor,
                              "longest_that_fits_tokens": longest(config, gpu, ram, attention_tiling=True)},
                          # And no checkpointed input kept on the device at the turn.
                          "with_attention_tiling_no_device_checkpoints": {
                              "fits": (q := run(config, target, gpu, ram, attention_tiling=True,
                                                device_checkpoints=0)).fits,
                              "gpu_needed_gib": round(q.gpu_bytes_needed / GIB, 1),
                              "bounded_by": q.gpu_bounded_by,
                              "longest_that_fits_tokens": longest(config, gpu, ram, attention_tiling=True,
                                                                  device_checkpoints=0)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
