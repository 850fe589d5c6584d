#!/usr/bin/env python
"""Causal language-model pretraining (GPT-style) with `StrongholdTrainer`; reports perplexity.

Follows the Hugging Face ``examples/pytorch/language-modeling/run_clm.py`` conventions: texts are
tokenized, concatenated and cut into ``--block_size`` blocks; the model predicts each next token.
``--stronghold`` turns on working-window offloading and CPU Adam; without it this is plain
`Trainer`.

With no data or model argument it runs offline on the embedded default (see
``examples/embedded_default.py``): the docstring corpus, a byte-level BPE tokenizer trained on
it, and a tiny GPT-2 (4 layers, width 128), for a few hundred steps::

    python examples/run_clm.py --stronghold             # embedded default, a few minutes on 2 cores
    python examples/run_clm.py --model_name_or_path gpt2 --train_file a.txt --validation_file b.txt \\
        --do_train --do_eval --output_dir out --stronghold --stronghold_window_size 2
    python examples/run_clm.py args.json                # all arguments from one JSON file

Writes ``train_results.json``, ``eval_results.json`` (``eval_loss``, ``perplexity``) and
``all_results.json`` into ``--output_dir``, with the model and tokenizer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import AutoModelForCausalLM, HfArgumentParser, default_data_collator, set_seed

import embedded_default
from script_utils import (
    train_and_evaluate,
    CliDefault,
    add_perplexity,
    build_model,
    check_model_sources,
    group_texts,
    load_config,
    load_raw_datasets,
    load_tokenizer,
    long_sequences_expected,
    log_filled_defaults,
    parse_args,
    setup_logging,
    standard_defaults,
    take,
)
from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Which model, config and tokenizer to train (none given: the embedded tiny GPT-2)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Checkpoint to start from (hub id or path)."})
    model_type: str | None = field(
        default=None, metadata={"help": "Train a new model of this type from scratch, e.g. gpt2, llama, opt."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Override config values of a new model, e.g. 'n_layer=2,n_embd=64,n_head=2'."},
    )
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache hub downloads."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models."})
    dtype: str | None = field(
        default=None,
        metadata={"help": "dtype to load the model in ('auto', 'float32', 'bfloat16', 'float16').",
                  "choices": ["auto", "bfloat16", "float16", "float32"]},
    )


@dataclass
class DataTrainingArguments:
    """What to train and evaluate on (none given: the embedded docstring corpus)."""

    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset name (needs the network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset config name."})
    train_file: str | None = field(default=None, metadata={"help": "Training data: .txt, .csv or .json(l) with 'text'."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same format."})
    text_column_name: str | None = field(default=None, metadata={"help": "Text column (default: 'text' or the first)."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of train used for validation when there is no validation split."}
    )
    block_size: int | None = field(
        default=None, metadata={"help": "Tokens per training block (default: the model's max length, at most 1024)."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training blocks to this many."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation blocks to this many."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks when reading .txt files."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the cached preprocessing."})


#: Short-run hyper-parameters of the embedded default: a few minutes on two CPU cores.
EMBEDDED_DEFAULTS = [
    CliDefault("max_steps", 200, unless=("num_train_epochs",), embedded_only=True),
    CliDefault("block_size", 128, embedded_only=True),
    CliDefault("per_device_train_batch_size", 8, embedded_only=True),
    CliDefault("per_device_eval_batch_size", 16, embedded_only=True),
    CliDefault("learning_rate", 2e-3, embedded_only=True),
    CliDefault("warmup_steps", 30, embedded_only=True),
    CliDefault("weight_decay", 0.01, embedded_only=True),
    CliDefault("logging_steps", 20, embedded_only=True),
    CliDefault("logging_first_step", True, embedded_only=True),
    CliDefault("max_eval_samples", 200, embedded_only=True),
    CliDefault("save_strategy", "no", embedded_only=True),
]
DATA_FLAGS = ("dataset_name", "train_file", "validation_file")


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, StrongholdTrainingArguments))
    (model_args, data_args, training_args), filled, embedded_data = parse_args(
        parser, standard_defaults("run_clm") + EMBEDDED_DEFAULTS, data_flags=DATA_FLAGS, argv=argv
    )
    setup_logging(training_args)
    log_filled_defaults(filled, embedded_data)
    check_model_sources(model_args)
    logger.info("Training arguments: stronghold=%s, window=%s", training_args.stronghold, training_args.stronghold_window_size)
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="loading the data"):
        raw = load_raw_datasets(
            data_args, model_args, embedded_files=embedded_default.text_files, keep_linebreaks=data_args.keep_linebreaks
        )
        tokenizer, embedded_tokenizer = load_tokenizer(model_args, "gpt")
    config, _ = load_config(model_args, "gpt", tokenizer, embedded_tokenizer=embedded_tokenizer)
    extra = {"dtype": model_args.dtype} if model_args.dtype and model_args.model_name_or_path else {}
    model = build_model(AutoModelForCausalLM, model_args, config, tokenizer, **extra)

    columns = raw["train"].column_names if training_args.do_train else raw["validation"].column_names
    text_column = data_args.text_column_name or ("text" if "text" in columns else columns[0])

    def tokenize(examples):
        return tokenizer(examples[text_column])

    max_length = tokenizer.model_max_length
    for attr in ("n_positions", "max_position_embeddings"):
        if getattr(config, attr, None):
            max_length = min(max_length, getattr(config, attr))
    block_size = min(data_args.block_size or 1024, max_length)
    if data_args.block_size and data_args.block_size > max_length:
        logger.warning("--block_size %d exceeds the model's %d positions; using %d.", data_args.block_size, max_length, block_size)

    with training_args.main_process_first(desc="tokenizing and grouping"), long_sequences_expected():
        tokenized = raw.map(
            tokenize, batched=True, num_proc=data_args.preprocessing_num_workers, remove_columns=columns,
            load_from_cache_file=not data_args.overwrite_cache, desc="Tokenizing",
        )
        lm_datasets = tokenized.map(
            group_texts, batched=True, fn_kwargs={"block_size": block_size},
            num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache,
            desc=f"Grouping into blocks of {block_size}",
        )
    # Labels are the inputs; the model shifts them by one inside its loss.
    lm_datasets = lm_datasets.map(lambda ex: {"labels": ex["input_ids"]}, batched=True, desc="Adding labels")
    train_dataset = take(lm_datasets["train"], data_args.max_train_samples) if training_args.do_train else None
    eval_dataset = take(lm_datasets["validation"], data_args.max_eval_samples) if training_args.do_eval else None
    for name, ds in (("train", train_dataset), ("validation", eval_dataset)):
        if ds is not None and len(ds) == 0:
            raise ValueError(f"The {name} split has no block of {block_size} tokens; give more text or a smaller --block_size.")

    trainer = StrongholdTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )

    return train_and_evaluate(trainer, tokenizer, train_dataset, eval_dataset, eval_metrics=add_perplexity)


if __name__ == "__main__":
    main()
