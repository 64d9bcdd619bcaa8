"""Each host's input-pipeline state beside a checkpoint step: its folder, writing, checking, pruning.

A step's input state is `<directory>/input_state/<step>/process_<i>/` (step_dirs.py), one
folder per process, written by a caller-provided function (e.g. a `tf.train.Checkpoint` of the
tf.data iterator) and read by the caller after `Checkpointer.restore`.

Consistency with the step: each process writes its own folder synchronously, *before* orbax starts
the save, and orbax's save begins with a barrier across processes; so when the step is committed
every host's input state is already on disk. A folder whose step never committed (a crash
mid-save) is cleared when that step is written again (`write`), and folders of steps that orbax no
longer keeps are deleted only after orbax has deleted the step itself (`prune`), so a committed
step never lacks its input state.

This module must not import tensorflow (the state is written by the caller's function).
"""

from __future__ import annotations

from typing import Callable, Optional

from bert_jax.checkpoints import integrity
from bert_jax.checkpoints.step_dirs import INPUT_STATE, CheckpointCorruptError, input_dir
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths


def process_dir(directory: str, step: int, process_index: int) -> str:
    """`<directory>/input_state/<step>/process_<process_index>`: one process's input state of `step`."""
    return storage_paths.join(input_dir(directory, step), f"process_{process_index}")


def write(directory: str, step: int, process_index: int, writer: Callable[[str], None]) -> None:
    """Calls `writer(path)` with this process's folder of `step`, empty.

    A folder already there is left over from a save of `step` that never committed: it is cleared,
    so that nothing of that attempt mixes with this one.
    """
    path = process_dir(directory, step, process_index)
    storage.rmtree(path)
    storage.makedirs(path)
    writer(path)


def check(directory: str, step: int, process_count: Optional[int]) -> None:
    """Raises unless every one of the `process_count` processes that saved `step`'s input state left a
    non-empty folder (None: the step was saved without input state; nothing to check).

    Every saving process's folder, not only this one's: a run on another number of processes reads
    the folders of the processes whose shards it now reads (`pretrain.input_position`).

    Raises:
        CheckpointCorruptError: a folder is missing or empty, naming it, with `.step` and `.damage`.
    """
    if process_count is None:
        return
    for index in range(process_count):
        path = process_dir(directory, step, index)
        if not storage.listdir(path):
            error = CheckpointCorruptError(f"step {step}: input state {path} is missing or empty")
            error.step = step
            error.damage = integrity.Damage(f"{INPUT_STATE}/process_{index}", "missing or empty")
            raise error


def prune(directory: str, process_index: int, kept: set[int], pending: Optional[int]) -> None:
    """Deletes this process's input state of steps orbax no longer has (pruned or never committed).

    Args:
        directory: the checkpoint directory.
        process_index: this process; each process deletes its own folders.
        kept: the steps orbax has committed (nothing is deleted while there are none).
        pending: a step being saved right now, whose folder is kept.

    Only steps at or below the latest kept one: a folder above it may belong to a save that another
    host is starting right now, and is cleared when that step is written.
    """
    root = storage_paths.join(directory, INPUT_STATE)
    try:
        names = storage.listdir(root)
    except OSError:  # e.g. the checkpoint directory is no folder (a failed save says so)
        return
    if not names or not kept:
        return
    latest = max(kept)
    for name in names:
        if not name.isdigit():
            continue
        step = int(name)
        if step in kept or step == pending or step > latest:
            continue
        storage.rmtree(process_dir(directory, step, process_index))
        try:
            # Succeeds once the last host has removed its own folder (object stores: nothing to do).
            storage.rmdir(storage_paths.join(root, name))
        except OSError:
            pass
