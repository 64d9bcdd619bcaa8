"""A stand-in `gcloud` for a TPU VM slice of local "workers" (folders), shared by the supervisor's
tests and the pod rehearsal.

`gcloud compute tpus tpu-vm ...`:
- `ssh NAME ... --worker=all|N --command=C`: runs C with bash in each chosen worker's folder (its
  home), all workers at once, with that worker's jax.distributed settings (what a TPU VM's metadata
  gives jax: one coordinator port per call), `TPU_WORKER_ID`, and its `$FAKE_ENV_<i>`; fails if any
  worker's command failed, and while the slice is not READY (its VMs are unreachable).
- `scp [--recurse] SRC... NAME:DEST ... --worker=all|N`: copies into each chosen worker's folder.
- `describe NAME --format=json`: the node, in the state written in `$FAKE_ROOT/state` (READY when
  absent); NOT_FOUND (an error, as gcloud's) after a delete.
- `delete NAME`: the slice is gone (NOT_FOUND); `create NAME ...`: every worker's folder emptied
  (a new VM), READY. `queued-resources delete|create` act the same on the node. Both wait for
  `$FAKE_ROOT/slice.lock`, which a test holds while it takes the slice away (`taken_away`), so a
  supervisor cannot recreate the VMs while the test is still wiping them.
Each call is recorded in `$FAKE_LOG`, its arguments NUL-separated, one call per line.
"""

import contextlib
import fcntl
import json
from pathlib import Path

NODE = {"acceleratorType": "v4-16", "runtimeVersion": "tpu-ubuntu2204-base",
        "schedulingConfig": {"spot": True},
        "networkConfig": {"network": "projects/p/global/networks/tpu-net",
                          "subnetwork": "projects/p/regions/local/subnetworks/tpu-sub", "enableExternalIps": False},
        "serviceAccount": {"email": "trainer@p.iam.gserviceaccount.com",
                           "scope": ["https://www.googleapis.com/auth/cloud-platform"]},
        "labels": {"team": "nlp"}}

GCLOUD = r"""#!/usr/bin/env bash
set -u
printf '%s\0' "$@" >> "$FAKE_LOG"; printf '\n' >> "$FAKE_LOG"
state=$(cat "$FAKE_ROOT/state" 2>/dev/null || echo READY)
workers=(); for a in "$@"; do case "$a" in
  --worker=all) for ((i = 0; i < FAKE_WORKERS; i++)); do workers+=("$i"); done ;;
  --worker=*) workers+=("${a#--worker=}") ;;
esac; done
case "$3 $4" in
  "tpu-vm describe" | "queued-resources describe")
    if [ "$state" = NOT_FOUND ]; then echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: $5" >&2; exit 1; fi
    "$FAKE_PY" -c 'import json, sys; node = json.loads(sys.argv[1]); node["state"] = sys.argv[2]; print(json.dumps(node))' \
      "$FAKE_NODE" "$state"
    exit 0 ;;
  "tpu-vm delete" | "queued-resources delete")
    exec 9>"$FAKE_ROOT/slice.lock"; flock 9
    if [ "$state" = NOT_FOUND ]; then echo "ERROR: NOT_FOUND" >&2; exit 1; fi
    echo NOT_FOUND > "$FAKE_ROOT/state"; exit 0 ;;
  "tpu-vm create" | "queued-resources create")
    exec 9>"$FAKE_ROOT/slice.lock"; flock 9
    for ((i = 0; i < FAKE_WORKERS; i++)); do rm -rf "$FAKE_ROOT/worker$i"; mkdir -p "$FAKE_ROOT/worker$i"; done
    echo READY > "$FAKE_ROOT/state"; exit 0 ;;
esac
if [ "$state" != READY ]; then echo "ERROR: ssh: connect to host: Connection refused (the slice is $state)" >&2; exit 255; fi
if [ "$4" = scp ]; then
  srcs=(); for a in "${@:5}"; do case "$a" in --*) ;; *) srcs+=("$a") ;; esac; done
  dest="${srcs[-1]#*:}"; unset 'srcs[-1]'
  for i in "${workers[@]}"; do cp -r "${srcs[@]}" "$FAKE_ROOT/worker$i/$dest" || exit 1; done
  exit 0
fi
port=$("$FAKE_PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for a in "$@"; do
  case "$a" in --command=*)
    pids=()
    for i in "${workers[@]}"; do
      extra="FAKE_ENV_$i"
      (cd "$FAKE_ROOT/worker$i" && env HOME="$FAKE_ROOT/worker$i" TPU_WORKER_ID="$i" \
        BERT_JAX_COORDINATOR="127.0.0.1:$port" BERT_JAX_NUM_PROCESSES="$FAKE_WORKERS" BERT_JAX_PROCESS_ID="$i" \
        ${!extra:-} bash -c "${a#--command=}") > "$FAKE_ROOT/ssh.$$.$i" 2>&1 &
      pids+=("$!")
    done
    status=0
    for p in "${pids[@]}"; do wait "$p" || status=1; done
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
            "FAKE_PY": python, "FAKE_NODE": json.dumps(NODE), "BIN": str(bin_dir)}


def calls(root: Path) -> list[list[str]]:
    """Every gcloud call so far, as its argument list."""
    log = root / "gcloud.log"
    return [line.split("\0")[:-1] for line in log.read_text().splitlines()] if log.exists() else []


@contextlib.contextmanager
def taken_away(root: Path, state: str):
    """The slice lost (`state`: PREEMPTED, TERMINATED...) for the duration of the block, in which
    the test kills the workers' processes and wipes their folders; gcloud's delete and create wait
    until the block ends."""
    with open(root / "slice.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (root / "state").write_text(state)
        yield
