#!/usr/bin/env bash
# One TPU worker's side of launch/tpu_pod.sh, run there over SSH from the project copy:
#
#   bash launch/tpu_worker.sh stop            # the run this script started, and whatever else holds the TPU
#   bash launch/tpu_worker.sh start ARGS...   # python -m bert_jax.main ARGS..., detached
#   bash launch/tpu_worker.sh status          # is it running, and the end of its log
#   bash launch/tpu_worker.sh collect DEST [LOG]  # uploads LOG (default: the newest) to DEST/worker-<N>.log
#
# The run is started in its own session (setsid nohup), so closing the SSH connection does not
# stop it. Its output goes to $RUN_DIR/logs/<time>-<pid>.log; logs are never overwritten, and
# latest.log links to the newest. $RUN_DIR (default ~/bert_jax_run) also holds the pid file and,
# once the run has ended, its exit code (a small shell waits on it and writes `exit_code`).
# With LOG_DEST set (a folder, gs:// or local), that shell uploads the log there as worker-<N>.log
# every LOG_SYNC_SECONDS (default 60) when it has grown, and when the run ends: a slice that
# disappears keeps its logs. That shell uploads its own run's log, never latest.log: a sync that
# wakes after the next run has started must not send that run's log under this run's name. The
# final upload waits for the periodic one to finish, so an older copy never lands over it. The
# shell and its sync loop ignore SIGTERM and SIGHUP (the run does not: bert_jax saves on SIGTERM):
# a maintenance event or an OS shutdown signals every process of the VM, and the shell must live
# on to write the run's exit code and upload its whole log.
# `stop` sends SIGTERM (bert_jax saves a checkpoint at the next step every host reaches, then
# exits), waits up to STOP_TIMEOUT seconds, then SIGKILLs; it then stops any other process that
# holds the TPU's device files and removes libtpu's lock file, which a killed process leaves.
# Unless STOP_BY=supervisor (the supervisor's own stops), it first leaves `stop_requested` in
# $RUN_DIR: the run was stopped by a person, and a supervisor must not relaunch it.
#
# `status` prints, besides the log's end, one line `bert_jax-worker <N> <state> [rc]` that
# bert_jax/pod/supervisor.py reads; state is running, finished (exit 0 after the last step), stopped
# (exit 0 after saving on SIGTERM), halted (ended after a person's `stop`: rc), failed (non-zero
# exit: rc), gone (no process and no exit code: killed with the shell that watched it, or a
# rebooted VM) or none (never started here).
set -euo pipefail

RUN_DIR="${RUN_DIR:-$HOME/bert_jax_run}"
PYTHON="${PYTHON:-python3}"
STOP_TIMEOUT="${STOP_TIMEOUT:-600}"
LOG_SYNC_SECONDS="${LOG_SYNC_SECONDS:-60}"
# What holds a TPU: its device files (v4+: /dev/accel*, v5e/v6e: /dev/vfio/<n>).
TPU_DEVICES="${TPU_DEVICES:-/dev/accel* /dev/vfio/[0-9]*}"
LIBTPU_LOCKFILE="${LIBTPU_LOCKFILE:-/tmp/libtpu_lockfile}"
HOLDER_TIMEOUT="${HOLDER_TIMEOUT:-30}"  # seconds a process holding the TPU gets after SIGTERM
PID_FILE="$RUN_DIR/pid"
EXIT_FILE="$RUN_DIR/exit_code"
SHELL_PID_FILE="$RUN_DIR/shell_pid"  # the shell that waits on the run and writes its exit code
STOP_REQUESTED="$RUN_DIR/stop_requested"  # a person stopped the run (tpu_pod.sh --stop)
cd "$(dirname "$0")/.."

