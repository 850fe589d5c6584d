#!/usr/bin/env python
"""Sequence-classification fine-tuning (GLUE-style) with `StrongholdTrainer` and `evaluate` metrics.

Follows the Hugging Face ``examples/pytorch/text-classification/run_glue.py`` conventions. Data:

* ``--task_name cola|sst2|mrpc|...``: the GLUE task from the hub (needs the network);
* ``--train_file``/``--validation_file``: CSV or JSON with a ``label`` column and either
  ``sentence`` or ``sentence1``/``sentence2`` (otherwise the first one or two other columns).
  Integer or string labels are classes; float labels mean regression;
* nothing: the embedded default task, **docstring topic** (``examples/embedded_default.py``,
  `topic_classification_files`): is a stdlib docstring from a concurrency module (asyncio,
  threading, ...) or an internet module (email, http, urllib, ...)? Balanced, chance is 0.5.

Model: ``--model_name_or_path`` (for example the output directory of ``run_mlm.py``: the encoder
is kept and a new classification head is added), ``--model_type`` to start from scratch, or
nothing: the embedded tiny BERT with the embedded WordPiece tokenizer, from scratch. (The script
does not pick up a ``run_mlm.py`` output by itself: pass it, so a run never depends on what a
previous run left on disk.)

Metrics, computed offline with the local modules in ``examples/metrics``: ``eval_accuracy`` for
classification, plus ``eval_f1`` (of label id 1) when there are two labels; ``eval_mse`` and
``eval_pearson`` for regression::

    python examples/run_glue.py --stronghold                          # embedded default task
    python examples/run_mlm.py --stronghold --output_dir outputs/my_bert
    python examples/run_glue.py --model_name_or_path outputs/my_bert --stronghold \\
        --output_dir outputs/my_bert_topic                            # pretrain -> fine-tune
    python examples/run_glue.py --model_name_or_path M --train_file t.csv --validation_file v.csv \\
        --do_train --do_eval --output_dir out --stronghold
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from datasets import ClassLabel
from transformers import (
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)

import embedded_default
from script_utils import (
    train_and_evaluate,
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
)
from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments

logger = logging.getLogger(__name__)

TASK_TO_KEYS = {
    "cola": ("sentence", None),
    "mnli": ("premise", "hypothesis"),
    "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None),
    "stsb": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}


@dataclass
class ModelArguments:
    """Which model to fine-tune (none given: the embedded tiny BERT, from scratch)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Checkpoint to fine-tune, e.g. the --output_dir of run_mlm.py."}
    )
    model_type: str | None = field(default=None, metadata={"help": "Train a new model of this type from scratch."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Override config values of a new model, e.g. 'num_hidden_layers=2'."}
    )
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache hub downloads."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models."})
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Reinitialise a checkpoint's head when its number of labels differs."}
    )


