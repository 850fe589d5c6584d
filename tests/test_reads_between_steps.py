"""No silent wrong reads: a parameter read between steps, in any loop, sees the finished update.

``optimizer.step()`` returns while the CPU updates still run on the host worker (the overlap
with the next forward). A read in between (an EMA, ``torch.save(model.state_dict())``, code
walking ``named_parameters()``) waits for its own unit's update (read_guard.py). The tests run
under `simulated_device`, whose host worker delays every task, so a read that did not wait
would see old values. With sharded data-parallel state a plain read is refused with the fix,
and ``engine.gathered_parameters()`` gives whole values on every rank.
"""

from __future__ import annotations

import copy
import io
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.read_guard import GuardedParameter, is_guarded
from stronghold_hf.testing import simulated_device
from tiny_models import batch, tiny_model

LR = 1e-2


def _last_block_reads(model, engine):
    return [p.detach().clone() for p in engine.blocks[-1].params]


@pytest.mark.parametrize("param_dtype, speculative, accum", [
    (None, "off", 1), (None, "on", 1), ("bf16", "off", 1), ("bf16", "on", 2), (None, "off", 2)])
def test_reads_right_after_step_equal_the_synchronized_values(param_dtype, speculative, accum):
    with simulated_device(0.003):
        model = tiny_model("llama", num_hidden_layers=8)
        engine = offload_model(model, StrongholdConfig(window_size=2, param_dtype=param_dtype,
                                                       speculative_step=speculative), device="cpu")
        assert not engine.worker.inline  # the worker overlaps: reads can land early
        opt = engine.build_optimizer(lr=LR)
        mismatches = reads = guarded = 0
        for step in range(4):
            for micro in range(accum):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype is not None):
                    loss = model(**batch("llama", seed=10 * step + micro)).loss / accum
                loss.backward()
            engine.clip_grad_norm_(1.0)
            opt.step()
            guarded += sum(is_guarded(p) for p in engine.blocks[-1].params)
            early = _last_block_reads(model, engine)  # right after step(): the update may still run
            engine.synchronize()
            settled = _last_block_reads(model, engine)
            mismatches += sum(not torch.equal(a, b) for a, b in zip(early, settled))
            reads += len(early)
            opt.zero_grad()
        assert guarded > 0, "the last block's update was still running when step() returned"
        assert mismatches == 0 and reads == 4 * len(engine.blocks[-1].params)
        engine.close()


def test_torch_save_of_the_state_dict_right_after_step():
    with simulated_device(0.003):
        model = tiny_model("gpt2", n_layer=6, vocab_size=1024)
        engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
        opt = engine.build_optimizer(lr=LR)
        for step in range(2):
            model(**batch("gpt2", seed=step)).loss.backward()
            opt.step()
            opt.zero_grad()
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        engine.synchronize()
        settled = {k: v.clone() for k, v in model.state_dict().items()}
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        assert saved.keys() == settled.keys()
        for k, v in settled.items():
            assert torch.equal(saved[k], v), k
        engine.close()