alive() {  # a process exists, whoever owns it (kill -0 answers EPERM for another user's: not "gone")
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

ours() {  # a live process whose command line is bert_jax.main
  alive "$1" && tr '\0' ' ' < "/proc/$1/cmdline" 2>/dev/null | grep -q "bert_jax.main"
}

worker_id() {  # this VM's worker number in the slice
  if [ -n "${TPU_WORKER_ID:-}" ]; then echo "$TPU_WORKER_ID"; return; fi
  local id
  id=$(curl -sf -m 2 -H 'Metadata-Flavor: Google' \
    http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number 2>/dev/null || true)
  echo "${id:-${BERT_JAX_PROCESS_ID:-$(hostname)}}"
}

wait_gone() {  # wait_gone SECONDS PID...: 0 when every PID has exited in time
  local deadline=$((SECONDS + $1)) pid any
  shift
  while :; do
    any=0
    for pid in "$@"; do alive "$pid" && any=1; done
    [ "$any" = 0 ] && return 0
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 1
  done
}

upload_log() {  # upload_log DEST [LOG]: LOG (default: the newest) to DEST/worker-<N>.log (through bert_jax's storage)
  local log="${2:-$RUN_DIR/logs/latest.log}"
  [ -e "$log" ] || return 0
  "$PYTHON" -c 'import sys; from data_pipeline import storage; from data_pipeline.storage import paths; storage.copy(sys.argv[1], paths.join(sys.argv[2], sys.argv[3]))' \
    "$(readlink -f "$log")" "$1" "worker-$(worker_id).log" || echo "$(hostname): could not upload the log to $1" >&2
}

stop() {
  if [ -f "$PID_FILE" ]; then
    local pid
    pid=$(cat "$PID_FILE")
    if ours "$pid"; then
      [ "${STOP_BY:-}" = supervisor ] || date -u +%FT%TZ > "$STOP_REQUESTED"
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
  # shellcheck disable=SC2086
  devices=$(ls $TPU_DEVICES 2>/dev/null || true)
  [ -z "$devices" ] && return 0
  if [ "$(id -u)" != 0 ] && command -v sudo > /dev/null; then sudo="sudo -n"; fi
  # shellcheck disable=SC2086
  holders=$($sudo lsof -t $devices 2>/dev/null | sort -u || true)
  if [ -n "$holders" ]; then
    echo "$(hostname): stopping processes holding the TPU: $(echo $holders)"
    # shellcheck disable=SC2086
    $sudo kill -TERM $holders 2>/dev/null || true
    # shellcheck disable=SC2086
    if ! wait_gone "$HOLDER_TIMEOUT" $holders; then
      # shellcheck disable=SC2086
      $sudo kill -KILL $holders 2>/dev/null || true
      # shellcheck disable=SC2086
      if ! wait_gone "$HOLDER_TIMEOUT" $holders; then  # the lock belongs to a live holder: leave it
        echo "$(hostname): processes $(echo $holders) still hold the TPU; libtpu's lock is kept" >&2
        return 1
      fi
    fi
  fi
  $sudo rm -f "$LIBTPU_LOCKFILE"
}

start() {
  if [ -f "$PID_FILE" ] && ours "$(cat "$PID_FILE")"; then
    echo "$(hostname): a run is already going (pid $(cat "$PID_FILE")): stop it first" >&2
    exit 1
  fi
  mkdir -p "$RUN_DIR/logs"
  rm -f "$PID_FILE" "$EXIT_FILE" "$SHELL_PID_FILE" "$STOP_REQUESTED"
  local log
  log="$RUN_DIR/logs/$(date +%Y%m%d-%H%M%S)-$$.log"
  ln -sfn "$(basename "$log")" "$RUN_DIR/logs/latest.log"
  # Its own session: no SIGHUP when SSH closes; stdin from /dev/null: nothing waits on the terminal.
  # The shell in between waits for the run, writes its exit code, and uploads the log.
  export RUN_DIR PYTHON LOG_SYNC_SECONDS LOG_DEST="${LOG_DEST:-}" RUN_LOG="$log"
  # shellcheck disable=SC2016
  setsid nohup bash -c '
    script=$1; shift
    "$@" &
    run=$!
    trap "" TERM HUP  # after the run started: it keeps the default (bert_jax saves on SIGTERM)
    echo "$run" > "$RUN_DIR/pid.tmp" && mv "$RUN_DIR/pid.tmp" "$RUN_DIR/pid"
    sync=""
    if [ -n "$LOG_DEST" ]; then  # uploaded when it has grown (an idle log costs nothing)
      (trap "" TERM HUP; sent=-1; while kill -0 "$run" 2>/dev/null; do
         waited=0  # a second at a time: this loop ends within one once the run has
         while [ "$waited" -lt "$LOG_SYNC_SECONDS" ] && kill -0 "$run" 2>/dev/null; do sleep 1; waited=$((waited + 1)); done
         kill -0 "$run" 2>/dev/null || break
         size=$(stat -Lc %s "$RUN_LOG" 2>/dev/null || echo 0)
         if [ "$size" != "$sent" ]; then bash "$script" collect "$LOG_DEST" "$RUN_LOG" && sent=$size; fi
       done) &
      sync=$!
    fi
    wait "$run"; rc=$?
    echo "$rc" > "$RUN_DIR/exit_code"
    if [ -n "$LOG_DEST" ]; then
      [ -n "$sync" ] && wait "$sync"  # an upload of an older copy must not land after the final one
      bash "$script" collect "$LOG_DEST" "$RUN_LOG"
    fi
  ' bash "$(pwd)/launch/tpu_worker.sh" "$PYTHON" -m bert_jax.main "$@" > "$log" 2>&1 < /dev/null &
  echo "$!" > "$SHELL_PID_FILE"
  local waited=0
  until [ -f "$PID_FILE" ]; do  # the run's own pid, written by the shell that started it
    sleep 0.1; waited=$((waited + 1))
    if [ "$waited" -ge 300 ]; then echo "$(hostname): the run did not start" >&2; exit 1; fi
  done
  echo "$(hostname): started pid $(cat "$PID_FILE") in $(pwd); log $log"
}

status() {
  local state rc=""
  if [ -f "$PID_FILE" ] && ours "$(cat "$PID_FILE")"; then
    state=running
    echo "$(hostname): running (pid $(cat "$PID_FILE"))"
  else
    echo "$(hostname): not running"
    local waited=0  # a run that has just ended: its shell writes the exit code in a moment
    while [ ! -f "$EXIT_FILE" ] && [ -f "$SHELL_PID_FILE" ] && alive "$(cat "$SHELL_PID_FILE")" && [ "$waited" -lt 100 ]; do
      sleep 0.1; waited=$((waited + 1))
    done
    if [ -f "$EXIT_FILE" ]; then
      rc=$(cat "$EXIT_FILE")
      if [ -f "$STOP_REQUESTED" ]; then state=halted
      elif [ "$rc" != 0 ]; then state=failed
      elif grep -q "preemption/SIGTERM: saved step" "$RUN_DIR/logs/latest.log" 2>/dev/null; then state=stopped
      else state=finished; fi
    elif [ -e "$RUN_DIR/logs/latest.log" ]; then state=gone
    else state=none; fi
  fi
  # The log's end (its last line may lack a newline: a progress bar's), then the status on a line of its own.
  if [ -e "$RUN_DIR/logs/latest.log" ]; then tail -n "${LINES:-5}" "$RUN_DIR/logs/latest.log"; echo; fi
  echo "bert_jax-worker $(worker_id) $state $rc"
}

command="${1:-}"
shift || true
case "$command" in
  stop) stop ;;
  start) start "$@" ;;
  status) status ;;
  collect) upload_log "$1" "${2:-}" ;;
  *) echo "usage: $0 stop | start ARGS... | status | collect DEST [LOG]" >&2; exit 2 ;;
esac
