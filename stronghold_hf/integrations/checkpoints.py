"""The Trainer's checkpoints for an offloaded run: written whole or not at all, resumed under any layout.

Two things the HF Trainer does not do and an offloaded run needs; the Trainer's hooks in
``trainer.py`` (`_save_checkpoint`, `_save`, `_save_optimizer_and_scheduler`,
`_load_optimizer_and_scheduler`) call into this module, which knows nothing of the Trainer:

* **Atomic saves.** Trainer writes ``checkpoint-N`` in place, so an interrupted save (a
  preempted job, a full disk, during the long write of the CPU Adam state) leaves a folder that
  resume takes for a good one. Here every rank writes into one staging folder
  (``.stronghold-staging/checkpoint-N`` under the run) and rank 0 renames the finished folder
  into place (`staged_checkpoint`); ``save_model``'s files are written next to the destination
  and each moved in with an atomic rename (`files_moved_into`).
* **Optimizer state that follows the data-parallel layout.** With sharded CPU state each rank
  writes the Adam state of its own shard (``optimizer-rank{r}-of-{world}.pt``, see
  ``docs/distributed.md``). Resuming with another number of processes, without sharding, or
  under another device/host split re-cuts that state for this run, one memory-mapped file at a
  time ([Note: state by parameter name] in ``optim/hybrid.py``). Optimizer state is always
  loaded onto the CPU, where CPU Adam keeps it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..mapped_checkpoint import MappedCheckpoint
from ..optim.hybrid import StrongholdOptimizer, remap_cpu_state

_hf_logger = logging.getLogger("transformers.trainer")  # where Trainer logs its own "Saving ..." lines

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
STAGING_DIR = ".stronghold-staging"


# ---------------------------------------------------------------------------- atomic saves
@contextlib.contextmanager
def staged_checkpoint(run_dir: str, name: str, *, writer: bool, barrier: Callable[[], None]) -> Iterator[str]:
    """Yields the staging run folder to save ``checkpoint-N`` into; moves it into place after.

    One staging folder for every rank (each writes its RNG state and, with sharded CPU state,
    its optimizer shard there); the ``writer`` (rank 0) moves it into place once all have
    written (``barrier``). A save that fails leaves nothing behind it.
    """
    final = os.path.join(run_dir, name)
    staging_run = os.path.join(run_dir, STAGING_DIR, name)
    if writer:
        shutil.rmtree(staging_run, ignore_errors=True)  # left by a save that was interrupted
        os.makedirs(staging_run, exist_ok=True)
        _hf_logger.info(f"Saving model checkpoint to {final}")
    barrier()
    try:
        with _transformers_info_silenced():  # its lines would name the staging folder
            yield staging_run
        barrier()
    except BaseException:
        if writer:
            shutil.rmtree(staging_run, ignore_errors=True)
        raise
    written = os.path.join(staging_run, name)
    if writer and os.path.isdir(written):
        _fix_paths_after_staging(written, staging_run, run_dir)
        _atomic_replace_dir(written, final)
    if writer:
        shutil.rmtree(staging_run, ignore_errors=True)


def remove_staging(run_dir: str) -> None:
    """Removes the staging root of ``run_dir``. Each checkpoint empties its own staging folder;
    the root goes with training, also when a save failed half-way (its partial folder is in there)."""
    shutil.rmtree(os.path.join(run_dir, STAGING_DIR), ignore_errors=True)


@contextlib.contextmanager
def files_moved_into(output_dir: str) -> Iterator[str]:
    """Yields a folder next to ``output_dir`` to save into; each file written there is then
    moved into ``output_dir`` with an atomic rename."""
    os.makedirs(output_dir, exist_ok=True)
    _hf_logger.info(f"Saving model checkpoint to {output_dir}")
    staging = tempfile.mkdtemp(prefix=".stronghold-save-", dir=output_dir)
    try:
        with _transformers_info_silenced():
            yield staging
        for entry in os.listdir(staging):
            os.replace(os.path.join(staging, entry), os.path.join(output_dir, entry))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _transformers_info_silenced():
    """Holds transformers' INFO lines back while it writes into a staging folder.

    Those lines ("Saving model checkpoint to ...", "Model weights saved in ...") would name
    the temporary folder; the Trainer logs the final path itself instead. Warnings still pass.
    """
    hf_root = logging.getLogger("transformers")
    level = hf_root.level
    if hf_root.getEffectiveLevel() <= logging.INFO:
        hf_root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        hf_root.setLevel(level)


def _fix_paths_after_staging(written: str, staging_run: str, run_dir: str) -> None:
    """``trainer_state.json`` names the staging folder (``best_model_checkpoint``); name the run's."""
    state_file = os.path.join(written, "trainer_state.json")
    if not os.path.isfile(state_file):
        return
    with open(state_file, encoding="utf-8") as fh:
        text = fh.read()
    if staging_run in text:
        state = json.loads(text.replace(staging_run, run_dir))
        with open(state_file, "w", encoding="utf-8") as fh:
            json.dump(state, fh, indent=2, sort_keys=True)


def _atomic_replace_dir(src: str, dst: str) -> None:
    """Moves a finished directory into place; an existing ``dst`` is swapped out, then removed."""
    if os.path.exists(dst):
        old = f"{dst}.old-{os.getpid()}"
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


# ---------------------------------------------------------------------------- optimizer state
def _optimizer_shard_name(rank: int, world: int) -> str:
    return f"optimizer-rank{rank}-of-{world}.pt"


