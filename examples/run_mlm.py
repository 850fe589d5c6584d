#!/usr/bin/env python
"""Masked language-model pretraining (BERT-style) with `StrongholdTrainer`.

Follows the Hugging Face ``examples/pytorch/language-modeling/run_mlm.py`` conventions: texts are
tokenized (with ``[CLS] ... [SEP]``), concatenated and cut into ``--max_seq_length`` blocks (or
kept one per line with ``--line_by_line``); `DataCollatorForLanguageModeling` masks
``--mlm_probability`` of the tokens (80% ``[MASK]``, 10% random, 10% kept). Evaluation reports
``eval_loss``, ``perplexity`` and ``eval_accuracy``, the accuracy of the predictions at the masked
positions (computed with the local ``examples/metrics/accuracy`` module, offline).

With no data or model argument it runs offline on the embedded default (see
``examples/embedded_default.py``): the docstring corpus, a WordPiece tokenizer trained on it, and a
tiny BERT (4 layers, width 128)::

    python examples/run_mlm.py --stronghold                       # embedded default
    python examples/run_mlm.py --stronghold --output_dir outputs/my_bert
    python examples/run_glue.py --model_name_or_path outputs/my_bert --stronghold   # then fine-tune

The model (``BertForMaskedLM``) and its tokenizer are saved to ``--output_dir``;
``AutoModelForSequenceClassification.from_pretrained`` of that directory keeps the encoder and
adds a new classification head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from transformers import AutoModelForMaskedLM, DataCollatorForLanguageModeling, HfArgumentParser, set_seed

import embedded_default
from script_utils import (
    train_and_evaluate,
    CliDefault,
    add_perplexity,
    build_model,
    check_model_sources,
    group_texts,
    load_config,
    load_metric,
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
    """Which model, config and tokenizer to train (none given: the embedded tiny BERT)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Checkpoint to start from (hub id or path)."})
    model_type: str | None = field(
        default=None, metadata={"help": "Train a new model of this type from scratch, e.g. bert, roberta."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Override config values of a new model, e.g. 'num_hidden_layers=2,hidden_size=64'."},
    )
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache hub downloads."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models."})


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
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Tokens per sequence (default: the model's max length, at most 512)."}
    )
    line_by_line: bool = field(
        default=False, metadata={"help": "One sequence per non-empty line instead of concatenated blocks."}
    )
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "With --line_by_line, pad every line to max_seq_length (else per batch)."}
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "Fraction of tokens to mask."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set to this many."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation set to this many."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the cached preprocessing."})

    def __post_init__(self):
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"--mlm_probability={self.mlm_probability} must be in (0, 1), e.g. 0.15.")


#: Short-run hyper-parameters of the embedded default: a few minutes on two CPU cores.
EMBEDDED_DEFAULTS = [
    CliDefault("max_steps", 200, unless=("num_train_epochs",), embedded_only=True),
    CliDefault("max_seq_length", 128, embedded_only=True),
    CliDefault("per_device_train_batch_size", 8, embedded_only=True),
    CliDefault("per_device_eval_batch_size", 16, embedded_only=True),
    CliDefault("learning_rate", 1e-3, embedded_only=True),
    CliDefault("warmup_steps", 30, embedded_only=True),
    CliDefault("weight_decay", 0.01, embedded_only=True),
    CliDefault("logging_steps", 20, embedded_only=True),
    CliDefault("logging_first_step", True, embedded_only=True),
    CliDefault("max_eval_samples", 200, embedded_only=True),
    CliDefault("save_strategy", "no", embedded_only=True),
]
DATA_FLAGS = ("dataset_name", "train_file", "validation_file")


