#!/usr/bin/env python
"""Text-to-text fine-tuning (T5, BART, ...) with `StrongholdSeq2SeqTrainer`; reports ROUGE.

Follows the Hugging Face ``examples/pytorch/summarization/run_summarization.py`` conventions:
``--text_column``/``--summary_column`` (default: the first two columns), ``--source_prefix``
("summarize: " for T5), ``--max_source_length``/``--max_target_length``/``--val_max_target_length``,
``--predict_with_generate`` with ``--generation_max_length``/``--generation_num_beams`` (or
``--num_beams``), ``--do_train --do_eval --do_predict``, and ``all_results.json``. Any
``AutoModelForSeq2SeqLM`` checkpoint works: the ``--output_dir`` of ``run_t5_mlm.py``, a BART
directory, a hub model when the hub is reachable. ``--stronghold`` streams the encoder blocks, then
the decoder blocks, through the window, in training and in generation.

ROUGE-1/2/L/Lsum (F-measure, in percent as in HF's script) come from the local module
``examples/metrics/rouge``, which needs neither the network nor ``rouge_score``; ``gen_len`` is the
mean generated length in tokens.

With no data argument the task is the embedded **docstring summary**
(``embedded_default.docstring_summary_files``): from the rest of a Python docstring, generate its
first sentence. With no model argument either, a tiny T5 (4 + 4 layers, width 128) is built from
a config with the embedded T5 tokenizer, the one ``run_t5_mlm.py`` uses, so the script runs
offline with nothing else::

    python examples/run_seq2seq.py --stronghold                       # embedded task, tiny T5 from scratch
    python examples/run_t5_mlm.py --stronghold --output_dir outputs/my_t5
    python examples/run_seq2seq.py --model_name_or_path outputs/my_t5 --stronghold \\
        --output_dir outputs/my_t5_summary                            # pretrain -> fine-tune
    python examples/run_seq2seq.py --model_name_or_path M --train_file t.csv --validation_file v.csv \\
        --text_column document --summary_column summary --source_prefix "summarize: " \\
        --do_train --do_eval --predict_with_generate --output_dir out --stronghold

``--do_predict`` uses ``--test_file``, else the validation split, and writes
``generated_predictions.txt`` (one generated text per line) with ``--predict_with_generate``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from transformers import AutoModelForSeq2SeqLM, DataCollatorForSeq2Seq, HfArgumentParser, set_seed

import embedded_default
from script_utils import (
    CliDefault,
    build_model,
    check_model_sources,
    load_config,
    load_metric,
    load_raw_datasets,
    load_tokenizer,
    log_filled_defaults,
    parse_args,
    setup_logging,
    standard_defaults,
    take,
    train_and_evaluate,
)
from stronghold_hf import StrongholdSeq2SeqTrainer, StrongholdSeq2SeqTrainingArguments

logger = logging.getLogger(__name__)

#: Text and summary columns of hub summarization datasets, as in HF's script.
SUMMARIZATION_COLUMNS = {
    "cnn_dailymail": ("article", "highlights"),
    "xsum": ("document", "summary"),
    "samsum": ("dialogue", "summary"),
    "multi_news": ("document", "summary"),
    "big_patent": ("description", "abstract"),
}


@dataclass
class ModelArguments:
    """Which model to fine-tune (none given: a tiny T5 from a config, with the embedded tokenizer)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Checkpoint to fine-tune, e.g. the --output_dir of run_t5_mlm.py."}
    )
    model_type: str | None = field(
        default=None, metadata={"help": "Train a new model of this type from scratch, e.g. t5 or bart."}
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "Override config values of a new model, e.g. 'd_model=64,num_layers=2'."}
    )
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache hub downloads."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models."})


