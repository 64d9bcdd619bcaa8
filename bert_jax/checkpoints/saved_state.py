"""Reading saved train states: pytree keys, restore targets, and read-only access to a step.

What a restore needs before orbax reads anything: the state's leaves by '/'-joined key path
(`flat`, the names orbax uses), a validated abstract target with a sharding on every leaf
(`to_abstract`), and a comparison with the saved metadata that names every key whose presence, shape
or dtype differs (`check_against_metadata`). `restorer.Restorer.restore` (under `Checkpointer.restore`)
uses them, through `StepReader` (one host's read of a verified step), and so do the read-only
helpers here for evaluation and export: `restore_part` (some fields of a saved state, e.g. the parameters alone),
`saved_keys` and `newest_intact_step`. None of these creates, cleans, moves or deletes anything in
the directory, so a training run may still be writing there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from bert_jax.checkpoints import input_state
from bert_jax.checkpoints.step_dirs import (INFO, META, ON_DAMAGED, STATE, CheckpointRestoreError, check_step,
                                            corrupt_error, is_read_failure, read_error)
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

PyTree = Any

# How many offending keys an error message lists before it summarizes.
MAX_LISTED = 10


# ---------------------------------------------------------------------------------------------
# Pytree keys and restore targets
# ---------------------------------------------------------------------------------------------


def _key_name(entry: Any) -> str:
    """One path entry as orbax names it: dataclass fields, dict keys and indices all become strings."""
    for attr in ("name", "key", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flat(tree: PyTree) -> dict[str, Any]:
    """{'opt_state/1/0/mu/dense/kernel': leaf, ...}; the same keys for a dataclass and its metadata."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(_key_name(e) for e in path): leaf for path, leaf in leaves}


