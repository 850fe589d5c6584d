"""The estimator's two ways in: a config (`estimate`) or a live model (`estimate_for_model`).

`estimate` builds the config's model on the meta device (meta.py) and takes the machine's
sizes from its caller; `estimate_for_model` reads a model the Trainer is about to offload and
fills in what it was not told from the machine it runs on (free GPU memory, available RAM
plus what the model's parameters already hold). Both then hand the model to the byte model
(`_estimate_built`: counts.py's units, budget.py's sums, for each split `_with_split` tries).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .. import memory
from ..config import parse_dtype, parse_memory
from .budget import _assemble, _with_split
from .counts import ATTENTION_KINDS, _NBYTES, _count, _gib, attention_kind
from .meta import build_meta_model
from .report import Estimate

_DTYPE_LABEL = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def available_cpu_memory_bytes() -> int | None:
    """Available host RAM (`memory.available_host_bytes`: psutil, else /proc/meminfo)."""
    return memory.available_host_bytes()


def _dtype_label(dtype: str | torch.dtype) -> str:
    return _DTYPE_LABEL[parse_dtype(dtype, field_name="dtype")]


def _device_type(device: torch.device | str | int | None) -> str:
    """The type of ``device`` (an int is a CUDA index; None: CUDA where there is one)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if isinstance(device, int) else torch.device(device).type


def _estimate_built(
    model: nn.Module, config: Any, label: str, block_classes: Sequence[str] | None, *, window_size: int | str | None,
    gpu_memory_bytes: int | None, grad_buffers: int, offload_non_block: bool, resident: int | bool | str,
    resident_budget_bytes: int | None, notes: Sequence[str] = (), attn_implementation: str | None = None,
    sequence_tiling: bool | str = "auto", tile_tokens: int | str = "auto", **options: Any,
) -> Estimate:
    """`_assemble` over ``model``'s units, for each split `_with_split` tries (none, then the
    engine's); ``options``: the rest of `_assemble`'s keywords, as the caller resolved them.
    ``attn_implementation=None``: what the model runs (``config._attn_implementation``, which
    transformers sets for the class: SDPA where it supports it)."""
    classes = tuple(block_classes) if block_classes else None
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    if attn_implementation is not None and attn_implementation not in ATTENTION_KINDS:
        raise ValueError(f"attn_implementation={attn_implementation!r}; use one of {ATTENTION_KINDS} (or None: the "
                         "model's own).")
    attention = attention_kind(attn_implementation or getattr(config, "_attn_implementation", None))
    options.update(attention=attention, sequence_tiling=sequence_tiling, tile_tokens=tile_tokens)
    notes = list(notes)
    if options.get("attention_tiling"):
        from ..query_tiling import causal_attention

        if not causal_attention(model):  # the engine's probe would leave these blocks whole
            options["attention_tiling"] = False
            notes.append("attention_tiling: the blocks' attention is not causal; counted whole, as the engine runs them")

    def assemble(split):
        counts = _count(model, classes, encoder_decoder, _NBYTES[label], offload_non_block,
                        keep=split.kept_param_ids if split is not None else frozenset())
        return _assemble(counts, config, model_name=type(model).__name__, dtype=label, window_size=window_size,
                         gpu_memory_bytes=gpu_memory_bytes, grad_buffers=grad_buffers, notes=list(notes),
                         offload_non_block=offload_non_block, split=split, **options)

    return _with_split(model, classes, _NBYTES[label], assemble, offload_non_block=offload_non_block,
                       resident=resident, gpu_memory_bytes=gpu_memory_bytes, window_size=window_size,
                       grad_buffers=grad_buffers, budget=resident_budget_bytes)


