"""Where gradient checkpointing meets the window: the checkpoint call, seen from outside.

transformers checkpoints a block by calling the block's ``_gradient_checkpointing_func``
(``torch.utils.checkpoint.checkpoint`` with the user's kwargs) on a function that runs the
block. *What* that function is changed between releases:

* 5.17 to 5.22: ``GradientCheckpointingLayer.__call__`` checkpoints ``nn.Module.__call__``,
  so module hooks run *inside* the checkpoint (in forward, and again in the recompute);
* 5.23 and later: only ``forward`` is checkpointed, so hooks run *outside* it, once.

The engine must put its saved-tensor hooks (``activations.py``: the block's checkpointed
inputs go to the host) *around* the checkpoint, never inside it: pushed from a forward
pre-hook on 5.17, they were innermost, caught every tensor the block saved, and the
checkpoint saved nothing, so nothing was recomputed and every activation was kept; with
reentrant checkpointing the pre-hook ran under ``no_grad`` and nothing was offloaded. Both
silently, with exact losses.

So the engine does not depend on where the hooks run. `CheckpointCall` stands in for every
``_gradient_checkpointing_func`` of the model (installed again whenever
``gradient_checkpointing_enable`` sets a new one): it is entered outside the checkpoint in
both styles, pushes the activation store's hooks there, and hands the checkpoint a function
that counts its own runs, so a recompute is *seen* (a run inside backward), not assumed.
`CheckpointWatch` keeps those counts per pass, tells the style by behaviour (does the block's
pre-hook fire inside the call?), and checks at the first step that what was promised
happened (``promises.py``).

[Note: copies of a model] ``copy.deepcopy`` of an offloaded model (TRL's reference model)
must not route the copy's checkpoints into this engine: a `CheckpointCall` deep-copies (and
pickles) as the function it stands in for.
"""

from __future__ import annotations

import copy
import functools
import logging
import weakref
from typing import Any, Callable

import torch
from torch import nn

from .hooks import in_backward, requires_grad_anywhere
from .promises import Promises

logger = logging.getLogger("stronghold_hf")

_ATTR = "_gradient_checkpointing_func"


class CheckpointCall:
    """A module's ``_gradient_checkpointing_func``, entered through the schedule."""

    __slots__ = ("inner", "_schedule", "unit")

    def __init__(self, inner: Callable, schedule, unit) -> None:
        self.inner = inner
        self._schedule = weakref.ref(schedule)
        self.unit = unit  # the block whose own function this is; None on a stack module

    def __call__(self, function: Callable, *args, **kwargs):
        schedule = self._schedule()
        if schedule is None or not torch.is_grad_enabled() or in_backward():
            return self.inner(function, *args, **kwargs)  # no backward will replay it: nothing to watch
        unit = self.unit if self.unit is not None else schedule.checkpoint_watch.unit_called_by(function)
        if unit is None:
            return self.inner(function, *args, **kwargs)
        return schedule.run_checkpointed(unit, self.inner, function, args, kwargs)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self.inner, memo)  # [Note: copies of a model]

    def __reduce__(self):
        return self.inner.__reduce__()


class CallRecord:
    """One checkpointed call of a block in a differentiable forward: how often its function ran
    in forward and in backward (the recompute), and whether its inputs were to leave the device."""

    __slots__ = ("unit_index", "position", "offload_here", "forwards", "recomputes")

    def __init__(self, unit_index: int, position: int, offload_here: bool) -> None:
        self.unit_index, self.position, self.offload_here = unit_index, position, offload_here
        self.forwards = self.recomputes = 0

    def counted(self, function: Callable) -> Callable:
        @functools.wraps(function)
        def run(*args, **kwargs):
            if in_backward():
                self.recomputes += 1
            else:
                self.forwards += 1
            return function(*args, **kwargs)

        return run


