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

* ``"native"`` (default when it builds): a ~100-line C++/OpenMP loop, compiled once with
  the system compiler into ``~/.cache/stronghold_hf`` and called through ctypes. One pass
  does scale, AdamW and copy-out (28 B/param, +2 for the copy), and one OpenMP region
  covers all tensors of a call. torch's fused kernel opens one region per tensor, and on a
  loaded machine each fork/join can wait for a descheduled thread.
* ``"torch"``: ``torch._fused_adamw_`` (aten/src/ATen/native/cpu/FusedAdamKernel.cpp), used
  when no compiler or no shared OpenMP runtime is available. Copy-out is then a second pass
  over the params, and a scaled gradient goes through it chunk by chunk
  (``_step_torch_chunked``): 1.15-1.5x the plain step time for either.

The two agree to rounding (a few ulps per step), not bit for bit. Both are deterministic: the
native kernel's results do not depend on thread count, chunking or group layout, and the
torch kernel's do not depend on chunking (both tested). A resumed run on the same kernel
continues bit-identically.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

__all__ = ["CPUAdam", "DEFAULT_CHUNK_NUMEL", "native_kernel_error"]

#: Elements per ``torch._fused_adamw_`` call when the torch kernel gets a scaled gradient.
#: 2**19 fp32 (2 MiB per array) keeps the gradient scratch in cache, and the ~50 us of Python
#: and OpenMP overhead per chunk a few percent of its memory time; 2**17..2**20 measured
#: within noise of each other, 2**16 a third slower (docs/performance.md).
DEFAULT_CHUNK_NUMEL = 1 << 19

_OUT_KIND = {torch.bfloat16: 1, torch.float16: 2}

# Every arithmetic step mirrors torch's fused kernel in order; -ffp-contract=off plus explicit
# fma keep the compiler from fusing differently in the vector body and the scalar tail, so
# every element gets the same rounding wherever chunk and thread boundaries fall.
_NATIVE_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

namespace {
inline uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// c10 round_to_nearest_even: what param.to(torch.bfloat16) computes.
inline uint16_t to_bf16(float f) {
  const uint32_t u = bits(f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(r);
}
// c10 fp16_ieee_from_fp32_value: round to nearest even, NaN -> 0x7E00, written to vectorize.
inline uint16_t to_fp16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
  base = from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  // Selects by mask, not ?:, which GCC 12 turns into a branch that stops vectorization.
  const uint32_t nan = 0u - uint32_t(shl1_w > 0xFF000000u);
  return uint16_t((sign >> 16) | (nan & 0x7E00u) | (~nan & nonsign));
}

struct Hyper { float grad_mul, decay, lerp_w, beta2, one_minus_beta2, eps; };
using RangeFn = void (*)(float*, const float*, float*, float*, uint16_t*, int64_t, const Hyper&, float, float);

// p, g, m, v: fp32 [n]; out: bf16/fp16 bits [n] or unused. kOut: 0 none, 1 bf16, 2 fp16.
template <bool kScale, bool kDecay, bool kSmallW, int kOut>
void adam_range(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                uint16_t* __restrict out, int64_t n, const Hyper& h, float neg_step, float bc2_sqrt) {
  const float w = kSmallW ? h.lerp_w : h.lerp_w - 1.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = kScale ? g[i] * h.grad_mul : g[i];
    float pi = kDecay ? p[i] * h.decay : p[i];
    // exp_avg.lerp_(grad, 1 - beta1) in torch's two-sided form.
    const float mi = std::fma(w, gi - m[i], kSmallW ? m[i] : gi);
    const float vi = std::fma(h.one_minus_beta2 * gi, gi, v[i] * h.beta2);
    const float denom = std::sqrt(vi) / bc2_sqrt + h.eps;
    pi = pi + neg_step * mi / denom;
    p[i] = pi; m[i] = mi; v[i] = vi;
    if (kOut == 1) out[i] = to_bf16(pi);
    if (kOut == 2) out[i] = to_fp16(pi);
  }
}
template <bool S, bool D, bool W> RangeFn pick3(int k) {
  return k == 1 ? adam_range<S, D, W, 1> : k == 2 ? adam_range<S, D, W, 2> : adam_range<S, D, W, 0>;
}
template <bool S, bool D> RangeFn pick2(bool w, int k) { return w ? pick3<S, D, true>(k) : pick3<S, D, false>(k); }
template <bool S> RangeFn pick1(bool d, bool w, int k) { return d ? pick2<S, true>(w, k) : pick2<S, false>(w, k); }
}  // namespace

