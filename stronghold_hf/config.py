"""`StrongholdConfig`: the one policy object of the engine.

Every knob of the working-window engine lives here, validated once in `__post_init__`, so
that a bad value fails before any memory is allocated. The shape follows torchtitan's config
dataclasses: frozen, keyword-only, slotted, one docstring per field, `Literal` for choices.

The parsers of its user-facing values (`parse_dtype`, `parse_window_size`, `parse_memory`)
live here too, at the bottom of the package: the estimator and its CLI (``estimate/``) read
the same strings, and this module imports nothing of ours.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch

WindowSize = int | Literal["auto"]

#: What ``window_size="auto"`` falls back to when nothing can be measured (no CUDA device,
#: or the planner is told not to probe). Two blocks is the smallest window that overlaps
#: the next block's transfer with the current block's compute.
DEFAULT_WINDOW_SIZE = 2


class ConfigError(ValueError, TypeError):
    """A value `StrongholdConfig` does not take. Both a ValueError and a TypeError: a wrong
    value and a value of the wrong type are one mistake to the user, and callers that catch
    either (``HfArgumentParser``, a launcher) see it."""


_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, *, field_name: str = "param_dtype") -> torch.dtype | None:
    """Turns ``"bf16"``/``"bfloat16"``/``torch.bfloat16`` into a float dtype; ``None`` stays ``None``."""
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in _DTYPE_NAMES.values():
            raise ConfigError(f"StrongholdConfig.{field_name}={value} is not a float dtype; use float32, bfloat16 or float16.")
        return value
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    raise ConfigError(
        f"StrongholdConfig.{field_name}={value!r} is not understood; use one of "
        f"{sorted(_DTYPE_NAMES)} or leave it unset to keep the model's dtype."
    )


_MEM_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_memory(text: str | int) -> int:
    """``"32GB"``, ``"32GiB"``, ``"32G"``, ``"900MB"``, ``"1.5T"`` or plain bytes -> bytes.

    Units are binary and case-insensitive: K/M/G/T with or without ``B`` or ``iB`` all mean
    2**10/2**20/2**30/2**40, so ``32GB == 32GiB == 32 * 2**30``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"memory size must be >= 0, got {text}")
        return text
    match = _MEM_RE.match(str(text))
    if not match or (not match.group(2) and "i" in match.group(3).lower()):
        raise ValueError(
            f"cannot parse memory size {text!r}; use e.g. 32GB, 32GiB, 900MB or a plain byte count "
            "(K/M/G/T are binary: GB = GiB = 2**30)"
        )
    value, unit = float(match.group(1)), match.group(2).lower()
    return int(value * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit])


#: ``cpu_reserve="auto"``: host RAM a verdict of "fits" leaves to the rest of the machine, the
#: larger of this floor (an OS, its page cache and a desktop session) and
HOST_RESERVE_FLOOR = 4 * 2**30
#: this share of the RAM (data-loader workers, the CUDA driver's own pinned pools, file
#: caches of the dataset), at most
HOST_RESERVE_FRACTION = 0.10
#: this much on very large machines (a 1.5 TB server keeps 32 GiB, not 150).
HOST_RESERVE_CAP = 32 * 2**30
#: ``gpu_reserve="auto"``: device memory left to what the engine does not count, the larger of
#: this floor (the CUDA context, cuBLAS and NCCL workspaces) and
DEVICE_RESERVE_FLOOR = 2 * 2**30
#: this share of the device (the caching allocator's fragmentation grows with the card).
DEVICE_RESERVE_FRACTION = 0.05


def host_reserve_bytes(setting: int | str, ram_bytes: int | None) -> int:
    """``StrongholdConfig.cpu_reserve`` in bytes for a machine of ``ram_bytes`` of RAM."""
    if setting != "auto":
        return parse_memory(setting)
    if ram_bytes is None:
        return HOST_RESERVE_FLOOR
    return max(HOST_RESERVE_FLOOR, min(int(ram_bytes * HOST_RESERVE_FRACTION), HOST_RESERVE_CAP))


