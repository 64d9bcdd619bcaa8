"""launch/tpu_pod.sh against a stand-in `gcloud`: the environment check, the three gcloud calls,
and the remote command as a worker's shell would run it (overrides with glob characters and
spaces arrive unchanged)."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "tpu_pod.sh"

# Records each call (arguments NUL-separated, one call per line) and, for `ssh --command=...`,
# runs the command with bash in $FAKE_WORKER, as the TPU worker's login shell would.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
printf '%s\0' "$@" >> "$FAKE_LOG"; printf '\n' >> "$FAKE_LOG"
for a in "$@"; do
  case "$a" in --command=*) (cd "$FAKE_WORKER" && bash -c "${a#--command=}") || exit 1 ;; esac
done
"""
# The worker's python3: records its arguments, one per line.
FAKE_PYTHON = r"""#!/usr/bin/env bash
printf '%s\n' "$@" >> "$FAKE_PY_LOG"
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "gcloud", FAKE_GCLOUD)
    _executable(bin_dir / "python3", FAKE_PYTHON)
    worker = tmp_path / "worker"  # a fresh worker: no project folder yet
    worker.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(tmp_path / "gcloud.log"),
               FAKE_PY_LOG=str(tmp_path / "python.log"), FAKE_WORKER=str(worker),
               TPU_NAME="my-v4-32", ZONE="us-central2-b", PROJECT="my-project", CONFIG="configs/large.py",
               WORKDIR="gs://bucket/my run")
    return tmp_path, env


def test_missing_environment_variable_is_named_and_nothing_runs(fake):
    tmp, env = fake
    del env["ZONE"]
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "ZONE is required" in r.stderr
    assert not (tmp / "gcloud.log").exists()


def test_copies_installs_and_starts_on_every_worker(fake):
    tmp, env = fake
    overrides = ["--config.train_data=gs://bucket/data/train-*.tfrecord", "--config.learning_rate=1e-4",
                 "--config.phases=({'fraction': 0.9},)"]
    r = subprocess.run(["bash", str(SCRIPT), *overrides], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    calls = [line.split("\0")[:-1] for line in (tmp / "gcloud.log").read_text().splitlines()]
    assert [c[:4] for c in calls] == [["compute", "tpus", "tpu-vm", "ssh"], ["compute", "tpus", "tpu-vm", "scp"],
                                      ["compute", "tpus", "tpu-vm", "ssh"], ["compute", "tpus", "tpu-vm", "ssh"]]
    assert calls[0][-1] == "--command=mkdir -p bert_jax" and (tmp / "worker" / "bert_jax").is_dir()
    calls = calls[1:]
    for c in calls:
        assert {"--zone=us-central2-b", "--project=my-project", "--worker=all"} <= set(c)
    scp = calls[0]
    assert scp[-1] == "my-v4-32:bert_jax/"
    assert {"setup.py", "bert_jax", "data_pipeline", "configs"} <= set(scp)
    assert calls[1][4] == "my-v4-32" and "pip install -q -e '.[tpu]'" in calls[1][-1]
    # What the worker ran: the entry point with the config, workdir, multi-host on, and every
    # override exactly as given here (no glob expansion, no word splitting on the worker).
    argv = (tmp / "python.log").read_text().splitlines()
    pip, main = argv[:6], argv[6:]
    assert pip == ["-m", "pip", "install", "-q", "-e", ".[tpu]"]
    assert main[:2] == ["-m", "bert_jax.main"]
    assert main[2:] == ["--config=configs/large.py", "--workdir=gs://bucket/my run", "--multihost=true", *overrides]


@pytest.mark.parametrize("env,tasks", [
    ({}, 0),
    ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, 0),  # one task: trains alone
    ({"SLURM_NTASKS": "8", "SLURM_PROCID": "3"}, 8),  # srun of 8 tasks
    ({"SLURM_NTASKS": "8"}, 0),  # salloc's shell, not a task: no rank to join with
    ({"SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, 2),  # this step's tasks
    ({"OMPI_COMM_WORLD_SIZE": "4"}, 4),  # mpirun -np 4
])
def test_multihost_auto_detects_slurm_and_open_mpi_tasks(monkeypatch, env, tasks):
    from bert_jax import main
    for var in ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert main.cluster_tasks() == tasks
