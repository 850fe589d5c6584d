"""Reading a causal LM's forward: is the step from its LM head to its loss one the chunked loss
reproduces exactly, and which elementwise transform does it apply to the logits in between?

The chunked loss (chunked_loss.py) replaces ``logits = self.lm_head(h)`` and
``self.loss_function(logits=logits, ...)`` by one chunked computation, which is exact only if
nothing else happens between the two. This module reads the class's ``forward`` source (its
AST) and answers with a `LossPlan`: the head's path and the `HeadTransform` to replay per chunk
(Gemma2/Gemma3 soft-capping, Cohere's ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's
``lm_head_multiplier``), or why not, in one line naming the model class.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import Tensor, nn

logger = logging.getLogger("stronghold_hf")

# --------------------------------------------------------------------------------------------
# The transform between the head and the loss
# --------------------------------------------------------------------------------------------

HeadOp = Literal["mul", "div", "tanh", "float"]


@dataclass(frozen=True, slots=True)
class HeadTransform:
    """The elementwise steps a model's forward applies to ``lm_head``'s output before its loss.

    ``ops`` are applied in order, each in the dtype the logits have at that point (bf16 under
    autocast), exactly as the modeling code writes them: ``("mul", s)`` is ``x * s``,
    ``("div", s)`` is ``x / s``, ``("tanh", None)`` is ``torch.tanh(x)`` and ``("float", None)``
    is ``x.float()``. Soft-capping is three ops, not one fused ``cap * tanh(x / cap)``, because
    in bf16 each op rounds and HF rounds after each.
    """

    ops: tuple[tuple[HeadOp, float | None], ...] = ()

    def __post_init__(self):
        for op, value in self.ops:
            if op in ("mul", "div"):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"HeadTransform: ({op!r}, {value!r}) needs a number, e.g. ({op!r}, 0.0625).")
            elif op not in ("tanh", "float"):
                raise ValueError(f"HeadTransform: unknown op {op!r}; use 'mul', 'div', 'tanh' or 'float'.")

    @classmethod
    def softcap(cls, cap: float) -> HeadTransform:
        """Gemma2/Gemma3's ``final_logit_softcapping``: ``cap * tanh(logits / cap)``."""
        return cls((("div", cap), ("tanh", None), ("mul", cap)))

    @classmethod
    def scale(cls, multiplier: float) -> HeadTransform:
        """Cohere's ``logit_scale``, Falcon-H1's ``lm_head_multiplier``: ``logits * multiplier``."""
        return cls((("mul", multiplier),))

    @classmethod
    def divide(cls, divisor: float) -> HeadTransform:
        """Granite's ``logits_scaling``: ``logits / divisor``."""
        return cls((("div", divisor),))

    def __call__(self, logits: Tensor) -> Tensor:
        for op, value in self.ops:
            if op == "mul":
                logits = logits * value
            elif op == "div":
                logits = logits / value
            elif op == "tanh":
                logits = torch.tanh(logits)
            elif op == "float":
                logits = logits.float()
        return logits

    def describe(self) -> str:
        words = {"mul": "* {}", "div": "/ {}", "tanh": "tanh", "float": "float()"}
        return ", ".join(words[op].format(v) for op, v in self.ops) or "no transform"


# --------------------------------------------------------------------------------------------
# Analysis: is the step from the head to the loss one we reproduce?
# --------------------------------------------------------------------------------------------

#: Config attributes a forward may scale its logits by, checked against the modeling code of
#: the installed transformers (5.24): Gemma2/Gemma3 divide by ``final_logit_softcapping``,
#: tanh, multiply by it; Cohere/Cohere2 multiply by ``logit_scale`` (copied to
#: ``self.logit_scale``); Granite/GraniteMoe divide by ``logits_scaling``; Falcon-H1
#: multiplies by ``lm_head_multiplier`` (copied to ``self.model.lm_head_multiplier``).
CONFIG_SCALARS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
_SOFTCAP = "final_logit_softcapping"
_BENIGN_METHODS = ("contiguous", "to")


@dataclass(frozen=True, slots=True)
class LossPlan:
    """What `analyse_causal_lm` found: the head module's path in the model and the transform."""

    head_path: str
    transform: HeadTransform


