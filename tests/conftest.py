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

#: Tests whose children measure peak RSS from outside (child_rss.py and the like): they run one
#: after another on one worker, never beside one another.
RSS_TESTS = (
    "peak_rss", "test_activation_peak_grows_as_measured", "test_resume_holds_the_optimizer_state_once",
    "test_bench_long_smoke",
)


def pytest_collection_modifyitems(config, items):
    # Parallel workers (pytest-xdist, --dist loadgroup): a module's tests stay on one worker, so
    # its module-scoped fixtures (a launch several tests read) run once; the RSS tests form one
    # group of their own. A test that shares no fixture with its module may name a group of its
    # own (``@pytest.mark.xdist_group``), so that a long module can be spread over both workers.
    for item in items:
        if any(name in item.name for name in RSS_TESTS):
            group = "rss"
        else:
            own = item.get_closest_marker("xdist_group")
            group = own.args[0] if own is not None else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