def estimate(
    model_config: Any, *, seq_len: int, batch_size: int, dtype: str = "fp32", gpu_memory_bytes: int,
    cpu_memory_bytes: int, gradient_checkpointing: bool = False, window_size: int | str | None = None,
    auto_class: Any = None, decoder_seq_len: int | None = None, block_classes: Sequence[str] | None = None,
    grad_buffers: int = 2, offload_non_block: bool = True, chunked_loss: bool | str = "auto",
    offload_activations: bool | str = "auto", loss_chunk_tokens: int | str = "auto", host_memory: str = "exact",
    host_image: bool | str = "auto", host_grads: str = "auto", gradient_accumulation_steps: int = 1,
    nvme_memory_bytes: int | str | None = None, nvme: bool | str = "auto", nvme_masters: bool | str = "auto",
    resident: int | bool | str = False, resident_budget_bytes: int | str | None = None,
    attn_implementation: str | None = None, sequence_tiling: bool | str = "auto", tile_tokens: int | str = "auto",
    attention_tiling: bool = False, cpu_reserve: int | str = "auto", gpu_reserve: int | str = "auto",
    nvme_activations: bool | str = "auto", device_checkpoints: int | str = "auto", device: str = "cuda",
    vocab_pieces: bool = True, head_lent_whole: bool = False,
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
    too when it still would not (``nvme_masters="auto"``; True: always, False: never); the
    offloaded checkpointed activations go to disk with the moments when the RAM would still not
    hold them, before the masters (``nvme_activations="auto"``; True: always, False: never).
    ``resident`` and ``resident_budget_bytes`` are `StrongholdConfig`'s ``resident`` and
    ``gpu_memory`` (``None``: the GPU's memory less the engine's reserve): the units the split
    keeps on the GPU (split.py) count there with their AdamW state, not on the host. Only fp32
    trainable parameters can be resident, so a ``dtype`` other than fp32 (the model taken as
    loaded in it) keeps everything streaming, as the engine would. ``attn_implementation``:
    the attention that runs (``None``: what transformers picks for the model class; eager
    attention stores ``s x s`` scores, SDPA and flash attention do not). ``sequence_tiling``,
    ``tile_tokens``: `StrongholdConfig`'s (the MLP in tiles of ``T`` tokens).
    ``attention_tiling``: `StrongholdConfig`'s (each causal block in query tiles, counts.layer_memory);
    ``device_checkpoints``: `StrongholdConfig`'s (offloaded checkpointed inputs kept at the turn).
    ``cpu_reserve``, ``gpu_reserve``: `StrongholdConfig`'s headroom ("fits" keeps them free).
    ``vocab_pieces``: `StrongholdConfig`'s (a vocabulary-sized unit on the device a row piece at a
    time, outside the window). ``head_lent_whole``: a forward reads the LM head's weight itself
    (TRL's fused LM head, Liger's fused linear cross-entropy), so the head is on the device
    whole, with its gradient, from that forward to the end of its backward.
    ``device``: the type of device the engine computes on, ``"cuda"`` or ``"cpu"``: which
    attention kernels run there (a query tile's causal mask is materialized on the CPU,
    counts.lower_right_mask_bytes).
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}; use \"cuda\" or \"cpu\" (the type of device the engine computes on).")
    model = build_meta_model(model_config, auto_class)
    label = _dtype_label(dtype)
    if label != "fp32":
        model.to(parse_dtype(label, field_name="dtype"))
    return _estimate_built(
        model, model_config, label, block_classes, window_size=window_size,
        gpu_memory_bytes=parse_memory(gpu_memory_bytes), grad_buffers=grad_buffers,
        offload_non_block=offload_non_block, resident=resident,
        resident_budget_bytes=None if resident_budget_bytes is None else parse_memory(resident_budget_bytes),
        attn_implementation=attn_implementation, sequence_tiling=sequence_tiling, tile_tokens=tile_tokens,
        attention_tiling=attention_tiling, device_checkpoints=device_checkpoints, cpu_reserve=cpu_reserve,
        gpu_reserve=gpu_reserve, seq_len=seq_len, batch_size=batch_size, gradient_checkpointing=gradient_checkpointing,
        cpu_memory_bytes=parse_memory(cpu_memory_bytes), decoder_seq_len=decoder_seq_len, chunked_loss=chunked_loss,
        offload_activations=offload_activations, loss_chunk_tokens=loss_chunk_tokens, host_memory=host_memory,
        host_image=host_image, host_grads=host_grads, gradient_accumulation_steps=gradient_accumulation_steps,
        nvme_memory_bytes=None if nvme_memory_bytes is None else parse_memory(nvme_memory_bytes),
        nvme=nvme, nvme_masters=nvme_masters, nvme_activations=nvme_activations, device_type=device,
        vocab_pieces=vocab_pieces, head_lent_whole=head_lent_whole,
    )


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
    attn_implementation: str | None = None, sequence_tiling: bool | str = "auto", tile_tokens: int | str = "auto",
    attention_tiling: bool = False, cpu_reserve: int | str = "auto", gpu_reserve: int | str = "auto",
    nvme_activations: bool | str = "auto", device_checkpoints: int | str = "auto", vocab_pieces: bool = True,
    head_lent_whole: bool = False,
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

    return _estimate_built(
        model, config, label, block_classes, window_size=window_size, gpu_memory_bytes=gpu_memory_bytes,
        grad_buffers=grad_buffers, offload_non_block=offload_non_block, resident=resident,
        resident_budget_bytes=resident_budget_bytes, notes=notes, attn_implementation=attn_implementation,
        sequence_tiling=sequence_tiling, tile_tokens=tile_tokens, attention_tiling=attention_tiling,
        device_checkpoints=device_checkpoints, cpu_reserve=cpu_reserve, gpu_reserve=gpu_reserve, seq_len=seq_len, batch_size=batch_size,
        gradient_checkpointing=gradient_checkpointing, cpu_memory_bytes=cpu_memory_bytes,
        decoder_seq_len=decoder_seq_len, chunked_loss=chunked_loss, offload_activations=offload_activations,
        loss_chunk_tokens=loss_chunk_tokens, host_memory=host_memory, host_image=host_image, host_grads=host_grads,
        gradient_accumulation_steps=gradient_accumulation_steps, nvme_memory_bytes=nvme_memory_bytes, nvme=nvme,
        nvme_ring_buffers=nvme_ring_buffers, nvme_masters=nvme_masters, nvme_activations=nvme_activations,
        device_type=_device_type(device), vocab_pieces=vocab_pieces, head_lent_whole=head_lent_whole,
    )