class _NotUnderstood(Exception):
    pass


@functools.lru_cache(maxsize=1)
def _causal_lm_names() -> frozenset[str]:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    except ImportError:  # pragma: no cover - a transformers without the auto mapping
        return frozenset()
    out = set()
    for value in names.values():
        out.update((value,) if isinstance(value, str) else value)
    return frozenset(out)


def is_causal_lm_class(cls: type) -> bool:
    """The class or a base is in transformers' causal-LM auto mapping or is named ``*ForCausalLM``."""
    names = _causal_lm_names()
    return any(c.__name__ in names or c.__name__.endswith("ForCausalLM") for c in cls.__mro__)


def _class_forward(model: nn.Module) -> Callable:
    """The unwrapped function the class's ``forward`` runs; raises if someone replaced it."""
    cls = type(model)
    own = model.__dict__.get("forward")
    if own is not None:
        # TRL's add_fused_lm_head installs a functools.wraps wrapper whose ``__wrapped__`` is the
        # class forward; without ``fused_lm_head=True`` it calls the original. Liger binds its
        # own forward, which wraps nothing.
        f, seen = own, 0
        while f is not None and f is not cls.forward and getattr(f, "__func__", None) is not cls.forward:
            f, seen = getattr(f, "__wrapped__", None), seen + 1
            if seen > 16:
                f = None
        if f is None:
            fn = getattr(own, "__func__", own)
            raise _NotUnderstood(f"forward was replaced on the instance by "
                                 f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}")
    owner = next(c for c in cls.__mro__ if "forward" in c.__dict__)
    fn = inspect.unwrap(owner.__dict__["forward"])
    module = getattr(fn, "__module__", "") or ""
    if module != owner.__module__ and not module.startswith("transformers."):
        # Liger's apply_liger_kernel_to_* assigns its own forward to the transformers class.
        raise _NotUnderstood(f"{owner.__name__}.forward was replaced by {module}.{fn.__qualname__}")
    return fn


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


