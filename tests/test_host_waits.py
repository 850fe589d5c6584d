"""The host side is a real-time system: the training and autograd threads do not block per block.

On a GPU the engine keeps pace only if the threads that launch work never wait on the host
worker or on a copy in the steady state; a wait per block is a step that grows with depth on
the host while the GPU idles (the first H200 run: the host set the pace). This CPU proxy runs
the simulated device (copies delayed on threads, completing through the same events) with
copies faster than compute, as on a GPU with enough bandwidth, and counts the waits that
really blocked the training or autograd thread (``host_blocks``; the engine's own threads and
the simulated stream waits, which are not the host's on a GPU, are not counted). The count per
step must not grow with depth.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.optim.cpu_adam import CPUAdam
from stronghold_hf.testing import simulated_device
from stronghold_hf.workers import HostWorker
from tiny_models import batch, tiny_model

COPY_DELAY_S = 0.0003  # per simulated copy: well under a block's compute at this size


def _blocks_per_step(layers: int, speculative_step: str, steps: int = 4) -> float:
    with simulated_device(COPY_DELAY_S):
        model = tiny_model("llama", num_hidden_layers=layers, hidden_size=64, intermediate_size=256)
        engine = offload_model(model, StrongholdConfig(window_size=2, host_worker="thread",
                                                       speculative_step=speculative_step), device="cpu")
        assert engine.transfer.mode == "delayed"
        opt = engine.build_optimizer(lr=1e-3)
        counts = []
        for step in range(steps):
            engine.stats.reset()
            model(**batch("llama", seed=step, seq=128)).loss.backward()
            engine.clip_grad_norm_(1e6)  # never clips: speculation hits
            opt.step()
            opt.zero_grad()
            counts.append(engine.stats.as_dict()["host_blocks"])
        engine.synchronize()
    return statistics.median(counts[1:])  # the steady state, after the first step


@pytest.mark.parametrize("speculative_step", ["off", "on"])
def test_host_blocking_waits_per_step_do_not_grow_with_depth(speculative_step):
    shallow = _blocks_per_step(4, speculative_step)
    deep = _blocks_per_step(16, speculative_step)
    # 12 more blocks: a wait per block would add about 12 (a lane, an update, a copy each).
    assert deep <= shallow + 3, (shallow, deep)


# ---------------------------------------------------------------- folds before updates

def _run_order(tasks: list[tuple[str, int | None, bool]]) -> list[str]:
    """Queues ``(name, unit, urgent)`` tasks behind one that holds the worker, lets it go, and
    returns the order they ran in."""
    worker = HostWorker(1)
    ran: list[str] = []
    started, gate = threading.Event(), threading.Event()
    worker.submit("gate", lambda: (started.set(), gate.wait()), unit=0)
    assert started.wait(10)
    tickets = [worker.submit(name, lambda name=name: ran.append(name), unit=unit, urgent=urgent)
               for name, unit, urgent in tasks]
    gate.set()
    for t in tickets:
        t.wait()
    worker.shutdown()
    return ran


def test_a_fold_runs_before_updates_queued_ahead_of_it_except_its_own_units():
    order = _run_order([("update 1", 1, False), ("update 2", 2, False), ("fold 3", 3, True),
                        ("fold 1", 1, True), ("update 3", 3, False), ("fold 4", 4, True), ("fold 1 again", 1, True)])
    # Folds of other units pass the queued updates; a unit's fold waits for that unit's update
    # queued before it (it writes the gradient the update reads), and a unit's tasks keep
    # their order among themselves; updates keep theirs.
    assert order == ["fold 3", "fold 4", "update 1", "fold 1", "fold 1 again", "update 2", "update 3"]


def test_a_task_without_a_unit_is_passed_by_nothing():
    order = _run_order([("update 1", 1, False), ("anything", None, False), ("fold 2", 2, True),
                        ("fold of anything", None, True), ("update 3", 3, False)])
    assert order == ["update 1", "anything", "fold 2", "fold of anything", "update 3"]


def test_folds_do_not_queue_behind_speculative_updates(monkeypatch):
    """During a speculating backward the worker holds both: each block's fold, which frees the
    lane the next block's backward waits for, and each block's update (long here: 30 ms
    injected into every CPU Adam call). In submission order a fold waited for every update
    queued before it (a wait that grows with the lanes in flight on the autograd thread); now
    only for the one in hand."""
    step_groups = CPUAdam.step_groups

    def slow_step_groups(self, *args, **kwargs):
        time.sleep(0.03)
        return step_groups(self, *args, **kwargs)

    monkeypatch.setattr(CPUAdam, "step_groups", slow_step_groups)
    with simulated_device(COPY_DELAY_S):
        model = tiny_model("llama", num_hidden_layers=8, hidden_size=64, intermediate_size=256)
        # Four lanes: enough that the backward runs ahead of the folds, so a FIFO worker holds
        # several updates in front of a fold (two lanes throttle the backward to one or two).
        engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="thread", speculative_step="on",
                                                       grad_buffers=4), device="cpu")
        opt = engine.build_optimizer(lr=1e-3)
        log: list[tuple[str, str, int]] = []  # (event, kind, task number), in the order they happened
        lock = threading.Lock()
        submit = engine.worker.submit

        def logged_submit(label, fn, **kwargs):
            kind = "fold" if label.startswith("gradient copy") else "update"
            with lock:
                n = len(log)
                log.append(("submit", kind, n))

            def run():
                with lock:
                    log.append(("start", kind, n))
                fn()

            return submit(label, run, **kwargs)

        monkeypatch.setattr(engine.worker, "submit", logged_submit)
        for step in range(2):
            model(**batch("llama", seed=step, seq=32)).loss.backward()
            engine.clip_grad_norm_(1e6)
            opt.step()
            opt.zero_grad()
        engine.synchronize()
    assert engine.stats.as_dict()["speculated_blocks"] >= 8
    passed_by = []  # per fold: the updates that started between its submission and its start
    for i, (event, kind, n) in enumerate(log):
        if event == "submit" and kind == "fold":
            start = log.index(("start", "fold", n))
            passed_by.append(sum(1 for e, k, _ in log[i:start] if e == "start" and k == "update"))
    # In submission order: up to 3 updates ahead of a fold here, 28 over the 18 folds.
    assert len(passed_by) >= 16 and max(passed_by) <= 1 and sum(passed_by) <= len(passed_by) // 4, passed_by


# ---------------------------------------------------------------- the .grad views of a lane

class _CountOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_lanes_grad_views_cost_one_op_per_parameter_and_alias_it_exactly():
    """Attaching a lane runs on the autograd thread before every block's backward (about 2 ms
    of Python per block on the H200, the hooks together). Each parameter's ``.grad`` view is one
    ``as_strided`` from geometry worked out once per unit, not a slice and then a view; the
    views are exactly those: the lane's memory at the parameter's offset, its shape, contiguous
    (the parity tests train through them)."""
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    u = engine.schedule.blocks[0]
    u.begin_fetch()
    u.wait_resident()
    n = u.layout.padded_grad_numel
    storage = torch.zeros(n + 64, dtype=u.layout.grad_dtype)
    lane = storage[64:]  # a lane need not start at its storage's start
    trainable = [k for k, e in enumerate(u.layout.entries) if e.trainable]
    for attach in range(2):
        with _CountOps() as ops:
            u.attach_grad_buffer(lane)
        # Per parameter: its view and setting its .grad; a slice and a view took one op more each.
        assert ops.calls <= 2 * len(trainable) + 3, ops.calls
        lane.copy_(torch.arange(n, dtype=lane.dtype))
        for k in trainable:
            e, g = u.layout.entries[k], u.params[k].grad
            reference = lane[e.grad_offset: e.grad_offset + e.numel].view(e.shape)
            assert g.data_ptr() == reference.data_ptr() and g.shape == e.shape and g.stride() == reference.stride()
            assert torch.equal(g, reference)
        lane.zero_()
        u.collect_into_buffer()
        u.detach_grad_buffer()
    u.evict()
