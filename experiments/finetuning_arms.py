"""Stage 3 of experiments/pretraining_helps.py: fine-tuning, pretrained vs random init. Per task: the
training set subsampled, the learning rate chosen on a held-back part of it, then every seed of both
arms fine-tuned with identical settings by `bert_jax.finetune.loop.run` (a run whose result.json
exists is read, not rerun). The random arm starts from a bert_jax export of a fresh
`BertForPreTraining.init` of the pretrained model's shape. experiments/chinese_pretraining_helps.py
runs its fine-tuning through `finetune_once` and `compile_cache`, and its random arm through
`stage_random_init`.
"""

from __future__ import annotations

import json
import os
import time

from experiments.pretraining_corpus import log
from experiments.pretraining_run import pretrain_config

ARMS = ("pretrained", "random")


def stage_random_init(path: str, overrides: dict, vocab: str, seed: int = 0) -> str:
    """A bert_jax export of a fresh `BertForPreTraining.init` of the pretrained model's shape."""
    if os.path.exists(os.path.join(path, "bert_config.json")):
        log(f"random init: {path} exists, skipped")
        return path
    import jax
    import numpy as np
    from flax import linen as nn
    from bert_jax import convert
    from bert_jax.model import modeling, pretraining_heads
    from bert_jax.training import run_setup

    cfg = run_setup.bert_config_from(pretrain_config(overrides))
    params = pretraining_heads.BertForPreTraining(cfg).init(jax.random.key(seed), **modeling.dummy_inputs(cfg))["params"]
    params = jax.tree_util.tree_map(np.asarray, nn.meta.unbox(params))
    convert.save_pretrained(convert.Pretrained(cfg, params, vocab, True), path, "bert_jax")
    log(f"random init: wrote {path}")
    return path


def _rows(task: str, path: str) -> tuple[list[str], list[str]]:
    """(header lines, data lines) of a GLUE file; the reader splits rows at newlines only
    (`tasks.read_tsv`), so sampling lines samples rows."""
    from data_pipeline.tasks import glue

    with open(path, encoding="utf-8-sig", newline="") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    headerless = task == "cola" and glue.SPECS[task].text_a not in lines[0].split("\t")
    return ([], lines) if headerless else ([lines[0]], lines[1:])


