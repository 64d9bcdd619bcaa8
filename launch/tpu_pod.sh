#!/usr/bin/env bash
# Runs bert_jax on every worker of a Cloud TPU VM pod slice, detached from this SSH session.
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b PROJECT=my-project \
#   CONFIG=configs/large.py WORKDIR=gs://my-bucket/bert-large \
#   launch/tpu_pod.sh [--dry_run] --config.train_data='gs://my-bucket/data/train-*.tfrecord'
#
#   launch/tpu_pod.sh --watch ARGS # the same run, supervised: restarted when it fails or hangs,
#                                  # the slice recreated when lost (bert_jax/pod/supervisor.py)
#   launch/tpu_pod.sh --status     # each worker: running or not, and the end of its log
#   launch/tpu_pod.sh --stop       # SIGTERM on every worker: a checkpoint is saved, then the run exits
#                                  # (a supervisor then ends too: a person stopped it)
#   launch/tpu_pod.sh --collect=DEST  # each worker's newest log to DEST/worker-<N>.log
#   launch/tpu_pod.sh --freeze     # worker 0's installed packages, pinned (pip freeze)
#
# On all workers at once (gcloud compute tpus tpu-vm ssh/scp --worker=all), in this order:
#   1. stop what holds the TPU: the run this script started there before (SIGTERM, then SIGKILL
#      after STOP_TIMEOUT seconds), any other process holding the TPU device files, libtpu's lock;
#   2. copy the project, and install it (`pip install -e '.[tpu,gcs]'`, with `-c` CONSTRAINTS when
#      that names a pip constraints file: the versions a run started with; SKIP_INSTALL=1 skips
#      this when the workers already have it, e.g. a rerun on the same VMs);
#   3. start `python -m bert_jax.main --config=$CONFIG --workdir=$WORKDIR --multihost=true ARGS`
#      detached (launch/tpu_worker.sh): it survives this script and the SSH session; each worker
#      logs to ~/bert_jax_run/logs/<time>-<pid>.log (kept; latest.log is the newest), and with
#      LOG_DEST set uploads it there every minute and when the run ends.
# A preempted or interrupted slice resumes by running the same command again: bert_jax continues
# from the newest intact checkpoint in WORKDIR. WORKDIR should be a gs:// path every worker can
# reach. --dry_run prints every gcloud command instead of running it.
#
# Other settings (environment): REMOTE_DIR (the project copy on each worker, relative to the home
# folder, default bert_jax), PYTHON (the workers' python, default python3), STOP_TIMEOUT (default
# 600), GCLOUD (default gcloud), INTERNAL_IP=1 (reach workers without external IPs by their
# internal ones: --internal-ip), IAP=1 (through Identity-Aware Proxy: --tunnel-through-iap).
# --watch's own (docs/pretraining.md, "Running on a pod", lists them all): POLL_SECONDS,
# MAX_RESTARTS, BACKOFF_SECONDS, MAX_BACKOFF_SECONDS, READY_TIMEOUT, QUEUE_TIMEOUT, LOST_READINGS,
# UNREACHABLE_POLLS, MAX_CREATE_FAILURES, HANG_SECONDS, HANG_MIN_SECONDS, HANG_FACTOR,
# STARTUP_SECONDS, ...; its flags --takeover and --update_code; SUPERVISOR_PYTHON (this machine's
# python with bert_jax's [gcs] extra).
set -euo pipefail

action=run
dry_run=0
collect_dest=""
args=()
for a in "$@"; do
  case "$a" in
    --dry_run) dry_run=1 ;;
    --status) action=status ;;
    --stop) action=stop ;;
    --freeze) action=freeze ;;
    --collect=*) action=collect; collect_dest="${a#--collect=}" ;;
    --watch) action=watch ;;
    *) args+=("$a") ;;
  esac
done

required=(TPU_NAME ZONE PROJECT)
case "$action" in run | watch) required+=(CONFIG WORKDIR) ;; esac
for var in "${required[@]}"; do
  if [ -z "${!var:-}" ]; then
    echo "tpu_pod.sh: environment variable $var is required (see the header of $0)" >&2
    exit 2
  fi
done
cd "$(dirname "$0")/.."
if [ "$action" = watch ]; then
  exec "${SUPERVISOR_PYTHON:-python3}" -m bert_jax.pod.supervisor "${args[@]}"
fi

