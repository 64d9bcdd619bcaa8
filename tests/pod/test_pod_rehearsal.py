"""A pod run rehearsed on one machine: the real launch/tpu_pod.sh, a stand-in `gcloud` whose
`--worker=all` is two local "TPU VMs" (folders, each a home with its own copy of the project,
its processes joined by jax.distributed on 127.0.0.1, 2 CPU devices each), data and workdir in
a bucket of the GCS emulator (tests/conftest.py).

Rehearsed: a run started detached; a maintenance event (SIGTERM to one worker) mid-run makes
every worker save the same step and exit; the same command again resumes, and when one worker
cannot read that newest step (a read error injected into that worker alone) every worker falls
back to the same earlier step, and when the bucket then stops answering as the next save starts,
every worker's save fails within its deadline instead of hanging the pod; the same command resumes
again. The final losses equal an uninterrupted two-worker run's, bit for bit: the same programs on
the same devices see the same batches from the same step on.

Then the same run under the supervisor (`launch/tpu_pod.sh --watch`, bert_jax/supervisor.py), in
the same test to share the reference run's compile: one worker's run SIGKILLed → the supervisor
stops the other, collects both logs into the bucket and relaunches; then the whole slice
"preempted" (every worker's processes killed, its folders - run dir, caches, project copy - wiped,
describe answering PREEMPTED) → recreated from the recorded spec, reinstalled pinned to the
recorded versions, resumed without hashing the data again; the losses equal the uninterrupted
run's. (The XLA compilation cache stays shared between the stand-in VMs: it stands for a cache
in the bucket, and keeps the test's compiles cheap.)
"""

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from data_pipeline import schema, storage, storage_gcs
import fake_pod  # tests/ is on sys.path
import fault_hooks
from pretraining_records import logged_losses, write_records
from xla_flags import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "tpu_pod.sh"

# The workers' python: pip is recorded (and an install checks that it was given the run's
# recorded versions); everything else is the real python.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [ "$1 $2 $3" = "-m pip install" ]; then
  printf '%s ' "$@" >> "$FAKE_ROOT/pip.$TPU_WORKER_ID.log"; echo >> "$FAKE_ROOT/pip.$TPU_WORKER_ID.log"
  if [ -f constraints.txt ]; then cp constraints.txt "$FAKE_ROOT/used-constraints.$TPU_WORKER_ID"; fi
  exit 0
fi
exec "$FAKE_PY" "$@"
"""

# Worker 1's read error: orbax's array restore of one step fails there (and only there).
FAULT = r"""
import os
_step = os.environ.get("FAULT_UNREADABLE_STEP")
if _step:
    import orbax.checkpoint as ocp
    _real = ocp.StandardCheckpointHandler.restore

    def _restore(self, directory, *args, **kwargs):
        if directory.parent.name == _step:
            raise OSError(f"injected read error in {directory} on this worker")
        return _real(self, directory, *args, **kwargs)

    ocp.StandardCheckpointHandler.restore = _restore
