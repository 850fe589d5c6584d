"""An official-style training script that has never heard of stronghold_hf.

`HfArgumentParser(TrainingArguments)` and a plain `transformers.Trainer` on a tiny GPT-2 built
from a config, with an in-memory dataset. ``tests/test_launcher.py`` runs it as is and under
``python -m stronghold_hf``. It writes ``result.pt`` into ``--output_dir``: the log history, the losses
and gradient norms, the final weights, the Trainer's class, and whether the model carries a
STRONGHOLD engine (the attribute `stronghold_hf.get_engine` reads), which is how the test
tells that STRONGHOLD was really on without this script importing the package.
"""

import os

import torch
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
    history = trainer.state.log_history
    torch.save({
        "history": history,
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "trainer_mro": [c.__name__ for c in type(trainer).__mro__],
        "engine": getattr(model, "_stronghold_engine", None) is not None,
    }, os.path.join(args.output_dir, f"result{os.environ.get('RANK', '')}.pt"))


if __name__ == "__main__":
    main()
