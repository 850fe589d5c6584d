"""How a reader walks the package: from ``offload_model(config)`` through the calls it makes.

STYLE.md asks for data that flows one way: start at ``offload_model`` and follow the config
through the calls; every return to a module already left is a place where the design leaks.
This script follows them for real while ``offload_model`` builds the engine of a small GPT-2
(and, with ``--step``, through one training step): the reader is in the module of the frame
that runs, moves with each call into another ``stronghold_hf`` module and moves back with
each return, and reads each function once (a second call of it, in a loop or elsewhere, is
stepped over with everything it calls), as a reader would. It reports:

* ``stays``: how often the reader arrives in a module (consecutive frames of one module are
  one stay);
* ``modules``: how many modules the walk visits;
* ``climbs``: arrivals in a module the reader had already left (``stays - modules``);
* ``entries``: stays per module, most entered first;
* ``callbacks``: calls into a module still on the call stack below the caller (a lower layer
  calling back up), by edge.

    python scripts/module_walk.py            # offload_model only
    python scripts/module_walk.py --step     # one training step, after it
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import torch
import transformers as T


def module_of(filename: str) -> str | None:
    marker = "stronghold_hf/"
    i = filename.rfind(marker)
    return filename[i + len(marker):] if i >= 0 else None


def walk(fn) -> dict:
    """The reader's path through the modules while ``fn`` runs; see the module docstring."""
    events: list[str] = []  # the module the reader arrives in, call by call and return by return
    stack: list[tuple[str | None, bool]] = []  # (module, read) of each frame
    read: set = set()  # functions already read: a second call is not followed again
    calls_out: collections.Counter = collections.Counter()  # module -> calls it makes into other modules
    callbacks: collections.Counter = collections.Counter()

    def reader_at() -> str | None:
        return next((m for m, r in reversed(stack) if m is not None and r), None)

    def profiler(frame, event, arg):
        if event == "call":
            code = frame.f_code
            mod = module_of(code.co_filename)
            skipping = bool(stack) and not stack[-1][1]
            if code.co_name.startswith("<"):  # a comprehension or lambda: transparent, the reader stays
                stack.append((None, not skipping))
                return
            first = mod is not None and not skipping and code not in read
            if first:
                read.add(code)
                caller = reader_at()
                if caller is not None and mod != caller:
                    calls_out[caller] += 1
                    if any(m == mod for m, r in stack if r):
                        callbacks[f"{caller} -> {mod}"] += 1
                events.append(mod)
            # A frame already read (or inside one) is stepped over with everything it calls.
            stack.append((mod, first or (not skipping and mod is None)))
        elif event == "return" and stack:
            mod, was_read = stack.pop()
            if was_read and mod is not None:
                back = reader_at()
                if back is not None:
                    events.append(back)

    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    stays = [m for i, m in enumerate(events) if i == 0 or events[i - 1] != m]
    entries = collections.Counter(stays)
    return {"stays": len(stays), "modules": len(entries), "climbs": len(stays) - len(entries),
            "entries": dict(entries.most_common()), "callbacks": dict(callbacks.most_common())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", action="store_true", help="follow one training step too")
    args = p.parse_args(argv)
    from stronghold_hf import StrongholdConfig, offload_model

    torch.manual_seed(0)
    cfg = T.GPT2Config(n_embd=32, n_layer=4, n_head=2, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0)
    model = T.GPT2LMHeadModel(cfg)
    config = StrongholdConfig(window_size=2)
    holder = {}
    out = {"walk": "offload_model",
           **walk(lambda: holder.setdefault("engine", offload_model(model, config, device="cpu")))}
    if args.step:
        engine = holder["engine"]
        opt = engine.build_optimizer(lr=1e-3)
        ids = torch.randint(0, 128, (1, 16))

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            engine.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()

        out = {"walk": "one training step", **walk(step)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
