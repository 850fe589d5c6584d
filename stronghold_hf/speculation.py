"""Speculative CPU updates: start a block's CPU Adam during backward, validate at the step.

STRONGHOLD's profile at 5.1 B parameters spent 18 of 25 s per iteration waiting on CPU Adam
and offload. SuperOffload (ASPLOS 2026) hides the update behind backward by *speculation then
validation*: a block's update starts as soon as its gradient reaches the host, assuming the
step will neither clip nor overflow; after backward the global norm and the overflow check
confirm the guess, and a wrong guess is rolled back and redone. Results stay exactly those of
plain training: a rolled-back block is redone with the right coefficient.

The guess is "no clipping" (coefficient 1.0, the only coefficient that can be known before the
global norm is). HF clips at ``max_grad_norm=1.0`` by default, and early training clips on
nearly every step, so a blind guess would miss constantly. `SpeculationPolicy` therefore
speculates only after a step that did not clip or overflow and whose norm stayed below
``NORM_MARGIN`` of the limit, and stops while the recent miss rate is high; ``"on"``, forced,
still skips the step right after one whose norm was over the limit by more than the same
margin (1 / ``NORM_MARGIN``, 1.25 times), which nearly always clips too. Within a pass, a running sum of the blocks' squared gradient norms (each copied
to the host with its gradient) stops further speculation as soon as it exceeds ``max_norm²``:
the step will clip, whatever the remaining blocks hold.

A speculative update is *undone* exactly from what it used: AdamW is invertible given the
gradient, the hyperparameters and the step count (`undo_adamw_`), so nothing is copied to make
the rollback possible. The inverse is one native pass over the block on every core of the
host worker (optim/undo_native.py; torch ops where that cannot be built). It recovers the old
moments to within an ulp of the new ones (exactly, for a parameter's first step); when the
redo applies a much smaller clip coefficient, that ulp grows relative to the redone moments,
up to about 1e-5 at a coefficient of 0.01, inside the suite's parity tolerances (1e-4).
When the redo reads the gradients the speculative update read (a clipped step), the undo and
the redo run as one native pass over the block (optim/unit_update.py, `UnitUpdates.redo`).
"""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .optim import undo_native

SpeculationMode = Literal["auto", "on", "off"]

#: How many recent speculative steps the miss rate is measured over, and the rate above which
#: ``"auto"`` stops speculating.
MISS_WINDOW = 8
MAX_MISS_RATE = 0.25
#: ``"auto"`` speculates after a clean step only when its gradient norm was at most this share
#: of ``max_norm``: a norm just under the limit crosses it on the next step often enough that
#: the guess would miss (a miss on the H200 cost about 0.5 s, a hit saves about 0.1 s).
NORM_MARGIN = 0.8


@dataclass
class SpecRecord:
    """One block's speculative update: exactly what it applied, so it can be validated or undone."""

    groups: list[int]  # CPU optimizer param groups of the block
    grads: list[tuple[int, torch.Tensor]]  # (parameter index in the block, host gradient it read)
    grad_mul: float  # the coefficient it applied: inverse loss scale x (guessed) clip coefficient 1.0
    hyper: list[dict[str, Any]]  # lr, betas, eps, weight_decay of each group, as applied
    applied: bool = False  # set by the worker: False when the pass stopped speculating first


@dataclass
class SpeculationPolicy:
    """Decides, per backward pass, whether to speculate; keeps the miss rate."""

    mode: SpeculationMode = "auto"
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MISS_WINDOW))
    last_step_clean: bool = False  # the last step neither clipped nor overflowed
    last_norm_ratio: float | None = None  # its gradient norm over max_norm (None: not clipped)
    hits: int = 0
    misses: int = 0

    def should_speculate(self) -> bool:
        if self.mode == "off":
            return False
        if self.mode == "on":
            # Forced, except right after a step whose norm was over the limit by more than the
            # margin: the next one nearly always clips too (a miss costs each block a second pass).
            return self.last_norm_ratio is None or self.last_norm_ratio <= 1.0 / NORM_MARGIN
        recent_misses = sum(1 for hit in self.history if not hit)
        if self.history and recent_misses / len(self.history) > MAX_MISS_RATE:
            # Cool down: forget one outcome per clean step, so speculation resumes eventually.
            if self.last_step_clean:
                self.history.popleft()
            return False
        return self.last_step_clean and (self.last_norm_ratio is None or self.last_norm_ratio <= NORM_MARGIN)

    def record_step(self, *, clean: bool, speculated: bool, hit: bool, norm_ratio: float | None = None) -> None:
        self.last_step_clean = clean
        self.last_norm_ratio = norm_ratio
        if speculated:
            self.history.append(hit)
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    @property
    def miss_rate(self) -> float:
        total = self.hits + self.misses
        return self.misses / total if total else 0.0


