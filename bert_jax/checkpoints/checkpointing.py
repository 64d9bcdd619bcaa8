"""Checkpoints: async orbax saves, keep-K, auto-resume with the data position, preemption.

This module owns everything a training loop needs to survive being stopped: when to save, what a
step on disk contains, which steps are kept, how a step is restored onto any mesh, and how a
SIGTERM (single process) or the multi-host preemption sync point turns into "save now and stop".
It wraps one orbax `CheckpointManager`; there is no hand-written checkpoint format. Its parts:

    checkpointing.py          `Checkpointer`: saving, keep-K, restoring, resuming (this module)
    checkpoint_steps.py       the on-disk layout, the errors, verifying a step, moving damaged ones aside
    checkpoint_integrity.py   the integrity manifest of a step (sizes and CRC-32C of its files)
    checkpoint_reading.py     restore targets and key checks; read-only `restore_part`, `saved_keys`,
                              `newest_intact_step`
    preemption.py             SIGTERM / the multi-host preemption sync point -> `should_stop`

Every public name of those is importable from here too (`checkpointing.restore_part`, ...).

Consistency of the per-host input state with the step: each process writes its own
`input_state/<step>/process_<i>/` synchronously, *before* orbax starts the save, and orbax's save
begins with a barrier across processes; so when the step is committed every host's input state is
already on disk. A folder whose step never committed (a crash mid-save) is cleared when that step
is written again, and folders of steps that orbax no longer keeps are deleted only after orbax has
deleted the step itself, so a committed step never lacks its input state.

Integrity: every step carries a manifest written before orbax commits it, and is checked against
it before anything of it is read; a damaged newest step is moved aside or raised, as `on_damaged`
says (checkpoint_steps.py, docs/reliability.md).

Preemption (preemption.py): `should_stop(step)` turns True at the first step after a SIGTERM
(single process) or at the multi-host preemption sync point (the same step on every host); it must
be called by every host at every step. `save` then saves regardless of the interval. The intended
loop::

    ckpt = Checkpointer(workdir / "checkpoints", save_interval_steps=1000, max_to_keep=3)
    if ckpt.latest_step() is not None:
        start, state, meta = ckpt.restore_latest(abstract_state)  # ShapeDtypeStructs with target shardings
        input_iterator_restore(ckpt.input_state_dir(start))
    for step in range(start + 1, num_steps + 1):
        state, metrics = train_step(state, next(batches))
        stop = ckpt.should_stop(step)
        ckpt.save(step, state, {"position": ...}, force=stop or step == num_steps,
                  input_state_writer=lambda path: tf_ckpt.write(os.path.join(path, "iterator")))
        if stop:
            break
    ckpt.close()                                         # waits; raises if the last save failed

Errors are never swallowed: a save that fails in the background is raised (as
`CheckpointSaveError`) by the next `save`, `wait_until_finished` or `close`, at the latest one
save interval later, and every later `save`/`wait_until_finished` raises it again.

PRNG keys: typed keys (`jax.random.key`) are rejected at save time, because orbax stores them as
raw `uint32` data and cannot restore them as typed keys. Store `jax.random.key_data(key)` and use
`jax.random.wrap_key_data` after restoring.

Several hosts agree on every verdict: a step is intact only if every host verified it, and a
restore that fails on one host (a read error, missing input state) fails on all of them, with the
same error, so they all fall back to the same step; no host resumes alone and none waits forever
(restores go through orbax's handlers, which hold no barrier a failing host would skip). Each
exchange names the step it is about, and a host that is sent another step's finding raises
`CheckpointRestoreError` naming both steps rather than combine them.

Paths: local or gs:// (`data_pipeline.storage`; orbax's own writes reach gs:// through etils.epath
and tensorstore).

This module must not import tensorflow (the input-pipeline state is written by a caller-provided
function).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp

from bert_jax.checkpoints import checkpoint_integrity as integrity
from bert_jax.checkpoints.checkpoint_reading import check_against_metadata, flat, is_typed_key, listed, rebuild_like, to_abstract
from bert_jax.checkpoints.checkpoint_reading import newest_intact_step, restore_part, saved_keys  # noqa: F401  (re-exported)
from bert_jax.checkpoints.checkpoint_steps import (FORMAT_VERSION, INFO, INPUT_STATE, META, ON_DAMAGED, STATE,
                                       CheckpointCorruptError, CheckpointRestoreError, CheckpointSaveError, check_step,
                                       corrupt_error, input_dir, is_read_failure, move_aside, read_error)
from bert_jax.checkpoints.preemption import Preemption
from bert_jax.checkpoints.save_deadline import SaveDeadline
from data_pipeline import storage, storage_paths

PyTree = Any

# How long a host waits for the others' verdicts or at a barrier (`_all_hosts`, `_barrier`): a
# slow host may be verifying or reading a large step. A host that died ends the wait sooner
# (jax's coordination service reports it to every process).
_AGREEMENT_TIMEOUT_S = 3600


class Checkpointer:
    """Async, keep-K orbax checkpoints of a train state, its JSON meta and per-host input state.

    Construct it after `jax.distributed.initialize` (multi-host) and in the main thread (single
    process: it installs a SIGTERM handler there; `close` puts the previous one back). Every
    process calls every method, with the same arguments, in the same order.

    Args:
        directory: where the steps live (created if missing); absolute or relative path.
        save_interval_steps: `save` saves when `step % save_interval_steps == 0` (>= 1).
        max_to_keep: how many most recent committed steps to keep (>= 1).
        async_save: write in a background thread. The caller may donate the state to the next
            step right after `save` returns: the values of save time are what is written.
        handle_sigterm: install the single-process SIGTERM handler. Ignored (JAX handles SIGTERM)
            when `jax.distributed` is initialized.
        on_damaged: what `latest_step`/`restore_latest` do when the newest step fails its
            integrity check or cannot be read: "fallback" (log one line naming the step, the file
            and the fault, move the step to `<directory>/damaged/<step>-<time>/`, use the newest
            intact step) or "stop" (raise `CheckpointCorruptError` with that line). With no intact
            step to fall back to, both raise and move nothing.
        save_timeout_s: each save's limit from its start to its commit; past it the process
            ends with a message naming the step (`bert_jax.checkpoints.save_deadline`). None: no limit.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_interval_steps: int,
        max_to_keep: int,
        async_save: bool = True,
        handle_sigterm: bool = True,
        on_damaged: str = "fallback",
        save_timeout_s: Optional[float] = None,
    ):
        if on_damaged not in ON_DAMAGED:
            raise ValueError(f"on_damaged must be one of {ON_DAMAGED}, got {on_damaged!r}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self._directory = storage_paths.abspath(storage_paths.check(os.fspath(directory), "checkpoint directory"))
        self._interval = save_interval_steps
        self._process_index = jax.process_index()
        self._process_count = jax.process_count()
        self._async = async_save
        self._on_damaged = on_damaged
        self._saving_step: Optional[int] = None  # the step `_write_manifest` runs for
        self._checked: dict[int, Optional[integrity.Damage]] = {}  # verification results by step
        self._exchanges = 0  # how many `_all_hosts`/`_barrier` calls so far: the same on every host
        options = ocp.CheckpointManagerOptions(
            # `max_to_keep` is deprecated in favour of a preservation policy.
            preservation_policy=ocp.checkpoint_managers.LatestN(n=max_to_keep),
            # Always orbax's async path (a synchronous save waits right after starting it): only it
            # has the post-finalization hook where the integrity manifest is written.
            enable_async_checkpointing=True,
            # Synchronous directory creation: a folder that cannot be created (read-only or
            # missing workdir) then raises from `save` itself. Created asynchronously, the
            # failure left orbax's other background threads waiting ~300 s for a signal that
            # never came, which delayed the process exit by as much.
            # The hook runs on the primary process once every process's data is written and the
            # items are finalized, before the rename that commits the step: the manifest is part
            # of the commit, and covers the files of all hosts.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False,
                                           post_finalization_callback=self._write_manifest),
            # A kill -9 mid-save leaves `<step>.orbax-checkpoint-tmp`; it is never a step, and
            # this removes it at startup. On Cloud Storage orbax would take every folder without
            # a commit marker for such a leftover, `input_state/` and `damaged/` included:
            # `_remove_uncommitted_steps` removes only uncommitted step folders there.
            cleanup_tmp_directories=not storage_paths.is_remote(self._directory),
            create=True,
        )
        self._mngr = ocp.CheckpointManager(
            self._directory,
            options=options,
            item_handlers={
                STATE: ocp.StandardCheckpointHandler(),
                META: ocp.JsonCheckpointHandler(),
                INFO: ocp.JsonCheckpointHandler(),
            },
        )
        self._deadline = SaveDeadline(save_timeout_s, self._directory, self._mngr.is_saving_in_progress)
        # Restores read through these (see `_read`); the manager's own are for saving.
        self._handlers = {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler(),
                          INFO: ocp.JsonCheckpointHandler()}
        self._pending_step: Optional[int] = None  # a save started by us, not yet known finished
        self._error: Optional[CheckpointSaveError] = None
        self._closed = False
        self._preemption = Preemption(handle_sigterm)
        if storage_paths.is_remote(self._directory):
            self._remove_uncommitted_steps()
        self._prune_input_state()

    # --- paths and queries ----------------------------------------------------------------------

    @property
    def directory(self) -> str:
        """The absolute checkpoint directory."""
        return self._directory

    def input_state_dir(self, step: int, process_index: Optional[int] = None) -> str:
        """The folder holding `process_index`'s input-pipeline state for `step`.

        Written through `save(..., input_state_writer=...)`; read it after `restore` (which checks
        that it exists when the step recorded input state).

        Args:
            step: the checkpoint step.
            process_index: defaults to `jax.process_index()`.
        """
        index = self._process_index if process_index is None else process_index
        return storage_paths.join(self._directory, INPUT_STATE, str(step), f"process_{index}")

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (a save still in flight is not listed)."""
        self._poll_pending()
        steps = set(self._mngr.all_steps())
        if self._pending_step is not None:
            steps.discard(self._pending_step)
        return sorted(steps)

    def latest_step(self) -> Optional[int]:
        """The newest committed step that passes its integrity check, or None (a fresh workdir).

        Newer steps that fail it are handled as `on_damaged` says (see the class): moved aside
        with one log line each, or a `CheckpointCorruptError`.

        Raises:
            CheckpointRestoreError: the newest step folder holds no train state and no integrity
                manifest (a folder that is not ours), naming it and the step a resume would use.
            CheckpointCorruptError: a damaged newest step, with on_damaged="stop" or nothing
                intact to fall back to.
        """
        steps = self.all_steps()
        if not steps:
            return None
        newest = storage_paths.join(self._directory, str(steps[-1]))
        if not storage.exists(storage_paths.join(newest, STATE)) and not storage.exists(storage_paths.join(newest, integrity.MANIFEST)):
            earlier = [s for s in steps[:-1] if storage.exists(storage_paths.join(self._directory, str(s), STATE))]
            then = f"resume from step {earlier[-1]}" if earlier else "start afresh"
            raise CheckpointRestoreError(
                f"{newest} has no '{STATE}' item: not a checkpoint "
                f"bert_jax wrote, or a damaged one; move it out of {self._directory} to {then}")
        return self._newest_intact(steps)

    def _verified(self, step: int) -> Optional[integrity.Damage]:
        """The step's damage (None when intact or unverifiable), checked once per Checkpointer, and
        the same on every host: damaged if any host found it damaged or could not read it."""
        if step not in self._checked:
            try:
                status, damage = check_step(self._directory, step)
            except Exception as e:  # pylint: disable=broad-except  # the store failed us mid-check
                if isinstance(e, MemoryError):
                    raise
                first_line = (str(e).strip().splitlines() or [""])[0][:300]
                status, damage = "damaged", integrity.Damage(
                    STATE, f"could not be read to verify it ({type(e).__name__}: {first_line})")
            status, damage = self._agreed_verdict(step, status, damage)
            if status == "unverified":
                logging.warning("checkpointing: step %d in %s has no integrity manifest (saved by an older "
                                "bert_jax): restoring it unverified", step, self._directory)
            self._checked[step] = damage
        return self._checked[step]

    def _newest_intact(self, steps: list[int]) -> Optional[int]:
        damaged, intact = [], None
        for step in reversed(steps):
            damage = self._verified(step)
            if damage is None:
                intact = step
                break
            damaged.append((step, damage))
        if not damaged:
            return intact
        if self._on_damaged == "stop" or intact is None:
            step, damage = damaged[0]
            raise corrupt_error(self._directory, step, damage, intact)
        for step, damage in damaged:
            moved = move_aside(self._directory, step) if self._process_index == 0 else "damaged/"
            logging.error("checkpointing: checkpoint step %d in %s is damaged: %s; moved it to %s and resume from "
                          "step %d (config.on_damaged_checkpoint='stop' stops instead)",
                          step, self._directory, damage, moved, intact)
            self._checked.pop(step, None)
        if self._process_count > 1:
            self._barrier("moved_damaged")
        self._mngr.reload()  # orbax lists the steps it has seen; the moved ones are gone
        return intact

    # --- saving ---------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: PyTree,
        meta: dict,
        *,
        force: bool = False,
        input_state_writer: Optional[Callable[[str], None]] = None,
    ) -> bool:
        """Starts saving `step` if it is due; call it at every step.

        The step is saved when `step % save_interval_steps == 0`, when `force`, or once
        `should_stop` has returned True. A step that is already saved (or being saved) is not
        saved again, so a forced final save right after a regular one is harmless.

        Args:
            step: the training step the state is at.
            state: a pytree of arrays (e.g. a flax `struct.dataclass` TrainState); no typed PRNG
                keys (store `jax.random.key_data`).
            meta: a JSON-serializable dict returned by `restore` (tuples come back as lists).
            force: save even off the interval.
            input_state_writer: called as `input_state_writer(path)` on every process, with an
                empty folder `input_state_dir(step)`, before the save starts; it writes that
                host's input-pipeline state there. It is only called when the step is saved.

        Returns:
            True when a save of `step` was started.

        Raises:
            CheckpointSaveError: this save or an earlier background save failed.
            TypeError / ValueError: `state` has typed PRNG keys, or `meta` is not a JSON dict.
        """
        self._raise_if_failed()
        self._poll_pending()
        due = force or self._preemption.stop_step is not None or step % self._interval == 0
        if not due or step == self._pending_step or step in self._mngr.all_steps():
            return False
        typed = [key for key, leaf in flat(state).items() if is_typed_key(leaf)]
        if typed:
            raise TypeError(
                f"typed PRNG keys cannot be checkpointed ({listed(typed)}): "
                "store jax.random.key_data(key) and jax.random.wrap_key_data after restoring"
            )
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        try:
            # Fail here, in the caller's frame, rather than in orbax's background thread.
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise ValueError(f"meta is not JSON-serializable: {e}") from e

        # Our previous save must be finished (and its failure raised) before its input-state
        # folders may be pruned or a new step started; orbax would wait here anyway.
        self.wait_until_finished()
        info = {"format_version": FORMAT_VERSION, "input_state_process_count": None}
        self._saving_step = step
        self._deadline.arm(step)  # from here to the commit: a stalled store ends the run loudly
        try:
            if input_state_writer is not None:
                path = self.input_state_dir(step)
                # A folder for an uncommitted step is left over from a crash: start empty.
                storage.rmtree(path)
                storage.makedirs(path)
                input_state_writer(path)
                info["input_state_process_count"] = self._process_count
            self._mngr.save(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE: ocp.args.StandardSave(state),
                        META: ocp.args.JsonSave(meta),
                        INFO: ocp.args.JsonSave(info),
                    }
                ),
                # We decided above; orbax's own policy would also save step 0 / refuse old steps.
                force=True,
            )
        except Exception as e:  # pylint: disable=broad-except
            self._deadline.disarm()
            self._fail(step, e)
        self._deadline.started()
        self._pending_step = step
        if self._preemption.stop_step is not None:
            logging.info("checkpointing: saving step %d because of preemption", step)
        if not self._async:
            self.wait_until_finished()
        return True

    def _write_manifest(self) -> None:
        """orbax's post-finalization hook (primary process, background thread): the step's manifest.

        Raising here fails the save: the step is then never committed.
        """
        step = self._saving_step
        final = storage_paths.join(self._directory, str(step))
        # Local filesystems: the temporary folder orbax is about to rename; object stores commit
        # in place with a marker file, so the data is in the final folder already.
        candidates = [] if storage_paths.is_remote(final) else storage.glob(
            storage_paths.glob_escape(final) + ".orbax-checkpoint-tmp*")
        step_dir = max(candidates, key=storage.getmtime) if candidates else final
        integrity.write_manifest(step_dir, input_dir(self._directory, step), step)

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight is committed; raises `CheckpointSaveError` if it failed."""
        self._raise_if_failed()
        try:
            self._mngr.wait_until_finished()
        except Exception as e:  # pylint: disable=broad-except
            self._deadline.disarm()
            self._fail(self._pending_step, e)
        self._deadline.disarm()
        if self._pending_step is not None and self._process_index == 0:
            try:
                integrity.seal_manifest(storage_paths.join(self._directory, str(self._pending_step)))
            except (OSError, ValueError) as e:
                # The unsealed manifest still covers every file but orbax's two commit-time writes.
                logging.warning("checkpointing: could not seal the integrity manifest of step %d: %s",
                                self._pending_step, e)
        self._pending_step = None
        self._prune_input_state()

    def close(self) -> None:
        """Waits for the save in flight, releases orbax, restores the previous SIGTERM handler.

        Raises:
            CheckpointSaveError: the last save failed (unless a failure was raised before).
        """
        if self._closed:
            return
        error = None
        try:
            if self._error is None:  # a latched error was raised to the caller already
                self.wait_until_finished()
        except CheckpointSaveError as e:
            error = e
        finally:
            self._closed = True
            self._deadline.close()
            self._preemption.close()
            for handler in self._handlers.values():
                handler.close()
            try:
                self._mngr.close()
            except Exception as e:  # pylint: disable=broad-except
                if error is None and self._error is None:
                    error = CheckpointSaveError(f"closing checkpoints in {self._directory}: {e}")
                    error.__cause__ = e
                else:
                    logging.exception("checkpointing: close after a failed save")
        if error is not None:
            raise error

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- preemption -----------------------------------------------------------------------------

    def should_stop(self, step: int) -> bool:
        """True once the run should save and stop; call it at every step, on every process.

        Single process: True from the first call after a SIGTERM. Multi-host: True when
        `multihost_utils.reached_preemption_sync_point(step)` is, i.e. at the same step on every
        host. After it returned True once, `save` saves whatever the interval, and it stays True.
        """
        return self._preemption.should_stop(step)

    # --- restoring ------------------------------------------------------------------------------

    def restore(
        self,
        abstract_state: PyTree,
        step: Optional[int] = None,
        *,
        check_input_state: bool = True,
    ) -> tuple[PyTree, dict]:
        """Restores a committed step onto the mesh of `abstract_state`.

        Args:
            abstract_state: the target: a pytree of `jax.ShapeDtypeStruct(shape, dtype,
                sharding=...)` (or of `jax.Array`s, whose shardings are used) with the same
                structure, shapes and dtypes as the saved state; the shardings may use any mesh.
            step: the step to restore; default `latest_step()` (the newest intact one).
            check_input_state: when the step was saved with input state, require
                `input_state_dir(step)` to exist for this process and the process count to be the
                one that saved it. Pass False to restore the model but restart the data.

        Returns:
            (state, meta): `state` has the structure of `abstract_state`, every leaf a jax.Array
            with the target's sharding, bitwise equal to what was saved; `meta` is the dict given
            to `save`.

        Raises:
            CheckpointRestoreError: missing/unexpected keys, shape or dtype mismatch (a bf16
                target for f32 data is refused, not cast), no sharding, missing input state.
            CheckpointCorruptError: the step fails its integrity check, or orbax cannot read it
                (no fallback here: use `restore_latest` to resume past a damaged step).
            FileNotFoundError: no such committed step (or no checkpoint at all).
        """
        if abstract_state is None:
            raise CheckpointRestoreError(
                "restore needs an abstract target (jax.ShapeDtypeStruct with shardings); "
                "build it with jax.eval_shape and the target mesh's shardings"
            )
        steps = self.all_steps()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint in {self._directory}")
        elif step not in steps:
            raise FileNotFoundError(
                f"step {step} is not a committed checkpoint in {self._directory} (have {steps})"
            )
        target = to_abstract(abstract_state)
        # Verify before use: nothing of a damaged step is read.
        damage = self._verified(step)
        if damage is not None:
            intact = next((s for s in reversed(steps) if s < step and self._verified(s) is None), None)
            raise corrupt_error(self._directory, step, damage, intact)
        failure: Optional[CheckpointRestoreError] = None
        try:
            state, meta = self._read(step, target, check_input_state)
        except CheckpointRestoreError as e:  # a wrong target, missing input state, or unreadable
            failure = e
        except Exception as e:  # pylint: disable=broad-except
            if not is_read_failure(e):
                raise
            failure = read_error(step, self._directory, e)
        failure = self._agreed_failure(step, failure)
        if failure is not None:
            raise failure
        return state, meta

    def _read(self, step: int, target: PyTree, check_input_state: bool) -> tuple[PyTree, dict]:
        """One host's read of a verified step. Through orbax's handlers, not the manager: the
        manager's restore ends in a barrier, which a host whose read failed would never reach."""
        step_dir = storage_paths.join(self._directory, str(step))
        try:
            saved = self._handlers[STATE].metadata(storage.epath(storage_paths.join(step_dir, STATE)))
        except Exception as e:  # pylint: disable=broad-except
            raise read_error(step, self._directory, e) from e
        saved_tree = getattr(saved, "tree", saved)
        check_against_metadata(target, saved_tree, f"checkpoint step {step} in {self._directory}")
        # The small JSON items first, so that a missing input state fails before the big read.
        try:
            meta, info = (self._handlers[name].restore(storage.epath(storage_paths.join(step_dir, name)),
                                                       args=ocp.args.JsonRestore())
                          for name in (META, INFO))
        except Exception as e:  # pylint: disable=broad-except
            raise read_error(step, self._directory, e) from e
        if check_input_state:
            self._check_input_state(step, info or {})
        restored = self._handlers[STATE].restore(storage.epath(storage_paths.join(step_dir, STATE)),
                                                 args=ocp.args.StandardRestore(target))
        return rebuild_like(target, restored), dict(meta or {})

    def restore_latest(
        self, abstract_state: PyTree, *, check_input_state: bool = True
    ) -> tuple[int, PyTree, dict]:
        """Resumes: (step, state, meta) of the newest intact step, falling back past damaged ones.

        A step fails when its integrity check fails or orbax cannot read it; it is then handled
        as `on_damaged` says (moved aside with one log line, or `CheckpointCorruptError`), and the
        next newest step is tried. Arguments and the rest as in `restore`.

        Raises:
            FileNotFoundError: no committed checkpoint.
            CheckpointCorruptError: on_damaged="stop", or no intact step is left.
        """
        while True:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint in {self._directory}")
            try:
                state, meta = self.restore(abstract_state, step, check_input_state=check_input_state)
                return step, state, meta
            except CheckpointCorruptError as e:
                # Every host raised it (`_agreed_failure`): all fall back together. Remembered as
                # damaged: latest_step moves it aside, or raises, as configured.
                self._checked[step] = e.damage

    def input_state_process_count(self, step: int) -> Optional[int]:
        """How many processes saved `step`'s input state (None: saved without any)."""
        info = self._handlers[INFO].restore(storage.epath(storage_paths.join(self._directory, str(step), INFO)),
                                            args=ocp.args.JsonRestore())
        return (info or {}).get("input_state_process_count")

    def _check_input_state(self, step: int, info: dict) -> None:
        count = info.get("input_state_process_count")
        if count is None:
            return
        # Every saving process's folder: a run on another number of processes reads the
        # folders of the processes whose shards it now reads (`pretrain.input_position`).
        for index in range(count):
            path = self.input_state_dir(step, index)
            if not storage.listdir(path):
                damage = integrity.Damage(f"{INPUT_STATE}/process_{index}", "missing or empty")
                error = CheckpointCorruptError(f"step {step}: input state {path} is missing or empty")
                error.step, error.damage = step, damage
                raise error

    # --- internals ------------------------------------------------------------------------------

    def _fail(self, step: Optional[int], cause: BaseException) -> None:
        self._error = CheckpointSaveError(
            f"checkpoint save of step {step} in {self._directory} failed: "
            f"{type(cause).__name__}: {cause}"
        )
        self._error.__cause__ = cause
        self._pending_step = None  # orbax has dropped the failed step from its list
        raise self._error

    def _raise_if_failed(self) -> None:
        if self._closed:
            raise RuntimeError(f"the checkpointer of {self._directory} is closed")
        if self._error is not None:
            raise self._error

    def _poll_pending(self) -> None:
        """Without blocking: if our last async save has ended, collect its result.

        This surfaces a background failure at the first `save` call after it happened, usually
        the very next step, rather than at the next save interval.
        """
        if self._error is not None:
            return  # already raised once; queries such as latest_step keep working
        if self._pending_step is not None and not self._mngr.is_saving_in_progress():
            self.wait_until_finished()

    def _remove_uncommitted_steps(self) -> None:
        """Object stores: step folders whose save never committed (no `commit_success.txt`: a
        kill -9 mid-save) are removed at startup by the primary process, as orbax removes a
        local `<step>.orbax-checkpoint-tmp` folder."""
        if self._process_index == 0:
            committed = set(self._mngr.all_steps())
            for name in storage.listdir(self._directory):
                if name.isdigit() and int(name) not in committed:
                    logging.info("checkpointing: removing step %s of %s, whose save never committed",
                                 name, self._directory)
                    storage.rmtree(storage_paths.join(self._directory, name))
        if self._process_count > 1:
            self._barrier("removed_uncommitted")

    def _prune_input_state(self) -> None:
        """Deletes this process's input state of steps orbax no longer has (pruned or never committed).

        Only steps at or below the latest committed one: a folder above it may belong to a save
        that another host is starting right now, and is cleared when that step is written.
        """
        root = storage_paths.join(self._directory, INPUT_STATE)
        try:
            names = storage.listdir(root)
        except OSError:  # e.g. the checkpoint directory is no folder (a failed save says so)
            return
        if not names:
            return
        kept = set(self._mngr.all_steps())
        if not kept:
            return
        latest = max(kept)
        for name in names:
            if not name.isdigit():
                continue
            step = int(name)
            if step in kept or step == self._pending_step or step > latest:
                continue
            storage.rmtree(self.input_state_dir(step))
            try:
                # Succeeds once the last host has removed its own folder (object stores: nothing to do).
                storage.rmdir(storage_paths.join(root, name))
            except OSError:
                pass

    # --- agreement across hosts -----------------------------------------------------------------

    def _exchange_key(self, what: str) -> str:
        """A key no earlier exchange of this Checkpointer (or another one's) used; the same on every host."""
        self._exchanges += 1
        digest = hashlib.sha256(self._directory.encode()).hexdigest()[:12]
        return f"bert_jax_checkpointing/{digest}/{self._exchanges}/{what}"

    def _all_hosts(self, step: int, what: str, code: int, text: str) -> list[tuple[int, str]]:
        """Every host's (code, text) about `step`, in host order: the same list on every host.

        Through the key-value store of jax's coordination service, not a collective: no device
        program, and no collective's short timeout (gloo's 30 s on CPU) for a host that is slower
        to verify or read. Each host publishes its finding under a key naming the step,
        `<exchange>/step_<step>/<host>`, then the step it is at under `<exchange>/step/<host>`;
        every host reads each host's step first, so hosts whose exchanges drifted apart (one
        verifying a step another skipped) can never combine findings about different steps.

        Raises:
            CheckpointRestoreError: a host is at another step in this exchange (a bug: every host
                must make the same calls in the same order), naming both steps.
        """
        if self._process_count == 1:
            return [(code, text)]
        client = ocp.multihost.get_jax_distributed_client()
        key = self._exchange_key(what)
        client.key_value_set(f"{key}/step_{step}/{self._process_index}", json.dumps([code, text]))
        client.key_value_set(f"{key}/step/{self._process_index}", str(step))
        verdicts = []
        for i in range(self._process_count):
            theirs = int(client.blocking_key_value_get(f"{key}/step/{i}", _AGREEMENT_TIMEOUT_S * 1000))
            if theirs != step:
                raise CheckpointRestoreError(
                    f"checkpointing: host {self._process_index} exchanged its {what} about step {step} of "
                    f"{self._directory} with host {i}, which sent its {what} about step {theirs} ({key}): the "
                    f"hosts' checkpoint calls went out of step (a bug); not combining them")
            verdicts.append(tuple(json.loads(client.blocking_key_value_get(f"{key}/step_{step}/{i}",
                                                                           _AGREEMENT_TIMEOUT_S * 1000))))
        return verdicts

    def _barrier(self, what: str) -> None:
        """Every host waits until all got here (the coordination service's barrier, not a collective)."""
        ocp.multihost.sync_global_processes(self._exchange_key(what), timeout=_AGREEMENT_TIMEOUT_S,
                                            processes=set(range(self._process_count)))

    def _agreed_verdict(self, step: int, status: str, damage: Optional[integrity.Damage]
                        ) -> tuple[str, Optional[integrity.Damage]]:
        """A step's verification, combined over hosts: damaged when any host found damage (the
        first such host's finding, everywhere), else unverified when any host could not verify."""
        codes = ("ok", "unverified", "damaged")
        text = f"{damage.file}\0{damage.problem}" if damage is not None else ""
        verdicts = self._all_hosts(step, "verdicts", codes.index(status), text)
        for host, (code, found) in enumerate(verdicts):
            if codes[code] == "damaged":
                if host == self._process_index:
                    return status, damage
                file, problem = found.split("\0", 1)
                return "damaged", integrity.Damage(file, f"{problem} (found by host {host})")
        return ("unverified" if any(codes[c] == "unverified" for c, _ in verdicts) else "ok"), None

    def _agreed_failure(self, step: int, failure: Optional[CheckpointRestoreError]
                        ) -> Optional[CheckpointRestoreError]:
        """The restore's outcome, combined over hosts: if any host's read failed, every host gets
        a failure (its own, or the first failing host's), corrupt ones first, so all fall back."""
        code = 0 if failure is None else 2 if isinstance(failure, CheckpointCorruptError) else 1
        verdicts = self._all_hosts(step, "restores", code, "" if failure is None else str(failure))
        worst = max(c for c, _ in verdicts)
        if worst == 0 or code == worst:
            return failure
        host, text = next((h, t) for h, (c, t) in enumerate(verdicts) if c == worst)
        message = f"host {host}: {text}"
        if worst == 1:
            return CheckpointRestoreError(message)
        error = CheckpointCorruptError(message)
        error.step = step
        error.damage = integrity.Damage(STATE, f"host {host} could not restore it: {text[:300]}")
        return error
