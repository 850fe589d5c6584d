"""The README's two newcomer commands are the ones CI and the examples really run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    """(a) and (b), the README's first two bash blocks, and (c), the floor block further down."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)
    return [blocks[0], blocks[1], next(b for b in blocks if ".venv-floor" in b)]


def test_ci_runs_the_readme_test_command():
    main_job, test_cmd, _ = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_cmd.strip() in ci.splitlines(), "README command (b) must appear verbatim as a line of .ci/run"
    assert "pytest" in test_cmd and "pip install" in test_cmd


def test_ci_runs_the_floor_command_after_the_test_command():
    _, test_cmd, floor_cmd = _readme_commands()
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert floor_cmd.strip() in lines, "README command (c) must appear verbatim as a line of .ci/run"
    assert lines.index(floor_cmd.strip()) > lines.index(test_cmd.strip())
    # The environment pins the declared floors: the oldest releases pyproject admits.
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for name in ("transformers", "accelerate"):
        floor = re.search(rf'"{name}>=([\d.]+)"', pyproject).group(1)
        assert f'"{name}=={floor}.0"' in pyproject or f'"{name}=={floor}"' in pyproject, name
    paths = [t for t in floor_cmd.split("pytest -q", 1)[1].split(" -k ")[0].split() if t.endswith(".py")]
    assert paths, floor_cmd
    for path in paths:
        assert (ROOT / path).is_file(), path


def test_main_job_is_the_embedded_default_pretraining():
    main_job, _, _ = _readme_commands()
    assert main_job.strip().endswith("python examples/run_clm.py --stronghold")
    assert (ROOT / "examples" / "run_clm.py").is_file()