class PartialNorm:
    """The squared gradient norm of the blocks folded so far in this pass (host worker side)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset(None)

    def reset(self, max_norm: float | None) -> None:
        with self._lock:
            self.sq = 0.0
            self.limit = None if max_norm is None else float(max_norm) ** 2
            self.exceeded = False

    def add(self, sq_norm: float) -> None:
        with self._lock:
            self.sq += sq_norm
            if not math.isfinite(self.sq) or (self.limit is not None and self.sq > self.limit):
                self.exceeded = True


UndoKernel = Literal["auto", "native", "torch"]


@torch.no_grad()
def undo_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict[str, torch.Tensor]],
                hyper: dict[str, Any], grad_mul: float, *, kernel: UndoKernel = "auto") -> None:
    """Inverts one AdamW step (``CPUAdam``/``torch._fused_adamw_`` math) in place.

    Forward, per element with ``g' = grad * grad_mul`` (in fp32, a bf16 gradient widened
    first, as CPUAdam computes it) and ``t`` the step after the update::

        m1 = b1 m0 + (1-b1) g';   v1 = b2 v0 + (1-b2) g'^2
        p1 = p0 (1 - lr wd) - (lr / bc1) m1 / (sqrt(v1) / sqrt(bc2) + eps)

    so ``p0 = (p1 + (lr / bc1) m1 / denom) / (1 - lr wd)``, ``m0 = (m1 - (1-b1) g') / b1``,
    ``v0 = (v1 - (1-b2) g'^2) / b2``, and the step count goes back by one. With ``b = 0`` the
    old moment does not matter to the redo (it is multiplied by 0) and is set to 0.

    ``kernel``: ``"native"`` is one pass per element on the calling thread's
    ``torch.get_num_threads()`` cores (optim/undo_native.py; it raises if the library cannot
    be built), ``"torch"`` about ten torch passes, ``"auto"`` the native one where it builds
    and the state has CPUAdam's fp32 layout. The two agree to a few ulps of the operands.
    """
    if kernel not in ("auto", "native", "torch"):
        raise ValueError(f"undo_adamw_: kernel={kernel!r}; use 'auto', 'native' or 'torch'.")
    items = [(p, g, st) for p, g, st in zip(params, grads, states) if st]
    if kernel != "torch" and items:
        if undo_native.native_undo_error() is None:
            native = [it for it in items if undo_native.native_undo_accepts(*it)]
            if native:
                undo_native.undo_adamw_native_(*map(list, zip(*native)), hyper, grad_mul)
            accepted = {id(p) for p, _, _ in native}
            items = [it for it in items if id(it[0]) not in accepted]
        elif kernel == "native":
            raise RuntimeError(f"undo_adamw_(kernel='native'): the native undo is unavailable "
                               f"({undo_native.native_undo_error()}). Use kernel='torch' or 'auto'.")
        if items and kernel == "native":
            raise ValueError("undo_adamw_(kernel='native'): some tensors are not in CPUAdam's fp32 layout "
                             "(contiguous fp32 CPU master and moments, fp32 or bf16 gradient); use kernel='auto'.")
    if items:
        _undo_adamw_torch(*map(list, zip(*items)), hyper, grad_mul)


def _undo_adamw_torch(params, grads, states, hyper: dict[str, Any], grad_mul: float) -> None:
    lr, (b1, b2), eps, wd = float(hyper["lr"]), (float(b) for b in hyper["betas"]), float(hyper["eps"]), float(
        hyper["weight_decay"])
    for p, g, st in zip(params, grads, states):
        t = float(st["step"])
        m, v = st["exp_avg"], st["exp_avg_sq"]
        bc1 = 1.0 - b1**t
        bc2_sqrt = math.sqrt(1.0 - b2**t)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)  # fp32 [numel] scratch
        p.addcdiv_(m, denom, value=lr / bc1)
        decay = 1.0 - lr * wd
        if decay != 1.0 and decay != 0.0:
            p.div_(decay)
        # In fp32 as the forward computed it: a bf16 gradient times grad_mul would round to bf16.
        gp = g.to(torch.float32) * grad_mul if grad_mul != 1.0 else g
        if t <= 1.0:  # the state was fresh before this step: its moments were exactly zero
            m.zero_()
            v.zero_()
        elif b1 > 0.0:
            m.sub_(gp, alpha=1.0 - b1).div_(b1)
        else:
            m.zero_()
        if t <= 1.0:
            pass
        elif b2 > 0.0:
            v.addcmul_(gp, gp, value=-(1.0 - b2)).div_(b2).clamp_(min=0.0)
        else:
            v.zero_()
        st["step"].sub_(1.0)
