"""Chunked LM head and cross-entropy for Hugging Face causal LMs: the logits are never whole.

A causal LM's forward computes ``logits = self.lm_head(hidden_states)`` as one
``[batch, tokens, vocab]`` tensor, then ``self.loss_function(logits=logits, labels=labels, ...)``
(transformers' ``ForCausalLMLoss``) upcasts it to fp32. For Llama-3-8B at 8k tokens that is
2.1 GB of bf16 logits, 4.2 GB of fp32 logits, and as much again for their gradients: more
than a whole decoder block, and it does not shrink with any offloading of the blocks.

This module computes the LM head and the cross-entropy in chunks of token rows instead, and
recomputes each chunk in backward, so what the loss region holds is ``O(chunk x vocab)``, or
``O(chunk x piece)`` when the head is read in vocabulary pieces ([Note: vocabulary pieces]).
That is what Liger's fused linear cross-entropy, Apple's Cut Cross-Entropy (Wijmans et al.,
"Cut Your Losses in Large-Vocabulary Language Models", arXiv:2411.09009) and NeMo's
ChunkedCrossEntropy do with GPU kernels; here it is plain torch, so it runs on CPU too. TRL's
``add_fused_lm_head`` (``trl/trainer/utils.py``) follows the same design for log-probs.

The pieces, bottom up:

* `chunked_linear_cross_entropy` (and its `ChunkedLinearCrossEntropy` autograd function): the
  loss of HF's ``ForCausalLMLoss`` with the same semantics (label shift, ``shift_labels``,
  ``ignore_index``, mean or ``sum / num_items_in_batch``), from hidden states and the head's
  weight and bias.
* `HeadTransform` and `analyse_causal_lm` (head_analysis.py, re-exported here): the
  elementwise steps a model applies to its logits before the loss (Gemma2/Gemma3
  soft-capping, Cohere's ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's
  ``lm_head_multiplier``), replayed per chunk in the model's own order and dtype, read from
  the class's ``forward`` source with whether the step from the head to the loss is one this
  module reproduces exactly.
* `ChunkedLoss`: installs the chunked path with native hooks and the ``loss_function``
  setter only. The head's input is captured and replaced by a zero-length slice, so the
  model's own code builds an empty ``[B, 0, V]`` logits tensor; the overridden
  ``loss_function`` then computes the loss from the captured hidden states.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger("stronghold_hf")

ChunkTokens = int | Literal["auto"]

# The analysis of the model's forward (what is reproduced, and the transform replayed per chunk);
# re-exported here, where users of the chunked loss look for them.
from .head_analysis import CONFIG_SCALARS, HeadTransform, LossPlan, analyse_causal_lm, is_causal_lm_class  # noqa: E402,F401

#: What ``chunk_tokens="auto"`` aims one chunk's loss-region memory at.
AUTO_CHUNK_BYTES = 512 * 2**20
#: Bytes one logit costs in a chunk at its peak: the bf16 logits (2), their fp32 copy (4),
#: the fp32 log-softmax autograd saves (4), its fp32 gradient (4), the bf16 gradient (2).
BYTES_PER_LOGIT = 16
AUTO_CHUNK_MIN, AUTO_CHUNK_MAX = 128, 8192
#: At most this many vocabulary pieces per chunk: a tiny model's blocks (a few thousand
#: parameters) next to a 32k vocabulary would otherwise make thousands of one-row tiles, each a
#: Python iteration and a kernel launch. Real models have a few (Llama-3-8B: 3).
MAX_VOCAB_PIECES = 64
#: Rows per piece are a multiple of this many when there are at least as many: [Note: aligned pieces].
PIECE_ROW_ALIGN = 64

# [Note: aligned pieces] A piece of the head makes the logits' columns [v0, v1): its product is
# written into the whole logits at column v0 (vocab_ops.PiecewiseLinear), or makes a tile of
# v1 - v0 columns. With a block's rows as they come (1,549 for a 128-wide GPT-2 block), every
# piece after the first starts mid cache line and the GEMM's stores straddle lines: on this
# machine's 2 cores the head's forward took 52 ms for six such pieces against 43 ms whole, and
# 44 ms for six pieces of 1,536 rows (``benchmarks/bench_step.py --vocab_pieces on,off``
# measures the step). GPU kernels, too, tile the output in multiples of 64 or 128 columns. So a
# piece of at least `PIECE_ROW_ALIGN` rows is cut down to a multiple of it: still no larger
# than a block, at most 63 rows smaller.


def vocab_piece_rows(vocab: int, hidden: int, piece_numel: int | None,
                     max_pieces: int = MAX_VOCAB_PIECES) -> int | None:
    """Vocabulary rows per piece of a ``[vocab, hidden]`` head: a head of more than
    ``piece_numel`` elements is read in pieces of at most that many, and in at most
    ``max_pieces``; None: whole (no ``piece_numel``, or the head is no larger). At least
    `PIECE_ROW_ALIGN` rows are a multiple of it ([Note: aligned pieces])."""
    if piece_numel is None or vocab * hidden <= piece_numel:
        return None
    rows = piece_numel // hidden
    if rows >= PIECE_ROW_ALIGN:
        rows -= rows % PIECE_ROW_ALIGN
    fewest = -(-vocab // max_pieces)  # at most max_pieces pieces, whatever the block (rounded up, aligned)
    if rows < fewest:
        rows = fewest if fewest < PIECE_ROW_ALIGN else -(-fewest // PIECE_ROW_ALIGN) * PIECE_ROW_ALIGN
    return max(rows, 1)


def resolve_chunk_tokens(chunk_tokens: ChunkTokens, vocab_size: int) -> int:
    """Token rows per chunk: ``chunk_tokens`` itself, or for ``"auto"`` the rows whose logits
    cost about `AUTO_CHUNK_BYTES`, clamped to ``[128, 8192]`` (261 rows for a 128k vocab)."""
    if chunk_tokens == "auto":
        rows = AUTO_CHUNK_BYTES // (BYTES_PER_LOGIT * max(int(vocab_size), 1))
        return max(AUTO_CHUNK_MIN, min(AUTO_CHUNK_MAX, rows))
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise TypeError(f"chunk_tokens={chunk_tokens!r}: pass an int >= 1 or 'auto'.")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: pass an int >= 1 or 'auto'.")
    return chunk_tokens


# --------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------


def _rows(hidden: Tensor, index: Tensor) -> tuple[Tensor, ...]:
    # Flat row numbers -> one index tensor per leading dim, so a non-contiguous hidden (a
    # slice) is gathered row by row instead of being copied whole by ``reshape``. Divided by
    # Python ints on the index's device: ``torch.unravel_index`` builds its divisors with
    # ``torch.tensor(..., device=...)``, two pageable copies (and host syncs) per chunk on a GPU.
    lead = hidden.shape[:-1]
    out: list[Tensor] = []
    for size in reversed(lead[1:]):
        out.append(index % size)
        index = index // size
    out.append(index)
    return tuple(reversed(out))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i CE(transform(hidden[i] @ weight.T + bias).float(), target_i)`` over the rows
    ``index`` (flat positions in ``hidden.shape[:-1]``), chunk by chunk.

    Forward keeps nothing but the fp32 scalar; backward recomputes each chunk under the
    autocast state of the forward and differentiates it with an inner autograd pass.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, targets: Tensor,
                transform: HeadTransform, chunk_tokens: int, ignore_index: int, piece_rows: int | None = None) -> Tensor:
        device_type = hidden.device.type
        # [Note: autocast in backward] Like torch.utils.checkpoint: the recompute must see the
        # autocast of the forward (the dtype of the logits decides the gradients), not whatever
        # is active where ``backward()`` is called.
        ctx.autocast = dict(device_type=device_type, enabled=torch.is_autocast_enabled(device_type),
                            dtype=torch.get_autocast_dtype(device_type),
                            cache_enabled=torch.is_autocast_cache_enabled())
        ctx.transform, ctx.chunk_tokens, ctx.ignore_index = transform, chunk_tokens, ignore_index
        vocab = weight.shape[0]
        ctx.piece_rows = piece_rows = vocab if piece_rows is None else max(1, min(int(piece_rows), vocab))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        if piece_rows < vocab:
            # [Note: vocabulary pieces] The loss of each chunk from [c, piece] tiles of logits, with
            # an online log-sum-exp; its fp32 [rows] log-sum-exps are all backward keeps besides the
            # inputs (O(tokens), not O(tokens x vocab)).
            torch._assert_async(((targets >= 0) & (targets < vocab)).all(),
                                "chunked loss: a label is outside [0, vocab_size)")
            lses = []
            for start in range(0, index.numel(), chunk_tokens):
                x = hidden[_rows(hidden, index[start:start + chunk_tokens])]
                lse, picked = _online_lse(x, weight, bias, transform, targets[start:start + chunk_tokens], piece_rows)
                total += (lse - picked).sum()
                lses.append(lse)
                del x, picked
            lse_all = torch.cat(lses) if lses else torch.zeros(0, dtype=torch.float32, device=hidden.device)
            ctx.save_for_backward(hidden, weight, bias, index, targets, lse_all)
            return total
        # [Note: saved tensors] Only the inputs: autograd checks their versions, so a weight
        # updated in place before backward fails loudly instead of giving stale gradients.
        ctx.save_for_backward(hidden, weight, bias, index, targets, None)
        for start in range(0, index.numel(), chunk_tokens):
            rows = index[start:start + chunk_tokens]
            # [c, V] in the autocast dtype, like HF's ``self.lm_head(...)``; freed each iteration.
            logits = transform(F.linear(hidden[_rows(hidden, rows)], weight, bias))
            total += F.cross_entropy(logits.float(), targets[start:start + chunk_tokens],
                                     ignore_index=ignore_index, reduction="sum")
            del logits  # before the next chunk's: one chunk of logits at a time
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        hidden, weight, bias, index, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_bias = need_bias and bias is not None
        if not (need_hidden or need_weight or need_bias):
            return (None,) * 9
        grad_hidden = hidden.new_zeros(hidden.shape) if need_hidden else None
        # [Note: fp32 head gradient] The chunks' [V, H] gradients are summed in fp32 even for a
        # bf16/fp16 head (one extra V x H x 4 bytes for the backward): HF's single matmul over
        # all tokens rounds once, and a 16-bit running sum would round once per chunk.
        acc = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if need_bias else None
        with torch.enable_grad(), torch.autocast(**ctx.autocast):
            # One leaf per parameter for the whole backward: autocast caches its cast of a leaf
            # that requires grad, so under bf16 the weight is cast once, not once per chunk.
            w = weight.detach().requires_grad_(need_weight)
            b = None if bias is None else bias.detach().requires_grad_(need_bias)
            if lse is not None:
                _piece_backward(ctx, hidden, weight, bias, index, targets, lse, grad_total,
                                grad_hidden, grad_weight, grad_bias)
            for start in range(0, index.numel() if lse is None else 0, ctx.chunk_tokens):
                rows = _rows(hidden, index[start:start + ctx.chunk_tokens])
                x = hidden[rows].detach().requires_grad_(need_hidden)
                logits = ctx.transform(F.linear(_uncached(x, ctx.autocast), w, b))
                loss = F.cross_entropy(logits.float(), targets[start:start + ctx.chunk_tokens],
                                       ignore_index=ctx.ignore_index, reduction="sum")
                wanted = [t for t, need in ((x, need_hidden), (w, need_weight), (b, need_bias)) if need]
                # [Note: chunk lifetime] The chunk's graph (its [c, V] logits, their fp32 copy and
                # softmax) is freed when ``grads`` returns; only [c, H] and the [V, H] sums survive.
                grads = list(torch.autograd.grad(loss, wanted, grad_total))
                if need_hidden:
                    grad_hidden[rows] = grads.pop(0)
                if need_weight:
                    grad_weight += grads.pop(0)
                if need_bias:
                    grad_bias += grads.pop(0)
                # [Note: chunk lifetime] also means the names: held over to the next iteration,
                # this chunk's logits (and the graph ``loss`` holds) would be alive next to the
                # next chunk's, two chunks at the loss's peak instead of one.
                del logits, loss, x, grads, wanted
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        if need_bias:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _uncached(x: Tensor, autocast: dict) -> Tensor:
    """[Note: autocast's cache in backward] A chunk's rows ``x`` are an fp32 leaf that requires
    grad, the kind of tensor autocast caches its casts of until its context exits; the backward
    keeps one context throughout (so that the weight is cast once), so every chunk's bf16 copy of
    its rows would stay cached to the end, the hidden states over again in bf16. A view of the
    leaf is cast the same way but not cached: its copy dies with its chunk. (tiling.py's backward
    does the same for its tiles.)"""
    return x.view_as(x) if autocast["enabled"] and x.requires_grad else x


def _online_lse(x: Tensor, weight: Tensor, bias: Tensor | None, transform: HeadTransform, targets: Tensor,
                piece_rows: int) -> tuple[Tensor, Tensor]:
    """fp32 ``(logsumexp(logits), logits[target])`` per row of ``x``, the logits made a
    ``[rows, piece_rows]`` tile at a time ([Note: vocabulary pieces])."""
    top = total = None
    picked = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    for v0 in range(0, weight.shape[0], piece_rows):
        v1 = v0 + piece_rows
        logits = transform(F.linear(x, weight[v0:v1], None if bias is None else bias[v0:v1])).float()
        tile_top = logits.amax(dim=1)
        if top is None:
            top, total = tile_top, torch.exp(logits - tile_top[:, None]).sum(dim=1)
        else:
            new_top = torch.maximum(top, tile_top)
            total = total * torch.exp(top - new_top) + torch.exp(logits - new_top[:, None]).sum(dim=1)
            top = new_top
        inside = (targets >= v0) & (targets < v1)
        column = (targets - v0).clamp(0, logits.shape[1] - 1)
        picked = torch.where(inside, logits.gather(1, column[:, None]).squeeze(1), picked)
        del logits  # one tile at a time
    return top + torch.log(total), picked


def _piece_backward(ctx, hidden, weight, bias, index, targets, lse, grad_total, grad_hidden, grad_weight, grad_bias):
    """`ChunkedLinearCrossEntropy.backward` over vocabulary pieces: per chunk and piece, the
    tile's logits are recomputed and ``(softmax - onehot) x grad`` (from the saved log-sum-exp)
    is pushed back through the transform and the piece's rows of the head; the hidden states'
    gradient is summed over the pieces in fp32 and rounded once per chunk, as one matmul would."""
    need_hidden, need_weight, need_bias = grad_hidden is not None, grad_weight is not None, grad_bias is not None
    rows_per = ctx.piece_rows
    starts = range(0, weight.shape[0], rows_per)
    # One leaf per piece for the whole backward: autocast caches its cast of each (as it does
    # the whole weight's on the unpieced path), and a piece's gradient is the piece's size.
    w_pieces = [weight[v0:v0 + rows_per].detach().requires_grad_(need_weight) for v0 in starts]
    b_pieces = [None if bias is None else bias[v0:v0 + rows_per].detach().requires_grad_(need_bias) for v0 in starts]
    for start in range(0, index.numel(), ctx.chunk_tokens):
        rows = _rows(hidden, index[start:start + ctx.chunk_tokens])
        x = hidden[rows].detach().requires_grad_(need_hidden)
        x_in = _uncached(x, ctx.autocast)
        t = targets[start:start + ctx.chunk_tokens]
        chunk_lse = lse[start:start + ctx.chunk_tokens]
        gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_hidden else None
        for v0, w, b in zip(starts, w_pieces, b_pieces):
            logits = ctx.transform(F.linear(x_in, w, b)).float()
            with torch.no_grad():
                g = torch.exp(logits - chunk_lse[:, None])
                # - onehot where the target is in this piece; a scatter, not a nonzero(), which
                # would wait for the device once per tile.
                inside = ((t >= v0) & (t < v0 + rows_per)).to(g.dtype)
                g.scatter_add_(1, (t - v0).clamp(0, g.shape[1] - 1)[:, None], -inside[:, None])
                g *= grad_total
            wanted = [u for u, need in ((x, need_hidden), (w, need_weight), (b, need_bias)) if need]
            grads = list(torch.autograd.grad(logits, wanted, g))
            if need_hidden:
                gx += grads.pop(0)
            if need_weight:
                grad_weight[v0:v0 + rows_per] += grads.pop(0)
            if need_bias:
                grad_bias[v0:v0 + rows_per] += grads.pop(0)
            del logits, g, grads, wanted  # [Note: chunk lifetime], per tile
        if need_hidden:
            grad_hidden[rows] = gx.to(grad_hidden.dtype)
        del x, gx


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor | None,
    *,
    shift_labels: Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: int | Tensor | None = None,
    transform: HeadTransform = HeadTransform(),
    chunk_tokens: ChunkTokens = "auto",
    vocab_piece_rows: int | None = None,
    pieces=None,
) -> Tensor:
    """The loss transformers' ``ForCausalLMLoss`` gives for
    ``logits = transform(F.linear(hidden, weight, bias))``, without building those logits.

    ``hidden`` is ``[..., tokens, hidden_size]`` (any strides) and ``labels`` has its leading
    shape. As in HF: labels are shifted left and padded with ``ignore_index`` unless
    ``shift_labels`` (already aligned, any shape with as many elements) is given; the result
    is the mean over non-ignored tokens (``nan`` when there are none), or their sum divided
    by ``num_items_in_batch`` when that is given (gradient accumulation).

    ``vocab_piece_rows``: with fewer rows than the head has, each chunk's logits are made over
    pieces of that many vocabulary rows with an online log-sum-exp, so what the loss holds at
    once is a ``[chunk, piece]`` tile ([Note: vocabulary pieces]); ``None``: the whole
    vocabulary per chunk. ``pieces``: the engine's `vocab_pieces.VocabularyPieces` of ``weight``,
    which is then never whole on the device (its pieces cross one at a time, outermost).
    """
    lead = hidden.shape[:-1]
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_linear_cross_entropy: pass labels or shift_labels.")
        if labels.shape != lead:
            raise ValueError(f"chunked_linear_cross_entropy: labels have shape {tuple(labels.shape)} but the hidden "
                             f"states lead with {tuple(lead)}; pass labels aligned with the tokens.")
        # HF: pad one ignore_index at the end, drop the first label, so row t predicts label t+1.
        targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    else:
        targets = shift_labels
        if targets.numel() != lead.numel():
            raise ValueError(f"chunked_linear_cross_entropy: shift_labels has {targets.numel()} elements but there are "
                             f"{lead.numel()} token rows; pass one label per row.")
    targets = targets.reshape(-1).to(hidden.device)
    index = (targets != ignore_index).nonzero().squeeze(1)
    chunk = resolve_chunk_tokens(chunk_tokens, weight.shape[0])
    if vocab_piece_rows is not None and (isinstance(vocab_piece_rows, bool) or not isinstance(vocab_piece_rows, int)
                                         or vocab_piece_rows < 1):
        raise ValueError(f"chunked_linear_cross_entropy: vocab_piece_rows={vocab_piece_rows!r}; pass an int >= 1 or None.")
    if pieces is not None:
        from .vocab_ops import StreamedLinearCrossEntropy

        if bias is not None and bias is not pieces.bias:
            raise ValueError("chunked_linear_cross_entropy: a head read in vocabulary pieces takes the bias of its unit.")
        total = StreamedLinearCrossEntropy.apply(hidden, weight, bias, index, targets[index], transform, chunk, pieces)
    else:
        total = ChunkedLinearCrossEntropy.apply(hidden, weight, bias, index, targets[index], transform, chunk,
                                                ignore_index, vocab_piece_rows)
    if num_items_in_batch is None:
        # HF's reduction="mean" over the non-ignored rows: 0 / 0 = nan when all are ignored.
        return total / index.numel()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


# --------------------------------------------------------------------------------------------
# Installation: hooks and the loss_function override
# --------------------------------------------------------------------------------------------


class _Phase(enum.Enum):
    IDLE = "idle"          # not a training forward with labels, or between forwards
    ARMED = "armed"        # a training forward with labels is running: the head input may be captured
    CAPTURED = "captured"  # the head input is held and the head got a zero-length slice of it
    CONSUMED = "consumed"  # loss_function computed the chunked loss from the captured input


def _loss_arguments(logits=None, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                    shift_labels=None, **kwargs):
    """ForCausalLMLoss's signature, to read a call the way it would."""
    return logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels


class _ChunkedHead:
    """The chunked path of one causal LM: its state for the forward in flight, and its hooks."""

    def __init__(self, model: nn.Module, plan: LossPlan, chunk_tokens: ChunkTokens, promises=None,
                 piece_numel: int | None = None):
        self.model, self.plan, self.chunk_tokens = model, plan, chunk_tokens
        self.piece_numel = piece_numel  # the largest piece of the head one tile of logits may use
        self.vocab_pieces: dict[int, Any] = {}  # id(weight) -> its VocabularyPieces (vocab_pieces.py)
        self.promises = promises  # promises.Promises: the first training forward says whether chunking ran
        self.head: nn.Module = model.get_submodule(plan.head_path)
        self._reset()
        # [Note: the previous loss_function] ``PreTrainedModel.loss_function`` is a property
        # with a setter that stores ``self._loss_function``; remember whether the instance had
        # its own so that `remove` restores exactly the state it found.
        self.had_own_loss = "_loss_function" in model.__dict__
        self.previous_loss = model.loss_function
        self.loss = functools.partial(_ChunkedHead._loss, self)  # one object, for identity checks
        model.loss_function = self.loss
        self.handles = [
            model.register_forward_pre_hook(self._arm, with_kwargs=True),
            self.head.register_forward_pre_hook(self._capture, with_kwargs=True),
            model.register_forward_hook(self._finish, with_kwargs=True, always_call=True),
        ]

    def _reset(self) -> None:
        self.phase = _Phase.IDLE
        self.labels: Tensor | None = None
        self.shift_labels: Tensor | None = None
        # [Note: captured hidden lifetime] Held from the head's pre-hook to the loss call only;
        # after that the autograd function's saved tensors keep it, as HF's graph would.
        self.hidden: Tensor | None = None
        self.hidden_version = -1
        self.logits: Tensor | None = None
        self.skipped: str | None = None  # why the head input was left whole, when that is by design

    def _arm(self, model, args, kwargs):
        # A phase other than IDLE here is left by a forward whose always-called hook did not
        # run (torch.compile skips them on an exception): it belongs to no live call.
        self._reset()
        if kwargs.get("fused_lm_head") and id(self.head.weight) in self.vocab_pieces:
            # TRL's fused LM head (GRPO, RLOO) multiplies by the whole weight outside the head:
            # for this forward (and its backward) the weight is on the device whole.
            self.vocab_pieces[id(self.head.weight)].lend_whole(for_backward=torch.is_grad_enabled())
        if (model.training and torch.is_grad_enabled() and torch.is_tensor(kwargs.get("labels"))
                and not kwargs.get("fused_lm_head") and model.__dict__.get("_loss_function") is self.loss):
            self.phase = _Phase.ARMED
            self.labels, self.shift_labels = kwargs["labels"], kwargs.get("shift_labels")
        return None

    def _capture(self, head, args, kwargs):
        if self.phase is not _Phase.ARMED or len(args) != 1 or kwargs or not torch.is_tensor(args[0]):
            return None
        hidden = args[0]
        lead = hidden.shape[:-1]
        if hidden.dim() < 2 or not (lead == self.labels.shape or (
                self.shift_labels is not None and self.shift_labels.numel() == lead.numel())):
            # logits_to_keep, a packed boolean mask, prompt-learning PEFT: not the rows the
            # labels describe, so the plain path computes this loss.
            self.skipped = "other rows"
            return None
        if lead.numel() <= self._chunk_rows():
            # One chunk would hold every token: chunking saves no memory then, and its
            # recompute in backward would cost a head matmul. The plain path runs.
            self.skipped = "one chunk"
            return None
        self.hidden, self.hidden_version, self.phase = hidden, hidden._version, _Phase.CAPTURED
        # The model's own ``self.lm_head(...)`` now builds [B, 0, V] logits, and every
        # transform between the head and the loss runs on that empty tensor.
        return (hidden[..., :0, :],), {}

    def _loss(self, *args, **kwargs):
        if self.phase is not _Phase.CAPTURED:
            return self.previous_loss(*args, **kwargs)
        logits, labels, vocab_size, num_items, ignore_index, shift_labels = _loss_arguments(*args, **kwargs)
        if not torch.is_tensor(logits) or logits.shape[-2:-1] != (0,):
            # Not the logits of the shrunk head: the forward hook raises for this call.
            return self.previous_loss(*args, **kwargs)
        # CONSUMED before computing: an error in this loss (a label out of range) is the
        # caller's, not a sign that the model took another path.
        hidden, self.phase, self.hidden, self.logits = self.hidden, _Phase.CONSUMED, None, logits
        weight, bias = self.head.weight, self.head.bias  # read now: offload and PEFT swap them
        if hidden._version != self.hidden_version:
            # HF's logits were computed before the change; the chunks would see it.
            raise RuntimeError(f"{type(self.model).__name__}: the LM head's input was modified in place between the "
                               f"head and the loss; use StrongholdConfig(chunked_loss=False) for this model.")
        if vocab_size != weight.shape[0]:
            raise ValueError(f"{type(self.model).__name__}: loss_function got vocab_size={vocab_size}, but "
                             f"{self.plan.head_path} has {weight.shape[0]} outputs; make config.vocab_size match the "
                             f"head, or use StrongholdConfig(chunked_loss=False).")
        pieces = self.vocab_pieces.get(id(weight))
        with pieces.routed() if pieces is not None else contextlib.nullcontext():
            return chunked_linear_cross_entropy(hidden, weight, bias, labels, shift_labels=shift_labels,
                                                ignore_index=ignore_index, num_items_in_batch=num_items,
                                                transform=self.plan.transform, chunk_tokens=self.chunk_tokens,
                                                vocab_piece_rows=self.piece_rows(weight), pieces=pieces)

    def piece_rows(self, weight: Tensor) -> int | None:
        return vocab_piece_rows(weight.shape[0], weight.shape[1], self.piece_numel)

    def _chunk_rows(self) -> int:
        return resolve_chunk_tokens(self.chunk_tokens, self.head.weight.shape[0])

    def _check_promise(self, phase: _Phase, skipped: str | None, labels: Tensor | None) -> None:
        """The first training forward that should have chunked says whether it did (promises.py)."""
        if self.promises is None or self.promises.checked("chunked_loss"):
            return
        name = type(self.model).__name__
        if phase is _Phase.CONSUMED:
            self.promises.keep("chunked_loss", f"{name}: the loss ran in chunks of {self._chunk_rows()} tokens")
        elif phase is _Phase.ARMED and skipped is None and labels is not None and labels.numel() > self._chunk_rows():
            self.promises.break_(
                "chunked_loss",
                f"{name}: the chunked loss was installed, but a training forward with labels never called "
                f"{self.plan.head_path} with the hidden states alone, so the whole [batch, tokens, vocab] logits "
                f"were computed.",
                "if the model computes its head another way (Liger, a fused head, a wrapper that calls the head with "
                "keyword arguments), pass StrongholdConfig(chunked_loss=False); the plain loss then runs knowingly.",
                explicit=False)

    def _finish(self, model, args, kwargs, output):
        phase, logits, skipped, labels = self.phase, self.logits, self.skipped, self.labels
        self._reset()
        if output is not None:
            self._check_promise(phase, skipped, labels)
        if phase is _Phase.CAPTURED:
            message = (f"{type(model).__name__}: the LM head's input was shrunk for the chunked loss, but forward "
                       f"never passed the resulting logits to self.loss_function: the model computed its loss some "
                       f"other way. Use StrongholdConfig(chunked_loss=False) to turn chunking off for this model.")
            if output is None:
                # Forward raised (torch calls always_call hooks with no output then, and would
                # only turn an error raised here into a warning): the empty logits may be why.
                logger.warning("%s (forward raised after the head input was shrunk)", message)
                return None
            raise RuntimeError(message)
        if phase is _Phase.CONSUMED:
            return _without_logits(output, logits)
        return None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self._reset()
        if self.model.__dict__.get("_loss_function") is self.loss:
            if self.had_own_loss:
                self.model.loss_function = self.previous_loss
            else:
                del self.model._loss_function


def _without_logits(output: Any, logits: Tensor | None) -> Any:
    """The output with ``logits=None``, like Liger in training: the [B, 0, V] placeholder
    would only mislead a caller that reads it."""
    try:
        from transformers.utils import ModelOutput
    except ImportError:  # pragma: no cover
        ModelOutput = ()
    if isinstance(output, ModelOutput) and "logits" in output.keys():
        # Setting the attribute to None leaves the key in the dict (ModelOutput.__setattr__
        # skips None), so rebuild: a field left None is absent, as HF's own outputs have it.
        return type(output)(**{k: v for k, v in output.items() if k != "logits"})
    if isinstance(output, tuple) and logits is not None:
        return type(output)(None if x is logits else x for x in output)
    return output


class ChunkedLoss:
    """The chunked LM-head loss installed on every supported causal LM inside ``root``.

    Use ``ChunkedLoss.install(model_or_peft_model, chunk_tokens="auto")``; ``remove()`` puts
    back the plain path. Training forwards with ``labels=`` then return ``logits=None``; eval,
    ``torch.no_grad()`` and ``generate()`` are untouched.
    """

    def __init__(self, heads: list[_ChunkedHead]):
        self._heads = heads

    @classmethod
    def install(cls, root: nn.Module, chunk_tokens: ChunkTokens = "auto", promises=None,
                piece_numel: int | None = None) -> ChunkedLoss:
        """``piece_numel``: a head with more elements computes each chunk's logits over
        vocabulary pieces of at most that many elements (the engine passes its largest block's:
        no tile of logits is made from more than a block's worth of head); None: whole."""
        resolve_chunk_tokens(chunk_tokens, 1)  # validate now, not at the first step
        if not isinstance(root, nn.Module):
            raise TypeError(f"ChunkedLoss.install: root is a {type(root).__name__}; pass the model (an nn.Module).")
        from transformers import PreTrainedModel

        found = [m for m in root.modules() if isinstance(m, PreTrainedModel) and is_causal_lm_class(type(m))]
        if not found:
            logger.info("chunked loss: no causal LM found in %s; the plain loss path is used", type(root).__name__)
        heads = []
        for model in found:
            if isinstance(model.__dict__.get("_loss_function"), functools.partial) and \
                    model.__dict__["_loss_function"].func is _ChunkedHead._loss:
                raise ValueError(f"ChunkedLoss.install: {type(model).__name__} already has a chunked loss; "
                                 f"call remove() on the first ChunkedLoss before installing again.")
            plan, reason = analyse_causal_lm(model)
            if plan is None:
                logger.info("chunked loss: the plain loss path is used for %s", reason)
                continue
            logger.debug("chunked loss: %s", reason)
            heads.append(_ChunkedHead(model, plan, chunk_tokens, promises, piece_numel))
        return cls(heads)

    def read_in_pieces(self, pieces) -> None:
        """The heads whose weight is ``pieces.weight`` ask it for its pieces (vocab_pieces.py)."""
        for head in self._heads:
            head.vocab_pieces[id(pieces.weight)] = pieces

    @property
    def models(self) -> list[nn.Module]:
        """The causal LMs that take the chunked path."""
        return [h.model for h in self._heads]

    def remove(self) -> None:
        """Removes every hook and restores each model's previous ``loss_function``; idempotent."""
        for head in self._heads:
            head.remove()
        self._heads = []


__all__ = [
    "AUTO_CHUNK_BYTES",
    "MAX_VOCAB_PIECES",
    "ChunkedLinearCrossEntropy",
    "ChunkedLoss",
    "HeadTransform",
    "LossPlan",
    "analyse_causal_lm",
    "chunked_linear_cross_entropy",
    "is_causal_lm_class",
    "resolve_chunk_tokens",
    "vocab_piece_rows",
]
