"""The autograd functions that compute with a weight crossing in row pieces (vocab_pieces.py).

Each one asks its `VocabularyPieces` for one piece of rows at a time (``fetch``, then
``release``), in forward and again in backward (nothing of the weight is saved for backward),
and hands each piece's gradient to the host as soon as the piece is done (``add_piece_grad``);
the embedding's rows go and come back as rows. The weight itself is an input only so that
autograd runs the backward when it needs a gradient; the functions return none for it.

* `EmbeddingRows`: ``F.embedding`` of the input ids.
* `PiecewiseLinear`: ``F.linear`` on the whole vocabulary, logits made a piece of columns at a
  time (evaluation, ``generate``, a loss the chunked path does not take).
* `StreamedLinearCrossEntropy`: the chunked loss (chunked_loss.py) with the pieces outermost:
  each piece crosses once per forward and once per backward, whatever the number of chunks.
  Per row it keeps the running maximum, sum and target logit (fp32) across pieces, the same
  online log-sum-exp as the chunked loss's pieces, in the same order, so the loss and the
  gradients are the ones the chunked loss gives with the whole weight on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .chunked_loss import _rows, _uncached
from .tiled_function import autocast_state  # the forward's autocast, replayed in backward


# [Note: one rounding of the input gradient] With the whole weight, the head's gradient with
# respect to its input is one product, ``g @ W``, whose fp32 sums a 16-bit matmul rounds once to
# its 16-bit output (and autocast's cast then widens it for an fp32 input). A piece at a time,
# rounding each piece's product to 16 bits before adding them would round once per piece: the
# gradient of everything before the head would differ from plain training's by about the 16-bit
# step (0.3% here, measured on a bf16 Llama, which with Adam moved rarely used embedding rows by
# 0.04 in three steps against 0.015 whole). So each piece's product keeps its fp32 sums
# (`_product_fp32`), they are added in fp32, and the total is rounded once to the compute dtype:
# the whole product's value but for the order of the fp32 sums (on this machine, bit for bit).
# The backward runs with autocast off: a backward called inside ``torch.autocast`` would
# otherwise turn those fp32 products back into 16-bit ones.
_MM_OUT_DTYPE: bool | None = None  # whether torch.mm takes out_dtype on this device (CUDA, recent torch)


def _product_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of 16-bit matrices with the fp32 sums kept. On CUDA, ``mm(out_dtype=float32)``
    (cuBLAS accumulates in fp32 and writes it); a torch without it gets the 16-bit product
    widened, as before, rather than an fp32 GEMM many times slower. Elsewhere the product of the
    widened factors (each term exact in fp32: the CPU's 16-bit GEMM converts them too)."""
    global _MM_OUT_DTYPE
    if a.is_cuda:
        if _MM_OUT_DTYPE is not False:
            try:
                out = torch.mm(a, b, out_dtype=torch.float32)
                _MM_OUT_DTYPE = True
                return out
            except (RuntimeError, TypeError, NotImplementedError):
                _MM_OUT_DTYPE = False
        return (a @ b).float()
    return a.float() @ b.float()


