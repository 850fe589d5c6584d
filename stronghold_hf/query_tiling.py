"""Query tiling: a causal block runs over tiles of queries, with the keys and values of the
whole sequence kept beside it.

Sequence tiling (``tiling.py``) tiles what treats each token on its own; the attention block
(its norm, the Q, K, V and output projections, the rotary copies, the attention output) still
runs on the whole sequence at once, and at long lengths it is what bounds a layer's recompute
and backward. A *causal* block's output for tokens ``[t0, t1)`` depends only on those tokens
and on the keys and values of tokens ``[0, t1)``: that is how a model decodes with a KV cache,
and how chunked prefill runs a prompt. So the block can run tile by tile through its own code,
given a cache that holds the keys and values of the tiles before (`_TileCache`): every
Hugging Face attention layer stores its keys and values through ``past_key_values.update``.

`QueryTiledBlock` is the autograd Function. Its forward runs the tiles in order, without grad,
and keeps the block's input and the keys and values of every token (``2 x s x kv_width``; the
part no tiling avoids). Its backward runs the tiles in *reverse* order, each with grad: the
tile's own keys and values must receive the gradients of every later tile's attention, and
those tiles came first, so their contributions wait in ``dK``/``dV``; the earlier tiles' keys
and values are leaves whose gradients join ``dK``/``dV`` for the tiles still to come. What a
tile holds is ``O(T)`` beyond the keys, values and their gradients, whatever the length.
The tiles write their own keys and values into the whole-length buffers and attend to a view
of the buffers' first ``t1`` tokens (`_JoinInPlace`): the prefix is never copied.

Nothing is chosen by class name. A block is tiled only if `probe` shows, on a prefix of its
real input, that running it in tiles gives the rows of running it whole: a bidirectional block
(BERT, T5's encoder), a block whose attention keeps no cache, or a call this module does not
know how to cut (`cut_call` names each argument it understands) is left whole.

Exact like ``tiling.py``: in fp32 the result matches the whole block to rounding (the attention
sums over the keys in another order); parameter gradients are summed in fp32 over the tiles.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .tiled_function import ParameterGradSums, autocast_state, replayed_rng, rng_state, sum_dtype
from .tiling import ModuleState

logger = logging.getLogger("stronghold_hf")

#: The names a block may call its cache argument (``cache`` from transformers 5.2x, before it
#: ``past_key_values``, and the older singular; GPT-BigCode, Bloom and MPT blocks call it
#: ``layer_past``). Whatever the name, the probe decides whether the tiles make the whole call.
CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


class _TileCache:
    """What a block's attention sees as ``past_key_values`` for one tile ``[t0, t1)``: its
    `update` writes the tile's keys and values into whole-sequence buffers (``keys``/``values``,
    ``[b, heads, s, d]``, made at the first tile's call when None) and returns the buffers' first
    ``t1`` tokens, the tiles before included: the prefix is joined in place, never copied (a
    copy of it was ``s`` tokens of K and V per call). It keeps the tile's own keys and values as
    the attention made them (``new_k``/``new_v``). ``prefix_k``/``prefix_v``: in a pass with
    grad, the buffers' first ``t0`` tokens as leaves, whose gradients the join gives back."""

    is_compileable = False

    def __init__(self, keys: Tensor | None, values: Tensor | None, t0: int, length: int,
                 prefix_k: Tensor | None = None, prefix_v: Tensor | None = None) -> None:
        self.keys, self.values, self.t0, self.length = keys, values, t0, length
        self.prefix_k, self.prefix_v = prefix_k, prefix_v
        self.new_k: Tensor | None = None
        self.new_v: Tensor | None = None
        self.calls = 0

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int = 0, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.calls += 1
        self.new_k, self.new_v = key_states, value_states
        if self.keys is None:
            self.keys = key_states.new_empty((*key_states.shape[:-2], self.length, key_states.shape[-1]))
            self.values = value_states.new_empty((*value_states.shape[:-2], self.length, value_states.shape[-1]))
        if self.prefix_k is not None and torch.is_grad_enabled():
            return (_JoinInPlace.apply(self.keys, self.prefix_k, key_states),
                    _JoinInPlace.apply(self.values, self.prefix_v, value_states))
        t0, t1 = self.t0, self.t0 + key_states.shape[-2]
        with torch.no_grad():
            self.keys[..., t0:t1, :].copy_(key_states)
            self.values[..., t0:t1, :].copy_(value_states)
        if not torch.is_grad_enabled() or not (key_states.requires_grad or value_states.requires_grad):
            return self.keys[..., :t1, :], self.values[..., :t1, :]
        return key_states, value_states  # the first tile, with grad: its own keys are the whole prefix

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.t0


