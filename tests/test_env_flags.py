"""``STRONGHOLD*`` environment variables and flags, through every entry point that reads them.

The bug these guard against: `HfArgumentParser` gave the ``stronghold`` bool field its own
argparse default (False), so ``STRONGHOLD=1`` did nothing in scripts that parse their
arguments. Everything here goes through ``parse_args_into_dataclasses``, as a script would.
"""

from __future__ import annotations

import json

import pytest
from transformers import HfArgumentParser, TrainingArguments

from stronghold_hf import (
    StrongholdPlugin,
    StrongholdSeq2SeqTrainingArguments,
    StrongholdTrainer,
    StrongholdTrainingArguments,
)
from stronghold_hf.integrations.arguments import SUPPORTED_OPTIMS, env_flag
from tiny_models import tiny_model

ARG_CLASSES = [StrongholdTrainingArguments, StrongholdSeq2SeqTrainingArguments]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for name in ("STRONGHOLD", "STRONGHOLD_WINDOW_SIZE", "STRONGHOLD_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def _parse(cls, argv, tmp_path):
    (args,) = HfArgumentParser(cls).parse_args_into_dataclasses(["--output_dir", str(tmp_path), *argv])
    return args


@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("true", True), ("TRUE", True), (" yes ", True), ("On", True),
    ("0", False), ("false", False), ("No", False), (" off\n", False),
    ("", None), ("   ", None),
])
def test_env_flag_accepted_values(monkeypatch, raw, expected):
    monkeypatch.setenv("STRONGHOLD", raw)
    assert env_flag() is expected


@pytest.mark.parametrize("raw", ["maybe", "2", "enable", "y es"])
def test_env_flag_refuses_other_values(monkeypatch, raw):
    monkeypatch.setenv("STRONGHOLD", raw)
    with pytest.raises(ValueError, match=r"STRONGHOLD=.*not a boolean.*1/on/true/yes.*0/false/no/off"):
        env_flag()


@pytest.mark.parametrize("cls", ARG_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("env, argv, expected", [
    (None, [], False),
    ("", [], False),
    ("1", [], True),  # the case HfArgumentParser's bool default used to swallow
    (" ON ", [], True),
    ("1", ["--stronghold", "false"], False),  # the command line beats the environment
    ("1", ["--stronghold", "no"], False),
    ("0", ["--stronghold"], True),
    (None, ["--stronghold"], True),
    (None, ["--stronghold", "true"], True),
    (None, ["--stronghold", "false"], False),
])
def test_flag_through_hf_argument_parser(cls, env, argv, expected, monkeypatch, tmp_path):
    if env is not None:
        monkeypatch.setenv("STRONGHOLD", env)
    args = _parse(cls, argv, tmp_path)
    assert args.stronghold is expected
    if expected:
        assert args.place_model_on_device is False  # the engine places the model


@pytest.mark.parametrize("cls", ARG_CLASSES, ids=lambda c: c.__name__)
def test_window_size_and_config_through_hf_argument_parser(cls, monkeypatch, tmp_path):
    monkeypatch.setenv("STRONGHOLD", "1")
    monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", "3")
    monkeypatch.setenv("STRONGHOLD_CONFIG", '{"cpu_threads": 2, "window_size": 5}')
    args = _parse(cls, [], tmp_path)
    # The window size (flag or variable) overrides the config's window_size.
    assert args.stronghold_config_resolved.window_size == 3 and args.stronghold_config_resolved.cpu_threads == 2
    args = _parse(cls, ["--stronghold_window_size", "1"], tmp_path)
    assert args.stronghold_config_resolved.window_size == 1
    cfg_file = tmp_path / "sh.json"
    cfg_file.write_text(json.dumps({"cpu_threads": 1}))
    args = _parse(cls, ["--stronghold_config", str(cfg_file)], tmp_path)
    assert args.stronghold_config_resolved.cpu_threads == 1 and args.stronghold_config_resolved.window_size == 3
    monkeypatch.setenv("STRONGHOLD_CONFIG", str(cfg_file))  # a path in the variable works too
    monkeypatch.delenv("STRONGHOLD_WINDOW_SIZE")
    args = _parse(cls, [], tmp_path)
    assert args.stronghold_config_resolved.cpu_threads == 1 and args.stronghold_config_resolved.window_size == "auto"


@pytest.mark.parametrize("value, match", [
    ("{window_size: 2}", r"--stronghold_config is not valid JSON .*window_size"),
    ('{"windw": 1}', r"Unknown stronghold config key.*windw"),
    ("no/such/file.json", r"no/such/file.json"),
])
def test_bad_stronghold_config_on_the_command_line_names_the_option(value, match, tmp_path):
    """A malformed ``--stronghold_config`` is refused at parse time, naming the option, with or
    without ``--stronghold`` (not a bare JSONDecodeError from TrainingArguments)."""
    for flag in (["--stronghold"], []):
        with pytest.raises(ValueError, match=match):
            _parse(StrongholdTrainingArguments, [*flag, "--stronghold_config", value], tmp_path)


@pytest.mark.parametrize("name, value, match", [
    ("STRONGHOLD", "maybe", r"STRONGHOLD='maybe' is not a boolean"),
    ("STRONGHOLD_WINDOW_SIZE", "0", r"STRONGHOLD_WINDOW_SIZE='0' is not a valid window_size"),
    ("STRONGHOLD_WINDOW_SIZE", "big", r"STRONGHOLD_WINDOW_SIZE='big'"),
    ("STRONGHOLD_CONFIG", '{"windw": 1}', r"STRONGHOLD_CONFIG: .*windw"),
    ("STRONGHOLD_CONFIG", "no/such/file.json", r"STRONGHOLD_CONFIG: .*no/such/file.json"),
])
def test_bad_environment_named_by_every_entry_point(name, value, match, monkeypatch, tmp_path):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        _parse(StrongholdTrainingArguments, [], tmp_path)
    with pytest.raises(ValueError, match=match):
        StrongholdPlugin()
    with pytest.raises(ValueError, match=match):
        StrongholdTrainer(model=tiny_model("gpt2"), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True))


