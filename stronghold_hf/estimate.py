"""Will it fit? Host and device bytes for STRONGHOLD training, next to plain training.

Before a run that takes hours to set up, a user wants to know whether a model trains on a
given GPU and host: STRONGHOLD moves every parameter's master, gradient and Adam state to CPU
RAM and keeps only a window of units on the device, so the question has two halves (CPU RAM
for the offloaded state, GPU memory for the window, the activations and the loss). This module
answers both from a config, by building the model on the meta device (exact parameter counts,
nothing allocated), or from a live model at start-up (`estimate_for_model`, what the Trainer
integration calls). It models what the engine does, unit by unit (``discovery.plan_units``):
the blocks, the large groups outside them that stream (embeddings, LM heads), and the
resident rest.

What is counted (per parameter ``p``; ``c`` = compute-dtype bytes, 4 for fp32, 2 for
bf16/fp16; a unit's device copy is in ``c`` for blocks and linear-only units such as an
untied head, in the stored dtype for embeddings and norms):

* CPU, trainable parameters (every unit): fp32 masters 4 B, Adam ``exp_avg`` + ``exp_avg_sq``
  8 B, fp32 gradients 4 B, and the pinned image sent to the device when the device copy is
  not fp32 (``c`` B; with fp32 the image *is* the master). With ``host_image=False`` (or
  ``"auto"`` when the RAM would not hold it) two staging buffers of the largest unit's
  compute-dtype copy replace the image. With bf16 compute and ``host_grads`` ``"compute"``
  (``"auto"`` without gradient accumulation) the gradients of bf16 units cost 2 B, not 4.
  Frozen parameters: their stored bytes only. ``K`` (``grad_buffers``) pinned gradient staging buffers of the largest streamed
  unit, one of each resident unit. With activation offload, host buffers for the checkpointed
  inputs. Plus a fixed process allowance (`CPU_PROCESS_BYTES`). This is what the engine's
  memory ledger books (a test holds the two within 5%).
* GPU, what the engine owns (the ledger's ``device_peak_bytes``, within 5%): the window, the
  most any ``W + 1`` consecutive positions of the sequence hold (a tied embedding counts at
  both ends); ``K`` gradient lanes of the largest trainable streamed unit; the resident units
  and their gradient buffers. With ``offload_non_block=False`` the parameters outside the
  blocks stay on the GPU instead, with a device AdamW at 16 B/param (18 under mixed precision:
  HF keeps them fp32 and autocast adds a compute copy).
* GPU, what autograd holds: the block activations (below) and the loss. A causal LM whose head
  the chunked loss reproduces (``chunked_loss.py``) holds one chunk of logits at 16 B per logit
  and, in backward, the head's gradient summed in fp32 (``V x H x 4``, and its cast back when
  the head computes in 16 bits); otherwise the whole logits at 12 B per logit (compute-dtype
  logits, the fp32 log-softmax saved for backward, the fp32 gradient, its cast back). Plus
  the final norm's input and output. A workspace allowance: `GPU_WORKSPACE_FIXED_BYTES` (CUDA
  context, cuBLAS workspaces) plus `GPU_WORKSPACE_PERCENT` of everything else.
* Plain training (everything on the GPU), for contrast: 16 B/param fp32, 18 B/param mixed
  precision, the same activations, the whole logits, and the workspace.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198), section 4.1: a transformer layer stores
``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations and 1-byte dropout masks. Broken into
its parts that is ``16`` stored ``s*b*h`` tensors (attention 5, layer norms 2, MLP 1 + 2x4)
plus two 1-byte masks, and 2 stored ``a*s*s*b`` tensors (softmax output, its dropout) plus
one mask. `layer_activation_bytes` keeps that breakdown and scales the tensors by the
compute dtype's bytes (fp32: ``s*b*h*(66 + 9*a*s/h)``) while masks stay 1 byte; the MLP
term uses the real FFN width (2 tensors of ``s*b*ffn``, or 4 for gated MLPs such as
SwiGLU), and Q/K/V use the real head and KV-head dims, so the formula is exact for
``ffn = 4h`` MHA and approximately right elsewhere. It assumes eager attention: with SDPA or
flash attention the ``s*s`` terms are not stored, so the estimate is an upper bound there.
Decoder layers of encoder-decoder models add a cross-attention block (its Q path and
output on the target length, K/V on the source length, scores ``a*s_tgt*s_src*b``) and a
layer norm. With gradient checkpointing each layer stores only its input (``s*b*h*c``)
plus, during the recompute, one layer's full activations; with activation offload only the
inputs of the last ``W`` blocks and two in flight stay on the device, the rest wait in host
memory.

Sizes are binary throughout: ``GB``/``GiB`` both mean 2**30 (as nvidia-smi and a "32 GB"
V100 use it), ``MB``/``MiB`` 2**20. See docs/estimate.md for a hand-checked example.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from .config import DEFAULT_WINDOW_SIZE, parse_dtype, parse_window_size
from . import memory
from .discovery import build_block_specs, find_block_stacks
from .transfer import FETCH_STAGING_BUFFERS  # host_image=False: the ring that replaces the image

GiB = 2**30
MiB = 2**20

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32


def _lean_adam_bytes(numel: int) -> int:
    """Adam state of one tensor under ``host_memory="lean"`` (optim/quant8.py): two uint8 codes
    per element and an fp32 absmax per block of 256 for each moment; small tensors stay fp32."""
    from .optim import quant8

    if numel < quant8.MIN_8BIT_NUMEL:
        return ADAM_STATE_BYTES * numel
    return 2 * numel + 2 * 4 * quant8.num_blocks(numel)
CPU_PROCESS_BYTES = 2 * GiB
GPU_WORKSPACE_FIXED_BYTES = 3 * GiB // 2
GPU_WORKSPACE_PERCENT = 5
LOGIT_BYTES = 12  # per logit, see the module docstring

_DTYPE_LABEL = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_AUTO_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "masked_lm": "AutoModelForMaskedLM",
    "seq2seq_lm": "AutoModelForSeq2SeqLM",
    "model": "AutoModel",
}
_GATED_MLP_NAMES = ("gate_proj", "gate_up_proj", "wi_0", "w3")


# ---------------------------------------------------------------------------- memory strings
_MEM_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_memory(text: str | int) -> int:
    """``"32GB"``, ``"32GiB"``, ``"32G"``, ``"900MB"``, ``"1.5T"`` or plain bytes -> bytes.

    Units are binary and case-insensitive: K/M/G/T with or without ``B`` or ``iB`` all mean
    2**10/2**20/2**30/2**40, so ``32GB == 32GiB == 32 * 2**30``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"memory size must be >= 0, got {text}")
        return text
    match = _MEM_RE.match(str(text))
    if not match or (not match.group(2) and "i" in match.group(3).lower()):
        raise ValueError(
            f"cannot parse memory size {text!r}; use e.g. 32GB, 32GiB, 900MB or a plain byte count "
            "(K/M/G/T are binary: GB = GiB = 2**30)"
        )
    value, unit = float(match.group(1)), match.group(2).lower()
    return int(value * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit])


def available_cpu_memory_bytes() -> int | None:
    """Available host RAM (`memory.available_host_bytes`: psutil, else /proc/meminfo)."""
    return memory.available_host_bytes()


# ---------------------------------------------------------------------------- model shape
@dataclass(frozen=True, slots=True)
class _Layer:
    params: int
    cross_attention: bool
    gated_mlp: bool
    ffn: int | None  # inferred from the block's weights when the config does not say


@dataclass(frozen=True, slots=True)
class _Unit:
    """One unit as the engine lays it out (``discovery.plan_units``), at a given compute dtype."""

    kind: str
    params: int
    trainable: int
    device_bytes: int  # its device slot: trainable in the device-copy dtype, frozen in their own
    grad_bytes: int  # its gradient buffer on the device: trainable in the device-copy dtype
    host_bytes: int  # masters, gradients, Adam state, the pinned image; frozen: stored bytes
    image_bytes: int  # of host_bytes, the pinned image (frozen parameters: their stored bytes)
    trainable_image_bytes: int  # of image_bytes, the trainable parameters' compute-dtype copy (0 in fp32)
    lean_adam_bytes: int  # its Adam state with host_memory="lean" (8-bit moments of the large tensors)


