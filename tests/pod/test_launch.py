"""launch/tpu_pod.sh against a stand-in `gcloud`: the environment check, the gcloud calls in order,
--dry_run, the run detached from the SSH session with its log kept, a stale run stopped before a
new start, and the remote command as a worker's shell would run it (overrides with glob
characters and spaces arrive unchanged). tests/pod/test_pod_rehearsal.py runs the real thing: two
workers training against an emulated bucket, preempted and relaunched."""

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "tpu_pod.sh"

# Records each call (arguments NUL-separated, one call per line); `scp` copies its sources into
# $FAKE_WORKER/<destination>, `ssh --command=...` runs the command with bash in $FAKE_WORKER (the
# worker's home), as the TPU worker's login shell would.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
printf '%s\0' "$@" >> "$FAKE_LOG"; printf '\n' >> "$FAKE_LOG"
if [ "$4" = scp ]; then
  srcs=(); for a in "${@:5}"; do case "$a" in --*) ;; *) srcs+=("$a") ;; esac; done
  dest="$FAKE_WORKER/${srcs[-1]#*:}"; unset 'srcs[-1]'
  cp -r "${srcs[@]}" "$dest"
fi
for a in "$@"; do
  case "$a" in --command=*) (cd "$FAKE_WORKER" && HOME="$FAKE_WORKER" bash -c "${a#--command=}") || exit 1 ;; esac
done
"""
# The worker's python3: records its arguments, one per line; as `-m bert_jax.main` it stays up
# like a training run until SIGTERM, which it records.
FAKE_PYTHON = r"""#!/usr/bin/env bash
printf '%s\n' "$@" >> "$FAKE_PY_LOG"
if [ "$1 $2" = "-m bert_jax.main" ]; then
  trap 'echo "SIGTERM $$" >> "$FAKE_PY_LOG.signals"; exit 0' TERM
  sleep 300 & wait
fi
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
               WORKDIR="gs://bucket/my run", STOP_TIMEOUT="20")
    yield tmp_path, env
    pid_file = worker / "bert_jax_run" / "pid"  # never leave a fake run behind
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _launch(env, *args):
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def _calls(tmp):
    return [line.split("\0")[:-1] for line in (tmp / "gcloud.log").read_text().splitlines()]


def _start_worker(tmp_path: Path, run: str, extra: str = "") -> tuple[Path, Path]:
    """`tpu_worker.sh start` with a stand-in python: `python -m ...` (the run) is the bash `run`;
    `extra` (bash) sees the other calls first; anything else is the real python. Returns the run
    folder and where its log is uploaded."""
    import sys
    run_dir, dest = tmp_path / "run", tmp_path / "dest"
    _executable(tmp_path / "python", f'#!/bin/bash\nif [ "$1" = -m ]; then {run}\nfi\n{extra}'
                                     f'exec {sys.executable} "$@"\n')
    env = dict(os.environ, RUN_DIR=str(run_dir), PYTHON=str(tmp_path / "python"), LOG_DEST=str(dest),
               LOG_SYNC_SECONDS="1", TPU_WORKER_ID="0")
    subprocess.run(["bash", str(ROOT / "launch" / "tpu_worker.sh"), "start", "--config=x"], env=env, check=True,
                   capture_output=True, timeout=60)
    return run_dir, dest


def _wait_for(predicate, what, timeout=20):
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    return state != "Z"


def test_missing_environment_variable_is_named_and_nothing_runs(fake):
    tmp, env = fake
    del env["ZONE"]
    r = _launch(env)
    assert r.returncode == 2
    assert "ZONE is required" in r.stderr
    assert not (tmp / "gcloud.log").exists()


OVERRIDES = ["--config.train_data=gs://bucket/data/train-*.tfrecord", "--config.learning_rate=1e-4",
             "--config.phases=({'fraction': 0.9},)"]


