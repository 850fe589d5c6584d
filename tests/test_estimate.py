"""The fits/does-not-fit estimator: exact byte counts by hand, the STRONGHOLD calibration
point (5.1 B GPT on a 32 GB V100 with 90 GB RAM), and the CLI."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from stronghold_hf.estimate import (
    check_fits,
    estimate,
    estimate_for_model,
    layer_activation_bytes,
    load_config,
    main,
    parse_memory,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
GiB = 2**30
H, L, A, V, P = 64, 2, 2, 100, 32
S, B = 32, 2


def tiny_gpt2(**overrides):
    kwargs = dict(n_embd=H, n_layer=L, n_head=A, vocab_size=V, n_positions=P) | overrides
    return AutoConfig.for_model("gpt2", **kwargs)


def per_block_params(h=H):
    # ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj
    return 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * 4 * h + 4 * h) + (4 * h * h + h)


def resident_params(h=H):
    return V * h + P * h + 2 * h  # wte (tied with lm_head: once), wpe, ln_f


def workspace(other):
    return math.ceil(other * 5 / 100)


def test_parse_memory():
    assert parse_memory("32GB") == parse_memory("32GiB") == parse_memory("32g") == parse_memory("32 GB") == 32 * GiB
    assert parse_memory("900MB") == 900 * 2**20
    assert parse_memory("1.5T") == int(1.5 * 2**40)
    assert parse_memory("123") == parse_memory(123) == 123
    for bad in ("32XB", "abc", "-5GB", "", "32iB", "GB"):
        with pytest.raises(ValueError, match="cannot parse memory size"):
            parse_memory(bad)


def test_korthikanti_formula_exact_for_gpt_layers():
    s, b, h, a = 1024, 4, 2048, 16
    assert layer_activation_bytes(s, b, h, a, nbytes=2) == s * b * h * (34 + 5 * a * s // h)
    # fp32: the 16 stored s*b*h tensors and 2 a*s*s*b tensors double; the 3 masks stay 1 B.
    assert layer_activation_bytes(s, b, h, a, nbytes=4) == s * b * h * (66 + 9 * a * s // h)
    ffn = 3 * h
    gated = layer_activation_bytes(s, b, h, a, nbytes=2, ffn=ffn, gated_mlp=True)
    assert gated - layer_activation_bytes(s, b, h, a, nbytes=2, ffn=ffn) == 2 * s * b * ffn * 2


def _buffers(dtype=torch.float32):
    model = AutoModelForCausalLM.from_config(tiny_gpt2()).to(dtype)
    return sum(b.numel() * b.element_size() for b in model.buffers())


def test_tiny_gpt2_bytes_by_hand():
    """Every parameter is offloaded; the embeddings here are smaller than half a block, so they
    and the final norm are the resident unit, on the device with their gradient buffer."""
    blk, res = per_block_params(), resident_params()
    e = estimate(tiny_gpt2(), seq_len=S, batch_size=B, dtype="fp32", gpu_memory_bytes=GiB * 8, cpu_memory_bytes=GiB * 8)
    assert (e.num_blocks, e.block_params, e.resident_params, e.largest_block_params) == (L, L * blk, res, blk)
    real = AutoModelForCausalLM.from_config(tiny_gpt2())
    assert e.total_params == sum(p.numel() for p in real.parameters())
    assert e.window_size == 2 and e.window_size_requested == "auto"
    assert e.offload_non_block and not e.chunked_loss and not e.offload_activations  # one chunk: plain

    # CPU: 4 + 8 + 4 B per parameter, blocks and the rest; fp32 has no extra pinned copy.
    n = L * blk + res
    assert e.cpu_master_bytes == 4 * n and e.cpu_adam_bytes == 8 * n and e.cpu_grad_bytes == 4 * n
    assert e.cpu_pinned_copy_bytes == 0
    staging = 2 * blk * 4 + res * 4  # K = 2 staging buffers of the largest streamed unit, one of the resident unit
    assert e.cpu_grad_staging_bytes == staging
    assert e.cpu_bytes_needed == 16 * n + staging + 2 * GiB

    # GPU: the window (both blocks), 2 gradient buffers, the resident unit and its gradient,
    # activations, and the loss: one chunk would hold all 64 tokens, so the engine runs the
    # plain loss (whole logits at 12 B in fp32), with the final norm's input and output and the
    # gradient w.r.t. the head's input. GPT-2 runs SDPA here (no s x s scores saved) with
    # dropout and gelu_new: per token a layer saves its two norm inputs (2h), the attention
    # input and Q, K, V (4h), SDPA's output (h; the output projection's input is a view of it)
    # and its fp32 log-sum-exp per head, the MLP input (h), its two 4h-wide tensors and the
    # three 4h-wide ones gelu_new's ops save (20h), all fp32, and two 1-byte dropout masks; its
    # backward adds the layer's output and input gradients (2h) and the larger of the MLP's one
    # 4h-wide gradient and the attention core's dO, dQ, dK, dV (4h).
    assert e.attn_implementation == "sdpa"
    saved = S * B * ((2 + 4 + 1 + 21) * H * 4 + 4 * A + 2 * H)
    transient = S * B * (2 + 4) * H * 4
    head = 3 * S * B * H * 4 + S * B * V * 12
    assert e.block_activation_bytes_full == L * saved + transient
    assert e.block_activation_bytes_checkpointed == L * S * B * H * 4 + saved + transient
    assert e.gpu_layer_peak_bytes == saved + transient
    assert e.gpu_block_activation_bytes == L * saved + transient  # checkpointing off
    # The loss and the last layer's backward do not overlap: what the layers keep, plus the larger.
    assert e.gpu_activation_peak_bytes == L * saved + max(head, transient)
    assert e.gpu_head_activation_bytes == head
    assert e.gpu_resident_bytes == 2 * res * 4 + _buffers()
    assert e.gpu_slot_bytes == blk * 4 and e.gpu_window_bytes == 2 * blk * 4
    assert e.gpu_grad_buffer_bytes == 2 * blk * 4
    assert e.gpu_engine_bytes == 2 * blk * 4 + 2 * blk * 4 + 2 * res * 4
    other = e.gpu_engine_bytes + _buffers() + L * saved + max(head, transient)
    assert e.gpu_bytes_needed == other + workspace(other)
    plain_head = 3 * S * B * H * 4 + S * B * V * 12
    plain_other = 16 * n + _buffers() + L * saved + max(plain_head, transient)
    assert e.plain_gpu_bytes_needed == plain_other + workspace(plain_other)
    assert e.fits and e.plain_fits and e.max_window_size == L


def test_tiny_gpt2_with_the_first_versions_choices():
    """``offload_non_block=False, chunked_loss=False``: the parameters outside the blocks stay on
    the device at 16 B/param with a device AdamW, and the logits are whole (12 B each)."""
    blk, res = per_block_params(), resident_params()
    e = estimate(tiny_gpt2(), seq_len=S, batch_size=B, dtype="fp32", gpu_memory_bytes=GiB * 8,
                 cpu_memory_bytes=GiB * 8, offload_non_block=False, chunked_loss=False)
    assert e.cpu_bytes_needed == 16 * L * blk + 2 * blk * 4 + 2 * GiB
    assert e.gpu_resident_bytes == 16 * res + _buffers() and e.gpu_window_bytes == 2 * blk * 4
    assert e.gpu_head_activation_bytes == 3 * S * B * H * 4 + S * B * V * 12 and not e.chunked_loss


def test_tiny_gpt2_bf16_and_checkpointing():
    blk, res = per_block_params(), resident_params()
    e = estimate(tiny_gpt2(), seq_len=S, batch_size=B, dtype="bf16", gpu_memory_bytes=8 * GiB,
                 cpu_memory_bytes=8 * GiB, gradient_checkpointing=True, window_size=1)
    n = L * blk + res  # a bf16 checkpoint: everything is bf16 on the device, fp32 masters on the host
    assert e.cpu_pinned_copy_bytes == 2 * n
    assert e.cpu_grad_staging_bytes == 2 * blk * 2 + res * 2
    # bf16 host gradients (one backward per step): 2 B each; fp32 with accumulation.
    assert e.cpu_grad_bytes == 2 * n and e.host_grads == "compute"
    assert e.cpu_bytes_needed == 16 * n + 2 * blk * 2 + res * 2 + 2 * GiB
    for kw in (dict(host_grads="fp32"), dict(gradient_accumulation_steps=4)):
        wide = estimate(tiny_gpt2(), seq_len=S, batch_size=B, dtype="bf16", gpu_memory_bytes=8 * GiB,
                        cpu_memory_bytes=8 * GiB, gradient_checkpointing=True, window_size=1, **kw)
        assert wide.cpu_bytes_needed == e.cpu_bytes_needed + 2 * n and wide.host_grads == "fp32"
    assert e.gpu_resident_bytes == 2 * res * 2 + _buffers(torch.bfloat16)  # the resident unit and its gradient
    assert e.gpu_window_bytes == 2 * blk * 2 and e.gpu_grad_buffer_bytes == 2 * blk * 2
    # Checkpointed: each layer's bf16 input, and one layer's recompute (saved, as in the fp32
    # test at 2 B) and its backward's transient.
    saved16 = S * B * ((2 + 4 + 1 + 21) * H * 2 + 4 * A + 2 * H)
    transient16 = S * B * (2 + 4) * H * 2
    assert e.gpu_block_activation_bytes == L * S * B * H * 2 + saved16 + transient16
    assert e.plain_state_bytes == 18 * n + _buffers(torch.bfloat16)


def test_gpu_limit_sets_max_window():
    e = estimate(tiny_gpt2(n_layer=8), seq_len=S, batch_size=B, gpu_memory_bytes=8 * GiB, cpu_memory_bytes=8 * GiB)
    assert e.max_window_size == 8
    other_w1 = e.gpu_bytes_needed - e.gpu_workspace_bytes - e.gpu_window_bytes + 2 * e.gpu_slot_bytes
    tight = other_w1 + workspace(other_w1) + 2 * GiB  # exactly W=1, and the reserve (its 2 GiB floor) left free
    e1 = estimate(tiny_gpt2(n_layer=8), seq_len=S, batch_size=B, gpu_memory_bytes=tight, cpu_memory_bytes=8 * GiB,
                  window_size=1)
    assert e1.max_window_size == 1 and e1.fits
    e0 = estimate(tiny_gpt2(n_layer=8), seq_len=S, batch_size=B, gpu_memory_bytes=tight - 1, cpu_memory_bytes=8 * GiB)
    assert e0.max_window_size == 0 and not e0.fits and e0.cpu_fits


LLAMA3_8B = ("llama", "hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,"
             "num_key_value_heads=8,vocab_size=128256,tie_word_embeddings=False")
QWEN25_14B = ("qwen2", "hidden_size=5120,intermediate_size=13824,num_hidden_layers=48,num_attention_heads=40,"
              "num_key_value_heads=8,vocab_size=152064,tie_word_embeddings=False")
LLAMA3_70B = ("llama", "hidden_size=8192,intermediate_size=28672,num_hidden_layers=80,num_attention_heads=64,"
              "num_key_value_heads=8,vocab_size=128256,tie_word_embeddings=False")


@pytest.mark.parametrize("shape, gpu", [(LLAMA3_8B, "24GB"), (QWEN25_14B, "24GB"), (LLAMA3_70B, "48GB")])
def test_modern_full_fine_tunes_fit_their_gpu(shape, gpu):
    """bf16, 4096 tokens, batch 1, gradient checkpointing: only the window and the activations
    are on the GPU (the host side is another question, with its own RAM)."""
    e = estimate(load_config(shape[0], config_overrides=shape[1]), seq_len=4096, batch_size=1, dtype="bf16",
                 gpu_memory_bytes=gpu, cpu_memory_bytes="4TB", gradient_checkpointing=True)
    assert e.gpu_fits and e.fits and not e.plain_fits, e.table()
    assert e.chunked_loss and e.offload_non_block


def test_the_first_versions_choices_do_not_fit_llama3_8b_on_24gb():
    """What the issue measured (32.7 GiB then, with eager attention's s x s scores counted;
    28.0 GiB with the SDPA Llama runs, rotary embeddings and the backward's transient, the loss
    and a layer's backward not overlapping, the RMS norms' fp32 copies, and the CUDA context in
    the 2 GiB reserve left free beside it): the embeddings and head resident (device AdamW), whole logits and checkpointed
    inputs on the device."""
    e = estimate(load_config(LLAMA3_8B[0], config_overrides=LLAMA3_8B[1]), seq_len=4096, batch_size=1, dtype="bf16",
                 gpu_memory_bytes="24GB", cpu_memory_bytes="4TB", gradient_checkpointing=True, offload_non_block=False,
                 chunked_loss=False, offload_activations=False)
    assert not e.gpu_fits and round(e.gpu_bytes_needed / GiB, 1) == 28.0 and e.attn_implementation == "sdpa"
    assert round(e.gpu_resident_bytes / GiB, 1) == 17.6


def test_lean_host_memory_costs_two_bytes_per_parameter_of_adam_state():
    """Llama-3-8B, bf16: lean keeps 8-bit moments (2 B/param and an fp32 absmax per 256) for every
    large tensor, 8 B/param for the norms; every other host byte stays."""
    cfg = load_config(LLAMA3_8B[0], config_overrides=LLAMA3_8B[1])
    kw = dict(seq_len=4096, batch_size=1, dtype="bf16", gpu_memory_bytes="24GB", cpu_memory_bytes="4TB",
              gradient_checkpointing=True)
    exact, lean = estimate(cfg, **kw), estimate(cfg, host_memory="lean", **kw)
    assert exact.cpu_adam_bytes == 8 * exact.total_params
    assert 2.03 <= lean.cpu_adam_bytes / lean.total_params <= 2.04
    assert exact.cpu_bytes_needed - lean.cpu_bytes_needed == exact.cpu_adam_bytes - lean.cpu_adam_bytes
    # The bf16 image kept (plenty of RAM) and bf16 gradients: 4 + 2.03 + 2 + 2 and 4 + 8 + 2 + 2.
    assert lean.cpu_bytes_per_param == pytest.approx(10.03, abs=0.01) and exact.cpu_bytes_per_param == 16
    assert "Adam state, lean" in lean.table() and lean.gpu_bytes_needed == exact.gpu_bytes_needed
    with pytest.raises(ValueError, match="host_memory"):
        estimate(cfg, host_memory="tiny", **kw)


def test_host_image_false_trades_the_image_for_two_staging_buffers():
    """Llama-3-8B, bf16: the 2 B/param image goes, two buffers of the largest block's bf16 copy
    come (the 1 GiB head crosses in pieces); "auto" drops it only when the RAM would not hold the
    state with it. (No reserve here: the image's mechanics; test_headroom_* has the reserve.)"""
    cfg = load_config(LLAMA3_8B[0], config_overrides=LLAMA3_8B[1])
    kw = dict(seq_len=4096, batch_size=1, dtype="bf16", gpu_memory_bytes="24GB", gradient_checkpointing=True,
              cpu_reserve=0)
    kept = estimate(cfg, cpu_memory_bytes="4TB", host_image=True, **kw)
    dropped = estimate(cfg, cpu_memory_bytes="4TB", host_image=False, **kw)
    block = 2 * kept.largest_block_params
    assert kept.cpu_bytes_needed - dropped.cpu_bytes_needed == 2 * kept.total_params - 2 * block
    assert dropped.cpu_bytes_per_param == 14 and kept.cpu_bytes_per_param == 16 and not dropped.host_image
    assert "staging, no image" in dropped.table()
    assert estimate(cfg, cpu_memory_bytes="4TB", **kw).host_image  # auto, plenty of RAM: kept
    tight = estimate(cfg, cpu_memory_bytes=f"{(dropped.cpu_bytes_needed + kept.cpu_bytes_needed) // 2}B", **kw)
    assert not tight.host_image and tight.cpu_fits and any("drops the pinned" in n for n in tight.notes)
    # Lean, no image ("auto" drops it), bf16 gradients: 8.03 B/param of state, two fetch and two
    # gradient staging buffers of a block (the 1 GiB untied head crosses in pieces, its gradient
    # through the lanes' staging) and the process: 63.7 GiB: on a desktop's 64 GB it would leave
    # the machine 0.3 GiB (the reserve refuses it: test_headroom_keeps_a_desktop_its_share).
    short = estimate(cfg, cpu_memory_bytes="64GB", host_memory="lean", **kw)
    assert not short.host_image and short.cpu_bytes_per_param == pytest.approx(8.03, abs=0.01)
    block = 2 * 2 * short.largest_block_params  # two bf16 buffers of a block
    assert short.cpu_pinned_copy_bytes == block and short.cpu_grad_staging_bytes == pytest.approx(block, rel=1e-4)
    assert short.cpu_bytes_needed / GiB == pytest.approx(63.69, abs=0.01) and short.cpu_fits and short.fits
    with pytest.raises(ValueError, match="does not fit"):
        estimate(cfg, cpu_memory_bytes="64GB", host_image=True, **kw).raise_if_not_fits()
    with pytest.raises(ValueError, match="host_image"):
        estimate(cfg, cpu_memory_bytes="4TB", host_image="yes", **kw)
    fp32 = estimate(cfg, **{**kw, "dtype": "fp32"}, cpu_memory_bytes="4TB", host_image=False)
    assert fp32.cpu_bytes_needed == estimate(cfg, **{**kw, "dtype": "fp32"}, cpu_memory_bytes="4TB").cpu_bytes_needed


def test_nvme_tier_moves_the_moments_to_disk_when_the_ram_needs_it():
    """Llama-3-8B, bf16, 64 GB of RAM: exact state does not fit; with an NVMe disk the moments
    (8 B/param) go there and the host keeps a ring of three buffers of the largest block's (the
    vocabulary-sized head, the largest unit, streams in block-sized segments). (The machine's
    reserve is 0 here: the tiers' mechanics; test_headroom_* has the reserve.)"""
    cfg = load_config(LLAMA3_8B[0], config_overrides=LLAMA3_8B[1])
    kw = dict(seq_len=4096, batch_size=1, dtype="bf16", gpu_memory_bytes="24GB", gradient_checkpointing=True,
              cpu_memory_bytes="64GB", cpu_reserve=0)
    ram = estimate(cfg, **kw)
    assert not ram.cpu_fits and not ram.nvme_adam and ram.nvme_fits is None
    with pytest.raises(ValueError, match=r"nvme_path=DIR\) on a fast local disk moves the Adam moments \(59.8"):
        ram.raise_if_not_fits()
    disk = estimate(cfg, nvme_memory_bytes="1TB", **kw)
    head = 128256 * 4096  # the untied head: the largest unit, 525 M parameters
    block = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # the largest block: 218 M
    assert disk.nvme_adam and disk.nvme_bytes_needed == 8 * disk.total_params and disk.cpu_adam_bytes == 0
    assert disk.cpu_nvme_ring_bytes == 3 * 8 * block < 3 * 8 * head
    assert not disk.host_image  # 64 GB hold masters, bf16 gradients and the ring, not the image too
    assert disk.cpu_fits and disk.nvme_fits and disk.fits  # 62.5 GiB: a desktop fine-tunes 8B in full
    assert disk.cpu_bytes_per_param == 4 + 2  # master, bf16 gradient
    roomy = estimate(cfg, nvme_memory_bytes="1TB", **{**kw, "cpu_memory_bytes": "80GB"})
    assert roomy.nvme_adam and roomy.host_image  # with the moments on disk the image fits again: kept
    assert "Adam state: on NVMe" in disk.table() and "NVMe (STRONGHOLD, nvme_path)" in disk.table()
    assert any("go to the NVMe tier" in n for n in disk.notes)
    plenty = estimate(cfg, nvme_memory_bytes="1TB", **{**kw, "cpu_memory_bytes": "4TB"})
    assert not plenty.nvme_adam  # "auto": RAM holds it, nothing goes to disk
    small = estimate(cfg, nvme_memory_bytes="32GB", **kw)
    assert small.nvme_fits is False and not small.fits
    with pytest.raises(ValueError, match="the Adam moments need 59.8. GiB on disk, which has 32.00 GiB"):
        small.raise_if_not_fits()
    forced = estimate(cfg, nvme=True, **{**kw, "cpu_memory_bytes": "4TB"})  # an engine with nvme_path
    assert forced.nvme_adam and forced.nvme_fits is None


def test_llama3_70b_fits_80gb_256gb_and_2tb_with_the_masters_on_disk():
    """Llama-3-70B, bf16, seq 4096, batch 1, checkpointing, 80 GB GPU, 256 GB RAM, 2 TB NVMe:
    the moments alone on disk leave the fp32 masters (263 GiB) in RAM, which does not fit, and
    the estimator names nvme_masters; "auto" then moves the masters too: the host keeps the bf16
    gradients and the rings, the disk 12 B/param, and it fits."""
    cfg = load_config(LLAMA3_70B[0], config_overrides=LLAMA3_70B[1])
    kw = dict(seq_len=4096, batch_size=1, dtype="bf16", gpu_memory_bytes="80GB", cpu_memory_bytes="256GB",
              gradient_checkpointing=True, nvme_memory_bytes="2TB")
    moments = estimate(cfg, nvme_masters=False, **kw)
    assert moments.gpu_fits and moments.nvme_adam and moments.nvme_fits and not moments.cpu_fits
    assert any("StrongholdConfig(nvme_masters=True) moves the masters too" in n for n in moments.notes)
    with pytest.raises(ValueError, match=r"nvme_masters=True\) moves the fp32 masters \(262.83 GiB\)"):
        moments.raise_if_not_fits()
    e = estimate(cfg, **kw)  # nvme_masters="auto"
    assert e.fits and e.nvme_masters and e.nvme_adam and e.cpu_master_bytes == 0 and not e.host_image
    assert e.nvme_bytes_needed == 12 * e.total_params  # fp32 masters and both moments
    assert e.cpu_grad_bytes == 2 * e.total_params  # bf16 gradients (141 GB) stay on the host
    rings = e.cpu_nvme_ring_bytes + e.cpu_pinned_copy_bytes + e.cpu_grad_staging_bytes
    assert e.cpu_bytes_needed == e.cpu_grad_bytes + rings + e.cpu_process_bytes
    assert e.cpu_bytes_needed < 256 * 10**9 * 0.75
    assert any("fp32 masters (262.83 GiB) go to disk too" in n for n in e.notes)
    forced = estimate(cfg, nvme_masters=True, **{**kw, "cpu_memory_bytes": "1TB"})
    assert forced.nvme_masters  # True: always, as an engine with nvme_masters does
    assert not estimate(cfg, **{**kw, "cpu_memory_bytes": "1TB"}).nvme_masters  # auto: only when needed


def test_activation_offload_auto_turns_on_when_the_inputs_do_not_fit():
    cfg = load_config(LLAMA3_8B[0], config_overrides=LLAMA3_8B[1].replace("num_hidden_layers=32", "num_hidden_layers=32"))
    kw = dict(seq_len=32768, batch_size=1, dtype="bf16", cpu_memory_bytes="4TB", gradient_checkpointing=True)
    big = estimate(cfg, gpu_memory_bytes="1TB", offload_activations=False, **kw)
    small = estimate(cfg, gpu_memory_bytes="1TB", offload_activations=True, **kw)
    assert small.gpu_block_activation_bytes < big.gpu_block_activation_bytes
    between = (small.gpu_bytes_needed + big.gpu_bytes_needed) // 2
    auto = estimate(cfg, gpu_memory_bytes=between, **kw)
    assert auto.offload_activations and auto.gpu_fits and auto.cpu_activation_bytes > 0
    assert not estimate(cfg, gpu_memory_bytes="1TB", **kw).offload_activations  # it fits without


def test_encoder_decoder_counts_both_stacks():
    cfg = AutoConfig.for_model("t5", d_model=64, d_ff=128, d_kv=32, num_heads=2, num_layers=2,
                               num_decoder_layers=3, vocab_size=100)
    e = estimate(cfg, seq_len=16, batch_size=2, gpu_memory_bytes=8 * GiB, cpu_memory_bytes=8 * GiB, decoder_seq_len=16)
    assert e.model_name == "T5ForConditionalGeneration" and e.num_blocks == 5
    real = AutoModelForSeq2SeqLM.from_config(cfg)
    assert e.total_params == sum(p.numel() for p in real.parameters())
    # Decoder layers carry cross-attention: more than 5 encoder-sized layers.
    enc_layer = layer_activation_bytes(16, 2, 64, 2, nbytes=4, ffn=128, head_dim=32)
    assert e.block_activation_bytes_full > 5 * enc_layer
    bart = AutoConfig.for_model("bart", d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100)
    eb = estimate(bart, seq_len=16, batch_size=1, gpu_memory_bytes=GiB, cpu_memory_bytes=8 * GiB)
    assert eb.model_name == "BartForConditionalGeneration" and eb.num_blocks == 4


def test_estimate_for_live_model_matches_config():
    model = AutoModelForCausalLM.from_config(tiny_gpt2())
    from_cfg = estimate(tiny_gpt2(), seq_len=S, batch_size=B, gpu_memory_bytes=8 * GiB, cpu_memory_bytes=8 * GiB)
    live = estimate_for_model(model, seq_len=S, batch_size=B, gpu_memory_bytes=8 * GiB, cpu_memory_bytes=8 * GiB)
    assert live.to_dict() == from_cfg.to_dict() | {"model_name": live.model_name}
    auto = estimate_for_model(model, seq_len=S, batch_size=B)
    assert auto.dtype == "fp32" and auto.gradient_checkpointing is False
    if not torch.cuda.is_available():
        assert auto.gpu_memory_bytes is None and auto.gpu_fits is None and auto.max_window_size is None
    if os.path.exists("/proc/meminfo"):
        assert auto.cpu_memory_bytes is not None and auto.cpu_fits is True and auto.fits


def test_calibration_stronghold_5b_on_v100():
    """STRONGHOLD's artifact trained the 5.1 B GPT (100 layers, hidden 2048) on a 32 GB V100 with
    90 GB RAM, with activation checkpointing; 400 layers is out of CPU RAM; plain training of
    5.1 B does not fit the GPU."""
    common = dict(seq_len=1024, batch_size=4, dtype="fp32", gpu_memory_bytes="32GB", cpu_memory_bytes="90GB",
                  gradient_checkpointing=True)
    start = time.perf_counter()
    e100 = estimate(load_config("gpt2", config_overrides="n_embd=2048,n_layer=100,n_head=16,n_positions=1024"), **common)
    e400 = estimate(load_config("gpt2", config_overrides="n_embd=2048,n_layer=400,n_head=16,n_positions=1024"), **common)
    assert time.perf_counter() - start < 10  # meta device: nothing is allocated

    assert 5.0e9 < e100.total_params < 5.2e9
    assert e100.fits and e100.cpu_fits and e100.gpu_fits
    assert e100.max_window_size >= 2
    assert e100.plain_fits is False
    check_fits(e100)

    assert not e400.fits and e400.cpu_fits is False
    with pytest.raises(ValueError, match="CPU RAM: needs .* Add CPU RAM"):
        e400.raise_if_not_fits()

    # Without checkpointing the 100 fp32 layers' activations (~108 GiB) do not fit the GPU.
    e_nock = estimate(load_config("gpt2", config_overrides="n_embd=2048,n_layer=100,n_head=16,n_positions=1024"),
                      **(common | {"gradient_checkpointing": False}))
    assert e_nock.cpu_fits and e_nock.gpu_fits is False
    with pytest.raises(ValueError, match="enable gradient checkpointing"):
        e_nock.raise_if_not_fits()


def _tiny_cli_args():
    return ["--model_type", "gpt2", "--config_overrides", f"n_embd={H},n_layer={L},n_head={A},vocab_size={V},n_positions={P}",
            "--seq_len", str(S), "--batch_size", str(B), "--gpu_memory", "8GB", "--cpu_memory", "16GiB"]


def test_cli_subprocess_last_line_is_json():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "stronghold_hf.estimate", *_tiny_cli_args(), "--gradient_checkpointing"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for key in ("cpu_bytes_needed", "gpu_bytes_needed", "fits", "max_window_size", "plain_gpu_bytes_needed", "plain_fits"):
        assert key in result
    assert result["fits"] is True and result["block_params"] == L * per_block_params()
    assert "CPU RAM (STRONGHOLD)" in out.stdout and "largest window_size that fits" in out.stdout


def test_cli_bad_memory_string(capsys):
    args = _tiny_cli_args()
    args[args.index("8GB")] = "8XB"
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code != 0
    assert "cannot parse memory size '8XB'" in capsys.readouterr().err


def test_cli_config_file_and_check(tmp_path, capsys):
    tiny_gpt2(n_layer=4).save_pretrained(tmp_path)
    args = ["--config_name", str(tmp_path / "config.json"), "--seq_len", "16", "--batch_size", "1",
            "--gpu_memory", "8GB", "--cpu_memory", "1GB", "--window_size", "3", "--check", "--resident", "false"]
    assert main(args) == 3  # 1 GiB RAM < the 2 GiB process allowance
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_blocks"] == 4 and result["window_size"] == 3 and result["fits"] is False
    with pytest.raises(SystemExit):
        main(["--model_type", "no_such_model", "--seq_len", "1", "--batch_size", "1", "--gpu_memory", "1GB",
              "--cpu_memory", "1GB"])


def test_config_overrides_reach_what_the_constructor_derives():
    from stronghold_hf.estimate import load_config

    cfg = load_config("t5", config_overrides="num_layers=2,d_model=64")
    assert (cfg.num_layers, cfg.num_decoder_layers, cfg.d_model) == (2, 2, 64)
    assert load_config("t5", config_overrides="num_layers=2,num_decoder_layers=3").num_decoder_layers == 3


def test_headroom_keeps_a_desktop_its_share():
    """#43: a verdict of "fits" leaves the machine its reserve. Llama-3-8B, bf16, 4096 tokens, a
    24 GB GPU and 64 GB of RAM: lean state alone (63.7 GiB) would leave 0.3 GiB and is refused
    with the reserve named and the NVMe tier's bytes offered; with a disk, "auto" moves the
    8-bit moments there rather than cut into the reserve, and the reserve stays free."""
    cfg = load_config(LLAMA3_8B[0], config_overrides=LLAMA3_8B[1])
    kw = dict(seq_len=4096, batch_size=1, dtype="bf16", gpu_memory_bytes="24GB", gradient_checkpointing=True,
              cpu_memory_bytes="64GB", host_memory="lean")
    no_disk = estimate(cfg, **kw)
    assert no_disk.cpu_reserve_bytes == int(64 * GiB * 0.10)  # the larger of 4 GiB and a tenth: 6.4 GiB
    assert not no_disk.cpu_fits and no_disk.cpu_bytes_needed <= 64 * GiB  # it fits the RAM, not with the reserve
    with pytest.raises(ValueError, match=r"keeps 6.40 GiB free \(cpu_reserve\).*nvme_path=DIR"):
        no_disk.raise_if_not_fits()
    disk = estimate(cfg, nvme_memory_bytes="1TB", **kw)
    assert disk.fits and disk.nvme_adam and not disk.nvme_masters
    assert disk.cpu_bytes_needed + disk.cpu_reserve_bytes <= 64 * GiB
    assert "reserve left free (OS, page cache, data loader)" in disk.table()
    # The GPU side: 2 GiB (its floor) left free for the context, workspaces and fragmentation.
    assert disk.gpu_reserve_bytes == 2 * GiB and disk.gpu_bytes_needed + 2 * GiB <= 24 * GiB
    # A reserve of the user's: a server that wants 32 GiB for its data loaders.
    big = estimate(cfg, nvme_memory_bytes="1TB", **{**kw, "cpu_memory_bytes": "256GB"}, cpu_reserve="32GB")
    assert big.cpu_reserve_bytes == 32 * GiB and big.fits


def test_headroom_defaults_scale_with_the_machine():
    from stronghold_hf.config import StrongholdConfig, device_reserve_bytes, host_reserve_bytes

    assert host_reserve_bytes("auto", 16 * GiB) == 4 * GiB  # the floor
    assert host_reserve_bytes("auto", 192 * GiB) == int(19.2 * GiB)  # a tenth
    assert host_reserve_bytes("auto", 1536 * GiB) == 32 * GiB  # the cap
    assert device_reserve_bytes("auto", 24 * GiB) == 2 * GiB and device_reserve_bytes("auto", 80 * GiB) == 4 * GiB
    assert host_reserve_bytes("8GB", 64 * GiB) == 8 * GiB
    with pytest.raises(ValueError, match="cpu_reserve"):
        StrongholdConfig(cpu_reserve="lots")


def test_long_context_checkpoints_go_to_disk_when_the_ram_would_not_hold_them():
    """Llama-3-8B, bf16, 512k tokens, 141 GB GPU, 128 GB RAM, 4 TB disk: the offloaded
    checkpointed inputs (31 x 4 GiB) do not fit next to the masters; "auto" moves them to the
    NVMe tier after the moments, the host keeps DISK_RING + 2 of them, and the disk counts them."""
    from stronghold_hf.activations import DISK_RING

    cfg = load_config(LLAMA3_8B[0], config_overrides=LLAMA3_8B[1])
    seq = 512 * 1024
    kw = dict(seq_len=seq, batch_size=1, dtype="bf16", gpu_memory_bytes="141GB", gradient_checkpointing=True,
              cpu_memory_bytes="128GB", host_memory="lean", offload_activations=True, nvme_memory_bytes="4TB")
    one = seq * 4096 * 2  # one layer's input in bf16: 4 GiB
    in_ram = estimate(cfg, nvme_activations=False, **kw)
    assert in_ram.cpu_activation_bytes >= 30 * one and not in_ram.cpu_fits
    e = estimate(cfg, **kw)  # nvme_activations="auto"
    assert e.nvme_activations and e.cpu_fits and e.nvme_fits
    assert e.cpu_activation_bytes == (DISK_RING + 2) * one
    assert e.nvme_bytes_needed == in_ram.cpu_activation_bytes + (e.cpu_adam_bytes == 0) * (
        estimate(cfg, nvme_activations=False, **{**kw, "cpu_memory_bytes": "4TB"}, nvme=True).nvme_bytes_needed)
    assert "checkpointed activations: on NVMe" in e.table() and "+ checkpointed activations" in e.table()
    assert any("checkpointed activations" in n and "go to the NVMe tier" in n for n in e.notes)
    roomy = estimate(cfg, **{**kw, "cpu_memory_bytes": "2TB"})
    assert not roomy.nvme_activations  # auto: RAM holds them, they stay
    assert estimate(cfg, nvme_activations=True, **{**kw, "cpu_memory_bytes": "2TB"}).nvme_activations
