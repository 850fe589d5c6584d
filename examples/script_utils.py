"""Plumbing shared by the example scripts: script defaults, data loading, model building, metrics.

The scripts follow the Hugging Face ``examples/pytorch`` conventions; what is ours is the
*embedded default* (see `embedded_default`): a flag the user does not pass may be filled in by the
script, so that ``python examples/run_clm.py`` alone does a real, short, offline run.

How defaults are filled in (`parse_args`): each `CliDefault` names a flag; it is applied only when
the user passed neither that flag nor any flag of its ``unless`` group; ``embedded_only`` defaults
(short-run hyper-parameters) apply only when no data argument is given. The filled-in flags are
put *before* the user's arguments, so they are parsed exactly as if typed, and they are logged.
A single ``.json`` argument works as in HF's scripts, with the same defaults.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Sequence

import embedded_default

logger = logging.getLogger(__name__)

METRICS_DIR = Path(__file__).resolve().parent / "metrics"


# ------------------------------------------------------------------------------ CLI defaults
@dataclass(frozen=True)
class CliDefault:
    """A value the script uses for ``--flag`` when the user did not choose one."""

    flag: str
    value: Any
    unless: tuple[str, ...] = ()
    """Other flags that also count as the user's choice (``max_steps`` unless ``num_train_epochs``)."""
    embedded_only: bool = False
    """Apply only to the embedded run (no data argument given)."""


def given_flags(argv: Sequence[str]) -> set[str]:
    """Names of the ``--flags`` in ``argv``, normalised (``--do-train=x`` -> ``do_train``; ``--no_x`` -> both)."""
    names: set[str] = set()
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name = token[2:].split("=", 1)[0].replace("-", "_")
            names.add(name)
            if name.startswith("no_"):
                names.add(name[3:])
    return names


def parse_args(
    parser,
    defaults: Sequence[CliDefault],
    *,
    data_flags: Sequence[str],
    argv: Sequence[str] | None = None,
) -> tuple[tuple, dict[str, Any], bool]:
    """Parses ``argv`` (or one ``.json`` file) with an `HfArgumentParser`, filling script defaults.

    Returns ``(dataclasses, filled, embedded_data)``: the parsed dataclasses, the defaults that
    were filled in, and whether no data flag was given (the embedded corpus is used).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    from_json = len(argv) == 1 and argv[0].endswith(".json")
    if from_json:
        with open(argv[0], encoding="utf-8") as fh:
            given_values = json.load(fh)
        given = set(given_values)
    else:
        given = given_flags(argv)
    embedded_data = not (given & set(data_flags))
    filled: dict[str, Any] = {}
    for d in defaults:
        if d.embedded_only and not embedded_data:
            continue
        if d.flag in given or given & set(d.unless) or d.flag in filled:
            continue
        filled[d.flag] = d.value
    if from_json:
        return parser.parse_dict({**filled, **given_values}), filled, embedded_data
    prefix: list[str] = []
    for flag, value in filled.items():
        prefix += [f"--{flag}", str(value)]
    return parser.parse_args_into_dataclasses(args=prefix + argv), filled, embedded_data


def standard_defaults(script: str) -> list[CliDefault]:
    """Defaults every script shares: an output dir and, when no ``--do_*`` flag is given, train + eval."""
    do_flags = ("do_train", "do_eval", "do_predict")
    return [
        CliDefault("output_dir", f"outputs/{script}"),
        CliDefault("do_train", True, unless=do_flags),
        CliDefault("do_eval", True, unless=do_flags),
    ]


def setup_logging(training_args) -> None:
    """HF-style logging: INFO on the main process, the Trainer's level elsewhere."""
    import datasets
    import transformers

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    # stronghold_hf logs its window choice at INFO ("stronghold: 4 blocks ..., window_size=2").
    for name in ("__main__", __name__, embedded_default.__name__, "stronghold_hf"):
        logging.getLogger(name).setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()


def log_filled_defaults(filled: dict[str, Any], embedded_data: bool) -> None:
    if embedded_data:
        logger.info(
            "No --dataset_name/--train_file given: using the embedded docstring corpus "
            "(cache: %s, cap: %d bytes).", embedded_default.cache_dir(), embedded_default.corpus_bytes_cap()
        )
    if filled:
        shown = " ".join(f"--{k} {v}" for k, v in filled.items())
        logger.info("Script defaults filled in (pass a flag to override it): %s", shown)


