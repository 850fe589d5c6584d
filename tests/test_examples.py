"""The example scripts run end to end, offline, with and without ``--stronghold``.

Each script runs in a subprocess, as a user runs it, on the embedded default with tiny configs
(2 layers, width 32-64, a few steps). The embedded corpus is capped small and its cache (corpus,
tokenizers, the topic task) is built once per session and shared by every subprocess through
``STRONGHOLD_EXAMPLES_CACHE``. ``HF_HUB_OFFLINE=1`` and a private ``HF_HOME`` keep the runs off
the network and out of the user's caches.

The pretrain -> fine-tune test loads ``run_mlm.py``'s output with ``run_glue.py
--model_name_or_path`` and must learn a task the test writes (does a sentence contain a number?)
to a stated accuracy.
"""

from __future__ import annotations

import csv
import math
import json
import random
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from examples_harness import (
    CORPUS_BYTES,
    EXAMPLES,
    SCRIPT_TIMEOUT_S,
    SHORT,
    STRONGHOLD,
    TINY_BERT,
    TINY_GPT,
    TINY_T5,
    assert_finite,
    assert_saved_checkpoint,
    run_failing,
    run_script,
)
from examples_harness import example_env as _example_env


@pytest.fixture(scope="session")
def example_env(tmp_path_factory):
    return _example_env(tmp_path_factory)


def _mode(stronghold: bool) -> str:
    return "stronghold" if stronghold else "plain"


# ------------------------------------------------------------------------------- the scripts
@pytest.mark.parametrize("stronghold", [False, True], ids=_mode)
def test_run_clm(example_env, tmp_path, stronghold):
    out = tmp_path / "clm"
    args = TINY_GPT + SHORT + ["--max_steps", "4", "--max_eval_samples", "8"] + (STRONGHOLD if stronghold else [])
    results = run_script(example_env, "run_clm.py", out, *args)
    assert_finite(results, "train_loss", "eval_loss", "perplexity")
    assert results["perplexity"] == pytest.approx(math.exp(results["eval_loss"]), rel=1e-6)
    for name in ("train_results.json", "eval_results.json"):
        assert (out / name).is_file()
    assert_saved_checkpoint(out)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.n_layer == 2 and model.config.vocab_size >= len(tokenizer)


@pytest.fixture(scope="session")
def mlm_checkpoint(example_env, tmp_path_factory):
    """``run_mlm.py --stronghold`` on the embedded corpus: the pretrained model for fine-tuning."""
    out = tmp_path_factory.mktemp("mlm") / "pretrained"
    args = TINY_BERT + SHORT + ["--max_seq_length", "32", "--max_steps", "5", "--max_eval_samples", "16"] + STRONGHOLD
    return out, run_script(example_env, "run_mlm.py", out, *args)


@pytest.mark.parametrize("stronghold", [False, True], ids=_mode)
def test_run_mlm(example_env, tmp_path, mlm_checkpoint, stronghold):
    if stronghold:
        out, results = mlm_checkpoint
    else:
        out = tmp_path / "mlm"
        args = TINY_BERT + SHORT + ["--max_seq_length", "32", "--max_steps", "5", "--max_eval_samples", "16"]
        results = run_script(example_env, "run_mlm.py", out, *args)
    assert_finite(results, "train_loss", "eval_loss", "eval_accuracy", "perplexity")
    assert 0.0 <= results["eval_accuracy"] <= 1.0
    assert_saved_checkpoint(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]


@pytest.mark.parametrize("stronghold", [False, True], ids=["plain-embedded_config", "stronghold-model_type"])
def test_run_t5_mlm(example_env, tmp_path, stronghold):
    """The embedded T5 config, and ``--model_type t5`` (which crashed without decoder_start_token_id).

    Both override only ``num_layers``: the decoder must follow it (2 + 2 blocks, not 2 + 6).
    """
    out = tmp_path / "t5"
    args = TINY_T5 + SHORT + ["--max_seq_length", "32", "--max_steps", "4", "--max_eval_samples", "8"]
    if stronghold:
        args += ["--model_type", "t5"] + STRONGHOLD
    results = run_script(example_env, "run_t5_mlm.py", out, *args)
    assert_finite(results, "train_loss", "eval_loss")
    assert_saved_checkpoint(out)

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (model.config.num_layers, model.config.num_decoder_layers) == (2, 2)
    assert len(model.decoder.block) == 2
    assert model.config.decoder_start_token_id == tokenizer.pad_token_id == 0
    assert tokenizer.convert_tokens_to_ids("<extra_id_99>") < model.config.vocab_size


