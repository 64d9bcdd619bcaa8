"""The pod run's supervisor: starts a run on a Cloud TPU slice, watches it, and brings it back.

    TPU_NAME=my-v4-32 ZONE=us-central2-b PROJECT=my-project CONFIG=configs/large.py \\
    WORKDIR=gs://my-bucket/bert-large launch/tpu_pod.sh --watch --config.train_data=...

(`launch/tpu_pod.sh --watch ARGS` runs `python -m bert_jax.supervisor ARGS` with the same
environment.) It runs on a machine that outlives the slice (a workstation, a small VM, Cloud
Shell): start it under tmux, screen or `nohup ... &`, since it must outlive its own SSH session.
Stopping it (Ctrl-C, SIGTERM) leaves the run going; started again with the same command it adopts
the run it finds, so it is safe to restart. Run one supervisor per workdir.

What it does, once a poll (`POLL_SECONDS`, default 60: one `describe` and one status over SSH,
nothing on the workers' step path):

- **The slice is READY and every worker's run is going**: nothing.
- **A worker's run failed** (non-zero exit) **or disappeared** (killed with no exit code, a
  rebooted VM): it stops the other workers (SIGTERM: they save a checkpoint where they can, then
  SIGKILL after STOP_TIMEOUT), collects every worker's log into `WORKDIR/logs/attempt-<n>/`, waits
  a backoff (`BACKOFF_SECONDS` doubling per failure in a row without a new checkpoint, at most
  `MAX_BACKOFF_SECONDS`) and relaunches the same command on the same VMs (no reinstall). After
  `MAX_RESTARTS` failures (default 10) it stops and exits 1.
- **Every worker stopped after saving on SIGTERM** (a maintenance event): relaunched at once; not
  counted as a failure.
- **The slice is PREEMPTED, TERMINATED or gone**: it deletes what is left and recreates it from
  the spec recorded at the first start (`WORKDIR/slice.json`: accelerator type, runtime version,
  spot/preemptible, network, subnetwork, internal IPs, service account and scopes, labels, tags;
  through the queued resource when the slice was created as one), waits for READY
  (`READY_TIMEOUT`, default 3600 s), then relaunches with a fresh install pinned to the versions
  the run started with. Not counted as a failure.
- **Every worker finished** (exit 0 after the last step): it records it and exits 0.

Every worker's run uploads its log to `WORKDIR/logs/attempt-<n>/worker-<N>.log` every minute and
when it ends (`launch/tpu_worker.sh`), so a preempted slice's logs survive up to the last minute.

Versions: after the first install it records worker 0's installed packages (`pip freeze`) in
`WORKDIR/constraints.txt`; every later install uses it as pip's constraints file, so a recreated
VM gets the jax, libtpu and orbax that wrote the checkpoints (bert_jax also refuses a resume with
other versions unless `--config.allow_version_change=true`).

`WORKDIR/attempts.jsonl` gets one line when an attempt starts and one when it ends: the attempt's
number, the time, its cause of ending, each worker's state and the step it resumed from.

This module imports neither jax nor TensorFlow: it needs Python, gcloud, and `data_pipeline.storage`
(gcsfs for a gs:// workdir: `pip install -e '.[gcs]'`).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Optional

from bert_jax import layout
from data_pipeline import storage, storage_atomic, storage_paths

POD_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "tpu_pod.sh")

# Slice states (Cloud TPU API v2 `Node.state`) after which the VMs are gone or will not come back
# by themselves; NOT_FOUND is a deleted slice.
LOST = ("PREEMPTED", "TERMINATED", "STOPPED", "NOT_FOUND")
WORKER_LINE = re.compile(r"^bert_jax-worker (\S+) (running|finished|stopped|failed|gone|none) ?(-?\d+)?\s*$")
RESUMED = re.compile(r"resumed from step (\d+)")


def log(message: str) -> None:
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')} supervisor: {message}", flush=True)


def setting(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        return float(value) if value else default
    except ValueError:
        raise SystemExit(f"supervisor: {name}={value!r} is not a number") from None


# ---------------------------------------------------------------------------------------------
# The slice: gcloud describe / delete / create
# ---------------------------------------------------------------------------------------------


class Slice:
    """One Cloud TPU VM slice, reached through gcloud."""

    def __init__(self, name: str, zone: str, project: str, gcloud: str = "gcloud"):
        self.name, self.zone, self.project, self.gcloud = name, zone, project, gcloud

    def _gcloud(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([self.gcloud, *args, f"--zone={self.zone}", f"--project={self.project}"],
                              capture_output=True, text=True, timeout=timeout, check=False)

    def describe(self) -> Optional[dict]:
        """The node's description; None when the slice does not exist. Raises RuntimeError when
        gcloud fails otherwise (no network, no credentials: the caller retries next poll)."""
        r = self._gcloud("compute", "tpus", "tpu-vm", "describe", self.name, "--format=json", timeout=120)
        if r.returncode != 0:
            if "NOT_FOUND" in r.stderr or "not found" in r.stderr.lower():
                return None
            raise RuntimeError(f"gcloud describe {self.name} failed: {r.stderr.strip()[-500:]}")
        return json.loads(r.stdout)

    @staticmethod
    def spec_of(node: dict) -> dict:
        """What recreating the slice needs, from its description."""
        scheduling = node.get("schedulingConfig") or {}
        network = node.get("networkConfig") or {}
        account = node.get("serviceAccount") or {}
        return {
            "accelerator_type": node.get("acceleratorType") or (node.get("acceleratorConfig") or {}).get("type"),
            "runtime_version": node.get("runtimeVersion"),
            "spot": bool(scheduling.get("spot")),
            "preemptible": bool(scheduling.get("preemptible")),
            "network": network.get("network"),
            "subnetwork": network.get("subnetwork"),
            "internal_ips": network.get("enableExternalIps") is False,
            "service_account": account.get("email"),
            "scopes": account.get("scope") or [],
            "labels": node.get("labels") or {},
            "tags": node.get("tags") or [],
            # projects/P/locations/Z/queuedResources/NAME when created through a queued resource.
            "queued_resource": (node.get("queuedResource") or "").rsplit("/", 1)[-1] or None,
        }

    def create_args(self, spec: dict) -> list[list[str]]:
        """The gcloud commands that delete what is left of the slice and create it again."""
        flags = [f"--accelerator-type={spec['accelerator_type']}"]
        if spec.get("spot"):
            flags.append("--spot")
        elif spec.get("preemptible"):
            flags.append("--preemptible" if not spec.get("queued_resource") else "--spot")
        for key, flag in (("network", "--network"), ("subnetwork", "--subnetwork"),
                          ("service_account", "--service-account")):
            if spec.get(key):
                flags.append(f"{flag}={spec[key]}")
        if spec.get("internal_ips"):
            flags.append("--internal-ips")
        if spec.get("scopes"):
            flags.append("--scopes=" + ",".join(spec["scopes"]))
        if spec.get("labels"):
            flags.append("--labels=" + ",".join(f"{k}={v}" for k, v in sorted(spec["labels"].items())))
        if spec.get("tags"):
            flags.append("--tags=" + ",".join(spec["tags"]))
        if spec.get("queued_resource"):
            qr = spec["queued_resource"]
            return [["compute", "tpus", "queued-resources", "delete", qr, "--quiet", "--force"],
                    ["compute", "tpus", "queued-resources", "create", qr, f"--node-id={self.name}",
                     f"--runtime-version={spec['runtime_version']}", *flags]]
        return [["compute", "tpus", "tpu-vm", "delete", self.name, "--quiet"],
                ["compute", "tpus", "tpu-vm", "create", self.name, f"--version={spec['runtime_version']}", *flags]]

    def recreate(self, spec: dict, ready_timeout: float, poll: float) -> None:
        """Deletes what is left, creates the slice again from `spec`, waits until it is READY."""
        delete, create = self.create_args(spec)
        r = self._gcloud(*delete, timeout=1800)
        if r.returncode != 0 and "NOT_FOUND" not in r.stderr and "not found" not in r.stderr.lower():
            raise RuntimeError(f"gcloud {' '.join(delete[:4])} failed: {r.stderr.strip()[-500:]}")
        r = self._gcloud(*create, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"gcloud {' '.join(create[:4])} failed: {r.stderr.strip()[-500:]}")
        deadline = time.time() + ready_timeout
        while True:
            node = self.describe()
            state = node.get("state") if node else "NOT_FOUND"
            if state == "READY":
                return
            if time.time() > deadline:
                raise RuntimeError(f"{self.name} is {state}, not READY, {ready_timeout:.0f} s after its creation")
            time.sleep(poll)


# ---------------------------------------------------------------------------------------------
# The run: launch/tpu_pod.sh
# ---------------------------------------------------------------------------------------------


class Supervisor:
    """Starts the run, polls it, relaunches it; one `run()` call lasts until the run finishes."""

    def __init__(self, args: list[str], env: Optional[dict] = None):
        self.env = dict(os.environ if env is None else env)
        missing = [v for v in ("TPU_NAME", "ZONE", "PROJECT", "CONFIG", "WORKDIR") if not self.env.get(v)]
        if missing:
            raise SystemExit(f"supervisor: environment variable {missing[0]} is required (see launch/tpu_pod.sh)")
        self.args = list(args)
        self.workdir = storage_paths.check(self.env["WORKDIR"], "WORKDIR")
        self.slice = Slice(self.env["TPU_NAME"], self.env["ZONE"], self.env["PROJECT"],
                           self.env.get("GCLOUD", "gcloud"))
        self.poll = setting("POLL_SECONDS", 60)
        self.max_restarts = int(setting("MAX_RESTARTS", 10))
        self.backoff = setting("BACKOFF_SECONDS", 60)
        self.max_backoff = setting("MAX_BACKOFF_SECONDS", 1800)
        self.ready_timeout = setting("READY_TIMEOUT", 3600)
        self.attempts_file = storage_paths.join(self.workdir, "attempts.jsonl")
        self.constraints_file = storage_paths.join(self.workdir, "constraints.txt")
        self.spec_file = storage_paths.join(self.workdir, "slice.json")

    # --- the workdir's records ----------------------------------------------------------------

    def _record(self, **row) -> None:
        row = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **row}
        storage_atomic.append_text(self.attempts_file, json.dumps(row) + "\n")

    def _attempts(self) -> list[dict]:
        try:
            return [json.loads(line) for line in storage.read_text(self.attempts_file).splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def _saved_step(self) -> Optional[int]:
        """The newest step folder in WORKDIR/checkpoints (the run checks its integrity on resume)."""
        steps = [int(n) for n in storage.listdir(storage_paths.join(self.workdir, layout.CHECKPOINTS)) if n.isdigit()]
        return max(steps) if steps else None

    def log_dest(self, attempt: int) -> str:
        return storage_paths.join(self.workdir, "logs", f"attempt-{attempt}")

    def _resumed_step(self, attempt: int) -> Optional[int]:
        """The step worker 0's run resumed from (0: it started fresh), from its collected log."""
        try:
            text = storage.read_text(storage_paths.join(self.log_dest(attempt), "worker-0.log"))
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        found = RESUMED.search(text)
        return int(found.group(1)) if found else 0

    def slice_spec(self) -> dict:
        """The recorded spec; recorded from the live slice on the first start."""
        try:
            return json.loads(storage.read_text(self.spec_file))
        except FileNotFoundError:
            pass
        node = self.slice.describe()
        if node is None:
            raise SystemExit(f"supervisor: the slice {self.slice.name} does not exist and {self.spec_file} has no "
                             "spec to create it from: create it (gcloud compute tpus tpu-vm create) and start again")
        spec = Slice.spec_of(node)
        storage.write_text(self.spec_file, json.dumps(spec, indent=1, sort_keys=True) + "\n")
        log(f"recorded the slice's spec in {self.spec_file}: {spec['accelerator_type']}, {spec['runtime_version']}"
            f"{', spot' if spec['spot'] else ', preemptible' if spec['preemptible'] else ''}")
        return spec

    # --- launch/tpu_pod.sh ----------------------------------------------------------------------

    def _pod(self, *flags: str, timeout: float = 3600, **env) -> subprocess.CompletedProcess:
        """`launch/tpu_pod.sh FLAGS`; one that takes longer than `timeout` (a hung SSH session) is
        killed and answers exit code 124, as a failed call."""
        try:
            return subprocess.run(["bash", POD_SCRIPT, *flags], env={**self.env, **env}, capture_output=True,
                                  text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, 124, stdout=str(e.stdout or ""),
                                               stderr=f"tpu_pod.sh {' '.join(flags[:1])} took over {timeout:.0f} s")

    def worker_states(self) -> Optional[dict[str, tuple[str, Optional[int]]]]:
        """{worker: (state, exit code)} from `tpu_pod.sh --status`; None when a worker did not answer."""
        r = self._pod("--status", timeout=300)
        states = {}
        for line in r.stdout.splitlines():
            m = WORKER_LINE.match(line.strip())
            if m:
                states[m.group(1)] = (m.group(2), int(m.group(3)) if m.group(3) else None)
        return states if r.returncode == 0 and states else None

    def launch(self, attempt: int, *, install: bool, why: str) -> bool:
        """Starts attempt `attempt` (tpu_pod.sh: stop, copy, install, start); False when it failed."""
        env = {"LOG_DEST": self.log_dest(attempt), "SKIP_INSTALL": "0" if install else "1"}
        with tempfile.TemporaryDirectory() as tmp:
            pinned = install and storage.exists(self.constraints_file)
            if pinned:
                env["CONSTRAINTS"] = os.path.join(tmp, "constraints.txt")
                storage.copy(self.constraints_file, env["CONSTRAINTS"])
            resume_from = self._saved_step()
            self._record(attempt=attempt, event="start", why=why, install=install, pinned=pinned,
                         resume_from=resume_from)
            log(f"attempt {attempt} ({why}): launching{' with a fresh install' if install else ''}"
                f"{' pinned to ' + self.constraints_file if pinned else ''}; newest saved step {resume_from}")
            r = self._pod(*self.args, **env)
        if r.returncode != 0:
            log(f"attempt {attempt}: launch failed: {(r.stderr or r.stdout).strip()[-2000:]}")
            return False
        if install and not storage.exists(self.constraints_file):
            self.record_versions()
        return True

    def record_versions(self) -> None:
        """Worker 0's installed packages into WORKDIR/constraints.txt (every later install uses them)."""
        r = self._pod("--freeze", timeout=300)
        pins = [line for line in r.stdout.splitlines() if re.match(r"^[A-Za-z0-9_.\-\[\]]+==\S+$", line.strip())]
        if r.returncode != 0 or not pins:
            log(f"could not record the installed versions: {(r.stderr or r.stdout).strip()[-500:]}")
            return
        storage.write_text(self.constraints_file, "\n".join(pins) + "\n")
        versions = {p.split("==")[0].lower(): p.split("==")[1] for p in pins}
        log(f"recorded {len(pins)} installed versions in {self.constraints_file} "
            f"(jax {versions.get('jax')}, libtpu {versions.get('libtpu')}, orbax {versions.get('orbax-checkpoint')})")

    def end(self, attempt: int, cause: str, workers: Optional[dict], *, collect: bool) -> None:
        """Stops what is left of the attempt, collects the logs, records the end."""
        if collect:
            self._pod("--stop", timeout=3600)  # SIGTERM first: a run that still can saves a checkpoint
            # Each run's shell uploads its log when the run ends; this covers a shell killed with it.
            self._pod(f"--collect={self.log_dest(attempt)}", timeout=600)
        self._record(attempt=attempt, event="end", cause=cause,
                     workers={k: f"{s}{'' if rc is None else f' {rc}'}" for k, (s, rc) in (workers or {}).items()},
                     resumed_step=self._resumed_step(attempt), saved_step=self._saved_step(),
                     logs=self.log_dest(attempt))
        log(f"attempt {attempt} ended: {cause}; logs in {self.log_dest(attempt)}")

    # --- the loop ---------------------------------------------------------------------------------

    def _failure(self, cause: str) -> bool:
        """Counts a failure, waits the backoff; False once there were more than MAX_RESTARTS."""
        self.failures += 1
        saved = self._saved_step()
        self.in_a_row = 1 if saved != self.progress_mark else self.in_a_row + 1
        self.progress_mark = saved
        self._record(attempt=self.attempt, event="failure", cause=cause, failures=self.failures,
                     in_a_row=self.in_a_row)
        if self.failures > self.max_restarts:
            log(f"{self.failures} failures, more than MAX_RESTARTS={self.max_restarts}: giving up")
            return False
        wait = min(self.backoff * 2 ** (self.in_a_row - 1), self.max_backoff)
        log(f"failure {self.failures} of at most {self.max_restarts} ({self.in_a_row} in a row without a new "
            f"checkpoint): relaunching in {wait:.0f} s")
        time.sleep(wait)
        return True

    def _launch_next(self, install: bool, why: str) -> bool:
        """The next attempt, launched; when the launch fails that attempt is ended as such."""
        self.attempt += 1
        if self.launch(self.attempt, install=install, why=why):
            return True
        self.end(self.attempt, "launch failed", None, collect=False)
        return False

    def run(self) -> int:
        """Supervises until the run finishes (0) or fails more than MAX_RESTARTS times (1)."""
        spec = self.slice_spec()
        attempts = self._attempts()
        self.attempt = max((a["attempt"] for a in attempts), default=0)
        self.failures = sum(1 for a in attempts if a.get("event") == "failure")
        self.in_a_row, self.progress_mark = 0, self._saved_step()
        if attempts and attempts[-1].get("event") == "done":
            log(f"{self.attempts_file} says the run finished: nothing to do")
            return 0
        pending = None  # (install, why) of the launch to make once the slice is READY
        open_attempt = bool(attempts) and attempts[-1].get("event") == "start"
        workers = self.worker_states() if open_attempt else None
        if workers and set(s for s, _ in workers.values()) == {"running"}:
            log(f"adopting attempt {self.attempt}: every worker's run is going")
        else:
            if open_attempt:
                self.end(self.attempt, "not running when the supervisor started", workers, collect=True)
            pending = (bool(attempts) or self.env.get("SKIP_INSTALL") != "1",
                       "supervisor restarted" if attempts else "first start")
        stop_grace_until, first = None, True
        while True:
            if not first:
                time.sleep(self.poll)
            first = False
            try:
                node = self.slice.describe()
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                log(f"describe failed ({e}); trying again next poll")
                continue
            state = node.get("state", "UNKNOWN") if node else "NOT_FOUND"
            if state in LOST:
                if self._attempts()[-1].get("event") == "start":
                    self.end(self.attempt, f"slice {state}", None, collect=False)
                log(f"{self.slice.name} is {state}: recreating it")
                try:
                    self.slice.recreate(spec, self.ready_timeout, max(self.poll, 1))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    log(f"recreating failed ({e}); trying again next poll")
                    continue
                pending, first = (True, f"slice recreated after {state}"), True
                continue
            if state != "READY":  # CREATING, RESTARTING, REPAIRING, ...: wait for it
                log(f"{self.slice.name} is {state}")
                continue
            if pending is not None:
                if self._launch_next(*pending):
                    pending = None
                elif not self._failure("launch failed"):
                    return 1
                continue
            workers = self.worker_states()
            if workers is None:
                log("a worker did not answer the status call; trying again next poll")
                continue
            states = {s for s, _ in workers.values()}
            if states == {"running"}:
                continue
            if states == {"finished"}:
                self.end(self.attempt, "finished", workers, collect=True)
                self._record(attempt=self.attempt, event="done", saved_step=self._saved_step())
                log("the run finished")
                return 0
            if states <= {"running", "stopped", "finished"} and "running" in states:
                # A SIGTERM'd worker saves at the step every host agrees on, and the others stop
                # there too: STOP_TIMEOUT for them to get there before they are stopped.
                stop_grace_until = stop_grace_until or time.time() + setting("STOP_TIMEOUT", 600)
                if time.time() < stop_grace_until:
                    continue
            stop_grace_until = None
            failed = {k: v for k, v in workers.items() if v[0] in ("failed", "gone", "none")}
            if failed and "failed" not in {s for s, _ in failed.values()}:
                # Processes that vanish without an exit code may be a preemption that describe
                # does not show yet: ask again before calling it a failure.
                try:
                    node = self.slice.describe()
                except (RuntimeError, subprocess.TimeoutExpired, ValueError):
                    node = {"state": "UNKNOWN"}
                if (node.get("state", "UNKNOWN") if node else "NOT_FOUND") != "READY":
                    first = True
                    continue
            cause = "; ".join(f"worker {k} {s}{'' if rc is None else f' (exit {rc})'}"
                              for k, (s, rc) in sorted(failed.items()))
            cause = cause or "stopped after saving on SIGTERM (a maintenance event or preemption notice)"
            self.end(self.attempt, cause, workers, collect=True)
            if failed and not self._failure(cause):
                return 1
            pending, first = (False, cause), True


def main(argv: list[str]) -> int:
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # as Ctrl-C: the run goes on
    try:
        return Supervisor(argv).run()
    except KeyboardInterrupt:
        log("interrupted: the run goes on without supervision; the same command adopts it again")
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
