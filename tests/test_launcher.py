"""``python -m stronghold_hf SCRIPT``: unchanged scripts train with STRONGHOLD, exactly.

The scripts under ``tests/scripts/`` never import stronghold_hf. Each runs once as is and
once under the launcher (also under torchrun and accelerate launch), in subprocesses started
together; the runs must agree on every loss and gradient norm and on the final weights,
and the launched ones must really have had an engine on the model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser, Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

import stronghold_hf
from stronghold_hf import StrongholdTrainer
from stronghold_hf.integrations.trainer import _StrongholdTrainerMixin
from stronghold_hf.launcher import main, patch_trainers, stronghold_class
from tiny_models import tiny_model

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(stronghold_hf.__file__).resolve().parents[1]
ADAM_SLACK = 0.02 * 1e-2 * 4  # as in test_trainer.py: Adam amplifies rounding noise of ~0 gradients
TRAIN_ARGS = [
    "--use_cpu", "--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
    "--learning_rate", "1e-2", "--weight_decay", "0.1", "--warmup_steps", "1", "--max_grad_norm", "1.0",
    "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--seed", "0", "--disable_tqdm", "true",
]
LAUNCHER_LINE = "STRONGHOLD is on for every transformers.Trainer that"


@pytest.fixture(autouse=True)
def _clean_environment():
    """No STRONGHOLD* variable in, none out (the launcher sets STRONGHOLD=1 when it is unset)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("STRONGHOLD")}
    for name in saved:
        del os.environ[name]
    yield
    for name in [k for k in os.environ if k.startswith("STRONGHOLD")]:
        del os.environ[name]
    os.environ.update(saved)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRONGHOLD")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), **extra)
    return env


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run_together(runs: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, str]:
    """Starts every command at once (2 cores: the runs overlap their start-up), returns stderr."""
    procs = {name: subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (cmd, env) in runs.items()}
    errors = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} failed:\n{out[-3000:]}\n{err[-5000:]}"
        errors[name] = err
    return errors


def _assert_same_training(result: dict, ref: dict) -> None:
    assert result["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert result["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)
    for k, v in ref["state"].items():
        torch.testing.assert_close(result["state"][k], v, rtol=1e-4, atol=ADAM_SLACK, msg=lambda m: f"{k}: {m}")


