"""The window's device slots: which units fill them, fetched ahead and evicted behind.

The schedule (``schedule.py``) decides *when* the window moves: a use of the unit at a
position of the forward sequence begins, forward or backward. This is *how* it moves there
(`make_resident`): evict the idle units the window no longer wants, make room when every slot
is taken, fetch the unit (after its CPU update: ``stepping.py``), and prefetch the next ``W``
positions' units in the direction of travel while slots are free. At the end of a
differentiable forward the last ``W`` positions' units stay (`evict_to_turn`): backward needs
them first, so the turn moves nothing.

A unit leaving the device takes its gradients with it (`release`): its lane is flushed, or
parked when another backward use of it is still to come (flush.py). At most ``W + 1``
streamed units hold a slot (``memory.DeviceSlotPool`` enforces it). This module holds the
window size and what it prefetched; it calls down only, into the units, the gradient flush and
the step coordinator, and is told the direction of travel by the schedule.
"""

from __future__ import annotations

from .flush import GradientFlush
from .memory import DeviceSlotPool
from .stats import EngineStats
from .stepping import StepCoordinator
from .unit import Residency, Unit


class WindowSlots:
    """The units in the window's slots; see the module docstring."""

    def __init__(self, units: list[Unit], sequence: list[int], positions_of: dict[int, list[int]], *,
                 window_size: int, pool: DeviceSlotPool, gradients: GradientFlush, coordinator: StepCoordinator,
                 stats: EngineStats) -> None:
        self.units = units
        self.sequence = sequence  # unit index at each forward position
        self.positions_of = positions_of  # unit index -> its positions
        self.window_size = window_size
        self.pool = pool
        self.gradients = gradients
        self.coordinator = coordinator
        self.stats = stats
        # Units at several positions of the sequence: they park their lane between backward uses.
        self._revisited = {u for u, positions in positions_of.items() if len(positions) > 1}
        self._prefetched: set[int] = set()  # fetched ahead of need (a fetch at need counts as on demand)
        self._ahead_cache: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def resize(self, window_size: int) -> None:
        """A new ``W`` (the probed choice of ``window_size="auto"``): the pool holds ``W + 1``."""
        self.window_size = window_size
        self.pool.resize(window_size + 1)

    # ------------------------------------------------------------------ one unit
    def fetch(self, u: Unit, *, forward: bool) -> None:
        self.coordinator.wait_update(u, forward=forward)  # it writes what the fetch reads
        u.begin_fetch()

    def release(self, u: Unit, *, backward: bool) -> None:
        """Ships a unit's gradients (if it has a lane) and evicts it.

        In ``backward``, a unit with another use still to come (a tied embedding, whose head
        use is done long before its input use; ALBERT's shared layer) keeps its lane instead:
        the lane is *parked* on the device and the next use accumulates into it, so the
        gradient crosses once, whole, with its norm taken on the device. Flushed after each use,
        a tied GPT-2 embedding crossed twice per step and its norm was taken on the host at clip
        (about 65 ms of a 292 ms step on the H200). Only a unit at several positions of the
        sequence parks: the queue has one lane more for each, so the blocks keep their K (a
        block used again by a second forward flushes as before)."""
        if u.grads.grad_buffer is not None:
            if backward and u.pending_backward > 0 and u.index in self._revisited:
                self.gradients.park(u)
            else:
                self.gradients.flush(u)
        if u.state is not Residency.ON_HOST:
            u.evict()

    # ------------------------------------------------------------------ the window
    def evict_idle(self, keep, *, backward: bool) -> None:
        """Releases every unit in the pool that is neither in ``keep`` nor held, in index order."""
        for idx in self.pool.sorted_in_use():
            u = self.units[idx]
            if idx not in keep and u.holds == 0:
                self.release(u, backward=backward)  # a lane goes with it: a collective, at the same point on every rank

    def turn_kept(self, pos: int) -> set[int]:
        """Units of the tail this differentiable pass already ran: backward needs them first."""
        n = len(self.sequence)
        return {self.sequence[j] for j in range(max(0, n - self.window_size), min(pos, n))
                if self.units[self.sequence[j]].pending_backward > 0}

    def evict_to_turn(self, *, backward: bool) -> None:
        """End of a pass over the sequence: only the tail a backward will need stays."""
        self.evict_idle(self.turn_kept(len(self.sequence)), backward=backward)

    def _ahead(self, pos: int, direction: int) -> list[int]:
        """The units to prefetch from ``pos`` in ``direction``: the next ``W`` positions' units,
        once each, not ``pos``'s own. Fixed for a window size, so worked out once per position."""
        key = (pos, direction, self.window_size)
        ahead = self._ahead_cache.get(key)
        if ahead is None:
            ahead = self._ahead_cache[key] = tuple(self._work_out_ahead(pos, direction))
        return ahead

    def _work_out_ahead(self, pos: int, direction: int) -> list[int]:
        n, w = len(self.sequence), self.window_size
        span = range(pos + 1, min(n, pos + w + 1)) if direction > 0 else range(pos - 1, max(-1, pos - w - 1), -1)
        out: list[int] = []
        for j in span:
            u = self.sequence[j]
            if u != self.sequence[pos] and u not in out:
                out.append(u)
        return out

    def make_resident(self, u: Unit, direction: int, pos: int) -> None:
        """Slides the window to position ``pos`` (unit ``u``), forward (``direction`` +1) or
        backward (-1): evicts what is not wanted, fetches ``u``, prefetches ahead. The resident
        unit only needs fetching."""
        forward = direction > 0
        if not u.streamed:
            if u.state is Residency.ON_HOST:
                self.fetch(u, forward=forward)
            return
        ahead = self._ahead(pos, direction)
        keep = {u.index, *ahead}
        if forward and pos > len(self.sequence) - self.window_size:
            keep |= self.turn_kept(pos)
        self.evict_idle(keep, backward=not forward)  # held units stay whatever keep says
        if u.state is Residency.ON_HOST:
            if self.pool.full:  # everything left is held or wanted: free the farthest wanted one
                self._make_room(u, pos, backward=not forward)
            if u.index not in self._prefetched:
                self.stats.add("fetches_on_demand", 1)
            self.fetch(u, forward=forward)
        self._prefetched.discard(u.index)
        for j in ahead:
            if self.pool.full:
                break
            nu = self.units[j]
            if nu.state is Residency.ON_HOST and not self.coordinator.update_pending(nu):
                self.fetch(nu, forward=forward)
                self._prefetched.add(j)

    def _distance(self, j: int, pos: int) -> int:
        return min((abs(p - pos) for p in self.positions_of.get(j, ())), default=len(self.sequence))

    def _make_room(self, u: Unit, pos: int, *, backward: bool) -> None:
        # Only units without a gradient lane, prefetches first: whether the pool is full depends
        # on how far this rank prefetched, and under data parallelism flushing a lane is a
        # collective, and a gathered unit evicted on one rank only would be gathered again by
        # that rank alone. Without prefetches in the pool, the residents are the same everywhere.
        units = self.units
        idle = [j for j in self.pool.in_use if units[j].holds == 0 and units[j].grads.grad_buffer is None]
        fetching = [j for j in idle if units[j].state is Residency.FETCHING]
        candidates = fetching or idle
        if not candidates:
            raise RuntimeError(
                f"stronghold: no device slot for {u.fqn}: all {self.pool.capacity} slots are held by units "
                f"{sorted(self.pool.in_use)} whose forward or backward is still running. Raise window_size."
            )
        self.release(units[max(candidates, key=lambda j: self._distance(j, pos))], backward=backward)
