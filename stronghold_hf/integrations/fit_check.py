"""The Trainer's fit check: a run that cannot fit is refused before the engine allocates anything.

`FitCheck` runs `stronghold_hf.estimate.estimate_for_model` with the Trainer's arguments (dtype,
gradient checkpointing, accumulation, batch size) and the run's `StrongholdConfig`, at the
sequence length actually trained: the arguments' length fields, else the first examples of a
map-style dataset, else the first batch (the device side then waits for it). Never at the
model's ``max_position_embeddings`` (131072 on Llama 3), which would refuse runs that fit.
The refusal is the estimate's own error (``Estimate.raise_if_not_fits``), which says what to
change.

It also settles two ``"auto"`` settings the estimate is the one to decide:

* ``offload_activations="auto"``: checkpointed activations go to host memory when only that
  makes the run fit;
* ``resident="auto"`` without ``gpu_memory``: the engine gets the device budget that this
  run's activations leave (the engine alone only knows a fixed reserve), or streams everything
  when only that fits.

Decisions flow one way: `FitCheck.at_start` returns the revised config before the engine is
built, and `FitCheck.on_first_batch` returns whether the engine must move activations to the
host; the Trainer applies them. The check never touches the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import random
import shutil
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ..config import StrongholdConfig

logger = logging.getLogger("stronghold_hf")
_hf_logger = logging.getLogger("transformers.trainer")  # the Trainer's verbosity decides

#: Argument fields that give the trained (encoder) sequence length, first match wins:
#: scripts' own ``max_seq_length``/``block_size``, TRL's ``max_length``, seq2seq ``max_source_length``.
_SEQ_LEN_FIELDS = ("max_seq_length", "max_length", "block_size", "max_source_length")
_DECODER_LEN_FIELDS = ("max_target_length", "generation_max_length")
#: How many leading examples of a map-style dataset the fit check reads for their length.
_PEEK_EXAMPLES = 32


class FitCheck:
    """The fit check of one Trainer's run; `config` is the run's config as the check left it.

    ``at_start`` checks what it can when the Trainer is built. When neither the arguments nor
    a map-style dataset tell the sequence length, the host side is checked then (it does not
    depend on the length) and the device side waits for the first batch (`pending`), with the
    memory measured at start, before the engine took its share.
    """

    def __init__(self, model: Any, args: Any, config: StrongholdConfig):
        self.config = config
        self._model = model
        self._args = args
        self._pending: tuple[int | None, int | None] | None = None  # (device, host) bytes measured at start
        self.activations_to_disk = False  # what on_first_batch decided for nvme_activations="auto"

    @property
    def pending(self) -> bool:
        """Whether the device side waits for the first batch."""
        return self._pending is not None

    def estimate(self, **shape: Any):
        """`estimate_for_model` for this run, at ``shape`` (``seq_len``, ``batch_size``...)."""
        # Looked up on the package at each call: tests cap the device memory by patching it there.
        from ..estimate import estimate_for_model

        cfg, args = self.config, self._args
        window = cfg.window_size
        return estimate_for_model(
            self._model,
            dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            gradient_checkpointing=bool(args.gradient_checkpointing),
            window_size=None if window == "auto" else int(window),
            grad_buffers=cfg.grad_buffers, offload_non_block=cfg.offload_non_block, chunked_loss=cfg.chunked_loss,
            offload_activations=cfg.offload_activations, loss_chunk_tokens=cfg.loss_chunk_tokens,
            host_memory=cfg.host_memory, host_image=cfg.host_image, host_grads=cfg.host_grads,
            gradient_accumulation_steps=args.gradient_accumulation_steps, resident=cfg.resident,
            resident_budget_bytes=cfg.gpu_memory, sequence_tiling=cfg.sequence_tiling, tile_tokens=cfg.tile_tokens,
            attention_tiling=cfg.attention_tiling, vocab_pieces=cfg.vocab_pieces,
            head_lent_whole=reads_head_whole(self._model, args), device_checkpoints=cfg.device_checkpoints,
            cpu_reserve=cfg.cpu_reserve, gpu_reserve=cfg.gpu_reserve, **_nvme_estimate_args(cfg), **shape,
        )

    def at_start(self, dataset: Any) -> StrongholdConfig:
        """Refuses a run that cannot fit; returns the config with the ``"auto"`` choices the
        estimate made (activation offload, the device budget of the split)."""
        seq_len, decoder_len = _trained_lengths(self._args, dataset, self._is_encoder_decoder())
        if seq_len is not None:
            est = self.estimate(seq_len=seq_len, decoder_seq_len=decoder_len,
                                batch_size=self._args.per_device_train_batch_size)
            est.raise_if_not_fits()
            if self._offloads_activations(est):
                self.config = self.config.replace(offload_activations=True)
            if self._activations_to_disk(est):
                self.config = self.config.replace(nvme_activations=True)
            self._adopt_split(est)
            return self.config
        est = self.estimate(seq_len=1, batch_size=1)
        dataclasses.replace(est, gpu_fits=None).raise_if_not_fits()
        self._pending = (est.gpu_memory_bytes, est.cpu_memory_bytes)
        return self.config

    def on_first_batch(self, inputs: Any) -> bool:
        """The device side at the first batch's shape, before its forward allocates anything.
        Returns whether checkpointed activations must now go to host memory."""
        gpu_memory, cpu_memory = self._pending
        self._pending = None
        # Trainers that build their batch inside training_step (TRL's GRPO gets a list of raw
        # rows and generates first) give nothing to size it by here.
        tokens = None
        if isinstance(inputs, Mapping):
            tokens = inputs.get("input_ids")
            if tokens is None:
                tokens = inputs.get("inputs_embeds")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            logger.warning("STRONGHOLD fit check skipped: the training batch has no input_ids to size it by.")
            return False
        decoder = inputs.get("labels") if self._is_encoder_decoder() else None
        est = self.estimate(
            seq_len=int(tokens.shape[1]), batch_size=int(tokens.shape[0]),
            decoder_seq_len=int(decoder.shape[-1]) if isinstance(decoder, torch.Tensor) and decoder.dim() >= 2 else None,
            gpu_memory_bytes=gpu_memory, cpu_memory_bytes=cpu_memory,
        )
        est.raise_if_not_fits()
        self.activations_to_disk = self._activations_to_disk(est)
        return self._offloads_activations(est)

    def _activations_to_disk(self, est) -> bool:
        """``nvme_activations="auto"``: the fit check decides (on when the host would not hold them)."""
        if self.config.nvme_activations != "auto" or not est.nvme_activations:
            return False
        _hf_logger.info("STRONGHOLD: checkpointed activations go on to the NVMe tier (the host would not hold them)")
        return True

    def _offloads_activations(self, est) -> bool:
        """``offload_activations="auto"``: the fit check decides (on when only that makes it fit)."""
        if self.config.offload_activations != "auto" or not est.offload_activations:
            return False
        _hf_logger.info("STRONGHOLD: checkpointed activations go to host memory (they would not fit on the device)")
        return True

    def _adopt_split(self, est) -> None:
        """``resident="auto"`` without ``gpu_memory``: the engine gets the budget the fit check
        found for the model once this run's activations are counted (the engine alone only
        knows a fixed reserve), or streams everything when only that fits."""
        cfg = self.config
        if cfg.resident != "auto" or cfg.gpu_memory is not None or est.gpu_memory_bytes is None:
            return
        if est.resident_units and est.resident_budget_bytes:
            _hf_logger.info(f"STRONGHOLD: the device/host split fills {est.resident_budget_bytes / 2**30:.2f} GiB of "
                            f"the device, what this run's activations leave: {est.split}")
            self.config = cfg.replace(gpu_memory=est.resident_budget_bytes)
        else:
            self.config = cfg.replace(resident=False)

    def _is_encoder_decoder(self) -> bool:
        return bool(getattr(getattr(self._model, "config", None), "is_encoder_decoder", False))


def reads_head_whole(model: Any, args: Any) -> bool:
    """Whether the run's training forward reads the LM head's weight itself, so that the engine
    lends the head whole to the device (`VocabularyPieces.lend_whole`): a TRL trainer's fused
    LM head (``add_fused_lm_head`` gives the model, or PEFT's base model, a ``forward`` taking
    ``fused_lm_head``), or Liger's fused linear cross-entropy (``use_liger_kernel`` without
    ``liger_kernel_config={"fused_linear_cross_entropy": False}``, or a forward of Liger's put on
    the model or its class by hand, ``apply_liger_kernel_to_*``)."""
    if getattr(args, "use_liger_kernel", False) and (getattr(args, "liger_kernel_config", None) or {}).get(
            "fused_linear_cross_entropy", True):
        return True
    models = [model]
    if callable(getattr(model, "get_base_model", None)):
        models.append(model.get_base_model())
    for m in models:
        own = getattr(m, "__dict__", {}).get("forward")
        owner = next((c for c in type(m).__mro__ if "forward" in c.__dict__), None)
        for forward in (own, owner.__dict__["forward"] if owner is not None else None):
            fn = getattr(forward, "__func__", forward)
            if fn is None:
                continue
            code = getattr(fn, "__code__", None)
            if code is not None and "fused_lm_head" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
                return True
            if (getattr(inspect.unwrap(fn), "__module__", None) or "").startswith("liger_kernel"):
                return True
    return False


def _positive_int_field(args: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@contextlib.contextmanager
def _rng_untouched():
    """Restores the host RNGs, so a dataset whose ``__getitem__`` draws randomness (random
    crops, masking) is read without shifting what the training run draws later."""
    py_state = random.getstate()
    np = sys.modules.get("numpy")  # only if the process uses it already
    np_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            if np_state is not None:
                np.random.set_state(np_state)


def _dataset_lengths(dataset: Any, encoder_decoder: bool) -> tuple[int | None, int | None]:
    """The longest ``input_ids`` (and, for encoder-decoder models, ``labels``) among the first
    examples of a map-style dataset; ``(None, None)`` when that cannot be read without
    iterating (an iterable dataset) or the examples carry no ``input_ids``."""
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return None, None
    try:
        count = min(len(dataset), _PEEK_EXAMPLES)
    except TypeError:  # no __len__: iterable in all but name
        return None, None
    seq = dec = 0
    with _rng_untouched():
        for i in range(count):
            example = dataset[i]
            ids = example.get("input_ids") if isinstance(example, Mapping) else None
            if ids is None:
                return None, None
            seq = max(seq, len(ids))
            labels = example.get("labels") if encoder_decoder else None
            if labels is not None and hasattr(labels, "__len__"):
                dec = max(dec, len(labels))
    return (seq or None), (dec or None)


def _trained_lengths(args: Any, dataset: Any, encoder_decoder: bool) -> tuple[int | None, int | None]:
    """``(sequence length, decoder length)`` the run trains with: from the arguments' length
    fields when set, else from the dataset's first examples, else ``(None, None)``."""
    seq = _positive_int_field(args, _SEQ_LEN_FIELDS)
    dec = _positive_int_field(args, _DECODER_LEN_FIELDS) if encoder_decoder else None
    if seq is None:
        seq, data_dec = _dataset_lengths(dataset, encoder_decoder)
        dec = dec or data_dec
    return seq, dec


def _nvme_estimate_args(cfg: StrongholdConfig) -> dict[str, Any]:
    """With ``nvme_path`` the moments (and with ``nvme_masters`` the masters) are on disk: the fit
    check counts the ring, and the disk's free space."""
    if cfg.nvme_path is None:
        return dict(nvme=False, nvme_masters=False, nvme_activations=False)
    probe = cfg.nvme_path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:  # created at the first step
        probe = os.path.dirname(probe)
    return dict(nvme=True, nvme_memory_bytes=shutil.disk_usage(probe).free, nvme_ring_buffers=cfg.nvme_ring_buffers,
                nvme_masters=cfg.nvme_masters, nvme_activations=cfg.nvme_activations)
