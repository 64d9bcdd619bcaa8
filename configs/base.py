"""BERT-Base (L=12, H=768, A=12), pretrained as in the paper (Devlin et al. 2018, Appendix A.2).

Every other config imports this one and overrides what differs.
"""

import ml_collections
from ml_collections import config_dict


def get_model_config(num_layers=12, hidden=768, heads=12) -> ml_collections.ConfigDict:
    """The fields of `bert_jax.model.model_config.BertConfig` for a published shape (feed-forward 4H)."""
    m = ml_collections.ConfigDict()
    m.vocab_size = 30522  # WordPiece vocabulary size (the released uncased vocab)
    m.hidden_size = hidden  # H
    m.num_hidden_layers = num_layers  # L
    m.num_attention_heads = heads  # A (head size H/A)
    m.intermediate_size = 4 * hidden  # feed-forward size, 4H
    m.hidden_act = "gelu"  # "gelu" = exact erf GELU; "gelu_tanh" = Google TF1's approximation
    m.hidden_dropout_prob = 0.1  # dropout on embeddings and every residual branch
    m.attention_probs_dropout_prob = 0.1  # dropout on attention probabilities
    m.max_position_embeddings = 512  # learned positions
    m.type_vocab_size = 2  # segments A and B
    m.initializer_range = 0.02  # stddev of the truncated-normal init
    m.layer_norm_eps = 1e-12  # LayerNorm epsilon (Google's)
    m.dtype = "float32"  # compute dtype; "bfloat16" on GPU/TPU
    m.param_dtype = "float32"  # parameter storage dtype
    m.scan_layers = False  # nn.scan over layers (compile time flat in depth)
    m.remat_policy = "none"  # none | full | dots | dots_no_batch
    m.attention_impl = "einsum"  # einsum | dot_product (Pallas splash attention on TPU, cuDNN on GPU)
    m.vocab_pad_multiple = 128  # pad the MLM decoder's vocab dim for speed (params keep real size)
    m.causal_attention = False  # left-to-right encoder (paper Table 5 ablation)
    m.sparse_last_layer = True  # last layer only where the heads read (masked LM, [CLS]); exact
    m.fp8 = False  # FP8 matmuls with delayed scaling in pretraining (H100); state checkpointed
    m.fused_ops = False  # dropout + residual + LayerNorm as one Pallas kernel each way (GPU)
    m.fused_ffn = False  # the FFN's first GEMM + bias + GELU as Pallas GEMM kernels each way (GPU)
    m.mixed_matmuls = False  # matmuls with bf16 inputs, float32 out; the rest float32 (CPUs with bf16 units)
    m.separate_qkv = False  # Q, K, V as three matmuls (no stacked kernel, no slices of its output)
    m.fused_qkv = False  # Q, K, V as one Pallas GEMM kernel each way, biases in its epilogues (GPU)
    return m


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.mode = "pretrain"  # pretrain | evaluate | demo (fine-tuning configs: finetune | predict)
    config.model = get_model_config()
    # Which encoder `config.model` describes: "bert" (BertConfig's fields, this file's get_model_config) or
    # "modernbert" (bert_jax.model.modernbert.ModernBertConfig's fields: configs/modernbert_*.py).
    config.model_family = "bert"
    config.seed = 42  # seeds init, dropout and data order
    # Random bits of dropout: "threefry2x32" (jax's default: the same masks on any mesh), or "rbg" /
    # "unsafe_rbg" (the hardware generator: faster on GPU and TPU; the speed tables' --prng=rbg).
    # A run resumes with the impl it started with (the checkpoint's key has its shape).
    config.prng_impl = "threefry2x32"
    # On a CPU: "on" runs every matmul with bfloat16 inputs and float32 accumulation and outputs, the
    # rest in float32 (model.mixed_matmuls: a TPU's default numerics); "auto" does where the CPU reports
    # bf16 matmul units (avx512_bf16, amx_bf16) and a matmul timed both ways at start-up is faster in
    # bf16, else float32 (bert_jax/training/cpu_bf16.py); "off" leaves model.mixed_matmuls as set.
    config.cpu_bf16 = "auto"

    # --- data (TFRecords in Google's schema, from data_pipeline.create_pretraining_data) ---
    config.train_data = ""  # glob(s), comma-separated, of training TFRecords
    config.eval_data = ""  # glob(s) of held-out TFRecords ("" = no periodic evaluation)
    config.vocab_file = ""  # vocab.txt: needed by dynamic masking; copied into the workdir
    # instead of vocab_file, for records made with create_pretraining_data --tokenizer_json: that
    # HuggingFace tokenizer.json (its [MASK] id, special ids and size; copied into the workdir)
    config.tokenizer_json = ""
    config.max_seq_length = 128  # phase 1 sequence length (the paper's 90% of steps)
    config.max_predictions_per_seq = 20  # masked-LM predictions per sequence at length 128
    config.shuffle_buffer_size = 10_000  # records held for shuffling, per host
    config.dynamic_masking = False  # re-mask each epoch instead of using the records' masks
    config.masked_lm_prob = 0.15  # dynamic masking: share of real tokens predicted (BERT's 15%; ModernBERT 30%)
    # dynamic masking of whole words (all ## pieces with their word); None = as the records were made
    config.dynamic_whole_word_mask = config_dict.placeholder(bool)
    config.packing = False  # pack several short sequences per row (MLPerf style)
    config.max_seqs_per_pack = 3  # sequences per packed row at most
    config.skip_corrupt_records = False  # True: skip (and count) corrupt records instead of failing
    config.data_shards = 0  # file shards (0 = one per process); fix it to make runs identical across host counts
    # Check every file against the manifest listing it (*.dataset_info.json) before training: its size, and its
    # SHA-256 the first time (remembered by path, size and mtime/generation; an unchanged file is not read again).
    config.verify_data = True
    config.rehash_data = False  # True: hash every file again, whatever was verified before
    # Two-phase pretraining: a list of dicts with keys max_seq_length, max_predictions_per_seq,
    # train_data, fraction (of num_train_steps). Empty = one phase from the fields above. The paper:
    # [dict(max_seq_length=128, max_predictions_per_seq=20, fraction=0.9, train_data=...),
    #  dict(max_seq_length=512, max_predictions_per_seq=80, fraction=0.1, train_data=...)]
    config.phases = ()

    # --- optimization (paper: batch 256, 1M steps, Adam lr 1e-4, warmup 10k, decay 0.01) ---
    config.global_batch_size = 256  # sequences per optimizer step, over all hosts
    config.grad_accum_steps = 1  # micro-batches per step (same update as the undivided batch)
    config.num_train_steps = 1_000_000  # optimizer steps (all phases together)
    config.optimizer = "adamw"  # adamw | google_adamw (no bias correction, as TF1 BERT) | stableadamw | lamb
    config.learning_rate = 1e-4  # peak learning rate
    config.warmup_steps = 10_000  # linear warmup, then decay to 0
    config.lr_decay_power = 1.0  # 1 = linear decay; other values = polynomial
    config.google_lr_schedule = False  # True: Google's decay over all steps, overridden by warmup
    config.lr_decay_steps = config_dict.placeholder(int)  # set: warmup-stable-decay, the decay over the last N steps
    config.lr_decay_shape = "polynomial"  # polynomial (lr_decay_power) | 1-sqrt (WSD's, ModernBERT's)
    config.weight_decay = 0.01  # decoupled weight decay (not on LayerNorm or biases)
    config.adam_b1 = 0.9  # Adam beta1
    config.adam_b2 = 0.999  # Adam beta2
    config.adam_eps = 1e-6  # Adam epsilon (Google's)
    config.clip_norm = 1.0  # global-norm gradient clipping (0 disables)

    # --- objectives (the paper's Table 5 ablations) ---
    config.use_nsp = True  # False: "No NSP"
    config.objective = "mlm"  # mlm | ltr (left-to-right LM; set model.causal_attention=True)

    # --- parallelism ---
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # per slice; -1 fills
    config.dcn_mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1))  # across slices

    # --- loop, logging, checkpoints ---
    config.log_every_steps = 100  # console/TensorBoard metrics interval
    config.eval_every_steps = 10_000  # periodic evaluation on eval_data
    config.eval_steps = 0  # batches per evaluation; 0 = one full pass over eval_data
    config.eval_batch_size = 0  # global eval batch; 0 = global_batch_size
    config.checkpoint_every_steps = 1000  # save interval
    config.keep_checkpoints = 3  # most recent checkpoints kept
    config.async_checkpointing = True  # write checkpoints in the background
    config.checkpoint_save_timeout_seconds = 1800  # a save not committed by then ends the run (a stalled store); 0: no limit
    config.checkpoint_restore_timeout_seconds = 1800  # a restore not done by then ends the run (exit 124); 0: no limit
    config.on_damaged_checkpoint = "fallback"  # newest step damaged: "fallback" to the newest intact one, or "stop"
    config.allow_version_change = False  # True: resume a checkpoint saved under other jax/flax/orbax/libtpu versions
    # CPU-only machines: glibc keeps freed large blocks for the next step instead of unmapping them
    # (~12% of a CPU run's time went to page faults; bert_jax/training/host_memory.py). auto | true | false
    config.keep_freed_host_memory = "auto"
    # Compiled programs kept on disk for the next run (bert_jax/training/compile_cache.py): auto (JAX_COMPILATION_CACHE_DIR,
    # else $BERT_JAX_CACHE_DIR/xla, at most 4 GiB) | off | a folder (local or gs://)
    config.compilation_cache = "auto"
    config.nonfinite = "stop"  # stop | skip: on a non-finite loss or gradient
    config.max_consecutive_nonfinite = 10  # in skip mode, abort after this many bad steps in a row
    # Loss spikes (bert_jax/pretrain/divergence.py, docs/reliability.md): a step is a spike step when its loss >
    # mean * (1 + divergence_margin), `mean` a moving average of the earlier finite non-spike losses; a divergence
    # is divergence_steps spike steps (or non-finite ones, under nonfinite="skip") in a row. "off": not watched
    # (as before); "stop": the run ends with DivergenceError (exit 81); "rollback": back to the newest checkpoint
    # before the first spike step, the batches around the spike skipped (skipped_batches.json), and on.
    config.on_divergence = "off"
    config.divergence_ema_decay = 0.99  # decay of `mean`, the exponential moving average the loss is judged against
    config.divergence_margin = 0.5  # a spike step's loss is above mean * (1 + margin)
    config.divergence_warmup_steps = 100  # finite non-spike steps fed to `mean` before any step is judged a spike
    config.divergence_steps = 3  # K: spike (or non-finite) steps in a row that make a divergence
    config.rollback_skip_batches = 0  # batches skipped after the step rolled back to; 0: those the rolled-back steps read
    config.max_rollbacks = 5  # rollbacks per run (counted in skipped_batches.json); past them the run stops (exit 81)
    config.skip_batches = ""  # "C:S,C2:S2": after step C, read and discard S batches (a rollback's skip, by hand)
    # pretrain: initial weights when the workdir has no checkpoint yet; evaluate: what to score.
    # Any format: a bert_jax workdir or export, a Google TF1 checkpoint, a HuggingFace directory.
    config.init_checkpoint = ""
    # What a Google TF1 init_checkpoint's hidden_act="gelu" is: None = "erf" (the 2018 releases),
    # "tanh" for models trained with google-research/bert's code since 2019-02 (docs/checkpoints.md).
    config.google_gelu = config_dict.placeholder(str)
    return config
