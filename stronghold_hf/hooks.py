"""The autograd side of the window: an identity on each use's inputs, hooks on its outputs,
and one token per unit use.

The schedule must know, for every *use* of a unit (one forward call that autograd will
differentiate), when its backward starts and when it is done:

* a tensor hook on each of the use's **outputs** runs as soon as the gradient w.r.t. one of
  them is ready: the unit's backward is about to start (pre-backward: make the unit
  resident, give its parameters a gradient buffer). Hooks, not a Function, because the
  outputs of a model (its loss) are often changed in place (``loss *= scale``), which
  autograd forbids on the outputs of a custom Function that returns its inputs;
* an identity on the use's **inputs** calls back once the gradients w.r.t. the inputs exist:
  the unit's backward is done (post-backward: ship its gradients, evict). For one input (a
  block's hidden states) the identity is a native view whose backward node has a pre-hook;
  for several, one `_CallInBackward` Function over all of them, so it runs once, when the
  last of them has its gradient.

Where a use begins and ends is told by module hooks (`install_module_hooks`): a forward
pre-hook and a forward hook on each block, on each module that registers a unit outside the
blocks, on the module before an LM head's region and on the model itself. Every hook here only
calls the schedule (``schedule.py``), which decides what the moment means.

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
import torch.utils._pytree as _pytree
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

#: The attribute that marks a module hook as the engine's own: sequence tiling (tiling.py) may
#: tile the module it is on, since the hook wraps the whole call.
ENGINE_HOOK = "_stronghold_engine_hook"


def in_backward() -> bool:
    """Whether autograd is executing a backward pass on this thread right now."""
    return torch._C._current_graph_task_id() != -1


#: The id of the backward pass autograd runs on this thread right now (-1: none); the C
#: function itself, called on every block's hooks.
current_graph_task = torch._C._current_graph_task_id


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


def _is_container_type(t: type) -> bool:
    """Whether pytree looks inside objects of type ``t`` (a registered node or a namedtuple)."""
    return t in _pytree.SUPPORTED_NODES or (issubclass(t, tuple) and hasattr(t, "_fields"))


#: Types whose objects hold no tensor pytree would find: skipped by `_grad_leaves`.
_OPAQUE: set[type] = {type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size}


def _grad_leaves(obj: Any, found: list) -> bool:
    """Appends the float tensors of ``obj`` that require grad to ``found``, looking inside plain
    tuples, lists and dicts; returns False (``found`` incomplete) at any other container type
    pytree knows (a ``ModelOutput``, a namedtuple), where the caller falls back to pytree.

    A block's call is ``(hidden_states,)`` plus a dict of masks, positions and caches: pytree's
    flatten and unflatten of it cost about 60 us on the autograd thread, this about 2."""
    t = type(obj)
    if t is torch.Tensor or t is nn.Parameter:
        if obj.requires_grad and obj.is_floating_point():
            found.append(obj)
        return True
    if t in _OPAQUE:
        return True
    if t is tuple or t is list or t is dict:
        for x in obj.values() if t is dict else obj:
            tx = type(x)
            if tx is torch.Tensor or tx is nn.Parameter:  # the leaves inline: no call per leaf
                if x.requires_grad and x.is_floating_point():
                    found.append(x)
            elif tx not in _OPAQUE and not _grad_leaves(x, found):
                return False
        return True
    if isinstance(obj, torch.Tensor):  # a tensor subclass is a leaf to pytree too
        if obj.requires_grad and obj.is_floating_point():
            found.append(obj)
        return True
    if _is_container_type(t):
        return False
    _OPAQUE.add(t)  # a leaf to pytree (a Cache object, a config): never looked into
    return True


def _replaced(obj: Any, new: dict[int, torch.Tensor]) -> Any:
    """``obj`` with each tensor whose id is in ``new`` replaced (plain tuples, lists, dicts only;
    containers with nothing replaced are returned as they are)."""
    t = type(obj)
    if t is tuple or t is list:
        items, changed = [], False
        for x in obj:
            y = x if type(x) in _OPAQUE else _replaced(x, new)
            changed |= y is not x
            items.append(y)
        return t(items) if changed else obj
    if t is dict:
        items, changed = {}, False
        for k, x in obj.items():
            y = items[k] = x if type(x) in _OPAQUE else _replaced(x, new)
            changed |= y is not x
        return items if changed else obj
    return new.get(id(obj), obj) if isinstance(obj, torch.Tensor) else obj


def _grad_tensors(tree: Any) -> tuple[list[torch.Tensor], bool]:
    """The float tensors of ``tree`` that require grad, and whether the fast scan saw them all."""
    found: list[torch.Tensor] = []
    if _grad_leaves(tree, found):
        return found, True
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()], False


def wrap_differentiable(callback: Callable[[], Any], tree: Any) -> tuple[Any, bool]:
    """Routes the float tensors of ``tree`` that require grad through one `_CallInBackward`.

    Returns the new tree and whether anything was wrapped (nothing requires grad: no node).
    """
    found: list[torch.Tensor] = []
    if _grad_leaves(tree, found):
        if not found:
            return tree, False
        if len(found) == 1:
            # One tensor (a block's hidden states): a native view, whose backward node calls
            # back before it runs: the same moment as `_CallInBackward`'s, without a Python
            # autograd Function (about 15 us less per block on the autograd thread).
            t = found[0]
            out = t.view_as(t)
            out.grad_fn.register_prehook(_PostBackwardPrehook(callback))
            if type(tree) is tuple and len(tree) == 2 and type(tree[0]) is tuple and tree[0] and tree[0][0] is t:
                # A module call ``(args, kwargs)`` whose first argument is the one tensor (a
                # block's hidden states): no second walk of the call to put the view in.
                return ((out, *tree[0][1:]), tree[1]), True
            return _replaced(tree, {id(t): out}), True
        outs = _CallInBackward.apply(callback, *found)
        return _replaced(tree, {id(t): o for t, o in zip(found, outs)}), True
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
    whether there was any such tensor.

    A pre-hook on each tensor's backward node, once per node: the moment a tensor hook would
    run (a tensor's hooks run as its node's pre-hooks, and an in-place change after this keeps
    both on the node before it), without ``Tensor.register_hook``'s Python (about 10 us per
    block on the training thread); and the node alone holds the callback, so a graph freed
    unrun frees the use. A leaf (no node) gets a tensor hook."""
    tensors, _ = _grad_tensors(tree)
    if not tensors:
        return False
    nodes: list = []
    for t in tensors:
        node = t.grad_fn
        if node is None:
            t.register_hook(_PreBackwardHook(callback))
        elif not any(n is node for n in nodes):
            nodes.append(node)
            node.register_prehook(_PostBackwardPrehook(callback))
    return True


