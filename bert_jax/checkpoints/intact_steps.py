"""Which committed steps every host takes for intact, and the newest one a resume uses.

A step is verified against its integrity manifest (`step_dirs.check_step`) once per
`Checkpointer`, and the verdict is agreed over hosts (`HostAgreement.verdict`): damaged if any host
found it damaged or could not read it. The newest intact step is then the same on every host.
Newer damaged steps are, as `on_damaged` says, raised as `CheckpointCorruptError` ("stop", or when
nothing intact is left) or moved to `<directory>/damaged/` by the primary process with one log
line each ("fallback"), every host waiting until they are gone.

Nothing here saves or restores: `checkpointer.Checkpointer` asks, and reads the step it is given.
"""

from __future__ import annotations

import logging
from typing import Optional

from bert_jax.checkpoints import integrity
from bert_jax.checkpoints.host_agreement import HostAgreement
from bert_jax.checkpoints.step_dirs import STATE, CheckpointRestoreError, check_step, corrupt_error, move_aside
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths


class IntactSteps:
    """The agreed verdicts on one checkpoint directory's steps, remembered by step.

    Args:
        directory: the absolute checkpoint directory.
        on_damaged: "fallback" or "stop" (`Checkpointer`'s argument of that name).
        hosts: the directory's agreement; every host makes the same calls in the same order.
        process_index: this host; process 0 moves damaged steps aside.
    """

    def __init__(self, directory: str, on_damaged: str, hosts: HostAgreement, process_index: int):
        self._directory = directory
        self._on_damaged = on_damaged
        self._hosts = hosts
        self._process_index = process_index
        self._checked: dict[int, Optional[integrity.Damage]] = {}  # agreed verdicts by step

    def damage(self, step: int) -> Optional[integrity.Damage]:
        """The step's damage (None when intact or unverifiable), checked once, and the same on every
        host: damaged if any host found it damaged or could not read it."""
        if step not in self._checked:
            try:
                status, damage = check_step(self._directory, step)
            except Exception as e:  # pylint: disable=broad-except  # the store failed us mid-check
                if isinstance(e, MemoryError):
                    raise
                first_line = (str(e).strip().splitlines() or [""])[0][:300]
                status, damage = "damaged", integrity.Damage(
                    STATE, f"could not be read to verify it ({type(e).__name__}: {first_line})")
            status, damage = self._hosts.verdict(step, status, damage)
            if status == "unverified":
                logging.warning("checkpointing: step %d in %s has no integrity manifest (saved by an older "
                                "bert_jax): restoring it unverified", step, self._directory)
            self._checked[step] = damage
        return self._checked[step]

    def mark_damaged(self, step: int, damage: integrity.Damage) -> None:
        """Remembers a step that every host failed to restore (`HostAgreement.failure`) as damaged."""
        self._checked[step] = damage

    def forget(self, step: int) -> None:
        """Drops the verdict on a step moved out of the directory: a step saved later under the same
        number is another one, and is verified afresh."""
        self._checked.pop(step, None)

    def newest(self, steps: list[int]) -> tuple[Optional[int], bool]:
        """(the newest intact step of `steps` or None, whether damaged steps were moved aside).

        `steps` ascending, committed. Newer damaged steps are raised or moved aside as `on_damaged`
        says; once some were moved, the caller's list of steps (orbax's) is stale.

        Raises:
            CheckpointRestoreError: the newest step folder holds no train state and no integrity
                manifest (a folder that is not ours), naming it and the step a resume would use.
            CheckpointCorruptError: the newest damaged step, with on_damaged="stop" or no intact step
                to fall back to (nothing is moved then).
        """
        if not steps:
            return None, False
        newest = storage_paths.join(self._directory, str(steps[-1]))
        if not storage.exists(storage_paths.join(newest, STATE)) and not storage.exists(
                storage_paths.join(newest, integrity.MANIFEST)):
            earlier = [s for s in steps[:-1] if storage.exists(storage_paths.join(self._directory, str(s), STATE))]
            then = f"resume from step {earlier[-1]}" if earlier else "start afresh"
            raise CheckpointRestoreError(
                f"{newest} has no '{STATE}' item: not a checkpoint "
                f"bert_jax wrote, or a damaged one; move it out of {self._directory} to {then}")
        damaged, intact = [], None
        for step in reversed(steps):
            damage = self.damage(step)
            if damage is None:
                intact = step
                break
            damaged.append((step, damage))
        if not damaged:
            return intact, False
        if self._on_damaged == "stop" or intact is None:
            step, damage = damaged[0]
            raise corrupt_error(self._directory, step, damage, intact)
        for step, damage in damaged:
            moved = move_aside(self._directory, step) if self._process_index == 0 else "damaged/"
            logging.error("checkpointing: checkpoint step %d in %s is damaged: %s; moved it to %s and resume from "
                          "step %d (config.on_damaged_checkpoint='stop' stops instead)",
                          step, self._directory, damage, moved, intact)
            self._checked.pop(step, None)
        self._hosts.barrier("moved_damaged")
        return intact, True
