"""The step coordinator: what happens between the end of backward and the next forward.

The engine owns one `StepCoordinator` (``engine.coordinator``). It holds the state of the
optimizer step that is not the schedule's: the global gradient norm, the clip coefficient,
the fp16 loss scale and its overflow verdict, and the tickets of the CPU updates in flight.
It sits below the schedule (which asks it whether a unit's update is done before fetching
the unit) and above the units; it never calls the schedule. Callers settle a backward that
raised (``schedule.settle()``) before asking it for norms.

The protocol with the optimizer (`optim/hybrid.py`) is narrow:

* ``take_step_scalars()``: the verdict (skip on overflow), the clip coefficient and the
  inverse loss scale the CPU kernel folds into its update;
* ``submit(unit, label, fn)``: runs ``fn`` (one unit's CPU Adam) on the host worker;
* ``synchronize()`` before touching optimizer state or hyperparameters;
* for speculation, ``speculation_record(unit)`` and the optimizer's per-unit work
  (``optimizer.updates``, optim/unit_update.py: ``apply_speculation``, ``undo``).

The schedule calls ``wait_update(unit)`` before it fetches a unit (the update writes what
the fetch reads) and ``update_pending(unit)`` so a prefetch never blocks on an update.

Exact global clipping without an extra pass over host gradients: when a unit's gradient
leaves the device and is its whole gradient for the step, its squared norm is computed on
the device right there (``GradientFlush.flush``). Only units whose gradient was accumulated on
the host (gradient accumulation, several uses, a late gradient) are re-normed on the host.
The coefficient is then folded into the CPU Adam kernel, so clipping itself costs no pass.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from .speculation import PartialNorm, SpeculationPolicy
from .workers import Ticket


class StepScalars(NamedTuple):
    """What the next optimizer step applies to the offloaded blocks' gradients."""

    found_inf: bool
    clip_coef: float
    inv_loss_scale: float
    norm_ratio: float | None = None  # the gradient norm over max_norm, when this step was clipped


def _state_bytes(optimizer) -> int:
    if optimizer is None:
        return 0
    total = 0
    for state in list(optimizer.state.values()):
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _host_sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of a unit's host gradients (fp32 scalar)."""
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
    return torch.stack([n.float() for n in norms]).square().sum()


