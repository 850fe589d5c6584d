"""The autograd side of the window: one identity Function, and one token per block use.

The engine must know, for every *use* of a block (one forward call that autograd will
differentiate), when its backward starts and when it is done:

* an identity `_CallInBackward` on the block's **outputs** runs its callback once every
  gradient w.r.t. those outputs exists: the block's backward is about to start
  (pre-backward: make the block resident, give its parameters a gradient buffer);
* the same Function on the block's **inputs** runs once the gradients w.r.t. the inputs
  exist: the block's backward is done (post-backward: ship its gradients, evict).

A block may be used several times in one step (two forwards and one backward; ALBERT's
shared layer group applied at every layer), so residency is counted per use, the way FSDP2
counts each unshard and reshard: a `BlockUse` is created at each differentiable forward call
and is done when its post-backward ran, or when autograd frees its graph without running it
(the token's finalizer tells the engine). Nothing is inferred from window positions.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def in_backward() -> bool:
    """Whether autograd is executing a backward pass on this thread right now."""
    return torch._C._current_graph_task_id() != -1


def current_graph_task() -> int:
    return torch._C._current_graph_task_id()


class _CallInBackward(torch.autograd.Function):
    """Identity on some tensors; its backward calls ``callback`` when their gradients are ready."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def wrap_differentiable(callback: Callable[[], Any], tree: Any) -> tuple[Any, bool]:
    """Routes the float tensors of ``tree`` that require grad through one `_CallInBackward`.

    Returns the new tree and whether anything was wrapped (nothing requires grad: no node).
    """
    leaves, spec = tree_flatten(tree)
    idx = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not idx:
        return tree, False
    outs = _CallInBackward.apply(callback, *[leaves[k] for k in idx])
    for k, t in zip(idx, outs):
        leaves[k] = t
    return tree_unflatten(leaves, spec), True


def requires_grad_anywhere(tree: Any) -> bool:
    leaves, _ = tree_flatten(tree)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


class BlockUse:
    """One differentiable forward call of one block, until its backward is done.

    The pre- and post-backward nodes hold the only strong references to it (through their
    callbacks), so when autograd frees a graph whose backward never ran, the use is
    collected and `__del__` tells the engine that this use will never need the block.
    """

    __slots__ = ("_engine", "block_index", "backward_started", "done", "__weakref__")

    def __init__(self, engine, block_index: int) -> None:
        self._engine = weakref.ref(engine)
        self.block_index = block_index
        self.backward_started = False
        self.done = False

    def pre_backward(self) -> None:
        engine = self._engine()
        if engine is not None:
            engine._on_pre_backward(self)

    def post_backward(self) -> None:
        engine = self._engine()
        if engine is not None:
            engine._on_post_backward(self)

    def __del__(self) -> None:
        if self.done:
            return
        engine = self._engine()
        if engine is not None:
            engine._on_use_dropped(self)