@dataclass(frozen=True, slots=True)
class _Counts:
    layers: tuple[_Layer, ...]
    units: tuple[_Unit, ...]
    sequence: tuple[int, ...]
    block_params: int
    resident_params: int  # parameters outside the blocks
    buffer_bytes: int
    logits_width: int
    hidden: int  # width of the head's input
    chunked: bool  # the chunked loss reproduces this model's head
    head_device_bytes: int  # bytes per element of the head's device copy (its fp32 gradient sum's cast)
    trainable_block_params: int
    frozen_block_bytes: int
    largest_trainable_params: int


def _count(model: nn.Module, block_classes: tuple[str, ...] | None, encoder_decoder: bool, c: int,
           offload_non_block: bool = True, keep: frozenset[int] = frozenset()) -> _Counts:
    """Units and shapes of ``model`` for a compute dtype of ``c`` bytes (its stored dtypes
    decide the rest, as they do in the engine); ``keep``: the parameters the device/host split
    keeps on the device (split.py), in no unit. The layers are every block's, kept or not:
    they all hold activations."""
    from .chunked_loss import analyse_causal_lm, is_causal_lm_class
    from .discovery import plan_units, unit_device_dtype

    stacks = find_block_stacks(model, block_classes)
    whole = plan_units(model, stacks, offload_non_block=offload_non_block)
    plan = plan_units(model, stacks, offload_non_block=offload_non_block, keep=keep) if keep else whole
    specs = [u for u in whole.units if u.kind == "block"]
    layers = []
    for spec in specs:
        names = [n for n, _ in spec.params]
        widths = [max(p.shape) for _, p in spec.params if p.dim() == 2]
        layers.append(
            _Layer(
                params=sum(p.numel() for _, p in spec.params),
                cross_attention=encoder_decoder and "decoder" in spec.fqn.split("."),
                gated_mlp=any(g in n.split(".") for n in names for g in _GATED_MLP_NAMES),
                ffn=max(widths) if widths else None,
            )
        )
    compute = {4: torch.float32, 2: torch.bfloat16}[c]
    units = []
    for spec in plan.units:
        dtype = unit_device_dtype(spec, None if c == 4 else compute)
        trainable = [p for _, p in spec.params if p.requires_grad]
        frozen = [p for _, p in spec.params if not p.requires_grad]
        dev = {id(p): (dtype or p.dtype).itemsize for p in trainable}
        image = sum(p.numel() * dev[id(p)] for p in trainable if dev[id(p)] != 4)
        masters = sum(4 * p.numel() for p in trainable)
        frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
        units.append(_Unit(
            kind=spec.kind, params=sum(p.numel() for _, p in spec.params), trainable=sum(p.numel() for p in trainable),
            device_bytes=sum(p.numel() * dev[id(p)] for p in trainable) + frozen_bytes,
            grad_bytes=sum(p.numel() * dev[id(p)] for p in trainable),
            host_bytes=masters + (4 + ADAM_STATE_BYTES) * sum(p.numel() for p in trainable) + image + frozen_bytes,
            image_bytes=image + frozen_bytes, trainable_image_bytes=image,
            lean_adam_bytes=sum(_lean_adam_bytes(p.numel()) for p in trainable),
        ))
    block_params = sum(layer.params for layer in layers)
    total = sum(p.numel() for p in model.parameters())  # unique tensors: tied weights once
    specs = [u for u in plan.units if u.kind == "block"]  # the streamed blocks, from here on
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(out, "weight", None) if out is not None else None
    width = weight.shape[0] if weight is not None else 0
    hidden = weight.shape[1] if weight is not None and weight.dim() == 2 else 0
    head_bytes = 4
    for spec in plan.units:
        if weight is not None and any(p is weight for _, p in spec.params):
            head_bytes = (unit_device_dtype(spec, None if c == 4 else compute) or weight.dtype).itemsize
    chunked = any(is_causal_lm_class(type(m)) and analyse_causal_lm(m)[0] is not None
                  for m in model.modules() if hasattr(m, "get_output_embeddings"))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = [sum(p.numel() for _, p in spec.params if p.requires_grad) for spec in specs]
    frozen_bytes = sum(p.numel() * p.element_size() for spec in specs for _, p in spec.params if not p.requires_grad)
    return _Counts(tuple(layers), tuple(units), plan.sequence, block_params, total - block_params, buffers, width,
                   hidden, chunked, head_bytes, sum(trainable), frozen_bytes, max(trainable, default=0))


