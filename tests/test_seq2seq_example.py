"""Text-to-text fine-tuning: the local ROUGE metric, the embedded task and ``run_seq2seq.py`` end to end.

The end-to-end test is the path the user guide describes: ``run_t5_mlm.py --stronghold``
pretrains a tiny T5, ``run_seq2seq.py --stronghold --model_name_or_path <it>`` fine-tunes it on the
embedded docstring-summary task, and ROUGE-L (with generation) must rise well above that of the
pretrained model, which emits only span-corruption sentinels.
"""

from __future__ import annotations

import csv
import json

import pytest

from examples_harness import (
    CORPUS_BYTES,
    STRONGHOLD,
    TINY_T5,
    assert_finite,
    assert_saved_checkpoint,
    run_failing,
    run_script,
)
from examples_harness import example_env as _example_env

ROUGE_KEYS = ("eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_rougeLsum", "eval_gen_len")


@pytest.fixture(scope="session")
def example_env(tmp_path_factory):
    return _example_env(tmp_path_factory)


@pytest.fixture(scope="module")
def rouge(example_env):
    import script_utils

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", example_env["HF_HOME"])
        yield script_utils.load_metric("rouge")


# --------------------------------------------------------------------------------------- ROUGE
def test_rouge_scores_by_hand(rouge):
    # candidate a b c d e f (6 tokens), reference a c b d f (5 tokens):
    # unigrams: 5 shared -> P 5/6, R 1 -> F 10/11; bigrams: none shared;
    # LCS a c d f (or a b d f) = 4 -> P 4/6, R 4/5 -> F 8/11.
    scores = rouge.compute(predictions=["A, b; c-d e_f!"], references=["a c b d f"], use_aggregator=False,
                           rouge_types=["rouge1", "rouge2", "rougeL"])
    assert scores["rouge1"][0] == pytest.approx(10 / 11)
    assert scores["rouge2"][0] == 0.0
    assert scores["rougeL"][0] == pytest.approx(8 / 11)
    # Summary level: reference sentences (a c), (b d f); candidate sentences (a b c d), (e f).
    # Union LCS hits: a c from the first, b d and f from the second -> 5 of 6 candidate tokens.
    lsum = rouge.compute(predictions=["a b c d\ne f"], references=["a c\nb d f"], rouge_types=["rougeLsum", "rougeL"])
    assert lsum["rougeLsum"] == pytest.approx(10 / 11)
    assert lsum["rougeL"] == pytest.approx(8 / 11)  # rougeL ignores the line breaks


def test_rouge_clipping_aggregation_and_references(rouge):
    # "the the the" vs "the cat": one "the" matches (clipped), P 1/3, R 1/2 -> F 0.4.
    assert rouge.compute(predictions=["the the the"], references=["the cat"], rouge_types=["rouge1"]) == {
        "rouge1": pytest.approx(0.4)
    }
    # Two examples, the mean; several references, the best one per example.
    both = rouge.compute(predictions=["x y", "p q r"], references=[["x z", "x y"], "s t"], rouge_types=["rouge2"])
    assert both["rouge2"] == pytest.approx((1.0 + 0.0) / 2)
    empty = rouge.compute(predictions=["", "a"], references=["a", ""], use_aggregator=False)
    assert all(v == [0.0, 0.0] for v in empty.values())
    with pytest.raises(ValueError, match="use_stemmer=True needs NLTK"):
        rouge.compute(predictions=["a"], references=["a"], use_stemmer=True)
    with pytest.raises(ValueError, match=r"rouge_types \['rouge3'\] are not supported"):
        rouge.compute(predictions=["a"], references=["a"], rouge_types=["rouge3"])