def test_stops_copies_installs_and_starts_detached_on_every_worker(fake):
    tmp, env = fake
    r = _launch(env, *OVERRIDES)
    assert r.returncode == 0, r.stderr
    calls = _calls(tmp)
    assert [c[3] for c in calls] == ["ssh", "scp", "ssh", "scp", "ssh", "ssh"]
    for c in calls:
        assert c[:3] == ["compute", "tpus", "tpu-vm"]
        assert c[3] == "scp" or c[4] == "my-v4-32"
        assert {"--zone=us-central2-b", "--project=my-project", "--worker=all"} <= set(c)
    assert calls[0][-1] == "--command=mkdir -p bert_jax/launch"
    assert calls[1][-2:] == ["launch/tpu_worker.sh", "my-v4-32:bert_jax/launch/"]
    assert calls[2][-1].endswith("bash launch/tpu_worker.sh stop")
    assert {"setup.py", "bert_jax", "data_pipeline", "configs", "launch"} <= set(calls[3])
    assert calls[3][-1] == "my-v4-32:bert_jax/"
    assert "pip install -q -e '.[tpu,gcs]'" in calls[4][-1]
    # The worker ran the entry point with the config, workdir, multi-host on, and every override
    # exactly as given here (no glob expansion, no word splitting on the worker) ...
    log = tmp / "python.log"
    _wait_for(lambda: log.exists() and "--multihost=true" in log.read_text(), "the run to start")
    argv = log.read_text().splitlines()
    pip, main = argv[:6], argv[6:]
    assert pip == ["-m", "pip", "install", "-q", "-e", ".[tpu,gcs]"]
    _wait_for(lambda: len(log.read_text().splitlines()) >= 6 + 5 + len(OVERRIDES), "all arguments")
    main = log.read_text().splitlines()[6:]
    assert main == ["-m", "bert_jax.main", "--config=configs/large.py", "--workdir=gs://bucket/my run",
                    "--multihost=true", *OVERRIDES]
    # ... detached: still running after the launcher (the SSH session) ended, in a session of its
    # own (no SIGHUP when SSH closes), with its output in a log that is kept.
    run_dir = tmp / "worker" / "bert_jax_run"
    pid = int((run_dir / "pid").read_text())
    # (the session's leader is the shell that waits on the run to record its exit code)
    assert _alive(pid) and _alive(os.getsid(pid)) and os.getsid(pid) != os.getsid(0)
    logs = sorted((run_dir / "logs").glob("*.log"))
    assert (run_dir / "logs" / "latest.log").resolve() in [p.resolve() for p in logs]


def test_a_rerun_stops_the_stale_run_first_and_keeps_its_log(fake):
    tmp, env = fake
    env["SKIP_INSTALL"] = "1"
    assert _launch(env).returncode == 0
    run_dir = tmp / "worker" / "bert_jax_run"
    _wait_for(lambda: (run_dir / "pid").exists(), "the first run")
    first = int((run_dir / "pid").read_text())
    _wait_for(lambda: _alive(first), "the first run to be up")
    time.sleep(1.1)  # log names carry the second
    r = _launch(env)
    assert r.returncode == 0, r.stderr
    assert f"stopping run {first}" in r.stdout
    signals = (tmp / "python.log.signals").read_text()
    assert f"SIGTERM {first}" in signals  # a graceful stop: bert_jax saves a checkpoint on SIGTERM
    assert not _alive(first)
    second = int((run_dir / "pid").read_text())
    assert second != first and _alive(second)
    assert len(list((run_dir / "logs").glob("*-*.log"))) == 2  # the first run's log is kept
    assert not any("pip" in line for line in (tmp / "python.log").read_text().splitlines())  # SKIP_INSTALL
    # --status and --stop reach the same run.
    status = _launch(env, "--status")
    assert status.returncode == 0 and f"running (pid {second})" in status.stdout
    assert _launch(env, "--stop").returncode == 0
    assert not _alive(second) and f"SIGTERM {second}" in (tmp / "python.log.signals").read_text()
    assert "not running" in _launch(env, "--status").stdout


def test_dry_run_prints_every_command_and_runs_none(fake):
    tmp, env = fake
    r = _launch(env, "--dry_run", *OVERRIDES)
    assert r.returncode == 0, r.stderr
    assert not (tmp / "gcloud.log").exists() and list((tmp / "worker").iterdir()) == []
    lines = r.stdout.splitlines()
    assert len(lines) == 6 and all(line.startswith("gcloud compute tpus tpu-vm ") for line in lines)
    # Each printed line is the command as the shell would run it: parsing it gives the same
    # arguments a real run sends.
    r2 = _launch(env, *OVERRIDES)
    assert r2.returncode == 0
    printed = [subprocess.run(["bash", "-c", f"printf '%s\\0' {line[len('gcloud '):]}"], capture_output=True,
                              text=True).stdout.split("\0")[:-1] for line in lines]
    assert printed == _calls(tmp)


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


