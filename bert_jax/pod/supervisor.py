"""The pod run's supervisor: starts a run on a Cloud TPU slice, watches it, brings it back.

    TPU_NAME=my-v4-32 ZONE=us-central2-b PROJECT=my-project CONFIG=configs/large.py \\
    WORKDIR=gs://my-bucket/bert-large launch/tpu_pod.sh --watch --config.train_data=...

(`launch/tpu_pod.sh --watch ARGS` runs `python -m bert_jax.pod.supervisor ARGS`.) It runs on a
machine that outlives the slice: a small VM, under systemd (`launch/bert_jax-supervisor.service`:
restarted if it ever exits abnormally, which is safe, since it adopts the run it finds). Stopping
it leaves the run going. One supervisor per workdir (the lease, `attempts.py`); `--takeover` takes
over from one whose heartbeat went stale; `--update_code` ships the checkout's code from now on.

Once a poll (`POLL_SECONDS`, 60): one `describe` (and the queued resource's, when the slice came
from one), one status call over SSH, and a look at the workdir; each poll runs in a guard that
logs an error and goes on (`MAX_INTERNAL_ERRORS` in a row end it). What it does, in words of
docs/pretraining.md's table:

- every worker running and progress in the workdir: nothing. No progress past the budget
  (progress.py): the run is **hung**, stopped and relaunched.
- a worker failed or vanished: the others are stopped (SIGTERM, SIGKILL after STOP_TIMEOUT), the
  logs collected, the attempt ended with its cause. An exit code that running again cannot get
  past (bert_jax/exit_codes.py: a refused config, a data error, refused versions, a non-finite
  loss, a divergence) ends supervision at once, with its cause; any other is a **failure**:
  relaunched after a backoff (`BACKOFF_SECONDS` doubling to `MAX_BACKOFF_SECONDS`), and more than
  `MAX_RESTARTS` failures in a row without a new checkpoint end supervision.
- a worker unanswered over SSH for `UNREACHABLE_POLLS` polls: lost; the attempt is ended (what
  answers is stopped) and relaunched, or the slice recreated when describe reports it unhealthy.
- every worker stopped after saving on SIGTERM (maintenance): relaunched at once. Stopped by
  `tpu_pod.sh --stop` (a person): supervision ends, the run stays stopped.
- the slice PREEMPTED, TERMINATED, or NOT_FOUND (gcloud's structured error), `LOST_READINGS`
  readings in a row: "needs install" is written to the workdir first, then the slice is deleted and
  created again from `slice.json` (a failed create is recorded and retried with backoff, up to
  `MAX_CREATE_FAILURES`), and the run relaunched on it with a pinned install. STOPPED: started
  again, not deleted. A queued resource still waiting for capacity keeps its place
  (`QUEUE_TIMEOUT`); a FAILED or SUSPENDED one is queued again. Any other state past
  `READY_TIMEOUT`: recreated.
- every worker finished: recorded, exit 0.

Every launch ships the project snapshot of the first start (pins.py) and installs, when it must,
pinned to the recorded versions. Everything it does is a line of `WORKDIR/attempts.jsonl`.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from typing import Optional

from bert_jax import exit_codes, layout
from bert_jax.pod import calls, pins
from bert_jax.pod.attempts import Attempts, Lease, LeaseHeld, local_state_dir
from bert_jax.pod.progress import Progress, newest_committed_step, resumed_step
from bert_jax.pod.settings import Settings
from bert_jax.pod.slice import NOT_FOUND, Slice
from bert_jax.pod.slice_recovery import SliceRecovery
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

# A worker's status line (launch/tpu_worker.sh), wherever on its line it starts (a log's last line
# without a newline before it).
WORKER_LINE = re.compile(r"bert_jax-worker (\S+) (running|finished|stopped|halted|failed|gone|none) ?(-?\d+)?\s*$")
SUPERVISOR_FLAGS = ("--takeover", "--update_code")
# The supervisor's own exit codes (launch/bert_jax-supervisor.service does not restart after them):
# 0 the run finished or a person stopped it; EXIT_HELD another supervisor holds the workdir;
# EXIT_GAVE_UP supervision gave up (the cause: attempts.jsonl's last line); 130 interrupted.
EXIT_HELD = 2
EXIT_GAVE_UP = 3


def log(message: str) -> None:
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')} supervisor: {message}", flush=True)


class Stop(Exception):
    """Supervision ends: `code` is the supervisor's exit code, `cause` why."""

    def __init__(self, code: int, cause: str):
        super().__init__(cause)
        self.code, self.cause = code, cause