def save_optimizer_shard(output_dir: str, optimizer: Any, lr_scheduler: Any, dp: Any, *, writer: bool) -> None:
    """Sharded CPU state: each rank's CPU Adam state covers its own shard, one file per rank.
    Rank 0 may not have created the folder yet (it writes the weights first): every rank makes
    sure it exists. The ``writer`` saves the scheduler."""
    os.makedirs(output_dir, exist_ok=True)
    torch.save(optimizer.state_dict(), os.path.join(output_dir, _optimizer_shard_name(dp.rank, dp.world)))
    if writer:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.save(lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_optimizer_and_scheduler(checkpoint: str, optimizer: Any, lr_scheduler: Any, dp: Any) -> None:
    """Loads the checkpoint's optimizer (onto the CPU) and scheduler state, if it has both;
    state written under another layout is re-cut for this one (`_state_for_this_layout`)."""
    sched_file = os.path.join(checkpoint, SCHEDULER_NAME)
    sharded = dp is not None and dp.sharded
    own = os.path.join(checkpoint, _optimizer_shard_name(dp.rank, dp.world) if sharded else OPTIMIZER_NAME)
    shard_files = sorted(f for f in os.listdir(checkpoint) if f.startswith("optimizer-rank"))
    if not os.path.isfile(sched_file):
        return
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    release = None
    if os.path.isfile(own) and (sharded or not shard_files):
        # CPU Adam state belongs in CPU RAM whatever the world size. The engine's own file is
        # mapped, not read: the load copies it into the optimizer's state a tensor (NVMe: a
        # unit) at a time and gives the file's pages back as it goes, so the state is never
        # held twice. Another optimizer's file is read as torch reads it.
        if isinstance(inner, StrongholdOptimizer):
            mapped = MappedCheckpoint(own)
            state, release = mapped.state, mapped.release
        else:
            state = torch.load(own, map_location="cpu", weights_only=True)
        if sharded and not inner.layout_matches(state):
            # Another device/host split: a parameter this rank now keeps whole on the device
            # may have been sharded across every rank's file.
            state, release = _state_for_this_layout(checkpoint, shard_files or [OPTIMIZER_NAME], optimizer, dp), None
    elif shard_files or os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
        state = _state_for_this_layout(checkpoint, shard_files or [OPTIMIZER_NAME], optimizer, dp)
    else:
        return
    if release is not None:
        inner.load_state_dict(state, release_source=release)
    else:
        optimizer.load_state_dict(state)
    del state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lr_scheduler.load_state_dict(torch.load(sched_file, map_location="cpu", weights_only=True))


def _state_for_this_layout(checkpoint: str, files: list[str], optimizer: Any, dp: Any) -> dict[str, Any]:
    """The checkpoint's optimizer state, re-cut for this run's data-parallel layout.

    A checkpoint written by W ranks with sharded CPU state holds W files, each with the
    Adam state of that rank's shard of every block and the map of what it covers
    (``cpu_pieces``). Resuming with another number of processes, or without sharding, takes
    from every file the elements this rank now keeps, one file at a time."""
    worlds = {f.rsplit("-of-", 1)[-1].split(".")[0] for f in files if f.startswith("optimizer-rank")}
    layout = (f"{dp.world} process(es) with {'sharded' if dp.sharded else 'replicated'} CPU state"
              if dp is not None else "one process")
    if len(worlds) > 1 or (worlds and len(files) != int(next(iter(worlds)))):
        raise ValueError(f"Checkpoint {checkpoint} holds an incomplete or mixed set of optimizer shards "
                         f"({files}); it cannot be resumed with {layout}.")
    paths = [os.path.join(checkpoint, f) for f in files]
    first = torch.load(paths[0], map_location="cpu", weights_only=True, mmap=True)  # memory-mapped: cheap
    if "cpu_pieces" not in first:
        raise ValueError(
            f"Checkpoint {checkpoint} holds CPU optimizer state for another data-parallel layout ({files[0]}) "
            f"and was written before checkpoints recorded what each shard covers; resume it with the layout "
            f"that wrote it, not {layout}, or start the optimizer afresh from its weights "
            "(--model_name_or_path <checkpoint>)."
        )
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    if "cpu_names" in first:  # state by parameter name ([Note: state by parameter name], optim/hybrid.py)
        del first

        def written():  # one file at a time, memory-mapped: a rank never holds them all
            for path in paths:
                yield torch.load(path, map_location="cpu", weights_only=True, mmap=True)

        state = inner.recut(written())
        _hf_logger.info(f"STRONGHOLD: optimizer state of {checkpoint} ({len(files)} file(s)) re-cut for {layout} "
                        "and this device/host split")
        return state
    # Resident parameters, the loss scale and the public groups are the same on every rank.
    shared = {key: first[key] for key in ("device", "scaler", "param_groups")}
    del first
    mine = optimizer.state_dict()  # this layout's groups and pieces, with no state yet
    if mine["cpu"] is not None:
        def saved():
            # One file's CPU state at a time (memory-mapped): a rank never holds them all.
            for path in paths:
                written = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                if written["cpu"] is not None:  # a writer rank that kept no piece of any block
                    yield written["cpu_pieces"], written["cpu"]["state"]
                del written

        shapes = [p.shape for g in inner.cpu_optimizer.param_groups for p in g["params"]]
        mine["cpu"]["state"] = remap_cpu_state(mine["cpu_pieces"], shapes, saved())
    mine.update(shared)
    _hf_logger.info(f"STRONGHOLD: optimizer state of {checkpoint} ({len(files)} file(s)) re-cut for {layout}")
    return mine
