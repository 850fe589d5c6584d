"""Native CPU kernels: C++ sources compiled once with the system compiler, loaded through ctypes.

`build_native_library` compiles a source into ``~/.cache/stronghold_hf`` (keyed by the source,
the compiler and the CPU, so a shared home directory never hands one machine another's binary)
and loads it; `NativeLibrary` does that on first use, checks the library's ABI version, sets its
functions' signatures, and remembers why it failed when it did, so callers fall back to torch
(CPUAdam's fp32 kernel in cpu_adam.py, the 8-bit one in quant8.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

#: fp32 -> bf16/fp16 bits exactly as torch rounds, and bf16 -> fp32, shared with the 8-bit
#: kernel (quant8.py).
ROUNDING_HELPERS = r"""
inline uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bf16 bits -> fp32, exact (a gradient kept in bf16 on the host is read through this).
inline float from_bf16(uint16_t h) { return from_bits(uint32_t(h) << 16); }
inline void widen_bf16(const uint16_t* __restrict src, int64_t n, float* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_bf16(src[i]);
}

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

"""

#: How the table-driven kernels (CPU Adam's update, the speculation undo) split one call's
#: concatenated tensors over OpenMP threads; needs <omp.h> and <algorithm>.
THREADING_HELPERS = r"""
// Small calls run on the calling thread: below ~64K elements (~2 GRAIN_SIZEs of torch's
// parallel_for) a fork/join costs about what a second core saves, and risks a stall.
inline int threads_for(int64_t total, int64_t nthreads) { return total >= 65536 ? std::max(1, int(nthreads)) : 1; }

// The calling thread's slice [lo, hi) of `total` concatenated elements: one contiguous slice per
// thread, starting on a 16-element (64-byte) boundary, so no two threads share a cache line.
inline void thread_slice(int64_t total, int64_t& lo, int64_t& hi) {
  const int64_t T = omp_get_num_threads(), id = omp_get_thread_num(), units = (total + 15) / 16;
  lo = std::min(total, units * id / T * 16);
  hi = std::min(total, units * (id + 1) / T * 16);
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


class NativeLibrary:
    """One kernel library: built and loaded on first `load`, or, when it cannot be, the reason
    (`error`), after which every caller takes its torch path. Thread-safe."""

    def __init__(self, name: str, source: str, *, abi: tuple[str, int], signatures: dict[str, list]) -> None:
        self.name, self.source, self.abi, self.signatures = name, source, abi, signatures
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        with self._lock:
            if self._lib is None and self._error is None:
                try:
                    lib = build_native_library(self.source, self.name)
                    symbol, version = self.abi
                    if getattr(lib, symbol)() != version:
                        raise RuntimeError("stale library ABI")
                    for fn, argtypes in self.signatures.items():
                        getattr(lib, fn).argtypes = argtypes
                        getattr(lib, fn).restype = None
                    self._lib = lib
                except Exception as err:  # any failure means: use the torch path
                    self._error = f"{type(err).__name__}: {err}"
            return self._lib

    def error(self) -> str | None:
        """Why the library is unavailable (building it if needed), or ``None`` if it works."""
        self.load()
        return self._error


__all__ = ["ROUNDING_HELPERS", "THREADING_HELPERS", "build_native_library", "NativeLibrary"]