class _JoinInPlace(torch.autograd.Function):
    """``cat([prefix, new], -2)`` without the copy: ``prefix`` is ``buffer[..., :t0, :]`` (a leaf
    view), ``new`` is written into ``buffer[..., t0:t1, :]``, and the result is
    ``buffer[..., :t1, :]``. Its gradient splits into the two parts as views."""

    @staticmethod
    def forward(ctx, buffer: Tensor, prefix: Tensor, new: Tensor) -> Tensor:
        t0, t1 = prefix.shape[-2], prefix.shape[-2] + new.shape[-2]
        buffer[..., t0:t1, :].copy_(new)
        ctx.t0 = t0
        return buffer[..., :t1, :]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        return None, grad[..., : ctx.t0, :], grad[..., ctx.t0 :, :]


@dataclass(frozen=True)
class CutCall:
    """How one call of a block is cut into query tiles: the call's arguments by name (the
    hidden states apart), and how each is sliced for tokens ``[t0, t1)``."""

    hidden_name: str
    cache_name: str
    length: int
    slicers: dict[str, Callable[[Any, int, int], Any]]
    causal_mask: str | None  # the call passed no mask: how the tiles get a causal one ("sdpa", "dense"; None: none needed)
    layer_idx: int | None  # where a cache the model passed keeps this block's keys and values
    model_cache: Any  # that cache (empty for this block), filled with the whole keys and values after
    drop_weights: bool = False  # the call asked for no attention weights: a tile's are dropped (`_first`)

    def tile_kwargs(self, kwargs: dict[str, Any], t0: int, t1: int, cache: _TileCache, like: Tensor) -> dict[str, Any]:
        out = {}
        for name, value in kwargs.items():
            slicer = self.slicers.get(name)
            out[name] = value if slicer is None else slicer(value, t0, t1)
        if self.causal_mask is not None:
            out["attention_mask"] = _causal_tile_mask(self.causal_mask, t0, t1, like.device)
        out[self.cache_name] = cache
        return out

    def shortened(self, n: int) -> "CutCall":
        return CutCall(self.hidden_name, self.cache_name, n, self.slicers, self.causal_mask, None, None,
                       self.drop_weights)


def _causal_tile_mask(kind: str, t0: int, t1: int, device: torch.device):
    """The mask of query tile ``[t0, t1)`` against keys ``[0, t1)``: query ``i`` is token
    ``t0 + i`` and sees keys ``[0, t0 + i]`` (causal, aligned bottom-right; SDPA's own
    ``is_causal`` aligns top-left, wrong once there are fewer queries than keys). For SDPA,
    torch's lower-right causal bias, which on CUDA its flash kernel applies without a dense
    mask ([T, t1] booleans would be 16 GiB for a tile of 8k queries at 2M tokens; on the CPU
    torch builds that mask); a dense boolean mask for any other attention that needs one."""
    if kind == "sdpa":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(t1 - t0, t1)
    rows = torch.arange(t0, t1, device=device)[:, None]
    return (torch.arange(t1, device=device)[None, :] <= rows)[None, None]


def _attention_implementation(module: nn.Module) -> str | None:
    for m in module.modules():
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if isinstance(impl, str):
            return impl
    return None


def _slice_dim(dim: int):
    def cut(t, t0, t1):
        return t.narrow(dim, t0, t1 - t0)
    return cut


def _slice_pair(dim: int):
    def cut(pair, t0, t1):
        return type(pair)(t.narrow(dim, t0, t1 - t0) for t in pair)
    return cut


def _slice_mask(mask: Tensor, t0: int, t1: int) -> Tensor:
    return mask[..., t0:t1, :t1]


