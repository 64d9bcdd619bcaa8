"""The offline demo: embedded corpus -> vocab -> TFRecords -> a tiny BERT pretrained on CPU.

`python -m bert_jax.main --config=configs/demo.py --workdir=/tmp/bert_demo` (a few minutes on a
laptop CPU; shorten with --config.num_train_steps=50).
"""

import ml_collections

from configs import base


def get_config():
    config = base.get_config()
    config.mode = "demo"
    config.model = base.get_model_config(num_layers=2, hidden=128, heads=2)  # BERT-Tiny's shape
    config.model.vocab_size = 8000  # replaced by the trained vocabulary's real size
    config.model.max_position_embeddings = 128
    config.max_seq_length = 128
    config.max_predictions_per_seq = 20
    config.global_batch_size = 32
    config.num_train_steps = 600
    config.learning_rate = 1e-3  # tiny models take a larger rate (Turc et al. use up to 3e-4 to fine-tune)
    config.warmup_steps = 60
    config.log_every_steps = 25
    config.eval_every_steps = 200
    config.eval_steps = 10
    config.checkpoint_every_steps = 200
    config.shuffle_buffer_size = 2000
    config.demo = ml_collections.ConfigDict()
    config.demo.num_shards = 4  # embedded corpus shards; the last one is held out for evaluation
    config.demo.vocab_size = 8000  # WordPiece vocabulary trained on the embedded corpus
    config.demo.dupe_factor = 5  # masked copies of each training document
    return config
