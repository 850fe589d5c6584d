"""A vocabulary-sized weight that crosses to the device in row pieces, never whole.

Llama-3's embedding and untied head are 525M parameters each, its largest block 218M. Streamed
as one unit, such a weight sets the size of a device slot, a gradient lane and the staging:
the device budget then grows with the vocabulary, not with a block. With
``StrongholdConfig(vocab_pieces=True)`` (the default) a unit that is one ``[vocab, hidden]``
weight larger than the largest block is used a *piece* of rows at a time instead
(`VocabularyPieces`):

* the input embedding gathers the rows a batch uses on the host and sends only those (row
  fetch); its backward sends the rows' gradient back and adds it into the host gradient;
* the head (``F.linear`` on the weight, in the model's own forward, and the chunked loss,
  which asks for pieces itself: ``vocab_ops.py``) fetches one piece of at most a block's rows
  at a time, and each piece's gradient goes to the host as soon as the piece is done.

So the device holds a piece of the weight (two while the next one's copy lands: [Note: piece
prefetch]) and a piece of its gradient, never ``vocab x hidden``. The unit's host side is unchanged: one master, one image, one host gradient, one
optimizer entry, one checkpoint tensor, and between steps the parameter is its host master as
for every unit. The unit is not in the window's sequence (the window's slots, lanes and staging
are sized by the blocks); the forwards of the modules that register the weight are routed here
while they run (``vocab_routing.py``).

[Note: lent whole] Any other use of the weight during a model forward (TRL's fused LM head,
``model(..., fused_lm_head=True)``; Liger's loss, which multiplies by ``lm_head.weight``
outside the head; a head that does ``x @ self.weight.T``; PEFT's DoRA norm) gets the unit lent
whole to the device for that forward and its backward (`lend_whole`): the engine cannot give
those ops pieces, so it gives them what plain training would, once per forward, said once in
the log. The weight stays guarded for that (read_guard.py: its class is `GuardedParameter` for
the engine's life), so such a use is seen on any device, not only as a device mismatch on a GPU.
Outside a forward the weight reads as every offloaded weight does: its host value.

A head's ``[vocab]`` bias (BERT's MLM decoder, Phi's head) is part of the unit and crosses with
each piece. What stays whole (the unit streams through the window as before): a unit of other
parameters besides, data parallel over several ranks (the pieces' gradients are not reduced
across them), sharded CPU state, a weight used by a module that is neither an embedding nor a
linear layer, an embedding with ``max_norm``. Without a host image (``host_image=False``) the
rows are converted from the fp32 masters on the way (with ``nvme_masters``, mapped from the
file).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn

from .fastpath import engine_access as _engine_access
from .read_guard import asks_where_storage_is
from .vocab_routing import describe_use

logger = logging.getLogger("stronghold_hf")

#: At most this many pieces per weight: a piece is a block's rows unless a tiny block sits next to
#: a vocabulary of more than this many blocks (a Python iteration and a copy per piece and pass).
MAX_PIECES = 1024


def piece_rows(vocab: int, hidden: int, largest_block: int) -> int:
    """Rows per piece of a ``[vocab, hidden]`` weight: a block's worth, at most `MAX_PIECES` pieces."""
    from .chunked_loss import vocab_piece_rows

    return vocab_piece_rows(vocab, hidden, largest_block, MAX_PIECES) or vocab


