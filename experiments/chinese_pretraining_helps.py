"""A Chinese BERT-Tiny from scratch on review text: whole-word vs character masking vs random init (issue 40).

    python -m experiments.chinese_pretraining_helps --workdir=W [--pretrain_steps=N] [--seeds=0,1,2] \\
        [--output_dir=experiments/results/chinese_pretraining_helps] [--quick]

Everything runs from ../shared/data (MANIFEST.md, "Chinese") with Google's BERT-Base Chinese vocab
(21,128 entries: each CJK character its own token). Stages, each skipped when its outputs exist:

1. splits (W/tasks): ChnSentiCorp hotel reviews (7,766 rows, one empty review dropped and counted)
   -> test 10%, dev 10%, train 80% by `RandomState(0).permutation` of the 7,765 usable rows (the
   file's order kept within each). MSRA NER (55,289 sentences, a character and its tag a line) ->
   test 10%, dev 10%, train 80% the same way, then `--msra_train`/`--msra_eval` sentences drawn
   from each (seed 0; the 2-hour budget).
2. corpus (W/corpus): the online-shopping (62,774 reviews, 10 categories, hotels among them) and
   food-delivery (11,987) reviews, minus every review equal (whitespace removed) to a ChnSentiCorp
   dev or test review or sharing a sentence of 8+ characters with one (near copies); a document is 10 reviews of one source, category and label (seeded order),
   a sentence ends after 。！？!?；; 2% of the documents are held out. Google's text format.
3. records, one set per masking arm (W/records/<arm>): `create_pretraining_data --do_whole_word_mask`
   with `--chinese_whole_word_mask` (jieba's words masked whole; Cui et al. 2019) for "wwm", without
   it for "char" (Google's whole-word masking, which masks single characters on Chinese).
4. pretrain (W/pretrain/<arm>): configs/pretrain_small.py (BERT-Tiny L=2 H=128 A=2, MLM + NSP) with
   the Chinese vocab, `--pretrain_steps` steps (default 1,500) of batch 64.
5. finetune (W/finetune/<arm>/<task>/seed<k>): each pretrained arm and a random init of the same
   shape (W/random_init), fine-tuned with identical settings by `bert_jax.finetune.loop.run` on
   configs/own_data.py's classification (ChnSentiCorp: accuracy) and tagging (MSRA: conlleval
   entity F1), 3 epochs, batch 32, learning rate `--finetune_lr` for every arm, seeds 0/1/2;
   the reported score is the test split's at the epoch with the best dev score.
6. report: W/chinese_pretraining_helps.json and .png (pretraining curves; scores per arm and seed).

--quick (tests/experiments/test_chinese_pretraining_helps.py): a test-sized model, a few steps, small slices.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import re
import statistics
import sys
import time
import zipfile

import numpy as np

from experiments import finetuning_arms as fa  # the English study's fine-tuning runs, reused
from experiments import pretraining_corpus as pc  # its record stage, reused
from experiments import pretraining_run as pr  # its pretraining stage, reused

ROOT, DATA = pc.ROOT, pc.DATA
ZH = os.path.join(DATA, "zh")
ARMS = ("wwm", "char", "random")
PRETRAINED = ("wwm", "char")
TASKS = {"chnsenticorp": ("classification", "accuracy"), "msra": ("tagging", "f1")}
log = pc.log


# ---------------------------------------------------------------------------------------------
# Stage 1: the fine-tuning splits
# ---------------------------------------------------------------------------------------------


def _three_way(n: int, seed: int = 0) -> tuple[list, list, list]:
    """(train, dev, test) indices: the first 10% of a seeded permutation is test, the next 10% dev."""
    order = np.random.RandomState(seed).permutation(n)
    k = int(round(0.1 * n))
    test, dev, train = sorted(order[:k]), sorted(order[k:2 * k]), sorted(order[2 * k:])
    return train, dev, test


def _sample(items: list, n: int, seed: int = 0) -> list:
    if not n or n >= len(items):
        return items
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), n))]


def stage_splits(out: str, msra_train: int, msra_eval: int, csc_train: int = 0, csc_eval: int = 0) -> dict:
    done = os.path.join(out, "splits.json")
    if os.path.exists(done):
        return json.load(open(done, encoding="utf-8"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(ZH, "ChnSentiCorp_htl_all.csv"), encoding="utf-8-sig", newline="") as f:
        rows = list(csv.DictReader(f))
    usable = [r for r in rows if r["review"].strip()]
    info = {"chnsenticorp": {"rows": len(rows), "empty_dropped": len(rows) - len(usable)}}
    for name, idx, n in zip(("train", "dev", "test"), _three_way(len(usable)), (csc_train, csc_eval, csc_eval)):
        idx = _sample(idx, n)
        with open(os.path.join(out, f"chnsenticorp_{name}.csv"), "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["label", "review"])
            w.writerows([usable[i]["label"], usable[i]["review"]] for i in idx)
        info["chnsenticorp"][name] = len(idx)
    with zipfile.ZipFile(os.path.join(ZH, "dh_msra.zip")) as z:
        text = z.read("dh_msra.txt").decode("utf-8")
    sentences = [s for s in re.split(r"\n\s*\n", text) if s.strip()]
    info["msra"] = {"sentences": len(sentences)}
    for name, idx, n in zip(("train", "dev", "test"), _three_way(len(sentences)), (msra_train, msra_eval, msra_eval)):
        chosen = _sample([sentences[i] for i in idx], n)
        with open(os.path.join(out, f"msra_{name}.conll"), "w", encoding="utf-8") as f:
            f.write("\n\n".join(s.strip("\n") for s in chosen) + "\n")
        info["msra"][name] = len(chosen)
    with open(done, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    log(f"splits: {info}")
    return info


# ---------------------------------------------------------------------------------------------
# Stage 2: the pretraining corpus
# ---------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[。！？!?；;])")


def _key(text: str) -> str:
    return "".join(text.split())


MIN_SHARED = 8  # characters: a sentence this long shared with a held-out review removes the review


def sentences(review: str) -> list[str]:
    """A review's sentences, cut after 。！？!?；, spaces collapsed."""
    return [s.strip() for s in _SENTENCE_END.split(" ".join(review.split())) if s.strip()]


