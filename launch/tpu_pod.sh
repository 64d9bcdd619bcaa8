#!/usr/bin/env bash
# Runs bert_jax on every worker of a Cloud TPU VM pod slice: copy the project, install it, start
# `python -m bert_jax.main` with the same config on all workers. No other logic lives here.
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b PROJECT=my-project \
#   CONFIG=configs/large.py WORKDIR=gs://my-bucket/bert-large \
#   launch/tpu_pod.sh --config.train_data='gs://my-bucket/data/train-*.tfrecord'
#
# Extra arguments are passed to bert_jax.main (config overrides). WORKDIR should be a GCS path
# that every worker can reach (orbax and tf.data read and write gs:// directly).
set -euo pipefail

for var in TPU_NAME ZONE PROJECT CONFIG WORKDIR; do
  if [ -z "${!var:-}" ]; then
    echo "tpu_pod.sh: environment variable $var is required (see the header of $0)" >&2
    exit 2
  fi
done
REMOTE_DIR="${REMOTE_DIR:-bert_jax}"
EXTRA_ARGS=$(printf ' %q' "$@")

cd "$(dirname "$0")/.."
# scp with several sources needs the target folder to exist on every worker.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --worker=all \
  --command="mkdir -p $(printf '%q' "$REMOTE_DIR")"
gcloud compute tpus tpu-vm scp --recurse --zone="$ZONE" --project="$PROJECT" --worker=all \
  setup.py README.md bert_jax data_pipeline configs "$TPU_NAME:$REMOTE_DIR/"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --worker=all \
  --command="cd $(printf '%q' "$REMOTE_DIR") && python3 -m pip install -q -e '.[tpu]'"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --worker=all \
  --command="cd $(printf '%q' "$REMOTE_DIR") && python3 -m bert_jax.main --config=$(printf '%q' "$CONFIG") --workdir=$(printf '%q' "$WORKDIR") --multihost=true$EXTRA_ARGS"
