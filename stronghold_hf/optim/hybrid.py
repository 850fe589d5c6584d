"""`StrongholdOptimizer`: one `torch.optim.Optimizer` over CPU masters and resident parameters.

The Trainer, accelerate and every LR scheduler expect a single optimizer. This one is a thin
composite:

* a `CPUAdam` over the fp32 masters of every unit (the blocks, and by default the embeddings,
  norms and heads outside them), one param group per (unit, user group), so a unit can be
  stepped alone from a worker thread;
* a device AdamW only over parameters the engine leaves on the device
  (``StrongholdConfig(offload_non_block=False)``, or parameters added after ``offload_model``).

Its ``param_groups`` are its own dicts, one per group the user gave ([Note: public groups]).
An LR scheduler writes them; ``step()`` copies the hyperparameters into the inner groups
*before* it submits any update. [Note: hyperparameter snapshot] The CPU updates run after
``step()`` returns, while the Trainer calls ``lr_scheduler.step()``; were the inner groups
the scheduler's dicts, a worker could read next step's learning rate. The copy happens once
every update of the previous step has finished (``engine.synchronize()``), so no worker is
reading an inner group while it is written.

[Note: the pipelined step] ``step()`` updates the device parameters (if any) at once, then
submits one CPU update per unit in the order the next forward needs them and returns. The
engine waits for unit ``i``'s update only when it next needs unit ``i`` (its prefetch in the
next forward), so update, host-to-device copy and forward pipeline across units. Clipping and the fp16 overflow
verdict are known before any update starts, because `WindowEngine.clip_grad_norm_` (or the
overflow check inside ``step``) ran after the whole backward.

Each unit's CPU work itself (its update, a speculative one, the undo) is ``unit_update.py``'s;
the step decides which unit gets which and queues it.

With ``StrongholdConfig(nvme_path=...)`` the CPU Adam moments live on disk (``nvme.py``):
``step()`` tells the tier the order of the updates it queued, and every update (and undo)
runs inside ``nvme.bound(unit)``, which brings the unit's moments into a ring buffer.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
from functools import partial
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..scaler import DynamicLossScaler
from ..speculation import SpecRecord
from . import quant8
from .cpu_adam import CPUAdam
from .segments import StateSegments
from .unit_update import UnitUpdates

logger = logging.getLogger("stronghold_hf")

_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")
_second = operator.itemgetter(1)


def _any_grad(grads: list[tuple[int, torch.Tensor | None]]) -> bool:
    """Whether any ``(index, gradient)`` pair has a gradient (the loop in C)."""
    return any(map(operator.is_not, map(_second, grads), itertools.repeat(None)))


def _normalise_groups(params: Any, defaults: dict[str, Any], model: nn.Module) -> list[dict[str, Any]]:
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    params = list(params)
    if not params:
        raise ValueError("build_optimizer: no parameters to optimize (every parameter is frozen?).")
    if isinstance(params[0], dict):
        groups = [dict(g) for g in params]
    else:
        groups = [{"params": params}]
    out = []
    for g in groups:
        unknown = set(g) - set(_HYPER_KEYS) - {"params"}
        if unknown - {"name", "initial_lr"}:
            raise ValueError(f"build_optimizer: param group keys {sorted(unknown)} are not supported; use {list(_HYPER_KEYS)}.")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        hyper = {k: g.get(k, defaults[k]) for k in _HYPER_KEYS}
        out.append({"params": ps, **hyper})
    return out


def _then_check_unwritten(task, grads) -> None:
    task()
    grads.check_unwritten()


class StrongholdOptimizer(torch.optim.Optimizer):
    """The optimizer `WindowEngine.build_optimizer` returns; see the module docstring."""

    def __init__(self, engine, cpu_optimizer: torch.optim.Optimizer, device_optimizer: torch.optim.Optimizer | None,
                 block_groups: dict[int, list[int]], scaler: DynamicLossScaler | None, defaults: dict[str, Any],
                 user_groups: list[dict[str, Any]], inner_user: list[int], nvme=None,
                 segments: StateSegments | None = None) -> None:
        self.engine = engine
        self.cpu_optimizer = cpu_optimizer
        self.device_optimizer = device_optimizer
        self.block_groups = block_groups
        self.scaler = scaler
        self._asynchronous = isinstance(cpu_optimizer, CPUAdam)
        self._inner_groups = self._collect_inner_groups()
        # [Note: public groups] One per group the user gave (the Trainer's decay / no-decay),
        # holding the model's parameters: the same on every rank and for every layout, so an LR
        # scheduler saved by one rank, or a checkpoint written by another world size, fits.
        # Inner groups (one per block and user group, and the resident ones) follow them.
        self._inner_user = list(inner_user)
        self._pushed: list[dict[str, Any]] | None = None  # see _push_hyperparameters
        self._speculation_hyper: list[dict[str, Any]] | None = None  # see prepare_speculation
        super().__init__([dict(g) for g in user_groups], defaults)
        self.last_step_skipped = False
        #: The NVMe tier holding the CPU Adam moments (``nvme.NvmeTier``), or None: in RAM.
        self.nvme = nvme
        #: The units whose CPU Adam state is stepped and streamed in segments (segments.py), or None.
        self.segments = segments
        #: Each unit's CPU work (unit_update.py), which the coordinator runs on the host worker.
        self.updates = UnitUpdates(cpu_optimizer, nvme, segments)

    def _collect_inner_groups(self) -> list[dict[str, Any]]:
        return [*(self.cpu_optimizer.param_groups if self.cpu_optimizer is not None else []),
                *(self.device_optimizer.param_groups if self.device_optimizer is not None else [])]

    def _push_hyperparameters(self) -> None:
        """Copies what schedulers changed in our groups into the inner ones (see the note). A
        tensor value (a tensor lr, which schedulers fill in place) is copied, not shared."""
        for inner, u in zip(self._inner_groups, self._inner_user):
            for key, value in self.param_groups[u].items():
                if key != "params":
                    inner[key] = value.clone() if isinstance(value, torch.Tensor) else value
        # What the inner groups hold now, per user group: `_hyperparameters_changed` compares
        # the few user groups with it instead of every inner group (one or two per block).
        self._pushed = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k in _HYPER_KEYS}
                        for g in self.param_groups]
        self._speculation_hyper = None  # taken again at the next speculating pass

    # ------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine, coordinator = self.engine, self.engine.coordinator
        engine.schedule.evict_all()
        scalars = coordinator.take_step_scalars()
        found_inf, clip_coef, inv_scale = scalars.found_inf, scalars.clip_coef, scalars.inv_loss_scale
        self.last_step_skipped = bool(found_inf)
        if self.scaler is not None:
            self.scaler.update(bool(found_inf))
        speculated = [b for b in engine.units if b.grads.spec is not None]
        hyper_changed = self._hyperparameters_changed()
        if hyper_changed or not speculated:
            coordinator.synchronize()  # running updates read the groups we are about to write
            if hyper_changed:
                self._push_hyperparameters()
        # [Note: validating speculation] A speculative update applied grad * inv_scale with the
        # hyperparameters of its pass. It stands when the step neither skips nor clips, the
        # scale and hyperparameters are those it used, and each block's gradient is exactly the
        # one it read; otherwise it is undone and the block is updated normally.
        guess_holds = (not found_inf and clip_coef == 1.0 and not hyper_changed
                       and all(b.grads.spec.grad_mul == inv_scale for b in speculated))
        # Plan every block first, then queue the CPU work in one go: the worker starts on block 0
        # while this thread moves on, instead of contending for the GIL with the planning loop.
        plan: list[tuple[Any, str, Any, str]] = []  # (block, label, task, counter)
        state_order: list = []  # the units whose state the planned tasks read, in order (NVMe tier)
        hits = misses = 0
        for block in engine.update_order:  # the order the next forward needs them: the first is updated first
            groups = self.block_groups.get(block.index)
            record, block.grads.spec, block.grads.spec_blocked = block.grads.spec, None, False
            if not groups:
                continue
            grads = block.grads.step_grads()
            if record is not None:
                modified = block.grads.grads_modified_in_place()
                if modified:
                    coordinator.wait_update(block, forward=False)  # did the speculative update run?
                if record.applied and modified:
                    raise RuntimeError(
                        f"stronghold: the gradients of {block.fqn} were changed in place between backward and "
                        "optimizer.step() after the engine had updated the block speculatively with them, so the "
                        "update can no longer be undone exactly. Clip with engine.clip_grad_norm_ (or the Trainer's "
                        "max_grad_norm), or set StrongholdConfig(speculative_step='off')."
                    )
                if guess_holds and not modified and block.grads.grads_match(grads, record.grads):
                    hits += 1
                    # Updated during backward, unless the pass stopped speculating before this
                    # block's turn: then the worker applies the update now (same coefficient).
                    plan.append((block, "the CPU optimizer update",
                                 self._reading_stepped_grads(block, partial(self.updates.complete_speculation, block,
                                                                            record)), "cpu_adam_s"))
                    continue
                misses += 1
                if (not found_inf and not modified and self.updates.fuses_redo and _any_grad(grads)
                        and block.grads.grads_match(grads, record.grads)):
                    # The usual miss (the step clipped): the rollback and the redo read the same
                    # gradients, so they run as one pass over the block's state (unit_update.py).
                    plan.append((block, "the rollback and redo of a speculative update",
                                 self._reading_stepped_grads(
                                     block, partial(self.updates.redo, block, record, groups, grads, clip_coef * inv_scale)),
                                 "rollback_s"))
                    state_order.append(block)
                    continue
                plan.append((block, "the rollback of a speculative update", partial(self.updates.undo, block, record),
                             "rollback_s"))
                state_order.append(block)
            if found_inf or not _any_grad(grads):
                continue
            plan.append((block, "the CPU optimizer update",
                         self._reading_stepped_grads(block, partial(self.updates.update, block, groups, grads,
                                                                    clip_coef * inv_scale)), "cpu_adam_s"))
            state_order.append(block)
        if self.device_optimizer is not None and not found_inf:
            # Before the CPU work: on a GPU it is a few asynchronous launches; on a CPU-only
            # device it would otherwise compete with the worker for the same cores.
            self.device_optimizer.step()
        if self.nvme is not None:
            # Reads start now, ahead of the updates: each unit's region, or its segments'.
            self.nvme.expect([key for b in state_order for key in self.updates.regions(b, self.block_groups[b.index])])
        coordinator.begin_updates()
        # Block 0 first, on this thread: the next forward needs it before anything else, and
        # handing it to the worker would add the worker's wake-up to the forward's wait. The
        # worker takes the other blocks once it is done, in order, each with every core.
        inline = self._asynchronous and next((e for e in plan if e[2] is not None), None)
        if inline:
            coordinator.wait_update(inline[0], forward=False)  # its speculative update, if any, ran first
            for block, label, task, counter in plan:
                if block is inline[0] and task is not None:
                    coordinator.run_inline(block, label, task, counter=counter)
        queued = [e for e in plan if e[2] is not None and not (inline and e[0] is inline[0])]
        if self._asynchronous:
            coordinator.submit_in_order(queued)
        else:
            for _, _, task, _ in queued:
                task()
        for block, _, _, _ in plan:
            coordinator.note_first_block(block)
        if speculated:
            engine.stats.add("speculation_hits" if misses == 0 else "speculation_misses", 1)
        coordinator.policy.record_step(clean=not found_inf and clip_coef == 1.0, speculated=bool(speculated),
                                       hit=bool(speculated) and misses == 0, norm_ratio=scalars.norm_ratio)
        return loss

    @staticmethod
    def _reading_stepped_grads(block, task):
        """``task``, the step's update of ``block``, then the check that nobody wrote into the
        gradients it read while it ran: they stay on show as ``.grad`` after ``step()``
        returns ([Note: the step's gradients stay on show], unit_grads.py)."""
        return partial(_then_check_unwritten, task, block.grads) if block.grads.stepped() else task

    # ------------------------------------------------------------------ speculation
    @property
    def can_speculate(self) -> bool:
        # A speculative update is undone by inverting AdamW exactly; 8-bit moments cannot be.
        return isinstance(self.cpu_optimizer, CPUAdam) and self.cpu_optimizer.state_bits == 32

    def _hyperparameters_changed(self) -> bool:
        pushed = self._pushed
        if pushed is None:
            # Nothing pushed since the inner groups were made or loaded: they may even share a
            # tensor lr with ours (filled in place, it would compare equal), so push.
            return True
        return any(bool(group.get(k) != values.get(k)) for group, values in zip(self.param_groups, pushed)
                   for k in _HYPER_KEYS)

    def prepare_speculation(self) -> None:
        """At the start of a speculating backward (no update running): the groups hold this step's
        hyperparameters, and the loss scale of this step is the one speculation applies."""
        if self._hyperparameters_changed():  # (what the inner groups hold is what their updates read)
            self._push_hyperparameters()
        self._speculation_scale = 1.0 if self.scaler is None else self.scaler.inv_scale
        # What each group's update will read in this pass, taken once per push (records share
        # them, read only).
        if self._speculation_hyper is None:
            self._speculation_hyper = [{k: group[k] for k in _HYPER_KEYS} for group in self.cpu_optimizer.param_groups]
        return self._speculation_scale

    def speculation_record(self, block) -> SpecRecord | None:
        groups = self.block_groups.get(block.index)
        grads = block.grads.host_grads()
        if not groups or not grads:
            return None
        hyper = self._speculation_hyper
        return SpecRecord(list(groups), grads, self._speculation_scale, [hyper[gi] for gi in groups])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.device_optimizer is not None:
            self.device_optimizer.zero_grad(set_to_none=set_to_none)
        self.engine.schedule.settle()
        coordinator = self.engine.coordinator
        for block in self.engine.units:
            if block.grads.spec is not None:  # the step it guessed did not come: undo it while its gradient is intact
                coordinator.undo_speculation(block)
        if not set_to_none:
            self.engine.coordinator.synchronize()  # zeroing in place writes what an update (or undo) may still read
        for block in self.engine.units:
            block.grads.zero_grads(set_to_none)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        self.engine.coordinator.synchronize()
        # With the NVMe tier the moments are read-only maps of its file (saved before the next step).
        with self.nvme.materialized() if self.nvme is not None else contextlib.nullcontext():
            cpu_state = self.cpu_optimizer.state_dict() if self.cpu_optimizer is not None else None
        return {
            "stronghold_format": 1,
            "cpu": cpu_state,
            # What each CPU state entry covers, by name: lets a checkpoint be loaded under another
            # data-parallel layout (a different world size, sharded or not). See `remap_cpu_state`.
            "cpu_pieces": self.cpu_pieces(),
            "device": self.device_optimizer.state_dict() if self.device_optimizer else None,
            # [Note: state by parameter name] What every CPU and device state entry belongs to,
            # by the model's parameter names: a checkpoint resumes under another device/host
            # split (split.py), where a parameter's state moves between the two. See `recut`.
            "cpu_names": self._cpu_names(),
            "device_pieces": self._device_pieces(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            # Our own groups run one scheduler step ahead of the inner ones (see the note).
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any], *,
                        release_source: Callable[[torch.Tensor], None] | None = None) -> None:
        """``release_source``: the state's tensors are maps of a checkpoint file; each is read
        into the host state (or the NVMe tier's file, a unit at a time) and then released, so
        resuming never holds the CPU state twice (`mapped_checkpoint.py`)."""
        if not isinstance(state_dict, dict) or state_dict.get("stronghold_format") != 1:
            raise ValueError(
                "StrongholdOptimizer.load_state_dict: this state was not saved by a stronghold optimizer "
                "(missing 'stronghold_format'). Resume from a checkpoint written with --stronghold."
            )
        if not self.layout_matches(state_dict):
            state_dict = self.recut([state_dict])  # another split, or pieces of another layout
        self.engine.coordinator.synchronize()
        if self.cpu_optimizer is not None and state_dict["cpu"] is not None:
            if self.nvme is not None:
                # The loaded moments (maps of the checkpoint when resuming) go to disk a unit at a time.
                self.cpu_optimizer.load_state_dict(state_dict["cpu"])
                self.nvme.absorb(release_source)
            else:
                self.cpu_optimizer.load_state_dict(state_dict["cpu"], release_source=release_source)
        if self.device_optimizer is not None and state_dict["device"] is not None:
            self.device_optimizer.load_state_dict(state_dict["device"])
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        # The inner loads replaced their group dicts: re-point at them and mirror their values.
        self._inner_groups = self._collect_inner_groups()
        saved_public = state_dict.get("param_groups")
        if not saved_public or (len(saved_public) != len(self.param_groups)
                                and len(saved_public) == len(self._inner_groups)):
            # Written before the public groups were the user's (one per inner group): each user
            # group takes the values of its first inner group.
            old = saved_public or [{k: v for k, v in g.items() if k != "params"} for g in self._inner_groups]
            first = {}
            for values, u in zip(old, self._inner_user):
                first.setdefault(u, values)
            saved_public = [first.get(u, {}) for u in range(len(self.param_groups))]
        if len(saved_public) != len(self.param_groups):
            raise ValueError(
                f"StrongholdOptimizer.load_state_dict: the checkpoint has {len(saved_public)} param groups, this "
                f"optimizer {len(self.param_groups)}; resume with the same model and stronghold settings."
            )
        for public, saved in zip(self.param_groups, saved_public):
            public.update(saved)
        self._pushed = self._speculation_hyper = None  # the inner groups hold what was loaded

    # ------------------------------------------------------------------ state by parameter name
    def _parameter_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.engine.model.named_parameters()}

    def _cpu_names(self) -> list[str] | None:
        """The model's name of the parameter behind each CPU state entry (``cpu_pieces`` order)."""
        if self.cpu_optimizer is None:
            return None
        names = self._parameter_names()
        of_master = {id(m): names[id(p)] for u in self.engine.units for m, p in zip(u.host.masters, u.params)
                     if m is not None}
        for key, sl in self.segments.slices.items() if self.segments is not None else ():
            of_master[key] = of_master[id(sl.master)]
        return [of_master[id(m)] for g in self.cpu_optimizer.param_groups for m in g["params"]]

    def _device_params(self) -> list[torch.Tensor]:
        if self.device_optimizer is None:
            return []
        return [p for g in self.device_optimizer.param_groups for p in g["params"]]

    def _device_pieces(self) -> list[tuple[str, int, int]]:
        """``(name, 0, numel)`` of each device optimizer parameter, in its state's index order."""
        names = self._parameter_names()
        return [(names[id(p)], 0, p.numel()) for p in self._device_params()]

    def layout_matches(self, state_dict: dict[str, Any]) -> bool:
        """Whether ``state_dict`` was saved with this optimizer's layout (the same split, the
        same pieces), so it loads entry by entry. A state saved before names were recorded is
        taken as matching: its inner loads say so if it does not."""
        if "cpu_names" not in state_dict:
            return True
        return (state_dict["cpu_names"] == self._cpu_names() and state_dict.get("cpu_pieces") == self.cpu_pieces()
                and [tuple(x) for x in state_dict["device_pieces"]] == self._device_pieces())

    def recut(self, saved: Iterable[dict[str, Any]]) -> dict[str, Any]:
        """This optimizer's ``state_dict`` with its CPU and device Adam state taken, by parameter
        name and element range, from states saved under another layout: another device/host
        split (a parameter's state moves between CPU Adam and the device AdamW), another
        data-parallel world size, sharded or not. ``saved`` yields the saved states (one per
        rank file of a sharded checkpoint), one held at a time; the public groups and the loss
        scale come from the first. A parameter the saved states do not cover raises, naming it."""
        mine = self.state_dict()
        cpu_names = mine["cpu_names"] or []
        targets = [("", n, offset, count) for n, (_, _, offset, count) in zip(cpu_names, mine["cpu_pieces"] or [])]
        n_cpu = len(targets)
        device_params = self._device_params()
        targets += [("", n, 0, count) for n, _, count in mine["device_pieces"]]
        shapes = [m.shape for g in (self.cpu_optimizer.param_groups if self.cpu_optimizer is not None else [])
                  for m in g["params"]] + [p.shape for p in device_params]
        first: dict[str, Any] = {}

        def entries():
            for written in saved:
                if "cpu_names" not in written:
                    raise ValueError(
                        "StrongholdOptimizer: this optimizer state was written before checkpoints recorded parameter "
                        "names, with another device/host split or data-parallel layout than this run's; resume it "
                        "with the StrongholdConfig(resident=..., gpu_memory=...) and world size that wrote it.")
                pieces = [("", n, offset, count) for n, (_, _, offset, count)
                          in zip(written["cpu_names"] or [], written["cpu_pieces"] or [])]
                states = dict(written["cpu"]["state"]) if written.get("cpu") else {}
                if not first:  # the device state is whole on every rank: the first file's
                    first.update({k: written.get(k) for k in ("scaler", "param_groups")})
                    for j, _ in enumerate(written["device_pieces"]):
                        st = (written.get("device") or {}).get("state", {}).get(j)
                        if st is not None:
                            states[len(pieces) + j] = st
                    pieces += [("", n, offset, count) for n, offset, count in written["device_pieces"]]
                yield pieces, states
                written = None  # the next file loads once this one is let go

        flat = remap_cpu_state(targets, shapes, entries())
        if mine["cpu"] is not None:
            mine["cpu"]["state"] = {j: st for j, st in flat.items() if j < n_cpu}
        if mine["device"] is not None:
            device_state = {}
            for j, st in flat.items():
                if j >= n_cpu:
                    p = device_params[j - n_cpu]
                    if quant8.is_8bit(st):  # lean host memory: the device AdamW keeps fp32 moments
                        st = quant8.state_to_fp32(st, p.shape)
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
                    device_state[j - n_cpu] = st
            mine["device"]["state"] = device_state
        mine["scaler"] = first.get("scaler")
        mine["param_groups"] = first.get("param_groups") or mine["param_groups"]
        return mine

    def cpu_pieces(self) -> list[tuple[str, str, int, int]] | None:
        """Per CPU optimizer parameter, in ``state_dict`` index order: ``(block, parameter name,
        first element, element count)`` of the piece of the parameter it is (the whole
        parameter unless CPU state is sharded)."""
        if self.cpu_optimizer is None:
            return None
        where: dict[int, tuple[str, str, int, int]] = {}
        for b in self.engine.units:
            for k, master in enumerate(b.host.masters):
                if master is not None:
                    offset, _, count = b.host.pieces[k]
                    where[id(master)] = (b.fqn, b.layout.entries[k].name, offset, count)
        for key, sl in self.segments.slices.items() if self.segments is not None else ():
            fqn, name, offset, _ = where[id(sl.master)]
            where[key] = (fqn, name, offset + sl.lo, sl.hi - sl.lo)
        return [where[id(p)] for g in self.cpu_optimizer.param_groups for p in g["params"]]

    @property
    def state(self):  # noqa: D401 - merged view for code that inspects optimizer.state
        merged = dict(self.cpu_optimizer.state) if self.cpu_optimizer is not None else {}
        if self.device_optimizer is not None:
            merged.update(self.device_optimizer.state)
        return merged

    @state.setter
    def state(self, value):  # Optimizer.__init__ assigns an empty state; the inner ones own it
        pass


def build_optimizer(engine, params: Iterable | None = None, *, fp16_loss_scaling: bool | DynamicLossScaler = False,
                    **adamw_kwargs: Any) -> StrongholdOptimizer:
    """See `WindowEngine.build_optimizer`."""
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    unknown = set(adamw_kwargs) - set(defaults) - {"fused", "foreach"}
    if unknown:
        raise ValueError(f"build_optimizer: unsupported AdamW arguments {sorted(unknown)}; use {sorted(defaults)}.")
    adamw_kwargs.pop("fused", None)
    adamw_kwargs.pop("foreach", None)
    defaults.update(adamw_kwargs)
    groups = _normalise_groups(params, defaults, engine.model)
    # With the NVMe tier, a unit larger than a block steps (and streams) in segments (segments.py).
    segments = (StateSegments.for_engine(engine) if engine.config.nvme_path is not None
                and engine.config.offload_optimizer else None)

    unit_at = {u.index: u for u in engine.units}
    cpu_groups: list[dict[str, Any]] = []
    block_groups: dict[int, list[int]] = {}
    device_groups: list[dict[str, Any]] = []
    cpu_users: list[int] = []  # the user group each inner group came from
    device_users: list[int] = []
    for u, g in enumerate(groups):
        hyper = {k: g[k] for k in _HYPER_KEYS}
        resident = [p for p in g["params"] if not engine.is_offloaded(p)]
        if resident:
            device_groups.append({"params": resident, **hyper})
            device_users.append(u)
        by_block: dict[int, list[nn.Parameter]] = {}
        for p in g["params"]:
            if engine.is_offloaded(p):
                block = engine.block_of(p)
                master = block.host.master_of(p)
                if master is None and block.host.is_trainable_param(p):
                    continue  # sharded data parallel: another rank keeps (and steps) this parameter
                if master is None:
                    raise ValueError(
                        f"build_optimizer: a parameter of {block.fqn} ({tuple(p.shape)}) was frozen when the model "
                        "was offloaded, so it has no fp32 master and no gradient. Set requires_grad on every parameter "
                        "you will train before offload_model (with the Trainer or the launcher: before the first "
                        "Trainer is built on this model). To unfreeze in stages, save the model "
                        "(trainer.save_model()) and start the next stage from it."
                    )
                by_block.setdefault(block.index, []).append(master)
        for idx, masters in by_block.items():
            cut = segments is not None and idx in segments.cut_units
            for part in segments.pack(unit_at[idx], masters) if cut else [masters]:
                block_groups.setdefault(idx, []).append(len(cpu_groups))
                cpu_groups.append({"params": part, **hyper})
                cpu_users.append(u)
    cpu_opt: torch.optim.Optimizer | None = None
    if cpu_groups and engine.config.offload_optimizer:
        lean = engine.config.host_memory == "lean"
        cpu_opt = CPUAdam(cpu_groups, **defaults, state_bits=8 if lean else 32)
        if lean:  # the whole parameter's size decides, so that every rank's piece (and segment) agrees
            whole = {id(m): e.numel for u in engine.units for m, e in zip(u.host.masters, u.layout.entries) if m is not None}
            if segments is not None:
                whole.update({key: whole[id(sl.master)] for key, sl in segments.slices.items()})
            masters = [m for g in cpu_groups for m in g["params"]]
            cpu_opt.set_state_bits([m for m in masters if whole[id(m)] < quant8.MIN_8BIT_NUMEL], 32)
            cpu_opt.set_state_bits([m for m in masters if whole[id(m)] >= quant8.MIN_8BIT_NUMEL], 8)
    elif cpu_groups:
        cpu_opt = torch.optim.AdamW(cpu_groups, **defaults, foreach=False)
    device_opt = None
    if device_groups:
        device_opt = torch.optim.AdamW(device_groups, **defaults, fused=True)
    scaler = fp16_loss_scaling if isinstance(fp16_loss_scaling, DynamicLossScaler) else (
        DynamicLossScaler() if fp16_loss_scaling else None)
    nvme = None
    if engine.config.nvme_path is not None and cpu_opt is None and engine.config.offload_optimizer:
        logger.info("stronghold: nvme_path is not used: the device/host split keeps every trained parameter on the "
                    "device, so there is no CPU Adam state to put on disk.")
    elif engine.config.nvme_path is not None:
        nvme = _nvme_tier(engine, cpu_opt, block_groups, segments)
    opt = StrongholdOptimizer(engine, cpu_opt, device_opt, block_groups, scaler, defaults, groups,
                              cpu_users + device_users, nvme, segments)
    if isinstance(cpu_opt, CPUAdam):
        # The kernel writes the compute-dtype image of each master in the same pass.
        stepped = {id(p) for g in cpu_groups for p in g["params"]}
        for block in engine.units:
            if block.layout.masters_in_image:
                continue
            for m, img in zip(block.host.masters, block.host.image_views):
                if m is not None and img is not None and id(m) in stepped:  # no image: fetches convert
                    cpu_opt.register_copy_out(m, img)
        for sl in segments.slices.values() if segments is not None else ():  # a segment: its range of the image
            block = unit_at[sl.unit]
            img = block.host.image_views[sl.k]
            if not block.layout.masters_in_image and img is not None:
                cpu_opt.register_copy_out(sl.param, img.view(-1)[sl.lo:sl.hi])

    if opt.can_speculate and engine.coordinator.policy.mode != "off":
        # The undo's native kernel is built (or loaded from the cache) now, not at the first
        # miss, which would pay its compile (about 0.7 s) inside a forward's wait.
        from .undo_native import native_undo_error

        native_undo_error()
    engine.coordinator.attach_optimizer(opt)
    return opt


def _nvme_tier(engine, cpu_opt, block_groups: dict[int, list[int]], segments: StateSegments | None):
    from ..nvme import MasterPiece, NvmeTier

    if not isinstance(cpu_opt, CPUAdam):
        raise ValueError("StrongholdConfig.nvme_path needs the engine's CPU Adam (offload_optimizer=True).")
    # A region per unit, or per segment (one param group each) of a unit cut into segments.
    units = []
    for u in engine.update_order:
        if u.index not in block_groups:
            continue
        if segments is not None and u.index in segments.cut_units:
            units += [((u.index, gi), f"{u.fqn} (segment {n})", list(cpu_opt.param_groups[gi]["params"]))
                      for n, gi in enumerate(block_groups[u.index])]
        else:
            units.append((u.index, u.fqn, [p for gi in block_groups[u.index]
                                           for p in cpu_opt.param_groups[gi]["params"]]))
    cfg = engine.config
    disk = engine.disk_masters
    master_pieces = None
    if disk is not None:  # nvme_masters: an update reads and writes a unit's masters with its moments
        previous = disk.tier
        if previous is not None:  # an optimizer built again: the old one's write-backs land first
            previous.flush()
        master_pieces = {u.index: [MasterPiece(m, piece[1], tuple(m.shape))
                                   for m, piece in zip(u.host.masters, u.host.pieces) if m is not None]
                         for u in engine.units if u.host.masters_on_disk
                         and (segments is None or u.index not in segments.cut_units)}
        # A segment's masters: its range of the unit's extent (segments.py: the unit's one master starts it).
        for u in engine.units:
            if segments is None or u.index not in segments.cut_units or not u.host.masters_on_disk:
                continue
            for gi in block_groups.get(u.index, ()):
                (param,) = cpu_opt.param_groups[gi]["params"]
                sl = segments.slices[id(param)]
                master_pieces[(u.index, gi)] = [MasterPiece(param, sl.lo, (sl.hi - sl.lo,))]
    return NvmeTier(cfg.nvme_path, cpu_opt, units, ring_buffers=cfg.nvme_ring_buffers, io_threads=cfg.nvme_io_threads,
                    ledger=engine.ledger, stats=engine.stats, masters=disk, master_pieces=master_pieces)


def remap_cpu_state(pieces: list[tuple[str, str, int, int]], shapes: list[torch.Size],
                    saved: Iterable[tuple[list[tuple[str, str, int, int]], dict[int, dict[str, Any]]]]
                    ) -> dict[int, dict[str, Any]]:
    """CPU Adam state for this optimizer's ``pieces`` from states saved under another layout.

    ``saved`` yields, one checkpoint file at a time, ``(pieces, state)`` of the optimizer that
    wrote it (``state_dict()["cpu_pieces"]`` and ``["cpu"]["state"]``); only one file's state
    is held at a time. Every element of a piece that has state must be covered exactly once
    by the saved pieces, or a ``ValueError`` says which parameter is not.
    """
    by_name: dict[tuple[str, str], list[int]] = {}
    for j, (block, name, _, _) in enumerate(pieces):
        by_name.setdefault((block, name), []).append(j)
    flat: dict[int, dict[str, Any]] = {}
    covered = [0] * len(pieces)  # elements with state
    found = [0] * len(pieces)  # elements the checkpoint has at all (stepped or not)
    for saved_pieces, saved_state in saved:
        for i, (block, name, offset, count) in enumerate(saved_pieces):
            st = saved_state.get(i)
            for j in by_name.get((block, name), ()):
                _, _, my_offset, my_count = pieces[j]
                lo, hi = max(offset, my_offset), min(offset + count, my_offset + my_count)
                if hi <= lo:
                    continue
                found[j] += hi - lo
                if st is None:
                    continue
                _copy_state_range(flat, j, st, my_count, lo - offset, lo - my_offset, hi - lo, _label(block, name))
                covered[j] += hi - lo
        saved_pieces = saved_state = None  # let this file go before the next one loads
    missing = [_label(block, name) for j, (block, name, _, count) in enumerate(pieces) if found[j] != count]
    if missing:
        raise ValueError(f"The checkpoint's optimizer state does not cover {len(missing)} parameter piece(s) this rank "
                         f"keeps ({', '.join(missing[:3])}...): it was written for another model, or it is one rank's file of a "
                         "sharded checkpoint, which covers that rank's pieces only (resume through the Trainer, which "
                         "reads every rank's file).")
    for j, out in flat.items():
        block, name, _, count = pieces[j]
        if covered[j] != count:
            raise ValueError(f"The checkpoint's optimizer state covers {covered[j]} of the {count} elements of "
                             f"{_label(block, name)} this rank keeps; it was written for another model.")
        for key in ("exp_avg", "exp_avg_sq"):  # fp32 moments have the parameter's shape; 8-bit ones stay flat
            if key in out:
                out[key] = out[key].view(shapes[j])
    return flat


def _label(unit: str, name: str) -> str:
    return f"{unit}.{name}" if unit else name  # pieces keyed by the parameter's model name have no unit


def _copy_state_range(flat: dict[int, dict[str, Any]], j: int, st: dict[str, Any], my_count: int, src: int, dst: int,
                      count: int, name: str) -> None:
    """Copies ``count`` elements' state from ``st`` (from element ``src``) into piece ``j``'s (at ``dst``).

    Per-element tensors (fp32 moments, 8-bit codes) move element by element; the 8-bit
    moments' absmax moves block by block, which is exact because lean layouts start every
    piece on a block of its parameter (memory.layout_block), so both ranges start on one."""
    out = flat.get(j)
    if out is None:
        step = st["step"]
        out = flat[j] = {"step": step.clone() if isinstance(step, torch.Tensor) else step}
        for key, value in st.items():
            if key != "step":
                size = quant8.num_blocks(my_count) if key in quant8.ABSMAX_KEYS else my_count
                out[key] = torch.zeros(size, dtype=value.dtype)
    elif set(out) != set(st):
        raise ValueError(f"The checkpoint's optimizer state of {name} mixes 8-bit and fp32 moments across its files; "
                         "it was written by another run.")
    for key, value in st.items():
        if key == "step":
            continue
        if key in quant8.ABSMAX_KEYS:
            if src % quant8.BLOCK or dst % quant8.BLOCK:
                raise ValueError(f"The checkpoint's 8-bit optimizer state of {name} is cut off its {quant8.BLOCK}-element "
                                 "blocks; it was written with another layout than lean host memory's.")
            nb = quant8.num_blocks(count)
            out[key][dst // quant8.BLOCK:dst // quant8.BLOCK + nb] = value[src // quant8.BLOCK:src // quant8.BLOCK + nb]
        else:
            out[key][dst:dst + count] = value.reshape(-1)[src:src + count]