@pytest.mark.parametrize("env", [
    {"BERT_JAX_COORDINATOR": "127.0.0.1:1234", "BERT_JAX_NUM_PROCESSES": "2", "BERT_JAX_PROCESS_ID": "1"},
    {"TPU_WORKER_HOSTNAMES": "t1v-n-0,t1v-n-1"},  # a multi-host Cloud TPU VM: jax finds the coordinator
])
def test_distributed_timeouts_apply_on_every_coordinator_path(monkeypatch, env):
    import jax

    from bert_jax import main
    for var in ("BERT_JAX_COORDINATOR", "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {**env, "BERT_JAX_INIT_TIMEOUT": "17", "BERT_JAX_HEARTBEAT_TIMEOUT": "23"}.items():
        monkeypatch.setenv(var, value)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    main.init_distributed("auto")
    assert len(calls) == 1
    assert calls[0]["initialization_timeout"] == 17 and calls[0]["heartbeat_timeout_seconds"] == 23


def test_status_on_a_fresh_worker_reports_it_instead_of_failing(fake):
    tmp, env = fake  # the worker has no project copy yet (a new or recreated VM)
    r = _launch(env, "--status")
    assert r.returncode == 0, r.stderr
    assert "no bert_jax in ~/bert_jax" in r.stdout and "bert_jax-worker ? none" in r.stdout
    assert _launch(env, "--stop").returncode == 0


def test_remote_dir_under_home_is_the_same_folder_for_ssh_and_scp(fake):
    tmp, env = fake
    env.update(REMOTE_DIR="~/runs/bert", SKIP_INSTALL="1")
    r = _launch(env)
    assert r.returncode == 0, r.stderr
    calls = _calls(tmp)
    assert calls[0][-1] == "--command=mkdir -p runs/bert/launch" and calls[1][-1] == "my-v4-32:runs/bert/launch/"
    assert calls[3][-1] == "my-v4-32:runs/bert/" and calls[-1][-1].startswith("--command=cd runs/bert &&")
    assert not any("~" in a for c in calls for a in c)
    # The worker script lands where the commands look for it, and the run starts.
    _wait_for(lambda: (tmp / "worker" / "bert_jax_run" / "pid").exists(), "the run")
    assert (tmp / "worker" / "runs" / "bert" / "launch" / "tpu_worker.sh").exists()
    for bad in ("/opt/bert", "~other/bert", "../bert"):
        r = _launch(dict(env, REMOTE_DIR=bad), "--dry_run")
        assert r.returncode == 2 and "REMOTE_DIR" in r.stderr and r.stdout == ""


def test_internal_ip_and_iap_reach_every_worker(fake):
    tmp, env = fake
    r = _launch(dict(env, INTERNAL_IP="1", IAP="1"), "--dry_run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 6 and all("--internal-ip --tunnel-through-iap" in line for line in lines)


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to the user nobody (needs root)")
def test_stop_keeps_libtpu_lock_while_a_process_of_another_user_holds_the_tpu(tmp_path):
    """On a TPU VM the run's user is not root, and what holds the TPU may be root's: `kill -0` on it
    answers EPERM, which must not read as "exited" (the lock would be removed under a live holder)."""
    import shutil
    import tempfile
    home = Path(tempfile.mkdtemp(prefix="bert_jax_nobody_"))  # pytest's tmp_path is not nobody's to read
    try:
        (home / "launch").mkdir()
        shutil.copy(ROOT / "launch" / "tpu_worker.sh", home / "launch")
        device, lock = home / "accel0", home / "libtpu_lockfile"
        device.touch()
        lock.touch()
        # root's holder: ignores SIGTERM, and nobody may not signal it anyway.
        holder = subprocess.Popen(["bash", "-c", "trap '' TERM; exec 3<\"$0\"; sleep 60", str(device)])
        bin_dir = home / "bin"
        bin_dir.mkdir()
        _executable(bin_dir / "lsof", f"#!/bin/sh\necho {holder.pid}\n")  # nobody's lsof cannot see root's files
        for p in (home, bin_dir, home / "launch", lock):
            os.chmod(p, 0o777)
        os.chmod(bin_dir / "lsof", 0o755)
        env = dict(os.environ, HOME=str(home), PATH=f"{bin_dir}:/usr/bin:/bin", TPU_DEVICES=str(device),
                   LIBTPU_LOCKFILE=str(lock), HOLDER_TIMEOUT="1", RUN_DIR=str(home / "run"))
        try:
            r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash",
                                str(home / "launch" / "tpu_worker.sh"), "stop"],
                               env=env, capture_output=True, text=True, timeout=60)
            assert holder.poll() is None  # nobody could not stop it ...
            assert lock.exists(), r.stdout + r.stderr  # ... so its lock stays
            assert f"processes {holder.pid} still hold the TPU" in r.stderr and r.returncode != 0
        finally:
            holder.kill()
            holder.wait()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_run_s_shell_uploads_its_own_log_even_after_the_next_run_has_started(tmp_path):
    """The shell that watches a run uploads the run's log every LOG_SYNC_SECONDS and when it ends.
    If the supervisor starts the next attempt while that shell sleeps, latest.log points to the
    next run's log: the upload must still send this run's (seen once in a pod rehearsal: attempt
    1's worker-0.log held attempt 2's "resumed from step 4")."""
    run_dir, dest = _start_worker(tmp_path, 'echo "the first run\'s log"; sleep 2; exit 0')
    # The next run's start, as it links its own log (its shell is not needed here).
    (run_dir / "logs" / "next.log").write_text("the next run's log\n")
    os.symlink("next.log", run_dir / "logs" / "latest.tmp")
    os.replace(run_dir / "logs" / "latest.tmp", run_dir / "logs" / "latest.log")
    shell = int((run_dir / "shell_pid").read_text())
    deadline = time.time() + 60
    while Path(f"/proc/{shell}").exists() and time.time() < deadline:  # the run ends, its shell uploads
        time.sleep(0.1)
    time.sleep(1.5)  # a sync that woke after the run ended (it checks the run before it sleeps)
    assert (run_dir / "exit_code").read_text().strip() == "0"
    assert (dest / "worker-0.log").read_text() == "the first run's log\n"


