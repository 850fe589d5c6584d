"""Data parallel through ``torchrun`` with gloo processes on CPU, against plain DDP.

The same tiny GPT-2, data and global batch, trained by the plain HF Trainer (DDP) and by
StrongholdTrainer with sharded CPU state (each rank keeps 1/world of the masters, gradients
and Adam state) and with full replicas: equal losses, grad norms and final weights; an exact
resume; a resume with another world size, its optimizer state re-cut; host bytes per rank
falling as 1/world. The runs of one world size share one launch (`runs`).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "dp_train.py")
ADAM_SLACK = 0.02 * 1e-2 * 6  # Adam turns rounding noise of ~0 gradients into lr-sized steps (test_step.py)

pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, runs: list[tuple]) -> list[list[dict]]:
    """One launch of ``world`` processes (torchrun, or one plain process) that trains ``runs``
    (``(out_dir, per_device, mode, *extra)``) one after another (dp_train.py's ``--then``);
    each run's records, by rank."""
    cmd = []
    for out, *args in runs:
        cmd += ["--then"] * bool(cmd) + [str(out), *map(str, args)]
    cmd = [sys.executable, SCRIPT, *cmd]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               f"--master_port={_port()}", *cmd[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [[torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)] for out, *_ in runs]


LLAMA, LEAN = ("--family", "llama"), ("--family", "llama", "--lean")
#: Every run the module's tests read, by name: (world, per-device batch, mode, *extra). The
#: global batch is 6 (x2 accumulation) for every world size. A ``{name}`` in an argument is that
#: run's output directory, so a run may resume from an earlier one's checkpoint.
RUNS = {
    2: {
        "plain2": (3, "plain"),
        "sharded2": (3, "sharded"),
        "replicated2": (3, "replicated"),
        "split2": (3, "sharded", "--resident", "2"),
        "saved2": (3, "sharded", "--max_steps", "6", "--save_steps", "3"),
        "resumed2": (3, "sharded", "--max_steps", "6", "--resume", "{saved2}/checkpoint-3"),
        "resumed_split2": (3, "sharded", "--max_steps", "6", "--resume", "{saved2}/checkpoint-3", "--resident", "2"),
        "llama2": (3, "sharded", "--max_steps", "3", "--save_steps", "3", *LLAMA),
        "lean2": (3, "sharded", "--max_steps", "3", "--save_steps", "3", *LEAN),
    },
    3: {
        "plain3": (2, "plain"),
        "sharded3": (2, "sharded"),
        # Three ranks go on for two steps from the two ranks' state, re-cut.
        "llama_as3": (2, "sharded", "--max_steps", "5", "--resume", "{llama2}/checkpoint-3", *LLAMA),
        "lean_as3": (2, "sharded", "--max_steps", "4", "--resume", "{lean2}/checkpoint-3", *LEAN),
    },
    1: {
        "sharded1": (6, "sharded"),
        "llama_as1": (2, "sharded", "--max_steps", "4", "--resume", "{llama2}/checkpoint-3", *LLAMA),
        # A checkpoint from before the files said what they cover (the fixture writes it).
        "older1": (2, "sharded", "--max_steps", "4", "--resume", "{older}", *LLAMA, "--expect_error"),
    },
}


def _strip_layout(checkpoint: Path, older: Path) -> None:
    """A copy of ``checkpoint`` as written before the optimizer files named the pieces they cover."""
    import shutil

    shutil.copytree(checkpoint, older)
    for name in os.listdir(older):
        if name.startswith("optimizer-rank"):
            state = torch.load(older / name, weights_only=True)
            del state["cpu_pieces"]
            torch.save(state, older / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """Every run of `RUNS`, by name: its output directory and its ranks' records. One launch per
    world size (a launch costs each process seconds of imports; a run, a fraction of one), in
    the order 2, 3, 1: later launches resume from the two ranks' checkpoints. The module's tests
    share one xdist worker (tests/conftest.py), so this runs once."""
    root = tmp_path_factory.mktemp("dp")
    dirs = {name: root / name for by_name in RUNS.values() for name in by_name}
    dirs["older"] = root / "older"
    done = {}
    for world, by_name in RUNS.items():
        if world == 1:
            _strip_layout(dirs["llama2"] / "checkpoint-3", dirs["older"])
        specs = [(dirs[name], *(str(a).format(**{k: str(v) for k, v in dirs.items()}) for a in spec))
                 for name, spec in by_name.items()]
        for name, records in zip(by_name, _launch(world, specs)):
            done[name] = (dirs[name], records)
    return done


def _assert_same_training(runs, ref, steps_slice=slice(None)):
    for r in runs:
        assert r["losses"][steps_slice] == pytest.approx(ref["losses"][steps_slice], rel=1e-4)
        assert r["grad_norms"][steps_slice] == pytest.approx(ref["grad_norms"][steps_slice], rel=1e-4)
    for k, v in ref["state"].items():
        for r in runs:
            assert torch.equal(r["state"][k], runs[0]["state"][k]), f"ranks disagree at {k}"
        torch.testing.assert_close(runs[0]["state"][k], v, rtol=1e-4, atol=ADAM_SLACK, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_state_matches_ddp(runs, world):
    _assert_same_training(runs[f"sharded{world}"][1], runs[f"plain{world}"][1][0])


def test_replicated_state_matches_ddp(runs):
    _assert_same_training(runs["replicated2"][1], runs["plain2"][1][0])


def test_a_device_host_split_matches_ddp(runs):
    """Two blocks resident (stepped by the device AdamW on every rank, their gradients averaged at
    the end of each backward), the rest streamed with sharded CPU state: the same training as DDP,
    and only the streamed part's state is sharded on the host."""
    split = runs["split2"][1]
    _assert_same_training(split, runs["plain2"][1][0])
    for r in split:
        assert r["memory"]["split_resident_blocks"] == 2
        resident = r["memory"]["split_resident_params"]
        assert r["memory"]["offloaded_trainable_params"] == r["memory"]["model_trainable_params"] - resident
    names = {name for name, _, _, _ in split[0]["adam"]["pieces"]}
    assert not any(n.startswith(("transformer.h.0", "transformer.h.1")) for n in names)  # not in CPU Adam


def test_resume_under_another_split_with_sharded_state(runs):
    """Written with everything streamed by two sharded ranks; resumed with two blocks resident:
    their Adam state, sharded across both ranks' files, is put together on each rank's device."""
    # The same losses; weights within Adam's slack: the global norm now sums the resident
    # blocks' squares in another order (test_device_split.py checks the state moves bit for bit).
    _assert_same_training(runs["resumed_split2"][1], runs["saved2"][1][0])


def test_host_bytes_per_rank_fall_as_one_over_world(runs):
    host = {}
    for world in (1, 2, 3):
        per_rank = [r["memory"]["pinned_host_bytes"] + r["memory"]["pageable_host_bytes"] - r["staging_bytes"]
                    for r in runs[f"sharded{world}"][1]]
        host[world] = max(per_rank)
    for world in (2, 3):
        # 1/world of the masters, gradients and Adam state, plus a little padding per shard.
        assert host[world] <= host[1] / world * 1.10, host


def test_exact_resume_with_the_same_world_size(runs):
    out, full = runs["saved2"]
    files = sorted(os.listdir(out / "checkpoint-3"))
    assert "optimizer-rank0-of-2.pt" in files and "optimizer-rank1-of-2.pt" in files
    assert "rng_state_0.pth" in files and "rng_state_1.pth" in files  # every rank's RNG, not only rank 0's
    resumed = runs["resumed2"][1]
    assert resumed[0]["losses"] == pytest.approx(full[0]["losses"], rel=1e-5)  # history restored, then steps 4-6
    for k, v in full[0]["state"].items():
        torch.testing.assert_close(resumed[0]["state"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _full_adam_state(runs, when="adam") -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """Every parameter's whole Adam state, put together from the ranks' pieces (fp32 moments,
    or 8-bit codes and their blocks' absmax)."""
    full: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for run in runs:
        for i, (block, name, offset, count) in enumerate(run[when]["pieces"]):
            st = run[when]["state"][i]
            entry = full.setdefault((block, name), {"step": st["step"], **{k: {} for k in st if k != "step"}})
            assert float(entry["step"]) == float(st["step"]) and entry.keys() == st.keys()
            for key in st:
                if key != "step":
                    entry[key][offset] = st[key].reshape(-1)
    for entry in full.values():
        for key in entry:
            if key != "step":
                entry[key] = torch.cat([entry[key][o] for o in sorted(entry[key])])
    return full


def test_resume_with_another_world_size_recuts_the_optimizer_state(runs):
    """Written by 2 ranks with sharded CPU state; resumed by 3 sharded ranks and by one process:
    each holds exactly the Adam state the writers held for its elements, and training goes on
    (a resume by 2 ranks again is test_exact_resume_with_the_same_world_size's). Llama with weight decay: its norms end each block, so one rank's shards hold only
    decayed weights and another's both kinds (the optimizer's groups must not depend on that)."""
    reference = _full_adam_state(runs["llama2"][1])
    assert len(reference) > 0 and all(float(e["step"]) == 3 for e in reference.values())
    for name in ("llama_as3", "llama_as1"):
        full = _full_adam_state(runs[name][1], when="adam_at_start")  # as the resumed loop starts
        assert full.keys() == reference.keys()
        for key, entry in reference.items():
            for part in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(full[key][part], entry[part]), (name, key, part)
    # Lean: 8-bit moments per shard re-cut bit for bit too (codes by element, absmax by block);
    # 3 ranks cut every parameter elsewhere.
    reference = _full_adam_state(runs["lean2"][1])
    assert sum("exp_avg_q" in e for e in reference.values()) >= 9  # each block's MLP weights
    full = _full_adam_state(runs["lean_as3"][1], when="adam_at_start")
    assert full.keys() == reference.keys()
    for key, entry in reference.items():
        for part in entry:
            if part != "step":
                assert torch.equal(full[key][part], entry[part]), (key, part)
    # A checkpoint from before the files said what they cover: refused under another layout, with the fix.
    assert "resume it with the layout that wrote it" in runs["older1"][1][0]["error"]
    went_on = runs["llama_as3"][1]
    assert len(went_on[0]["losses"]) == 5 and all(math.isfinite(x) for x in went_on[0]["losses"])
    assert all(float(e["step"]) == 5 for e in _full_adam_state(went_on).values())


@pytest.mark.parametrize("pieces", [False, True], ids=["", "vocab_pieces"])
@pytest.mark.parametrize("shard", [True, False])
def test_a_process_group_of_one_takes_the_data_parallel_path_exactly(shard, pieces):
    """In-process gloo group of one: every collective of the sharded (or replicated) path runs,
    and training equals plain training. (tests/test_gpu.py does the same under NCCL.) With
    ``vocab_pieces`` (T5's shared embedding of 1024 rows): read in pieces when replicated over one
    rank, streamed whole when sharded."""
    import copy

    import torch.distributed as dist

    from stronghold_hf import StrongholdConfig, offload_model
    from tiny_models import batch, tiny_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        ref = tiny_model("t5", **(dict(vocab_size=1024) if pieces else {}))
        model = copy.deepcopy(ref)
        engine = offload_model(model, StrongholdConfig(window_size=1, shard_cpu_state=shard, vocab_pieces=pieces),
                               device="cpu")
        assert engine.dp is not None and engine.dp.sharded is shard and engine.blocks[0].sharded is shard
        assert [u.fqn for u in engine.units if u.vocab_pieces is not None] == (["shared"] if pieces and not shard else [])
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        opt = engine.build_optimizer(lr=1e-2, weight_decay=0.1)
        for step in range(3):
            b = batch("t5", seed=step)
            loss_ref, loss = ref(**b).loss, model(**b).loss
            assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-5)
            loss_ref.backward()
            loss.backward()
            n_ref, n = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0), engine.clip_grad_norm_(1.0)
            assert float(n) == pytest.approx(float(n_ref), rel=1e-5)
            opt_ref.step()
            opt.step()
            opt_ref.zero_grad()
            opt.zero_grad()
            # Nothing left to step with: the norm of the last flush must not be counted again.
            assert float(engine.global_grad_norm()) == 0.0
        state = engine.full_state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=ADAM_SLACK, msg=lambda m: f"{k}: {m}")
        engine.close()
    finally:
        dist.destroy_process_group()


def test_sync_ref_model_with_sharded_state_is_refused_before_training(monkeypatch, tmp_path):
    """TRL's sync_ref_model reads the trained weights between steps; a rank holds only a shard."""
    trl = pytest.importorskip("trl")
    import torch.distributed as dist

    import copy

    from stronghold_hf import StrongholdTrainer

    class MyDPOTrainer(StrongholdTrainer, trl.DPOTrainer):
        pass

    monkeypatch.setenv("STRONGHOLD", "1")
    monkeypatch.setenv("STRONGHOLD_CONFIG", '{"shard_cpu_state": true, "window_size": 1}')
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        sys.path.insert(0, str(Path(__file__).parent / "scripts"))
        from dpo_script import CHOSEN, PROMPTS, REJECTED
        from sft_script import build

        model, tokenizer, _ = build()
        from datasets import Dataset

        pairs = Dataset.from_dict({"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED})
        args = trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], sync_ref_model=True, bf16=False)
        with pytest.raises(ValueError, match="sync_ref_model=True .*shard_cpu_state"):
            MyDPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=pairs,
                         processing_class=tokenizer)
    finally:
        sys.path.remove(str(Path(__file__).parent / "scripts"))
        dist.destroy_process_group()


def test_remap_cpu_state_recuts_pieces_and_names_a_gap():
    from stronghold_hf.optim.hybrid import remap_cpu_state

    full = torch.arange(10.0)

    def state(lo, hi):
        return {"step": torch.tensor(3.0), "exp_avg": full[lo:hi].clone(), "exp_avg_sq": 2 * full[lo:hi]}

    saved = [([("b0", "w", 0, 4)], {0: state(0, 4)}), ([("b0", "w", 4, 6)], {0: state(4, 10)})]
    # One rank now keeps elements 2..8 as a flat piece; another keeps the whole parameter as [2, 5].
    out = remap_cpu_state([("b0", "w", 2, 7)], [torch.Size([7])], iter(saved))
    assert torch.equal(out[0]["exp_avg"], full[2:9]) and torch.equal(out[0]["exp_avg_sq"], 2 * full[2:9])
    whole = remap_cpu_state([("b0", "w", 0, 10)], [torch.Size([2, 5])], iter(saved))
    assert torch.equal(whole[0]["exp_avg"], full.view(2, 5)) and float(whole[0]["step"]) == 3.0
    with pytest.raises(ValueError, match=r"does not cover 1 parameter piece\(s\) this rank keeps \(b0.w"):
        remap_cpu_state([("b0", "w", 0, 10)], [torch.Size([10])], iter(saved[:1]))  # elements 4..9 absent
    with pytest.raises(ValueError, match="covers 4 of the 10 elements of b0.w"):  # present, half never stepped
        remap_cpu_state([("b0", "w", 0, 10)], [torch.Size([10])], iter([saved[0], ([("b0", "w", 4, 6)], {})]))
    # A writer that never stepped a parameter: no state to bring, and no error.
    assert remap_cpu_state([("b0", "w", 0, 10)], [torch.Size([10])], iter([([("b0", "w", 0, 10)], {})])) == {}


@pytest.mark.parametrize("resident", [False, 2])
@pytest.mark.parametrize("reentrant", [False, True])
def test_resident_gradients_are_averaged_once_per_backward(monkeypatch, reentrant, resident):
    """In-process gloo group of one, checkpointed layers: one average of the device-resident
    gradients per backward (reentrant checkpointing runs a backward per layer inside the outer
    one), covering an adapter attached after offload_model, also when it is the only one."""
    import torch.distributed as dist

    from stronghold_hf import StrongholdConfig, offload_model
    from stronghold_hf.distributed import DataParallel
    from tiny_models import batch, tiny_model

    averaged = []
    original = DataParallel.average_resident_grads_
    monkeypatch.setattr(DataParallel, "average_resident_grads_",
                        lambda self, params: (averaged.append([id(p) for p in params]), original(self, params))[1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        model = tiny_model("gpt2", n_layer=4)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        engine = offload_model(model, StrongholdConfig(window_size=1, resident=resident), device="cpu")
        adapter = torch.nn.Parameter(torch.zeros(model.config.n_embd))
        model.transformer.ln_f.register_parameter("adapter", adapter)
        model.transformer.ln_f.register_forward_hook(lambda m, a, out: out + m.adapter)
        for step in range(2):
            model(**batch("gpt2", seed=step)).loss.backward()
        assert len(averaged) == 2
        assert id(adapter) in averaged[-1] and adapter.grad is not None and adapter.grad.abs().sum() > 0
        kept = {id(p) for p in engine.resident_parameters() if p.requires_grad}
        assert set(averaged[-1]) == kept and len(kept) == (1 if resident is False else 1 + 2 * 12)
        engine.close()
    finally:
        dist.destroy_process_group()


def _gather_and_modify(rank, port, out):
    import torch.distributed as dist

    from stronghold_hf import StrongholdConfig, offload_model
    from tiny_models import tiny_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = tiny_model("gpt2")
        engine = offload_model(model, StrongholdConfig(window_size=1, gpu_memory="1GB"), device="cpu")
        head = model.lm_head.weight
        assert not engine.is_offloaded(head)  # the split keeps it on the device
        with engine.gathered_parameters([head], modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    head.mul_(0.5)
        torch.save(head.detach().clone(), os.path.join(out, f"head{rank}.pt"))
        engine.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.xdist_group("distributed_own_launches")  # not the module's runs: may run beside them
def test_gathered_parameters_broadcasts_resident_parameters_from_the_modifier(tmp_path):
    """``gathered_parameters(modifier_rank=0)`` on a parameter the split keeps on the device: rank
    0's change reaches rank 1, as it does for offloaded parameters."""
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(__file__))
    mp.start_processes(_gather_and_modify, args=(_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    heads = [torch.load(tmp_path / f"head{r}.pt") for r in range(2)]
    assert torch.equal(heads[0], heads[1])