def listed(keys: list[str]) -> str:
    """The first `MAX_LISTED` keys, quoted, and how many more there are."""
    shown = ", ".join(repr(k) for k in keys[:MAX_LISTED])
    more = len(keys) - MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def is_typed_key(leaf: Any) -> bool:
    """A typed PRNG key (`jax.random.key`), which orbax cannot restore as one."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def to_abstract(abstract_state: PyTree) -> PyTree:
    """Validates the restore target and turns concrete `jax.Array` leaves into ShapeDtypeStructs.

    Every leaf needs a sharding: without one orbax would fall back to the sharding stored in the
    checkpoint, i.e. the mesh of the run that saved it, which is exactly what must not happen when
    restoring onto another mesh.
    """
    problems = []

    def convert(key: str, leaf: Any) -> Any:
        if is_typed_key(leaf):
            problems.append(f"{key!r} is a typed PRNG key; restore its jax.random.key_data (uint32)")
        elif isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)):
            if getattr(leaf, "sharding", None) is None:
                problems.append(f"{key!r} has no sharding")
            else:
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        else:
            problems.append(f"{key!r} is a {type(leaf).__name__}, not a jax.ShapeDtypeStruct")
        return leaf

    leaves = [convert(key, leaf) for key, leaf in flat(abstract_state).items()]
    if problems:
        raise CheckpointRestoreError(
            "restore target must be a pytree of jax.ShapeDtypeStruct(shape, dtype, sharding=...) "
            "for the target mesh: " + "; ".join(problems[:MAX_LISTED])
        )
    treedef = jax.tree_util.tree_structure(abstract_state)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def check_against_metadata(target: PyTree, saved: PyTree, where: str) -> None:
    """Raises `CheckpointRestoreError` naming every key whose presence, shape or dtype differs.

    orbax's own messages name neither the key (shape mismatch) nor the difference (structure
    mismatch), and a lower-precision target would be cast silently (bf16 for f32 data), so we
    compare against the saved metadata first.
    """
    want, have = flat(target), flat(saved)
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    errors = []
    if missing:
        errors.append(f"missing from the checkpoint: {listed(missing)}")
    if unexpected:
        errors.append(f"in the checkpoint but not in the target: {listed(unexpected)}")
    shapes, dtypes = [], []
    for key in sorted(set(want) & set(have)):
        w, h = want[key], have[key]
        if tuple(w.shape) != tuple(h.shape):
            shapes.append(f"{key!r}: checkpoint {tuple(h.shape)} vs target {tuple(w.shape)}")
        if h.dtype is not None and np.dtype(w.dtype) != np.dtype(h.dtype):
            dtypes.append(f"{key!r}: checkpoint {np.dtype(h.dtype)} vs target {np.dtype(w.dtype)}")
    if shapes:
        errors.append("shape mismatch: " + "; ".join(shapes[:MAX_LISTED]))
    if dtypes:
        errors.append(
            "dtype mismatch (restore in the saved dtype and cast explicitly): "
            + "; ".join(dtypes[:MAX_LISTED])
        )
    if errors:
        raise CheckpointRestoreError(f"{where} does not match the restore target: " + ". ".join(errors))


def rebuild_like(target: PyTree, restored: PyTree) -> PyTree:
    """`restored`'s leaves in `target`'s structure, matched by key path.

    So custom nodes (flax struct.dataclass, optax namedtuples) come back as the very types the
    caller passed, whatever containers orbax returns them in.
    """
    by_key = flat(restored)
    treedef = jax.tree_util.tree_structure(target)
    return jax.tree_util.tree_unflatten(treedef, [by_key[key] for key in flat(target)])


# ---------------------------------------------------------------------------------------------
# One host's read of a verified step (`Checkpointer.restore`)
# ---------------------------------------------------------------------------------------------


class StepReader:
    """Reads the steps of one directory through orbax's handlers, not a `CheckpointManager`: the
    manager's restore ends in a barrier across processes, which a host whose read failed would
    never reach (the hosts agree on the outcome instead: `HostAgreement.failure`). `close` it.

    Args:
        directory: the absolute checkpoint directory.
    """

    def __init__(self, directory: str):
        self._directory = directory
        self._handlers = {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler(),
                          INFO: ocp.JsonCheckpointHandler()}

    def _path(self, step: int, item: str):
        return storage.epath(storage_paths.join(self._directory, str(step), item))

    def info(self, step: int) -> dict:
        """The step's bookkeeping (`checkpointer_info`: format version, input-state process count)."""
        return self._handlers[INFO].restore(self._path(step, INFO), args=ocp.args.JsonRestore()) or {}

    def read(self, step: int, target: PyTree, check_input_state: bool) -> tuple[PyTree, dict]:
        """(state, meta) of a verified step, onto `target` (validated by `to_abstract`).

        Raises:
            CheckpointRestoreError: the target does not match what was saved.
            CheckpointCorruptError: orbax cannot read the step's metadata or JSON items, or (with
                `check_input_state`) a saving process's input state is missing.
            Exception: orbax's own, from the array read (`is_read_failure` tells a read error).
        """
        try:
            saved = self._handlers[STATE].metadata(self._path(step, STATE))
        except Exception as e:  # pylint: disable=broad-except
            raise read_error(step, self._directory, e) from e
        saved_tree = getattr(saved, "tree", saved)
        check_against_metadata(target, saved_tree, f"checkpoint step {step} in {self._directory}")
        # The small JSON items first, so that a missing input state fails before the big read.
        try:
            meta, info = (self._handlers[name].restore(self._path(step, name), args=ocp.args.JsonRestore())
                          for name in (META, INFO))
        except Exception as e:  # pylint: disable=broad-except
            raise read_error(step, self._directory, e) from e
        if check_input_state:
            input_state.check(self._directory, step, (info or {}).get("input_state_process_count"))
        restored = self._handlers[STATE].restore(self._path(step, STATE), args=ocp.args.StandardRestore(target))
        return rebuild_like(target, restored), dict(meta or {})

    def close(self) -> None:
        for handler in self._handlers.values():
            handler.close()


# ---------------------------------------------------------------------------------------------
# Read-only: one part of a saved state
# ---------------------------------------------------------------------------------------------


def restore_part(directory: str | os.PathLike, abstract_part: dict, step: Optional[int] = None,
                 *, on_damaged: str = "fallback") -> tuple[dict, int]:
    """Restores only some top-level fields of a saved train state (e.g. `{"params": ...}`), read-only.

    For evaluation and export: the optimizer state is neither read nor needed, so a workdir
    trained with another optimizer, clipping, or number of hosts (per-host input state) restores
    the same. Nothing in `directory` is created, cleaned or deleted, so a training run may still be
    writing there.

    Args:
        directory: a `Checkpointer` directory.
        abstract_part: {field: pytree of jax.ShapeDtypeStruct(shape, dtype, sharding=...)}.
        step: the step to restore; default the newest intact one (verified against its
            integrity manifest; a damaged newer step is named in one log line and skipped, never
            moved, with on_damaged="fallback", or raised with "stop").
        on_damaged: "fallback" or "stop", for the default step only; an explicit damaged step raises.

    Returns:
        (part, step): `part` has the structure of `abstract_part`, bitwise equal to what was saved.

    Raises:
        FileNotFoundError: no committed checkpoint (or not that step) in `directory`.
        CheckpointRestoreError: a field, key, shape or dtype the checkpoint does not have.
        CheckpointCorruptError: the step is damaged (see `on_damaged`) or orbax cannot read it.
    """
    directory = storage_paths.abspath(directory)
    step, saved_tree = _saved_state_metadata(directory, step, on_damaged)
    target = to_abstract(abstract_part)
    have = {k: v for k, v in flat(saved_tree).items()
            if any(k == f or k.startswith(f + "/") for f in abstract_part)}
    missing = [f for f in abstract_part if not any(k == f or k.startswith(f + "/") for k in have)]
    if missing:
        raise CheckpointRestoreError(f"checkpoint step {step} in {directory} has no field(s) {missing}")
    check_against_metadata(flat(target), have, f"checkpoint step {step} in {directory}")
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            storage_paths.join(directory, str(step), STATE),
            args=ocp.args.PyTreeRestore(item=target,
                                        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                        partial_restore=True))
    except Exception as e:  # pylint: disable=broad-except
        if not is_read_failure(e):
            raise
        raise read_error(step, directory, e) from e
    return rebuild_like(target, restored), step


