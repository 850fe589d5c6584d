"""Sequence tiling: the per-token submodules of each block run in tiles of ``T`` tokens.

Offloading bounds the parameters on the device; the activations of a long sequence are the
next wall. Inside a block only the attention core needs the whole sequence. The MLP and the
norms treat each token on its own, yet autograd keeps their intermediates for every token at
once: a Llama-3-8B MLP saves four ``[s, 14336]`` tensors, 3.7 GB in bf16 at 32k tokens, for
one block (with checkpointing, during that block's backward). ALST's TiledMLP (Bekman et al.,
"Arctic Long Sequence Training", arXiv:2506.13996; DeepSpeed's ``TiledMLP``) computes such a
module tile by tile under ``no_grad`` and keeps only its input; backward recomputes each
tile and differentiates it, so what the module holds beyond its input and output is
``O(T)``, not ``O(s)``. DESIGN.md §7.

The pieces:

* `tiled_function.TiledForward`: the autograd Function (forward in tiles, backward recomputes
  per tile; ``tiled_function.py``);
* `probe`: a cheap test that a submodule is per-token (a token's output depends on that
  token only) and worth tiling (it saves intermediates per token beyond its input);
* `SequenceTiling`: at each block's first long forward, finds the per-token submodules
  without class names and routes their calls through `TiledForward`; ``remove()`` gives the
  model back.

With dropout active, a tile draws its own mask: the result is the same in distribution as
the untiled module's, not bit for bit (the backward replays the forward's masks exactly).
"""

from __future__ import annotations

import contextlib
import copyreg
import enum
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import Tensor, nn

from .hooks import ENGINE_HOOK
from .tiled_function import run_in_tiles, tiled_forward

logger = logging.getLogger("stronghold_hf")

TilingMode = bool | Literal["auto"]
TileTokens = int | Literal["auto"]

#: ``sequence_tiling="auto"`` tiles a call only when its sequence is longer than this. Below
#: it the intermediates of one block's MLP fit next to the rest (Llama-3-8B, bf16: 1.8 GB at
#: 16k tokens), and tiling would only cost the recompute (about a third of the MLP's FLOPs).
AUTO_MIN_SEQUENCE = 16384
#: ``tile_tokens="auto"`` aims what one tile of a module saves for backward (as `probe`
#: measured it, times the batch) at this many bytes...
AUTO_TILE_BYTES = 256 * 2**20
#: ...within these bounds (Llama-3-8B's MLP in bf16 at batch 1: about 2300 tokens).
AUTO_TILE_MIN, AUTO_TILE_MAX = 256, 16384
#: Tokens `probe` runs a module on, and the fewest it can decide with.
PROBE_TOKENS, MIN_PROBE_TOKENS = 8, 4
#: Copies of one token the probe runs in training mode: more than the expert capacity of the
#: capacity-routed mixtures of experts (Switch Transformers and NLLB-MoE keep 64 tokens per expert).
IDENTICAL_TOKENS = 256
#: A per-token module is tiled only if it saves for backward, per token and beyond its input,
#: at least this many times its input's bytes: a bare Linear saves only its input (tiling would
#: cost a recompute for nothing; under bf16 autocast also a bf16 copy of it, half as many
#: bytes), a LayerNorm kernel two floats, an RMSNorm written in torch a normalised copy, an MLP
#: several ``ffn`` rows.
WORTH_FRACTION = 1.0

_SITE = "_stronghold_tile_site"
_PLAIN = "_stronghold_tiled_plain"


def resolve_tile_tokens(tile_tokens: TileTokens, saved_bytes_per_token: int) -> int:
    """Tokens per tile: ``tile_tokens`` itself, or for ``"auto"`` the tokens whose saved
    intermediates (``saved_bytes_per_token``, the batch included) cost about
    `AUTO_TILE_BYTES`, clamped to ``[AUTO_TILE_MIN, AUTO_TILE_MAX]``."""
    if tile_tokens == "auto":
        tokens = AUTO_TILE_BYTES // max(int(saved_bytes_per_token), 1)
        return max(AUTO_TILE_MIN, min(AUTO_TILE_MAX, tokens))
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens!r}: pass an int >= 1 or 'auto'.")
    return tile_tokens


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    """What `probe` found for one module: tile it or not, why, and what tiling saves."""

    tiled: bool
    reason: str
    per_token: bool = False
    """Proven per-token (``tiled`` also needs something to save)."""
    saved_bytes_per_token: int = 0
    """Bytes the module saves for backward per token of one sequence, beyond its input."""


