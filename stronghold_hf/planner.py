"""Choosing the working-window size ``W`` (``window_size="auto"``).

STRONGHOLD (Sun et al., SC22, "Fast and Affordable Billion-Scale Deep Learning Model
Training", section on the working window) keeps ``W`` consecutive blocks on the device and
prefetches the next one while the current one computes. ``W`` trades device memory for
slack: a larger window gives each host-to-device copy more compute time to hide behind, and
costs one more slot. The paper picks ``W`` by hand; this module picks it from measurements:
the smallest ``W`` whose copies are hidden behind compute, within the device-memory budget.

The timing model (one host-to-device and one device-to-host stream, each serial, the two
directions independent, as on PCIe and NVLink-C2C which are full duplex):

* **Forward.** Blocks ``0..W-1`` are resident when the step starts (the previous backward
  ended with them). When block ``i`` starts, the slot of block ``i-1`` is free and block
  ``i+W`` is issued on the h2d stream; it must land before block ``i+W`` starts, i.e. within
  the forward time of blocks ``i..i+W-1``.
* **Backward** runs the blocks in reverse. The last ``W`` blocks are still resident from the
  forward. When block ``i`` starts its backward, block ``i-W`` is issued on the h2d stream.
  When block ``i`` ends, its gradients (same bytes as its parameters, in the compute dtype)
  go device-to-host on the d2h stream; with ``W + 1`` gradient buffers cycling, that copy
  must finish before block ``i-W-1`` needs the buffer back, i.e. within the backward time of
  blocks ``i-1..i-W``.

Each pass is simulated block by block (`_simulate_pass`) rather than checked with a
per-block inequality alone. The inequality "W blocks of compute >= one block's copy" is
necessary, but with a serial stream it is not sufficient: when every copy takes longer than
one block's compute, the stream falls further behind at every block and no window hides it
(the link, not the window, is the bottleneck). The simulation catches both, and handles
blocks of different sizes (T5's encoder and decoder blocks, say).

The engine measures the inputs (`BlockProfile` per block, `LinkProfile` from
`measure_link`) and calls `choose_window`; on a CPU-only device it calls
`choose_window_for_cpu`. Both return a `WindowChoice` whose ``reason`` is one log line.

Units in messages: bytes as MiB/GiB (2**20, 2**30), bandwidth as GB/s (1e9 B/s, as CUDA's
bandwidth tests print it), times in ms.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .config import DEFAULT_WINDOW_SIZE

logger = logging.getLogger("stronghold_hf")

MiB = 2**20
GiB = 2**30

# Stalls below this fraction of the step's compute are float noise from summing times, not
# a real wait (an exactly-balanced window, say 3 x 1 ms against a 3 ms copy).
_STALL_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class BlockProfile:
    """Measured cost of one block, in execution order."""

    fqn: str
    forward_s: float
    """Forward compute time of the block, in seconds."""
    backward_s: float
    """Backward compute time as the block runs it in training. With gradient checkpointing the
    forward is recomputed inside backward, so this must include it: use `with_recompute` (or
    ``choose_window(..., recompute=True)``) when the backward was timed without it."""
    param_bytes: int
    """Bytes of the block's parameters in the compute dtype: what crosses the link each way
    (parameters in, gradients of the same dtype out)."""

    def __post_init__(self) -> None:
        if self.forward_s < 0 or self.backward_s < 0:
            raise ValueError(f"BlockProfile {self.fqn!r}: times must be >= 0, got fwd={self.forward_s} bwd={self.backward_s}.")
        if self.param_bytes < 0:
            raise ValueError(f"BlockProfile {self.fqn!r}: param_bytes must be >= 0, got {self.param_bytes}.")

    def with_recompute(self) -> "BlockProfile":
        """This profile with the checkpoint recompute (one more forward) added to backward."""
        return dataclasses.replace(self, backward_s=self.backward_s + self.forward_s)


def add_recompute(blocks: Sequence[BlockProfile]) -> list[BlockProfile]:
    """`BlockProfile.with_recompute` over a whole profile."""
    return [b.with_recompute() for b in blocks]


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """Host<->device bandwidth in bytes per second, each direction measured on its own."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.h2d_bytes_per_s > 0 and self.d2h_bytes_per_s > 0):
            raise ValueError(
                f"LinkProfile bandwidths must be > 0, got h2d={self.h2d_bytes_per_s} d2h={self.d2h_bytes_per_s}."
            )