def test_plugin_parses_like_the_arguments(monkeypatch):
    monkeypatch.setenv("STRONGHOLD", " Off ")
    assert StrongholdPlugin().enabled is False
    monkeypatch.setenv("STRONGHOLD", "yes")
    monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", " 2 ")
    plugin = StrongholdPlugin()
    assert plugin.enabled is True and plugin.stronghold_config.window_size == 2
    assert StrongholdPlugin(window_size="1").stronghold_config.window_size == 1  # explicit beats environment


@pytest.mark.parametrize("env, on", [("1", True), ("0", False), (None, False)])
def test_plain_training_arguments_take_the_environment(env, on, monkeypatch, tmp_path):
    if env is not None:
        monkeypatch.setenv("STRONGHOLD", env)
    monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", "2")
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none"])
    trainer = StrongholdTrainer(model=tiny_model("gpt2"), args=args)
    assert (trainer.stronghold_engine is not None) is on
    if on:
        assert trainer.stronghold_engine.window_size == 2
        trainer.stronghold_engine.close()


@pytest.mark.parametrize("optim", ["sgd", "adafactor", "lion_8bit", "lion_32bit"])  # 8-bit AdamW names select lean
def test_unsupported_optim_refused_at_parse_time(optim, tmp_path):
    with pytest.raises(ValueError, match=rf"--optim {optim} is not supported.*adamw_torch.*adamw_torch_fused"):
        _parse(StrongholdTrainingArguments, ["--stronghold", "--optim", optim], tmp_path)
    assert _parse(StrongholdTrainingArguments, ["--optim", optim], tmp_path).optim.value == optim  # off: untouched


@pytest.mark.parametrize("optim", SUPPORTED_OPTIMS)
def test_adamw_optims_accepted(optim, tmp_path):
    assert _parse(StrongholdTrainingArguments, ["--stronghold", "--optim", optim], tmp_path).stronghold


@pytest.mark.parametrize("argv", [["--torch_compile"], ["--torch_compile_backend", "inductor"]])
def test_torch_compile_refused_at_parse_time(argv, tmp_path):
    with pytest.raises(ValueError, match="--torch_compile"):
        _parse(StrongholdTrainingArguments, ["--stronghold", *argv], tmp_path)


@pytest.mark.parametrize("kwargs, match", [
    (dict(optim="sgd"), "--optim sgd is not supported"),
    (dict(torch_compile=True), "--torch_compile"),
])
def test_environment_route_refuses_the_same_options(kwargs, match, monkeypatch, tmp_path):
    monkeypatch.setenv("STRONGHOLD", "1")
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match=rf"STRONGHOLD=1 .*{match}|{match}.*STRONGHOLD=1"):
        StrongholdTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kwargs))
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters()), "nothing was offloaded"


def test_prepare_stronghold_refuses_a_compiling_accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from stronghold_hf import prepare_stronghold

    try:
        accelerator = Accelerator(cpu=True, dynamo_backend="inductor")
        model = tiny_model("gpt2")
        with pytest.raises(ValueError, match="dynamo backend.*--dynamo_backend no"):
            prepare_stronghold(accelerator, model, dict(lr=1e-3))
        assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters()), "nothing was offloaded"
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_no_arguments_at_all_take_the_environment(monkeypatch, tmp_path):
    """``StrongholdTrainer(model=...)`` without ``args``: the Trainer builds its defaults, and
    ``STRONGHOLD=1`` still turns the engine on."""
    monkeypatch.setenv("STRONGHOLD", "1")
    monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", "1")
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    trainer = StrongholdTrainer(model=tiny_model("gpt2"))
    assert trainer.stronghold_engine is not None and trainer.stronghold_engine.window_size == 1
    trainer.stronghold_engine.close()