# ------------------------------------------------------------------------------------- data
def _data_files(train_file: str | None, validation_file: str | None) -> tuple[str, dict[str, str]]:
    files = {k: v for k, v in (("train", train_file), ("validation", validation_file)) if v}
    extensions = {Path(p).suffix.lstrip(".") for p in files.values()}
    if len(extensions) != 1:
        raise ValueError(f"--train_file and --validation_file must share one extension, got {sorted(extensions)}.")
    ext = extensions.pop()
    builder = {"txt": "text", "text": "text", "csv": "csv", "json": "json", "jsonl": "json"}.get(ext)
    if builder is None:
        raise ValueError(f"Data files must be .txt, .csv, .json or .jsonl, got .{ext}.")
    return builder, files


def load_raw_datasets(
    data_args,
    model_args,
    *,
    embedded_files: Callable[[], dict[str, str]] | None,
    keep_linebreaks: bool = True,
):
    """A `DatasetDict` with ``train`` and ``validation`` from the hub, local files, or the embedded corpus.

    ``data_args`` needs ``dataset_name``, ``dataset_config_name``, ``train_file``,
    ``validation_file`` and ``validation_split_percentage``. Without a validation file the last
    ``validation_split_percentage`` % of ``train`` becomes the validation split.
    """
    from datasets import DatasetDict, load_dataset

    cache_dir = getattr(model_args, "cache_dir", None)
    token = getattr(model_args, "token", None)
    if data_args.dataset_name is not None:
        try:
            raw = load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=cache_dir, token=token)
        except Exception as err:  # offline: ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
            raise RuntimeError(
                f"Could not load --dataset_name {data_args.dataset_name!r} from the Hugging Face hub "
                f"({type(err).__name__}: {err}). Offline (HF_HUB_OFFLINE=1 or no network), pass "
                "--train_file/--validation_file instead, or no data argument at all to use the embedded "
                "docstring corpus."
            ) from err
    else:
        train_file, validation_file = data_args.train_file, data_args.validation_file
        if train_file is None and validation_file is None:
            if embedded_files is None:
                raise ValueError("Pass --dataset_name or --train_file/--validation_file.")
            files = embedded_files()
            train_file, validation_file = files["train"], files.get("validation")
        builder, files = _data_files(train_file, validation_file)
        kwargs = {"keep_linebreaks": keep_linebreaks} if builder == "text" else {}
        raw = load_dataset(builder, data_files=files, cache_dir=cache_dir, token=token, **kwargs)
    raw = DatasetDict(raw)
    if "validation" not in raw and "train" in raw:
        percent = getattr(data_args, "validation_split_percentage", 5) or 5
        split = raw["train"].train_test_split(test_size=percent / 100, shuffle=False)
        raw["train"], raw["validation"] = split["train"], split["test"]
    return raw


