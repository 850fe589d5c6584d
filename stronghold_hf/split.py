"""The device/host split: which units stay on the device instead of streaming.

Streaming is what lets a model larger than the device train, but a unit that fits costs
twice: its bytes cross the link (a fetch in forward, another in backward unless the turn
keeps it, its gradient back), and its update is CPU Adam, which the next forward may wait
for. A *resident* unit keeps its parameters, gradients and Adam state on the device and is
stepped there by the device AdamW the engine already runs for parameters outside every unit
(``WindowEngine.resident_parameters``): the same math (fp32 parameters are their own masters,
the same global clipping, loss scale and weight decay), and it drops out of the window.

`choose_split` decides, from ``StrongholdConfig(resident=..., gpu_memory=...)``, before the
engine lays out any unit; `discovery.plan_units` then leaves the chosen parameters out of
every unit. ``"auto"`` fills the budget in order of what residency saves per byte
(`preference`):

1. the small parameters outside the blocks (the rest unit): they visit the device on every
   step, and their CPU update is the first the next forward waits for;
2. units fetched twice per step (in forward, and again in backward because the turn does not
   keep them): a tied embedding (used at both ends: three fetches), then blocks from the first,
   whose CPU update the next forward needs first, so their device step hides the CPU Adam of
   the units after them;
3. the units the turn keeps (the last ``W`` positions: one fetch per step), in forward order.

Every candidate's cost is its device bytes (`resident_bytes`: the parameters, and for
trainable ones an fp32 gradient and two fp32 Adam moments, 16 B/param); the streamed rest
keeps its window, gradient lanes and rest unit (`streamed_bytes`), and the two together
stay within the budget. Activations are not in the budget: on CUDA the reserve
(`device_reserve_bytes`) leaves room for them; an explicit ``gpu_memory`` is the model's share.

Only units whose trainable parameters are fp32 can be resident: their parameters are then
their masters, as in plain training. A bf16 trainable parameter would be stepped in bf16 on
the device, which is not the engine's math; such units stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .config import DEFAULT_WINDOW_SIZE, StrongholdConfig
from .discovery import UnitPlan, UnitSpec, unit_device_dtype
from .memory import element_size

logger = logging.getLogger("stronghold_hf")

#: Device bytes per trainable resident parameter besides the parameter itself: its fp32
#: gradient and the fused AdamW's two fp32 moments.
TRAINABLE_EXTRA_BYTES = 4 + 8

#: The device AdamW's step count: one fp32 scalar per trainable parameter tensor.
STEP_BYTES = 4

GiB = 2**30


@dataclass(frozen=True, slots=True)
class DeviceSplit:
    """What `choose_split` decided: the units kept on the device, and why."""

    resident: tuple[str, ...]  # the kept units' names (block paths, or the groups outside them)
    resident_blocks: int
    resident_params: int  # parameters kept on the device by the split
    resident_bytes: int  # their device bytes with gradients and Adam state (`resident_bytes`)
    streamed_bytes: int  # the streamed rest's window, lanes and rest unit, and parameters outside every unit
    budget: int | None  # the device bytes the split had (None: no budget)
    reason: str
    kept_param_ids: frozenset[int] = frozenset()  # id() of every parameter the split keeps

    @property
    def streams_everything(self) -> bool:
        return not self.resident


NOTHING_RESIDENT = DeviceSplit((), 0, 0, 0, 0, None, "everything streams")


def device_reserve_bytes(total: int) -> int:
    """What ``gpu_memory=None`` leaves free on CUDA for activations, the loss and workspaces: a
    tenth of the device, at least 2 GiB."""
    return max(2 * GiB, total // 10)


def cuda_budget_bytes(device: torch.device, model: torch.nn.Module | None = None) -> int:
    """``gpu_memory=None`` on CUDA: the free device memory less the reserve, within a per-process
    cap (``torch.cuda.set_per_process_memory_fraction``) when one is set, so a capped process
    plans for the card it is given. The bytes ``model`` holds on ``device`` already (a model the
    user moved there) count as free: the engine takes them back to the host or keeps them."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        total = int(fraction(device) * total)
        free = min(free, total - torch.cuda.memory_reserved(device))
    if model is not None:
        free += sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                    if t.device == device)
    return max(0, free - device_reserve_bytes(total))


def resident_bytes(spec: UnitSpec) -> int:
    """Device bytes of ``spec`` kept resident: its parameters as stored, and for each trainable
    one an fp32 gradient and the device AdamW's two moments."""
    out = 0
    for _, p in spec.params:
        out += p.numel() * p.element_size()
        if p.requires_grad:
            out += p.numel() * TRAINABLE_EXTRA_BYTES + STEP_BYTES
    return out