# ------------------------------------------------------------------------------ embedded task
def test_docstring_summary_task(example_env, monkeypatch):
    import embedded_default

    assert embedded_default.first_sentence_pair(
        "Return the payload as a string. The value is decoded first.\nRaises ValueError when it is empty."
    ) == ("The value is decoded first. Raises ValueError when it is empty.", "Return the payload as a string.")
    assert embedded_default.first_sentence_pair("Return self, e.g. the thing. Then more words here for the model to read.") == (
        "Then more words here for the model to read.", "Return self, e.g. the thing."
    )
    assert embedded_default.first_sentence_pair("Only a summary line here.") is None  # no source

    monkeypatch.setenv(embedded_default.CACHE_ENV, example_env[embedded_default.CACHE_ENV])
    monkeypatch.setenv(embedded_default.CORPUS_BYTES_ENV, CORPUS_BYTES)
    files = embedded_default.docstring_summary_files()
    rows = {}
    for split, path in files.items():
        with open(path, newline="", encoding="utf-8") as fh:
            rows[split] = list(csv.DictReader(fh))
    # The task reads at least SUMMARY_MIN_CORPUS_BYTES, so the small test corpus does not shrink it.
    assert 1000 < len(rows["train"]) + len(rows["validation"]) <= embedded_default.SUMMARY_MAX_PAIRS
    assert len(rows["validation"]) >= 100
    for row in rows["train"] + rows["validation"]:
        assert 3 <= len(row["summary"].split()) <= embedded_default.SUMMARY_MAX_TARGET_WORDS
        assert embedded_default.SUMMARY_MIN_SOURCE_WORDS <= len(row["text"].split()) <= embedded_default.SUMMARY_MAX_SOURCE_WORDS
    # Split by summary: a summary shared by several docstrings never sits on both sides.
    assert not {r["summary"] for r in rows["train"]} & {r["summary"] for r in rows["validation"]}
    assert embedded_default.docstring_summary_files() == files  # cached


def test_seq2seq_defaults_make_a_generating_run():
    import run_seq2seq
    import script_utils
    from transformers import HfArgumentParser

    from stronghold_hf import StrongholdSeq2SeqTrainingArguments

    parser = HfArgumentParser((run_seq2seq.ModelArguments, run_seq2seq.DataTrainingArguments,
                               StrongholdSeq2SeqTrainingArguments))
    defaults = script_utils.standard_defaults("run_seq2seq") + run_seq2seq.EMBEDDED_DEFAULTS
    (model, data, args), _, embedded = script_utils.parse_args(parser, defaults, data_flags=run_seq2seq.DATA_FLAGS,
                                                               argv=["--stronghold"])
    assert embedded and args.stronghold and args.do_train and args.do_eval and args.predict_with_generate
    assert data.source_prefix == "summarize: " and data.val_max_target_length == data.max_target_length == 48
    assert model.model_name_or_path is None and args.output_dir == "outputs/run_seq2seq"

    argv = ["--train_file", "t.csv", "--val_max_target_length", "20", "--output_dir", "o"]
    (_, data, args), _, embedded = script_utils.parse_args(parser, defaults, data_flags=run_seq2seq.DATA_FLAGS, argv=argv)
    assert not embedded and not args.predict_with_generate and data.source_prefix is None
    assert (data.max_source_length, data.max_target_length, data.val_max_target_length) == (1024, 128, 20)
    with pytest.raises(ValueError, match=r"--train_file 'a.txt': use a .csv or .json\(l\) file"):
        parser.parse_args_into_dataclasses(args=["--train_file", "a.txt", "--output_dir", "o"])


# ----------------------------------------------------------------------------- the script
def test_run_seq2seq_embedded_t5(example_env, tmp_path):
    """No model argument: a T5 from the embedded config and tokenizer, trained, evaluated, predicting."""
    out = tmp_path / "s2s"
    results = run_script(
        example_env, "run_seq2seq.py", out, *TINY_T5, "--max_steps", "4", "--max_eval_samples", "8",
        "--per_device_train_batch_size", "4", "--do_train", "--do_eval", "--do_predict", "--max_predict_samples", "5",
        *STRONGHOLD,
    )
    assert_finite(results, "train_loss", "eval_loss", "predict_loss", *ROUGE_KEYS)
    assert results["eval_samples"] == 8 and results["predict_samples"] == 5
    assert_saved_checkpoint(out)
    assert len((out / "generated_predictions.txt").read_text(encoding="utf-8").splitlines()) == 5
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["T5ForConditionalGeneration"]
    assert (config["num_layers"], config["num_decoder_layers"], config["decoder_start_token_id"]) == (2, 2, 0)


def test_run_seq2seq_bart_through_the_same_code(example_env, tmp_path):
    """``--model_type bart`` with the embedded tokenizer, then its output as ``--model_name_or_path``."""
    tiny_bart = ("d_model=32,encoder_layers=2,decoder_layers=2,encoder_attention_heads=2,decoder_attention_heads=2,"
                 "encoder_ffn_dim=64,decoder_ffn_dim=64,max_position_embeddings=128")
    out = tmp_path / "bart"
    results = run_script(example_env, "run_seq2seq.py", out, "--model_type", "bart", "--config_overrides", tiny_bart,
                         "--max_steps", "4", "--max_eval_samples", "8", *STRONGHOLD)
    assert_finite(results, "train_loss", "eval_loss", *ROUGE_KEYS)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BartForConditionalGeneration"]
    assert config["decoder_start_token_id"] == config["eos_token_id"] == 1  # the embedded tokenizer's </s>

    again = run_script(example_env, "run_seq2seq.py", tmp_path / "bart_predict", "--model_name_or_path", str(out),
                       "--do_predict", "--max_predict_samples", "6", "--max_source_length", "64")
    assert again["predict_samples"] == 6 and "predict_rougeL" in again and "train_loss" not in again


