#!/usr/bin/env bash
# Issue 30's GPU measurements in one device call: four lanes of processes share the GPU, their
# compiles side by side, their timed steps never at once (benchmarks.step.fp8 --gpu_lock), and the
# BERT-Large steps (most of the GPU's memory each) one process after the other (--slot_lock).
#   lane A: BERT-Large, T=128, batch 256, 24 layers unrolled: bf16 / gelu_tanh / fused_gelu_tanh
#           timed in alternating rounds, each profiled (2 steps) and two of their HLOs kept;
#   lane B: the kernel alone: its launch shapes swept (the fused variants use the fastest), then
#           against XLA's passes; tests/model/test_fused.py on the GPU (the Triton kernels against the
#           unfused path); BERT-Large packed 512 (32 rows of 3 sequences): bf16 / fused_gelu_tanh;
#   lane C: FP8's loss curve against bf16's (BERT-Base, 300 steps of real records, scanned), then
#           BERT-Base T=128 batch 256: bf16 / gelu_tanh / fp8_gelu_tanh;
#   lane D: BERT-Large T=128 batch 256: gelu_tanh / fp8_gelu_tanh (FP8 compiles for minutes).
# Every phase runs under the time left (a phase that would not fit is skipped and says so). What
# comes back is 8 files (the device tool's limit): four lane logs (some results inside them), three
# results as JSON, and the optimized HLO of two variants (the profile's kernel names).
#   bash benchmarks/gpu/fused_fp8.sh OUT_DIR [BUDGET_S]      (the device tool: OUT_DIR=$OUT)
set -u
OUT_DIR=${1:?an output folder}; BUDGET=${2:-540}
source "$(dirname "$0")/phases.sh"  # the wheels, the environment, `phase`
COMMON="--dtype=bfloat16 --attention=dot_product --prng=rbg --gpu_lock=/tmp/gpu.lock"
SLOT="--slot_lock=/tmp/big_memory.lock"  # BERT-Large's steps: one process at a time holds the memory

lane_a() {
  local log=$OUT_DIR/lane_a.log
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv >>"$log" 2>&1
  phase "$log" large24 200 0.55 python3 -m benchmarks.step.fp8 --config=configs/large.py $COMMON $SLOT \
    --seq_len=128 --batch=256 --variants=bf16,gelu_tanh,fused_gelu_tanh --parallel_compile \
    --fused_blocks_from=/tmp/fused_blocks.json \
    --warmup=2 --rounds=3 --steps=5 --profile_dir=/tmp/prof_large --profile_steps=2 --hlo_dir=/tmp/hlo_large \
    --out_json="$OUT_DIR/large24.json"
  [ -d /tmp/hlo_large ] && tar -cf "$OUT_DIR/hlo_large.tar" -C /tmp hlo_large/bf16.hlo.txt.gz hlo_large/fused_gelu_tanh.hlo.txt.gz
}

lane_b() {
  local log=$OUT_DIR/lane_b.log
  phase "$log" kernel 60 0.08 python3 -m benchmarks.step.fp8 --config=configs/large.py $COMMON \
    --seq_len=128 --batch=256 --kernel --kernel_iters=30 --kernel_sweep=/tmp/fused_blocks.json \
    --out_json=/tmp/kernel.json
  [ -f /tmp/fused_blocks.json ] || echo '{"forward": null, "backward": null}' >/tmp/fused_blocks.json
  [ -f /tmp/kernel.json ] && { echo "== kernel.json"; cat /tmp/kernel.json; echo; } >>"$log"
  phase "$log" test_fused 60 0.08 python3 -m pytest -q -p no:cacheprovider tests/model/test_fused.py
  phase "$log" packed512 150 0.45 python3 -m benchmarks.step.fp8 --config=configs/large.py $COMMON $SLOT \
    --seq_len=512 --batch=32 --packing --variants=bf16,fused_gelu_tanh --parallel_compile \
    --fused_blocks_from=/tmp/fused_blocks.json \
    --warmup=2 --rounds=3 --steps=5 --out_json="$OUT_DIR/packed512.json"
}

lane_c() {
  local log=$OUT_DIR/lane_c.log
  phase "$log" parity 120 0.12 python3 -m benchmarks.step.fp8 --config=configs/base.py $COMMON --scan \
    --parity=gpu_carry/parity_128x128.npz --parity_steps=300 --out_json="$OUT_DIR/parity.json"
  phase "$log" base128 120 0.2 python3 -m benchmarks.step.fp8 --config=configs/base.py $COMMON \
    --seq_len=128 --batch=256 --variants=bf16,gelu_tanh,fp8_gelu_tanh --parallel_compile \
    --warmup=2 --rounds=3 --steps=5 --out_json=/tmp/base128.json
  [ -f /tmp/base128.json ] && { echo "== base128.json"; cat /tmp/base128.json; echo; } >>"$log"
}

lane_d() {  # FP8 apart: its 24-layer program compiles for minutes; the others must not wait for it
  local log=$OUT_DIR/lane_d.log
  phase "$log" large24_fp8 200 0.55 python3 -m benchmarks.step.fp8 --config=configs/large.py $COMMON $SLOT \
    --seq_len=128 --batch=256 --variants=gelu_tanh,fp8_gelu_tanh --parallel_compile \
    --warmup=2 --rounds=3 --steps=5 --out_json=/tmp/large24_fp8.json
  [ -f /tmp/large24_fp8.json ] && { echo "== large24_fp8.json"; cat /tmp/large24_fp8.json; echo; } >>"$log"
}

rm -f /tmp/fused_blocks.json
lane_a & lane_b & lane_c & lane_d & wait
echo "all lanes done at +$(( $(date +%s) - T )) s"
for f in "$OUT_DIR"/lane_*.log; do
  echo "#### $(basename "$f")"
  grep -E "^==|seq/s|^kernel|passed|failed|Error|fp8_within|_mean_abs_diff|parity run|loss .* ->|sweep: fastest" "$f" \
    | grep -vE '^\s+"' | cut -c1-300 | tail -40
done