def test_an_ema_in_an_accelerate_loop_equals_the_same_ema_in_a_plain_loop():
    from accelerate import Accelerator

    from stronghold_hf import prepare_stronghold

    ref = tiny_model("llama", num_hidden_layers=4)
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    ema_ref = {n: p.detach().clone() for n, p in ref.named_parameters()}
    with simulated_device(0.003):
        accelerator = Accelerator(cpu=True)
        model, opt, engine = prepare_stronghold(accelerator, model, dict(lr=LR, weight_decay=0.01))
        assert not engine.worker.inline
        ema = {n: p.detach().clone() for n, p in model.named_parameters()}
        for step in range(3):
            b = batch("llama", seed=step)
            loss_ref = ref(**b).loss
            loss_ref.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt_ref.step()
            opt_ref.zero_grad()
            accelerator.backward(model(**b).loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # right after step(), no synchronize: what a user's loop does
                for n, p in model.named_parameters():
                    ema[n].mul_(0.9).add_(p, alpha=0.1)
                for n, p in ref.named_parameters():
                    ema_ref[n].mul_(0.9).add_(p, alpha=0.1)
        for n, v in ema_ref.items():
            torch.testing.assert_close(ema[n], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        engine.close()


def test_metadata_reads_do_not_wait_and_zero_grad_keeps_the_overlap():
    with simulated_device(0.02):
        model = tiny_model("gpt2", n_layer=4)
        engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
        opt = engine.build_optimizer(lr=LR)
        model(**batch("gpt2", seed=0)).loss.backward()
        opt.step()
        last = engine.blocks[-1]
        assert engine.coordinator.update_pending(last) and all(isinstance(p, GuardedParameter) for p in last.params)
        model.zero_grad()  # the Trainer does this right after step(): .grad only, no value read
        assert [tuple(p.shape) for p in last.params] and all(p.requires_grad for p in last.params)
        assert engine.coordinator.update_pending(last), "metadata made the read barrier wait"
        value = last.params[0].detach()  # a value read: waits for the update, then reads freely
        assert not engine.coordinator.update_pending(last) and not is_guarded(last.params[0])
        assert torch.equal(value, last.params[0].detach())
        engine.close()


def test_gradients_stay_on_show_after_the_step_and_a_write_into_them_during_its_update_is_refused():
    """As torch's ``.grad`` after ``optimizer.step()`` (read by ``on_optimizer_step`` callbacks
    and PEFT's AdaLoRA), the offloaded parameters keep their gradients until ``zero_grad``. The
    step's updates still read them on the host worker: a write into them before an update has
    read them is refused by name, never applied half-read."""
    model = tiny_model("gpt2", n_layer=4)
    ref = copy.deepcopy(model)
    engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="thread", speculative_step="off"),
                           device="cpu")
    assert not engine.worker.inline
    opt = engine.build_optimizer(lr=LR)
    ref(**batch("gpt2", seed=0)).loss.backward()
    model(**batch("gpt2", seed=0)).loss.backward()
    gate, held = threading.Event(), threading.Event()
    engine.worker.submit("a task ahead of the step's updates", lambda: (held.set(), gate.wait()))
    assert held.wait(10)
    opt.step()  # block 0 is updated on this thread; the others wait behind the held task
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name
    last = engine.blocks[-1]
    assert engine.coordinator.update_pending(last)
    last.params[0].grad.zero_()  # model.zero_grad(set_to_none=False) would do this
    gate.set()
    with pytest.raises(RuntimeError, match=r"gradients of .*h\.3 were written in place .* optimizer\.zero_grad\(\)"):
        engine.synchronize()
    engine.close()

    # Reading them, then zeroing them as the Trainer does, is the usual path: no error, and the
    # next backward starts from None.
    model = tiny_model("gpt2", n_layer=4)
    engine = offload_model(model, StrongholdConfig(window_size=1, host_worker="thread"), device="cpu")
    opt = engine.build_optimizer(lr=LR)
    for step in range(2):
        model(**batch("gpt2", seed=step)).loss.backward()
        opt.step()
        assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in engine.blocks[-1].params)
        model.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    engine.synchronize()
    engine.close()


def test_a_cpu_device_never_guards():
    model = tiny_model("gpt2")
    engine = offload_model(model, StrongholdConfig(window_size=1), device="cpu")
    opt = engine.build_optimizer(lr=LR)
    model(**batch("gpt2", seed=0)).loss.backward()
    opt.step()
    assert engine.worker.inline and not any(is_guarded(p) for p in model.parameters())
    engine.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_sharded_reads_are_refused_and_gathered_parameters_gives_whole_values(tmp_path, world):
    script = os.path.join(os.path.dirname(__file__), "scripts", "dp_reads.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={_port()}",
           script, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r in runs:
        # Never a NaN: the read is refused, and the message names both ways to read whole values.
        assert r["plain_read"] != "returned", r.get("plain_read_nan")
        assert "full_state_dict()" in r["plain_read"] and "gathered_parameters" in r["plain_read"]
        for name, value in r["gathered"].items():
            assert not torch.isnan(value).any(), name
            torch.testing.assert_close(value, r["full_state_dict"][name], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(value, runs[0]["gathered"][name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(r["after_modify"], r["expected_after_modify"], rtol=0, atol=0)
        assert r["trained_after"]
