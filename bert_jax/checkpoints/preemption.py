"""Preemption: when a training loop should save and stop.

* Single process (`jax.distributed` not initialized): `Preemption` installs a SIGTERM handler
  that only sets a flag; `should_stop(step)` returns True at the first step after the signal.
* Multi-host (`jax.distributed.initialize` was called): JAX itself catches SIGTERM, and
  `should_stop(step)` asks `multihost_utils.reached_preemption_sync_point(step)`, which becomes
  True on every host at the same step. It must be called by every host at every step, including
  the last one, or a preemption notice is silently lost.

`checkpointer.Checkpointer` holds one: its `should_stop` is this one's, and once it has returned
True, `Checkpointer.save` saves regardless of the interval.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Optional

import jax
from jax.experimental import multihost_utils


class Preemption:
    """Watches for a preemption notice; construct it in the main thread, `close` it when done.

    Args:
        handle_sigterm: install the single-process SIGTERM handler (`close` puts the previous one
            back). Ignored (JAX handles SIGTERM) when `jax.distributed` is initialized.
    """

    def __init__(self, handle_sigterm: bool = True):
        self.stop_step: Optional[int] = None  # the step `should_stop` first returned True at
        self._sigterm_seen = threading.Event()
        self._previous_handler: Any = None
        self._distributed = jax.distributed.is_initialized()
        if handle_sigterm and not self._distributed:
            self._install_sigterm_handler()

    def should_stop(self, step: int) -> bool:
        """True once the run should save and stop; call it at every step, on every process.

        Single process: True from the first call after a SIGTERM. Multi-host: True when
        `multihost_utils.reached_preemption_sync_point(step)` is, i.e. at the same step on every
        host. After it returned True once, it stays True.
        """
        if self.stop_step is not None:
            return True
        if self._distributed:
            try:
                reached = multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:
                # The preemption service is disabled (jax_enable_preemption_service=False):
                # nothing is caught, a SIGTERM kills the process, the last save is the fallback.
                reached = False
        else:
            reached = self._sigterm_seen.is_set()
        if reached:
            self.stop_step = step
            logging.warning("checkpointing: stop requested (preemption) at step %d", step)
        return reached

    def close(self) -> None:
        """Puts back the SIGTERM handler that was there before (if this one installed its own)."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def _install_sigterm_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logging.warning("checkpointing: not in the main thread, SIGTERM is not handled")
            return

        def handler(signum, frame):  # pylint: disable=unused-argument
            # Only a flag: the loop saves at its next step boundary, where the state is whole.
            self._sigterm_seen.set()

        self._previous_handler = signal.signal(signal.SIGTERM, handler)
