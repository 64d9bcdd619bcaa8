"""The model: the encoder and its configuration, attention, dropout, the fused kernels and the
pretraining heads (docs/architecture.md). Nothing here imports tensorflow, the training loops or
the checkpoints.

  model_config       `BertConfig`: the model's shape and options, and the config files it reads
  modeling           the encoder: embeddings, self-attention, feed-forward, the layer stack
  attention          scaled dot-product attention (einsum, cuDNN, Pallas splash) and its masks
  dropout            dropout with `jax.random.bernoulli`'s masks, in one fused pass
  fused              the dropout + residual + LayerNorm kernels (Pallas; Triton on GPUs)
  fused_ffn          the FFN's GEMM + bias + GELU kernels (Pallas; Triton on GPUs)
  fused_qkv          the Q/K/V projections as GEMM kernels, biases in their epilogues (Pallas; Triton)
  fused_fp8          FP8: the output layers' e5m2 gradient cast and amax inside the LayerNorm kernel
  pallas_gemm        what the GEMM kernels share: tiles, launch arguments, the row padding
  mixed_precision    matmuls with bf16 inputs and float32 outputs (CPUs with bf16 units)
  pretraining_heads  the masked-LM and next-sentence heads, `BertForPreTraining`
"""
