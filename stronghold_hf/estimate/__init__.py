"""Will it fit? Host and device bytes for STRONGHOLD training, next to plain training.

Before a run that takes hours to set up, a user wants to know whether a model trains on a
given GPU and host: STRONGHOLD moves every parameter's master, gradient and Adam state to CPU
RAM and keeps only a window of units on the device, so the question has two halves (CPU RAM
for the offloaded state, GPU memory for the window, the activations and the loss). This
package answers both from a config, by building the model on the meta device (exact parameter
counts, nothing allocated), or from a live model at start-up (`estimate_for_model`, what the
Trainer integration calls). It models what the engine does, unit by unit
(``discovery.plan_units``): the blocks, the large groups outside them that stream
(embeddings, LM heads), and the resident rest.

The modules, each importing only those above it in this list:

* ``counts.py``: the units of a model and what each costs; one layer's activations; the
  per-element costs and fixed allowances.
* ``report.py``: `Estimate`, the record of every byte count and verdict, and how it reads
  (its table, its does-not-fit error).
* ``budget.py``: the byte model's sums, from counted units to an `Estimate` (what ``"auto"``
  chooses, the largest window that fits, the device/host split).
* ``meta.py``: a config's model on the meta device.
* ``api.py``: `estimate` (from a config) and `estimate_for_model` (from a live model).
* ``cli.py``, ``__main__.py``: ``python -m stronghold_hf.estimate``.

This file only re-exports. Memory strings are parsed by `config.parse_memory` (re-exported
here), so that `StrongholdConfig` reads ``gpu_memory="20GB"`` without importing the
estimator. Sizes are binary throughout: ``GB``/``GiB`` both mean 2**30 (as nvidia-smi and a
"32 GB" V100 use it), ``MB``/``MiB`` 2**20. See docs/estimate.md for a hand-checked example.
"""

from ..config import parse_memory
from .api import available_cpu_memory_bytes, estimate, estimate_for_model
from .cli import main
from .counts import (
    ADAM_STATE_BYTES,
    CPU_PROCESS_BYTES,
    GPU_WORKSPACE_PERCENT,
    LOGIT_BYTES,
    GiB,
    MiB,
    _lean_adam_bytes,
    layer_activation_bytes,
)
from .meta import build_meta_model, load_config
from .report import Estimate, check_fits

__all__ = [
    "Estimate", "estimate", "estimate_for_model", "check_fits", "layer_activation_bytes", "parse_memory",
    "available_cpu_memory_bytes", "build_meta_model", "load_config", "main",
]