REMOTE_DIR="${REMOTE_DIR:-bert_jax}"
# ssh runs the command in the home folder and scp resolves a relative destination there: a path
# relative to home means the same folder to both. "~/x" is taken as "x"; "~" quoted for one and
# expanded by the other would name two folders.
REMOTE_DIR="${REMOTE_DIR#\~/}"
case "$REMOTE_DIR" in
  "~"* | /* | "" | *..*)
    echo "tpu_pod.sh: REMOTE_DIR=$REMOTE_DIR: give a folder relative to the workers' home (e.g. bert_jax)" >&2
    exit 2 ;;
esac
PYTHON="${PYTHON:-python3}"
STOP_TIMEOUT="${STOP_TIMEOUT:-600}"
GCLOUD="${GCLOUD:-gcloud}"
reach=()
[ "${INTERNAL_IP:-0}" = 1 ] && reach+=(--internal-ip)
[ "${IAP:-0}" = 1 ] && reach+=(--tunnel-through-iap)
where=(--zone="$ZONE" --project="$PROJECT" "${reach[@]}")

gcloud_() {  # runs (or with --dry_run prints) one gcloud command
  if [ "$dry_run" = 1 ]; then
    printf '%q' "$GCLOUD"; printf ' %q' "$@"; printf '\n'
  else
    "$GCLOUD" "$@"
  fi
}
on_workers() { gcloud_ compute tpus tpu-vm ssh "$TPU_NAME" "${where[@]}" --worker=all --command="$1"; }

dir=$(printf '%q' "$REMOTE_DIR")
log_dest=""
[ -n "${LOG_DEST:-}" ] && log_dest="LOG_DEST=$(printf '%q' "$LOG_DEST") "
stop_by=""
[ -n "${STOP_BY:-}" ] && stop_by="STOP_BY=$(printf '%q' "$STOP_BY") "
worker="cd $dir && ${log_dest}${stop_by}PYTHON=$(printf '%q' "$PYTHON") STOP_TIMEOUT=$(printf '%q' "$STOP_TIMEOUT") bash launch/tpu_worker.sh"
# A fresh VM (just created, or recreated after a preemption) has no project copy yet.
if_copied() { echo "if [ -f $dir/launch/tpu_worker.sh ]; then $1; else echo \"\$(hostname): no bert_jax in ~/$dir\"; $2; fi"; }
case "$action" in
  status) on_workers "$(if_copied "$worker status" 'echo "bert_jax-worker ${TPU_WORKER_ID:-?} none"')"; exit 0 ;;
  stop) on_workers "$(if_copied "$worker stop" true)"; exit 0 ;;
  collect) on_workers "$(if_copied "$worker collect $(printf '%q' "$collect_dest")" true)"; exit 0 ;;
  freeze)
    gcloud_ compute tpus tpu-vm ssh "$TPU_NAME" "${where[@]}" --worker=0 \
      --command="$(printf '%q' "$PYTHON") -m pip freeze --exclude-editable"
    exit 0 ;;
esac

# 1. The worker script first (a fresh VM has none), then stop what is running.
on_workers "mkdir -p $dir/launch"
gcloud_ compute tpus tpu-vm scp "${where[@]}" --worker=all launch/tpu_worker.sh "$TPU_NAME:$REMOTE_DIR/launch/"
on_workers "$worker stop"
# 2. The project, installed (with the run's recorded versions when CONSTRAINTS names them).
gcloud_ compute tpus tpu-vm scp --recurse "${where[@]}" --worker=all \
  setup.py README.md bert_jax data_pipeline configs launch "$TPU_NAME:$REMOTE_DIR/"
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  constrain=""
  if [ -n "${CONSTRAINTS:-}" ]; then
    gcloud_ compute tpus tpu-vm scp "${where[@]}" --worker=all "$CONSTRAINTS" "$TPU_NAME:$REMOTE_DIR/constraints.txt"
    constrain=" -c constraints.txt"
  fi
  on_workers "cd $dir && $(printf '%q' "$PYTHON") -m pip install -q$constrain -e '.[tpu,gcs]'"
fi
# 3. The run, detached.
# Quoted for the worker's shell: overrides with glob characters and spaces arrive unchanged.
overrides=""
for a in "${args[@]}"; do overrides+=" $(printf '%q' "$a")"; done
on_workers "$worker start --config=$(printf '%q' "$CONFIG") --workdir=$(printf '%q' "$WORKDIR") --multihost=true$overrides"
