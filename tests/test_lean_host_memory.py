"""Lean host memory: 8-bit Adam moments on the host (optim/quant8.py, ``host_memory="lean"``).

The quantizer against a brute-force nearest code, the native kernel against the torch
reference, CPUAdam(state_bits=8) against fp32 AdamW, the state's round trips (save/load, and
conversion between exact and lean), the Trainer through ``--optim adamw_8bit`` with the
ledger's bytes per parameter, resume, and the peak RSS of a child process measured from outside.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import HfArgumentParser

from stronghold_hf import StrongholdConfig, StrongholdTrainer, StrongholdTrainingArguments, offload_model
from stronghold_hf.optim import quant8
from stronghold_hf.optim.cpu_adam import CPUAdam
from child_rss import saved_bytes_per_unit
from test_trainer import COMMON, TinyDataset, trainer_log
from tiny_models import tiny_model

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
WIDE = dict(intermediate_size=128)  # 32 x 128 MLP weights: at the 8-bit size (quant8.MIN_8BIT_NUMEL)


# ------------------------------------------------------------------------------ the quantizer
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_picks_the_nearest_code(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, generator=g).mul(torch.rand(400_000, generator=g).pow(12))  # every decade
    x = x / x.abs().max()
    if not signed:
        x = x.abs()
    table = quant8.signed_map() if signed else quant8.unsigned_map()
    mids = (table[1:].double() + table[:-1].double()) / 2
    x = torch.cat([x, table, mids.float(), torch.tensor([0.0, 1.0, 1e-12, 1e-30])] + ([torch.tensor([-1.0])] if signed
                                                                                      else []))
    codes = quant8.quantize(x, signed).long()
    nearest = torch.searchsorted(mids, x.double(), right=True)  # brute force: the midpoints at or below x
    off = (codes != nearest).nonzero().flatten()  # only a value on a midpoint (a tie, up to rounding) may differ
    gap = (x.double()[off, None] - mids[None, :]).abs().min(dim=1).values
    assert (gap <= 1e-6 * x.double()[off].abs()).all(), x[off][:5]
    assert torch.equal(quant8.quantize(table, signed).long(), torch.arange(256))  # codes are fixed points
    assert (table[1:] > table[:-1]).all() and table[0] == (-table[-2] if signed else 0.0) and table[-1] == 1.0
    # 7 decades: the smallest magnitude is 10**-7 of the largest, with 1, 2, ... 64 (signed) or 2 ... 128 codes each.
    mags = table[table > 0][:-1]
    assert mags.numel() == (127 if signed else 254) and 1e-7 < mags[0] < 1e-6 and mags[-1] > 0.99


def _tensors(numel, seed, out_dtype=None):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(numel, generator=g) * 0.02
    grads = [torch.randn(numel, generator=g) * 10.0 ** (-k % 5 - 2) for k in range(4)]
    out = torch.empty(numel, dtype=out_dtype) if out_dtype is not None else None
    return p, grads, out


@pytest.mark.parametrize("numel,out_dtype,grad_mul", [(256 * 40, None, 1.0), (5000, torch.bfloat16, 0.5),
                                                      (4099, torch.float16, 1.0)])
def test_native_kernel_equals_the_reference(numel, out_dtype, grad_mul):
    if quant8.native_error():
        pytest.skip(f"no native kernel here: {quant8.native_error()}")
    p, grads, out = _tensors(numel, 0, out_dtype)
    opt = CPUAdam([torch.nn.Parameter(p.clone())], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], state_bits=8,
                  kernel="native")
    master = opt.param_groups[0]["params"][0]
    if out is not None:
        opt.register_copy_out(master, out)
    ref_p, ref_state = p.clone(), quant8.new_state(p)
    ref_out = torch.empty_like(out) if out is not None else None
    for g in grads:
        master.grad = g.clone()
        opt.step_groups([0], clip_coef=grad_mul)
        quant8.step_reference(ref_p, g, ref_state, **HYPER, grad_mul=grad_mul, out=ref_out)
    state = opt.state[master]
    for key in quant8.CODE_KEYS + quant8.ABSMAX_KEYS:
        assert torch.equal(state[key], ref_state[key]), key
    torch.testing.assert_close(master.detach(), ref_p, rtol=0, atol=1e-7)
    if out is not None:
        assert (out.float() - ref_out.float()).abs().max() <= (ref_out.float().abs().max() * 2**-7)


def test_eight_bit_adamw_tracks_fp32_adamw():
    """On a least-squares problem over 500 steps, 8-bit moments land where fp32 AdamW does."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 128, generator=g), torch.randn(256, 64, generator=g)
    w0 = torch.randn(128, 64, generator=g) * 0.1
    ends = {}
    for bits in (32, 8):
        w = torch.nn.Parameter(w0.clone())
        opt = CPUAdam([w], lr=1e-2, weight_decay=0.0, state_bits=bits)
        for _ in range(500):
            loss = (a @ w - b).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        ends[bits] = ((a @ w - b).square().mean().item(), w.detach().clone())
        assert bits == 32 or "exp_avg_q" in opt.state[w]
    assert ends[8][0] == pytest.approx(ends[32][0], rel=0.02)
    assert (ends[8][1] - ends[32][1]).norm() <= 0.05 * ends[32][1].norm()


