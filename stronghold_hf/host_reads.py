"""Reads of the offloaded parameters between steps, and their whole values across ranks.

Between steps every parameter points at host memory (unit_host.py, [Note: parameters always
point at real memory]), but three things can stand between a read and the value the last
``step()`` produced, and this module answers each:

* the unit's CPU update is still running, or a speculative update the step has not validated
  is applied: `read_barrier`, run by a guarded parameter's first read (read_guard.py), waits
  for it or undoes it;
* the masters are on disk (``nvme_masters``): the read barrier maps them from the file;
* this rank holds only a shard (sharded data-parallel state): no rank has the value, so the
  ranks assemble it together, `full_state_dict` (every offloaded weight, through the
  ``state_dict`` hooks of state_dict.py) or `gathered_parameters` (chosen parameters for the
  body of a ``with``, writes broadcast back on exit); a read outside them is refused with the
  fix named.

The engine holds one `HostReads` and registers it as its units' read barrier; it calls down
into the schedule (evict before reading), the step coordinator (wait for updates) and the
units' host state.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .param_watch import ParametersOutside
from .schedule import WindowSchedule
from .stepping import StepCoordinator
from .unit import Residency, Unit


class HostReads:
    """What a read between steps waits for, and the gathers of whole values; see the module
    docstring."""

    def __init__(self, model: nn.Module, units: list[Unit], *, schedule: WindowSchedule,
                 coordinator: StepCoordinator, dp, unit_of_param: dict[int, Unit],
                 device_parameters: ParametersOutside) -> None:
        self.model = model
        self.units = units
        self.schedule = schedule
        self.coordinator = coordinator
        self.dp = dp
        self._unit_of_param = unit_of_param
        self._device_parameters = device_parameters
        self.gathering = False  # inside full_state_dict(): every rank is gathering (state_dict.py reads it)
        self._gathered = 0  # depth of gathered_parameters() contexts

    def read_barrier(self, index: int, func=None) -> None:
        """A guarded parameter of unit ``index`` is about to be read by torch function ``func``
        (read_guard.py): its CPU update finishes first (a speculative update the step has not
        validated is undone, so the read sees what the last ``step()`` produced); a shard this
        rank holds is refused. A weight read in vocabulary pieces is served by its device side
        during a model forward ([Note: lent whole] in vocab_pieces.py)."""
        u = self.units[index]
        pieces = u.vocab_pieces
        if pieces is not None and pieces.serves_read(func, self.schedule.in_model_forward,
                                                     self.schedule.forward_records_graph, "outside its modules"):
            return
        self.coordinator.wait_update(u, forward=False)
        if u.host.masters_on_disk and not u.sharded and u.state is Residency.ON_HOST:
            u.host.materialize()  # the value, mapped from the file
        elif u.sharded and u.state is Residency.ON_HOST:
            if self.gathering or self._gathered:
                return  # the values are being assembled (full_state_dict, gathered_parameters)
            raise RuntimeError(
                f"stronghold: with sharded CPU state (data parallel) this rank holds only a shard of the parameters "
                f"of {u.fqn} between steps, so reading one here would give a placeholder, not its value. Read whole "
                "values with engine.full_state_dict() (on every rank), or inside `with "
                "engine.gathered_parameters(params):` entered on every rank (modifier_rank=r writes rank r's changes "
                "back), or use StrongholdConfig(shard_cpu_state=False)."
            )
        u.read_guard.unguard()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with every offloaded weight whole (fp32 masters for trainable
        ones). With sharded CPU state this gathers the shards: call it on every rank."""
        self.schedule.evict_all()
        self.gathering = True
        try:
            return self.model.state_dict()
        finally:
            self.gathering = False

    @contextlib.contextmanager
    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        """Whole parameters on every rank for the body of the ``with`` (`WindowEngine.gathered_parameters`)."""
        self.schedule.evict_all()
        self.coordinator.synchronize()
        if params is None:
            units = list(self.units)
            on_device = list(self._device_parameters.get())
        else:
            params = list(params)
            chosen = {self._unit_of_param[id(p)].index for p in params if id(p) in self._unit_of_param}
            units = [u for u in self.units if u.index in chosen]
            on_device = [p for p in params if id(p) not in self._unit_of_param]
        gathered = []
        self._gathered += 1
        try:
            for u in units:  # the same order on every rank: each full_values is a collective
                u.read_guard.unguard()
                if u.host.masters_on_disk and not u.sharded:
                    assert u.state is Residency.ON_HOST, f"{u.fqn}: gathered while resident"
                    u.host.materialize()  # a write is taken into the file at the next fetch
                elif u.sharded:
                    values = u.host.full_values()
                    with torch.no_grad():
                        for e, p, v in zip(u.layout.entries, u.params, values):
                            if e.trainable:
                                p.data = v
                    gathered.append(u)
            yield
        finally:
            self._gathered -= 1
            with torch.no_grad():
                for u in units:
                    trainable = [(k, p) for k, (e, p) in enumerate(zip(u.layout.entries, u.params)) if e.trainable]
                    if modifier_rank is not None and self.dp is not None:
                        self.dp.broadcast_([p.data for _, p in trainable], src=modifier_rank)
                    if u in gathered:
                        if modifier_rank is not None:
                            for k, p in trainable:
                                u.host.write_value(k, p.data.to(torch.float32))
                            u.host.image_stale = not u.layout.masters_in_image
                        for p, view in zip(u.params, u.host.param_views):
                            p.data = view
                        u.read_guard.guard()
                if modifier_rank is not None and self.dp is not None and on_device:
                    # Parameters left on the device (the split's resident units) are whole on
                    # every rank already: rank r's changes reach the others the same way.
                    self.dp.broadcast_([p.data for p in on_device], src=modifier_rank)
