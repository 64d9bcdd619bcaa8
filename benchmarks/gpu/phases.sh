# Sourced by the device scripts (benchmarks/gpu/fused_fp8.sh, benchmarks/gpu/fused_ffn.sh, benchmarks/gpu/fused_qkv.sh, benchmarks/gpu/base_kernels.sh, benchmarks/gpu/modernbert_local.sh): the wheels the GPU image lacks
# (.whl/, installed to /tmp/site), the environment, and `phase`, which runs one step of a script
# under the time its BUDGET leaves (a phase that would not fit is skipped and says so), `$LOCKED`, `COMMON`.
#   OUT_DIR=... BUDGET=...; source benchmarks/gpu/phases.sh
mkdir -p "$OUT_DIR"; DEADLINE=$(( $(date +%s) + BUDGET ))
if ls .whl/*.whl >/dev/null 2>&1; then  # e.g. ml_collections, google-crc32c, transformers<5
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
T=$(date +%s)
# Processes that share the GPU take turns for their timed parts: `$LOCKED COMMAND...` runs the
# command holding $LOCK (flock(2), as benchmarks.step.fp8 --gpu_lock; a program, not a shell function, so
# that `timeout` can run it). COMMON: the step benchmarks' shapes (length 128, batch 256, bf16).
LOCK=/tmp/gpu.lock
cat >/tmp/locked.py <<'PY'
import fcntl, subprocess, sys
lock = open(sys.argv[1], "a+")
fcntl.flock(lock, fcntl.LOCK_EX)
sys.exit(subprocess.call(sys.argv[2:]))
PY
LOCKED="python3 /tmp/locked.py $LOCK"
COMMON="--dtype=bfloat16 --attention=dot_product --prng=rbg --seq_len=128 --batch=256"

phase() {  # phase LOG NAME NEEDED_S MEM_FRACTION command...
  local log=$1 name=$2 need=$3 mem=$4; shift 4
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt "$need" ]; then echo "== $name: skipped, $left s left (needs ~$need)" >>"$log"; return; fi
  echo "== $name: start at +$(( $(date +%s) - T )) s, $left s left: $*" >>"$log"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$mem timeout -k 10 "$left" "$@" >>"$log" 2>&1
  echo "== $name: rc=$? at +$(( $(date +%s) - T )) s" >>"$log"
}

hf_peer() {  # hf_peer LOG NAME NEEDED_S MEM_FRACTION CONFIG [flags...]: HF's FlaxBertForPreTraining, COMMON's shapes
  local log=$1 name=$2 need=$3 mem=$4 config=$5; shift 5
  phase "$log" "$name" "$need" "$mem" python3 -m benchmarks.step.pretrain_step --config="$config" $COMMON \
    --hf_only --warmup=2 --rounds=3 --steps=5 --hf_pipelined_steps=10 --host_memory=false "$@"
}

summarize() {  # the lines of every lane's log that the results need
  echo "all lanes done at +$(( $(date +%s) - T )) s"
  for f in "$OUT_DIR"/lane_*.log; do
    echo "#### $(basename "$f")"
    grep -E "^==|seq/s|sweep: fastest|fused .* ms|errors vs|passed|failed|Error|hf_step_s" "$f" | cut -c1-400 | tail -40
  done
}