def masked_accuracy_metrics():
    """``compute_metrics`` for MLM: accuracy over the positions whose label is not -100."""
    accuracy = load_metric("accuracy")

    def preprocess_logits_for_metrics(logits, labels):
        # Keep only the argmax on the device: [batch, seq, vocab] logits would not fit in memory
        # once accumulated over the whole evaluation set.
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_pred):
        preds, labels = eval_pred
        preds, labels = np.asarray(preds).reshape(-1), np.asarray(labels).reshape(-1)
        masked = labels != -100
        return accuracy.compute(predictions=preds[masked], references=labels[masked])

    return compute_metrics, preprocess_logits_for_metrics


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, StrongholdTrainingArguments))
    (model_args, data_args, training_args), filled, embedded_data = parse_args(
        parser, standard_defaults("run_mlm") + EMBEDDED_DEFAULTS, data_flags=DATA_FLAGS, argv=argv
    )
    setup_logging(training_args)
    log_filled_defaults(filled, embedded_data)
    check_model_sources(model_args)
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="loading the data"):
        raw = load_raw_datasets(data_args, model_args, embedded_files=embedded_default.text_files)
        tokenizer, embedded_tokenizer = load_tokenizer(model_args, "bert")
    if tokenizer.mask_token is None:
        raise ValueError(f"The tokenizer {tokenizer.name_or_path!r} has no mask token; MLM needs one.")
    config, _ = load_config(model_args, "bert", tokenizer, embedded_tokenizer=embedded_tokenizer)
    model = build_model(AutoModelForMaskedLM, model_args, config, tokenizer)

    columns = raw["train"].column_names if training_args.do_train else raw["validation"].column_names
    text_column = data_args.text_column_name or ("text" if "text" in columns else columns[0])
    max_length = min(tokenizer.model_max_length, getattr(config, "max_position_embeddings", 512) or 512, 512)
    max_seq_length = min(data_args.max_seq_length or max_length, max_length)

    with training_args.main_process_first(desc="tokenizing"), long_sequences_expected():
        if data_args.line_by_line:
            padding = "max_length" if data_args.pad_to_max_length else False

            def tokenize(examples):
                lines = [line for line in examples[text_column] if line and not line.isspace()]
                return tokenizer(
                    lines, padding=padding, truncation=True, max_length=max_seq_length, return_special_tokens_mask=True
                )

            datasets = raw.map(
                tokenize, batched=True, num_proc=data_args.preprocessing_num_workers, remove_columns=columns,
                load_from_cache_file=not data_args.overwrite_cache, desc="Tokenizing line by line",
            )
        else:
            def tokenize(examples):
                return tokenizer(examples[text_column], return_special_tokens_mask=True)

            tokenized = raw.map(
                tokenize, batched=True, num_proc=data_args.preprocessing_num_workers, remove_columns=columns,
                load_from_cache_file=not data_args.overwrite_cache, desc="Tokenizing",
            )
            datasets = tokenized.map(
                group_texts, batched=True, fn_kwargs={"block_size": max_seq_length},
                num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache,
                desc=f"Grouping into blocks of {max_seq_length}",
            )
    train_dataset = take(datasets["train"], data_args.max_train_samples) if training_args.do_train else None
    eval_dataset = take(datasets["validation"], data_args.max_eval_samples) if training_args.do_eval else None
    for name, ds in (("train", train_dataset), ("validation", eval_dataset)):
        if ds is not None and len(ds) == 0:
            raise ValueError(f"The {name} split is empty after tokenization; give more text or a smaller --max_seq_length.")

    collator = DataCollatorForLanguageModeling(
        tokenizer=tokenizer, mlm_probability=data_args.mlm_probability,
        pad_to_multiple_of=8 if data_args.line_by_line and not data_args.pad_to_max_length else None,
    )
    compute_metrics, preprocess_logits = masked_accuracy_metrics() if training_args.do_eval else (None, None)
    trainer = StrongholdTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits,
    )

    return train_and_evaluate(trainer, tokenizer, train_dataset, eval_dataset, eval_metrics=add_perplexity)


if __name__ == "__main__":
    main()