def test_run_seq2seq_refuses_bad_models_and_columns(example_env, tmp_path):
    proc = run_failing(example_env, "run_seq2seq.py", "--model_type", "gpt2", "--output_dir", str(tmp_path / "a"),
                       cwd=tmp_path)
    assert "needs an encoder-decoder model (T5, BART, ...); 'gpt2' is not one" in proc.stderr, proc.stderr[-3000:]
    proc = run_failing(example_env, "run_seq2seq.py", *TINY_T5, "--summary_column", "title",
                       "--output_dir", str(tmp_path / "b"), cwd=tmp_path)
    assert "--summary_column 'title' is not a column of the data; it has ['text', 'summary']" in proc.stderr, (
        proc.stderr[-3000:]
    )


# ------------------------------------------------------------------------ pretrain -> fine-tune
TINY_T5_64 = ["--config_overrides", "d_model=64,d_ff=128,d_kv=16,num_heads=4,num_layers=2"]
SEQ2SEQ_EVAL = ["--max_source_length", "64", "--val_max_target_length", "32", "--max_eval_samples", "200"]
#: ROUGE-L is in percent (HF's convention). Measured with these settings (150 pretraining steps,
#: 350 fine-tuning steps) on seeds 1, 7 and 42 with --stronghold: 0.0 before fine-tuning (the
#: span-corruption model emits sentinels, which decode to nothing) and 11.1-12.6 after, eval loss
#: 7.7-8.0 -> 5.8-5.9, the model having learned the commonest openings ("Return the ..."); twice
#: the steps (300 and 600) gave 9.8-12.7 on six seeds. ROUGE of a model this barely trained moves
#: with the last digits of its weights: one CI run (2026-12-06, the machine loaded by the other
#: worker) ended at an eval loss of 5.859, inside the range above, with ROUGE-L 4.69; the same
#: commit alone gave 11.2 (5.863), and beside a CPU hog 11.8 (5.865). A gain of 2 points still
#: separates learning from not learning (a model that did not learn the task stays near 0); the
#: eval loss below is the steadier check.
MIN_ROUGE_L_GAIN = 2.0


@pytest.mark.slow
def test_pretrain_t5_then_finetune_seq2seq(example_env, tmp_path):
    pretrained = tmp_path / "t5_pretrained"
    run_script(example_env, "run_t5_mlm.py", pretrained, *TINY_T5_64, "--max_steps", "150", "--max_seq_length", "64",
               "--per_device_train_batch_size", "16", "--max_eval_samples", "32", "--logging_steps", "50", *STRONGHOLD)

    before = run_script(example_env, "run_seq2seq.py", tmp_path / "before", "--model_name_or_path", str(pretrained),
                        "--do_eval", *SEQ2SEQ_EVAL)
    after = run_script(
        example_env, "run_seq2seq.py", tmp_path / "after", "--model_name_or_path", str(pretrained),
        "--max_steps", "350", "--learning_rate", "3e-3", "--per_device_train_batch_size", "16", "--logging_steps", "100",
        "--do_train", "--do_eval", "--do_predict", "--max_predict_samples", "16", *SEQ2SEQ_EVAL, *STRONGHOLD,
    )
    print(f"ROUGE-L before {before['eval_rougeL']}, after {after['eval_rougeL']}; "
          f"eval_loss before {before['eval_loss']:.3f}, after {after['eval_loss']:.3f}")
    assert before["eval_samples"] == after["eval_samples"] == 200
    assert after["eval_rougeL"] - before["eval_rougeL"] >= MIN_ROUGE_L_GAIN, (before, after)
    assert after["eval_loss"] < before["eval_loss"] - 1.0, (before, after)
    assert 0 < after["eval_gen_len"] <= 32
    predictions = (tmp_path / "after" / "generated_predictions.txt").read_text(encoding="utf-8").splitlines()
    assert len(predictions) == 16 and sum(bool(p.strip()) for p in predictions) >= 12
