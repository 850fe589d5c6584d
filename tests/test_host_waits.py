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

import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.optim.cpu_adam import CPUAdam
from stronghold_hf.testing import simulated_device
from stronghold_hf.workers import HostWorker
from tiny_models import batch, tiny_model

COPY_DELAY_S = 0.0003  # per simulated copy: well under a block's compute at this size


def _blocks_per_step(layers: int, speculative_step: str, steps: int = 6) -> float:
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
    # The steady state, after the first step: its least-blocked step. A wait per block blocks
    # every step; the suite's other worker, competing for the cores, only some of them.
    return min(counts[1:])


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
            text = label if isinstance(label, str) else "".join(label)  # a label may come in pieces
            kind = "fold" if text.startswith("gradient copy") else "update"
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

class _CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched (what launches kernels on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_lane_takes_a_blocks_gradients_in_one_fused_copy_through_views_made_once():
    """Before and after every block's backward, on the autograd thread: no ``.grad`` views, no
    ``zero_`` of the lane and no ``add_`` per parameter. Autograd steals each gradient as in
    plain training; the lane takes them in with one ``_foreach_copy_``, through views of the
    lane made once per geometry (the same for every block of a stack) that alias it exactly,
    and parameters without a gradient read as zeros there."""
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    queue = engine.grad_queue
    blocks = engine.schedule.blocks
    assert len({u.layout.grad_geometry_key for u in blocks}) == 1  # one geometry for the stack
    trainable = [k for k, e in enumerate(blocks[0].layout.entries) if e.trainable]
    made, seen_lanes = [], set()
    for round_ in range(2):
        for u in blocks:
            u.begin_fetch()
            u.wait_resident()
            with _CountOps() as ops:
                lane = queue.acquire(u.index, u.layout.padded_grad_numel, u.layout.grad_dtype, u.layout.grad_geometry_key)
                views = lane.views(u.layout.grad_geometry_key, u.layout.grad_geometry)
                u.grads.attach_grad_buffer(lane.device_buffer, views)
            made.append(views)
            # A lane's first use makes its views and zeroes it; later blocks of the same geometry
            # cost no op at all.
            assert lane.index in seen_lanes or round_ == 0 or ops.calls == 0
            if lane.index in seen_lanes:
                assert ops.calls == 0, ops.calls
            seen_lanes.add(lane.index)
            assert all(u.params[k].grad is None for k in trainable)
            for k in trainable:  # what autograd would leave: stolen gradients
                u.params[k].grad = torch.full_like(u.params[k], float(k + 1))
            u.params[trainable[-1]].grad = None  # one parameter without a gradient
            with _CountOps() as ops:
                touched = u.grads.collect_into_buffer()
            assert ops.calls <= 2, ops.calls  # one fused copy (and one zero of the missing view)
            assert touched == trainable[:-1]
            for k in trainable:
                e = u.layout.entries[k]
                ref = lane.device_buffer[e.grad_offset: e.grad_offset + e.numel].view(e.shape)
                assert views[k].data_ptr() == ref.data_ptr() and views[k].stride() == ref.stride()
                assert torch.equal(ref, torch.full_like(ref, float(k + 1) if k != trainable[-1] else 0.0))
                assert u.params[k].grad is None
            padding = torch.ones(lane.device_buffer.numel(), dtype=torch.bool)
            for k in trainable:
                e = u.layout.entries[k]
                padding[e.grad_offset: e.grad_offset + e.numel] = False
            assert not lane.device_buffer[padding].any()  # the padding stays zero
            u.grads.detach_grad_buffer()
            queue.discard(lane)
            u.evict()
    # Views made once per lane, reused by every block and pass.
    assert len({id(v) for v in made}) == len(seen_lanes)
    queue.release_device_buffers()
    engine.close()
