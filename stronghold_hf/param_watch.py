"""Whether any module or parameter was registered anywhere since a given moment.

The engine answers "which parameters are not in a unit" (the split's resident ones, adapters
attached after `offload_model`) at every clip and step. Walking ``model.parameters()`` for it
costs time that grows with depth (about 3 ms per step at 40 blocks, on the training thread).
torch calls global hooks whenever a parameter or a submodule is registered on any module;
counting those calls gives a *generation* that changes whenever a parameter set may have
changed, so the walk runs once per change instead of once per step.

Parameters registered around the hooks (``module._parameters[name] = p``) are not seen; PEFT,
TRL and transformers register through ``setattr`` or ``register_parameter``, which are.
"""

from __future__ import annotations

import threading

from torch.nn.modules import module as _module

_lock = threading.Lock()
_generation = 0
_installed = False


def _bump(*_args):
    global _generation
    _generation += 1


def _install() -> None:
    global _installed
    with _lock:
        if not _installed:
            _module.register_module_parameter_registration_hook(_bump)
            _module.register_module_module_registration_hook(_bump)
            _installed = True


def generation() -> int:
    """A number that changes whenever any module registers a parameter or a submodule."""
    if not _installed:
        _install()
    return _generation


class ParametersOutside:
    """The parameters of ``model`` not in ``inside`` (ids), each once, in ``model.parameters()``
    order; walked again only when the generation moved (a parameter or module was registered)."""

    __slots__ = ("_model", "_inside", "_generation", "_value")

    def __init__(self, model, inside: set[int] | dict) -> None:
        self._model = model
        self._inside = inside
        self._generation = -1
        self._value: list = []

    def get(self) -> list:
        g = generation()
        if g != self._generation:
            seen: set[int] = set()
            out = []
            for p in self._model.parameters():
                if id(p) not in self._inside and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
            self._value = out
            self._generation = generation()
        return self._value
