"""A stand-in `gcloud` for a TPU VM slice of local "workers" (folders), shared by the supervisor's
tests and the pod rehearsal. Its faults are files a test writes in `$FAKE_ROOT`.

`gcloud compute tpus tpu-vm ...`:
- `ssh NAME ... --worker=all|N --command=C`: runs C with bash in each chosen worker's folder (its
  home), all workers at once, with that worker's jax.distributed settings (what a TPU VM's metadata
  gives jax: one coordinator port per call), `TPU_WORKER_ID`, and its `$FAKE_ENV_<i>`; fails (255)
  if any worker's command failed or could not be reached, while the slice is not READY (its VMs are
  unreachable) and for worker i while `unreachable.<i>` exists (the others still run and answer).
- `scp [--recurse] SRC... NAME:DEST ... --worker=all|N`: copies into each chosen worker's folder.
- `describe NAME --format=json`: the node (`node.json`, first `$FAKE_NODE`) in the state written in
  `state` (READY when absent), merged with `node_extra.json` (health, upcomingMaintenance) if there;
  gcloud's structured NOT_FOUND error after a delete. While `describe_errors` holds a number n > 0,
  describe fails n more times with an error that is not NOT_FOUND (a transient UNAVAILABLE, or, when
  `describe_noise` exists, a message that merely contains "not found").
- `delete NAME`: the slice is gone (NOT_FOUND). `create NAME FLAGS`: fails with a stockout
  (RESOURCE_EXHAUSTED) while `create_failures` holds n > 0 (n - 1 left); else every worker's folder
  emptied (new VMs), the node rebuilt from the create's flags alone (`node.json`: a supervisor that
  forgot a flag gets a node without it), after `create_sleep` seconds if that file exists (a slow
  gcloud call), and CREATING for `create_delay` seconds before READY (a slow slice).
  `start NAME` (a STOPPED slice): READY again, folders kept. `state_once` is the state of the next
  describe alone (one odd reading). With `preempt_on_start`, the next `tpu_worker.sh start` finds
  the slice PREEMPTED (lost mid-launch).
- `queued-resources describe|delete|create`: a request; `queued_state` (ACTIVE when absent) is its
  state; while it is not ACTIVE its node is NOT_FOUND. create acts on the node as tpu-vm's does
  (it also writes `queued_created`).
Delete and create wait for `$FAKE_ROOT/slice.lock`, which a test holds while it takes the slice away
(`taken_away`), so a supervisor cannot recreate the VMs while the test is still wiping them.
Each call is recorded in `$FAKE_LOG`, its arguments NUL-separated, one call per line.
"""

import contextlib
import datetime
import fcntl
import json
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "tpu_pod.sh"

NODE = {"acceleratorType": "v4-16", "runtimeVersion": "tpu-ubuntu2204-base",
        "schedulingConfig": {"spot": True},
        "networkConfig": {"network": "projects/p/global/networks/tpu-net",
                          "subnetwork": "projects/p/regions/local/subnetworks/tpu-sub", "enableExternalIps": False},
        "serviceAccount": {"email": "trainer@p.iam.gserviceaccount.com",
                           "scope": ["https://www.googleapis.com/auth/cloud-platform"]},
        "labels": {"team": "nlp"}}

# The node's side, in Python: describe's JSON (with the state, a slow creation's CREATING), and the
# node a create's flags describe.
NODE_PY = r"""
import json, os, sys, time
root, action = os.environ["FAKE_ROOT"], sys.argv[1]
path = os.path.join(root, "node.json")
if action == "describe":
    node = json.load(open(path)) if os.path.exists(path) else json.loads(os.environ["FAKE_NODE"])
    node["state"] = sys.argv[2]
    ready_at = os.path.join(root, "ready_at")
    if node["state"] == "READY" and os.path.exists(ready_at) and time.time() < float(open(ready_at).read()):
        node["state"] = "CREATING"
    extra = os.path.join(root, "node_extra.json")
    if os.path.exists(extra):
        node.update(json.load(open(extra)))
    print(json.dumps(node))
elif action == "create":
    flags = dict(a[2:].split("=", 1) if "=" in a else (a[2:], True) for a in sys.argv[2:] if a.startswith("--"))
    node = {"acceleratorType": flags.get("accelerator-type"),
            "runtimeVersion": flags.get("version") or flags.get("runtime-version"),
            "schedulingConfig": {"spot": bool(flags.get("spot")), "preemptible": bool(flags.get("preemptible"))},
            "networkConfig": {"network": flags.get("network"), "subnetwork": flags.get("subnetwork"),
                              "enableExternalIps": not flags.get("internal-ips")},
            "serviceAccount": {"email": flags.get("service-account"),
                               "scope": flags["scopes"].split(",") if flags.get("scopes") else []},
            "labels": dict(kv.split("=", 1) for kv in flags["labels"].split(",")) if flags.get("labels") else {}}
    if "node-id" in flags:
        node["queuedResource"] = "projects/p/locations/z/queuedResources/" + sys.argv[3]
    json.dump(node, open(path, "w"))
"""

