"""Any autograd shape trains with parity: blocks used several times, shared layer groups,
gradients through frozen blocks, repeated flushes, retained graphs, and a backward that raises.

Each test trains an untouched deepcopy next to the offloaded model and compares gradients
(after backward) and weights (after steps), as the parity tests of test_window.py do.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.testing import simulated_device
from tiny_models import batch, tiny_model

LR = 1e-2


def _assert_grads_equal(model, ref):
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        if p.grad is None:
            assert q.grad is None, name
        else:
            assert q.grad is not None, name
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _assert_weights_close(model, ref, steps):
    sd, sd_ref = model.state_dict(), ref.state_dict()
    for k, v in sd_ref.items():
        # Adam turns rounding noise of ~0 gradients into lr-sized steps (see test_window.py).
        torch.testing.assert_close(sd[k], v, rtol=1e-4, atol=2e-2 * LR * steps * 50, msg=lambda m: f"{k}: {m}")


def _pair(model_fn, window_size=1, **cfg):
    ref = model_fn()
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=window_size, **cfg), device="cpu")
    return ref, model, engine


def _step_both(ref, model, engine, loss_fn, steps=3):
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR)
    opt = engine.build_optimizer(lr=LR)
    for step in range(steps):
        l_ref, l = loss_fn(ref, step), loss_fn(model, step)
        torch.testing.assert_close(l, l_ref, rtol=1e-5, atol=1e-6)
        l_ref.backward()
        l.backward()
        _assert_grads_equal(model, ref)
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        n = engine.clip_grad_norm_(1.0)
        torch.testing.assert_close(n, n_ref, rtol=1e-5, atol=1e-6)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    engine.synchronize()
    _assert_weights_close(model, ref, steps)
    return engine


def _two_forwards(model, step):
    return model(**batch("gpt2", seed=step)).loss + 0.5 * model(**batch("gpt2", seed=100 + step)).loss


@pytest.mark.parametrize("window_size", [1, 2, 3])
def test_two_forwards_one_backward(window_size):
    ref, model, engine = _pair(lambda: tiny_model("gpt2"), window_size=window_size)
    engine = _step_both(ref, model, engine, _two_forwards)
    assert engine.resident_blocks() == []
    stats = engine.memory_stats()
    assert stats["device_peak_bytes"] <= (stats["window_bound_bytes"] + 2 * stats["grad_buffer_bytes"]
                                          + stats["rest_unit_bytes"] + stats["rest_grad_bytes"])


def test_two_forwards_with_delayed_copies():
    with simulated_device(0.002):
        ref, model, engine = _pair(lambda: tiny_model("gpt2"), window_size=1)
        _step_both(ref, model, engine, _two_forwards, steps=2)


def test_repeated_flushes_of_one_block_accumulate():
    """W=1 over 3 blocks: each block leaves between its two uses and is flushed twice."""
    ref, model, engine = _pair(lambda: tiny_model("gpt2"), window_size=1)
    flushes = []
    original = engine.schedule.gradients.flush

    def counting_flush(b):
        flushes.append(b.index)
        original(b)

    engine.schedule.gradients.flush = counting_flush
    _step_both(ref, model, engine, _two_forwards, steps=1)
    assert all(flushes.count(i) == 2 for i in range(engine.num_blocks)), flushes


def _albert(groups=1, layers=4):
    torch.manual_seed(0)
    cfg = T.AlbertConfig(vocab_size=96, embedding_size=16, hidden_size=32, num_hidden_layers=layers,
                         num_hidden_groups=groups, num_attention_heads=2, intermediate_size=64,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
                         max_position_embeddings=64)
    return T.AlbertForMaskedLM(cfg).train()


def _mlm_loss(model, step):
    return model(**batch("bert", seed=step)).loss


@pytest.mark.parametrize("groups", [1, 2])
def test_albert_shared_layer_group_trains_without_flags(groups):
    ref, model, engine = _pair(lambda: _albert(groups), window_size=1)
    assert engine.num_blocks == groups
    _step_both(ref, model, engine, _mlm_loss)


def test_albert_with_the_errors_advice_block_classes():
    ref, model, engine = _pair(lambda: _albert(1), window_size=1, block_classes=["AlbertLayer"])
    _step_both(ref, model, engine, _mlm_loss)


def test_gradients_through_frozen_blocks():
    def make():
        m = tiny_model("llama", num_hidden_layers=4)
        for p in m.model.layers[1].parameters():
            p.requires_grad_(False)
        for p in m.model.layers[2].parameters():
            p.requires_grad_(False)
        return m

    ref, model, engine = _pair(make, window_size=1)
    _step_both(ref, model, engine, lambda m, s: m(**batch("llama", seed=s)).loss)
    assert not engine.blocks[1].trainable and engine.blocks[1].grads.grad_flat is None


def test_retained_graph_backward_twice_accumulates():
    ref, model, engine = _pair(lambda: tiny_model("t5"), window_size=1)
    b = batch("t5", seed=0)
    for m in (ref, model):
        loss = m(**b).loss
        loss.backward(retain_graph=True)
        loss.backward()
    _assert_grads_equal(model, ref)


class _Boom(Exception):
    pass


def _raise_in_block(model, block_index):
    """Makes the backward of one block raise, half-way through the backward pass."""
    def hook(module, grad_output):
        raise _Boom()

    return model.transformer.h[block_index].register_full_backward_pre_hook(hook)


def test_backward_that_raises_leaves_no_partial_gradients():
    ref, model, engine = _pair(lambda: tiny_model("gpt2"), window_size=1)
    handle = _raise_in_block(model, 1)
    with pytest.raises(_Boom):
        model(**batch("gpt2", seed=0)).loss.backward()
    handle.remove()
    # Block 2 had finished its backward and shipped its gradient; none of it remains.
    model(**batch("gpt2", seed=1)).loss  # the next call into the engine notices and rolls back
    assert all(p.grad is None for b in engine.blocks for p in b.params)
    stats = engine.memory_stats()
    assert stats["grads_in_flight"] == 0
    for p in model.parameters():
        p.grad = None  # resident parameters keep partial gradients, as in plain PyTorch
    # Training goes on and equals a reference that never saw the failed step.
    _step_both(ref, model, engine, lambda m, s: m(**batch("gpt2", seed=s + 1)).loss, steps=2)


def test_backward_that_raises_during_accumulation_is_refused_until_zeroed():
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    opt = engine.build_optimizer(lr=LR)
    model(**batch("gpt2", seed=0)).loss.backward()  # micro-batch 1: fine
    handle = _raise_in_block(model, 0)
    with pytest.raises(_Boom):
        model(**batch("gpt2", seed=1)).loss.backward()  # micro-batch 2 raises after blocks 2, 1 flushed
    handle.remove()
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.step()
    opt.zero_grad()
    model(**batch("gpt2", seed=2)).loss.backward()
    opt.step()
    engine.synchronize()
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _CheckpointedStack(torch.nn.Module):
    """Blocks called through torch.utils.checkpoint from the parent: the module hooks run
    inside the checkpoint, and non-reentrant checkpointing may stop the recompute early."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)) for _ in range(4))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
        return self.out(h).square().mean()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("window_size", [1, 2])
