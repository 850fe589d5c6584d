"""The working-window engine against an untouched copy of the model (CPU path).

Each parity test trains a deepcopy with plain torch AdamW next to the offloaded model, whose
optimizer steps `engine.optimizer_parameters()` (CPU masters for blocks, live parameters for
the rest), and asserts equal losses at every step, equal gradients, and equal final weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from stronghold_hf import StrongholdConfig, get_engine, offload_model
from stronghold_hf.unit import Residency
from stronghold_hf.testing import simulated_device
from tiny_models import batch, is_seq2seq, tiny_model

FAMILIES = ["gpt2", "llama", "bert", "t5", "bart", "opt", "mixtral", "gemma2", "deberta-v2", "falcon"]


def _grads_by_name(model, engine=None):
    # Between steps an offloaded parameter's .grad is its fp32 host gradient.
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def _train_pair(family, *, window_size, grad_ckpt=None, accum=1, steps=3):
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    if grad_ckpt is not None:
        for m in (ref, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": grad_ckpt == "reentrant"})
    engine = offload_model(model, StrongholdConfig(window_size=window_size), device="cpu")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    opt = torch.optim.AdamW(engine.optimizer_parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    # Some gradients are mathematically zero (a key-projection bias cannot change a softmax)
    # and come out as ~1e-10 rounding noise; Adam normalises noise into full-size steps, so
    # those parameters are compared only to within the step size.
    noise_only: set[str] = set()
    for step in range(steps):
        for micro in range(accum):
            b = batch(family, seed=100 * step + micro)
            loss_ref = ref(**b).loss / accum
            loss = model(**b).loss / accum
            torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
            loss_ref.backward()
            loss.backward()
        g_ref, g = _grads_by_name(ref), _grads_by_name(model, engine)
        for name, gr in g_ref.items():
            if gr is None:
                assert g[name] is None, name
            else:
                torch.testing.assert_close(g[name], gr, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
                if gr.abs().max() < 1e-7:
                    noise_only.add(name)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert sd.keys() == sd_ref.keys()
    for k in sd_ref:
        # 2% of the distance Adam can move a weight (lr * steps): Adam normalises away the size
        # of a gradient, so rounding noise in an entry whose gradient is ~0 (a ReLU unit that
        # is almost always off) becomes a visible step.
        atol = 2e-2 * steps if k in noise_only else 0.02 * 1e-2 * steps
        torch.testing.assert_close(sd[k], sd_ref[k], rtol=1e-5, atol=atol, msg=lambda m: f"{k}: {m}")
    return engine


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("window_size", [1, 2])
def test_training_parity(family, window_size):
    _train_pair(family, window_size=window_size)


@pytest.mark.parametrize("family", ["gpt2", "t5", "bart", "llama"])
@pytest.mark.parametrize("window_size", [1, 2])
def test_training_parity_with_delayed_copies(family, window_size):
    """Copies land late on background threads, as on a GPU: a missing wait gives wrong numbers."""
    with simulated_device(copy_delay_s=0.002):
        engine = _train_pair(family, window_size=window_size)
    assert engine.transfer.mode == "delayed"


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5", "bert"])
@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_gradient_checkpointing_parity(family, mode):
    _train_pair(family, window_size=1, grad_ckpt=mode)


@pytest.mark.parametrize("family", ["gpt2", "t5", "llama"])
def test_gradient_accumulation_parity(family):
    _train_pair(family, window_size=2, accum=2)


def _count_resident(engine):
    return sum(1 for b in engine.blocks if b.holds_device_storage)


@pytest.mark.parametrize("family", ["gpt2", "t5", "bart"])
@pytest.mark.parametrize("window_size", [1, 2])
@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_resident_bound(family, window_size, grad_ckpt):
    """Counts storage-holding blocks at every block hook and every autograd save/unpack."""
    model = tiny_model(family)
    if grad_ckpt:
        model.gradient_checkpointing_enable()
    engine = offload_model(model, StrongholdConfig(window_size=window_size), device="cpu")
    seen: list[int] = []

    def observe(*_args, **_kwargs):
        seen.append(_count_resident(engine))

    for b in engine.blocks:
        b.module.register_forward_pre_hook(lambda m, a: observe())
        b.module.register_forward_hook(lambda m, a, o: observe())
        b.module.register_full_backward_pre_hook(lambda m, g: observe())

    def pack(t):
        observe()
        return t

    def unpack(t):
        observe()
        return t

    for step in range(2):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = model(**batch(family, seed=step)).loss
            loss.backward()
        assert _count_resident(engine) == 0, "everything is evicted after backward"
    assert seen and max(seen) <= window_size + 1, f"resident blocks peaked at {max(seen)} > W+1"
    assert engine.pool.peak_in_use <= window_size + 1
    # The window really slides: at some point exactly W+1 (the prefetch) or W blocks live.
    assert max(seen) >= min(window_size, engine.num_blocks)


def test_evicted_blocks_hold_no_device_storage_and_parameters_point_at_host_memory():
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    for b in engine.units:  # the blocks, and the units outside them
        assert b.state is Residency.ON_HOST
        assert not b.holds_device_storage and b.slot is None  # a slot is allocated at its first fetch
        for p, view in zip(b.params, b.host.param_views):
            assert p.data_ptr() == view.data_ptr()  # readable and writable, never freed memory
    assert engine.memory_stats()["device_bytes"] == 0
    # The tied embedding and LM head stay one tensor, offloaded once, in one unit outside the blocks.
    assert model.lm_head.weight is model.transformer.wte.weight
    assert engine.is_offloaded(model.lm_head.weight) and engine.unit_of(model.lm_head.weight).kind != "block"
    assert sum(1 for u in engine.units for p in u.params if p is model.lm_head.weight) == 1
    assert engine.resident_parameters() == []


def test_parameters_keep_identity():
    model = tiny_model("llama")
    before = {name: id(p) for name, p in model.named_parameters()}
    offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    assert {name: id(p) for name, p in model.named_parameters()} == before


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5", "bart"])
def test_eval_and_generate_parity(family):
    ref = tiny_model(family).eval()
    model = copy.deepcopy(ref)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    b = batch(family, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(model(**b).logits, ref(**b).logits, rtol=1e-5, atol=1e-6)
    assert engine.resident_blocks() == []
    prompt = b["input_ids"][:, :5]
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True)
    if not is_seq2seq(family):
        kwargs["pad_token_id"] = 0
    out_ref = ref.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    assert torch.equal(out, out_ref)
    assert engine.resident_blocks() == []


def test_state_dict_roundtrip_while_evicted():
    model = tiny_model("gpt2")
    ref_sd = {k: v.clone() for k, v in model.state_dict().items()}
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    sd = model.state_dict()
    for k, v in ref_sd.items():
        assert torch.equal(sd[k], v), k
    # load_state_dict writes block weights into the masters, strict mode included.
    new = {k: v + 1.0 if v.is_floating_point() else v for k, v in ref_sd.items()}
    result = model.load_state_dict(new, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    sd2 = model.state_dict()
    for k, v in new.items():
        assert torch.equal(sd2[k], v), k
    b = batch("gpt2", seed=3)
    fresh = tiny_model("gpt2")
    fresh.load_state_dict(new)
    torch.testing.assert_close(model(**b).loss, fresh(**b).loss, rtol=1e-5, atol=0)
    assert engine.num_blocks == 3


def test_save_pretrained_loads_without_stronghold(tmp_path):
    import transformers

    model = tiny_model("llama")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_frozen_embeddings_still_train_blocks():
    """Block 0's inputs need no grad; the end-of-backward callback must still ship its grads."""
    ref = tiny_model("gpt2")
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.transformer.wte.weight.requires_grad_(False)
        m.transformer.wpe.weight.requires_grad_(False)
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    b = batch("gpt2", seed=1)
    ref(**b).loss.backward()
    model(**b).loss.backward()
    g_ref, g = _grads_by_name(ref), _grads_by_name(model, engine)
    for name, gr in g_ref.items():
        if gr is not None:
            torch.testing.assert_close(g[name], gr, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad, err", [(0, ValueError), (-1, ValueError), ("big", TypeError), (1.5, TypeError), (True, TypeError)])
def test_bad_window_size(bad, err):
    with pytest.raises(err, match="window_size"):
        StrongholdConfig(window_size=bad)


def test_unknown_config_key():
    with pytest.raises(ValueError, match="windw"):
        StrongholdConfig.from_dict({"windw": 2})


def test_every_field_refuses_a_value_it_does_not_take():
    """Each field, given a value outside what it takes (a word it does not know, an int where a
    bool is meant, a size that does not parse), fails at construction naming the field: a
    ValueError and a TypeError both, so a caller catching either sees it."""
    from stronghold_hf.config import ConfigError

    special = {"block_classes": [], "param_dtype": "int8", "gpu_memory": "lots", "cpu_reserve": "lots",
               "gpu_reserve": "lots", "max_pinned_bytes": "lots", "nvme_path": ""}
    for name in StrongholdConfig.field_names():
        for bad in ([special[name]] if name in special else ["no-such-value", 2.5, -1]):
            with pytest.raises(ConfigError, match=f"{name}=") as err:
                StrongholdConfig(**{name: bad})
            assert isinstance(err.value, ValueError) and isinstance(err.value, TypeError)
    for name in ("check_fit", "attention_tiling", "pin_memory", "nvme_masters"):  # 1 is not True
        with pytest.raises(ConfigError, match=f"{name}=1; use True or False"):
            StrongholdConfig(**{name: 1})
    for good in (dict(window_size=3, resident=0, device_checkpoints=0, cpu_threads=None, shard_cpu_state=None),
                 dict(host_worker="inline", speculative_step="off", log_metrics="all", host_grads="compute")):
        StrongholdConfig(**good)


def test_param_dtype_outside_autocast_names_the_setting_and_the_fix():
    """``param_dtype=bf16`` on an fp32 model computes the blocks in bf16, which needs autocast:
    without it the first matmul's dtype error gets a note naming the setting and the fix; with
    it the step matches the untouched model under the same autocast."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    engine = offload_model(model, StrongholdConfig(window_size=1, param_dtype="bf16"), device="cpu")
    b = batch("llama", seed=0)
    with pytest.raises(RuntimeError) as raised:
        model(**b)
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "param_dtype=bfloat16" in notes and "torch.autocast('cpu', dtype=torch.bfloat16)" in notes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(**b).loss, reference(**b).loss
    assert got.item() == want.item()
    engine.close()


def test_double_offload_refused():
    model = tiny_model("gpt2")
    offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    with pytest.raises(ValueError, match="already offloaded"):
        offload_model(model, StrongholdConfig(window_size=1), device="cpu")


def test_a_model_dispatched_by_accelerate_is_refused():
    """device_map=... / cpu_offload attach hooks that move weights themselves: two owners."""
    from accelerate import cpu_offload

    model = tiny_model("gpt2")
    cpu_offload(model, execution_device="cpu")
    with pytest.raises(ValueError, match="accelerate dispatch hooks .* Load it without device_map"):
        offload_model(model, StrongholdConfig(window_size=1), device="cpu")



def test_a_model_on_the_meta_device_and_a_missing_gpu_are_refused_by_name():
    """A model built under ``init_empty_weights`` has no values to stream; ``device="cuda"``
    without a GPU, or a device torch does not know, names the device and what to do. The model
    is left as it was (not offloaded)."""
    import transformers as T

    with torch.device("meta"):
        empty = T.GPT2LMHeadModel(tiny_model("gpt2").config)
    with pytest.raises(ValueError, match=r"meta device \(transformer\.wte\.weight.*from_pretrained"):
        offload_model(empty, device="cpu")
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="'tpu' is not a device"):
        offload_model(model, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device.*device='cpu'"):
            offload_model(model, device="cuda")
    assert get_engine(model) is None
    offload_model(model, device="cpu").close()  # nothing was half done

def test_model_without_blocks_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="no repeated blocks"):
        offload_model(model, device="cpu")


def test_block_classes_override():
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1, block_classes=["GPT2Block"]), device="cpu")
    assert [b.fqn for b in engine.blocks] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def test_block_classes_unknown_refused():
    with pytest.raises(ValueError, match="NoSuchBlock"):
        offload_model(tiny_model("gpt2"), StrongholdConfig(block_classes=["NoSuchBlock"]), device="cpu")


# ---------------------------------------------------------------------- auto window
def test_auto_window_on_cpu_chooses_and_says_why(caplog):
    with caplog.at_level("INFO", logger="stronghold_hf"):
        engine = offload_model(tiny_model("gpt2"), StrongholdConfig(window_size="auto"), device="cpu")
    assert 1 <= engine.window_size <= engine.num_blocks
    assert engine.pool.capacity == engine.window_size + 1
    assert "CPU-only" in engine.window_choice.reason
    assert any(engine.window_choice.reason in r.getMessage() for r in caplog.records)


def test_auto_window_probe_measures_a_real_step():
    """The first-step probe (the CUDA path of "auto") runs the same hooks on the CPU."""
    from stronghold_hf.auto_window import AutoWindowProbe

    model = tiny_model("t5")
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    engine._probe = AutoWindowProbe(engine.blocks, engine.device)
    model(**batch("t5", seed=0)).loss.backward()
    assert engine._probe is None, "the probe finished after the first backward"
    assert engine.window_choice is not None and engine.window_size == engine.window_choice.window_size
    assert engine.pool.capacity == engine.window_size + 1
    # Training goes on with the chosen window.
    model(**batch("t5", seed=1)).loss.backward()
    assert engine.resident_blocks() == []