def held_out_keys(reviews) -> tuple[set, set]:
    """(whole reviews, sentences of at least MIN_SHARED characters), whitespace removed."""
    whole = {_key(r) for r in reviews}
    parts = {_key(s) for r in reviews for s in sentences(r) if len(_key(s)) >= MIN_SHARED}
    return whole, parts


def leaks(review: str, whole: set, parts: set) -> bool:
    """Whether `review` is a held-out review, or shares a sentence of MIN_SHARED+ characters with
    one (the shopping set's hotel reviews hold near copies of ChnSentiCorp's: the same review with
    a word or a character changed)."""
    return _key(review) in whole or any(_key(s) in parts for s in sentences(review) if len(_key(s)) >= MIN_SHARED)


def review_documents(reviews: list[tuple[str, str]], per_doc: int = 10, seed: int = 0) -> list[list[str]]:
    """(group, review) pairs -> documents of `per_doc` reviews of one group (seeded order), each
    review cut into sentences after 。！？!?；."""
    groups: dict = {}
    for group, review in reviews:
        groups.setdefault(group, []).append(review)
    docs = []
    rng = random.Random(seed)
    for group in sorted(groups):
        items = groups[group]
        rng.shuffle(items)
        for k in range(0, len(items), per_doc):
            doc = [s for r in items[k:k + per_doc] for s in sentences(r)]
            if len(doc) > 1:
                docs.append(doc)
    return docs


