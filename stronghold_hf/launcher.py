"""``python -m stronghold_hf SCRIPT [ARGS...]``: STRONGHOLD for an unchanged training script.

Most training scripts (the transformers examples, TRL recipes, in-house scripts) build a
``transformers.Trainer`` or a subclass of it and never import this package. The launcher
runs such a script as ``python SCRIPT ARGS`` would, after arranging that every Trainer it
constructs is a STRONGHOLD Trainer, with the settings of the ``STRONGHOLD_*`` environment.

How: `patch_trainers` gives ``transformers.Trainer`` a ``__new__`` that, for any class
``cls`` derived from it, builds an instance of ``type("Stronghold" + cls.__name__,
(_StrongholdTrainerMixin, cls), {})`` instead (one per class, cached). Python then runs
that type's ``__init__``: the mixin's, which hands every argument on to ``cls.__init__``.
Classes that already carry the mixin (`StrongholdTrainer`, ``class
MySFT(StrongholdTrainer, SFTTrainer)``) are built as they are. Nothing installed is edited,
and the patch lives only in this process.

It composes with the launchers that start one Python process per device, because each of
those processes is ``python -m stronghold_hf SCRIPT``::

    torchrun --nproc_per_node 8 -m stronghold_hf train.py --bf16 ...
    accelerate launch -m stronghold_hf train.py ...
"""

from __future__ import annotations

import functools
import logging
import os
import runpy
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

logger = logging.getLogger("stronghold_hf")

PROG = "python -m stronghold_hf"
USAGE = f"""usage: {PROG} [-h] SCRIPT [ARGS ...]
       {PROG} -m MODULE [ARGS ...]

Runs a training script unchanged with STRONGHOLD working-window offloading and CPU Adam
on for every transformers.Trainer it builds (Trainer, Seq2SeqTrainer, TRL trainers such as
SFTTrainer, and their subclasses). SCRIPT gets ARGS in sys.argv, as under `python SCRIPT`.

Settings come from the environment (a variable that is empty counts as unset):
  STRONGHOLD          1/true/yes/on (the default under this launcher) or 0/false/no/off
  STRONGHOLD_WINDOW_SIZE  auto (default) or N: blocks kept on the device
  STRONGHOLD_CONFIG   a StrongholdConfig as JSON, or the path of a JSON file
The script's command line may carry the same settings as options, whether or not its parser
knows them, and they win over the environment:
  --stronghold [true|false]   --stronghold_window_size N|auto   --stronghold_config JSON|PATH
A parser that does not declare them (plain TrainingArguments, TRL's configs, argparse) never
sees them.

With one process per device, put this module where the script would go:
  torchrun --nproc_per_node 8 -m stronghold_hf train.py ARGS
  accelerate launch -m stronghold_hf train.py ARGS

The memory estimate has its own command: python -m stronghold_hf.estimate --help
"""


class UsageError(Exception):
    """A launcher command line that cannot run; the message says why."""


# ---------------------------------------------------------------------------- the patch
@functools.cache
def stronghold_class(cls: type) -> type:
    """``cls`` with the STRONGHOLD Trainer behaviour in front (``cls`` itself if it has it)."""
    from .integrations.trainer import _StrongholdTrainerMixin

    if issubclass(cls, _StrongholdTrainerMixin):
        return cls
    return type(f"Stronghold{cls.__name__}", (_StrongholdTrainerMixin, cls), {
        "__module__": __name__,
        "__qualname__": f"Stronghold{cls.__qualname__}",
        "__doc__": f"`{cls.__module__}.{cls.__qualname__}` with STRONGHOLD (built by {PROG}).",
    })


_active = 0  # how many patch_trainers() blocks are open


def _stronghold_new(cls, *args, **kwargs):
    # Trainer has no __new__ of its own: object.__new__ takes the class alone. Python runs the
    # __init__ of the returned instance's type, a subclass of cls, with the caller's arguments.
    return object.__new__(stronghold_class(cls) if _active else cls)


