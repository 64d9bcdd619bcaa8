"""A deadline on every checkpoint save and restore: a stalled store ends the run loudly instead of hanging it.

A save writes the state's arrays through tensorstore and its metadata through gcsfs (on Cloud
Storage), partly in the caller's thread and partly in orbax's background thread; a restore reads
them back in the caller's thread. gcsfs's requests are bounded (`data_pipeline.storage.gcs.gcs_timeout`),
tensorstore's are not by default: a read or write of a bucket that stops answering waits for as
long as the bucket does, and on a pod the other hosts wait for it in the next collective,
heartbeating: the run hangs without an error. `Deadline` gives each save `seconds`
(`config.checkpoint_save_timeout_seconds`) from its start to its commit, and each restore
(`config.checkpoint_restore_timeout_seconds`) from its start to its return. Past that it logs
which step, where and how long, dumps every thread's stack (what was waiting on what), and ends
the process with exit code `EXIT_CODE`: an uncommitted step is never restored, so the next
attempt resumes from the newest committed one, and a supervisor (`bert_jax.pod.supervisor`) restarts
it. The other hosts of a pod then fail within jax's heartbeat timeout (`BERT_JAX_HEARTBEAT_TIMEOUT`,
100 s), the coordination service having lost this one.

Exiting rather than raising: the stalled call holds the main thread or orbax's thread, and nothing
there can be interrupted from Python.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Callable, Optional

from absl import logging

from bert_jax import exit_codes

EXIT_CODE = exit_codes.DEADLINE  # 124, as GNU timeout's: the run was stopped for taking too long

# What a deadline watches: (the message's words, with {step} and {where}; the config field that sets it).
KINDS = {
    "save": ("saving step {step} to {where}", "config.checkpoint_save_timeout_seconds"),
    "restore": ("restoring step {step} from {where}", "config.checkpoint_restore_timeout_seconds"),
}


class Deadline:
    """Watches one save (or one restore) at a time; `arm` when it starts, `disarm` once it is done.

    Args:
        seconds: each operation's limit, from its start to its end (None or <= 0: no limit).
        where: the checkpoint folder, for the message.
        saving: whether a background save is still in flight (orbax's `is_saving_in_progress`):
            once the caller's part of the save has returned (`started`), the deadline is lifted
            as soon as this turns False. None: the operation runs in the caller's thread only
            (a restore), and only `disarm` lifts the deadline.
        exit: what ends the process (tests replace it).
        kind: "save" or "restore" (`KINDS`): the message's words and the config field it names.
    """

    def __init__(self, seconds: Optional[float], where: str, saving: Optional[Callable[[], bool]] = None,
                 exit: Callable[[int], None] = os._exit,  # pylint: disable=redefined-builtin
                 kind: str = "save"):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
        self.seconds = seconds if seconds and seconds > 0 else None
        self._where, self._saving, self._exit, self._kind = where, saving, exit, kind
        self._lock = threading.Lock()
        self._step: Optional[int] = None
        self._deadline = 0.0
        self._started = False  # the caller's part of the save has returned
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def arm(self, step: int) -> None:
        """An operation on `step` starts now."""
        if self.seconds is None:
            return
        with self._lock:
            self._step, self._deadline, self._started = step, time.monotonic() + self.seconds, False
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name=f"bert_jax-{self._kind}-deadline", daemon=True)
            self._thread.start()

    def started(self) -> None:
        """The caller's part of the save returned; the rest is orbax's background thread's."""
        with self._lock:
            self._started = True

    def disarm(self) -> None:
        """The operation is done (committed, restored, or failed and reported): no deadline."""
        with self._lock:
            self._step = None

    def close(self) -> None:
        self.disarm()
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                step, deadline, started = self._step, self._deadline, self._started
            if step is None:
                continue
            if started and self._saving is not None:
                try:
                    if not self._saving():
                        with self._lock:
                            if self._step == step:
                                self._step = None
                        continue
                except Exception:  # pylint: disable=broad-except  # the deadline still holds
                    pass
            if time.monotonic() > deadline:
                self._fire(step)
                return

    def _fire(self, step: int) -> None:
        what, field = KINDS[self._kind]
        logging.error("checkpointing: %s did not finish within %.0f s (%s): the store stopped answering? "
                      "Ending the run (exit code %d); the next attempt resumes from the newest committed step. "
                      "The threads' stacks follow.", what.format(step=step, where=self._where), self.seconds,
                      field, EXIT_CODE)
        try:
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:
            self._exit(EXIT_CODE)

