"""Small context managers for the per-block hot path, each cheaper than the general one.

On a GPU the training and autograd threads launch every kernel, so whatever Python runs per
block is time the GPU may wait (docs/design.md, "The hot path"). Three general tools cost
more than the work they wrap there:

* ``torch.no_grad()`` builds a decorator-capable object each time (about 2.5 us);
  `no_grad` sets and restores the grad mode directly (about 0.4 us);
* ``record_function`` enters the profiler even when nobody profiles (about 6 us);
  `profiled` labels the range only while a profiler runs;
* the engine's own reads of a parameter that is guarded (read_guard.py) would go through the
  guard's ``__torch_function__`` (about 3 us per attribute); `engine_access` turns that off
  for the body, once per call instead of once per attribute;
* a torch call lets go of the GIL, and on the host worker that hands it to the training
  thread, which then waits to get it back (unit_grads.py, [Note: torch calls on the host worker]);
  `host_copy_` copies a small host buffer keeping the GIL.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch.autograd.profiler import record_function

_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled
_profiler_enabled = torch.autograd._profiler_enabled
_DisableSubclass = torch._C.DisableTorchFunctionSubclass


class _NoGrad:
    __slots__ = ("_prev",)

    def __enter__(self) -> None:
        self._prev = _is_grad_enabled()
        _set_grad_enabled(False)

    def __exit__(self, *exc) -> None:
        _set_grad_enabled(self._prev)


def no_grad() -> _NoGrad:
    """``torch.no_grad()`` as a plain context manager (not a decorator), for hot paths."""
    return _NoGrad()


class _Nothing:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_NOTHING = _Nothing()


def profiled(label, *parts):
    """``record_function(label + parts)`` while a profiler runs; a no-op context otherwise.
    The label is built only when it is used (pass its pieces, not an f-string)."""
    if _profiler_enabled():
        return record_function("".join((label, *map(str, parts))))
    return _NOTHING


#: ``with engine_access():`` the engine's own reads and writes of parameters: a guarded
#: parameter (read_guard.py) does not run its read barrier for them. The C context manager
#: itself, made without a Python call.
engine_access = _DisableSubclass


def engine_method(fn):
    """Runs the method under `engine_access` (the whole body: one switch, not one per read)
    when its object's parameters may be guarded (``self.read_guard.guarded``, read_guard.py); as
    it is otherwise."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if not self.read_guard.guarded:
            return fn(self, *args, **kwargs)
        with _DisableSubclass():
            return fn(self, *args, **kwargs)

    return wrapper


#: ``memmove`` called keeping the GIL (ctypes.memmove lets go of it, as every CDLL call does).
_memmove_holding_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr)

#: Below this many bytes a host copy keeps the GIL: a few microseconds of memcpy cost less than
#: handing the GIL over and waiting for it.
SMALL_COPY_BYTES = 1 << 18


def host_copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for host tensors, keeping the GIL when both are contiguous, of one
    dtype and size, and small (`SMALL_COPY_BYTES`)."""
    nbytes = src.nbytes
    if (nbytes < SMALL_COPY_BYTES and dst.dtype == src.dtype and dst.numel() == src.numel()
            and dst.is_contiguous() and src.is_contiguous()):
        _memmove_holding_gil(dst.data_ptr(), src.data_ptr(), nbytes)
    else:
        dst.copy_(src)