@contextmanager
def patch_trainers() -> Iterator[None]:
    """While active, every ``transformers.Trainer`` (subclass) built is a STRONGHOLD one.

    [Note: the __new__ stays] Once a class has had ``__new__`` assigned, CPython keeps
    routing construction through the ``__new__`` attribute; deleting it leaves
    ``object.__new__`` to be called with the constructor's arguments, which it refuses. So
    the hook is installed once and turns into plain ``object.__new__(cls)`` when no block is
    open.
    """
    global _active
    from transformers import Trainer

    current = Trainer.__dict__.get("__new__")
    if current is None:
        Trainer.__new__ = staticmethod(_stronghold_new)
    elif getattr(current, "__func__", None) is not _stronghold_new:
        raise RuntimeError(
            "transformers.Trainer already defines __new__ (another tool patched it, or a newer transformers "
            f"does); {PROG} cannot wrap it. Use StrongholdTrainer, or STRONGHOLD=1 with StrongholdTrainer."
        )
    _active += 1
    try:
        yield
    finally:
        _active -= 1


# ---------------------------------------------------------------------------- the script's options
def _options() -> dict[str, str]:
    """The stronghold options of `StrongholdTrainingArguments` (``--a_b`` and ``--a-b``, as
    HfArgumentParser takes them), and the variable each sets for a script whose parser lacks them."""
    from .integrations.arguments import ENV_CONFIG, ENV_FLAG, ENV_WINDOW_SIZE

    return {"stronghold": ENV_FLAG, "stronghold_window_size": ENV_WINDOW_SIZE, "stronghold_config": ENV_CONFIG}


def _as_flag(word: str) -> str | None:
    """``"1"``/``"0"`` for a boolean as HfArgumentParser reads one (``string_to_bool``), else None."""
    from transformers.hf_argparser import string_to_bool

    try:
        return "1" if string_to_bool(word) else "0"
    except Exception:  # argparse.ArgumentTypeError: not a boolean
        return None


