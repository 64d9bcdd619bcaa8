"""bert_jax/pod/supervisor.py (launch/tpu_pod.sh --watch) watching a run: failures and their budget,
exit codes it does not retry, hangs, unreachable workers, a person's stop, adoption after a restart,
maintenance. Against the stand-in gcloud and run of tests/helpers/fake_pod.py (two workers, fast polls).
tests/pod/test_supervisor_slice.py covers the slice (preemption, recreation, queued resources),
tests/pod/test_supervisor_records.py what it keeps (attempts, the lease, the code, the pins), and
tests/pod/test_pod_rehearsal.py all of it over real training, in a chaos rehearsal."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import fake_pod
from tests.helpers.fake_pod import SCRIPT, attempts, events, run_pids, starts, status_calls, wait_for, watch, when


def test_a_failing_run_is_relaunched_after_a_doubling_capped_backoff_until_max_restarts(pod):
    root, env, workdir = pod
    (root / "mode").write_text("fail")
    proc = watch(dict(env, MAX_RESTARTS="2", BACKOFF_SECONDS="0.6", MAX_BACKOFF_SECONDS="1"),
                 "--config.learning_rate=1e-4")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 3, out[-3000:]  # supervision gave up
    assert "more than MAX_RESTARTS=2: giving up" in out
    rows = attempts(workdir)
    assert [r["event"] for r in rows] == ["start", "end", "failure"] * 3 + ["gave_up"]
    ends = [r for r in rows if r["event"] == "end"]
    assert all(r["cause"] == "worker 0 failed (exit 3); worker 1 failed (exit 3)" for r in ends), ends
    failures = [r for r in rows if r["event"] == "failure"]
    assert [r["in_a_row"] for r in failures] == [1, 2, 3]  # no new checkpoint: each one counts
    assert [r["retry_in"] for r in failures] == [0.6, 1, 1]  # doubling, capped at MAX_BACKOFF_SECONDS
    # And it did wait that long (a lower bound: a loaded machine only waits longer).
    starts_ = [r for r in rows if r["event"] == "start"]
    for failure, nxt in zip(failures, starts_[1:]):
        assert when(nxt) - when(failure) >= failure["retry_in"] - 0.01, (failure, nxt)
    assert [r["install"] for r in starts_] == [True, False, False]  # same VMs: no reinstall
    assert len({r["id"] for r in rows}) == len(rows)  # every line once
    # Every attempt's logs, both workers', collected into the workdir.
    for n in (1, 2, 3):
        for w in (0, 1):
            text = (workdir / "logs" / f"attempt-{n}" / f"worker-{w}.log").read_text()
            assert f"worker {w}: crashed" in text and "--config.learning_rate=1e-4" in text
    # The first install's versions, recorded from worker 0, though the run never got going.
    assert (workdir / "constraints.txt").read_text().splitlines() == [
        "jax==0.10.2", "libtpu==0.0.42", "orbax-checkpoint==0.12.8"]
    assert json.loads((workdir / "slice.json").read_text())["accelerator_type"] == "v4-16"
    assert len(starts(root)) == 3


def test_failures_that_made_progress_do_not_use_up_the_budget(pod):
    root, env, workdir = pod
    (root / "mode").write_text("save_then_fail")  # each attempt commits a new checkpoint, then crashes
    proc = watch(dict(env, MAX_RESTARTS="1"))
    wait_for(lambda: len([r for r in attempts(workdir) if r["event"] == "failure"]) >= 4, "four failures", proc)
    (root / "mode").write_text("fail")  # now without progress: two in a row exceed MAX_RESTARTS=1
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 3, out[-3000:]  # supervision gave up
    failures = [r for r in attempts(workdir) if r["event"] == "failure"]
    assert [r["in_a_row"] for r in failures[:4]] == [1, 1, 1, 1], failures
    assert [r["in_a_row"] for r in failures[-2:]] == [1, 2]
    assert len(failures) >= 5 and attempts(workdir)[-1]["event"] == "gave_up"


@pytest.mark.parametrize("code,meaning", [(78, "refused config"), (80, "non-finite loss"), (81, "diverged")])
def test_an_exit_code_that_a_rerun_cannot_get_past_stops_supervision_at_once(pod, code, meaning):
    root, env, workdir = pod
    (root / "mode").write_text(f"exit={code}")
    proc = watch(dict(env, BACKOFF_SECONDS="60"))  # a retry would wait a minute: there is none
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 3, out[-3000:]  # supervision gave up
    assert events(workdir) == [(1, "start"), (1, "end"), (1, "gave_up")]
    gave_up = attempts(workdir)[-1]
    assert f"exit code {code} is {meaning}" in gave_up["cause"] and "not retried" in gave_up["cause"]
    assert len(starts(root)) == 1


def test_a_run_without_progress_past_its_budget_is_hung_and_relaunched(pod):
    root, env, workdir = pod
    proc = watch(dict(env, STARTUP_SECONDS="4", HANG_MIN_SECONDS="1", HANG_FACTOR="3"))
    wait_for(lambda: any(r["event"] == "failure" for r in attempts(workdir)), "the hang", proc)
    end = next(r for r in attempts(workdir) if r["event"] == "end")
    assert end["cause"].startswith("hung: no progress for") and "from the start to the first signal" in end["cause"]
    assert end["workers"] == {"0": "running", "1": "running"}  # alive, going nowhere: stopped (SIGTERM)
    assert any("STOP_BY=supervisor" in c[-1] and "tpu_worker.sh stop" in c[-1] for c in fake_pod.calls(root))
    # The relaunched run makes progress (a train_log.jsonl line every 0.2 s): never hung, over 40
    # lines (8 s, twice the startup budget, at the worker's pace: a loaded machine slows both).
    (root / "progress").touch()
    wait_for(lambda: len(starts(root)) == 2, "the relaunch", proc)
    log = workdir / "train_log.jsonl"
    lines = lambda: len(log.read_text().splitlines()) if log.exists() else 0  # noqa: E731
    wait_for(lambda: lines() >= 40, "40 lines of progress", proc)
    assert [r["event"] for r in attempts(workdir)].count("failure") == 1
    (root / "finish").touch()
    assert proc.wait(timeout=30) == 0


def test_a_worker_unreachable_over_ssh_is_watched_through_the_others_then_counted_lost(pod):
    root, env, workdir = pod
    proc = watch(dict(env, UNREACHABLE_POLLS="6", BACKOFF_SECONDS="2", MAX_BACKOFF_SECONDS="2"))
    wait_for(lambda: status_calls(root) >= 2, "a first poll", proc)
    (root / "unreachable.1").touch()  # worker 1 stops answering; its run goes on
    wait_for(lambda: status_calls(root) >= 4, "polls", proc)
    assert len(starts(root)) == 1 and not any(r["event"] == "end" for r in attempts(workdir))
    # Not blind meanwhile: worker 0's run fails, and that is seen and acted on.
    os.kill(run_pids(root)[0], signal.SIGKILL)
    wait_for(lambda: any(r["event"] == "end" for r in attempts(workdir)), "the end of attempt 1", proc)
    assert next(r for r in attempts(workdir) if r["event"] == "end")["cause"] == "worker 0 failed (exit 137)"
    (root / "unreachable.1").unlink()  # back before the relaunch (a 2 s backoff)
    wait_for(lambda: len(starts(root)) >= 2, "the relaunch", proc)
    polls = status_calls(root)
    wait_for(lambda: status_calls(root) >= polls + 2, "the relaunched run watched", proc)
    # Unreachable again, now for good: after UNREACHABLE_POLLS polls the attempt ends as lost.
    (root / "unreachable.1").touch()
    wait_for(lambda: sum(r["event"] == "end" for r in attempts(workdir)) == 2, "the end of attempt 2", proc)
    assert [r for r in attempts(workdir) if r["event"] == "end"][1]["cause"] == "worker(s) 1 unreachable for 6 polls"
    (root / "unreachable.1").unlink()
    wait_for(lambda: len(starts(root)) >= 3, "the third attempt", proc)
    (root / "finish").touch()
    assert proc.wait(timeout=30) == 0


def test_a_run_killed_with_its_shell_is_stopped_everywhere_and_its_log_collected(pod):
    """Worker 0's run and the shell that watches it killed together (no exit code, no last upload):
    the supervisor stops worker 1's run and collects both logs itself."""
    root, env, workdir = pod
    proc = watch(dict(env, LOG_SYNC_SECONDS="3600"))  # no periodic upload: only the supervisor's collect
    wait_for(lambda: status_calls(root) >= 2, "the running attempt", proc)
    shell = int((root / "worker0/bert_jax_run/shell_pid").read_text())
    os.killpg(shell, signal.SIGKILL)
    wait_for(lambda: any(r["event"] == "end" for r in attempts(workdir)), "the end of attempt 1", proc)
    end = next(r for r in attempts(workdir) if r["event"] == "end")
    assert end["cause"] == "worker 0 gone" and end["workers"] == {"0": "gone", "1": "running"}
    assert "worker 0: run started" in (workdir / "logs" / "attempt-1" / "worker-0.log").read_text()
    # Worker 1's run was stopped (SIGTERM: it saved) before the relaunch, which never found it running.
    assert "preemption/SIGTERM: saved step 4" in (workdir / "logs" / "attempt-1" / "worker-1.log").read_text()
    wait_for(lambda: len(starts(root)) == 2, "the relaunch", proc)
    (root / "finish").touch()
    assert proc.wait(timeout=30) == 0


