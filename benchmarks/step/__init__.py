"""Pretraining-step throughput, MFU and compile time, and the variants of the step (FP8, dropout masks,
optimizer, bf16 matmuls on CPU); ahead-of-time compilation for TPU slices."""