@dataclass(frozen=True, slots=True)
class WindowChoice:
    """The chosen ``W``, whether its copies are hidden, and why (``reason`` is one log line)."""

    window_size: int
    hidden: bool
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- simulation
def _simulate_pass(
    compute: Sequence[float], fetch: Sequence[float], w: int, copy_out: Sequence[float] | None = None
) -> float:
    """Total seconds compute waits on copies in one pass over blocks in execution order.

    ``compute[k]``: block k's compute time. ``fetch[k]``: its h2d copy, issued when block
    ``k-W`` starts (blocks ``0..W-1`` are already resident). ``copy_out[k]`` (backward only):
    its gradient d2h copy, issued when block k ends; block ``k+W+1`` reuses that buffer.
    Each stream runs its copies one after another.
    """
    n = len(compute)
    start = [0.0] * n
    out_done = [0.0] * n
    h2d_free = 0.0  # time the h2d stream finishes its last queued copy
    d2h_free = 0.0
    clock = 0.0  # end of the previous block's compute
    stall = 0.0
    for k in range(n):
        ready = clock
        if k >= w:
            h2d_free = max(start[k - w], h2d_free) + fetch[k]
            ready = max(ready, h2d_free)
        if copy_out is not None and k >= w + 1:
            ready = max(ready, out_done[k - w - 1])
        stall += ready - clock
        start[k] = ready
        clock = ready + compute[k]
        if copy_out is not None:
            d2h_free = max(clock, d2h_free) + copy_out[k]
            out_done[k] = d2h_free
    return stall


def _worst_window(compute: Sequence[float], copy: Sequence[float], w: int, *, trailing: bool) -> tuple[float, float] | None:
    """(window compute, copy) of the tightest window: for prefetch the ``W`` blocks before the
    fetched one; for copy-out (``trailing``) the ``W`` blocks after the copied one."""
    n = len(compute)
    worst: tuple[float, float] | None = None
    for k in range(n):
        if trailing:
            if k + w + 1 >= n:
                break
            window = sum(compute[k + 1 : k + w + 1])
        else:
            if k < w:
                continue
            window = sum(compute[k - w : k])
        if worst is None or window - copy[k] < worst[0] - worst[1]:
            worst = (window, copy[k])
    return worst


def _stalls(blocks: Sequence[BlockProfile], link: LinkProfile, w: int) -> tuple[float, float]:
    fwd = [b.forward_s for b in blocks]
    h2d = [b.param_bytes / link.h2d_bytes_per_s for b in blocks]
    rev = blocks[::-1]
    bwd = [b.backward_s for b in rev]
    h2d_rev = h2d[::-1]
    d2h_rev = [b.param_bytes / link.d2h_bytes_per_s for b in rev]
    return _simulate_pass(fwd, h2d, w), _simulate_pass(bwd, h2d_rev, w, copy_out=d2h_rev)


def _is_hidden(stall_fwd: float, stall_bwd: float, total_compute: float) -> bool:
    return stall_fwd + stall_bwd <= _STALL_TOLERANCE * max(total_compute, 1e-12)


# ---------------------------------------------------------------------------- formatting
def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB" if abs(nbytes) >= GiB else f"{nbytes / MiB:.1f} MiB"


def _gbps(bps: float) -> str:
    return f"{bps / 1e9:.1f} GB/s"


