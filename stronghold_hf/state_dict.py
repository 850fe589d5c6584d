"""``state_dict`` and ``load_state_dict`` on an offloaded model: hooks on each unit's modules.

Between steps an offloaded parameter points at its host master, so the default
``state_dict``/``load_state_dict`` of a module already read and write the right values. The
hooks, on every module that registers a unit's parameters (a block's module; an embedding, a
head, a norm outside the blocks), cover what the default cannot:

* a unit that is resident mid-pass (its parameters point at the compute-dtype device slot):
  ``state_dict`` returns the host values, ``load_state_dict`` evicts it first;
* sharded data-parallel state, where no rank holds a whole trainable parameter: ``state_dict``
  gathers (inside `WindowEngine.full_state_dict`, on every rank, and refuses otherwise), and
  ``load_state_dict`` writes each rank's piece of every full tensor into its masters;
* masters on disk (``nvme_masters``): ``state_dict`` maps them from the file copy-on-write
  (no RAM of their own), ``load_state_dict`` writes the file;
* an in-flight CPU update of the unit is waited for, and ``assign=True`` (which would replace
  the parameter objects the engine manages) is refused by name.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .unit import Residency, Unit


def install_state_dict_hooks(u: Unit, *, schedule, coordinator, reads) -> list[Any]:
    """The hooks on every module that registers ``u``'s parameters. ``schedule`` evicts a
    rest unit before a load, ``coordinator`` has its update waited for, ``reads``
    (host_reads.py) says whether every rank is gathering (``full_state_dict``)."""
    handles = []
    loaded: list[str] = []  # sharded load_state_dict: keys the pre-hooks took, until the post-hook reads them
    values = _ValuesOfOneCall()  # shared by the unit's modules: a tied weight gets one tensor under both names
    for module, names in u.owners:
        handles += [
            module.register_state_dict_post_hook(_state_dict_hook(reads, coordinator, u, names, values)),
            module._register_load_state_dict_pre_hook(_load_pre_hook(schedule, coordinator, u, names, loaded)),
            module.register_load_state_dict_post_hook(_load_post_hook(u, names, loaded)),
        ]
    return handles


class _ValuesOfOneCall:
    """A unit's whole values as one ``state_dict()`` call read them, for the unit's other modules
    in the same call: a weight tied across two modules (GPT-2's embedding and head) is read once
    (gathered once under sharded state, mapped once from the file) and is one tensor under both
    names, as in a plain model, so savers that drop tied duplicates (accelerate, safetensors)
    find the pair. Keyed by the call's destination dict, held weakly; let go with it."""

    __slots__ = ("_destination", "_values", "__weakref__")

    def __init__(self) -> None:
        self._destination = None
        self._values = None

    def get(self, destination) -> list[torch.Tensor] | None:
        return self._values if self._destination is not None and self._destination() is destination else None

    def put(self, destination, values: list[torch.Tensor]) -> None:
        me = weakref.ref(self)

        def forget(_) -> None:
            kept = me()
            if kept is not None:
                kept._destination = kept._values = None

        try:
            self._destination, self._values = weakref.ref(destination, forget), values
        except TypeError:  # a destination that cannot be referenced weakly: nothing is shared
            self._destination = self._values = None


def _state_dict_hook(reads, coordinator, u: Unit, names, shared: _ValuesOfOneCall):
    def hook(module, state_dict, prefix, local_metadata):
        coordinator.wait_update(u, forward=False)
        values = shared.get(state_dict)
        if values is None:
            values = _whole_values(reads, u)
            if values is None:
                return None
            shared.put(state_dict, values)
        for name, k in names:
            if prefix + name in state_dict:
                state_dict[prefix + name] = values[k]
        return None

    return hook


def _whole_values(reads, u: Unit) -> list[torch.Tensor] | None:
    """``u``'s values where the default ``state_dict`` would not read them whole; None where it does."""
    if u.sharded:
        if not reads.gathering:
            raise RuntimeError(
                "stronghold: with sharded CPU state (data parallel) each rank holds a shard of the offloaded "
                "weights; model.state_dict() alone cannot assemble them. Call engine.full_state_dict() on "
                "every rank (the Trainer's save does), or use StrongholdConfig(shard_cpu_state=False)."
            )
        return u.host.full_values()  # collective: every rank gathers this unit now, in the same order
    if u.host.masters_on_disk:
        return u.host.full_values()  # mapped from the file (nvme_masters)
    if u.state is not Residency.ON_HOST:  # mid-pass: the slot holds a compute copy
        return [v.detach() for v in u.host.param_views]
    return None


def _load_pre_hook(schedule, coordinator, u: Unit, names, loaded_keys: list[str]):
    def hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        coordinator.wait_update(u, forward=False)
        if u.state is not Residency.ON_HOST:
            if u.holds:
                raise RuntimeError(f"stronghold: load_state_dict during the forward or backward of {u.fqn}.")
            schedule.release(u)
        if not (u.sharded or u.host.masters_on_disk):
            return  # the default load writes each parameter, which is its host master now
        # Sharded: every rank takes its piece of each full tensor into its masters. On disk:
        # the values go to the file.
        loaded = []
        with torch.no_grad():
            for name, k in names:
                key = prefix + name
                if key not in state_dict or not u.layout.entries[k].trainable:
                    continue
                value = state_dict.pop(key)
                view = u.host.param_views[k]
                if tuple(value.shape) != tuple(view.shape):
                    error_msgs.append(f"size mismatch for {key}: copying {tuple(value.shape)} into {tuple(view.shape)}")
                    continue
                u.host.write_value(k, value.to(torch.float32))
                loaded.append(key)
        u.host.image_stale = not u.layout.masters_in_image
        loaded_keys.extend(loaded)

    return hook


def _load_post_hook(u: Unit, names, loaded_keys: list[str]):
    def hook(module, incompatible_keys):
        loaded = set(loaded_keys)
        if loaded:
            incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded]
            loaded_keys.clear()
        for name, k in names:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if owner._parameters.get(leaf) is not u.params[k]:
                raise RuntimeError(
                    f"stronghold: load_state_dict replaced parameter {name} of {u.fqn} (assign=True?). An offloaded "
                    "model keeps its parameter objects; load with assign=False, or engine.close() first."
                )

    return hook
