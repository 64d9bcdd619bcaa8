"""One restore of one committed step: verified before anything of it is read, within the restore
deadline, with one outcome on every host.

`Restorer.restore` checks the step against its integrity manifest (with the hosts' verdict on it,
`intact_steps.IntactSteps`), reads it through `saved_state.StepReader` while the restore deadline
(`save_deadline.Deadline`) runs, and turns a failure on any host into the same failure on all of
them (`host_agreement.HostAgreement`), so that they all fall back to one step.
`checkpointer.Checkpointer` decides which step, and what a failure means for the next one.
"""

from __future__ import annotations

from typing import Any, Optional

from bert_jax.checkpoints.host_agreement import HostAgreement
from bert_jax.checkpoints.intact_steps import IntactSteps
from bert_jax.checkpoints.save_deadline import Deadline
from bert_jax.checkpoints.saved_state import StepReader, to_abstract
from bert_jax.checkpoints.step_dirs import CheckpointRestoreError, corrupt_error, is_read_failure, read_error

PyTree = Any


class Restorer:
    """Restores steps of `directory` onto the mesh of a target, as every host's one outcome.

    Args:
        directory: the checkpoint directory (absolute).
        steps: the hosts' verdicts on the steps (damaged or intact).
        hosts: the hosts' exchanges.
        restore_timeout_s: each restore's limit for verifying and reading the step; past it the
            process ends with a message naming the step. None: no limit.
    """

    def __init__(self, directory: str, steps: IntactSteps, hosts: HostAgreement,
                 restore_timeout_s: Optional[float]):
        self._directory = directory
        self._steps = steps
        self._hosts = hosts
        # Restores read through this, not the manager (whose handlers are for saving).
        self.reader = StepReader(directory)
        self.deadline = Deadline(restore_timeout_s, directory, kind="restore")

    def restore(self, abstract_state: PyTree, step: int, committed: list[int],
                check_input_state: bool) -> tuple[PyTree, dict]:
        """(state, meta) of the committed `step` (`committed`: every committed step, ascending).

        Raises, on every host alike:
            CheckpointRestoreError: a wrong target, missing input state (`StepReader.read`).
            CheckpointCorruptError: the step fails its integrity check, or cannot be read.
        """
        target = to_abstract(abstract_state)
        # Verifying (with the hosts' verdict on it) and reading: a store that stops answering ends
        # the run within the deadline (tensorstore's reads wait as long as the store does). The
        # hosts' agreement on the outcome has its own bound (host_agreement.AGREEMENT_TIMEOUT_S).
        self.deadline.arm(step)
        try:
            # Verify before use: nothing of a damaged step is read.
            damage = self._steps.damage(step)
            if damage is not None:
                intact = next((s for s in reversed(committed) if s < step and self._steps.damage(s) is None), None)
                raise corrupt_error(self._directory, step, damage, intact)
            failure: Optional[CheckpointRestoreError] = None
            try:
                state, meta = self.reader.read(step, target, check_input_state)
            except CheckpointRestoreError as e:  # a wrong target, missing input state, or unreadable
                failure = e
            except Exception as e:  # pylint: disable=broad-except
                if not is_read_failure(e):
                    raise
                failure = read_error(step, self._directory, e)
        finally:
            self.deadline.disarm()
        failure = self._hosts.failure(step, failure)
        if failure is not None:
            raise failure
        return state, meta

    def close(self) -> None:
        """Stops the deadline's watchdog and releases the reader."""
        self.deadline.close()
        self.reader.close()
