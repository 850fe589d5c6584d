"""A finished run exits 0: no engine or process-group thread outlives the interpreter (issue #36).

A 2-rank gloo Trainer run with ``--stronghold`` finished training and then, in about 1 run of
10, died at exit with "terminate called without an active exception" (SIGABRT): the process
group's worker thread (``pt_gloo_runloop``) released the last collective's tensors after
``Py_FinalizeEx`` had begun (lifecycle.py tells the story). The fix orders the teardown
before finalization; these tests hold it there from outside, on processes that really exit.

Every child process checks, in the ``atexit`` handler that runs last (registered before
stronghold_hf is imported), that no ``pt_gloo_runloop`` thread and no ``stronghold-*``
thread is still alive, and exits 70 naming them if one is. That check fails on every run
without the fix; the crash itself is a race (about 1 in 10 under torchrun on 2 cores).

Twelve 2-rank runs (each of the four cases three times) cannot each import torch and
transformers within a minute on 2 cores (a rank spends about 5 s importing and 6 s in
finalization's garbage collection). So one process imports once, freezes what it imported out
of the collector's sight (``gc.freeze``), and forks each run's two ranks; each rank sets up
torch.distributed from the environment as torchrun's children do, trains through
`StrongholdTrainer` parsed by ``HfArgumentParser``, and falls off the end of the script into
the interpreter's normal exit. Forked ranks rarely show the abort itself (0 of 40 on the code
before the fix with the exit check off, against about 1 in 10 under torchrun): in them the exit
check is what fails. Two launches through ``torch.distributed.run`` run the same script the way
the issue did, alongside.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stronghold_hf

REPO = Path(stronghold_hf.__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
RUNS = 12

# Registered before stronghold_hf is imported, so it runs after lifecycle.py's handler: the
# state the interpreter's finalization will find.
_EXIT_CHECK = r'''
import atexit, os, sys, threading

def _alive_threads():
    names = [t.name for t in threading.enumerate() if t.name.startswith("stronghold")]
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        if name == "pt_gloo_runloop":
            names.append(name)
    return sorted(names)

def _exit_check():
    alive = _alive_threads()
    if alive:
        sys.stderr.write(f"EXIT-CHECK: threads alive when the interpreter finalizes: {alive}\n")
        sys.stderr.flush()
        os._exit(70)

atexit.register(_exit_check)
'''

_RANKS_SCRIPT = _EXIT_CHECK + r'''
"""clean_exit_ranks.py fork OUT RUNS CONCURRENCY | torchrun: clean_exit_ranks.py rank OUT READ SAVE"""
import gc, json, signal, socket, time
sys.path[:0] = [os.environ["CLEAN_EXIT_REPO"], os.environ["CLEAN_EXIT_TESTS"]]
import conftest  # noqa: F401  offline settings
import torch
from transformers import HfArgumentParser
from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments
from test_trainer import TinyDataset
from tiny_models import tiny_model

CASES = [(read, save) for read in (True, False) for save in (False, True)]


def train(out, read, save):
    """The issue's script: parse, train two steps, read the parameters after the last one."""
    argv = ["--use_cpu", "--ddp_backend", "gloo", "--max_steps", "2", "--stronghold", "--output_dir", out,
            "--report_to", "none", "--per_device_train_batch_size", "2", "--disable_tqdm", "true",
            "--save_strategy", "steps" if save else "no", "--save_steps", "1", "--learning_rate", "1e-2"]
    (args,) = HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses(args=argv)
    model = tiny_model("gpt2")
    trainer = StrongholdTrainer(model=model, args=args, train_dataset=TinyDataset("gpt2", n=8, padded=False))
    trainer.train()
    if read:  # every rank gathers (sharded CPU state): the run's last collectives are the engine's
        total = sum(float(v.float().sum()) for v in trainer.stronghold_engine.full_state_dict().values())
        print(f"rank {os.environ['RANK']} read {total:.6f}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fork_runs(out, runs, concurrency):
    """Parent: forks each run's two ranks, `concurrency` runs at a time. Returns the child's
    run spec in a child, None in the parent once every run is reaped."""
    gc.collect()
    gc.freeze()  # children skip the imported modules' objects when they collect at exit
    results, active, started = [], [], 0
    while started < runs or active:
        while started < runs and len(active) < concurrency:
            i, (read, save) = started, CASES[started % len(CASES)]
            port, pids = _free_port(), []
            for rank in range(2):
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    log = os.open(os.path.join(out, f"run{i}-rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(log, 1)
                    os.dup2(log, 2)
                    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                    return os.path.join(out, f"run{i}"), read, save
                pids.append(pid)
            active.append((i, read, save, {pid: None for pid in pids}, time.monotonic()))
            started += 1
        time.sleep(0.05)
        for entry in list(active):
            i, read, save, codes, t0 = entry
            for pid in [p for p, code in codes.items() if code is None]:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            if any(code is None for code in codes.values()) and time.monotonic() - t0 > 180:
                for pid in [p for p, code in codes.items() if code is None]:  # hung: a failure too
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid] = "hung"
            if all(code is not None for code in codes.values()):
                results.append(dict(run=i, read=read, save=save, codes=list(codes.values()),
                                    seconds=time.monotonic() - t0))
                active.remove(entry)
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)
    return None


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "fork":
        child = fork_runs(out, int(sys.argv[3]), int(sys.argv[4]))
        if child is not None:
            train(*child)
    else:  # one rank under torchrun
        train(out, sys.argv[3] == "read", sys.argv[4] == "save")
    # Falls off the end: the interpreter exits as the issue's script did.
'''

_ALONE_SCRIPT = _EXIT_CHECK + r'''
"""One process, every engine thread running, a loop that never calls engine.close()."""
import threading
sys.path[:0] = [os.environ["CLEAN_EXIT_REPO"], os.environ["CLEAN_EXIT_TESTS"]]
import conftest  # noqa: F401
import torch
from stronghold_hf import StrongholdConfig, offload_model
from tiny_models import batch, tiny_model

model = tiny_model("llama")
# bf16 copies without the host image: fetches convert on the conversion thread; the delayed
# copy mode (environment) runs the simulated copy threads; CPU Adam's moments on disk.
config = StrongholdConfig(window_size=1, host_worker="thread", host_image=False, param_dtype=torch.bfloat16,
                          nvme_path=sys.argv[1])
engine = offload_model(model, config, device="cpu")
opt = engine.build_optimizer(lr=1e-2)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch("llama", seed=step)).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
print("RUNNING " + " ".join(sorted({t.name.rstrip("_0123456789") for t in threading.enumerate()})))
'''


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRONGHOLD")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               CLEAN_EXIT_REPO=str(REPO), CLEAN_EXIT_TESTS=str(TESTS), PYTHONFAULTHANDLER="1", **extra)
    return env


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _failure(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return f"--- {path.name}:\n{text[-2500:]}"


@pytest.mark.slow
def test_two_rank_trainer_runs_exit_cleanly_every_time(tmp_path):
    """12 forked 2-rank runs in a row (reads after training or not, checkpoints or not), and two
    through torchrun alongside: both ranks exit 0 every time, nothing says "terminate called",
    and no gloo or engine thread is alive when the interpreter finalizes."""
    script = tmp_path / "clean_exit_ranks.py"
    script.write_text(_RANKS_SCRIPT)
    t0 = time.perf_counter()
    torchrun = {  # the launch, with and without reads after training
        case: subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={_port()}",
             str(script), "rank", str(tmp_path / f"torchrun-{case[0]}"), *case],
            env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for case in [("read", "save"), ("noread", "nosave")]}
    forked = subprocess.run([sys.executable, str(script), "fork", str(tmp_path), str(RUNS), "2"], env=_env(),
                            cwd=tmp_path, capture_output=True, text=True, timeout=900)
    launched = {case: (proc.communicate(timeout=600)[0], proc.returncode) for case, proc in torchrun.items()}
    elapsed = time.perf_counter() - t0
    assert forked.returncode == 0, forked.stdout[-2000:] + forked.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["run"] for r in sorted(results, key=lambda r: r["run"])] == list(range(RUNS))
    failures = []
    for r in sorted(results, key=lambda r: r["run"]):
        logs = [tmp_path / f"run{r['run']}-rank{rank}.log" for rank in range(2)]
        texts = [p.read_text(errors="replace") for p in logs]
        if r["codes"] != [0, 0] or any("terminate called" in t or "EXIT-CHECK" in t for t in texts):
            failures.append(f"run {r['run']} (read={r['read']}, save={r['save']}): exit codes {r['codes']}\n"
                            + "\n".join(_failure(p) for p in logs))
        if r["read"]:
            reads = {line.split()[-1] for t in texts for line in t.splitlines() if " read " in line}
            assert len(reads) == 1, (r, reads)  # both ranks read the same gathered parameters
        if r["save"]:
            assert (tmp_path / f"run{r['run']}" / "checkpoint-2").is_dir(), r
    assert not failures, f"{len(failures)} of {RUNS} runs did not exit cleanly:\n" + "\n\n".join(failures)
    for case, (out, code) in launched.items():
        assert code == 0 and "terminate called" not in out and "EXIT-CHECK" not in out, (case, out[-5000:])
        assert out.count(" read ") == (2 if case[0] == "read" else 0), (case, out[-3000:])
    print(f"{RUNS} forked runs and {len(launched)} torchrun runs in {elapsed:.1f} s; "
          f"slowest forked run {max(r['seconds'] for r in results):.1f} s")


def test_a_loop_that_never_closes_the_engine_exits_cleanly(tmp_path):
    """offload_model, three steps with every engine thread running (host worker, fetch
    conversion, simulated copies, NVMe I/O), then the interpreter exits without close()."""
    script = tmp_path / "never_closed.py"
    script.write_text(_ALONE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "nvme")],
                          env=_env(STRONGHOLD_SIMULATE_COPY_DELAY_MS="1"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr and "EXIT-CHECK" not in proc.stderr, proc.stderr[-4000:]
    running = next(line for line in proc.stdout.splitlines() if line.startswith("RUNNING")).split()[1:]
    # Not vacuous: each kind of engine thread was alive before the exit.
    for name in ("stronghold-host-worker", "stronghold-fetch-convert", "stronghold-sim-h2d", "stronghold-sim-d2h",
                 "stronghold-nvme"):
        assert name in running, running
    assert not list((tmp_path / "nvme").glob("stronghold-*")), "the NVMe scratch directory outlived the run"


def test_shutdown_workers_stops_every_engine_thread_and_training_goes_on(tmp_path, monkeypatch):
    """In process: `shutdown_workers` joins every engine thread, and the next step restarts
    them; training equals a run that never stopped them, bit for bit."""
    import copy
    import threading

    import torch

    from stronghold_hf import StrongholdConfig, offload_model
    from tiny_models import batch, tiny_model

    monkeypatch.setenv("STRONGHOLD_SIMULATE_COPY_DELAY_MS", "1")

    others = set(threading.enumerate())  # engines other tests left open keep theirs

    def engine_threads():
        return sorted(t.name for t in set(threading.enumerate()) - others if t.name.startswith("stronghold"))

    def train(model, nvme, stop_between):
        config = StrongholdConfig(window_size=1, host_worker="thread", host_image=False, param_dtype=torch.bfloat16,
                                  nvme_path=str(nvme))
        engine = offload_model(model, config, device="cpu")
        opt = engine.build_optimizer(lr=1e-2, weight_decay=0.1)
        losses, seen = [], []
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch("llama", seed=step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if stop_between:
                seen.append(engine_threads())
                engine.shutdown_workers()
                assert engine_threads() == [], engine_threads()
        state = {k: v.clone() for k, v in engine.full_state_dict().items()}
        engine.close()
        assert engine_threads() == []
        return losses, state, seen

    ref = tiny_model("llama")
    kept = train(copy.deepcopy(ref), tmp_path / "a", stop_between=False)
    stopped = train(copy.deepcopy(ref), tmp_path / "b", stop_between=True)
    assert stopped[0] == kept[0]
    for k, v in kept[1].items():
        assert torch.equal(stopped[1][k], v), k
    for names in stopped[2]:  # every step started them again
        assert {"stronghold-host-worker", "stronghold-fetch-convert", "stronghold-sim-h2d"} <= set(names), names
        assert any(n.startswith("stronghold-nvme") for n in names), names


def test_exit_teardown_joins_the_gloo_worker_threads():
    """lifecycle's exit steps, run by hand in a gloo group of one: the engine settles (the group
    holds none of its tensors), and the group's worker threads are joined before anything else
    is torn down."""
    import torch.distributed as dist

    from stronghold_hf import StrongholdConfig, lifecycle, offload_model
    from tiny_models import batch, tiny_model

    def gloo_workers():
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
            except OSError:
                pass
        return names.count("pt_gloo_runloop")

    before = gloo_workers()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        model = tiny_model("gpt2")
        engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
        opt = engine.build_optimizer(lr=1e-2)
        model(**batch("gpt2", seed=0)).loss.backward()
        engine.clip_grad_norm_(1.0)
        opt.step()
        engine.full_state_dict()
        assert gloo_workers() > before
        assert engine in lifecycle.live_engines()
        lifecycle.shutdown_engines()
        assert engine.dp.held_by_group() == 0
        assert lifecycle.destroy_gloo_process_groups()
        assert not dist.is_initialized()
        assert gloo_workers() == before  # joined now, not during interpreter finalization
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_accelerate_end_training_stops_the_engine_threads_first(monkeypatch):
    """``accelerator.end_training()`` destroys the process group; the engine's threads stop and
    its collectives settle before, and the model still trains afterwards."""
    import threading

    import torch
    from accelerate import Accelerator

    from stronghold_hf import StrongholdConfig, prepare_stronghold
    from tiny_models import batch, tiny_model

    calls, others = [], set(threading.enumerate())
    monkeypatch.setattr(Accelerator, "end_training", lambda self: calls.append(
        sorted(t.name for t in set(threading.enumerate()) - others if t.name.startswith("stronghold"))))
    acc = Accelerator(cpu=True)
    model, opt, engine = prepare_stronghold(acc, tiny_model("gpt2"), dict(lr=1e-2),
                                            config=StrongholdConfig(window_size=1, host_worker="thread"))
    for step in range(2):
        acc.backward(model(**batch("gpt2", seed=step)).loss)
        opt.step()
        opt.zero_grad()
    assert engine.worker.running
    acc.end_training()
    assert calls == [[]]  # the original ran with no engine thread left
    acc.backward(model(**batch("gpt2", seed=5)).loss)  # the worker restarts on demand
    opt.step()
    assert torch.isfinite(next(iter(engine.full_state_dict().values()))).all()
    engine.close()