class _ForwardReader:
    """Walks a forward's statements from the head call to the ``self.loss_function`` call."""

    def __init__(self, model: nn.Module, fdef: ast.FunctionDef, head_path: str):
        self.model = model
        self.self_name = fdef.args.args[0].arg if fdef.args.args else "self"
        self.head = f"{self.self_name}.{head_path}"
        self.head_path = head_path
        self.fdef = fdef
        self.ops: list[tuple[HeadOp, float | None, str | None]] = []

    # -- expressions -------------------------------------------------------------------------

    def _is(self, node: ast.AST, base: ast.AST | str) -> bool:
        if isinstance(base, str):
            return isinstance(node, ast.Name) and node.id == base
        return node is base

    def _contains(self, node: ast.AST, base: ast.AST | str) -> bool:
        return any(self._is(n, base) for n in ast.walk(node))

    def _config_scalar(self, node: ast.AST) -> tuple[float, str]:
        """``self.config.logit_scale`` or ``self.logit_scale``: a number a known attribute names."""
        chain = _dotted(node)
        if chain is None or not chain.startswith(self.self_name + ".") or chain.rsplit(".", 1)[-1] not in CONFIG_SCALARS:
            raise _NotUnderstood(f"scales the logits by `{ast.unparse(node)}`, which no config attribute explains")
        value: Any = self.model
        for attr in chain.split(".")[1:]:
            value = getattr(value, attr, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _NotUnderstood(f"scales the logits by `{ast.unparse(node)}` = {value!r}, not a number")
        return value, chain.rsplit(".", 1)[-1]

    def peel(self, expr: ast.AST, base: ast.AST | str) -> None:
        """Appends to ``ops`` what ``expr`` does to ``base`` (the head call or the logits name)."""
        if self._is(expr, base):
            return
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and self._contains(expr.func.value, base):
            method = expr.func.attr
            self.peel(expr.func.value, base)
            if method == "float" and not expr.args and not expr.keywords:
                self.ops.append(("float", None, None))
                return
            if method == "tanh" and not expr.args and not expr.keywords:
                self.ops.append(("tanh", None, None))
                return
            if method in _BENIGN_METHODS and self._benign_call(expr):
                return
            raise _NotUnderstood(f"applies `{ast.unparse(expr)}` to the logits")
        if (isinstance(expr, ast.Call) and _dotted(expr.func) == "torch.tanh" and len(expr.args) == 1
                and not expr.keywords):
            self.peel(expr.args[0], base)
            self.ops.append(("tanh", None, None))
            return
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Mult, ast.Div)):
            if self._contains(expr.left, base) and not self._contains(expr.right, base):
                self.peel(expr.left, base)
                value, attr = self._config_scalar(expr.right)
                self.ops.append(("mul" if isinstance(expr.op, ast.Mult) else "div", value, attr))
                return
            if isinstance(expr.op, ast.Mult) and self._contains(expr.right, base) and not self._contains(expr.left, base):
                self.peel(expr.right, base)
                value, attr = self._config_scalar(expr.left)
                self.ops.append(("mul", value, attr))
                return
        raise _NotUnderstood(f"computes `{ast.unparse(expr)}` from the logits")

    def _benign_call(self, call: ast.Call) -> bool:
        # ``.contiguous()`` changes no value, nor does ``.to(<...device>)``. A ``.to`` that may
        # name a dtype could round the logits, so it is not understood.
        if call.func.attr == "contiguous":
            return not call.args and not call.keywords
        args = [*call.args, *(k.value for k in call.keywords if k.arg in (None, "device"))]
        return (len(args) == 1 and len(call.args) + len(call.keywords) == 1
                and (_dotted(args[0]) or "").rsplit(".", 1)[-1] == "device")

    # -- statements --------------------------------------------------------------------------

    def _config_test(self, test: ast.AST) -> bool | None:
        """Evaluates ``if self.config.x is not None:`` style tests; ``None`` for runtime tests."""
        negate = False
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, negate = test.operand, True
        compare = None
        if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
                and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
            compare, test = test.ops[0], test.left
        chain = _dotted(test)
        if chain is None or not chain.startswith(f"{self.self_name}.config."):
            return None
        value: Any = self.model
        for attr in chain.split(".")[1:]:
            if not hasattr(value, attr):
                return None
            value = getattr(value, attr)
        result = bool(value) if compare is None else ((value is None) == isinstance(compare, ast.Is))
        return result != negate

    def _loss_call(self, node: ast.AST) -> ast.Call | None:
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and _dotted(n.func) == f"{self.self_name}.loss_function":
                return n
        return None

    def _stores(self, node: ast.AST, name: str) -> bool:
        return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(node))

    def follow(self, stmts: list[ast.stmt], name: str) -> bool:
        """True when the statements reach a ``self.loss_function(name, ...)`` call with ``name``
        rebound only by understood steps; raises `_NotUnderstood` for anything else."""
        for stmt in stmts:
            line = f"line {stmt.lineno - 1 + self.fdef.lineno}" if hasattr(stmt, "lineno") else "a statement"
            call = self._loss_call(stmt)
            if isinstance(stmt, ast.If):
                known = self._config_test(stmt.test)
                if known is not None:
                    if self.follow(stmt.body if known else stmt.orelse, name):
                        return True
                    continue
                if call is not None:
                    # A runtime test (``if labels is not None``) guards the loss: follow the
                    # branch that calls it; the other one does not reach the loss.
                    branch = stmt.body if any(self._loss_call(s) is call for s in stmt.body) else stmt.orelse
                    if self._contains(stmt.test, name):
                        raise _NotUnderstood(f"tests the logits in {line}")
                    return self.follow(branch, name)
                if self._contains(stmt, name):
                    raise _NotUnderstood(f"uses `{name}` under a runtime condition in {line}")
                continue
            if call is not None:
                if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr)):
                    raise _NotUnderstood(f"calls loss_function inside a {type(stmt).__name__} in {line}")
                given = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "logits"), None)
                if given is None or not self._is(given, name):
                    raise _NotUnderstood(f"passes `{ast.unparse(given) if given else 'nothing'}` as logits "
                                         f"to loss_function, not `{name}`")
                return True
            if self._stores(stmt, name):
                target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
                if not (isinstance(target, ast.Name) and target.id == name):
                    raise _NotUnderstood(f"rebinds `{name}` in {line}: `{ast.unparse(stmt)}`")
                self.peel(stmt.value, name)
                continue
            if self._contains(stmt, name):
                raise _NotUnderstood(f"uses `{name}` before its loss in {line}: `{ast.unparse(stmt)[:80]}`")
        return False

    def read(self) -> HeadTransform:
        heads = [n for n in ast.walk(self.fdef) if isinstance(n, ast.Call) and _dotted(n.func) == self.head]
        if len(heads) != 1:
            raise _NotUnderstood(f"its forward calls `{self.head}(...)` {len(heads)} times, not once")
        losses = [n for n in ast.walk(self.fdef) if isinstance(n, ast.Call)
                  and _dotted(n.func) == f"{self.self_name}.loss_function"]
        if len(losses) != 1:
            raise _NotUnderstood(f"its forward calls `{self.self_name}.loss_function(...)` {len(losses)} times, not once")
        body = self.fdef.body
        at = next((i for i, s in enumerate(body) if any(n is heads[0] for n in ast.walk(s))), None)
        stmt = body[at] if at is not None else None
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            raise _NotUnderstood(f"`{self.head}(...)` is not assigned to a name at the top level of forward")
        name = stmt.targets[0].id
        self.peel(stmt.value, heads[0])
        if not self.follow(body[at + 1:], name):
            raise _NotUnderstood(f"`{name}` from `{self.head}` never reaches `self.loss_function` as its logits")
        return self._checked_transform()

    def _checked_transform(self) -> HeadTransform:
        ops = self.ops
        for k, (op, value, attr) in enumerate(ops):
            in_softcap = (0 < k < len(ops) - 1 and ops[k - 1][0] == "div" and ops[k + 1][0] == "mul"
                          and ops[k - 1][2] == ops[k + 1][2] == _SOFTCAP)
            if op == "tanh" and not in_softcap:
                raise _NotUnderstood("applies tanh to the logits outside a final_logit_softcapping soft-cap")
            if attr == _SOFTCAP and not any(ops[j][0] == "tanh" and j in (k - 1, k + 1) for j in range(len(ops))):
                raise _NotUnderstood("scales the logits by final_logit_softcapping outside a soft-cap")
        return HeadTransform(tuple((op, value) for op, value, _ in ops))


