#!/usr/bin/env bash
# Issue 56's GPU measurements of 2026-11-28 (second call), in one device call, two lanes of
# processes sharing the GPU: their compiles side by side, their timed parts never at once (a flock
# on /tmp/gpu.lock).
#   lane A: BERT-Base (hidden 768, now read by the LayerNorm kernels as 512 + 256 columns): the
#           kernel alone against XLA with its launch shapes swept; the step with the tanh GELU, with
#           the kernels, and each with Q/K/V as three matmuls (`separate_qkv`); then BERT-Large:
#           the tanh GELU, the kernels, the kernels with `separate_qkv` (profiled);
#   lane B: tests/model/test_fused.py and the separate-Q/K/V test on the GPU (the real Triton kernels,
#           BERT-Base's 768 among them); HF's FlaxBertForPreTraining (transformers<5, carried as
#           wheels in .whl/), BERT-Base, in a process of its own;
#   then, alone: HF's BERT-Large (its step allocates 49 GiB at once).
# Every phase runs under the time left (a phase that would not fit is skipped and says so).
#   bash benchmarks/gpu/base_kernels.sh OUT_DIR [BUDGET_S]      (the device tool: OUT_DIR=$OUT)
# The second call (`... OUT_DIR BUDGET_S again`): BERT-Base's launch-shape sweep (it failed in the
# first call) and its step with the kernels at the swept shapes, beside HF's BERT-Large.
set -u
OUT_DIR=${1:?an output folder}; BUDGET=${2:-480}; MODE=${3:-first}
source "$(dirname "$0")/phases.sh"  # the wheels, the environment, `phase`
STEPS="--warmup=2 --rounds=3 --steps=5 --pipelined_steps=10 --parallel_compile --gpu_lock=$LOCK"

lane_a() {
  local log=$OUT_DIR/lane_a.log
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv >>"$log" 2>&1
  phase "$log" base_kernel 40 0.2 python3 -m benchmarks.step.fp8 --config=configs/base.py $COMMON --kernel \
    --kernel_sweep=/tmp/base_blocks.json --gpu_lock=$LOCK --out_json="$OUT_DIR/base_kernel.json"
  phase "$log" base 90 0.35 python3 -m benchmarks.step.fp8 --config=configs/base.py $COMMON $STEPS \
    --variants=gelu_tanh,fused_gelu_tanh,gelu_tanh_separate_qkv,fused_gelu_tanh_separate_qkv \
    --fused_blocks_from=/tmp/base_blocks.json --fused_blocks_wait=5 --out_json="$OUT_DIR/base.json"
  phase "$log" large 140 0.5 python3 -m benchmarks.step.fp8 --config=configs/large.py $COMMON $STEPS \
    --variants=gelu_tanh,fused_gelu_tanh,fused_gelu_tanh_separate_qkv \
    --profile_dir=/tmp/prof_large --profile_steps=2 --profile_variants=fused_gelu_tanh_separate_qkv \
    --out_json="$OUT_DIR/large.json"
}

lane_b() {
  local log=$OUT_DIR/lane_b.log
  phase "$log" tests 40 0.08 $LOCKED env JAX_DEFAULT_MATMUL_PRECISION=float32 python3 -m pytest -q -p no:cacheprovider tests/model/test_fused.py \
    "tests/model/test_modeling_options.py::test_separate_qkv_matmuls_train_like_the_stacked_kernel"
  phase "$log" hf_base 60 0.3 python3 -m benchmarks.step.pretrain_step --config=configs/base.py $COMMON \
    --hf_only --warmup=2 --rounds=3 --steps=5 --hf_pipelined_steps=10 --hf_gpu_lock=$LOCK --host_memory=false
}

again_a() {
  local log=$OUT_DIR/lane_a.log
  phase "$log" base_kernel 40 0.2 python3 -m benchmarks.step.fp8 --config=configs/base.py $COMMON --kernel \
    --kernel_sweep=/tmp/base_blocks.json --gpu_lock=$LOCK --out_json="$OUT_DIR/base_kernel.json"
  phase "$log" base 80 0.3 python3 -m benchmarks.step.fp8 --config=configs/base.py $COMMON $STEPS \
    --variants=gelu_tanh,fused_gelu_tanh --fused_blocks_from=/tmp/base_blocks.json --fused_blocks_wait=5 \
    --out_json="$OUT_DIR/base.json"
}

if [ "$MODE" = again ]; then
  again_a & phase "$OUT_DIR/lane_b.log" hf_large 110 0.5 python3 -m benchmarks.step.pretrain_step --config=configs/large.py \
    $COMMON --hf_only --warmup=2 --rounds=3 --steps=5 --hf_pipelined_steps=10 --hf_gpu_lock=$LOCK --host_memory=false &
  wait
else
lane_a & lane_b & wait
phase "$OUT_DIR/lane_b.log" hf_large 110 0.9 python3 -m benchmarks.step.pretrain_step --config=configs/large.py $COMMON \
  --hf_only --warmup=2 --rounds=3 --steps=5 --hf_pipelined_steps=10 --host_memory=false
fi
echo "all lanes done at +$(( $(date +%s) - T )) s"
for f in "$OUT_DIR"/lane_*.log; do
  echo "#### $(basename "$f")"
  grep -E "^==|seq/s|sweep: fastest|^kernel|passed|failed|Error|hf_step_s|speedup" "$f" | cut -c1-400 | tail -40
done
