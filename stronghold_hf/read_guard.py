"""Reads between steps see the finished update: parameters with work pending are guarded.

``optimizer.step()`` returns while the CPU updates of the units still run on the host worker;
the next forward waits for each unit's update only when it needs the unit, and that overlap
is the engine's speed. Code that reads a parameter in between (an EMA of the weights, a
weight-norm log line, ``torch.save(model.state_dict())``, an evaluation that reads weights
directly) would otherwise see half-updated values, silently. With sharded data-parallel
state a rank holds only a shard of each parameter, and the parameter is a placeholder.

DTensor intercepts every op on a sharded tensor with ``__torch_function__``. Here only the
parameters that need it are intercepted, and only while they do: a unit whose update is in
flight, whose speculative update the step has not validated, or whose parameters this rank
does not hold whole, switches its parameters' class to `GuardedParameter` (same object, still
an ``nn.Parameter``). The first op that reads one runs the unit's *read barrier* (registered
by the engine: wait for the update, undo an unvalidated speculation, or refuse a shard with
the fix named) and switches the unit back to ``nn.Parameter``. Metadata (shape, dtype,
``.grad``, ``requires_grad``) never waits, so ``model.zero_grad()`` after a step does not
stall the overlap. When nobody reads, the cost is one class assignment per parameter per step.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

#: id(parameter) -> (weak reference to the owner, key): the owner's ``read_barrier(key)`` runs
#: before a guarded parameter is read. A weak reference, so a dropped engine is not kept alive.
_BARRIERS: dict[int, tuple[weakref.ref, Any]] = {}

#: Attributes and methods that read no parameter values (``Tensor.grad.__get__`` is
#: ``"grad"``): they never wait.
_METADATA = frozenset({
    "grad", "_grad", "requires_grad", "is_leaf", "grad_fn", "_grad_fn", "retains_grad", "shape", "dtype",
    "device", "layout", "ndim", "names", "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_meta", "is_mkldnn",
    "is_nested", "output_nr", "_version", "_base", "_cdata", "itemsize", "nbytes", "_backward_hooks",
    "_post_accumulate_grad_hooks", "size", "dim", "numel", "nelement", "stride", "element_size", "is_contiguous",
    "is_floating_point", "is_complex", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "__hash__", "__len__", "get_device", "data_ptr", "_is_view", "storage_offset",
})


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a getset descriptor: Tensor.grad.__get__
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def reads_no_values(func: Any) -> bool:
    """Whether a torch function reads no values of its tensors (metadata: shape, dtype, ``.grad``, ``data_ptr``)."""
    return _name(func) in _METADATA


#: Functions that ask where a tensor's storage is, not what it holds (a saved-tensor hook keying
#: tensors by storage, safetensors' sharing check). They still wait for an update in flight.
_STORAGE_QUERIES = frozenset({"untyped_storage", "storage", "_typed_storage", "is_pinned", "is_shared"})


def asks_where_storage_is(func: Any) -> bool:
    """Whether a torch function only asks where its tensor's storage is (``untyped_storage()``)."""
    return _name(func) in _STORAGE_QUERIES


class GuardedParameter(nn.Parameter):
    """An ``nn.Parameter`` whose unit has work pending; see the module docstring."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _name(func) not in _METADATA:
            leaves, _ = tree_flatten((args, kwargs))
            for t in leaves:
                if type(t) is GuardedParameter:
                    entry = _BARRIERS.get(id(t))
                    owner = entry[0]() if entry is not None else None
                    if owner is not None:
                        owner.read_barrier(entry[1], func)
                    elif type(t) is GuardedParameter:
                        t.__class__ = nn.Parameter  # its engine is gone: nothing to wait for
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def register(params: Iterable[nn.Parameter], owner: Any, key: Any) -> None:
    """``owner.read_barrier(key, func)`` runs before torch function ``func`` reads any of
    ``params`` while they are guarded."""
    ref = weakref.ref(owner)
    for p in params:
        _BARRIERS[id(p)] = (ref, key)


def unregister(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        _BARRIERS.pop(id(p), None)
        if type(p) is GuardedParameter:
            p.__class__ = nn.Parameter


def guard(params: Iterable[nn.Parameter]) -> None:
    """Reads of ``params`` run their barrier first (plain ``nn.Parameter`` only: a parameter of
    another class, such as bitsandbytes' ``Params4bit``, keeps its class and is not guarded)."""
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = GuardedParameter


def unguard(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        if type(p) is GuardedParameter:
            p.__class__ = nn.Parameter


def is_guarded(p: torch.Tensor) -> bool:
    return type(p) is GuardedParameter


class ReadGuard:
    """The guard over one unit's parameters. `guard` switches their class so that a read runs
    the unit's barrier first; `unguard` switches it back. ``guarded``: whether the class may be
    switched now; the engine's own reads turn the guard off only then (fastpath.engine_method).
    `pin`: guarded for good (a weight read in vocabulary pieces: every read during a forward is
    looked at, vocab_pieces.py). The unit and its gradient state (unit_grads.py) share one, so
    both know."""

    __slots__ = ("params", "guarded", "pinned")

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.guarded = False
        self.pinned = False

    def guard(self) -> None:
        if not self.guarded:  # (a speculated unit is guarded at its record and again at its task's submission)
            guard(self.params)
            self.guarded = True

    def unguard(self) -> None:
        if self.guarded and not self.pinned:
            unguard(self.params)
            self.guarded = False

    def pin(self) -> None:
        self.guard()
        self.pinned = True


__all__ = ["GuardedParameter", "ReadGuard", "register", "unregister", "guard", "unguard", "is_guarded",
           "reads_no_values", "asks_where_storage_is"]