def bind_call(forward: Callable, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | str:
    """The call's arguments by name (``**kwargs`` ones included), or why they cannot be named."""
    try:
        bound = inspect.signature(forward).bind(module, *args, **kwargs)
    except (TypeError, ValueError) as err:
        return f"its arguments cannot be named ({err})"
    named = dict(bound.arguments)
    named.pop(next(iter(named)))  # self
    for name, p in inspect.signature(forward).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
        elif p.kind is inspect.Parameter.VAR_POSITIONAL and name in named:
            if named.pop(name):
                return "it takes extra positional arguments"
    return named


def _layer_index(module: nn.Module) -> int | None:
    return next((m.layer_idx for m in module.modules() if isinstance(getattr(m, "layer_idx", None), int)), None)


def cut_call(forward: Callable, module: nn.Module, named: dict[str, Any]) -> CutCall | str:
    """How to cut this call of a block's ``forward`` (its arguments by name, `bind_call`) into
    query tiles, or why it cannot be (a string). The hidden states are the first argument;
    every other tensor argument must be one this function knows (the mask, the rotary tables,
    the positions, the cache position) or must not have the sequence length in any dimension
    (those go to every tile as they are)."""
    params = inspect.signature(forward).parameters
    hidden_name = list(params)[1] if len(params) > 1 else None
    hidden = named.get(hidden_name)
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        return "its first argument is not [batch, tokens, width] hidden states"
    s = hidden.shape[1]
    cache_name = next((n for n in CACHE_ARGS if n in params), None)
    if cache_name is None:
        return "its forward takes no cache"
    model_cache, layer_idx = named.get(cache_name), None
    if model_cache is not None:
        # A cache the model made for this forward (use_cache in training): it must hold nothing
        # for this block yet, and gets the whole keys and values afterwards, as without tiling.
        layer_idx = _layer_index(module)
        get_length = getattr(model_cache, "get_seq_length", None)
        if layer_idx is None or get_length is None or get_length(layer_idx) != 0 or not hasattr(model_cache, "update"):
            return "it was called with a cache that holds tokens already"
    if named.get("output_attentions"):
        return "it is asked for its attention weights (whole [tokens, tokens] maps)"
    slicers: dict[str, Callable] = {}
    causal_mask = None
    if "attention_mask" in params and named.get("attention_mask") is None:
        # No mask: the model relies on the kernel's causal flag. Flash attention's aligns
        # bottom-right when there are fewer queries than keys, which is what a tile needs.
        impl = _attention_implementation(module) or "sdpa"
        causal_mask = None if impl.startswith("flash") else ("sdpa" if impl == "sdpa" else "dense")
    for name, value in named.items():
        if name in (hidden_name, cache_name) or value is None:
            continue
        if name == "attention_mask":
            if isinstance(value, Tensor) and value.dim() == 4 and value.shape[-2] == s and value.shape[-1] >= s:
                slicers[name] = _slice_mask
            else:
                return "its attention mask is not a [batch, heads, tokens, tokens] tensor"
        elif name == "position_embeddings" and isinstance(value, tuple):
            if not all(isinstance(t, Tensor) and t.dim() >= 2 and t.shape[-2] == s for t in value):
                return "its position embeddings are not [.., tokens, dim] tables"
            slicers[name] = _slice_pair(-2)
        elif name == "position_ids" and isinstance(value, Tensor):
            if value.shape[-1] != s:
                return "its position ids do not have one per token"
            slicers[name] = _slice_dim(-1)
        elif name == "cache_position" and isinstance(value, Tensor):
            if value.dim() != 1 or value.shape[0] != s:
                return "its cache position does not have one per token"
            slicers[name] = _slice_dim(0)
        elif isinstance(value, Tensor) and value.dim() >= 2 and value.shape[-1] == s and value.shape[-2] == 1 and (
                s not in value.shape[:-1]):
            # One value per key, broadcast over the queries (Bloom's ALiBi, [batch x heads, 1, keys]):
            # a tile attends to keys [0, t1).
            slicers[name] = _slice_keys
        elif isinstance(value, Tensor):
            if s in value.shape:  # per token, in a way this does not know (a bias, a mask of its own)
                return f"it takes a tensor argument {name!r} with a dimension of the sequence length"
            # Anything else (the Trainer's num_items_in_batch, an encoder's states) goes to each
            # tile as it is; the probe shows whether the tiles still make the whole call.
        elif isinstance(value, (tuple, list, dict)) and any(
                isinstance(v, Tensor) and s in v.shape for v in (value.values() if isinstance(value, dict) else value)):
            return f"its argument {name!r} holds tensors with a dimension of the sequence length"
    if "attention_mask" not in params:
        return "its forward takes no attention mask"
    drop_weights = "output_attentions" in params and not named.get("output_attentions")
    return CutCall(hidden_name, cache_name, s, slicers, causal_mask, layer_idx, model_cache, drop_weights)


def _first(out, drop_weights: bool = False):
    """The hidden states of a block's output: a tensor, or a tuple whose other entries are None
    (or, with ``drop_weights``, attention weights the call did not ask for: MPT returns them
    whatever ``output_attentions`` says, and its model reads them only when it asked)."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], Tensor) and all(
            o is None or (drop_weights and isinstance(o, Tensor)) for o in out[1:]):
        return out[0]
    raise RuntimeError(f"query tiling: the block returned {type(out).__name__}, not its hidden states alone")


def _arity(out) -> int:
    """How the whole call returns: 0 for a bare tensor, else the tuple's length."""
    return 0 if isinstance(out, Tensor) else len(out)


def _slice_keys(t, t0, t1):
    return t[..., :t1]


@contextlib.contextmanager
def _sdpa_native_gqa():
    """transformers' SDPA path repeats K and V to every query head unless the call has no mask
    (``use_gqa_in_sdpa``); a tile's lower-right causal bias is a mask to it, and the repeat
    would cost ``heads / kv_heads`` copies of the prefix per tile. Its switch for passing
    ``enable_gqa`` instead (torch's flash kernel takes lower-right causal and GQA as they are)
    is an environment variable read at each call: set for the tile's call only."""
    key = "TRANSFORMERS_SDPA_FORCE_GQA"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _call(forward, module, cut: CutCall, x: Tensor, kwargs: dict[str, Any], t0: int, t1: int,
          cache: _TileCache) -> Tensor:
    kw = cut.tile_kwargs(kwargs, t0, t1, cache, x)
    kw[cut.hidden_name] = x
    if cut.causal_mask == "sdpa" and t0:
        with _sdpa_native_gqa():
            return _first(forward(module, **kw), cut.drop_weights)
    return _first(forward(module, **kw), cut.drop_weights)


def _tiles(s: int, tokens: int) -> list[tuple[int, int]]:
    return [(t0, min(t0 + tokens, s)) for t0 in range(0, s, tokens)]


class QueryTiledBlock(torch.autograd.Function):
    """The block's ``forward(module, hidden, **kwargs)`` over query tiles; see the module
    docstring. ``params`` are inputs so that their gradients leave through this node, as in
    ``tiled_function.TiledForward``."""

    @staticmethod
    def forward(ctx, forward, module, cut: CutCall, kwargs: dict, tile_tokens: int, preserve_rng: bool,
                x: Tensor, *params: Tensor) -> Tensor:
        ctx.forward, ctx.module, ctx.cut, ctx.kwargs = forward, module, cut, kwargs
        ctx.tile_tokens, ctx.params = tile_tokens, params
        ctx.autocast = autocast_state(x.device.type)
        s = x.shape[1]
        out = keys = values = None
        rng = []
        for t0, t1 in _tiles(s, tile_tokens):
            rng.append(rng_state(x.device) if preserve_rng else None)
            cache = _TileCache(keys, values, t0, s)  # the tile's keys and values go into the whole buffers
            yt = _call(forward, module, cut, x[:, t0:t1].contiguous(), kwargs, t0, t1, cache)
            if cache.calls != 1:
                raise RuntimeError(f"query tiling: the block stored keys and values {cache.calls} times in one call; "
                                   "set attention_tiling=False")
            if out is None:
                out = yt.new_empty((yt.shape[0], s, *yt.shape[2:]))
                keys, values = cache.keys, cache.values
            out[:, t0:t1] = yt
        ctx.rng = rng
        ctx.save_for_backward(x, keys, values)
        if cut.model_cache is not None:
            cut.model_cache.update(keys, values, cut.layer_idx)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, keys, values = ctx.saved_tensors
        need_x = ctx.needs_input_grad[6]
        wanted = [k for k, need in enumerate(ctx.needs_input_grad[7:]) if need]
        params = [ctx.params[k] for k in wanted]
        s = x.shape[1]
        grad_x = torch.empty_like(x) if need_x else None
        # The gradients of the keys and values of every token, from the tiles done so far (fp32
        # for 16-bit keys: each tile adds to them once).
        d_keys = torch.zeros_like(keys, dtype=sum_dtype(keys.dtype))
        d_values = torch.zeros_like(values, dtype=sum_dtype(values.dtype))
        sums = ParameterGradSums(len(params))
        tiles = _tiles(s, ctx.tile_tokens)
        with torch.enable_grad(), torch.autocast(**ctx.autocast):
            for index in reversed(range(len(tiles))):
                t0, t1 = tiles[index]
                with replayed_rng(ctx.rng[index]):
                    xt = x[:, t0:t1].detach().contiguous().requires_grad_(need_x)
                    # The prefix as leaves over the saved keys and values: the tile's own are
                    # written after them (the same values again) and joined without a copy,
                    # through ``.data`` (a version counter of its own), so that the saved
                    # tensors read as unmodified to a retained graph's second backward.
                    pk = keys[..., :t0, :].detach().requires_grad_() if t0 else None
                    pv = values[..., :t0, :].detach().requires_grad_() if t0 else None
                    cache = _TileCache(keys.data, values.data, t0, s, pk, pv)
                    yt = _call(ctx.forward, ctx.module, ctx.cut, xt.view_as(xt) if need_x else xt, ctx.kwargs, t0, t1,
                               cache)
                outputs = [yt, cache.new_k, cache.new_v]
                grads_out = [grad_out[:, t0:t1], d_keys[..., t0:t1, :].to(cache.new_k.dtype),
                             d_values[..., t0:t1, :].to(cache.new_v.dtype)]
                inputs = ([xt] if need_x else []) + ([pk, pv] if t0 else []) + params
                live = [(o, g) for o, g in zip(outputs, grads_out) if o.requires_grad]
                grads = (torch.autograd.grad([o for o, _ in live], inputs, [g for _, g in live], allow_unused=True)
                         if live else (None,) * len(inputs))
                if need_x:
                    gx, grads = grads[0], grads[1:]
                    grad_x[:, t0:t1] = 0 if gx is None else gx
                if t0:
                    gk, gv, grads = grads[0], grads[1], grads[2:]
                    if gk is not None:
                        d_keys[..., :t0, :] += gk
                    if gv is not None:
                        d_values[..., :t0, :] += gv
                sums.add(grads)
        return None, None, None, None, None, None, grad_x, *sums.result(ctx.params, wanted)


def run_query_tiled(forward: Callable, module: nn.Module, cut: CutCall, named: dict[str, Any],
                    tile_tokens: int, preserve_rng: bool = True) -> Tensor:
    """The block's output for the call ``named`` (`bind_call`) over query tiles of
    ``tile_tokens``; its gradients through `QueryTiledBlock` when grad is on."""
    x = named[cut.hidden_name]
    kwargs = {k: v for k, v in named.items() if k not in (cut.hidden_name, cut.cache_name)}
    params = [p for p in module.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        with torch.no_grad():
            return QueryTiledBlock.forward(_NoCtx(), forward, module, cut, kwargs, tile_tokens, False, x)
    return QueryTiledBlock.apply(forward, module, cut, kwargs, tile_tokens, preserve_rng, x, *params)


class _NoCtx:
    """The ``ctx`` of a forward without grad: what it is given is dropped."""

    def save_for_backward(self, *tensors) -> None:
        pass


def probe(forward: Callable, module: nn.Module, named: dict[str, Any], tokens: int = 12,
          tile: int = 4) -> tuple[str | None, int]:
    """Whether running ``module`` in query tiles gives the rows of running it whole, on the first
    ``tokens`` tokens of the call ``named`` (eval mode, no grad; what the calls change in the
    block, `tiling.ModuleState`, is put back): None if it does, else why not;
    and how the whole call returns (`_arity`), which the tiled call then returns too."""
    cut = cut_call(forward, module, named)
    if isinstance(cut, str):
        return cut, 0
    n = min(tokens, cut.length)
    if n <= tile:
        return "the call is too short to probe", 0
    short = cut.shortened(n)
    x = named[cut.hidden_name][:, :n].detach()
    kwargs = {k: (cut.slicers[k](v, 0, n) if k in cut.slicers else v) for k, v in named.items()
              if k not in (cut.hidden_name, cut.cache_name)}
    kept = ModuleState(module)  # what the probe's calls change in the block is put back after them
    kept.set_training(lambda m: False)
    try:
        with torch.no_grad():
            raw = forward(module, **{**kwargs, cut.hidden_name: x})
            arity, whole = _arity(raw), _first(raw, cut.drop_weights)
            tiled = QueryTiledBlock.forward(_NoCtx(), forward, module, short, kwargs, tile, False, x)
    except Exception as err:  # a block this cannot run in tiles is left whole, not broken
        return f"running it in tiles raised {type(err).__name__}: {err}", 0
    finally:
        kept.restore()
    if whole.shape != tiled.shape:
        return "its tiles do not make its output", arity
    scale = whole.abs().max().clamp_min(1e-6)
    # Under bf16/fp16 autocast the output may be fp32 (the residual adds) while its matmuls
    # rounded to 8 bits of mantissa: tiles and the whole call then differ by that rounding.
    low_precision = whole.dtype != torch.float32 or (
        torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) != torch.float32)
    tol = 2e-2 if low_precision else 1e-4
    if not bool(((whole - tiled).abs().max() / scale) <= tol):
        return "its tiles give other rows than the whole call (it is not causal, or not through its cache)", arity
    return None, arity


# --------------------------------------------------------------------------------------------
# Installed on a model's blocks
# --------------------------------------------------------------------------------------------

#: ``tile_tokens="auto"`` for query tiles: a tile of a Llama-3-8B block in bf16 holds about
#: 1.6 GB of intermediates at this many tokens, and each tile reads the keys and values before
#: it once (fewer, larger tiles read them fewer times).
AUTO_QUERY_TILE = 8192

_QT = "_stronghold_query_tiling"
_QT_PLAIN = "_stronghold_query_plain"
_QT_CLASSES: dict[type, type] = {}


def _query_reduce_ex(self, protocol):
    # A copy or pickle is of the plain class, without the tiling (as tiling.py's classes).
    import copyreg

    state = {k: v for k, v in self.__getstate__().items() if k != _QT}
    return copyreg._reconstructor, (getattr(type(self), _QT_PLAIN), object, None), state


def _query_class(cls: type) -> type:
    """The block's class with a ``forward`` that goes through its `QueryTiling` ([Note: the
    tiled class] in tiling.py). A ``GradientCheckpointingLayer`` wraps a subclass's forward in
    its checkpoint too, and only the outermost wrapper checkpoints: the whole tiled call is
    checkpointed as the block's own call was."""
    import functools

    sub = _QT_CLASSES.get(cls)
    if sub is None:
        def forward(self, *args, **kwargs):
            return self.__dict__[_QT].call(self, cls.forward, args, kwargs)

        functools.update_wrapper(forward, cls.forward)
        sub = type(cls.__name__, (cls,), {
            "forward": forward, "__reduce_ex__": _query_reduce_ex, _QT_PLAIN: cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        })
        _QT_CLASSES[cls] = sub
    return sub


def resolve_query_tile_tokens(tile_tokens: int | str) -> int:
    """Queries per tile: ``tile_tokens`` itself, or `AUTO_QUERY_TILE` for ``"auto"``."""
    if tile_tokens == "auto":
        return AUTO_QUERY_TILE
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens!r}: pass an int >= 1 or 'auto'.")
    return tile_tokens