class EmbeddingRows(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` from the rows of ``ids`` alone."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, pieces, padding_idx: int | None) -> Tensor:
        rows, host_ids = pieces.gather_rows(ids)
        # The ids on the host, kept from the forward: the backward copies none back.
        ctx.pieces, ctx.padding_idx, ctx.host_ids = pieces, padding_idx, host_ids
        return rows

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.needs_input_grad[1]:
            ctx.pieces.add_row_grads(ctx.host_ids, grad, ctx.padding_idx)
        return None, None, None, None


class PiecewiseLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for a ``[vocab, hidden]`` weight (and the unit's ``[vocab]``
    bias, or None), a piece of output columns at a time."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, pieces) -> Tensor:
        device_type = x.device.type
        ctx.autocast, ctx.pieces, ctx.has_bias = autocast_state(device_type), pieces, bias is not None
        ctx.save_for_backward(x)
        lead = x.shape[:-1]
        if x.numel() == 0:  # the chunked loss's shrunk head input: nothing to fetch
            dtype = ctx.autocast["dtype"] if ctx.autocast["enabled"] else x.dtype
            return x.new_empty((*lead, pieces.vocab), dtype=dtype)
        if not ctx.autocast["enabled"] and x.dtype == pieces.dtype:
            # Each piece's product written in place into its columns of the logits (the GEMM
            # takes the row stride): no piece-sized result and no strided copy of it, which
            # was most of what pieces added to a step (F.linear's own kernel, bit for bit).
            out = x.new_empty((*lead, pieces.vocab))
            x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, pieces.vocab)
            for k, (v0, v1) in enumerate(pieces.bounds):
                w = pieces.fetch(k)
                if bias is not None:
                    torch.addmm(pieces.fetch_bias(k), x2, w.t(), out=out2[:, v0:v1])
                else:
                    torch.mm(x2, w.t(), out=out2[:, v0:v1])
                pieces.release(k)
                del w
            return out
        out = None
        for k, (v0, v1) in enumerate(pieces.bounds):
            w = pieces.fetch(k)
            y = F.linear(x, w, pieces.fetch_bias(k) if bias is not None else None)
            pieces.release(k)
            if out is None:
                out = x.new_empty((*lead, pieces.vocab), dtype=y.dtype)
            out[..., v0:v1] = y
            del w, y
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if x.numel() == 0 or not (need_x or need_w or need_b):
            return (x.new_zeros(x.shape) if need_x else None), None, None, None
        # F.linear's own gradients, in the dtype it computed in (autocast's, or x's), without
        # computing the logits again: grad_x = g @ W, grad_W = g^T @ x, grad_b = the sum of g
        # over the rows, a piece of columns at a time.
        dtype = ctx.autocast["dtype"] if ctx.autocast["enabled"] and x.is_floating_point() else x.dtype
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are set here, whatever runs the backward
            return PiecewiseLinear._backward(ctx, x, grad, dtype, need_x, need_w, need_b)

    @staticmethod
    def _backward(ctx, x: Tensor, grad: Tensor, dtype: torch.dtype, need_x: bool, need_w: bool, need_b: bool):
        pieces = ctx.pieces
        xc = x.reshape(-1, x.shape[-1]).to(dtype)
        g = grad.reshape(-1, grad.shape[-1]).to(dtype)
        gx = torch.zeros(xc.shape, dtype=torch.float32, device=x.device) if need_x else None
        for k, (v0, v1) in enumerate(pieces.bounds):
            if need_b:
                pieces.add_bias_grad(k, g[:, v0:v1].sum(0).to(pieces.bias.dtype))
            if not (need_x or need_w):
                continue
            w = pieces.fetch(k)
            wc = w.to(dtype)
            if need_x:
                if wc.dtype == torch.float32:
                    gx.addmm_(g[:, v0:v1], wc)  # no piece-sized product to add
                else:
                    gx += _product_fp32(g[:, v0:v1], wc)  # [Note: one rounding of the input gradient]
            if need_w:
                gw = g[:, v0:v1].t() @ xc
                cast = gw.to(w.dtype)
                pieces.add_piece_grad(k, cast, booked=pieces.book(gw, cast))
                del gw, cast
            pieces.release(k)
            del w, wc
        return (gx.to(dtype).view(x.shape).to(x.dtype) if need_x else None), None, None, None


class StreamedLinearCrossEntropy(torch.autograd.Function):
    """`chunked_loss.ChunkedLinearCrossEntropy` with the head's pieces outermost (``bias``: the
    unit's own, or None)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, targets: Tensor, transform,
                chunk_tokens: int, pieces) -> Tensor:
        ctx.autocast, ctx.has_bias = autocast_state(hidden.device.type), bias is not None
        ctx.transform, ctx.chunk_tokens, ctx.pieces = transform, chunk_tokens, pieces
        n = index.numel()
        torch._assert_async(((targets >= 0) & (targets < pieces.vocab)).all(),
                            "chunked loss: a label is outside [0, vocab_size)")
        top = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.empty(n, dtype=torch.float32, device=hidden.device)
        picked = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        chunks = range(0, n, chunk_tokens)
        for k, (v0, v1) in enumerate(pieces.bounds):
            w = pieces.fetch(k)
            b = pieces.fetch_bias(k) if bias is not None else None
            for start in chunks:
                end = min(start + chunk_tokens, n)
                x = hidden[_rows(hidden, index[start:end])]
                t = targets[start:end]
                logits = transform(F.linear(x, w, b)).float()
                tile_top = logits.amax(dim=1)
                if k == 0:
                    top[start:end] = tile_top
                    total[start:end] = torch.exp(logits - tile_top[:, None]).sum(dim=1)
                else:
                    old = top[start:end]
                    new_top = torch.maximum(old, tile_top)
                    total[start:end] = (total[start:end] * torch.exp(old - new_top)
                                        + torch.exp(logits - new_top[:, None]).sum(dim=1))
                    top[start:end] = new_top
                inside = (t >= v0) & (t < v1)
                column = (t - v0).clamp(0, logits.shape[1] - 1)
                picked[start:end] = torch.where(inside, logits.gather(1, column[:, None]).squeeze(1),
                                                picked[start:end])
                del x, logits  # one tile at a time
            pieces.release(k)
            del w, b
        lse = top + torch.log(total)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in chunks:  # summed chunk by chunk, as the chunked loss does
            loss += (lse[start:start + chunk_tokens] - picked[start:start + chunk_tokens]).sum()
        ctx.save_for_backward(hidden, index, targets, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        hidden, index, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        pieces = ctx.pieces
        if not (need_hidden or need_weight or need_bias):
            return (None,) * 8
        n = index.numel()
        chunks = range(0, n, ctx.chunk_tokens)
        # The rows' gradient summed over the pieces in fp32 and rounded once, as the chunked loss
        # does: in the gradient itself when the hidden states are fp32, else in an fp32 sum of
        # the rows (tokens x hidden x 4 bytes, which the estimator counts).
        rows_of = [_rows(hidden, index[start:start + ctx.chunk_tokens]) for start in chunks]
        grad_hidden = hidden.new_zeros(hidden.shape) if need_hidden else None
        direct = need_hidden and hidden.dtype == torch.float32
        gx_all = (torch.zeros((n, hidden.shape[-1]), dtype=torch.float32, device=hidden.device)
                  if need_hidden and not direct else None)
        for k, (v0, v1) in enumerate(pieces.bounds):
            w = pieces.fetch(k)
            gw = pieces.new_grad(k) if need_weight else None
            b = pieces.fetch_bias(k) if ctx.has_bias else None
            gb = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if need_bias else None
            # A context per piece: autocast's cached cast of the piece is freed with it.
            with torch.enable_grad(), torch.autocast(**ctx.autocast):
                wl = w.detach().requires_grad_(need_weight)
                bl = None if b is None else b.detach().requires_grad_(need_bias)
                for start, rows in zip(chunks, rows_of):
                    end = min(start + ctx.chunk_tokens, n)
                    x = hidden[rows].detach().requires_grad_(need_hidden)
                    t = targets[start:end]
                    logits = ctx.transform(F.linear(_uncached(x, ctx.autocast), wl, bl)).float()
                    with torch.no_grad():
                        g = torch.exp(logits - lse[start:end, None])
                        inside = ((t >= v0) & (t < v1)).to(g.dtype)
                        g.scatter_add_(1, (t - v0).clamp(0, g.shape[1] - 1)[:, None], -inside[:, None])
                        g *= grad_total
                    wanted = [u for u, need in ((x, need_hidden), (wl, need_weight), (bl, need_bias)) if need]
                    grads = list(torch.autograd.grad(logits, wanted, g))
                    if direct:
                        grad_hidden[rows] += grads.pop(0)
                    elif need_hidden:
                        gx_all[start:end] += grads.pop(0)
                    if need_weight:
                        gw += grads.pop(0)
                    if need_bias:
                        gb += grads.pop(0)
                    del logits, g, grads, wanted, x
            del wl, bl
            if need_weight:
                cast = gw.to(w.dtype)
                pieces.add_piece_grad(k, cast, booked=pieces.grad_sum_bytes(k) + (pieces.book(cast) if cast is not gw
                                                                                   else 0))
                del cast
            if need_bias:
                pieces.add_bias_grad(k, gb.to(b.dtype))
            pieces.release(k)
            del w, gw, b, gb
        if gx_all is not None:
            for start, rows in zip(chunks, rows_of):
                grad_hidden[rows] = gx_all[start:start + ctx.chunk_tokens].to(grad_hidden.dtype)
        return grad_hidden, None, None, None, None, None, None, None


__all__ = ["EmbeddingRows", "PiecewiseLinear", "StreamedLinearCrossEntropy"]
