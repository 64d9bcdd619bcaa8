"""What the supervisor does about its slice when a poll finds it not READY (the bullets of
`bert_jax.pod.supervisor`'s docstring on the slice): a queued resource waiting for capacity keeps
its place (`QUEUE_TIMEOUT`); a slice PREEMPTED, TERMINATED, NOT_FOUND or whose queued resource
FAILED, `LOST_READINGS` readings in a row, is deleted and created again from its recorded spec
(`recreate`: "needs install" written to the workdir first, a failed create backed off and retried up
to `MAX_CREATE_FAILURES`); a STOPPED one is started again, not deleted (`restart_stopped`); any
other state past `READY_TIMEOUT` is recreated. Each ends the attempt on it (`lose_attempt`), which
is not a failure of the run. Describe's health and announced maintenance are recorded when they
change (`note_maintenance`).

`SliceRecovery` is a part of `bert_jax.pod.supervisor.Supervisor` (its base class), on the
supervisor's state: `s` (the settings), `slice`, `spec`, `spec_file`, `io`, `attempt`, `open`,
`pending`, the slice's `slice_state`, `state_since`, `readings`, `create_failures`,
`create_not_before`, `maintenance`, the install's `needs_install`, `first_install`,
`needs_install_file`; and its methods `log`, `record`, `end` and `give_up`.
"""

from __future__ import annotations

import datetime
import json
import time

from bert_jax.pod import calls
from bert_jax.pod.slice import GONE, NOT_FOUND, QUEUED_FAILED, Reading, maintenance_of
from data_pipeline import storage


class SliceRecovery:
    """The supervisor's slice: read each poll, and made to come back when it does not."""

    def lose_attempt(self, cause: str) -> None:
        """The slice took the attempt's VMs (or will be made again): the attempt ends, not a failure."""
        if self.open:
            self.end(cause, None, collect=False)
        if self.pending is None:
            self.pending = cause

    def describe(self) -> Reading:
        return self.slice.read(self.spec.get("queued_resource"), sleep=lambda s: time.sleep(min(self.s.poll_seconds, s)))

    def slice_not_ready(self, state: str, now: float) -> None:
        """The slice is not READY (`poll`): wait on a queued resource, recreate a lost slice, start a
        STOPPED one again, recreate one stuck in any other state past READY_TIMEOUT."""
        if self.open and self.readings == 1:
            self.log(f"{self.slice.name} is {state}")
        if state == "QUEUED":  # the node is gone; the request waits for capacity: keep its place
            self.lose_attempt("slice QUEUED")
            self.mark_needs_install("slice QUEUED")
            if now - self.state_since > self.s.queue_timeout:
                raise self.give_up(f"the queued resource {self.spec['queued_resource']} waited more than "
                                   f"QUEUE_TIMEOUT={self.s.queue_timeout:.0f} s; it keeps its place in the queue: "
                                   "start the supervisor again to wait on")
            return
        if state in GONE or state == NOT_FOUND or state in (f"QUEUED_{s}" for s in QUEUED_FAILED):
            if self.readings < self.s.lost_readings:
                self.log(f"{self.slice.name} is {state} (reading {self.readings} of {self.s.lost_readings} before "
                         "recreating it)")
                return
            self.recreate(state)
            return
        if state == "STOPPED":
            if self.readings >= self.s.lost_readings:
                self.restart_stopped()
            return
        if now - self.state_since > self.s.ready_timeout:  # CREATING, REPAIRING, UNKNOWN, ... for too long
            self.log(f"{self.slice.name} has been {state} for more than READY_TIMEOUT={self.s.ready_timeout:.0f} s")
            self.recreate(f"{state} past READY_TIMEOUT")

    def mark_needs_install(self, why: str) -> bool:
        """Writes "needs install" to the workdir before the slice is touched; False if it could not."""
        if self.needs_install and not self.first_install:
            return True
        try:
            self.io.call("writing needs_install.json", storage.write_text, self.needs_install_file,
                         json.dumps({"why": why, "time": datetime.datetime.now().isoformat(timespec="seconds")}) + "\n")
        except calls.Unavailable as e:
            self.log(f"not touching the slice before 'needs install' is recorded: {e}")
            return False
        self.needs_install, self.first_install = True, False
        return True

    def recreate(self, state: str) -> None:
        """Deletes what is left and creates the slice again from its spec (one try a poll, backed off)."""
        self.lose_attempt(f"slice {state}")
        if not self.mark_needs_install(f"slice {state}") or time.monotonic() < self.create_not_before:
            return
        self.log(f"{self.slice.name} is {state}: recreating it from {self.spec_file}")
        error = self.slice.delete(self.spec)
        if error is None:
            self.record(event="recreate", cause=f"slice {state}", tries=self.create_failures + 1)
            error = self.slice.create(self.spec, timeout=self.s.create_timeout)
        if error is None:
            self.pending = f"slice recreated after {state}"
            self.slice_state = None  # its next state's clock starts now
            return
        self.create_failures += 1
        wait = min(self.s.backoff_seconds * 2 ** (self.create_failures - 1), self.s.max_backoff_seconds)
        self.record(event="create_failed", cause=f"slice {state}", error=error[-500:], failures=self.create_failures,
                    retry_in=wait)
        if self.create_failures >= self.s.max_create_failures:
            raise self.give_up(f"creating {self.slice.name} failed {self.create_failures} times "
                               f"(MAX_CREATE_FAILURES); the last: {error[-300:]}")
        self.log(f"recreating failed ({error[-300:]}); trying again in {wait:g} s")
        self.create_not_before = time.monotonic() + wait

    def restart_stopped(self) -> None:
        """A STOPPED slice is started again, not deleted (its disks are kept)."""
        self.lose_attempt("slice STOPPED")
        if not self.mark_needs_install("slice STOPPED") or time.monotonic() < self.create_not_before:
            return
        error = self.slice.start()
        self.record(event="start_slice", error=error and error[-500:])
        if error is not None:
            self.create_failures += 1
            self.create_not_before = time.monotonic() + min(self.s.backoff_seconds * 2 ** (self.create_failures - 1),
                                                            self.s.max_backoff_seconds)
        else:
            self.slice_state = None

    def note_maintenance(self, reading: Reading) -> None:
        """Records describe's health and announced maintenance when they change."""
        found = maintenance_of(reading.node)
        if found != self.maintenance:
            self.maintenance = found
            if found:
                self.log(f"{self.slice.name}: {json.dumps(found)}")
            self.record(event="maintenance", attempt=self.attempt, **(found or {"health": "HEALTHY"}))