def causal_attention(model: nn.Module) -> bool:
    """Whether every attention module of ``model`` says it is causal (``is_causal``, which
    transformers' attention classes set): what the estimator takes for the probe's verdict,
    which needs real inputs. BERT's and T5's encoders are not; a model that says nothing is
    not taken for causal."""
    flags = [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    return bool(flags) and all(flags)


class QueryTiling:
    """Query tiling installed on a model's blocks (`install`); `remove` undoes it.

    Each block's class is swapped for one whose ``forward`` runs a call longer than one tile
    through `run_query_tiled`, once `probe` has shown, at the block's first such call, that the
    tiles give the whole call's rows; a block that fails (or a call `cut_call` cannot cut) runs
    whole, and one log line per block class and reason says so. ``calls`` counts the tiled calls."""

    def __init__(self, tile_tokens: int | str, around_probe: Callable | None = None) -> None:
        self.tile_tokens = resolve_query_tile_tokens(tile_tokens)
        self.blocks: list[nn.Module] = []
        self.verdicts: dict[int, str | None] = {}  # id(block) -> None (tiled) or why not
        self._arity: dict[int, int] = {}  # id(block) -> how its whole call returns (`_arity`)
        self.calls = 0
        self._around_probe = around_probe  # a context manager factory the probe runs inside
        self._logged: set[str] = set()

    @classmethod
    def install(cls, model: nn.Module, tile_tokens: int | str = "auto", block_classes: tuple[str, ...] | None = None,
                around_probe: Callable | None = None) -> QueryTiling:
        """Swaps the classes of ``model``'s blocks (`discovery.find_block_stacks`). ``around_probe``:
        what the probe runs inside (the sequence tiling's `probing`, so that its own judging of
        the block's submodules waits for the real call)."""
        from .discovery import find_block_stacks

        tiling = cls(tile_tokens, around_probe)
        for stack in find_block_stacks(model, block_classes):
            for block in stack.blocks:
                if _QT in block.__dict__ or "forward" in block.__dict__:
                    continue  # twice in the stacks, or a forward set on the instance (that one runs)
                block.__dict__[_QT] = tiling
                block.__class__ = _query_class(type(block))
                tiling.blocks.append(block)
        return tiling

    def call(self, block: nn.Module, forward: Callable, args: tuple, kwargs: dict[str, Any]):
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[1] <= self.tile_tokens:
            return forward(block, *args, **kwargs)
        named = bind_call(forward, block, args, kwargs)
        verdict = self.verdicts.get(id(block), False)
        if verdict is False:  # the first long call: decide
            if isinstance(named, str):
                verdict = named
            else:
                with self._around_probe() if self._around_probe is not None else contextlib.nullcontext():
                    verdict, self._arity[id(block)] = probe(forward, block, named)
            self.verdicts[id(block)] = verdict
            self._log(block, verdict)
        if verdict is not None or isinstance(named, str):
            return forward(block, *args, **kwargs)
        cut = cut_call(forward, block, named)
        if isinstance(cut, str):  # this call differs from the probed one (a cache, a mask)
            self._log(block, cut)
            return forward(block, *args, **kwargs)
        self.calls += 1
        out = run_query_tiled(forward, block, cut, named, self.tile_tokens)
        arity = self._arity.get(id(block), 0)
        # The whole call's structure (Bloom's and MPT's models read ``outputs[0]``); the weights
        # the call did not ask for are None.
        return out if not arity else (out,) + (None,) * (arity - 1)

    def _log(self, block: nn.Module, verdict: str | None) -> None:
        line = (f"attention tiling: each {type(block).__name__} runs in query tiles of {self.tile_tokens} tokens"
                if verdict is None else f"attention tiling: {type(block).__name__} runs whole: {verdict}")
        if line not in self._logged:
            self._logged.add(line)
            logger.info("stronghold: %s", line)

    def remove(self) -> None:
        """Gives every block its class back; idempotent."""
        for block in self.blocks:
            if block.__dict__.pop(_QT, None) is not None:
                block.__class__ = getattr(type(block), _QT_PLAIN)
        self.blocks.clear()


def installed(model: nn.Module) -> QueryTiling | None:
    """The `QueryTiling` installed on ``model``'s blocks (its ``calls``, ``verdicts``), or None."""
    return next((m.__dict__[_QT] for m in model.modules() if _QT in m.__dict__), None)


__all__ = ["AUTO_QUERY_TILE", "QueryTiledBlock", "QueryTiling", "bind_call", "causal_attention", "cut_call",
           "installed", "probe", "resolve_query_tile_tokens", "run_query_tiled"]
