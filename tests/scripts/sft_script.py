"""A TRL ``SFTTrainer`` script that has never heard of stronghold_hf.

Everything is local: a word-level tokenizer trained on a few sentences, a tiny Llama built
from a config, a `datasets.Dataset` of text. ``tests/test_launcher.py`` runs it as is and
under ``python -m stronghold_hf``, and imports `build` for the subclass route. It writes
``result.pt`` into ``--output_dir`` (see run_record.py).
"""

import os

import torch
from datasets import Dataset
from run_record import save_run
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

SENTENCES = [
    "the cat sat on the mat", "a dog ran in the park", "the sun is warm today", "we train a small model",
    "blocks move through a window", "the optimizer runs on the host", "tokens flow from left to right",
    "a short line of text", "the model learns the words", "every step moves the weights",
    "memory is shared by the host", "the window slides back in backward",
]


def build():
    """``(model, tokenizer, dataset)``, the same on every call."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    torch.manual_seed(0)
    # A vocabulary larger than the tokenizer's, as real checkpoints pad theirs: 4096 x 32 is many
    # blocks large, so stronghold reads the embedding and head in pieces, and TRL's fused LM head
    # gets the head lent whole, as on a real model.
    config = AutoConfig.for_model(
        "llama", vocab_size=4096, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config)
    return model, tokenizer, Dataset.from_dict({"text": SENTENCES})


def main() -> None:
    (args,) = HfArgumentParser(SFTConfig).parse_args_into_dataclasses()
    model, tokenizer, dataset = build()
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    save_run(trainer, model, os.path.join(args.output_dir, "result.pt"))


if __name__ == "__main__":
    main()