def stage_corpus(out: str, splits_dir: str, max_reviews: int) -> dict:
    from data_pipeline.pretraining_data import corpora

    done = os.path.join(out, "corpus_info.json")
    if os.path.exists(done):
        return json.load(open(done, encoding="utf-8"))
    os.makedirs(out, exist_ok=True)
    held_out = []
    for name in ("dev", "test"):
        with open(os.path.join(splits_dir, f"chnsenticorp_{name}.csv"), encoding="utf-8", newline="") as f:
            held_out += [r["review"] for r in csv.DictReader(f)]
    whole, parts = held_out_keys(held_out)
    with zipfile.ZipFile(os.path.join(ZH, "online_shopping_10_cats.zip")) as z:
        shopping = list(csv.DictReader(io.StringIO(z.read("online_shopping_10_cats.csv").decode("utf-8-sig"),
                                                   newline="")))
    with open(os.path.join(ZH, "waimai_10k.csv"), encoding="utf-8-sig", newline="") as f:
        waimai = list(csv.DictReader(f))
    reviews = [(f"shopping/{r['cat']}/{r['label']}", r["review"].lstrip("\ufeff")) for r in shopping]
    reviews += [(f"waimai/{r['label']}", r["review"]) for r in waimai]
    leaked = [bool(_key(r)) and leaks(r, whole, parts) for _, r in reviews]
    kept = [(g, r) for (g, r), bad in zip(reviews, leaked) if _key(r) and not bad]
    info = {"reviews": len(reviews), "empty": sum(not _key(r) for _, r in reviews),
            "removed_as_chnsenticorp_dev_or_test": sum(_key(r) in whole for _, r in reviews if _key(r)),
            "removed_sharing_a_sentence": sum(leaked) - sum(_key(r) in whole for _, r in reviews if _key(r))}
    kept = _sample(kept, max_reviews)
    docs = review_documents(kept)
    random.Random(0).shuffle(docs)
    held = max(1, len(docs) // 50)
    corpora.write_google_text(os.path.join(out, "heldout.txt"), docs[:held])
    train = docs[held:]
    for k in range(pc.TRAIN_SHARDS):
        corpora.write_google_text(os.path.join(out, f"train-{k:02d}.txt"), train[k::pc.TRAIN_SHARDS])
    info.update(reviews_used=len(kept), documents=len(docs), heldout_documents=held,
                characters=sum(len(s) for d in docs for s in d))
    with open(done, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    log(f"corpus: {info}")
    return info


# ---------------------------------------------------------------------------------------------
# Stage 3: records per masking arm
# ---------------------------------------------------------------------------------------------


def stage_records(args, corpus: str, out: str, arm: str) -> dict:
    done = os.path.join(out, "records_done.json")
    if os.path.exists(done):
        return json.load(open(done, encoding="utf-8"))
    started = time.time()
    flags = ["--do_whole_word_mask=true"] + (["--chinese_whole_word_mask=true"] if arm == "wwm" else [])
    train = sorted(os.path.join(corpus, f) for f in os.listdir(corpus) if f.startswith("train-"))
    for name, inputs, dupe, shards, workers in (
            ("train", train, args.dupe_factor, len(train), args.num_workers),
            ("heldout", [os.path.join(corpus, "heldout.txt")], 1, 1, 1)):
        pc.create_records(inputs, os.path.join(out, name, name + ".tfrecord"), args.vocab_file, dupe_factor=dupe,
                          seq_len=args.max_seq_length, predictions=args.max_predictions, shards=shards,
                          workers=workers, flags=flags)
    info = pc.records_info(out, wall_s=round(time.time() - started, 1), flags=flags)
    with open(done, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    log(f"records {arm}: {info}")
    return info


# ---------------------------------------------------------------------------------------------
# Stage 5: fine-tuning
# ---------------------------------------------------------------------------------------------


def finetune_config(args, task: str, init: str, seed: int):
    from configs import own_data

    kind, _ = TASKS[task]
    config = own_data.get_config(kind)
    suffix = "csv" if kind == "classification" else "conll"
    for split in ("train", "dev", "test"):
        config.split_files[split] = os.path.join(args.workdir, "tasks", f"{task}_{split}.{suffix}")
    if kind == "classification":
        config.task_options.text_column = "review"
    config.eval_splits = ("dev", "test")
    config.predict_test = False
    config.init_checkpoint = init
    config.vocab_file = args.vocab_file
    config.do_lower_case = True
    config.seed = seed
    config.max_seq_length = args.max_seq_length
    config.global_batch_size = args.finetune_batch_size
    config.num_train_epochs = args.finetune_epochs
    config.learning_rate = args.finetune_lr
    config.log_every_steps = 1000
    config.async_checkpointing = False
    if args.quick:
        config.xla_backend_optimization_level = 0
    return config


def test_at_best_dev(run_dir: str, metric: str) -> dict:
    """The test score at the epoch with the best dev score (the first such epoch)."""
    with open(os.path.join(run_dir, "eval_history.json"), encoding="utf-8") as f:
        history = json.load(f)
    best = max(history, key=lambda h: (h[metric], -h["epoch"]))
    return {"epoch": best["epoch"], "dev": best[metric], "test": best[f"test_{metric}"]}


def stage_finetune(args, inits: dict) -> dict:
    fa.compile_cache(os.path.join(args.workdir, "xla_cache"))
    out: dict = {}
    for task, (_, metric) in TASKS.items():
        for arm in ARMS:
            for seed in args.seeds:
                run_dir = os.path.join(args.workdir, "finetune", arm, task, f"seed{seed}")
                record = fa.finetune_once(args, run_dir, finetune_config(args, task, inits[arm], seed),
                                          f"finetune {task} {arm} seed {seed}")
                record["at_best_dev"] = test_at_best_dev(run_dir, metric)
                out.setdefault(task, {}).setdefault(arm, {})[str(seed)] = record
    return out


# ---------------------------------------------------------------------------------------------
# Stage 6: report
# ---------------------------------------------------------------------------------------------


def summarize(finetuned: dict) -> dict:
    tasks = {}
    for task, arms in finetuned.items():
        row = {}
        for arm in ARMS:
            seeds = {s: r["at_best_dev"]["test"] for s, r in arms.get(arm, {}).items()}
            vals = list(seeds.values())
            row[arm] = {"test_per_seed": seeds, "mean": statistics.mean(vals),
                        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                        "dev_per_seed": {s: r["at_best_dev"]["dev"] for s, r in arms[arm].items()}}
        for arm in PRETRAINED:
            row[f"{arm}_minus_random_points"] = 100 * (row[arm]["mean"] - row["random"]["mean"])
        row["wwm_minus_char_points"] = 100 * (row["wwm"]["mean"] - row["char"]["mean"])
        tasks[task] = row
    return tasks


def draw(path: str, curves: dict, summary: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for arm, color in (("wwm", "tab:blue"), ("char", "tab:green")):
        for ax, (train_tag, eval_tag, title) in zip(axes[:2], (
                ("train/mlm_loss", "eval/masked_lm_loss", "MLM loss"),
                ("train/mlm_accuracy", "eval/masked_lm_accuracy", "MLM accuracy"))):
            for tag, style, label in ((train_tag, "-", "train"), (eval_tag, "o--", "held-out")):
                if tag in curves.get(arm, {}):
                    steps, values = zip(*curves[arm][tag])
                    ax.plot(steps, values, style, color=color, label=f"{arm} {label}", alpha=0.8)
            ax.set_title(f"pretraining: {title} (each arm on its own masks)")
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    ax = axes[2]
    colors = {"wwm": "tab:blue", "char": "tab:green", "random": "tab:orange"}
    for i, task in enumerate(summary):
        for k, arm in enumerate(ARMS):
            vals = [100 * v for v in summary[task][arm]["test_per_seed"].values()]
            x = i + (k - 1) * 0.27
            ax.bar(x, statistics.mean(vals), width=0.27, color=colors[arm], alpha=0.6, label=arm if i == 0 else None)
            ax.scatter([x] * len(vals), vals, color="k", s=10, zorder=3)
    ax.set_xticks(range(len(summary)), [f"{t}\n({TASKS[t][1]})" for t in summary])
    ax.set_ylabel("test score x100 (dots = seeds)")
    ax.set_title("fine-tuning: whole-word vs character masking vs random init")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def markdown(summary: dict) -> str:
    lines = ["| task (test score) | whole-word masking | character masking | random init | wwm − random | char − random "
             "| wwm − char |", "|---|---|---|---|---|---|---|"]
    for task, row in summary.items():
        cell = lambda arm: f"{100 * row[arm]['mean']:.1f} ± {100 * row[arm]['std']:.1f}"  # noqa: E731
        lines.append(f"| {task} ({TASKS[task][1]}) | {cell('wwm')} | {cell('char')} | {cell('random')} | "
                     f"{row['wwm_minus_random_points']:+.1f} | {row['char_minus_random_points']:+.1f} | "
                     f"{row['wwm_minus_char_points']:+.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--vocab_file", default=os.path.join(DATA, "vocab", "bert-base-chinese", "vocab.txt"))
    p.add_argument("--pretrain_steps", type=int, default=1500)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--max_reviews", type=int, default=0, help="reviews drawn for the corpus (0 = all)")
    p.add_argument("--msra_train", type=int, default=4000, help="MSRA training sentences drawn (0 = all 80%%)")
    p.add_argument("--msra_eval", type=int, default=1000, help="MSRA dev and test sentences drawn each")
    p.add_argument("--chnsenticorp_train", type=int, default=0, help="ChnSentiCorp training rows drawn (0 = all 80%%)")
    p.add_argument("--chnsenticorp_eval", type=int, default=0, help="ChnSentiCorp dev and test rows drawn (0 = all)")
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--max_predictions", type=int, default=20)
    p.add_argument("--dupe_factor", type=int, default=5)
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--finetune_lr", type=float, default=1e-3)
    p.add_argument("--finetune_epochs", type=float, default=3.0)
    p.add_argument("--finetune_batch_size", type=int, default=32)
    p.add_argument("--output_dir", default="", help="also copy the JSON and PNG here")
    p.add_argument("--quick", action="store_true", help="a test-sized model, a few steps (the test)")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.no_nsp = False
    if args.quick:
        args.pretrain_steps = min(args.pretrain_steps, 4)
        args.max_seq_length, args.max_predictions, args.dupe_factor, args.num_workers = 32, 5, 1, 1
        args.max_reviews = args.max_reviews or 400
        args.msra_train, args.msra_eval = 32, 16
        args.chnsenticorp_train, args.chnsenticorp_eval = 32, 16
        args.finetune_epochs, args.finetune_batch_size = 1.0, 8
    args.workdir = os.path.abspath(args.workdir)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    times: dict = {}

    def timed(name, fn, *a, **kw):
        started = time.time()
        value = fn(*a, **kw)
        times[name] = round(time.time() - started, 1)
        return value

    tasks_dir, corpus = os.path.join(args.workdir, "tasks"), os.path.join(args.workdir, "corpus")
    splits = timed("splits", stage_splits, tasks_dir, args.msra_train, args.msra_eval, args.chnsenticorp_train,
                   args.chnsenticorp_eval)
    corpus_info = timed("corpus", stage_corpus, corpus, tasks_dir, args.max_reviews)
    records, inits, curves, overrides = {}, {}, {}, {}
    for arm in PRETRAINED:
        out = os.path.join(args.workdir, "records", arm)
        records[arm] = timed(f"records_{arm}", stage_records, args, corpus, out, arm)
        overrides[arm] = pr.pretrain_overrides(args, out)
        overrides[arm]["max_predictions_per_seq"] = args.max_predictions
        inits[arm] = os.path.join(args.workdir, "pretrain", arm)
        timed(f"pretrain_{arm}", pr.stage_pretrain, args, inits[arm], overrides[arm])
        curves[arm] = pr.pretraining_curves(inits[arm])
    inits["random"] = timed("random_init", fa.stage_random_init, os.path.join(args.workdir, "random_init"),
                            overrides["wwm"], args.vocab_file)
    finetuned = timed("finetune", stage_finetune, args, inits)
    summary = summarize(finetuned)
    report = {"issue": 40, "command": "python -m experiments.chinese_pretraining_helps " + " ".join(argv or sys.argv[1:]),
              "splits": splits, "corpus": corpus_info, "records": records, "pretrain_overrides": overrides,
              "finetune": {"lr": args.finetune_lr, "epochs": args.finetune_epochs, "batch": args.finetune_batch_size,
                           "max_seq_length": args.max_seq_length, "seeds": args.seeds},
              "stage_wall_s": times, "pretraining_curves": curves, "tasks": summary,
              "runs": {t: {a: {s: {"at_best_dev": r["at_best_dev"], "wall_s": r["wall_s"]} for s, r in v.items()}
                           for a, v in arms.items()} for t, arms in finetuned.items()}}
    json_path = os.path.join(args.workdir, "chinese_pretraining_helps.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
    png_path = os.path.join(args.workdir, "chinese_pretraining_helps.png")
    draw(png_path, curves, summary)
    if args.output_dir:
        import shutil
        os.makedirs(args.output_dir, exist_ok=True)
        for path in (json_path, png_path):
            shutil.copy(path, args.output_dir)
    print(markdown(summary), flush=True)
    log(f"wrote {json_path} and {png_path}; stages {times}")
    return report


if __name__ == "__main__":
    main()
