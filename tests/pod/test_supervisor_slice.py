"""bert_jax/pod/supervisor.py and the slice: a slice gone from the API recreated from its recorded spec
and reinstalled pinned, never on one bad reading, a stockout backed off and budgeted, a slow slice
awaited, a supervisor killed mid-recreation that still reinstalls, queued resources that keep their
place, a STOPPED slice started again, a slice stuck in a state recreated, a launch lost with its
slice not counted. Against tests/helpers/fake_pod.py's stand-in gcloud (whose create builds the node from
its flags alone, so a recreation that forgot one shows in describe)."""

import json
import time
from pathlib import Path


from tests.helpers import fake_pod
from bert_jax.pod import slice as pod_slice
from tests.helpers.fake_pod import attempts, events, lose, run_pids, starts, status_calls, wait_for, watch, when


def gcloud(root, *words):
    return [c for c in fake_pod.calls(root) if c[2:2 + len(words)] == list(words)]


def first_start(root, workdir, proc):
    wait_for(lambda: len(starts(root)) == 1 and (workdir / "constraints.txt").exists(), "the first start", proc)
    wait_for(lambda: all((root / f"worker{i}/bert_jax_run/pid").exists() for i in (0, 1)), "the runs", proc)


def test_a_slice_gone_from_the_api_is_recreated_from_its_recorded_spec_and_reinstalled_pinned(pod):
    root, env, workdir = pod
    proc = watch(env)
    first_start(root, workdir, proc)
    wait_for(lambda: all((workdir / "logs" / "attempt-1" / f"worker-{i}.log").exists() for i in (0, 1)),
             "the logs' first upload", proc)
    lose(root, "NOT_FOUND")  # preempted and deleted: describe has nothing to read the spec from
    wait_for(lambda: len(starts(root)) == 2, "the relaunch on the recreated slice", proc)
    (root / "finish").touch()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    calls = fake_pod.calls(root)
    delete, create = gcloud(root, "tpu-vm", "delete")[0], gcloud(root, "tpu-vm", "create")[0]
    assert calls.index(delete) < calls.index(create)
    # Not on one reading: LOST_READINGS (2) describes said NOT_FOUND before the delete.
    before = calls[:calls.index(delete)]
    assert sum(1 for c in before[-4:] if c[2:4] == ["tpu-vm", "describe"]) >= 2
    # The new node, built by the fake from the create's flags alone, has the spec of the old one.
    spec = json.loads((workdir / "slice.json").read_text())
    assert pod_slice.Slice.spec_of(json.loads((root / "node.json").read_text())) == spec
    assert spec == pod_slice.Slice.spec_of(fake_pod.NODE)
    assert (root / "create_saw_needs_install").exists()  # "needs install" was written before the create
    # Reinstalled on both new VMs, pinned to what the first install recorded; the flag cleared after.
    for i in (0, 1):
        assert (root / f"used-constraints.{i}").read_text() == (workdir / "constraints.txt").read_text()
        assert "-c constraints.txt -e .[tpu,gcs]" in (root / f"pip.{i}.log").read_text()
    assert not (workdir / "needs_install.json").exists()
    assert events(workdir) == [(1, "start"), (1, "end"), (1, "recreate"), (2, "start"), (2, "end"), (2, "done")]
    rows = [r for r in attempts(workdir) if r["event"] != "maintenance"]
    assert rows[1]["cause"] == "slice NOT_FOUND" and rows[3]["why"] == "slice recreated after NOT_FOUND"
    assert rows[3]["install"] and rows[3]["pinned"] == "constraints.txt" and rows[4]["cause"] == "finished"
    assert "worker 1: run started" in (workdir / "logs" / "attempt-1" / "worker-1.log").read_text()


def test_one_odd_reading_or_a_message_that_merely_says_not_found_never_touches_the_slice(pod):
    root, env, workdir = pod
    proc = watch(dict(env, LOST_READINGS="3"))
    first_start(root, workdir, proc)
    (root / "describe_noise").touch()
    (root / "describe_errors").write_text("4")  # "...credentials file not found": not gcloud's NOT_FOUND
    wait_for(lambda: (root / "describe_errors").read_text().strip() == "0", "the noisy describes", proc)
    (root / "state_once").write_text("PREEMPTED")  # one reading of a lost slice, then READY again
    wait_for(lambda: not (root / "state_once").exists(), "the odd reading", proc)
    polls = len(gcloud(root, "tpu-vm", "describe"))
    wait_for(lambda: len(gcloud(root, "tpu-vm", "describe")) >= polls + 4, "more polls", proc)
    assert not gcloud(root, "tpu-vm", "delete") and not gcloud(root, "tpu-vm", "create")
    assert len(starts(root)) == 1 and all(Path(f"/proc/{p}").exists() for p in run_pids(root))
    (root / "finish").touch()
    assert proc.wait(timeout=30) == 0


