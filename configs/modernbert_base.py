"""ModernBERT-base (Warner et al. 2024, arXiv 2412.13663): its shape, and its pretraining recipe as far
as bert_jax's input pipeline carries it.

    python -m bert_jax.main --config=configs/modernbert_base.py --workdir=W \\
        --config.train_data='RECORDS_1024/*.tfrecord' --config.tokenizer_json=MODERNBERT/tokenizer.json

The tokenizer is ModernBERT's own BPE tokenizer.json (OLMo's, 50,368 ids, the model's `vocab_size` and
special-token ids as set below): the records are made with it (`create_pretraining_data
--tokenizer_json=MODERNBERT/tokenizer.json`), and `config.tokenizer_json` gives dynamic masking its [MASK]
id and is checked against the records' manifest (docs/model.md, "Pretraining ModernBERT"). Records of a
WordPiece vocab.txt train too (`config.vocab_file`, with `model.vocab_size` and the special-token ids
set to that vocabulary's: [PAD], [CLS] and [SEP] ids that differ from the vocabulary's are refused).

With the context extension, a config file of your own sets the two phases' records:

    from configs import modernbert_base
    def get_config():
        config = modernbert_base.get_config()
        config.phases = modernbert_base.context_extension("RECORDS_1024/*.tfrecord", "RECORDS_8192/*.tfrecord")
        return config

The shape: `bert_jax.model.modernbert.ModernBertConfig`'s defaults (transformers' ModernBertConfig: 22
layers, H 768, GeGLU 1152, 12 heads, every third layer global, a 128-token local window, RoPE theta
160k global and 10k local, no biases, vocabulary 50,368).

The recipe, as the paper trains it and as this config sets it:
- masked LM only (`use_nsp=False`), 30% of the tokens (`masked_lm_prob=0.3`), masked anew each time a
  record is read (`dynamic_masking`, BERT's 80/10/10 rule);
- sequences packed into rows of 1,024 tokens (`packing`, `max_seq_length=1024`);
- decoupled AdamW (`optimizer="adamw"`, weight decay 1e-5 as the paper's decoupled 1e-5; betas
  0.9/0.98, eps 1e-6), a warmup-stable-decay schedule: linear warmup, a constant peak 8e-4, and a
  "1-sqrt" decay over the last `lr_decay_steps`;
- a context extension to 8,192 tokens: a second phase on records of 8,192 tokens (`context_extension`,
  for `config.phases`; without it, one phase at 1,024 from `config.train_data`).

What differs from the paper, because of the input pipeline (docs/model.md, "Pretraining ModernBERT"):
- dynamic masking masks token by token: the records carry no BPE word boundaries, so whole-word
  dynamic masking is refused with a tokenizer.json;
- packing fills a row only with records of this phase's file (first-fit within a window of records),
  and needs records shorter than the row: records written at `--max_seq_length=1024` from short
  documents (the paper packs unpadded sequences into the row, ours keeps [CLS]/[SEP] per record);
- the paper's StableAdamW (AdamW with per-parameter update clipping) is not implemented: AdamW with
  global-norm gradient clipping (`clip_norm=1.0`) stands in;
- the learning-rate schedule is one schedule over both phases (`config.phases`): the paper's
  context extension restarts a warmup-stable-decay at a lower peak (3e-4), which one schedule cannot;
  the batch-size warmup and the 1.7T/250B/50B token budgets are not reproduced (set `num_train_steps`).
"""

from configs import base


def get_model_config():
    """`ModernBertConfig`'s fields, as transformers names them; ModernBERT-base's values."""
    import dataclasses

    from bert_jax.model.modernbert import ModernBertConfig
    import ml_collections
    return ml_collections.ConfigDict({f.name: f.default for f in dataclasses.fields(ModernBertConfig)})


def get_config():
    config = base.get_config()
    config.model_family = "modernbert"
    config.model = get_model_config()
    config.use_nsp = False  # masked LM only
    config.masked_lm_prob = 0.3  # 30% masking
    config.dynamic_masking = True  # new masks each time a record is read
    config.max_seq_length = 1024  # packed rows of 1,024 tokens
    config.max_predictions_per_seq = 308  # 30% of 1,024 tokens is 307
    config.packing = True
    config.max_seqs_per_pack = 8  # short records per 1,024-token row at most
    config.optimizer = "adamw"  # decoupled weight decay
    config.weight_decay = 1e-5
    config.adam_b1, config.adam_b2, config.adam_eps = 0.9, 0.98, 1e-6
    config.learning_rate = 8e-4  # the stable phase's rate
    config.warmup_steps = 3_000
    config.num_train_steps = 200_000
    config.lr_decay_steps = 20_000  # warmup-stable-decay: the last 10% decay
    config.lr_decay_shape = "1-sqrt"
    config.clip_norm = 1.0  # global-norm clipping (StableAdamW's update clipping is not implemented)
    return config


def context_extension(data_1024: str, data_8192: str, fraction: float = 0.9) -> tuple:
    """`config.phases` for the context extension: `fraction` of the steps on packed rows of 1,024 tokens
    (`data_1024`), the rest at 8,192 (`data_8192`, records written at that length), 30% predicted."""
    return (dict(max_seq_length=1024, max_predictions_per_seq=308, fraction=fraction, train_data=data_1024),
            dict(max_seq_length=8192, max_predictions_per_seq=2458, fraction=1.0 - fraction, train_data=data_8192))
