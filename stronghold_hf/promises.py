"""What the engine promised, checked once against what happened.

Some features hold only if the model runs its layers the way the engine expects: gradient
checkpointing must really recompute the blocks, offloaded checkpoints must really leave the
device, the chunked loss must really replace the full logits. A change in transformers (5.17
to 5.22 checkpoint a layer's whole ``__call__``, 5.23 and later only its ``forward``), a
wrapper, or a model's own forward can quietly break one, and training would still match
plain training: only memory would grow. So the first step that exercises a promise checks
it by behaviour (what was recomputed, what crossed, what the loss computed), and a promise
that does not hold is never silent:

* one warning that names the cause and the fix, when the feature was the engine's own
  choice (``"auto"``, a default);
* a ``RuntimeError`` with the same words, when the user asked for the feature explicitly;
* either way, ``memory_stats()`` says which promise is off: ``promise_<name>`` is 1.0 when
  it held and 0.0 when it did not (absent until checked), ``promises_broken`` counts them.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("stronghold_hf")

#: The promises the engine checks, by name.
PROMISE_NAMES = ("checkpoint_recompute", "activation_offload", "chunked_loss")


class PromiseBroken(RuntimeError):
    """A feature the user asked for explicitly does not work on this model."""


class Promises:
    """The outcome of each promise's check (see the module docstring)."""

    def __init__(self) -> None:
        self._outcome: dict[str, tuple[bool, str]] = {}  # name -> (held, what was seen)

    def checked(self, name: str) -> bool:
        return name in self._outcome

    def keep(self, name: str, seen: str) -> None:
        assert name in PROMISE_NAMES, name
        self._outcome[name] = (True, seen)
        logger.debug("stronghold: promise %s held: %s", name, seen)

    def break_(self, name: str, cause: str, fix: str, *, explicit: bool) -> None:
        """Records that ``name`` does not hold; warns once, or raises when ``explicit``."""
        assert name in PROMISE_NAMES, name
        first = name not in self._outcome
        self._outcome[name] = (False, cause)
        message = f"stronghold: {cause} Fix: {fix}"
        if explicit:
            raise PromiseBroken(message)
        if first:
            logger.warning(message)

    def stats(self) -> dict[str, float]:
        out = {f"promise_{name}": float(held) for name, (held, _) in self._outcome.items()}
        out["promises_broken"] = float(sum(not held for held, _ in self._outcome.values()))
        return out
