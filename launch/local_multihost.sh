#!/usr/bin/env bash
# Starts N local processes on 127.0.0.1, each with D CPU devices, joined by jax.distributed
# (gloo CPU collectives): the multi-host code path of a pod, on one machine.
#
#   NUM_PROCESSES=2 DEVICES_PER_PROCESS=1 launch/local_multihost.sh \
#       --config=configs/test.py --workdir=/tmp/w --config.train_data='/tmp/data/*.tfrecord'
#
# Every process gets the same arguments. If one exits non-zero the others are stopped
# (SIGTERM, then SIGKILL after KILL_AFTER seconds) and the script exits non-zero.
set -euo pipefail

NUM_PROCESSES="${NUM_PROCESSES:-2}"
DEVICES_PER_PROCESS="${DEVICES_PER_PROCESS:-1}"
PORT="${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
KILL_AFTER="${KILL_AFTER:-20}"
PYTHON="${PYTHON:-python3}"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  sleep 1
  for _ in $(seq "$KILL_AFTER"); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return
    sleep 1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

# Each process's fake devices are JAX_NUM_CPU_DEVICES'; any other XLA flag given passes through.
xla_flags=$(printf '%s' "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g')
for ((i = 0; i < NUM_PROCESSES; i++)); do
  BERT_JAX_COORDINATOR="127.0.0.1:$PORT" BERT_JAX_NUM_PROCESSES="$NUM_PROCESSES" BERT_JAX_PROCESS_ID="$i" \
  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES="$DEVICES_PER_PROCESS" XLA_FLAGS="$xla_flags" \
    "$PYTHON" -m bert_jax.main "$@" &
  pids+=("$!")
done

status=0
# Wait for the first process to end; a failure anywhere stops everyone.
while [ "${#pids[@]}" -gt 0 ]; do
  if ! wait -n; then status=1; break; fi
  remaining=()
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && remaining+=("$pid"); done
  pids=("${remaining[@]}")
done
exit "$status"