# ---------------------------------------------------------------------------- the command line
def test_help_and_usage_errors(capsys, tmp_path, monkeypatch):
    assert main(["--help"]) == 0
    assert "python -m stronghold_hf [-h] SCRIPT" in capsys.readouterr().out
    for argv, message in [
        ([], "the script to run is missing"),
        ([str(tmp_path / "nope.py")], "cannot find the script"),
        (["-m"], "-m needs a module name"),
        (["--window_size", "2", "train.py"], "unknown option '--window_size'"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "usage: python -m stronghold_hf" in err, err
    monkeypatch.setenv("STRONGHOLD", "maybe")
    assert main([__file__]) == 2
    assert "STRONGHOLD='maybe' is not a boolean" in capsys.readouterr().err


def test_help_from_the_package_entry_point():
    out = subprocess.run([sys.executable, "-m", "stronghold_hf", "--help"], env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "STRONGHOLD_WINDOW_SIZE" in out.stdout, out.stderr


_PROBE = """
import json, os, sys
import transformers
json.dump({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "env": os.environ.get("STRONGHOLD"),
           "built": type(transformers.Trainer.__new__(transformers.Trainer)).__name__},  # no __init__ run
          open(os.environ["PROBE_OUT"], "w"))
"""


@pytest.mark.parametrize("module", [False, True], ids=["script", "module"])
@pytest.mark.parametrize("env, patched", [(None, True), ("0", False), ("yes", True)])
def test_script_sees_what_python_would_give_it(module, env, patched, tmp_path, monkeypatch, caplog):
    (tmp_path / "probe_script.py").write_text(_PROBE)
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "seen.json"))
    if env is not None:
        monkeypatch.setenv("STRONGHOLD", env)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    target = ["-m", "probe_script"] if module else [str(tmp_path / "probe_script.py")]
    assert main([*target, "--x", "1"]) == 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["name"] == "__main__" and seen["argv"] == [str(tmp_path / "probe_script.py"), "--x", "1"]
    assert seen["path0"] == str(tmp_path)
    assert seen["built"] == ("StrongholdTrainer" if patched else "Trainer")
    said = caplog.text
    assert ("STRONGHOLD is on for every" in said) is patched and ("turns STRONGHOLD off" in said) is (not patched)
    assert "built no transformers.Trainer" not in said  # the probe's __new__ call counts as building one
    assert seen["env"] == ("1" if env is None else env)
    assert type(Trainer.__new__(Trainer)) is Trainer, "the patch must not outlive the run"


_PARSE_PROBE = """
import json, os, sys
from transformers import HfArgumentParser, TrainingArguments
from stronghold_hf import StrongholdTrainingArguments
out = {"env": {k: v for k, v in os.environ.items() if k.startswith("STRONGHOLD")}}
(plain,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
(ours,) = HfArgumentParser(StrongholdTrainingArguments).parse_args_into_dataclasses()
out.update(plain_steps=plain.max_steps, ours=[ours.stronghold, ours.stronghold_window_size])
import argparse
bare = argparse.ArgumentParser()
for name in ("--output_dir", "--max_steps", "--report_to"):
    bare.add_argument(name)
out["argparse_steps"] = bare.parse_args().max_steps
if os.environ.get("PROBE_TRL"):
    from trl import SFTConfig, TrlParser
    (trl_args,) = TrlParser(SFTConfig).parse_args_and_config(args=sys.argv[1:] + ["--use_cpu", "--bf16", "false"])
    out["trl_steps"] = trl_args.max_steps
json.dump(out, open(os.environ["PROBE_OUT"], "w"))
"""


@pytest.mark.parametrize("options, env, window", [
    (["--stronghold", "--stronghold_window_size", "2"], {"STRONGHOLD": "1", "STRONGHOLD_WINDOW_SIZE": "2"}, "2"),
    (["--stronghold=t", "--stronghold-window-size=auto"], {"STRONGHOLD": "1", "STRONGHOLD_WINDOW_SIZE": "auto"},
     "auto"),
    (["--stronghold_config", '{"window_size": 3}'], {"STRONGHOLD": "1", "STRONGHOLD_CONFIG": '{"window_size": 3}'},
     None),
])
def test_stronghold_options_on_a_script_whose_parser_lacks_them(options, env, window, tmp_path, monkeypatch):
    """``python -m stronghold_hf train.py --stronghold_window_size 2``: a plain TrainingArguments
    parser parses the rest of the command line (it would refuse the unknown options), the
    environment carries them to the Trainer, and a parser with the stronghold fields still reads
    them itself."""
    (tmp_path / "parse_probe.py").write_text(_PARSE_PROBE)
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "seen.json"))
    if window is not None:
        monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", "5")  # the command line wins
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    args = ["--output_dir", str(tmp_path / "out"), "--max_steps", "7", *options, "--report_to", "none"]
    assert main([str(tmp_path / "parse_probe.py"), *args]) == 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["plain_steps"] == 7 and seen["argparse_steps"] == "7"
    assert {k: v for k, v in seen["env"].items() if k in env} == env
    assert seen["ours"] == [True, window]


