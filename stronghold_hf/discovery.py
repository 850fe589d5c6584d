"""Finding the repeated blocks of any Hugging Face model.

The working window slides over the model's repeated blocks (transformer layers). A model can
hold several stacks (T5 and BART: encoder and decoder); all blocks of all stacks form one
execution sequence in module-registration order, which is the order HF models run them.

Discovery, in order:

1. ``block_classes`` given by the user: every ``nn.ModuleList`` whose children are all
   instances of those class names.
2. ``nn.ModuleList``s whose children are instances of a class named in the model's
   ``_no_split_modules`` or of ``transformers.modeling_layers.GradientCheckpointingLayer``.
3. Failing that, the largest homogeneous ``nn.ModuleList`` (same child class, each child
   holding parameters; lists of >= 2 children first, then of one, for ALBERT's single
   shared layer group). A list of lists (Funnel's ``blocks[i][j]``) counts by its innermost
   modules: a container has no forward of its own, so only the modules it holds are called
   and can be streamed.

A parameter is windowed only if it belongs to exactly one block: a weight that is also
registered elsewhere (tied into another block, or shared with a resident module) stays
resident, so tying keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

try:  # transformers >= 4.48
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover - older transformers
    GradientCheckpointingLayer = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class BlockStack:
    """One ``nn.ModuleList`` of blocks, by its fully qualified name.

    ``names`` are the blocks' names inside the list: ``"3"``, or ``"3.0"`` for a list of lists."""

    fqn: str
    blocks: tuple[nn.Module, ...]
    names: tuple[str, ...]


def _stack(fqn: str, mlist: nn.ModuleList) -> BlockStack:
    units = _callable_units(mlist)
    return BlockStack(fqn, tuple(m for _, m in units), tuple(n for n, _ in units))


def _callable_units(mlist: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The modules a list holds, in order and with repeats, looking through nested plain
    containers (a ``ModuleList``/``ModuleDict`` without a forward of its own: code calls what
    it holds, so that is what has hooks). A container subclass with a forward is a unit."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in mlist._modules.items():
        if child is None:
            continue
        if _is_plain_container(child):
            out.extend(_callable_units(child, f"{prefix}{name}."))
        else:
            out.append((f"{prefix}{name}", child))
    return out


def _is_plain_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward


UnitKind = Literal["block", "streamed", "rest"]


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """One unit: a group of parameters that moves between host and device together.

    ``kind`` says how it is used. A ``"block"`` is a repeated layer, used by its module's
    forward. A ``"streamed"`` unit is a large group of parameters outside the blocks (an
    embedding, an LM head; a tied embedding is one unit used at both ends), used by the
    forwards of the modules that register it. The ``"rest"`` unit gathers every other
    parameter outside the blocks (norms, position embeddings, poolers, classifier heads):
    small, so it stays on the device from the model's forward to the end of its backward.
    """

    index: int
    fqn: str
    params: tuple[tuple[str, nn.Parameter], ...]  # (name, parameter): relative to ``module`` for a block, else the FQN
    module: nn.Module | None = None  # a block's module
    kind: UnitKind = "block"
    # The modules that register the unit's parameters, with each one's local names: where the
    # state_dict hooks go, and (outside blocks) the forwards that use the unit.
    owners: tuple[tuple[nn.Module, tuple[tuple[str, int], ...]], ...] = ()


BlockSpec = UnitSpec  # the name of a block's spec before non-block units existed


def _no_split_class_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        value = getattr(module, "_no_split_modules", None)
        if value:
            names.update(value)
    return names


def _is_block_list(child_list: nn.ModuleList, class_names: set[str], use_gc_layer: bool) -> bool:
    if len(child_list) == 0:
        return False
    for child in child_list:
        by_name = type(child).__name__ in class_names
        by_base = use_gc_layer and GradientCheckpointingLayer is not None and isinstance(child, GradientCheckpointingLayer)
        if not (by_name or by_base):
            return False
    return True


def _module_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]


def _drop_nested(stacks: list[tuple[str, nn.ModuleList]]) -> list[tuple[str, nn.ModuleList]]:
    """Keeps the outermost stacks: a block list inside another block cannot be windowed twice."""
    kept: list[tuple[str, nn.ModuleList]] = []
    for name, mlist in stacks:
        if any(name.startswith(other + ".") for other, _ in stacks if other != name):
            continue
        kept.append((name, mlist))
    return kept


