"""Does pretraining with bert_jax make fine-tuning better? BERT-Tiny, from scratch, on CPU (issue 28).

    python -m experiments.pretraining_helps --workdir=/tmp/ph [--pretrain_steps=N] \\
        [--tasks=sst2,cola,stsb,mrpc,rte] [--seeds=0,1,2] [--max_train_examples=N] [--quick] \\
        [--task_text=sst2,cola,stsb,mrpc,rte] [--no_nsp] [--train_vocab_size=N]

--task_text: task-adaptive pretraining (Gururangan et al. 2020): the named GLUE tasks' training
text, without labels, joins the corpus (`pretraining_corpus.task_text_documents` says how it becomes documents);
dev and test files are never read for it.

--train_vocab_size=N: a WordPiece vocabulary of N lines trained on the corpus's training shards
(`data_pipeline.train_vocab`; never the held-out shard or a GLUE file) instead of the released
uncased one; both arms and the fine-tuning tokenize with it.

Stages, each skipped when its outputs exist (rerun the command to resume after a stop):

1. data: the corpora (WikiText-2 raw, Gutenberg, tiny-shakespeare) -> Google's text format under
   W/corpus (WikiText-2's last tenth of articles held out), then records under W/records with
   `python -m data_pipeline.create_pretraining_data` and the released uncased vocab
   (configs/pretrain_small.py says why), or with --train_vocab_size one trained on W/corpus's
   training shards (W/vocab/vocab.txt).
2. pretrain: `python -m bert_jax.main --config=configs/pretrain_small.py --workdir=W/pretrain`
   (resumes from its own checkpoints).
3. finetune: per task and seed, the pretrained encoder and the same shape from a fresh random
   init (W/random_init, a bert_jax export of `BertForPreTraining.init`) fine-tuned with identical
   settings by `bert_jax.finetune.loop.run`; W/finetune/<arm>/<task>/seed<k>/result.json.
4. report: W/pretraining_helps.json (dev scores, both arms, every seed) and
   W/pretraining_helps.png (pretraining MLM loss/accuracy; fine-tuning scores with seed spread).

MRPC: `data_pipeline.tasks.glue` reads the raw `msr_paraphrase_train.txt`, but GLUE's MRPC dev
split (dev_ids.tsv) is not in shared/data; the labelled `msr_paraphrase_test.txt` (= GLUE's MRPC
test) is scored as "dev" here, through `config.split_files.dev`.

--quick (what tests/experiments/test_pretraining_helps.py runs): the test-sized model of configs/test.py
shape, a few steps, the data under --corpus_dir/--glue_dir/--vocab_file the caller gives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Stage 1 (corpus, vocabulary, records) lives in experiments.pretraining_corpus.
from experiments.pretraining_corpus import (DATA, ROOT, log, stage_corpus, stage_records, stage_vocab,
                                            task_text_documents)

TASK_DIRS = {"sst2": "SST-2", "cola": "CoLA", "stsb": "STS-B", "mrpc": "MRPC", "rte": "RTE"}
ARMS = ("pretrained", "random")


# ---------------------------------------------------------------------------------------------
# Stage 2: pretraining (a subprocess of bert_jax.main; it resumes from its own checkpoints)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Stage 3: fine-tuning, pretrained vs random init
# ---------------------------------------------------------------------------------------------


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


def _finetune_once(args, run_dir: str, config, what: str) -> dict:
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
        record = _finetune_once(args, run_dir, finetune_config(args, task, init, 0, fit, lr, select),
                                f"select {task} {arm} lr {lr:g}")
        scores[f"{lr:g}"] = _score(record["results"])
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
                record = _finetune_once(args, run_dir, config, f"finetune {task} {arm} seed {seed} lr {lr:g}")
                if record.get("learning_rate", lr) != lr:
                    raise RuntimeError(f"{run_dir} was trained with lr {record['learning_rate']}, not the "
                                       f"chosen {lr}: remove it (or the workdir) to rerun")
                out.setdefault(task, {}).setdefault(arm, {})[str(seed)] = record
    return out, chosen


# ---------------------------------------------------------------------------------------------
# Stage 4: report
# ---------------------------------------------------------------------------------------------


def _score(results: dict) -> float:
    """The task's GLUE number as a fraction: `score`, the mean of its official metrics."""
    for key in ("score", "dev/score"):
        if key in results:
            return float(results[key])
    scores = [v for k, v in results.items() if k.endswith("score")]
    return float(scores[0])


def pretraining_curves(pretrain_dir: str) -> dict:
    """`{tag: [[step, value], ...]}` of the MLM/NSP losses and accuracies (TensorBoard events)."""
    from bert_jax import plot

    scalars = plot.read_scalars(pretrain_dir)
    keep = ("train/mlm_loss", "train/mlm_accuracy", "train/nsp_accuracy", "eval/masked_lm_loss",
            "eval/masked_lm_accuracy", "eval/next_sentence_accuracy")
    return {t: [[int(s), float(v)] for s, v in zip(*scalars[t])] for t in keep if t in scalars}


