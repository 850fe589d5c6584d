"""The autograd side of the window: one identity Function, and one token per unit use.

The schedule must know, for every *use* of a unit (one forward call that autograd will
differentiate), when its backward starts and when it is done:

* a tensor hook on each of the use's **outputs** runs as soon as the gradient w.r.t. one of
  them is ready: the unit's backward is about to start (pre-backward: make the unit
  resident, give its parameters a gradient buffer). Hooks, not a Function, because the
  outputs of a model (its loss) are often changed in place (``loss *= scale``), which
  autograd forbids on the outputs of a custom Function that returns its inputs;
* an identity `_CallInBackward` on the use's **inputs** runs once the gradients w.r.t. the
  inputs exist: the unit's backward is done (post-backward: ship its gradients, evict).

A unit may be used several times in one step (two forwards and one backward; ALBERT's
shared layer group applied at every layer; a tied embedding at both ends), so residency is
counted per use, the way FSDP2 counts each unshard and reshard: a `UnitUse` is created at
each differentiable forward call and is done when its post-backward ran, or when autograd
frees its graph without running it (the token's finalizer tells the schedule). Nothing is
inferred from window positions.
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


def register_pre_backward(callback: Callable[[], Any], tree: Any) -> bool:
    """Calls ``callback`` when the gradient w.r.t. any float tensor of ``tree`` that requires
    grad is ready (the callback must tolerate being called once per such tensor). Returns
    whether there was any such tensor."""
    leaves, _ = tree_flatten(tree)
    found = False
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            t.register_hook(_PreBackwardHook(callback))
            found = True
    return found


class _PreBackwardHook:
    """A tensor hook that calls back and leaves the gradient as it is."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], Any]) -> None:
        self.callback = callback

    def __call__(self, grad: torch.Tensor) -> None:
        self.callback()
        return None


def requires_grad_anywhere(tree: Any) -> bool:
    leaves, _ = tree_flatten(tree)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


class UnitUse:
    """One differentiable forward call of one unit, until its backward is done.

    The pre- and post-backward nodes hold the only strong references to it (through their
    callbacks), so when autograd frees a graph whose backward never ran, the use is
    collected and `__del__` tells the schedule that this use will never need the unit.
    ``position`` is where in the forward sequence the use happened (-1 for the resident unit).
    """

    __slots__ = ("_schedule", "unit_index", "position", "backward_started", "done", "_pre_task", "__weakref__")

    def __init__(self, schedule, unit_index: int, position: int = -1) -> None:
        self._schedule = weakref.ref(schedule)
        self.unit_index = unit_index
        self.position = position
        self.backward_started = False
        self.done = False
        self._pre_task = None  # the backward pass whose pre-backward already ran (one per pass)

    @property
    def block_index(self) -> int:
        return self.unit_index

    def pre_backward(self) -> None:
        task = current_graph_task()
        if self._pre_task == task:
            return  # another output of the same use: its backward has started already
        self._pre_task = task
        schedule = self._schedule()
        if schedule is not None:
            schedule.on_pre_backward(self)

    def post_backward(self) -> None:
        schedule = self._schedule()
        if schedule is not None:
            schedule.on_post_backward(self)

    def __del__(self) -> None:
        if self.done:
            return
        schedule = self._schedule()
        if schedule is not None:
            schedule.on_use_dropped(self)


BlockUse = UnitUse