def take_stronghold_options(args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``args`` without its stronghold options, and the ``STRONGHOLD_*`` variables they set.

    ``--stronghold`` alone means true and takes the next word only when it is a boolean, as
    HfArgumentParser reads it; the other two need a value. Raises `UsageError` when one is
    missing, or when ``--stronghold=`` is given something that is not a boolean."""
    options = _options()
    rest, variables = [], {}
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        name = name.replace("-", "_")
        if name not in options:
            rest.append(arg)
            i += 1
            continue
        i += 1
        if name == "stronghold":
            flag = _as_flag(value) if eq else (_as_flag(args[i]) if i < len(args) else None)
            if eq and flag is None:
                raise UsageError(f"--stronghold={value!r} is not a boolean; use true or false")
            if not eq and flag is not None:
                i += 1
            value = flag if flag is not None else "1"
        elif not eq:
            if i >= len(args) or args[i].startswith("--"):
                raise UsageError(f"--{name} needs a value")
            value, i = args[i], i + 1
        variables[options[name]] = value
    return rest, variables


@contextmanager
def parsers_skip_stronghold_options() -> Iterator[None]:
    """While active, an argument parser that declares no ``--stronghold`` option (an
    ``HfArgumentParser`` over plain `TrainingArguments`, TRL's own copy of that parser, a
    script's argparse) parses its command line without the stronghold options
    (`take_stronghold_options`), which `main` has already put into the environment; one that
    declares them (`StrongholdTrainingArguments`) parses them itself. Patched at
    ``argparse.ArgumentParser.parse_known_args``, which ``parse_args`` and HfArgumentParser's
    ``parse_args_into_dataclasses`` both call."""
    import argparse

    original = argparse.ArgumentParser.parse_known_args

    @functools.wraps(original)
    def parse_known_args(self, args=None, namespace=None):
        if "--stronghold" not in self._option_string_actions:
            args, _ = take_stronghold_options(sys.argv[1:] if args is None else list(args))
        return original(self, args, namespace)

    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


# ---------------------------------------------------------------------------- the command line
def _parse(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """``(kind, target, args)`` with kind ``"script"`` or ``"module"``; raises `UsageError`."""
    if not argv:
        raise UsageError("the script to run is missing")
    head, rest = argv[0], list(argv[1:])
    if head == "-m":
        if not rest:
            raise UsageError("-m needs a module name")
        return "module", rest[0], rest[1:]
    if head.startswith("-m") and len(head) > 2:  # -mpackage.module, as python accepts
        return "module", head[2:], rest
    if head.startswith("-"):
        raise UsageError(
            f"unknown option {head!r}: the launcher takes no options of its own (settings come from the "
            "STRONGHOLD_* environment variables); the script's own options go after the script"
        )
    if not os.path.isfile(head):
        raise UsageError(f"cannot find the script {head!r}")
    return "script", head, rest


def _turn_on_from_environment(options: dict[str, str]) -> tuple[bool, str]:
    """Sets ``STRONGHOLD=1`` unless the user set it, then the variables the script's stronghold
    ``options`` set (they win); validates all of them and describes them."""
    from .integrations.arguments import ENV_FLAG, settings_from_env

    if not os.environ.get(ENV_FLAG, "").strip():
        os.environ[ENV_FLAG] = "1"  # child processes (dataloader workers, spawned ranks) inherit it
    os.environ.update(options)
    try:
        on, config = settings_from_env()
    except ValueError as err:  # name the option the user wrote, not the variable it set
        message = str(err)
        for name, variable in _options().items():
            if variable in options:
                message = message.replace(f"Environment variable {variable}", f"--{name}")
        raise ValueError(message) from None
    source = "the command line and the STRONGHOLD_* environment variables" if options else \
        "the STRONGHOLD_* environment variables"
    return on, f"window_size={config.window_size}, from {source}"


def _run(kind: str, target: str, args: list[str]) -> None:
    if kind == "script":
        # As `python SCRIPT ARGS`: argv[0] is the script as given, the folder it really lives
        # in (symlinks resolved) leads sys.path. (__file__ stays as given, where python 3.9+
        # makes it absolute: the same file either way while the script keeps its directory.)
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        runpy.run_path(target, run_name="__main__")
    else:
        # As `python -m MODULE ARGS`: the working directory leads sys.path; runpy sets argv[0].
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0
    try:
        kind, target, args = _parse(argv)
        options = take_stronghold_options(args)[1]
        on, described = _turn_on_from_environment(options)
    except (UsageError, ValueError) as err:
        short_usage = "\n".join(USAGE.splitlines()[:2])
        sys.stderr.write(f"{short_usage}\n{PROG}: error: {err}\n(see {PROG} --help)\n")
        return 2
    name = target if kind == "script" else f"-m {target}"
    lead = os.environ.get("RANK", "0") == "0"  # say things once per job under torchrun/accelerate, not per rank
    if lead:
        if on:
            logger.warning("%s: STRONGHOLD is on for every transformers.Trainer that %s builds, and every model it "
                           "prepares through accelerate (%s).", PROG, name, described)
        else:
            how = "--stronghold false" if "STRONGHOLD" in options else f"STRONGHOLD={os.environ['STRONGHOLD']}"
            logger.warning("%s: %s turns STRONGHOLD off; running %s unchanged.", PROG, how, name)
    if not on:
        with parsers_skip_stronghold_options():
            _run(kind, target, args)
        return 0
    from .integrations import accelerate as accelerate_side

    before, prepared = stronghold_class.cache_info(), accelerate_side.prepared_models
    with patch_trainers(), accelerate_side.patch_accelerate(), parsers_skip_stronghold_options():
        _run(kind, target, args)
    after = stronghold_class.cache_info()
    if lead and after.hits + after.misses == before.hits + before.misses and accelerate_side.prepared_models == prepared:
        logger.warning("%s: %s built no transformers.Trainer and prepared no model through "
                       "accelerate, so STRONGHOLD changed nothing. For a plain PyTorch loop use offload_model.",
                       PROG, name)
    return 0