def find_block_stacks(model: nn.Module, block_classes: tuple[str, ...] | None = None) -> list[BlockStack]:
    """Returns the model's block stacks in execution (registration) order.

    Raises ``ValueError`` naming what was searched when nothing can be windowed.
    """
    lists = _module_lists(model)
    if block_classes is not None:
        found = [(n, m) for n, m in lists if _is_block_list(m, set(block_classes), use_gc_layer=False)]
        if not found:
            seen = sorted({type(c).__name__ for _, m in lists for c in m})
            raise ValueError(
                f"No nn.ModuleList of {list(block_classes)} found in {type(model).__name__}. "
                f"ModuleList children seen: {seen or 'none'}. Fix block_classes, or leave it unset to discover."
            )
        return [_stack(n, m) for n, m in _drop_nested(found)]

    class_names = _no_split_class_names(model)
    found = [(n, m) for n, m in lists if _is_block_list(m, class_names, use_gc_layer=True)]
    if not found:
        found = _largest_homogeneous(lists)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks to window: searched nn.ModuleLists of "
            f"_no_split_modules classes {sorted(class_names) or '[]'}, of GradientCheckpointingLayer, and "
            f"homogeneous nn.ModuleLists of parameterised modules ({len(lists)} ModuleList(s) seen). "
            "Pass StrongholdConfig(block_classes=[...]) naming the block class."
        )
    return [_stack(n, m) for n, m in _drop_nested(found)]


def _largest_homogeneous(lists: list[tuple[str, nn.ModuleList]]) -> list[tuple[str, nn.ModuleList]]:
    """The homogeneous ``ModuleList`` holding the most parameters; lists of >= 2 first.

    A list of one block is taken only when nothing longer exists: ALBERT with one layer
    group keeps ``albert_layer_groups = ModuleList([group])`` and applies that group at every
    layer, so its single block is what the window streams (once per pass, however often used).
    """
    for min_len in (2, 1):
        best: tuple[str, nn.ModuleList] | None = None
        best_params = 0
        for name, mlist in lists:
            units = [m for _, m in _callable_units(mlist)]
            if len(units) < min_len or len({type(c) for c in units}) != 1:
                continue
            if any(next(c.parameters(), None) is None for c in units):
                continue
            n_params = sum(p.numel() for p in mlist.parameters())
            if n_params > best_params:
                best, best_params = (name, mlist), n_params
        if best is not None:
            return [best]
    return []


def build_block_specs(model: nn.Module, stacks: list[BlockStack], keep: frozenset[int] = frozenset()) -> list[BlockSpec]:
    """Lays the stacks out as one sequence and assigns each block the parameters it alone owns.

    A module that appears several times (the same layer object at several positions of a
    list) is one block: it is streamed once per use. A parameter is owned by a block when
    every module that registers it lies inside that block, so weights tied across blocks or
    shared with resident modules stay resident. Parameters in ``keep`` (``id()``s: what the
    device/host split keeps on the device, split.py) belong to no block; a block left with
    nothing is not a unit.
    """
    registrars: dict[int, set[int]] = {}  # id(param) -> ids of the modules registering it
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                registrars.setdefault(id(p), set()).add(id(module))
    specs: list[BlockSpec] = []
    seen_blocks: set[int] = set()
    for stack in stacks:
        for local_name, block in zip(stack.names, stack.blocks):
            if id(block) in seen_blocks:
                continue
            seen_blocks.add(id(block))
            inside = {id(m) for m in block.modules()}
            owned: list[tuple[str, nn.Parameter]] = []
            for name, p in block.named_parameters():  # unique tensors, first name
                if registrars[id(p)] <= inside and p.is_floating_point() and id(p) not in keep:
                    owned.append((name, p))
            if owned:  # a block whose weights all live elsewhere has nothing to stream
                specs.append(UnitSpec(len(specs), f"{stack.fqn}.{local_name}" if stack.fqn else local_name,
                                      tuple(owned), block, "block",
                                      ((block, tuple((name, k) for k, (name, _) in enumerate(owned))),)))
    return specs