@dataclass
class DataTrainingArguments:
    """What to fine-tune on (none given: the embedded docstring-summary task)."""

    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset name (needs the network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset config name."})
    text_column: str | None = field(default=None, metadata={"help": "Source text column (default: the first)."})
    summary_column: str | None = field(default=None, metadata={"help": "Target text column (default: the second)."})
    train_file: str | None = field(default=None, metadata={"help": "Training data: .csv or .json(l)."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same format."})
    test_file: str | None = field(default=None, metadata={"help": "Data for --do_predict, same format."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of train used for validation when there is no validation split."}
    )
    source_prefix: str | None = field(
        default=None, metadata={"help": "Text put before every source, e.g. 'summarize: ' for T5."}
    )
    max_source_length: int = field(default=1024, metadata={"help": "Truncate sources to this many tokens."})
    max_target_length: int = field(default=128, metadata={"help": "Truncate training targets to this many tokens."})
    val_max_target_length: int | None = field(
        default=None,
        metadata={"help": "Truncate validation/test targets to this many tokens (default: --max_target_length); "
                          "also the generation length unless --generation_max_length is given."},
    )
    num_beams: int | None = field(
        default=None, metadata={"help": "Beams for generation in evaluate/predict (overrides --generation_num_beams)."}
    )
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad to the max lengths, else per batch."})
    ignore_pad_token_for_loss: bool = field(default=True, metadata={"help": "Leave padded label positions out of the loss."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set to this many."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the validation set to this many."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Truncate the prediction set to this many."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the cached preprocessing."})

    def __post_init__(self):
        for flag in ("train_file", "validation_file", "test_file"):
            path = getattr(self, flag)
            if path is not None and Path(path).suffix not in (".csv", ".json", ".jsonl"):
                raise ValueError(f"--{flag} {path!r}: use a .csv or .json(l) file with a source and a target column.")
        for flag in ("max_source_length", "max_target_length", "val_max_target_length"):
            value = getattr(self, flag)
            if value is not None and value < 1:
                raise ValueError(f"--{flag}={value} must be at least 1.")
        if self.val_max_target_length is None:
            self.val_max_target_length = self.max_target_length


#: Short-run settings of the embedded task: a few minutes on two CPU cores.
EMBEDDED_DEFAULTS = [
    CliDefault("max_steps", 300, unless=("num_train_epochs",), embedded_only=True),
    CliDefault("predict_with_generate", True, embedded_only=True),
    CliDefault("source_prefix", "summarize: ", embedded_only=True),
    CliDefault("max_source_length", 128, embedded_only=True),
    CliDefault("max_target_length", 48, embedded_only=True),
    CliDefault("per_device_train_batch_size", 16, embedded_only=True),
    CliDefault("per_device_eval_batch_size", 32, embedded_only=True),
    CliDefault("learning_rate", 3e-3, embedded_only=True),
    CliDefault("warmup_steps", 30, embedded_only=True),
    CliDefault("weight_decay", 0.01, embedded_only=True),
    CliDefault("logging_steps", 25, embedded_only=True),
    CliDefault("logging_first_step", True, embedded_only=True),
    CliDefault("max_eval_samples", 200, embedded_only=True),
    CliDefault("save_strategy", "no", embedded_only=True),
]
DATA_FLAGS = ("dataset_name", "train_file", "validation_file", "test_file")


def _columns(data_args, column_names: list[str]) -> tuple[str, str]:
    mapped = SUMMARIZATION_COLUMNS.get((data_args.dataset_name or "").split("/")[-1])
    chosen = []
    for flag, position in (("text_column", 0), ("summary_column", 1)):
        name = getattr(data_args, flag)
        if name is None:
            if mapped is not None:
                name = mapped[position]
            elif len(column_names) < 2:
                raise ValueError(f"The data has the columns {column_names}; it needs a source and a target column.")
            else:
                name = column_names[position]
        if name not in column_names:
            raise ValueError(f"--{flag} {name!r} is not a column of the data; it has {column_names}.")
        chosen.append(name)
    return chosen[0], chosen[1]


def _rouge_metrics(tokenizer):
    """``compute_metrics`` for `Seq2SeqTrainer` with ``predict_with_generate``: ROUGE in percent and ``gen_len``."""
    rouge = load_metric("rouge")

    def decode(ids) -> list[str]:
        ids = np.where(ids != -100, ids, tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        # rougeLsum compares sentence by sentence: one sentence per line, as HF's script does with NLTK.
        return ["\n".join(embedded_default.split_sentences(t.strip())) for t in texts]

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        preds = preds[0] if isinstance(preds, tuple) else preds
        result = rouge.compute(predictions=decode(preds), references=decode(labels))
        result = {k: round(v * 100, 4) for k, v in result.items()}
        generated = (preds != tokenizer.pad_token_id) & (preds != -100)
        result["gen_len"] = float(np.mean(np.count_nonzero(generated, axis=-1)))
        return result

    return compute_metrics


def predict(trainer, tokenizer, predict_dataset) -> None:
    """``--do_predict``: ``predict_results.json`` and, with generation, ``generated_predictions.txt``."""
    results = trainer.predict(predict_dataset, metric_key_prefix="predict")
    metrics = results.metrics
    metrics["predict_samples"] = len(predict_dataset)
    trainer.log_metrics("predict", metrics)
    trainer.save_metrics("predict", metrics)
    if trainer.args.predict_with_generate and trainer.is_world_process_zero():
        ids = np.where(results.predictions != -100, results.predictions, tokenizer.pad_token_id)
        texts = [t.strip().replace("\n", " ") for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
        with open(os.path.join(trainer.args.output_dir, "generated_predictions.txt"), "w", encoding="utf-8") as fh:
            fh.write("\n".join(texts) + "\n")


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, StrongholdSeq2SeqTrainingArguments))
    (model_args, data_args, training_args), filled, embedded_data = parse_args(
        parser, standard_defaults("run_seq2seq") + EMBEDDED_DEFAULTS, data_flags=DATA_FLAGS, argv=argv
    )
    setup_logging(training_args)
    log_filled_defaults(filled, embedded_data)
    check_model_sources(model_args)
    if embedded_data:
        logger.info("Embedded task: a Python docstring's first sentence from the rest of the docstring.")
    if not (training_args.do_train or training_args.do_eval or training_args.do_predict):
        raise ValueError("Nothing to do: pass --do_train, --do_eval and/or --do_predict.")
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="loading the data"):
        raw = load_raw_datasets(data_args, model_args, embedded_files=embedded_default.docstring_summary_files)
        tokenizer, embedded_tokenizer = load_tokenizer(model_args, "t5")
    config, _ = load_config(model_args, "t5", tokenizer, embedded_tokenizer=embedded_tokenizer)
    if not config.is_encoder_decoder:
        raise ValueError(
            f"run_seq2seq.py needs an encoder-decoder model (T5, BART, ...); {config.model_type!r} is not one. "
            "For a decoder-only model use run_clm.py."
        )
    model = build_model(AutoModelForSeq2SeqLM, model_args, config, tokenizer)
    if model.config.decoder_start_token_id is None:
        raise ValueError(
            f"The {model.config.model_type} config has no decoder_start_token_id; set it in its config.json "
            "(T5 uses the pad id, BART the EOS id)."
        )
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions is not None and max_positions < data_args.max_source_length:
        raise ValueError(
            f"--max_source_length {data_args.max_source_length} exceeds the model's {max_positions} positions; "
            f"pass --max_source_length {max_positions} or less."
        )
    prefix = data_args.source_prefix or ""
    if not prefix and model.config.model_type == "t5" and model_args.model_name_or_path:
        logger.warning("A T5 checkpoint without --source_prefix; T5 was trained with task prefixes such as 'summarize: '.")

    predict_split = "test" if "test" in raw else "validation"
    if training_args.do_predict and predict_split == "validation":
        logger.info("--do_predict without --test_file: predicting on the validation split.")
    # role -> (split, row limit, target length); the roles the run does not need are left out.
    roles = {
        role: spec
        for role, wanted, spec in (
            ("train", training_args.do_train, ("train", data_args.max_train_samples, data_args.max_target_length)),
            ("eval", training_args.do_eval, ("validation", data_args.max_eval_samples, data_args.val_max_target_length)),
            ("predict", training_args.do_predict,
             (predict_split, data_args.max_predict_samples, data_args.val_max_target_length)),
        )
        if wanted
    }
    for split, _, _ in roles.values():
        if split not in raw:
            raise ValueError(f"The data has no {split} split; pass --{split}_file.")
    text_column, summary_column = _columns(data_args, raw[next(iter(roles.values()))[0]].column_names)
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess(examples, max_target_length: int):
        pairs = [(s, t) for s, t in zip(examples[text_column], examples[summary_column]) if s and t]
        inputs = tokenizer([prefix + s for s, _ in pairs], max_length=data_args.max_source_length, padding=padding,
                           truncation=True)
        labels = tokenizer(text_target=[t for _, t in pairs], max_length=max_target_length, padding=padding,
                           truncation=True)["input_ids"]
        if padding == "max_length" and data_args.ignore_pad_token_for_loss:
            labels = [[t if t != tokenizer.pad_token_id else -100 for t in seq] for seq in labels]
        inputs["labels"] = labels
        return inputs

    tokenized = {}
    with training_args.main_process_first(desc="tokenizing"):
        for role, (split, limit, target_length) in roles.items():
            rows = take(raw[split], limit)
            tokenized[role] = rows.map(
                preprocess, batched=True, fn_kwargs={"max_target_length": target_length},
                num_proc=data_args.preprocessing_num_workers, remove_columns=rows.column_names,
                load_from_cache_file=not data_args.overwrite_cache, desc=f"Tokenizing {split} ({role})",
            )
            if len(tokenized[role]) == 0:
                raise ValueError(f"The {split} split has no row with both {text_column!r} and {summary_column!r}.")

    # The generation settings of evaluate/predict, as HF's script sets them.
    if training_args.generation_max_length is None:
        training_args.generation_max_length = data_args.val_max_target_length
    if data_args.num_beams is not None:
        training_args.generation_num_beams = data_args.num_beams

    collator = DataCollatorForSeq2Seq(
        tokenizer, model=model, label_pad_token_id=-100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id,
        pad_to_multiple_of=8 if training_args.fp16 else None,
    )
    trainer = StrongholdSeq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=tokenized.get("train"),
        eval_dataset=tokenized.get("eval"),
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=_rouge_metrics(tokenizer) if training_args.predict_with_generate else None,
    )

    train_and_evaluate(trainer, tokenizer, tokenized.get("train"), tokenized.get("eval"))
    if training_args.do_predict:
        predict(trainer, tokenizer, tokenized["predict"])
    return trainer


if __name__ == "__main__":
    main()