def training_mode(m: nn.Module) -> bool:
    """The probe's training mode for ``m``: on, but for dropout modules (their masks are random)."""
    return not isinstance(m, nn.modules.dropout._DropoutNd)


class ModuleState:
    """What a probe's calls of a module may change besides their outputs, kept to be put back:
    each submodule's buffers and plain attributes (numbers, strings, flags: ``training`` among
    them, and the expert capacity NLLB-MoE's router sets in an eval forward).

    A buffer is written back only when a call changed it (replaced it, or changed its values; a
    kernel's own writes, as batch norm's running statistics, bump no version counter): writing
    an unchanged one would bump its version, and the forward that is running may have saved it
    for backward already (Gemma-3n's AltUp scales its router input by a buffer before its
    submodules are probed)."""

    _PLAIN = (int, float, bool, str, type(None))

    def __init__(self, module: nn.Module) -> None:
        self.modules = list(module.modules())
        self._attrs = [{k: v for k, v in vars(m).items() if type(v) in self._PLAIN} for m in self.modules]
        # (module, name, the buffer, its value, its version)
        self._buffers = [(m, name, b, b.detach().clone(), b._version)
                         for m in self.modules for name, b in m._buffers.items() if b is not None]

    def set_training(self, mode: Callable[[nn.Module], bool]) -> None:
        for m in self.modules:
            m.training = mode(m)

    def restore(self) -> None:
        for m, attrs in zip(self.modules, self._attrs):
            now = vars(m)
            for k, v in attrs.items():
                if now.get(k, v) is not v:
                    setattr(m, k, v)
        with torch.no_grad():
            for i, (m, name, b, value, version) in enumerate(self._buffers):
                if m._buffers.get(name) is not b:
                    m._buffers[name] = b  # replaced by a call: the buffer itself goes back
                if b.shape == value.shape and (b._version != version or not torch.equal(b, value)):
                    b.copy_(value)
                    self._buffers[i] = (m, name, b, value, b._version)


def _relative_change(got: Tensor, want: Tensor) -> float:
    scale = want.abs().max().item()
    change = (got - want).abs().max().item()
    return change / max(scale, 1e-30) if change == change else float("inf")  # NaN: as large as can be


