"""One global dynamic loss scaler for fp16 training across device and CPU parameters.

STRONGHOLD's artifact gave each optimizer its own scaler, so an overflow in one block could
skip that block's step while the others went ahead. Here a single scale multiplies the
loss; the overflow verdict is taken once, after backward, from every gradient (the device
partial norms of offloaded blocks and the resident gradients), and an overflowing step is
skipped for every parameter. The scale adapts exactly as ``torch.amp.GradScaler`` does:
halve on overflow, double after ``growth_interval`` clean steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DynamicLossScaler:
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    scale: float = field(init=False)
    _growth_tracker: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and self.growth_factor > 1.0 and 0.0 < self.backoff_factor < 1.0 and self.growth_interval >= 1):
            raise ValueError(
                "DynamicLossScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1."
            )
        self.scale = float(self.init_scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Adapts the scale after a step (skipped when ``found_inf``), like ``GradScaler.update``."""
        if found_inf:
            self.scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self.scale *= self.growth_factor
                self._growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
