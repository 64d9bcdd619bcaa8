#!/usr/bin/env bash
# Issue 56's Q/K/V kernels on a GPU in one device call, two lanes of processes sharing the GPU: their
# compiles side by side, their timed parts never at once (a flock on /tmp/gpu.lock).
#   lane A: the Q/K/V kernels alone (benchmarks.kernels.fused_qkv: launch shapes swept, then against XLA's
#           GEMM, bias and slices, errors against float32); BERT-Large T=128 batch 256: the fused
#           LayerNorm kernels with tanh GELU (the fastest so far), then with the Q/K/V kernels
#           (`fused_qkv`), waited-for and pipelined steps, the last profiled; and on BERT-Large the
#           same without a Pallas GEMM: Q, K, V as three cuBLAS GEMMs (`separate_qkv`) with XLA's dot
#           merger off (it joined them again on 2026-11-28), their biases in cuBLASLt epilogues and
#           no slices (on a card under 100 GB, BERT-Large leaves the Q/K/V kernels' variant out,
#           and HF's BERT-Base runs after lane A: memory); then BERT-Base, all three;
#   lane B: tests/model/test_fused_qkv.py and test_fused_fp8.py on the GPU (the real Triton kernels
#           against the unfused path, and the LayerNorm kernels' e5m2 and e4m3 casts against flax's);
#           HF's FlaxBertForPreTraining (transformers<5, carried as wheels in .whl/) on the same
#           shapes, BERT-Base, in a process of its own; FP8 on BERT-Base with the LayerNorm kernels,
#           FP8's casts and amaxes in the kernels (the output denses' gradient in e5m2, the FFN's and,
#           unrolled as configs/base.py runs, the next layer's Q/K/V inputs in e4m3) against XLA's passes;
#   then, alone: HF's BERT-Large (49 GiB at once: not beside our BERT-Large on an 80 GB card).
# Every phase runs under the time left (a phase that would not fit is skipped and says so).
#   bash benchmarks/gpu/fused_qkv.sh OUT_DIR [BUDGET_S]      (the device tool: OUT_DIR=$OUT)
set -u
OUT_DIR=${1:?an output folder}; BUDGET=${2:-480}
source "$(dirname "$0")/phases.sh"  # the wheels, the environment, `phase`
# Two BERT-Large states and their step in one process need 48 GB (benchmarks/gpu/xla_options.sh, an H100), a
# third ~52: on a card under 100 GB BERT-Large gets 0.6 of it and two variants (the Q/K/V kernels'
# step is timed on Base there), and HF's BERT-Base waits until our processes are done.
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
SMALL=0; [ "${MIB:-0}" -lt 100000 ] 2>/dev/null && SMALL=1

lane_a() {
  local log=$OUT_DIR/lane_a.log
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv >>"$log" 2>&1
  phase "$log" kernel 60 0.2 $LOCKED python3 -m benchmarks.kernels.fused_qkv --sweep=/tmp/qkv_blocks.json \
    --out_json="$OUT_DIR/kernel.json"
  local qkv=",fused_qkv_gelu_tanh"  # the Q/K/V kernels' variant only where every launch shape compiled
  [ -f /tmp/qkv_blocks.json ] || { qkv=""; echo "== no Q/K/V launch shape compiled: its variant left out" >>"$log"; }
  local merged="fused_gelu_tanh_separate_qkv+xla_disable_hlo_passes=dot-merger"
  local large_qkv=$qkv large_mem=0.5
  if [ "$SMALL" = 1 ]; then
    large_qkv="" large_mem=0.6; echo "== ${MIB:-?} MiB: BERT-Large without the Q/K/V kernels' variant (memory)" >>"$log"
  fi
  local profiled=${large_qkv#,}
  phase "$log" large 150 $large_mem python3 -m benchmarks.step.fp8 --config=configs/large.py $COMMON --gpu_lock=$LOCK \
    --variants=fused_gelu_tanh,$merged$large_qkv --parallel_compile --fused_qkv_blocks_from=/tmp/qkv_blocks.json \
    --warmup=2 --rounds=3 --steps=5 --pipelined_steps=10 \
    --profile_dir=/tmp/prof_large --profile_steps=2 --profile_variants=${profiled:-$merged} \
    --out_json="$OUT_DIR/large.json"
  phase "$log" base 80 0.3 python3 -m benchmarks.step.fp8 --config=configs/base.py $COMMON --gpu_lock=$LOCK \
    --variants=fused_gelu_tanh,$merged$qkv --parallel_compile --fused_qkv_blocks_from=/tmp/qkv_blocks.json \
    --warmup=2 --rounds=3 --steps=5 --pipelined_steps=10 --out_json="$OUT_DIR/base.json"
}

lane_b() {
  local log=$OUT_DIR/lane_b.log
  phase "$log" tests 60 0.08 $LOCKED python3 -m pytest -q -p no:cacheprovider tests/model/test_fused_qkv.py \
    tests/model/test_fused_fp8.py
  [ "$SMALL" = 1 ] || hf_peer "$log" hf_base 60 0.3 configs/base.py --hf_gpu_lock=$LOCK
  phase "$log" fp8_base 120 0.25 python3 -m benchmarks.step.fp8 --config=configs/base.py $COMMON --gpu_lock=$LOCK \
    --variants=fp8_fused_gelu_tanh,fp8_fused_cast_apart_gelu_tanh --parallel_compile \
    --warmup=2 --rounds=3 --steps=5 --pipelined_steps=10 --out_json="$OUT_DIR/fp8_base.json"
}

lane_a & lane_b & wait
[ "$SMALL" = 0 ] || hf_peer "$OUT_DIR/lane_b.log" hf_base 60 0.3 configs/base.py
hf_peer "$OUT_DIR/lane_b.log" hf_large 120 0.9 configs/large.py
summarize