def _saved_bytes(run: Callable[[Tensor], Tensor], x: Tensor) -> int:
    """Bytes of the distinct storages autograd saves for ``run(x)``, ``x``'s own excluded."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    leaf = x.detach().clone().requires_grad_()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(leaf)
    storages.pop(leaf.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def probe(run: Callable[[Tensor], Any], module: nn.Module, x: Tensor) -> Verdict:
    """Whether ``run`` (``module``'s own forward on one call, ``x`` put in) is per-token and
    worth tiling, decided on the first tokens of ``x``'s first sequence.

    In eval mode (no dropout), without grad, under the caller's autocast (the dtypes the module
    really computes in; params are never cast): (i) the rows of the tokens left alone must not
    change when the first and last tokens' inputs change (attention, convolutions over the
    sequence and recurrences fail here); (ii) running the tokens in two pieces must give the
    same rows (a module that reads its own position in the input, or its length, fails here);
    (iii) in training mode (dropout modules aside), `IDENTICAL_TOKENS` copies of one token must
    give one row (routing with an expert capacity, as Switch Transformers' and NLLB-MoE's,
    drops the tokens past it in training, so a tile's rows would depend on the tile; a module
    that draws random numbers in training fails here too), and those rows must not change when
    the first copy does (batch norm's statistics over the tokens). All to the rounding of the compute
    dtype. Then, with grad, the bytes it saves for backward at two token counts: their slope
    is what tiling saves per token (constant saves, such as autocast's cast weights, cancel).
    What the probe's calls change in the modules (a buffer, a number an eval-mode forward
    sets, as NLLB-MoE's router sets its capacity) is put back after it."""
    k = min(x.shape[-2], PROBE_TOKENS)
    first = x[(*(slice(0, 1),) * (x.dim() - 2), slice(0, k))].detach()
    device_type = x.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    tolerance = 1e-4 if compute in (torch.float32, torch.float64) else 2e-2
    kept = ModuleState(module)
    try:
        kept.set_training(lambda m: False)
        with torch.no_grad():
            y = run(first)
            if not (isinstance(y, Tensor) and y.is_floating_point() and y.shape[:-1] == first.shape[:-1]):
                return Verdict(False, "returns no tensor of its input's leading shape")
            moved = first.clone()
            for t in (0, k - 1):
                moved[..., t, :] = moved[..., t, :] * -1.5 + 0.25
            if _relative_change(run(moved)[..., 1:k - 1, :], y[..., 1:k - 1, :]) > tolerance:
                return Verdict(False, "a token's output changes with other tokens' inputs")
            cut = k // 2 - 1
            pieces = torch.cat([run(first[..., :cut, :]), run(first[..., cut:, :])], dim=-2)
            if _relative_change(pieces, y) > tolerance:
                return Verdict(False, "a split of the tokens gives other rows")
            kept.restore()  # the eval calls' changes (NLLB-MoE's capacity) must not decide the training one
            kept.set_training(training_mode)
            same = first[..., :1, :].expand(*first.shape[:-2], IDENTICAL_TOKENS, first.shape[-1]).contiguous()
            z = run(same)
            if _relative_change(z, z[..., :1, :].expand_as(z)) > tolerance:
                return Verdict(False, "in training, copies of one token give different rows (an expert capacity, "
                                      "or random draws)")
            same[..., 0, :] = same[..., 0, :] * -1.5 + 0.25
            if _relative_change(run(same)[..., 1:, :], z[..., 1:, :]) > tolerance:
                return Verdict(False, "in training, a token's output changes with other tokens' inputs (statistics "
                                      "over the tokens)")
            kept.set_training(lambda m: False)
        half = k // 2
        per_token = (_saved_bytes(run, first) - _saved_bytes(run, first[..., :half, :])) // (k - half)
    except Exception as err:  # noqa: BLE001 - a probe that cannot run proves nothing
        return Verdict(False, f"the probe raised {type(err).__name__}: {str(err)[:120]}")
    finally:
        kept.restore()
    row = first[..., 0, :].numel() * first.element_size()
    if per_token < WORTH_FRACTION * row:
        return Verdict(False, f"per-token, but saves {per_token} B per token beyond its {row} B input: "
                              "nothing for tiling to save", True, per_token)
    return Verdict(True, f"per-token, saves {per_token} B per token beyond its input", True, per_token)


# --------------------------------------------------------------------------------------------
# Installing
# --------------------------------------------------------------------------------------------


class _State(enum.Enum):
    PROBING = "probing"  # swapped for its block's first long forward: the first call probes
    TILED = "tiled"
    PLAIN = "plain"  # judged untiled while another class was put over ours: calls pass through


#: What else a candidate's call may pass: values a probe cannot change. Anything else (a
#: container that may hold tensors, a KV cache that a call appends to) rules the call out.
_PLAIN_VALUES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size)


def _one_tensor(args: tuple, kwargs: dict) -> tuple[int | str, Tensor] | None:
    """(position or keyword, tensor) of a call's only tensor argument, when everything else it
    passes is a plain value; None for any other call."""
    found = None
    for slot, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, Tensor):
            if found is not None:
                return None
            found = (slot, value)
        elif not isinstance(value, _PLAIN_VALUES):
            return None
    return found


