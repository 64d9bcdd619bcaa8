"""The model's Pallas kernels (Triton on GPUs, Pallas' interpreter elsewhere), each behind a
`BertConfig` option and equal to the unfused path it replaces (docs/architecture.md). Part of the
model layer: nothing here imports above `bert_jax.model`.

  fused        the (bias +) dropout + residual + LayerNorm kernels (`fused_ops`)
  fused_ffn    the FFN's GEMM + bias + GELU kernels (`fused_ffn`)
  fused_qkv    the Q/K/V projections as GEMM kernels, biases in their epilogues (`fused_qkv`)
  fused_fp8    FP8: the e5m2 gradient cast and amax inside the LayerNorm kernels (`fp8` + `fused_ops`)
  pallas_gemm  what the GEMM kernels share: tiles, launch arguments, the row padding
  per_device   every kernel on a mesh: each device runs it on its own rows (`jax.shard_map`)
"""
