"""Peak RSS measured from outside: one child process per variant, so no variant's memory
(or the test runner's) hides another's. The child prints two integers on its last line: a
parameter count and its ``ru_maxrss`` growth in KiB over the part it measures."""

from __future__ import annotations

import os
import subprocess
import sys

#: A bf16-compute Llama (12 blocks of hidden 512, 4.2 M each: 50 M in the body; a 2 M untied
#: vocabulary) offloaded with the StrongholdConfig keys given as JSON in argv[1]; prints the
#: body's parameter count and the peak-RSS growth from offload_model through the first step.
BF16_LLAMA_CHILD = r"""
import json, resource, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from stronghold_hf import StrongholdConfig, offload_model

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=2000, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
body = sum(p.numel() for p in model.model.layers.parameters())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype=torch.bfloat16, host_worker="inline",
                                               **json.loads(sys.argv[1])))
opt = engine.build_optimizer(lr=1e-4)
ids = torch.randint(0, 2000, (1, 32))
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = model(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
engine.synchronize()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(body, after - before)
"""


def peak_rss_growth(child_code: str, variants: tuple[str, ...]) -> tuple[int, dict[str, int]]:
    """Runs ``child_code`` once per variant (passed as ``sys.argv[1]``); returns the count the
    children printed and each variant's peak-RSS growth in bytes."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    growth, count = {}, 0
    for variant in variants:
        out = subprocess.run([sys.executable, "-c", child_code, variant], capture_output=True, text=True, env=env,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        count, kib = map(int, out.stdout.split()[-2:])
        growth[variant] = kib * 1024
    return count, growth


def saved_bytes_per_unit(child_code: str, baseline: str, variant: str, what: str) -> tuple[int, float]:
    """Peak-RSS growth of ``baseline`` minus ``variant``'s, per unit of the children's count
    (printed, for the log); returns (count, bytes saved per unit)."""
    count, growth = peak_rss_growth(child_code, (baseline, variant))
    saved = (growth[baseline] - growth[variant]) / count
    print(f"peak RSS growth, {count / 1e6:.1f} M {what}: {baseline} {growth[baseline] / 2**20:.0f} MiB, {variant} "
          f"{growth[variant] / 2**20:.0f} MiB, saved {saved:.2f} B each")
    return count, saved