class TileSite:
    """One module being probed or tiled: its plain class and how its calls are tiled."""

    __slots__ = ("owner", "cls", "block", "name", "lead", "state", "slot", "saved_bytes_per_token", "calls")

    def __init__(self, owner: SequenceTiling, cls: type, block: int, name: str, lead: torch.Size) -> None:
        self.owner = owner
        self.cls = cls  # the class before the swap, whose forward computes each tile
        self.block = block  # id() of the block being decided when it was swapped
        self.name = name  # relative to that block, for the log
        self.lead = lead  # the block input's leading shape [..., s]: a candidate's input shares its tokens
        self.state = _State.PROBING
        self.slot: int | str | None = None  # where the call passes the tensor to tile
        self.saved_bytes_per_token = 0
        self.calls = 0  # calls computed in tiles

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.state is _State.PROBING:
            return self.owner._first_call(self, module, args, kwargs)
        if self.state is _State.PLAIN:
            self.owner._restore(module)
            return self.cls.forward(module, *args, **kwargs)
        found = _one_tensor(args, kwargs)
        tokens = None
        if found is not None and found[0] == self.slot and found[1].dim() >= 2:
            tokens = self.owner.tile_tokens_for(found[1], self.saved_bytes_per_token)
        if tokens is None:  # at most one tile, or a call of another shape: the module as it is
            return self.cls.forward(module, *args, **kwargs)
        x = found[1]
        self.calls += 1
        run = self._runner(module, args, kwargs)
        params = [p for p in module.parameters() if p.requires_grad]
        if torch.is_grad_enabled() and (x.requires_grad or params):
            return tiled_forward(run, tokens, module.training, x, *params)
        return run_in_tiles(run, x, tokens)

    def _runner(self, module: nn.Module, args: tuple, kwargs: dict) -> Callable[[Tensor], Any]:
        forward, slot = self.cls.forward, self.slot
        if isinstance(slot, int):
            head, tail = args[:slot], args[slot + 1:]
            return lambda t: forward(module, *head, t, *tail, **kwargs)
        return lambda t: forward(module, *args, **{**kwargs, slot: t})


# [Note: the tiled class] A module being probed or tiled has its class swapped for a
# subclass of the same name whose ``forward`` goes through its `TileSite`, which calls the
# plain class's ``forward`` once per tile. That is what FSDP2's ``fully_shard`` does
# (``FSDP<Class>``), and what the engine does for ``model.device``. Parameters (the same
# objects), buffers, submodules, ``state_dict`` keys, ``repr`` and the module's own hooks (run
# once, around the whole call) are untouched. The alternatives fall short: a forward pre-hook
# cannot replace the computation; a wrapper module in the parent adds a level to every
# parameter name; an instance ``forward`` is accelerate's ``add_hook_to_module`` (STYLE.md).
# `remove` assigns the class back. A copy or pickle of the module is of the plain class.
_TILING_CLASSES: dict[type, type] = {}


def _plain_reduce_ex(self, protocol):
    # Rebuilt as the plain class, without the site: a copy is an ordinary module. (pickle
    # refuses ``copyreg.__newobj__`` of another class than the object's; ``_reconstructor``,
    # protocol 0's form, builds any class.)
    state = {k: v for k, v in self.__getstate__().items() if k != _SITE}
    return copyreg._reconstructor, (getattr(type(self), _PLAIN), object, None), state


def _tiling_class(cls: type) -> type:
    sub = _TILING_CLASSES.get(cls)
    if sub is None:
        def forward(self, *args, **kwargs):
            return self.__dict__[_SITE](self, args, kwargs)

        functools.update_wrapper(forward, cls.forward)  # the plain forward's name, docstring and signature
        sub = type(cls.__name__, (cls,), {
            "forward": forward, "__reduce_ex__": _plain_reduce_ex, _PLAIN: cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        })
        _TILING_CLASSES[cls] = sub
    return sub


def _restore(module: nn.Module) -> bool:
    """Gives ``module`` its plain class back; False (and its calls pass through, `_State.PLAIN`)
    while another class is over ours: PEFT's LoRA on a bare parameter (a mixture of experts'
    router or experts) puts torch's parametrization class over the module's for each forward,
    and takes it off after; assigning the plain class inside that forward would drop it."""
    site = module.__dict__.get(_SITE)
    if site is None:
        return True
    if type(module) is not _TILING_CLASSES.get(site.cls):
        site.state = _State.PLAIN
        return False
    del module.__dict__[_SITE]
    module.__class__ = site.cls
    return True


def _observed(module: nn.Module) -> bool:
    """Whether hooks watch the module or a submodule (transformers' output recorders, a
    user's): tiled, they would see each tile instead of the call. The engine's own hooks on
    the module itself do not count: they open and close a unit's use around the whole call
    (the tiling replaces ``forward``, not ``__call__``), tiled or not; a final norm has them
    ([Note: tiling outside the blocks])."""
    for m in module.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
            if any(m is not module or not getattr(h, ENGINE_HOOK, False) for h in hooks.values()):
                return True
    return False


