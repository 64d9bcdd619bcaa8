#!/usr/bin/env bash
# Issue 56's GPU measurements in one device call, two lanes of processes sharing the GPU: their
# compiles side by side, their timed parts never at once (a flock on /tmp/gpu.lock).
#   lane A: the FFN kernels alone (benchmarks.kernels.fused_ffn: launch shapes swept, then against XLA's GEMMs
#           and passes, errors against float32); BERT-Large T=128 batch 256: tanh GELU unfused, the
#           fused LayerNorm kernels (`fused_ops`, the output biases now inside them), and those with
#           the FFN kernels (`fused_ffn`), waited-for and pipelined steps, the last profiled; then
#           BERT-Base (hidden 768: no LayerNorm kernels): tanh GELU without and with the FFN kernels;
#   lane B: tests/model/test_fused_ffn.py and tests/model/test_fused.py on the GPU (the real Triton kernels
#           against the unfused path); HF's FlaxBertForPreTraining (transformers<5, carried as wheels
#           in .whl/) on the same shapes, BERT-Base, in a process of its own;
#   then, alone: HF's BERT-Large.
# Every phase runs under the time left (a phase that would not fit is skipped and says so).
#   bash benchmarks/gpu/fused_ffn.sh OUT_DIR [BUDGET_S]      (the device tool: OUT_DIR=$OUT)
set -u
OUT_DIR=${1:?an output folder}; BUDGET=${2:-480}
source "$(dirname "$0")/phases.sh"  # the wheels, the environment, `phase`

lane_a() {
  local log=$OUT_DIR/lane_a.log
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv >>"$log" 2>&1
  phase "$log" kernel 60 0.2 $LOCKED python3 -m benchmarks.kernels.fused_ffn --sweep=/tmp/ffn_blocks.json \
    --out_json="$OUT_DIR/kernel.json"
  local ffn=",fused_ffn_gelu_tanh"  # the FFN kernels' variant only where a launch shape compiled
  [ -f /tmp/ffn_blocks.json ] || { ffn=""; echo "== no FFN launch shape compiled: its variants left out" >>"$log"; }
  phase "$log" large 150 0.5 python3 -m benchmarks.step.fp8 --config=configs/large.py $COMMON --gpu_lock=$LOCK \
    --variants=gelu_tanh,fused_gelu_tanh$ffn --parallel_compile --fused_ffn_blocks_from=/tmp/ffn_blocks.json \
    --warmup=2 --rounds=3 --steps=5 --pipelined_steps=10 \
    --profile_dir=/tmp/prof_large --profile_steps=2 --profile_variants=fused_ffn_gelu_tanh \
    --out_json="$OUT_DIR/large.json"
  phase "$log" base 80 0.3 python3 -m benchmarks.step.fp8 --config=configs/base.py $COMMON --gpu_lock=$LOCK \
    --variants=gelu_tanh$ffn --parallel_compile --fused_ffn_blocks_from=/tmp/ffn_blocks.json \
    --warmup=2 --rounds=3 --steps=5 --pipelined_steps=10 --out_json="$OUT_DIR/base.json"
}

lane_b() {
  local log=$OUT_DIR/lane_b.log
  phase "$log" tests 40 0.08 $LOCKED python3 -m pytest -q -p no:cacheprovider tests/model/test_fused_ffn.py tests/model/test_fused.py
  hf_peer "$log" hf_base 60 0.3 configs/base.py --hf_gpu_lock=$LOCK
}

lane_a & lane_b & wait
# HF's BERT-Large alone at the end: its step allocates 49 GiB at once (an H200, 2026-11-28), more
# than fits beside our BERT-Large process on an 80 GB card.
hf_peer "$OUT_DIR/lane_b.log" hf_large 120 0.9 configs/large.py
summarize
