"""``host_grads``: host gradients of bf16 units kept in bf16 while nothing accumulates.

What the device sends is bf16, so holding it in bf16 changes nothing (CPU Adam widens it
exactly, tests/test_cpu_adam.py) and saves 2 B/param. The first write bf16 cannot hold
exactly (an accumulation over micro-batches, a gradient set by hand) widens that unit's host
gradient to fp32 for good. Every case is checked bit for bit against ``host_grads="fp32"``,
then through the user's entry points, by the ledger, and as a child's peak RSS.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import HfArgumentParser

from stronghold_hf import StrongholdConfig, StrongholdTrainingArguments, offload_model
from child_rss import BF16_LLAMA_CHILD, saved_bytes_per_unit
from stronghold_hf.testing import simulated_device
from tiny_models import batch, tiny_model

BF16 = torch.bfloat16


def _train(model, family, *, steps=3, accumulate=1, by_hand=False, **config):
    engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype=BF16, **config), device="cpu")
    opt = engine.build_optimizer(lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        for micro in range(accumulate):
            with torch.autocast("cpu", dtype=BF16):
                loss = model(**batch(family, seed=10 * step + micro)).loss / accumulate
            loss.backward()
        if by_hand:  # a user's own gradient surgery: replaces one .grad with an fp32 tensor
            p = next(p for n, p in model.named_parameters() if "layers.1.mlp.up_proj" in n)
            p.grad = (p.grad.float() * 0.5).contiguous()
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    stats = engine.memory_stats()
    grad_dtypes = {u.grads.grad_flat.dtype for u in engine.units if u.grads.grad_flat is not None}
    engine.close()
    return state, stats, grad_dtypes


def _assert_identical(a, b):
    for k, v in a.items():
        assert torch.equal(b[k], v), k


def _host(stats):
    return stats["pinned_host_bytes"] + stats["pageable_host_bytes"]


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                              ("qwen2", {}), ("t5", {})], ids=["llama", "llama-tied", "qwen2", "t5"])
def test_bf16_host_gradients_train_bit_identically(family, overrides):
    ref = tiny_model(family, **overrides)
    fp32 = _train(copy.deepcopy(ref), family, host_grads="fp32")
    bf16 = _train(copy.deepcopy(ref), family, host_grads="compute")
    _assert_identical(fp32[0], bf16[0])
    assert fp32[2] == {torch.float32} and torch.bfloat16 in bf16[2]
    # Half the gradient bytes of the bf16 units (the blocks, an untied head), by the ledger.
    bf16_numel = sum(p.numel() for n, p in ref.named_parameters() if ".layers." in n or ".block." in n)
    assert _host(fp32[1]) - _host(bf16[1]) >= 2 * bf16_numel


@pytest.mark.parametrize("case", [dict(accumulate=2), dict(by_hand=True), dict(speculative_step="on"),
                                  dict(host_memory="lean", accumulate=2)],
                         ids=["accumulation", "grad-set-by-hand", "speculative", "lean-accumulation"])
def test_what_bf16_cannot_hold_widens_to_fp32_and_stays_exact(case, caplog):
    ref = tiny_model("llama", intermediate_size=128)
    fp32 = _train(copy.deepcopy(ref), "llama", steps=3, host_grads="fp32", **case)
    with caplog.at_level(logging.INFO, logger="stronghold_hf"):
        bf16 = _train(copy.deepcopy(ref), "llama", steps=3, host_grads="compute", **case)
    _assert_identical(fp32[0], bf16[0])
    widened = [r.getMessage() for r in caplog.records if "keeps fp32 host gradients" in r.getMessage()]
    if case.get("accumulate", 1) > 1:
        assert bf16[2] == {torch.float32} and widened  # every unit accumulated once: all widened, said so
        assert _host(bf16[1]) == pytest.approx(_host(fp32[1]), abs=64 * 16)  # and the old buffers were freed
    elif case.get("by_hand"):
        assert any("layers.1" in m for m in widened) and torch.bfloat16 in bf16[2]  # only that unit
    else:
        assert not widened


def test_exposed_gradients_are_the_bf16_host_gradients():
    """Between backward and step, .grad is the host gradient itself (bf16), and a custom loop's
    clip or inspection sees the values the device computed."""
    ref = tiny_model("llama")
    plain = copy.deepcopy(ref)
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype=BF16, host_grads="compute"), device="cpu")
    with torch.autocast("cpu", dtype=BF16):
        model(**batch("llama", seed=0)).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert grads["model.embed_tokens.weight"].dtype == torch.float32  # embeddings compute in their own dtype
    with torch.autocast("cpu", dtype=BF16):
        plain(**batch("llama", seed=0)).loss.backward()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n].float(), p.grad, rtol=2e-2, atol=2e-3, msg=lambda m: f"{n}: {m}")
    engine.close()


def test_host_grads_resolution_through_hf_argument_parser():
    parse = HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses
    base = ["--output_dir", "/tmp/unused", "--stronghold", "--use_cpu"]
    assert parse(base)[0].stronghold_config_resolved.host_grads == "compute"
    assert parse(base + ["--gradient_accumulation_steps", "4"])[0].stronghold_config_resolved.host_grads == "fp32"
    pinned = base + ["--gradient_accumulation_steps", "4", "--stronghold_config", '{"host_grads": "compute"}']
    assert parse(pinned)[0].stronghold_config_resolved.host_grads == "compute"  # a user's choice stands
    with pytest.raises(ValueError, match="host_grads"):
        parse(base + ["--stronghold_config", '{"host_grads": "bf16"}'])


def test_bf16_host_gradients_save_two_bytes_per_parameter_of_peak_rss():
    body, per_param = saved_bytes_per_unit(BF16_LLAMA_CHILD, '{"host_grads": "fp32"}', '{"host_grads": "compute"}',
                                           "bf16 block params")
    assert body > 37e6
    assert per_param >= 0.7 * 2


def test_sharded_state_keeps_bf16_shards_exactly():
    """A process group of one takes the sharded path (reduce-scatter, shards of the host gradient)."""
    import torch.distributed as dist

    from test_distributed import _port

    ref = tiny_model("qwen2")
    fp32 = _train(copy.deepcopy(ref), "qwen2", host_grads="fp32")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        bf16 = _train(copy.deepcopy(ref), "qwen2", host_grads="compute", shard_cpu_state=True)
    finally:
        dist.destroy_process_group()
    assert torch.bfloat16 in bf16[2]
    for k, v in fp32[0].items():
        torch.testing.assert_close(bf16[0][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("accumulation", [1, 2])
def test_accelerate_plugin_resolves_auto_by_its_accumulation(accumulation):
    from accelerate import Accelerator

    from stronghold_hf.integrations.accelerate import prepare_stronghold

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    _, _, engine = prepare_stronghold(accelerator, tiny_model("llama"), dict(lr=1e-3),
                                      config={"window_size": 1, "param_dtype": "bfloat16"})
    dtypes = {u.grads.grad_flat.dtype for u in engine.blocks}
    engine.close()
    assert dtypes == ({torch.bfloat16} if accumulation == 1 else {torch.float32})


@pytest.mark.parametrize("host_memory,bound", [("exact", 14.3), ("lean", 8.3)])
def test_ledger_bytes_per_parameter_with_bf16_compute(host_memory, bound):
    """Issue targets, by the ledger, beside the bounded staging buffers: bf16 compute with no
    image and bf16 gradients costs 14 B/param exact (4 master + 2 gradient + 8 moments) and
    about 8 lean (2.03 for the 8-bit moments); the fp32 parameters outside the blocks (2% of
    this model: embeddings, norms) add a little."""
    model = tiny_model("llama", hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)
    with simulated_device():  # the staging ring is real memory here
        engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype=BF16, host_image=False,
                                                       host_grads="compute", host_memory=host_memory), device="cpu")
        opt = engine.build_optimizer(lr=1e-3)
        with torch.autocast("cpu", dtype=BF16):
            model(**batch("llama", seed=0)).loss.backward()
        opt.step()
        engine.synchronize()
        stats = engine.memory_stats()
        staging = stats["grad_staging_bytes"] + stats["fetch_staging_bytes"]
        engine.close()
    per_param = (_host(stats) - staging) / stats["offloaded_trainable_params"]
    assert bound - 0.5 < per_param <= bound, per_param


def test_offload_model_alone_keeps_fp32_gradients_for_a_users_optimizer():
    """"auto" without the Trainer: the loop may step with its own optimizer over
    model.parameters(), which needs fp32 gradients on the fp32 values it holds between steps."""
    model = tiny_model("llama")
    engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype=BF16), device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        with torch.autocast("cpu", dtype=BF16):
            model(**batch("llama", seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    assert {u.grads.grad_flat.dtype for u in engine.units if u.grads.grad_flat is not None} == {torch.float32}
    engine.close()
