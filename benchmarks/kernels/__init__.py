"""The Pallas kernels (fused FFN, Q/K/V, dropout + residual + LayerNorm) against XLA's passes."""
