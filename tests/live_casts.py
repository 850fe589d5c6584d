"""Counting autocast's casts that stay alive: what a backward keeps in autocast's cache.

[Note: autocast's cache in backward] in stronghold_hf/chunked_loss.py: a cast autocast caches
lives until its context exits, so a chunk's or tile's bf16 copy of its input, if cached, is
alive next to every later one. `LiveCasts` keeps weak references to the bf16 copies of fp32
tensors that ``which(out)`` selects and records the most of them alive at once.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveCasts(TorchDispatchMode):
    def __init__(self, which: Callable[[torch.Tensor], bool]):
        super().__init__()
        self.which, self.refs, self.most_alive = which, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
                and args[0].dtype == torch.float32 and self.which(out)):
            self.refs.append(weakref.ref(out))
            self.most_alive = max(self.most_alive, sum(r() is not None for r in self.refs))
        return out
