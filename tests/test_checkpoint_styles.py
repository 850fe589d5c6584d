"""Gradient checkpointing in both of transformers' wrapper styles, and promises never silent.

transformers 5.17-5.22 checkpoint a ``GradientCheckpointingLayer``'s whole ``__call__`` (module
hooks run inside the checkpoint); 5.23 and later only its ``forward`` (hooks outside). Whichever
release is installed, `as_style` rebuilds each block's class in the *other* style too, the way
that release's code does it, so both are tested on every release: exact parity with the same
model trained without the engine, every checkpointed block recomputed once per backward, and
the same activation bytes on the device and the host.
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.activations import _HostBuffers
from stronghold_hf.ledger import MemoryLedger
from stronghold_hf.memory import HostAllocator
from stronghold_hf.promises import PromiseBroken
from stronghold_hf.stats import EngineStats
from stronghold_hf.transfer import TransferContext
from tiny_models import batch, tiny_model

LR = 1e-2
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")


def _drop_cache(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for name in _CACHE_KWARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    return kwargs


def _plain_forward(cls):
    """The layer's own forward, without any checkpointing wrapper of the installed release."""
    forward = cls.forward
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    return forward


def _call_style(self, *args, **kwargs):
    # transformers 5.17-5.22: GradientCheckpointingLayer.__call__
    if self.gradient_checkpointing and self.training:
        return self._gradient_checkpointing_func(functools.partial(nn.Module.__call__, self, **_drop_cache(kwargs)),
                                                 *args)
    return nn.Module.__call__(self, *args, **kwargs)


