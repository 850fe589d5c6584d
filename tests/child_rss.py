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


#: What a child that measures its own peak RSS needs: ``status_kib(field)`` reads
#: /proc/self/status; ``reset_peak()`` trims the heap, sets VmHWM to the current RSS and
#: returns that RSS (KiB).
PEAK_HELPERS = r"""
import ctypes


def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return status_kib("VmRSS")
"""


def llama_steps_child(*, layers: int, hidden: int, since: str, vocab: int = 2000) -> str:
    """Child code: an fp32 Llama body of ``layers`` blocks of ``hidden`` (MLP 4x, an untied
    vocabulary of ``vocab`` tokens) offloaded with the StrongholdConfig keys given as JSON in
    argv[1], two steps; prints the body's parameter count and the growth of peak RSS (VmHWM,
    KiB) since ``"step"`` (after offload_model and build_optimizer) or ``"offload"`` (before
    them). The key ``"whole_units": true`` (not a config key) turns the NVMe tier's segments off,
    for the run without them (optim/segments.py).

    The peak is reset to the resident memory at that point after ``malloc_trim``, so neither an
    earlier transient peak nor freed tensors kept in the heap (or not, depending on the
    allocator's history) hide or absorb part of the growth."""
    assert since in ("step", "offload")
    return PEAK_HELPERS + f"""
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from stronghold_hf import StrongholdConfig, offload_model

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size={vocab}, hidden_size={hidden}, intermediate_size={4 * hidden}, num_hidden_layers={layers},
                  num_attention_heads={hidden // 64}, num_key_value_heads={hidden // 64}, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
body = sum(p.numel() for p in model.model.layers.parameters())
ids = torch.randint(0, {vocab}, (1, 32))
settings = json.loads(sys.argv[1])
if settings.pop("whole_units", False):
    from stronghold_hf.optim.segments import StateSegments
    StateSegments.for_engine = classmethod(lambda cls, engine: None)

before = reset_peak() if {since!r} == "offload" else None
engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="inline", **settings))
opt = engine.build_optimizer(lr=1e-4)
if before is None:
    before = reset_peak()
for _ in range(2):
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
engine.synchronize()
print(body, status_kib("VmHWM") - before)
"""


#: An fp32 Llama (two blocks of hidden 128, an untied vocabulary of argv[2] tokens) offloaded
#: under real copies (`simulated_device`: delayed copies, pinned staging) with the
#: StrongholdConfig keys given as JSON in argv[1]; four steps of 64 tokens, the loss in chunks of
#: 16. The peak is reset before each step; prints the vocabulary unit's fp32 bytes and the
#: largest peak-RSS growth (KiB) of steps 2 to 4, once everything the engine keeps is allocated.
VOCAB_STEP_CHILD = PEAK_HELPERS + r"""
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.testing import simulated_device

torch.manual_seed(0)
vocab, hidden = int(sys.argv[2]), 128
cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
ids = torch.randint(0, vocab, (1, 64))
with simulated_device(0.0):
    engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="inline", loss_chunk_tokens=16,
                                                   **json.loads(sys.argv[1])))
    opt = engine.build_optimizer(lr=1e-4)
    growth = []
    for _ in range(4):
        before = reset_peak()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        growth.append(status_kib("VmHWM") - before)
print(vocab * hidden * 4, max(growth[1:]))
"""


def peak_rss_growth(child_code: str, variants: tuple[str, ...], env: dict[str, str] | None = None,
                    args: tuple[str, ...] = ()) -> tuple[int, dict[str, int]]:
    """Runs ``child_code`` once per variant (passed as ``sys.argv[1]``, ``args`` after it);
    returns the count the children printed and each variant's peak-RSS growth in bytes.
    ``env``: added to the children's environment."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env or {}))
    growth, count = {}, 0
    for variant in variants:
        out = subprocess.run([sys.executable, "-c", child_code, variant, *args], capture_output=True, text=True,
                             env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        count, kib = map(int, out.stdout.split()[-2:])
        growth[variant] = kib * 1024
    return count, growth


def saved_bytes_per_unit(child_code: str, baseline: str, variant: str, what: str,
                         env: dict[str, str] | None = None) -> tuple[int, float]:
    """Peak-RSS growth of ``baseline`` minus ``variant``'s, per unit of the children's count
    (printed, for the log); returns (count, bytes saved per unit)."""
    count, growth = peak_rss_growth(child_code, (baseline, variant), env)
    saved = (growth[baseline] - growth[variant]) / count
    print(f"peak RSS growth, {count / 1e6:.1f} M {what}: {baseline} {growth[baseline] / 2**20:.0f} MiB, {variant} "
          f"{growth[variant] / 2**20:.0f} MiB, saved {saved:.2f} B each")
    return count, saved


#: A two-layer model of a family, fp32, offloaded (window 1, inline); one warm-up step at 256
#: tokens, then for each length in argv[1] (comma-separated) the peak RSS is reset and one step
#: runs at that length (argv[2] == "1": gradient checkpointing). Prints one line per length:
#: the peak-RSS growth of that step, in KiB.
ACTIVATION_PEAK_CHILD = PEAK_HELPERS + r"""
import sys
import torch
import transformers as T
from stronghold_hf import StrongholdConfig, offload_model