@dataclass
class DataTrainingArguments:
    """What to fine-tune on (none given: the embedded docstring-topic task)."""

    task_name: str | None = field(
        default=None, metadata={"help": "GLUE task (hub): " + ", ".join(TASK_TO_KEYS), "choices": list(TASK_TO_KEYS)}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Other hub dataset name (needs the network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset config name."})
    train_file: str | None = field(default=None, metadata={"help": "Training data: .csv or .json(l) with 'label'."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same format."})
    validation_split_percentage: int = field(
        default=10, metadata={"help": "Percent of train used for validation when there is no validation split."}
    )
    max_seq_length: int = field(default=128, metadata={"help": "Truncate (and with --pad_to_max_length pad) to this."})
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad to max_seq_length, else per batch."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set to this many."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation set to this many."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the cached preprocessing."})


#: Short-run hyper-parameters of the embedded default task: a couple of minutes on two CPU cores.
EMBEDDED_DEFAULTS = [
    CliDefault("max_steps", 150, unless=("num_train_epochs",), embedded_only=True),
    CliDefault("per_device_train_batch_size", 32, embedded_only=True),
    CliDefault("per_device_eval_batch_size", 64, embedded_only=True),
    CliDefault("learning_rate", 1e-3, embedded_only=True),
    CliDefault("warmup_steps", 15, embedded_only=True),
    CliDefault("weight_decay", 0.01, embedded_only=True),
    CliDefault("logging_steps", 25, embedded_only=True),
    CliDefault("logging_first_step", True, embedded_only=True),
    CliDefault("save_strategy", "no", embedded_only=True),
]
DATA_FLAGS = ("task_name", "dataset_name", "train_file", "validation_file")


def _load_data(data_args, model_args):
    if data_args.task_name is not None:
        if data_args.dataset_name is None:
            data_args.dataset_name, data_args.dataset_config_name = "nyu-mll/glue", data_args.task_name
        raw = load_raw_datasets(data_args, model_args, embedded_files=None)
        if data_args.task_name == "mnli":
            raw["validation"] = raw["validation_matched"]
        return raw
    return load_raw_datasets(data_args, model_args, embedded_files=embedded_default.topic_classification_files)


def _text_keys(data_args, column_names: list[str]) -> tuple[str, str | None]:
    if data_args.task_name is not None:
        return TASK_TO_KEYS[data_args.task_name]
    if "sentence1" in column_names and "sentence2" in column_names:
        return "sentence1", "sentence2"
    if "sentence" in column_names:
        return "sentence", None
    others = [c for c in column_names if c not in ("label", "idx")]
    if not others:
        raise ValueError(f"No text column besides 'label' in {column_names}; name it 'sentence'.")
    return others[0], (others[1] if len(others) > 1 else None)


def _metrics_fn(is_regression: bool, num_labels: int):
    if is_regression:
        def compute_metrics(p):
            preds = np.squeeze(p.predictions)
            labels = np.asarray(p.label_ids, dtype=float)
            pearson = float(np.corrcoef(preds, labels)[0, 1]) if len(labels) > 1 else float("nan")
            return {"mse": float(np.mean((preds - labels) ** 2)), "pearson": pearson}

        return compute_metrics
    accuracy = load_metric("accuracy")
    f1 = load_metric("f1") if num_labels == 2 else None

    def compute_metrics(p):
        logits = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.argmax(logits, axis=-1)
        result = accuracy.compute(predictions=preds, references=p.label_ids)
        if f1 is not None:
            result.update(f1.compute(predictions=preds, references=p.label_ids))
        return result

    return compute_metrics


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, StrongholdTrainingArguments))
    (model_args, data_args, training_args), filled, embedded_data = parse_args(
        parser, standard_defaults("run_glue") + EMBEDDED_DEFAULTS, data_flags=DATA_FLAGS, argv=argv
    )
    setup_logging(training_args)
    log_filled_defaults(filled, embedded_data)
    check_model_sources(model_args)
    if embedded_data:
        logger.info("Embedded task: docstring topic, %s vs %s (balanced; chance = 0.5).", *embedded_default.TOPICS)
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="loading the data"):
        raw = _load_data(data_args, model_args)
        tokenizer, embedded_tokenizer = load_tokenizer(model_args, "bert")

    train_split = raw["train"]
    if "label" not in train_split.column_names:
        raise ValueError(f"The data needs a 'label' column; it has {train_split.column_names}.")
    label_feature = train_split.features["label"]
    if data_args.task_name is not None:
        is_regression = data_args.task_name == "stsb"
    else:
        is_regression = getattr(label_feature, "dtype", "") in ("float32", "float64")
    if is_regression:
        label_list, num_labels = None, 1
    elif hasattr(label_feature, "names"):  # ClassLabel (hub GLUE)
        label_list = list(label_feature.names)
        num_labels = len(label_list)
    else:
        label_list = sorted(set(train_split.unique("label")))
        num_labels = len(label_list)
        if getattr(label_feature, "dtype", "") in ("string", "large_string"):
            # String labels become a ClassLabel (ids in sorted order). This also rejects a
            # validation label never seen in training.
            try:
                raw = raw.cast_column("label", ClassLabel(names=[str(label) for label in label_list]))
            except ValueError as err:
                raise ValueError(f"A label outside the training labels {label_list} ({err}).") from None
            train_split, label_feature = raw["train"], raw["train"].features["label"]
    if not is_regression and num_labels < 2:
        raise ValueError(f"Found a single label {label_list} in the training data; classification needs two or more.")

    config, _ = load_config(
        model_args, "bert", tokenizer, embedded_tokenizer=embedded_tokenizer, num_labels=num_labels,
        finetuning_task=data_args.task_name or "text-classification",
    )
    if label_list is not None:
        names = [str(label) for label in label_list]
        config.id2label = dict(enumerate(names))
        config.label2id = {name: i for i, name in enumerate(names)}
    if is_regression:
        config.problem_type = "regression"
    if tokenizer.pad_token is None:  # GPT-style checkpoints
        tokenizer.pad_token = tokenizer.eos_token
    config.pad_token_id = tokenizer.pad_token_id
    model = build_model(
        AutoModelForSequenceClassification, model_args, config, tokenizer,
        **({"ignore_mismatched_sizes": model_args.ignore_mismatched_sizes} if model_args.model_name_or_path else {}),
    )

    key1, key2 = _text_keys(data_args, train_split.column_names)
    label_to_id = None if label_list is None or hasattr(label_feature, "names") else {v: i for i, v in enumerate(label_list)}
    max_seq_length = min(data_args.max_seq_length, tokenizer.model_max_length)
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess(examples):
        texts = (examples[key1],) if key2 is None else (examples[key1], examples[key2])
        out = tokenizer(*texts, padding=padding, max_length=max_seq_length, truncation=True)
        if label_to_id is not None:
            out["label"] = [label_to_id.get(label, -1) for label in examples["label"]]
        else:
            out["label"] = examples["label"]
        return out

    with training_args.main_process_first(desc="tokenizing"):
        # Dropping the original columns (label included) lets the new integer "label" column take
        # its own type; overwriting a string column in place would keep it a string.
        encoded = raw.map(
            preprocess, batched=True, num_proc=data_args.preprocessing_num_workers, remove_columns=train_split.column_names,
            load_from_cache_file=not data_args.overwrite_cache, desc="Tokenizing",
        )
    train_dataset = take(encoded["train"], data_args.max_train_samples) if training_args.do_train else None
    eval_dataset = take(encoded["validation"], data_args.max_eval_samples) if training_args.do_eval else None
    if eval_dataset is not None and label_to_id is not None:
        unknown = eval_dataset.filter(lambda ex: ex["label"] == -1)
        if len(unknown):
            raise ValueError(f"{len(unknown)} validation rows have labels not seen in training (known: {label_list}).")

    collator = default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    trainer = StrongholdTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=_metrics_fn(is_regression, num_labels),
    )

    return train_and_evaluate(trainer, tokenizer, train_dataset, eval_dataset)


if __name__ == "__main__":
    main()
