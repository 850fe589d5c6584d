"""Test-wide settings: offline, deterministic, quiet, and GPU tests skipped without CUDA."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """A Trainer leaves accelerate's process-wide state behind (bf16 mixed precision after a
    bf16 test), which a later plain ``Accelerator()`` in the same process would inherit."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores (README (b)'s -n 2): one torch thread each, not two apiece.
    torch.set_num_threads(1)

#: Tests that assert what children measure of peak RSS from outside (child_rss.py and the like):
#: they run one after another on one worker, never beside one another. (bench_long's smoke run
#: measures RSS too, but asserts only its plumbing, so it may run beside them.)
RSS_TESTS = (
    "peak_rss", "test_activation_peak_grows_as_measured", "test_resume_holds_the_optimizer_state_once",
    "test_attention_tiled_peak_grows_as_measured",
)


def _shares_a_module_fixture(item) -> bool:
    """Whether ``item`` uses a fixture made once per module (a launch several tests read)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope in ("module", "package", "class") for defs in info.name2fixturedefs.values() for d in defs)


def _name_the_group_in_the_nodeid(config, item, group: str) -> None:
    """``--dist loadgroup`` schedules by a ``@group`` suffix of the node id, which pytest-xdist
    (3.8) writes into ``item._nodeid``. pytest 9 keeps the id in ``item._id`` instead, so that
    write no longer takes and every test was scheduled alone: a module's launches ran once per
    worker, and the peak-RSS tests side by side. On such a pytest the suffix goes into ``_id``."""
    if not config.getoption("loadgroup", False) or not hasattr(item, "_id"):
        return
    from _pytest.nodes import NodeId

    if "@" not in item.nodeid.rpartition("]")[2]:
        item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    # Parallel workers (pytest-xdist, --dist loadgroup): the tests of a module that share a
    # module-scoped fixture stay on one worker, so the fixture runs once; the RSS tests form one
    # group of their own; every other test is a unit of its own, so the two workers balance by
    # test, not by module. A test may also name its group (``@pytest.mark.xdist_group``).
    for item in items:
        if any(name in item.name for name in RSS_TESTS):
            group = "rss"
        else:
            own = item.get_closest_marker("xdist_group")
            if own is not None:
                group = own.args[0]
            elif _shares_a_module_fixture(item):
                group = item.module.__name__
            else:
                continue
        item.add_marker(pytest.mark.xdist_group(group))
        _name_the_group_in_the_nodeid(config, item, group)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
