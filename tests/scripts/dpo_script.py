"""A TRL ``DPOTrainer`` script that has never heard of stronghold_hf (preference tuning).

The reference model is an explicit copy: the model is built from a config, so TRL cannot
reload it by name. ``tests/test_launcher.py`` runs it as is and under ``python -m stronghold_hf``.
"""

import copy
import os

from datasets import Dataset
from run_record import save_run
from sft_script import build
from transformers import HfArgumentParser
from trl import DPOConfig, DPOTrainer

PROMPTS = ["the cat", "a dog", "the sun", "we train"]
CHOSEN = [" sat on the mat", " ran in the park", " is warm today", " a small model"]
REJECTED = [" the the the", " park park", " warm warm", " model model"]


def main() -> None:
    (args,) = HfArgumentParser(DPOConfig).parse_args_into_dataclasses()
    model, tokenizer, _ = build()
    pairs = Dataset.from_dict({"prompt": PROMPTS * 4, "chosen": CHOSEN * 4, "rejected": REJECTED * 4})
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=pairs,
                         processing_class=tokenizer)
    trainer.train()
    save_run(trainer, model, os.path.join(args.output_dir, "result.pt"))


if __name__ == "__main__":
    main()
