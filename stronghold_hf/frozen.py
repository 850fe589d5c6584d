"""Parameters frozen when the model was offloaded stay frozen.

A unit's layouts are fixed at ``offload_model``: a parameter frozen then has no fp32 master, no
place in the gradient layout, no gradient lane and no Adam state, and its bytes stream as
stored. Unfreezing it later (``requires_grad_(True)`` between two ``trainer.train()`` calls,
gradual unfreezing) would have it take gradients the engine has nowhere to put: a crash deep
in a backward for a vocabulary read in pieces, and otherwise a gradient that the global clip
norm never sees and no step applies. So each model forward that records a graph checks, before
any block runs, that those parameters are still frozen, and refuses by name otherwise. One
check per forward, in C over a list made once (nothing for a model trained whole).
"""

from __future__ import annotations

import operator

_requires_grad = operator.attrgetter("requires_grad")


class FrozenAtOffload:
    """The offloaded parameters that were frozen at ``offload_model``, and the check that they still are."""

    def __init__(self, units) -> None:
        self._where = [(u, e, u.params[k]) for u in units for k, e in enumerate(u.layout.entries) if not e.trainable]
        self._params = [p for _, _, p in self._where]

    def check(self) -> None:
        """Raises if one of them requires grad now (a forward that records a graph is about to run)."""
        if not any(map(_requires_grad, self._params)):
            return
        unit, entry, _ = next(w for w in self._where if w[2].requires_grad)
        raise RuntimeError(
            f"stronghold: {unit.fqn}.{entry.name} {tuple(entry.shape)} was frozen when the model was offloaded and "
            "requires grad now. The engine laid out its gradients and optimizer state at offload_model, with no "
            "gradient, fp32 master or Adam state for it, so it cannot train. Set requires_grad on every parameter "
            "you will train before offload_model (with the Trainer or the launcher: before the Trainer is built), "
            "or freeze it again. To unfreeze in stages, save the model (trainer.save_model()) and start the next "
            "stage from it with a new Trainer."
        )