"""


@pytest.fixture
def pod(gcs_server, tmp_path):
    bucket = f"gs://pod-{uuid.uuid4().hex[:8]}"
    storage_gcs.filesystem(bucket).mkdir(bucket[5:])
    for i in range(4):
        write_records(tmp_path / f"train-{i}.tfrecord", 48, seed=i)
        storage.copy(str(tmp_path / f"train-{i}.tfrecord"), f"{bucket}/data/train-{i}.tfrecord")
    schema.write_dataset_info(f"{bucket}/data", {f"{bucket}/data/train-{i}.tfrecord": 48 for i in range(4)})
    fake = fake_pod.install(tmp_path, workers=2, python=sys.executable)
    python = Path(fake["BIN"]) / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "sitecustomize.py").write_text(FAULT + fault_hooks.FREEZE_AT_SAVE + fault_hooks.PAUSE_AT_STEP)
    workers = [tmp_path / f"worker{i}" for i in range(2)]
    env = dict(os.environ, **fake, PATH=f"{fake['BIN']}:{os.environ['PATH']}", PYTHON=str(python),
               JAX_NUM_CPU_DEVICES="2", XLA_FLAGS=FAST_COMPILE,
               SKIP_INSTALL="1", STOP_TIMEOUT="20", TPU_NAME="rehearsal", ZONE="local", PROJECT="none",
               CONFIG="configs/test.py", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
               BERT_JAX_CACHE_DIR=str(tmp_path / "cache"), BERT_JAX_INIT_TIMEOUT="120",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("PYTHONPATH", None)  # each worker imports its own copy of the project
    yield {"bucket": bucket, "env": env, "workers": workers, "faults": faults, "root": tmp_path}
    for w in workers:  # never leave a run behind
        pid_file = w / "bert_jax_run" / "pid"
        if pid_file.exists():
            try:
                os.killpg(os.getpgid(int(pid_file.read_text())), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


ARGS = ["--config.log_every_steps=1", "--config.checkpoint_every_steps=4", "--config.num_train_steps=12",
        "--config.shuffle_buffer_size=64"]


def launch(pod, workdir, *extra_args, **extra_env):
    args = [f"--config.train_data={pod['bucket']}/data/train-*.tfrecord", "--config.verify_data=false", *ARGS,
            *extra_args]
    r = subprocess.run(["bash", str(SCRIPT), *args], env=dict(pod["env"], WORKDIR=workdir, **extra_env),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return [int((w / "bert_jax_run" / "pid").read_text()) for w in pod["workers"]]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def wait_exit(pod, pids, timeout=420) -> str:
    """Waits for the workers' runs to end; returns their logs (each worker's newest)."""
    deadline = time.time() + timeout
    while any(alive(p) for p in pids):
        if time.time() > deadline:
            pytest.fail("the workers did not finish:\n" + logs(pod)[-4000:])
        time.sleep(0.5)
    return logs(pod)


def logs(pod) -> str:
    return "\n".join(f"--- worker {i}\n" + (w / "bert_jax_run" / "logs" / "latest.log").read_text(errors="replace")
                     for i, w in enumerate(pod["workers"]))


def exit_codes(pod, timeout=60) -> list:
    """Each worker's exit code, once the shell that waited on its run has written it (a moment
    after the run's process is gone)."""
    files = [w / "bert_jax_run" / "exit_code" for w in pod["workers"]]
    deadline = time.time() + timeout
    while not all(f.exists() and f.read_text().strip() for f in files):
        if time.time() > deadline:
            pytest.fail("no exit code written:\n" + logs(pod)[-4000:])
        time.sleep(0.2)
    return [int(f.read_text()) for f in files]


def losses(workdir) -> dict:
    return logged_losses(storage.read_text(f"{workdir}/train_log.jsonl"))


def pausing(pod, steps: str) -> str:
    """A `FAKE_ENV_0` that holds worker 0 still once it has logged each of `steps` (fault_hooks.
    PAUSE_AT_STEP): the run is then at that step when the test signals it, not already finished."""
    return f"PYTHONPATH={pod['faults']} FAULT_PAUSE_AT_STEPS={steps} FAULT_PAUSE_DIR={pod['faults']}"


