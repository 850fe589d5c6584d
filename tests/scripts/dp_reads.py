"""Reads of sharded parameters between steps, under torchrun (gloo) or alone; writes what it saw.

    dp_reads.py OUT_DIR

Trains a tiny GPT-2 two steps with STRONGHOLD and sharded CPU state (also in a group of one),
then: a plain read of an offloaded parameter (must raise, naming the fix, never return NaN);
``engine.gathered_parameters()`` (whole values, equal to ``full_state_dict``); and a write
inside ``gathered_parameters(modifier_rank=0)`` that every rank must see afterwards. Writes
``OUT_DIR/rank{rank}.pt``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import conftest  # noqa: E402,F401  - offline settings
from stronghold_hf import StrongholdConfig, offload_model  # noqa: E402
from tiny_models import batch, tiny_model  # noqa: E402


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_model("gpt2", vocab_size=1024)
    engine = offload_model(model, StrongholdConfig(window_size=1, shard_cpu_state=True), device="cpu")
    opt = engine.build_optimizer(lr=1e-2)
    for step in range(2):
        model(**batch("gpt2", seed=10 * step + rank)).loss.backward()
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    weight = model.transformer.h[1].mlp.c_fc.weight
    result = {"rank": rank}
    try:
        value = weight.detach().clone()
        result["plain_read"] = "returned"
        result["plain_read_nan"] = bool(torch.isnan(value).any())
    except RuntimeError as err:
        result["plain_read"] = str(err)
    full = engine.full_state_dict()
    with engine.gathered_parameters():
        result["gathered"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    result["full_state_dict"] = {k: v.clone() for k, v in full.items()}
    before = full["transformer.h.1.mlp.c_fc.weight"].clone()
    with engine.gathered_parameters([weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.mul_(2.0)
    result["after_modify"] = engine.full_state_dict()["transformer.h.1.mlp.c_fc.weight"].clone()
    result["expected_after_modify"] = before * 2.0
    # Training goes on from the written value.
    model(**batch("gpt2", seed=99)).loss.backward()
    opt.step()
    result["trained_after"] = bool(all(torch.isfinite(v).all() for v in engine.full_state_dict().values()))
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    engine.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see dp_train.py: gloo's destructor can deadlock at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
