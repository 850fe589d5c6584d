"""Trains a tiny GPT-2 with the HF Trainer under torchrun (gloo) or alone; writes what it saw.

    dp_train.py OUT_DIR PER_DEVICE_BATCH MODE [--max_steps N] [--save_steps N] [--resume DIR] [--family F] [--lean]
                [--resident N] [--expect_error] [--then OUT_DIR PER_DEVICE_BATCH MODE ...]...

``--then`` starts another run in the same processes, after the one before it has finished (it
may resume from that one's checkpoint): a launch costs each process seconds of imports, a tiny
run a fraction of one. Every run builds its own model, arguments and Trainer; the process group
is the first run's.

MODE: ``plain`` (Trainer, DDP when launched with several processes), ``sharded`` (STRONGHOLD,
sharded CPU state) or ``replicated`` (STRONGHOLD, full CPU replicas). Writes
``OUT_DIR/rank{rank}.pt``: logged losses and grad norms, the final weights (whole, gathered),
and the engine's host bytes; with ``--expect_error`` (one process only), the error the run
raised instead (``{"error": message}``), and none is a failure.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import conftest  # noqa: E402,F401  - offline settings
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments  # noqa: E402
from test_trainer import TinyDataset  # noqa: E402
from tiny_models import tiny_model  # noqa: E402


def _adam_state(trainer) -> dict:
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # under accelerate's wrapper
    return {"pieces": optimizer.cpu_pieces(),
            "state": {i: {k: v.clone() for k, v in st.items()}
                      for i, st in optimizer.cpu_optimizer.state_dict()["state"].items()}}


class _AdamAtStart(TrainerCallback):
    """Keeps the optimizer state as the training loop starts (after a resume has loaded it)."""

    def __init__(self, trainer, out: dict):
        self.trainer, self.out = trainer, out

    def on_train_begin(self, args, state, control, **kwargs):
        if getattr(self.trainer, "stronghold_engine", None) is not None:
            self.out["adam"] = _adam_state(self.trainer)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("per_device", type=int)
    ap.add_argument("mode", choices=["plain", "sharded", "replicated"])
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--save_steps", type=int, default=0)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--family", default="gpt2", help="llama: norms end each block, so ranks' shards mix decay groups")
    ap.add_argument("--lean", action="store_true", help="host_memory='lean', and MLPs wide enough for 8-bit moments")
    ap.add_argument("--resident", type=int, default=None, help="StrongholdConfig(resident=N): N blocks on the device")
    ap.add_argument("--expect_error", action="store_true", help="the run must raise; its message is the record")
    return ap


def train(opts, keep: list) -> None:
    """One run; ``keep`` holds its Trainer until the process ends (a DDP Reducer freed while its
    process group lives can deadlock in gloo's destructor, as at interpreter teardown below)."""
    os.makedirs(opts.out_dir, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    common = dict(
        output_dir=opts.out_dir, per_device_train_batch_size=opts.per_device, gradient_accumulation_steps=2,
        max_steps=opts.max_steps, learning_rate=1e-2, weight_decay=0.1, warmup_steps=1, max_grad_norm=1.0,
        logging_steps=1, report_to=[], seed=0, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        save_strategy="steps" if opts.save_steps else "no", save_steps=opts.save_steps or 500,
        ddp_backend="gloo" if "RANK" in os.environ else None,
    )
    model = tiny_model(opts.family, seed=rank, **(dict(intermediate_size=128) if opts.lean else {}))  # ranks start different: rank 0's weights must win
    data = TinyDataset(opts.family, n=48, padded=False)
    if opts.mode == "plain":
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=data)
    else:
        args = StrongholdTrainingArguments(
            **common, stronghold=True, stronghold_window_size="1",
            stronghold_config={"shard_cpu_state": opts.mode == "sharded",
                               "host_memory": "lean" if opts.lean else "exact",
                               **({"resident": opts.resident} if opts.resident is not None else {})},
        )
        trainer = StrongholdTrainer(model=model, args=args, train_dataset=data)
    keep.append(trainer)
    at_start = {}
    trainer.add_callback(_AdamAtStart(trainer, at_start))
    if opts.expect_error:
        try:
            trainer.train(resume_from_checkpoint=opts.resume)
        except Exception as e:  # noqa: BLE001 - the record says what was raised
            torch.save({"error": f"{type(e).__name__}: {e}"}, os.path.join(opts.out_dir, f"rank{rank}.pt"))
            return
        raise SystemExit(f"{opts.out_dir}: the run was expected to raise, and finished")
    trainer.train(resume_from_checkpoint=opts.resume)
    engine = getattr(trainer, "stronghold_engine", None)
    state = engine.full_state_dict() if engine is not None else model.state_dict()  # every rank gathers
    record = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "state": {k: v.detach().clone() for k, v in state.items()},
        "memory": engine.memory_stats() if engine is not None else None,
        "staging_bytes": engine.grad_queue.staging_bytes * engine.config.grad_buffers if engine is not None else 0,
        # This rank's CPU Adam state and what each entry covers (block, parameter, offset, count),
        # at the end and right after a resume loaded it.
        "adam": _adam_state(trainer) if engine is not None else None,
        "adam_at_start": at_start.get("adam"),
    }
    torch.save(record, os.path.join(opts.out_dir, f"rank{rank}.pt"))


def main() -> None:
    argv, runs = sys.argv[1:], [[]]
    for a in argv:
        if a == "--then":
            runs.append([])
        else:
            runs[-1].append(a)
    keep: list = []
    for run in runs:
        train(_parser().parse_args(run), keep)
    # Skip interpreter teardown: freeing a DDP Reducer there can deadlock in torch's gloo
    # ProcessGroup destructor (it joins a thread that waits for the GIL); the record is saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
