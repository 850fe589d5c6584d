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
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

#: Small enough that tokenizer training takes about a second, large enough for a few hundred
#: 32-token blocks in the train split and a dozen in validation.
CORPUS_BYTES = "120000"
SCRIPT_TIMEOUT_S = 300

TINY_GPT = ["--config_overrides", "n_layer=2,n_embd=32,n_head=2", "--block_size", "32"]
TINY_BERT = ["--config_overrides", "num_hidden_layers=2,hidden_size=64,num_attention_heads=2,intermediate_size=128"]
TINY_T5 = ["--config_overrides", "d_model=32,d_ff=64,d_kv=16,num_heads=2,num_layers=2,num_decoder_layers=2"]
# With 2 blocks (T5: 2 + 2) a window of 1 makes the engine stream and evict blocks.
STRONGHOLD = ["--stronghold", "--stronghold_window_size", "1"]
SHORT = ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--logging_steps", "1"]


@pytest.fixture(scope="session")
def example_env(tmp_path_factory):
    """Environment for the subprocesses, with the embedded assets built once for the session."""
    root = tmp_path_factory.mktemp("examples")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRONGHOLD")}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(root / "hf_home"),
        STRONGHOLD_EXAMPLES_CACHE=str(root / "cache"),
        STRONGHOLD_EXAMPLES_CORPUS_BYTES=CORPUS_BYTES,
        TOKENIZERS_PARALLELISM="false",
        # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP
        # oversubscription makes them several times slower.
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    # Build the corpus, the three tokenizers and the topic task once, in a subprocess so the
    # test process's environment stays untouched.
    build = (
        "import embedded_default as e; e.text_files(); e.topic_classification_files(); "
        "[e.tokenizer_dir(k) for k in ('gpt', 'bert', 't5')]"
    )
    subprocess.run([sys.executable, "-c", build], env=env, cwd=EXAMPLES, check=True, timeout=SCRIPT_TIMEOUT_S)
    env["_TEST_ROOT"] = str(root)
    return env


def run_script(env: dict, script: str, output_dir: Path, *args: str) -> dict:
    """Runs ``examples/<script>`` with ``args``; returns its ``all_results.json``.

    With ``--stronghold`` it also checks that the engine really took the model: it logs
    ``stronghold: <n> blocks ..., window_size=<W>`` when it offloads.
    """
    cmd = [sys.executable, str(EXAMPLES / script), "--output_dir", str(output_dir), *args]
    proc = subprocess.run(cmd, env=env, cwd=output_dir.parent, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    log = proc.stdout + proc.stderr
    engine_line = re.search(r"stronghold: \d+ blocks .*window_size=(\d+)", log)
    if "--stronghold" in args:
        assert engine_line and engine_line.group(1) == "1", f"no stronghold engine log line:\n{log[-4000:]}"
    else:
        assert engine_line is None, engine_line.group(0)
    with open(output_dir / "all_results.json") as fh:
        return json.load(fh)


def assert_saved_checkpoint(output_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (output_dir / name).is_file(), f"{name} missing from {output_dir}"


def assert_finite(results: dict, *keys: str) -> None:
    for key in keys:
        assert key in results, f"{key} missing from all_results.json: {sorted(results)}"
        assert math.isfinite(results[key]), f"{key}={results[key]}"


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


@pytest.mark.parametrize("stronghold", [False, True], ids=_mode)
def test_run_t5_mlm(example_env, tmp_path, stronghold):
    out = tmp_path / "t5"
    args = TINY_T5 + SHORT + ["--max_seq_length", "32", "--max_steps", "4", "--max_eval_samples", "8"]
    results = run_script(example_env, "run_t5_mlm.py", out, *args + (STRONGHOLD if stronghold else []))
    assert_finite(results, "train_loss", "eval_loss")
    assert_saved_checkpoint(out)

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.num_layers == 2 and tokenizer.convert_tokens_to_ids("<extra_id_99>") < model.config.vocab_size


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
