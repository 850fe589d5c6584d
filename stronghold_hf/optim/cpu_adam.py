"""`CPUAdam`: AdamW over fp32 master weights in CPU memory, at memory-bandwidth speed.

STRONGHOLD (Sun et al., SC'22) and ZeRO-Offload keep the fp32 master weights and the Adam
moments in CPU memory and run the optimizer there, so that GPU memory holds only the
working window. The CPU step is then on the critical path of every iteration, and it is
memory bound: AdamW reads param, grad, exp_avg and exp_avg_sq and writes param, exp_avg and
exp_avg_sq, 28 bytes per parameter, with a handful of flops in between. The only torch
kernel that runs at that bound on the CPU is the fused one (``torch._fused_adamw_``,
``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``); foreach and for-loop AdamW are 5-7x
slower (docs/performance.md). This module is a thin, thread-safe driver around it that adds
what offloaded training needs:

* ``clip_coef`` and ``inv_loss_scale`` folded into the kernel's ``grad_scale`` (a divisor),
  so clipping and loss-scale removal cost no extra pass over the gradients;
* ``found_inf`` skips the step entirely, as a skipped ``GradScaler`` step does;
* *copy-out*: after each update the low-precision copy of a parameter (bf16/fp16, typically
  a view into a pinned flat buffer that is then copied to the GPU) is refreshed from the
  chunk of master weights the kernel just wrote, while that chunk is still in cache;
* ``step_groups`` to step a subset of param groups from a worker thread while the main
  thread keeps running backward (the GIL is released inside the torch kernels).

[Note: the fused kernel writes the unscaled gradient back]
When ``grad_scale`` is given, FusedAdamKernel.cpp stores ``grad / grad_scale`` back into
the gradient it was handed (a leftover of the GradScaler contract). ``.grad`` must stay
untouched here (the caller may still read it, e.g. for a norm or for gradient accumulation
across micro-steps), so with a scale the kernel is handed a copy of each chunk of the
gradient in a small per-thread scratch buffer instead. The copy reads the gradient from
DRAM once, as the kernel would have, and the kernel then reads and writes the scratch in
cache, so DRAM traffic is unchanged; the price is an in-cache copy and one kernel call per
chunk. Without a scale the gradient is passed as is and the kernel only reads it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

__all__ = ["CPUAdam", "DEFAULT_CHUNK_NUMEL"]

#: Elements per kernel call on the chunked path (scaled gradients or copy-out). 2**18 fp32
#: elements is 1 MiB per array, half of it per core with two threads: small enough that
#: the chunk of params the kernel just wrote is still in L2/L3 when it is copied out, large
#: enough that the ~50 us of Python and OpenMP overhead per chunk stays a few percent of the
#: chunk's memory time. Measured in benchmarks/bench_cpu_adam.py (docs/performance.md).
DEFAULT_CHUNK_NUMEL = 1 << 18

_COPY_OUT_DTYPES = (torch.bfloat16, torch.float16)


def _is_true(flag: bool | Tensor | None) -> bool:
    if flag is None:
        return False
    if isinstance(flag, Tensor):
        return bool(flag.item())  # a device-to-host sync for a CUDA tensor, by necessity
    return bool(flag)


def _as_float(value: float | Tensor, name: str) -> float:
    out = float(value.item()) if isinstance(value, Tensor) else float(value)
    if not math.isfinite(out):
        raise ValueError(
            f"CPUAdam: {name}={out} is not finite. Detect overflow before stepping and pass "
            "found_inf=True to skip the step instead."
        )
    return out


class CPUAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) for fp32 parameters in CPU memory.

    Same math, defaults and per-group hyperparameters as ``torch.optim.AdamW`` with
    ``amsgrad=False, maximize=False``, and the same per-parameter state (``step``: a
    float32 0-d CPU tensor, ``exp_avg`` and ``exp_avg_sq``: fp32 like the parameter), so
    ``state_dict()`` is interchangeable with AdamW's and a resumed run continues
    bit-identically. Works with ``torch.optim.lr_scheduler`` and with decay/no-decay
    param groups as built by the HF Trainer.

    Args:
        params: parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
            Every parameter must be a contiguous fp32 CPU tensor.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        amsgrad, maximize: accepted for signature compatibility; only ``False`` is supported.
        chunk_numel: elements per kernel call on the chunked path (see module docstring);
            a multiple of 16, so that results do not depend on it.

    Extras over AdamW:
        ``step(..., clip_coef=, inv_loss_scale=, found_inf=)`` and ``step_groups(...)``
        apply ``grad * clip_coef * inv_loss_scale`` inside the kernel without modifying
        ``.grad``, and skip the step when ``found_inf`` is true. ``register_copy_out``
        keeps a bf16/fp16 copy of a parameter current after each update.

    Thread-safety contract:
        * ``step_groups`` is the worker-thread entry point. Calls from several threads may
          overlap as long as their group sets are disjoint; the result is the same as
          stepping those groups one after another (each group's math touches only its own
          parameters, state and copy-out buffers). Stepping a group that another thread is
          currently stepping raises ``RuntimeError`` rather than racing.
        * ``step()`` is ``step_groups`` over all groups, so it must not overlap any other
          step call.
        * Lazily created state (first step of a parameter) is allocated outside and
          inserted under an internal lock; the group-claim set and the copy-out map are
          also guarded by it, so ``register_copy_out``/``unregister_copy_out`` for a
          parameter may run while *other* groups step, but not while its own group steps.
        * The torch kernels release the GIL, so a worker thread stepping groups runs in
          parallel with Python in the main thread. Each calling thread gets its own OpenMP
          team of ``torch.get_num_threads()`` threads; concurrent callers therefore
          oversubscribe the cores unless each caps its team (docs/performance.md).
        * ``state_dict``, ``load_state_dict``, ``add_param_group``, ``zero_grad`` and
          changes to ``param_groups`` (LR schedulers) must not overlap a step; the gradients
          of a group must not be written while that group steps.
        * ``step_groups`` runs no step pre/post hooks; ``step()`` does (the Optimizer
          wrapper).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    ) -> None:
        if not isinstance(chunk_numel, int) or chunk_numel < 16 or chunk_numel % 16:
            # The kernel splits work in 16-element (64-byte) units and runs a scalar tail
            # loop whose rounding differs from the vector body; chunk boundaries on unit
            # boundaries keep chunked results bit-identical to one call per tensor.
            raise ValueError(f"CPUAdam: chunk_numel must be a positive multiple of 16, got {chunk_numel!r}.")
        self._chunk_numel = chunk_numel
        self._init_runtime()
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)

    # --- runtime (non-state) attributes ---------------------------------------------------

    def _init_runtime(self) -> None:
        # Guards: lazy state insertion, the in-flight group set and the copy-out map.
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        # param -> low-precision destination; deliberately not part of state_dict.
        self._copy_out: dict[Tensor, Tensor] = {}
        # Per-thread fp32 [chunk_numel] scratch for scaled gradients, so concurrent
        # step_groups calls never share one.
        self._tls = threading.local()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_lock"):  # unpickled / deep-copied: runtime attributes are not state
            self._chunk_numel = getattr(self, "_chunk_numel", DEFAULT_CHUNK_NUMEL)
            self._init_runtime()
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)

    # --- param groups and state -----------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            self._validate_group(self.param_groups[-1], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise

    @staticmethod
    def _validate_group(group: dict[str, Any], gi: int) -> None:
        where = f"CPUAdam param group {gi}"
        if group["amsgrad"]:
            raise ValueError(f"{where}: amsgrad=True is not supported. Pass amsgrad=False, or use torch.optim.AdamW(amsgrad=True).")
        if group["maximize"]:
            raise ValueError(f"{where}: maximize=True is not supported. Negate the loss instead (minimize -objective).")
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        if not lr >= 0.0:
            raise ValueError(f"{where}: lr={lr} must be >= 0.")
        if not float(group["eps"]) >= 0.0:
            raise ValueError(f"{where}: eps={group['eps']} must be >= 0.")
        if not (0.0 <= float(beta1) < 1.0 and 0.0 <= float(beta2) < 1.0):
            raise ValueError(f"{where}: betas={group['betas']} must each be in [0, 1).")
        if not float(group["weight_decay"]) >= 0.0:
            raise ValueError(f"{where}: weight_decay={group['weight_decay']} must be >= 0.")
        for pi, p in enumerate(group["params"]):
            desc = f"{where}, parameter {pi} (shape {tuple(p.shape)}, {p.dtype}, device {p.device})"
            if p.device.type != "cpu":
                raise ValueError(
                    f"{desc} is not on the CPU. CPUAdam updates fp32 master weights in CPU memory: "
                    "give it a CPU fp32 master copy (master = p.detach().float().cpu(); meta tensors must "
                    "be materialized first, e.g. module.to_empty(device='cpu') and load the weights), or "
                    "use torch.optim.AdamW(fused=True) for device-resident parameters."
                )
            if p.dtype != torch.float32:
                raise ValueError(
                    f"{desc} is not float32. CPUAdam keeps fp32 master weights: optimize an fp32 copy "
                    "(master = p.detach().float()) and mirror it into the low-precision tensor with "
                    "register_copy_out(master, dest)."
                )
            if p.layout != torch.strided or not p.is_contiguous():
                raise ValueError(f"{desc} is not a contiguous dense tensor. Make it one first: p.data = p.data.contiguous().")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, gi)
        for state in self.state.values():
            # Older checkpoints (or other optimizers) may hold a Python number or a
            # device tensor; the kernel wants a float32 0-d CPU tensor.
            step = state.get("step")
            if step is not None and not (
                isinstance(step, Tensor) and step.dtype == torch.float32 and step.device.type == "cpu" and step.dim() == 0
            ):
                state["step"] = torch.tensor(float(step), dtype=torch.float32)

    def _state_for(self, p: Tensor) -> dict[str, Tensor]:
        state = self.state.get(p)
        if state:
            return state
        # Allocate (and zero) outside the lock: it is the slow part, and a parameter belongs
        # to one group, so only one thread ever initializes it.
        fresh = {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
        with self._lock:
            state = self.state[p]  # defaultdict insert: mutates the shared dict
            if not state:
                state.update(fresh)
        return state

    # --- copy-out ----------------------------------------------------------------------------

    def register_copy_out(self, param: Tensor, dest: Tensor) -> None:
        """After every update of ``param``, write ``param.to(dest.dtype)`` into ``dest``.

        ``dest`` is a contiguous bf16/fp16 CPU tensor of ``param``'s shape, typically a view
        into a pinned flat buffer. It is written only by later updates, not now; skipped
        steps (``found_inf``) and parameters without a gradient leave it untouched. The
        mapping is runtime wiring, not optimizer state: ``state_dict`` does not include it.
        """
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError(f"CPUAdam.register_copy_out: the parameter (shape {tuple(param.shape)}) is in no param group of this optimizer; pass the fp32 master it updates.")
        if not isinstance(dest, Tensor) or dest.dtype not in _COPY_OUT_DTYPES or dest.device.type != "cpu":
            got = f"{dest.dtype} on {dest.device}" if isinstance(dest, Tensor) else type(dest).__name__
            raise ValueError(f"CPUAdam.register_copy_out: dest must be a bf16 or fp16 CPU tensor, got {got}; allocate it with torch.empty(shape, dtype=torch.bfloat16).")
        if dest.shape != param.shape or not dest.is_contiguous():
            raise ValueError(
                f"CPUAdam.register_copy_out: dest must be contiguous with the parameter's shape {tuple(param.shape)}, "
                f"got shape {tuple(dest.shape)} (contiguous={dest.is_contiguous()}); use flat_buffer[offset:offset + n].view(shape)."
            )
        with self._lock:
            self._copy_out[param] = dest

    def unregister_copy_out(self, param: Tensor) -> Tensor | None:
        """Stops refreshing ``param``'s copy; returns the destination it had, or ``None``."""
        with self._lock:
            return self._copy_out.pop(param, None)

    # --- stepping ----------------------------------------------------------------------------

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        clip_coef: float | Tensor = 1.0,
        inv_loss_scale: float | Tensor = 1.0,
        found_inf: bool | Tensor | None = None,
    ) -> Any:
        """Steps every param group; returns ``closure()``'s loss if a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_groups(range(len(self.param_groups)), clip_coef=clip_coef, inv_loss_scale=inv_loss_scale, found_inf=found_inf)
        return loss

    def step_groups(
        self,
        group_indices: Iterable[int],
        *,
        clip_coef: float | Tensor = 1.0,
        inv_loss_scale: float | Tensor = 1.0,
        found_inf: bool | Tensor | None = None,
    ) -> None:
        """Steps only ``self.param_groups[i]`` for ``i`` in ``group_indices``.

        The effective gradient is ``grad * clip_coef * inv_loss_scale``; ``.grad`` is never
        written. If ``found_inf`` is true nothing changes (params, state, step counts,
        copy-out buffers). Safe to call from several threads on disjoint groups.
        """
        indices = self._claim(group_indices)
        try:
            # Tell LR schedulers an optimizer step happened even when step() is bypassed.
            self._opt_called = True
            if _is_true(found_inf):
                return
            gmul = _as_float(clip_coef, "clip_coef") * _as_float(inv_loss_scale, "inv_loss_scale")
            # The kernel divides by grad_scale; None (not 1.0) keeps the gradient read-only.
            grad_scale = None if gmul == 1.0 else torch.tensor(1.0 / gmul, dtype=torch.float32)
            with torch.no_grad(), record_function(f"CPUAdam.step_groups{tuple(indices)}"):
                for gi in indices:
                    self._step_group(gi, grad_scale)
        finally:
            with self._lock:
                self._in_flight.difference_update(indices)

    def _claim(self, group_indices: Iterable[int]) -> list[int]:
        indices = [int(i) for i in group_indices]
        n = len(self.param_groups)
        if len(set(indices)) != len(indices) or any(not 0 <= i < n for i in indices):
            raise ValueError(f"CPUAdam.step_groups: group indices {indices} must be distinct and in [0, {n}).")
        with self._lock:
            busy = self._in_flight.intersection(indices)
            if busy:
                raise RuntimeError(f"CPUAdam.step_groups: groups {sorted(busy)} are being stepped by another thread; each group must be stepped by one thread at a time.")
            self._in_flight.update(indices)
        return indices

    def _step_group(self, gi: int, grad_scale: Tensor | None) -> None:
        group = self.param_groups[gi]
        beta1, beta2 = group["betas"]
        hyper = dict(
            lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
            weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
            amsgrad=False, maximize=False,
        )
        # Parallel lists over the parameters that have a gradient (torch skips the rest).
        bulk: list[list[Tensor]] = [[], [], [], [], []]  # params, grads, exp_avgs, exp_avg_sqs, steps
        chunked: list[tuple[Tensor, ...]] = []  # (param, grad, exp_avg, exp_avg_sq, step, dest | None)
        steps: list[Tensor] = []
        for pi, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided or g.dtype != torch.float32 or g.device.type != "cpu" or g.shape != p.shape:
                raise ValueError(
                    f"CPUAdam param group {gi}, parameter {pi}: grad must be a dense fp32 CPU tensor of shape "
                    f"{tuple(p.shape)}, got {g.layout} {g.dtype} {tuple(g.shape)} on {g.device}; "
                    "accumulate or copy the gradient into the fp32 master's .grad first."
                )
            if not g.is_contiguous():
                g = g.contiguous()  # the kernel walks raw pointers; never reshape .grad itself
            st = self._state_for(p)
            steps.append(st["step"])
            dest = self._copy_out.get(p)
            if grad_scale is None and dest is None:
                for lst, t in zip(bulk, (p, g, st["exp_avg"], st["exp_avg_sq"], st["step"])):
                    lst.append(t)
            else:
                chunked.append((p, g, st["exp_avg"], st["exp_avg_sq"], st["step"], dest))
        if not steps:
            return
        # As torch's _fused_adam: the caller increments the step before the kernel reads it.
        torch._foreach_add_(steps, 1.0)
        if bulk[0]:
            torch._fused_adamw_(*bulk[:4], [], bulk[4], grad_scale=None, found_inf=None, **hyper)
        if chunked:
            self._step_chunked(chunked, grad_scale, hyper)

    def _scratch(self) -> Tensor:
        buf = getattr(self._tls, "scratch", None)
        if buf is None or buf.numel() < self._chunk_numel:
            buf = torch.empty(self._chunk_numel, dtype=torch.float32)  # fp32 [chunk_numel]
            self._tls.scratch = buf
        return buf

    def _step_chunked(self, items: list[tuple[Tensor, ...]], grad_scale: Tensor | None, hyper: dict[str, Any]) -> None:
        """Kernel calls over batches of <= chunk_numel elements: big tensors are split, small
        ones packed together, so the number of calls stays ~numel / chunk_numel."""
        limit = self._chunk_numel
        scratch = self._scratch() if grad_scale is not None else None
        # One batch: parallel lists of 1-D views; dst/src are the copy-out pairs.
        ps: list[Tensor] = []; gs: list[Tensor] = []; ms: list[Tensor] = []; vs: list[Tensor] = []
        ss: list[Tensor] = []; dst: list[Tensor] = []; src: list[Tensor] = []
        filled = 0

        def flush() -> None:
            nonlocal filled
            grads = gs
            if scratch is not None:
                # See [Note: the fused kernel writes the unscaled gradient back].
                grads = list(scratch[:filled].split([g.numel() for g in gs]))
                torch._foreach_copy_(grads, gs)
            torch._fused_adamw_(ps, grads, ms, vs, [], ss, grad_scale=grad_scale, found_inf=None, **hyper)
            if dst:
                # The params of this batch were just written and are still in cache.
                torch._foreach_copy_(dst, src)
            for lst in (ps, gs, ms, vs, ss, dst, src):
                lst.clear()
            filled = 0

        for p, g, m, v, s, d in items:
            n = p.numel()
            if n == 0:
                continue
            pieces = zip(*(t.view(-1).split(limit) for t in (p, g, m, v)))
            d_pieces = d.view(-1).split(limit) if d is not None else None
            for k, (pp, gp, mp, vp) in enumerate(pieces):
                if filled and filled + pp.numel() > limit:
                    flush()
                ps.append(pp); gs.append(gp); ms.append(mp); vs.append(vp); ss.append(s)
                if d_pieces is not None:
                    dst.append(d_pieces[k]); src.append(pp)
                filled += pp.numel()
        if ps:
            flush()