@dataclass(frozen=True, slots=True)
class HeadRegion:
    """An output embedding in use from the end of the last block before it to the end of its model.

    Code may read an LM head's weight without calling the head module: Liger's fused
    linear cross-entropy, TRL's fused LM head and our chunked loss all take
    ``lm_head.weight`` inside the model's forward. So a streamed head unit is made resident
    when the block before it in the sequence returns (or, without one, the model's
    ``base_model``; OPT's forward calls its decoder past its base model, so the block is the
    surer mark), and held until the model's forward returns."""

    model: nn.Module
    start: nn.Module  # whose forward's end starts the use
    unit: int
    position: int


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """Every unit of a model, and the order in which a forward uses them.

    ``units``: the blocks (indices ``0..N-1``, execution order), then the streamed non-block
    units, then the rest unit. ``sequence``: the unit at each forward position (blocks and
    streamed units; a tied embedding appears at both ends), which is what the window slides
    over. ``entry_positions``: for each module whose forward opens a use of a block or a
    streamed unit, the positions those uses have."""

    units: tuple[UnitSpec, ...]
    sequence: tuple[int, ...]
    entry_positions: dict[int, tuple[int, ...]]
    head_regions: tuple[HeadRegion, ...]

    @property
    def blocks(self) -> tuple[UnitSpec, ...]:
        return tuple(u for u in self.units if u.kind == "block")

    def without_positions_of(self, dropped: set[int]) -> UnitPlan:
        """The plan with units ``dropped`` (indices) taken out of the sequence: they are used
        outside the window (vocab_pieces.py). The units themselves stay."""
        if not dropped:
            return self
        new_position: dict[int, int] = {}
        sequence: list[int] = []
        for pos, u in enumerate(self.sequence):
            if u in dropped:
                continue
            if not sequence or sequence[-1] != u:
                sequence.append(u)
            new_position[pos] = len(sequence) - 1
        entry = {m: tuple(dict.fromkeys(new_position[p] for p in ps if p in new_position))
                 for m, ps in self.entry_positions.items()}
        heads = tuple(HeadRegion(h.model, h.start, h.unit, new_position[h.position]) for h in self.head_regions
                      if h.unit not in dropped and h.position in new_position)
        return UnitPlan(self.units, tuple(sequence), {m: ps for m, ps in entry.items() if ps}, heads)


def _registrars(model: nn.Module) -> tuple[dict[int, list[tuple[nn.Module, str]]], list[tuple[str, nn.Module]]]:
    """``id(param) -> [(module, local name), ...]`` over every registration, and every module path."""
    paths = list(model.named_modules(remove_duplicate=False))
    regs: dict[int, list[tuple[nn.Module, str]]] = {}
    seen: set[tuple[int, str, int]] = set()
    for _, module in paths:
        for name, p in module._parameters.items():
            if p is None or (id(module), name, id(p)) in seen:
                continue
            seen.add((id(module), name, id(p)))
            regs.setdefault(id(p), []).append((module, name))
    return regs, paths


