"""The scripts a lent GPU session runs (bash benchmarks/gpu/NAME.sh OUT_DIR [BUDGET_S]); the GPU lock the
benchmarks take is benchmarks.common.gpu_lock."""
