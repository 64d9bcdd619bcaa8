"""Steps on disk: their layout, the errors, verifying a step, and moving a damaged one aside.

On-disk layout of a `checkpointer.Checkpointer` directory (a step exists once orbax has renamed its
temporary folder, so a `kill -9` at any moment leaves the previous committed step as the latest)::

    <directory>/
      <step>/                        committed step (orbax; `<step>.orbax-checkpoint-tmp` while saving)
        state/                       the train-state pytree (orbax StandardCheckpointHandler, OCDBT)
        meta/metadata                the caller's JSON dict (input position, data files, config hash)
        checkpointer_info/metadata   our bookkeeping, e.g. how many processes wrote input state
        bert_jax_integrity.json      size + CRC-32C of every file of the step (integrity.py)
      input_state/<step>/process_<i>/   per-host input-pipeline state (e.g. a tf.train.Checkpoint
                                        of the tf.data iterator), written by `input_state_writer`
      damaged/<step>-<time>/{<step>,input_state}/   steps that failed verification, moved aside
      diverged/<step>-<time>/{<step>,input_state}/  steps past a loss spike a run rolled back from

Integrity (docs/reliability.md): orbax's post-finalization hook, which runs on the primary
process once every host's data is written and before the rename that commits the step, records
size and CRC-32C of every file of the step, input state of all hosts included, in the step's
`bert_jax_integrity.json`; the two files orbax writes during the rename are added once the save is
known to be committed ("sealing"). Before anything of a step is read, `Checkpointer.latest_step`,
`restore`, `restore_latest`, `restore_part` and `saved_keys` check it against that manifest
(`check_step`). A damaged newest step (or one orbax cannot read) is, as `on_damaged` says, named in
one log line and moved to `damaged/` ("fallback": the newest intact step is used) or raised as
`CheckpointCorruptError` ("stop"); the line names the step, the file, the fault and the remedy
(`damage_message`). Steps saved by an older bert_jax (no manifest) restore unverified, with one
warning.

On Cloud Storage a step is committed by orbax's `commit_success.txt` marker instead of a rename,
and moving a step aside copies its objects server-side before deleting them (the input state
first, as below): the layout and every rule here are the same.

This module only touches files (through `data_pipeline.storage`): no jax, no orbax.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional

from bert_jax.checkpoints import integrity
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

# Items and folders of the layout above.
STATE = "state"
META = "meta"
INFO = "checkpointer_info"
INPUT_STATE = "input_state"
DAMAGED = "damaged"
DIVERGED = "diverged"
# 2: every step carries an integrity manifest (integrity.py); 1: older bert_jax, none.
FORMAT_VERSION = 2
ON_DAMAGED = ("fallback", "stop")


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed (synchronously or in the background); the run must stop."""


class CheckpointRestoreError(ValueError):
    """A checkpoint does not match the restore target (keys, shapes, dtypes, input state)."""


class CheckpointCorruptError(CheckpointRestoreError):
    """A step on disk is not what was saved (fails its integrity manifest, or cannot be read)."""


def input_dir(directory: str, step: int) -> str:
    """`<directory>/input_state/<step>`: every process's input state of `step`."""
    return storage_paths.join(directory, INPUT_STATE, str(step))


def committing_dir(directory: str, step: int) -> str:
    """The folder of a step whose save is being committed, as orbax's post-finalization hook sees it.

    Local filesystems: the temporary folder orbax is about to rename; object stores commit in place
    with a marker file, so the data is in the final folder already.
    """
    final = storage_paths.join(directory, str(step))
    candidates = [] if storage_paths.is_remote(final) else storage.glob(
        storage_paths.glob_escape(final) + ".orbax-checkpoint-tmp*")
    return max(candidates, key=storage.getmtime) if candidates else final


def remove_uncommitted(directory: str, committed: set[int]) -> None:
    """Removes the step folders of `directory` that are not in `committed` (orbax's steps).

    For object stores, where a save that never committed (a kill -9 mid-save) leaves a step folder
    without `commit_success.txt` rather than a `<step>.orbax-checkpoint-tmp` folder.
    """
    for name in storage.listdir(directory):
        if name.isdigit() and int(name) not in committed:
            logging.info("checkpointing: removing step %s of %s, whose save never committed", name, directory)
            storage.rmtree(storage_paths.join(directory, name))


# ---------------------------------------------------------------------------------------------
# Verify a step before anything in it is read
# ---------------------------------------------------------------------------------------------