def _cfg(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def layer_activation_bytes(
    s: int, b: int, h: int, a: int, *, nbytes: int, ffn: int | None = None, head_dim: int | None = None,
    kv_heads: int | None = None, gated_mlp: bool = False, cross_attention: bool = False, s_kv: int | None = None,
) -> int:
    """Bytes one transformer layer saves for backward (Korthikanti et al. 2022, generalised).

    With ``nbytes=2``, ``ffn=4h`` and plain MHA this is exactly ``s*b*h*(34 + 5*a*s/h)``.
    """
    ffn = 4 * h if ffn is None else ffn
    q = a * (head_dim or h // a)
    kv = (kv_heads or a) * (head_dim or h // a)
    sb = s * b
    # Attention: QKV input, Q, K, V, output-projection input; two layer-norm inputs; the MLP
    # input and (gated: 4, else 2) ffn-wide tensors around the activation function.
    elems = sb * (h + q + 2 * kv + q) + 2 * sb * h + sb * h + (4 if gated_mlp else 2) * sb * ffn
    masks = 2 * sb * h  # attention-output and MLP dropout masks, 1 byte each
    scores = a * s * s * b  # softmax output and its dropout output are stored, plus a mask
    total = (elems + 2 * scores) * nbytes + masks + scores
    if cross_attention:
        s_kv = s if s_kv is None else s_kv
        x_scores = a * s * s_kv * b
        # Q input, Q, output-projection input and the extra layer norm on the target length;
        # K and V on the source length; scores as above; one more output dropout mask.
        total += (sb * (h + 2 * q) + sb * h + 2 * s_kv * b * kv + 2 * x_scores) * nbytes + sb * h + x_scores
    return total


# ---------------------------------------------------------------------------- the estimate
@dataclass(frozen=True, slots=True)
class Estimate:
    """Byte counts for STRONGHOLD and for plain training; ``None`` means "not checked"."""

    model_name: str
    seq_len: int
    batch_size: int
    dtype: str
    gradient_checkpointing: bool
    window_size: int
    window_size_requested: int | str
    num_blocks: int
    block_params: int
    resident_params: int  # parameters outside the blocks (embeddings, norms, heads)
    total_params: int
    largest_block_params: int
    offload_non_block: bool
    chunked_loss: bool  # the chunked loss computes this model's training loss
    offload_activations: bool
    # CPU side (STRONGHOLD)
    cpu_master_bytes: int
    cpu_adam_bytes: int
    cpu_grad_bytes: int
    host_memory: str  # "exact" (fp32 Adam moments) or "lean" (8-bit)
    host_image: bool  # the pinned compute-dtype image is kept (else a staging ring; no difference in fp32)
    host_grads: str  # "compute" (bf16 host gradients of bf16 units) or "fp32"
    cpu_pinned_copy_bytes: int
    cpu_grad_staging_bytes: int
    cpu_activation_bytes: int
    cpu_process_bytes: int
    cpu_bytes_needed: int
    cpu_memory_bytes: int | None
    # NVMe tier (StrongholdConfig(nvme_path=...)): the Adam moments on disk, a ring in RAM
    nvme_adam: bool  # the moments are on disk (then cpu_adam_bytes counts none of them)
    nvme_bytes_needed: int
    nvme_memory_bytes: int | None
    cpu_nvme_ring_bytes: int
    nvme_masters: bool  # the fp32 masters are on disk too (then cpu_master_bytes is 0)
    # GPU side (STRONGHOLD)
    gpu_resident_bytes: int  # outside the window: resident units and their gradients, or (offload_non_block=False) params + grads + AdamW
    gpu_window_bytes: int
    gpu_slot_bytes: int  # the largest streamed unit's device copy
    gpu_grad_buffer_bytes: int
    gpu_engine_bytes: int  # what the ledger's device_peak_bytes counts: window + lanes + resident units
    gpu_block_activation_bytes: int
    gpu_head_activation_bytes: int  # the final norm, the logits (whole or one chunk) and the head's gradient sum
    gpu_workspace_bytes: int
    gpu_bytes_needed: int
    gpu_memory_bytes: int | None
    max_window_size: int | None
    # Plain training (everything on the GPU)
    plain_state_bytes: int
    plain_workspace_bytes: int
    plain_gpu_bytes_needed: int
    # Verdicts
    cpu_fits: bool | None
    gpu_fits: bool | None
    nvme_fits: bool | None
    fits: bool
    plain_fits: bool | None
    block_activation_bytes_checkpointed: int
    block_activation_bytes_full: int
    notes: tuple[str, ...] = ()
    # The device/host split (StrongholdConfig.resident, split.py): units kept on the GPU, in
    # gpu_resident_bytes with their gradients and AdamW state (and, in 16-bit compute, autocast's copy).
    resident_units: int = 0
    resident_params_on_gpu: int = 0
    gpu_split_bytes: int = 0
    split: str = "everything streams"
    resident_budget_bytes: int | None = None  # the device bytes the split had (what the Trainer gives the engine)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["notes"] = list(self.notes)
        return out

    def table(self) -> str:
        return _table(self)

    def raise_if_not_fits(self) -> None:
        """Raises ``ValueError`` with the numbers and what to change when it does not fit."""
        problems = []
        if self.cpu_fits is False:
            problems.append(
                f"CPU RAM: needs {_gib(self.cpu_bytes_needed)} (fp32 masters {_gib(self.cpu_master_bytes)} + Adam "
                f"{_gib(self.cpu_adam_bytes)} + gradients {_gib(self.cpu_grad_bytes)} + pinned buffers "
                f"{_gib(self.cpu_pinned_copy_bytes + self.cpu_grad_staging_bytes + self.cpu_activation_bytes)} + "
                + (f"NVMe ring {_gib(self.cpu_nvme_ring_bytes)} + " if self.nvme_adam else "")
                + f"process {_gib(self.cpu_process_bytes)}) for {self.total_params / 1e9:.2f} B offloaded parameters, "
                f"has {_gib(self.cpu_memory_bytes)}. Add CPU RAM, or train fewer or narrower layers "
                f"(each trainable parameter costs {self.cpu_bytes_per_param:.1f} B of RAM"
                + ("; host_memory=\"lean\" (--optim adamw_8bit) keeps 8-bit Adam moments, 6 B/param less"
                   if self.host_memory == "exact" else "")
                + ("; host_image=False drops the pinned compute-dtype image, 2 B/param less" if self.host_image
                   and self.dtype != "fp32" else "")
                + ("; without gradient accumulation the host gradients stay bf16, 2 B/param less"
                   if self.host_grads == "fp32" and self.dtype == "bf16" else "")
                + ("; StrongholdConfig(nvme_path=DIR) on a fast local disk moves the Adam moments "
                   f"({_gib(self.cpu_adam_bytes)}) there (estimate with --nvme_memory)" if not self.nvme_adam else "")
                + ("; StrongholdConfig(nvme_masters=True) moves the fp32 masters "
                   f"({_gib(self.cpu_master_bytes)}) there too" if self.nvme_adam and not self.nvme_masters else "")
                + ")."
            )
        if self.nvme_fits is False:
            what = "the Adam moments and the fp32 masters" if self.nvme_masters else "the Adam moments"
            problems.append(f"NVMe: {what} need {_gib(self.nvme_bytes_needed)} on disk, which has "
                            f"{_gib(self.nvme_memory_bytes)}. Free space or use a larger disk for nvme_path.")
        if self.gpu_fits is False:
            fixes = []
            if not self.gradient_checkpointing:
                fixes.append(
                    "enable gradient checkpointing (block activations "
                    f"{_gib(self.block_activation_bytes_full)} -> {_gib(self.block_activation_bytes_checkpointed)})"
                )
            elif not self.offload_activations:
                fixes.append("offload the checkpointed activations (StrongholdConfig(offload_activations=True))")
            if not self.offload_non_block:
                fixes.append("offload the parameters outside the blocks (StrongholdConfig(offload_non_block=True))")
            fixes.append("use a smaller batch or sequence length")
            if self.dtype == "fp32":
                fixes.append("train in bf16 (halves the window slots and activations)")
            if self.max_window_size and self.max_window_size < self.window_size:
                fixes.append(f"use a smaller window_size (the largest that fits is {self.max_window_size})")
            problems.append(
                f"GPU memory: needs {_gib(self.gpu_bytes_needed)} at window_size={self.window_size} (window "
                f"{_gib(self.gpu_window_bytes)} + gradient buffers {_gib(self.gpu_grad_buffer_bytes)} + outside the "
                f"window {_gib(self.gpu_resident_bytes)} + activations "
                f"{_gib(self.gpu_block_activation_bytes + self.gpu_head_activation_bytes)} + workspace "
                f"{_gib(self.gpu_workspace_bytes)}), has {_gib(self.gpu_memory_bytes)}. Fix: " + "; ".join(fixes) + "."
            )
        if problems:
            raise ValueError(f"{self.model_name} does not fit for STRONGHOLD training. " + " ".join(problems))

    @property
    def cpu_bytes_per_param(self) -> float:
        """Host bytes of a trainable parameter of a block: master, gradient, Adam state, image."""
        adam = ADAM_STATE_BYTES if self.host_memory == "exact" else self.cpu_adam_bytes / max(self.total_params, 1)
        adam = 0 if self.nvme_adam else adam
        grad = 2 if self.host_grads == "compute" else 4
        master = 0 if self.nvme_masters else 4
        return master + adam + grad + (0 if self.dtype == "fp32" or not self.host_image else _NBYTES[self.dtype])


_NBYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def check_fits(estimate_: Estimate) -> Estimate:
    """`Estimate.raise_if_not_fits`, returning the estimate when it fits."""
    estimate_.raise_if_not_fits()
    return estimate_


def _workspace(other: int) -> int:
    return GPU_WORKSPACE_FIXED_BYTES + -(-other * GPU_WORKSPACE_PERCENT // 100)


def _window_bytes(counts: _Counts, window: int) -> int:
    """The most device bytes ``window + 1`` consecutive positions of the sequence hold."""
    seq = counts.sequence
    best = 0
    for start in range(max(1, len(seq) - window)):
        units = set(seq[start:start + window + 1])
        best = max(best, sum(counts.units[u].device_bytes for u in units))
    return best


def _assemble(
    counts: _Counts, config: Any, *, model_name: str, seq_len: int, batch_size: int, dtype: str,
    gradient_checkpointing: bool, window_size: int | str | None, gpu_memory_bytes: int | None,
    cpu_memory_bytes: int | None, decoder_seq_len: int | None, notes: list[str], grad_buffers: int = 2,
    offload_non_block: bool = True, chunked_loss: bool | str = "auto", offload_activations: bool | str = "auto",
    loss_chunk_tokens: int | str = "auto", host_memory: str = "exact", host_image: bool | str = "auto",
    host_grads: str = "auto", gradient_accumulation_steps: int = 1, nvme_memory_bytes: int | None = None,
    nvme: bool | str = "auto", nvme_ring_buffers: int = 3, nvme_masters: bool | str = "auto", split: Any = None,
) -> Estimate:
    if nvme not in (True, False, "auto"):
        raise ValueError(f"nvme={nvme!r}; use \"auto\", True or False.")
    if nvme_masters not in (True, False, "auto"):
        raise ValueError(f"nvme_masters={nvme_masters!r}; use \"auto\", True or False.")
    if host_grads not in ("auto", "fp32", "compute"):
        raise ValueError(f"host_grads={host_grads!r}; use \"auto\", \"fp32\" or \"compute\".")
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}.")
    if host_image not in (True, False, "auto"):
        raise ValueError(f"host_image={host_image!r}; use \"auto\", True or False.")
    if host_memory not in ("exact", "lean"):
        raise ValueError(f"host_memory={host_memory!r}; use \"exact\" or \"lean\".")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got seq_len={seq_len}, batch_size={batch_size}.")
    c = _NBYTES[dtype]
    n = len(counts.layers)
    positions = len(counts.sequence)
    largest = max(layer.params for layer in counts.layers)
    requested: int | str = "auto" if window_size in (None, "auto") else parse_window_size(window_size)
    w = min(DEFAULT_WINDOW_SIZE if requested == "auto" else requested, positions)
    if requested != "auto" and requested > positions:
        notes.append(f"window_size={requested} exceeds the {positions} streamed units; evaluated at {positions}")
    units = counts.units
    streamed = [u for u in units if u.kind != "resident"]
    resident = [u for u in units if u.kind == "resident"]

    # CPU: every unit's host bytes (masters, gradients, Adam state, pinned images; frozen:
    # stored bytes), K pinned staging buffers of the largest streamed gradient, one for each
    # resident unit, the activation buffers, the process itself.
    trainable = sum(u.trainable for u in units)
    master = sum(4 * u.trainable for u in units)
    unit_adam = [u.lean_adam_bytes if host_memory == "lean" else ADAM_STATE_BYTES * u.trainable for u in units]
    adam = sum(unit_adam)
    image = sum(u.trainable_image_bytes for u in units)
    # bf16 host gradients (unit.py, [Note: host gradients in the compute dtype]): 2 B instead of
    # 4 for bf16 units, unless accumulation widens them to fp32.
    bf16_grads = dtype == "bf16" and host_grads != "fp32" and gradient_accumulation_steps == 1
    grad = 4 * trainable - (image if bf16_grads else 0)
    pinned = sum(u.image_bytes for u in units)
    # Without the image: two staging buffers of the largest block (larger units cross in pieces).
    ring = FETCH_STAGING_BUFFERS * max((u.trainable_image_bytes for u in units if u.kind == "block"),
                                       default=max((u.trainable_image_bytes for u in units), default=0))
    lane = max((u.grad_bytes for u in streamed), default=0)
    # Pinned gradient staging holds the largest block's gradient; larger units cross in pieces.
    block_lane = max((u.grad_bytes for u in streamed if u.kind == "block"), default=lane)
    staging = grad_buffers * block_lane + len([u for u in resident if u.trainable]) * max(
        (u.grad_bytes for u in resident), default=0)

    # Activations, from the config's shape.
    h = _cfg(config, "hidden_size", "d_model", "n_embd", "dim")
    a = _cfg(config, "num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
    full = ckpt = ckpt_offloaded = head = inputs_host = 0
    if h and a:
        s_dec = decoder_seq_len or seq_len
        per_layer, inputs = [], []
        for layer in counts.layers:
            s = s_dec if layer.cross_attention else seq_len
            ffn = _cfg(config, "decoder_ffn_dim") if layer.cross_attention else None
            ffn = ffn or _cfg(config, "intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim") or layer.ffn
            per_layer.append(layer_activation_bytes(
                s, batch_size, h, a, nbytes=c, ffn=ffn, head_dim=_cfg(config, "head_dim", "d_kv"),
                kv_heads=_cfg(config, "num_key_value_heads"), gated_mlp=layer.gated_mlp,
                cross_attention=layer.cross_attention, s_kv=seq_len,
            ))
            inputs.append(s * batch_size * h * c)
        full = sum(per_layer)
        # Checkpointing keeps each layer's input; the recompute holds one layer in full. With
        # the inputs offloaded, the last W stay and two more are on their way.
        ckpt = sum(inputs) + max(per_layer)
        kept = sorted(inputs, reverse=True)[: min(n, w + 2)]
        ckpt_offloaded = sum(kept) + max(per_layer)
        inputs_host = sum(inputs) - sum(inputs[-w:]) if n > w else 0
        s_out = s_dec if any(layer.cross_attention for layer in counts.layers) else seq_len
        tokens = s_out * batch_size
        head = 2 * tokens * (counts.hidden or h) * c  # the final norm's input and output
        whole_resident = not counts.units and split is not None  # the split keeps the model on the GPU
        use_chunks = (chunked_loss is True or (chunked_loss == "auto" and not whole_resident)) and (
            counts.chunked and counts.logits_width)
        if use_chunks:
            from .chunked_loss import BYTES_PER_LOGIT, resolve_chunk_tokens

            chunk = min(tokens, resolve_chunk_tokens(loss_chunk_tokens, counts.logits_width))
            head_grad = counts.logits_width * counts.hidden * (4 + (counts.head_device_bytes if
                                                                    counts.head_device_bytes != 4 else 0))
            head += chunk * counts.logits_width * BYTES_PER_LOGIT + head_grad
        else:
            head += tokens * counts.logits_width * LOGIT_BYTES
        plain_head = 2 * tokens * (counts.hidden or h) * c + tokens * counts.logits_width * LOGIT_BYTES
    else:
        use_chunks = False
        plain_head = 0
        notes.append("model config has no hidden size / head count: activations not counted")

    # GPU: the window, the gradient lanes, what stays outside the window, activations, loss.
    state_per_param = 16 if c == 4 else 18
    # A unit used at several positions (a tied embedding) keeps a lane of its own between its
    # backward uses: one more lane each (schedule.release).
    parked = sum(1 for i, u in enumerate(units) if u.kind != "resident" and u.trainable
                 and counts.sequence.count(i) > 1)
    lanes = (grad_buffers + parked) * lane
    if offload_non_block:
        outside = sum(u.device_bytes + u.grad_bytes for u in resident) + counts.buffer_bytes
    else:
        outside = state_per_param * counts.resident_params + counts.buffer_bytes
    # The split's resident units: parameters, fp32 gradients, AdamW state; autocast's 16-bit copy.
    split_bytes = 0 if split is None else split.resident_bytes + (c * split.resident_params if c != 4 else 0)
    outside += split_bytes

    def need(window: int, offload: bool) -> int:
        block_act = (ckpt_offloaded if offload else ckpt) if gradient_checkpointing else full
        other = _window_bytes(counts, window) + lanes + outside + block_act + head
        return other + _workspace(other)

    offload = bool(gradient_checkpointing and offload_activations is True)
    if offload_activations == "auto" and gradient_checkpointing and gpu_memory_bytes is not None:
        offload = need(w, False) > gpu_memory_bytes and need(w, True) < need(w, False)
    block_act = (ckpt_offloaded if offload else ckpt) if gradient_checkpointing else full
    window_bytes = _window_bytes(counts, w)
    gpu_need = need(w, offload)
    max_w: int | None = None
    if gpu_memory_bytes is not None:
        max_w = 0
        for cand in range(1, positions + 1):  # a few thousand at most: a scan is exact and cheap
            if need(cand, offload) > gpu_memory_bytes:
                break
            max_w = cand
    activation_host = inputs_host if offload else 0
    # The NVMe tier: the moments on disk, a ring of buffers of the largest unit's moments in RAM
    # (with nvme_masters, of its masters and moments).
    unit_master = [4 * u.trainable for u in units]

    def nvme_ring(masters_on_disk: bool) -> int:
        per_unit = [a + (m if masters_on_disk else 0) for a, m in zip(unit_adam, unit_master)]
        return min(nvme_ring_buffers, len(per_unit)) * max(per_unit, default=0)

    # Masters on disk: no image; fetches read one block's masters at a time (fp32 scratch) and
    # convert them through the staging ring, in the compute dtype (fp32 compute too).
    block_trainable = max((u.trainable for u in units if u.kind == "block"),
                          default=max((u.trainable for u in units), default=0))
    disk_fetch = FETCH_STAGING_BUFFERS * c * block_trainable + 4 * block_trainable

    def host_need(keep: bool, on_disk: bool, masters_on_disk: bool = False) -> int:
        if masters_on_disk:
            return (nvme_ring(True) + grad + pinned - image + disk_fetch + staging + activation_host
                    + CPU_PROCESS_BYTES)
        image_or_ring = 0 if keep or not image else ring - image
        moments = nvme_ring(False) if on_disk else adam
        return master + moments + grad + pinned + image_or_ring + staging + activation_host + CPU_PROCESS_BYTES

    # What "auto" chooses, in order, the first that fits the RAM: everything in RAM; without
    # the image (host_image="auto"); the moments on disk (with nvme_memory), image kept if it
    # fits; then the masters on disk too (nvme_masters="auto").
    images = [True, False] if host_image == "auto" else [bool(host_image)]
    disks = [True] if nvme is True else [False] if nvme is False or (nvme_memory_bytes is None) else [False, True]
    choices = [(keep, disk, False) for disk in disks for keep in images]
    if nvme_masters is True:
        choices = [(False, True, True)]
    elif nvme_masters == "auto" and True in disks and host_image is not True:
        choices.append((False, True, True))
    keep_image, on_disk, masters_on_disk = next(
        (c for c in choices if cpu_memory_bytes is None or host_need(*c) <= cpu_memory_bytes), choices[-1])
    cpu_needed = host_need(keep_image, on_disk, masters_on_disk)
    if masters_on_disk:
        pinned += disk_fetch - image
    elif image and not keep_image:
        pinned += ring - image
        if host_image == "auto":
            notes.append(f"host_image=\"auto\" drops the pinned {dtype} image ({_gib(image)}): fetches convert the "
                         "fp32 masters through two staging buffers")
    if on_disk and nvme == "auto":
        notes.append(f"the Adam moments ({_gib(adam)}) go to the NVMe tier (StrongholdConfig(nvme_path=DIR)): the host "
                     f"holds a ring of {min(nvme_ring_buffers, len(unit_adam))} buffers instead")
    if masters_on_disk and nvme_masters == "auto":
        notes.append(f"the fp32 masters ({_gib(master)}) go to disk too (StrongholdConfig(nvme_masters=True)): "
                     "every fetch reads them from the NVMe tier")
    if on_disk and not masters_on_disk and cpu_memory_bytes is not None and cpu_needed > cpu_memory_bytes:
        notes.append(f"with the moments on disk the host still needs the fp32 masters ({_gib(master)}) and the "
                     f"gradients ({_gib(grad)}); StrongholdConfig(nvme_masters=True) moves the masters too")

    total = counts.block_params + counts.resident_params
    plain_state = state_per_param * total + counts.buffer_bytes
    plain_other = plain_state + (ckpt if gradient_checkpointing else full) + plain_head
    plain_ws = _workspace(plain_other)
    plain_need = plain_other + plain_ws

    cpu_fits = None if cpu_memory_bytes is None else cpu_needed <= cpu_memory_bytes
    gpu_fits = None if gpu_memory_bytes is None else gpu_need <= gpu_memory_bytes
    if cpu_fits is None:
        notes.append("CPU RAM unknown: CPU check skipped")
    if gpu_fits is None:
        notes.append("GPU memory unknown: GPU check skipped")
    on_nvme = (adam if on_disk else 0) + (master if masters_on_disk else 0)
    nvme_fits = None if not on_disk or nvme_memory_bytes is None else on_nvme <= nvme_memory_bytes
    fixed = window_bytes + lanes + outside + block_act + head
    return Estimate(
        model_name=model_name, seq_len=seq_len, batch_size=batch_size, dtype=dtype,
        gradient_checkpointing=gradient_checkpointing, window_size=w, window_size_requested=requested,
        num_blocks=n, block_params=counts.block_params, resident_params=counts.resident_params,
        total_params=total, largest_block_params=largest, offload_non_block=offload_non_block,
        chunked_loss=bool(use_chunks), offload_activations=offload,
        cpu_master_bytes=0 if masters_on_disk else master, cpu_adam_bytes=0 if on_disk else adam, cpu_grad_bytes=grad, host_memory=host_memory,
        host_image=bool(keep_image or not image), host_grads="compute" if bf16_grads else "fp32",
        cpu_pinned_copy_bytes=pinned,
        cpu_grad_staging_bytes=staging, cpu_activation_bytes=activation_host, cpu_process_bytes=CPU_PROCESS_BYTES,
        cpu_bytes_needed=cpu_needed, cpu_memory_bytes=cpu_memory_bytes,
        nvme_adam=on_disk, nvme_bytes_needed=on_nvme, nvme_memory_bytes=nvme_memory_bytes,
        cpu_nvme_ring_bytes=nvme_ring(masters_on_disk) if on_disk else 0, nvme_masters=masters_on_disk,
        gpu_resident_bytes=outside, gpu_window_bytes=window_bytes,
        gpu_slot_bytes=max((u.device_bytes for u in streamed), default=0),
        gpu_grad_buffer_bytes=lanes, gpu_engine_bytes=window_bytes + lanes + (outside - counts.buffer_bytes
                                                                               if offload_non_block else split_bytes),
        gpu_block_activation_bytes=block_act, gpu_head_activation_bytes=head,
        gpu_workspace_bytes=gpu_need - fixed, gpu_bytes_needed=gpu_need,
        gpu_memory_bytes=gpu_memory_bytes, max_window_size=max_w,
        plain_state_bytes=plain_state, plain_workspace_bytes=plain_ws, plain_gpu_bytes_needed=plain_need,
        cpu_fits=cpu_fits, gpu_fits=gpu_fits, nvme_fits=nvme_fits,
        fits=cpu_fits is not False and gpu_fits is not False and nvme_fits is not False,
        plain_fits=None if gpu_memory_bytes is None else plain_need <= gpu_memory_bytes,
        block_activation_bytes_checkpointed=ckpt, block_activation_bytes_full=full, notes=tuple(notes),
        resident_units=0 if split is None else len(split.resident),
        resident_params_on_gpu=0 if split is None else split.resident_params, gpu_split_bytes=split_bytes,
        split="everything streams" if split is None else split.reason,
    )


def _with_split(model: nn.Module, block_classes: tuple[str, ...] | None, c: int, assemble, *, offload_non_block: bool,
                resident: Any, gpu_memory_bytes: int | None, window_size: int | str | None, grad_buffers: int,
                budget: int | None) -> Estimate:
    """``assemble(split)`` for the split the engine would keep (split.py). ``resident="auto"``
    without a budget of its own (``gpu_memory``) fills what the GPU leaves once this run's
    activations, loss and workspace are counted (from the everything-streamed estimate), so a
    run that fits streaming does not stop fitting because of the split. A whole-resident model
    computes its loss whole (``chunked_loss="auto"``): when those logits would not fit, the
    budget shrinks by them, so that something streams and the loss stays chunked. If the split
    still would not fit, the estimate is the streamed one."""
    streamed = assemble(None)
    if resident is False:
        return streamed
    measured = budget is None and resident == "auto"
    if measured:
        if gpu_memory_bytes is None:
            return streamed
        room = (gpu_memory_bytes - GPU_WORKSPACE_FIXED_BYTES) * 100 // (100 + GPU_WORKSPACE_PERCENT)
        buffers = streamed.gpu_resident_bytes - streamed.gpu_split_bytes - (
            streamed.gpu_engine_bytes - streamed.gpu_window_bytes - streamed.gpu_grad_buffer_bytes)
        model_state = room - streamed.gpu_block_activation_bytes - streamed.gpu_head_activation_bytes - buffers
        budget = max(0, model_state * 16 // 18 if c != 4 else model_state)  # autocast's 16-bit copies
    split = _split(model, block_classes, c, offload_non_block=offload_non_block, resident=resident, budget=budget,
                   window_size=window_size, grad_buffers=grad_buffers)
    if split is None:
        return streamed
    with_split = dataclasses.replace(assemble(split), resident_budget_bytes=budget)
    if measured and with_split.gpu_fits is False and streamed.chunked_loss and not with_split.chunked_loss:
        whole_logits = with_split.gpu_head_activation_bytes - streamed.gpu_head_activation_bytes
        budget = max(0, budget - whole_logits * 105 // 100)
        split = _split(model, block_classes, c, offload_non_block=offload_non_block, resident=resident,
                       budget=budget, window_size=window_size, grad_buffers=grad_buffers)
        if split is None:
            return streamed
        with_split = dataclasses.replace(assemble(split), resident_budget_bytes=budget)
    if with_split.gpu_fits is False and streamed.gpu_fits:
        return streamed
    return with_split


def _split(model: nn.Module, block_classes: tuple[str, ...] | None, c: int, *, offload_non_block: bool, resident: Any,
           budget: int | None, window_size: int | str | None, grad_buffers: int):
    """The device/host split the engine would choose (split.py) within ``budget``."""
    from .discovery import plan_units
    from .split import TRAINABLE_EXTRA_BYTES, choose_split

    if resident is False or (resident == "auto" and budget is None):
        return None
    plan = plan_units(model, find_block_stacks(model, block_classes), offload_non_block=offload_non_block)
    in_units = {id(p) for u in plan.units for _, p in u.params}
    base = sum(p.numel() * (p.element_size() + (TRAINABLE_EXTRA_BYTES if p.requires_grad else 0))
               for p in model.parameters() if id(p) not in in_units)
    ws = window_size if isinstance(window_size, int) else DEFAULT_WINDOW_SIZE
    split = choose_split(plan, resident=resident, budget=budget, window_size=min(ws, len(plan.sequence)),
                         grad_buffers=grad_buffers, param_dtype=None if c == 4 else torch.bfloat16, base_bytes=base)
    return split if split.resident else None


def _dtype_label(dtype: str | torch.dtype) -> str:
    return _DTYPE_LABEL[parse_dtype(dtype, field_name="dtype")]


# ---------------------------------------------------------------------------- model building
@contextlib.contextmanager
def _skip_init():
    # On meta, torch.nn.init calls still run (slowly, through the meta reference kernels):
    # about half the build time of a GPT-2 block. transformers' no_init_weights turns them
    # off; it also skips init_weights, whose only work on meta is tying, redone below.
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        yield
        return
    with no_init_weights():
        yield


def _auto_classes(config: Any, auto_class: Any) -> list[Any]:
    import transformers

    if auto_class is not None:
        if isinstance(auto_class, str):
            name = _AUTO_CLASSES.get(auto_class, auto_class)
            if not hasattr(transformers, name):
                raise ValueError(f"auto_class={auto_class!r} is unknown; use one of {sorted(_AUTO_CLASSES)} or a class.")
            return [getattr(transformers, name)]
        return [auto_class]
    order = ["causal_lm", "masked_lm", "seq2seq_lm", "model"]
    if getattr(config, "is_encoder_decoder", False):
        # BART/T5 also map to a CausalLM class that is the decoder alone; count both stacks.
        order.remove("seq2seq_lm")
        order.insert(0, "seq2seq_lm")
    return [getattr(transformers, _AUTO_CLASSES[k]) for k in order]


def build_meta_model(config: Any, auto_class: Any = None) -> nn.Module:
    """The model for ``config`` on the meta device (no memory), trying Auto classes in order."""
    errors = []
    for cls in _auto_classes(config, auto_class):
        try:
            with torch.device("meta"), _skip_init():
                model = cls.from_config(config)
        except ValueError as err:  # "Unrecognized configuration class ... for this kind of AutoModel"
            errors.append(f"{getattr(cls, '__name__', cls)}: {str(err).splitlines()[0]}")
            continue
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        return model
    raise ValueError(f"No Auto class builds {type(config).__name__}: " + "; ".join(errors))


def load_config(model_type: str | None = None, config_name: str | None = None, config_overrides: str | None = None) -> Any:
    """A config from a model type or a local config dir/json, with run_clm-style ``k=v,k=v`` overrides."""
    from transformers import AutoConfig

    if config_name:
        config = AutoConfig.from_pretrained(config_name)
        if config_overrides:
            config.update_from_string(config_overrides)
        return config
    if not model_type:
        raise ValueError("give a model_type (e.g. gpt2) or a config_name (a local config dir or json file)")
    # Overrides go to the constructor, so that what it derives follows them (T5's
    # num_decoder_layers defaults to num_layers); update_from_string parses the types.
    base = AutoConfig.for_model(model_type)
    if not config_overrides:
        return base
    probe = AutoConfig.for_model(model_type)
    probe.update_from_string(config_overrides)
    keys = [kv.split("=", 1)[0].strip() for kv in config_overrides.split(",") if kv.strip()]
    return AutoConfig.for_model(model_type, **{k: getattr(probe, k) for k in keys})


def estimate(
    model_config: Any, *, seq_len: int, batch_size: int, dtype: str = "fp32", gpu_memory_bytes: int,
    cpu_memory_bytes: int, gradient_checkpointing: bool = False, window_size: int | str | None = None,
    auto_class: Any = None, decoder_seq_len: int | None = None, block_classes: Sequence[str] | None = None,
    grad_buffers: int = 2, offload_non_block: bool = True, chunked_loss: bool | str = "auto",
    offload_activations: bool | str = "auto", loss_chunk_tokens: int | str = "auto", host_memory: str = "exact",
    host_image: bool | str = "auto", host_grads: str = "auto", gradient_accumulation_steps: int = 1,
    nvme_memory_bytes: int | str | None = None, nvme: bool | str = "auto", nvme_masters: bool | str = "auto",
    resident: int | bool | str = False, resident_budget_bytes: int | str | None = None,
) -> Estimate:
    """Estimates STRONGHOLD and plain-training memory for a config (built on the meta device).

    ``window_size=None``/``"auto"`` evaluates ``DEFAULT_WINDOW_SIZE`` (capped by the block
    count), the smallest window auto mode would sensibly use, and reports the largest that
    fits. ``decoder_seq_len`` is the target length of encoder-decoder models (default
    ``seq_len``). ``auto_class``: ``"causal_lm"``, ``"masked_lm"``, ``"seq2seq_lm"``,
    ``"model"`` or a class with ``from_config``; ``None`` tries them in that order
    (seq2seq first for encoder-decoder configs). The model is taken as loaded in ``dtype``
    (bf16 checkpoints are), so embeddings and norms are in it on the device too.
    ``offload_non_block``, ``chunked_loss``, ``offload_activations``, ``loss_chunk_tokens``,
    ``host_memory``, ``host_image`` and ``host_grads`` are `StrongholdConfig`'s
    (``host_image="auto"`` drops the image when the RAM would not hold it; ``host_grads="auto"``
    keeps bf16 gradients when ``gradient_accumulation_steps`` is 1); ``offload_activations="auto"`` offloads when
    the GPU would not fit otherwise. ``nvme_memory_bytes``: the NVMe tier's disk space; with it
    (``nvme="auto"``) the Adam moments go to disk when the RAM would not hold them
    (``nvme=True``: always, as an engine with ``nvme_path`` does), and then the fp32 masters
    too when it still would not (``nvme_masters="auto"``; True: always, False: never).
    ``resident`` and ``resident_budget_bytes`` are `StrongholdConfig`'s ``resident`` and
    ``gpu_memory`` (``None``: the GPU's memory less the engine's reserve): the units the split
    keeps on the GPU (split.py) count there with their AdamW state, not on the host. Only fp32
    trainable parameters can be resident, so a ``dtype`` other than fp32 (the model taken as
    loaded in it) keeps everything streaming, as the engine would.
    """
    model = build_meta_model(model_config, auto_class)
    label = _dtype_label(dtype)
    if label != "fp32":
        model.to(parse_dtype(label, field_name="dtype"))
    classes = tuple(block_classes) if block_classes else None
    gpu = parse_memory(gpu_memory_bytes)

    def assemble(split):
        counts = _count(model, classes, bool(getattr(model_config, "is_encoder_decoder", False)), _NBYTES[label],
                        offload_non_block, keep=split.kept_param_ids if split is not None else frozenset())
        return _assemble(
            counts, model_config, model_name=type(model).__name__, seq_len=seq_len, batch_size=batch_size,
            dtype=label, gradient_checkpointing=gradient_checkpointing, window_size=window_size,
            gpu_memory_bytes=gpu, cpu_memory_bytes=parse_memory(cpu_memory_bytes),
            decoder_seq_len=decoder_seq_len, notes=[], grad_buffers=grad_buffers, offload_non_block=offload_non_block,
            chunked_loss=chunked_loss, offload_activations=offload_activations, loss_chunk_tokens=loss_chunk_tokens,
            host_memory=host_memory, host_image=host_image, host_grads=host_grads,
            gradient_accumulation_steps=gradient_accumulation_steps,
            nvme_memory_bytes=None if nvme_memory_bytes is None else parse_memory(nvme_memory_bytes),
            nvme=nvme, nvme_masters=nvme_masters, split=split,
        )

    return _with_split(model, classes, _NBYTES[label], assemble, offload_non_block=offload_non_block,
                       resident=resident, gpu_memory_bytes=gpu, window_size=window_size, grad_buffers=grad_buffers,
                       budget=None if resident_budget_bytes is None else parse_memory(resident_budget_bytes))


def estimate_for_model(
    model: nn.Module, *, seq_len: int, batch_size: int, dtype: str | torch.dtype | None = None,
    gpu_memory_bytes: int | None = None, cpu_memory_bytes: int | None = None,
    gradient_checkpointing: bool | None = None, window_size: int | str | None = None,
    block_classes: Sequence[str] | None = None, decoder_seq_len: int | None = None, grad_buffers: int = 2,
    device: torch.device | str | int | None = None, offload_non_block: bool = True, chunked_loss: bool | str = "auto",
    offload_activations: bool | str = "auto", loss_chunk_tokens: int | str = "auto", host_memory: str = "exact",
    host_image: bool | str = "auto", host_grads: str = "auto", gradient_accumulation_steps: int = 1,
    nvme_memory_bytes: int | None = None, nvme: bool | str = "auto", nvme_ring_buffers: int = 3,
    nvme_masters: bool | str = "auto", resident: int | bool | str = False, resident_budget_bytes: int | None = None,
) -> Estimate:
    """The same estimate from a live, already built model (call before moving it to the GPU).

    ``dtype=None``: the dtype of the model's parameters. ``gradient_checkpointing=None``: the
    model's ``is_gradient_checkpointing``. ``gpu_memory_bytes=None``: free memory of
    ``device`` (default the current CUDA device) from ``torch.cuda.mem_get_info`` when CUDA
    exists, else the GPU check is skipped. ``cpu_memory_bytes=None``: available RAM (psutil or
    /proc/meminfo) plus the bytes the model's block parameters hold on the CPU now, since the
    engine moves them into its own arenas and frees the originals; skipped when unknown.
    ``resident``, ``resident_budget_bytes``: the device/host split, as in `estimate`.
    """
    notes: list[str] = []
    config = getattr(model, "config", None)
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    label = _dtype_label(dtype)
    if gpu_memory_bytes is None and torch.cuda.is_available():
        # Creating the context here means ``free`` already excludes it, so the workspace's
        # context allowance is counted twice: a deliberate, small (< 1 GiB) overestimate.
        gpu_memory_bytes = torch.cuda.mem_get_info(device)[0]
    classes = tuple(block_classes) if block_classes else None
    if gradient_checkpointing is None:
        # transformers 5.x renamed the flag; read the new name first to avoid its deprecation warning.
        flag = getattr(type(model), "is_activation_checkpointing", None)
        name = "is_activation_checkpointing" if flag is not None else "is_gradient_checkpointing"
        gradient_checkpointing = bool(getattr(model, name, False))
    if cpu_memory_bytes is None:
        avail = available_cpu_memory_bytes()
        if avail is not None:
            moving = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
            cpu_memory_bytes = avail + moving
            notes.append(f"CPU RAM: {_gib(avail)} available + {_gib(moving)} held by the model's parameters now")

    def assemble(split):
        counts = _count(model, classes, bool(getattr(config, "is_encoder_decoder", False)), _NBYTES[label],
                        offload_non_block, keep=split.kept_param_ids if split is not None else frozenset())
        return _assemble(
            counts, config, model_name=type(model).__name__, seq_len=seq_len, batch_size=batch_size,
            dtype=label, gradient_checkpointing=gradient_checkpointing, window_size=window_size,
            gpu_memory_bytes=gpu_memory_bytes, cpu_memory_bytes=cpu_memory_bytes, decoder_seq_len=decoder_seq_len,
            grad_buffers=grad_buffers, notes=list(notes), offload_non_block=offload_non_block,
            chunked_loss=chunked_loss, offload_activations=offload_activations, loss_chunk_tokens=loss_chunk_tokens,
            host_memory=host_memory, host_image=host_image, host_grads=host_grads,
            gradient_accumulation_steps=gradient_accumulation_steps, nvme_memory_bytes=nvme_memory_bytes, nvme=nvme,
            nvme_ring_buffers=nvme_ring_buffers, nvme_masters=nvme_masters, split=split,
        )

    return _with_split(model, classes, _NBYTES[label], assemble, offload_non_block=offload_non_block,
                       resident=resident, gpu_memory_bytes=gpu_memory_bytes, window_size=window_size,
                       grad_buffers=grad_buffers, budget=resident_budget_bytes)


# ---------------------------------------------------------------------------- output
def _gib(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else f"{nbytes / GiB:.2f} GiB"


def _verdict(ok: bool | None) -> str:
    return {None: "not checked", True: "fits", False: "does NOT fit"}[ok]


def _table(e: Estimate) -> str:
    def row(label: str, nbytes: int) -> str:
        return f"  {label:<52}{nbytes / GiB:>10.2f}"

    def total(label: str, need: int, have: int | None, ok: bool | None) -> str:
        have_s = "?" if have is None else f"{have / GiB:.2f}"
        return f"  {label:<52}{need / GiB:>10.2f}  of {have_s} GiB: {_verdict(ok)}"

    c = _NBYTES[e.dtype]
    ckpt = "on" if e.gradient_checkpointing else "off"
    outside = ("resident units and their gradients" if e.offload_non_block else
               f"outside the blocks: params+grads+Adam ({16 if c == 4 else 18} B)")
    loss = "loss (final norm, a chunk of logits, head grad)" if e.chunked_loss else "loss (final norm, whole logits)"
    lines = [
        f"{e.model_name}: {e.total_params / 1e9:.3f} B params ({e.block_params / 1e9:.3f} B in {e.num_blocks} blocks, "
        f"largest {e.largest_block_params / 1e6:.1f} M; {e.resident_params / 1e6:.1f} M outside them), seq "
        f"{e.seq_len} x batch {e.batch_size}, {e.dtype}, gradient checkpointing {ckpt}"
        + (", checkpointed activations offloaded" if e.offload_activations else ""),
        f"{'CPU RAM (STRONGHOLD)':<54}{'GiB':>10}",
        row("fp32 master weights: on NVMe (nvme_masters)" if e.nvme_masters else "fp32 master weights (4 B/param)",
            e.cpu_master_bytes),
        row("Adam state + masters: on NVMe, a ring in RAM" if e.nvme_masters
            else "Adam state: on NVMe, a ring of buffers in RAM" if e.nvme_adam
            else f"Adam state ({ADAM_STATE_BYTES} B/param)" if e.host_memory == "exact"
            else "Adam state, lean (8-bit moments, 2 B/param)", e.cpu_nvme_ring_bytes if e.nvme_adam else e.cpu_adam_bytes),
        row("fp32 gradient buffers (4 B/param)" if e.host_grads == "fp32"
            else "gradient buffers (bf16 units 2 B/param, others 4)", e.cpu_grad_bytes),
        row("pinned images (fp32: the masters; frozen: stored bytes)" if c == 4 and not e.nvme_masters
            else f"pinned {e.dtype} images ({c} B/param; frozen: stored bytes)" if e.host_image
            else f"pinned {e.dtype} staging, no image (frozen: stored bytes)" if not e.nvme_masters
            else f"pinned {e.dtype} staging + fp32 read scratch (frozen: stored)",
            e.cpu_pinned_copy_bytes),
        row("pinned gradient staging (K buffers)", e.cpu_grad_staging_bytes),
        row("offloaded checkpointed activations", e.cpu_activation_bytes),
        row("process allowance (Python, torch, CUDA runtime)", e.cpu_process_bytes),
        total("total", e.cpu_bytes_needed, e.cpu_memory_bytes, e.cpu_fits),
        *([f"NVMe (STRONGHOLD, nvme_path)",
           total(f"Adam moments ({'8-bit' if e.host_memory == 'lean' else 'fp32'})"
                 + (" + fp32 masters" if e.nvme_masters else ""), e.nvme_bytes_needed,
                 e.nvme_memory_bytes, e.nvme_fits)] if e.nvme_adam else []),
        f"GPU (STRONGHOLD, window_size={e.window_size})",
        row(f"window ({e.window_size + 1} units, largest {e.gpu_slot_bytes / MiB:.1f} MiB)", e.gpu_window_bytes),
        row("gradient buffers in flight (K)", e.gpu_grad_buffer_bytes),
        row(outside, e.gpu_resident_bytes - e.gpu_split_bytes),
        *([row(f"resident units of the split ({e.resident_units}: params+grads+Adam)", e.gpu_split_bytes)]
          if e.resident_units else []),
        row(f"block activations ({'checkpointed' if e.gradient_checkpointing else 'all stored'}"
            + (", offloaded" if e.offload_activations else "") + ")", e.gpu_block_activation_bytes),
        row(loss, e.gpu_head_activation_bytes),
        row(f"workspace ({GPU_WORKSPACE_FIXED_BYTES / GiB:.1f} GiB + {GPU_WORKSPACE_PERCENT}%)", e.gpu_workspace_bytes),
        total("total", e.gpu_bytes_needed, e.gpu_memory_bytes, e.gpu_fits),
        f"  largest window_size that fits: {'unknown' if e.max_window_size is None else e.max_window_size}",
        "Plain training (everything on the GPU)",
        row(f"params+grads+Adam ({e.total_params / 1e9:.3f} B x {16 if c == 4 else 18} B)", e.plain_state_bytes),
        row("activations (blocks, whole logits)", e.plain_gpu_bytes_needed - e.plain_state_bytes
            - e.plain_workspace_bytes),
        row(f"workspace ({GPU_WORKSPACE_FIXED_BYTES / GiB:.1f} GiB + {GPU_WORKSPACE_PERCENT}%)", e.plain_workspace_bytes),
        total("total", e.plain_gpu_bytes_needed, e.gpu_memory_bytes, e.plain_fits),
        f"STRONGHOLD: {'fits' if e.fits else 'does NOT fit'}; plain training: {_verdict(e.plain_fits)}",
    ]
    lines += [f"note: {note}" for note in e.notes]
    return "\n".join(lines)


def _parse_bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not true or false")


def _parse_auto_bool(text: str) -> bool | str:
    return "auto" if str(text).strip().lower() == "auto" else _parse_bool(text)


def _parse_resident(text: str) -> int | bool | str:
    value = text.strip().lower()
    if value in ("auto", "false"):
        return "auto" if value == "auto" else False
    if value.isdigit():
        return int(value)
    raise ValueError(text)


def _arg_type(parse: Any, name: str) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (TypeError, ValueError) as err:  # argparse prints these as "argument --x: ..."
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = name
    return convert


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stronghold_hf.estimate",
        description="Estimate CPU RAM and GPU memory for STRONGHOLD training (and plain training) of a HF model "
        "config. Memory sizes are binary: GB = GiB = 2**30. The last output line is one JSON object.",
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model_type", help="a transformers model type, e.g. gpt2, llama, t5")
    src.add_argument("--config_name", help="a local config dir or config.json")
    parser.add_argument("--config_overrides", help='run_clm-style "k=v,k=v", e.g. "n_embd=2048,n_layer=100"')
    parser.add_argument("--seq_len", type=int, required=True)
    parser.add_argument("--decoder_seq_len", type=int, help="target length for encoder-decoder models (default seq_len)")
    parser.add_argument("--batch_size", type=int, required=True, help="per-device batch size")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    memory = _arg_type(parse_memory, "memory size")
    parser.add_argument("--gpu_memory", type=memory, required=True, help="GPU memory, e.g. 32GB")
    parser.add_argument("--cpu_memory", type=memory, required=True, help="host RAM, e.g. 90GB")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--window_size", type=_arg_type(parse_window_size, "window size"), default="auto", help="auto (default) or an int >= 1")
    parser.add_argument("--auto_class", choices=sorted(_AUTO_CLASSES), help="which Auto class builds the model")
    flag = _arg_type(_parse_bool, "true or false")
    parser.add_argument("--offload_non_block", type=flag, default=True,
                        help="true (default): embeddings, norms and heads are offloaded like blocks; false: they stay "
                        "on the GPU with a device AdamW")
    parser.add_argument("--chunked_loss", type=_arg_type(_parse_auto_bool, "auto, true or false"), default="auto",
                        help="auto (default: unless the split keeps the whole model on the GPU) or true: causal LMs "
                        "compute the head and loss in chunks; false: whole logits")
    parser.add_argument("--offload_activations", type=_arg_type(_parse_auto_bool, "auto, true or false"),
                        default="auto", help="auto (default: when the GPU would not fit otherwise), true or false")
    parser.add_argument("--grad_buffers", type=int, default=2, help="K, gradient buffers in flight (default 2)")
    parser.add_argument("--host_memory", default="exact", choices=["exact", "lean"],
                        help="exact: fp32 Adam moments (default); lean: 8-bit moments (--optim adamw_8bit)")
    parser.add_argument("--host_grads", default="auto", choices=["auto", "fp32", "compute"],
                        help="host gradients of bf16 units: auto (default: bf16 when --gradient_accumulation_steps "
                        "is 1), fp32, or compute (bf16)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1,
                        help="backward passes per step (default 1); above 1 host gradients are fp32")
    parser.add_argument("--host_image", type=_arg_type(_parse_auto_bool, "auto, true or false"), default="auto",
                        help="keep the pinned bf16/fp16 image on the host (2 B/param): auto (default: unless the RAM "
                        "would not hold it), true or false")
    parser.add_argument("--nvme_memory", type=memory, default=None,
                        help="disk space for the NVMe tier (nvme_path), e.g. 2TB: the Adam moments go there when the "
                        "RAM would not hold them, then the fp32 masters")
    parser.add_argument("--nvme_masters", type=_arg_type(_parse_auto_bool, "auto, true or false"), default="auto",
                        help="the fp32 masters on disk too (nvme_masters): auto (default: when the RAM would not hold "
                        "them with the moments on disk), true or false")
    parser.add_argument("--resident", type=_arg_type(_parse_resident, "auto, an int >= 0 or false"), default="auto",
                        help="the device/host split (StrongholdConfig.resident): auto (default: what fits in the GPU "
                        "less the engine's reserve stays there), N blocks, or false (everything streams)")
    parser.add_argument("--resident_budget", type=memory, default=None,
                        help="StrongholdConfig.gpu_memory: the GPU bytes the split may fill (default: the GPU less "
                        "the reserve)")
    parser.add_argument("--check", action="store_true", help="exit with status 3 when STRONGHOLD does not fit")
    args = parser.parse_args(argv)

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the CLI's output is the table, not build-time warnings
    try:
        config = load_config(args.model_type, args.config_name, args.config_overrides)
        result = estimate(
            config, seq_len=args.seq_len, batch_size=args.batch_size, dtype=args.dtype,
            gpu_memory_bytes=args.gpu_memory, cpu_memory_bytes=args.cpu_memory,
            gradient_checkpointing=args.gradient_checkpointing, window_size=args.window_size,
            auto_class=args.auto_class, decoder_seq_len=args.decoder_seq_len, grad_buffers=args.grad_buffers,
            offload_non_block=args.offload_non_block, chunked_loss=args.chunked_loss,
            offload_activations=args.offload_activations, host_memory=args.host_memory,
            host_image=args.host_image, host_grads=args.host_grads,
            gradient_accumulation_steps=args.gradient_accumulation_steps, nvme_memory_bytes=args.nvme_memory,
            nvme_masters=args.nvme_masters, resident=args.resident, resident_budget_bytes=args.resident_budget,
        )
    except (ValueError, OSError, KeyError) as err:
        parser.error(str(err))
    print(result.table())
    print(json.dumps(result.to_dict(), sort_keys=True))
    return 3 if args.check and not result.fits else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "Estimate", "estimate", "estimate_for_model", "check_fits", "layer_activation_bytes", "parse_memory",
    "available_cpu_memory_bytes", "build_meta_model", "load_config", "main",
]
