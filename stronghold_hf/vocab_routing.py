"""Which calls a vocabulary unit read in pieces serves: the routing of its modules' forwards.

A unit read in pieces (`vocab_pieces.VocabularyPieces`) has no whole weight on the device, so
the calls that use it must be given the pieces instead. While a module that registers the
weight runs (its forward, between a pre-hook and an always-called hook that `install` puts on
it), a torch function mode (`_VocabCalls`) looks at every call that takes the weight:

* ``F.embedding`` on it: the rows a batch uses (`vocab_ops.EmbeddingRows`);
* ``F.linear`` on it, with or without its bias: a piece of columns at a time
  (`vocab_ops.PiecewiseLinear`);
* anything that reads only metadata (shape, dtype, ``data_ptr``): passed through;
* any other op on the weight (``x @ self.weight.T``, a norm of it): the unit is lent whole
  for that forward and its backward ([Note: lent whole] in vocab_pieces.py), and every op
  after that in the same forward runs on the lent copy.

The pieces count the routed calls running (``VocabularyPieces.routing``), so that the weight's
read guard lets their reads through; a read of the weight outside them during a model forward
is the read barrier's (`VocabularyPieces.serves_read`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .read_guard import reads_no_values


def install(pieces) -> list:
    """Routes the forwards of the modules that register ``pieces``' weight; returns the hooks'
    handles (removed with the engine's)."""
    handles = []
    seen: set[int] = set()
    for m, _ in pieces.unit.owners:
        if id(m) in seen:
            continue
        seen.add(id(m))
        stack: list[_VocabCalls] = []

        def enter(module, args, _stack=stack):
            mode = _VocabCalls(pieces)
            mode.__enter__()
            pieces.routing += 1
            _stack.append(mode)

        def leave(module, args, output, _stack=stack):
            if _stack:
                pieces.routing -= 1
                _stack.pop().__exit__(None, None, None)

        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave, always_call=True))
    return handles


def _embedding(pieces, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):  # F.embedding's signature
    if max_norm is not None or scale_grad_by_freq or sparse:  # its module's attributes said otherwise
        raise RuntimeError(
            f"stronghold: {pieces.unit.fqn} is read in vocabulary pieces, and an F.embedding call on it asked for "
            "max_norm, scale_grad_by_freq or sparse gradients, which pieces cannot give. Use "
            "StrongholdConfig(vocab_pieces=False).")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += pieces.vocab
    from .vocab_ops import EmbeddingRows

    return EmbeddingRows.apply(input, weight, pieces, padding_idx)


def _linear(pieces, input, weight, bias=None):  # F.linear's signature
    from .vocab_ops import PiecewiseLinear

    ours = bias is not None and bias is pieces.bias
    out = PiecewiseLinear.apply(input, weight, bias if ours else None, pieces)
    return out if bias is None or ours else out + bias


def _is_attribute_read(func) -> bool:
    return getattr(func, "__name__", "") == "__get__"


def describe_use(func) -> str:
    """How a torch function that read the weight is named in the log (``.T``, ``matmul()``)."""
    if _is_attribute_read(func):
        return f".{getattr(func.__self__, '__name__', '?')}"  # .T, .data: the whole weight carried on
    return f"{getattr(func, '__name__', func)}()"


class _VocabCalls(TorchFunctionMode):
    """While a module that registers the weight runs: its ``F.embedding`` and ``F.linear`` on the
    weight go through the pieces; any other op on the weight gets it lent whole ([Note: lent
    whole]), and so does every op after that in the same forward."""

    def __init__(self, pieces) -> None:
        super().__init__()
        self.pieces = pieces

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pieces = self.pieces
        if pieces.lent:
            return func(*args, **kwargs)
        weight, bias = pieces.weight, pieces.bias
        if (args[1] if len(args) > 1 else kwargs.get("weight")) is weight:
            if func is F.embedding:
                return _embedding(pieces, *args, **kwargs)
            if func is F.linear:
                return _linear(pieces, *args, **kwargs)
        if reads_no_values(func) or not any(a is weight or (bias is not None and a is bias)
                                            for a in (*args, *kwargs.values())):
            return func(*args, **kwargs)  # metadata (shape, dtype, data_ptr), or not the weight
        pieces.lend_whole(for_backward=torch.is_grad_enabled(), what=f"{describe_use(func)} in the forward of its module")
        return func(*args, **kwargs)


__all__ = ["describe_use", "install"]