class _PostBackwardPrehook:
    """A backward-node pre-hook that calls back and leaves the gradients as they are (on a
    use's inputs, its post-backward; on its outputs, its pre-backward)."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], Any]) -> None:
        self.callback = callback

    def __call__(self, grad_outputs) -> None:
        self.callback()
        return None


class _PreBackwardHook:
    """A tensor hook that calls back and leaves the gradient as it is."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], Any]) -> None:
        self.callback = callback

    def __call__(self, grad: torch.Tensor) -> None:
        self.callback()
        return None


def requires_grad_anywhere(tree: Any) -> bool:
    found: list[torch.Tensor] = []
    if _grad_leaves(tree, found):
        if found:
            return True
    leaves, _ = tree_flatten(tree)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


class UnitUse:
    """One differentiable forward call of one unit, until its backward is done.

    The pre- and post-backward nodes hold the only strong references to it (through their
    callbacks), so when autograd frees a graph whose backward never ran, the use is
    collected and `__del__` tells the schedule that this use will never need the unit.
    ``position`` is where in the forward sequence the use happened (-1 for the rest unit).
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


# ---------------------------------------------------------------------------- module hooks
def install_module_hooks(schedule, model: nn.Module, plan, units: list) -> list[Any]:
    """Registers the module hooks that drive ``schedule`` for ``plan``'s units (discovery.py);
    returns their handles. The forward hooks are ``always_call``, so a forward that raises
    still closes its use."""
    handles = [model.register_forward_pre_hook(schedule.on_model_forward_start, with_kwargs=True),
               model.register_forward_hook(schedule.on_model_forward_end, with_kwargs=True, always_call=True)]
    entry = plan.entry_positions
    for u in units:
        # A block's use is its forward; another unit's, the forward of a module that registers
        # it (the model's own forward already holds the rest unit).
        modules = [u.module] if u.kind == "block" else [m for m, _ in u.owners if m is not model]
        for m in modules:
            handles.append(m.register_forward_pre_hook(_pre_forward(schedule, u, entry.get(id(m))), with_kwargs=True))
            handles.append(m.register_forward_hook(_post_forward(schedule, u), with_kwargs=True, always_call=True))
    for region in plan.head_regions:
        u = units[region.unit]
        handles.append(region.start.register_forward_hook(_region_start(schedule, u, region.position)))
        # Before the model's own end hook (which closes the rest unit, opened earlier).
        handles.append(region.model.register_forward_hook(_region_end(schedule, u), prepend=True, always_call=True))
    return handles


def _pre_forward(schedule, u, positions):
    def hook(module, args, kwargs):
        return schedule.on_pre_forward(u, positions, args, kwargs)

    setattr(hook, ENGINE_HOOK, True)
    return hook


def _post_forward(schedule, u):
    def hook(module, args, kwargs, output):
        return schedule.on_post_forward(u, output)

    setattr(hook, ENGINE_HOOK, True)
    return hook


def _region_start(schedule, u, position: int):
    def hook(module, args, output):
        return schedule.on_region_start(u, position, output)

    return hook


def _region_end(schedule, u):
    def hook(module, args, output):
        return schedule.on_region_end(u, output)

    return hook
