"""CPU Adam's step with torch's fused kernel (``CPUAdam(kernel="torch")``): the fallback where
the native kernel (csrc/cpu_adam.cpp) cannot be built.

``torch._fused_adamw_`` (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) does AdamW; the
copy-out to the bf16/fp16 image is a second pass, and a scaled or bf16 gradient goes through a
per-thread fp32 scratch chunk by chunk (`TorchAdamStep._chunked`). It agrees with the native
kernel to rounding (a few ulps per step), and its results do not depend on chunking.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor


class TorchAdamStep:
    """The torch kernel's step, with its per-thread scratch of ``chunk_numel`` fp32 elements."""

    def __init__(self, chunk_numel: int) -> None:
        self.chunk_numel = chunk_numel
        self._tls = threading.local()  # per-thread scratch of the scaled path

    def step(self, items, gmul: float, hyper: dict[str, Any]) -> None:
        """One step of ``items`` ((param, grad, state, copy-out target or None)) with ``grad * gmul``."""
        if gmul != 1.0:  # see [Note: the fused kernel writes the unscaled gradient back]
            self._chunked(items, torch.tensor(1.0 / gmul, dtype=torch.float32), hyper)  # a divisor
            return
        if any(g.dtype != torch.float32 for _, g, _, _ in items):  # bf16 gradients: widened chunk by chunk
            self._chunked(items, None, hyper, widen=True)
            return
        # grad_scale=None (not 1.0) keeps the gradient read-only. Copy-out is a separate pass:
        # chunking it to copy from cache measured no faster here (docs/performance.md), and
        # one call per group means one OpenMP region per tensor instead of several.
        ps, gs, sts = zip(*[(p, g, st) for p, g, st, _ in items])
        torch._fused_adamw_(list(ps), list(gs), [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts], [],
                            [s["step"] for s in sts], grad_scale=None, found_inf=None, **hyper)
        pairs = [(d, p) for p, _, _, d in items if d is not None]
        if pairs:
            torch._foreach_copy_(*map(list, zip(*pairs)))

    def _chunked(self, items, grad_scale: Tensor | None, hyper: dict[str, Any], widen: bool = False) -> None:
        """``_fused_adamw_`` over batches of <= chunk_numel elements (big tensors split, small
        ones packed), each followed by its copy-out while the params are still in cache, for
        a scaled gradient.

        [Note: the fused kernel writes the unscaled gradient back] Given ``grad_scale``,
        FusedAdamKernel.cpp stores ``grad / grad_scale`` into the gradient it is handed, so
        each chunk of the gradient is first copied into a per-thread fp32 scratch and the
        kernel gets that. DRAM traffic is unchanged (the copy reads the gradient once, the
        kernel then works in cache); the cost is the in-cache copy and a call per chunk. A bf16
        gradient takes the same scratch (``widen``, or any scaled step): the copy widens it.
        """
        limit = self.chunk_numel
        scratch = None
        if grad_scale is not None or widen or any(g.dtype != torch.float32 for _, g, _, _ in items):
            scratch = getattr(self._tls, "scratch", None)
            if scratch is None or scratch.numel() < limit:
                scratch = self._tls.scratch = torch.empty(limit, dtype=torch.float32)  # fp32 [chunk_numel]
        ps, gs, ms, vs, ss, dst, src = [], [], [], [], [], [], []  # one batch of 1-D views
        filled = 0

        def flush() -> None:
            nonlocal filled
            grads = gs
            if scratch is not None:
                grads = list(scratch[:filled].split([g.numel() for g in gs]))
                torch._foreach_copy_(grads, gs)
            torch._fused_adamw_(ps, grads, ms, vs, [], ss, grad_scale=grad_scale, found_inf=None, **hyper)
            if dst:
                torch._foreach_copy_(dst, src)
            for lst in (ps, gs, ms, vs, ss, dst, src):
                lst.clear()
            filled = 0

        for p, g, st, d in items:
            if p.numel() == 0:
                continue
            pieces = zip(*(t.view(-1).split(limit) for t in (p, g, st["exp_avg"], st["exp_avg_sq"])))
            d_pieces = d.view(-1).split(limit) if d is not None else None
            for k, (pp, gp, mp, vp) in enumerate(pieces):
                if filled and filled + pp.numel() > limit:
                    flush()
                ps.append(pp); gs.append(gp); ms.append(mp); vs.append(vp); ss.append(st["step"])
                if d_pieces is not None:
                    dst.append(d_pieces[k]); src.append(pp)
                filled += pp.numel()
        if ps:
            flush()


__all__ = ["TorchAdamStep"]