def test_a_persons_stop_ends_supervision_and_the_run_stays_stopped(pod):
    root, env, workdir = pod
    proc = watch(env)
    wait_for(lambda: len(starts(root)) == 1 and (workdir / "constraints.txt").exists(), "the start", proc)
    r = subprocess.run(["bash", str(SCRIPT), "--stop"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "stopped by tpu_pod.sh --stop" in out
    assert events(workdir) == [(1, "start"), (1, "end"), (1, "halted")]
    assert len(starts(root)) == 1


def test_a_restarted_supervisor_adopts_the_run_and_a_maintenance_stop_is_relaunched(pod):
    root, env, workdir = pod
    proc = watch(env)
    wait_for(lambda: all((root / f"worker{i}/bert_jax_run/pid").exists() for i in (0, 1)), "the runs", proc)
    wait_for(lambda: (workdir / "constraints.txt").exists(), "the versions", proc)
    proc.send_signal(signal.SIGTERM)  # the supervisor's session ends; the run goes on
    out = proc.communicate(timeout=30)[0]
    assert "the run goes on without supervision" in out
    pids = run_pids(root)
    assert all(Path(f"/proc/{p}").exists() for p in pids)
    # Restarted while worker 1 cannot be reached: a run it cannot see is not stopped.
    (root / "unreachable.1").touch()
    log = root / "gcloud.log"
    polls, stops = log.read_text().count("tpu_worker.sh status"), log.read_text().count("tpu_worker.sh stop")
    proc = watch(env)  # (UNREACHABLE_POLLS: 5)
    wait_for(lambda: log.read_text().count("tpu_worker.sh status") >= polls + 3, "polls", proc)
    assert log.read_text().count("tpu_worker.sh stop") == stops
    (root / "unreachable.1").unlink()
    wait_for(lambda: log.read_text().count("tpu_worker.sh status") >= polls + 6, "more polls", proc)
    assert len(starts(root)) == 1  # adopted, not relaunched
    # A maintenance event: SIGTERM on every worker; each saves and exits 0.
    for p in pids:
        os.kill(p, signal.SIGTERM)
    wait_for(lambda: len(starts(root)) == 2, "the relaunch", proc)
    (root / "finish").touch()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "adopting attempt 1" in out
    assert events(workdir) == [(1, "start"), (1, "end"), (2, "start"), (2, "end"), (2, "done")]
    rows = [r for r in attempts(workdir) if r["event"] != "maintenance"]
    assert rows[1]["cause"].startswith("stopped after saving on SIGTERM")
    assert rows[1]["workers"] == {"0": "stopped 0", "1": "stopped 0"}
    assert not rows[2]["install"] and not any(r["event"] == "failure" for r in rows)


def test_announced_maintenance_and_health_are_recorded(pod):
    root, env, workdir = pod
    proc = watch(env)
    wait_for(lambda: len(starts(root)) == 1, "the start", proc)
    upcoming = {"type": "SCHEDULED", "maintenanceStatus": "PENDING", "windowStartTime": "2026-12-08T02:00:00Z"}
    (root / "node_extra.json").write_text(json.dumps({"health": "HEALTHY", "upcomingMaintenance": upcoming}))
    wait_for(lambda: any(r["event"] == "maintenance" for r in attempts(workdir)), "the record", proc)
    (root / "node_extra.json").unlink()
    wait_for(lambda: sum(r["event"] == "maintenance" for r in attempts(workdir)) == 2, "its end", proc)
    rows = [r for r in attempts(workdir) if r["event"] == "maintenance"]
    assert rows[0]["upcomingMaintenance"] == upcoming and rows[1]["health"] == "HEALTHY"
    (root / "finish").touch()
    assert proc.wait(timeout=30) == 0
