"""The byte model: from a model's counted units to every byte a run needs, host and device.

`_assemble` turns the counts of counts.py into an `Estimate` for one configuration: it
resolves what ``"auto"`` would choose (the image, the NVMe tier, activation offload), sums
the host and device bytes and finds the largest window that fits. `_with_split` runs it for
the device/host split the engine would keep (split.py).

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
  unit, one of each rest unit. With activation offload, host buffers for the checkpointed
  inputs. Plus a fixed process allowance (`CPU_PROCESS_BYTES`). This is what the engine's
  memory ledger books (a test holds the two within 5%).
* GPU, what the engine owns (the ledger's ``device_peak_bytes``, within 5%): the window, the
  most any ``W + 1`` consecutive positions of the sequence hold (a tied embedding counts at
  both ends); ``K`` gradient lanes of the largest trainable streamed unit; the rest units
  and their gradient buffers. With ``offload_non_block=False`` the parameters outside the
  blocks stay on the GPU instead, with a device AdamW at 16 B/param (18 under mixed precision:
  HF keeps them fp32 and autocast adds a compute copy).
* GPU, what autograd holds: the block activations (counts.py) and the loss. A causal LM whose head
  the chunked loss reproduces (``chunked_loss.py``) holds one chunk of logits at 16 B per logit
  and, in backward, the head's gradient summed in fp32 (``V x H x 4``, and its cast back when
  the head computes in 16 bits); otherwise (or when one chunk would hold every token, where
  the engine runs the plain loss) the whole logits at 12 B per logit (compute-dtype logits,
  the fp32 log-softmax saved for backward, the fp32 gradient, its cast back). Plus the final
  norm's input and output (an RMS norm's fp32 copy too, unless sequence tiling tiles it) and
  the gradient w.r.t. the head's input. The rotary embedding's cos and sin count once, for
  the whole step. A workspace allowance for kernels: `GPU_WORKSPACE_PERCENT`
  of everything else.
* Headroom (StrongholdConfig's ``cpu_reserve`` and ``gpu_reserve``, config.py): "fits" means
  the run's bytes plus the reserve fit, on each side; every "auto" choice (the image, the NVMe
  tiers, activation offload, the window) keeps the reserve free. The device reserve is where
  the CUDA context, library workspaces and fragmentation go; the host's is the rest of the
  machine (the OS, a desktop session, the page cache, data-loader workers).
* Plain training (everything on the GPU), for contrast: 16 B/param fp32, 18 B/param mixed
  precision, the same activations, the whole logits, and the workspace.

With gradient checkpointing each layer stores only its input (``s*b*h*c``) plus, during the
recompute, one layer's full activations; with activation offload only the inputs of the last
``W`` blocks and two in flight stay on the device, the rest wait in host memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import nn

from ..activations import DISK_RING  # nvme_activations: the writes in flight
from ..config import DEFAULT_WINDOW_SIZE, device_reserve_bytes, host_reserve_bytes, parse_window_size
from ..discovery import find_block_stacks
from ..transfer import FETCH_STAGING_BUFFERS  # host_image=False: the ring that replaces the image
from .counts import (
    ADAM_STATE_BYTES, CPU_PROCESS_BYTES, GPU_WORKSPACE_PERCENT, LOGIT_BYTES, _NBYTES,
    _Counts, _gib, activation_saves, layer_memory, lower_right_mask_bytes, mlp_tile_tokens, query_tile_tokens, uses_rotary,
)
from .report import Estimate


def _cfg(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


#: Config fields that carry a dropout probability: with any of them above 0 the masks are stored.
_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
                   "resid_pdrop", "attn_pdrop", "embd_pdrop", "dropout_rate", "dropout", "activation_dropout")


def _rms_norm(config: Any) -> bool:
    """Whether the model's norms are RMS norms (transformers names their epsilon so)."""
    return getattr(config, "rms_norm_eps", None) is not None or getattr(config, "model_type", "") in ("t5", "mt5", "umt5")