def check_step(directory: str | os.PathLike, step: int) -> tuple[str, Optional[integrity.Damage]]:
    """("ok" | "unverified" | "damaged", damage) of a committed step, from its integrity manifest.

    "unverified": the step has no manifest and was written by a bert_jax older than manifests
    (its `checkpointer_info` says format 1, or it has none); it restores as before. A step whose
    bookkeeping says it was written with a manifest but has none is damaged.
    """
    directory = storage_paths.abspath(directory)
    step_dir = storage_paths.join(directory, str(step))
    manifest, damage = integrity.verify(step_dir, input_dir(directory, step), step)
    if damage is not None:
        return "damaged", damage
    if manifest is not None:
        return "ok", None
    info_path = storage_paths.join(step_dir, INFO, "metadata")
    try:
        version = json.loads(storage.read_text(info_path)).get("format_version", 1)
    except FileNotFoundError:
        return "unverified", None
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        return "damaged", integrity.Damage(f"{INFO}/metadata",
                                           f"unreadable ({e}) and the step has no integrity manifest")
    if version >= 2:
        return "damaged", integrity.Damage(integrity.MANIFEST, "missing, but this step was saved with one "
                                                               "(deleted?): it cannot be verified")
    return "unverified", None


# ---------------------------------------------------------------------------------------------
# Damaged steps: the message, the error, moving them aside
# ---------------------------------------------------------------------------------------------


def damage_message(directory: str, step: int, damage: integrity.Damage, intact: Optional[int]) -> str:
    """One line: the step, the file, what is wrong with it, and what to do."""
    step_dir = storage_paths.join(directory, str(step))
    if intact is None:
        remedy = (f"no earlier intact step to resume from: put the file back from a copy, or move {step_dir} "
                  f"(and {input_dir(directory, step)}) out of {directory} to start afresh")
    else:
        remedy = (f"resume from step {intact}, the newest intact one, with "
                  f"config.on_damaged_checkpoint='fallback' (moves step {step} to {directory}/{DAMAGED}/), "
                  f"or move {step_dir} (and {input_dir(directory, step)}) out of {directory} yourself")
    return f"checkpoint step {step} in {directory} is damaged: {damage}. To go on: {remedy}"


def corrupt_error(directory: str, step: int, damage: integrity.Damage,
                  intact: Optional[int]) -> CheckpointCorruptError:
    """`CheckpointCorruptError` with `damage_message`, carrying `.step` and `.damage`."""
    error = CheckpointCorruptError(damage_message(directory, step, damage, intact))
    error.step, error.damage = step, damage
    return error


def move_aside(directory: str, step: int, folder: str = DAMAGED) -> str:
    """Renames a step (and its input state) to `<directory>/<folder>/<step>-<time>/`; never deletes.

    `folder`: `DAMAGED` (a step that failed verification) or `DIVERGED` (a step past a loss spike
    that the run rolled back from, `Checkpointer.move_steps_aside`).
    """
    dest = storage_paths.join(directory, folder, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    base, n = dest, 1
    while storage.exists(dest):
        dest, n = f"{base}-{n}", n + 1
    storage.makedirs(dest)
    # Input state first: a crash in between leaves the step in place and missing its input
    # state (damaged again next time), never input state that pruning would delete.
    if storage.isdir(input_dir(directory, step)):
        storage.rename(input_dir(directory, step), storage_paths.join(dest, INPUT_STATE))
    storage.rename(storage_paths.join(directory, str(step)), storage_paths.join(dest, str(step)))
    return dest


def read_error(step: int, directory: str, cause: BaseException) -> CheckpointCorruptError:
    """The `CheckpointCorruptError` of a step orbax could not read (the cause's first line in it)."""
    first_line = (str(cause).strip().splitlines() or [""])[0][:300]
    damage = integrity.Damage(STATE, f"orbax could not read it ({type(cause).__name__}: {first_line})")
    error = CheckpointCorruptError(
        f"checkpoint step {step} in {directory} is damaged: {damage}. To go on: restore an earlier step "
        f"(Checkpointer.restore_latest does, with on_damaged='fallback'), or move "
        f"{storage_paths.join(directory, str(step))} out of {directory}")
    error.step, error.damage = step, damage
    error.__cause__ = cause
    return error


def is_read_failure(e: BaseException) -> bool:
    """orbax/tensorstore errors while reading a step, as opposed to a wrong target or no memory."""
    return isinstance(e, Exception) and not isinstance(e, (CheckpointRestoreError, MemoryError))
