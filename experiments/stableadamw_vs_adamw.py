"""Does StableAdamW pay? ModernBERT-tiny pretrained with AdamW + global-norm clipping against StableAdamW,
at the recipe's rate and at a higher one, on the same records (issue 72).

    python -m experiments.stableadamw_vs_adamw --workdir=W [--steps=300] [--seeds=0,1] [--rates=1e-3,4e-3]

Each arm is this project's pretraining code, called in-process as experiments/modernbert_vs_bert.py
calls it (`loop.build`, `steps.train_step`, `feed.make_train_input` / `run_eval`; its `Arm`):

- the model: configs/modernbert_tiny.py's shape (L=2, H=64, A=4, GeGLU 96), at length 128 with the
  bert-base-uncased vocabulary (30,522 ids), layer 1 local with a window of 32 tokens;
- the optimizer: "adamw" with `clip_norm=1.0` (the config's) against "stableadamw" with no global-norm
  clipping (ModernBERT's, which clips each tensor's update), both with the recipe's betas 0.9/0.98,
  eps 1e-6 and weight decay 1e-5;
- the schedule: configs/modernbert_tiny.py's warmup-stable-decay scaled to `--steps`: a linear warmup
  over the first 10%, the constant rate, a 1-sqrt decay over the last 20%; the rate is each of
  `--rates` (the tiny config's 1e-3, and 4 times it: StableAdamW's claim is stability at high rates);
- the same seed gives every arm the same initial parameters and the same batches with the same masks
  (dynamic masking at 15%, no dropout, float32).

The data: experiments/pretraining_corpus.py's corpus and records, as modernbert_vs_bert.py makes them
(WikiText-2 raw + Gutenberg + tiny-shakespeare; the held-out records, the last tenth of the WikiText-2
articles with their masks fixed, are the eval set of every arm). Held-out MLM loss at half the steps
and at the end; writes W/stableadamw_vs_adamw.json and prints the RESULTS.md table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

from experiments import modernbert_vs_bert
from experiments.pretraining_corpus import CORPUS_DIR, UNCASED_VOCAB, log, stage_corpus, stage_records

LENGTH = 128
ARMS = (("adamw", 1.0), ("stableadamw", 0.0))  # (config.optimizer, config.clip_norm)


def arm_config(optimizer: str, clip_norm: float, rate: float, seed: int, args, records: str):
    """configs/modernbert_tiny.py at length 128 on the records, as the module docstring says."""
    from configs import modernbert_tiny

    tiny = modernbert_tiny.get_config()
    shape = SimpleNamespace(vocab_file=args.vocab_file, hidden=tiny.model.hidden_size,
                            layers=tiny.model.num_hidden_layers, heads=tiny.model.num_attention_heads,
                            local_attention=0, tokens_per_batch=args.tokens_per_batch, quick=False,
                            learning_rate=rate, warmup_steps=max(1, args.steps // 10))
    config = modernbert_vs_bert.arm_config("modernbert", shape, LENGTH, seed, records)
    config.model.intermediate_size = tiny.model.intermediate_size  # GeGLU 96, the tiny config's
    config.optimizer, config.clip_norm = optimizer, clip_norm
    config.weight_decay = tiny.weight_decay
    config.num_train_steps = args.steps
    config.lr_decay_steps = max(1, args.steps // 5)
    config.lr_decay_shape = "1-sqrt"
    return config


def run_arm(optimizer: str, clip_norm: float, rate: float, seed: int, args, records: str) -> dict:
    config = arm_config(optimizer, clip_norm, rate, seed, args, records)
    arm = modernbert_vs_bert.Arm(optimizer, config, os.path.join(args.workdir, f"{optimizer}_{rate:g}_seed{seed}"))
    compile_s = arm.compile()
    curve = [arm.evaluate("start")]
    for mark in (args.steps // 2, args.steps):
        while arm.step < mark:
            arm.train_step()
        curve.append(arm.evaluate(f"step{mark}"))
    log(f"{optimizer} lr {rate:g} seed {seed}: held-out MLM loss {[round(p['mlm_loss'], 3) for p in curve]}, "
        f"{arm.seconds:.0f} s training")
    return {"optimizer": optimizer, "clip_norm": clip_norm, "learning_rate": rate, "seed": seed,
            "params": arm.params, "compile_s": round(compile_s, 1), "train_seconds": round(arm.seconds, 1),
            "curve": curve, "batch_digests": arm.batch_digests, "load_average_1min": os.getloadavg()[0]}


def markdown(report: dict) -> str:
    lines = ["| rate | seed | adamw + clip 1.0: held-out MLM loss (mid, end) | stableadamw (mid, end) "
             "| end: stable - adamw |", "|---|---|---|---|---|"]
    by = {(r["optimizer"], r["learning_rate"], r["seed"]): r for r in report["runs"]}
    for rate in report["settings"]["rates"]:
        deltas = []
        for seed in report["settings"]["seeds"]:
            a, s = by[("adamw", rate, seed)]["curve"], by[("stableadamw", rate, seed)]["curve"]
            deltas.append(s[-1]["mlm_loss"] - a[-1]["mlm_loss"])
            lines.append(f"| {rate:g} | {seed} | {a[1]['mlm_loss']:.3f}, {a[2]['mlm_loss']:.3f} "
                         f"| {s[1]['mlm_loss']:.3f}, {s[2]['mlm_loss']:.3f} | {deltas[-1]:+.3f} |")
        lines.append(f"| {rate:g} | mean | | | {statistics.mean(deltas):+.3f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="records and the report (the records are reused)")
    p.add_argument("--corpus_dir", default=CORPUS_DIR)
    p.add_argument("--vocab_file", default=UNCASED_VOCAB)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--rates", default="1e-3,4e-3", help="peak learning rates; 1e-3 is configs/modernbert_tiny.py's")
    p.add_argument("--tokens_per_batch", type=int, default=2048, help="16 rows of 128 tokens")
    p.add_argument("--dupe_factor", type=int, default=1)
    p.add_argument("--num_workers", type=int, default=2)
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.workdir = os.path.abspath(args.workdir)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    started = time.time()
    corpus = os.path.join(args.workdir, "corpus")
    report = {"issue": 72, "corpus": stage_corpus(args.corpus_dir, corpus), "runs": [],
              "settings": dict(vars(args))}
    records = os.path.join(args.workdir, f"records_{LENGTH}")
    report["records"] = stage_records(corpus, records, args.vocab_file, dupe_factor=args.dupe_factor,
                                      seq_len=LENGTH, predictions=modernbert_vs_bert.predictions(LENGTH),
                                      workers=args.num_workers)
    for seed in args.seeds:
        for rate in args.rates:
            for optimizer, clip_norm in ARMS:
                report["runs"].append(run_arm(optimizer, clip_norm, rate, seed, args, records))
    digests = {r["seed"]: set() for r in report["runs"]}
    for r in report["runs"]:
        digests[r["seed"]].add(tuple(r.pop("batch_digests")))
    report["same_batches_per_seed"] = all(len(d) == 1 for d in digests.values())
    report["wall_s"] = round(time.time() - started, 1)
    report["load_average_1min_at_end"] = os.getloadavg()[0]
    path = os.path.join(args.workdir, "stableadamw_vs_adamw.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(markdown(report), flush=True)
    log(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
