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
import difflib
import functools
import json
import logging
import math
import os
import sys
import threading
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
    import transformers

    if training_args.should_log:
        # The default log_level is "passive": the process level follows transformers' verbosity.
        transformers.utils.logging.set_verbosity_info()
    level = training_args.get_process_log_level()
    # The Trainer says what STRONGHOLD does in one start line and one end line ("STRONGHOLD is
    # on: ...", "STRONGHOLD done ..."); the engine's own account of how it chose (the split, the
    # window, the slots) is for --log_level debug.
    configure_logging(level, engine_level=level if level <= logging.DEBUG else max(level, logging.WARNING))


def configure_logging(log_level: int, engine_level: int | None = None) -> None:
    """One formatted stdout handler on the root logger; each record printed once.

    As in HF's scripts, the script's own loggers (and ``stronghold_hf``, which logs its window
    choice, "stronghold: 4 blocks ..., window_size=2", at ``engine_level``, default
    ``log_level``) go through `logging.basicConfig`'s handler; transformers keeps its own handler
    (``enable_default_handler``, no propagation: transformers propagates its records to the root
    logger when the environment sets ``CI=true``, as CI services do, which would print each one
    twice, so propagation is turned off explicitly).
    ``datasets`` installs a bare ``StreamHandler`` on its root logger *and* propagates to the root
    logger, so each of its records would print twice, once unformatted on stderr and once
    formatted; its handler is removed, and its records print once, formatted, like ours.
    """
    import datasets
    import transformers

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    for name in ("__main__", __name__, embedded_default.__name__):
        logging.getLogger(name).setLevel(log_level)
    logging.getLogger("stronghold_hf").setLevel(log_level if engine_level is None else engine_level)
    datasets.utils.logging.set_verbosity(log_level)
    datasets_root = logging.getLogger("datasets")
    for handler in list(datasets_root.handlers):
        if type(handler) is logging.StreamHandler:  # the one datasets added at import
            datasets_root.removeHandler(handler)
    datasets_root.propagate = True
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.disable_propagation()
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
def _data_files(
    train_file: str | None, validation_file: str | None, test_file: str | None = None
) -> tuple[str, dict[str, str]]:
    files = {k: v for k, v in (("train", train_file), ("validation", validation_file), ("test", test_file)) if v}
    extensions = {Path(p).suffix.lstrip(".") for p in files.values()}
    if len(extensions) != 1:
        raise ValueError(f"--train_file, --validation_file and --test_file must share one extension, got {sorted(extensions)}.")
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
    ``validation_file`` and ``validation_split_percentage`` (and may have ``test_file``, which
    becomes the ``test`` split). Without a validation file the last
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
        test_file = getattr(data_args, "test_file", None)
        if train_file is None and validation_file is None and test_file is None:
            if embedded_files is None:
                raise ValueError("Pass --dataset_name or --train_file/--validation_file.")
            files = embedded_files()
            train_file, validation_file = files["train"], files.get("validation")
        builder, files = _data_files(train_file, validation_file, test_file)
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
#: How long `check_model_sources` waits for the hub to answer before calling it unreachable.
HUB_PROBE_TIMEOUT_S = 5.0
_SOURCE_FLAGS = ("model_name_or_path", "config_name", "tokenizer_name")


def check_model_sources(model_args) -> None:
    """Fails at once, naming the flag and the path, when a model source can be neither read nor downloaded.

    ``from_pretrained`` takes a name that is not a local directory for a hub id. With no network
    and without ``HF_HUB_OFFLINE=1`` it then retries for about 50 s, and offline it fails with a
    message that does not name the path. Here a source must be a local directory (or, for
    ``--config_name``, a JSON file), be in the hub cache, or be a hub id while the hub answers
    within `HUB_PROBE_TIMEOUT_S`.
    """
    for flag in _SOURCE_FLAGS:
        name = getattr(model_args, flag, None)
        if name:
            _check_source(flag, name, getattr(model_args, "cache_dir", None))


