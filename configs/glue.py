"""Fine-tuning on GLUE (the paper's setup) and the fields every fine-tuning config shares.

    python -m bert_jax.main --config=configs/glue.py --config.task=sst2 \\
        --config.data_dir=glue_data --config.init_checkpoint=PATH --workdir=W

Tasks: cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli. The paper: batch 32, 3 epochs, the best
learning rate of {5e-5, 4e-5, 3e-5, 2e-5} on dev; warmup over 10% of the steps, dropout 0.1.

google-research/bert's run_classifier.py exactly (its optimizer, schedule and number of steps;
docs/finetuning.md, "Reproducing run_classifier.py / run_squad.py"):

    --config.optimizer=google_adamw --config.google_lr_schedule=True --config.num_train_steps_from=examples

Not the default: the default trains whole epochs (every feature row seen num_train_epochs times,
evaluated after each), with bias-corrected AdamW; workdirs of earlier runs resume unchanged.
"""

import ml_collections
from ml_collections import config_dict

from configs import base


def get_finetune_config() -> ml_collections.ConfigDict:
    """The fields of `bert_jax.finetune.loop` (configs/squad.py, ner.py, swag.py import this)."""
    config = ml_collections.ConfigDict()
    config.mode = "finetune"  # finetune | predict (bert_jax/finetune/predict.py)
    config.task = "sst2"  # data_pipeline.tasks.TASK_NAMES
    config.seed = 42  # seeds the head's init, dropout and the data order
    # Random restarts, as the paper's for BERT-Large: a run per seed in W/seeds/<seed>/, the best on dev
    # kept in W/best/ (--config.seeds=1,2,3; docs/finetuning.md). () = one run of config.seed.
    config.seeds = ()
    # The head's kernel at the start: truncated_normal (google-research/bert: stddev 0.02 before the
    # cut at 2 stddev) | normal (transformers' BERT: a plain normal of stddev 0.02). Over a short run
    # the draw moves the scores (benchmarks/finetune/RESULTS.md, CoNLL-2003).
    config.head_init = "truncated_normal"
    config.prng_impl = "threefry2x32"  # dropout's random bits: threefry2x32 | rbg | unsafe_rbg (configs/base.py)
    config.cpu_bf16 = "auto"  # auto | on | off: matmuls in bf16 with float32 outputs on a CPU (configs/base.py)
    # Compile the programs the run calls later (each training and evaluation batch shape) on a background
    # thread while it initializes, trains and evaluates: the same programs, earlier (training/compile_ahead.py).
    config.compile_ahead = True

    # --- data ---
    config.data_source = "files"  # files (as distributed) | tfds (config.tfds_data_dir)
    config.data_dir = ""  # the task's folder: GLUE's tsv files, SQuAD json, CoNLL columns, SWAG csv
    config.tfds_data_dir = ""  # TFDS data_dir ("" = TFDS's default)
    # A file per split instead of the usual names in data_dir ("" = the usual names).
    config.split_files = ml_collections.ConfigDict(dict(train="", dev="", test=""))
    config.skip_bad_rows = False  # True: skip (count, log) malformed rows instead of failing
    config.eval_splits = ()  # splits scored after each epoch; () = the task's (dev; MNLI m+mm; CoNLL dev+test)
    config.predict_test = True  # after training, write predictions (GLUE server files) for test splits
    config.max_seq_length = 128  # word pieces per row, [CLS] and [SEP] included
    # Each batch cut to the shortest of this many evenly spaced lengths up to max_seq_length that
    # holds its longest row (64 and 4: 16, 32, 48, 64), training and evaluation: the same result
    # as full padding, to float rounding, with dropout's masks drawn for the shorter shape; not for
    # the span head (SQuAD's softmax spans the padding). Each length compiles once. 0: rows padded
    # to max_seq_length, as runs before this option.
    config.trim_padding_buckets = 4
    # Of those lengths, only the ones whose training steps save more than their compile costs: a
    # compile costs this many steps at max_seq_length (-1: 8 on CPU, 1000 on GPU/TPU, measured; 0:
    # every length some batch needs). Evaluation chooses its own: its programs compile ~8x faster.
    config.trim_padding_compile_cost = -1.0
    # Training batches of the classification and regression heads packed: a batch's rows laid end
    # to end in fewer rows of max_seq_length, each sequence attending only to itself (its own
    # positions and [CLS]): the unpacked loss to float rounding, with dropout's masks drawn for the
    # packed shape (bert_jax/finetune/row_packing.py). Replaces trimming for those steps; evaluation
    # is not packed. Other heads train unpacked. False: unpacked (trimmed) rows, as runs before.
    config.packing = True
    config.task_options = ml_collections.ConfigDict()  # keyword arguments of the task (see squad.py)

    # --- mode=predict: the fine-tuned model in --workdir on new text (bert_jax/finetune/predict.py) ---
    config.predict_input = ""  # a text file (one example a line) or a file in the task's format
    config.predict_format = "auto"  # auto | text | task (auto: the task's file names and suffixes)
    config.predict_params = "best"  # best (W/best/, the best epoch) | last (W/checkpoints/)
    config.predict_output_dir = ""  # "" = W/predictions

    # --- model ---
    # The encoder: any format bert_jax.convert reads (bert_jax workdir/export, Google TF1, HF).
    config.init_checkpoint = ""
    config.google_gelu = config_dict.placeholder(str)  # a Google checkpoint's "gelu": None/"erf" or "tanh"
    config.vocab_file = ""  # "" = the checkpoint's vocab.txt
    config.do_lower_case = config_dict.placeholder(bool)  # None = the checkpoint's casing (else True)
    # A HuggingFace tokenizer.json instead of vocab_file (model_family="modernbert"; "" = the checkpoint
    # folder's when it has no vocab.txt): ModernBERT's BPE, with the file's [CLS]/[SEP]/[PAD] ids.
    config.tokenizer_json = ""
    config.model = base.get_model_config()  # with init_checkpoint: docs/configuration.md says which keys apply
    # "modernbert": init_checkpoint is a transformers ModernBERT folder, whose config.json decides the
    # architecture (docs/finetuning.md#modernbert, bert_jax/finetune/modernbert_tasks.py).
    config.model_family = "bert"

    # --- optimization (paper: Adam, warmup 10%, linear decay, dropout 0.1) ---
    # Google's scripts exactly: optimizer=google_adamw, google_lr_schedule=True,
    # num_train_steps_from=examples (docs/finetuning.md). The defaults below train whole epochs.
    config.global_batch_size = 32  # sequences per step, over all hosts
    config.eval_batch_size = 0  # 0 = global_batch_size
    # Passes over the training set (whole with num_train_steps_from=epochs; any float with examples).
    config.num_train_epochs = 3.0
    # How many steps: "epochs" = num_train_epochs * ceil(feature rows / batch), the last batch of
    # each epoch completed with weight-0 rows; "examples" = Google's
    # int(training examples / batch * num_train_epochs) full batches from one stream of feature rows
    # (SQuAD counts questions, not windows), evaluated after each pass over the rows.
    config.num_train_steps_from = "epochs"
    config.learning_rate = 2e-5  # peak learning rate
    config.warmup_proportion = 0.1  # fraction of the steps with linear warmup: int(steps * proportion)
    # False: warmup, then linear decay from the peak to 0 over the remaining steps. True: Google's
    # optimization.py, linear decay from step 0 over all steps, overridden during warmup.
    config.google_lr_schedule = False
    config.optimizer = "adamw"  # adamw | google_adamw (no bias correction, as TF1 BERT) | stableadamw | lamb
    config.weight_decay = 0.01  # decoupled weight decay (not on LayerNorm or biases)
    config.adam_b1 = 0.9  # Adam beta1
    config.adam_b2 = 0.999  # Adam beta2
    config.adam_eps = 1e-6  # Adam epsilon (Google's)
    config.clip_norm = 1.0  # global-norm clipping (0 disables), as Google's fine-tuning

    # --- parallelism, loop ---
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # per slice; -1 fills
    config.dcn_mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1))  # across slices
    config.log_every_steps = 50  # console/TensorBoard metrics interval
    config.async_checkpointing = True  # write the last-state checkpoint in the background
    config.checkpoint_save_timeout_seconds = 1800  # a save not committed by then ends the run (a stalled store); 0: no limit
    config.checkpoint_restore_timeout_seconds = 1800  # a restore not done by then ends the run (exit 124); 0: no limit
    # Also save the last state every N steps inside an epoch (0: after each epoch and on SIGTERM
    # only); a run killed without warning (kill -9, a lost machine) then resumes from there.
    config.checkpoint_every_steps = 0
    config.allow_version_change = False  # True: resume a checkpoint saved under other jax/flax/orbax/libtpu versions
    # CPU-only machines: glibc keeps freed large blocks for the next step instead of unmapping them
    # (~12% of a CPU run's time went to page faults; bert_jax/training/host_memory.py). auto | true | false
    config.keep_freed_host_memory = "auto"
    # Compiled programs kept on disk for the next run (bert_jax/training/compile_cache.py): auto (JAX_COMPILATION_CACHE_DIR,
    # else $BERT_JAX_CACHE_DIR/xla, at most 4 GiB) | off | a folder (local or gs://)
    config.compilation_cache = "auto"
    # -1: XLA's default. 0 compiles several times faster on CPU and runs slower (tests, debugging).
    config.xla_backend_optimization_level = -1
    return config


def get_config() -> ml_collections.ConfigDict:
    config = get_finetune_config()
    config.task = "sst2"  # cola | sst2 | mrpc | stsb | qqp | mnli | qnli | rte | wnli
    config.learning_rate = 2e-5  # the paper's grid: 5e-5, 4e-5, 3e-5, 2e-5
    return config
