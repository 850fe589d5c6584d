#!/usr/bin/env python
"""T5 span-corruption pretraining in PyTorch with `StrongholdSeq2SeqTrainer`; reports eval loss.

Hugging Face ships T5 span corruption only as a Flax example; this is the PyTorch counterpart
with the same conventions. Texts are tokenized (each line ends with ``</s>``), concatenated and
cut into blocks of ``tokens_length`` raw tokens, where
``compute_input_and_target_lengths(--max_seq_length, --noise_density, --mean_noise_span_length)``
makes each corrupted input exactly ``--max_seq_length`` tokens long. The collator
(``examples/t5_span_corruption.py``) draws random spans and replaces them with the sentinels
``<extra_id_N>``; the decoder learns to emit the hidden spans. Both T5 stacks (encoder blocks
then decoder blocks) form the one sequence that ``--stronghold`` streams through its window.

With no data or model argument it runs offline on the embedded default (see
``examples/embedded_default.py``): the docstring corpus, a Unigram tokenizer with 100 sentinels
trained on it, and a tiny T5 (4 + 4 layers, width 128)::

    python examples/run_t5_mlm.py --stronghold
    python examples/run_t5_mlm.py --model_type t5 --config_overrides d_model=256,num_layers=6 --stronghold

Writes ``train_results.json``, ``eval_results.json`` (``eval_loss``) and ``all_results.json``
into ``--output_dir`` with the model (``T5ForConditionalGeneration``) and tokenizer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import AutoModelForSeq2SeqLM, HfArgumentParser, set_seed

import embedded_default
from script_utils import (
    train_and_evaluate,
    CliDefault,
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
from stronghold_hf import StrongholdSeq2SeqTrainer, StrongholdSeq2SeqTrainingArguments
from t5_span_corruption import DataCollatorForT5SpanCorruption, compute_input_and_target_lengths

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Which model, config and tokenizer to train (none given: the embedded tiny T5)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Checkpoint to start from (hub id or path)."})
    model_type: str | None = field(default=None, metadata={"help": "Train a new model of this type from scratch, e.g. t5."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Override config values of a new model, e.g. 'd_model=64,num_layers=2'."}
    )
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer name or path (must have <extra_id_N> sentinels)."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache hub downloads."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models."})


@dataclass
class DataTrainingArguments:
    """What to train on and how to corrupt it (none given: the embedded docstring corpus)."""

    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset name (needs the network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset config name."})
    train_file: str | None = field(default=None, metadata={"help": "Training data: .txt, .csv or .json(l) with 'text'."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same format."})
    text_column_name: str | None = field(default=None, metadata={"help": "Text column (default: 'text' or the first)."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of train used for validation when there is no validation split."}
    )
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Encoder input length after corruption (default: min(512, tokenizer max))."}
    )
    noise_density: float = field(default=0.15, metadata={"help": "Fraction of tokens to corrupt."})
    mean_noise_span_length: float = field(default=3.0, metadata={"help": "Mean length of a corrupted span."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training blocks to this many."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation blocks to this many."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the cached preprocessing."})

    def __post_init__(self):
        if not 0.0 < self.noise_density < 1.0:
            raise ValueError(f"--noise_density={self.noise_density} must be in (0, 1), e.g. 0.15.")
        if self.mean_noise_span_length < 1.0:
            raise ValueError(f"--mean_noise_span_length={self.mean_noise_span_length} must be >= 1, e.g. 3.0.")


#: Short-run hyper-parameters of the embedded default: a few minutes on two CPU cores.
EMBEDDED_DEFAULTS = [
    CliDefault("max_steps", 200, unless=("num_train_epochs",), embedded_only=True),
    CliDefault("max_seq_length", 128, embedded_only=True),
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
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, StrongholdSeq2SeqTrainingArguments))
    (model_args, data_args, training_args), filled, embedded_data = parse_args(
        parser, standard_defaults("run_t5_mlm") + EMBEDDED_DEFAULTS, data_flags=DATA_FLAGS, argv=argv
    )
    setup_logging(training_args)
    log_filled_defaults(filled, embedded_data)
    check_model_sources(model_args)
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="loading the data"):
        raw = load_raw_datasets(data_args, model_args, embedded_files=embedded_default.text_files)
        tokenizer, embedded_tokenizer = load_tokenizer(model_args, "t5")
    config, _ = load_config(model_args, "t5", tokenizer, embedded_tokenizer=embedded_tokenizer)
    if not config.is_encoder_decoder:
        raise ValueError(f"Span corruption needs an encoder-decoder model; {config.model_type!r} is not one.")
    model = build_model(AutoModelForSeq2SeqLM, model_args, config, tokenizer)
    # Raises, naming the fix, when the tokenizer has no <extra_id_N> sentinels.
    collator = DataCollatorForT5SpanCorruption.from_tokenizer(
        tokenizer, noise_density=data_args.noise_density, mean_noise_span_length=data_args.mean_noise_span_length
    )

    max_seq_length = min(data_args.max_seq_length or 512, tokenizer.model_max_length)
    tokens_length, targets_length = compute_input_and_target_lengths(
        max_seq_length, data_args.noise_density, data_args.mean_noise_span_length
    )
    logger.info(
        "Span corruption: blocks of %d raw tokens -> %d input tokens and %d target tokens "
        "(noise_density=%s, mean_noise_span_length=%s)", tokens_length, max_seq_length, targets_length,
        data_args.noise_density, data_args.mean_noise_span_length,
    )

    columns = raw["train"].column_names if training_args.do_train else raw["validation"].column_names
    text_column = data_args.text_column_name or ("text" if "text" in columns else columns[0])

    def tokenize(examples):
        # Only the ids: attention masks are rebuilt by the collator after corruption.
        return tokenizer(examples[text_column], return_attention_mask=False)

    with training_args.main_process_first(desc="tokenizing and grouping"), long_sequences_expected():
        tokenized = raw.map(
            tokenize, batched=True, num_proc=data_args.preprocessing_num_workers, remove_columns=columns,
            load_from_cache_file=not data_args.overwrite_cache, desc="Tokenizing",
        )
        blocks = tokenized.map(
            group_texts, batched=True, fn_kwargs={"block_size": tokens_length},
            num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache,
            desc=f"Grouping into blocks of {tokens_length}",
        )
    train_dataset = take(blocks["train"], data_args.max_train_samples) if training_args.do_train else None
    eval_dataset = take(blocks["validation"], data_args.max_eval_samples) if training_args.do_eval else None
    for name, ds in (("train", train_dataset), ("validation", eval_dataset)):
        if ds is not None and len(ds) == 0:
            raise ValueError(f"The {name} split has no block of {tokens_length} tokens; give more text or a smaller --max_seq_length.")

    trainer = StrongholdSeq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
    )

    return train_and_evaluate(trainer, tokenizer, train_dataset, eval_dataset)


if __name__ == "__main__":
    main()
