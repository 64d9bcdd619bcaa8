"""Every file and folder name in a bert_jax workdir or export: the one place that spells them.

    W/                          a pretraining or fine-tuning workdir (`--workdir`)
      checkpoints/<step>/       CHECKPOINTS        the resumable train state (`bert_jax.checkpoints`)
      best/<step>/              BEST               fine-tuning: the best epoch's parameters
      best_predictions/         BEST_PREDICTIONS   fine-tuning: the best epoch's predictions
      transformers/             TRANSFORMERS       ModernBERT fine-tuning: the best epoch in transformers'
                                                   format (config.json, model.safetensors, vocab.txt or
                                                   tokenizer.json, tokenizer_config.json)
      bert_config.json          MODEL_CONFIG       the model's config (Google's file name and fields)
      modernbert_config.json    MODERNBERT_CONFIG  instead, for config.model_family="modernbert": transformers'
                                                   config.json of ModernBertForMaskedLM (+ dtype, attention_impl,
                                                   local_blocks)
      vocab.txt                 VOCAB              the WordPiece vocabulary, one token a line
      tokenizer.json            TOKENIZER_JSON     instead, for a run of config.tokenizer_json: that HuggingFace
                                                   tokenizer.json (ModernBERT's BPE, ...)
      tokenizer_config.json     TOKENIZER_CONFIG   the casing (`do_lower_case`), as HF writes it
      task.json                 TASK_FILE          fine-tuning: the task, its head and labels
      train_log.jsonl           TRAIN_LOG          one line of metrics per logged step (and event lines)
      skipped_batches.json      SKIPPED_BATCHES    pretraining: batches skipped after a step, rollbacks
      eval_results.json         EVAL_RESULTS       the last evaluation (metric -> value)
      eval_history.json         EVAL_HISTORY       fine-tuning: every epoch's evaluation
      cpu_bf16.json             CPU_BF16           on a CPU: "auto"'s decision, kept for resumption
      seeds/<seed>/             SEEDS              fine-tuning with config.seeds: each seed's own workdir
      events.out.tfevents.*     EVENTS_PREFIX      TensorBoard's (`bert_jax.workdir.MetricWriter`)
      verified_data/process_<i>.json  VERIFIED_DATA, verified_data_file(i)  pretraining: the hashes of
                                                   the files process i checked (`pretrain.feed`)
      predictions/<split>_scores.json  PREDICTIONS, scores_file(split)  mode=predict's default output
                                                   folder (the predictions' own files: the task's)
      curves.png                CURVES             the training curves (`bert_jax.plot`)

    The demo's workdir (`bert_jax.demo`) also holds:
      corpus/*.txt              DEMO_CORPUS        the embedded corpus's shards
      data/train/, data/eval/   DEMO_DATA          the pretraining records made from them
      fill_mask.json            FILL_MASK          the trained model's guesses for the demo's prompts

    A supervised pod run's workdir also holds the supervisor's files (`bert_jax.pod`):
      attempts.jsonl            ATTEMPTS           every attempt's start and end, failures, recreations
      slice.json                SLICE_SPEC         what recreating the slice needs
      constraints.txt           CONSTRAINTS        the first install's `pip freeze`: every reinstall's pins
      code.json, code/<sha>.tar.gz  CODE_POINTER, CODE_DIR, code_archive(sha)  the project snapshot
                                                   every attempt ships
      needs_install.json        NEEDS_INSTALL      the next launch must install (a slice was recreated)
      supervisor.lease          LEASE              which supervisor holds the workdir, and its heartbeat
      logs/attempt-<n>/worker-<N>.log  LOGS, attempt_logs(n), worker_log(N)  every worker's log of
                                                   every attempt

    E/                          an export (`bert_jax.convert --to=bert_jax`)
      params/                   EXPORTED_PARAMS    an orbax checkpoint of the parameter tree
      bert_config.json, vocab.txt, tokenizer_config.json, and task.json for a fine-tuned model

A step folder's own layout (its state, the per-host input state, the integrity manifest) is
`bert_jax.checkpoints.step_dirs`'. Google's and HuggingFace's checkpoints keep their own
names (`bert_jax.formats.google`, `bert_jax.formats.hf`).
"""

CHECKPOINTS = "checkpoints"
BEST = "best"
BEST_PREDICTIONS = "best_predictions"
TRANSFORMERS = "transformers"
MODEL_CONFIG = "bert_config.json"
MODERNBERT_CONFIG = "modernbert_config.json"
VOCAB = "vocab.txt"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TASK_FILE = "task.json"
TRAIN_LOG = "train_log.jsonl"
SKIPPED_BATCHES = "skipped_batches.json"
EVAL_RESULTS = "eval_results.json"
EVAL_HISTORY = "eval_history.json"
CPU_BF16 = "cpu_bf16.json"
SEEDS = "seeds"
EVENTS_PREFIX = "events.out.tfevents"
VERIFIED_DATA = "verified_data"
PREDICTIONS = "predictions"
CURVES = "curves.png"
EXPORTED_PARAMS = "params"
# The demo's (bert_jax.demo).
DEMO_CORPUS = "corpus"
DEMO_DATA = "data"
FILL_MASK = "fill_mask.json"
# The supervisor's (bert_jax.pod).
ATTEMPTS = "attempts.jsonl"
SLICE_SPEC = "slice.json"
CONSTRAINTS = "constraints.txt"
CODE_POINTER = "code.json"
CODE_DIR = "code"
NEEDS_INSTALL = "needs_install.json"
LEASE = "supervisor.lease"
LOGS = "logs"


def verified_data_file(process: int) -> str:
    """`VERIFIED_DATA`'s file of process `process`: "process_3.json"."""
    return f"process_{process}.json"


def scores_file(split: str) -> str:
    """The scores of a labelled split's predictions, in `PREDICTIONS` (or --predict_output_dir): "dev_scores.json"."""
    return f"{split}_scores.json"


def code_archive(digest: str) -> str:
    """`CODE_DIR`'s snapshot of the project at `digest`: "<digest>.tar.gz"."""
    return f"{digest}.tar.gz"


def attempt_logs(attempt: int) -> str:
    """`LOGS`'s folder of a supervised attempt: "attempt-2"."""
    return f"attempt-{attempt}"


def worker_log(worker: int) -> str:
    """A worker's log in an attempt's folder: "worker-0.log" (launch/tpu_worker.sh uploads it so)."""
    return f"worker-{worker}.log"
