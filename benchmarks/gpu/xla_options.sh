#!/usr/bin/env bash
# Issue 41's XLA-options measurement (benchmarks/step/RESULTS.md, "One H100, 2026-11-27"): the best
# step (fused kernels + tanh GELU) with the XLA option `xla_gpu_enable_cublaslt` (cuBLASLt GEMMs,
# whose epilogue can take the bias and the tanh GELU) and without Triton's GEMMs, built from one
# initial state in one process, timed in alternating rounds both per step (waited for) and
# pipelined (as bert_jax.main runs); then FP8 against it. One process at a time holds the GPU; a
# phase runs only if the time left and the device's memory allow it, else it says why.
#   phase 1: BERT-Base, T=128, batch 256: the four variants, 2 x 2 (peak 19 GB)
#   phase 2: BERT-Large, T=128, batch 256, 24 layers unrolled: with and without Triton's GEMMs
#            (peak 43 GB; four BERT-Large variants in one process ran out of the H100's memory)
#   phase 3: BERT-Large, FP8 + fused + tanh GELU against fused + tanh GELU (compiles ~110 s)
#   bash benchmarks/gpu/xla_options.sh OUT_DIR [BUDGET_S]      (the device tool: OUT_DIR=$OUT)
set -u
OUT_DIR=${1:?an output folder}; BUDGET=${2:-600}
mkdir -p "$OUT_DIR"; DEADLINE=$(( $(date +%s) + BUDGET )); T=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then  # ml_collections, google-crc32c: not in the GPU image
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
# Without preallocation XLA still caps the process at 75% of the GPU's memory unless told otherwise.
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 TF_CPP_MIN_LOG_LEVEL=2
LOG=$OUT_DIR/gpu_xla_options.log
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee -a "$LOG"
TOTAL_GB=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) / 1024 ))
COMMON="--dtype=bfloat16 --attention=dot_product --prng=rbg --seq_len=128 --batch=256 --parallel_compile \
  --warmup=2 --rounds=3 --steps=5 --pipelined_steps=10"
FOUR="fused_gelu_tanh,fused_gelu_tanh+xla_gpu_enable_cublaslt=true,fused_gelu_tanh+xla_gpu_enable_triton_gemm=false"
FOUR="$FOUR,fused_gelu_tanh+xla_gpu_enable_cublaslt=true+xla_gpu_enable_triton_gemm=false"

phase() {  # phase NAME NEEDED_S NEEDED_GB command...
  local name=$1 need=$2 gb=$3; shift 3
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt "$need" ]; then echo "== $name: skipped, $left s left (needs ~$need)" | tee -a "$LOG"; return; fi
  if [ "$TOTAL_GB" -lt "$gb" ]; then echo "== $name: skipped, the GPU has $TOTAL_GB GB (needs ~$gb)" | tee -a "$LOG"; return; fi
  echo "== $name: start at +$(( $(date +%s) - T )) s, $left s left: $*" | tee -a "$LOG"
  timeout -k 10 "$left" "$@" 2>&1 | grep -vE '^\s+"' | tee -a "$LOG"
  echo "== $name: rc=${PIPESTATUS[0]} at +$(( $(date +%s) - T )) s" | tee -a "$LOG"
}

phase base 160 24 python3 -m benchmarks.step.fp8 --config=configs/base.py $COMMON --variants="$FOUR" \
  --out_json="$OUT_DIR/base.json"
phase large 170 48 python3 -m benchmarks.step.fp8 --config=configs/large.py $COMMON \
  --variants=fused_gelu_tanh,fused_gelu_tanh+xla_gpu_enable_triton_gemm=false --out_json="$OUT_DIR/large.json"
phase large_fp8 230 48 python3 -m benchmarks.step.fp8 --config=configs/large.py $COMMON \
  --variants=fused_gelu_tanh,fp8_fused_gelu_tanh --out_json="$OUT_DIR/large_fp8.json"
echo "done at +$(( $(date +%s) - T )) s" | tee -a "$LOG"
