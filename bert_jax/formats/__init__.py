"""Checkpoint formats, one module each: names, config, read, write.

* `google`: Google's TF1 checkpoints (`bert_model.ckpt` + `bert_config.json`), and the name table
  every format maps through;
* `hf`: HuggingFace (`config.json` + `model.safetensors`, sharded safetensors, `flax_model.msgpack`,
  `pytorch_model.bin`);
* `native`: ours (`bert_config.json` + orbax `params/` + `task.json` for a fine-tuned model, or a
  training workdir's checkpoints);
* `modernbert_hf`: transformers' ModernBERT (`config.json` + `model.safetensors`), the MLM model and
  its task heads, to and from `bert_jax.model.modernbert`'s parameters;
* `common`: `Pretrained`, the checkpoint in memory that every reader returns and every writer takes.

`bert_jax.convert` detects the format, dispatches to these, and is the CLI. None of them imports
tensorflow except inside the two functions that read and write Google's checkpoints.
"""
