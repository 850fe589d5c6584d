"""The README's two newcomer commands are the ones CI and the examples really run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)[:2]


def test_ci_runs_the_readme_test_command():
    main_job, test_cmd = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_cmd.strip() in ci.splitlines(), "README command (b) must appear verbatim as a line of .ci/run"
    assert "pytest" in test_cmd and "pip install" in test_cmd


def test_main_job_is_the_embedded_default_pretraining():
    main_job, _ = _readme_commands()
    assert main_job.strip().endswith("python examples/run_clm.py --stronghold")
    assert (ROOT / "examples" / "run_clm.py").is_file()
