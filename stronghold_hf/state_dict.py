"""``state_dict`` and ``load_state_dict`` on an offloaded model: hooks on each block.

Between steps an offloaded parameter points at its host master, so the default
``state_dict``/``load_state_dict`` of a block already read and write the right values. The
hooks cover what the default cannot:

* a block that is resident mid-pass (its parameters point at the compute-dtype device slot):
  ``state_dict`` returns the host values, ``load_state_dict`` evicts it first;
* sharded data-parallel state, where no rank holds a whole trainable parameter: ``state_dict``
  gathers (inside `WindowEngine.full_state_dict`, on every rank, and refuses otherwise), and
  ``load_state_dict`` writes each rank's piece of every full tensor into its masters;
* an in-flight CPU update of the block is waited for, and ``assign=True`` (which would replace
  the parameter objects the engine manages) is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from .block import OffloadedBlock, Residency


def install_state_dict_hooks(engine, b: OffloadedBlock) -> list[Any]:
    m = b.module
    return [
        m.register_state_dict_post_hook(_state_dict_hook(engine, b)),
        m._register_load_state_dict_pre_hook(_load_pre_hook(engine, b)),
        m.register_load_state_dict_post_hook(_load_post_hook(b)),
    ]


def _state_dict_hook(engine, b: OffloadedBlock):
    def hook(module, state_dict, prefix, local_metadata):
        engine.coordinator.wait_update(b, forward=False)
        if b.sharded:
            if not engine._gathering:
                raise RuntimeError(
                    "stronghold: with sharded CPU state (data parallel) each rank holds a shard of the offloaded "
                    "weights; model.state_dict() alone cannot assemble them. Call engine.full_state_dict() on "
                    "every rank (the Trainer's save does), or use StrongholdConfig(shard_cpu_state=False)."
                )
            values = b.full_values()  # collective: every rank gathers this block now
        elif b.state is not Residency.ON_HOST:  # mid-pass: the slot holds a compute copy
            values = [v.detach() for v in b.host_views]
        else:
            return None
        for name, value in zip(b.names, values):
            if prefix + name in state_dict:
                state_dict[prefix + name] = value
        return None

    return hook


def _load_pre_hook(engine, b: OffloadedBlock):
    def hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        engine.coordinator.wait_update(b, forward=False)
        if b.state is not Residency.ON_HOST:
            if b.holds:
                raise RuntimeError(f"stronghold: load_state_dict during the forward or backward of {b.fqn}.")
            engine._release(b)
        if not b.sharded:
            return  # the default load writes each parameter, which is its host master now
        # Sharded: every rank takes its piece of each full tensor into its masters.
        loaded = []
        with torch.no_grad():
            for k, (name, view) in enumerate(zip(b.names, b.host_views)):
                key = prefix + name
                if key not in state_dict or not b.layout.entries[k].trainable:
                    continue
                value = state_dict.pop(key)
                if tuple(value.shape) != tuple(view.shape):
                    error_msgs.append(f"size mismatch for {key}: copying {tuple(value.shape)} into {tuple(view.shape)}")
                    continue
                b._write_host_value(k, value.to(torch.float32))
                loaded.append(key)
        b.image_stale = not b.layout.masters_in_image
        b._loaded_keys = loaded

    return hook


def _load_post_hook(b: OffloadedBlock):
    def hook(module, incompatible_keys):
        loaded = set(getattr(b, "_loaded_keys", ()))
        if loaded:
            incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded]
            b._loaded_keys = []
        for name, p in zip(b.names, b.params):
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if owner._parameters.get(leaf) is not p:
                raise RuntimeError(
                    f"stronghold: load_state_dict replaced parameter {b.fqn}.{name} (assign=True?). An offloaded "
                    "model keeps its parameter objects; load with assign=False, or engine.close() first."
                )

    return hook