def test_config_overrides_go_through_the_constructor(example_env, monkeypatch):
    """Derived config values follow ``--config_overrides``; special ids follow the embedded tokenizer."""
    import embedded_default
    import script_utils
    from transformers import AutoTokenizer

    monkeypatch.setenv(embedded_default.CACHE_ENV, example_env[embedded_default.CACHE_ENV])
    monkeypatch.setenv(embedded_default.CORPUS_BYTES_ENV, CORPUS_BYTES)
    tokenizer = AutoTokenizer.from_pretrained(embedded_default.tokenizer_dir("t5"))

    def config(**given):
        fields = dict(model_name_or_path=None, config_name=None, model_type=None, config_overrides=None,
                      cache_dir=None, model_revision="main", token=None)
        args = types.SimpleNamespace(**{**fields, **given})
        return script_utils.load_config(args, "t5", tokenizer, embedded_tokenizer=True)[0]

    t5 = config(model_type="t5", config_overrides="d_model=64,num_layers=2")
    assert (t5.d_model, t5.num_layers, t5.num_decoder_layers, t5.decoder_start_token_id) == (64, 2, 2, 0)
    assert t5.vocab_size == len(tokenizer) and (t5.pad_token_id, t5.eos_token_id) == (0, 1)
    explicit = config(model_type="t5", config_overrides="num_layers=3,num_decoder_layers=1")
    assert (explicit.num_layers, explicit.num_decoder_layers) == (3, 1)
    embedded = config(config_overrides="num_layers=2,dropout_rate=0.0")
    assert (embedded.num_layers, embedded.num_decoder_layers, embedded.d_model, embedded.dropout_rate) == (2, 2, 128, 0.0)
    # BART starts decoding from (and forces) its EOS: those ids move to the tokenizer's EOS.
    bart = config(model_type="bart", config_overrides="d_model=32,encoder_layers=1")
    assert (bart.pad_token_id, bart.eos_token_id, bart.decoder_start_token_id, bart.forced_eos_token_id) == (0, 1, 1, 1)
    assert (bart.d_model, bart.encoder_layers) == (32, 1)

    with pytest.raises(ValueError, match="T5Config has no 'num_layer'. Did you mean num_layers"):
        config(model_type="t5", config_overrides="num_layer=2")
    with pytest.raises(ValueError, match="d_model='wide': expected int"):
        config(model_type="t5", config_overrides="d_model=wide")
    with pytest.raises(ValueError, match="is not key=value"):
        config(config_overrides="d_model")
    with pytest.raises(ValueError, match="only applies to a model trained from scratch"):
        config(model_name_or_path="some/model", config_overrides="d_model=64")
    # Fewer query heads than Mistral's default 8 key/value heads: refused before any forward.
    with pytest.raises(ValueError, match=r"num_attention_heads=2 is not a multiple of num_key_value_heads=8 "
                                         r"\(MistralConfig's default\); add num_key_value_heads=N with N one of \[1, 2\]"):
        config(model_type="mistral", config_overrides="hidden_size=32,num_attention_heads=2")
    assert config(model_type="mistral", config_overrides="hidden_size=32,num_attention_heads=2,"
                                                         "num_key_value_heads=1").num_key_value_heads == 1


def test_run_glue_embedded_task(example_env, tmp_path):
    """No data or model argument: the docstring-topic task with a tiny BERT from scratch."""
    out = tmp_path / "glue"
    tiny = ["--config_overrides", "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,intermediate_size=64"]
    results = run_script(example_env, "run_glue.py", out, *tiny, "--max_steps", "4", "--max_seq_length", "64",
                         "--per_device_train_batch_size", "8")
    assert_finite(results, "train_loss", "eval_loss", "eval_accuracy", "eval_f1")
    assert results["eval_samples"] > 100, "the topic task holds out a few hundred rows"
    config = json.loads((out / "config.json").read_text())
    assert sorted(config["label2id"]) == ["concurrency", "internet"]
    assert_saved_checkpoint(out)


@pytest.mark.parametrize("stronghold", [False, True], ids=_mode)
def test_run_clm_no_trainer(example_env, tmp_path, stronghold):
    if stronghold:
        import stronghold_hf

        if not hasattr(stronghold_hf, "prepare_stronghold"):
            pytest.skip("stronghold_hf.prepare_stronghold (the accelerate integration) is not available yet")
    out = tmp_path / "clm_nt"
    args = TINY_GPT + ["--max_train_steps", "4", "--max_eval_samples", "8", "--per_device_train_batch_size", "4",
                       "--logging_steps", "1", "--gradient_accumulation_steps", "2"]
    results = run_script(example_env, "run_clm_no_trainer.py", out, *args, *(STRONGHOLD if stronghold else []))
    assert_finite(results, "train_loss", "eval_loss", "perplexity")
    assert results["step"] == 4
    assert_saved_checkpoint(out)


