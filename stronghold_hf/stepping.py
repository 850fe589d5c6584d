"""The engine's side of the optimizer step: global gradient norm, clipping, loss scaling,
and the bookkeeping of in-flight CPU updates.

Kept apart from `window.py` (the schedule) because it is a separate concern: what happens
between the end of backward and the next forward.

Exact global clipping without an extra pass over CPU gradients: when a block's gradient
leaves the device and is the whole gradient of the step (no accumulation onto an earlier
micro-batch), its squared norm is computed on the device right there (one reduction over a
buffer that is being read anyway). Only blocks whose gradient was accumulated on the CPU
(gradient accumulation) are re-normed on the host. The coefficient is then folded into the
CPU Adam kernel, so clipping itself costs no pass either.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .workers import CPUWorkers, UpdateTicket


class StepScalars(NamedTuple):
    """What the next optimizer step applies to the offloaded blocks' gradients."""

    found_inf: bool
    clip_coef: float
    inv_loss_scale: float


class StepMixin:
    """Mixed into `WindowEngine`; needs ``self.blocks``, ``self.device``, ``self.model``."""

    def _init_stepping(self) -> None:
        self._pending_updates: dict[int, UpdateTicket] = {}
        self._deferred_zero: dict[int, bool] = {}
        self._optimizer = None
        self._clip_coef: float | None = None
        self._found_inf: bool | None = None
        self._resident_unscaled = False
        self._workers = CPUWorkers(self.config.resolved_cpu_threads())
        self.last_grad_norm: float | None = None

    # ------------------------------------------------------------------ optimizer
    def build_optimizer(self, params=None, **adamw_kwargs):
        """One `torch.optim.Optimizer` for the whole model: CPU Adam on the masters of the
        offloaded blocks (in worker threads, pipelined with the next forward) and a device
        AdamW on the resident parameters. ``params`` may be None (all trainable
        parameters), a list of model parameters, or Trainer-style param-group dicts.
        ``fp16_loss_scaling=True`` adds one global dynamic loss scaler (use
        `scale_loss`)."""
        from .optim.hybrid import build_optimizer

        return build_optimizer(self, params, **adamw_kwargs)

    def _attach_optimizer(self, optimizer) -> None:
        if self._optimizer is not None:
            raise ValueError("build_optimizer was already called for this engine; reuse the optimizer it returned.")
        self._optimizer = optimizer

    @property
    def optimizer(self):
        return self._optimizer

    def block_of(self, param):
        return self._block_param_ids[id(param)]

    # ------------------------------------------------------------------ in-flight updates
    def _submit_update(self, block, task) -> None:
        assert block.index not in self._pending_updates, f"{block.fqn}: update submitted twice"
        self._pending_updates[block.index] = self._workers.submit(block.index, block.fqn, task)

    def _wait_update(self, block) -> None:
        ticket = self._pending_updates.pop(block.index, None)
        if ticket is not None:
            self.stats.blocked_s += ticket.wait()
        zero = self._deferred_zero.pop(block.index, None)
        if zero is not None:
            self._zero_block_grads(block, set_to_none=zero)

    def synchronize(self) -> None:
        """Waits for every in-flight CPU update (before reading masters, saving, clipping)."""
        for block in self.blocks:
            if block.index in self._pending_updates or block.index in self._deferred_zero:
                self._wait_update(block)

    def shutdown_workers(self) -> None:
        """Finishes pending updates and joins the worker threads (restarted on demand)."""
        self.synchronize()
        self._workers.shutdown()

    def zero_master_grads(self, set_to_none: bool = True) -> None:
        for block in self.blocks:
            if block.index in self._pending_updates:
                self._deferred_zero[block.index] = set_to_none  # the worker still reads them
            else:
                self._zero_block_grads(block, set_to_none=set_to_none)

    @staticmethod
    def _zero_block_grads(block, *, set_to_none: bool) -> None:
        block.device_grad_sq_norm = None
        for m in block.masters:
            if m.grad is None:
                continue
            if set_to_none:
                m.grad = None
            else:
                m.grad.zero_()

    # ------------------------------------------------------------------ loss scaling
    @property
    def scaler(self):
        return None if self._optimizer is None else self._optimizer.scaler

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiplies the loss by the global fp16 loss scale (identity without a scaler)."""
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    # ------------------------------------------------------------------ norms and clipping
    def _resident_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.resident_parameters() if p.grad is not None]

    def _global_grad_sq_norm(self) -> torch.Tensor:
        """Sum of squared gradient entries over all parameters, as a device fp32 scalar."""
        self.synchronize()
        parts: list[torch.Tensor] = []
        for block in self.blocks:
            grads = [m.grad for m in block.masters if m.grad is not None]
            if not grads:
                continue
            if block.device_grad_sq_norm is not None:
                parts.append(block.device_grad_sq_norm.to(self.device))
            else:  # accumulated on the host: norm it there
                sq = sum(torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads)
                parts.append(torch.as_tensor(sq, dtype=torch.float32).to(self.device))
        resident = self._resident_grads()
        if resident:
            norms = torch._foreach_norm(resident)
            parts.append(torch.stack([n.float() for n in norms]).pow(2).sum())
        if not parts:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.stack(parts).sum()

    def invalidate_grad_norms(self) -> None:
        """Forgets the device partial norms (gradients were rescaled in place, e.g. fp16 unscale)."""
        for block in self.blocks:
            block.device_grad_sq_norm = None

    def global_grad_norm(self) -> torch.Tensor:
        """The total L2 norm of all gradients (unscaled), without clipping anything."""
        inv_scale = 1.0 if self.scaler is None else self.scaler.inv_scale
        return self._global_grad_sq_norm().sqrt() * inv_scale

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Exact global clipping over every parameter, offloaded or resident.

        Returns the total (unscaled) gradient norm, like ``torch.nn.utils.clip_grad_norm_``.
        Resident gradients are scaled in place now; offloaded ones are scaled inside the CPU
        Adam kernel of the next ``optimizer.step()`` (or in place here when the optimizer is
        not the engine's own).
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_: only norm_type=2.0 is supported, got {norm_type}.")
        total_sq = self._global_grad_sq_norm()
        inv_scale = 1.0 if self.scaler is None else self.scaler.inv_scale
        total = total_sq.sqrt() * inv_scale
        found_inf = not math.isfinite(float(total_sq))  # one scalar sync: the step needs it
        self._found_inf = found_inf
        if found_inf:
            self._clip_coef = 1.0
            self.last_grad_norm = float("inf")
            return total
        coef = min(1.0, float(max_norm) / (float(total) + 1e-6))
        self._clip_coef = coef
        self.last_grad_norm = float(total)
        resident_mul = coef * inv_scale
        resident = self._resident_grads()
        if resident and resident_mul != 1.0:
            torch._foreach_mul_(resident, resident_mul)
        self._resident_unscaled = True
        if self._optimizer is None and coef != 1.0:
            for block in self.blocks:
                for m in block.masters:
                    if m.grad is not None:
                        m.grad.mul_(coef)
            self._clip_coef = 1.0
        return total

    def _take_step_scalars(self) -> StepScalars:
        """Called by the optimizer's step: the verdict and coefficients, then reset."""
        inv_scale = 1.0 if self.scaler is None else self.scaler.inv_scale
        found_inf = self._found_inf
        if found_inf is None and self.scaler is not None:
            found_inf = not math.isfinite(float(self._global_grad_sq_norm()))
        if not self._resident_unscaled and inv_scale != 1.0 and not found_inf:
            resident = self._resident_grads()
            if resident:
                torch._foreach_mul_(resident, inv_scale)
        out = StepScalars(bool(found_inf), self._clip_coef if self._clip_coef is not None else 1.0, inv_scale)
        self._clip_coef, self._found_inf, self._resident_unscaled = None, None, False
        return out