@pytest.mark.parametrize("kernel", ["native", "reference"])
def test_a_second_moment_rounded_to_zero_does_not_blow_up_the_update(kernel):
    """[Note: the second moment's floor]: an element whose gradient is 1e-4 of its block's
    largest keeps a first moment while its second rounds to 0; a step without gradient then
    divided by eps alone (thousands of times lr). Held to Adam's own bound, K lr at most, and a
    second moment the codec kept is not changed."""
    if kernel == "native" and quant8.native_error():
        pytest.skip(f"no native kernel here: {quant8.native_error()}")
    lr, k = 1e-2, 1.0 / quant8.moment_floor(0.9, 0.999)
    assert k == pytest.approx(7.27, abs=0.01)
    w = torch.nn.Parameter(torch.zeros(quant8.BLOCK * 16))
    # kernel="torch": quant8.step_reference steps every 8-bit tensor (the fallback).
    opt = CPUAdam([w], lr=lr, weight_decay=0.0, state_bits=8, kernel=kernel if kernel == "native" else "torch")
    first = torch.zeros_like(w)
    first[0::quant8.BLOCK] = 1.0  # each block's largest
    first[1::quant8.BLOCK] = 1e-4  # a first moment that survives, a second that rounds to 0
    first[2::quant8.BLOCK] = 0.05  # an ordinary element
    moved = []
    for g in (first, torch.zeros_like(w), torch.zeros_like(w)):
        before = w.detach().clone()
        w.grad = g.clone()
        opt.step()
        moved.append((w.detach() - before).abs())
    state = opt.state[w]
    assert quant8.is_8bit(state)
    for step in moved:
        assert step.max() <= k * lr, step.max()  # without the floor: 3.2 at the second step
    # The ordinary element moves as fp32 AdamW moves it (its moments are well inside the map).
    ref = torch.nn.Parameter(torch.zeros(3))
    ref_opt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.0)
    for g in (torch.tensor([1.0, 1e-4, 0.05]), torch.zeros(3), torch.zeros(3)):
        ref.grad = g
        ref_opt.step()
    torch.testing.assert_close(w.detach()[2], ref.detach()[2], rtol=0.02, atol=0)


def test_lean_training_of_a_wide_vocabulary_moves_no_weight_more_than_adam_can():
    """The same on a model (the family probe's Llama, vocabulary 2048, lr 1e-2): the head's
    rows that went quiet and the embedding's rows of tokens not in the batch moved 3.0 in one
    step (the head ended 7.2 from fp32 AdamW's). Now every step moves every weight by at most
    K lr, and the run stays near fp32 AdamW's."""
    import transformers as T

    config = T.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=64, vocab_size=2048, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(config).train()
    model = copy.deepcopy(ref)
    lr, k = 1e-2, 1.0 / quant8.moment_floor(0.9, 0.999)
    engine = offload_model(model, StrongholdConfig(window_size=1, host_memory="lean"), device="cpu")
    try:
        opt = engine.build_optimizer(lr=lr, weight_decay=0.0)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0)
        for step in range(6):
            ids = torch.randint(3, 2048, (2, 12), generator=torch.Generator().manual_seed(step))
            before = [p.detach().clone() for p in model.parameters()]
            for m in (model, ref):
                m(input_ids=ids, labels=ids).loss.backward()
            engine.clip_grad_norm_(1.0)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            engine.synchronize()
            for (name, p), b in zip(model.named_parameters(), before):
                assert (p.detach() - b).abs().max() <= k * lr * 1.001, (step, name)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert (p.detach() - q.detach()).abs().max() <= 5 * lr, name  # fp32 AdamW moved them up to 6 lr
    finally:
        engine.close()


