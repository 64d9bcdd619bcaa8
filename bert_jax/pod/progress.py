"""Whether a run is getting anywhere: the supervisor's hang detection.

"Running" only says the processes are alive. A restore stalled in tensorstore, tf.data blocked in
TensorFlow's GCS client or a collective that never completes all look alive forever. So the
supervisor also watches what a healthy run leaves in the workdir, each poll:

- `train_log.jsonl` growing (host 0 appends a line per step, `log_every_steps` at a time): its
  size and generation, and the step of its last line (read from the object's tail, 64 KiB at most,
  however long the log is);
- a newer committed checkpoint (`checkpoints/<step>`; on Cloud Storage only a step with orbax's
  `commit_success.txt` counts: a step folder whose save never committed is not progress).

Each is a *progress signal*. The run is **hung** when no signal came for longer than its budget:

- from the attempt's start to its first signal (restore, data checks, compile):
  `STARTUP_SECONDS` (3600), or `HANG_FACTOR` x the longest start seen before, if longer;
- between signals: `HANG_FACTOR` (5) x the longest gap seen between two signals of this run
  (its log interval, or a save or an evaluation that holds the log up), at least
  `HANG_MIN_SECONDS` (1800); `HANG_SECONDS` > 0 sets it instead.

Time in which the workdir could not be read (a bucket outage) does not count: a run the supervisor
cannot see is never called hung. Each signal is recorded with its time, so the cause of a hang names
the last one it saw. `train_log.jsonl`'s event lines (`{"event": "rollback", ...}`, written when
the run rolls back past a loss spike) are handed to the supervisor, which records them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Callable, Optional

from bert_jax import layout
from bert_jax.pod import calls
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

TAIL_BYTES = 64 * 1024
RESUMED = re.compile(r"resumed from step (\d+)")
LOG_HEAD_BYTES = 1 << 20  # the part of worker 0's log where a resume says its step


@dataclasses.dataclass
class Signals:
    """One reading of the workdir."""

    log_identity: Optional[tuple]  # train_log.jsonl's (size, generation); None when absent
    log_step: Optional[int]  # the step of its last line
    saved_step: Optional[int]  # the newest committed checkpoint step
    events: list  # event lines in the log's tail


def newest_committed_step(checkpoints: str) -> Optional[int]:
    """The newest committed step of a checkpoint folder (local: a step folder exists only once
    orbax renamed it into place; Cloud Storage: its `commit_success.txt` marks it committed)."""
    try:
        steps = sorted((int(n) for n in storage.listdir(checkpoints) if n.isdigit()), reverse=True)
    except FileNotFoundError:
        return None
    for step in steps:
        if not storage_paths.is_remote(checkpoints) or storage.exists(
                storage_paths.join(checkpoints, str(step), "commit_success.txt")):
            return step
    return None


def resumed_step(attempt_logs: str) -> int:
    """The step worker 0's run resumed from (0: it started fresh), from the head of its log in an
    attempt's collected logs (`logs/attempt-<n>/`)."""
    text = storage.read_range(storage_paths.join(attempt_logs, layout.worker_log(0)), 0, LOG_HEAD_BYTES)
    found = RESUMED.search(text.decode("utf-8", errors="replace"))
    return int(found.group(1)) if found else 0


def read_signals(workdir: str, last_identity: Optional[tuple] = None, last_step: Optional[int] = None) -> Signals:
    """The workdir's progress signals (the log's tail only when it changed since `last_identity`)."""
    log = storage_paths.join(workdir, layout.TRAIN_LOG)
    try:
        identity = storage.identity(log)
    except FileNotFoundError:
        identity = None
    step, events = last_step, []
    if identity is not None and identity != last_identity:
        size = identity[0]
        tail = storage.read_range(log, max(0, size - TAIL_BYTES), size).decode("utf-8", errors="replace")
        for line in tail.splitlines()[1 if size > TAIL_BYTES else 0:]:  # the first may be cut
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "event" in row:
                events.append(row)
            elif isinstance(row.get("step"), int):
                step = row["step"]
    return Signals(identity, step, newest_committed_step(storage_paths.join(workdir, layout.CHECKPOINTS)), events)


class Progress:
    """The hang clock of the run the supervisor watches (one `start` per attempt, `observe` per poll)."""

    def __init__(self, workdir: str, io: calls.Storage, *, hang_seconds: float = 0, hang_min: float = 1800,
                 factor: float = 5, startup: float = 3600, clock: Callable[[], float] = time.monotonic):
        self.workdir, self._io, self._clock = workdir, io, clock
        self.fixed, self.hang_min, self.factor, self.startup = hang_seconds, hang_min, factor, startup
        self.longest_gap = 0.0  # between two signals, over every attempt watched
        self.longest_start = 0.0  # from an attempt's start to its first signal
        self.signals: Optional[Signals] = None
        self._seen_events: set = set()
        self.start()

    def start(self) -> None:
        """A new attempt starts now: its signals count from what the workdir holds now."""
        self.started = self.last = self.last_read = self._clock()
        self.blind = 0.0  # seconds since `last` in which the workdir could not be read
        self.any_signal = False
        self.last_what = "the attempt's start"
        self.signals = None  # the first reading is the baseline: its later changes are signals

    def observe(self) -> list:
        """Reads the workdir once; returns the event lines not seen before. A failed read (raises
        `calls.Unavailable`) makes the time since the last read, its own included, blind time."""
        try:
            old = self.signals
            new = self._io.call("reading the run's progress", read_signals, self.workdir,
                                old.log_identity if old else None, old.log_step if old else None)
        except calls.Unavailable:
            now = self._clock()
            self.blind += now - max(self.last_read, self.last)
            self.last_read = now
            raise
        now = self.last_read = self._clock()
        what = []
        if old is not None and new.log_identity != old.log_identity and new.log_identity is not None:
            what.append(f"train_log.jsonl at step {new.log_step}")
        if old is not None and new.saved_step is not None and new.saved_step != old.saved_step:
            what.append(f"checkpoint step {new.saved_step} committed")
        if old is None:
            what = []  # the first reading is the baseline
        if what:
            gap = now - self.last - self.blind
            if self.any_signal:
                self.longest_gap = max(self.longest_gap, gap)
            else:
                self.longest_start = max(self.longest_start, gap)
            self.any_signal, self.last, self.blind = True, now, 0.0
            self.last_what = " and ".join(what)
        self.signals = new
        fresh = []
        for event in new.events:
            key = json.dumps(event, sort_keys=True)
            if key not in self._seen_events:
                self._seen_events.add(key)
                fresh.append(event)
        return fresh

    def budget(self) -> float:
        """Seconds without a signal after which the run is hung (see the module's docstring)."""
        if not self.any_signal:
            return max(self.startup, self.factor * self.longest_start)
        if self.fixed > 0:
            return self.fixed
        return max(self.hang_min, self.factor * self.longest_gap)

    def hung(self) -> Optional[str]:
        """The cause, when the run is hung; None while it is not (or cannot be seen)."""
        quiet = self._clock() - self.last - self.blind
        budget = self.budget()
        if quiet <= budget:
            return None
        return (f"hung: no progress for {quiet:.0f} s (budget {budget:.0f} s"
                f"{'' if self.any_signal else ' from the start to the first signal'}); the last signal: "
                f"{self.last_what}, {self._clock() - self.last:.0f} s ago")