def analyse_causal_lm(model: nn.Module) -> tuple[LossPlan | None, str]:
    """Whether ``model`` can take the chunked loss: ``(plan, reason)``, or ``(None, reason)``
    with one line naming the model class and what was not understood."""
    name = type(model).__name__
    try:
        from transformers import PreTrainedModel
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None, f"{name}: transformers is not importable"
    if not isinstance(model, PreTrainedModel):
        return None, f"{name} is not a transformers PreTrainedModel"
    if not is_causal_lm_class(type(model)):
        return None, f"{name} is not a causal LM (not in the causal-LM auto mapping, not *ForCausalLM)"
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    if type(head) is not nn.Linear or "forward" in head.__dict__:
        # A subclass (bitsandbytes' Linear4bit, a LoRA wrapper) computes something other
        # than F.linear(x, weight, bias) with the weight it exposes.
        return None, f"{name}: its output embedding is {type(head).__name__}, not a plain nn.Linear"
    head_path = next((p for p, m in model.named_modules() if m is head), None)
    if not head_path:
        return None, f"{name}: its output embedding is not a submodule of the model"
    if model.loss_function is not ForCausalLMLoss:
        fn = model.loss_function
        return None, (f"{name}: its loss_function is {getattr(fn, '__qualname__', type(fn).__name__)}, "
                      f"not transformers' ForCausalLMLoss")
    try:
        fn = _class_forward(model)
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
        fdef = tree.body[0]
        if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise _NotUnderstood("its forward is not a plain function")
        fdef.lineno = inspect.getsourcelines(fn)[1]
        transform = _ForwardReader(model, fdef, head_path).read()
    except _NotUnderstood as e:
        return None, f"{name}: {e}"
    except (OSError, TypeError, SyntaxError) as e:
        return None, f"{name}: its forward source cannot be read ({e})"
    return LossPlan(head_path, transform), f"{name}: {head_path} -> loss_function, {transform.describe()}"


__all__ = ["CONFIG_SCALARS", "HeadTransform", "LossPlan", "analyse_causal_lm", "is_causal_lm_class"]