def _slot_bytes(spec: UnitSpec, param_dtype: torch.dtype | None) -> int:
    dtype = unit_device_dtype(spec, param_dtype)
    return sum(p.numel() * (element_size(dtype) if dtype is not None and p.requires_grad else p.element_size())
               for _, p in spec.params)


def _grad_bytes(spec: UnitSpec, param_dtype: torch.dtype | None) -> int:
    dtype = unit_device_dtype(spec, param_dtype)
    return sum(p.numel() * (element_size(dtype) if dtype is not None else p.element_size())
               for _, p in spec.params if p.requires_grad)


def streamed_bytes(plan: UnitPlan, kept: set[int], *, window_size: int, grad_buffers: int,
                   param_dtype: torch.dtype | None) -> int:
    """The device bytes of what still streams when the units ``kept`` (indices) are resident:
    ``W + 1`` slots of the largest streamed units, ``K`` gradient lanes (one more per unit used
    at several positions) of the largest trainable one, and the rest unit with its lane."""
    streamed = [u for u in plan.units if u.index not in kept and u.kind != "rest"]
    small = [u for u in plan.units if u.index not in kept and u.kind == "rest"]
    out = sum(_slot_bytes(u, param_dtype) + _grad_bytes(u, param_dtype) for u in small)
    if streamed:
        slots = sorted((_slot_bytes(u, param_dtype) for u in streamed), reverse=True)
        out += sum(slots[: window_size + 1])
        uses = {i: plan.sequence.count(i) for i in set(plan.sequence)}
        lanes = grad_buffers + sum(1 for u in streamed if _grad_bytes(u, param_dtype) and uses.get(u.index, 0) > 1)
        out += lanes * max(_grad_bytes(u, param_dtype) for u in streamed)
    return out


def eligible(spec: UnitSpec) -> bool:
    """A unit can be resident when its trainable parameters are fp32 (they are their masters)."""
    return all(p.dtype == torch.float32 for _, p in spec.params if p.requires_grad)


def fetches_per_step(plan: UnitPlan, index: int, window_size: int) -> int:
    """Fetches of unit ``index`` in one training step: one per forward use, and one more in
    backward for a use the turn does not keep (positions before the last ``W``)."""
    length = len(plan.sequence)
    return sum(1 + (pos < length - window_size) for pos, u in enumerate(plan.sequence) if u == index)


def preference(plan: UnitPlan, window_size: int) -> list[UnitSpec]:
    """The units in the order ``"auto"`` keeps them (see the module docstring)."""
    first = {}
    for pos, u in enumerate(plan.sequence):
        first.setdefault(u, pos)
    candidates = [u for u in plan.units if eligible(u)]
    return sorted(candidates, key=lambda u: (u.kind != "rest", -fetches_per_step(plan, u.index, window_size),
                                             first.get(u.index, -1), u.index))


def split_for_model(model: torch.nn.Module, plan: UnitPlan, config: StrongholdConfig, device: torch.device,
                    dp) -> DeviceSplit:
    """An engine's split: ``config.resident`` within the device budget, ``gpu_memory``, or on
    CUDA the free memory less the reserve; the smallest budget of all ranks under data
    parallelism (``dp``), so that every rank keeps the same units. The parameters outside
    every unit (``offload_non_block=False``) are on the device already (``base_bytes``)."""
    budget = config.gpu_memory
    if budget is None and device.type == "cuda" and config.resident == "auto":
        budget = cuda_budget_bytes(device, model)
    if budget is not None and dp is not None:
        budget = dp.min_int(int(budget))
    in_units = {id(p) for u in plan.units for _, p in u.params}
    outside = [p for p in model.parameters() if id(p) not in in_units]
    base = sum(p.numel() * (p.element_size() + (TRAINABLE_EXTRA_BYTES if p.requires_grad else 0)) for p in outside)
    ws = config.window_size if isinstance(config.window_size, int) else DEFAULT_WINDOW_SIZE
    split = choose_split(plan, resident=config.resident, budget=budget, window_size=min(ws, len(plan.sequence)),
                         grad_buffers=config.grad_buffers, param_dtype=config.param_dtype, base_bytes=base,
                         explicit=config.gpu_memory is not None)
    logger.info("stronghold: device/host split: %s", split.reason)
    return split


