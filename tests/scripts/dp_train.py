"""Trains a tiny GPT-2 with StrongholdTrainer; run under torchrun (gloo) or alone.

Writes the logged losses and the final parameters to ``$OUT_DIR/rank{rank}.pt``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import conftest  # noqa: E402,F401  - offline settings
from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments  # noqa: E402
from test_trainer import TinyDataset  # noqa: E402
from tiny_models import tiny_model  # noqa: E402


def main() -> None:
    out_dir, per_device = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    args = StrongholdTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-2, weight_decay=0.1, warmup_steps=1, max_grad_norm=1.0, logging_steps=1, report_to=[],
        seed=0, save_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        ddp_backend="gloo" if "RANK" in os.environ else None, stronghold=True, stronghold_window_size="1",
    )
    model = tiny_model("gpt2", seed=rank)  # ranks start different: the engine must broadcast rank 0
    trainer = StrongholdTrainer(model=model, args=args, train_dataset=TinyDataset("gpt2", n=32, padded=False))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    torch.save({"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}},
               os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
