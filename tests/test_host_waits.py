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

import pytest

from stronghold_hf import StrongholdConfig, offload_model
from stronghold_hf.testing import simulated_device
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