def test_user_checkpointing_around_block_calls(reentrant, window_size):
    ref, model, engine = _pair(lambda: _CheckpointedStack(reentrant), window_size=window_size)
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(4, 8, generator=g) for _ in range(3)]
    _step_both(ref, model, engine, lambda m, s: m(data[s]))
    assert all(b.holds == 0 for b in engine.blocks) and engine.resident_blocks() == []


def _funnel():
    # Funnel keeps its layers as a list of lists (encoder.blocks[i][j]) and calls the inner
    # layers directly: the outer lists' items have no forward of their own.
    torch.manual_seed(0)
    cfg = T.FunnelConfig(vocab_size=96, d_model=32, n_head=2, d_head=16, d_inner=64, block_sizes=[1, 2],
                         num_decoder_layers=1, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    return T.FunnelForMaskedLM(cfg).train()


def test_list_of_lists_streams_the_layers_it_holds():
    ref, model, engine = _pair(_funnel, window_size=1)
    assert [b.fqn for b in engine.blocks] == ["funnel.encoder.blocks.0.0", "funnel.encoder.blocks.1.0",
                                              "funnel.encoder.blocks.1.1"]
    _step_both(ref, model, engine, _mlm_loss)
    # Every block went through the window: fetched for forward and again for backward.
    assert engine.memory_stats()["h2d_bytes"] > 0
    stats = engine.memory_stats()
    assert stats["sequence_length"] == engine.num_blocks  # a small embedding: everything else is the resident unit
    assert stats["fetches"] == 3 * (2 * engine.num_blocks - 1 + stats["rest_units"])


class _DictBlock(torch.nn.ModuleDict):
    """A container subclass with its own forward: a block, not something to look through."""

    def __init__(self):
        super().__init__({"inner": torch.nn.Linear(8, 8), "outer": torch.nn.Linear(8, 8)})

    def forward(self, x):
        return self["outer"](torch.tanh(self["inner"](x)))


class _Containers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_DictBlock() for _ in range(4))
        shared = torch.nn.Linear(8, 8)
        self.shared = torch.nn.ModuleList([shared] * 6)  # one layer applied six times
        self.heads = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return sum(h(x).square().mean() for h in self.heads)


def test_container_subclasses_with_a_forward_are_blocks():
    from stronghold_hf.discovery import build_block_specs, find_block_stacks

    model = _Containers()
    stacks = find_block_stacks(model)
    assert [s.fqn for s in stacks] == ["blocks"] and [type(b) for b in stacks[0].blocks] == [_DictBlock] * 4
    assert [s.fqn for s in find_block_stacks(model, ("_DictBlock",))] == ["blocks"]
    # A list holding one layer six times counts six uses, not one distinct module.
    del model.blocks
    stacks = find_block_stacks(model)
    assert [s.fqn for s in stacks] == ["shared"] and len(stacks[0].blocks) == 6
    assert len(build_block_specs(model, stacks)) == 1


def test_grad_norm_counts_gradients_the_user_set_between_steps():
    ref, model, engine = _pair(lambda: tiny_model("gpt2"), window_size=1)
    engine.build_optimizer(lr=LR)
    for m in (ref, model):
        with torch.no_grad():  # no backward ran: gradients written by hand (a custom update rule)
            for i, p in enumerate(m.parameters()):
                p.grad = torch.full_like(p, 0.01 * i)
    torch.testing.assert_close(engine.global_grad_norm(), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9),
                               rtol=1e-5, atol=1e-6)


class _BypassingModel(torch.nn.Module):
    """Calls its layers through ``.forward``, which skips module hooks."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x.square().mean()


def test_a_forward_that_runs_no_block_is_reported(caplog):
    model = _BypassingModel().train()
    offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    with caplog.at_level("WARNING", logger="stronghold_hf"):
        model(torch.randn(2, 8))
        model(torch.randn(2, 8))
    said = [r.getMessage() for r in caplog.records if "ran none of its 3 offloaded blocks" in r.getMessage()]
    assert len(said) == 1 and "block_classes" in said[0]
