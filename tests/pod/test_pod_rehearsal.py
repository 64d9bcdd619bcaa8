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

Then the chaos rehearsal (`chaos`, in the same test to share the reference run's compile): one run
under the supervisor (`launch/tpu_pod.sh --watch`, bert_jax/pod/supervisor.py) through a planted
loss spike (rolled back), a worker SIGKILLed, a worker unreachable over SSH, a frozen bucket and
failing describes, a hang (a worker's python SIGSTOPped), and the slice lost from the API with its
VMs wiped, two stockouts, a slow creation and the supervisor itself SIGKILLed mid-recreation and
started again: it ends with every logged loss equal to the reference's (which skips the batches the
rollback skips), every attempt and cause recorded once, every worker's logs in the bucket, the new
VMs reinstalled pinned and nothing hashed again. Then a refused config, which stops supervision at
once (`refused_at_once`). (The XLA compilation cache stays shared between the stand-in VMs: it
stands for a cache in the bucket, and keeps the test's compiles cheap.)
"""

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from data_pipeline import storage
from data_pipeline.records import manifests
from data_pipeline.storage import gcs as storage_gcs
from tests.helpers import fake_pod, fault_hooks
from tests.helpers.pretraining_records import logged_losses, write_records
from tests.helpers.xla_flags import FAST_COMPILE

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
    manifests.write_dataset_info(f"{bucket}/data", {f"{bucket}/data/train-{i}.tfrecord": 48 for i in range(4)})
    fake = fake_pod.install(tmp_path, workers=2, python=sys.executable)
    python = Path(fake["BIN"]) / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "sitecustomize.py").write_text(FAULT + fault_hooks.FREEZE_AT_SAVE + fault_hooks.PAUSE_AT_STEP
                                             + fault_hooks.SPIKE_AT_STEPS)
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


# The chaos rehearsal's rounds of faults (`chaos`), 20 steps each: one in CI; the long mode, for a
# developer's machine, repeats them (`BERT_JAX_CHAOS_ROUNDS=3 python -m pytest tests/pod/test_pod_rehearsal.py`).
ROUNDS = int(os.environ.get("BERT_JAX_CHAOS_ROUNDS", "1"))
STEPS = 20 * ROUNDS
# Every run of the test: the same steps and schedule, rollback on a divergence (each round's planted
# spike: steps 5 and 6 of the round, K=2, so back to its step 4 and 6 - 4 = 2 batches skipped), and
# the skips those rollbacks make, given by hand: every run but the chaos one then reads the batches
# the chaos run reads, and all of them must log the reference's losses.
ARGS = ["--config.log_every_steps=1", "--config.checkpoint_every_steps=4", f"--config.num_train_steps={STEPS}",
        "--config.shuffle_buffer_size=64", "--config.on_divergence=rollback", "--config.divergence_warmup_steps=2",
        "--config.divergence_steps=2"]
SKIP = "--config.skip_batches=" + ",".join(f"{20 * k + 4}:2" for k in range(ROUNDS))


def launch(pod, workdir, *extra_args, **extra_env):
    args = [f"--config.train_data={pod['bucket']}/data/train-*.tfrecord", "--config.verify_data=false", *ARGS, SKIP,
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


def test_pod_runs_through_preemptions_crashes_and_a_chaos_of_faults_log_the_reference_losses(pod):
    bucket = pod["bucket"]
    out = wait_exit(pod, launch(pod, f"{bucket}/ref"))
    want = losses(f"{bucket}/ref")
    assert sorted(want) == list(range(1, STEPS + 1)), out[-4000:]

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
    # checkpoint interval, 8 here on an idle machine: the save is still the preemption's).
    assert 6 <= stop_step < STEPS, (stop_step, saved)
    assert out.count(f"saving step {stop_step} because of preemption") == 2, out[-4000:]

    # The same command again: worker 1 cannot read the newest step; both fall back to the same one.
    # And the bucket stops answering as the next save starts (that of step fallback + 4): the save
    # fails on every host within its deadline (5 s here) instead of hanging the pod.
    fallback = max(s for s in saved if s < stop_step)
    frozen = fallback + 4
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
    # The same command resumes from the same step again and finishes with the uninterrupted losses.
    out = wait_exit(pod, launch(pod, work))
    assert out.count(f"resumed from step {fallback}") == 2, out[-4000:]
    assert losses(work) == want  # bitwise, step for step
    # Each run of each worker kept its own log.
    for w in pod["workers"]:
        assert len([p for p in (w / "bert_jax_run" / "logs").iterdir() if p.name != "latest.log"]) == 4


    chaos(pod, want)
    refused_at_once(pod)


# ---------------------------------------------------------------------------------------------
# The chaos rehearsal: one supervised run (launch/tpu_pod.sh --watch) through every fault a weekend
# meets, which must end with the reference's losses
# ---------------------------------------------------------------------------------------------

# The supervisor's settings for the rehearsal: polls every second; a run that makes no progress for
# 25 s is hung (a run's end, its last save to its exit, took 16 s here; a worker blocked in a
# collective on a stopped peer waited 75 s without an error, and jax's heartbeat allows 100 s);
# 6 polls without an answer make a worker lost (step 9's worker is unreachable for 3: a margin of 3 polls,
# which a loaded machine needs: at 4 the supervisor's 4th poll once came before the test's unlink);
# storage calls of the supervisor's own give up after 2 s a try (the workers keep the default limit).
CHAOS = dict(POLL_SECONDS="1", BACKOFF_SECONDS="2", MAX_BACKOFF_SECONDS="4", STOP_TIMEOUT="5",
             LOG_SYNC_SECONDS="2", UNREACHABLE_POLLS="6", HANG_SECONDS="25", STARTUP_SECONDS="300",
             STORAGE_TIMEOUT="3", BERT_JAX_GCS_TIMEOUT="2", READY_TIMEOUT="120", SKIP_INSTALL="0")


def chaos(pod, want: dict) -> None:
    """The faults of each round, in the order they come (step numbers within the round; worker 0 held
    at each step named, until the test lets it go):

    1. steps 5 and 6: a planted loss spike (on both workers) -> the run rolls back to step 4 and
       skips 2 batches (`SKIP`, what every other run of the test reads);
    2. step 7: worker 1's run SIGKILLed -> stopped, logs collected, relaunched from step 4: the
       recorded skip applies again;
    3. step 9: worker 1 unreachable over SSH for 2 polls -> watched through worker 0, not stopped
       (a worker lost for good is tests/pod/test_supervisor.py's);
    4. step 10: the bucket frozen past the supervisor's own storage calls (9 s), and describe
       failing meanwhile, three times once with a message that merely says "not found";
    5. step 11: worker 1's python SIGSTOPped: the run hangs -> stopped and relaunched from step 8;
    6. step 13: the slice preempted and gone from the API (describe NOT_FOUND: recreated from
       slice.json alone), its VMs wiped; two creates fail (a stockout), the third takes 3 s and the
       slice 3 s more to come up; the supervisor SIGKILLed during that create and started again;
    7. the run reinstalled pinned on the new VMs, resumed from step 12 without hashing the data
       again, to the next round or the end.
    """
    bucket, root, faults = pod["bucket"], pod["root"], pod["faults"]
    work = f"{bucket}/chaos"
    attempts_file = f"{work}/attempts.jsonl"
    hold = ",".join(str(20 * k + s) for k in range(ROUNDS) for s in (7, 9, 10, 11, 13))
    spikes = ";".join(f"{20 * k + 5},{20 * k + 6}" for k in range(ROUNDS))
    # Both workers: the spikes; each VM's cache in its own home (~/.cache/bert_jax: wiped with it);
    # the default storage time limit (CHAOS's 2 s is the supervisor's).
    spike = f"FAULT_SPIKE_STEPS={spikes} FAULT_SPIKE_DIR={faults} BERT_JAX_CACHE_DIR= BERT_JAX_GCS_TIMEOUT=60"
    env = dict(pod["env"], WORKDIR=work, SUPERVISOR_PYTHON=sys.executable,
               BERT_JAX_CACHE_DIR=str(root / "supervisor_cache"),  # the supervisor's own: its spool, the code
               FAKE_ENV_0=f"PYTHONPATH={faults} FAULT_PAUSE_AT_STEPS={hold} FAULT_PAUSE_DIR={faults} {spike}",
               FAKE_ENV_1=f"PYTHONPATH={faults} {spike}", **CHAOS)
    args = [f"--config.train_data={bucket}/data/train-*.tfrecord", "--config.verify_data=true", *ARGS]
    out_file = root / "supervisor.out"
    emulator = int(os.environ["BERT_JAX_TEST_EMULATOR_PID"])

    def start_supervisor():
        with open(out_file, "a") as out:
            return subprocess.Popen(["bash", str(SCRIPT), "--watch", *args], env=env, stdout=out,
                                    stderr=subprocess.STDOUT)

    supervisor = start_supervisor()

    def wait_for(predicate, what, timeout=300):
        deadline = time.time() + timeout
        while not predicate():
            if time.time() > deadline or supervisor.poll() is not None:
                pytest.fail(f"{what}: not seen\n{out_file.read_text()[-3000:]}\n{logs(pod)[-3000:]}")
            time.sleep(0.1)

    def rows():
        try:
            return [json.loads(line) for line in storage.read_text(attempts_file).splitlines()]
        except FileNotFoundError:
            return []

    def count(event, cause=""):
        return sum(1 for r in rows() if r["event"] == event and r.get("cause", "").startswith(cause))

    def held(step):
        wait_for(lambda: (faults / f"paused-{step}").exists(), f"step {step}")

    def go_on(step):
        (faults / f"resume-{step}").touch()

    def pid(i):
        return int((pod["workers"][i] / "bert_jax_run" / "pid").read_text())

    try:
        for k in range(ROUNDS):
            o, ends = 20 * k, count("end")
            # 1-2. The spike rolls the run back (the run's own doing); then a worker's run is killed.
            held(o + 7)
            marker = f"-{k}" if k else ""
            assert (faults / f"spiked-0{marker}").exists() and (faults / f"spiked-1{marker}").exists()
            starts = count("start")
            os.kill(pid(1), signal.SIGKILL)
            go_on(o + 7)
            wait_for(lambda: count("start") == starts + 1, "the relaunch after the crash")
            # 3. A worker unreachable over SSH for 2 polls (fewer than UNREACHABLE_POLLS): watched
            # through the other meanwhile, and neither stopped nor counted lost.
            held(o + 9)
            (root / "unreachable.1").touch()
            polls = fake_pod.status_calls(root)
            wait_for(lambda: fake_pod.status_calls(root) >= polls + 3, "two polls without worker 1")
            (root / "unreachable.1").unlink()
            go_on(o + 9)
            assert count("end") == ends + 1
            held(o + 10)
            # 4. The bucket frozen past the supervisor's storage calls; describe failing meanwhile.
            (root / "describe_noise").touch()
            (root / "describe_errors").write_text("3")
            os.kill(emulator, signal.SIGSTOP)
            try:
                time.sleep(9)
                assert supervisor.poll() is None
            finally:
                os.kill(emulator, signal.SIGCONT)
            go_on(o + 10)
            # 5. A hang: worker 1's python stopped; worker 0 waits for it in the next collective.
            held(o + 11)
            assert count("end") == ends + 1  # nothing ended through the freeze: it was not taken for a hang
            os.kill(pid(1), signal.SIGSTOP)
            go_on(o + 11)
            wait_for(lambda: count("end", "hung") == k + 1, "the hang detected")
            # 6. The slice lost (gone from the API) once the round's step 12 is saved and the
            # attempt's logs are up.
            held(o + 13)
            n = max(r["attempt"] for r in rows())
            wait_for(lambda: storage.exists(f"{work}/checkpoints/{o + 12}/commit_success.txt")
                     and len(storage.listdir(f"{work}/logs/attempt-{n}")) == 2, "step 12 saved, the logs uploaded")
            (root / "create_failures").write_text("2")
            (root / "create_sleep").write_text("3")
            (root / "create_delay").write_text("3")
            fake_pod.lose(root, "NOT_FOUND")
            go_on(o + 13)
            creates = len(gcloud_creates(root))
            wait_for(lambda: len(gcloud_creates(root)) == creates + 3, "the third create")
            supervisor.kill()  # mid-recreation: its create goes on in its own process group
            supervisor.wait(timeout=10)
            supervisor = start_supervisor()  # as systemd would
        assert supervisor.wait(timeout=420) == 0, out_file.read_text()[-4000:]
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        os.kill(emulator, signal.SIGCONT)
    supervised = out_file.read_text()

    # --- What the supervisor recorded: every attempt and cause, each line once. ---
    got = rows()
    assert len({r["id"] for r in got}) == len(got), got
    ends = [r for r in got if r["event"] == "end"]
    causes = [r["cause"] for r in ends]
    expected = ["worker 1 failed (exit 137)", "hung: no progress for", "slice NOT_FOUND"] * ROUNDS + ["finished"]
    found = iter(causes)
    assert all(any(c.startswith(e) for c in found) for e in expected), causes  # in this order
    assert [r["attempt"] for r in ends] == sorted({r["attempt"] for r in got if r["event"] == "start"})
    assert all(c.startswith(("launch failed", *expected)) for c in causes), causes  # nothing else ended one
    for k, hung in enumerate(r for r in ends if r["cause"].startswith("hung")):
        assert "(budget 25 s)" in hung["cause"] and f"train_log.jsonl at step {20 * k + 11}" in hung["cause"], hung
    failed_creates = [r for r in got if r["event"] == "create_failed"]
    assert len(failed_creates) == 2 * ROUNDS and all("RESOURCE_EXHAUSTED" in r["error"] for r in failed_creates)
    assert got[-1]["event"] == "done"
    rollbacks = [r["line"] for r in got if r["event"] == "rollback"]
    assert [(r["first_spike_step"], r["restored_step"], r["skipped_batches"]) for r in rollbacks] == [
        (20 * k + 5, 20 * k + 4, 2) for k in range(ROUNDS)], rollbacks
    assert "taking over the lease" in supervised  # of its killed self
    assert "no status from worker(s) 1 (2 poll(s) in a row)" in supervised
    assert "could not renew the lease" in supervised  # the bucket was frozen, and the supervisor lived on
    # No slice deleted on a bad reading: every recreation (a delete, then a create) is a lost slice's.
    assert [(r["cause"], r["tries"]) for r in got if r["event"] == "recreate"] == [
        ("slice NOT_FOUND", 1), ("slice NOT_FOUND", 2), ("slice NOT_FOUND", 3)] * ROUNDS
    # No reinstall skipped: the recreated VMs were installed, pinned to the recorded versions.
    installed = [r for r in got if r["event"] == "start" and r["install"]]
    assert [r["why"] for r in installed] == ["first start"] + ["supervisor restarted"] * ROUNDS, installed
    assert all(r["pinned"] == "constraints.txt" for r in installed[1:]), installed
    pins = storage.read_text(f"{work}/constraints.txt")
    assert f"jax=={importlib.metadata.version('jax')}" in pins.splitlines()
    for i in range(2):
        assert (root / f"used-constraints.{i}").read_text() == pins
    # Every worker's log of every attempt that ran is in the bucket.
    for n in {r["attempt"] for r in ends if not r["cause"].startswith("launch failed")}:
        assert storage.listdir(f"{work}/logs/attempt-{n}") == ["worker-0.log", "worker-1.log"], n
    last = storage.read_text(f"{work}/logs/attempt-{installed[-1]['attempt']}/worker-0.log")
    assert f"resumed from step {20 * (ROUNDS - 1) + 12}" in last
    assert re.search(r"data verification: hashed 0 files \(0 bytes\)", last), last[-3000:]  # nothing re-read

    # --- The losses: every line logged equals the reference's, but those a rollback superseded
    # (logged before its event line, for steps after the step it went back to). ---
    lines = [json.loads(line) for line in storage.read_text(f"{work}/train_log.jsonl").splitlines()]
    events = [(i, r["restored_step"]) for i, r in enumerate(lines) if r.get("event") == "rollback"]
    superseded = {i for e, restored in events for i in range(e)
                  if "event" not in lines[i] and lines[i]["step"] > restored}
    kept = [r for i, r in enumerate(lines) if "event" not in r and i not in superseded]
    assert {r["step"] for r in kept} == set(want)
    assert all(r["loss"] == want[r["step"]] for r in kept), [(r["step"], r["loss"], want[r["step"]]) for r in kept
                                                           if r["loss"] != want[r["step"]]]
    assert any(lines[i]["loss"] != want[lines[i]["step"]] for i in superseded)  # the skips mattered


def gcloud_creates(root):
    return [c for c in fake_pod.calls(root) if c[2:4] == ["tpu-vm", "create"]]


def refused_at_once(pod) -> None:
    """A run the same command cannot get past (a refused config: exit 78 on every worker) stops
    supervision within one poll, with the cause, and is never relaunched."""
    work = f"{pod['bucket']}/refused"
    env = dict(pod["env"], WORKDIR=work, SUPERVISOR_PYTHON=sys.executable, FAKE_ENV_0="", FAKE_ENV_1="",
               **dict(CHAOS, BACKOFF_SECONDS="60"), BERT_JAX_CACHE_DIR=str(pod["root"] / "supervisor_cache"))
    r = subprocess.run(["bash", str(SCRIPT), "--watch", f"--config.train_data={pod['bucket']}/data/train-*.tfrecord",
                        *ARGS, "--config.objective=bogus"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout[-3000:]
    got = [json.loads(line) for line in storage.read_text(f"{work}/attempts.jsonl").splitlines()]
    assert [g["event"] for g in got if g["event"] != "maintenance"] == ["start", "end", "gave_up"], got
    assert "failed 78" in got[-2]["workers"].values(), got[-2]  # (the other may not have got there yet)
    assert "exit code 78 is refused config" in got[-1]["cause"]
    assert "config.objective must be 'mlm' or 'ltr'" in storage.read_text(f"{work}/logs/attempt-1/worker-0.log")