# ---------------------------------------------------------------------- pretrain -> fine-tune
FILLER = (
    "the value of a file object returns an error if the list is empty and this method reads data "
    "from the stream when called with new keyword arguments for each item in the given path"
).split()


def write_contains_number_task(directory: Path) -> tuple[Path, Path]:
    """label = 1 iff the sentence contains a number: 6-12 filler words, plus 1-2 numbers in half the rows."""
    paths = []
    for split, n, seed in (("train", 400, 0), ("validation", 200, 1)):
        rng = random.Random(seed)
        rows = []
        for i in range(n):
            words = [rng.choice(FILLER) for _ in range(rng.randint(6, 12))]
            label = i % 2
            for _ in range(rng.randint(1, 2) if label else 0):
                words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 999)))
            rows.append((" ".join(words), label))
        rng.shuffle(rows)
        path = directory / f"{split}.csv"
        with open(path, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["sentence", "label"])
            writer.writerows(rows)
        paths.append(path)
    return paths[0], paths[1]


#: Chance is 0.5 (balanced). Tried on 3 seeds with this checkpoint and these 80 steps the
#: plain run reached 0.975-0.98; 40 steps already gave 0.925-0.955. With 200 validation rows
#: the standard error at p=0.97 is about 0.012, so 0.85 leaves a wide margin for seed and
#: floating-point differences (the stronghold engine is only equal up to reassociation), while a
#: model that did not learn the token class would stay near 0.5.
FINETUNE_ACCURACY = 0.85


def test_pretrain_then_finetune(example_env, tmp_path, mlm_checkpoint):
    pretrained, _ = mlm_checkpoint
    train_csv, validation_csv = write_contains_number_task(tmp_path)
    out = tmp_path / "finetuned"
    results = run_script(
        example_env, "run_glue.py", out,
        "--model_name_or_path", str(pretrained), "--train_file", str(train_csv), "--validation_file", str(validation_csv),
        "--do_train", "--do_eval", "--max_steps", "80", "--learning_rate", "3e-3", "--warmup_steps", "5",
        "--per_device_train_batch_size", "16", "--save_strategy", "no", "--logging_steps", "10", *STRONGHOLD,
    )
    assert results["eval_samples"] == 200
    assert results["eval_accuracy"] >= FINETUNE_ACCURACY, results
    assert results["eval_f1"] >= FINETUNE_ACCURACY, results

    # The encoder came from the checkpoint: fine-tuning moves the word embeddings only a little,
    # so they stay aligned with the pretrained ones (a fresh init would have cosine ~0).
    import torch
    from safetensors.torch import load_file

    before = load_file(pretrained / "model.safetensors")["bert.embeddings.word_embeddings.weight"]
    after = load_file(out / "model.safetensors")["bert.embeddings.word_embeddings.weight"]
    assert before.shape == after.shape
    assert torch.nn.functional.cosine_similarity(before.flatten(), after.flatten(), dim=0) > 0.9
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]


# ----------------------------------------------------------------- arguments and offline bits
def _clm_parser():
    import run_clm
    from transformers import HfArgumentParser

    from stronghold_hf import StrongholdTrainingArguments

    return run_clm, HfArgumentParser((run_clm.ModelArguments, run_clm.DataTrainingArguments, StrongholdTrainingArguments))


def test_defaults_fill_only_what_the_user_did_not_choose(tmp_path):
    import script_utils

    run_clm, parser = _clm_parser()
    defaults = script_utils.standard_defaults("run_clm") + run_clm.EMBEDDED_DEFAULTS
    flags = run_clm.DATA_FLAGS

    (_, data, args), filled, embedded = script_utils.parse_args(parser, defaults, data_flags=flags, argv=[])
    assert embedded and args.do_train and args.do_eval and args.max_steps == 200 and data.block_size == 128
    assert args.output_dir == "outputs/run_clm" and not args.stronghold

    argv = ["--train_file", "a.txt", "--do_eval", "--output_dir", str(tmp_path), "--stronghold"]
    (_, data, args), filled, embedded = script_utils.parse_args(parser, defaults, data_flags=flags, argv=argv)
    assert not embedded and args.do_eval and not args.do_train  # --do_eval alone means eval only
    assert args.max_steps == -1 and data.block_size is None and args.learning_rate == 5e-5  # HF defaults
    assert args.stronghold and args.output_dir == str(tmp_path) and filled == {}

    argv = ["--num_train_epochs", "1", "--learning_rate=1e-4", "--output-dir", str(tmp_path)]
    (_, _, args), filled, _ = script_utils.parse_args(parser, defaults, data_flags=flags, argv=argv)
    assert args.max_steps == -1 and args.num_train_epochs == 1 and args.learning_rate == 1e-4
    assert "max_steps" not in filled and "learning_rate" not in filled and "output_dir" not in filled


