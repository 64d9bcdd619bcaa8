"""Pretraining: the loop, its input, the checks before compiling, phases, and the losses and step
(docs/pretraining.md, docs/architecture.md). It imports `bert_jax.model`, `bert_jax.training` and
`bert_jax.checkpoints`, never `bert_jax.finetune`.

  loop             `run` (pretrain, resuming from the workdir): mesh, sharded init, restore, the
                   jitted step, logging, evaluation, saves, preemption
  checkpoint_eval  `evaluate` (mode=evaluate): a checkpoint scored on pretraining records
  feed             the per-host tf.data input made global, its position saved with the checkpoint
  startup_checks   what every host checks before compiling: config, mesh, data, vocab, token ids
  model_family     BERT or ModernBERT: the model, its init inputs, FLOPs, what ModernBERT refuses
  phases           the phases of a run (length 128, then 512), each phase's own rate in one schedule
  divergence       the loss-spike rule and its statistic, `DivergenceError`, `config.skip_batches`
  rollback         rolling back past a loss spike; the batches skipped (`skipped_batches.json`)
  steps            the masked-LM / next-sentence / left-to-right losses, the train and eval steps,
                   FLOPs per sequence
"""
