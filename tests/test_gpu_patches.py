"""The GPU tests' patches keep up with the library, checked on CPU.

tests/test_gpu.py swaps library functions for slow ones (delay injection). Those tests run only
on a GPU machine, so a replacement that falls behind its original's signature fails only there:
the H200 run of 2026-12-04 lost its delay test to a ``copy_d2h`` replacement without the
``continues`` parameter gradient staging had added. Here, on every machine, each replacement
listed in ``test_gpu.PATCHES`` must take exactly its original's parameters, and test_gpu.py must
patch nothing outside that list (see [Note: patched functions] there).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import test_gpu

GPU_TESTS = Path(test_gpu.__file__)


def _parameters(fn) -> list[tuple[str, object, bool]]:
    """(name, kind, has a default) of each parameter; annotations do not matter to a caller."""
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(fn).parameters.values()]


def _mismatch(original, replacement) -> str | None:
    want, got = _parameters(original), _parameters(replacement)
    if want == got:
        return None
    return f"{replacement.__qualname__}{inspect.signature(replacement)} replaces {original.__qualname__}{inspect.signature(original)}"


def _patch_list():
    return [(name, owner, attr, fn) for name, entries in test_gpu.PATCHES.items() for owner, attr, fn in entries]


@pytest.mark.parametrize("name,owner,attr,replacement", _patch_list(),
                         ids=[f"{n}:{o.__name__}.{a}" for n, o, a, _ in _patch_list()])
def test_replacement_has_the_signature_of_the_original(name, owner, attr, replacement):
    original = inspect.getattr_static(owner, attr)
    assert callable(original), f"{owner.__name__}.{attr} is gone; update PATCHES[{name!r}] in tests/test_gpu.py"
    problem = _mismatch(original, replacement)
    assert problem is None, f"PATCHES[{name!r}]: {problem}; give the replacement the original's parameters"


def test_a_stale_replacement_is_caught():
    """The check would have failed on the replacement the H200 run tripped over."""
    from stronghold_hf.transfer import TransferContext

    def old_slow_d2h(self, dst, src):
        return None

    assert _mismatch(TransferContext.copy_d2h, old_slow_d2h) is not None
    assert _mismatch(TransferContext.copy_d2h, test_gpu._late_d2h) is None


def test_gpu_tests_patch_only_through_the_list():
    """Every ``setattr`` in test_gpu.py sits in ``apply_patches``, which applies PATCHES only."""
    tree = ast.parse(GPU_TESTS.read_text(encoding="utf-8"))
    outside = []

    def visit(node, function=None):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in ("setattr", "patch", "patch.object", "setitem") and function != "apply_patches":
                outside.append(f"line {node.lineno} in {function}: {ast.unparse(node)[:80]}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree)
    assert not outside, ("patch through PATCHES and apply_patches in tests/test_gpu.py, so that "
                         f"tests/test_gpu_patches.py checks the signatures: {outside}")
    assert _patch_list(), "test_gpu.PATCHES is empty: nothing would be checked"