extern "C" int sh_cpu_adam_abi() { return 2; }

// table: int64 [nt, 8] = numel, then the addresses of param, grad, exp_avg, exp_avg_sq (fp32
// [numel]), out (bf16/fp16 [numel] or 0) and step (fp32 0-d), then the out kind (0/1/2).
// Scalars arrive as doubles and are rounded to fp32 here, as FusedAdamKernel.cpp does.
extern "C" void sh_adamw_step(int64_t nt, const int64_t* table, double lr, double beta1, double beta2,
                              double weight_decay, double eps, double grad_mul, int32_t nthreads) {
  const Hyper h{float(grad_mul), float(1.0 - lr * weight_decay), float(1.0 - beta1),
                float(beta2), float(1.0 - beta2), float(eps)};
  const bool scale = grad_mul != 1.0, dec = weight_decay != 0.0, small_w = std::fabs(h.lerp_w) < 0.5f;
  // As torch's _fused_adam: bump each step (in fp32), then derive the bias corrections in double.
  std::vector<float> coefs(2 * nt);  // -lr / bias_correction1, sqrt(bias_correction2)
  int64_t total = 0;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t* e = table + 8 * t;
    float* step = reinterpret_cast<float*>(e[6]);
    *step = *step + 1.0f;
    coefs[2 * t] = float(-(lr / (1.0 - std::pow(beta1, double(*step)))));
    coefs[2 * t + 1] = float(std::sqrt(1.0 - std::pow(beta2, double(*step))));
    total += e[0];
  }
  // Small calls run on the calling thread: below ~64K elements (~2 GRAIN_SIZEs of torch's
  // parallel_for) a fork/join costs about what a second core saves, and risks a stall.
  const int threads = total >= 65536 ? std::max(1, int(nthreads)) : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // One contiguous, 64-byte-aligned slice of the concatenated tensors per thread.
    const int64_t T = omp_get_num_threads(), id = omp_get_thread_num(), units = (total + 15) / 16;
    const int64_t lo = std::min(total, units * id / T * 16), hi = std::min(total, units * (id + 1) / T * 16);
    int64_t base = 0;
    for (int64_t t = 0; t < nt && base < hi; base += table[8 * t], ++t) {
      const int64_t* e = table + 8 * t;
      const int64_t s = std::max(lo, base), end = std::min(hi, base + e[0]), off = s - base;
      if (s >= end) continue;
      const int kind = int(e[7]);
      RangeFn fn = scale ? pick1<true>(dec, small_w, kind) : pick1<false>(dec, small_w, kind);
      uint16_t* out = kind ? reinterpret_cast<uint16_t*>(e[5]) + off : nullptr;
      fn(reinterpret_cast<float*>(e[1]) + off, reinterpret_cast<const float*>(e[2]) + off,
         reinterpret_cast<float*>(e[3]) + off, reinterpret_cast<float*>(e[4]) + off, out, end - s, h,
         coefs[2 * t], coefs[2 * t + 1]);
    }
  }
}
"""

_BUILD_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]


def build_native_library(source: str, name: str) -> ctypes.CDLL:
    """Compiles ``source`` once per (source, compiler, CPU) into the cache and loads it.

    ``-march=native`` is tried first, so the cache key includes the CPU's flags: a home
    directory shared by different machines must not hand one a binary for another. Raises
    ``RuntimeError`` with the reason when there is no compiler or the build fails.
    """
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX)")
    try:
        cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        cpu = ""
    key = hashlib.sha256("\0".join([source, cxx, *_BUILD_FLAGS, platform.machine(), cpu]).encode()).hexdigest()[:16]
    xdg_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = Path(os.environ.get("STRONGHOLD_CACHE_DIR") or xdg_cache / "stronghold_hf")
    lib = cache / f"{name}-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, out = Path(tmp) / f"{name}.cpp", Path(tmp) / f"{name}.so"
            src.write_text(source)
            for isa in (["-march=native"], []):
                cmd = [cxx, *_BUILD_FLAGS, *isa, str(src), "-o", str(out)]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if proc.returncode == 0:
                    break
            else:
                raise RuntimeError(f"building {name} with {cxx} failed: {proc.stderr.strip()[-1500:]}")
            os.replace(out, lib)  # atomic: concurrent ranks building the same key are fine
    # Loaded after torch, the library's libgomp.so.1 dependency resolves by soname to the
    # copy torch already loaded, so both share one OpenMP runtime and one thread pool.
    handle = ctypes.CDLL(str(lib))  # CDLL (not PyDLL) calls release the GIL
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    names = ("libgomp", "libiomp", "libomp")
    runtimes = {ln.split()[-1] for ln in maps.splitlines() if any(r in ln.rsplit("/", 1)[-1] for r in names)}
    if len(runtimes) > 1:
        raise RuntimeError(f"two OpenMP runtimes are loaded ({sorted(runtimes)}); they would oversubscribe the cores")
    return handle


_native: ctypes.CDLL | None = None
_native_error: str | None = None
_native_lock = threading.Lock()
_fallback_warned = threading.Event()  # warn once per process about kernel="auto" falling back


def _load_native() -> ctypes.CDLL | None:
    global _native, _native_error
    with _native_lock:
        if _native is None and _native_error is None:
            try:
                lib = build_native_library(_NATIVE_SOURCE, "cpu_adam")
                if lib.sh_cpu_adam_abi() != 2:
                    raise RuntimeError("stale library ABI")
                f64 = ctypes.c_double
                lib.sh_adamw_step.argtypes = [ctypes.c_int64, ctypes.c_void_p, f64, f64, f64, f64, f64, f64, ctypes.c_int32]
                lib.sh_adamw_step.restype = None
                _native = lib
            except Exception as e:  # any failure means: use the torch kernel
                _native_error = f"{type(e).__name__}: {e}"
        return _native


def native_kernel_error() -> str | None:
    """Why the native kernel is unavailable (building it if needed), or ``None`` if it works."""
    _load_native()
    return _native_error


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
    ) -> None:
        if kernel not in ("auto", "native", "torch"):
            raise ValueError(f"CPUAdam: kernel={kernel!r}; use 'auto', 'native' or 'torch'.")
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
            if _load_native() is not None:
                self.kernel = "native"
            elif self._kernel_request == "native":
                raise RuntimeError(f"CPUAdam(kernel='native'): the native kernel is unavailable ({_native_error}). "
                                   "Use kernel='torch' or 'auto'.")
            elif not _fallback_warned.is_set():
                _fallback_warned.set()
                warnings.warn(f"CPUAdam: native kernel unavailable ({_native_error}); using torch's fused kernel, which "
                              "is slower for copy-out and scaled gradients. Pass kernel='torch' to silence this.",
                              stacklevel=3)
        self._lock = threading.Lock()  # guards lazy state insertion, _in_flight and _copy_out
        self._in_flight: set[int] = set()
        self._copy_out: dict[Tensor, Tensor] = {}  # param -> bf16/fp16 dest; not optimizer state
        self._tables: dict[int, tuple] = {}  # group -> (grad ids, params list, table, items): [Note: cached tables]
        self._tls = threading.local()  # per-thread scratch of the torch kernel's scaled path

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_kernel_request": self._kernel_request, "_chunk_numel": self._chunk_numel}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_lock"):  # unpickled / deep-copied, not load_state_dict
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
            if p.layout != torch.strided or not p.is_contiguous():
                raise ValueError(f"{desc} is not a contiguous dense tensor. Make it one first: p.data = p.data.contiguous().")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._tables.clear()
        super().load_state_dict(state_dict)
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, gi)
        for state in self.state.values():
            # Old checkpoints / other optimizers may hold a number or a device tensor.
            step = state.get("step")
            ok = isinstance(step, Tensor) and step.dtype == torch.float32 and step.device.type == "cpu" and step.dim() == 0
            if step is not None and not ok:
                state["step"] = torch.tensor(float(step), dtype=torch.float32)

    def _state_for(self, p: Tensor) -> dict[str, Tensor]:
        state = self.state.get(p)
        if state:
            return state
        # Allocate and zero outside the lock (the slow part); a param is in one group only,
        # so only the thread stepping that group ever initializes it.
        fresh = {"step": torch.tensor(0.0, dtype=torch.float32),  # fp32 0-d, as torch AdamW's
                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}  # fp32, p's shape
        with self._lock:
            state = self.state[p]  # defaultdict insert: mutates the shared dict
            if not state:
                state.update(fresh)
        return state

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
        if not isinstance(dest, Tensor) or dest.dtype not in _OUT_KIND or dest.device.type != "cpu":
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
        with self._lock:
            busy = self._in_flight.intersection(indices)
            if busy:
                raise RuntimeError(f"CPUAdam.step_groups: groups {sorted(busy)} are being stepped by another thread; "
                                   "a group must be stepped by one thread at a time.")
            self._in_flight.update(indices)
        try:
            self._opt_called = True  # LR schedulers check this; step_groups bypasses step()
            if _is_true(found_inf):
                return
            gmul = _as_float(clip_coef, "clip_coef") * _as_float(inv_loss_scale, "inv_loss_scale")
            with torch.no_grad(), record_function(f"CPUAdam.step_groups{tuple(indices)}"):
                for gi in indices:
                    self._step_group(gi, gmul)
        finally:
            with self._lock:
                self._in_flight.difference_update(indices)

    def _step_group(self, gi: int, gmul: float) -> None:
        group = self.param_groups[gi]
        if self.kernel == "native":
            # [Note: cached tables] A group whose parameters hold the same gradient tensors as at
            # its last step reuses that step's address table: the engine steps each block with
            # the same gradient buffers every step, and rebuilding the table is all Python (tens
            # of microseconds per parameter, the whole update of a small block). State tensors
            # and copy-out targets only change through load_state_dict / register_copy_out,
            # which clear the cache.
            key = tuple(map(id, (p.grad for p in group["params"])))
            cached = self._tables.get(gi)
            if cached is not None and cached[0] == key and cached[1] is group["params"]:
                self._run_native(cached[2], cached[3], group, gmul)
                return
        items: list[tuple[Tensor, Tensor, dict[str, Tensor], Tensor | None]] = []  # (param, grad, state, dest)
        for pi, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided or g.dtype != torch.float32 or g.device.type != "cpu" or g.shape != p.shape:
                raise ValueError(f"CPUAdam param group {gi}, parameter {pi}: grad must be a dense fp32 CPU tensor of "
                                 f"shape {tuple(p.shape)}, got {g.layout} {g.dtype} {tuple(g.shape)} on {g.device}; "
                                 "put an fp32 gradient in the master's .grad.")
            items.append((p, g if g.is_contiguous() else g.contiguous(), self._state_for(p), self._copy_out.get(p)))
        if not items:
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        if self.kernel == "native":
            # [Note: raw addresses] The table holds addresses only; every tensor it names is
            # kept alive by `items` (grads made contiguous included) as long as the table is used.
            table = array.array("q")  # int64 [n, 8], see sh_adamw_step
            for p, g, st, d in items:
                table.extend((p.numel(), p.data_ptr(), g.data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                              0 if d is None else d.data_ptr(), st["step"].data_ptr(), 0 if d is None else _OUT_KIND[d.dtype]))
            if all(g is p.grad for p, g, _, _ in items):  # no contiguous() copies: the table stays valid
                with self._lock:
                    self._tables[gi] = (key, group["params"], table, items)
            self._run_native(table, items, group, gmul)
        else:
            # As torch's _fused_adam: the caller bumps the step before the kernel reads it.
            torch._foreach_add_([st["step"] for _, _, st, _ in items], 1.0)
            hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
            self._step_torch(items, gmul, hyper)

    def _run_native(self, table: array.array, items, group: dict[str, Any], gmul: float) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        # The kernel bumps the steps itself; the GIL is released for the whole call.
        _native.sh_adamw_step(len(items), table.buffer_info()[0], lr, beta1, beta2, wd, eps, gmul, torch.get_num_threads())

    def _step_torch(self, items, gmul: float, hyper: dict[str, Any]) -> None:
        if gmul != 1.0:  # see [Note: the fused kernel writes the unscaled gradient back]
            self._step_torch_chunked(items, torch.tensor(1.0 / gmul, dtype=torch.float32), hyper)  # a divisor
            return
        # grad_scale=None (not 1.0) keeps the gradient read-only. Copy-out is a separate pass:
        # chunking it to copy from cache measured no faster here (docs/performance.md), and
        # one call per group means one OpenMP region per tensor instead of several.
        ps, gs, sts = zip(*[(p, g, st) for p, g, st, _ in items])
        torch._fused_adamw_(list(ps), list(gs), [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts], [],
                            [s["step"] for s in sts], grad_scale=None, found_inf=None, **hyper)
        pairs = [(d, p) for p, _, _, d in items if d is not None]
        if pairs:
            torch._foreach_copy_(*map(list, zip(*pairs)))

    def _step_torch_chunked(self, items, grad_scale: Tensor | None, hyper: dict[str, Any]) -> None:
        """``_fused_adamw_`` over batches of <= chunk_numel elements (big tensors split, small
        ones packed), each followed by its copy-out while the params are still in cache, for
        a scaled gradient.

        [Note: the fused kernel writes the unscaled gradient back] Given ``grad_scale``,
        FusedAdamKernel.cpp stores ``grad / grad_scale`` into the gradient it is handed, so
        each chunk of the gradient is first copied into a per-thread fp32 scratch and the
        kernel gets that. DRAM traffic is unchanged (the copy reads the gradient once, the
        kernel then works in cache); the cost is the in-cache copy and a call per chunk.
        """
        limit = self._chunk_numel
        scratch = None
        if grad_scale is not None:
            scratch = getattr(self._tls, "scratch", None)
            if scratch is None or scratch.numel() < limit:
                scratch = self._tls.scratch = torch.empty(limit, dtype=torch.float32)  # fp32 [chunk_numel]
        ps, gs, ms, vs, ss, dst, src = [], [], [], [], [], [], []  # one batch of 1-D views
        filled = 0

        def flush() -> None:
            nonlocal filled
            grads = gs
            if scratch is not None:
                grads = list(scratch[:filled].split([g.numel() for g in gs]))
                torch._foreach_copy_(grads, gs)
            torch._fused_adamw_(ps, grads, ms, vs, [], ss, grad_scale=grad_scale, found_inf=None, **hyper)
            if dst:
                torch._foreach_copy_(dst, src)
            for lst in (ps, gs, ms, vs, ss, dst, src):
                lst.clear()
            filled = 0

        for p, g, st, d in items:
            if p.numel() == 0:
                continue
            pieces = zip(*(t.view(-1).split(limit) for t in (p, g, st["exp_avg"], st["exp_avg_sq"])))
            d_pieces = d.view(-1).split(limit) if d is not None else None
            for k, (pp, gp, mp, vp) in enumerate(pieces):
                if filled and filled + pp.numel() > limit:
                    flush()
                ps.append(pp); gs.append(gp); ms.append(mp); vs.append(vp); ss.append(st["step"])
                if d_pieces is not None:
                    dst.append(d_pieces[k]); src.append(pp)
                filled += pp.numel()
        if ps:
            flush()