class _ReadOnlyNoticeFilter(logging.Filter):
    """Drops orbax's warnings that a read-only manager is read-only (we asked for it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("read_only=True, setting save_interval_steps" in message
                    or "Given directory is read only" in message)


@contextlib.contextmanager
def _without_read_only_notices():
    logger, notice_filter = logging.getLogger("absl"), _ReadOnlyNoticeFilter()
    logger.addFilter(notice_filter)
    try:
        yield
    finally:
        logger.removeFilter(notice_filter)


def newest_intact_step(directory: str | os.PathLike, steps: list[int], on_damaged: str = "fallback"
                       ) -> Optional[int]:
    """The newest of `steps` (committed steps of a Checkpointer directory) that passes its
    integrity check, read-only: damaged newer ones are named in one log line each (fallback) or
    raised as `CheckpointCorruptError` (stop), never moved. None when `steps` is empty.
    """
    if on_damaged not in ON_DAMAGED:
        raise ValueError(f"on_damaged must be one of {ON_DAMAGED}, got {on_damaged!r}")
    directory = storage_paths.abspath(directory)
    damaged = []
    for step in sorted(steps, reverse=True):
        status, damage = check_step(directory, step)
        if status == "unverified":
            logging.warning("checkpointing: step %d in %s has no integrity manifest (saved by an older "
                            "bert_jax): reading it unverified", step, directory)
        if damage is None:
            for bad, bad_damage in damaged:
                logging.error("checkpointing: checkpoint step %d in %s is damaged: %s; reading step %d instead",
                              bad, directory, bad_damage, step)
            return step
        damaged.append((step, damage))
        if on_damaged == "stop":
            break
    if not damaged:
        return None
    step, damage = damaged[0]
    intact = None
    if on_damaged == "stop":
        intact = next((s for s in sorted(steps, reverse=True) if s < step and check_step(directory, s)[1] is None),
                      None)
    raise corrupt_error(directory, step, damage, intact)


def _saved_state_metadata(directory: str, step: Optional[int], on_damaged: str = "fallback"
                          ) -> tuple[int, PyTree]:
    """(step, the saved state's metadata tree) of a verified committed step (default the newest
    intact one), read-only."""
    if not storage.isdir(directory):
        raise FileNotFoundError(f"no checkpoint directory {directory}")
    with warnings.catch_warnings(), _without_read_only_notices():
        warnings.simplefilter("ignore")
        mngr = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(read_only=True, create=False),
            # Every item the Checkpointer writes has its handler, or orbax warns about the others.
            item_handlers={STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler(),
                           INFO: ocp.JsonCheckpointHandler()})
    try:
        steps = sorted(mngr.all_steps())
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no committed checkpoint in {directory}")
            step = newest_intact_step(directory, steps, on_damaged)
        elif step not in steps:
            raise FileNotFoundError(f"step {step} is not a committed checkpoint in {directory} (have {steps})")
        else:
            status, damage = check_step(directory, step)
            if damage is not None:
                raise corrupt_error(directory, step, damage, None)
        try:
            saved = mngr.item_metadata(step)[STATE]
        except Exception as e:  # pylint: disable=broad-except
            raise read_error(step, directory, e) from e
    finally:
        mngr.close()
    return step, getattr(saved, "tree", saved)


def saved_keys(directory: str | os.PathLike, step: Optional[int] = None) -> list[str]:
    """The '/'-joined key paths of a committed step's saved state (default the newest intact), read-only.

    Raises:
        FileNotFoundError: no committed checkpoint (or not that step) in `directory`.
    """
    return sorted(flat(_saved_state_metadata(storage_paths.abspath(directory), step)[1]))