class CheckpointWatch:
    """The model's checkpoint calls, counted per pass, and the checks of the first step."""

    def __init__(self, model: nn.Module, block_of_module: dict[int, Any], promises: Promises) -> None:
        # transformers sets the function on every module that has a ``gradient_checkpointing``
        # attribute (the layers, and stack modules of older remote code that checkpoint
        # ``layer.__call__`` themselves): those are the places to watch.
        self.modules = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        self.block_of_module = block_of_module
        self.promises = promises
        self.style: str | None = None  # "call" (hooks inside the checkpoint) or "forward", once seen
        self._inside: list[Any] = []  # units whose checkpoint call is running on this thread
        self._warned_idle_offload = False
        self.last = {"checkpointed_calls": 0.0, "checkpoint_recomputes": 0.0}
        self.begin_pass()

    # ------------------------------------------------------------------ installation
    def install(self, schedule, modules: list[nn.Module] | None = None) -> None:
        """Puts a `CheckpointCall` in front of each module's checkpoint function that has none."""
        for m in modules if modules is not None else self.modules:
            inner = m.__dict__.get(_ATTR)
            if inner is not None and not isinstance(inner, CheckpointCall):
                m.__dict__[_ATTR] = CheckpointCall(inner, schedule, self.block_of_module.get(id(m)))

    def remove(self) -> None:
        for m in self.modules:
            call = m.__dict__.get(_ATTR)
            if isinstance(call, CheckpointCall):
                m.__dict__[_ATTR] = call.inner

    def unit_called_by(self, function: Callable):
        """The block a stack module's checkpoint runs: ``layer.__call__`` or a partial of it."""
        seen = 0
        while function is not None and seen < 8:
            seen += 1
            owner = getattr(function, "__self__", None)
            if isinstance(owner, nn.Module) and id(owner) in self.block_of_module:
                return self.block_of_module[id(owner)]
            if isinstance(function, functools.partial):
                if function.args and isinstance(function.args[0], nn.Module):
                    return self.block_of_module.get(id(function.args[0]))
                function = function.func
            else:
                function = getattr(function, "__wrapped__", None)
        return None

    # ------------------------------------------------------------------ counting
    def begin_pass(self) -> None:
        """Counts from here to the end of the next backward (one step, or one micro-batch)."""
        self.expected = 0  # checkpointed block calls seen by the block hooks
        self.records: list[CallRecord] = []  # the calls that went through a CheckpointCall
        self.hook_recomputes = 0  # block forward hooks run inside backward

    def block_forward(self, u, module: nn.Module) -> None:
        """A block's forward pre-hook, outside backward: count it if it is being checkpointed."""
        inside = bool(self._inside) and self._inside[-1] is u
        if self.style is None and inside:
            self.style = "call"
            logger.info("stronghold: gradient checkpointing wraps the blocks' whole call (module hooks run inside it)")
        if module.training and getattr(module, "gradient_checkpointing", False) and (inside or torch.is_grad_enabled()):
            self.expected += 1

    def block_recomputed(self) -> None:
        self.hook_recomputes += 1

    def enter(self, u, position: int, offload_here: bool) -> CallRecord:
        record = CallRecord(u.index, position, offload_here)
        self._inside.append(u)
        return record

    def leave(self, record: CallRecord, output: Any) -> None:
        self._inside.pop()
        if self.style is None:
            self.style = "forward"  # the call ran without the block's pre-hook inside it
            logger.info("stronghold: gradient checkpointing wraps the blocks' forward (module hooks run outside it)")
        if requires_grad_anywhere(output):  # a backward may replay it
            self.records.append(record)

    def stats(self) -> dict[str, float]:
        """Up to the last backward: checkpointed block calls, and how often their functions ran in it."""
        return dict(self.last)

    # ------------------------------------------------------------------ the first step's checks
    def check_forward(self, store) -> None:
        """End of a differentiable forward pass: did the checkpointed inputs leave the device?"""
        if self.expected == 0:
            if store is not None and store.requested is True and not self._warned_idle_offload:
                self._warned_idle_offload = True
                logger.warning("stronghold: offload_activations=True does nothing here: no block was checkpointed in "
                               "this training forward. Call model.gradient_checkpointing_enable() (or pass "
                               "--gradient_checkpointing) to offload the checkpointed inputs.")
            return
        if self.promises.checked("activation_offload") or store is None or store.offload is not True:
            return
        explicit = store.requested is True
        fix = ("call model.gradient_checkpointing_enable() from transformers (the engine offloads what its "
               "checkpoint function saves), or set StrongholdConfig(offload_activations=False) to keep the inputs "
               "on the device.")
        bypassed = self.expected - len(self.records)
        if bypassed > 0:
            self.promises.break_(
                "activation_offload",
                f"{bypassed} of {self.expected} checkpointed block calls did not go through the model's "
                f"_gradient_checkpointing_func, so the engine never saw their saved inputs: they stayed on the device.",
                fix, explicit=explicit)
            return
        away = [r for r in self.records if r.offload_here]
        unseen = sum(1 for r in away if not store.packed_positions.get(r.position))
        if unseen:
            self.promises.break_(
                "activation_offload",
                f"the checkpoint of {unseen} blocks saved its inputs out of the engine's sight (a saved-tensor hook "
                f"inside the block took them), so they stayed on the device.", fix, explicit=explicit)
            return
        if store.eligible_this_pass and not store.offloaded_this_pass:
            self.promises.break_(
                "activation_offload",
                f"none of the {store.eligible_this_pass} checkpointed inputs left the device.", fix, explicit=explicit)
            return
        if store.offloaded_this_pass:
            self.promises.keep("activation_offload",
                               f"{store.offloaded_this_pass} checkpointed inputs of {len(away)} blocks left the device")

    def check_backward(self) -> None:
        """End of a backward: was every checkpointed block recomputed?

        Judged only when no call recomputed, or every one did: a forward whose graph was
        dropped without a backward leaves calls that never recompute, and is no fault."""
        self.last = {"checkpointed_calls": float(self.expected),
                     "checkpoint_recomputes": float(sum(r.recomputes for r in self.records))}
        if self.promises.checked("checkpoint_recompute") or self.expected == 0:
            return
        fix = ("checkpoint the layers with transformers' model.gradient_checkpointing_enable(); if a saved-tensor "
               "hook of your own (torch.autograd.graph.saved_tensors_hooks, save_on_cpu) runs inside the blocks, "
               "remove it or turn gradient checkpointing off.")
        lost = [r for r in self.records if r.forwards and not r.recomputes]
        if lost and len(lost) < len(self.records):
            return  # some recomputed: the others belong to a dropped graph, or ran out of this backward
        if lost:
            self.promises.break_(
                "checkpoint_recompute",
                f"{len(lost)} of {len(self.records)} checkpointed block calls were never recomputed in backward: the "
                f"checkpoint saved their activations instead, so activation memory grows with depth.", fix,
                explicit=False)
            return
        bypassed = self.expected - len(self.records)
        seen_in_hooks = self.hook_recomputes - (sum(r.recomputes for r in self.records) if self.style == "call" else 0)
        if bypassed > 0 and seen_in_hooks < bypassed:
            self.promises.break_(
                "checkpoint_recompute",
                f"{bypassed} of {self.expected} checkpointed block calls did not go through the model's "
                f"_gradient_checkpointing_func and {bypassed - max(seen_in_hooks, 0)} of them were not seen "
                f"recomputing in backward.", fix, explicit=False)
            return
        self.promises.keep("checkpoint_recompute",
                           f"{sum(r.recomputes for r in self.records)} recomputes of {len(self.records)} checkpointed "
                           f"calls ({self.style or 'unknown'} style)")
