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


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """One block in the global execution sequence and the parameters it owns."""

    index: int
    fqn: str
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter], ...]  # (local name, parameter), owned by this block only


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


def build_block_specs(model: nn.Module, stacks: list[BlockStack]) -> list[BlockSpec]:
    """Lays the stacks out as one sequence and assigns each block the parameters it alone owns.

    A module that appears several times (the same layer object at several positions of a
    list) is one block: it is streamed once per use. A parameter is owned by a block when
    every module that registers it lies inside that block, so weights tied across blocks or
    shared with resident modules stay resident.
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
                if registrars[id(p)] <= inside and p.is_floating_point():
                    owned.append((name, p))
            if owned:  # a block whose weights all live elsewhere has nothing to stream
                specs.append(BlockSpec(len(specs), f"{stack.fqn}.{local_name}" if stack.fqn else local_name, block,
                                       tuple(owned)))
    return specs


def count_block_parameters(specs: list[BlockSpec]) -> int:
    return sum(p.numel() for s in specs for _, p in s.params)


def describe(specs: list[BlockSpec]) -> str:
    stacks: dict[str, int] = {}
    for s in specs:
        stacks[s.fqn.rsplit(".", 1)[0]] = stacks.get(s.fqn.rsplit(".", 1)[0], 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in stacks.items())


__all__ = ["BlockStack", "BlockSpec", "find_block_stacks", "build_block_specs", "count_block_parameters", "describe"]