def shape_problem(params, owners) -> str | None:
    """Why parameters ``params`` registered by ``owners`` (a unit's, or its spec's) cannot be read
    in row pieces whatever the engine's state; None: one ``[vocab, hidden]`` weight, with a
    ``[vocab]`` bias at most, used by embeddings and linear layers. (The estimator asks too.)"""
    weight, *bias = params
    if weight.dim() != 2 or len(bias) > 1 or (bias and tuple(bias[0].shape) != (weight.shape[0],)):
        return "not one [vocab, hidden] weight (with a [vocab] bias at most)"
    # An embedding, a linear layer, or a module that registers only the bias (BERT's prediction
    # head, whose decoder uses it): their forwards are routed, and any other use lent whole.
    if not all(isinstance(m, (nn.Embedding, nn.Linear)) or all(k == 1 for _, k in names) for m, names in owners):
        return "a module other than an embedding or a linear layer registers its weight"
    if any(isinstance(m, nn.Embedding) and (m.max_norm is not None or m.scale_grad_by_freq or m.sparse)
           for m, _ in owners):
        return "an embedding with max_norm, scale_grad_by_freq or sparse gradients uses it"
    return None


def why_not_pieced(u, largest_block: int) -> str | None:
    """Why unit ``u`` keeps streaming whole (None: it can cross in row pieces)."""
    if u.kind != "streamed":
        return "not a unit outside the blocks"
    problem = shape_problem(u.params, u.owners)
    if problem is not None:
        return problem
    if sum(p.numel() for p in u.params) <= largest_block:
        return "no larger than a block"
    if u.sharded:
        return "its CPU state is sharded across ranks"
    if u.dp is not None and u.dp.world > 1:
        return "data parallel across ranks (its pieces' gradients are not reduced across them)"
    return None