def summarize(finetuned: dict) -> dict:
    tasks = {}
    for task, arms in finetuned.items():
        row = {}
        for arm in ARMS:
            seeds = {s: _score(r["results"]) for s, r in arms.get(arm, {}).items()}
            vals = list(seeds.values())
            row[arm] = {"per_seed": seeds, "mean": statistics.mean(vals) if vals else None,
                        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                        "metrics": {s: r["results"] for s, r in arms.get(arm, {}).items()}}
        if row["pretrained"]["mean"] is not None and row["random"]["mean"] is not None:
            row["delta_points"] = 100 * (row["pretrained"]["mean"] - row["random"]["mean"])
        tasks[task] = row
    means = {arm: [t[arm]["mean"] for t in tasks.values() if t[arm]["mean"] is not None] for arm in ARMS}
    average = {arm: statistics.mean(v) if v else None for arm, v in means.items()}
    return {"tasks": tasks, "average": average}


def draw(path: str, curves: dict, summary: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (train_tag, eval_tag, title) in zip(axes[:2], (
            ("train/mlm_loss", "eval/masked_lm_loss", "MLM loss"),
            ("train/mlm_accuracy", "eval/masked_lm_accuracy", "MLM accuracy"))):
        for tag, style, label in ((train_tag, "-", "train"), (eval_tag, "o-", "held-out")):
            if tag in curves:
                steps, values = zip(*curves[tag])
                ax.plot(steps, values, style, label=label)
        ax.set_title(f"pretraining: {title}")
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[2]
    tasks = list(summary["tasks"])
    for k, (arm, color) in enumerate((("pretrained", "tab:blue"), ("random", "tab:orange"))):
        for i, task in enumerate(tasks):
            row = summary["tasks"][task][arm]
            x = i + (k - 0.5) * 0.3
            vals = [100 * v for v in row["per_seed"].values()]
            if not vals:
                continue
            ax.bar(x, statistics.mean(vals), width=0.3, color=color, alpha=0.6,
                   label=arm if i == 0 else None)
            ax.scatter([x] * len(vals), vals, color="k", s=10, zorder=3)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("dev score (x100; dots = seeds)")
    ax.set_title("fine-tuning: pretrained vs random init")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


METRIC_NAMES = {"sst2": "accuracy", "cola": "MCC", "stsb": "mean of Pearson and Spearman", "mrpc": "mean of F1 and accuracy",
                "rte": "accuracy"}


def markdown(report: dict) -> str:
    """The RESULTS.md table of a report: dev scores x 100, mean ± std over seeds, the chosen rates."""
    lines = ["| task (score) | pretrained | random init | Δ | per seed (pretrained / random) | lr (pretrained / random) |",
             "|---|---|---|---|---|---|"]
    for task, row in report["tasks"].items():
        p, r = row["pretrained"], row["random"]
        seeds = lambda arm: " ".join(f"{100 * v:.1f}" for v in arm["per_seed"].values())
        lrs = report.get("learning_rates", {}).get(task, {})
        lr = " / ".join(f"{lrs[a]['lr']:g}" for a in ARMS if a in lrs)
        lines.append(f"| {TASK_DIRS[task]} ({METRIC_NAMES.get(task, 'score')}) | {100 * p['mean']:.1f} ± {100 * p['std']:.1f} "
                     f"| {100 * r['mean']:.1f} ± {100 * r['std']:.1f} | {row['delta_points']:+.1f} | {seeds(p)} / {seeds(r)} | {lr} |")
    avg = report["average"]
    lines.append(f"| average | {100 * avg['pretrained']:.1f} | {100 * avg['random']:.1f} | "
                 f"{100 * (avg['pretrained'] - avg['random']):+.1f} | | |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="everything the stages write (resumable)")
    p.add_argument("--corpus_dir", default=os.path.join(DATA, "corpus"))
    p.add_argument("--glue_dir", default=os.path.join(DATA, "glue"))
    p.add_argument("--vocab_file", default=os.path.join(DATA, "vocab", "bert-base-uncased", "vocab.txt"))
    p.add_argument("--pretrain_steps", type=int, default=0, help="0 = configs/pretrain_small.py's")
    p.add_argument("--no_nsp", action="store_true", help="pretrain with masked LM only (no next-sentence loss)")
    p.add_argument("--task_text", default="",
                   help="comma-separated GLUE tasks whose unlabelled training text joins the pretraining "
                        "corpus (task-adaptive pretraining; e.g. sst2,cola,stsb,mrpc,rte). Default: none")
    p.add_argument("--train_vocab_size", type=int, default=0,
                   help="train a WordPiece vocab of this many lines on the corpus's training shards "
                        "(data_pipeline.train_vocab) instead of using --vocab_file. Default: 0 (--vocab_file)")
    p.add_argument("--tasks", default="sst2,cola,stsb,mrpc,rte")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--max_train_examples", type=int, default=2000,
                   help="rows drawn from each training set (0 = all): the low-resource regime, and the 2-hour budget")
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--finetune_lrs", default="1e-4,3e-4,1e-3",
                   help="learning-rate grid; each arm and task takes the best on a held-back part of train")
    p.add_argument("--select_fraction", type=float, default=0.2,
                   help="part of the (subsampled) training set held back to choose the learning rate")
    p.add_argument("--finetune_epochs", type=float, default=3.0)
    p.add_argument("--finetune_batch_size", type=int, default=32)
    p.add_argument("--dupe_factor", type=int, default=5)
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--output_dir", default="", help="also copy the JSON and PNG here")
    p.add_argument("--quick", action="store_true", help="a few steps of a test-sized model (the test)")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.task_text = [t for t in args.task_text.split(",") if t]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.finetune_lrs = [float(v) for v in args.finetune_lrs.split(",") if v]
    for flag in ("tasks", "task_text"):
        unknown = set(getattr(args, flag)) - set(TASK_DIRS)
        if unknown:
            p.error(f"--{flag}: unknown {sorted(unknown)}; expected some of {sorted(TASK_DIRS)}")
    if args.train_vocab_size < 0:
        p.error(f"--train_vocab_size={args.train_vocab_size}: a number of vocab lines, or 0 for --vocab_file")
    if args.quick:
        args.pretrain_steps = args.pretrain_steps or 4
        args.max_seq_length = min(args.max_seq_length, 32)
        args.dupe_factor = 1
        args.num_workers = 1
        args.finetune_epochs = min(args.finetune_epochs, 1.0)
        args.finetune_batch_size = 8
    args.workdir = os.path.abspath(args.workdir)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    times_path = os.path.join(args.workdir, "stage_wall_s.json")
    times = json.load(open(times_path, encoding="utf-8")) if os.path.exists(times_path) else {}

    def timed(name, fn, *a, **kw):
        started = time.time()
        value = fn(*a, **kw)
        elapsed = round(time.time() - started, 1)
        if elapsed > 1.0 or name not in times:  # a skipped stage keeps its earlier time
            times[name] = elapsed
        with open(times_path, "w", encoding="utf-8") as f:
            json.dump(times, f, indent=1)
        return value

    corpus, records = os.path.join(args.workdir, "corpus"), os.path.join(args.workdir, "records")
    pretrain_dir = os.path.join(args.workdir, "pretrain")
    task_text = task_text_documents(args.glue_dir, args.task_text) if args.task_text else None
    corpus_info = timed("corpus", stage_corpus, args.corpus_dir, corpus, task_text)
    if args.train_vocab_size:
        args.vocab_file = timed("vocab", stage_vocab, corpus, os.path.join(args.workdir, "vocab"),
                                args.train_vocab_size)
    records_info = timed("records", stage_records, corpus, records, args.vocab_file, dupe_factor=args.dupe_factor,
                         seq_len=args.max_seq_length, predictions=5 if args.quick else 20,
                         workers=args.num_workers)
    overrides = pretrain_overrides(args, records)
    timed("pretrain", stage_pretrain, args, pretrain_dir, overrides)
    inits = {"pretrained": pretrain_dir,
             "random": timed("random_init", stage_random_init, os.path.join(args.workdir, "random_init"),
                             overrides, args.vocab_file)}
    finetuned, chosen = timed("finetune", stage_finetune, args, inits)

    summary = summarize(finetuned)
    curves = pretraining_curves(pretrain_dir)
    report = {
        "issue": 28,
        "recipe": {"config": "configs/pretrain_small.py", "overrides": overrides, "quick": args.quick,
                   "corpus": corpus_info, "records": records_info, "task_text": args.task_text,
                   "vocab": {"file": args.vocab_file, "trained_size": args.train_vocab_size},
                   "finetune": {"lr_grid": args.finetune_lrs, "select_fraction": args.select_fraction,
                                "epochs": args.finetune_epochs,
                                "batch": args.finetune_batch_size, "max_seq_length": args.max_seq_length,
                                "max_train_examples": args.max_train_examples, "seeds": args.seeds},
                   "mrpc_dev": "msr_paraphrase_test.txt (GLUE MRPC test; GLUE's dev split is not available)"},
        "stage_wall_s": times,  # of the last invocation that ran each stage
        "finetune_runs_wall_s": {arm: round(sum(r["wall_s"] for t in finetuned.values()
                                                for r in t.get(arm, {}).values()), 1) for arm in ARMS},
        "learning_rates": chosen,  # per task and arm: the chosen rate and the selection scores
        "pretraining_curves": curves,
        **summary,
    }
    json_path = os.path.join(args.workdir, "pretraining_helps.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    png_path = os.path.join(args.workdir, "pretraining_helps.png")
    draw(png_path, curves, summary)
    if args.output_dir:
        import shutil
        os.makedirs(args.output_dir, exist_ok=True)
        for p in (json_path, png_path):
            shutil.copy(p, args.output_dir)
    for task, row in summary["tasks"].items():
        log(f"{task}: pretrained {row['pretrained']['mean']} ± {row['pretrained']['std']}, "
            f"random {row['random']['mean']} ± {row['random']['std']}")
    print(markdown(report), flush=True)
    log(f"wrote {json_path} and {png_path}")
    return report


if __name__ == "__main__":
    main()
