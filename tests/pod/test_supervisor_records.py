"""What keeps bert_jax/pod/supervisor.py alive and honest: its calls bounded (a timed-out child killed
with its whole process group, storage calls retried and given up in time), a frozen bucket that
neither kills it nor loses or repeats a line of attempts.jsonl (even across a supervisor killed
with lines queued), the lease (one supervisor per workdir, taken over only when stale), the guard
around each poll, the project snapshot every attempt ships, and the versions a reinstall is pinned
to (the freeze retried until recorded; the newest checkpoint's versions without it; an unpinned
reinstall refused)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import fake_pod
from bert_jax.pod import calls, pins, supervisor
from data_pipeline import storage
from tests.helpers.fake_pod import attempts, lose, starts, wait_for, watch

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# Bounded calls
# ---------------------------------------------------------------------------------------------


def test_a_child_past_its_time_limit_is_killed_with_its_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild"
    r = calls.run(["bash", "-c", f"sleep 300 & echo $! > {pid_file}; wait"], timeout=1)
    assert r.returncode == 124 and "killed after 1 s" in r.stderr
    grandchild = int(pid_file.read_text())
    deadline = time.time() + 10
    while Path(f"/proc/{grandchild}").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{grandchild}").exists()  # gcloud's ssh, not only the shell
    assert calls.run(["true"], timeout=10).returncode == 0
    assert calls.run(["/nonexistent/gcloud"], timeout=10).returncode == 127


def test_storage_calls_are_retried_with_backoff_and_given_up_in_time():
    waits = []
    io = calls.Storage(timeout=1, tries=3, backoff=0.5, sleep=waits.append)
    tries = []

    def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise TimeoutError("the bucket did not answer")
        return "done"

    assert io.call("a flaky read", flaky) == "done" and waits == [0.5, 1.0]
    with pytest.raises(calls.Unavailable, match="would wait for itself"):  # never a deadlock
        io.call("an outer call", lambda: io.call("an inner call", lambda: "never"))
    with pytest.raises(FileNotFoundError):  # an answer, not a failure: no retry
        io.call("a missing file", lambda: (_ for _ in ()).throw(FileNotFoundError("x")))
    with pytest.raises(calls.Unavailable, match="a broken write: OSError: 503"):
        io.call("a broken write", lambda: (_ for _ in ()).throw(OSError("503")))
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(calls.Unavailable, match="no answer within 1 s"):
        io.call("a stalled read", release.wait)
    with pytest.raises(calls.Unavailable, match="still waiting on a stalled read"):  # fails at once, no queue
        io.call("the next read", lambda: "never")
    assert time.monotonic() - started < 30  # bounded (generous: only a hang would pass it)
    release.set()
    deadline = time.time() + 10
    while True:  # the stalled call returns; the thread is free again
        try:
            assert io.call("a read after it", lambda: "ok") == "ok"
            break
        except calls.Unavailable:
            assert time.time() < deadline
            time.sleep(0.1)
    io.close()


def test_a_poll_that_fails_is_logged_and_retried_and_too_many_in_a_row_end_supervision(pod, monkeypatch):
    root, env, workdir = pod
    monkeypatch.setattr(supervisor.time, "sleep", lambda s: None)
    sup = supervisor.Supervisor([], dict(env, MAX_INTERNAL_ERRORS="3"))
    outcomes = iter([KeyError("one bad poll"), None, None, ValueError("a"), ValueError("b"), ValueError("c")])

    def poll():
        error = next(outcomes)
        if error is not None:
            raise error

    sup.poll = poll
    with pytest.raises(supervisor.Stop, match="3 internal errors in a row; the last: ValueError: c"):
        sup.loop()
    sup.attempts.flush()
    rows = attempts(workdir)
    assert [(r["event"], r.get("in_a_row")) for r in rows] == [
        ("internal_error", 1), ("internal_error", 1), ("internal_error", 2), ("internal_error", 3), ("gave_up", None)]
    sup.close()


# ---------------------------------------------------------------------------------------------
# A frozen bucket
# ---------------------------------------------------------------------------------------------


def test_a_frozen_bucket_neither_stops_the_supervisor_nor_loses_or_repeats_a_line(gcs_server, bucket, tmp_path):
    env, _ = fake_pod.supervised(tmp_path, sys.executable, str(ROOT), WORKDIR=f"{bucket}/run",
                                 BERT_JAX_GCS_TIMEOUT="1", STORAGE_TIMEOUT="1", BACKOFF_SECONDS="1",
                                 STARTUP_SECONDS="3600")
    work, emulator = f"{bucket}/run", int(os.environ["BERT_JAX_TEST_EMULATOR_PID"])

    def rows():
        return [json.loads(line) for line in storage.read_text(f"{work}/attempts.jsonl").splitlines()]

    proc = watch(env)
    try:
        wait_for(lambda: storage.exists(f"{work}/constraints.txt"), "the first start", proc)
        pid0 = int((tmp_path / "worker0/bert_jax_run/pid").read_text())
        os.kill(emulator, signal.SIGSTOP)  # the bucket stops answering
        try:
            os.kill(pid0, signal.SIGKILL)  # meanwhile a worker's run dies: end, failure, relaunch
            wait_for(lambda: len(starts(tmp_path)) == 2, "the relaunch during the outage", proc, timeout=120)
            time.sleep(3)
            assert proc.poll() is None  # alive through it
            proc.kill()  # and killed with its lines still queued (spooled locally)
            proc.wait(timeout=10)
        finally:
            os.kill(emulator, signal.SIGCONT)
        proc = watch(env)  # started again: it sends the spooled lines, adopts the run
        wait_for(lambda: [r["event"] for r in rows()].count("start") == 2, "the spooled lines", proc, timeout=120)
        (tmp_path / "finish").touch()
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        fake_pod.stop_runs(tmp_path)
    got = rows()
    assert [(r["attempt"], r["event"]) for r in got if r["event"] != "maintenance"] == [
        (1, "start"), (1, "end"), (1, "failure"), (2, "start"), (2, "end"), (2, "done")]
    assert len({r["id"] for r in got}) == len(got)  # no line twice
    assert got[1]["cause"] == "worker 0 failed (exit 137)"


# ---------------------------------------------------------------------------------------------
# The records, across a supervisor killed with lines queued
# ---------------------------------------------------------------------------------------------


def test_lines_spooled_by_a_killed_supervisor_are_sent_once(tmp_path, monkeypatch):
    monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "w" / "attempts.jsonl")
    down = calls.Storage(timeout=1, tries=1)
    down.call = lambda what, fn, *a, **k: (_ for _ in ()).throw(calls.Unavailable(what))  # an outage
    first = supervisor.Attempts(path, down, log=lambda m: None)
    first.record(event="start", attempt=1)
    first.record(event="end", attempt=1)
    assert not Path(path).exists()  # queued, spooled
    # One of them had landed before the kill (its reply lost): the file holds it already.
    storage.write_text(path, json.dumps(first.rows[0]) + "\n")
    second = supervisor.Attempts(path, calls.Storage(timeout=5), log=lambda m: None)
    assert [r["event"] for r in second.load()] == ["start", "end"]
    assert second.flush()
    written = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert written == first.rows  # both, in order, each once
    third = supervisor.Attempts(path, calls.Storage(timeout=5), log=lambda m: None)
    assert third.load() == first.rows  # the spool is empty once sent


# ---------------------------------------------------------------------------------------------
# The lease
# ---------------------------------------------------------------------------------------------


def test_one_supervisor_per_workdir_and_a_takeover_only_once_its_heartbeat_is_stale(pod):
    root, env, workdir = pod
    env = dict(env, LEASE_STALE_SECONDS="2")
    first = watch(env)
    wait_for(lambda: len(starts(root)) == 1, "the first supervisor's start", first)
    lease = json.loads((workdir / "supervisor.lease").read_text())
    second = subprocess.run(["bash", str(fake_pod.SCRIPT), "--watch"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert second.returncode == 2
    assert f"host {lease['host']}, pid {lease['pid']}, since {lease['since']}" in second.stdout
    fresh = subprocess.run(["bash", str(fake_pod.SCRIPT), "--watch", "--takeover"], env=env, capture_output=True,
                           text=True, timeout=60)  # a heartbeat younger than LEASE_STALE_SECONDS: refused
    assert fresh.returncode == 2 and "once its heartbeat is older than 2 s" in fresh.stdout, fresh.stdout
    os.kill(first.pid, signal.SIGSTOP)  # hung: its heartbeat goes stale
    try:
        refused = subprocess.run(["bash", str(fake_pod.SCRIPT), "--watch"], env=env, capture_output=True,
                                 text=True, timeout=60)  # a live process on this host: no takeover unasked
        assert refused.returncode == 2 and "--takeover" in refused.stdout
        time.sleep(2.5)
        third = watch(env, "--takeover")
        wait_for(lambda: json.loads((workdir / "supervisor.lease").read_text())["pid"] != lease["pid"],
                 "the takeover", third)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out = first.communicate(timeout=60)[0]  # the first sees the lease gone at its next heartbeat
    assert first.returncode == 2 and "was taken over by host" in out, out[-2000:]
    (root / "finish").touch()
    assert third.wait(timeout=60) == 0
    assert len(starts(root)) == 1  # the third adopted the run


# ---------------------------------------------------------------------------------------------
# The code and the versions every attempt runs
# ---------------------------------------------------------------------------------------------


def test_every_attempt_ships_the_first_start_s_snapshot_whatever_the_checkout_becomes(tmp_path):
    project = tmp_path / "checkout"
    project.mkdir()
    for name in pins.SHIPPED:
        src = ROOT / name
        shutil.copytree(src, project / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir() \
            else shutil.copy(src, project / name)
    assert pins.pack(str(project)) == pins.pack(str(project))  # deterministic
    io = calls.Storage(timeout=30)
    code = pins.Code(str(tmp_path / "workdir"), io, str(tmp_path / "cache"))
    sha, folder, taken = code.pinned(root=str(project))
    assert taken and (tmp_path / "workdir" / "code" / f"{sha}.tar.gz").exists()
    worker = (project / "launch" / "tpu_worker.sh").read_text()
    (project / "launch" / "tpu_worker.sh").write_text(worker + "\necho edited during the weekend\n")
    shutil.rmtree(tmp_path / "cache")  # another machine, or a cleaned cache: fetched from the workdir
    again, folder, taken = code.pinned(root=str(project))
    assert (again, taken) == (sha, False)
    assert (Path(folder) / "launch" / "tpu_worker.sh").read_text() == worker
    assert os.access(Path(folder) / "launch" / "tpu_pod.sh", os.X_OK)
    assert sorted(p.name for p in Path(folder).iterdir()) == sorted(pins.SHIPPED)
    updated, folder, taken = code.pinned(update=True, root=str(project))  # --update_code
    assert taken and updated != sha and "edited" in (Path(folder) / "launch" / "tpu_worker.sh").read_text()
    archive = tmp_path / "workdir" / "code" / f"{updated}.tar.gz"
    archive.write_bytes(archive.read_bytes()[:-10] + b"0123456789")  # damaged in the bucket
    shutil.rmtree(tmp_path / "cache")
    with pytest.raises(ValueError, match="does not hash to"):
        code.pinned(root=str(project))
    io.close()


def test_attempts_name_the_code_and_the_versions_are_recorded_even_without_an_install(pod):
    root, env, workdir = pod
    (root / "freeze_failures").write_text("3")  # the freeze fails three times: retried until recorded
    proc = watch(dict(env, SKIP_INSTALL="1"))
    wait_for(lambda: (workdir / "constraints.txt").exists(), "the versions", proc)
    assert not (root / "pip.0.log").read_text().count("install")  # recorded though nothing was installed
    assert (root / "freeze_failures").read_text().strip() == "0"
    start = attempts(workdir)[0]
    assert start["code"] == json.loads((workdir / "code.json").read_text())["sha256"][:16]
    (root / "finish").touch()
    assert proc.wait(timeout=30) == 0


def _checkpoint(workdir: Path, step: int, versions) -> None:
    meta = workdir / "checkpoints" / str(step) / "meta"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text(json.dumps({"step": step, **({"versions": versions} if versions else {})}))


def test_a_reinstall_without_recorded_versions_takes_the_checkpoint_s_or_is_refused(pod):
    root, env, workdir = pod
    versions = {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.0", "optax": "0.2.8",
                "orbax-checkpoint": "0.12.8", "libtpu": None}
    _checkpoint(workdir, 8, versions)
    (root / "freeze_failures").write_text("1000")  # constraints.txt never recorded
    proc = watch(env)
    fake_pod.wait_launched(root, 1, proc)
    lose(root, "PREEMPTED")
    fake_pod.wait_launched(root, 2, proc)
    start = [r for r in attempts(workdir) if r["event"] == "start"][1]
    assert start["install"] and start["pinned"] == "checkpoint step 8"
    for i in (0, 1):
        assert (root / f"used-constraints.{i}").read_text().splitlines() == [
            "flax==0.12.0", "jax==0.10.2", "jaxlib==0.10.2", "optax==0.2.8", "orbax-checkpoint==0.12.8"]
    # A newer checkpoint that records no versions: the next reinstall would be unpinned: refused.
    _checkpoint(workdir, 16, None)
    lose(root, "PREEMPTED")
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 3, out[-3000:]  # supervision gave up
    assert "refusing an unpinned reinstall" in attempts(workdir)[-1]["cause"]
    assert len(starts(root)) == 2


def test_the_systemd_unit_restarts_a_dead_supervisor_but_not_one_that_ended_on_purpose():
    """launch/bert_jax-supervisor.service: Restart=always (adoption makes a restart safe), except
    after the supervisor's deliberate ends, which must match its exit codes."""
    import configparser
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string((ROOT / "launch" / "bert_jax-supervisor.service").read_text())
    service = unit["Service"]
    assert service["Restart"] == "always"
    assert set(service["RestartPreventExitStatus"].split()) == {
        "0", str(supervisor.EXIT_HELD), str(supervisor.EXIT_GAVE_UP)}
    assert service["ExecStart"].split()[1:3] == ["launch/tpu_pod.sh", "--watch"]
    assert (ROOT / service["ExecStart"].split()[1]).exists()