def _window_detail(blocks: Sequence[BlockProfile], link: LinkProfile, w: int) -> str:
    """'fwd 12.3 ms >= h2d 2.1 ms, ...' for the tightest window of each copy at this W."""
    if w >= len(blocks):
        return f"all {len(blocks)} blocks stay resident, nothing moves"
    fwd = [b.forward_s for b in blocks]
    h2d = [b.param_bytes / link.h2d_bytes_per_s for b in blocks]
    rev = blocks[::-1]
    bwd = [b.backward_s for b in rev]
    parts = []
    for label, comp, copy, trailing, copy_name in (
        ("fwd", fwd, h2d, False, "h2d"),
        ("bwd", bwd, h2d[::-1], False, "h2d"),
        ("bwd", bwd, [b.param_bytes / link.d2h_bytes_per_s for b in rev], True, "d2h"),
    ):
        worst = _worst_window(comp, copy, w, trailing=trailing)
        if worst is not None:
            op = ">=" if worst[0] >= worst[1] else "<"
            parts.append(f"{label} {w}-block window {_ms(worst[0])} {op} {copy_name} {_ms(worst[1])}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------- choice
def choose_window(
    blocks: list[BlockProfile],
    link: LinkProfile,
    *,
    device_bytes_free: int,
    slot_bytes: int,
    activation_bytes_per_block: int = 0,
    recompute: bool = False,
    max_window: int | None = None,
) -> WindowChoice:
    """The smallest ``W >= 1`` whose copies are hidden, within the device budget.

    ``blocks``: one profile per block, in execution order (all stacks, encoder then decoder).
    ``device_bytes_free``: device bytes available to the window and the activations, after
    the resident part (embeddings, heads, their optimizer state) is accounted for.
    ``slot_bytes``: bytes of one slot of the pool (the largest block's parameters and its
    gradient buffer); the window costs ``(W + 1) * slot_bytes``.
    ``activation_bytes_per_block``: device bytes each block's saved activations hold until
    its backward. All ``N`` blocks' worth are live at the forward/backward turn whatever
    ``W`` is, so they come out of the budget first. Pass 0 when ``device_bytes_free``
    already leaves room for them.
    ``recompute``: the profiles' ``backward_s`` were timed without the checkpoint recompute
    but training runs with gradient checkpointing; adds ``forward_s`` to each. Leave False
    when ``backward_s`` already includes it (do not add it twice).
    ``max_window``: a user cap on ``W``.

    When no ``W`` within budget hides the copies, the largest ``W`` that fits is returned
    with ``hidden=False`` and the reason says so. Raises ``ValueError`` when not even
    ``W = 1`` fits, with the numbers and what to change.
    """
    if not blocks:
        raise ValueError("choose_window needs at least one BlockProfile; the model has no blocks to window.")
    if slot_bytes <= 0:
        raise ValueError(f"choose_window: slot_bytes must be > 0, got {slot_bytes}.")
    if max_window is not None and (isinstance(max_window, bool) or max_window < 1):
        raise ValueError(f"choose_window: max_window must be None or an int >= 1, got {max_window!r}.")
    if recompute:
        blocks = add_recompute(blocks)
    n = len(blocks)

    activations = activation_bytes_per_block * n
    budget = device_bytes_free - activations
    w_mem = budget // slot_bytes - 1 if budget > 0 else -1
    w_cap = min(w_mem, n, max_window if max_window is not None else n)
    if w_cap < 1:
        raise ValueError(
            f"Not even window_size=1 fits on the device: 2 slots x {_size(slot_bytes)} + activations "
            f"{_size(activations)} ({n} blocks x {_size(activation_bytes_per_block)}) = "
            f"{_size(2 * slot_bytes + activations)} > {_size(device_bytes_free)} free. Use a smaller "
            "per-device batch or sequence length, enable gradient checkpointing (it keeps only each "
            "block's input), set param_dtype=bfloat16 (halves each slot), or free device memory."
        )

    total_compute = sum(b.forward_s + b.backward_s for b in blocks)
    hiding_w: int | None = None
    stalls: dict[int, tuple[float, float]] = {}
    for w in range(1, w_cap + 1):  # exact smallest hiding W among those that fit
        stalls[w] = _stalls(blocks, link, w)
        if _is_hidden(*stalls[w], total_compute):
            hiding_w = w
            break
    if hiding_w is None:
        # Only for the report: the smallest W past the budget that would hide. W = n always
        # does (nothing moves); a larger window only adds slack, so bisect.
        lo, hi = w_cap + 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            if _is_hidden(*_stalls(blocks, link, mid), total_compute):
                hi = mid
            else:
                lo = mid + 1
        hiding_w = lo if lo <= n and _is_hidden(*_stalls(blocks, link, lo), total_compute) else None
    chosen = hiding_w if hiding_w is not None and hiding_w <= w_cap else w_cap
    if chosen not in stalls:
        stalls[chosen] = _stalls(blocks, link, chosen)
    stall_fwd, stall_bwd = stalls[chosen]
    hidden = _is_hidden(stall_fwd, stall_bwd, total_compute)

    biggest = max(blocks, key=lambda b: b.param_bytes)
    fwd_mean = statistics.fmean(b.forward_s for b in blocks)
    bwd_mean = statistics.fmean(b.backward_s for b in blocks)
    head = (
        f"window_size={chosen}: {n} blocks, fwd {_ms(fwd_mean)} / bwd {_ms(bwd_mean)} per block"
        f"{' (incl. recompute)' if recompute else ''}, largest block {_size(biggest.param_bytes)}, "
        f"h2d {_gbps(link.h2d_bytes_per_s)} ({_ms(biggest.param_bytes / link.h2d_bytes_per_s)}), "
        f"d2h {_gbps(link.d2h_bytes_per_s)} ({_ms(biggest.param_bytes / link.d2h_bytes_per_s)})"
    )
    cap_note = f"budget allows W<={max(w_mem, 0)} ({_size(budget)} after activations, {_size(slot_bytes)} per slot)"
    if max_window is not None and max_window < min(w_mem, n):
        cap_note += f", capped at max_window={max_window}"
    detail = _window_detail(blocks, link, chosen)
    if hidden:
        verdict = f"W={chosen} hides the copies ({detail})"
    else:
        # The per-window inequalities can all hold while a serial stream still falls behind
        # (every copy longer than a block's compute): then the link is the bottleneck and
        # only a window holding most of the model hides it.
        mean_bytes = statistics.fmean(b.param_bytes for b in blocks)
        h2d_mean, d2h_mean = mean_bytes / link.h2d_bytes_per_s, mean_bytes / link.d2h_bytes_per_s
        link_bound = h2d_mean > fwd_mean or max(h2d_mean, d2h_mean) > bwd_mean
        verdict = (
            f"no W<={w_cap} hides the copies"
            + (f", the link is the bottleneck (mean h2d {_ms(h2d_mean)} per block vs fwd {_ms(fwd_mean)})" if link_bound else "")
            + (f"; W={hiding_w} would ({hiding_w} of {n} blocks resident)" if hiding_w is not None else "")
            + f"; taking the largest W that fits: W={chosen} stalls ~{_ms(stall_fwd + stall_bwd)} per step ({detail})"
        )
    reason = f"{head}; {verdict}; {cap_note}"
    numbers = {
        "window_size": chosen,
        "hidden": hidden,
        "hiding_window_size": hiding_w,
        "max_window_size_budget": max(w_mem, 0),
        "num_blocks": n,
        "forward_s_mean": fwd_mean,
        "backward_s_mean": bwd_mean,
        "recompute_added": recompute,
        "largest_block_bytes": biggest.param_bytes,
        "h2d_bytes_per_s": link.h2d_bytes_per_s,
        "d2h_bytes_per_s": link.d2h_bytes_per_s,
        "stall_forward_s": stall_fwd,
        "stall_backward_s": stall_bwd,
        "device_bytes_free": device_bytes_free,
        "activation_bytes": activations,
        "slot_bytes": slot_bytes,
        "window_bytes": (chosen + 1) * slot_bytes,
    }
    return WindowChoice(chosen, hidden, reason, numbers)


def choose_window_for_cpu(num_blocks: int) -> WindowChoice:
    """The window on a CPU-only device: ``DEFAULT_WINDOW_SIZE`` capped by the block count.

    There is no link to hide there: "device" and host share memory and the copies are
    synchronous memcpys, so nothing overlaps (``hidden=False``) and a larger window would
    only hold more copies. The default keeps the same state machine and ``W + 1`` bound the
    GPU path has, which is what the CPU tests exercise.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"choose_window_for_cpu: num_blocks must be an int >= 1, got {num_blocks!r}.")
    w = min(DEFAULT_WINDOW_SIZE, num_blocks)
    reason = (
        f"window_size={w}: CPU-only device, copies are synchronous host memcpys with no link to hide; "
        f"using DEFAULT_WINDOW_SIZE={DEFAULT_WINDOW_SIZE} capped by {num_blocks} block(s)"
    )
    return WindowChoice(w, False, reason, {"window_size": w, "num_blocks": num_blocks, "device": "cpu"})


def initial_window_size(window_size, device: torch.device, num_blocks: int,
                        sequence_length: int) -> tuple[int, bool, WindowChoice | None]:
    """The window size an engine starts with (``StrongholdConfig.window_size``, capped by the
    ``sequence_length`` streamed positions), whether its first training step is probed
    (``"auto"`` on CUDA: auto_window.py decides after it), and the choice behind ``"auto"`` on
    a CPU device (None otherwise)."""
    ws = window_size
    if sequence_length == 0:
        return 0, False, None  # the split keeps everything on the device: no window
    if num_blocks == 0:  # every block is resident; a few units outside them stream: nothing to probe
        return max(1, min(DEFAULT_WINDOW_SIZE if ws == "auto" else int(ws), sequence_length)), False, None
    choice = None
    if ws == "auto":
        if device.type == "cuda":
            # The first training step runs with the default; auto_window.py then decides.
            return max(1, min(DEFAULT_WINDOW_SIZE, sequence_length)), True, None
        choice = choose_window_for_cpu(num_blocks)
        logger.info("stronghold: %s", choice.reason)
        ws = choice.window_size
    elif ws > sequence_length:
        warnings.warn(
            f"stronghold: window_size={ws} is larger than the model's {sequence_length} streamed units "
            f"({num_blocks} blocks); using window_size={sequence_length} (every unit resident, nothing to slide).",
            stacklevel=4,
        )
    return max(1, min(int(ws), sequence_length)), False, choice


# ---------------------------------------------------------------------------- measurement
def measure_link(
    device: torch.device | str | int | None = None, nbytes: int = 64 * MiB, repeats: int = 5
) -> LinkProfile | None:
    """Measures host-to-device and device-to-host bandwidth with pinned buffers.

    Returns ``None`` on a CPU device (no link; the caller uses `choose_window_for_cpu`).
    ``device=None`` means the current CUDA device when CUDA is available, else CPU. Each
    direction is timed on its own side stream with CUDA events, after one warm-up copy, and
    the median of ``repeats`` copies is kept. 64 MiB is past the size where per-copy latency
    matters, and close to a transformer block's size. Both directions running at once can
    be a little slower than each alone on some hosts; the planner treats them as independent.
    This synchronises the device: call it at start-up, never on the hot path.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"measure_link({device}): CUDA is not available on this machine.")
    if nbytes <= 0 or repeats < 1:
        raise ValueError(f"measure_link: nbytes and repeats must be positive, got {nbytes}, {repeats}.")
    with torch.cuda.device(device):
        host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)

        def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                begin.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            # [Note: buffer lifetime] the buffers outlive this wait, so the non-blocking copy
            # never reads or writes freed memory.
            end.synchronize()
            return begin.elapsed_time(end) / 1e3

        timed(dev, host_src)
        timed(host_dst, dev)
        h2d = statistics.median(timed(dev, host_src) for _ in range(repeats))
        d2h = statistics.median(timed(host_dst, dev) for _ in range(repeats))
    return LinkProfile(h2d_bytes_per_s=nbytes / h2d, d2h_bytes_per_s=nbytes / d2h)


__all__ = [
    "BlockProfile",
    "LinkProfile",
    "WindowChoice",
    "add_recompute",
    "choose_window",
    "choose_window_for_cpu",
    "measure_link",
]