def test_small_tensors_keep_fp32_moments_and_the_override_wins():
    big, small, forced = (torch.nn.Parameter(torch.zeros(n)) for n in (quant8.MIN_8BIT_NUMEL, 100, 8192))
    opt = CPUAdam([big, small, forced], state_bits=8)
    opt.set_state_bits([forced], 32)
    for p in (big, small, forced):
        p.grad = torch.ones_like(p)
    opt.step()
    assert quant8.is_8bit(opt.state[big]) and not quant8.is_8bit(opt.state[small])
    assert not quant8.is_8bit(opt.state[forced])
    assert opt.state[big]["exp_avg_q"].dtype == torch.uint8 and opt.state[big]["exp_avg_absmax"].numel() == 16


def test_state_dict_round_trip_is_exact_and_converts_between_modes():
    g = torch.Generator().manual_seed(1)
    start = torch.randn(5000, generator=g)
    grads = [torch.randn(5000, generator=g) for _ in range(6)]

    def run(bits, steps, state=None, from_bits=None):
        w = torch.nn.Parameter(start.clone())
        opt = CPUAdam([w], lr=1e-2, state_bits=bits)
        if state is not None:
            w.data.copy_(state[0])
            opt.load_state_dict(state[1])
        for gr in steps:
            w.grad = gr.clone()
            opt.step()
        return w.detach().clone(), copy.deepcopy(opt.state_dict()), opt

    straight, _, _ = run(8, grads)
    half, saved, _ = run(8, grads[:3])
    assert saved["state"][0]["exp_avg_q"].dtype == torch.uint8  # torch.save-able as is
    resumed, _, opt = run(8, grads[3:], state=(half, saved))
    assert torch.equal(resumed, straight)  # the quantized state resumes bit for bit
    assert opt.state[opt.param_groups[0]["params"][0]]["exp_avg_q"].dtype == torch.uint8
    # An exact checkpoint resumed lean is quantized; a lean one resumed exact is read back as fp32.
    _, exact_saved, _ = run(32, grads[:3])
    _, _, lean_opt = run(8, [], state=(half, exact_saved))
    st = lean_opt.state[lean_opt.param_groups[0]["params"][0]]
    assert quant8.is_8bit(st)
    m = quant8.state_to_fp32(st, torch.Size([5000]))["exp_avg"]
    ref = exact_saved["state"][0]["exp_avg"]
    assert (m - ref).abs().max() <= ref.abs().max() * 0.02
    _, _, exact_opt = run(32, [], state=(half, saved))
    st = exact_opt.state[exact_opt.param_groups[0]["params"][0]]
    assert not quant8.is_8bit(st) and st["exp_avg"].shape == (5000,) and st["exp_avg"].dtype == torch.float32


# ------------------------------------------------------------------------------ the engine
def test_offload_model_lean_trains_and_never_speculates():
    model = tiny_model("llama", **WIDE)
    reference = copy.deepcopy(model)
    engine = offload_model(model, StrongholdConfig(window_size=1, host_memory="lean", speculative_step="auto"))
    opt = engine.build_optimizer(lr=1e-2)
    ref_engine = offload_model(reference, StrongholdConfig(window_size=1))
    ref_opt = ref_engine.build_optimizer(lr=1e-2)
    assert opt.can_speculate is False and ref_opt.can_speculate is True
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = {}
    for name, m, o in (("lean", model, opt), ("exact", reference, ref_opt)):
        for _ in range(12):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
        losses[name] = loss.item()
    engine.synchronize()
    assert losses["lean"] == pytest.approx(losses["exact"], rel=0.02)
    states = list(opt.cpu_optimizer.state.values())
    assert sum(quant8.is_8bit(s) for s in states) >= 3 * 3  # each block's MLP weights
    assert engine.stats.as_dict().get("speculated_blocks", 0) == 0


def test_lean_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="speculative_step"):
        StrongholdConfig(host_memory="lean", speculative_step="on")
    with pytest.raises(ValueError, match="offload_optimizer"):
        StrongholdConfig(host_memory="lean", offload_optimizer=False)
    with pytest.raises(ValueError, match="host_memory"):
        StrongholdConfig(host_memory="small")


@pytest.mark.parametrize("optim", ["adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_torch_8bit"])
def test_eight_bit_optim_names_select_lean(optim):
    (args,) = HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/unused", "--stronghold", "--optim", optim, "--use_cpu"])
    assert args.stronghold_config_resolved.host_memory == "lean"
    (plain,) = HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/unused", "--stronghold", "--use_cpu"])
    assert plain.stronghold_config_resolved.host_memory == "exact"


