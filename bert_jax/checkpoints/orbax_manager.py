"""The orbax `CheckpointManager` as bert_jax configures it: keep-K, always orbax's async path (for the
integrity manifest's hook), synchronous directory creation, leftover cleanup, the three items a step
holds, and orbax's own save timeout set past ours.

`checkpointer.Checkpointer` builds one with `make_manager` and drives it; nothing here saves, restores
or decides when.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import orbax.checkpoint as ocp

from bert_jax.checkpoints.step_dirs import INFO, META, STATE
from data_pipeline.storage import paths as storage_paths

# orbax gives each async save its own time (`AsyncOptions.timeout_secs`, 1200 s in orbax 0.12.8), after which
# its background thread fails the save with a TimeoutError. Ours (`Deadline`) must fire first, with its
# clearer message and exit code: orbax gets the save deadline plus this margin (its clock starts a little
# later, in its thread), or a week when the save has no deadline.
ORBAX_TIMEOUT_MARGIN_S = 300
ORBAX_TIMEOUT_WITHOUT_DEADLINE_S = 7 * 24 * 3600  # as milliseconds (orbax's barriers), well within an int32


def orbax_timeout_s(save_timeout_s: Optional[float]) -> int:
    """orbax's `AsyncOptions.timeout_secs` for a save deadline of `save_timeout_s` (None or <= 0: none):
    never shorter than the deadline plus `ORBAX_TIMEOUT_MARGIN_S`, nor than orbax's own default."""
    default = ocp.AsyncOptions().timeout_secs
    if not save_timeout_s or save_timeout_s <= 0:
        return max(default, ORBAX_TIMEOUT_WITHOUT_DEADLINE_S)
    return max(default, math.ceil(save_timeout_s) + ORBAX_TIMEOUT_MARGIN_S)


def make_manager(directory: str, *, max_to_keep: int, save_timeout_s: Optional[float],
                 on_finalized: Callable[[], None]) -> ocp.CheckpointManager:
    """The manager of the steps in `directory` (absolute; created if missing).

    Args:
        directory: the checkpoint directory, local or gs://.
        max_to_keep: how many most recent committed steps orbax keeps (>= 1).
        save_timeout_s: our save deadline (None: none); orbax's own is `orbax_timeout_s` of it.
        on_finalized: orbax's post-finalization hook (the integrity manifest's writer).
    """
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
                                       post_finalization_callback=on_finalized,
                                       timeout_secs=orbax_timeout_s(save_timeout_s)),
        # A kill -9 mid-save leaves `<step>.orbax-checkpoint-tmp`; it is never a step, and
        # this removes it at startup. On Cloud Storage orbax would take every folder without
        # a commit marker for such a leftover, `input_state/` and `damaged/` included:
        # `Checkpointer` removes only uncommitted step folders there (`step_dirs.remove_uncommitted`).
        cleanup_tmp_directories=not storage_paths.is_remote(directory),
        create=True,
    )
    return ocp.CheckpointManager(
        directory,
        options=options,
        item_handlers={
            STATE: ocp.StandardCheckpointHandler(),
            META: ocp.JsonCheckpointHandler(),
            INFO: ocp.JsonCheckpointHandler(),
        },
    )