def _write_rows(path: str, header: list[str], body: list[str]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("\n".join(header + body) + "\n")
    return path


def subsample_train(task: str, glue_dir: str, out_dir: str, n: int, seed: int = 0) -> str:
    """The task's training file with `n` rows drawn without replacement (header kept)."""
    import random
    from data_pipeline.tasks import glue

    spec = glue.SPECS[task]
    folder = os.path.join(glue_dir, spec.folder)
    source = next(os.path.join(folder, f) for f in spec.splits["train"] if os.path.exists(os.path.join(folder, f)))
    header, body = _rows(task, source)
    if n and n < len(body):
        body = [body[i] for i in sorted(random.Random(seed).sample(range(len(body)), n))]
    return _write_rows(os.path.join(out_dir, f"{task}_train_{len(body)}.tsv"), header, body)


def selection_split(task: str, train_file: str, fraction: float, seed: int = 0) -> tuple[str, str]:
    """`train_file` cut in two (seeded): (fit, select). The learning rate is chosen by training on
    `fit` and scoring on `select`, both parts of the training set; the dev sets we report are
    never used for a choice."""
    import random

    header, body = _rows(task, train_file)
    chosen = set(random.Random(seed).sample(range(len(body)), max(1, int(round(fraction * len(body))))))
    stem = os.path.splitext(train_file)[0]
    fit = _write_rows(f"{stem}_fit.tsv", header, [r for i, r in enumerate(body) if i not in chosen])
    select = _write_rows(f"{stem}_select.tsv", header, [r for i, r in enumerate(body) if i in chosen])
    return fit, select


def finetune_config(args, task: str, init: str, seed: int, train_file: str, lr: float, dev_file: str = ""):
    from configs import glue as glue_config

    config = glue_config.get_config()
    config.task = task
    config.data_dir = args.glue_dir
    config.init_checkpoint = init
    config.seed = seed
    config.split_files.train = train_file
    if dev_file:
        config.split_files.dev = dev_file
    elif task == "mrpc" and not os.path.exists(os.path.join(args.glue_dir, "MRPC", "dev.tsv")):
        config.split_files.dev = os.path.join(args.glue_dir, "MRPC", "msr_paraphrase_test.txt")
    config.predict_test = False
    config.max_seq_length = args.max_seq_length
    config.global_batch_size = args.finetune_batch_size
    config.num_train_epochs = args.finetune_epochs
    config.learning_rate = lr
    config.log_every_steps = 1000
    config.async_checkpointing = False
    if args.quick:
        config.xla_backend_optimization_level = 0  # faster compiles; the model is tiny
        # Every run's batches at one shape (no trimmed lengths, no packed row counts chosen from its
        # rows): the test's runs then share their compiled programs through the compilation cache.
        config.packing = False
        config.trim_padding_buckets = 0
    return config


def finetune_once(args, run_dir: str, config, what: str) -> dict:
    """`bert_jax.finetune.loop.run` into run_dir, or its result.json when that run finished before."""
    from bert_jax.finetune import loop as finetune

    done = os.path.join(run_dir, "result.json")
    if not os.path.exists(done):
        if os.path.isdir(run_dir):  # a stopped run: start it over (its checkpoints are stale)
            import shutil
            shutil.rmtree(run_dir)
        started = time.time()
        results = finetune.run(config, run_dir)
        record = {"results": results, "wall_s": round(time.time() - started, 1),
                  "train_file": config.split_files.train, "dev_file": config.split_files.dev,
                  "learning_rate": config.learning_rate, "seed": config.seed}
        with open(done, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        log(f"{what}: score {results.get('score')} ({record['wall_s']} s)")
    else:
        log(f"{what}: done, skipped")
    with open(done, encoding="utf-8") as f:
        return json.load(f)


def choose_lr(args, task: str, arm: str, init: str, train_file: str) -> tuple[float, dict]:
    """The learning rate of `args.finetune_lrs` with the best score on a held-back part of the
    training set (seed 0, trained on the rest); one value = no selection."""
    if len(args.finetune_lrs) == 1:
        return args.finetune_lrs[0], {}
    fit, select = selection_split(task, train_file, args.select_fraction)
    scores = {}
    for lr in args.finetune_lrs:
        run_dir = os.path.join(args.workdir, "select", arm, task, f"lr{lr:g}")
        record = finetune_once(args, run_dir, finetune_config(args, task, init, 0, fit, lr, select),
                                f"select {task} {arm} lr {lr:g}")
        scores[f"{lr:g}"] = score(record["results"])
    best = max(args.finetune_lrs, key=lambda lr: (scores[f"{lr:g}"], -lr))  # ties: the smaller rate
    return best, scores


def compile_cache(path: str) -> None:
    """A persistent XLA cache for the fine-tuning runs: every run of a task has the same shapes
    (the selection runs, both arms, every seed), so all but the first load their programs."""
    import jax

    if jax.config.jax_compilation_cache_dir:  # the caller's (the test's) cache
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def stage_finetune(args, inits: dict) -> dict:
    """`{task: {arm: {seed: record}}}` and `{task: {arm: {"lr", "selection"}}}`; a run whose
    result.json exists is read, not rerun."""
    compile_cache(os.path.join(args.workdir, "xla_cache"))
    out: dict = {}
    chosen: dict = {}
    for task in args.tasks:
        train_file = subsample_train(task, args.glue_dir, os.path.join(args.workdir, "glue_train"),
                                     args.max_train_examples)
        for arm in ARMS:
            lr, selection = choose_lr(args, task, arm, inits[arm], train_file)
            chosen.setdefault(task, {})[arm] = {"lr": lr, "selection_scores": selection}
            for seed in args.seeds:
                run_dir = os.path.join(args.workdir, "finetune", arm, task, f"seed{seed}")
                config = finetune_config(args, task, inits[arm], seed, train_file, lr)
                record = finetune_once(args, run_dir, config, f"finetune {task} {arm} seed {seed} lr {lr:g}")
                if record.get("learning_rate", lr) != lr:
                    raise RuntimeError(f"{run_dir} was trained with lr {record['learning_rate']}, not the "
                                       f"chosen {lr}: remove it (or the workdir) to rerun")
                out.setdefault(task, {}).setdefault(arm, {})[str(seed)] = record
    return out, chosen


def score(results: dict) -> float:
    """The task's GLUE number as a fraction: `score`, the mean of its official metrics."""
    for key in ("score", "dev/score"):
        if key in results:
            return float(results[key])
    scores = [v for k, v in results.items() if k.endswith("score")]
    return float(scores[0])
