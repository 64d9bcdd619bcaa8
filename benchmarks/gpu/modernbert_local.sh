#!/usr/bin/env bash
# Issue 72's GPU measurement: ModernBERT-base's pretraining step (bfloat16, attention_impl="dot_product",
# 16,384 tokens a step, rows padded at random lengths) at lengths 1,024 and 8,192, its local layers
# on the kernel's own window (`attention.local_kernel`: cuDNN's `local_window_size` where cuDNN takes
# a two-sided window, which jax 0.10.2 refuses and logs: then the blocks) against the band mask in
# cuDNN's fused attention (`local_blocks=False`), from the same parameters and batch, timed in
# alternating rounds, their masked-LM logits and losses compared (benchmarks/step/modernbert_local.py;
# a disagreement fails the phase). One process at a time holds the GPU; a phase runs only if the
# time left allows it, else it says so.
#   phase len1024: 16 rows of 1,024     phase len8192: 2 rows of 8,192
#   bash benchmarks/gpu/modernbert_local.sh OUT_DIR [BUDGET_S]      (the device tool: OUT_DIR=$OUT)
#   bash benchmarks/gpu/modernbert_local.sh --help                  (this text)
set -u
case "${1:-}" in
  -h|--help) sed -n '2,/^set -u/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "unknown option $1 (bash $0 --help)" >&2; exit 2 ;;
esac
OUT_DIR=${1:?an output folder (bash $0 --help)}; BUDGET=${2:-480}
case "$BUDGET" in ''|*[!0-9]*) echo "BUDGET_S must be a number of seconds, got '$BUDGET'" >&2; exit 2 ;; esac
source "$(dirname "$0")/phases.sh"  # the wheels, the environment, `phase`
LOG=$OUT_DIR/lane_a.log
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv >>"$LOG" 2>&1
phase "$LOG" len1024 150 0.9 python3 -m benchmarks.step.modernbert_local --lengths=1024 --batch_tokens=16384 \
  --json="$OUT_DIR/len1024.json"
phase "$LOG" len8192 200 0.9 python3 -m benchmarks.step.modernbert_local --lengths=8192 --batch_tokens=16384 \
  --json="$OUT_DIR/len8192.json"
echo "done at +$(( $(date +%s) - T )) s"
grep -E "^==|^length|refused|DISAGREE|disagree|Error" "$LOG" | cut -c1-400 | tail -40