def test_the_run_s_shell_outlives_a_shutdown_s_sigterm_to_write_the_exit_code_and_upload_the_log(tmp_path):
    """An OS shutdown (a maintenance event) SIGTERMs every process of the VM: the run saves and exits
    0, and the shell that watches it must live on to write that exit code and upload the whole log
    (without them the supervisor sees a run "gone", not one stopped after saving)."""
    run_dir, dest = _start_worker(tmp_path, 'trap \'echo "saved step 4, exiting"; exit 0\' TERM\n'
                                            '  echo "training"; while :; do sleep 0.1; done')
    shell = int((run_dir / "shell_pid").read_text())
    _wait_for(lambda: "training" in (run_dir / "logs" / "latest.log").read_text(), "the run")
    os.killpg(shell, signal.SIGTERM)  # every process of the run's session at once, the shell included
    _wait_for(lambda: (run_dir / "exit_code").exists(), "the exit code")
    assert (run_dir / "exit_code").read_text().strip() == "0"
    _wait_for(lambda: not Path(f"/proc/{shell}").exists(), "the shell's end")
    assert "saved step 4, exiting" in (dest / "worker-0.log").read_text()


def test_the_final_log_upload_is_never_overwritten_by_an_older_periodic_one(tmp_path):
    """A periodic upload that started while the run was alive and lands after it ended (a slow
    link) must not replace the final, whole log with its older copy."""
    # The run logs a line, lives 1.5 s, logs its last line. An upload reads its source at once and
    # lands 2 s later while the run is alive (a slow link), at once after.
    run_dir, dest = _start_worker(
        tmp_path, f'echo "line 1"; sleep 1.5; echo "line 2, the last"; touch {tmp_path}/ended; exit 0',
        extra=f'if [ "$1" = -c ]; then copy=$(cat "$3"); [ -e {tmp_path}/ended ] || sleep 2; '
              'mkdir -p "$4"; printf "%s\\n" "$copy" > "$4/$5"; exit 0; fi\n')
    shell = int((run_dir / "shell_pid").read_text())
    _wait_for(lambda: not Path(f"/proc/{shell}").exists(), "the shell's end")
    time.sleep(2.5)  # anything still in flight lands
    assert (dest / "worker-0.log").read_text() == "line 1\nline 2, the last\n"


def test_status_is_on_a_line_of_its_own_after_a_log_that_ends_mid_line(tmp_path):
    """A run's log ends with a progress bar's line and no newline: the status line the supervisor
    reads must not be glued to it (worker 0 looked unanswered, and its run was restarted)."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "latest.log").write_text("step 3\nphase 1/1: 15%|#5   | 3/20 [00:02<00:12]")
    r = subprocess.run(["bash", str(ROOT / "launch" / "tpu_worker.sh"), "status"], capture_output=True, text=True,
                       env=dict(os.environ, RUN_DIR=str(run_dir), TPU_WORKER_ID="0"), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "bert_jax-worker 0 gone" in [line.strip() for line in r.stdout.splitlines()], r.stdout
