"""A pod run rehearsed on one machine: the real launch/tpu_pod.sh, a stand-in `gcloud` whose
`--worker=all` is two local "TPU VMs" (folders, each a home with its own copy of the project,
its processes joined by jax.distributed on 127.0.0.1, 2 CPU devices each), data and workdir in
a bucket of the GCS emulator (tests/conftest.py).

Rehearsed: a run started detached; a maintenance event (SIGTERM to one worker) mid-run makes
every worker save the same step and exit; the same command again resumes, and when one worker
cannot read that newest step (a read error injected into that worker alone) every worker falls
back to the same earlier step. The final losses equal an uninterrupted two-worker run's, bit for
bit: the same programs on the same devices see the same batches from the same step on.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from data_pipeline import storage
from pretraining_records import logged_losses, write_records  # tests/ is on sys.path
from xla_flags import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "tpu_pod.sh"

# `gcloud compute tpus tpu-vm ssh|scp NAME ... --worker=all` on $FAKE_WORKERS local workers:
# scp copies into each worker's home, ssh runs the command in each home with that worker's
# jax.distributed settings (what a TPU VM's metadata gives jax) and its $FAKE_ENV_<i>.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
set -e
printf '%s\0' "$@" >> "$FAKE_LOG"; printf '\n' >> "$FAKE_LOG"
if [ "$4" = scp ]; then
  srcs=(); for a in "${@:5}"; do case "$a" in --*) ;; *) srcs+=("$a") ;; esac; done
  dest="${srcs[-1]#*:}"; unset 'srcs[-1]'
  for ((i = 0; i < FAKE_WORKERS; i++)); do cp -r "${srcs[@]}" "$FAKE_ROOT/worker$i/$dest"; done
  exit 0
fi
port=$("$FAKE_PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for a in "$@"; do
  case "$a" in --command=*)
    for ((i = 0; i < FAKE_WORKERS; i++)); do
      extra="FAKE_ENV_$i"
      (cd "$FAKE_ROOT/worker$i" && env HOME="$FAKE_ROOT/worker$i" BERT_JAX_COORDINATOR="127.0.0.1:$port" \
        BERT_JAX_NUM_PROCESSES="$FAKE_WORKERS" BERT_JAX_PROCESS_ID="$i" JAX_NUM_CPU_DEVICES=2 \
        XLA_FLAGS="$FAKE_XLA_FLAGS" \
        ${!extra:-} bash -c "${a#--command=}")
    done ;;
  esac
done
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
    storage._fs(bucket).mkdir(bucket[5:])  # pylint: disable=protected-access
    for i in range(4):
        write_records(tmp_path / f"train-{i}.tfrecord", 48, seed=i)
        storage.copy(str(tmp_path / f"train-{i}.tfrecord"), f"{bucket}/data/train-{i}.tfrecord")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "sitecustomize.py").write_text(FAULT)
    workers = [tmp_path / f"worker{i}" for i in range(2)]
    for w in workers:
        w.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(tmp_path / "gcloud.log"),
               FAKE_ROOT=str(tmp_path), FAKE_WORKERS="2", FAKE_PY=sys.executable, FAKE_XLA_FLAGS=FAST_COMPILE,
               PYTHON=sys.executable,
               SKIP_INSTALL="1", STOP_TIMEOUT="60", TPU_NAME="rehearsal", ZONE="local", PROJECT="none",
               CONFIG="configs/test.py", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
               BERT_JAX_CACHE_DIR=str(tmp_path / "cache"), BERT_JAX_INIT_TIMEOUT="120",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("PYTHONPATH", None)  # each worker imports its own copy of the project
    yield {"bucket": bucket, "env": env, "workers": workers, "faults": faults}
    for w in workers:  # never leave a run behind
        pid_file = w / "bert_jax_run" / "pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def launch(pod, workdir, **extra_env):
    args = [f"--config.train_data={pod['bucket']}/data/train-*.tfrecord", "--config.verify_data=false",
            "--config.log_every_steps=1", "--config.checkpoint_every_steps=4", "--config.num_train_steps=12",
            "--config.shuffle_buffer_size=64"]
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


def losses(workdir) -> dict:
    return logged_losses(storage.read_text(f"{workdir}/train_log.jsonl"))


def test_preempted_pod_run_resumes_with_the_uninterrupted_losses(pod):
    bucket = pod["bucket"]
    out = wait_exit(pod, launch(pod, f"{bucket}/ref"))
    want = losses(f"{bucket}/ref")
    assert sorted(want) == list(range(1, 13)), out[-4000:]

    # A maintenance event: SIGTERM to worker 1 alone, once step 6 is logged.
    work = f"{bucket}/run"
    pids = launch(pod, work)
    deadline = time.time() + 300
    while not (storage.exists(f"{work}/train_log.jsonl") and len(losses(work)) >= 6):
        if time.time() > deadline or not all(alive(p) for p in pids):
            pytest.fail("the run did not reach step 6:\n" + logs(pod)[-4000:])
        time.sleep(0.2)
    os.kill(pids[1], signal.SIGTERM)
    out = wait_exit(pod, pids)
    saved = [int(s) for s in storage.listdir(f"{work}/checkpoints") if s.isdigit()]
    stop_step = max(saved)
    assert out.count(f"preemption/SIGTERM: saved step {stop_step}, exiting") == 2, out[-4000:]  # both workers
    # Stopped early, saved by the preemption path on both hosts (the agreed step may fall on the
    # checkpoint interval, 8 of 12 here on an idle machine: the save is still the preemption's).
    assert 6 <= stop_step < 12, (stop_step, saved)
    assert out.count(f"saving step {stop_step} because of preemption") == 2, out[-4000:]

    # The same command again: worker 1 cannot read the newest step; both fall back to the same one.
    out = wait_exit(pod, launch(pod, work, FAKE_ENV_1=f"PYTHONPATH={pod['faults']} FAULT_UNREADABLE_STEP={stop_step}"))
    fallback = max(s for s in saved if s < stop_step)
    assert out.count(f"resumed from step {fallback}") == 2, out[-4000:]
    assert "host 1" in out and "injected read error" in out
    assert [n.split("-")[0] for n in storage.listdir(f"{work}/checkpoints/damaged")] == [str(stop_step)]
    assert losses(work) == want  # bitwise, step for step
    # Each run of each worker kept its own log.
    for w in pod["workers"]:
        assert len([p for p in (w / "bert_jax_run" / "logs").iterdir() if p.name != "latest.log"]) == 3