def choose_split(plan: UnitPlan, *, resident, budget: int | None, window_size: int, grad_buffers: int,
                 param_dtype: torch.dtype | None, base_bytes: int = 0, explicit: bool = False) -> DeviceSplit:
    """The split for ``StrongholdConfig.resident`` within ``budget`` device bytes.

    ``base_bytes``: what is on the device whatever the split (parameters outside every unit,
    with ``offload_non_block=False``). ``resident=N`` keeps the first ``N`` blocks and raises
    when a given budget cannot hold them; ``"auto"`` keeps what fits, in `preference` order.
    ``explicit``: the budget is the user's ``gpu_memory``, and one that cannot even hold the
    streamed window is refused (a measured budget that small leaves everything streaming)."""

    def total(kept: set[int]) -> int:
        return base_bytes + sum(resident_bytes(plan.units[i]) for i in kept) + streamed_bytes(
            plan, kept, window_size=window_size, grad_buffers=grad_buffers, param_dtype=param_dtype)

    blocks = list(plan.blocks)
    if resident is False or (resident == "auto" and budget is None):
        why = "resident=False" if resident is False else "no device budget (a CPU device without gpu_memory)"
        return _split(plan, set(), total(set()), budget, f"everything streams: {why}")
    if resident != "auto":
        count = int(resident)
        if count > len(blocks):
            logger.warning("stronghold: resident=%d but the model has %d blocks; all %d stay on the device.",
                           count, len(blocks), len(blocks))
        chosen = blocks[:count]
        unfit = [b.fqn for b in chosen if not eligible(b)]
        if unfit:
            raise ValueError(
                f"StrongholdConfig(resident={count}): {unfit[0]} has trainable parameters that are not fp32, and a "
                "resident unit's parameters are its fp32 masters. Load the model in fp32 (train in bf16 with "
                "param_dtype='bf16' or the Trainer's --bf16), or keep fewer blocks resident.")
        kept = {b.index for b in chosen}
        need = total(kept)
        if budget is not None and need > budget:
            raise ValueError(
                f"StrongholdConfig(resident={count}) needs {need / GiB:.2f} GiB of device memory for the model "
                f"({count} resident blocks with their gradients and Adam state, and the streamed rest's window), "
                f"but gpu_memory allows {budget / GiB:.2f} GiB. Keep fewer blocks resident, raise gpu_memory, or use "
                "resident=\"auto\".")
        return _split(plan, kept, need, budget, f"resident={count}: the first {len(kept)} blocks stay on the device")
    kept: set[int] = set()
    if explicit and total(kept) > budget:
        raise ValueError(
            f"StrongholdConfig(gpu_memory={budget}) is below what streaming alone needs on the device: "
            f"{total(kept) / 2**20:.1f} MiB for the window of {window_size} + 1 units and {grad_buffers} gradient "
            "buffers (and the parameters outside the units). Raise gpu_memory, or lower window_size or grad_buffers.")
    for spec in preference(plan, window_size):
        if total(kept | {spec.index}) <= budget:
            kept.add(spec.index)
    need = total(kept)
    if not kept:
        reason = (f"everything streams: no unit fits next to the window in the device budget of "
                  f"{budget / GiB:.2f} GiB")
    elif len(kept) == len(plan.units):
        reason = f"the whole model stays on the device ({need / GiB:.2f} of {budget / GiB:.2f} GiB)"
    else:
        reason = (f"{len(kept)} of {len(plan.units)} units stay on the device ({need / GiB:.2f} of "
                  f"{budget / GiB:.2f} GiB with the streamed rest's window)")
    excluded = [u for u in plan.units if not eligible(u)]
    if excluded:
        reason += (f"; {len(excluded)} unit(s) with trainable parameters that are not fp32 stream whatever the budget "
                   "(a resident unit's parameters are its fp32 masters: load the model in fp32 and train in bf16 with "
                   "--bf16 or param_dtype='bf16' to let them stay)")
    return _split(plan, kept, need, budget, reason)


def _split(plan: UnitPlan, kept: set[int], need: int, budget: int | None, reason: str) -> DeviceSplit:
    specs = [u for u in plan.units if u.index in kept]
    own = sum(resident_bytes(u) for u in specs)
    return DeviceSplit(
        resident=tuple(u.fqn for u in specs),
        resident_blocks=sum(1 for u in specs if u.kind == "block"),
        resident_params=sum(p.numel() for u in specs for _, p in u.params),
        resident_bytes=own,
        streamed_bytes=need - own,
        budget=budget,
        reason=reason,
        kept_param_ids=frozenset(id(p) for u in specs for _, p in u.params),
    )


__all__ = ["DeviceSplit", "NOTHING_RESIDENT", "choose_split", "cuda_budget_bytes", "device_reserve_bytes", "resident_bytes",
           "streamed_bytes", "preference", "fetches_per_step", "eligible"]