def test_preempted_crashed_and_recreated_pod_runs_resume_with_the_uninterrupted_losses(pod):
    bucket = pod["bucket"]
    out = wait_exit(pod, launch(pod, f"{bucket}/ref"))
    want = losses(f"{bucket}/ref")
    assert sorted(want) == list(range(1, 13)), out[-4000:]

    # A maintenance event: SIGTERM to worker 1 alone, once step 6 is logged (worker 0 held there
    # until the signal is sent).
    work = f"{bucket}/run"
    pids = launch(pod, work, FAKE_ENV_0=pausing(pod, "6"))
    deadline = time.time() + 300
    while not (pod["faults"] / "paused-6").exists():
        if time.time() > deadline or not all(alive(p) for p in pids):
            pytest.fail("the run did not reach step 6:\n" + logs(pod)[-4000:])
        time.sleep(0.1)
    os.kill(pids[1], signal.SIGTERM)
    (pod["faults"] / "resume-6").touch()
    out = wait_exit(pod, pids)
    saved = [int(s) for s in storage.listdir(f"{work}/checkpoints") if s.isdigit()]
    stop_step = max(saved)
    assert out.count(f"preemption/SIGTERM: saved step {stop_step}, exiting") == 2, out[-4000:]  # both workers
    # Stopped early, saved by the preemption path on both hosts (the agreed step may fall on the
    # checkpoint interval, 8 of 12 here on an idle machine: the save is still the preemption's).
    assert 6 <= stop_step < 12, (stop_step, saved)
    assert out.count(f"saving step {stop_step} because of preemption") == 2, out[-4000:]

    # The same command again: worker 1 cannot read the newest step; both fall back to the same one.
    # And the bucket stops answering as the next save starts (that of step fallback + 4): the save
    # fails on every host within its deadline (5 s here) instead of hanging the pod.
    fallback = max(s for s in saved if s < stop_step)
    frozen = fallback + 4
    started = time.time()
    try:
        pids = launch(pod, work, "--config.checkpoint_save_timeout_seconds=5",
                      FAKE_ENV_0=f"PYTHONPATH={pod['faults']} FAULT_FREEZE_AT_SAVE={frozen}",
                      FAKE_ENV_1=f"PYTHONPATH={pod['faults']} FAULT_UNREADABLE_STEP={stop_step}")
        deadline = time.time() + 300  # (the bucket cannot be asked while it is frozen)
        while any(alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.5)
    finally:
        os.kill(int(os.environ["BERT_JAX_TEST_EMULATOR_PID"]), signal.SIGCONT)
    out = wait_exit(pod, pids, timeout=30)
    assert out.count(f"resumed from step {fallback}") == 2, out[-4000:]
    assert "host 1" in out and "injected read error" in out
    assert [n.split("-")[0] for n in storage.listdir(f"{work}/checkpoints/damaged")] == [str(stop_step)]
    codes = exit_codes(pod)
    # Each host ends on its own deadline (124), or, when the other got there first, on the error its
    # own save then meets (the coordination service's or orbax's barrier losing that host), loudly.
    # Which host's deadline comes first is the machine's timing: worker 0 freezes the bucket as its
    # save starts, but a loaded machine has seen worker 1's save start first and end first (124),
    # worker 0's then failing on the lost peer and aborting at shutdown (134).
    assert 124 in codes and 0 not in codes, (codes, out[-4000:])
    for i, text in enumerate(out.split("--- worker ")[1:]):
        assert (f"saving step {frozen} to {work}/checkpoints did not finish within 5 s" in text
                or f"checkpoint save of step {frozen} in {work}/checkpoints failed" in text), (i, text[-3000:])
    assert time.time() - started < 240
    # The same command resumes from the same step again and finishes with the uninterrupted losses.
    out = wait_exit(pod, launch(pod, work))
    assert out.count(f"resumed from step {fallback}") == 2, out[-4000:]
    assert losses(work) == want  # bitwise, step for step
    # Each run of each worker kept its own log.
    for w in pod["workers"]:
        assert len([p for p in (w / "bert_jax_run" / "logs").iterdir() if p.name != "latest.log"]) == 4

    # --- Supervised (launch/tpu_pod.sh --watch): a crash, then the whole slice preempted. ---
    work = f"{bucket}/supervised"
    root = pod["root"]
    env = dict(pod["env"], WORKDIR=work, SKIP_INSTALL="0", POLL_SECONDS="1", BACKOFF_SECONDS="1",
               LOG_SYNC_SECONDS="10", STOP_TIMEOUT="5", SUPERVISOR_PYTHON=sys.executable,
               BERT_JAX_CACHE_DIR="",  # each VM's cache in its own home (~/.cache/bert_jax): wiped with it
               FAKE_ENV_0=pausing(pod, "5,9"))  # held at step 5 (attempt 1) and step 9 (attempt 2)
    out_file = root / "supervisor.out"
    args = [f"--config.train_data={bucket}/data/train-*.tfrecord", "--config.verify_data=true", *ARGS]
    with open(out_file, "w") as out:
        supervisor = subprocess.Popen(["bash", str(SCRIPT), "--watch", *args], env=env, stdout=out,
                                      stderr=subprocess.STDOUT)
    try:
        def wait_for(predicate, what, timeout=300):
            deadline = time.time() + timeout
            while not predicate():
                if time.time() > deadline or supervisor.poll() is not None:
                    pytest.fail(f"{what}: not seen\n{out_file.read_text()[-3000:]}\n{logs(pod)[-3000:]}")
                time.sleep(0.1)

        def pid(i):
            return int((pod["workers"][i] / "bert_jax_run" / "pid").read_text())

        # One worker's run killed (an OOM kill, a segfault) once step 5 is logged.
        wait_for(lambda: (pod["faults"] / "paused-5").exists(), "step 5")
        os.kill(pid(1), signal.SIGKILL)
        (pod["faults"] / "resume-5").touch()
        attempts = f"{work}/attempts.jsonl"
        wait_for(lambda: storage.read_text(attempts).count('"event": "start"') == 2, "the relaunch")
        # The relaunched run saves step 8; then the slice is preempted: every process on every VM
        # dies and the VMs come back empty.
        # (Its logs are uploaded while it runs, every LOG_SYNC_SECONDS: the VMs will take theirs with them.)
        wait_for(lambda: len(storage.listdir(f"{work}/logs/attempt-2")) == 2, "attempt 2's logs")
        wait_for(lambda: storage.exists(f"{work}/checkpoints/8/commit_success.txt"), "step 8 saved again")
        wait_for(lambda: (pod["faults"] / "paused-9").exists(), "step 9")
        with fake_pod.taken_away(root, "PREEMPTED"):  # (the supervisor cannot recreate it meanwhile)
            for i in range(2):
                os.killpg(os.getpgid(pid(i)), signal.SIGKILL)
            for w in pod["workers"]:
                shutil.rmtree(w)
                w.mkdir()
            (pod["faults"] / "resume-9").touch()  # the recreated run goes on past step 9
        assert supervisor.wait(timeout=420) == 0, out_file.read_text()[-4000:]
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    rows = [json.loads(line) for line in storage.read_text(attempts).splitlines()]
    ends = [r for r in rows if r["event"] == "end"]
    assert [r["attempt"] for r in ends] == [1, 2, 3], rows
    assert ends[0]["cause"].startswith("worker 1 failed (exit 137)"), rows
    assert ends[1]["cause"] == "slice PREEMPTED" and ends[2]["cause"] == "finished", rows
    assert [r["event"] for r in rows].count("failure") == 1  # the crash; a preemption is not a failure
    # Both workers' logs of every attempt are in the bucket (attempt 2's uploaded while it ran).
    collected = {n: storage.listdir(f"{work}/logs/{n}") for n in ("attempt-1", "attempt-2", "attempt-3")}
    assert all(names == ["worker-0.log", "worker-1.log"] for names in collected.values()), collected
    crashed = storage.read_text(f"{work}/logs/attempt-1/worker-0.log")
    assert "resumed from step" not in crashed  # attempt 1 started fresh
    last = storage.read_text(f"{work}/logs/attempt-3/worker-0.log")
    assert "resumed from step 8" in last
    assert re.search(r"data verification: hashed 0 files \(0 bytes\)", last), last[-3000:]  # nothing re-read
    # The new VMs were installed with the versions the first install recorded.
    pins = storage.read_text(f"{work}/constraints.txt")
    assert f"jax=={importlib.metadata.version('jax')}" in pins.splitlines()
    for i in range(2):
        assert (root / f"used-constraints.{i}").read_text() == pins
    # Every logged loss, the repeats of resumed steps included, equals the uninterrupted run's.
    logged = [json.loads(line) for line in storage.read_text(f"{work}/train_log.jsonl").splitlines()]
    assert {r["step"] for r in logged} == set(want)
    assert all(r["loss"] == want[r["step"]] for r in logged)
