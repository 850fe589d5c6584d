"""What an estimate reports and how it reads: `Estimate`, its table, its does-not-fit error.

`Estimate` is the record the byte model fills (budget.py): every byte count on the host, the
NVMe tier and the GPU, for STRONGHOLD and for plain training, and the verdicts. Reading it is
kept next to it: `Estimate.table` (what the CLI prints), `Estimate.raise_if_not_fits` (the
numbers and what to change, which the Trainer's start-up check raises) and `check_fits`. It
computes nothing; it imports only the constants its labels name (counts.py), so the budget
imports it and not the other way round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .counts import (
    ADAM_STATE_BYTES, GPU_WORKSPACE_PERCENT, GiB, MiB, _NBYTES, _gib,
)


@dataclass(frozen=True, slots=True)
class Estimate:
    """Byte counts for STRONGHOLD and for plain training; ``None`` means "not checked"."""

    model_name: str
    seq_len: int
    batch_size: int
    dtype: str
    gradient_checkpointing: bool
    window_size: int
    window_size_requested: int | str
    num_blocks: int
    block_params: int
    resident_params: int  # parameters outside the blocks (embeddings, norms, heads)
    total_params: int
    largest_block_params: int
    offload_non_block: bool
    chunked_loss: bool  # the chunked loss computes this model's training loss
    offload_activations: bool
    # CPU side (STRONGHOLD)
    cpu_master_bytes: int
    cpu_adam_bytes: int
    cpu_grad_bytes: int
    host_memory: str  # "exact" (fp32 Adam moments) or "lean" (8-bit)
    host_image: bool  # the pinned compute-dtype image is kept (else a staging ring; no difference in fp32)
    host_grads: str  # "compute" (bf16 host gradients of bf16 units) or "fp32"
    cpu_pinned_copy_bytes: int
    cpu_grad_staging_bytes: int
    cpu_activation_bytes: int
    cpu_process_bytes: int
    cpu_bytes_needed: int
    cpu_memory_bytes: int | None
    # NVMe tier (StrongholdConfig(nvme_path=...)): the Adam moments on disk, a ring in RAM
    nvme_adam: bool  # the moments are on disk (then cpu_adam_bytes counts none of them)
    nvme_bytes_needed: int
    nvme_memory_bytes: int | None
    cpu_nvme_ring_bytes: int
    nvme_masters: bool  # the fp32 masters are on disk too (then cpu_master_bytes is 0)
    # GPU side (STRONGHOLD)
    gpu_resident_bytes: int  # outside the window: rest units and their gradients, or (offload_non_block=False) params + grads + AdamW
    gpu_window_bytes: int
    gpu_slot_bytes: int  # the largest streamed unit's device copy
    gpu_grad_buffer_bytes: int
    gpu_engine_bytes: int  # what the ledger's device_peak_bytes counts: window + lanes + rest units
    gpu_block_activation_bytes: int
    gpu_head_activation_bytes: int  # the final norm, the logits (whole or one chunk) and the head's gradient sum
    gpu_workspace_bytes: int
    gpu_bytes_needed: int
    gpu_memory_bytes: int | None
    max_window_size: int | None
    # Plain training (everything on the GPU)
    plain_state_bytes: int
    plain_workspace_bytes: int
    plain_gpu_bytes_needed: int
    # Verdicts
    cpu_fits: bool | None
    gpu_fits: bool | None
    nvme_fits: bool | None
    fits: bool
    plain_fits: bool | None
    block_activation_bytes_checkpointed: int
    block_activation_bytes_full: int
    notes: tuple[str, ...] = ()
    # The device/host split (StrongholdConfig.resident, split.py): units kept on the GPU, in
    # gpu_resident_bytes with their gradients and AdamW state (and, in 16-bit compute, autocast's copy).
    resident_units: int = 0
    resident_params_on_gpu: int = 0
    gpu_split_bytes: int = 0
    split: str = "everything streams"
    resident_budget_bytes: int | None = None  # the device bytes the split had (what the Trainer gives the engine)
    # The activations' model: the attention that runs, the MLP's tile (None: untiled), one
    # layer's recompute and backward at their height, and what bounds the GPU verdict.
    gpu_activation_peak_bytes: int = 0  # what the layers keep, plus the larger of the loss and one layer's backward
    # Headroom (StrongholdConfig.cpu_reserve / gpu_reserve): left free on each side; "fits"
    # means the bytes needed plus the reserve fit.
    cpu_reserve_bytes: int = 0
    gpu_reserve_bytes: int = 0
    attn_implementation: str = "eager"
    # The checkpointed activations are on disk too (nvme_activations; cpu_activation_bytes is then their ring).
    nvme_activations: bool = False
    tile_tokens: int | None = None
    gpu_layer_peak_bytes: int = 0
    layer_largest_tensor: str = ""
    gpu_bounded_by: str = ""
    gpu_vocab_piece_bytes: int = 0  # vocab_pieces: the largest piece of a vocabulary unit, with its gradient
    # head_lent_whole: the LM head's whole copy and its gradient, beside the window from a forward
    # that reads the weight itself (a fused LM head) to the end of its backward
    gpu_head_lent_whole_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["notes"] = list(self.notes)
        return out

    def table(self) -> str:
        return _table(self)

    def raise_if_not_fits(self) -> None:
        """Raises ``ValueError`` with the numbers and what to change when it does not fit."""
        problems = []
        if self.cpu_fits is False:
            problems.append(
                f"CPU RAM: needs {_gib(self.cpu_bytes_needed)} (fp32 masters {_gib(self.cpu_master_bytes)} + Adam "
                f"{_gib(self.cpu_adam_bytes)} + gradients {_gib(self.cpu_grad_bytes)} + pinned buffers "
                f"{_gib(self.cpu_pinned_copy_bytes + self.cpu_grad_staging_bytes + self.cpu_activation_bytes)} + "
                + (f"NVMe ring {_gib(self.cpu_nvme_ring_bytes)} + " if self.nvme_adam else "")
                + f"process {_gib(self.cpu_process_bytes)}) for {self.total_params / 1e9:.2f} B offloaded parameters, "
                f"and the machine keeps {_gib(self.cpu_reserve_bytes)} free (cpu_reserve); it has "
                f"{_gib(self.cpu_memory_bytes)}. Add CPU RAM, or train fewer or narrower layers "
                f"(each trainable parameter costs {self.cpu_bytes_per_param:.1f} B of RAM"
                + ("; host_memory=\"lean\" (--optim adamw_8bit) keeps 8-bit Adam moments, 6 B/param less"
                   if self.host_memory == "exact" else "")
                + ("; host_image=False drops the pinned compute-dtype image, 2 B/param less" if self.host_image
                   and self.dtype != "fp32" else "")
                + ("; without gradient accumulation the host gradients stay bf16, 2 B/param less"
                   if self.host_grads == "fp32" and self.dtype == "bf16" else "")
                + ("; StrongholdConfig(nvme_path=DIR) on a fast local disk moves the Adam moments "
                   f"({_gib(self.cpu_adam_bytes)}) there (estimate with --nvme_memory)" if not self.nvme_adam else "")
                + ("; StrongholdConfig(nvme_masters=True) moves the fp32 masters "
                   f"({_gib(self.cpu_master_bytes)}) there too" if self.nvme_adam and not self.nvme_masters else "")
                + ")."
            )
        if self.nvme_fits is False:
            what = "the Adam moments and the fp32 masters" if self.nvme_masters else "the Adam moments"
            problems.append(f"NVMe: {what} need {_gib(self.nvme_bytes_needed)} on disk, which has "
                            f"{_gib(self.nvme_memory_bytes)}. Free space or use a larger disk for nvme_path.")
        if self.gpu_fits is False:
            fixes = []
            if not self.gradient_checkpointing:
                fixes.append(
                    "enable gradient checkpointing (block activations "
                    f"{_gib(self.block_activation_bytes_full)} -> {_gib(self.block_activation_bytes_checkpointed)})"
                )
            elif not self.offload_activations:
                fixes.append("offload the checkpointed activations (StrongholdConfig(offload_activations=True))")
            if not self.offload_non_block:
                fixes.append("offload the parameters outside the blocks (StrongholdConfig(offload_non_block=True))")
            if self.gpu_head_lent_whole_bytes:
                fixes.append("a fused LM head (TRL's trainers add one, Liger's fused cross-entropy is one) holds the "
                             "whole head on the device: with Liger, liger_kernel_config={\"fused_linear_cross_entropy\": "
                             "false} leaves the loss to the engine, which reads the head in pieces of a block")
            fixes.append("use a smaller batch or sequence length")
            if self.dtype == "fp32":
                fixes.append("train in bf16 (halves the window slots and activations)")
            if self.max_window_size and self.max_window_size < self.window_size:
                fixes.append(f"use a smaller window_size (the largest that fits is {self.max_window_size})")
            problems.append(
                f"GPU memory: needs {_gib(self.gpu_bytes_needed)} at window_size={self.window_size} (window "
                f"{_gib(self.gpu_window_bytes)} + gradient buffers {_gib(self.gpu_grad_buffer_bytes)} + "
                + (f"the LM head lent whole to a fused head {_gib(self.gpu_head_lent_whole_bytes)} + "
                   if self.gpu_head_lent_whole_bytes else "") + "outside the "
                f"window {_gib(self.gpu_resident_bytes)} + activations "
                f"{_gib(self.gpu_activation_peak_bytes)} + workspace "
                f"{_gib(self.gpu_workspace_bytes)}), and {_gib(self.gpu_reserve_bytes)} stay free (gpu_reserve: the CUDA "
                f"context, library workspaces, fragmentation); it has {_gib(self.gpu_memory_bytes)}. Fix: "
                + "; ".join(fixes) + "."
            )
        if problems:
            raise ValueError(f"{self.model_name} does not fit for STRONGHOLD training. " + " ".join(problems))

    @property
    def cpu_bytes_per_param(self) -> float:
        """Host bytes of a trainable parameter of a block: master, gradient, Adam state, image."""
        adam = ADAM_STATE_BYTES if self.host_memory == "exact" else self.cpu_adam_bytes / max(self.total_params, 1)
        adam = 0 if self.nvme_adam else adam
        grad = 2 if self.host_grads == "compute" else 4
        master = 0 if self.nvme_masters else 4
        return master + adam + grad + (0 if self.dtype == "fp32" or not self.host_image else _NBYTES[self.dtype])


def check_fits(estimate_: Estimate) -> Estimate:
    """`Estimate.raise_if_not_fits`, returning the estimate when it fits."""
    estimate_.raise_if_not_fits()
    return estimate_


def _verdict(ok: bool | None) -> str:
    return {None: "not checked", True: "fits", False: "does NOT fit"}[ok]


def _table(e: Estimate) -> str:
    def row(label: str, nbytes: int) -> str:
        return f"  {label:<52}{nbytes / GiB:>10.2f}"

    def total(label: str, need: int, have: int | None, ok: bool | None) -> str:
        have_s = "?" if have is None else f"{have / GiB:.2f}"
        return f"  {label:<52}{need / GiB:>10.2f}  of {have_s} GiB: {_verdict(ok)}"

    c = _NBYTES[e.dtype]
    ckpt = "on" if e.gradient_checkpointing else "off"
    outside = ("rest units and their gradients" if e.offload_non_block else
               f"outside the blocks: params+grads+Adam ({16 if c == 4 else 18} B)")
    loss = "loss (final norm, a chunk of logits, head grad)" if e.chunked_loss else "loss (final norm, whole logits)"
    lines = [
        f"{e.model_name}: {e.total_params / 1e9:.3f} B params ({e.block_params / 1e9:.3f} B in {e.num_blocks} blocks, "
        f"largest {e.largest_block_params / 1e6:.1f} M; {e.resident_params / 1e6:.1f} M outside them), seq "
        f"{e.seq_len} x batch {e.batch_size}, {e.dtype}, gradient checkpointing {ckpt}"
        + (", checkpointed activations offloaded" if e.offload_activations else "")
        + f", {e.attn_implementation} attention"
        + (f", MLP in tiles of {e.tile_tokens} tokens" if e.tile_tokens else ""),
        f"{'CPU RAM (STRONGHOLD)':<54}{'GiB':>10}",
        row("fp32 master weights: on NVMe (nvme_masters)" if e.nvme_masters else "fp32 master weights (4 B/param)",
            e.cpu_master_bytes),
        row("Adam state + masters: on NVMe, a ring in RAM" if e.nvme_masters
            else "Adam state: on NVMe, a ring of buffers in RAM" if e.nvme_adam
            else f"Adam state ({ADAM_STATE_BYTES} B/param)" if e.host_memory == "exact"
            else "Adam state, lean (8-bit moments, 2 B/param)", e.cpu_nvme_ring_bytes if e.nvme_adam else e.cpu_adam_bytes),
        row("fp32 gradient buffers (4 B/param)" if e.host_grads == "fp32"
            else "gradient buffers (bf16 units 2 B/param, others 4)", e.cpu_grad_bytes),
        row("pinned images (fp32: the masters; frozen: stored bytes)" if c == 4 and not e.nvme_masters
            else f"pinned {e.dtype} images ({c} B/param; frozen: stored bytes)" if e.host_image
            else f"pinned {e.dtype} staging, no image (frozen: stored bytes)" if not e.nvme_masters
            else f"pinned {e.dtype} staging + fp32 read scratch (frozen: stored)",
            e.cpu_pinned_copy_bytes),
        row("pinned gradient staging (K buffers)", e.cpu_grad_staging_bytes),
        row("checkpointed activations: on NVMe, a ring in RAM" if e.nvme_activations
            else "offloaded checkpointed activations", e.cpu_activation_bytes),
        row("process allowance (Python, torch, CUDA runtime)", e.cpu_process_bytes),
        row("reserve left free (OS, page cache, data loader)", e.cpu_reserve_bytes),
        total("total, with the reserve", e.cpu_bytes_needed + e.cpu_reserve_bytes, e.cpu_memory_bytes, e.cpu_fits),
        *(["NVMe (STRONGHOLD, nvme_path)",
           total(f"Adam moments ({'8-bit' if e.host_memory == 'lean' else 'fp32'})"
                 + (" + fp32 masters" if e.nvme_masters else "")
                 + (" + checkpointed activations" if e.nvme_activations else ""), e.nvme_bytes_needed,
                 e.nvme_memory_bytes, e.nvme_fits)] if e.nvme_adam else []),
        f"GPU (STRONGHOLD, window_size={e.window_size})",
        row(f"window ({e.window_size + 1} units, largest {e.gpu_slot_bytes / MiB:.1f} MiB)", e.gpu_window_bytes),
        row("gradient buffers in flight (K)", e.gpu_grad_buffer_bytes),
        *([row("the LM head lent whole to a fused head, with its gradient", e.gpu_head_lent_whole_bytes)]
          if e.gpu_head_lent_whole_bytes else []),
        row(outside, e.gpu_resident_bytes - e.gpu_split_bytes),
        *([row(f"resident units of the split ({e.resident_units}: params+grads+Adam)", e.gpu_split_bytes)]
          if e.resident_units else []),
        row(f"block activations ({'checkpointed' if e.gradient_checkpointing else 'all stored'}"
            + (", offloaded" if e.offload_activations else "") + ")", e.gpu_block_activation_bytes),
        *([row("  of which one layer's recompute and backward", e.gpu_layer_peak_bytes)]
          if e.gradient_checkpointing else []),
        row(loss, e.gpu_head_activation_bytes),
        row("  activations at their peak (the loss and a layer's backward do not overlap)",
            e.gpu_activation_peak_bytes),
        row(f"kernel workspace ({GPU_WORKSPACE_PERCENT}%)", e.gpu_workspace_bytes),
        row("reserve left free (CUDA context, library workspaces, fragmentation)", e.gpu_reserve_bytes),
        total("total, with the reserve", e.gpu_bytes_needed + e.gpu_reserve_bytes, e.gpu_memory_bytes, e.gpu_fits),
        f"  largest window_size that fits: {'unknown' if e.max_window_size is None else e.max_window_size}",
        f"  bounded by: {e.gpu_bounded_by}; a layer's largest tensors: {e.layer_largest_tensor}",
        "Plain training (everything on the GPU)",
        row(f"params+grads+Adam ({e.total_params / 1e9:.3f} B x {16 if c == 4 else 18} B)", e.plain_state_bytes),
        row("activations (blocks, whole logits)", e.plain_gpu_bytes_needed - e.plain_state_bytes
            - e.plain_workspace_bytes),
        row(f"kernel workspace ({GPU_WORKSPACE_PERCENT}%)", e.plain_workspace_bytes),
        total("total, with the reserve", e.plain_gpu_bytes_needed + e.gpu_reserve_bytes, e.gpu_memory_bytes,
              e.plain_fits),
        f"STRONGHOLD: {'fits' if e.fits else 'does NOT fit'}; plain training: {_verdict(e.plain_fits)}",
    ]
    lines += [f"note: {note}" for note in e.notes]
    return "\n".join(lines)