def test_a_stockout_is_backed_off_and_recorded_then_a_slow_slice_is_awaited(pod):
    root, env, workdir = pod
    proc = watch(dict(env, BACKOFF_SECONDS="0.5", MAX_BACKOFF_SECONDS="0.8"))
    first_start(root, workdir, proc)
    (root / "create_failures").write_text("3")
    (root / "create_delay").write_text("3")  # then CREATING for 3 s
    lose(root, "PREEMPTED")
    wait_for(lambda: len(starts(root)) == 2, "the relaunch", proc, timeout=90)
    failed = [r for r in attempts(workdir) if r["event"] == "create_failed"]
    assert [r["failures"] for r in failed] == [1, 2, 3]
    assert [r["retry_in"] for r in failed] == [0.5, 0.8, 0.8]
    assert all("RESOURCE_EXHAUSTED" in r["error"] for r in failed)
    recreates = [r for r in attempts(workdir) if r["event"] == "recreate"]
    assert [r["tries"] for r in recreates] == [1, 2, 3, 4]
    for failure, nxt in zip(failed, recreates[1:]):  # each retry waited its backoff (a lower bound)
        assert when(nxt) - when(failure) >= failure["retry_in"] - 0.01
    # The slow slice: CREATING for 3 s was waited on (no second create after the one that worked).
    assert len(gcloud(root, "tpu-vm", "create")) == 4
    start = [r for r in attempts(workdir) if r["event"] == "start"][1]
    assert start["install"] and when(start) - when(recreates[-1]) >= 3
    (root / "finish").touch()
    assert proc.wait(timeout=30) == 0


def test_creates_that_keep_failing_end_supervision_after_max_create_failures(pod):
    root, env, workdir = pod
    proc = watch(dict(env, MAX_CREATE_FAILURES="3"))
    first_start(root, workdir, proc)
    (root / "create_failures").write_text("100")
    lose(root, "TERMINATED")
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 3, out[-3000:]  # supervision gave up
    assert [r["event"] for r in attempts(workdir)].count("create_failed") == 3
    assert attempts(workdir)[-1]["event"] == "gave_up" and "MAX_CREATE_FAILURES" in attempts(workdir)[-1]["cause"]


def test_a_supervisor_killed_mid_recreation_reinstalls_once_restarted(pod):
    root, env, workdir = pod
    proc = watch(env)
    first_start(root, workdir, proc)
    (root / "create_sleep").write_text("4")  # gcloud's create takes 4 s
    lose(root, "PREEMPTED")
    wait_for(lambda: gcloud(root, "tpu-vm", "create"), "the create", proc)
    proc.kill()  # mid-recreation (its gcloud call, in a process group of its own, goes on)
    proc.wait(timeout=10)
    proc = watch(env)  # as systemd would: the lease of a dead process on this machine is taken over
    wait_for(lambda: len(starts(root)) == 2, "the relaunch", proc)
    (root / "finish").touch()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "taking over the lease" in out
    start = [r for r in attempts(workdir) if r["event"] == "start"][1]
    assert start["install"] and start["pinned"] == "constraints.txt"
    for i in (0, 1):
        assert "install" in (root / f"pip.{i}.log").read_text()  # the new VMs were installed
    rows = attempts(workdir)
    assert [r["attempt"] for r in rows if r["event"] == "end"] == [1, 2]  # attempt 1 ended once
    assert len({r["id"] for r in rows}) == len(rows)


