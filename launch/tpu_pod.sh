#!/usr/bin/env bash
# Runs bert_jax on every worker of a Cloud TPU VM pod slice, detached from this SSH session.
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b PROJECT=my-project \
#   CONFIG=configs/large.py WORKDIR=gs://my-bucket/bert-large \
#   launch/tpu_pod.sh [--dry_run] --config.train_data='gs://my-bucket/data/train-*.tfrecord'
#
#   launch/tpu_pod.sh --status     # each worker: running or not, and the end of its log
#   launch/tpu_pod.sh --stop       # SIGTERM on every worker: a checkpoint is saved, then the run exits
#
# On all workers at once (gcloud compute tpus tpu-vm ssh/scp --worker=all), in this order:
#   1. stop what holds the TPU: the run this script started there before (SIGTERM, then SIGKILL
#      after STOP_TIMEOUT seconds), any other process holding the TPU device files, libtpu's lock;
#   2. copy the project, and install it (`pip install -e '.[tpu,gcs]'`; SKIP_INSTALL=1 skips this
#      when the workers already have it, e.g. a rerun on the same VMs);
#   3. start `python -m bert_jax.main --config=$CONFIG --workdir=$WORKDIR --multihost=true ARGS`
#      detached (launch/tpu_worker.sh): it survives this script and the SSH session; each worker
#      logs to ~/bert_jax_run/logs/<time>-<pid>.log (kept; latest.log is the newest).
# A preempted or interrupted slice resumes by running the same command again: bert_jax continues
# from the newest intact checkpoint in WORKDIR. WORKDIR should be a gs:// path every worker can
# reach. --dry_run prints every gcloud command instead of running it.
#
# Other settings (environment): REMOTE_DIR (the project copy on each worker, default bert_jax),
# PYTHON (the workers' python, default python3), STOP_TIMEOUT (default 600), GCLOUD (default gcloud).
set -euo pipefail

action=run
dry_run=0
args=()
for a in "$@"; do
  case "$a" in
    --dry_run) dry_run=1 ;;
    --status) action=status ;;
    --stop) action=stop ;;
    *) args+=("$a") ;;
  esac
done

required=(TPU_NAME ZONE PROJECT)
[ "$action" = run ] && required+=(CONFIG WORKDIR)
for var in "${required[@]}"; do
  if [ -z "${!var:-}" ]; then
    echo "tpu_pod.sh: environment variable $var is required (see the header of $0)" >&2
    exit 2
  fi
done
REMOTE_DIR="${REMOTE_DIR:-bert_jax}"
PYTHON="${PYTHON:-python3}"
STOP_TIMEOUT="${STOP_TIMEOUT:-600}"
GCLOUD="${GCLOUD:-gcloud}"
where=(--zone="$ZONE" --project="$PROJECT" --worker=all)

gcloud_() {  # runs (or with --dry_run prints) one gcloud command
  if [ "$dry_run" = 1 ]; then
    printf '%q' "$GCLOUD"; printf ' %q' "$@"; printf '\n'
  else
    "$GCLOUD" "$@"
  fi
}
on_workers() { gcloud_ compute tpus tpu-vm ssh "$TPU_NAME" "${where[@]}" --command="$1"; }

dir=$(printf '%q' "$REMOTE_DIR")
worker="cd $dir && PYTHON=$(printf '%q' "$PYTHON") STOP_TIMEOUT=$(printf '%q' "$STOP_TIMEOUT") bash launch/tpu_worker.sh"
case "$action" in
  status) on_workers "$worker status"; exit 0 ;;
  stop) on_workers "if [ -f $dir/launch/tpu_worker.sh ]; then $worker stop; fi"; exit 0 ;;
esac

cd "$(dirname "$0")/.."
# 1. The worker script first (a fresh VM has none), then stop what is running.
on_workers "mkdir -p $dir/launch"
gcloud_ compute tpus tpu-vm scp "${where[@]}" launch/tpu_worker.sh "$TPU_NAME:$REMOTE_DIR/launch/"
on_workers "$worker stop"
# 2. The project, installed.
gcloud_ compute tpus tpu-vm scp --recurse "${where[@]}" \
  setup.py README.md bert_jax data_pipeline configs launch "$TPU_NAME:$REMOTE_DIR/"
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  on_workers "cd $dir && $(printf '%q' "$PYTHON") -m pip install -q -e '.[tpu,gcs]'"
fi
# 3. The run, detached.
# Quoted for the worker's shell: overrides with glob characters and spaces arrive unchanged.
overrides=""
for a in "${args[@]}"; do overrides+=" $(printf '%q' "$a")"; done
on_workers "$worker start --config=$(printf '%q' "$CONFIG") --workdir=$(printf '%q' "$WORKDIR") --multihost=true$overrides"
