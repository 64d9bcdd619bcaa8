#!/usr/bin/env bash
# One TPU worker's side of launch/tpu_pod.sh, run there over SSH from the project copy:
#
#   bash launch/tpu_worker.sh stop            # the run this script started, and whatever else holds the TPU
#   bash launch/tpu_worker.sh start ARGS...   # python -m bert_jax.main ARGS..., detached
#   bash launch/tpu_worker.sh status          # is it running, and the end of its log
#
# The run is started in its own session (setsid nohup), so closing the SSH connection does not
# stop it. Its output goes to $RUN_DIR/logs/<time>-<pid>.log; logs are never overwritten, and
# latest.log links to the newest. $RUN_DIR (default ~/bert_jax_run) also holds the pid file.
# `stop` sends SIGTERM (bert_jax saves a checkpoint at the next step every host reaches, then
# exits), waits up to STOP_TIMEOUT seconds, then SIGKILLs; it then stops any other process that
# holds the TPU's device files and removes libtpu's lock file, which a killed process leaves.
set -euo pipefail

RUN_DIR="${RUN_DIR:-$HOME/bert_jax_run}"
PYTHON="${PYTHON:-python3}"
STOP_TIMEOUT="${STOP_TIMEOUT:-600}"
PID_FILE="$RUN_DIR/pid"
cd "$(dirname "$0")/.."

ours() {  # a live process whose command line is bert_jax.main
  kill -0 "$1" 2>/dev/null && tr '\0' ' ' < "/proc/$1/cmdline" 2>/dev/null | grep -q "bert_jax.main"
}

wait_gone() {  # wait_gone SECONDS PID...: 0 when every PID has exited in time
  local deadline=$((SECONDS + $1)) pid alive
  shift
  while :; do
    alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 1
  done
}

stop() {
  if [ -f "$PID_FILE" ]; then
    local pid
    pid=$(cat "$PID_FILE")
    if ours "$pid"; then
      echo "$(hostname): stopping run $pid (SIGTERM: it saves a checkpoint, then exits)"
      kill -TERM "$pid" 2>/dev/null || true
      if ! wait_gone "$STOP_TIMEOUT" "$pid"; then
        echo "$(hostname): run $pid still alive after ${STOP_TIMEOUT}s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        wait_gone 30 "$pid" || true
      fi
    fi
    rm -f "$PID_FILE"
  fi
  # Anything else holding the TPU (a notebook kernel, a run started by hand).
  local devices holders sudo=""
  devices=$(ls /dev/accel* /dev/vfio/[0-9]* 2>/dev/null || true)
  [ -z "$devices" ] && return 0
  if [ "$(id -u)" != 0 ] && command -v sudo > /dev/null; then sudo="sudo -n"; fi
  # shellcheck disable=SC2086
  holders=$($sudo lsof -t $devices 2>/dev/null | sort -u || true)
  if [ -n "$holders" ]; then
    echo "$(hostname): stopping processes holding the TPU: $(echo $holders)"
    # shellcheck disable=SC2086
    $sudo kill -TERM $holders 2>/dev/null || true
    # shellcheck disable=SC2086
    wait_gone 30 $holders || $sudo kill -KILL $holders 2>/dev/null || true
  fi
  $sudo rm -f /tmp/libtpu_lockfile
}

start() {
  if [ -f "$PID_FILE" ] && ours "$(cat "$PID_FILE")"; then
    echo "$(hostname): a run is already going (pid $(cat "$PID_FILE")): stop it first" >&2
    exit 1
  fi
  mkdir -p "$RUN_DIR/logs"
  local log
  log="$RUN_DIR/logs/$(date +%Y%m%d-%H%M%S)-$$.log"
  # Its own session: no SIGHUP when SSH closes; stdin from /dev/null: nothing waits on the terminal.
  setsid nohup "$PYTHON" -m bert_jax.main "$@" > "$log" 2>&1 < /dev/null &
  echo "$!" > "$PID_FILE"
  ln -sfn "$(basename "$log")" "$RUN_DIR/logs/latest.log"
  echo "$(hostname): started pid $! in $(pwd); log $log"
}

status() {
  if [ -f "$PID_FILE" ] && ours "$(cat "$PID_FILE")"; then
    echo "$(hostname): running (pid $(cat "$PID_FILE"))"
  else
    echo "$(hostname): not running"
  fi
  if [ -e "$RUN_DIR/logs/latest.log" ]; then tail -n "${LINES:-5}" "$RUN_DIR/logs/latest.log"; fi
}

command="${1:-}"
shift || true
case "$command" in
  stop) stop ;;
  start) start "$@" ;;
  status) status ;;
  *) echo "usage: $0 stop | start ARGS... | status" >&2; exit 2 ;;
esac
