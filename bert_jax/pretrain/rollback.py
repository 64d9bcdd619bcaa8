"""Rolling back past a loss spike, and the batches a run skips (by hand or after a rollback).

When `divergence.DivergenceMonitor` finds a divergence at step X (first spike step F) and
`config.on_divergence="rollback"`, `roll_back`:

1. waits for the save in flight, and checks the budget (`config.max_rollbacks`) and that a
   checkpoint before F exists in the current phase (else `DivergenceError`, nothing moved);
2. moves every committed step >= F to `<checkpoints>/diverged/<step>-<time>/`
   (`Checkpointer.move_steps_aside`: process 0 moves, every host waits; never deleted);
3. restores the newest intact checkpoint, step C < F (the monitor's state comes with it);
4. records the skip durably before training goes on: S = `config.rollback_skip_batches`, or with
   0 the X - C batches the rolled-back steps read, added to step C's entry of
   `<workdir>/skipped_batches.json` (`SkippedBatches`, written by process 0; every host waits);
5. logs one `{"event": "rollback", ...}` line in train_log.jsonl (flushed at once) and a warning.

The loop then rebuilds the phase's input at C's saved position, exactly as a resume does, and
continues from step C. Skips, recorded or given by hand (`config.skip_batches`, "C:S"), apply
whenever the loop is at step C, after the save of step C and before it draws batch C+1: S batches
are read and discarded on every host. A resume from checkpoint C therefore skips again, and a resume
from a later checkpoint (whose input position includes the skip) does not; an uninterrupted run
with `--config.skip_batches=C:S` sees the batches of a run that rolled back to C and skipped S.

A run killed between steps 2 and 4 resumes from C without the new skip: it trains the same batches
from the same state again (the loop is deterministic), so it meets the same spike (one the data and
the state made; tests/helpers/fault_hooks.py's planted one is spent by then) and rolls back the same way,
counted once.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jax

from bert_jax import layout
from bert_jax.pretrain.divergence import Divergence, DivergenceError, Settings
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

# Grepped by the pod supervisor (bert_jax/pod/progress.py): keep the key names and the event's name.
ROLLBACK_EVENT = "rollback"


class SkippedBatches:
    """The batches skipped after each step: `config.skip_batches` and `<workdir>/skipped_batches.json`.

    The file (written whole, atomically, by process 0 only)::

        {"rollbacks": 2, "skipped_after_step": {"4000": 700}, "history": [<each rollback's event>]}

    Every host reads it at start and keeps the same copy: the hosts make the same rollbacks.

    Args:
        workdir: the run's workdir.
        by_hand: `divergence.parse_skip_batches(config.skip_batches)`.

    Raises:
        ValueError: the file is not of that form, naming it.
    """

    def __init__(self, workdir: str, by_hand: dict[int, int]):
        self.path = storage_paths.join(workdir, layout.SKIPPED_BATCHES)
        self.by_hand = dict(by_hand)
        self.recorded: dict[int, int] = {}
        self.rollbacks = 0
        self.history: list = []
        if storage.exists(self.path):
            try:
                saved = json.loads(storage.read_text(self.path))
                self.recorded = {int(k): int(v) for k, v in saved["skipped_after_step"].items()}
                self.rollbacks, self.history = int(saved["rollbacks"]), list(saved.get("history", []))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{self.path} is damaged ({type(e).__name__}: {e}): it records the batches this "
                                 "run skipped after its rollbacks; restore it from a copy") from None

    def after(self, step: int) -> int:
        """How many batches to skip once the run is at `step` (recorded and by hand together)."""
        return self.recorded.get(step, 0) + self.by_hand.get(step, 0)

    def record(self, step: int, batches: int, event: dict) -> None:
        """Adds a rollback's skip of `batches` after `step`, durably, before anything trains on.

        Every host updates its copy; process 0 writes the file; all then wait at a barrier.
        """
        self.recorded[step] = self.recorded.get(step, 0) + batches
        self.rollbacks += 1
        self.history.append(event)
        if jax.process_index() == 0:
            content = {"rollbacks": self.rollbacks, "history": self.history,
                       "skipped_after_step": {str(k): v for k, v in sorted(self.recorded.items())}}
            storage.write_text(self.path, json.dumps(content, indent=1) + "\n", fsync=True)  # whole or absent
        if jax.process_count() > 1:
            import orbax.checkpoint as ocp
            ocp.multihost.sync_global_processes(f"bert_jax_skipped_batches_{self.rollbacks}", timeout=3600,
                                                processes=set(range(jax.process_count())))


def roll_back(found: Divergence, settings: Settings, ckpt, abstract_state: Any, skipped: SkippedBatches,
              phase_start: int, writer, log_path: str) -> tuple[int, Any, dict]:
    """Steps 1-5 of the module docstring, on every host; returns (C, the state of C, its meta).

    Args:
        found: the divergence.
        settings: the run's divergence settings (`rollback_skip_batches`, `max_rollbacks`).
        ckpt: the run's `Checkpointer`.
        abstract_state: the restore target.
        skipped: the run's `SkippedBatches`.
        phase_start: the current phase's first step (exclusive): C must be at least that.
        writer: the run's `MetricWriter` (process 0 writes the event line).
        log_path: train_log.jsonl.

    Raises:
        DivergenceError: the budget is spent, or no checkpoint before the spike is in this phase.
    """
    first = found.first_spike_step
    if skipped.rollbacks >= settings.max_rollbacks:
        raise DivergenceError(f"{found.describe()}; not rolling back: {skipped.rollbacks} rollbacks already "
                              f"(config.max_rollbacks={settings.max_rollbacks}; {skipped.path})")
    ckpt.wait_until_finished()  # a save in flight may be the step to go back to
    earlier = [s for s in ckpt.all_steps() if s < first]
    if not earlier or earlier[-1] < phase_start:
        where = (f"the newest before it, step {earlier[-1]}, is in an earlier phase (this one starts after step "
                 f"{phase_start})" if earlier else "there is none")
        raise DivergenceError(f"{found.describe()}; cannot roll back: no checkpoint before step {first} in this "
                              f"phase ({where}); skip batches by hand with config.skip_batches")
    ckpt.move_steps_aside(first)
    restored, state, meta = ckpt.restore_latest(abstract_state)
    restored = int(restored)
    if restored < phase_start:  # the intact steps of this phase were damaged: moved aside to damaged/
        raise DivergenceError(f"{found.describe()}; cannot roll back: the newest intact checkpoint, step "
                              f"{restored}, is in an earlier phase")
    batches = settings.rollback_skip_batches or found.step - restored
    event = {"event": ROLLBACK_EVENT, "step": found.step, "first_spike_step": first, "loss": found.loss,
             "statistic": found.statistic, "restored_step": restored, "skipped_batches": batches,
             "rollbacks": skipped.rollbacks + 1}
    skipped.record(restored, batches, event)
    if jax.process_index() == 0:
        writer.append_jsonl(log_path, [event])
    writer.flush()  # the supervisor reads the event now, not at the next log interval
    logging.warning("%s; rolled back to step %d, skipping %d batches after it (rollback %d of at most %d; "
                    "recorded in %s)", found.describe(), restored, batches, skipped.rollbacks,
                    settings.max_rollbacks, skipped.path)
    return restored, state, meta

