"""What a speculation miss costs the next forward, against a hit and against not speculating.

A speculative step (speculation.py) guesses during backward that the step will not clip; a
hit leaves the next forward nothing to wait for, a miss undoes each block's update and redoes
it. The promise a user leans on when speculation is on by default: a miss costs about what
not speculating costs, plus the undo's own work. On the first H200 run it cost about 0.5 s
instead (each block waiting ~27 ms in the forward, and the redo's image left stale, re-derived
on the training thread), more than the whole CPU Adam it was meant to hide.

This CPU proxy runs the simulated device with a host worker thread and gives every CPU Adam
update an injected cost (``UPDATE_S``, a sleep: large against the noise of a shared 2-core
machine, and it does not compete with the training thread for cores), so waiting on updates
dominates the next forward as it does on a GPU. The undo keeps its real cost, which at this
size is a small fraction of an update. Before each step the worker is drained, as a backward
long enough to hide the speculative updates would leave it (the regime speculation is for).
Then the forward after each kind of step is measured by what the training thread paid: the
seconds it waited for updates (``forward_stall_s``), the waits that blocked it
(``host_blocks``) and the images it had to re-derive (``image_refreshes``).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.optim.cpu_adam import CPUAdam
from stronghold_hf.testing import simulated_device
from tiny_models import batch, tiny_model

UPDATE_S = 0.03  # injected cost of one unit's CPU Adam update
LAYERS = 6


@pytest.fixture
def slow_updates(monkeypatch):
    """Every CPU Adam update (speculative, redo or plain) costs ``UPDATE_S`` more; a redo fused
    with its rollback (CPUAdam.redo_groups) too."""
    step_groups, redo_groups = CPUAdam.step_groups, CPUAdam.redo_groups

    def slow_step_groups(self, *args, **kwargs):
        time.sleep(UPDATE_S)
        return step_groups(self, *args, **kwargs)

    def slow_redo_groups(self, *args, **kwargs):
        time.sleep(UPDATE_S)
        return redo_groups(self, *args, **kwargs)

    monkeypatch.setattr(CPUAdam, "step_groups", slow_step_groups)
    monkeypatch.setattr(CPUAdam, "redo_groups", slow_redo_groups)


def _forward_costs(speculative_step: str, kinds: list[str]) -> dict[str, list[dict[str, float]]]:
    """Trains one step per entry of ``kinds`` ("hit" and "warm": no clip, "clip": clipped,
    "lr": the LR changed before the step) and returns, per kind, the costs of the forward that
    follows it."""
    with simulated_device(0.002):
        model = tiny_model("llama", num_hidden_layers=LAYERS)
        engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="thread", param_dtype="bf16",
                                                       speculative_step=speculative_step), device="cpu")
        assert engine.transfer.mode == "delayed" and engine.host_image
        opt = engine.build_optimizer(lr=1e-3)
        costs: dict[str, list[dict[str, float]]] = {}
        previous, outcome = None, {}  # the step before's kind, and how its speculation ended
        for step, kind in enumerate([*kinds, "hit"]):
            engine.stats.reset()
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch("llama", seed=step)).loss
            forward_s = time.perf_counter() - t0
            stats = engine.stats.as_dict()
            if previous is not None:
                costs.setdefault(previous, []).append({"forward_s": forward_s, **stats, **outcome})
            loss.backward()
            engine.synchronize()  # the speculative updates are hidden behind a long enough backward
            engine.clip_grad_norm_(1e-4 if kind == "clip" else 1e6)
            if kind == "lr":
                opt.param_groups[0]["lr"] *= 0.5
            opt.step()
            opt.zero_grad()
            after = engine.stats.as_dict()
            outcome = {"hit": after["speculation_hits"], "missed": after["speculation_misses"]}
            previous = kind if step < len(kinds) else None
        engine.synchronize()
        units = len(engine.update_order)
    for runs in costs.values():
        for run in runs:
            run["units"] = units
    return costs


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


@pytest.mark.parametrize("miss", ["clip", "lr"])
def test_a_miss_costs_the_next_forward_no_more_than_not_speculating(slow_updates, miss):
    # Hits and misses are measured after an unclipped step: a pass speculates on every unit only
    # then (after a clipped step its running norm stops speculating at that step's max_norm,
    # here 1e-4, so a hit there finds most updates still to do). The miss is the expensive
    # kind: every unit updated during backward, then undone and redone.
    on = _forward_costs("on", ["warm", "hit", miss] * 3)
    off = _forward_costs("off", ["hit"] * 4)
    hits, misses, plain = on["hit"], on[miss], off["hit"]
    assert all(r["hit"] == 1 for r in hits) and all(r["missed"] == 1 and r["rollback_s"] > 0 for r in misses)
    units = plain[0]["units"]
    stall_off = _median(plain, "forward_stall_s")
    stall_miss = _median(misses, "forward_stall_s")
    stall_hit = _median(hits, "forward_stall_s")
    forward_off, forward_miss = _median(plain, "forward_s"), _median(misses, "forward_s")
    report = dict(units=units, stall_off=stall_off, stall_miss=stall_miss, stall_hit=stall_hit,
                  forward_off=forward_off, forward_miss=forward_miss)
    # Not speculating, the forward waits for about every update but the first (run inline).
    assert stall_off >= 0.5 * (units - 1) * UPDATE_S, report
    # A miss waits for the undo and the redo of each unit: about the redo, the undo's small
    # cost, and the simulated device's per-task delay; not a second update's worth per unit
    # (the H200's 27 ms per block), which adds (units - 1) * UPDATE_S.
    margin = 0.25 * stall_off + UPDATE_S
    assert stall_miss <= stall_off + margin, report
    assert forward_miss <= forward_off + margin, report  # nothing else on the training thread either
    # No image left stale by the redo: the forward converts nothing (91 ms of copies on the H200).
    assert all(r["image_refreshes"] == 0 for r in misses), misses
    # No wait per unit beyond those of a step that did not speculate.
    assert _median(misses, "host_blocks") <= _median(plain, "host_blocks") + 2, report
    # A hit leaves (almost) nothing to wait for: the updates ran during backward.
    assert stall_hit <= 0.25 * stall_miss, report