def test_a_queued_resource_keeps_its_place_while_it_waits_and_is_queued_again_when_it_failed(pod):
    root, env, workdir = pod
    node = dict(fake_pod.NODE, queuedResource="projects/p/locations/z/queuedResources/my-qr")
    env = dict(env, FAKE_NODE=json.dumps(node), READY_TIMEOUT="2")
    proc = watch(env)
    first_start(root, workdir, proc)
    assert json.loads((workdir / "slice.json").read_text())["queued_resource"] == "my-qr"
    (root / "queued_state").write_text("WAITING_FOR_RESOURCES")  # its node gone, the request queued
    lose(root, "READY")
    time.sleep(5)  # more than READY_TIMEOUT: a wait in the queue is not a stuck slice
    assert not gcloud(root, "queued-resources", "delete") and not gcloud(root, "queued-resources", "create")
    assert gcloud(root, "queued-resources", "describe")
    (root / "queued_state").write_text("ACTIVE")  # capacity: the node comes up (new VMs)
    wait_for(lambda: len(starts(root)) == 2, "the relaunch", proc)
    polls = status_calls(root)
    wait_for(lambda: status_calls(root) > polls, "the relaunched run watched", proc)  # launched whole
    assert [r for r in attempts(workdir) if r["event"] == "start"][1]["install"]
    # A request that failed is queued again: deleted and created through the queued resource.
    (root / "queued_state").write_text("FAILED")
    lose(root, "READY")
    wait_for(lambda: (root / "queued_created").exists(), "the new request", proc)
    delete, create = gcloud(root, "queued-resources", "delete")[0], gcloud(root, "queued-resources", "create")[0]
    assert delete[4] == "my-qr" and create[4] == "my-qr" and "--node-id=my-v4-16" in create
    (root / "queued_state").write_text("ACTIVE")
    wait_for(lambda: len(starts(root)) == 3, "the relaunch on the new request's node", proc)
    assert not gcloud(root, "tpu-vm", "delete")
    (root / "finish").touch()
    assert proc.wait(timeout=30) == 0


def test_a_stopped_slice_is_started_again_not_deleted(pod):
    root, env, workdir = pod
    proc = watch(env)
    first_start(root, workdir, proc)
    lose(root, "STOPPED", wipe=False)  # its VMs' processes gone, their disks kept
    wait_for(lambda: len(starts(root)) == 2, "the relaunch", proc)
    assert gcloud(root, "tpu-vm", "start") and not gcloud(root, "tpu-vm", "delete")
    assert [r for r in attempts(workdir) if r["event"] == "end"][0]["cause"] == "slice STOPPED"
    (root / "finish").touch()
    assert proc.wait(timeout=30) == 0


def test_a_slice_stuck_in_a_state_past_ready_timeout_is_recreated(pod):
    root, env, workdir = pod
    proc = watch(dict(env, READY_TIMEOUT="2"))
    first_start(root, workdir, proc)
    lose(root, "REPAIRING", wipe=False)
    wait_for(lambda: len(starts(root)) == 2, "the relaunch", proc)
    recreate = next(r for r in attempts(workdir) if r["event"] == "recreate")
    assert recreate["cause"] == "slice REPAIRING past READY_TIMEOUT"
    (root / "finish").touch()
    assert proc.wait(timeout=30) == 0


def test_a_launch_that_fails_because_the_slice_went_away_is_not_a_failure(pod):
    root, env, workdir = pod
    (root / "preempt_on_start").touch()
    proc = watch(env)
    wait_for(lambda: len(starts(root)) == 2, "the launch on the recreated slice", proc)
    (root / "finish").touch()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    rows = attempts(workdir)
    assert rows[1]["event"] == "end" and rows[1]["cause"].startswith("launch failed")
    assert not any(r["event"] == "failure" for r in rows)
    assert any(r["event"] == "recreate" for r in rows)


def test_a_first_start_on_a_slice_already_lost_recreates_it_from_the_recorded_spec(pod):
    """Supervision (re)started with no attempt recorded and the slice gone (the old supervisor
    indexed the attempts of an empty file here and died)."""
    root, env, workdir = pod
    workdir.mkdir()
    (workdir / "slice.json").write_text(json.dumps(pod_slice.Slice.spec_of(fake_pod.NODE)))
    lose(root, "NOT_FOUND")
    proc = watch(env)
    wait_for(lambda: len(starts(root)) == 1, "the start on the recreated slice", proc)
    (root / "finish").touch()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    assert events(workdir) == [(0, "recreate"), (1, "start"), (1, "end"), (1, "done")]
    assert attempts(workdir)[1]["install"]
