"""Writes that only feed logs, done off the training step by one background thread, in bounded time.

What goes through here: appends to a run's text logs (`train_log.jsonl`) and uploads of staged
TensorBoard event files (`storage_staging.Mirror`). On Cloud Storage either can stall (a request
hangs until `storage_gcs.gcs_timeout()`, 60 s) or fail for minutes (an outage); neither may stall or
stop training, so the training loop only queues them:

- `append(path, text)` and `sync(mirror)` queue and return at once; they never touch storage.
- Coalescing and rate: what is queued for one file is written in one go, at most once per
  `min_interval_s` (1 s: Cloud Storage's sustained write rate for one object name; none for a
  local file); a mirror is uploaded at most once per `mirror_interval_s` (5 s; an upload of a
  4 MiB event file took 0.1 s against the emulator), its first upload at once.
- Retries: a write that fails or times out is retried after 0.5 s, doubling up to 30 s, for
  `retry_budget_s` (600 s) from its first failure; then what it held is dropped with a warning:
  `dropped_lines` counts the log lines given up, `dropped_uploads` the uploads (the event files
  stay staged and go with the next upload), `failed_writes` every failed try. Each drop is logged
  with the totals.
- No line twice, none lost while it is retried: appends go through `storage_atomic.Appender`, which
  composes with a generation precondition and, after a failure, checks whether the failed write
  landed before writing again.
- `flush(timeout)` writes everything queued now (ignoring the intervals) and waits for it at most
  `timeout`; `close(timeout)` does the same, then counts what is left as dropped and stops the
  thread. Neither waits longer than asked, even on a stalled request (the thread is a daemon and
  gives up on its own once closed).

What a killed process loses: the lines queued in the last `min_interval_s` plus one write, the
events of the last `mirror_interval_s` plus one upload, and whatever an outage held back.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from data_pipeline.storage import atomic as storage_atomic, paths as storage_paths, staging as storage_staging

MIN_INTERVAL_S = 1.0  # between two writes of one object (Cloud Storage: ~1 write/s per object name)
MIRROR_INTERVAL_S = 5.0  # between two TensorBoard uploads
RETRY_BUDGET_S = 600.0  # how long a failing write is retried before what it holds is dropped
CLOSE_TIMEOUT_S = 10.0  # how long `flush`/`close` wait by default (a preempted VM has ~30 s)
_BACKOFF_S = (0.5, 30.0)  # first retry delay, doubling up to the second


class _Job:
    """One file to append to, or one mirror to upload: what is queued and when it may go."""

    def __init__(self, interval: float, appender: Optional[storage_atomic.Appender] = None,
                 mirror: Optional[storage_staging.Mirror] = None):
        self.interval = interval
        self.appender, self.mirror = appender, mirror
        self.queued: list[str] = []  # appends not yet handed to the appender (the caller's thread adds)
        self.requested = 0  # sync requests (mirror): `sending` of them in the upload under way,
        self.sending = 0  # `uploaded` of them covered by an upload that succeeded
        self.uploaded = 0
        self.last_try = float("-inf")  # monotonic start of the last write
        self.failing_since: Optional[float] = None
        self.failures = 0
        self.retry_at = float("-inf")

    def has_work(self) -> bool:
        if self.mirror is not None:
            return self.requested > self.uploaded
        return bool(self.queued or self.appender.queued)

    def ready_at(self, urgent: bool) -> float:
        """When it may be written: after its interval (unless urgent) and its backoff."""
        at = self.retry_at
        if not urgent:
            at = max(at, self.last_try + self.interval)
        return at

    def queued_lines(self) -> int:
        if self.mirror is not None:
            return 0
        return sum(text.count("\n") for text in self.queued) + self.appender.queued.count(b"\n")


class LogWriter:
    """The background writer (see the module docstring); one per process that writes logs.

    Args:
        min_interval_s: least time between two writes of one remote file.
        mirror_interval_s: least time between two uploads of one mirror.
        retry_budget_s: how long a failing write is retried before it is dropped.
    """

    def __init__(self, *, min_interval_s: float = MIN_INTERVAL_S, mirror_interval_s: float = MIRROR_INTERVAL_S,
                 retry_budget_s: float = RETRY_BUDGET_S):
        self.min_interval_s = min_interval_s
        self.mirror_interval_s = mirror_interval_s
        self.retry_budget_s = retry_budget_s
        self.dropped_lines = 0
        self.dropped_uploads = 0
        self.failed_writes = 0
        self.writes = 0
        self._cond = threading.Condition()
        self._jobs: dict[object, _Job] = {}
        self._thread: Optional[threading.Thread] = None
        self._urgent = False  # a flush or close is waiting: intervals do not apply
        self._busy = False
        self._closed = False

    # -- the caller's side: never waits on storage ------------------------------------------------

    def append(self, path, text: str) -> None:
        """Queues `text` to be appended to `path` (local or remote)."""
        if not text:
            return
        path = storage_paths.abspath(path)
        with self._cond:
            self._check_open()
            job = self._jobs.get(path)
            if job is None:
                interval = self.min_interval_s if storage_paths.is_remote(path) else 0.0
                job = self._jobs[path] = _Job(interval, appender=storage_atomic.Appender(path))
            job.queued.append(text)
            self._wake()

    def sync(self, mirror: storage_staging.Mirror) -> None:
        """Asks for an upload of what `mirror` has staged (nothing to do for a local one)."""
        if not storage_paths.is_remote(mirror.remote):
            return
        with self._cond:
            self._check_open()
            job = self._jobs.get(id(mirror))
            if job is None:
                job = self._jobs[id(mirror)] = _Job(self.mirror_interval_s, mirror=mirror)
            job.requested += 1
            self._wake()

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Writes what is queued now and waits for it, at most `timeout` seconds; whether all of
        it was written (or dropped) in that time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._urgent = True
            self._cond.notify_all()
            while self._pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    self._urgent = False
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """`flush(timeout)`, then what is still queued is counted as dropped and the thread told to
        stop; later appends and syncs raise. Whether everything was written."""
        done = self.flush(timeout)
        with self._cond:
            if self._closed:
                return done
            self._closed = True
            if not done:
                lines = sum(job.queued_lines() for job in self._jobs.values())
                uploads = sum(job.has_work() for job in self._jobs.values() if job.mirror is not None)
                self.dropped_lines += lines
                self.dropped_uploads += uploads
                logging.warning("log writer: closed after %.1f s with %d log line(s) and %d upload(s) unwritten; "
                                "%s", timeout, lines, uploads, self._totals())
            self._cond.notify_all()
        return done

    # -- the thread ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("LogWriter is closed")

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bert_jax-log-writer", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _pending(self) -> bool:
        return self._busy or any(job.has_work() for job in self._jobs.values())

    def _totals(self) -> str:
        return (f"{self.dropped_lines} log line(s) and {self.dropped_uploads} upload(s) dropped, "
                f"{self.failed_writes} failed write(s) so far")

    def _next(self) -> Optional[_Job]:
        """Waits for the next job that is due; None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                due = [(job.ready_at(self._urgent), i, job) for i, job in enumerate(self._jobs.values())
                       if job.has_work()]
                if not due:
                    self._urgent = False
                    self._cond.notify_all()  # a flush waiting for an idle writer
                    self._cond.wait()
                    continue
                at, _, job = min(due, key=lambda d: d[:2])
                if at <= now:
                    self._busy = True
                    job.sending = job.requested
                    if job.appender is not None:  # hand the queued text to the appender (this thread's)
                        job.appender.add("".join(job.queued).encode("utf-8"))
                        job.queued.clear()
                    return job
                self._cond.wait(at - now)

    def _run(self) -> None:
        while (job := self._next()) is not None:
            started = time.monotonic()
            try:
                if job.appender is not None:
                    job.appender.flush()
                else:
                    job.mirror.sync()
                error = None
            except Exception as e:  # pylint: disable=broad-except  # logs never stop training
                error = e
            with self._cond:
                self._busy = False
                job.last_try = started
                if error is None:
                    self.writes += 1
                    job.uploaded = max(job.uploaded, job.sending)
                    job.failing_since, job.failures, job.retry_at = None, 0, float("-inf")
                else:
                    self._failed(job, error, started)
                self._cond.notify_all()

    def _failed(self, job: _Job, error: BaseException, started: float) -> None:
        """Schedules the retry of a failed write, or drops what it holds once its budget is spent."""
        self.failed_writes += 1
        job.failures += 1
        if self._closed:  # what it held is counted as dropped already
            return
        what = job.appender.path if job.appender is not None else job.mirror.remote
        if job.failing_since is None:
            job.failing_since = started
            logging.warning("log writer: writing %s failed (%s: %s); retrying for up to %.0f s", what,
                            type(error).__name__, error, self.retry_budget_s)
        now = time.monotonic()
        if now - job.failing_since < self.retry_budget_s:
            job.retry_at = now + min(_BACKOFF_S[0] * 2 ** (job.failures - 1), _BACKOFF_S[1])
            return
        if job.appender is not None:
            lines = job.appender.discard().count(b"\n")
            self.dropped_lines += lines
            dropped = f"{lines} log line(s)"
        else:
            job.uploaded = job.requested  # the next write asks again; the files stay staged
            self.dropped_uploads += 1
            dropped = "an upload"
        logging.warning("log writer: gave up on %s after %.0f s of failures (last: %s: %s): dropped %s; %s", what,
                        now - job.failing_since, type(error).__name__, error, dropped, self._totals())
        job.failing_since, job.failures, job.retry_at = None, 0, float("-inf")
