"""Teardown in order: the engine's threads and its hold on torch.distributed end before the
interpreter does.

A training script is free to end without ``engine.close()`` or ``destroy_process_group()``
(most Trainer scripts do both). What then runs at exit is ``Py_FinalizeEx``, which frees
modules, and with them the process group, after it has started refusing the GIL to every
thread but the main one. Issue #36 was that order: a 2-rank gloo Trainer run finished
training and then died with "terminate called without an active exception" (SIGABRT) in 9
of 91 runs under torchrun on 2 cores (the plain Trainer, without STRONGHOLD, in 1 of 21).
The core files all show the same two threads::

    Thread 1 "pt_gloo_runloop":  c10d::ProcessGroupGloo::runLoop
        -> c10d::(anonymous namespace)::AsyncAllgatherWork::~AsyncAllgatherWork
        -> c10::TensorImpl::decref_pyobject -> pybind11::gil_scoped_acquire
        -> take_gil -> PyThread_exit_thread -> __pthread_unwind -> std::terminate
    Thread 5 "python":           Py_FinalizeEx -> PyGC_Collect

The gloo worker thread still held the last collective of the run (the Trainer's ``store_flos``
all-gather, or the engine's own all-gathers of ``full_state_dict``), whose tensors carry Python
objects; releasing them needs the GIL, and a thread that takes the GIL during finalization
is ended with ``pthread_exit`` inside a ``noexcept`` destructor (distributed.py, [Note: the
process group's last reference]). None of the engine's own threads was involved (the host
worker runs inline on a CPU device; the native kernels run on the calling thread).

`register` (called by every `WindowEngine`) installs one ``atexit`` handler. ``atexit`` runs
before finalization, and this handler, registered after torch, accelerate and transformers
were imported, runs before theirs. It does, in this order:

1. for each engine still alive (held by weak reference, so the registry keeps none alive)
   and not closed: `WindowEngine.shutdown_workers` (pending CPU work finished; the host
   worker, the fetch conversion thread, the simulated copy threads and the NVMe I/O pool
   joined; the process group's hold on the engine's tensors settled), then
   `DataParallel.close` (the gloo group the engine made for host tensors given back);
2. if an engine used data parallelism over a gloo default group that is still initialized
   (the user did not call ``destroy_process_group()``): the groups are destroyed, with this
   module holding a reference to each so that the last one is dropped here, by pybind,
   which releases the GIL before the C++ destructor joins the group's worker threads. A
   worker that still holds a finished work takes the GIL, drops it, and is joined while the
   interpreter is whole. (torch's own ``destroy_process_group`` drops the last reference
   inside ``_unregister_all_process_groups`` with the GIL held: a worker waiting for the GIL
   there would deadlock the join; holding our references avoids that too.)

NCCL default groups are left to the user and torch: their watchdog is not the thread that
failed here, and shutting NCCL down is a collective in some NCCL versions.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref

logger = logging.getLogger("stronghold_hf")

_engines: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()
_registered = False
_process_group_used = False  # an engine communicated through torch.distributed in this process


def register(engine) -> None:
    """Remembers ``engine`` (weakly) for the exit-time teardown; installs the handler once."""
    global _registered, _process_group_used
    with _lock:
        _engines.add(engine)
        if getattr(engine, "dp", None) is not None:
            _process_group_used = True
        if not _registered:
            atexit.register(_at_exit)
            _registered = True


def live_engines() -> list:
    """The registered engines that are still alive and not closed."""
    with _lock:
        return [e for e in list(_engines) if not e.closed]


def shutdown_engines() -> None:
    """Step 1 of the teardown (module docstring): every live engine's threads stop, its
    collectives settle, and it gives back the process group it made. Local: no collective,
    so one rank may run it alone (an exception ended its training, the others wait)."""
    for engine in live_engines():
        try:
            engine.shutdown_workers()
        except Exception as err:  # at exit: a failed step's error was reported already
            logger.debug("stronghold: shutting down an engine's workers at exit failed: %r", err)
        if engine.dp is not None:
            try:
                engine.dp.close()
            except Exception as err:
                logger.debug("stronghold: giving back the engine's process group at exit failed: %r", err)


def destroy_gloo_process_groups() -> bool:
    """Step 2 (module docstring): destroys the process groups when the default one is gloo and
    still initialized, joining their worker threads now. Returns whether it did."""
    import torch.distributed as dist

    from .distributed import _registered_groups, is_initialized

    if not is_initialized() or dist.get_backend() != "gloo":
        return False
    held = _registered_groups()  # ours: the last reference of each is dropped below
    dist.destroy_process_group()
    names = len(held)
    del held  # pybind releases the GIL, each group drains its queue and joins its threads
    logger.debug("stronghold: destroyed %d gloo process group(s) at exit, before interpreter finalization", names)
    return True


def _at_exit() -> None:
    shutdown_engines()
    if _process_group_used:
        try:
            destroy_gloo_process_groups()
        except Exception as err:
            logger.debug("stronghold: destroying the process group at exit failed: %r", err)