def test_other_optims_are_refused_with_the_accepted_names():
    with pytest.raises(ValueError, match="adamw_torch_8bit") as err:
        HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", "/tmp/unused", "--stronghold", "--optim", "lion_8bit", "--use_cpu"])
    assert "adamw_torch" in str(err.value) and "lion_8bit" in str(err.value)


def _trainer(tmp_path, name, optim, **extra):
    args = StrongholdTrainingArguments(output_dir=str(tmp_path / name), stronghold=True, optim=optim,
                                       stronghold_window_size="1", **{**COMMON, **extra})
    return StrongholdTrainer(model=tiny_model("llama", **WIDE), args=args, train_dataset=TinyDataset("llama", n=24))


def test_trainer_lean_costs_fewer_host_bytes_and_trains_like_exact(tmp_path):
    runs = {}
    with trainer_log() as messages:
        for optim in ("adamw_torch", "adamw_8bit"):
            t = _trainer(tmp_path, optim, optim, max_steps=6)
            t.train()
            runs[optim] = (t, t.stronghold_engine.memory_stats())
    start = [m for m in messages if "STRONGHOLD is on" in m]
    assert "host_memory=exact (fp32 Adam moments)" in start[0] and "host_memory=lean (8-bit Adam moments)" in start[1]
    exact, lean = runs["adamw_torch"][1], runs["adamw_8bit"][1]
    # The ledger: the moments of the 8-bit tensors cost 2 B/param (+ absmax) instead of 8.
    saved = (exact["optimizer_state_bytes"] - lean["optimizer_state_bytes"]) / lean["offloaded_trainable_params"]
    big = sum(s["exp_avg_q"].numel() for s in runs["adamw_8bit"][0].optimizer.optimizer.cpu_optimizer.state.values()
              if quant8.is_8bit(s)) / lean["offloaded_trainable_params"]
    assert saved == pytest.approx(6 * big, rel=0.02)  # 8 -> 2 B/param (+ 4 B per 256 of absmax)
    losses = {k: [h["loss"] for h in t.state.log_history if "loss" in h] for k, (t, _) in runs.items()}
    assert losses["adamw_8bit"][-1] == pytest.approx(losses["adamw_torch"][-1], rel=0.02)


def test_trainer_lean_resume_matches_uninterrupted(tmp_path):
    full = _trainer(tmp_path, "full", "adamw_8bit", max_steps=6, save_strategy="steps", save_steps=3)
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-3"
    resumed = _trainer(tmp_path, "resumed", "adamw_8bit", max_steps=6, save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint=str(ckpt))
    a, b = full.stronghold_engine.full_state_dict(), resumed.stronghold_engine.full_state_dict()
    for k, v in a.items():
        assert torch.equal(b[k], v), k  # the quantized state resumed bit for bit
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert any(quant8.is_8bit(s) for s in saved["cpu"]["state"].values())
    # The HF checkpoint is written from the fp32 masters and loads in plain HF, no engine.
    from transformers import AutoModelForCausalLM

    short = _trainer(tmp_path, "short", "adamw_8bit", max_steps=3, save_strategy="steps", save_steps=3)
    short.train()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "short" / "checkpoint-3")
    for k, v in short.stronghold_engine.full_state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k


# ------------------------------------------------------------------------------ measured from outside
_CHILD = r"""
import ctypes, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from stronghold_hf import StrongholdConfig, offload_model

torch.manual_seed(0)
# A 39 M-parameter body (6 blocks of hidden 640, 6.6 M each) and a 5.8 M untied vocabulary.
cfg = LlamaConfig(vocab_size=4500, hidden_size=640, intermediate_size=2560, num_hidden_layers=6,
                  num_attention_heads=5, num_key_value_heads=5, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
engine = offload_model(model, StrongholdConfig(window_size=1, host_memory=sys.argv[1], host_worker="inline"))
opt = engine.build_optimizer(lr=1e-4)
params = sum(p.numel() for p in model.parameters())
ids = torch.randint(0, 4500, (1, 32))


def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


# The peak restarts from what is resident now, after malloc_trim: neither the model's build nor
# freed memory the heap kept (or not, by the allocator's history) moves the growth.
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
before = status_kib("VmRSS")
model(input_ids=ids, labels=ids).loss.backward()
opt.step()
engine.synchronize()
print(params, status_kib("VmHWM") - before)
"""


def test_lean_peak_rss_saves_six_bytes_per_parameter():
    """The optimizer state appears at the first step: its growth of peak RSS, child by child."""
    params, per_param = saved_bytes_per_unit(_CHILD, "exact", "lean", "params, first step")
    assert params > 38e6
    assert per_param >= 0.7 * 6