GCLOUD = r"""#!/usr/bin/env bash
set -u
printf '%s\0' "$@" >> "$FAKE_LOG"; printf '\n' >> "$FAKE_LOG"
state=$(cat "$FAKE_ROOT/state" 2>/dev/null || echo READY)
if [ "$3 $4" = "tpu-vm describe" ] && [ -f "$FAKE_ROOT/state_once" ]; then  # one reading of another state
  state=$(cat "$FAKE_ROOT/state_once"); rm -f "$FAKE_ROOT/state_once"
fi
qstate=$(cat "$FAKE_ROOT/queued_state" 2>/dev/null || echo ACTIVE)
workers=(); for a in "$@"; do case "$a" in
  --worker=all) for ((i = 0; i < FAKE_WORKERS; i++)); do workers+=("$i"); done ;;
  --worker=*) workers+=("${a#--worker=}") ;;
esac; done
count_down() {  # count_down FILE: true (and one less) while FILE holds a number > 0
  local n; n=$(cat "$FAKE_ROOT/$1" 2>/dev/null || echo 0)
  [ "$n" -gt 0 ] 2>/dev/null || return 1
  echo $((n - 1)) > "$FAKE_ROOT/$1"
}
new_vms() {  # CREATING while gcloud's create runs, then READY (or CREATING `create_delay` s more)
  echo CREATING > "$FAKE_ROOT/state"
  for ((i = 0; i < FAKE_WORKERS; i++)); do rm -rf "$FAKE_ROOT/worker$i"; mkdir -p "$FAKE_ROOT/worker$i"; done
  [ -f "$FAKE_ROOT/create_sleep" ] && sleep "$(cat "$FAKE_ROOT/create_sleep")"
  if [ -f "$FAKE_ROOT/create_delay" ]; then
    "$FAKE_PY" -c 'import sys, time; print(time.time() + float(sys.argv[1]))' "$(cat "$FAKE_ROOT/create_delay")" \
      > "$FAKE_ROOT/ready_at"
  fi
  echo READY > "$FAKE_ROOT/state"
}
case "$3 $4" in
  "tpu-vm describe")
    if count_down describe_errors; then
      if [ -f "$FAKE_ROOT/describe_noise" ]; then
        echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) There was a problem refreshing your current auth tokens: credentials file not found" >&2
      else
        echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) UNAVAILABLE: The service is currently unavailable." >&2
      fi
      exit 1
    fi
    if [ "$state" = NOT_FOUND ] || [ "$qstate" != ACTIVE ]; then
      echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource 'projects/p/locations/z/nodes/$5' was not found" >&2
      exit 1
    fi
    exec "$FAKE_PY" -c "$FAKE_NODE_PY" describe "$state" ;;
  "queued-resources describe")
    if [ "$qstate" = NOT_FOUND ]; then
      echo "ERROR: (gcloud.compute.tpus.queued-resources.describe) NOT_FOUND: Resource 'projects/p/locations/z/queuedResources/$5' was not found" >&2
      exit 1
    fi
    printf '{"name": "projects/p/locations/z/queuedResources/%s", "state": {"state": "%s"}}\n' "$5" "$qstate"
    exit 0 ;;
  "tpu-vm delete" | "queued-resources delete")
    exec 9>"$FAKE_ROOT/slice.lock"; flock 9
    if [ "$state" = NOT_FOUND ] && [ "$4" = delete ] && [ "$3" = tpu-vm ]; then
      echo "ERROR: (gcloud.compute.tpus.tpu-vm.delete) NOT_FOUND: Resource 'projects/p/locations/z/nodes/$5' was not found" >&2
      exit 1
    fi
    echo NOT_FOUND > "$FAKE_ROOT/state"; [ "$3" = queued-resources ] && echo NOT_FOUND > "$FAKE_ROOT/queued_state"
    exit 0 ;;
  "tpu-vm create" | "queued-resources create")
    exec 9>"$FAKE_ROOT/slice.lock"; flock 9
    if count_down create_failures; then
      echo "ERROR: (gcloud.compute.tpus.$3.create) RESOURCE_EXHAUSTED: There is no more capacity in the zone \"z\"" >&2
      exit 1
    fi
    [ -e "${WORKDIR:-/nonexistent}/needs_install.json" ] && touch "$FAKE_ROOT/create_saw_needs_install"
    "$FAKE_PY" -c "$FAKE_NODE_PY" create "$5" "${@:6}"
    if [ "$3" = queued-resources ]; then
      touch "$FAKE_ROOT/queued_created"; echo ACCEPTED > "$FAKE_ROOT/queued_state"
    fi
    new_vms; exit 0 ;;
  "tpu-vm start")
    echo READY > "$FAKE_ROOT/state"; exit 0 ;;
esac
if [ "$state" != READY ]; then echo "ERROR: ssh: connect to host: Connection refused (the slice is $state)" >&2; exit 255; fi
if [ -f "$FAKE_ROOT/preempt_on_start" ] && [[ "$*" == *"tpu_worker.sh start"* ]]; then  # lost mid-launch
  rm -f "$FAKE_ROOT/preempt_on_start"; echo PREEMPTED > "$FAKE_ROOT/state"
  echo "ERROR: ssh: connect to host: Connection reset by peer" >&2; exit 255
fi
if [ "$4" = scp ]; then
  srcs=(); for a in "${@:5}"; do case "$a" in --*) ;; *) srcs+=("$a") ;; esac; done
  dest="${srcs[-1]#*:}"; unset 'srcs[-1]'
  for i in "${workers[@]}"; do
    [ -e "$FAKE_ROOT/unreachable.$i" ] && { echo "ERROR: ssh: connect to host worker-$i: Connection timed out" >&2; exit 255; }
    cp -r "${srcs[@]}" "$FAKE_ROOT/worker$i/$dest" || exit 1
  done
  exit 0
fi
port=$("$FAKE_PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for a in "$@"; do
  case "$a" in --command=*)
    pids=()
    status=0
    for i in "${workers[@]}"; do
      if [ -e "$FAKE_ROOT/unreachable.$i" ]; then
        echo "ssh: connect to host worker-$i port 22: Connection timed out" > "$FAKE_ROOT/ssh.$$.$i"; status=255; continue
      fi
      extra="FAKE_ENV_$i"
      (cd "$FAKE_ROOT/worker$i" && env HOME="$FAKE_ROOT/worker$i" TPU_WORKER_ID="$i" \
        BERT_JAX_COORDINATOR="127.0.0.1:$port" BERT_JAX_NUM_PROCESSES="$FAKE_WORKERS" BERT_JAX_PROCESS_ID="$i" \
        ${!extra:-} bash -c "${a#--command=}") > "$FAKE_ROOT/ssh.$$.$i" 2>&1 &
      pids+=("$!")
    done
    for p in "${pids[@]}"; do wait "$p" || { [ "$status" = 0 ] && status=1; }; done
    for i in "${workers[@]}"; do cat "$FAKE_ROOT/ssh.$$.$i"; rm -f "$FAKE_ROOT/ssh.$$.$i"; done
    exit "$status" ;;
  esac
done
"""