def device_reserve_bytes(setting: int | str, device_bytes: int | None) -> int:
    """``StrongholdConfig.gpu_reserve`` in bytes for a device of ``device_bytes``."""
    if setting != "auto":
        return parse_memory(setting)
    if device_bytes is None:
        return DEVICE_RESERVE_FLOOR
    return max(DEVICE_RESERVE_FLOOR, int(device_bytes * DEVICE_RESERVE_FRACTION))


#: The least int an int field takes (a field not named here takes none: see its annotation).
_LEAST_INT = {"window_size": 1, "loss_chunk_tokens": 1, "tile_tokens": 1, "device_checkpoints": 0,
              "cpu_threads": 1, "grad_buffers": 1, "nvme_ring_buffers": 2, "nvme_io_threads": 1, "resident": 0}


@functools.cache
def _annotation_rules() -> dict[str, tuple[tuple, int | None]]:
    """For each field annotated only with bools, ints, None and ``Literal`` values: the values
    it takes and the least int it takes (None: no ints). Worked out once from the annotations,
    so a new field of that kind is checked without code of its own."""
    rules = {}
    for name, hint in typing.get_type_hints(StrongholdConfig).items():
        values: list = []
        takes_int = False
        for part in (hint,) if typing.get_origin(hint) is Literal else typing.get_args(hint) or (hint,):
            if part is bool:
                values += [True, False]
            elif part is int:
                takes_int = True
            elif part is type(None):
                values.append(None)
            elif typing.get_origin(part) is Literal:
                values += typing.get_args(part)
            else:
                break  # a str, a dtype, a tuple: parsed by __post_init__ itself
        else:
            rules[name] = (tuple(values), _LEAST_INT[name] if takes_int else None)
    return rules


def _check_annotated(name: str, value: Any, values: tuple, least: int | None) -> None:
    """Raises `ConfigError` unless ``value`` is one of ``values`` (a bool only as a bool: ``1``
    is not True) or an int >= ``least``."""
    if any(value is v if isinstance(v, bool) or v is None else (type(value) is type(v) and value == v) for v in values):
        return
    if least is not None and type(value) is int and value >= least:
        return
    allowed = [json.dumps(v) if isinstance(v, str) else repr(v) for v in values]
    if least is not None:
        allowed.append(f"an int >= {least}")
    use = allowed[0] if len(allowed) == 1 else ", ".join(allowed[:-1]) + " or " + allowed[-1]
    raise ConfigError(f"StrongholdConfig.{name}={value!r}; use {use} (docs/config.md says what each means).")