def _block_input(args: tuple, kwargs: dict) -> Tensor | None:
    """A block's hidden states: its first floating tensor argument of at least two dims."""
    for value in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(value, Tensor) and value.is_floating_point() and value.dim() >= 2:
            return value
    return None


#: `TileSite.block` of a module outside the blocks ([Note: tiling outside the blocks]).
_OUTSIDE = -1


def _stack_siblings(model: nn.Module, stack, blocks: dict[int, nn.Module]) -> list[tuple[str, nn.Module]]:
    """[Note: tiling outside the blocks] The modules beside a block stack in the module that
    holds it, which may be called on the blocks' hidden states: a decoder's final norm
    (Llama's ``model.norm``, GPT-2's ``transformer.ln_f``, T5's ``final_layer_norm``). Each is
    swapped into the probing class at the first long forward of a block of its stack, with that
    block's leading shape, and judged at its own first call like a block's submodules: an RMS
    norm written in torch saves its input upcast to fp32 and the normalized values (Llama-3-8B
    at 2M tokens: 48 GiB in bf16), tiled only its input. The embedding (integer ids), the
    rotary embedding (two tensors) and a dropout (nothing worth saving) are not tiled."""
    parent_name = stack.fqn.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    container = model.get_submodule(stack.fqn)
    found = []
    for name, child in parent.named_children():
        if child is container or id(child) in blocks or _never_swapped(child):
            continue
        if any(id(m) in blocks for m in child.modules()):
            continue  # holds blocks (another stack): its own blocks are judged as such
        found.append((f"{parent_name}.{name}" if parent_name else name, child))
    return found


def _same_tokens(lead: torch.Size, block_lead: torch.Size) -> bool:
    """Whether a call's leading shape ``[..., s]`` holds the block input's tokens: the same
    shape, or one ends the other, as when a block stacks its hidden states along a leading
    axis (Gemma-3n's AltUp holds ``[2, b, s, h]`` and runs its MLP on ``[b, s, h]``). Only a
    cheap filter: `probe` proves a candidate per-token."""
    if lead == block_lead:
        return True
    n = min(len(lead), len(block_lead))
    return n >= 2 and lead[-n:] == block_lead[-n:]


def _never_swapped(module: nn.Module) -> bool:
    if type(module).forward is nn.Module.forward or "forward" in module.__dict__:
        return True  # a container nobody calls, or a forward set on the instance (that one would run)
    if isinstance(module, torch.jit.ScriptModule):
        return True
    # A block inside a block: transformers wraps a GradientCheckpointingLayer subclass's
    # forward in its checkpoint (``__init_subclass__``), which would wrap the tiling class too.
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