def _check_source(flag: str, name: str, cache_dir: str | None) -> None:
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = Path(name).expanduser()
    if path.is_dir() or (flag == "config_name" and path.is_file() and path.suffix == ".json"):
        return
    where = f"--{flag} {name!r}"
    if path.exists():
        raise ValueError(f"{where} is a file; pass the directory that holds the checkpoint (config.json, weights, tokenizer).")
    try:
        validate_repo_id(name)
    except HFValidationError:  # "/abs/dir", "./dir", "a/b/c": only ever a local path
        raise ValueError(
            f"{where}: no such directory ({path.resolve()}). Pass the directory of a saved checkpoint, "
            "for example the --output_dir of an earlier run."
        ) from None
    hub_cache = Path(cache_dir or huggingface_hub.constants.HF_HUB_CACHE)
    if (hub_cache / f"models--{name.replace('/', '--')}").is_dir():
        return  # from_pretrained resolves it from the cache (offline) or checks it online
    missing = f"{where} is not a local directory ({path.resolve()}) and not in the Hugging Face cache ({hub_cache})"
    if huggingface_hub.is_offline_mode():
        raise ValueError(
            f"{missing}, and the hub is offline (HF_HUB_OFFLINE=1), so it cannot be downloaded. Check the path "
            "(for example the --output_dir of an earlier run), or unset HF_HUB_OFFLINE with network access "
            "to download a hub model."
        )
    reachable, reason = _hub_reachable()
    if not reachable:
        raise ValueError(
            f"{missing}, and the Hugging Face hub ({huggingface_hub.constants.ENDPOINT}) is unreachable "
            f"({reason}), so it cannot be downloaded. Check the path (for example the --output_dir of an "
            "earlier run), or restore network access; set HF_HUB_OFFLINE=1 to work from the cache offline."
        )


@functools.lru_cache(maxsize=1)
def _hub_reachable() -> tuple[bool, str]:
    """``(True, "")`` if the hub endpoint answers any HTTP request within `HUB_PROBE_TIMEOUT_S`."""
    import huggingface_hub

    result: list[tuple[bool, str]] = []

    def probe() -> None:
        try:
            huggingface_hub.get_session().head(huggingface_hub.constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
            result.append((True, ""))
        except Exception as err:  # any transport error (DNS, refused, TLS, proxy) means "not reachable"
            result.append((False, f"{type(err).__name__}: {err}"))

    # A thread bounds the wait even where name resolution blocks past the request timeout.
    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 1.0)
    return result[0] if result else (False, f"no answer within {HUB_PROBE_TIMEOUT_S:.0f} s")


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
        config = new_config(
            model_args.model_type, tokenizer if embedded_tokenizer else None, model_args.config_overrides, **kwargs
        )
        logger.warning("Training a new %s model from scratch.", model_args.model_type)
        return config, True
    reference = embedded_default.default_config(kind, tokenizer)
    overrides = parse_config_overrides(model_args.config_overrides, reference)
    config = embedded_default.default_config(kind, tokenizer, **{**kwargs, **overrides})
    logger.info("No --model_name_or_path/--model_type: training the embedded tiny %s config from scratch.", kind)
    return config, True


def new_config(model_type: str, tokenizer=None, overrides: str | None = None, **kwargs):
    """``AutoConfig.for_model(model_type)`` with ``--config_overrides`` passed to its constructor.

    Overrides go to the constructor rather than onto a built config
    (`PretrainedConfig.update_from_string`), so that values the constructor derives follow them:
    T5's ``num_decoder_layers`` defaults to ``num_layers`` unless given, Llama's ``head_dim`` to
    ``hidden_size // num_attention_heads``. With ``tokenizer`` (a tokenizer trained for this new
    model) the vocabulary size and the special-token ids come from it. An encoder-decoder config
    without ``decoder_start_token_id`` (T5's, in transformers 5) gets the pad id, as T5 does.
    """
    from transformers import AutoConfig

    init: dict[str, Any] = {}
    if tokenizer is not None:
        init["vocab_size"] = len(tokenizer)
        init.update(_special_token_ids(AutoConfig.for_model(model_type), tokenizer))
    init.update(kwargs)
    reference = _with_decoder_start(AutoConfig.for_model(model_type, **init))
    given = parse_config_overrides(overrides, reference)
    init.update(given)
    config = _with_decoder_start(AutoConfig.for_model(model_type, **init))
    _check_attention_heads(config, given)
    return config


def _check_attention_heads(config, given: dict[str, Any]) -> None:
    """Grouped-query attention needs ``num_attention_heads`` divisible by ``num_key_value_heads``;
    shrinking the heads with --config_overrides while a default of 8 key/value heads stays
    would otherwise fail in the first forward with a bare shape error."""
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not given or not isinstance(heads, int) or not isinstance(kv, int) or kv <= 0 or heads % kv == 0:
        return
    source = "given" if "num_key_value_heads" in given else f"{type(config).__name__}'s default"
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    raise ValueError(
        f"--config_overrides: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} ({source}); "
        f"add num_key_value_heads=N with N one of {divisors}."
    )