def group_texts(examples: dict[str, list], block_size: int) -> dict[str, list]:
    """Concatenates tokenized texts and cuts them into ``block_size`` chunks (the remainder is dropped)."""
    concatenated = {k: list(chain.from_iterable(v)) for k, v in examples.items()}
    total = len(next(iter(concatenated.values())))
    total = (total // block_size) * block_size
    return {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}


@contextlib.contextmanager
def long_sequences_expected():
    """Silences the tokenizer's "sequence length is longer than the maximum" warning.

    Texts are tokenized whole and only then cut into blocks (`group_texts`), so long texts are
    expected and the warning would only mislead.
    """
    tok_logger = logging.getLogger("transformers.tokenization_utils_base")
    level = tok_logger.level
    tok_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tok_logger.setLevel(level)


def take(dataset, n: int | None):
    return dataset if n is None else dataset.select(range(min(n, len(dataset))))


# ------------------------------------------------------------------------------------ model
def load_tokenizer(model_args, kind: embedded_default.TokenizerKind):
    """``--tokenizer_name``, else ``--model_name_or_path``'s tokenizer, else the embedded one of ``kind``.

    Returns ``(tokenizer, embedded)``.
    """
    from transformers import AutoTokenizer

    common = dict(cache_dir=model_args.cache_dir, revision=model_args.model_revision, token=model_args.token)
    if model_args.tokenizer_name:
        return AutoTokenizer.from_pretrained(model_args.tokenizer_name, **common), False
    if model_args.model_name_or_path:
        return AutoTokenizer.from_pretrained(model_args.model_name_or_path, **common), False
    path = embedded_default.tokenizer_dir(kind)
    logger.info("No --tokenizer_name/--model_name_or_path: using the embedded %s tokenizer in %s", kind, path)
    return AutoTokenizer.from_pretrained(path), True


def load_config(model_args, kind: embedded_default.TokenizerKind, tokenizer, *, embedded_tokenizer: bool, **kwargs):
    """The config from ``--config_name``/``--model_name_or_path``, ``--model_type``, or the embedded tiny one.

    ``--config_overrides`` applies to new models only (``--model_type`` or the embedded config),
    as in HF's scripts. Returns ``(config, from_scratch)``.
    """
    from transformers import AutoConfig

    common = dict(cache_dir=model_args.cache_dir, revision=model_args.model_revision, token=model_args.token)
    pretrained = model_args.config_name or model_args.model_name_or_path
    if pretrained:
        if model_args.config_overrides:
            raise ValueError(
                "--config_overrides only applies to a model trained from scratch (--model_type, or "
                "no model argument); drop it, or drop --config_name/--model_name_or_path."
            )
        return AutoConfig.from_pretrained(pretrained, **common, **kwargs), model_args.model_name_or_path is None
    if model_args.model_type:
        config = AutoConfig.for_model(model_args.model_type, **kwargs)
        if embedded_tokenizer:
            config.vocab_size = len(tokenizer)
            for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
                if getattr(tokenizer, name, None) is not None and hasattr(config, name):
                    setattr(config, name, getattr(tokenizer, name))
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        logger.warning("Training a new %s model from scratch.", model_args.model_type)
        return config, True
    config = embedded_default.default_config(kind, tokenizer, model_args.config_overrides)
    for key, value in kwargs.items():
        setattr(config, key, value)
    logger.info("No --model_name_or_path/--model_type: training the embedded tiny %s config from scratch.", kind)
    return config, True


def build_model(auto_class, model_args, config, tokenizer, **kwargs):
    """``auto_class.from_pretrained`` when a checkpoint is given, else ``from_config``; resizes embeddings."""
    if model_args.model_name_or_path:
        model = auto_class.from_pretrained(
            model_args.model_name_or_path, config=config, cache_dir=model_args.cache_dir,
            revision=model_args.model_revision, token=model_args.token, **kwargs,
        )
    else:
        model = auto_class.from_config(config)
        n = sum(p.numel() for p in model.parameters())
        logger.info("New %s: %.2fM parameters", type(model).__name__, n / 1e6)
    embeddings = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embeddings:
        model.resize_token_embeddings(len(tokenizer))
    return model


# ---------------------------------------------------------------------------------- metrics
def load_metric(name: str):
    """A metric from ``examples/metrics/<name>/<name>.py`` through `evaluate`; works offline."""
    import evaluate

    return evaluate.load(str(METRICS_DIR / name))


def add_perplexity(metrics: dict[str, float], key: str = "eval_loss") -> dict[str, float]:
    try:
        metrics["perplexity"] = math.exp(metrics[key])
    except OverflowError:
        metrics["perplexity"] = float("inf")
    return metrics


def save_model_and_tokenizer(trainer, tokenizer, output_dir: str | None = None) -> None:
    """`Trainer.save_model` (an ordinary HF checkpoint) plus the tokenizer, so the next script loads both."""
    output_dir = output_dir or trainer.args.output_dir
    trainer.save_model(output_dir)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(output_dir)


def train_and_evaluate(trainer, tokenizer, train_dataset, eval_dataset, *, eval_metrics=lambda m: m):
    """The ``--do_train`` / ``--do_eval`` tail every Trainer script shares, as HF's examples write it.

    Trains (resuming if asked), saves model and tokenizer, writes ``train_results.json`` and
    ``eval_results.json`` (``all_results.json`` is kept up to date by ``save_metrics``).
    ``eval_metrics`` post-processes the evaluation metrics (for example to add perplexity).
    """
    args = trainer.args
    if args.do_train:
        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        save_model_and_tokenizer(trainer, tokenizer)
        metrics = result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    elif trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output_dir)

    if args.do_eval:
        metrics = eval_metrics(trainer.evaluate())
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    return trainer


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}
