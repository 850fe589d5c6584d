"""Native CPU kernels: C++ files shipped in the package, compiled once by the system compiler, loaded by ctypes.

The sources live in ``stronghold_hf/optim/csrc/`` (package data, so a wheel carries them): one
``.cpp`` per kernel library, each a complete translation unit, and ``common.h``, the helpers they
share (fp32 -> bf16/fp16 rounding as torch does it, the OpenMP thread split). They are plain
C++17 and build by hand with the flags used here::

    g++ -O3 -std=c++17 -shared -fPIC -fopenmp -ffp-contract=off -fno-math-errno -march=native \\
        -I stronghold_hf/optim/csrc stronghold_hf/optim/csrc/cpu_adam.cpp -o cpu_adam.so

`build_native_library` compiles a source into ``~/.cache/stronghold_hf`` (``$STRONGHOLD_CACHE_DIR``
overrides it), keyed by the source, the headers of ``csrc``, the compiler, the flags and the CPU,
so an edited header rebuilds every library and a shared home directory never hands one machine
another's binary, and loads it. `NativeLibrary` does that on first use for one ``csrc`` file,
checks the library's ABI version, sets its functions' signatures, and remembers why it failed
when it did, naming the torch path its callers take instead: CPUAdam's fp32 kernel
(cpu_adam.py, ``cpu_adam.cpp``), the 8-bit one (quant8.py, ``cpu_adam8.cpp``) and the
speculation undo (undo_native.py, ``adam_undo.cpp``).
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

#: The kernels' C++ sources and their shared header, shipped as package data.
CSRC = Path(__file__).resolve().parent / "csrc"

_BUILD_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]


def build_native_library(source: str, name: str, *, include_dir: Path = CSRC) -> ctypes.CDLL:
    """Compiles ``source`` (C++ text) with ``-I include_dir`` once per (source, headers,
    compiler, CPU) into the cache and loads it.

    Every ``*.h`` in ``include_dir`` is part of the cache key, so editing a header rebuilds
    what includes it. ``-march=native`` is tried first, so the key includes the CPU's flags: a
    home directory shared by different machines must not hand one a binary for another. Raises
    ``RuntimeError`` with the reason when there is no compiler or the build fails.
    """
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX)")
    try:
        cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        cpu = ""
    headers = [part for h in sorted(include_dir.glob("*.h")) for part in (h.name, h.read_text())]
    parts = [source, *headers, cxx, *_BUILD_FLAGS, platform.machine(), cpu]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    xdg_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = Path(os.environ.get("STRONGHOLD_CACHE_DIR") or xdg_cache / "stronghold_hf")
    lib = cache / f"{name}-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, out = Path(tmp) / f"{name}.cpp", Path(tmp) / f"{name}.so"
            src.write_text(source)  # the text the key covers, whatever happens to the file meanwhile
            for isa in (["-march=native"], []):
                cmd = [cxx, *_BUILD_FLAGS, *isa, f"-I{include_dir}", str(src), "-o", str(out)]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if proc.returncode == 0:
                    break
            else:
                reason = proc.stderr.strip()[-1500:] or f"exit status {proc.returncode}"
                raise RuntimeError(f"building {name} with {cxx} failed: {reason}")
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
    """One kernel library, ``csrc/<source_file>``: built and loaded on first `load`, or, when it
    cannot be, the reason (`error`), after which every caller takes its torch path, which
    ``fallback`` names (it ends the reason). Thread-safe."""

    def __init__(self, name: str, source_file: str, *, abi: tuple[str, int], signatures: dict[str, list],
                 fallback: str) -> None:
        self.name, self.source_file, self.abi, self.signatures = name, source_file, abi, signatures
        self.fallback = fallback
        self._lib: ctypes.CDLL | None = None
        self._lib_holding_gil: ctypes.PyDLL | None = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        lib = self._lib
        if lib is not None or self._error is not None:  # decided: no lock (every update calls this)
            return lib
        with self._lock:
            if self._lib is None and self._error is None:
                try:
                    lib = build_native_library((CSRC / self.source_file).read_text(), self.name)
                    symbol, version = self.abi
                    if getattr(lib, symbol)() != version:
                        raise RuntimeError("stale library ABI")
                    # [Note: small calls keep the GIL] The same library through PyDLL: its calls
                    # keep the GIL. Letting go of it costs the thread that launches the kernels a
                    # wait to get it back (unit_grads.py, [Note: torch calls on the host worker]);
                    # for a call of a few microseconds that costs more than it frees.
                    held = ctypes.PyDLL(lib._name)
                    for handle in (lib, held):
                        for fn, argtypes in self.signatures.items():
                            getattr(handle, fn).argtypes = argtypes
                            getattr(handle, fn).restype = None
                    self._lib_holding_gil = held  # first: `load` returns without the lock once _lib is set
                    self._lib = lib
                except Exception as err:  # any failure means: use the torch path
                    self._error = f"{type(err).__name__}: {err}; {self.fallback}"
            return self._lib

    def for_elements(self, numel: int):
        """The library to call for ``numel`` elements: keeping the GIL below `SMALL_CALL_NUMEL`
        ([Note: small calls keep the GIL]), letting go of it above. Call after `load`."""
        return self._lib_holding_gil if numel < SMALL_CALL_NUMEL else self._lib

    def error(self) -> str | None:
        """Why the library is unavailable (building it if needed) and what runs instead, or
        ``None`` if it works."""
        self.load()
        return self._error


#: Below this many elements a kernel runs on one thread in a few microseconds (common.h's
#: ``threads_for`` cutoff): its call keeps the GIL ([Note: small calls keep the GIL]).
SMALL_CALL_NUMEL = 65536

__all__ = ["CSRC", "SMALL_CALL_NUMEL", "build_native_library", "NativeLibrary"]
