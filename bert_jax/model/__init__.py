"""The model: the encoder and its configuration, attention, dropout, the fused kernels and the
pretraining heads (docs/architecture.md). Nothing here imports tensorflow, the training loops or
the checkpoints.

  model_config       `BertConfig`: the model's shape and options, and the config files it reads
  modeling           the encoder: embeddings, self-attention, feed-forward, the layer stack
  attention          scaled dot-product attention (einsum, cuDNN, Pallas splash) and its masks
  dropout            dropout with `jax.random.bernoulli`'s masks, in one fused pass
  layers             the building blocks: Dense, LayerNorm, activations, initializers, sub-layer ends
  kernels/           the Pallas kernels (Triton on GPUs) and their run per device on a mesh
  modernbert         a ModernBERT-family encoder beside BERT, exact to transformers
  mixed_precision    matmuls with bf16 inputs and float32 outputs (CPUs with bf16 units)
  pretraining_heads  the masked-LM and next-sentence heads, `BertForPreTraining`
"""