@dataclass(frozen=True, kw_only=True, slots=True)
class StrongholdConfig:
    """Policy for `offload_model`. Build it directly, or from a dict/JSON with `from_dict`."""

    window_size: WindowSize = "auto"
    """Blocks kept on the device at once (the working window, ``W``). ``"auto"`` measures
    compute time, block size and link bandwidth at the first step and picks the smallest
    ``W`` whose prefetch is hidden, capped by free device memory. An int >= 1 fixes it.
    At most ``W + 1`` blocks hold device storage at any moment (the extra one is the
    prefetch)."""

    offload_optimizer: bool = True
    """Step offloaded units with `CPUAdam` on the fp32 CPU masters, in worker threads that
    overlap with device work. With ``False`` the optimizer returned by
    `engine.build_optimizer` steps the same masters synchronously with torch AdamW."""

    offload_non_block: bool = True
    """Offload every parameter outside the blocks too (embeddings, position embeddings, final
    norms, LM and classifier heads, tied weights): each keeps its fp32 master, gradient and
    Adam state on the host, stepped by CPU Adam like a block. Groups as large as half a block
    (an embedding, an LM head) stream through the window as units of their own; the small rest
    is one unit that visits the device for each forward and its backward. ``False`` keeps them
    resident on the device with a device AdamW (the first version's behaviour: for Llama-3-8B
    that is 1.05 B parameters at 16-18 B each on the GPU)."""

    resident: int | bool | Literal["auto"] = "auto"
    """How much of the model stays on the device instead of streaming (``split.py``). A
    resident unit keeps its parameters, gradients and Adam state on the device and is stepped
    there by a fused AdamW with the same math (fp32 parameters, the same clipping, loss scale
    and weight decay); it never crosses the link and costs no CPU Adam. ``"auto"``: the split
    that makes the step fastest within ``gpu_memory``: the small parameters outside the blocks
    first, then the units that cross the link twice per step (a tied embedding, the first
    blocks, whose CPU update the next forward waits for first), then the rest in forward order.
    On a CPU compute device nothing is resident unless ``gpu_memory`` is given. An int keeps
    that many blocks resident (the first in forward order); ``False`` streams everything.
    Only units whose trainable parameters are fp32 can be resident (their parameters are their
    masters); others stream."""

    gpu_memory: int | str | None = None
    """The device bytes the engine may hold for the model (``"20GB"``, ``"512MiB"`` or bytes):
    the rest units' parameters, gradients and Adam state, plus the streamed part's window,
    gradient lanes and rest unit. Activations, the CUDA context and the allocator's cache
    come on top. ``None``: on CUDA, the free device memory at ``offload_model`` (within a per-process memory
    fraction, if one is set) less the reserve
    (``split.device_reserve_bytes``: a tenth of the device, at least 2 GiB, for activations and
    workspaces); on a CPU device, no budget (nothing resident under ``resident="auto"``)."""

    cpu_reserve: int | str | Literal["auto"] = "auto"
    """Host RAM left free for the rest of the machine: a verdict of "fits" (the estimator, the
    Trainer's fit check) and every ``"auto"`` choice (``host_image``, the NVMe tiers) keep it
    free, so the OOM killer does not end the run. ``"auto"``: the larger of 4 GiB (an OS, its
    page cache, a desktop session) and a tenth of the RAM (data-loader workers, the driver's
    pinned pools), at most 32 GiB (``config.host_reserve_bytes``). Or a size: ``"8GB"``, bytes."""

    gpu_reserve: int | str | Literal["auto"] = "auto"
    """Device memory left free for what the engine does not count: the CUDA context, library
    workspaces, the caching allocator's fragmentation. "Fits" keeps it free, and with
    ``gpu_memory=None`` the device/host split leaves it (plus room for activations).
    ``"auto"``: the larger of 2 GiB and 5% of the device (``config.device_reserve_bytes``)."""

    log_metrics: Literal["brief", "all"] = "brief"
    """What the Trainer's log carries at each logging step besides the loss. ``"brief"``: four
    ``stronghold_*`` keys (the window, the device peak, host bytes per parameter, waits per
    step); ``"all"``: every counter (transfer rates, CPU Adam time, speculation, fetches, the
    pinned and pageable host memory, promises). Sizes are binary throughout (GiB, GiB/s).
    ``engine.memory_stats()`` has everything whatever this says."""

    cpu_threads: int | None = None
    """CPU threads inside each host-side kernel (CPU Adam, gradient folds), which run one block
    at a time in block order, so block 0 is ready first. ``None``: the intra-op thread count
    of the process (``torch.get_num_threads()``), i.e. every core it may use."""

    host_worker: Literal["auto", "thread", "inline"] = "auto"
    """Where the host work runs (gradient folds during backward, CPU Adam after the step).
    ``"thread"``: on a worker thread, overlapped with device work (the next forward waits per
    unit). ``"inline"``: on the training thread, when it is submitted. ``"auto"``: a thread
    when the compute device is a GPU (or the simulated one of ``testing.simulated_device``),
    inline when it is the CPU itself, where a worker would only compete with the training
    thread for the same cores; ``speculative_step="auto"`` then does not speculate either."""

    pin_memory: bool = True
    """Pin the host arenas (page-locked) so host-to-device copies are asynchronous. Ignored,
    with a one-time warning, on a machine without CUDA, where pinning is impossible."""

    block_classes: tuple[str, ...] | None = None
    """Class names of the repeated blocks, overriding discovery (for example
    ``("GPT2Block",)``). ``None`` discovers them from ``_no_split_modules`` and
    ``GradientCheckpointingLayer``."""

    param_dtype: torch.dtype | None = None
    """dtype of the device copies of block parameters (and of their gradients). ``None``
    keeps the model's dtype. ``bfloat16``/``float16`` halve the bytes on the link; the fp32
    masters on the CPU stay exact. Strings such as ``"bf16"`` are accepted. On a CPU device a
    model whose blocks have trainable fp32 ``nn.LayerNorm``s is refused with 16-bit copies (CPU
    autocast runs LayerNorm in its input's dtype); frozen ones keep their dtype and run."""

    grad_buffers: int = 2
    """``K``: block gradients that may be on their way from the device to the host at once
    (the gradient queue). Each costs one device buffer and one pinned host buffer of the
    largest block's trainable parameters. A block's gradient leaves the device as soon as its
    backward is done, so device memory stays ``(W + 1)`` slots plus ``K`` gradient buffers,
    whatever the depth. 2 overlaps one copy with the next block's backward."""

    max_pinned_bytes: int | str | None = None
    """Upper bound on page-locked host memory (``"64GB"``, ``"512MiB"`` or bytes). Transfer
    buffers are pinned until the bound is reached, then allocated pageable (slower
    host-to-device copies, same results). ``None``: no bound; pinning still falls back to
    pageable memory, with one warning, when the system refuses it."""

    shard_cpu_state: bool | None = None
    """Under data parallelism (a torch.distributed process group, e.g. ``torchrun`` or
    ``accelerate launch``), each rank keeps the fp32 masters, gradients and Adam state of
    1/world of every block (ZeRO-Offload's partition): host memory per rank falls as 1/world,
    blocks are all-gathered on the device when used and gradients reduce-scattered there.
    ``None`` (default): sharded when the group has more than one rank. ``False`` keeps full
    replicas on every rank (world times the host memory; gradients are all-reduced and every
    parameter stays readable between steps). ``True`` shards even a group of one (the same
    code path as a larger group). See docs/distributed.md."""

    speculative_step: Literal["auto", "on", "off"] = "auto"
    """Start each block's CPU Adam during backward, as soon as its gradient reaches the host,
    guessing that the step will neither clip nor overflow; the step validates the guess and
    rolls back and redoes the blocks when it was wrong, so results are always exact.
    ``"auto"`` speculates only after a step that did not clip, and pauses while the recent miss
    rate is high (early training clips on nearly every step at ``max_grad_norm=1.0``); it never
    speculates when the host work runs inline (a CPU compute device, see ``host_worker``).
    ``"on"`` speculates every step except right after one whose norm was more than 1.25 times
    ``max_norm`` (the next nearly always clips too; a miss costs an undo and a redo per block,
    one fused pass where they read the same gradients); ``"off"`` never. Either way a pass stops
    speculating once the blocks folded so far exceed the last ``max_norm``."""

    chunked_loss: bool | Literal["auto"] = "auto"
    """Causal LMs compute the LM head and the cross-entropy in chunks of tokens during training
    and recompute each chunk in backward, so the ``[batch, tokens, vocab]`` logits are never
    whole (``chunked_loss.py``). A training forward with ``labels`` then returns
    ``logits=None``, as Liger's fused loss does; evaluation and ``generate`` are unchanged.
    A model whose head does something this does not reproduce exactly keeps the plain path,
    with one log line. ``"auto"``: on, unless the device/host split keeps the whole model on
    the device (``resident``), where the model trains as plain training does, whole logits
    and no recompute of the head included. ``True``: always; ``False``: never."""

    loss_chunk_tokens: int | Literal["auto"] = "auto"
    """Tokens per chunk of the chunked loss. ``"auto"``: one chunk's logits, their fp32 copies
    and gradients stay near 512 MiB (at least 128 and at most 8192 tokens)."""

    sequence_tiling: bool | Literal["auto"] = "auto"
    """Compute the per-token submodules of each block (the MLP, the norms that save
    intermediates) in tiles of ``tile_tokens`` tokens, forward and backward; each tile is
    recomputed in backward, so what such a module holds is ``O(tile)``, not ``O(sequence)``
    (ALST's TiledMLP; ``tiling.py``). Per-token is proven by a probe at each block's first
    long forward, not guessed from class names; attention is not (``attention_tiling`` tiles the
    whole block by queries). Exact to fp32
    rounding; with dropout active a tile draws its own mask (the same in distribution).
    ``"auto"``: only calls whose sequence is longer than 16384 tokens
    (``tiling.AUTO_MIN_SEQUENCE``); ``True``: every call longer than one tile; ``False``: never."""

    attention_tiling: bool = False
    """Also tile the attention block: each causal block (decoders: Llama, Qwen2, Mistral,
    Gemma2, GPT-2, ...) runs whole, norms, projections, attention and MLP, in tiles of
    ``tile_tokens`` queries, against the keys and values of the tokens before them, as chunked
    prefill does through the block's own cache; its backward runs the tiles again in reverse
    order (``query_tiling.py``). A layer then holds, per token, only its input, keys, values and
    their gradients: the longest contexts. Proven per block by a probe at its first call longer
    than one tile (a bidirectional block, BERT's or T5's encoder's, fails it and runs whole).
    Exact to fp32 rounding. ``tile_tokens="auto"`` is 8192 here (``query_tiling.AUTO_QUERY_TILE``)."""

    vocab_pieces: bool = True
    """Read a vocabulary-sized unit (an embedding or LM head of one ``[vocab, hidden]`` weight
    larger than the largest block, tied or not) in row pieces of at most a block's size instead
    of streaming it whole (``vocab_pieces.py``): the embedding sends only the rows a batch
    uses, the head (its own forward and the chunked loss) fetches one piece at a time, and each
    piece's gradient goes to the host when the piece is done. The device slots, gradient lanes
    and staging are then sized by the largest block, whatever the vocabulary. The unit's host
    side, optimizer state and checkpoints do not change. Any other use of the weight during a
    model forward (TRL's fused LM head, Liger's loss, a head that multiplies by ``self.weight``)
    gets the unit lent whole to the device for that forward and its backward, said once in the
    log. A head's ``[vocab]`` bias crosses with its pieces. A unit it cannot read in pieces
    (other parameters besides the weight and its bias, data parallel over several ranks, an
    embedding with ``max_norm``) streams whole, with one log line. ``False``: every unit streams
    whole."""

    tile_tokens: int | Literal["auto"] = "auto"
    """Tokens per tile of ``sequence_tiling`` (and of ``attention_tiling``). ``"auto"``: per module, the tokens whose saved
    intermediates (as the probe measured them, times the batch) cost about 256 MiB, at least
    256 and at most 16384 (about 2300 for Llama-3-8B's MLP in bf16 at batch 1). A call no
    longer than one tile runs untiled."""

    check_fit: bool = True
    """At Trainer start-up, run the fits/does-not-fit estimate (`stronghold_hf.estimate`) with
    the sequence length actually trained, and refuse a run that cannot fit before anything
    is allocated. ``False`` skips it."""

    offload_activations: bool | Literal["auto"] = "auto"
    """With gradient checkpointing, move each block's checkpointed input to pinned host memory
    during forward and bring it back one block ahead of its backward (the last ``W`` stay on
    the device, as at the turn), so they do not add up with depth (``activations.py``).
    ``"auto"``: on when the fit check (the Trainer's, at start-up) says they do not fit, or,
    for ``offload_model`` alone on a GPU, when all blocks' inputs would take more than a
    quarter of the free device memory; never on a CPU device. Without gradient checkpointing
    it does nothing."""

    device_checkpoints: int | Literal["auto"] = "auto"
    """With ``offload_activations``, how many checkpointed block inputs at the end of the
    forward stay on the device for the start of the backward (the turn); the backward brings
    each other one back a block ahead. ``"auto"``: the window size ``W``. ``0``: all leave; at
    the longest contexts each is GiBs (8 GiB a layer at 1M tokens of Llama-3-8B in bf16), and
    the first block's backward then waits for its input once."""

    host_memory: Literal["exact", "lean"] = "exact"
    """What the host keeps per trainable parameter. ``"exact"``: fp32 masters, gradients and
    Adam moments (``torch.optim.AdamW``'s state, bit for bit). ``"lean"``: the two Adam moments
    in blockwise 8-bit (Dettmers et al.'s dynamic quantization, blocks of 256, what
    ``--optim adamw_bnb_8bit`` does on a GPU; ``optim/quant8.py``), about 2 B/param for both
    instead of 8; masters stay fp32 and tensors under 4096 elements keep fp32 moments. Lean
    updates cannot be undone exactly, so it never speculates (``speculative_step``). The
    Trainer also selects it for ``--optim adamw_8bit``, ``adamw_bnb_8bit``,
    ``paged_adamw_8bit`` and ``adamw_torch_8bit``."""

    host_image: bool | Literal["auto"] = "auto"
    """With bf16/fp16 compute, keep a pinned compute-dtype *image* of every trainable parameter
    on the host (2 B/param): a fetch is then one copy, and CPU Adam writes the image in the
    same pass as the update. ``False``: no image; a fetch converts the fp32 masters into a
    bounded ring of pinned staging buffers and copies from there (``transfer.py``), which
    saves 2 B/param of host RAM for a conversion per fetch. ``"auto"``: keep it unless the
    host's available memory at ``offload_model`` would not hold the engine's host state with
    it (a log line says so). With fp32 compute the master is the image and nothing changes."""

    host_grads: Literal["auto", "fp32", "compute"] = "auto"
    """The dtype of the host gradients of units that compute in bf16. ``"compute"``: bf16, as
    they arrive from the device (2 B/param instead of 4, and lossless while a step sees one
    backward pass); the first time a unit's gradient would be accumulated (a second backward
    before ``step()``, a gradient set by hand, a weight used twice whose uses flush apart) that
    unit widens its host gradient to fp32 for good, so accumulation is exactly fp32's (a log
    line says so). ``"fp32"``: fp32 from the start. ``"auto"``: the Trainer and the accelerate
    plugin choose ``"compute"``, or ``"fp32"`` when ``gradient_accumulation_steps`` is above 1;
    ``offload_model`` on its own takes it as ``"fp32"`` (a custom loop may step with its own
    optimizer over ``model.parameters()``, which wants fp32 gradients; ask for ``"compute"``
    with ``engine.build_optimizer``). fp32/fp16 compute and ``offload_optimizer=False`` keep
    fp32 gradients."""

    nvme_path: str | None = None
    """A directory on a fast local disk for the NVMe tier (``nvme.py``): the CPU optimizer's
    Adam moments of every offloaded unit live in a file there (8 B/param exact, about 2 lean)
    instead of host RAM, read ahead in update order through a ring of host buffers and
    written back behind each update; training is bit-identical to keeping them in RAM. The
    engine makes (and removes) its own subdirectory; the file is scratch, never a checkpoint.
    Needs the engine's CPU Adam (``offload_optimizer=True``). ``None``: moments in RAM. The
    fp32 masters stay in RAM unless ``nvme_masters``."""

    nvme_masters: bool = False
    """With ``nvme_path``: the fp32 masters of the offloaded units live on disk too (4 B/param
    more off the host, 12 in all exact), in a second file there, from ``offload_model`` on. A
    unit's update reads its masters with its moments through the same ring; a fetch reads them
    and converts them on the way to the device (no compute-dtype image is kept: the host holds
    the gradients, the rings and the frozen weights). Between steps a parameter reads its value
    from a copy-on-write map of the file, and a write to it reaches the file before the next
    fetch. Meant for models whose masters do not fit in RAM (Llama-3-70B on 256 GB): every fetch
    then reads the disk."""

    nvme_activations: bool | Literal["auto"] = "auto"
    """With ``nvme_path`` and offloaded checkpoints (``offload_activations``): each block's
    checkpointed input goes on from host memory to a scratch file in the NVMe tier's
    directory, written as it lands and read back one block ahead of the host-to-device copy in
    backward (``activations.py``, [Note: checkpoints beyond RAM]). The host then holds a few
    inputs instead of all of them: at 1M tokens Llama-3-8B's are 256 GiB. Training is
    bit-identical. ``"auto"``: on when the fit check (the Trainer's, at start-up) says the host
    cannot hold them, or, for ``offload_model`` alone, when all blocks' inputs would take more
    than the host's available memory less ``cpu_reserve``; off without ``nvme_path``.
    ``True``: always (needs ``nvme_path``; ``offload_activations="auto"`` is then on);
    ``False``: never."""

    nvme_ring_buffers: int = 3
    """Host buffers between the NVMe tier and CPU Adam, each the size of the largest unit's
    moments: one being updated, one being written back, one read ahead (more read further
    ahead; at least 2). Their size follows the largest unit: an untied LM head of a large vocabulary
    (Llama-3's 525 M parameters) sets it."""

    nvme_io_threads: int = 4
    """Threads issuing the NVMe tier's reads and writes (several requests in flight is what an
    NVMe drive needs to reach its bandwidth)."""

    def __post_init__(self) -> None:
        # Each field whose annotation is made of bools, ints, None and Literal values is checked
        # against it (`_check_annotated`); the rest are parsed here, then the combinations.
        for name, rule in _annotation_rules().items():
            _check_annotated(name, getattr(self, name), *rule)
        if self.resident is True:
            raise ConfigError("StrongholdConfig.resident=True; use \"auto\" (the split chosen within gpu_memory), an "
                              "int >= 0 (that many blocks stay on the device) or False (everything streams).")
        if self.block_classes is not None:
            classes = (self.block_classes,) if isinstance(self.block_classes, str) else tuple(self.block_classes)
            if not classes or not all(isinstance(c, str) and c for c in classes):
                raise ConfigError(
                    f"StrongholdConfig.block_classes={self.block_classes!r}; give a non-empty list of class "
                    "names such as [\"GPT2Block\"], or None to discover them."
                )
            object.__setattr__(self, "block_classes", classes)
        object.__setattr__(self, "param_dtype", parse_dtype(self.param_dtype))
        for name in ("gpu_memory", "max_pinned_bytes", "cpu_reserve", "gpu_reserve"):
            value = getattr(self, name)
            if value is None or value == "auto":
                continue
            try:
                nbytes = parse_memory(value)
            except (ValueError, TypeError) as err:
                raise ConfigError(f"StrongholdConfig.{name}={value!r}: {err}") from None
            if name == "gpu_memory" and nbytes <= 0:
                raise ConfigError(f"StrongholdConfig.gpu_memory={value!r}; use a positive size such as \"20GB\".")
            object.__setattr__(self, name, nbytes)
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, os.PathLike)) or not str(self.nvme_path):
                raise ConfigError(f"StrongholdConfig.nvme_path={self.nvme_path!r}; use a directory path or None.")
            object.__setattr__(self, "nvme_path", os.fspath(self.nvme_path))
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Values each allowed alone that do not go together."""
        if self.host_memory == "lean" and self.speculative_step == "on":
            raise ConfigError(
                "StrongholdConfig(host_memory=\"lean\", speculative_step=\"on\"): a speculative update is rolled back "
                "by inverting AdamW exactly, which 8-bit moments do not allow. Use speculative_step=\"auto\" or \"off\" "
                "(lean never speculates), or host_memory=\"exact\"."
            )
        if self.host_memory == "lean" and self.offload_optimizer is False:
            raise ConfigError(
                "StrongholdConfig(host_memory=\"lean\") keeps 8-bit Adam moments, which only the engine's CPU Adam "
                "updates; offload_optimizer=False asks for torch's AdamW instead. Drop one of the two."
            )
        if self.nvme_path is not None and not self.offload_optimizer:
            raise ConfigError("StrongholdConfig.nvme_path needs offload_optimizer=True: the NVMe tier holds the "
                              "state of the engine's CPU Adam.")
        if self.nvme_activations is True and self.nvme_path is None:
            raise ConfigError("StrongholdConfig.nvme_activations=True needs nvme_path: a directory on a fast local disk "
                              "for the checkpointed activations' file (or use nvme_activations=\"auto\").")
        if self.nvme_activations is True and self.offload_activations is False:
            raise ConfigError("StrongholdConfig.nvme_activations=True with offload_activations=False: only inputs "
                              "offloaded to the host go on to the file. Set offload_activations=True (or \"auto\").")
        if self.nvme_masters and self.nvme_path is None:
            raise ConfigError("StrongholdConfig.nvme_masters=True needs nvme_path: a directory on a fast local disk "
                              "to hold the masters.")
        if self.nvme_masters and self.host_image is True:
            raise ConfigError("StrongholdConfig.nvme_masters=True keeps no compute-dtype image in RAM (fetches read the "
                              "masters from disk); leave host_image at \"auto\" or set it to False.")

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "StrongholdConfig":
        """Builds a config from a mapping, refusing unknown keys by name."""
        if not isinstance(values, Mapping):
            raise TypeError(f"StrongholdConfig.from_dict expects a dict, got {type(values).__name__}.")
        known = set(cls.field_names())
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"Unknown stronghold config key(s) {unknown}; valid keys are {sorted(known)}."
            )
        return cls(**dict(values))

    @classmethod
    def from_any(cls, value: "StrongholdConfig | Mapping[str, Any] | str | os.PathLike | None") -> "StrongholdConfig":
        """Accepts a config, a dict, a JSON string, or a path to a JSON file (like ``fsdp_config``)."""
        if value is None:
            return cls()
        if isinstance(value, StrongholdConfig):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if isinstance(value, (str, os.PathLike)):
            text = str(value).strip()
            if text.startswith("{"):
                try:
                    return cls.from_dict(json.loads(text))
                except json.JSONDecodeError as err:
                    raise ValueError(f"stronghold_config is not valid JSON ({err}): {text!r}") from None
            if not os.path.isfile(text):
                raise ValueError(
                    f"stronghold_config={text!r} is neither a JSON object nor an existing JSON file path."
                )
            with open(text, encoding="utf-8") as fh:
                try:
                    return cls.from_dict(json.load(fh))
                except json.JSONDecodeError as err:
                    raise ValueError(f"stronghold_config file {text!r} is not valid JSON: {err}") from None
        raise TypeError(
            f"stronghold_config must be a dict, a JSON string or a JSON file path, got {type(value).__name__}."
        )

    def replace(self, **changes: Any) -> "StrongholdConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["param_dtype"] is not None:
            out["param_dtype"] = str(out["param_dtype"]).replace("torch.", "")
        if out["block_classes"] is not None:
            out["block_classes"] = list(out["block_classes"])
        return out

    def resolved_cpu_threads(self) -> int:
        if self.cpu_threads is not None:
            return self.cpu_threads
        # The same team size as the training thread: torch's thread setting also reaches
        # process-wide libraries (MKL), so a different size here would change the training
        # thread's kernels and their rounding.
        return max(1, torch.get_num_threads())


def parse_window_size(value: Any, *, field_name: str = "window_size") -> WindowSize:
    """Parses ``"auto"``, ``"3"`` or ``3`` into a window size, with a message naming ``field_name``."""
    if isinstance(value, bool):
        raise TypeError(f"{field_name}={value!r} is not allowed; use \"auto\" or an int >= 1.")
    if isinstance(value, int):
        parsed: WindowSize = value
    elif isinstance(value, str) and value.strip().lower() == "auto":
        parsed = "auto"
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        parsed = int(value.strip())
    else:
        raise ValueError(f"{field_name}={value!r} is not allowed; use \"auto\" or an int >= 1.")
    if isinstance(parsed, int) and parsed < 1:
        raise ValueError(f"{field_name}={parsed} is not allowed; use \"auto\" or an int >= 1.")
    return parsed