def test_single_json_argument(tmp_path):
    import script_utils

    run_clm, parser = _clm_parser()
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path / "o"), "max_steps": 7, "stronghold": True,
                                "stronghold_window_size": "2"}))
    defaults = script_utils.standard_defaults("run_clm") + run_clm.EMBEDDED_DEFAULTS
    (model, data, args), _, embedded = script_utils.parse_args(parser, defaults, data_flags=run_clm.DATA_FLAGS,
                                                              argv=[str(path)])
    assert embedded and args.max_steps == 7 and args.stronghold and args.stronghold_window_size == "2"
    assert args.do_train and data.block_size == 128 and args.output_dir == str(tmp_path / "o")


def test_dataset_name_fails_clearly_offline(example_env):
    code = (
        "import types, script_utils\n"
        "a = types.SimpleNamespace(dataset_name='wikitext', dataset_config_name='wikitext-2-raw-v1', train_file=None,"
        " validation_file=None, validation_split_percentage=5)\n"
        "m = types.SimpleNamespace(cache_dir=None, token=None)\n"
        "script_utils.load_raw_datasets(a, m, embedded_files=None)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=example_env, cwd=EXAMPLES, capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode != 0
    assert "Could not load --dataset_name 'wikitext'" in proc.stderr and "--train_file" in proc.stderr


def test_local_metric_modules_work_offline(example_env, monkeypatch):
    import script_utils

    monkeypatch.setenv("HF_HOME", example_env["HF_HOME"])
    accuracy = script_utils.load_metric("accuracy")
    f1 = script_utils.load_metric("f1")
    assert accuracy.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0]) == {"accuracy": 0.75}
    assert f1.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])["f1"] == pytest.approx(2 / 3)
    assert f1.compute(predictions=[0, 1, 2, 0], references=[0, 1, 2, 2], average="macro")["f1"] == pytest.approx(7 / 9)
    assert f1.compute(predictions=[1, 1], references=[0, 0])["f1"] == 0.0


def test_embedded_assets(example_env, monkeypatch):
    """The cached corpus is deterministic, split stably, and the tokenizers have their special tokens."""
    import embedded_default
    from transformers import AutoTokenizer

    monkeypatch.setenv(embedded_default.CACHE_ENV, example_env[embedded_default.CACHE_ENV])
    monkeypatch.setenv(embedded_default.CORPUS_BYTES_ENV, CORPUS_BYTES)
    docs = embedded_default.load_corpus()
    assert sum(len(d.text.encode()) for d in docs) >= int(CORPUS_BYTES)
    assert {d.split for d in docs} == {"train", "validation"}
    fresh = embedded_default.load_corpus(int(CORPUS_BYTES) + 1)  # a different cap is rebuilt from source
    assert [d.key for d in fresh[: len(docs) - 1]] == [d.key for d in docs[: len(docs) - 1]]

    bert = AutoTokenizer.from_pretrained(embedded_default.tokenizer_dir("bert"))
    ids = bert("Return the value.", "Raise an error.")["input_ids"]
    assert ids[0] == bert.cls_token_id and ids.count(bert.sep_token_id) == 2 and bert.mask_token == "[MASK]"
    t5 = AutoTokenizer.from_pretrained(embedded_default.tokenizer_dir("t5"))
    assert (t5.pad_token_id, t5.eos_token_id) == (0, 1) and t5("Return x.")["input_ids"][-1] == 1
    assert all(t5.convert_tokens_to_ids(f"<extra_id_{i}>") != t5.unk_token_id for i in range(100))
    gpt = AutoTokenizer.from_pretrained(embedded_default.tokenizer_dir("gpt"))
    assert gpt.eos_token == "<|endoftext|>" and gpt.decode(gpt("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"


#: Imports take about 4 s on two cores; a hub retry loop takes about 50 s.
MISSING_MODEL_BOUND_S = 15.0
SCRIPTS = ["run_clm.py", "run_mlm.py", "run_t5_mlm.py", "run_glue.py", "run_clm_no_trainer.py", "run_seq2seq.py"]


def test_missing_model_path_fails_fast_offline(example_env, tmp_path):
    """A wrong --model_name_or_path fails at once in every script, naming the path and why it
    cannot be downloaded. The scripts run one after another in one process (each as ``__main__``
    with its own argv), so the imports are paid once; each must fail within the bound after
    them. (The test below times a whole subprocess, imports included.)"""
    runs = [[script, ["--model_name_or_path", "outputs/no_such_model", "--output_dir", str(tmp_path / script)]]
            for script in SCRIPTS]
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "scripts" / "run_each_failing.py"),
                           json.dumps(runs)], env=example_env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(results) == SCRIPTS
    for script, r in results.items():
        assert r["failed"], f"{script} did not fail"
        assert r["seconds"] < MISSING_MODEL_BOUND_S, f"{script} took {r['seconds']:.1f} s to fail"
        assert "--model_name_or_path 'outputs/no_such_model' is not a local directory" in r["stderr"], (
            script, r["stderr"][-3000:])
        assert "the hub is offline (HF_HUB_OFFLINE=1)" in r["stderr"], script