def _forward_style(forward):
    # transformers 5.23 and later: __init_subclass__ wraps forward
    @functools.wraps(forward)
    def forward_with_checkpointing(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(functools.partial(forward, self, **_drop_cache(kwargs)), *args)
        return forward(self, *args, **kwargs)

    return forward_with_checkpointing


def _direct_call_style(self, *args, **kwargs):
    # A layer that checkpoints itself without the model's _gradient_checkpointing_func.
    if self.gradient_checkpointing and self.training:
        return torch.utils.checkpoint.checkpoint(functools.partial(nn.Module.__call__, self, **_drop_cache(kwargs)),
                                                 *args, use_reentrant=False)
    return nn.Module.__call__(self, *args, **kwargs)


def _swallowing_saves(forward):
    """The forward under a saved-tensor hook of its own (where the engine's hooks were on
    5.17-5.22): it takes every tensor the block saves, so a checkpoint around it saves nothing."""
    @functools.wraps(forward)
    def swallowing(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return forward(self, *args, **kwargs)

    return swallowing


def as_style(model: nn.Module, style: str, swallow_saves: bool = False) -> nn.Module:
    """Gives every checkpointing layer of ``model`` a class that checkpoints in ``style``."""
    for m in model.modules():
        if not isinstance(m, GradientCheckpointingLayer):
            continue
        cls = type(m)
        sub = type(cls.__name__, (cls,), {})  # on 5.23+ this wraps forward once more: replaced below
        forward = _plain_forward(cls)
        if swallow_saves:
            forward = _swallowing_saves(forward)
        if style == "call":
            sub.__call__, sub.forward = _call_style, forward
        elif style == "forward":
            sub.__call__, sub.forward = nn.Module.__call__, _forward_style(forward)
        elif style == "direct":
            sub.__call__, sub.forward = _direct_call_style, forward
        else:
            raise ValueError(style)
        m.__class__ = sub
    return model


def _checkpointed(family, reentrant, style, swallow_saves=False, **kw):
    model = tiny_model(family, **kw)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return as_style(model, style, swallow_saves)


def _batch(family, step, seq):
    if family != "t5":
        return batch(family, seed=step, seq=seq)
    b = batch("t5", seed=step, seq=seq)  # encoder and decoder of different lengths: inputs of two sizes
    b["labels"] = b["labels"][:, : max(2, seq // 3)].contiguous()
    return b


def _train(model, family, engine=None, steps=2, seq=16):
    if engine is not None:
        opt = engine.build_optimizer(lr=LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(steps):
        loss = model(**_batch(family, step, seq)).loss
        loss.backward()
        losses.append(loss.item())
        if engine is not None:
            engine.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    if engine is not None:
        engine.synchronize()
    return losses


_SIZES = {"gpt2": {"n_layer": 4}, "bert": {"num_hidden_layers": 4}, "t5": {"num_layers": 3, "num_decoder_layers": 2}}


def _run(family, reentrant, style, offload, seq=16):
    ref = _checkpointed(family, reentrant, style, **_SIZES[family])
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=offload), device="cpu")
    losses = _train(model, family, engine, seq=seq)
    ref_losses = _train(ref, family, seq=seq)
    return model, ref, engine, losses, ref_losses


@pytest.mark.parametrize("family", ["gpt2", "bert", "t5"])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("offload", [True, False])
def test_both_wrapper_styles_recompute_offload_and_train_exactly(family, reentrant, offload):
    seen = {}
    for style in ("call", "forward"):
        model, ref, engine, losses, ref_losses = _run(family, reentrant, style, offload, seq=48 if family == "t5" else 16)
        assert losses == pytest.approx(ref_losses, rel=1e-5), style
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=4e-4, msg=lambda m: f"{style} {name}: {m}")
        stats = engine.memory_stats()
        blocks = engine.num_blocks
        # Every block was checkpointed, and its function ran again in backward exactly once.
        assert stats["checkpointed_calls"] == blocks and stats["checkpoint_recomputes"] == blocks, (style, stats)
        assert stats["promise_checkpoint_recompute"] == 1.0 and stats["promises_broken"] == 0
        assert engine.schedule.checkpoint_watch.style == style
        if offload:
            assert stats["activation_host_bytes"] > 0 and stats["promise_activation_offload"] == 1.0
        else:
            assert stats["activation_host_bytes"] == 0 and "promise_activation_offload" not in stats
        seen[style] = {k: stats[k] for k in ("activation_device_peak_bytes", "activation_host_bytes",
                                            "checkpoint_recomputes", "fetches")}
        if reentrant:
            # A reentrant checkpoint of the whole call runs the block's hooks under no_grad: its
            # backward starts at the recompute, so the turn cannot keep the last block (one
            # more fetch per step than when the hooks run outside).
            seen[style]["fetches"] -= 2 if style == "call" else 0
    assert seen["call"] == seen["forward"]


def _activation_peak(layers, style, offload):
    model = _checkpointed("llama", False, style, num_hidden_layers=layers, hidden_size=64, intermediate_size=128)
    engine = offload_model(model, StrongholdConfig(window_size=2, offload_activations=offload), device="cpu")
    _train(model, "llama", engine, steps=2, seq=32)
    return engine.memory_stats()


@pytest.mark.parametrize("style", ["call", "forward"])
def test_the_device_keeps_one_input_per_checkpointed_block_in_either_style(style):
    # One checkpointed input: batch 2 x 32 tokens x hidden 64, fp32. Without offload the device
    # holds exactly one per block (not every intermediate: the checkpoint must recompute them).
    one = 2 * 32 * 64 * 4
    for layers in (4, 8):
        kept = _activation_peak(layers, style, offload=False)
        assert kept["activation_device_peak_bytes"] == layers * one, (style, layers, kept["activation_device_peak_bytes"])
        off = _activation_peak(layers, style, offload=True)
        assert off["activation_device_peak_bytes"] <= (2 + 2) * one
        assert off["activation_host_bytes"] >= (layers - 2) * one


def test_the_host_buffer_pool_reuses_buffers_of_several_sizes():
    ledger = MemoryLedger()
    pool = _HostBuffers(HostAllocator(ledger, pin=False), ledger, TransferContext(torch.device("cpu"), ledger, EngineStats(ledger)))
    sizes = [4096, 12288, 6144, 16384]
    first = [pool.acquire(n) for n in sizes]
    for buf in first:
        pool.release(buf, None)
    again = [pool.acquire(n) for n in (6144, 4096, 16384, 12288)]
    # The smallest free buffer that fits, each taken once: nothing new allocated.
    assert [b.numel() for b in again] == [6144, 4096, 16384, 12288]
    assert len({b.data_ptr() for b in again}) == 4 and pool.total_bytes == sum(sizes)


def test_a_checkpoint_that_never_recomputes_is_said_once(caplog):
    model = _checkpointed("gpt2", False, "forward", swallow_saves=True, n_layer=3)
    engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=False), device="cpu")
    with caplog.at_level(logging.WARNING, logger="stronghold_hf"):
        _train(model, "gpt2", engine, steps=2)
    stats = engine.memory_stats()
    assert stats["promise_checkpoint_recompute"] == 0.0 and stats["promises_broken"] == 1
    assert stats["checkpoint_recomputes"] == 0
    warned = [r.getMessage() for r in caplog.records if "never recomputed" in r.getMessage()]
    assert len(warned) == 1 and "Fix:" in warned[0] and "saved_tensors_hooks" in warned[0]


