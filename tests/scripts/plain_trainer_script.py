"""An official-style training script that has never heard of stronghold_hf.

`HfArgumentParser(TrainingArguments)` and a plain `transformers.Trainer` on a tiny GPT-2 built
from a config, with an in-memory dataset. ``tests/test_launcher.py`` runs it as is and under
``python -m stronghold_hf`` (also under torchrun and accelerate launch), and compares the
``result*.pt`` it writes into ``--output_dir`` (see run_record.py).
"""

import os

import torch
from run_record import save_run
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", vocab_size=96, n_embd=32, n_layer=3, n_head=2, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(3, 96, (16, 12), generator=torch.Generator().manual_seed(1))
    train_dataset = [{"input_ids": row, "labels": row} for row in ids]
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
    trainer.train()
    save_run(trainer, model, os.path.join(args.output_dir, f"result{os.environ.get('RANK', '')}.pt"))


if __name__ == "__main__":
    main()
