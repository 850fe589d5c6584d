"""A TRL ``GRPOTrainer`` script that has never heard of stronghold_hf (RL with generation).

Each step samples completions with ``model.generate`` (under no_grad, through the window),
scores them with a local reward function and trains on them. ``training_step`` receives raw
dataset rows here, not a tokenised batch. ``tests/test_launcher.py`` runs it as is and under
``python -m stronghold_hf``.
"""

import os

from datasets import Dataset
from run_record import save_run
from sft_script import build
from transformers import HfArgumentParser
from trl import GRPOConfig, GRPOTrainer


def reward_token_ids(completions, completion_ids, **kwargs):
    """The mean token id of each completion, scaled: it differs from sample to sample whatever
    the tokenizer makes of the ids, so every group has an advantage to learn from."""
    return [sum(ids) / (1000.0 * max(len(ids), 1)) for ids in completion_ids]


def main() -> None:
    (args,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses()
    model, tokenizer, _ = build()
    prompts = Dataset.from_dict({"prompt": ["the cat", "a dog", "the sun", "we train"] * 2})
    trainer = GRPOTrainer(model=model, reward_funcs=reward_token_ids, args=args, train_dataset=prompts,
                          processing_class=tokenizer)
    trainer.train()
    save_run(trainer, model, os.path.join(args.output_dir, "result.pt"))


if __name__ == "__main__":
    main()
