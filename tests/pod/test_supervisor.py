"""bert_jax/supervisor.py (launch/tpu_pod.sh --watch) against the stand-in gcloud of tests/fake_pod.py,
two workers, and a stand-in python whose "run" fails, finishes or waits as a test says: restarts
with backoff up to MAX_RESTARTS, logs collected per attempt, a preempted slice recreated from its
recorded spec and reinstalled pinned to the recorded versions, a restarted supervisor adopting the
run, a maintenance stop relaunched without counting as a failure. tests/pod/test_pod_rehearsal.py
runs the supervisor over real training."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fake_pod  # tests/ is on sys.path
from bert_jax import supervisor

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "tpu_pod.sh"

# The workers' python: `-m bert_jax.main` prints a line, then fails (mode "fail"), or runs until
# $FAKE_ROOT/finish exists (exit 0), or until SIGTERM (saves, as bert_jax logs it, exit 0); `-m pip`
# is recorded (freeze answers pins); anything else (the log upload) is the real python.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [ "$1 $2" = "-m bert_jax.main" ]; then
  echo "worker $TPU_WORKER_ID: run started with $*"
  [ "$(cat "$FAKE_ROOT/mode" 2>/dev/null)" = fail ] && { echo "worker $TPU_WORKER_ID: crashed"; exit 3; }
  trap 'echo "preemption/SIGTERM: saved step 4, exiting"; exit 0' TERM
  while [ ! -e "$FAKE_ROOT/finish" ]; do sleep 0.1; done
  exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
  printf '%s ' "$@" >> "$FAKE_ROOT/pip.$TPU_WORKER_ID.log"; echo >> "$FAKE_ROOT/pip.$TPU_WORKER_ID.log"
  if [ "$3" = freeze ]; then printf 'jax==0.10.2\nlibtpu==0.0.42\norbax-checkpoint==0.12.8\n'; fi
  if [ "$3" = install ] && [ -f constraints.txt ]; then cp constraints.txt "$FAKE_ROOT/used-constraints.$TPU_WORKER_ID"; fi
  exit 0
fi
exec "$REAL_PY" "$@"
"""


