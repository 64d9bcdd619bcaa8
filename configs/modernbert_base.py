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

With the context extension, a config file of your own sets the two phases' records, and the paper's
decay (the last 50B of its 2T tokens, 2.5% of the steps, at the extension's rate):

    from configs import modernbert_base
    def get_config():
        config = modernbert_base.get_config()
        config.phases = modernbert_base.context_extension("RECORDS_1024/*.tfrecord", "RECORDS_8192/*.tfrecord")
        config.lr_decay_steps = modernbert_base.CONTEXT_EXTENSION_DECAY_STEPS
        return config

The shape: `bert_jax.model.modernbert.ModernBertConfig`'s defaults (transformers' ModernBertConfig: 22
layers, H 768, GeGLU 1152, 12 heads, every third layer global, a 128-token local window, RoPE theta
160k global and 10k local, no biases, vocabulary 50,368).

The recipe, as the paper trains it and as this config sets it:
- masked LM only (`use_nsp=False`), 30% of the tokens (`masked_lm_prob=0.3`), masked anew each time a
  record is read (`dynamic_masking`, BERT's 80/10/10 rule);
- sequences packed into rows of 1,024 tokens (`packing`, `max_seq_length=1024`);
- decoupled AdamW (`optimizer="adamw"`, betas 0.9/0.98, eps 1e-6) with global-norm clipping; the
  paper's weight decay 1e-5 is "decoupled" as Composer's and optimi's `decouple_lr` mean it (each step
  decays by 1e-5 x the schedule's fraction of the peak), which is optax's `lr_t * weight_decay` with
  `weight_decay = 1e-5 / 8e-4`; at the extension's 3e-4 the paper's restarted optimizer decays by
  1e-5 a step, ours by 3.75e-6; the paper's StableAdamW (`optimizer="stableadamw"`, per-tensor
  update clipping, `clip_norm=0`) is implemented and selectable, but did not pay on ModernBERT-tiny
  at the recipe's rate or at 4x (experiments/RESULTS.md, "StableAdamW against AdamW");
- a warmup-stable-decay schedule: linear warmup, a constant peak 8e-4, and a "1-sqrt" decay over the
  last `lr_decay_steps`;
- a context extension to 8,192 tokens (`context_extension`, for `config.phases`; without it, one phase
  at 1,024 from `config.train_data`): the first 85% of the steps at 1,024 and 8e-4 (the paper's 1.7T of
  2T tokens), then records of 8,192 tokens at a constant 3e-4 (the phase's `learning_rate`), and the
  1-sqrt decay from 3e-4 to 0 over the last 2.5% (`CONTEXT_EXTENSION_DECAY_STEPS`: the paper's last
  50B tokens). The paper's decay ends at 0.001 of its rate (3e-7) and its extension restarted
  Composer's schedule without a warmup; ours goes to 0, also without one.

What differs from the paper, because of the input pipeline (docs/model.md, "Pretraining ModernBERT"):
- dynamic masking masks token by token: the records carry no BPE word boundaries, so whole-word
  dynamic masking is refused with a tokenizer.json;
- packing fills a row only with records of this phase's file (first-fit within a window of records),
  and needs records shorter than the row: records written at `--max_seq_length=1024` from short
  documents (the paper packs unpadded sequences into the row, ours keeps [CLS]/[SEP] per record);
- the phases share `global_batch_size`: the paper's extension took 576 rows of 8,192 tokens a step
  against 4,608 of 1,024 (the same tokens a step), so its fractions of the steps are fractions of
  the tokens; here one `global_batch_size` serves both, so a step at 8,192 holds 8 times the tokens of
  a step at 1,024; the batch-size warmup is not reproduced (set `num_train_steps`).
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
    # The paper's decoupled 1e-5 (Composer's/optimi's `decouple_lr`: each step decays by 1e-5 * lr_t / peak);
    # optax's decay is lr_t * weight_decay, so the same decay is 1e-5 / 8e-4 (1e-5 would decay 1,250x less).
    config.weight_decay = 1e-5 / 8e-4
    config.adam_b1, config.adam_b2, config.adam_eps = 0.9, 0.98, 1e-6
    config.learning_rate = 8e-4  # the stable phase's rate
    config.warmup_steps = 3_000
    config.num_train_steps = 200_000
    config.lr_decay_steps = 20_000  # warmup-stable-decay: the last 10% decay
    config.lr_decay_shape = "1-sqrt"
    config.clip_norm = 1.0  # global-norm clipping (0 with "stableadamw", which clips its own updates)
    return config


CONTEXT_EXTENSION_DECAY_STEPS = 5_000  # the paper's last 50B of ~2.02T tokens: 2.5% of 200,000 steps


def context_extension(data_1024: str, data_8192: str, fraction: float = 0.85,
                      learning_rate: float = 3e-4) -> tuple:
    """`config.phases` for the context extension: `fraction` of the steps on packed rows of 1,024 tokens
    (`data_1024`; the paper's 1.7T of 2T tokens) at the config's rate, the rest at 8,192 (`data_8192`,
    records written at that length) at a constant `learning_rate` (the paper's 3e-4 for base), 30%
    predicted. The decay (`config.lr_decay_steps`) starts from that rate: set it within the 8,192
    phase (`CONTEXT_EXTENSION_DECAY_STEPS`)."""
    return (dict(max_seq_length=1024, max_predictions_per_seq=308, fraction=fraction, train_data=data_1024),
            dict(max_seq_length=8192, max_predictions_per_seq=2458, fraction=1.0 - fraction, train_data=data_8192,
                 learning_rate=learning_rate))
