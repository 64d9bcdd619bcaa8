"""Stage 2 of experiments/pretraining_helps.py: the pretraining, a subprocess of `bert_jax.main` on
configs/pretrain_small.py with the study's overrides (it resumes from its own checkpoints), and the
curves it logged. experiments/chinese_pretraining_helps.py pretrains its two arms with these too.
"""

from __future__ import annotations

import os
import subprocess
import sys

from experiments.pretraining_corpus import ROOT, log


def pretrain_overrides(args, records: str) -> dict:
    """`--config.x=y` for configs/pretrain_small.py: the data paths, the step count, --quick's shape."""
    o = {"train_data": os.path.join(records, "train", "*.tfrecord*"),  # a folder per dataset
         "eval_data": os.path.join(records, "heldout", "*.tfrecord*"),
         "vocab_file": args.vocab_file}
    if args.quick:  # configs/test.py's shape with the vocab's real size
        o.update({"model.hidden_size": 32, "model.num_attention_heads": 4, "model.intermediate_size": 64,
                  "model.max_position_embeddings": 64, "max_seq_length": args.max_seq_length,
                  "max_predictions_per_seq": 5, "global_batch_size": 8, "log_every_steps": 1,
                  "eval_every_steps": args.pretrain_steps or 4, "eval_steps": 1, "shuffle_buffer_size": 64,
                  "checkpoint_every_steps": 1000, "async_checkpointing": False})
    if args.no_nsp:  # masked LM only (RoBERTa's finding; here: NSP does not learn on this corpus)
        o["use_nsp"] = False
    if args.pretrain_steps:
        o["num_train_steps"] = args.pretrain_steps
        o["warmup_steps"] = max(1, args.pretrain_steps // 10)  # the recipe's 10%
        if not args.quick:
            o["eval_every_steps"] = max(1, args.pretrain_steps // 4)
            o["checkpoint_every_steps"] = max(1, args.pretrain_steps // 4)
    with open(args.vocab_file, encoding="utf-8") as f:
        o["model.vocab_size"] = sum(1 for _ in f)
    return o


def pretrain_config(overrides: dict):
    """configs/pretrain_small.py with `overrides` applied (dotted keys), as main.py would."""
    from configs import pretrain_small

    config = pretrain_small.get_config()
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def _finished(pretrain_dir: str, steps: int) -> bool:
    return os.path.exists(os.path.join(pretrain_dir, "checkpoints", str(steps), "commit_success.txt"))


def stage_pretrain(args, pretrain_dir: str, overrides: dict) -> bool:
    """Runs the pretraining unless its last checkpoint exists; True if it ran."""
    steps = int(pretrain_config(overrides).num_train_steps)
    if _finished(pretrain_dir, steps):
        log(f"pretrain: {pretrain_dir} has step {steps}, skipped")
        return False
    cmd = [sys.executable, "-m", "bert_jax.main", "--config=configs/pretrain_small.py", f"--workdir={pretrain_dir}"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    log("pretrain: " + " ".join(cmd[1:]))
    os.makedirs(pretrain_dir, exist_ok=True)
    env = dict(os.environ)
    if args.quick:  # compiles several times faster on CPU; the test-sized model runs 4 steps
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    with open(os.path.join(pretrain_dir, "console.log"), "a", encoding="utf-8") as out:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    if proc.returncode or not _finished(pretrain_dir, steps):
        raise RuntimeError(f"pretraining failed (exit {proc.returncode}); see {pretrain_dir}/console.log")
    return True


def pretraining_curves(pretrain_dir: str) -> dict:
    """`{tag: [[step, value], ...]}` of the MLM/NSP losses and accuracies (TensorBoard events)."""
    from bert_jax import plot

    scalars = plot.read_scalars(pretrain_dir)
    keep = ("train/mlm_loss", "train/mlm_accuracy", "train/nsp_accuracy", "eval/masked_lm_loss",
            "eval/masked_lm_accuracy", "eval/next_sentence_accuracy")
    return {t: [[int(s), float(v)] for s, v in zip(*scalars[t])] for t in keep if t in scalars}
