"""Running the example scripts in subprocesses, as a user runs them: shared by the example tests.

`example_env` builds the environment once per test session, whichever test module asks first:
offline (``HF_HUB_OFFLINE=1``), a private ``HF_HOME``, and the embedded assets (a small corpus,
the tokenizers, the fine-tuning tasks) built once in a cache every subprocess shares.
`run_script` runs one script and returns its ``all_results.json``, after checking that the
stronghold engine took the model exactly when ``--stronghold`` was passed and that no log record
was printed twice.
"""

from __future__ import annotations

import json
import math
import os
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
# No num_decoder_layers: the decoder follows num_layers (2 + 2 blocks).
TINY_T5 = ["--config_overrides", "d_model=32,d_ff=64,d_kv=16,num_heads=2,num_layers=2"]
# With 2 blocks (T5: 2 + 2) a window of 1 makes the engine stream and evict blocks.
STRONGHOLD = ["--stronghold", "--stronghold_window_size", "1"]
SHORT = ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--logging_steps", "1"]

_ENV: dict[str, str] | None = None


def example_env(tmp_path_factory) -> dict[str, str]:
    """Environment for the subprocesses, with the embedded assets built once for the session."""
    global _ENV
    if _ENV is not None:
        return dict(_ENV)
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
        # CI services set CI=true, and transformers then propagates its records to the root
        # logger; the scripts must still print each record once, so every run here sets it too.
        CI="true",
    )
    # Build the corpus, the three tokenizers and the fine-tuning tasks once, in a subprocess so
    # the test process's environment stays untouched.
    build = (
        "import embedded_default as e; e.text_files(); e.topic_classification_files(); "
        "e.docstring_summary_files(); [e.tokenizer_dir(k) for k in ('gpt', 'bert', 't5')]"
    )
    subprocess.run([sys.executable, "-c", build], env=env, cwd=EXAMPLES, check=True, timeout=SCRIPT_TIMEOUT_S)
    env["_TEST_ROOT"] = str(root)
    _ENV = env
    return dict(env)


def assert_each_record_once(log: str) -> None:
    """No ``datasets`` log record is printed twice (formatted, and again bare by datasets' own handler)."""
    lines = {line.strip() for line in log.splitlines()}
    records = re.findall(r" - (?:DEBUG|INFO|WARNING|ERROR) - datasets[\w.]* - (.+)", log)
    repeated = [message for message in records if message.strip() in lines]
    assert not repeated, f"datasets records printed twice: {repeated[:3]}"


def run_script(env: dict, script: str, output_dir: Path, *args: str) -> dict:
    """Runs ``examples/<script>`` with ``args``; returns its ``all_results.json``.

    With ``--stronghold`` it also checks that the engine really took the model: the Trainer's
    start line says ``STRONGHOLD is on: <n> blocks, window of <W>``, once (a script without a
    Trainer shows the engine's own ``stronghold: <n> blocks ..., window_size=<W>``).
    """
    cmd = [sys.executable, str(EXAMPLES / script), "--output_dir", str(output_dir), *args]
    proc = subprocess.run(cmd, env=env, cwd=output_dir.parent, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    log = proc.stdout + proc.stderr
    starts = re.findall(r"STRONGHOLD is on: \d+ blocks, window of (\d+)", log)
    engine_line = re.search(r"stronghold: \d+ blocks .*window_size=(\d+)", log)
    if "--stronghold" in args:
        assert starts == ["1"] or (not starts and engine_line and engine_line.group(1) == "1"), (
            f"no single STRONGHOLD start line:\n{log[-4000:]}")
    else:
        assert not starts and engine_line is None, (starts, engine_line)
    assert_each_record_once(log)
    with open(output_dir / "all_results.json") as fh:
        return json.load(fh)


def run_failing(env: dict, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Runs ``examples/<script>`` expecting it to fail; returns the finished process."""
    cmd = [sys.executable, str(EXAMPLES / script), *args]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode != 0, f"{' '.join(cmd)} succeeded:\n{proc.stdout[-2000:]}"
    return proc


def assert_saved_checkpoint(output_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (output_dir / name).is_file(), f"{name} missing from {output_dir}"


def assert_finite(results: dict, *keys: str) -> None:
    for key in keys:
        assert key in results, f"{key} missing from all_results.json: {sorted(results)}"
        assert math.isfinite(results[key]), f"{key}={results[key]}"
