"""Checkpoints: async orbax saves, keep-K, auto-resume with the data position, preemption.

This module owns everything a training loop needs to survive being stopped: when to save, what a
step on disk contains, which steps are kept, how a step is restored onto any mesh, and how a
SIGTERM (single process) or the multi-host preemption sync point turns into "save now and stop".
It wraps one orbax `CheckpointManager` (`orbax_manager.make_manager`: its options and orbax's own save
timeout); there is no hand-written checkpoint format. `Checkpointer` saves, keeps K, restores and
resumes, and composes the other modules of bert_jax/checkpoints/ (the package docstring lists them):
`input_state` (each host's input-pipeline state beside a step), `HostAgreement` and `IntactSteps`
(the hosts' agreement on every verdict, and the step a resume uses), `Restorer` (one restore of a
step: verified, read through `StepReader` within the restore deadline, one outcome on every host),
`Preemption` and `Deadline` (the save deadline).

Integrity: every step carries a manifest written before orbax commits it, and is checked against
it before anything of it is read, with one verdict for all hosts (intact_steps.py); a damaged
newest step is moved aside or raised, as `on_damaged` says (docs/reliability.md). A restore that
fails on one host fails on all of them (host_agreement.py), so they all fall back to one step.

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

Paths: local or gs:// (`data_pipeline.storage`; orbax's own writes reach gs:// through etils.epath
and tensorstore). No tensorflow here: the input-pipeline state is written by a caller's function.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp

from bert_jax.checkpoints import input_state, integrity
from bert_jax.checkpoints.host_agreement import HostAgreement
from bert_jax.checkpoints.intact_steps import IntactSteps
from bert_jax.checkpoints.orbax_manager import make_manager
from bert_jax.checkpoints.preemption import Preemption
from bert_jax.checkpoints.restorer import Restorer
from bert_jax.checkpoints.save_deadline import Deadline
from bert_jax.checkpoints.saved_state import flat, is_typed_key, listed
from bert_jax.checkpoints.step_dirs import (DIVERGED, FORMAT_VERSION, INFO, META, ON_DAMAGED, STATE,
                                            CheckpointCorruptError, CheckpointRestoreError, CheckpointSaveError,
                                            committing_dir, input_dir, move_aside, remove_uncommitted)
from data_pipeline.storage import paths as storage_paths

PyTree = Any

# The names it imports are for its own use: import each from the module that defines it.
__all__ = ["Checkpointer"]


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
            orbax's own timeout is set past it (`orbax_manager.orbax_timeout_s`).
        restore_timeout_s: each `restore` (and so each step `restore_latest` tries)'s limit for
            verifying and reading the step; past it the process ends the same way. None: no limit.
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
        restore_timeout_s: Optional[float] = None,
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
        self._saving_step: Optional[int] = None  # the step `_write_manifest` runs for
        self._hosts = HostAgreement(self._directory, self._process_index, self._process_count)
        self._steps = IntactSteps(self._directory, on_damaged, self._hosts, self._process_index)
        # The integrity manifest is written in orbax's post-finalization hook, part of the commit.
        self._mngr = make_manager(self._directory, max_to_keep=max_to_keep, save_timeout_s=save_timeout_s,
                                  on_finalized=self._write_manifest)
        self._deadline = Deadline(save_timeout_s, self._directory, self._mngr.is_saving_in_progress)
        self._restorer = Restorer(self._directory, self._steps, self._hosts, restore_timeout_s)
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
        return input_state.process_dir(self._directory, step, index)

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
        intact, moved = self._steps.newest(self.all_steps())
        if moved:
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
                input_state.write(self._directory, step, self._process_index, input_state_writer)
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
        integrity.write_manifest(committing_dir(self._directory, step), input_dir(self._directory, step), step)

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
            self._restorer.close()
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
        # Verified, read within the restore deadline, one outcome on every host (restorer.py).
        return self._restorer.restore(abstract_state, step, steps, check_input_state)

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
                # Every host raised it (`HostAgreement.failure`): all fall back together. Remembered as
                # damaged: latest_step moves it aside, or raises, as configured.
                self._steps.mark_damaged(step, e.damage)

    def move_steps_aside(self, first_step: int) -> list[int]:
        """Moves every committed step >= `first_step` to `<directory>/diverged/<step>-<time>/`.

        For a run that rolls back past a loss spike (`bert_jax.pretrain.rollback`): the steps saved
        after the spike began are kept for a human to look at, never deleted, and never resumed
        from. Waits for the save in flight first. Process 0 moves them (each with its input state,
        as `step_dirs.move_aside` moves a damaged step), then every host waits until they
        are gone and orbax forgets them: `latest_step` and `restore_latest` then see the steps
        before, and a later save may reuse a moved step's number.

        Returns:
            The steps moved, ascending (the same list on every host).
        """
        self.wait_until_finished()
        steps = [s for s in self.all_steps() if s >= first_step]
        for step in steps:
            moved = move_aside(self._directory, step, DIVERGED) if self._process_index == 0 else f"{DIVERGED}/"
            logging.warning("checkpointing: moved step %d of %s, saved after the loss spike of step %d, to %s",
                            step, self._directory, first_step, moved)
        self._hosts.barrier("moved_diverged")
        for step in steps:
            self._steps.forget(step)
        self._mngr.reload()  # orbax lists the steps it has seen; the moved ones are gone
        return steps

    def input_state_process_count(self, step: int) -> Optional[int]:
        """How many processes saved `step`'s input state (None: saved without any)."""
        return self._restorer.reader.info(step).get("input_state_process_count")

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
            remove_uncommitted(self._directory, set(self._mngr.all_steps()))
        self._hosts.barrier("removed_uncommitted")

    def _prune_input_state(self) -> None:
        """Deletes this process's input state of steps orbax no longer has (`input_state.prune`)."""
        input_state.prune(self._directory, self._process_index, set(self._mngr.all_steps()), self._pending_step)