family, lengths, ckpt = sys.argv[3], [int(x) for x in sys.argv[1].split(",")], sys.argv[2] == "1"
torch.manual_seed(0)
torch.set_num_threads(1)
model = T.AutoModelForCausalLM.from_config(activation_config(family))
model.train()
if ckpt:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
import json

extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="inline", resident=False, **extra),
                       device="cpu")
opt = engine.build_optimizer(lr=1e-4)


def step(n):
    ids = torch.randint(0, 512, (1, n))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


step(256)
for n in lengths:
    before = reset_peak()
    step(n)
    print(n, status_kib("VmHWM") - before, flush=True)
"""


def activation_config(family: str):
    """The model ACTIVATION_PEAK_CHILD trains: two layers, hidden 64, a 256-wide MLP (gated in
    Llama and Qwen2), a 512-token vocabulary, no dropout."""
    import transformers as T

    if family == "llama":
        return T.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16384,
                             tie_word_embeddings=False)
    if family == "qwen2":
        return T.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16384,
                             tie_word_embeddings=False)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=512, n_embd=64, n_inner=256, n_layer=2, n_head=2, n_positions=16384,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    raise ValueError(family)


def activation_peak_kib(family: str, lengths, checkpointing: bool, config: str = "{}") -> dict[int, int]:
    """Runs ACTIVATION_PEAK_CHILD: the peak-RSS growth (KiB) of a step at each of ``lengths``;
    ``config``: more `StrongholdConfig` keys, as JSON."""
    import inspect

    code = inspect.getsource(activation_config) + ACTIVATION_PEAK_CHILD
    # Every allocation of 64 KiB or more is its own mapping, returned on free: the peak RSS
    # follows the live tensors, not the heap's history (glibc raises its threshold otherwise).
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, "-c", code, ",".join(map(str, lengths)), "1" if checkpointing else "0",
                           family, config], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.strip().splitlines() if line.strip()]
    return {int(n): int(kib) for n, kib in rows[-len(lengths):]}


#: Trainer-level resume (argv: the StrongholdConfig keys as JSON, "train" or "resume", the output
#: directory): an fp32 Llama of 6 blocks of hidden 512 (4.2 M parameters each) trains two steps
#: and saves checkpoint-2, or a fresh one resumes from it for one more step. The peak RSS is
#: reset just before ``train()``; a callback reads its growth (KiB) when the last step ends,
#: before any save. Prints the largest block's parameter count and that growth.
RESUME_CHILD = r"""
import ctypes, json, os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments

config, phase, out = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=2000, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
block = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 2000, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class PeakAtLastStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        self.growth = status_kib("VmHWM") - before


resume = phase == "resume"
args = StrongholdTrainingArguments(
    output_dir=out, stronghold=True, stronghold_window_size="1", stronghold_config=config, use_cpu=True,
    max_steps=3 if resume else 2, per_device_train_batch_size=1, learning_rate=1e-3, report_to=[],
    save_strategy="no" if resume else "steps", save_steps=2, disable_tqdm=True, logging_steps=1)
peak = PeakAtLastStep()
trainer = StrongholdTrainer(model=model, args=args, train_dataset=Data(), callbacks=[peak])
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = status_kib("VmRSS")
trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2") if resume else None)
print(block, peak.growth)
"""


#: Checkpointed activations in host memory or on to a file (argv[1]: the StrongholdConfig keys
#: as JSON, argv[2]: a directory for nvme_path): an fp32 Llama of 16 blocks of hidden 32 with
#: gradient checkpointing, batch 128 x 128 tokens (each block's checkpointed input 2 MiB), window
#: 1, inputs offloaded. The peak RSS is reset after build_optimizer; prints one input's bytes and
#: the peak-RSS growth (KiB) over one step.
CHECKPOINTS_CHILD = PEAK_HELPERS + r"""
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from stronghold_hf import StrongholdConfig, offload_model

torch.manual_seed(0)
torch.set_num_threads(1)
cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=16, num_attention_heads=1,
                  num_key_value_heads=1, tie_word_embeddings=False, max_position_embeddings=128)
model = LlamaForCausalLM(cfg)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
config = dict(json.loads(sys.argv[1]))
if config.pop("on_disk", False):
    config.update(nvme_path=sys.argv[2], nvme_activations=True)
engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="inline", resident=False,
                                               offload_activations=True, **config), device="cpu")
opt = engine.build_optimizer(lr=1e-4)
ids = torch.randint(0, 256, (128, 128))


def step():
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


before = reset_peak()
step()
print(128 * 128 * 32 * 4, status_kib("VmHWM") - before)
"""
