"""A CPU-sized ModernBERT (L=2, H=64, A=4) pretrained through `bert_jax.main`: the ModernBERT recipe of
configs/modernbert_base.py in miniature, for tests and a first run on a laptop.

    python -m bert_jax.main --config=configs/modernbert_tiny.py --workdir=W \\
        --config.train_data='RECORDS/*.tfrecord' --config.vocab_file=VOCAB

Two layers, the first global and the second local (`global_attn_every_n_layers=2`) with a window of
8 tokens (`local_attention=8`: 4 on each side), so 32-token rows cross the window. The vocabulary
is the records' (512 ids in the tests' records); the special-token ids are BERT's vocab.txt ones
([PAD] 0, [CLS] 2, [SEP] 3: the records are made with a WordPiece vocab.txt); records of a BPE
tokenizer.json train with `--config.tokenizer_json=FILE` instead of `--config.vocab_file`
(tests/pretrain/test_tokenizer_json_pretraining.py).
"""

from configs import modernbert_base


def get_config():
    config = modernbert_base.get_config()
    m = config.model
    m.vocab_size = 512  # the tests' records and vocabularies
    m.hidden_size = 64
    m.intermediate_size = 96  # GeGLU: Wi makes 2 x 96
    m.num_hidden_layers = 2
    m.num_attention_heads = 4  # head size 16
    m.global_attn_every_n_layers = 2  # layer 0 global, layer 1 local
    m.local_attention = 8  # a band of 4 tokens each side: shorter than the rows
    m.max_position_embeddings = 128
    m.pad_token_id, m.cls_token_id, m.sep_token_id, m.bos_token_id, m.eos_token_id = 0, 2, 3, 2, 3
    config.max_seq_length = 32
    config.max_predictions_per_seq = 10  # 30% of 32 tokens
    config.max_seqs_per_pack = 3
    config.global_batch_size = 8
    config.num_train_steps = 20
    config.warmup_steps = 2
    config.lr_decay_steps = 4  # warmup-stable-decay: the last 4 steps decay (1-sqrt)
    config.learning_rate = 1e-3
    config.shuffle_buffer_size = 64
    config.log_every_steps = 5
    config.eval_every_steps = 10
    config.checkpoint_every_steps = 10
    return config