class StepCoordinator:
    def __init__(self, *, units: list, worker, stats, dp, device: torch.device, speculative_step: str,
                 device_parameters) -> None:
        self.units = units  # every unit, in index order
        self.worker = worker
        self.stats = stats
        self.dp = dp
        self.device = device
        self._device_parameters = device_parameters  # () -> trainable parameters the engine leaves on the device
        self.optimizer = None
        self._tickets: dict[int, Ticket] = {}  # the latest CPU task of each block (the worker runs them in order)
        self._step_started_at: float | None = None
        self._first_ticket: Ticket | None = None  # the step's task for the first block the next forward needs
        self._clip_coef: float | None = None
        self._norm_ratio: float | None = None
        self._found_inf: bool | None = None
        self._resident_unscaled = False
        self.last_grad_norm: float | None = None
        self.last_max_norm: float | None = None
        # ---- speculation (speculation.py)
        self.policy = SpeculationPolicy(speculative_step)
        self.partial_norm = PartialNorm()
        self.speculating = False  # in this backward pass
        #: Whether the backward now running is followed by ``optimizer.step()`` with the
        #: gradients untouched except through the engine (the last micro-batch of an
        #: accumulation window, clipping through `clip_grad_norm_`). The Trainer and
        #: `prepare_stronghold` set it; without it only ``speculative_step="on"`` speculates.
        #: A wrong "yes" about the step only costs an undo (the next flush into a speculated
        #: block rolls it back); gradients changed in place before the step are refused there.
        self.step_signal = None

    # ------------------------------------------------------------------ the optimizer
    def attach_optimizer(self, optimizer) -> None:
        if self.optimizer is not None:
            raise ValueError("build_optimizer was already called for this engine; reuse the optimizer it returned.")
        self.optimizer = optimizer

    @property
    def scaler(self):
        return None if self.optimizer is None else self.optimizer.scaler

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiplies the loss by the global fp16 loss scale (identity without a scaler)."""
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    def optimizer_state_bytes(self) -> int:
        """Bytes of the CPU optimizer's state (host memory)."""
        return _state_bytes(getattr(self.optimizer, "cpu_optimizer", None))

    def device_optimizer_state_bytes(self) -> int:
        """Bytes of the device optimizer's state: 0 unless parameters are left on the device."""
        return _state_bytes(getattr(self.optimizer, "device_optimizer", None))

    # ------------------------------------------------------------------ CPU tasks in flight
    def submit(self, block, label: str, fn, *, counter: str = "cpu_adam_s") -> Ticket:
        """Runs ``fn`` (one unit's CPU work) on the host worker, after everything submitted before."""
        stats = self.stats

        def timed() -> None:
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            stats.add(counter, elapsed)
            stats.add("update_total_s", elapsed)

        ticket = self.worker.submit((label, " of ", block.fqn), timed, unit=block.index)
        self._tickets[block.index] = ticket
        if not ticket.done():
            block.read_guard.guard()  # a read before it finishes waits for it (read_guard.py)
        return ticket

    def submit_in_order(self, entries) -> None:
        """Runs ``(unit, label, fn, counter)`` entries (the step's updates, in the order the next
        forward needs the units) on the host worker as one task. Each unit gets a ticket of its
        own, finished with its last entry, so the next forward waits per unit as before; one
        task instead of one per unit means one wake-up of the worker and one pass through its
        queue per step (unit_grads.py, [Note: torch calls on the host worker]). A unit whose work
        raises has the error on its ticket; the units after it are still updated."""
        groups: list[tuple[object, list, Ticket]] = []
        for block, label, fn, counter in entries:
            if groups and groups[-1][0] is block:
                groups[-1][1].append((fn, counter))
            else:
                groups.append((block, [(fn, counter)], Ticket((label, " of ", block.fqn))))
        if not groups:
            return
        for block, _, ticket in groups:
            self._tickets[block.index] = ticket
            if not self.worker.inline:  # inline, it is done when submit returns
                block.read_guard.guard()  # a read before its update finishes waits for it (read_guard.py)
        stats, clock = self.stats, time.perf_counter

        def run_all() -> None:
            for _, work, ticket in groups:
                try:
                    for fn, counter in work:
                        t0 = clock()
                        fn()
                        elapsed = clock() - t0
                        stats.add(counter, elapsed)
                        stats.add("update_total_s", elapsed)
                except BaseException as err:  # re-raised, naming the unit, where its ticket is waited on
                    ticket._error = err
                ticket._finish()

        self.worker.submit("the CPU updates of a step", run_all, unit=None)

    def run_inline(self, block, label: str, fn, *, counter: str = "cpu_adam_s") -> None:
        """Runs one unit's CPU work on the training thread (the unit the next forward needs first)."""
        stats = self.stats
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as err:  # the same message a worker task's failure gets
            raise RuntimeError(f"stronghold: {label} of {block.fqn} failed: {err!r}") from err
        t1 = time.perf_counter()
        stats.add(counter, t1 - t0)
        stats.add("update_total_s", t1 - t0)
        if self._first_ticket is None and self._step_started_at is not None:
            stats.add("first_block_ready_s", t1 - self._step_started_at)
            self._first_ticket = False  # accounted

    def begin_updates(self) -> None:
        self._step_started_at = time.perf_counter()
        self._first_ticket = None
        self.stats.add("steps", 1)

    def note_first_block(self, block) -> None:
        """The first block the next forward needs has its last task queued: time it from the step."""
        if self._first_ticket is not None:
            return
        ticket = self._tickets.get(block.index)
        if ticket is not None and not ticket.done():
            self._first_ticket = ticket
        else:  # already up to date (its speculative update finished during backward)
            self.stats.add("first_block_ready_s", 0.0)
            self._first_ticket = False

    def _account_first_block(self) -> None:
        ticket, started = self._first_ticket, self._step_started_at
        if ticket is None or ticket is False or started is None:
            return
        ready = 0.0 if ticket is False or ticket.finished_at is None else max(0.0, ticket.finished_at - started)
        self.stats.add("first_block_ready_s", ready)
        self._first_ticket = None

    def update_pending(self, block) -> bool:
        ticket = self._tickets.get(block.index)
        return ticket is not None and not ticket.done()

    def wait_update(self, block, *, forward: bool = True) -> None:
        """Before the engine reads ``block``'s bytes: its CPU work is done (and a speculative
        update that no step validated is undone first)."""
        if block.grads.spec is not None:
            self.undo_speculation(block)
        ticket = self._tickets.pop(block.index, None)
        if ticket is not None:
            if not ticket.done():
                self.stats.count_host_block()
                waited = ticket.wait()
                self.stats.add("blocked_s", waited)
                if forward:
                    self.stats.add("forward_stall_s", waited)
            else:
                ticket.wait()  # re-raises the task's error; no time to count
            if self._first_ticket is ticket:
                self._account_first_block()

    def _wait_ticket(self, block) -> None:
        ticket = self._tickets.get(block.index)
        if ticket is not None:
            if not ticket.done():
                self.stats.count_host_block()
            self.stats.add("blocked_s", ticket.wait())

    def synchronize(self) -> None:
        """Waits for every in-flight CPU task (before reading masters, saving, clipping)."""
        for index in list(self._tickets):
            ticket = self._tickets.pop(index)
            if not ticket.done():
                self.stats.count_host_block()
            self.stats.add("blocked_s", ticket.wait())
            if self._first_ticket is ticket:
                self._account_first_block()
            unit = self.units[index]
            # A shard or masters on disk stay guarded: a read must not see the placeholder.
            if unit.grads.spec is None and not unit.guard_on_host:
                unit.read_guard.unguard()

    # ------------------------------------------------------------------ speculation
    def begin_backward_pass(self) -> None:
        """At the first pre-backward of a pass: speculate in this pass or not."""
        opt = self.optimizer
        expect_step = self.step_signal() if self.step_signal is not None else self.policy.mode == "on"
        self.speculating = bool(expect_step and opt is not None and opt.can_speculate and self.policy.should_speculate())
        if self.speculating:
            self.synchronize()  # the groups' hyperparameters are written next
            inv_scale = opt.prepare_speculation()
            # The flushed norms are of the loss-scaled gradient: the limit is in the same units.
            limit = None if self.last_max_norm is None else self.last_max_norm / inv_scale
            self.partial_norm.reset(limit)

    def speculate(self, block) -> None:
        """``block``'s gradient for this step is complete on its way to the host: update it now.

        Once the blocks folded so far already exceed ``max_norm`` the step will clip whatever
        the rest hold: the pass stops speculating, so the blocks after need no record, no
        guard, no task and no rollback at the step."""
        if self.partial_norm.exceeded:
            self.speculating = False
            return
        record = self.optimizer.speculation_record(block)
        if record is None:
            return
        block.grads.spec = record
        block.read_guard.guard()  # a read before the step validates it sees the value the last step produced
        partial = self.partial_norm
        self.submit(block, "the speculative CPU optimizer update",
                    lambda: self.optimizer.updates.apply_speculation(block, record, partial),
                    counter="speculative_update_s")
        self.stats.add("speculated_blocks", 1)

    def undo_speculation(self, block) -> None:
        if block.grads.grads_modified_in_place():
            # The undo recomputes the old moments from the gradient the update read: refuse
            # rather than undo with a gradient that was changed since.
            self._wait_ticket(block)  # did the speculative update run?
            if block.grads.spec.applied:
                raise RuntimeError(
                    f"stronghold: the gradients of {block.fqn} were changed in place after the engine had updated the "
                    "block speculatively with them, and the step it guessed did not come, so the update can no "
                    "longer be undone exactly. Clear gradients with zero_grad(set_to_none=True) or "
                    "optimizer.zero_grad(), or set StrongholdConfig(speculative_step='off')."
                )
        record, block.grads.spec = block.grads.spec, None
        block.grads.spec_blocked = True  # more gradient arrived or the step did not come: no second guess
        self.submit(block, "the rollback of a speculative update", lambda: self.optimizer.updates.undo(block, record),
                    counter="rollback_s")

    # ------------------------------------------------------------------ norms and clipping
    def resident_grads(self) -> list[torch.Tensor]:
        """Gradients of the parameters the engine leaves on the device (``offload_non_block=False``,
        or added after ``offload_model``)."""
        return [p.grad for p in self._device_parameters() if p.grad is not None]

    def _offloaded_grads(self) -> list[torch.Tensor]:
        return [g for b in self.units for g in b.grads.current_grads()]

    def global_grad_sq_norm(self) -> torch.Tensor:
        """Sum of squared gradient entries over all parameters, as a device fp32 scalar.

        With sharded data parallelism each rank holds a shard of every block's gradient: the
        ranks' block parts are summed (one all-reduce of a scalar), with the resident part,
        which every rank holds whole after its all-reduce, counted once."""
        device = self.device
        zero = torch.zeros((), dtype=torch.float32, device=device)
        norms, squares = [], []  # L2 norms of flushes taken on the device; squared norms taken on the host
        for b in self.units:
            if not b.trainable:
                continue
            if b.grads.device_norm_valid():
                norms.append(b.grads.device_norm)
            else:  # accumulated on the host, or a .grad set outside the engine's flushes (by the user)
                grads = b.grads.current_grads()
                if grads:
                    squares.append(_host_sq_norm(grads).to(device))
        block_part = torch.stack(norms).to(device).square().sum() if norms else zero
        if squares:
            block_part = block_part + torch.stack(squares).sum()
        resident = self.resident_grads()
        resident_part = zero
        if resident:
            norms = torch._foreach_norm(resident)
            resident_part = torch.stack([n.float() for n in norms]).square().sum()
        dp = self.dp
        if dp is not None and dp.sharded:
            total = block_part + (resident_part if dp.rank == 0 else zero)
            return dp.sum_(total.reshape(1)).reshape(())
        return block_part + resident_part

    def global_grad_norm(self) -> torch.Tensor:
        """The total L2 norm of all gradients (unscaled), without clipping anything."""
        inv_scale = 1.0 if self.scaler is None else self.scaler.inv_scale
        return self.global_grad_sq_norm().sqrt() * inv_scale

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Exact global clipping over every parameter, offloaded or resident.

        Returns the total (unscaled) gradient norm, like ``torch.nn.utils.clip_grad_norm_``.
        Resident gradients are scaled in place now; offloaded ones inside the CPU Adam kernel
        of the next ``optimizer.step()``, or in place here when the engine's optimizer is not
        in use (a plain torch optimizer over ``engine.optimizer_parameters()``).
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_: only norm_type=2.0 is supported, got {norm_type}.")
        self.last_max_norm = float(max_norm)
        total_sq = self.global_grad_sq_norm()
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
        self._norm_ratio = float(total) / float(max_norm) if max_norm > 0 else None
        self.last_grad_norm = float(total)
        resident = self.resident_grads()
        if resident and coef * inv_scale != 1.0:
            torch._foreach_mul_(resident, coef * inv_scale)
        self._resident_unscaled = True
        if self.optimizer is None and coef != 1.0:
            offloaded = self._offloaded_grads()
            if offloaded:
                torch._foreach_mul_(offloaded, coef)
            self._clip_coef = 1.0
        return total

    def take_step_scalars(self) -> StepScalars:
        """Called by the optimizer's step: the verdict and coefficients, then reset."""
        inv_scale = 1.0 if self.scaler is None else self.scaler.inv_scale
        found_inf = self._found_inf
        if found_inf is None and self.scaler is not None:
            found_inf = not math.isfinite(float(self.global_grad_sq_norm()))
        if not self._resident_unscaled and inv_scale != 1.0 and not found_inf:
            resident = self.resident_grads()
            if resident:
                torch._foreach_mul_(resident, inv_scale)
        out = StepScalars(bool(found_inf), self._clip_coef if self._clip_coef is not None else 1.0, inv_scale,
                          self._norm_ratio if self._clip_coef is not None else None)
        self._clip_coef, self._found_inf, self._resident_unscaled, self._norm_ratio = None, None, False, None
        return out