def test_each_promise_is_judged_on_its_own():
    # The inputs still leave the device (the checkpoint saves them outside the block), but
    # nothing is recomputed: one promise held, the other not.
    model = _checkpointed("gpt2", False, "forward", swallow_saves=True, n_layer=3)
    engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=True), device="cpu")
    model(**batch("gpt2", seed=0, seq=32)).loss.backward()
    stats = engine.memory_stats()
    assert stats["promise_activation_offload"] == 1.0 and stats["promise_checkpoint_recompute"] == 0.0


def test_checkpoints_that_bypass_the_models_checkpoint_function():
    # Explicit offload: raises, naming the bypass.
    model = _checkpointed("gpt2", False, "direct", n_layer=3)
    offload_model(model, StrongholdConfig(window_size=1, offload_activations=True), device="cpu")
    with pytest.raises(PromiseBroken, match="did not go through the model's _gradient_checkpointing_func"):
        model(**batch("gpt2", seed=0, seq=32))
    # Without offload: training is exact, and the recompute is seen through the block hooks
    # (they run inside this checkpoint).
    ref = _checkpointed("gpt2", False, "direct", n_layer=3)
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1, offload_activations=False), device="cpu")
    assert _train(model, "gpt2", engine) == pytest.approx(_train(ref, "gpt2"), rel=1e-5)
    assert engine.memory_stats()["promise_checkpoint_recompute"] == 1.0


def test_a_chunked_loss_that_did_not_run_is_said(caplog):
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1, loss_chunk_tokens=8), device="cpu")
    head = engine.chunked_loss._heads[0]
    head.handles[1].remove()  # the head's input is no longer captured: as if the model called it another way
    with caplog.at_level(logging.WARNING, logger="stronghold_hf"):
        model(**batch("gpt2", seed=0, seq=32)).loss.backward()
    stats = engine.memory_stats()
    assert stats["promise_chunked_loss"] == 0.0
    assert any("chunked_loss=False" in r.getMessage() for r in caplog.records)


def test_a_chunked_loss_that_ran_is_kept():
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1, loss_chunk_tokens=8), device="cpu")
    model(**batch("gpt2", seed=0, seq=32)).loss.backward()
    stats = engine.memory_stats()
    assert stats["promise_chunked_loss"] == 1.0 and stats["promises_broken"] == 0


def test_deepcopy_of_an_offloaded_model_checkpoints_on_its_own():
    model = _checkpointed("gpt2", False, "forward", n_layer=3)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    _train(model, "gpt2", engine, steps=1)
    calls = [m.__dict__["_gradient_checkpointing_func"] for m in model.modules()
             if "_gradient_checkpointing_func" in m.__dict__]
    assert calls and all(type(f).__name__ == "CheckpointCall" for f in calls)  # installed by the first forward
    twin = copy.deepcopy(calls[0])
    assert type(twin).__name__ != "CheckpointCall" and callable(twin)
    engine.close()  # gives the model its own checkpoint functions back
    assert all(type(m.__dict__["_gradient_checkpointing_func"]).__name__ != "CheckpointCall"
               for m in model.modules() if "_gradient_checkpointing_func" in m.__dict__)
