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
Transformer Models" (arXiv:2205.05198), section 4.1, broken into the tensors that hold them
(`layer_memory`): per token, the attention block saves its normed input, Q, K and V, and the
output projection's input (with SDPA and flash attention a view of the kernel's output); the
MLP its input and (4 for gated MLPs such as SwiGLU, else 2) ``ffn``-wide tensors; the two
norms their inputs (RMS norms as transformers writes them also an fp32 copy and the
normalized values). *Which attention runs* decides the rest:
eager attention stores the ``a x s x s`` softmax (and its dropout output) and backward holds
its gradient; SDPA and flash attention store no ``s x s`` term, only their output and an fp32
log-sum-exp per head and token. Dropout masks (1 byte) count only when the config has
dropout. The *transient* of a layer's backward (what exists beyond the saved tensors while it
runs: the gradients flowing through the MLP or the attention core, and the layer's input and
output gradients) counts too, since with checkpointing one layer is recomputed and
backpropagated at a time. Sequence tiling (tiling.py) keeps the MLP's ``ffn``-wide tensors to
one tile of ``T`` tokens. Decoder layers of encoder-decoder models add a cross-attention block
(its Q path on the target length, K/V on the source length).
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
#: Kernel workspaces (cuBLAS, attention kernels) as a share of what the run holds; the CUDA
#: context and fragmentation are the device reserve's (``config.device_reserve_bytes``).
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
    trainable_tensors: int = 0  # how many trainable parameters (the NVMe tier cuts one vocabulary tensor with its masters)
    # One [rows, width] weight that embeddings and linear layers use (vocab_pieces.py can read it
    # in row pieces); 0 for any other unit.
    vocab_rows: int = 0
    vocab_width: int = 0


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
    from ..vocab_pieces import shape_problem

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
        first = spec.params[0][1]
        vocab = spec.kind == "streamed" and shape_problem([p for _, p in spec.params], spec.owners) is None
        units.append(_Unit(
            kind=spec.kind, params=sum(p.numel() for _, p in spec.params), trainable=sum(p.numel() for p in trainable),
            trainable_tensors=len(trainable), vocab_rows=first.shape[0] if vocab else 0,
            vocab_width=first.shape[1] if vocab else 0,
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


#: Attention implementations the estimator knows (transformers' ``attn_implementation``).
ATTENTION_KINDS = ("eager", "sdpa", "flash_attention_2")

def mlp_tile_tokens(sequence_tiling: bool | str, tile_tokens: int | str, seq_len: int, batch: int,
                    saved_per_token: int) -> int | None:
    """The tile tiling.py gives an MLP that saves ``saved_per_token`` bytes per token beyond its
    input, in a run of ``seq_len`` tokens (None: it runs untiled). ``"auto"`` tiles above
    ``AUTO_MIN_SEQUENCE`` tokens, in tiles that save about ``AUTO_TILE_BYTES``."""
    from ..tiling import AUTO_MIN_SEQUENCE, AUTO_TILE_BYTES, AUTO_TILE_MAX, AUTO_TILE_MIN

    if sequence_tiling is False or (sequence_tiling == "auto" and seq_len <= AUTO_MIN_SEQUENCE):
        return None
    if tile_tokens == "auto":
        tile = AUTO_TILE_BYTES // max(saved_per_token * batch, 1)
        tile = max(AUTO_TILE_MIN, min(AUTO_TILE_MAX, tile))
    else:
        tile = int(tile_tokens)
    return tile if tile < seq_len else None


def query_tile_tokens(tile_tokens: int | str, seq_len: int) -> int | None:
    """The query tile query_tiling.py gives a run of ``seq_len`` tokens (None: one tile, untiled)."""
    from ..query_tiling import resolve_query_tile_tokens

    tile = resolve_query_tile_tokens(tile_tokens)
    return tile if tile < seq_len else None


def lower_right_mask_bytes(device_type: str, nbytes: int, heads: int, kv_heads: int | None, head_dim: int) -> int:
    """Bytes per (query, key) pair one query tile's attention materializes for its causal mask.

    query_tiling.py hands SDPA torch's lower-right `CausalBias` (a tile's queries are the last
    of the keys). torch runs it without a mask where a kernel takes the alignment as a flag:
    CUDA's flash attention (16-bit, heads up to 256 wide, grouped heads too) and its
    memory-efficient kernel (not with grouped heads). Elsewhere (the CPU; CUDA in fp32 with
    grouped heads) it builds the bool mask, ``tile x keys``, which SDPA turns into an additive
    mask of the query's dtype: ``1 + nbytes``. On CUDA that fallback is also the math kernel,
    which holds the scores and their softmax (``2 x heads x nbytes`` more; not yet measured)."""
    grouped = (kv_heads or heads) != heads
    if device_type == "cuda":
        if (nbytes == 2 and head_dim <= 256) or not grouped:
            return 0
        return 1 + nbytes + 2 * heads * nbytes
    return 1 + nbytes


#: Activation functions transformers writes as several ops, and the ffn-wide tensors each saves
#: for backward beyond its input (``gelu_new``: tanh's output, ``0.5 * x`` and ``1 + tanh``).
_ACTIVATION_SAVES = {"gelu_new": 3, "gelu_fast": 3, "quick_gelu": 1, "gelu_python": 2}


def activation_saves(config) -> int:
    """`layer_memory`'s ``activation_saves`` for a model config (0: a native activation)."""
    name = next((getattr(config, f) for f in ("hidden_act", "hidden_activation", "activation_function", "dense_act_fn")
                 if isinstance(getattr(config, f, None), str)), None)
    return _ACTIVATION_SAVES.get(str(name), 0)


def uses_rotary(config) -> bool:
    """Whether the model applies rotary position embeddings to Q and K."""
    return any(getattr(config, f, None) is not None for f in ("rope_theta", "rope_parameters", "rope_scaling",
                                                               "rotary_dim", "rotary_pct")) or (
        getattr(config, "position_embedding_type", None) == "rotary")


def attention_kind(implementation: str | None) -> str:
    """transformers' ``attn_implementation`` as one of `ATTENTION_KINDS`: every kernel that
    stores no ``s x s`` scores (flash 2 or 3, flex, the kernels hub's) counts as flash/SDPA."""
    name = (implementation or "eager").lower()
    if name == "eager":
        return "eager"
    return "flash_attention_2" if "flash" in name else "sdpa"


@dataclass(frozen=True, slots=True)
class LayerMemory:
    """What one transformer layer holds, in bytes: ``saved`` for its backward (all of it kept
    between forward and backward without checkpointing; held during its recompute with it),
    ``transient`` on top of that while its backward runs, and the group of tensors that is
    the largest part of the two (``largest``: its name and bytes)."""

    saved: int
    transient: int
    largest: tuple[str, int]

    @property
    def peak(self) -> int:
        """Saved plus transient: one layer's recompute and backward at their height."""
        return self.saved + self.transient


def layer_memory(
    s: int, b: int, h: int, a: int, *, nbytes: int, ffn: int | None = None, head_dim: int | None = None,
    kv_heads: int | None = None, gated_mlp: bool = False, cross_attention: bool = False, s_kv: int | None = None,
    attention: str = "eager", dropout: bool = True, tile_tokens: int | None = None, rotary: bool = False,
    activation_saves: int = 0, attention_tiling: bool = False, mask_pair_bytes: int = 0, rms_norm: bool = False,
) -> LayerMemory:
    """One transformer layer's activations (Korthikanti et al. 2022, generalised; see the
    module docstring). ``attention``: one of `ATTENTION_KINDS`; ``tile_tokens``: the MLP runs
    in tiles of that many tokens (tiling.py), ``None``: untiled; ``rotary``: rotary position
    embeddings (the layer saves nothing for them: ``q * cos`` keeps only ``cos``, which needs no
    gradient; the model's cos and sin, shared by every layer, are budget.py's); ``rms_norm``:
    RMS norms as transformers writes them (Llama, Qwen2, Mistral, Gemma, T5): each keeps its
    input upcast to fp32 and the normalized values, ``4 + c`` per element, where a native layer
    norm keeps its input (``c``);
    ``activation_saves``: the ``ffn``-wide tensors an activation function written as several
    ops saves beyond its input (`activation_saves`: 3 for ``gelu_new``, 0 for native ones).
    ``attention_tiling``: the whole causal block in query tiles of ``tile_tokens`` against the
    keys and values of the tokens before (``StrongholdConfig.attention_tiling``,
    query_tiling.py): per token only the block's input, K and V stay between its forward and
    backward; its backward adds the output and input gradients, fp32 sums of K's and V's
    gradients, and, per tile, the gradient of the K and V it attends to (the prefix is joined in
    place, not copied); ``mask_pair_bytes``: what a tile's attention materializes per (query, key) pair
    for its causal mask (`lower_right_mask_bytes`), at its height the last tile's, ``tile x s``.

    With ``nbytes=2``, ``ffn=4h``, plain MHA, eager attention and dropout, ``saved`` is exactly
    ``s*b*h*(34 + 5*a*s/h)``."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention={attention!r}; use one of {ATTENTION_KINDS}.")
    ffn = 4 * h if ffn is None else ffn
    d = head_dim or h // a
    q, kv = a * d, (kv_heads or a) * d
    sb = s * b
    c = nbytes
    eager = attention == "eager"
    mask = 1 if dropout else 0
    # Saved for backward, by group: bytes.
    tiled = tile_tokens is not None and tile_tokens < s
    rms_whole = rms_norm and not tiled  # sequence tiling tiles an RMS norm too: it keeps its input
    groups = {
        ("norm inputs and normalized values (2 x hidden)" if rms_whole else "norm inputs (2 x hidden)"):
            2 * sb * h * ((4 + c) if rms_whole else c),
        "attention input and Q, K, V": sb * (h + q + 2 * kv) * c,
    }
    if eager:  # the softmax output and its dropout output are stored, plus the dropout mask
        groups["attention scores (heads x s x s)"] = a * s * s * b * (2 * c + mask)
        groups["attention output (o_proj input)"] = sb * q * c
    else:
        # The kernel keeps its output and an fp32 log-sum-exp per head and token; its output,
        # laid out token-major, is the o_proj input too (a view, not a copy).
        groups["attention kernel output and log-sum-exp"] = sb * (q * c + 4 * a)
    wide = ((4 if gated_mlp else 2) + activation_saves) * ffn
    if tiled:  # the input whole, the ffn-wide tensors per tile
        groups["MLP input (tiled: one tile's ffn-wide tensors)"] = sb * h * c + tile_tokens * b * (h + wide) * c
    else:
        groups[f"MLP input and {'4' if gated_mlp else '2'} x ffn-wide tensors"] = sb * (h + wide) * c
    groups["dropout masks"] = 2 * sb * h * mask
    if cross_attention:
        s_kv = s if s_kv is None else s_kv
        x = {
            "cross-attention Q path and norm": sb * (h + 2 * q + h) * c + sb * h * mask,
            "cross-attention K, V": 2 * s_kv * b * kv * c,
        }
        if eager:
            x["cross-attention scores"] = a * s * s_kv * b * (2 * c + mask)
        else:
            x["cross-attention kernel output"] = sb * (q * c + 4 * a)
        groups.update(x)
    if attention_tiling and tile_tokens is not None and tile_tokens < s and not eager and not cross_attention:
        t = tile_tokens * b
        groups = {
            "the block input, K and V (whole)": sb * (h + 2 * kv) * c,
            "one query tile of the block": t * (4 * h + 3 * q + 2 * kv + wide) * c,
        }
        saved = sum(groups.values())
        # dY and dX; fp32 sums of dK, dV; the gradient of a tile's joined K, V (the join itself is
        # in place: query_tiling._JoinInPlace); the tile's own backward (its attention core's, or
        # its MLP's ffn-wide gradients).
        # The causal mask a tile materializes (mask_pair_bytes): whole, bool and additive, while
        # the tile's attention runs forward; in backward only the additive mask the kernel's
        # backward reads is left beside the whole-length gradients (measured on the CPU, RSS of
        # a child: within 5% at tiles of 1024 and 2048 tokens).
        mask = t * s * mask_pair_bytes
        grads = (2 * sb * h * c + sb * 2 * kv * (4 + c)
                 + t * max(2 * q + 2 * kv, (2 if gated_mlp else 1) * ffn) * c)
        transient = max(mask, grads + t * s * max(mask_pair_bytes - 1, 0))
        name, largest = max(groups.items(), key=lambda kv_: kv_[1])
        if mask > max(largest, grads):
            name, largest = "a query tile's materialized causal mask (tile x s)", mask
        elif transient > largest:
            name, largest = "the backward's gradients of the block input and output, K and V (whole)", transient
        return LayerMemory(saved=saved, transient=transient, largest=(name, largest))
    saved = sum(groups.values())
    # The backward's working set beyond the saved tensors: the layer's output gradient and its
    # input gradient throughout, and at its height either the MLP's gradients or the attention
    # core's (dO and dQ, dK, dV; eager also the scores' gradient and the softmax backward's
    # temporary). The MLP's: as each op's backward runs, the tensors it saved are freed, so
    # beyond the saved ones it holds two ffn-wide gradients at once when gated (the gate's and
    # the up projection's), one otherwise; one tile of them when tiled.
    mlp_tokens = tile_tokens if tile_tokens is not None and tile_tokens < s else s
    mlp_bwd = mlp_tokens * b * (2 if gated_mlp else 1) * ffn * c
    attn_bwd = sb * (2 * q + 2 * kv) * c + (2 * a * s * s * b * c if eager else 0)
    transient = 2 * sb * h * c + max(mlp_bwd, attn_bwd)
    name, nbytes_largest = max(groups.items(), key=lambda kv_: kv_[1])
    if max(mlp_bwd, attn_bwd) > nbytes_largest:
        name = ("the MLP's gradients (ffn-wide)" if mlp_bwd >= attn_bwd else
                "the attention core's gradients" + (" (s x s scores)" if eager else ""))
        nbytes_largest = max(mlp_bwd, attn_bwd)
    return LayerMemory(saved=saved, transient=transient, largest=(name, nbytes_largest))


def layer_activation_bytes(
    s: int, b: int, h: int, a: int, *, nbytes: int, ffn: int | None = None, head_dim: int | None = None,
    kv_heads: int | None = None, gated_mlp: bool = False, cross_attention: bool = False, s_kv: int | None = None,
    attention: str = "eager", dropout: bool = True,
) -> int:
    """Bytes one transformer layer saves for backward (`layer_memory`'s ``saved``).

    With ``nbytes=2``, ``ffn=4h``, plain MHA, eager attention and dropout this is exactly
    ``s*b*h*(34 + 5*a*s/h)``.
    """
    return layer_memory(s, b, h, a, nbytes=nbytes, ffn=ffn, head_dim=head_dim, kv_heads=kv_heads, gated_mlp=gated_mlp,
                        cross_attention=cross_attention, s_kv=s_kv, attention=attention, dropout=dropout).saved
