"""The byte model's ground floor: what a model is, unit by unit, and what each part costs.

`_count` lays a model out the way the engine does (``discovery.plan_units``: the blocks, the
large groups outside them that stream, the resident rest) and prices each unit for a compute
dtype: its device slot, its gradient buffer, its host state (fp32 master, gradient, Adam
moments, pinned image). `layer_activation_bytes` prices one transformer layer's saved
activations. The per-element costs and fixed allowances (`ADAM_STATE_BYTES`,
`GPU_WORKSPACE_FIXED_BYTES`, ...) live here too, because the budget (budget.py), the report
(report.py) and the engine's own ``host_image="auto"`` check (window.py) all read them; this
module imports nothing else of the estimator.

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
layer norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..discovery import find_block_stacks

GiB = 2**30
MiB = 2**20

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
CPU_PROCESS_BYTES = 2 * GiB
GPU_WORKSPACE_FIXED_BYTES = 3 * GiB // 2
GPU_WORKSPACE_PERCENT = 5
LOGIT_BYTES = 12  # per logit, see budget.py's docstring
_NBYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_GATED_MLP_NAMES = ("gate_proj", "gate_up_proj", "wi_0", "w3")


def _lean_adam_bytes(numel: int) -> int:
    """Adam state of one tensor under ``host_memory="lean"`` (optim/quant8.py): two uint8 codes
    per element and an fp32 absmax per block of 256 for each moment; small tensors stay fp32."""
    from ..optim import quant8

    if numel < quant8.MIN_8BIT_NUMEL:
        return ADAM_STATE_BYTES * numel
    return 2 * numel + 2 * 4 * quant8.num_blocks(numel)


def _gib(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else f"{nbytes / GiB:.2f} GiB"


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
    from ..chunked_loss import analyse_causal_lm, is_causal_lm_class
    from ..discovery import plan_units, unit_device_dtype

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