def test_stronghold_options_pass_trl_parser(tmp_path, monkeypatch):
    """TRL parses with its own copy of HfArgumentParser (``trl.scripts._hf_argparser``)."""
    pytest.importorskip("trl")
    (tmp_path / "parse_probe.py").write_text(_PARSE_PROBE)
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "seen.json"))
    monkeypatch.setenv("PROBE_TRL", "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    args = ["--output_dir", str(tmp_path / "out"), "--max_steps", "7", "--stronghold_window_size", "2"]
    assert main([str(tmp_path / "parse_probe.py"), *args]) == 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["trl_steps"] == 7 and seen["env"]["STRONGHOLD_WINDOW_SIZE"] == "2"


def test_stronghold_options_turn_it_off_and_are_checked(tmp_path, monkeypatch, capsys, caplog):
    (tmp_path / "parse_probe.py").write_text(_PARSE_PROBE)
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "seen.json"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = str(tmp_path / "parse_probe.py")
    assert main([script, "--output_dir", str(tmp_path / "out"), "--stronghold", "false"]) == 0
    assert "--stronghold false turns STRONGHOLD off" in caplog.text
    assert json.loads((tmp_path / "seen.json").read_text())["ours"][0] is False
    for bad, message in [(["--stronghold_window_size"], "--stronghold_window_size needs a value"),
                         (["--stronghold=maybe"], "--stronghold='maybe' is not a boolean"),
                         (["--stronghold_window_size", "zero"], "--stronghold_window_size='zero' is not a valid")]:
        assert main([script, *bad]) == 2
        assert message in capsys.readouterr().err


def test_a_script_without_a_trainer_is_told(tmp_path, monkeypatch, caplog):
    (tmp_path / "loop.py").write_text("import transformers\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main([str(tmp_path / "loop.py")]) == 0
    assert ("loop.py built no transformers.Trainer and prepared no model through accelerate, so "
            "STRONGHOLD changed nothing") in caplog.text


# ---------------------------------------------------------------------------- the patch, in process
def test_patch_wraps_every_trainer_class(tmp_path, monkeypatch):
    monkeypatch.setenv("STRONGHOLD", "1")
    monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", "1")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])

    class PassThrough(Trainer):  # the usual custom Trainer: extra options, the rest passed on
        def __init__(self, *pos, extra=None, **kwargs):
            super().__init__(*pos, **kwargs)
            self.extra = extra

    class RefFirst(Trainer):  # args third, as in TRL's DPOTrainer(model, ref_model, args, ...)
        def __init__(self, model, ref_model=None, args=None, **kwargs):
            super().__init__(model=model, args=args, **kwargs)

    s2s_args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with patch_trainers():
        for cls in (Trainer, Seq2SeqTrainer, PassThrough):
            extra = dict(extra=3) if cls is PassThrough else {}
            trainer = cls(tiny_model("gpt2"), s2s_args if cls is Seq2SeqTrainer else args, **extra)
            assert type(trainer) is stronghold_class(cls) and isinstance(trainer, cls)
            assert type(trainer).__mro__[1] is _StrongholdTrainerMixin
            assert trainer.stronghold_engine is not None and trainer.stronghold_engine.window_size == 1
            trainer.stronghold_engine.close()
        assert trainer.extra == 3
        assert type(StrongholdTrainer(tiny_model("gpt2"), args)) is StrongholdTrainer  # not wrapped twice
        assert stronghold_class(StrongholdTrainer) is StrongholdTrainer
        with pytest.raises(ValueError, match="--optim sgd is not supported"):  # args found by name
            RefFirst(tiny_model("gpt2"), None, TrainingArguments(output_dir=str(tmp_path), use_cpu=True, optim="sgd"))
    assert type(Trainer(tiny_model("gpt2"), args)) is Trainer


# ---------------------------------------------------------------------------- unchanged scripts
@pytest.fixture(scope="module")
def official_runs(tmp_path_factory):
    """The plain-Trainer script: as is, under the launcher, under torchrun and accelerate launch."""
    out = tmp_path_factory.mktemp("official")
    script = str(SCRIPTS / "plain_trainer_script.py")
    py = [sys.executable]
    runs = {
        "plain": (py + [script, "--output_dir", str(out / "plain"), *TRAIN_ARGS], _env()),
        "launcher": (py + ["-m", "stronghold_hf", script, "--output_dir", str(out / "launcher"), *TRAIN_ARGS],
                     _env(STRONGHOLD_WINDOW_SIZE="1")),
        "torchrun": (py + ["-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={_free_port()}",
                           "-m", "stronghold_hf", script, "--output_dir", str(out / "torchrun"),
                           "--ddp_backend", "gloo", *TRAIN_ARGS], _env()),
        "accelerate": (py + ["-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
                             "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "stronghold_hf", script,
                             "--output_dir", str(out / "accelerate"), *TRAIN_ARGS], _env()),
    }
    stderr = _run_together(runs)
    results = {name: torch.load(next((out / name).glob("result*.pt")), weights_only=True) for name in runs}
    return results, stderr


@pytest.mark.slow
@pytest.mark.parametrize("run", ["launcher", "torchrun", "accelerate"])
def test_official_script_unchanged_trains_with_stronghold(official_runs, run):
    results, stderr = official_runs
    ref, result = results["plain"], results[run]
    assert not ref["engine"] and ref["trainer_mro"][0] == "Trainer"
    assert result["engine"], "the launched run had no STRONGHOLD engine on its model"
    assert result["trainer_mro"][:3] == ["StrongholdTrainer", "_StrongholdTrainerMixin", "Trainer"]
    assert stderr[run].count(LAUNCHER_LINE) == 1 and "plain_trainer_script.py" in stderr[run]
    assert LAUNCHER_LINE not in stderr["plain"] and "built no transformers.Trainer" not in stderr[run]
    _assert_same_training(result, ref)


@pytest.mark.slow
def test_window_size_from_the_environment_reaches_the_engine(official_runs):
    """``STRONGHOLD_WINDOW_SIZE=1`` (what ``--stronghold_window_size 1`` on an unchanged script's
    command line sets: `test_stronghold_options_on_a_script_whose_parser_lacks_them`)."""
    results, _ = official_runs
    logged = [h for h in results["launcher"]["history"] if "stronghold_window_size" in h]
    assert logged and all(h["stronghold_window_size"] == 1 for h in logged)


SFT_ARGS = [
    "--use_cpu", "--max_steps", "3", "--per_device_train_batch_size", "2", "--learning_rate", "1e-2",
    "--max_grad_norm", "1.0", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
    "--bf16", "false", "--max_length", "32", "--seed", "0", "--disable_tqdm", "true",
]


@pytest.mark.slow
def test_trl_sft_script_unchanged_trains_with_stronghold(tmp_path):
    pytest.importorskip("trl")
    script = str(SCRIPTS / "sft_script.py")
    _run_together({
        "plain": ([sys.executable, script, "--output_dir", str(tmp_path / "plain"), *SFT_ARGS], _env()),
        "launcher": ([sys.executable, "-m", "stronghold_hf", script, "--output_dir", str(tmp_path / "launcher"),
                      *SFT_ARGS], _env()),
    })
    ref = torch.load(tmp_path / "plain" / "result.pt", weights_only=True)
    result = torch.load(tmp_path / "launcher" / "result.pt", weights_only=True)
    assert not ref["engine"] and result["engine"]
    assert result["trainer_mro"][:3] == ["StrongholdSFTTrainer", "_StrongholdTrainerMixin", "SFTTrainer"]
    _assert_same_training(result, ref)


TRL_RUNS = {
    "dpo": ("dpo_script.py", ["--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--bf16", "false"]),
    # The trained weights are mixed into the reference model after every step (a callback
    # reading the weights right after optimizer.step(), while CPU updates may still run).
    "dpo_sync_ref_model": ("dpo_script.py", ["--per_device_train_batch_size", "4", "--learning_rate", "1e-2",
                                             "--bf16", "false", "--sync_ref_model", "true",
                                             "--ref_model_sync_steps", "1", "--ref_model_mixup_alpha", "0.5"]),
    # Two blocks of each model resident (the device/host split): the trained one's stepped by the
    # device AdamW, the reference model's kept whole on the device, the rest streamed.
    "dpo_split": ("dpo_script.py", ["--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--bf16", "false"]),
    # Four completions per prompt, six tokens each, sampled with the seed both runs share.
    "grpo": ("grpo_script.py", ["--per_device_train_batch_size", "4", "--num_generations", "4",
                                "--max_completion_length", "6", "--learning_rate", "1e-3", "--bf16", "false"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(TRL_RUNS))
def test_trl_preference_and_rl_scripts_unchanged_train_with_stronghold(tmp_path, run):
    """DPO (a frozen reference model next to the trained one) and GRPO (generation inside
    every training step, raw rows as the batch) through the launcher, against the same script."""
    pytest.importorskip("trl")
    script, extra = TRL_RUNS[run]
    common = ["--use_cpu", "--max_steps", "3", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
              "--seed", "0", "--disable_tqdm", "true", *extra]
    path = str(SCRIPTS / script)
    _run_together({
        "plain": ([sys.executable, path, "--output_dir", str(tmp_path / "plain"), *common], _env()),
        # Delayed copies and host work (testing.simulated_device): a read that does not wait
        # for the CPU updates sees old weights.
        "launcher": ([sys.executable, "-m", "stronghold_hf", path, "--output_dir", str(tmp_path / "launcher"), *common],
                     _env(STRONGHOLD_WINDOW_SIZE="1", STRONGHOLD_SIMULATE_COPY_DELAY_MS="3",
                          **({"STRONGHOLD_CONFIG": '{"resident": 2}'} if run.endswith("_split") else {}))),
    })
    ref = torch.load(tmp_path / "plain" / "result.pt", weights_only=True)
    result = torch.load(tmp_path / "launcher" / "result.pt", weights_only=True)
    assert not ref["engine"] and result["engine"]
    assert len(result["losses"]) == 3
    _assert_same_training(result, ref)
    for k, v in ref["auxiliary_state"].get("ref_model", {}).items():
        torch.testing.assert_close(result["auxiliary_state"]["ref_model"][k], v, rtol=1e-4, atol=ADAM_SLACK,
                                   msg=lambda m: f"reference model {k}: {m}")
    if script == "dpo_script.py":
        # The reference model streams through its own forward-only window: frozen, so it holds
        # its stored bytes on the host, and a bounded window on the device (a whole copy there
        # would undo the offloading of the trained model).
        assert ref["auxiliary"]["ref_model"] is None
        ledger = result["auxiliary"]["ref_model"]
        assert ledger is not None and ledger["offloaded_trainable_params"] == 0
        assert ledger["split_resident_blocks"] == (2 if run.endswith("_split") else 0)
        # One forward per step over every position (blocks, and units outside them that stream),
        # the resident unit once, and the vocabulary (4096 x 32, read in pieces): the embedding's
        # rows once, and the head lent whole once to TRL's fused LM head, which reads its weight.
        assert ledger["fetches"] == 3 * (ledger["sequence_length"] + ledger["rest_units"] + 2)
        head = result["auxiliary_state"]["ref_model"]["lm_head.weight"]
        assert ledger["device_peak_bytes"] <= (ledger["window_bound_bytes"] + ledger["rest_unit_bytes"]
                                               + head.numel() * head.element_size())


def _sft_build():
    """``build`` of tests/scripts/sft_script.py (the model, tokenizer and data it trains)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from sft_script import build
    finally:
        sys.path.remove(str(SCRIPTS))
    return build


def test_trl_subclass_route(tmp_path, monkeypatch):
    """``class MySFTTrainer(StrongholdTrainer, SFTTrainer)``: TRL configs take the environment,
    or the stronghold flags when the config is declared with `StrongholdArgumentsMixin`."""
    pytest.importorskip("trl")
    from trl import SFTConfig, SFTTrainer

    from stronghold_hf import StrongholdArgumentsMixin

    build = _sft_build()

    class MySFTTrainer(StrongholdTrainer, SFTTrainer):
        pass

    @dataclass
    class StrongholdSFTConfig(StrongholdArgumentsMixin, SFTConfig):
        pass

    def train(trainer_cls, args):
        model, tokenizer, dataset = build()
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
        history = trainer.state.log_history
        return dict(losses=[h["loss"] for h in history if "loss" in h], grad_norms=[h["grad_norm"] for h in history
                    if "grad_norm" in h], state=model.state_dict(), engine=getattr(trainer, "stronghold_engine", None))

    def parse(cls, extra=()):
        (args,) = HfArgumentParser(cls).parse_args_into_dataclasses(["--output_dir", str(tmp_path), *SFT_ARGS, *extra])
        return args

    ref = train(SFTTrainer, parse(SFTConfig))
    assert train(MySFTTrainer, parse(SFTConfig))["engine"] is None  # STRONGHOLD unset: off
    monkeypatch.setenv("STRONGHOLD", "1")
    by_env = train(MySFTTrainer, parse(SFTConfig))
    assert by_env["engine"] is not None
    _assert_same_training(by_env, ref)
    monkeypatch.delenv("STRONGHOLD")
    by_flag = train(MySFTTrainer, parse(StrongholdSFTConfig, ["--stronghold", "--stronghold_window_size", "1"]))
    assert by_flag["engine"] is not None and by_flag["engine"].window_size == 1
    _assert_same_training(by_flag, ref)


def test_a_trl_trainers_fit_check_counts_the_lm_head_lent_whole(tmp_path, monkeypatch):
    """TRL's trainers give the model a fused LM head, which reads the head's weight whole: the
    fit check of ``class MySFTTrainer(StrongholdTrainer, SFTTrainer)`` counts the head on the
    device whole and refuses, by name, a GPU where only its pieces would fit. The same model
    and GPU through the plain Trainer (the head read in pieces) fits, unless Liger's forward was
    put on the model by hand, which reads the head whole too."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    import stronghold_hf.estimate as est

    build = _sft_build()
    _, tokenizer, dataset = build()

    def big_vocabulary_model():  # a head of 8192 x 32: many blocks large, so it is read in pieces
        model, _, _ = build()
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(model.config.__class__(**{**model.config.to_dict(), "vocab_size": 8192}))

    shape = dict(seq_len=32, batch_size=2, dtype="fp32", gpu_reserve=0, gradient_checkpointing=False)
    pieced = est.estimate_for_model(big_vocabulary_model(), **shape)
    lent = est.estimate_for_model(big_vocabulary_model(), head_lent_whole=True, **shape)
    assert pieced.gpu_bytes_needed < lent.gpu_bytes_needed
    cap = (pieced.gpu_bytes_needed + lent.gpu_bytes_needed) // 2
    real = est.estimate_for_model
    monkeypatch.setattr(est, "estimate_for_model",
                        lambda model, **kw: real(model, **{**kw, "gpu_memory_bytes": cap, "gpu_reserve": 0}))
    monkeypatch.setenv("STRONGHOLD", "1")

    class MySFTTrainer(StrongholdTrainer, SFTTrainer):
        pass

    (args,) = HfArgumentParser(SFTConfig).parse_args_into_dataclasses(["--output_dir", str(tmp_path), *SFT_ARGS])
    with pytest.raises(ValueError, match="does not fit.*the LM head lent whole"):
        MySFTTrainer(model=big_vocabulary_model(), args=args, train_dataset=dataset, processing_class=tokenizer)

    ids = [list(range(3, 35))] * 4
    data = [{"input_ids": i, "labels": i} for i in ids]
    args = TrainingArguments(output_dir=str(tmp_path / "plain"), use_cpu=True, max_steps=1,
                             per_device_train_batch_size=2, report_to="none")
    plain = StrongholdTrainer(model=big_vocabulary_model(), train_dataset=data, args=args)
    assert plain.stronghold_engine is not None
    plain.stronghold_engine.close()

    # Liger's apply_liger_kernel_to_llama puts its own forward on the class, by hand: the same.
    model = big_vocabulary_model()

    def lce_forward(self, *a, **kw):
        return super(type(self), self).forward(*a, **kw)

    lce_forward.__module__ = "liger_kernel.transformers.model.llama"  # where Liger's forward lives
    model.__class__ = type(type(model).__name__, (type(model),), {"forward": lce_forward})
    with pytest.raises(ValueError, match="does not fit.*the LM head lent whole"):
        StrongholdTrainer(model=model, train_dataset=data, args=args)


# ---------------------------------------------------------------------------- the package surface
def test_dir_and_help_list_the_lazy_names():
    code = (
        "import pydoc, stronghold_hf as s\n"
        "lazy = [n for n in s.__all__ if n not in vars(s)]\n"
        "assert lazy, 'nothing is lazy any more: this test checks nothing'\n"
        "missing = [n for n in s.__all__ if n not in dir(s)]\n"
        "assert not missing, missing\n"
        "undocumented = [n for n in s.__all__ if n not in (s.__doc__ or '')]\n"
        "assert not undocumented, undocumented\n"
        "text = pydoc.render_doc(s, renderer=pydoc.plaintext)\n"
        "assert all(n in text for n in s.__all__), [n for n in s.__all__ if n not in text]\n"
        # `stronghold_hf.estimate` is the submodule, whichever way it is reached first.
        "import stronghold_hf.estimate as e, sys\n"
        "assert s.estimate is e is sys.modules['stronghold_hf.estimate'] and callable(e.estimate)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_trl_sft_with_peft_config_trains_lora_on_an_offloaded_base(tmp_path, monkeypatch):
    """``SFTTrainer(..., peft_config=LoraConfig(...))`` wraps the model inside its __init__; the
    engine then windows the frozen base and trains the adapters, exactly like plain TRL."""
    pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    from trl import SFTConfig, SFTTrainer

    build = _sft_build()

    class MySFTTrainer(StrongholdTrainer, SFTTrainer):
        pass

    runs = {}
    for name, cls in (("plain", SFTTrainer), ("stronghold", MySFTTrainer)):
        if name == "stronghold":
            monkeypatch.setenv("STRONGHOLD", "1")
            monkeypatch.setenv("STRONGHOLD_WINDOW_SIZE", "1")
        model, tokenizer, dataset = build()
        args = SFTConfig(output_dir=str(tmp_path / name), use_cpu=True, max_steps=3, per_device_train_batch_size=2,
                         learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", bf16=False,
                         max_length=32, seed=0)
        trainer = cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                      peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        trainer.train()
        runs[name] = trainer
    plain, sh = runs["plain"], runs["stronghold"]
    assert [h["loss"] for h in sh.state.log_history if "loss" in h] == pytest.approx(
        [h["loss"] for h in plain.state.log_history if "loss" in h], rel=1e-4)
    ledger = sh.stronghold_engine.memory_stats()
    lora = sum(p.numel() for n, p in sh.model.named_parameters() if "lora_" in n and ".layers." in n)
    assert ledger["offloaded_trainable_params"] == lora > 0
    for k, v in plain.model.state_dict().items():
        torch.testing.assert_close(sh.model.state_dict()[k], v, rtol=1e-4, atol=ADAM_SLACK, msg=lambda m: f"{k}: {m}")


def test_an_unchanged_accelerate_loop_trains_with_stronghold(tmp_path):
    """HF's ``run_clm_no_trainer.py`` shape (tests/scripts/accelerate_loop_script.py): under the
    launcher its ``accelerator.prepare(model, optimizer, ...)`` offloads the model and steps its
    AdamW groups with the engine's optimizer, its scheduler drives the engine's learning rate, and
    the run matches the same script without the launcher, also when it prepares the model, the
    optimizer and the scheduler in separate calls; an optimizer the engine cannot stand in for is
    refused, naming the fix."""
    script = str(SCRIPTS / "accelerate_loop_script.py")
    for name in ("plain", "launcher", "apart"):
        (tmp_path / name).mkdir()
    stderr = _run_together({
        "plain": ([sys.executable, script, str(tmp_path / "plain")], _env()),
        "launcher": ([sys.executable, "-m", "stronghold_hf", script, str(tmp_path / "launcher")],
                     _env(STRONGHOLD_WINDOW_SIZE="1")),
        # prepare(model), prepare(optimizer), then the scheduler: the model is offloaded before
        # accelerate could place it, and the scheduler prepared last drives the engine's optimizer.
        "apart": ([sys.executable, "-m", "stronghold_hf", script, str(tmp_path / "apart"), "--prepare", "apart"],
                  _env(STRONGHOLD_WINDOW_SIZE="1")),
    })
    ref = torch.load(tmp_path / "plain" / "result.pt", weights_only=True)
    for name in ("launcher", "apart"):
        got = torch.load(tmp_path / name / "result.pt", weights_only=True)
        assert not ref["engine"] and got["engine"]
        assert "changed nothing" not in stderr[name] and "has been overridden" not in stderr[name]
        assert got["lrs"] == ref["lrs"] and len(got["losses"]) == 8
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4)
        for k, v in ref["state"].items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-4, atol=ADAM_SLACK, msg=lambda m: f"{name} {k}: {m}")
    proc = subprocess.run([sys.executable, "-m", "stronghold_hf", script, str(tmp_path / "launcher"), "--optimizer", "sgd"],
                          env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "prepares a SGD optimizer" in proc.stderr and "STRONGHOLD=0" in proc.stderr
