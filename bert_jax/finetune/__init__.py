"""Fine-tuning: the loop, its batches, the task heads and prediction (docs/finetuning.md,
docs/architecture.md). It imports `bert_jax.model`, `bert_jax.training` and `bert_jax.checkpoints`,
never `bert_jax.pretrain`; `data_pipeline.tasks` reads and featurizes the data.

  loop     `run` and `train_and_evaluate`: one loop for every task, evaluation after each epoch,
           the best epoch kept, test predictions
  preparation  what every seed of a run shares, made once: the data featurized, the step plan,
           the optimizer, the jitted programs (`prepare` -> `Prepared`)
  restarts `config.seeds`: the paper's random restarts, one run per seed, the best on dev kept
  steps    the train and eval steps, and predicting a split batch by batch
  batches  every batching decision: the steps of a run, each step's rows, trimming rows short of
           their padding, the lengths and packed row counts worth a compile
  bucketing  the arithmetic of row and batch lengths, and which lengths are worth a compile
  row_packing  rows packed several to a row (first fit), for the classification, regression
           and token heads
  heads    `BertForTask`: the encoder plus a classification, regression, span, token or
           multiple-choice head, and their losses
  modernbert_tasks  `config.model_family="modernbert"`: transformers' ModernBERT task classes behind
           `BertForTask`'s call, the init checkpoint, BERT-only options refused, the export
  predict  the fine-tuned model on new text (`config.mode=predict`)
"""