def _special_token_ids(base, tokenizer) -> dict[str, int]:
    """The config's pad/bos/eos ids from ``tokenizer``, and the ids that alias them remapped too.

    BART starts decoding from its EOS and forces EOS last; T5 starts from its pad token. Ids that
    equal one of the config's own special ids (``decoder_start_token_id``, ``forced_*``) are
    moved to the tokenizer's id for the same role.
    """
    ids: dict[str, int] = {}
    moved: dict[int, int] = {}
    for role in ("pad", "bos", "eos"):
        attr = f"{role}_token_id"
        new = getattr(tokenizer, attr, None)
        if new is None or not hasattr(base, attr):
            continue
        ids[attr] = new
        old = getattr(base, attr)
        if isinstance(old, int):
            moved.setdefault(old, new)
    for attr in ("decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id"):
        old = getattr(base, attr, None)
        if isinstance(old, int) and old in moved:
            ids[attr] = moved[old]
    return ids


def _with_decoder_start(config):
    if config.is_encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = config.pad_token_id
    return config


def parse_config_overrides(overrides: str | None, reference) -> dict[str, Any]:
    """``"d_model=64,num_layers=2"`` -> ``{"d_model": 64, "num_layers": 2}``, typed after ``reference``.

    Values take the type of ``reference``'s current value, as `PretrainedConfig.update_from_string`
    does (``true``/``false`` for booleans); a key whose value is ``None`` takes an int, a float,
    a boolean or ``none`` if the text reads as one, else the string.
    """
    if not overrides:
        return {}
    known = reference.to_dict()
    out: dict[str, Any] = {}
    for item in overrides.split(","):
        key, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise ValueError(f"--config_overrides item {item!r} is not key=value; write e.g. 'd_model=64,num_layers=2'.")
        if not hasattr(reference, key):
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"--config_overrides: {type(reference).__name__} has no {key!r}.{hint}")
        out[key] = _typed_override(key, raw, getattr(reference, key))
    return out


def _typed_override(key: str, raw: str, current: Any) -> Any:
    truth = {"true": True, "1": True, "yes": True, "y": True, "false": False, "0": False, "no": False, "n": False}
    try:
        if isinstance(current, bool):
            if raw.lower() not in truth:
                raise ValueError
            return truth[raw.lower()]
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
    except ValueError:
        raise ValueError(
            f"--config_overrides {key}={raw!r}: expected {type(current).__name__} (its default is {current!r})."
        ) from None
    if isinstance(current, str):
        return raw
    if current is None:
        for parse in (int, float):
            try:
                return parse(raw)
            except ValueError:
                pass
        lowered = raw.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        return None if lowered in ("none", "null") else raw
    raise ValueError(f"--config_overrides {key}: only int, float, bool and string values can be set; its value is {current!r}.")


def build_model(auto_class, model_args, config, tokenizer, **kwargs):
    """``auto_class.from_pretrained`` when a checkpoint is given, else ``from_config``; resizes embeddings."""
    if model_args.model_name_or_path:
        model = auto_class.from_pretrained(
            model_args.model_name_or_path, config=config, cache_dir=model_args.cache_dir,
            revision=model_args.model_revision, token=model_args.token, **kwargs,
        )
    else:
        check_new_model_fits(auto_class, config)
        model = auto_class.from_config(config)
        n = sum(p.numel() for p in model.parameters())
        logger.info("New %s: %.2fM parameters", type(model).__name__, n / 1e6)
    embeddings = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embeddings:
        model.resize_token_embeddings(len(tokenizer))
    return model


def check_new_model_fits(auto_class, config) -> None:
    """Refuses, before anything is allocated, a model from scratch whose weights alone would not
    fit in the host memory available now: ``--model_type llama`` without ``--config_overrides``
    is LlamaConfig's default, 6.7 B parameters and 25 GiB of fp32 weights, and building it on a
    smaller machine ends with the OOM killer (exit -9) and no word of why."""
    import torch

    from stronghold_hf.estimate.meta import build_meta_model
    from stronghold_hf.memory import available_host_bytes

    shape = build_meta_model(config, auto_class)  # the estimator's: init skipped, tied weights counted once
    n = sum(p.numel() for p in shape.parameters())
    need = n * torch.get_default_dtype().itemsize
    available = available_host_bytes()
    if available is not None and need > available:
        raise ValueError(
            f"A new {type(shape).__name__} from this config has {n / 1e9:.2f} B parameters: creating its weights "
            f"takes {need / 2**30:.1f} GiB of RAM, and this machine has {available / 2**30:.1f} GiB available. "
            f"--model_type {config.model_type} starts from {type(config).__name__}'s default sizes; shrink it with "
            "--config_overrides (for example 'hidden_size=512,num_hidden_layers=8,intermediate_size=1408'), or "
            "start from a checkpoint with --model_name_or_path."
        )


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