def test_missing_model_path_fails_fast_when_the_hub_is_unreachable(example_env, tmp_path):
    """Without HF_HUB_OFFLINE, an unreachable hub is found in one probe, not after a minute of retries."""
    env = {k: v for k, v in example_env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused
    start = time.perf_counter()
    proc = run_failing(env, "run_clm.py", "--tokenizer_name", "someone/missing-tokenizer",
                       "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    elapsed = time.perf_counter() - start
    assert elapsed < MISSING_MODEL_BOUND_S, f"took {elapsed:.1f} s to fail"
    assert "--tokenizer_name 'someone/missing-tokenizer' is not a local directory" in proc.stderr, proc.stderr[-3000:]
    assert "hub (http://127.0.0.1:9) is unreachable" in proc.stderr


def test_a_new_model_larger_than_the_ram_is_refused_before_it_is_built(example_env, tmp_path, monkeypatch):
    """--model_type starts from the config class's default sizes (Llama's: 6.7 B parameters); a
    model whose weights would not fit the RAM available is refused by name before any weight
    is allocated, instead of ending in the OOM killer. Through the script, with a width no
    machine holds (built on the meta device only); in process, the default Llama config against
    a 1 GiB machine, and a tiny one that passes."""
    proc = run_failing(example_env, "run_clm.py", "--model_type", "llama", "--config_overrides",
                       "hidden_size=1048576,num_hidden_layers=1,num_attention_heads=1,num_key_value_heads=1,"
                       "intermediate_size=16", "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert "A new LlamaForCausalLM from this config has" in proc.stderr, proc.stderr[-3000:]
    assert "--config_overrides" in proc.stderr and "--model_name_or_path" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())

    import script_utils
    import stronghold_hf.memory
    import transformers as T

    monkeypatch.setattr(stronghold_hf.memory, "available_host_bytes", lambda: 2**30)
    with pytest.raises(ValueError, match=r"6\.\d\d B parameters: creating its weights takes 2\d\.\d GiB of RAM, "
                                         r"and this machine has 1\.0 GiB available"):
        script_utils.check_new_model_fits(T.AutoModelForCausalLM, T.LlamaConfig())
    script_utils.check_new_model_fits(T.AutoModelForCausalLM, T.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))


def test_model_sources_that_can_only_be_local_paths(tmp_path):
    import script_utils

    def check(**given):
        fields = dict(model_name_or_path=None, config_name=None, tokenizer_name=None, cache_dir=str(tmp_path))
        script_utils.check_model_sources(types.SimpleNamespace(**{**fields, **given}))

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "config.json").write_text("{}")
    check(model_name_or_path=str(tmp_path / "ckpt"), config_name=str(tmp_path / "config.json"))
    with pytest.raises(ValueError, match=r"--model_name_or_path '/no/such/dir': no such directory"):
        check(model_name_or_path="/no/such/dir")
    with pytest.raises(ValueError, match=r"--tokenizer_name '.*config.json' is a file"):
        check(tokenizer_name=str(tmp_path / "config.json"))
    (tmp_path / "models--org--cached").mkdir()  # a hub id in the cache is left to from_pretrained
    check(model_name_or_path="org/cached")


def test_logging_prints_each_datasets_record_once(example_env):
    """datasets' own handler is removed: its records print once, in the scripts' format."""
    code = (
        "import logging, datasets, script_utils\n"
        "script_utils.configure_logging(logging.INFO)\n"
        "datasets.utils.logging.get_logger('datasets.builder').info('probe record')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=example_env, cwd=EXAMPLES, capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S, check=True)
    log = proc.stdout + proc.stderr
    assert log.count("probe record") == 1, log
    assert re.search(r" - INFO - datasets\.builder - probe record", proc.stdout), log
