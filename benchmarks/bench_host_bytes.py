"""Host bytes per trainable parameter, by the engine's ledger, for each host-memory setting.

Why: the largest model one machine trains is its RAM over these bytes. This trains one step of
the same Llama (8 blocks of hidden 512, a 4 M untied vocabulary) under the simulated device (so
the pinned staging buffers are real memory, as on a GPU) with fp32 and bf16 compute, exact and
lean moments, the bf16 image kept or dropped, fp32 or bf16 host gradients, and reads
``memory_stats()``.

Output: one JSON line per setting with ``bytes_per_param`` (everything the ledger holds on
the host over the trainable parameters) and ``bytes_per_param_without_staging`` (less the
gradient and fetch staging buffers, which are bounded by the largest unit, not the model),
then a summary line with the lean targets of the host-memory issue (<= 10.3 fp32, <= 8.3 bf16).

    python benchmarks/bench_host_bytes.py
"""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.testing import simulated_device

SETTINGS = [
    ("fp32", dict()),
    ("fp32 lean", dict(host_memory="lean")),
    ("bf16, fp32 grads, image", dict(param_dtype=torch.bfloat16, host_grads="fp32", host_image=True)),
    ("bf16, bf16 grads, image", dict(param_dtype=torch.bfloat16, host_grads="compute", host_image=True)),
    ("bf16, bf16 grads, no image", dict(param_dtype=torch.bfloat16, host_grads="compute", host_image=False)),
    ("bf16 lean, fp32 grads, image", dict(param_dtype=torch.bfloat16, host_memory="lean", host_grads="fp32",
                                          host_image=True)),
    ("bf16 lean, bf16 grads, image", dict(param_dtype=torch.bfloat16, host_memory="lean", host_grads="compute",
                                          host_image=True)),
    ("bf16 lean, bf16 grads, no image", dict(param_dtype=torch.bfloat16, host_memory="lean", host_grads="compute",
                                             host_image=False)),
]


def measure(name: str, settings: dict) -> dict:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    bf16 = settings.get("param_dtype") is not None
    with simulated_device(0.0):
        engine = offload_model(model, StrongholdConfig(window_size=2, host_worker="inline", **settings), device="cpu")
        opt = engine.build_optimizer(lr=1e-4)
        ids = torch.randint(0, 8192, (1, 32))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        engine.synchronize()
        stats = engine.memory_stats()
        engine.close()
    host = stats["pinned_host_bytes"] + stats["pageable_host_bytes"]
    staging = stats["grad_staging_bytes"] + stats["fetch_staging_bytes"]
    n = stats["offloaded_trainable_params"]
    return {"bench": "host_bytes", "setting": name, "trainable_params": n,
            "bytes_per_param": round(host / n, 2), "bytes_per_param_without_staging": round((host - staging) / n, 2),
            "host_image_bytes": stats["host_image_bytes"], "staging_bytes": staging}


def main() -> None:
    rows = []
    for name, settings in SETTINGS:
        rows.append(measure(name, settings))
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"bench": "host_bytes", "summary": True,
                      "bytes_per_param_without_staging": {r["setting"]: r["bytes_per_param_without_staging"] for r in rows},
                      "target_fp32_lean_le_10_3": rows[1]["bytes_per_param_without_staging"] <= 10.3,
                      "target_bf16_lean_le_8_3": rows[-1]["bytes_per_param_without_staging"] <= 8.3}))


if __name__ == "__main__":
    main()
