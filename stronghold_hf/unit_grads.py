"""One unit's gradients: its host gradient, the lane it holds during backward, and what the
step reads.

A unit's trainable parameters get their gradients in three places over a step, and this is
the state of all three, so that the schedule (``schedule.py``, ``flush.py``) and the optimizer
(``optim/hybrid.py``) ask one object what a unit's gradient is:

* during its backward, a *lane* of the gradient queue (``grads.py``), handed down as a plain
  device buffer with each parameter's view of it (`attach_grad_buffer`): autograd steals each
  gradient as in plain training, and `collect_into_buffer` moves them in when the use is done;
* after a flush, this rank's shard of the *host gradient* (``grad_flat``, fp32 or bf16:
  [Note: host gradients in the compute dtype]), which `fold` writes on the host worker, with
  what it holds (``grad_valid``, ``flushes``, the flush's device norm);
* between backward and the next backward, each parameter's ``.grad`` (unsharded): exposed as
  the host gradient, read by the step (`step_grads`, `load_master_grads`) and still on show
  after it, as torch's are, until ``zero_grad``; taken back at the next backward (`begin_pass`:
  what the user left is the source of truth for accumulation).

It also keeps what a backward that raised must undo (``valid_at_pass_start``,
``grads_poisoned``) and the speculative update that read the host gradient (``spec``,
speculation.py). The unit's host memory (``unit_host.py``) gives it the pieces this rank keeps
and the masters whose ``.grad`` the step sets; nothing here calls back into the unit.

[Note: host gradients in the compute dtype] With bf16 compute and host_grads allowing it, the
host gradient is bf16 [S]: what the device sends, exactly, at half the bytes. The first write
that bf16 cannot hold exactly (an accumulation, a gradient set by hand) widens it to fp32 [S]
for good (`_widen_grads`), so sums are fp32's.

[Note: the step's gradients stay on show] After ``optimizer.step()`` torch leaves ``.grad``
in place until ``zero_grad``, and code reads it there: a Trainer callback's
``on_optimizer_step``, PEFT's AdaLoRA and AdaMSS ``update_and_allocate`` (their importance is
``p * p.grad``). So the step leaves the exposed host gradients as ``.grad`` (`stepped`). The
updates it queued read them on the host worker after ``step()`` returns: reading ``.grad``
meanwhile is safe (an update never writes it), writing into it in place is not, so the update
compares their version counters with the step's afterwards and refuses a write
(`check_unwritten`). ``optimizer.zero_grad(set_to_none=False)`` waits for the updates first;
setting ``.grad`` to None writes nothing. ``.grad`` holds the gradient as accumulated: a clip
(``engine.clip_grad_norm_``) is a coefficient the update applies, not a rescale of ``.grad``.

[Note: torch calls on the host worker] Each torch call lets go of the GIL, and the training
thread, which launches the kernels, then waits to get it back. So the host worker's part here,
`fold`, writes a whole flat gradient without slicing it first and copies a small one with a
``memmove`` that keeps the GIL (fastpath.host_copy_).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import operator
from collections.abc import Sequence

import torch
from torch import nn

from .fastpath import engine_access as _engine_access, engine_method, host_copy_, no_grad
from .memory import BlockLayout, HostAllocator, element_size
from .read_guard import ReadGuard

logger = logging.getLogger("stronghold_hf")

_version = operator.attrgetter("_version")
_grad = operator.attrgetter("grad")
_first = operator.itemgetter(0)
_second = operator.itemgetter(1)


def _set_grads(tensors, grads) -> None:
    """``t.grad = g`` for each pair, the loop in C (``grads``: a list, or ``repeat(None)``)."""
    collections.deque(map(setattr, tensors, itertools.repeat("grad"), grads), maxlen=0)


def _all_are(xs, ys) -> bool:
    return all(map(operator.is_, xs, ys))


class UnitGrads:
    """The gradient state of one unit; see the module docstring. ``read_guard`` is the unit's
    (its methods run under `fastpath.engine_method`)."""

    def __init__(self, fqn: str, params: list[nn.Parameter], layout: BlockLayout, *, pieces: list,
                 masters: list[nn.Parameter | None], host: HostAllocator, sharded: bool, compute_grads: bool,
                 read_guard: ReadGuard) -> None:
        self.fqn = fqn
        self.params = params
        self.layout = layout
        self.pieces = pieces  # this rank's piece of each parameter (unit_host.py), fixed
        self.masters = masters
        self.read_guard = read_guard
        self._host = host
        S = layout.shard_numel
        # The host gradient, [S]: fp32, or bf16 ([Note: host gradients in the compute dtype]).
        grad_dtype = torch.bfloat16 if compute_grads and layout.grad_dtype == torch.bfloat16 else torch.float32
        self.grad_flat = host.allocate(element_size(grad_dtype) * S, transfer=False).view(grad_dtype) if S else None
        self.grad_views: list[torch.Tensor | None] = []  # each piece's host gradient
        for k, (piece, master) in enumerate(zip(pieces, masters)):
            if piece is None:
                self.grad_views.append(None)
                continue
            if grad_dtype != torch.float32:  # .grad is the bf16 host gradient on fp32 values
                master.grad_dtype = None
                params[k].grad_dtype = None
            self.grad_views.append(self.grad_flat[piece[1] : piece[1] + piece[2]].view(master.shape))
        self._has_frozen_pieces = any(gv is None for gv in self.grad_views)
        # The trainable pieces this rank keeps, as parallel lists: the per-step gradient
        # bookkeeping reads and writes them with loops in C (`_set_grads`, `_all_are`).
        self._local = [k for k, gv in enumerate(self.grad_views) if gv is not None]
        self._refresh_grad_lists()
        self._n_local = sum(piece is not None for piece in pieces)  # parameters this rank keeps a piece of
        # ---- during backward
        # The device gradient buffer while the unit has one (a lane of the gradient queue, handed
        # down by the schedule as a plain tensor): [padded trainable numel] in the grad dtype.
        self.grad_buffer: torch.Tensor | None = None
        self._lane_views: list[torch.Tensor | None] | None = None  # each trainable parameter's part of it
        self._lane_accumulates = False
        # ---- on the host
        self.grad_valid = [False] * len(params)  # the host gradient holds a value (exposed as .grad)
        self.flushes = 0  # flushes folded into the host gradient since it was last empty
        self.device_norm: torch.Tensor | None = None  # valid while the host grad is one untouched flush
        self._exposed_grad_versions: list[int] = []
        self.taken_grads = False  # this backward already took the exposed gradients from the user
        self._versions_at_step: list[int] | None = None  # the step's gradients, read by its update (`check_unwritten`)
        # With sharded state no rank holds whole gradients, so .grad is not exposed between
        # steps; the engine's own flags say what is accumulated (cleared by the step or zero_grad).
        self.exposes_grads = not sharded
        self.valid_at_pass_start = list(self.grad_valid)  # to roll back a backward that raised
        self.flushes_this_pass = 0
        self.grads_poisoned = False  # a failed backward added into accumulated gradients
        # ---- speculation (speculation.py), driven by the step coordinator
        self.spec = None  # SpecRecord of a speculative update no step has validated yet
        self.spec_blocked = False  # no speculation for this unit until the next step

    def _refresh_grad_lists(self) -> None:
        local = self._local
        self._lp = [self.params[k] for k in local]
        self._lm = [self.masters[k] for k in local]
        self._lg = [self.grad_views[k] for k in local]

    def _all_valid(self) -> bool:
        return all(map(self.grad_valid.__getitem__, self._local))

    def _set_valid(self, value: bool) -> None:
        valid = self.grad_valid
        for k in self._local:
            valid[k] = value

    @engine_method
    def begin_pass(self) -> None:
        """A backward pass begins: from here on autograd owns ``.grad``, and gradients that arrive
        after the unit left the device land in fresh tensors (late gradients), never in host
        buffers. Takes what the user left in ``.grad`` between steps, the source of truth for
        accumulation: ``model.zero_grad()`` sets it to None (the next flush overwrites); our host
        view means "accumulate onto it"; any other tensor is copied in first. With sharded state
        nothing is exposed and the engine's own flags stand. Remembers what the host gradient
        holds now, for a pass that raises (`roll_back_pass`)."""
        if not self.taken_grads:
            if self.grads_poisoned:
                self._check_not_poisoned()
            self.taken_grads = True
            if self.exposes_grads:
                grads = list(map(_grad, self._lp))
                if _all_are(grads, itertools.repeat(None)):  # zeroed (set to None): nothing to take
                    self._set_valid(False)
                elif _all_are(grads, self._lg):  # the exposed host gradients, untouched: accumulate onto them
                    self._set_valid(True)
                    _set_grads(self._lp, itertools.repeat(None))
                else:
                    with no_grad():
                        for k, gv, g in zip(self._local, self._lg, grads):
                            if g is None:
                                self.grad_valid[k] = False
                            elif g is gv:
                                self.grad_valid[k] = True
                            else:
                                self._host_grad_for(k, g).copy_(g)
                                self.grad_valid[k] = True
                    _set_grads(self._lp, itertools.repeat(None))
            if not any(self.grad_valid):
                self.flushes = 0
                self.device_norm = None
            elif not self._exposed_unchanged():
                self.device_norm = None
            self._exposed_grad_versions = []  # the engine owns the gradients until the next exposure
        self.valid_at_pass_start = list(self.grad_valid)
        self.flushes_this_pass = 0

    @engine_method
    def drop_stray_grads(self) -> None:
        """A backward that raised: the late gradients it left in ``.grad`` are dropped."""
        views = self.grad_views
        for k in self._trainable_indices:
            p = self.params[k]
            if p.grad is not None and p.grad is not views[k]:
                p.grad = None

    def roll_back_pass(self) -> None:
        """A backward that raised: the host gradient goes back to what it held when the pass
        began. Where the pass had added onto gradients accumulated earlier, the sum can no
        longer be split: the step refuses it until the user zeroes them (`grads_poisoned`)."""
        if not self.flushes_this_pass:
            return
        before = self.valid_at_pass_start
        if any(before):
            self.grads_poisoned = True
        self.grad_valid = list(before)
        self.flushes_this_pass = 0
        if not any(before):
            self.flushes = 0
            self.device_norm = None

    def _check_not_poisoned(self) -> None:
        if not self.grads_poisoned:
            return
        if not any(self.grad_valid) or (self.exposes_grads and all(
                p.grad is None for p, gv in zip(self.params, self.grad_views) if gv is not None)):
            self.grads_poisoned = False  # the user zeroed them: nothing partial is left
            return
        raise RuntimeError(
            f"stronghold: a backward pass raised after adding part of its gradients into the accumulated gradients "
            f"of {self.fqn}; they can no longer be separated. Call optimizer.zero_grad() (or model.zero_grad()) and "
            "redo the gradient-accumulation window."
        )

    def _exposed_unchanged(self) -> bool:
        if not self.exposes_grads:
            return True  # nobody else holds the host gradients
        return bool(self._exposed_grad_versions) and self._grad_versions() == self._exposed_grad_versions

    def _grad_versions(self) -> list[int]:
        """The version of each trainable piece's host gradient (0 for the others)."""
        views = self.grad_views
        return [0 if gv is None else gv._version for gv in views] if self._has_frozen_pieces else list(
            map(_version, views))


    @functools.cached_property
    def _trainable_indices(self) -> tuple[int, ...]:
        return tuple(k for k, e in enumerate(self.layout.entries) if e.trainable)

    @functools.cached_property
    def _tparams(self) -> list[nn.Parameter]:
        return [self.params[k] for k in self._trainable_indices]

    def attach_grad_buffer(self, buffer: torch.Tensor, views: list[torch.Tensor | None], *,
                           accumulate: bool = False) -> None:
        """Gives the unit a lane for this backward use: ``buffer`` (in the gradient layout) and
        ``views``, each trainable parameter's part of it. ``.grad`` stays None, so autograd
        *steals* each gradient as plain training does (no zeroed buffer to add into);
        `collect_into_buffer` moves them in when the use is done. ``accumulate``: the lane holds
        a partial sum already (a parked lane, flush.py) and gradients add onto it. The caller
        says when the unit may take one (resident, or for its late gradients: flush.py)."""
        assert self.grad_buffer is None, f"{self.fqn}: attach with a gradient buffer attached"
        self.grad_buffer = buffer
        self._lane_views = views
        self._lane_accumulates = accumulate

    @engine_method
    def collect_into_buffer(self) -> Sequence[int]:
        """Moves the gradients autograd produced since `attach_grad_buffer` into the lane, in one
        fused copy (an add onto a partial sum), and clears ``.grad``; returns the indices of the
        parameters that received one. Parameters that received none read as zeros in the lane
        (its padding stays zero: grads.py, [Note: a clean lane])."""
        assert self.grad_buffer is not None
        tparams = self._tparams
        grads = list(map(_grad, tparams))
        if not self._lane_accumulates and all(map(operator.is_not, grads, itertools.repeat(None))):
            # The usual case, every trainable parameter got a gradient: no loop in Python.
            views = self._lane_views
            if len(views) != len(grads):
                views = [views[k] for k in self._trainable_indices]
            with no_grad():
                torch._foreach_copy_(views, grads)
            _set_grads(tparams, itertools.repeat(None))
            self._lane_views = None
            return self._trainable_indices
        params, views = self.params, self._lane_views
        touched, srcs, dsts = [], [], []
        for k in self._trainable_indices:
            p = params[k]
            g = p.grad
            if g is not None:
                touched.append(k)
                srcs.append(g)
                dsts.append(views[k])
                p.grad = None
        with no_grad():
            if self._lane_accumulates:
                for dst, g in zip(dsts, srcs):  # rare (a unit used twice): devices and dtypes may differ
                    dst.add_(g.to(device=dst.device, dtype=dst.dtype))
            else:
                if len(touched) < len(self._trainable_indices):
                    missing = [views[k] for k in self._trainable_indices if k not in touched]
                    torch._foreach_zero_(missing)
                if dsts:
                    torch._foreach_copy_(dsts, srcs)
        self._lane_views = None
        return touched

    @engine_method
    def late_gradients(self) -> list[int]:
        """Trainable parameters with a gradient the engine has not taken in: autograd made it
        after the unit left the device (T5's relative bias, used by every later block)."""
        grads = list(map(_grad, self._tparams))
        if _all_are(grads, itertools.repeat(None)):
            return []
        return [k for k, g in zip(self._trainable_indices, grads) if g is not None and g is not self.grad_views[k]]

    @engine_method
    def drop_lane_gradients(self) -> None:
        """Forgets the gradients of this use (a backward that raised): ``.grad`` back to None."""
        for k in self._trainable_indices:
            self.params[k].grad = None
        self._lane_views = None

    def detach_grad_buffer(self) -> torch.Tensor:
        """Gives the buffer back (after `collect_into_buffer`); the flush sends or drops it."""
        buffer, self.grad_buffer = self.grad_buffer, None
        return buffer

    def local_params(self, touched: list[int]) -> list[int]:
        """Of ``touched``, the parameters this rank keeps a piece of."""
        return [k for k in touched if self.pieces[k] is not None]

    def fold(self, touched: list[int], accumulate: list[bool], lo: int, staged: torch.Tensor) -> None:
        """Worker thread: adds (or copies) one landed piece of a flush, ``staged`` at element
        ``lo`` of this rank's shard of the gradient layout (the whole layout, unsharded), into
        the host gradient. The gradient queue calls it for each piece as it lands (grads.py,
        `GradientQueue.land`)."""
        grad_flat = self.grad_flat
        if grad_flat.dtype != torch.float32 and (any(accumulate) or staged.dtype != grad_flat.dtype):
            self._widen_grads("its gradient was accumulated")
            grad_flat = self.grad_flat
        hi = lo + staged.numel()
        if len(touched) == self._n_local and len(set(accumulate)) <= 1:  # the usual case: one flat pass
            # [Note: torch calls on the host worker]: the whole flat gradient is written
            # without slicing it first.
            dst = grad_flat if lo == 0 and hi == grad_flat.numel() else grad_flat[lo:hi]
            if accumulate and accumulate[0]:
                dst.add_(staged)
            else:
                host_copy_(dst, staged)
            return
        for k, acc in zip(touched, accumulate):
            _, at, n = self.pieces[k]
            a, b = max(at, lo), min(at + n, hi)
            if a >= b:
                continue
            src, dst = staged[a - lo: b - lo], grad_flat[a:b]
            if acc:
                dst.add_(src)
            else:
                dst.copy_(src)

    @engine_method
    def expose_grads(self) -> None:
        """After a backward: the masters' (and, unsharded, the parameters') ``.grad`` are the
        host gradients, or None."""
        valid = self.grad_valid
        grads = self._lg if self._all_valid() else [gv if valid[k] else None for k, gv in zip(self._local, self._lg)]
        if self.exposes_grads:
            _set_grads(self._lp, grads)
        if not _all_are(map(_grad, self._lm), grads):  # the masters keep theirs between steps
            _set_grads(self._lm, grads)
        self._exposed_grad_versions = self._grad_versions()
        self.taken_grads = False

    @engine_method
    def current_grads(self) -> list[torch.Tensor]:
        """The gradients the next step would apply (exposed ``.grad``, or the engine's own)."""
        if self.exposes_grads:
            return [g for g in map(_grad, self._lp) if g is not None]
        return [gv for k, gv in zip(self._local, self._lg) if self.grad_valid[k]]

    @engine_method
    def zero_grads(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: forget (or zero) the accumulated gradients of this block."""
        if self.exposes_grads and set_to_none:
            if not _all_are(map(_grad, self._lp), itertools.repeat(None)):  # (the step let go of them already)
                _set_grads(self._lp, itertools.repeat(None))
            return
        for k, (p, gv) in enumerate(zip(self.params, self.grad_views)):
            if gv is None:
                continue
            if self.exposes_grads:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
            elif set_to_none:
                self.grad_valid[k] = False
            elif self.grad_valid[k]:
                gv.zero_()

    def stepped(self) -> bool:
        """The step took these gradients ([Note: the step's gradients stay on show]). Sharded,
        the next backward starts a new accumulation window. Exposed, ``.grad`` keeps them until
        ``zero_grad`` or the next backward (which adds onto them if nobody zeroed them), as
        torch's ``.grad`` after ``optimizer.step()``; returns True: the update that reads them
        is to `check_unwritten` afterwards."""
        if self.exposes_grads:
            self._versions_at_step = self._grad_versions()
            return True
        self._set_valid(False)
        return False

    def check_unwritten(self) -> None:
        """On the host worker, after the step's update read the host gradients: refuses a write
        into them (``.grad`` on show) since the step, which that update may have read half-done."""
        versions, self._versions_at_step = self._versions_at_step, None
        if versions is not None and self._grad_versions() != versions:
            raise RuntimeError(
                f"stronghold: the gradients of {self.fqn} were written in place (p.grad.zero_(), "
                "model.zero_grad(set_to_none=False), ...) after optimizer.step() while its CPU update was still "
                "reading them, so that update may have used part of the new values. Zero them with "
                "optimizer.zero_grad() or model.zero_grad() (set_to_none=True), or call engine.synchronize() "
                "before writing into .grad."
            )

    @engine_method
    def device_norm_valid(self) -> bool:
        if (self.device_norm is None or self.flushes != 1 or not any(self.grad_valid)
                or not self._exposed_unchanged()):
            return False  # no gradient left (consumed, zeroed): the norm of the last flush is stale
        if not self.exposes_grads:
            return True
        if self._all_valid():
            return _all_are(map(_grad, self._lp), self._lg)
        return all(p.grad is gv for k, p, gv in zip(self._local, self._lp, self._lg) if self.grad_valid[k])

    @engine_method
    def step_grads(self) -> list[tuple[int, torch.Tensor | None]]:
        """At ``optimizer.step()`` (training thread): the gradient each trainable piece steps with,
        from the exposed ``.grad`` (which ``zero_grad`` or the user may have changed). Reads
        only: the host worker applies it (`load_master_grads`), so nothing a running task reads
        is touched here."""
        self._check_not_poisoned()
        if self.exposes_grads:
            return list(zip(self._local, map(_grad, self._lp)))
        return [(k, gv if self.grad_valid[k] else None) for k, gv in zip(self._local, self._lg)]

    def host_grads(self) -> list[tuple[int, torch.Tensor]]:
        """The host gradients folded so far (what a speculative update reads)."""
        if self._all_valid():
            return list(zip(self._local, self._lg))
        return [(k, gv) for k, gv in zip(self._local, self._lg) if self.grad_valid[k]]

    @engine_method
    def grads_match(self, grads: list[tuple[int, torch.Tensor | None]], used: list[tuple[int, torch.Tensor]]) -> bool:
        """Whether ``grads`` (from `step_grads`) are exactly the host gradients a speculative
        update ``used``, untouched since the end of backward (version counters)."""
        if (len(grads) == len(used) and _all_are(map(_second, grads), map(_second, used))
                and all(map(operator.eq, map(_first, grads), map(_first, used)))):
            return self._exposed_unchanged()  # the usual case, in C: the very tensors it read
        present = [(k, g) for k, g in grads if g is not None]
        if len(present) != len(used) or any(k != j for (k, _), (j, _) in zip(present, used)):
            return False
        return all(g is self.grad_views[k] for k, g in present) and self._exposed_unchanged()

    @engine_method
    def grads_modified_in_place(self) -> bool:
        """Whether an exposed host gradient was written since the end of backward."""
        return bool(self._exposed_grad_versions) and not self._exposed_unchanged()

    @engine_method
    def load_master_grads(self, grads: list[tuple[int, torch.Tensor | None]]) -> bool:
        """On the host worker: points the masters' ``.grad`` at the gradients to step with."""
        if len(grads) == len(self._lg) and _all_are(map(_second, grads), self._lg):
            _set_grads(self._lm, self._lg)  # the usual step: every piece with its own host gradient
            return bool(grads)
        given = dict(grads)
        any_grad = copied = False
        with no_grad():
            for k, (master, gv) in enumerate(zip(self.masters, self.grad_views)):
                if gv is None:
                    continue
                g = given.get(k)
                if g is None:
                    master.grad = None
                    continue
                if g is not gv:
                    gv = self._host_grad_for(k, g)
                    gv.copy_(g)
                    copied = True
                master.grad = gv
                any_grad = True
        if copied and self._versions_at_step is not None:
            self._versions_at_step = self._grad_versions()  # our own writes, not the user's
        return any_grad

    def _host_grad_for(self, k: int, value: torch.Tensor) -> torch.Tensor:
        """The host gradient of parameter ``k``, able to hold ``value`` exactly: a bf16 host
        gradient given anything but bf16 widens first ([Note: host gradients in the compute dtype])."""
        if self.grad_flat.dtype != torch.float32 and value.dtype != self.grad_flat.dtype:
            self._widen_grads(f"a {value.dtype} gradient was set by hand")
        return self.grad_views[k]

    def widen(self, why: str) -> None:
        """From now on the host gradient is fp32 (nothing if it is already)."""
        if self.grad_flat is not None and self.grad_flat.dtype != torch.float32:
            self._widen_grads(why)

    def _widen_grads(self, why: str) -> None:
        """From now on this unit keeps fp32 host gradients: the bf16 values move over exactly,
        and every ``.grad`` that pointed at the old buffer points at the new one."""
        old = self.grad_flat
        wide = self._host.allocate(4 * old.numel(), transfer=False).view(torch.float32)
        wide.copy_(old)
        self.grad_flat = wide
        with torch.no_grad(), _engine_access():
            for k, piece in enumerate(self.pieces):
                if piece is None:
                    continue
                before, after = self.grad_views[k], wide[piece[1] : piece[1] + piece[2]].view(self.masters[k].shape)
                if self.exposes_grads and self.params[k].grad is before:
                    self.params[k].grad = after
                if self.masters[k].grad is before:
                    self.masters[k].grad = after
                self.grad_views[k] = after
        self._refresh_grad_lists()
        self._exposed_grad_versions = self._grad_versions() if self._exposed_grad_versions else []
        if self._versions_at_step is not None:
            self._versions_at_step = self._grad_versions()  # new views, new counters
        self._host.free(old)
        logger.info("stronghold: %s keeps fp32 host gradients from now on (%s; host_grads=\"compute\" holds one "
                    "backward's gradient in bf16).", self.fqn, why)

