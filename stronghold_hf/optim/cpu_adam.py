"""`CPUAdam`: AdamW over fp32 master weights in CPU memory, at memory-bandwidth speed.

STRONGHOLD (Sun et al., SC'22) and ZeRO-Offload keep the fp32 master weights and the Adam
moments in CPU memory and run the optimizer there, so that GPU memory holds only the
working window. The CPU step is then on the critical path of every iteration, and it is
memory bound: AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg,
exp_avg_sq, 28 bytes per parameter, with a handful of flops in between. What offloaded
training adds on top of plain AdamW, and why this is more than ``AdamW(fused=True)``:

* ``clip_coef`` and ``inv_loss_scale`` are applied inside the kernel, with no extra pass
  over the gradients, and ``.grad`` is left untouched;
* ``found_inf`` skips the step entirely, as a skipped ``GradScaler`` step does;
* *copy-out*: the bf16/fp16 copy of each parameter (typically a view into a pinned flat
  buffer that is then copied to the GPU) is written in the same pass, from registers;
* ``step_groups`` steps a subset of param groups from a worker thread while the main thread
  keeps running backward; the GIL is released during the math.

Two kernels do the math (docs/performance.md has the measurements):

* ``"native"`` (default when it builds): a ~100-line C++/OpenMP loop (``csrc/cpu_adam.cpp``),
  compiled once with the system compiler into ``~/.cache/stronghold_hf`` (native.py) and
  called through ctypes. One pass does scale, AdamW and copy-out (28 B/param, +2 for the
  copy), and one OpenMP region covers all tensors of a call. torch's fused kernel opens one
  region per tensor, and on a loaded machine each fork/join can wait for a descheduled thread.
* ``"torch"``: ``torch._fused_adamw_`` (aten/src/ATen/native/cpu/FusedAdamKernel.cpp), used
  when no compiler or no shared OpenMP runtime is available. Copy-out is then a second pass
  over the params, and a scaled gradient goes through it chunk by chunk
  (adam_torch.py): 1.15-1.5x the plain step time for either.

The two agree to rounding (a few ulps per step), not bit for bit. Both are deterministic: the
native kernel's results do not depend on thread count, chunking or group layout, and the
torch kernel's do not depend on chunking (both tested). A resumed run on the same kernel
continues bit-identically.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import math
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from ..fastpath import no_grad, profiled

from ..memory import is_placeholder  # a master bound around each update (nvme_masters)
from . import quant8, undo_native
from .adam_torch import TorchAdamStep
from .kernel_tables import OUT_KIND, GroupTables, Item, fp32_table, lean_table
from .native import NativeLibrary

__all__ = ["CPUAdam", "DEFAULT_CHUNK_NUMEL", "native_kernel_error"]

#: Elements per ``torch._fused_adamw_`` call when the torch kernel gets a scaled gradient.
#: 2**19 fp32 (2 MiB per array) keeps the gradient scratch in cache, and the ~50 us of Python
#: and OpenMP overhead per chunk a few percent of its memory time; 2**17..2**20 measured
#: within noise of each other, 2**16 a third slower (docs/performance.md).
DEFAULT_CHUNK_NUMEL = 1 << 19

#: Gradient dtypes the kernels read: fp32, and bf16 (host gradients kept in the compute dtype,
#: ``StrongholdConfig.host_grads``), widened exactly.
GRAD_DTYPES = (torch.float32, torch.bfloat16)


# The kernel: csrc/cpu_adam.cpp (sh_adamw_step's table layout is documented there).
_NATIVE = NativeLibrary("cpu_adam", "cpu_adam.cpp", abi=("sh_cpu_adam_abi", 3), signatures={
    "sh_adamw_step": [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_double] * 6 + [ctypes.c_int32]},
    fallback="CPUAdam(kernel='auto') steps with torch's fused AdamW kernel (torch._fused_adamw_) instead")
_fallback_warned = threading.Event()  # warn once per process about kernel="auto" falling back


def native_kernel_error() -> str | None:
    """Why the native kernel is unavailable (building it if needed), or ``None`` if it works."""
    return _NATIVE.error()


def _is_true(flag: bool | Tensor | None) -> bool:
    if isinstance(flag, Tensor):
        return bool(flag.item())  # a device-to-host sync for a CUDA tensor, by necessity
    return bool(flag)


def _as_float(value: float | Tensor, name: str) -> float:
    out = float(value.item()) if isinstance(value, Tensor) else float(value)
    if not math.isfinite(out):
        raise ValueError(f"CPUAdam: {name}={out} is not finite. Detect overflow before stepping and pass "
                         "found_inf=True to skip the step instead.")
    return out


class CPUAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) for fp32 parameters in CPU memory.

    Same math, defaults and per-group hyperparameters as ``torch.optim.AdamW`` with
    ``amsgrad=False, maximize=False``, and the same per-parameter state (``step``: a
    float32 0-d CPU tensor, ``exp_avg`` and ``exp_avg_sq``: fp32 like the parameter), so
    ``state_dict()`` is interchangeable with AdamW's. Works with ``torch.optim.lr_scheduler``
    and with the HF Trainer's decay/no-decay param groups.

    Args:
        params: parameters or param-group dicts; every parameter a contiguous fp32 CPU tensor.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        amsgrad, maximize: accepted for signature compatibility; only ``False`` is supported.
        kernel: ``"auto"`` (native if it builds, else torch, with one warning), ``"native"``
            (raise if unavailable) or ``"torch"``. ``self.kernel`` says which one runs.
        chunk_numel: elements per call on the torch kernel's scaled-gradient path; a multiple of 16.
        state_bits: 32 (``exp_avg``/``exp_avg_sq`` in fp32, AdamW's state) or 8: blockwise 8-bit
            moments (``optim/quant8.py``) for tensors of at least `quant8.MIN_8BIT_NUMEL`
            elements, fp32 for smaller ones (`set_state_bits` overrides per tensor). The 8-bit
            state is ``exp_avg_q``/``exp_avg_sq_q`` (uint8 codes) and ``exp_avg_absmax``/
            ``exp_avg_sq_absmax`` (fp32 per block of 256); ``load_state_dict`` converts a state
            saved with the other setting.

    Thread-safety contract:
        * ``step_groups`` is the worker-thread entry point. Calls from several threads may
          overlap if their group sets are disjoint; the result equals stepping the groups
          one after another (a group's math touches only its params, state and copy-out
          buffers). Claiming a group that another thread is stepping raises RuntimeError.
        * ``step()`` is ``step_groups`` over all groups: it must not overlap another step.
        * Lazily created state (a parameter's first step) is allocated outside and inserted
          under an internal lock, which also guards the group claims and the copy-out map:
          ``(un)register_copy_out`` may run while *other* groups step, not the param's own.
        * The kernels release the GIL, so stepping in a worker runs in parallel with Python
          in the main thread. Each calling thread gets its own OpenMP team of
          ``torch.get_num_threads()`` (as seen by that thread), so concurrent callers
          oversubscribe the cores unless each caps its team (docs/performance.md).
        * ``state_dict``, ``load_state_dict``, ``add_param_group``, ``zero_grad`` and edits
          of ``param_groups`` (LR schedulers) must not overlap a step, and a group's
          gradients must not be written while it steps.
        * ``step_groups`` runs no step hooks; ``step()`` runs them (the Optimizer wrapper).
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
        kernel: Literal["auto", "native", "torch"] = "auto",
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        state_bits: Literal[32, 8] = 32,
    ) -> None:
        if kernel not in ("auto", "native", "torch"):
            raise ValueError(f"CPUAdam: kernel={kernel!r}; use 'auto', 'native' or 'torch'.")
        if state_bits not in (32, 8):
            raise ValueError(f"CPUAdam: state_bits={state_bits!r}; use 32 (fp32 moments) or 8 (blockwise 8-bit).")
        self.state_bits = state_bits
        if not isinstance(chunk_numel, int) or chunk_numel < 16 or chunk_numel % 16:
            # torch's kernel splits work in 16-element units and rounds its scalar tail
            # differently; unit-aligned chunks keep results independent of chunking.
            raise ValueError(f"CPUAdam: chunk_numel must be a positive multiple of 16, got {chunk_numel!r}.")
        self._kernel_request, self._chunk_numel = kernel, chunk_numel
        self._init_runtime()
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)

    def _init_runtime(self) -> None:
        self.kernel: Literal["native", "torch"] = "torch"
        if self._kernel_request != "torch":
            if _NATIVE.load() is not None:
                self.kernel = "native"
            elif self._kernel_request == "native":
                raise RuntimeError(f"CPUAdam(kernel='native'): the native kernel is unavailable ({_NATIVE.error()}). "
                                   "Use kernel='torch' or 'auto'.")
            elif not _fallback_warned.is_set():
                _fallback_warned.set()
                warnings.warn(f"CPUAdam: native kernel unavailable ({_NATIVE.error()}); using torch's fused kernel, which "
                              "is slower for copy-out and scaled gradients. Pass kernel='torch' to silence this.",
                              stacklevel=3)
        self._lock = threading.Lock()  # guards lazy state insertion, _in_flight and _copy_out
        self._in_flight: set[int] = set()
        self._copy_out: dict[Tensor, Tensor] = {}  # param -> bf16/fp16 dest; not optimizer state
        self._tables = GroupTables()  # the native kernels' address tables (kernel_tables.py)
        self._torch_kernel = TorchAdamStep(self._chunk_numel)  # kernel="torch" (adam_torch.py)
        self.__dict__.setdefault("_bits", {})  # param -> 32/8, set_state_bits' overrides (kept across copies)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_kernel_request": self._kernel_request, "_chunk_numel": self._chunk_numel,
                "state_bits": self.state_bits, "_bits": self._bits}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_lock"):  # unpickled / deep-copied, not load_state_dict
            self.__dict__.setdefault("state_bits", 32)
            self.__dict__.setdefault("_kernel_request", "auto")
            self.__dict__.setdefault("_chunk_numel", DEFAULT_CHUNK_NUMEL)
            self._init_runtime()
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)

    # --- param groups and state -------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_tables"):
            self._tables.clear()
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
            raise ValueError(f"{where}: amsgrad=True is not supported. Pass amsgrad=False, "
                             "or use torch.optim.AdamW(amsgrad=True).")
        if group["maximize"]:
            raise ValueError(f"{where}: maximize=True is not supported. Negate the loss instead (minimize -objective).")
        (beta1, beta2), lr, eps, wd = group["betas"], float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        if not (lr >= 0.0 and eps >= 0.0 and wd >= 0.0 and 0.0 <= float(beta1) < 1.0 and 0.0 <= float(beta2) < 1.0):
            raise ValueError(f"{where}: need lr, eps, weight_decay >= 0 and betas in [0, 1); got lr={lr}, eps={eps}, "
                             f"weight_decay={wd}, betas={group['betas']}.")
        for pi, p in enumerate(group["params"]):
            desc = f"{where}, parameter {pi} (shape {tuple(p.shape)}, {p.dtype}, device {p.device})"
            if p.device.type != "cpu":
                raise ValueError(f"{desc} is not on the CPU. CPUAdam updates fp32 master weights in CPU memory: give "
                                 "it a CPU fp32 master copy (master = p.detach().float().cpu(); materialize meta tensors "
                                 "first, e.g. module.to_empty(device='cpu'), then load the weights), or use "
                                 "torch.optim.AdamW(fused=True) on the device.")
            if p.dtype != torch.float32:
                raise ValueError(f"{desc} is not float32. CPUAdam keeps fp32 master weights: optimize an fp32 copy "
                                 "(master = p.detach().float()) and mirror it into the low-precision tensor with "
                                 "register_copy_out(master, dest).")
            if p.layout != torch.strided or not (p.is_contiguous() or is_placeholder(p)):
                raise ValueError(f"{desc} is not a contiguous dense tensor. Make it one first: p.data = p.data.contiguous().")

    def load_state_dict(self, state_dict: dict[str, Any], *,
                        release_source: Callable[[Tensor], None] | None = None) -> None:
        """As ``torch.optim.AdamW``'s; a state saved with the other ``state_bits`` is converted
        (fp32 moments quantized, or 8-bit ones read back as fp32) to what each parameter uses.

        ``release_source``: the saved tensors are maps of a checkpoint file
        (`mapped_checkpoint.MappedCheckpoint.release`). Each parameter's state is then copied
        into memory of its own and its sources released before the next one, so the load
        holds the state once. Without it the loaded tensors become the state, as in torch."""
        self._tables.clear()
        # torch casts every floating parameter's non-step state to the parameter's dtype: the
        # uint8 codes go around it and come back after.
        codes: dict[Any, dict[str, Tensor]] = {}
        states = {}
        for i, st in state_dict.get("state", {}).items():
            codes[i] = {k: st[k] for k in quant8.CODE_KEYS if k in st}
            states[i] = {k: v for k, v in st.items() if k not in quant8.CODE_KEYS}
        super().load_state_dict({**state_dict, "state": states})
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            st = self.state.get(p)
            if not st:
                continue
            st.update(codes.get(i, {}))
            sources = list(st.values())
            if quant8.is_8bit(st) and not self.wants_8bit(p):
                self.state[p] = quant8.state_to_fp32(st, p.shape)
            elif not quant8.is_8bit(st) and "exp_avg" in st and self.wants_8bit(p):
                self.state[p] = quant8.state_to_8bit(st)
            elif release_source is not None:
                self.state[p] = {k: v.clone() for k, v in st.items()}
            if release_source is not None:
                for v in sources:
                    release_source(v)
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, gi)
        for state in self.state.values():
            # Old checkpoints / other optimizers may hold a number or a device tensor.
            step = state.get("step")
            ok = isinstance(step, Tensor) and step.dtype == torch.float32 and step.device.type == "cpu" and step.dim() == 0
            if step is not None and not ok:
                state["step"] = torch.tensor(float(step), dtype=torch.float32)

    def set_state_bits(self, params: Iterable[Tensor], bits: Literal[32, 8]) -> None:
        """Overrides the size rule for ``params`` (before their first step): with sharded state a
        master is a piece, and the whole parameter decides, so every rank's piece agrees."""
        if bits not in (32, 8):
            raise ValueError(f"CPUAdam.set_state_bits: bits={bits!r}; use 32 or 8.")
        with self._lock:
            for p in params:
                self._bits[p] = bits

    def wants_8bit(self, p: Tensor) -> bool:
        """Whether ``p``'s moments are (or will be) 8-bit: ``state_bits=8`` and at least
        `quant8.MIN_8BIT_NUMEL` elements, unless `set_state_bits` said otherwise."""
        default = self.state_bits if p.numel() >= quant8.MIN_8BIT_NUMEL else 32
        return self._bits.get(p, default) == 8

    def _state_for(self, p: Tensor) -> dict[str, Tensor]:
        state = self.state.get(p)
        if state:
            return state
        # Allocate and zero outside the lock (the slow part); a param is in one group only,
        # so only the thread stepping that group ever initializes it.
        if self.wants_8bit(p):
            fresh = quant8.new_state(p)  # uint8 codes [numel] and fp32 absmax [blocks] per moment
        else:
            fresh = {"step": torch.tensor(0.0, dtype=torch.float32),  # fp32 0-d, as torch AdamW's
                     "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}  # fp32, p's shape
        with self._lock:
            state = self.state[p]  # defaultdict insert: mutates the shared dict
            if not state:
                state.update(fresh)
        return state

    def state_moved(self) -> None:
        """Some state tensors were replaced by others (the NVMe tier points them at a ring
        buffer for one update, and away after it): forget the address tables built from them."""
        with self._lock:
            self._tables.clear()

    # --- copy-out ---------------------------------------------------------------------------

    def register_copy_out(self, param: Tensor, dest: Tensor) -> None:
        """After every update of ``param``, ``dest`` holds ``param.to(dest.dtype)``.

        ``dest``: a contiguous bf16/fp16 CPU tensor of ``param``'s shape, e.g. a view into a
        pinned flat buffer. It is written by later updates only; skipped steps and params
        without a gradient leave it as is. The mapping is not part of ``state_dict``.
        """
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError(f"CPUAdam.register_copy_out: the tensor (shape {tuple(param.shape)}) is in no param group; "
                             "pass the fp32 master this optimizer updates.")
        if not isinstance(dest, Tensor) or dest.dtype not in OUT_KIND or dest.device.type != "cpu":
            got = f"{dest.dtype} on {dest.device}" if isinstance(dest, Tensor) else type(dest).__name__
            raise ValueError(f"CPUAdam.register_copy_out: dest must be a bf16 or fp16 CPU tensor, got {got}; "
                             "e.g. torch.empty(shape, dtype=torch.bfloat16).")
        if dest.shape != param.shape or not dest.is_contiguous():
            raise ValueError(f"CPUAdam.register_copy_out: dest must be contiguous with shape {tuple(param.shape)}, "
                             f"got {tuple(dest.shape)} "
                             f"(contiguous={dest.is_contiguous()}); use flat[offset:offset + param.numel()].view(param.shape).")
        with self._lock:
            self._copy_out[param] = dest
            self._tables.clear()

    def unregister_copy_out(self, param: Tensor) -> Tensor | None:
        """Stops refreshing ``param``'s copy; returns its destination, or ``None`` if it had none."""
        with self._lock:
            self._tables.clear()
            return self._copy_out.pop(param, None)

    # --- stepping ---------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, *, clip_coef: float | Tensor = 1.0,
             inv_loss_scale: float | Tensor = 1.0, found_inf: bool | Tensor | None = None) -> Any:
        """Steps every param group; returns ``closure()``'s loss if a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_groups(range(len(self.param_groups)), clip_coef=clip_coef, inv_loss_scale=inv_loss_scale, found_inf=found_inf)
        return loss

    def step_groups(self, group_indices: Iterable[int], *, clip_coef: float | Tensor = 1.0,
                    inv_loss_scale: float | Tensor = 1.0, found_inf: bool | Tensor | None = None) -> None:
        """Steps only ``self.param_groups[i]`` for ``i`` in ``group_indices``.

        The effective gradient is ``grad * clip_coef * inv_loss_scale``; ``.grad`` is never
        written. If ``found_inf`` is true nothing changes (params, state, step counts,
        copy-out buffers). Safe from several threads at once on disjoint groups.
        """
        indices = [int(i) for i in group_indices]
        n = len(self.param_groups)
        if len(set(indices)) != len(indices) or any(not 0 <= i < n for i in indices):
            raise ValueError(f"CPUAdam.step_groups: group indices {indices} must be distinct and in [0, {n}).")
        with self._claimed(indices, "step_groups"):
            if _is_true(found_inf):
                return
            gmul = _as_float(clip_coef, "clip_coef") * _as_float(inv_loss_scale, "inv_loss_scale")
            with no_grad(), profiled("CPUAdam.step_groups", tuple(indices)):
                for gi in indices:
                    self._step_group(gi, gmul)

    @contextlib.contextmanager
    def _claimed(self, indices: list[int], caller: str):
        """Inside: ``indices`` are this thread's to step (a group is stepped by one thread at a
        time); LR schedulers see that the optimizer stepped (the group calls bypass step())."""
        with self._lock:
            busy = self._in_flight.intersection(indices)
            if busy:
                raise RuntimeError(f"CPUAdam.{caller}: groups {sorted(busy)} are being stepped by another thread; "
                                   "a group must be stepped by one thread at a time.")
            self._in_flight.update(indices)
        try:
            self._opt_called = True
            yield
        finally:
            with self._lock:
                self._in_flight.difference_update(indices)

    def _step_group(self, gi: int, gmul: float) -> None:
        group = self.param_groups[gi]
        if self.kernel == "native":
            cached = self._tables.cached(gi, group["params"])  # kernel_tables.py, [Note: cached tables]
            if cached is not None:
                table, items, table8, items8 = cached
                self._run_native(table, items, group, gmul)
                self._run_native8(table8, items8, group, gmul)
                return
        items: list[Item] = []
        for pi, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided or g.dtype not in GRAD_DTYPES or g.device.type != "cpu" or g.shape != p.shape:
                raise ValueError(f"CPUAdam param group {gi}, parameter {pi}: grad must be a dense fp32 or bf16 CPU "
                                 f"tensor of shape {tuple(p.shape)}, got {g.layout} {g.dtype} {tuple(g.shape)} on "
                                 f"{g.device}; put an fp32 (or bf16) gradient in the master's .grad.")
            if not p.is_contiguous():  # a master on disk stepped outside its NVMe tier binding
                raise RuntimeError(f"CPUAdam param group {gi}, parameter {pi}: the parameter is not contiguous memory "
                                   "at step time; a master on disk (nvme_masters) is stepped only inside its tier's "
                                   "binding.")
            items.append((p, g if g.is_contiguous() else g.contiguous(), self._state_for(p), self._copy_out.get(p)))
        if not items:
            return
        items8 = [it for it in items if "exp_avg_q" in it[2]]
        items = [it for it in items if "exp_avg_q" not in it[2]]
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        if self.kernel == "native":
            table, table8 = fp32_table(items), lean_table(items8)  # [Note: raw addresses]
            self._tables.keep(gi, group["params"], table, items, table8, items8)
            self._run_native(table, items, group, gmul)
            self._run_native8(table8, items8, group, gmul)
        else:
            hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
            if items:
                # As torch's _fused_adam: the caller bumps the step before the kernel reads it.
                torch._foreach_add_([st["step"] for _, _, st, _ in items], 1.0)
                self._torch_kernel.step(items, gmul, hyper)
            for p, g, st, d in items8:
                quant8.step_reference(p, g, st, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                                      grad_mul=gmul, out=d)

    def undo_table(self, gi: int, grad_of: Callable[[Tensor], Tensor | None]) -> array.array | None:
        """The address table that undoes group ``gi``'s last native step, made from that step's
        cached table (kernel_tables.py, `GroupTables.undo`); None when the undo would read other
        tensors. An undo after every step whose speculation missed then costs no Python per
        parameter."""
        return self._tables.undo(gi, self.param_groups[gi]["params"], grad_of)

    def redo_groups(self, group_indices: Iterable[int], undo_hypers: list[dict[str, Any]], undo_gmul: float, *,
                    clip_coef: float = 1.0, inv_loss_scale: float = 1.0) -> bool:
        """Rolls back each group's last native step (made with ``undo_hypers[k]`` and
        ``undo_gmul``) and steps it again with its current hyperparameters and ``clip_coef x
        inv_loss_scale``, in one native pass per group (undo_native.redo_adamw_table_): the same
        result, bit for bit, as `undo_table`'s undo followed by `step_groups`. Only where that
        holds: every group's cached step table names the gradients its masters hold now, none
        has 8-bit state, and the native undo builds. Otherwise nothing changes and it returns
        False; the caller undoes and steps separately."""
        indices = [int(i) for i in group_indices]
        if self.kernel != "native" or undo_native.native_undo_error() is not None:
            return False
        tables = []
        for gi in indices:
            cached = self._tables.cached(gi, self.param_groups[gi]["params"])
            if cached is None or cached[3] or not cached[1]:  # no cached step, or 8-bit items
                return False
            tables.append(cached[0])
        with self._claimed(indices, "redo_groups"):
            gmul = _as_float(clip_coef, "clip_coef") * _as_float(inv_loss_scale, "inv_loss_scale")
            with profiled("CPUAdam.redo_groups", tuple(indices)):
                for gi, table, undo_hyper in zip(indices, tables, undo_hypers):
                    undo_native.redo_adamw_table_(table, undo_hyper, undo_gmul, self.param_groups[gi], gmul)
        return True

    def _run_native8(self, table: array.array, items, group: dict[str, Any], gmul: float) -> None:
        if not items:
            return
        lib = quant8.native_kernel()
        if lib is None:  # built with the fp32 kernel but not this one: the reference, same math
            beta1, beta2 = (float(b) for b in group["betas"])
            for p, g, st, d in items:
                quant8.step_reference(p, g, st, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                                      eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                                      grad_mul=gmul, out=d)
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        _, maps = quant8._map_pointers()
        lib.sh_adamw8_step(len(items), table.buffer_info()[0], float(group["lr"]), beta1, beta2,
                           float(group["weight_decay"]), float(group["eps"]), gmul, quant8.moment_floor(beta1, beta2),
                           *maps, torch.get_num_threads())

    def _run_native(self, table: array.array, items, group: dict[str, Any], gmul: float) -> None:
        if not items:
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        # The kernel bumps the steps itself; the GIL is released for the whole call.
        _NATIVE.load()
        lib = _NATIVE.for_elements(sum(table[0::8]))  # a small update keeps the GIL (native.py)
        lib.sh_adamw_step(len(items), table.buffer_info()[0], lr, beta1, beta2, wd, eps, gmul, torch.get_num_threads())

