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
import time

# Stage 1 (corpus, vocabulary, records) lives in experiments.pretraining_corpus, stage 2 (pretraining)
# in experiments.pretraining_run, stage 3 (fine-tuning both arms) in experiments.finetuning_arms.
from experiments.finetuning_arms import ARMS, score, stage_finetune, stage_random_init
from experiments.pretraining_corpus import (CORPUS_DIR, DATA, UNCASED_VOCAB, log, stage_corpus, stage_records, stage_vocab,
                                            task_text_documents)
from experiments.pretraining_run import pretrain_overrides, pretraining_curves, stage_pretrain

TASK_DIRS = {"sst2": "SST-2", "cola": "CoLA", "stsb": "STS-B", "mrpc": "MRPC", "rte": "RTE"}


# ---------------------------------------------------------------------------------------------
# Stage 4: report
# ---------------------------------------------------------------------------------------------


def summarize(finetuned: dict) -> dict:
    tasks = {}
    for task, arms in finetuned.items():
        row = {}
        for arm in ARMS:
            seeds = {s: score(r["results"]) for s, r in arms.get(arm, {}).items()}
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
    p.add_argument("--corpus_dir", default=CORPUS_DIR)
    p.add_argument("--glue_dir", default=os.path.join(DATA, "glue"))
    p.add_argument("--vocab_file", default=UNCASED_VOCAB)
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