class Supervisor(SliceRecovery):
    """Starts the run, polls it, relaunches it; one `run()` call lasts until supervision ends."""

    log = staticmethod(log)  # the console log, for the methods of its base (the slice: slice_recovery.py)

    def __init__(self, args: list[str], env: Optional[dict] = None):
        self.env = dict(os.environ if env is None else env)
        missing = [v for v in ("TPU_NAME", "ZONE", "PROJECT", "CONFIG", "WORKDIR") if not self.env.get(v)]
        if missing:
            raise SystemExit(f"supervisor: environment variable {missing[0]} is required (see launch/tpu_pod.sh)")
        self.takeover, self.update_code = "--takeover" in args, "--update_code" in args
        self.args = [a for a in args if a not in SUPERVISOR_FLAGS]
        self.s = Settings.from_env(self.env)
        self.workdir = storage_paths.check(self.env["WORKDIR"], "WORKDIR")
        self.slice = Slice(self.env["TPU_NAME"], self.env["ZONE"], self.env["PROJECT"], self.env.get("GCLOUD", "gcloud"))
        self.io = calls.Storage(timeout=self.s.storage_timeout)
        path = lambda name: storage_paths.join(self.workdir, name)  # noqa: E731
        self.attempts = Attempts(path(layout.ATTEMPTS), self.io, log)
        self.lease = Lease(path(layout.LEASE), interval=max(self.s.poll_seconds, 1), stale_after=self.s.lease_stale_seconds,
                           log=log)
        self.code = pins.Code(self.workdir, self.io, local_state_dir())
        self.progress = Progress(self.workdir, self.io, hang_seconds=self.s.hang_seconds,
                                 hang_min=self.s.hang_min_seconds, factor=self.s.hang_factor,
                                 startup=self.s.startup_seconds)
        self.versions = pins.Versions(self.workdir, self.io, log)
        self.spec_file = path(layout.SLICE_SPEC)
        self.needs_install_file = path(layout.NEEDS_INSTALL)
        # The loop's state.
        self.attempt, self.open, self.pending = 0, False, None  # pending: why the next launch is due
        self.not_before = 0.0  # no launch before (a failure's backoff)
        self.failures, self.in_a_row, self.progress_mark = 0, 0, None
        self.needs_install, self.versions_due, self.first_install, self.adopting = False, False, False, False
        self.code_sha, self.code_dir, self.spec = "", "", {}
        self.slice_state, self.state_since, self.readings = None, time.monotonic(), 0
        self.create_failures, self.create_not_before = 0, 0.0
        self.known_workers: set = set()
        self.unanswered: dict = {}
        self.stop_grace_until: Optional[float] = None
        self.maintenance: Optional[dict] = None

    # --- small helpers ------------------------------------------------------------------------

    def record(self, **row) -> None:
        """One line of attempts.jsonl (the current attempt's number unless `row` gives one)."""
        self.attempts.record(**{"attempt": self.attempt, **row})

    def quietly(self, default, what: str, fn, *args):
        """`fn(*args)` through the bounded storage thread; `default` (logged) when storage cannot answer."""
        try:
            return self.io.call(what, fn, *args)
        except FileNotFoundError:
            return default
        except calls.Unavailable as e:
            log(f"{e}")
            return default

    def saved_step(self, default=None) -> Optional[int]:
        return self.quietly(default, "listing committed checkpoints", newest_committed_step,
                            storage_paths.join(self.workdir, layout.CHECKPOINTS))

    def log_dest(self, attempt: int) -> str:
        return storage_paths.join(self.workdir, layout.LOGS, layout.attempt_logs(attempt))

    def pod(self, *flags: str, timeout: float, **env) -> "calls.subprocess.CompletedProcess":
        """The snapshot's `launch/tpu_pod.sh FLAGS`, bounded (its process group killed past `timeout`)."""
        return calls.run(["bash", os.path.join(self.code_dir, "launch", "tpu_pod.sh"), *flags], timeout,
                         env={**self.env, **env}, cwd=self.code_dir)

    # --- start --------------------------------------------------------------------------------

    def until_available(self, what: str, fn, *args):
        """`fn(*args)`, tried again every poll while storage or gcloud cannot answer."""
        while True:
            try:
                return fn(*args)
            except (Stop, LeaseHeld):
                raise
            except Exception as e:  # pylint: disable=broad-except  # an outage looks like anything
                log(f"{what}: {type(e).__name__}: {str(e)[:300]}; trying again in {self.s.poll_seconds:.0f} s")
                time.sleep(self.s.poll_seconds)

    def start(self) -> None:
        rows = self.until_available("reading the attempts", self.attempts.load)
        try:
            self.until_available("taking the lease", self.lease.acquire, self.takeover)
        except LeaseHeld as e:
            raise Stop(EXIT_HELD, str(e)) from None
        sha, self.code_dir, taken = self.until_available("the project snapshot", self.code.pinned, self.update_code)
        self.code_sha = sha[:16]
        log(f"{'took a snapshot of the project' if taken else 'ships the project snapshot'} {self.code_sha} "
            f"({self.code_dir})")
        self.spec = self.until_available("the slice's spec", self.slice_spec)
        ends = [i for i, r in enumerate(rows) if r.get("event") in ("start", "done", "gave_up", "halted")]
        if ends and rows[ends[-1]]["event"] == "done":
            raise Stop(0, f"{self.attempts.path} says the run finished: nothing to do")
        # A restart after supervision gave up or was stopped starts a new count of failures.
        since = next((i + 1 for i in reversed(ends) if rows[i]["event"] != "start"), 0)
        self.attempt = max((r.get("attempt") or 0 for r in rows), default=0)
        starts = [r for r in rows if r.get("event") == "start"]
        ended = {r.get("attempt") for r in rows if r.get("event") == "end"}
        self.open = bool(starts) and starts[-1].get("attempt") not in ended
        failures = [r for r in rows[since:] if r.get("event") == "failure"]
        self.failures = len([r for r in rows if r.get("event") == "failure"])
        self.progress_mark = self.saved_step()
        if failures and failures[-1].get("saved_step") == self.progress_mark:
            self.in_a_row = int(failures[-1].get("in_a_row") or 0)
        self.needs_install = bool(self.quietly(False, "reading needs_install.json", storage.exists,
                                               self.needs_install_file))
        self.versions_due = not self.quietly(True, "looking for constraints.txt", storage.exists,
                                             self.versions.constraints_file)
        for row in rows:
            if row.get("event") == "rollback" and isinstance(row.get("line"), dict):
                self.progress._seen_events.add(json.dumps(row["line"], sort_keys=True))  # pylint: disable=protected-access
        if self.open:
            log(f"attempt {self.attempt} is open: watching it (adopted when every worker answers running)")
            self.adopting = True
        else:
            self.pending = "supervisor restarted" if rows else "first start"
            self.adopting = False
        if not rows and self.env.get("SKIP_INSTALL") != "1":
            self.needs_install = True  # the first start installs (it is not a reinstall: unpinned is fine)
            self.first_install = True
        else:
            self.first_install = False

    def slice_spec(self) -> dict:
        """The recorded spec; recorded from the live slice on the first start."""
        try:
            return json.loads(self.io.call("reading slice.json", storage.read_text, self.spec_file))
        except FileNotFoundError:
            pass
        reading = self.slice.describe()
        if reading.state == NOT_FOUND:
            raise Stop(EXIT_GAVE_UP, f"the slice {self.slice.name} does not exist and {self.spec_file} has no spec to create it "
                          "from: create it (gcloud compute tpus tpu-vm create) and start again")
        if reading.node is None:
            raise RuntimeError(reading.error)
        spec = Slice.spec_of(reading.node)
        self.io.call("writing slice.json", storage.write_text, self.spec_file,
                     json.dumps(spec, indent=1, sort_keys=True) + "\n")
        log(f"recorded the slice's spec in {self.spec_file}: {spec['accelerator_type']}, {spec['runtime_version']}"
            f"{', spot' if spec['spot'] else ', preemptible' if spec['preemptible'] else ''}")
        return spec

    # --- the slice ----------------------------------------------------------------------------

    def poll(self) -> None:
        self.attempts.flush()
        if self.lease.lost:
            raise Stop(EXIT_HELD, self.lease.lost)
        reading = self.describe()
        state = reading.state
        if state is None:
            log(f"describe failed: {reading.error}")
            if self.open:
                self.watch_run()  # the workers may still answer: never blind to them
            return
        now = time.monotonic()
        if state != self.slice_state:
            self.slice_state, self.state_since, self.readings = state, now, 0
        self.readings += 1
        self.note_maintenance(reading)
        if state == "READY":
            self.create_failures = 0
            if self.versions_due and not self.needs_install and self.attempt > 0:
                self.record_versions()  # what an install of ours put there (never a bare VM's image)
            if self.pending is not None:
                if now >= self.not_before:
                    self.launch(self.pending)
            elif self.open:
                self.watch_run()
            return
        self.slice_not_ready(state, now)

    # --- the run ------------------------------------------------------------------------------

    def launch(self, why: str) -> None:
        """The next attempt (tpu_pod.sh: stop, copy, install when due, start)."""
        install = self.needs_install
        try:
            constraints, pinned = self.versions.for_install(self.first_install) if install else (None, None)
        except pins.Unpinned as e:
            raise self.give_up(str(e)) from None
        resume_from = self.saved_step()
        self.attempt += 1
        self.record(attempt=self.attempt, event="start", why=why, install=install, pinned=pinned,
                    resume_from=resume_from, code=self.code_sha)
        log(f"attempt {self.attempt} ({why}): launching{' with a fresh install' if install else ''}"
            f"{' pinned to ' + pinned if pinned else ''}; newest saved step {resume_from}")
        env = {"LOG_DEST": self.log_dest(self.attempt), "SKIP_INSTALL": "0" if install else "1"}
        with tempfile.TemporaryDirectory() as tmp:
            if constraints:
                env["CONSTRAINTS"] = os.path.join(tmp, layout.CONSTRAINTS)
                storage.write_text(env["CONSTRAINTS"], constraints)
            r = self.pod(*self.args, timeout=self.s.launch_timeout, **env)
        if r.returncode == 0:
            self.open, self.pending, self.adopting = True, None, False
            self.unanswered, self.stop_grace_until = {}, None
            self.progress.start()
            if install:
                self.first_install = False
                self.needs_install = not self.quietly(False, "clearing needs_install.json", self._clear_needs_install)
            self.versions_due = self.versions_due or install
            return
        cause = f"launch failed: {(r.stderr or r.stdout).strip()[-1500:]}"
        log(f"attempt {self.attempt}: {cause}")
        self.record(attempt=self.attempt, event="end", cause=cause[:2000], saved_step=self.saved_step())
        self.open = False
        if self.describe().state != "READY":  # the slice went away under the launch: not the run's failure
            log("the slice is no longer READY: the launch's failure is not counted")
            return
        self.failure("launch failed")

    def _clear_needs_install(self) -> bool:
        storage.remove(self.needs_install_file, missing_ok=True)
        return True

    def record_versions(self) -> None:
        """Worker 0's installed packages into constraints.txt (tried each poll until recorded)."""
        try:
            r = None if self.versions.recorded() else self.pod("--freeze", timeout=300)
            self.versions_due = not self.versions.record(r)
        except calls.Unavailable as e:
            log(f"could not record the installed versions yet: {e}")

    def worker_states(self) -> tuple[dict, bool]:
        """({worker: (state, exit code)} of the workers that answered, whether every one did)."""
        r = self.pod("--status", timeout=300)
        states = {}
        for line in r.stdout.splitlines():
            m = WORKER_LINE.search(line.strip())
            if m:
                states[m.group(1)] = (m.group(2), int(m.group(3)) if m.group(3) else None)
        complete = r.returncode == 0 and bool(states) and set(states) >= self.known_workers
        if complete:
            self.known_workers |= set(states)
        missing = (self.known_workers - set(states)) or ({"?"} if not complete else set())
        self.unanswered = {w: self.unanswered.get(w, 0) + 1 for w in missing}
        if missing:
            log(f"no status from worker(s) {', '.join(sorted(missing))} "
                f"({max(self.unanswered.values())} poll(s) in a row): "
                f"{(r.stderr or '').strip()[-200:] or f'the status call exited {r.returncode}'}")
        return states, complete

    def watch_run(self) -> None:
        workers, complete = self.worker_states()
        states = {s for s, _ in workers.values()}
        if self.adopting and complete and states == {"running"}:
            log(f"adopting attempt {self.attempt}: every worker's run is going")
            self.adopting = False
        failed = {k: v for k, v in workers.items() if v[0] in ("failed", "gone", "none")}
        if "halted" in states and "running" not in states:
            self.end("stopped by tpu_pod.sh --stop", workers)
            self.record(attempt=self.attempt, event="halted", cause="stopped by tpu_pod.sh --stop")
            raise Stop(0, "the run was stopped by tpu_pod.sh --stop: supervision ends (start it again to go on)")
        if failed:
            if "failed" not in {s for s, _ in failed.values()} and self.describe().state != "READY":
                return  # vanished without an exit code: a preemption describe did not show yet
            cause = "; ".join(f"worker {k} {s}{'' if rc is None else f' (exit {rc})'}"
                              for k, (s, rc) in sorted(failed.items()))
            refused = {k: rc for k, (s, rc) in failed.items() if s == "failed" and rc is not None
                       and not exit_codes.retried(rc)}
            self.end(cause, workers)
            if refused:
                rc = next(iter(refused.values()))
                raise self.give_up(f"not retried: {cause}: exit code {rc} is {exit_codes.describe(rc)}, which the "
                                   "same command would meet again (see the collected logs); fix it and start again")
            self.failure(cause)
            return
        if complete and states == {"finished"}:
            self.end("finished", workers)
            self.record(attempt=self.attempt, event="done", saved_step=self.saved_step())
            raise Stop(0, "the run finished")
        if "stopped" in states:
            if complete and states <= {"stopped", "finished"}:
                self.stop_grace_until = None
                self.end("stopped after saving on SIGTERM (a maintenance event or preemption notice)", workers)
                self.pending = "maintenance stop"
                return
            # A SIGTERM'd worker saves at the step every host agrees on, and the others stop
            # there too: STOP_TIMEOUT for them to get there before they are stopped.
            self.stop_grace_until = self.stop_grace_until or time.monotonic() + self.s.stop_timeout
            if time.monotonic() >= self.stop_grace_until:
                self.stop_grace_until = None
                self.end("stopped after saving on SIGTERM (a maintenance event or preemption notice)", workers)
                self.pending = "maintenance stop"
            return
        if self.unanswered and max(self.unanswered.values()) >= self.s.unreachable_polls:
            self.workers_lost(workers)
            return
        self.check_progress(workers)

    def check_progress(self, workers: dict) -> None:
        try:
            events = self.progress.observe()
        except calls.Unavailable as e:
            log(f"cannot see the run's progress: {e}")
            return
        for event in events:
            log(f"the run recorded: {json.dumps(event)}")
            self.record(attempt=self.attempt, event=event.get("event", "run_event"), line=event)
        cause = self.progress.hung()
        if cause:
            self.end(cause, workers)
            self.failure(cause)

    def workers_lost(self, workers: dict) -> None:
        """Workers unanswered for UNREACHABLE_POLLS polls: restart, or recreate an unhealthy slice."""
        lost = sorted(w for w, n in self.unanswered.items() if n >= self.s.unreachable_polls)
        cause = f"worker(s) {', '.join(lost)} unreachable for {self.s.unreachable_polls} polls"
        reading = self.describe()
        health = (reading.node or {}).get("health")
        self.unanswered = {}
        if reading.state == "READY" and health not in (None, "HEALTHY", "HEALTH_UNSPECIFIED"):
            self.lose_attempt(cause)
            self.recreate(f"READY but {health} with {cause}")
            return
        self.end(cause, workers)
        self.failure(cause)

    def end(self, cause: str, workers: Optional[dict], *, collect: bool = True) -> None:
        """Stops what is left of the attempt, collects the logs, records its end."""
        if collect:  # SIGTERM first: a run that still can saves a checkpoint
            self.pod("--stop", timeout=self.s.stop_timeout + 300, STOP_BY="supervisor")
            # Each run's shell uploads its log when the run ends; this covers a shell killed with it.
            self.pod(f"--collect={self.log_dest(self.attempt)}", timeout=600)
        self.record(attempt=self.attempt, event="end", cause=cause,
                    workers={k: f"{s}{'' if rc is None else f' {rc}'}" for k, (s, rc) in (workers or {}).items()},
                    resumed_step=self.quietly(None, "reading worker 0's log", resumed_step, self.log_dest(self.attempt)),
                    saved_step=self.saved_step(), logs=self.log_dest(self.attempt))
        self.open, self.adopting, self.stop_grace_until = False, False, None
        log(f"attempt {self.attempt} ended: {cause}; logs in {self.log_dest(self.attempt)}")

    def failure(self, cause: str) -> None:
        """A failure: counted only without a new checkpoint since the last one; backed off."""
        saved = self.saved_step(self.progress_mark)
        self.failures += 1
        self.in_a_row = 1 if saved != self.progress_mark else self.in_a_row + 1
        self.progress_mark = saved
        wait = min(self.s.backoff_seconds * 2 ** (self.in_a_row - 1), self.s.max_backoff_seconds)
        self.record(attempt=self.attempt, event="failure", cause=cause, failures=self.failures, in_a_row=self.in_a_row,
                    saved_step=saved, retry_in=wait)
        if self.in_a_row > self.s.max_restarts:
            raise self.give_up(f"{self.in_a_row} failures in a row without a new checkpoint, more than "
                               f"MAX_RESTARTS={self.s.max_restarts}: giving up; the last: {cause}")
        log(f"failure {self.in_a_row} in a row since the last new checkpoint (at most {self.s.max_restarts}): "
            f"relaunching in {wait:g} s")
        self.pending, self.not_before = cause, time.monotonic() + wait

    def give_up(self, cause: str) -> Stop:
        self.record(attempt=self.attempt, event="gave_up", cause=cause)
        return Stop(EXIT_GAVE_UP, cause)

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Supervises until the run finishes (0), or supervision cannot go on (EXIT_HELD, EXIT_GAVE_UP)."""
        try:
            try:
                self.start()
                self.loop()
            except Stop as stop:
                log(stop.cause)
                return stop.code
        finally:
            self.close()

    def loop(self) -> None:
        errors, first = 0, True
        while True:
            if not first:
                time.sleep(self.s.poll_seconds)
            first = False
            try:
                self.poll()
                errors = 0
            except Stop:
                raise
            except calls.Unavailable as e:
                log(f"storage cannot be reached this poll: {e}")
            except Exception as e:  # pylint: disable=broad-except  # the supervisor must not die of one poll
                errors += 1
                log(f"internal error ({errors} in a row, at most {self.s.max_internal_errors}):\n"
                    f"{traceback.format_exc()}")
                self.record(attempt=self.attempt, event="internal_error", error=f"{type(e).__name__}: {e}"[:1000],
                            in_a_row=errors)
                if errors >= self.s.max_internal_errors:
                    raise self.give_up(f"{errors} internal errors in a row; the last: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Sends what is queued (a while, at most), releases the lease, stops the storage thread."""
        deadline = time.monotonic() + min(300, 5 * self.s.storage_timeout)
        while not self.attempts.flush() and time.monotonic() < deadline:
            time.sleep(min(self.s.poll_seconds, 5))
        self.lease.release()
        self.io.close()


def main(argv: list[str]) -> int:
    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # as Ctrl-C: the run goes on
    supervisor = Supervisor(argv)
    try:
        return supervisor.run()
    except KeyboardInterrupt:
        log("interrupted: the run goes on without supervision; the same command adopts it again")
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
