"""A per-token function computed in tiles of tokens, with autograd: what sequence tiling runs.

``run`` maps ``[..., s, h]`` to ``[..., s, h']`` token by token (an MLP, a norm written in
torch: `tiling.probe` proved it). `TiledForward` computes it on tiles of ``T`` tokens under
``no_grad`` and keeps only its input; its backward computes each tile again with gradients and
differentiates it, so what the function holds beyond its input and output is ``O(T)``, not
``O(s)`` (ALST's TiledMLP). `tiled_forward` is the call: it saves the input first ([Note: the
input saved first]), so that a checkpoint's recompute can stop before the tiles.

The helpers that replay a forward in backward (its autocast, its RNG state) and sum parameter
gradients over tiles in fp32 are shared with attention tiling (``query_tiling.py``) and the
vocabulary pieces' products (``vocab_ops.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


def _tile(x: Tensor, start: int, tokens: int) -> Tensor:
    # Contiguous: a batch > 1 slices the middle dim, and modules ``view`` their input (GPT-2's
    # Conv1D). One tile's copy; free for batch 1, where the slice is contiguous already.
    return x[..., start:start + tokens, :].contiguous()


def run_in_tiles(run: Callable[[Tensor], Tensor], x: Tensor, tile_tokens: int) -> Tensor:
    """``run(x)`` assembled from ``run`` on tiles of ``x`` along dim -2 (under the caller's grad mode)."""
    s = x.shape[-2]
    out = None
    for start in range(0, s, tile_tokens):
        xt = _tile(x, start, tile_tokens)
        yt = run(xt)
        if not isinstance(yt, Tensor) or yt.shape[:-1] != xt.shape[:-1]:
            raise RuntimeError(f"sequence tiling: a tile of shape {tuple(xt.shape)} gave "
                               f"{tuple(yt.shape) if isinstance(yt, Tensor) else type(yt).__name__}; "
                               "a per-token module keeps the leading shape. Set sequence_tiling=False.")
        if out is None:  # [..., s, h_out], filled tile by tile: no list of tiles to concatenate
            out = yt.new_empty((*yt.shape[:-2], s, yt.shape[-1]))
        out[..., start:start + tile_tokens, :] = yt
    return out


def autocast_state(device_type: str) -> dict[str, Any]:
    return dict(device_type=device_type, enabled=torch.is_autocast_enabled(device_type),
                dtype=torch.get_autocast_dtype(device_type), cache_enabled=torch.is_autocast_cache_enabled())


def rng_state(device: torch.device) -> tuple:
    on_cuda = device.type == "cuda"
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if on_cuda else None, device


@contextlib.contextmanager
def replayed_rng(state: tuple | None):
    """The forward's RNG state for the recompute, and the caller's back afterwards (like
    ``torch.utils.checkpoint``'s ``preserve_rng_state``)."""
    if state is None:
        yield
        return
    cpu, device_state, device = state
    with torch.random.fork_rng(devices=[device] if device_state is not None else []):
        torch.set_rng_state(cpu)
        if device_state is not None:
            torch.cuda.set_rng_state(device_state, device)
        yield


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class ParameterGradSums:
    """The parameters' gradients over the tiles of a backward: each tile's added to a sum kept
    in fp32 for a 16-bit parameter and rounded once at the end ([Note: fp32 parameter sums])."""

    def __init__(self, count: int) -> None:
        self.sums: list[Tensor | None] = [None] * count

    def add(self, grads) -> None:
        for i, g in enumerate(grads):
            if g is None:
                continue
            if self.sums[i] is None:
                self.sums[i] = g.to(sum_dtype(g.dtype), copy=True)
            else:
                self.sums[i] += g

    def result(self, params: tuple, wanted: list[int]) -> list[Tensor | None]:
        """One entry per parameter of ``params`` (None where not wanted or never reached)."""
        out: list[Tensor | None] = [None] * len(params)
        for k, total in zip(wanted, self.sums):
            out[k] = None if total is None else total.to(params[k].dtype)
        return out


class SavedInput(torch.autograd.Function):
    """``x`` unchanged, saved for the `TiledForward` after it ([Note: the input saved first])."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


# [Note: the input saved first] A Function's saved tensors are packed when its forward
# returns, so a `TiledForward` that saved its own input would pack it after computing every
# tile. Under a non-reentrant checkpoint the backward's recompute of a block stops once the
# last tensor the backward needs is packed again (torch's early stop): when nothing after the
# tiled module saves anything (Llama's MLP, then a residual add), that is the tiled module's
# input, and its tiles' forward would run again for nothing, a third time with the forward
# and the backward's per-tile recompute. So the input is saved by a `SavedInput` node just
# before, whose pack comes first, and the recompute stops there; `TiledForward` reads it from
# that node. Where something later saves (Gemma2's norm after the MLP) the recompute goes on
# and computes the tiles, as it must.


class TiledForward(torch.autograd.Function):
    """``run(x)`` over tiles of ``tile_tokens`` along dim -2 of ``x``, keeping only ``x``.

    ``run`` is per-token (``[..., s, h] -> [..., s, h']``) and reads ``params``. They are
    inputs here only so that their gradients leave through this node to autograd's
    ``AccumulateGrad``, like any other gradient (``.grad`` stealing, accumulation, DDP's
    hooks). ``preserve_rng``: replay the forward's RNG state in the recompute (dropout).
    ``saver``: the `SavedInput` node that holds ``x`` ([Note: the input saved first]), or None
    to save it here.
    """

    @staticmethod
    def forward(ctx, run, tile_tokens: int, preserve_rng: bool, saver, x: Tensor, *params: Tensor) -> Tensor:
        ctx.run, ctx.tile_tokens, ctx.params, ctx.saver = run, tile_tokens, params, saver
        # [Note: autocast in backward] As torch.utils.checkpoint: the recompute must run under
        # the autocast of the forward (it decides the dtypes of the intermediates and so of
        # the gradients), not under whatever is active where ``backward()`` is called.
        ctx.autocast = autocast_state(x.device.type)
        ctx.rng = rng_state(x.device) if preserve_rng else None
        if saver is None:
            ctx.save_for_backward(x)
        return run_in_tiles(run, x, tile_tokens)  # autograd runs a Function's forward without grad

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        (x,) = ctx.saved_tensors if ctx.saver is None else ctx.saver.saved_tensors
        need_x = ctx.needs_input_grad[4]
        wanted = [k for k, need in enumerate(ctx.needs_input_grad[5:]) if need]
        params = [ctx.params[k] for k in wanted]
        grad_x = torch.empty_like(x) if need_x else None
        # [Note: fp32 parameter sums] Each tile's parameter gradient is summed in fp32 for a
        # 16-bit parameter, rounded once at the end: the untiled matmul sums over all tokens
        # in fp32 and rounds once; a 16-bit running sum would round once per tile.
        sums = ParameterGradSums(len(params))
        s, tokens = x.shape[-2], ctx.tile_tokens
        with torch.enable_grad(), torch.autocast(**ctx.autocast), replayed_rng(ctx.rng):
            for start in range(0, s, tokens):
                xt = _tile(x, start, tokens).detach().requires_grad_(need_x)
                # [Note: autocast's cache in backward] (chunked_loss.py): the tile's leaf, cached
                # by autocast to the end of this one context, would keep every tile's bf16 copy
                # of the input; a view of it is cast the same way but not cached.
                yt = ctx.run(xt.view_as(xt) if need_x and ctx.autocast["enabled"] else xt)
                inputs = [xt, *params] if need_x else params
                grads = (torch.autograd.grad(yt, inputs, _tile(grad_out, start, tokens), allow_unused=True)
                         if yt.requires_grad else (None,) * len(inputs))
                # [Note: tile lifetime] The tile's graph (its [.., T, ffn] intermediates) is
                # freed when ``grad`` returns; only the input gradient's slice and the sums stay.
                if need_x:
                    gx, grads = grads[0], grads[1:]
                    grad_x[..., start:start + tokens, :] = 0 if gx is None else gx
                sums.add(grads)
        return None, None, None, None, grad_x, *sums.result(ctx.params, wanted)


def tiled_forward(run, tile_tokens: int, preserve_rng: bool, x: Tensor, *params: Tensor) -> Tensor:
    """`TiledForward` of ``run`` on ``x``, its input saved first when it needs a gradient
    ([Note: the input saved first])."""
    saver = None
    if x.requires_grad:
        x = SavedInput.apply(x)
        saver = x.grad_fn
    return TiledForward.apply(run, tile_tokens, preserve_rng, saver, x, *params)


__all__ = ["ParameterGradSums", "SavedInput", "TiledForward", "autocast_state", "replayed_rng", "rng_state",
           "run_in_tiles", "sum_dtype", "tiled_forward"]