def plan_units(model: nn.Module, stacks: list[BlockStack], *, offload_non_block: bool = True,
               stream_min_params: int | None = None, keep: frozenset[int] = frozenset()) -> UnitPlan:
    """The units of ``model``: its blocks and, with ``offload_non_block``, everything else.

    Parameters outside the blocks are grouped by the modules that register them (a weight
    registered by two modules, as a tied embedding and LM head, joins their groups). A group
    registered only by modules outside the blocks, and holding at least ``stream_min_params``
    elements (default: half the largest block), streams through the window as its own unit;
    every other non-block parameter joins the one rest unit. Parameters in ``keep``
    (``id()``s, split.py) stay on the device, in no unit; the rest is grouped as if they were
    in theirs, so a split changes which units exist, never what a unit holds."""
    every_block = build_block_specs(model, stacks)
    blocks = build_block_specs(model, stacks, keep) if keep else every_block
    if not offload_non_block:
        sequence = tuple(range(len(blocks)))
        entry = {id(s.module): (s.index,) for s in blocks}
        return UnitPlan(tuple(blocks), sequence, entry, ())
    regs, paths = _registrars(model)
    in_block = {id(p) for s in every_block for _, p in s.params}
    inside_blocks = {id(m) for s in every_block for m in s.module.modules()}
    holds_blocks = {id(m) for m in model.modules() if any(id(c) in inside_blocks for c in m.children())}
    holds_blocks |= {id(m) for m in model.modules() if any(id(d) in holds_blocks for d in m.children())}
    free = [(n, p) for n, p in model.named_parameters() if id(p) not in in_block and p.is_floating_point()]
    if not free:
        sequence = tuple(range(len(blocks)))
        return UnitPlan(tuple(blocks), sequence, {id(s.module): (s.index,) for s in blocks}, ())

    # Group by registering module: a parameter's registrars all join one group (union-find).
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for _, p in free:
        mods = [id(m) for m, _ in regs[id(p)]]
        for m in mods[1:]:
            parent[find(m)] = find(mods[0])
        find(mods[0])
    groups: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for name, p in free:
        groups.setdefault(find(id(regs[id(p)][0][0])), []).append((name, p))
    largest_block = max((sum(p.numel() for _, p in s.params) for s in every_block), default=0)
    threshold = max(1, largest_block // 2) if stream_min_params is None else stream_min_params

    def streamable(members: list[tuple[str, nn.Parameter]]) -> bool:
        owners = {id(m) for _, p in members for m, _ in regs[id(p)]}
        if owners & (inside_blocks | holds_blocks) or id(model) in owners:
            return False  # used inside a block, or by a module around them: the whole pass needs it
        return sum(p.numel() for _, p in members) >= threshold

    units: list[UnitSpec] = list(blocks)
    resident: list[tuple[str, nn.Parameter]] = []
    for members in groups.values():  # in the order of their first parameter
        if all(id(p) in keep for _, p in members):
            continue  # the split keeps the whole group on the device
        if streamable(members):
            units.append(_non_block_spec(len(units), members, regs, "streamed"))
        else:
            resident.extend((n, p) for n, p in members if id(p) not in keep)
    # The resident rest: one unit per dtype of its trainable parameters (a unit's gradients
    # share one dtype; a bf16 embedding next to fp32 norms, as PEFT's k-bit preparation leaves
    # them, makes two). Frozen parameters join the first.
    order = {id(p): k for k, (_, p) in enumerate(free)}
    resident.sort(key=lambda item: order[id(item[1])])
    by_dtype: dict[torch.dtype | None, list[tuple[str, nn.Parameter]]] = {}
    for name, p in resident:
        by_dtype.setdefault(p.dtype if p.requires_grad else None, []).append((name, p))
    frozen = by_dtype.pop(None, [])
    parts = list(by_dtype.values()) or ([frozen] if frozen else [])
    if by_dtype and frozen:
        parts[0] = sorted(parts[0] + frozen, key=lambda item: order[id(item[1])])
    for members in parts:
        units.append(_non_block_spec(len(units), members, regs, "rest"))

    # Forward positions, in module-registration order: the order HF models run their parts.
    unit_of_module: dict[int, int] = {id(s.module): s.index for s in blocks}
    for u in units:
        if u.kind == "streamed":
            for m, _ in u.owners:
                unit_of_module[id(m)] = u.index
    sequence: list[int] = []
    entry: dict[int, list[int]] = {}
    for _, m in paths:
        u = unit_of_module.get(id(m))
        if u is None:
            continue
        if not sequence or sequence[-1] != u:
            sequence.append(u)
        entry.setdefault(id(m), [])
        if not entry[id(m)] or entry[id(m)][-1] != len(sequence) - 1:
            entry[id(m)].append(len(sequence) - 1)
    heads = _head_regions(model, units, entry, sequence)
    return UnitPlan(tuple(units), tuple(sequence), {k: tuple(v) for k, v in entry.items()}, heads)


def _non_block_spec(index: int, members: list[tuple[str, nn.Parameter]],
                    regs: dict[int, list[tuple[nn.Module, str]]], kind: UnitKind) -> UnitSpec:
    fqn = members[0][0].rsplit(".", 1)[0] if kind == "streamed" else "<non-block parameters>"
    if kind == "streamed" and sum(p.dim() == 2 for _, p in members) == 1:
        # The one matrix first, whatever the registration order (XLM-R's and CamemBERT's tied
        # head register the [vocab] bias before it): vocab_pieces.py reads the weight as the
        # unit's first parameter and a bias as its second.
        members = sorted(members, key=lambda item: item[1].dim() != 2)
    position = {id(p): k for k, (_, p) in enumerate(members)}
    owners: dict[int, tuple[nn.Module, list[tuple[str, int]]]] = {}
    for _, p in members:
        for m, local in regs[id(p)]:
            owners.setdefault(id(m), (m, []))[1].append((local, position[id(p)]))
    if kind == "rest" and len({p.dtype for _, p in members if p.requires_grad}) == 1:
        dtypes = {p.dtype for _, p in members if p.requires_grad}
        fqn = f"<non-block parameters, {str(next(iter(dtypes))).replace('torch.', '')}>"
    return UnitSpec(index, fqn, tuple(members), None, kind, tuple((m, tuple(names)) for m, names in owners.values()))


def _head_regions(model: nn.Module, units: list[UnitSpec], entry: dict[int, list[int]],
                  sequence: list[int]) -> tuple[HeadRegion, ...]:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return ()
    streamed = {id(p): u.index for u in units if u.kind == "streamed" for _, p in u.params}
    out = []
    for m in model.modules():
        if not isinstance(m, PreTrainedModel):
            continue
        try:
            head = m.get_output_embeddings()
        except (NotImplementedError, AttributeError):
            continue
        weight = getattr(head, "weight", None) if isinstance(head, nn.Module) else None
        backbone = getattr(m, "base_model", None)
        if weight is None or id(weight) not in streamed or not isinstance(backbone, nn.Module) or backbone is m:
            continue
        if not any(c is backbone for c in m.modules()) or any(c is head for c in backbone.modules()):
            continue
        positions = entry.get(id(head))
        if not positions:
            continue
        before = units[sequence[positions[-1] - 1]] if positions[-1] > 0 else None
        start = before.module if before is not None and before.kind == "block" else backbone
        out.append(HeadRegion(m, start, streamed[id(weight)], positions[-1]))
    return tuple(out)


def unit_device_dtype(spec: UnitSpec, param_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype of a unit's device copy (``None``: the parameters' own). A block takes
    ``param_dtype``; so does a unit outside the blocks that only linear layers use (an untied
    LM head, a classifier), where autocast would round the weight to that dtype for the matmul
    anyway. Embeddings and norms keep their stored dtype: a bf16 embedding would make the
    residual stream bf16, which plain HF under autocast keeps in fp32."""
    if spec.kind == "block" or all(isinstance(m, nn.Linear) for m, _ in spec.owners):
        return param_dtype
    return None


def refuse_16bit_layer_norm_on_cpu(blocks: list[UnitSpec], dtype: torch.dtype) -> None:
    """CPU autocast runs ``layer_norm`` in its input's dtype: a block's fp32 ``nn.LayerNorm``
    given a 16-bit device copy next to the fp32 residual stream fails in torch ("mixed dtype
    (CPU): expect parameter to have scalar type of Float"), at the first forward. CUDA autocast
    runs norms in fp32; RMSNorms (Llama, T5) compute in fp32 themselves. Refused here, by name,
    when a block casts a norm's parameter: a trainable one it offloads (a frozen one, or one the
    split keeps on the device, keeps its stored dtype)."""
    for spec in blocks:
        cast = {id(p) for _, p in spec.params if p.requires_grad and p.dtype == torch.float32}
        for name, m in spec.module.named_modules():
            if isinstance(m, nn.LayerNorm) and any(id(q) in cast for q in m.parameters(recurse=False)):
                where = f"{spec.fqn}.{name}" if name else spec.fqn
                raise ValueError(
                    f"StrongholdConfig(param_dtype={str(dtype).replace('torch.', '')}) on a CPU device: the blocks have "
                    f"fp32 LayerNorms ({where}), whose 16-bit copies next to the fp32 residual stream CPU autocast does "
                    "not run (torch: 'mixed dtype (CPU)'). On a CPU device leave param_dtype=None (the Trainer does "
                    "with --bf16); on CUDA, where autocast runs norms in fp32, 16-bit copies work.")


def count_block_parameters(specs: list[BlockSpec]) -> int:
    return sum(p.numel() for s in specs for _, p in s.params)


def describe(specs: list[BlockSpec]) -> str:
    stacks: dict[str, int] = {}
    for s in specs:
        stacks[s.fqn.rsplit(".", 1)[0]] = stacks.get(s.fqn.rsplit(".", 1)[0], 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in stacks.items())


__all__ = ["BlockStack", "BlockSpec", "UnitSpec", "UnitPlan", "HeadRegion", "plan_units", "unit_device_dtype",
           "refuse_16bit_layer_norm_on_cpu", "find_block_stacks", "build_block_specs", "count_block_parameters", "describe"]