@pytest.fixture
def pod(tmp_path):
    fake = fake_pod.install(tmp_path, workers=2, python=sys.executable)
    python = Path(fake["BIN"]) / "python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    workdir = tmp_path / "workdir"
    env = dict(os.environ, **fake, PATH=f"{fake['BIN']}:{os.environ['PATH']}", REAL_PY=sys.executable,
               TPU_NAME="my-v4-16", ZONE="local", PROJECT="p", CONFIG="configs/test.py", WORKDIR=str(workdir),
               STOP_TIMEOUT="5", POLL_SECONDS="0.3", BACKOFF_SECONDS="0.2", MAX_BACKOFF_SECONDS="0.5",
               READY_TIMEOUT="30", LOG_SYNC_SECONDS="1", SUPERVISOR_PYTHON=sys.executable)
    env["PYTHONPATH"] = str(ROOT)  # the supervisor's imports on this machine
    yield tmp_path, env, workdir
    (tmp_path / "finish").touch()  # every fake run ends
    for w in tmp_path.glob("worker*/bert_jax_run/pid"):
        try:
            os.kill(int(w.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def watch(env, *args, timeout=90):
    return subprocess.Popen(["bash", str(SCRIPT), "--watch", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def attempts(workdir):
    path = workdir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, what, proc=None, timeout=60):
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline or (proc is not None and proc.poll() is not None):
            out = proc.communicate(timeout=10)[0] if proc is not None and proc.poll() is not None else ""
            pytest.fail(f"timed out waiting for {what}\n{out[-3000:]}")
        time.sleep(0.1)


def starts(root):
    return [c for c in fake_pod.calls(root) if c[3] == "ssh" and "tpu_worker.sh start" in c[-1]]


def test_a_failing_run_is_restarted_with_backoff_until_max_restarts(pod):
    root, env, workdir = pod
    (root / "mode").write_text("fail")
    proc = watch(dict(env, MAX_RESTARTS="2"), "--config.learning_rate=1e-4")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, out[-3000:]
    assert "more than MAX_RESTARTS=2: giving up" in out
    rows = attempts(workdir)
    assert [r["event"] for r in rows] == ["start", "end", "failure"] * 3
    ends = [r for r in rows if r["event"] == "end"]
    assert all(r["cause"] == "worker 0 failed (exit 3); worker 1 failed (exit 3)" for r in ends), ends
    assert [r["in_a_row"] for r in rows if r["event"] == "failure"] == [1, 2, 3]  # no new checkpoint: backoff doubles
    assert [r["install"] for r in rows if r["event"] == "start"] == [True, False, False]  # same VMs: no reinstall
    # Every attempt's logs, both workers', collected into the workdir.
    for n in (1, 2, 3):
        for w in (0, 1):
            text = (workdir / "logs" / f"attempt-{n}" / f"worker-{w}.log").read_text()
            assert f"worker {w}: crashed" in text and "--config.learning_rate=1e-4" in text
    # The first install's versions, recorded from worker 0.
    assert (workdir / "constraints.txt").read_text().splitlines() == [
        "jax==0.10.2", "libtpu==0.0.42", "orbax-checkpoint==0.12.8"]
    assert json.loads((workdir / "slice.json").read_text())["accelerator_type"] == "v4-16"
    assert len(starts(root)) == 3


def test_a_preempted_slice_is_recreated_from_its_spec_and_reinstalled_with_the_recorded_versions(pod):
    root, env, workdir = pod
    proc = watch(env)
    wait_for(lambda: len(starts(root)) == 1 and (workdir / "constraints.txt").exists(), "the first start", proc)
    # Each run uploads its log while it runs (LOG_SYNC_SECONDS): the VMs will take theirs with them.
    wait_for(lambda: all((workdir / "logs" / "attempt-1" / f"worker-{i}.log").exists() for i in (0, 1)),
             "the logs' first upload", proc)
    # Preempted: describe says so, every worker's processes die with the VM.
    with fake_pod.taken_away(root, "PREEMPTED"):
        for i in (0, 1):
            pid = int((root / f"worker{i}/bert_jax_run/pid").read_text())
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    wait_for(lambda: len(starts(root)) == 2, "the relaunch on the recreated slice", proc)
    (root / "finish").touch()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    calls = fake_pod.calls(root)
    delete = next(c for c in calls if c[3] == "delete")
    create = next(c for c in calls if c[3] == "create")
    assert calls.index(delete) < calls.index(create)
    assert set(create[4:]) >= {
        "my-v4-16", "--version=tpu-ubuntu2204-base", "--accelerator-type=v4-16", "--spot",
        "--network=projects/p/global/networks/tpu-net", "--subnetwork=projects/p/regions/local/subnetworks/tpu-sub",
        "--internal-ips", "--service-account=trainer@p.iam.gserviceaccount.com",
        "--scopes=https://www.googleapis.com/auth/cloud-platform", "--labels=team=nlp"}
    # Reinstalled on both new VMs, pinned to what the first install recorded.
    for i in (0, 1):
        assert (root / f"used-constraints.{i}").read_text() == (workdir / "constraints.txt").read_text()
        assert "-c constraints.txt -e .[tpu,gcs]" in (root / f"pip.{i}.log").read_text()
    rows = attempts(workdir)
    assert [(r["attempt"], r["event"]) for r in rows] == [(1, "start"), (1, "end"), (2, "start"), (2, "end"),
                                                         (2, "done")]
    assert rows[1]["cause"] == "slice PREEMPTED" and rows[2]["why"] == "slice recreated after PREEMPTED"
    assert rows[2]["install"] and rows[2]["pinned"] and rows[3]["cause"] == "finished"
    assert not any(r["event"] == "failure" for r in rows)
    assert "worker 1: run started" in (workdir / "logs" / "attempt-1" / "worker-1.log").read_text()


def test_a_restarted_supervisor_adopts_the_run_and_a_maintenance_stop_is_relaunched(pod):
    root, env, workdir = pod
    proc = watch(env)
    wait_for(lambda: all((root / f"worker{i}/bert_jax_run/pid").exists() for i in (0, 1)), "the runs", proc)
    wait_for(lambda: (workdir / "constraints.txt").exists(), "the versions", proc)
    proc.send_signal(signal.SIGTERM)  # the supervisor's SSH session ends; the run goes on
    out = proc.communicate(timeout=30)[0]
    assert "the run goes on without supervision" in out
    pids = [int((root / f"worker{i}/bert_jax_run/pid").read_text()) for i in (0, 1)]
    assert all(Path(f"/proc/{p}").exists() for p in pids)
    proc = watch(env)
    wait_for(lambda: (root / "gcloud.log").read_text().count("tpu_worker.sh status") >= 3, "polls", proc)
    assert len(starts(root)) == 1  # adopted, not relaunched
    # A maintenance event: SIGTERM on every worker; each saves and exits 0.
    for p in pids:
        os.kill(p, signal.SIGTERM)
    wait_for(lambda: len(starts(root)) == 2, "the relaunch", proc)
    (root / "finish").touch()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "adopting attempt 1" in out
    rows = attempts(workdir)
    assert [(r["attempt"], r["event"]) for r in rows] == [(1, "start"), (1, "end"), (2, "start"), (2, "end"),
                                                         (2, "done")]
    assert rows[1]["cause"].startswith("stopped after saving on SIGTERM")
    assert rows[1]["workers"] == {"0": "stopped 0", "1": "stopped 0"}
    assert not rows[2]["install"] and not any(r["event"] == "failure" for r in rows)


def test_queued_resource_slices_are_recreated_through_their_queued_resource():
    node = dict(fake_pod.NODE, queuedResource="projects/p/locations/z/queuedResources/my-qr",
                schedulingConfig={"spot": True})
    spec = supervisor.Slice.spec_of(node)
    delete, create = supervisor.Slice("my-v4-16", "z", "p").create_args(spec)
    assert delete == ["compute", "tpus", "queued-resources", "delete", "my-qr", "--quiet", "--force"]
    assert create[:5] == ["compute", "tpus", "queued-resources", "create", "my-qr"]
    assert {"--node-id=my-v4-16", "--runtime-version=tpu-ubuntu2204-base", "--accelerator-type=v4-16",
            "--spot"} <= set(create)