class SequenceTiling:
    """Sequence tiling installed on a model's blocks (`install`); `remove` undoes it.

    Each block gets a forward pre-hook (a shape check per call until the block is decided). At
    the block's first forward long enough to tile, it swaps the block's submodules into a
    probing class for that forward ([Note: the tiled class]): each one's first call is judged
    (a candidate takes one tensor with the block input's leading shape ``[..., s]``, nothing
    hooks it, and `probe` proves it per-token and worth tiling) and computed in tiles at once
    if it passed, so the first step is bounded too. The outermost passing module wins: once
    the MLP is tiled its Linear layers are never judged. When the block returns, every module
    not tiled gets its class back, the block's hooks go, and one log line per distinct outcome
    says what is tiled and why the rest is not. From then on only the tiled modules differ
    from the model's own code."""

    def __init__(self, model: nn.Module, mode: TilingMode, tile_tokens: TileTokens) -> None:
        self.model = model
        self.mode = mode
        self.tile_tokens = tile_tokens
        self.auto_min_sequence = AUTO_MIN_SEQUENCE  # "auto" tiles calls longer than this
        least = tile_tokens if isinstance(tile_tokens, int) else AUTO_TILE_MIN
        # The shortest block call that could tile anything (before any probe ran).
        self._min_tokens = max(MIN_PROBE_TOKENS, least + 1, self.auto_min_sequence + 1 if mode == "auto" else 0)
        self._block_hooks: dict[int, list] = {}
        self._swapped: dict[int, nn.Module] = {}
        self._verdicts: dict[int, list[tuple[str, str, Verdict]]] = {}
        self._probing = 0  # depth of probes running: modules they call run as they are
        self._logged: set[str] = set()
        # [Note: tiling outside the blocks] block id -> its stack's sibling modules, by name.
        self._outside: dict[int, list[tuple[str, nn.Module]]] = {}
        self._outside_judged: set[int] = set()

    @classmethod
    def install(cls, model: nn.Module, mode: TilingMode = "auto", tile_tokens: TileTokens = "auto",
                block_classes: tuple[str, ...] | None = None) -> SequenceTiling:
        """Tiles the per-token submodules of ``model``'s blocks (`discovery.find_block_stacks`).

        ``mode``: ``True`` tiles every call longer than one tile; ``"auto"`` only calls whose
        sequence is longer than `AUTO_MIN_SEQUENCE`; ``False`` installs nothing.
        ``tile_tokens``: an int, or ``"auto"`` (`resolve_tile_tokens`)."""
        if mode not in (True, False, "auto") or (isinstance(mode, int) and not isinstance(mode, bool)):
            raise ValueError(f"sequence tiling mode {mode!r}: use \"auto\", True or False.")
        resolve_tile_tokens(tile_tokens, 1)  # validate now, not at the first long step
        tiling = cls(model, mode, tile_tokens)
        if mode is False:
            return tiling
        if any(_SITE in m.__dict__ for m in model.modules()):
            raise ValueError(f"{type(model).__name__} already has sequence tiling; remove() it before installing "
                             "again.")
        from .discovery import find_block_stacks

        stacks = find_block_stacks(model, block_classes)
        blocks = {id(b): b for stack in stacks for b in stack.blocks}
        for stack in stacks:
            outside = _stack_siblings(model, stack, blocks)
            for block in stack.blocks:
                tiling._outside[id(block)] = outside
        for block in blocks.values():  # the forward hook comes with the first long call
            tiling._block_hooks[id(block)] = [block.register_forward_pre_hook(tiling._block_pre, with_kwargs=True)]
        return tiling

    # ------------------------------------------------------------------ the policy
    def tile_tokens_for(self, x: Tensor, saved_bytes_per_token: int) -> int | None:
        """Tokens per tile for a call on ``x`` ``[..., s, h]``, or None: not tiled (one tile
        would hold it all, or ``"auto"`` and the sequence is not longer than `AUTO_MIN_SEQUENCE`)."""
        s = x.shape[-2]
        if self.mode == "auto" and s <= self.auto_min_sequence:
            return None
        rows = x.shape[:-2].numel()
        tokens = resolve_tile_tokens(self.tile_tokens, saved_bytes_per_token * rows)
        return tokens if s > tokens else None

    @contextlib.contextmanager
    def probing(self):
        """Inside: the modules being judged run as they are, undecided (another probe calls them)."""
        self._probing += 1
        try:
            yield
        finally:
            self._probing -= 1

    # ------------------------------------------------------------------ the first long forward
    def _block_pre(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else None  # the hidden states, in every HF block: a quick look first
        if type(x) is not Tensor or not x.is_floating_point() or x.dim() < 2:
            x = _block_input(args, kwargs)
            if x is None:
                return
        if x.shape[-2] < self._min_tokens or torch.is_inference_mode_enabled():
            return
        lead = x.shape[:-1]
        if id(block) not in self._verdicts:  # (it is, after a first long call that raised)
            self._verdicts[id(block)] = []
            # Registered now, it runs when this very call returns: nothing else pays for it.
            self._block_hooks[id(block)].append(block.register_forward_hook(self._block_post))
        for name, m in block.named_modules():
            if m is block or _SITE in m.__dict__ or _never_swapped(m):
                continue
            m.__dict__[_SITE] = TileSite(self, type(m), id(block), name, lead)
            m.__class__ = _tiling_class(type(m))
            self._swapped[id(m)] = m
        for name, m in self._outside.get(id(block), ()):
            if _SITE in m.__dict__ or id(m) in self._outside_judged:
                continue
            m.__dict__[_SITE] = TileSite(self, type(m), _OUTSIDE, name, lead)
            m.__class__ = _tiling_class(type(m))
            self._swapped[id(m)] = m

    def _block_post(self, block: nn.Module, args: tuple, output: Any) -> None:
        verdicts = self._verdicts.pop(id(block), None)
        if verdicts is None:
            return  # a call too short to tile: the block stays undecided
        for m in block.modules():
            site = m.__dict__.get(_SITE)
            if site is not None and site.state is _State.PROBING:  # not called: nothing to tile
                self._restore(m)
        for handle in self._block_hooks.pop(id(block), []):
            handle.remove()
        self._log(block, verdicts)

    def _first_call(self, site: TileSite, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._probing:  # called by the probe of a module around it: as it is
            return site.cls.forward(module, *args, **kwargs)
        found = _one_tensor(args, kwargs)
        if found is None or not found[1].is_floating_point() or not _same_tokens(found[1].shape[:-1], site.lead):
            verdict = None  # not a candidate: not called with one [..., s, h] tensor
        elif _observed(module):
            verdict = Verdict(False, "hooks observe it or a submodule")
        else:
            slot, x = found
            site.slot = slot
            self._probing += 1
            try:
                verdict = probe(site._runner(module, args, kwargs), module, x)
            finally:
                self._probing -= 1
        if site.block == _OUTSIDE:
            self._outside_judged.add(id(module))  # judged once, at its first long call
            if verdict is not None:
                self._log_outside(site.name, site.cls.__name__, verdict)
        elif verdict is not None and site.block in self._verdicts:
            self._verdicts[site.block].append((site.name, site.cls.__name__, verdict))
        if verdict is None or not verdict.tiled:
            self._restore(module)
            return site.cls.forward(module, *args, **kwargs)
        site.state = _State.TILED
        site.saved_bytes_per_token = verdict.saved_bytes_per_token
        for inner in module.modules():  # the outermost wins: what runs inside a tile stays plain
            if inner is not module and _SITE in inner.__dict__:
                self._restore(inner)
        return site(module, args, kwargs)

    def _restore(self, module: nn.Module) -> None:
        """`_restore`, and the module is no longer one this installation swapped once it is."""
        if _restore(module):
            self._swapped.pop(id(module), None)

    def _log(self, block: nn.Module, verdicts: list[tuple[str, str, Verdict]]) -> None:
        tiled = [f"{n} ({c})" for n, c, v in verdicts if v.tiled]
        idle = [n for n, _, v in verdicts if v.per_token and not v.tiled]
        unproven = [f"{n} ({c}): {v.reason}" for n, c, v in verdicts if not v.per_token]
        line = f"sequence tiling in each {type(block).__name__}: tiles {', '.join(tiled) or 'nothing'}"
        if idle:
            line += f"; per-token with nothing to save (left as they are): {', '.join(idle)}"
        if unproven:
            line += f"; not proven per-token, left untiled: {'; '.join(unproven)}"
        self._say(line)

    def _log_outside(self, name: str, cls: str, verdict: Verdict) -> None:
        if verdict.tiled:
            self._say(f"sequence tiling outside the blocks: tiles {name} ({cls})")
        else:
            why = "per-token with nothing to save" if verdict.per_token else verdict.reason
            self._say(f"sequence tiling outside the blocks: leaves {name} ({cls}) as it is: {why}")

    def _say(self, line: str) -> None:
        """Logs ``line`` once per installation."""
        if line not in self._logged:
            self._logged.add(line)
            logger.info("stronghold: %s", line)

    # ------------------------------------------------------------------ handle
    def remove(self) -> None:
        """Removes the hooks and gives every module its class back; idempotent."""
        for handles in self._block_hooks.values():
            for handle in handles:
                handle.remove()
        self._block_hooks.clear()
        for m in list(self._swapped.values()):
            self._restore(m)
        self._swapped.clear()
        self._verdicts.clear()


def tiled_modules(model: nn.Module) -> dict[str, TileSite]:
    """The modules of ``model`` whose calls are tiled, by name, with their `TileSite` (its
    ``calls`` counts the calls computed in tiles)."""
    return {name: m.__dict__[_SITE] for name, m in model.named_modules()
            if _SITE in m.__dict__ and m.__dict__[_SITE].state is _State.TILED}


__all__ = [
    "AUTO_MIN_SEQUENCE",
    "AUTO_TILE_BYTES",
    "SequenceTiling",
    "TileSite",
    "Verdict",
    "probe",
    "resolve_tile_tokens",
    "tiled_modules",
]