def install(root: Path, workers: int, python: str) -> dict:
    """Writes the fake gcloud into root/bin and makes the workers' folders; returns the environment
    variables that point a launcher at them (prepend `PATH`)."""
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "gcloud").write_text(GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    for i in range(workers):
        (root / f"worker{i}").mkdir(exist_ok=True)
    return {"FAKE_LOG": str(root / "gcloud.log"), "FAKE_ROOT": str(root), "FAKE_WORKERS": str(workers),
            "FAKE_PY": python, "FAKE_NODE": json.dumps(NODE), "FAKE_NODE_PY": NODE_PY, "BIN": str(bin_dir)}


def calls(root: Path) -> list[list[str]]:
    """Every gcloud call so far, as its argument list."""
    log = root / "gcloud.log"
    return [line.split("\0")[:-1] for line in log.read_text().splitlines()] if log.exists() else []


@contextlib.contextmanager
def taken_away(root: Path, state: str):
    """The slice lost (`state`: PREEMPTED, TERMINATED, NOT_FOUND...) for the duration of the block,
    in which the test kills the workers' processes and wipes their folders; gcloud's delete and
    create wait until the block ends."""
    with open(root / "slice.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (root / "state").write_text(state)
        yield


# ---------------------------------------------------------------------------------------------
# A stand-in run for the supervisor's tests: what a worker's `python -m bert_jax.main` does is
# what `$FAKE_ROOT/mode` says, read when the run starts:
#   (absent)       runs until `$FAKE_ROOT/finish` exists (exit 0), or SIGTERM (saves, exit 0);
#                  with `$FAKE_ROOT/progress`, worker 0 appends a step line to the workdir's
#                  train_log.jsonl every 0.2 s meanwhile (a run that makes progress)
#   fail           exits 3 at once (a crash: retried)
#   exit=N         exits N at once (bert_jax/exit_codes.py: 78 a refused config, ...)
#   save_then_fail worker 0 commits the next checkpoint step folder, then both exit 3 (a crash
#                  after progress)
# `-m pip` is recorded (freeze answers pins, or fails while `$FAKE_ROOT/freeze_failures` holds n > 0);
# anything else (the log upload) is the real python.
# ---------------------------------------------------------------------------------------------

RUN_PYTHON = r"""#!/usr/bin/env bash
if [ "$1 $2" = "-m bert_jax.main" ]; then
  echo "worker $TPU_WORKER_ID: run started with $*"
  workdir=""; for a in "$@"; do case "$a" in --workdir=*) workdir="${a#--workdir=}" ;; esac; done
  mode=$(cat "$FAKE_ROOT/mode" 2>/dev/null)
  case "$mode" in
    fail) echo "worker $TPU_WORKER_ID: crashed"; exit 3 ;;
    exit=*) echo "worker $TPU_WORKER_ID: refused"; exit "${mode#exit=}" ;;
    save_then_fail)
      if [ "$TPU_WORKER_ID" = 0 ]; then
        n=$(ls "$workdir/checkpoints" 2>/dev/null | grep -c '^[0-9]*$'); mkdir -p "$workdir/checkpoints/$((n + 1))"
      fi
      echo "worker $TPU_WORKER_ID: crashed after a save"; exit 3 ;;
  esac
  trap 'echo "preemption/SIGTERM: saved step 4, exiting"; exit 0' TERM
  step=0
  while [ ! -e "$FAKE_ROOT/finish" ]; do
    if [ -e "$FAKE_ROOT/progress" ] && [ "$TPU_WORKER_ID" = 0 ]; then
      step=$((step + 1)); echo "{\"step\": $step, \"loss\": 1.0}" >> "$workdir/train_log.jsonl"
    fi
    sleep 0.2
  done
  exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
  printf '%s ' "$@" >> "$FAKE_ROOT/pip.$TPU_WORKER_ID.log"; echo >> "$FAKE_ROOT/pip.$TPU_WORKER_ID.log"
  if [ "$3" = freeze ]; then
    n=$(cat "$FAKE_ROOT/freeze_failures" 2>/dev/null || echo 0)  # a freeze that fails n more times
    if [ "$n" -gt 0 ]; then echo $((n - 1)) > "$FAKE_ROOT/freeze_failures"; echo "pip: broken" >&2; exit 1; fi
    printf 'jax==0.10.2\nlibtpu==0.0.42\norbax-checkpoint==0.12.8\n'
  fi
  if [ "$3" = install ] && [ -f constraints.txt ]; then cp constraints.txt "$FAKE_ROOT/used-constraints.$TPU_WORKER_ID"; fi
  exit 0
fi
exec "$REAL_PY" "$@"
"""


def supervised(root: Path, python: str, project: str, **settings) -> tuple[dict, Path]:
    """A fake two-worker pod under `root` whose runs are RUN_PYTHON's, and the environment that
    points `launch/tpu_pod.sh --watch` at it (fast polls and backoffs; `settings` override them).
    Returns (env, workdir)."""
    import os
    fake = install(root, workers=2, python=python)
    run_python = Path(fake["BIN"]) / "python3"
    run_python.write_text(RUN_PYTHON)
    run_python.chmod(0o755)
    workdir = root / "workdir"
    env = dict(os.environ, **fake, PATH=f"{fake['BIN']}:{os.environ['PATH']}", REAL_PY=python,
               TPU_NAME="my-v4-16", ZONE="local", PROJECT="p", CONFIG="configs/test.py", WORKDIR=str(workdir),
               STOP_TIMEOUT="5", POLL_SECONDS="0.3", BACKOFF_SECONDS="0.2", MAX_BACKOFF_SECONDS="0.5",
               READY_TIMEOUT="30", LOG_SYNC_SECONDS="1", SUPERVISOR_PYTHON=python, PYTHONPATH=project,
               BERT_JAX_CACHE_DIR=str(root / "cache"))
    env.update({k: str(v) for k, v in settings.items()})
    return env, workdir


def stop_runs(root: Path) -> None:
    """Ends every fake run of a test (and its shell), whatever state the test left it in."""
    import os
    import signal
    (root / "finish").touch()
    for pid_file in root.glob("worker*/bert_jax_run/*pid"):
        try:
            os.killpg(os.getpgid(int(pid_file.read_text())), signal.SIGKILL)
        except (ProcessLookupError, ValueError, PermissionError):
            pass


# ---------------------------------------------------------------------------------------------
# The supervisor's tests: run it, read what it recorded, wait for it
# ---------------------------------------------------------------------------------------------


def watch(env, *args):
    return subprocess.Popen(["bash", str(SCRIPT), "--watch", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def attempts(workdir):
    path = workdir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(workdir):
    return [(r.get("attempt"), r["event"]) for r in attempts(workdir) if r["event"] != "maintenance"]


def when(row) -> float:
    return datetime.datetime.fromisoformat(row["time"]).timestamp()


def wait_for(predicate, what, proc=None, timeout=60):
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline or (proc is not None and proc.poll() is not None):
            out = proc.communicate(timeout=10)[0] if proc is not None and proc.poll() is not None else ""
            pytest.fail(f"timed out waiting for {what}\n{out[-3000:]}")
        time.sleep(0.1)


def status_calls(root) -> int:
    return sum("tpu_worker.sh status" in c[-1] for c in calls(root))


def starts(root):
    return [c for c in calls(root) if c[3] == "ssh" and "tpu_worker.sh start" in c[-1]]


def wait_launched(root, n, proc, timeout=60):
    """Waits until the supervisor's launch of attempt `n` is over (its next status poll came), so
    that a test's fault does not land in the middle of the launch."""
    wait_for(lambda: len(starts(root)) == n, f"launch {n}", proc, timeout)
    polls = status_calls(root)
    wait_for(lambda: status_calls(root) > polls, f"the poll after launch {n}", proc, timeout)


def run_pids(root):
    return [int((root / f"worker{i}/bert_jax_run/pid").read_text()) for i in (0, 1)]


def lose(root: Path, state: str, wipe: bool = True) -> None:
    """The slice `state` (PREEMPTED, NOT_FOUND, ...): every worker's processes killed with it and,
    with `wipe`, its folders (a new VM starts empty)."""
    import os
    import shutil
    import signal
    with taken_away(root, state):
        # Every worker's processes first, then the folders: a worker whose peer died first may be
        # gone already (a run aborts on a lost peer within moments), as on a real slice.
        for pid_file in root.glob("worker*/bert_jax_run/pid"):
            try:
                os.killpg(os.getpgid(int(pid_file.read_text())), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for i in (0, 1):
            if wipe:
                shutil.rmtree(root / f"worker{i}")
                (root / f"worker{i}").mkdir()
        if state == "NOT_FOUND":
            (root / "node.json").unlink(missing_ok=True)