class VocabularyPieces:
    """One vocabulary-sized unit's device side, a row piece at a time; see the module docstring.

    ``enter_backward``: the schedule's start of a backward pass (the host gradient takes what
    the user left in ``.grad`` first); the head's backward runs before any block's."""

    def __init__(self, unit, rows_per_piece: int, *, transfer, ledger, host, coordinator, worker,
                 enter_backward, grad_queue=None) -> None:
        self.unit = unit
        # The blocks' gradient lanes, whose pinned staging carries the pieces' gradients ([Note:
        # vocabulary pieces through the lanes] in grads.py); None, or a queue without lanes (no
        # block streams a gradient): two pinned buffers of a piece of its own.
        self.grad_queue = grad_queue if grad_queue is not None and grad_queue.carries_staged else None
        self.weight: nn.Parameter = unit.params[0]
        self.bias: nn.Parameter | None = unit.params[1] if len(unit.params) > 1 else None
        self.vocab, self.width = unit.layout.entries[0].shape
        self.dtype = unit.layout.entries[0].device_dtype
        self.rows_per_piece = max(1, min(int(rows_per_piece), self.vocab))
        self.bounds = [(r0, min(r0 + self.rows_per_piece, self.vocab))
                       for r0 in range(0, self.vocab, self.rows_per_piece)]
        self.transfer = transfer
        self.ledger = ledger
        self.coordinator = coordinator
        self.worker = worker
        self._enter_backward = enter_backward
        self._host = host
        self._device = transfer.device
        self._alias = transfer.mode == "sync"  # CPU compute: the image rows are the device rows
        # Two pinned buffers of a piece's gradient: one landing while the other is added on the host.
        self._staging: list[torch.Tensor | None] = [None, None]
        self._staging_ticket: list = [None, None]
        self._turn = 0
        self._folds: list = []  # this backward's folds on the host worker (tickets)
        # [Note: pieces' host gradient] It stays in the compute dtype (bf16 host gradients,
        # unit_grads.py) while each row gets one contribution per backward, as a whole unit's
        # lane gives it: a head's piece is summed on the device (in fp32 over the chunks) and
        # added once into a zeroed row range, which is exact. A second contribution to the same
        # rows (an accumulation across backwards, the head used twice, a tied embedding's rows
        # after the head's pieces) or the embedding's rows (summed per id) widen it to fp32
        # first, for good (`_begin_grad`).
        self._added: set[tuple[int, int]] = set()  # (parameter, piece) added in this backward
        self._rows_added = False  # the embedding's rows were added in this backward
        self.piece_bytes = self.rows_per_piece * self.width * self.dtype.itemsize
        self.fetches = 0
        self._ahead: tuple | None = None  # (piece, device tensor, landed event): [Note: piece prefetch]
        self._lent: tuple | None = None  # (host views, bytes, hook handles): `lend_whole`
        self._lent_for_backward = False  # a forward with gradients read the lent copy: kept until its backward ends
        self.routing = 0  # inside a routed call (`routed`): reads of the weight are the pieces'
        self._said_lent = False

    # ------------------------------------------------------------------ host state
    def _image(self, i: int = 0) -> torch.Tensor:
        """The rows a fetch reads of parameter ``i`` (the weight, or the bias), current (the CPU
        update of the unit is done and writes made between steps are taken in): the
        compute-dtype image, or without one (``host_image=False``) the fp32 masters, converted by
        the caller."""
        u = self.unit
        if self._lent is None:  # lent whole, the parameters point at the device copy, made current
            self.coordinator.wait_update(u)
            with _engine_access():
                u.host.adopt_host_writes()
                u.host.refresh_image()
        image = u.host.image_views[i]
        return image if image is not None else u.host.read_value(i)

    def _fold(self, what: str, task):
        """Runs ``task`` (an add into the host gradient) on the host worker, in order with the
        unit's other work; the schedule's end of the backward waits for it (`drain`). Returns
        its ticket."""
        ticket = self.worker.submit((what, self.unit.fqn), task, unit=self.unit.index, urgent=True)
        self._folds.append(ticket)
        return ticket

    def drain(self) -> None:
        """Every fold so far has landed in the host gradient (the end of a backward, before
        anything reads it: the exposed ``.grad``, a norm, the step)."""
        folds, self._folds = self._folds, []
        for ticket in folds:
            ticket.wait()

    def _begin_grad(self, i: int = 0, piece: int | None = None, *, enter: bool = True) -> torch.Tensor:
        """A gradient contribution of this backward pass to parameter ``i`` (row piece
        ``piece``, or None: the embedding's rows, or a whole gradient): its host gradient, to add
        into (zeroed first when it holds nothing yet; widened to fp32 first when the
        contribution would be a sum: [Note: pieces' host gradient]). ``enter=False``: called
        from the schedule's end of the backward itself."""
        if enter:
            self._enter_backward()  # the schedule's end of this backward drains the folds
        u, g = self.unit, self.unit.grads
        if g.spec is not None:  # more gradient after a speculative update read the old one
            self.coordinator.undo_speculation(u)
        first = g.flushes_this_pass == 0
        if first:
            self._added.clear()
            self._rows_added = False
        if g.grad_flat is not None and g.grad_flat.dtype != torch.float32:
            sums = g.grad_valid[i] and (first or piece is None or self._rows_added or (i, piece) in self._added)
            if sums or piece is None:
                self.drain()  # the folds queued so far add into the buffer that is replaced
                g.widen("its rows get a second gradient contribution" if sums else
                        "the embedding's rows are summed per id on the host")
        if piece is None:
            self._rows_added = True
        else:
            self._added.add((i, piece))
        hg = g.grad_views[i]
        if not g.grad_valid[i]:
            hg.zero_()
            g.grad_valid[i] = True
        if first:
            g.flushes += 1
            g.flushes_this_pass = 1
        g.device_norm = None  # the norm is taken on the host at clip
        return hg

    # ------------------------------------------------------------------ pieces of the weight
    def fetch(self, k: int) -> torch.Tensor:
        """Piece ``k``'s rows on the device, ``[rows, hidden]`` in the compute dtype; give it
        back with `release`.

        [Note: piece prefetch] Every use sweeps the pieces in order, from 0: a fetch of ``k``
        also starts the copy of ``k + 1``, which lands while ``k`` computes (two pieces on the
        device at once). A copy started for another piece than the one fetched is what a sweep
        that stopped part-way (it raised) left behind: it is dropped, since the unit may have
        been updated since."""
        self.fetches += 1
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] != k:
            self.release(ahead[0])
            ahead = None
        dst, landed = ahead[1:] if ahead is not None else self._start_copy(k)
        if k + 1 < len(self.bounds):
            self._ahead = (k + 1, *self._start_copy(k + 1))
        if landed is not None:
            self.transfer.device_wait(landed)
        return dst

    def _host_rows(self, k: int) -> torch.Tensor:
        r0, r1 = self.bounds[k]
        return self._image()[r0:r1].to(self.dtype)

    def _start_copy(self, k: int):
        """Books piece ``k`` on the device and starts its copy there; ``(tensor, landed event)``.
        On the CPU device the image rows are the device rows (no copy, no event), booked all the
        same: the ledger holds what a GPU would, one piece ahead included."""
        rows = self._host_rows(k)
        nbytes = rows.numel() * rows.element_size()
        self.ledger.device_alloc(nbytes)
        if self._alias:
            self.ledger.count_h2d(nbytes, fetch=True)
            return rows, None
        dst = torch.empty(rows.shape, dtype=rows.dtype, device=self._device)
        return dst, self.transfer.copy_h2d(dst, rows, fetch=True)

    def fetch_bias(self, k: int) -> torch.Tensor:
        """Piece ``k``'s rows of the bias on the device (``[rows]``, a block's rows / hidden the
        size of its weight's piece: not booked as a slot)."""
        r0, r1 = self.bounds[k]
        rows = self._image(1)[r0:r1].to(self.unit.layout.entries[1].device_dtype)
        self.ledger.count_h2d(rows.numel() * rows.element_size(), fetch=True)
        return rows if self._alias else rows.to(self._device)

    def add_bias_grad(self, k: int, grad: torch.Tensor) -> None:
        """Adds piece ``k``'s gradient of the bias (device, ``[rows]``) into its host gradient."""
        r0, r1 = self.bounds[k]
        hg = self._begin_grad(1, k)
        self.ledger.count_d2h(grad.numel() * grad.element_size())
        self._fold("a vocabulary piece's bias gradient of ", functools.partial(torch.Tensor.add_, hg[r0:r1],
                                                                                 grad.to("cpu")))

    def release(self, k: int) -> None:
        r0, r1 = self.bounds[k]
        self.ledger.device_free((r1 - r0) * self.width * self.dtype.itemsize)

    def new_grad(self, k: int) -> torch.Tensor:
        """A zeroed fp32 sum for piece ``k``'s gradient on the device (booked in the ledger until
        `add_piece_grad` takes it: its bytes are `grad_sum_bytes`)."""
        self.ledger.device_alloc(self.grad_sum_bytes(k))
        r0, r1 = self.bounds[k]
        return torch.zeros((r1 - r0, self.width), dtype=torch.float32, device=self._device)

    def grad_sum_bytes(self, k: int) -> int:
        r0, r1 = self.bounds[k]
        return (r1 - r0) * self.width * 4

    def book(self, *tensors: torch.Tensor | None) -> int:
        """Books the device tensors the pieces' backward made (a piece's gradient, its cast)
        until `add_piece_grad` takes them; returns their bytes (a repeat or None: nothing)."""
        seen, nbytes = set(), 0
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                nbytes += t.numel() * t.element_size()
        self.ledger.device_alloc(nbytes)
        return nbytes

    def add_piece_grad(self, k: int, grad: torch.Tensor, booked: int = 0):
        """Adds piece ``k``'s gradient (device, ``[rows, hidden]``) into the host gradient;
        ``booked``: the device bytes whose booking ends here (the sum `new_grad` gave, what
        `book` booked). Returns the event of its copy to the host (into a buffer of its own; on
        the CPU device a host copy, done), or None when it goes through a lane's staging, whose
        copies the fold may issue in halves: ``grad`` must not change before the copy landed, or
        before `drain`."""
        r0, r1 = self.bounds[k]
        self.ledger.device_free(booked)
        hg = self._begin_grad(0, k)
        queue = self.grad_queue
        if queue is not None:
            lane = queue.acquire_staging()
            flush = queue.send_staged(lane, grad.reshape(-1))
            lane.ticket = self._fold("a vocabulary piece's gradient of ", functools.partial(
                queue.land, lane, flush, functools.partial(_add_at, hg[r0:r1].view(-1))))
            return None
        nbytes = grad.numel() * grad.element_size()
        # On the CPU device too: the copy is a host copy, and the same two buffers and folds run.
        turn, self._turn = self._turn, 1 - self._turn
        if self._staging_ticket[turn] is not None:
            self._staging_ticket[turn].wait()  # its last piece was added: the buffer is free
        if self._staging[turn] is None or self._staging[turn].numel() < nbytes:
            self._staging[turn] = self._host.allocate(self.rows_per_piece * self.width * grad.element_size(),
                                                      transfer=True)
        staged = self._staging[turn][:nbytes].view(grad.dtype).view(grad.shape)
        landed = self.transfer.copy_d2h(staged, grad)
        self._fold("a vocabulary piece's gradient of ",
                   functools.partial(_land_and_add, self.transfer, landed, grad, staged, hg[r0:r1]))
        self._staging_ticket[turn] = self._folds[-1]
        return landed

    def add_late_grads(self, indices: list[int]) -> int:
        """The gradients autograd gave parameters ``indices`` themselves, found at the end of a
        backward (`flush.GradientFlush.flush_late`): the weight was used outside the model's
        forward, as it is there (its host value: a weight penalty, a head ``h @ E.T`` on a base
        model's output, on a GPU with the weight moved to the device by the user), as a whole
        unit's would be. Each is added whole into the host gradient on the
        host worker (the end of the backward drains it) and ``.grad`` is the engine's again.
        Returns how many there were."""
        for i in indices:
            p = self.unit.params[i]
            grad = p.grad
            with _engine_access():
                p.grad = None
            hg = self._begin_grad(i, enter=False)
            if grad.device.type != "cpu":
                self.ledger.count_d2h(grad.numel() * grad.element_size())
            self._fold("a gradient from outside the forward of ", functools.partial(_add_whole, hg, grad))
        return len(indices)

    # ------------------------------------------------------------------ lent whole: [Note: lent whole]
    @property
    def lent(self) -> bool:
        return self._lent is not None

    @contextlib.contextmanager
    def routed(self):
        """The body computes with the pieces (a routed module's forward, the chunked loss): its
        reads of the weight are not other uses."""
        self.routing += 1
        try:
            yield
        finally:
            self.routing -= 1

    def serves_read(self, func, in_forward: bool, forward_grad: bool, where: str) -> bool:
        """A guarded read of the weight or bias by torch function ``func`` (read_guard.py):
        whether the device side serves it (a routed call; a lent copy, lent now when a model
        forward is running, for its backward too when it began with gradients on: the read may
        run with them off, in a saved-tensor hook). False: the read is between forwards, of the
        host value, or asks only where the storage is (``untyped_storage``, ``is_pinned``)."""
        if self.routing or self._lent is not None:
            return True
        if not in_forward or asks_where_storage_is(func):  # no reason to lend the weight
            return False
        self.lend_whole(for_backward=forward_grad or torch.is_grad_enabled(), what=f"{describe_use(func)} {where}")
        return True

    def lend_whole(self, *, for_backward: bool, what: str | None = None) -> None:
        """For a forward that reads the weight whole outside the pieces' routing (TRL's fused LM
        head, announced by ``fused_lm_head=True``; ``what``: another use, said once in the log):
        until `reclaim_whole`, the parameters
        point at a copy of the whole unit on the device (booked in the ledger: the one time the
        unit is whole there). A gradient autograd gives them is added into the host gradient a
        piece at a time as it arrives, as the pieces' own are, and the ``.grad`` autograd then
        keeps is dropped at once: the whole gradient is on the device only while it crosses.
        ``for_backward``: the forward records a graph, so the copy stays until the end of its
        backward (its saved tensors are the copy)."""
        self._lent_for_backward |= for_backward
        if self._lent is not None:
            return
        u = self.unit
        if what is not None and not self._said_lent:
            self._said_lent = True
            whole = sum(p.numel() * e.device_dtype.itemsize for p, e in zip(u.params, u.layout.entries))
            logger.warning(
                "stronghold: %s is read in vocabulary pieces, and the model used the whole weight (%s), which "
                "pieces cannot serve: for such a forward and its backward it is lent whole to the device (%.1f MiB), "
                "as plain training holds it. StrongholdConfig(vocab_pieces=False) streams it whole instead.",
                u.fqn, what, whole / 2**20)
        copies = []
        for i, e in enumerate(u.layout.entries):
            rows = self._image(i)
            copies.append(rows.to(device=self._device, dtype=e.device_dtype))  # (aliased: the image itself)
        nbytes = sum(c.numel() * c.element_size() for c in copies)
        self.ledger.device_alloc(nbytes)
        self.ledger.count_h2d(nbytes, fetch=True)
        with _engine_access():
            views = [p.data for p in u.params]
            for p, c in zip(u.params, copies):
                p.data = c
        # After the swap: autograd's accumulator of a parameter whose device changed is a new one.
        handles = []
        for i, p in enumerate(u.params):
            if u.trainable and p.requires_grad:
                handles.append(p.register_hook(functools.partial(self._lent_grad, i)))
                handles.append(p.register_post_accumulate_grad_hook(self._drop_lent_grad))
        self._lent = (views, nbytes, handles)

    def _lent_grad(self, i: int, grad: torch.Tensor) -> None:
        landed = None
        for k, (r0, r1) in enumerate(self.bounds):
            if i == 0:
                landed = self.add_piece_grad(k, grad[r0:r1])
            else:
                self.add_bias_grad(k, grad[r0:r1])  # copied to the host before it returns
        # Autograd keeps ``grad`` as ``.grad`` until `_drop_lent_grad` frees it: the device waits
        # for the copies (in order on one stream) before its memory can be reused; through the
        # lanes, whose fold issues later halves, the host waits for the folds.
        if landed is not None:
            self.transfer.device_wait(landed)
        elif i == 0 and self.grad_queue is not None:
            self.drain()

    def _drop_lent_grad(self, param: torch.Tensor) -> None:
        """After autograd stored the lent copy's gradient (in the host gradient already): the
        device copy goes, so a second contribution (a tied unit) starts a new one. Booked for
        the moment it was there (the ledger's peak holds it); a gradient autograd never stored
        (``torch.autograd.grad``) leaves nothing to book."""
        grad = param.grad
        if grad is None:
            return
        nbytes = grad.numel() * grad.element_size()
        self.ledger.device_alloc(nbytes)
        with _engine_access():
            param.grad = None
        self.ledger.device_free(nbytes)

    def release_after_forward(self) -> None:
        """The end of a model forward (the schedule's): a copy no graph recorded goes back
        (`reclaim_whole`)."""
        if self._lent is not None and not self._lent_for_backward:
            self.reclaim_whole()

    def reclaim_whole(self) -> None:
        """The parameters point at their host memory again and the device copy is freed: at the
        end of a forward without gradients, of the backward (the schedule's end of backward), or
        at the latest before the optimizer step (`WindowSchedule.evict_all`)."""
        lent, self._lent, self._lent_for_backward = self._lent, None, False
        if lent is None:
            return
        views, nbytes, handles = lent
        for h in handles:
            h.remove()
        u = self.unit
        with _engine_access():
            for p, view in zip(u.params, views):
                p.data = view  # its gradient, added into the host gradient, left with `_drop_lent_grad`
        u.host.record_versions()
        self.ledger.device_free(nbytes)

    # ------------------------------------------------------------------ rows (the embedding)
    def gather_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``ids`` on the device, ``ids.shape + [hidden]``: gathered on the host,
        only those cross; and the ids on the host, flat (for `add_row_grads`)."""
        image = self._image()
        flat = ids.reshape(-1).to("cpu")
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.vocab):
            raise IndexError(f"stronghold: an input id is outside [0, {self.vocab}) for {self.unit.fqn}.")
        # Gathered straight into the output's shape: the autograd function's output must not be
        # a view, or a model that scales it in place (CTRL: ``inputs_embeds *= sqrt(d)``) is refused.
        rows = image.new_empty((*ids.shape, self.width))
        torch.index_select(image, 0, flat, out=rows.view(-1, self.width))
        rows = rows.to(self.dtype)
        self.ledger.count_h2d(rows.numel() * rows.element_size(), fetch=True)
        return rows.to(self._device), flat

    def add_row_grads(self, ids: torch.Tensor, grad: torch.Tensor, padding_idx: int | None) -> None:
        """Adds the gradient of the rows of ``ids`` (host, flat) into the host gradient (the
        padding row gets none, as ``F.embedding`` gives it): through a lane's staging, in parts
        of whole rows ([Note: vocabulary pieces through the lanes] in grads.py), or copied whole."""
        hg = self._begin_grad()
        g = grad.reshape(-1, self.width).contiguous()
        queue = self.grad_queue
        if queue is not None:
            lane = queue.acquire_staging()
            flush = queue.send_staged(lane, g.view(-1), align=self.width)
            lane.ticket = self._fold("the embedding rows' gradient of ", functools.partial(
                queue.land, lane, flush, functools.partial(_add_row_part, hg, ids, self.width, padding_idx)))
            return
        self.ledger.count_d2h(g.numel() * g.element_size())
        g = g.to("cpu")
        self._fold("the embedding rows' gradient of ", functools.partial(_add_rows, hg, ids, g, padding_idx))

def _land_and_add(transfer, landed, src: torch.Tensor, staged: torch.Tensor, dst: torch.Tensor) -> None:
    """Host worker: once the copy of device ``src`` into ``staged`` has landed, adds it into
    ``dst``. ``src`` is held here until then ([Note: D2H lifetime] in transfer.py)."""
    transfer.host_wait(landed)
    dst.add_(staged)
    del src


def _add_whole(dst: torch.Tensor, grad: torch.Tensor) -> None:
    """Host worker: a whole gradient of a parameter (from a use outside the forward) into its host gradient."""
    dst.add_(grad.detach().to(device=dst.device, dtype=dst.dtype).reshape_as(dst))


def _add_at(dst: torch.Tensor, lo: int, staged: torch.Tensor) -> None:
    """Host worker: one landed part of a flat piece gradient, added at element ``lo`` of ``dst``."""
    dst[lo:lo + staged.numel()].add_(staged)


def _add_row_part(grad: torch.Tensor, ids: torch.Tensor, width: int, padding_idx: int | None, lo: int,
                  staged: torch.Tensor) -> None:
    """Host worker: one landed part of the rows' gradient (whole rows, from element ``lo``)."""
    r0 = lo // width
    values = staged.view(-1, width)
    _add_rows(grad, ids[r0:r0 + values.shape[0]], values, padding_idx)


def _add_rows(grad: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, padding_idx: int | None) -> None:
    """Host worker: ``grad[ids] += values`` (duplicates summed), the padding row left out."""
    if padding_idx is not None:
        keep = ids != padding_idx
        ids, values = ids[keep], values[keep]
    grad.index_add_(0, ids, values.to(grad.dtype))


__all__ = ["MAX_PIECES", "VocabularyPieces", "piece_rows", "shape_problem", "why_not_pieced"]
