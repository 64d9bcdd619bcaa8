"""What the pretraining and fine-tuning loops share (docs/architecture.md): nothing here imports
`bert_jax.pretrain` or `bert_jax.finetune`.

  run_setup      the model's config from a run's config, the PRNG, a checkpoint's parameters on the
                 mesh, TensorBoard's hparams, peak FLOP/s for MFU (from `chips`)
  train_state    `TrainState` and the guarded optimizer update both steps end with
  optim          optimizers (AdamW, LAMB, Google's AdamW) and learning-rate schedules (optax)
  sharding       the named (data, fsdp, tensor) mesh and the logical-axis rules
  compile_cache  JAX's persistent compilation cache (`config.compilation_cache`)
  host_memory    glibc's allocator kept from unmapping freed blocks on CPU-only machines
  chips          the chips' public figures (peak FLOP/s, HBM, links) and their slices' shapes
"""