def _has_dropout(config: Any) -> bool:
    return any(isinstance(getattr(config, f, None), (int, float)) and getattr(config, f) > 0 for f in _DROPOUT_FIELDS)


def _workspace(other: int) -> int:
    return -(-other * GPU_WORKSPACE_PERCENT // 100)


class _Pieces(NamedTuple):
    """What `vocab_pieces` changes in the counts (vocab_pieces.py)."""

    counts: _Counts  # the units read in row pieces taken out of the sequence
    device_bytes: int  # the head's piece at its use: its rows, the next piece's on their way, its gradient
    # (the chunked loss's: an fp32 sum and its cast to the device dtype)
    host_staging: int  # pinned staging of the head's piece gradients when no lane carries them: two pieces' worth
    widened_grads: int  # bf16 host gradients of pieced units kept in fp32 instead: the bytes that adds
    plain_device_bytes: int = 0  # the same without the chunked loss: one product in the compute dtype, and its cast
    lent_whole_bytes: int = 0  # the head lent whole to a forward that reads its weight itself, with its gradient
    pieced: frozenset = frozenset()  # the indices of the units read in pieces (not in the window)


def _read_in_pieces(counts: _Counts, largest: int, c: int, head_lent_whole: bool = False) -> _Pieces:
    """The units `vocab_pieces` reads in row pieces, and what they hold: on the device the
    largest piece at its use (its rows, the next piece's on their way, and for a trainable
    unit its gradient's fp32 sum and that sum's cast: vocab_ops.py); on the host two pinned
    buffers of the head's piece gradient, used only when no lane's staging can carry it
    (`VocabularyPieces.add_piece_grad`; the embedding's rows come back unstaged), and fp32 host
    gradients where a tied unit's rows get two contributions ([Note: pieces' host gradient]).

    ``head_lent_whole``: a forward reads the head's weight itself (TRL's fused LM head, Liger's
    fused linear cross-entropy), so the head is lent whole from that forward to the end of its
    backward (`VocabularyPieces.lend_whole`): its copy stays on the device beside the window
    instead of a piece, and its gradient in the device dtype is there while it crosses to the
    host (counted throughout: a little more than the engine holds once the head is done)."""
    from ..vocab_pieces import piece_rows

    pieced, piece_bytes, plain_bytes, staging, widened, lent = set(), 0, 0, 0, 0, 0
    head = counts.sequence[-1] if counts.sequence else None  # the LM head (or a tied embedding's end)
    for i, u in enumerate(counts.units):
        if u.kind != "streamed" or not u.vocab_rows or u.params <= largest:
            continue
        pieced.add(i)
        if u.trainable and counts.sequence.count(i) > 1:  # tied: its bf16 host gradient becomes fp32, 2 B more each
            widened += u.trainable_image_bytes
        if i != head:
            continue  # an embedding alone sends the rows of a batch, not pieces
        if head_lent_whole:
            lent = u.device_bytes * (2 if u.trainable else 1)
            continue
        rows = piece_rows(u.vocab_rows, u.vocab_width, largest)
        element = u.device_bytes // u.params  # the unit's device dtype (an fp32 embedding under bf16 autocast)
        piece = rows * u.vocab_width * element
        # The gradient: its fp32 sum, and the sum's cast to the device dtype (none in fp32); without
        # the chunked loss one product in the compute dtype, and its cast (vocab_ops.py).
        grad = (rows * u.vocab_width * 4 + (piece if element != 4 else 0)) if u.trainable else 0
        plain = (rows * u.vocab_width * c + (piece if element != c else 0)) if u.trainable else 0
        # The piece, the next one on its way ([Note: piece prefetch]), and the piece's gradient.
        piece_bytes, plain_bytes = 2 * piece + grad, 2 * piece + plain
        if u.trainable:
            staging = 2 * piece
    sequence: list[int] = []
    for i in counts.sequence:
        if i not in pieced and (not sequence or sequence[-1] != i):
            sequence.append(i)
    return _Pieces(dataclasses.replace(counts, sequence=tuple(sequence)), piece_bytes, staging, widened, plain_bytes,
                   lent, frozenset(pieced))


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
    attention: str = "eager", sequence_tiling: bool | str = "auto", tile_tokens: int | str = "auto",
    attention_tiling: bool = False, device_checkpoints: int | str = "auto", cpu_reserve: int | str = "auto", gpu_reserve: int | str = "auto",
    nvme_activations: bool | str = "auto", device_type: str = "cuda", vocab_pieces: bool = True,
    head_lent_whole: bool = False,
) -> Estimate:
    if nvme not in (True, False, "auto"):
        raise ValueError(f"nvme={nvme!r}; use \"auto\", True or False.")
    if nvme_activations not in (True, False, "auto"):
        raise ValueError(f"nvme_activations={nvme_activations!r}; use \"auto\", True or False.")
    if nvme_activations is True and nvme == "auto":
        nvme = True  # it needs nvme_path, which puts the moments on disk too
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
    cpu_res = host_reserve_bytes(cpu_reserve, cpu_memory_bytes)
    gpu_res = device_reserve_bytes(gpu_reserve, gpu_memory_bytes)
    # What the run may use on each side: the memory less the reserve (headroom).
    gpu_room = None if gpu_memory_bytes is None else gpu_memory_bytes - gpu_res
    cpu_room = None if cpu_memory_bytes is None else cpu_memory_bytes - cpu_res
    largest = max(layer.params for layer in counts.layers)
    # vocab_pieces (vocab_pieces.py): a vocabulary-sized unit leaves the window's sequence; on the
    # device it holds one piece of rows (and, trainable, the piece's gradient: its fp32 sum and
    # its cast) at a time.
    pieces = _read_in_pieces(counts, largest, c, head_lent_whole) if vocab_pieces else _Pieces(counts, 0, 0, 0)
    counts, piece_bytes, lent = pieces.counts, pieces.device_bytes, pieces.lent_whole_bytes
    if lent:
        notes.append(f"the LM head is lent whole ({_gib(lent)} on the device) from each forward that reads its "
                     "weight itself (TRL's fused LM head, Liger's fused cross-entropy) to the end of its backward")
    if not vocab_pieces:
        # Worth saying from two blocks up: a piece's fp32 gradient sum costs about what a
        # vocabulary of one or two blocks saves.
        whole = max((u.device_bytes for u in counts.units if u.kind == "streamed" and u.vocab_rows
                     and u.params >= 2 * largest), default=0)
        if whole:
            notes.append(f"a vocabulary-sized unit ({_gib(whole)} on the device) streams whole, two blocks or more: "
                         "StrongholdConfig(vocab_pieces=True) (--vocab_pieces true) reads it in pieces of a block")
    positions = len(counts.sequence)
    requested: int | str = "auto" if window_size in (None, "auto") else parse_window_size(window_size)
    w = min(DEFAULT_WINDOW_SIZE if requested == "auto" else requested, positions)
    if requested != "auto" and requested > positions:
        notes.append(f"window_size={requested} exceeds the {positions} streamed units; evaluated at {positions}")
    units = counts.units
    streamed = [u for i, u in enumerate(units) if u.kind != "rest" and i not in pieces.pieced]
    resident = [u for u in units if u.kind == "rest"]

    # CPU: every unit's host bytes (masters, gradients, Adam state, pinned images; frozen:
    # stored bytes), K pinned staging buffers of the largest streamed gradient, one for each
    # rest unit, the activation buffers, the process itself.
    trainable = sum(u.trainable for u in units)
    master = sum(4 * u.trainable for u in units)
    unit_adam = [u.lean_adam_bytes if host_memory == "lean" else ADAM_STATE_BYTES * u.trainable for u in units]
    adam = sum(unit_adam)
    image = sum(u.trainable_image_bytes for u in units)
    # bf16 host gradients (unit.py, [Note: host gradients in the compute dtype]): 2 B instead of
    # 4 for bf16 units, unless accumulation widens them to fp32.
    bf16_grads = dtype == "bf16" and host_grads != "fp32" and gradient_accumulation_steps == 1
    grad = 4 * trainable - (image - pieces.widened_grads if bf16_grads else 0)
    pinned = sum(u.image_bytes for u in units)
    # Without the image: two staging buffers of the largest block (larger units cross in pieces).
    ring = FETCH_STAGING_BUFFERS * max((u.trainable_image_bytes for u in units if u.kind == "block"),
                                       default=max((u.trainable_image_bytes for u in units), default=0))
    lane = max((u.grad_bytes for u in streamed), default=0)
    # Pinned gradient staging holds the largest block's gradient; larger units cross in pieces.
    block_lane = max((u.grad_bytes for u in streamed if u.kind == "block"), default=lane)
    # The head's piece gradients cross through the lanes' staging ([Note: vocabulary pieces
    # through the lanes] in grads.py); with no lane (nothing streamed trains), two buffers of their own.
    staging = grad_buffers * block_lane + len([u for u in resident if u.trainable]) * max(
        (u.grad_bytes for u in resident), default=0) + (0 if lane else pieces.host_staging)

    # Activations, from the config's shape.
    h = _cfg(config, "hidden_size", "d_model", "n_embd", "dim")
    a = _cfg(config, "num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
    full = ckpt = ckpt_offloaded = head = inputs_host = input_largest = 0
    layer_peak, layer_transient, layer_largest = 0, 0, ("", 0)
    if h and a:
        s_dec = decoder_seq_len or seq_len
        layers, inputs, tiles = [], [], []
        rms_norm = _rms_norm(config)
        for layer in counts.layers:
            s = s_dec if layer.cross_attention else seq_len
            ffn = _cfg(config, "decoder_ffn_dim") if layer.cross_attention else None
            ffn = ffn or _cfg(config, "intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim") or layer.ffn
            saves = activation_saves(config)
            tile = mlp_tile_tokens(sequence_tiling, tile_tokens, s, batch_size,
                                   ((4 if layer.gated_mlp else 2) + saves) * (ffn or 4 * h) * c)
            mask_pair = 0
            if attention_tiling:  # the whole block in query tiles (the MLP runs inside one)
                tile = query_tile_tokens(tile_tokens, s)
                if attention == "sdpa":  # flash implementations take no mask; eager is not tiled
                    mask_pair = lower_right_mask_bytes(device_type, c, a, _cfg(config, "num_key_value_heads"),
                                                       _cfg(config, "head_dim", "d_kv") or h // a)
            tiles.append(tile)
            layers.append(layer_memory(
                s, batch_size, h, a, nbytes=c, ffn=ffn, head_dim=_cfg(config, "head_dim", "d_kv"),
                kv_heads=_cfg(config, "num_key_value_heads"), gated_mlp=layer.gated_mlp,
                cross_attention=layer.cross_attention, s_kv=seq_len, attention=attention,
                dropout=_has_dropout(config), tile_tokens=tile, rotary=uses_rotary(config), activation_saves=saves,
                attention_tiling=attention_tiling, mask_pair_bytes=mask_pair, rms_norm=rms_norm,
            ))
            inputs.append(s * batch_size * h * c)
        worst = max(layers, key=lambda m: m.peak)
        layer_peak, layer_largest = worst.peak, worst.largest
        layer_transient = max(m.transient for m in layers)
        # Without checkpointing every layer's saved tensors live until its backward, and the
        # backward of one adds its transient.
        # Rotary position embeddings: the model computes cos and sin once per forward and hands
        # them to every layer, so they live from the first layer's forward to the last backward.
        head_dim = _cfg(config, "head_dim", "d_kv") or h // a
        shared = 2 * seq_len * batch_size * head_dim * c if uses_rotary(config) else 0
        full = shared + sum(m.saved for m in layers) + max(m.transient for m in layers)
        # Checkpointing keeps each layer's input; one layer is recomputed and backpropagated at
        # a time (its saved tensors and its transient). With the inputs offloaded, the last W
        # (device_checkpoints) stay and two more are on their way.
        ckpt = shared + sum(inputs) + layer_peak
        tail = w if device_checkpoints == "auto" else int(device_checkpoints)
        kept = sorted(inputs, reverse=True)[: min(n, tail + 2)]
        ckpt_offloaded = shared + sum(kept) + layer_peak
        inputs_host = sum(inputs[: max(n - tail, 0)])  # the offloaded ones: all but the tail kept on the device
        input_largest = max(inputs)
        s_out = s_dec if any(layer.cross_attention for layer in counts.layers) else seq_len
        tokens = s_out * batch_size
        hidden = counts.hidden or h
        # The final norm's input and output (an RMS norm keeps its input upcast to fp32 and the
        # normalized values, counts.layer_memory's rms_norm, unless sequence tiling tiles it:
        # tiling.py, [Note: tiling outside the blocks]), and the gradient w.r.t. the head's
        # input, whole, that the loss's backward ends with.
        norm_tiled = mlp_tile_tokens(sequence_tiling, tile_tokens, s_out, batch_size, (4 + c) * hidden) is not None
        norm = 2 * c + (4 if rms_norm and not norm_tiled else 0)
        head = tokens * hidden * (norm + c)
        whole_resident = not counts.units and split is not None  # the split keeps the model on the GPU
        use_chunks = (chunked_loss is True or (chunked_loss == "auto" and not whole_resident)) and (
            counts.chunked and counts.logits_width)
        if use_chunks:
            from ..chunked_loss import BYTES_PER_LOGIT, resolve_chunk_tokens, vocab_piece_rows

            chunk = resolve_chunk_tokens(loss_chunk_tokens, counts.logits_width)
            # One chunk that would hold every token: the engine runs the plain loss instead.
            use_chunks = chunk < tokens
        if use_chunks:
            # A head larger than the largest block makes each chunk's logits a piece of the
            # vocabulary at a time (chunked_loss.py, [Note: vocabulary pieces]).
            tile_width = vocab_piece_rows(counts.logits_width, hidden, largest or None) or counts.logits_width
            head_grad = counts.logits_width * counts.hidden * (4 + (counts.head_device_bytes if
                                                                    counts.head_device_bytes != 4 else 0))
            if lent:
                # A fused head (TRL's) sums the weight's gradient in fp32 over its chunks; the sum's
                # cast is the lent copy's gradient, in ``lent`` (in fp32 the sum is the gradient).
                head_grad = counts.logits_width * counts.hidden * 4 if counts.head_device_bytes != 4 else 0
            elif piece_bytes and counts.logits_width * counts.hidden > largest:
                # Read in pieces (vocab_ops.py): a piece's gradient is in piece_bytes; the rows'
                # gradient is summed over the pieces in fp32 instead (in the gradient itself in fp32).
                head_grad = tokens * hidden * 4 if c != 4 else 0
            # BYTES_PER_LOGIT: a chunk's backward, in fp32 or 16 bits alike (measured: 16.4 B in
            # fp32, 14.4 in bf16, benchmarks' RSS of a child).
            head += chunk * tile_width * BYTES_PER_LOGIT + head_grad
        else:
            head += tokens * counts.logits_width * LOGIT_BYTES
            piece_bytes = pieces.plain_device_bytes  # the head's own backward, a piece at a time
        plain_head = tokens * hidden * (norm + c) + tokens * counts.logits_width * LOGIT_BYTES
    else:
        use_chunks = False
        plain_head = 0
        notes.append("model config has no hidden size / head count: activations not counted")

    # GPU: the window, the gradient lanes, what stays outside the window, activations, loss.
    state_per_param = 16 if c == 4 else 18
    # A unit used at several positions (a tied embedding) keeps a lane of its own between its
    # backward uses: one more lane each (schedule.release).
    parked = sum(1 for i, u in enumerate(units) if u.kind != "rest" and u.trainable
                 and counts.sequence.count(i) > 1)
    lanes = (grad_buffers + parked) * lane
    if offload_non_block:
        outside = sum(u.device_bytes + u.grad_bytes for u in resident) + counts.buffer_bytes
    else:
        outside = state_per_param * counts.resident_params + counts.buffer_bytes
    # The split's resident units: parameters, fp32 gradients, AdamW state; autocast's 16-bit copy.
    split_bytes = 0 if split is None else split.resident_bytes + (c * split.resident_params if c != 4 else 0)
    outside += split_bytes

    # The loss and the layers' backward do not hold memory at the same time: the loss's chunks
    # and the final norm are freed before the last layer's backward starts, so what the layers
    # keep throughout (every layer's saved tensors, or the checkpointed inputs) adds to the
    # larger of the two: the loss, or one layer's backward (with checkpointing its recompute too).
    phase = layer_peak if gradient_checkpointing else layer_transient

    def activations(block_act: int, loss: int) -> int:
        return block_act - phase + max(loss, phase)

    def units_on_device(window: int) -> int:
        """The window's slots with the gradient lanes (a block's backward: W + 1 slots), or at
        the head the pieces with W slots: the lanes are taken at the first block's backward,
        after the head's, and given back at the end of it (grads.py)."""
        slots = _window_bytes(counts, window) + lanes
        return (max(slots, _window_bytes(counts, window - 1) + piece_bytes) if piece_bytes else slots) + lent

    def need(window: int, offload: bool) -> int:
        block_act = (ckpt_offloaded if offload else ckpt) if gradient_checkpointing else full
        other = units_on_device(window) + outside + activations(block_act, head)
        return other + _workspace(other)

    offload = bool(gradient_checkpointing and offload_activations is True)
    if offload_activations == "auto" and gradient_checkpointing and gpu_memory_bytes is not None:
        offload = need(w, False) > gpu_room and need(w, True) < need(w, False)
    block_act = (ckpt_offloaded if offload else ckpt) if gradient_checkpointing else full
    window_bytes = _window_bytes(counts, w)
    gpu_need = need(w, offload)
    max_w: int | None = None
    if gpu_memory_bytes is not None:
        max_w = 0
        for cand in range(1, positions + 1):  # a few thousand at most: a scan is exact and cheap
            if need(cand, offload) > gpu_room:
                break
            max_w = cand
    activation_host = inputs_host if offload else 0
    # Checkpoints beyond RAM (nvme_activations, activations.py): the file holds them, the host
    # a ring (the writes in flight and the two inputs being read back).
    activation_ring = min(DISK_RING + 2, n) * input_largest if offload else 0
    # The NVMe tier: the moments on disk, a ring of buffers of the largest unit's moments in RAM
    # (with nvme_masters, of its masters and moments). A unit larger than the largest block (a
    # vocabulary) streams in segments of at most the largest block's elements (optim/segments.py;
    # with nvme_masters, one whose masters are a single tensor), so a block sizes the ring.
    unit_master = [4 * u.trainable for u in units]
    largest_block = max((u.trainable for u in units if u.kind == "block"), default=0)

    def nvme_ring(masters_on_disk: bool) -> int:
        per_unit = []
        for u, a, m in zip(units, unit_adam, unit_master):
            state = a + (m if masters_on_disk else 0)
            if largest_block and u.kind != "block" and u.trainable > largest_block and (
                    not masters_on_disk or u.trainable_tensors == 1):
                state = state * largest_block // u.trainable  # one segment's share
            per_unit.append(state)
        return min(nvme_ring_buffers, len(per_unit)) * max(per_unit, default=0)

    # Masters on disk: no image; fetches read one block's masters at a time (fp32 scratch) and
    # convert them through the staging ring, in the compute dtype (fp32 compute too).
    block_trainable = max((u.trainable for u in units if u.kind == "block"),
                          default=max((u.trainable for u in units), default=0))
    disk_fetch = FETCH_STAGING_BUFFERS * c * block_trainable + 4 * block_trainable

    def host_need(keep: bool, on_disk: bool, masters_on_disk: bool = False, acts_on_disk: bool = False) -> int:
        acts = activation_ring if acts_on_disk else activation_host
        if masters_on_disk:
            return nvme_ring(True) + grad + pinned - image + disk_fetch + staging + acts + CPU_PROCESS_BYTES
        image_or_ring = 0 if keep or not image else ring - image
        moments = nvme_ring(False) if on_disk else adam
        return master + moments + grad + pinned + image_or_ring + staging + acts + CPU_PROCESS_BYTES

    # What "auto" chooses, in order, the first that fits the RAM: everything in RAM; without
    # the image (host_image="auto"); the moments on disk (with nvme_memory), image kept if it
    # fits; then the masters on disk too (nvme_masters="auto").
    images = [True, False] if host_image == "auto" else [bool(host_image)]
    disks = [True] if nvme is True else [False] if nvme is False or (nvme_memory_bytes is None) else [False, True]
    # The checkpointed inputs go to the file with the moments (an engine with nvme_path), when
    # offloaded: "auto" after the choices that keep them in RAM, before the masters follow.
    acts_ok = offload and activation_host > activation_ring and nvme_activations is not False
    acts_forced = offload and nvme_activations is True
    choices = [(keep, disk, False, disk and acts_forced) for disk in disks for keep in images]
    if acts_ok and not acts_forced and True in disks:
        choices += [(keep, True, False, True) for keep in images]
    if nvme_masters is True:
        choices = [(False, True, True, acts_ok or acts_forced)]
    elif nvme_masters == "auto" and True in disks and host_image is not True:
        choices.append((False, True, True, acts_ok or acts_forced))
    keep_image, on_disk, masters_on_disk, acts_on_disk = next(
        (c for c in choices if cpu_room is None or host_need(*c) <= cpu_room), choices[-1])
    cpu_needed = host_need(keep_image, on_disk, masters_on_disk, acts_on_disk)
    if acts_on_disk and nvme_activations == "auto":
        notes.append(f"the checkpointed activations ({_gib(activation_host)}) go to the NVMe tier "
                     f"(StrongholdConfig(nvme_activations=True)): the host holds {min(DISK_RING + 2, n)} of them")
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
    if on_disk and not masters_on_disk and cpu_room is not None and cpu_needed > cpu_room:
        notes.append(f"with the moments on disk the host still needs the fp32 masters ({_gib(master)}) and the "
                     f"gradients ({_gib(grad)}); StrongholdConfig(nvme_masters=True) moves the masters too")

    total = counts.block_params + counts.resident_params
    plain_state = state_per_param * total + counts.buffer_bytes
    plain_other = plain_state + activations(ckpt if gradient_checkpointing else full, plain_head)
    plain_ws = _workspace(plain_other)
    plain_need = plain_other + plain_ws

    cpu_fits = None if cpu_room is None else cpu_needed <= cpu_room
    gpu_fits = None if gpu_room is None else gpu_need <= gpu_room
    if cpu_fits is None:
        notes.append("CPU RAM unknown: CPU check skipped")
    if gpu_fits is None:
        notes.append("GPU memory unknown: GPU check skipped")
    on_nvme = (adam if on_disk else 0) + (master if masters_on_disk else 0) + (activation_host if acts_on_disk else 0)
    nvme_fits = None if not on_disk or nvme_memory_bytes is None else on_nvme <= nvme_memory_bytes
    act_peak = activations(block_act, head)
    on_device = units_on_device(w)
    # Beside the window's slots: the lanes, or at the head the pieces (with a slot fewer).
    beside = on_device - window_bytes
    beside_name = ("the LM head lent whole, with the lanes" if lent else "the gradient lanes"
                   if on_device == window_bytes + lanes else "the vocabulary pieces, at the head")
    fixed = on_device + outside + act_peak
    layer_phase = (f"one layer's recompute and backward (largest: {layer_largest[0]})" if gradient_checkpointing
                   else f"one layer's backward (largest: {layer_largest[0]})")
    terms = {"the window": window_bytes, beside_name: beside, "what stays outside the window": outside,
             "the checkpointed layer inputs" if gradient_checkpointing else "the layers' saved activations":
                 block_act - phase,
             layer_phase if phase >= head else "the loss (final norm, logits)": max(phase, head),
             "the workspace": gpu_need - fixed}
    bounded_by = max(terms, key=terms.get)
    return Estimate(
        model_name=model_name, seq_len=seq_len, batch_size=batch_size, dtype=dtype,
        gradient_checkpointing=gradient_checkpointing, window_size=w, window_size_requested=requested,
        num_blocks=n, block_params=counts.block_params, resident_params=counts.resident_params,
        total_params=total, largest_block_params=largest, offload_non_block=offload_non_block,
        chunked_loss=bool(use_chunks), offload_activations=offload,
        cpu_master_bytes=0 if masters_on_disk else master, cpu_adam_bytes=0 if on_disk else adam, cpu_grad_bytes=grad, host_memory=host_memory,
        host_image=bool(keep_image or not image), host_grads="compute" if bf16_grads else "fp32",
        cpu_pinned_copy_bytes=pinned,
        cpu_grad_staging_bytes=staging, cpu_activation_bytes=activation_ring if acts_on_disk else activation_host, nvme_activations=acts_on_disk, cpu_process_bytes=CPU_PROCESS_BYTES,
        cpu_bytes_needed=cpu_needed, cpu_memory_bytes=cpu_memory_bytes,
        nvme_adam=on_disk, nvme_bytes_needed=on_nvme, nvme_memory_bytes=nvme_memory_bytes,
        cpu_nvme_ring_bytes=nvme_ring(masters_on_disk) if on_disk else 0, nvme_masters=masters_on_disk,
        gpu_resident_bytes=outside, gpu_window_bytes=window_bytes,
        gpu_slot_bytes=max((u.device_bytes for u in streamed), default=0), gpu_vocab_piece_bytes=piece_bytes,
        gpu_head_lent_whole_bytes=lent,
        gpu_grad_buffer_bytes=lanes, gpu_engine_bytes=on_device + (outside - counts.buffer_bytes
                                                                    if offload_non_block else split_bytes),
        gpu_block_activation_bytes=block_act, gpu_head_activation_bytes=head, gpu_activation_peak_bytes=act_peak,
        gpu_workspace_bytes=gpu_need - fixed, gpu_bytes_needed=gpu_need,
        gpu_memory_bytes=gpu_memory_bytes, max_window_size=max_w,
        plain_state_bytes=plain_state, plain_workspace_bytes=plain_ws, plain_gpu_bytes_needed=plain_need,
        cpu_fits=cpu_fits, gpu_fits=gpu_fits, nvme_fits=nvme_fits,
        fits=cpu_fits is not False and gpu_fits is not False and nvme_fits is not False,
        plain_fits=None if gpu_room is None else plain_need <= gpu_room,
        block_activation_bytes_checkpointed=ckpt, block_activation_bytes_full=full, notes=tuple(notes),
        resident_units=0 if split is None else len(split.resident),
        resident_params_on_gpu=0 if split is None else split.resident_params, gpu_split_bytes=split_bytes,
        split="everything streams" if split is None else split.reason,
        attn_implementation=attention, tile_tokens=max((t for t in tiles if t), default=None) if h and a else None,
        gpu_bounded_by=bounded_by,
        gpu_layer_peak_bytes=layer_peak, layer_largest_tensor=layer_largest[0],
        cpu_reserve_bytes=cpu_res, gpu_reserve_bytes=gpu_res,
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
        room = (gpu_memory_bytes - streamed.gpu_reserve_bytes) * 100 // (100 + GPU_WORKSPACE_PERCENT)
        buffers = streamed.gpu_resident_bytes - streamed.gpu_split_bytes - (
            streamed.gpu_engine_bytes - streamed.gpu_window_bytes - streamed.gpu_grad_buffer_bytes)
        model_state = room - streamed.gpu_activation_peak_bytes - buffers
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
    from ..discovery import plan_units
    from ..split import TRAINABLE_EXTRA_BYTES, choose_split

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
