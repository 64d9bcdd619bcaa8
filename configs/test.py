"""A test-sized model (L=2, H=32, A=4) for CPU unit tests and CI: compiles and steps in seconds."""

from configs import base


def get_config():
    config = base.get_config()
    config.model = base.get_model_config(num_layers=2, hidden=32, heads=4)
    config.model.vocab_size = 512  # small test vocabularies
    config.model.intermediate_size = 64  # 2H, not 4H: catches shape mix-ups; divides any tensor axis <= 8
    config.model.max_position_embeddings = 64
    config.max_seq_length = 32
    config.max_predictions_per_seq = 5
    config.global_batch_size = 8
    config.num_train_steps = 10
    config.warmup_steps = 2
    return config
