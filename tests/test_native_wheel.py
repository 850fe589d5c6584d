"""The native kernels' C++ sources ship in the wheel, and an installed wheel builds and runs them.

The kernels are compiled on first use from ``stronghold_hf/optim/csrc`` (optim/native.py), so a
wheel without those files installs fine and then silently takes the torch paths. This builds a
wheel of the repository, checks that it holds every file of ``csrc``, installs it into a fresh
venv, and there compiles CPUAdam's kernel into an empty cache and takes one native step
against ``torch.optim.AdamW``.

The wheel is built from a copy of the repository root (build outputs left out): building in the
working tree itself writes ``build/`` and the ``egg-info`` the editable install reads, and
setuptools' ``build/lib`` keeps files since deleted from the tree, which would then be in the
wheel. The venv sees the system site-packages (for torch), where the repository's editable
install also lives, so the child runs isolated (``-I``) from outside the repository and asserts
that it imported the venv's copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from stronghold_hf.optim import cpu_adam

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "stronghold_hf" / "optim" / "csrc"
#: Build outputs and local state: never part of what a wheel is built from.
NOT_SOURCES = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".venv*",
                                     ".whl", "outputs", "out", "runs", ".benchmarks")

CHILD = r"""
import json, os, sys
from pathlib import Path

import torch

import stronghold_hf
from stronghold_hf.optim import CPUAdam, cpu_adam, native

torch.manual_seed(0)
p = torch.randn(1000, 37)  # fp32, not a multiple of 16 elements: the vector body and the scalar tail
g = torch.randn_like(p)
ref = p.clone().requires_grad_(True)
ref.grad = g.clone()
torch.optim.AdamW([ref], lr=1e-3, weight_decay=1e-2, foreach=False).step()
opt = CPUAdam([p], lr=1e-3, weight_decay=1e-2, kernel="native")
p.grad = g
opt.step()
print(json.dumps({
    "module": stronghold_hf.__file__, "csrc": str(native.CSRC), "csrc_files": sorted(f.name for f in native.CSRC.iterdir()),
    "native_error": cpu_adam.native_kernel_error(), "kernel": opt.kernel,
    "built": sorted(f.name for f in Path(os.environ["STRONGHOLD_CACHE_DIR"]).iterdir()),
    "max_abs_diff": (p - ref.detach()).abs().max().item(),
}))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.skipif(cpu_adam.native_kernel_error() is not None,
                    reason=f"the native kernel does not build here: {cpu_adam.native_kernel_error()}")
def test_wheel_ships_the_kernel_sources_and_builds_them(tmp_path):
    pytest.importorskip("setuptools", minversion="64", reason="--no-build-isolation builds with this environment's "
                        "setuptools (pyproject.toml's build requirement), and there is none >= 64")
    src, dist = tmp_path / "src", tmp_path / "dist"
    shutil.copytree(REPO, src, ignore=NOT_SOURCES)
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist)], cwd=src)
    (wheel,) = dist.glob("stronghold_hf-*.whl")
    expected = sorted(f.name for f in CSRC.iterdir() if f.is_file())
    assert {"common.h", "adam_step.h", "cpu_adam.cpp", "cpu_adam8.cpp", "adam_undo.cpp"} <= set(expected)
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n: zf.read(n) for n in zf.namelist() if n.startswith("stronghold_hf/optim/csrc/")}
    assert sorted(Path(n).name for n in shipped) == expected
    for name, data in shipped.items():
        assert data == (CSRC / Path(name).name).read_bytes(), name

    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)  # torch comes from the system
    python = env_dir / "bin" / "python"
    # The system's pip, run by the venv's python, installs into the venv.
    # --ignore-installed: the editable install of this checkout is visible through the system
    # site-packages at the same version, and pip would otherwise call the wheel satisfied.
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)],
         cwd=tmp_path)
    cache = tmp_path / "cache"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    child_env.update(STRONGHOLD_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    out = _run([str(python), "-I", "-c", CHILD], cwd=tmp_path, env=child_env).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print(json.dumps({"wheel": wheel.name, "bytes": wheel.stat().st_size, "csrc_in_wheel": sorted(shipped), **result}))

    site = (env_dir / "lib").resolve()
    assert Path(result["module"]).resolve().is_relative_to(site), result["module"]  # not the editable install
    assert Path(result["csrc"]).resolve().is_relative_to(site)
    assert result["csrc_files"] == expected
    assert result["native_error"] is None and result["kernel"] == "native"
    assert any(n.startswith("cpu_adam-") and n.endswith(".so") for n in result["built"]), result["built"]
    assert result["max_abs_diff"] <= 1e-6
