"""Fine-tuning a real pretrained encoder end to end: dev scores, wall time, sequences/s; vs transformers.

    python -m benchmarks.finetune.end_to_end --model=../minilm --tasks=sst2,conll2003,squad_v1 \\
        [--hf_python=/path/to/venv-with-torch/bin/python] [--sst2_train=10000] [--epochs=1] \\
        [--set trim_padding_buckets=0 ...]

The encoder is all-MiniLM-L6-v2 (`../shared/tools/fetch_minilm.sh DIR`: a BERT with L=6, H=384,
A=12, HF format, no pretraining heads); the data is `../shared/data` (GLUE SST-2, CoNLL-2003,
SQuAD v1.1 dev). Each task runs `python -m bert_jax.main` with its config (configs/glue.py,
ner.py, squad.py) in a fresh process, and, with `--hf_python`, the same data and
hyper-parameters through transformers + PyTorch (`benchmarks.finetune.hf_reference`, in a Python that has
torch) right after it, so both see the same machine.

- SST-2: the first `--sst2_train` rows of a seeded shuffle of train.tsv (0 = all 67,349), dev.tsv
  (872) scored; accuracy.
- CoNLL-2003: the first `--conll_train` sentences of train.txt (0 = all 14,041), valid and test
  scored; entity F1 (conlleval semantics; HF's side is scored by seqeval).
- SQuAD v1.1: there is no SQuAD training file in ../shared/data, so the official dev set is
  split by article: the first `--squad_train_articles` (8) articles train, the other 40 are
  evaluated with the official scorer (EM/F1); length 256 (stride 128) instead of the paper's 384
  keeps the run near half an hour on 2 cores. bert_jax only (a transformers QA reference needs
  its own n-best post-processing: not written here).

Defaults are sized for a 2-core CPU (one epoch, SST-2 on 10,000 training rows at length 64,
CoNLL on 5,000 sentences); `--sst2_train=0 --conll_train=0 --epochs=3` is the full recipe.

bert_jax's run starts on an empty compilation cache of its own (`config.compilation_cache`), so it
compiles every program, as a first run does; `--warm` runs it once more on that cache after the
transformers run ("bert_jax_warm": what a second run with the same shapes and hyper-parameters,
another seed or a rerun, costs).

With `--seeds=42,1,2` each side runs once per seed (the seed draws the head, dropout and the data
order on both sides) and each task's record ends with `scores`: every score's mean, sample standard
deviation, min and max per side. Over the short runs sized for a CPU one seed's score says little:
the head's first draw moves it by more than the two sides differ (benchmarks/finetune/RESULTS.md, CoNLL-2003). The
heads start differently: ours as google-research/bert's (a truncated normal, stddev 0.02 before
the cut at 2 stddev), transformers' as a plain normal of stddev 0.02; `--set head_init=normal`
draws ours as transformers does. Each record names both (`head_init`). The first seed's runs are
the record's `bert_jax` / `transformers` (/ `bert_jax_warm`); every seed's are under `seeds`. Our
runs after the first load the first one's programs from its compilation cache (their walls are
a second run's).

Reported per run: the scores, the wall time of the whole process (loading, featurization,
compilation, training, evaluation, predictions), and the steady training rate (bert_jax: the
median of its logged `train/sequences_per_second` windows after the first, which holds the
compilation; transformers: training sequences over training seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")


def run_ours(config: str, workdir: str, overrides: dict) -> dict:
    """One `bert_jax.main` run. Its compilation cache is the folder `overrides` names (each task
    gets a fresh one: the first run compiles everything, as a first run on a new machine)."""
    cmd = [sys.executable, "-m", "bert_jax.main", f"--config={config}", f"--workdir={workdir}"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - started
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    with open(os.path.join(workdir, "eval_results.json")) as f:
        results = json.load(f)
    from bert_jax import plot

    rates = plot.read_scalars(workdir).get("train/sequences_per_second")
    steady = statistics.median(rates[1][1:]) if rates is not None and len(rates[1]) > 1 else float("nan")
    loaded = re.findall(r"compilation cache: (\d+) of (\d+) programs loaded from it, ([\d.]+)s", proc.stderr)
    return {"results": results, "wall_s": wall, "train_sequences_per_s": steady, "command": " ".join(cmd[1:]),
            "programs_from_cache": f"{loaded[-1][0]} of {loaded[-1][1]}" if loaded else "",
            "compile_s_saved": float(loaded[-1][2]) if loaded else 0.0}


SCORE = re.compile(r"(accuracy|f1|exact_match)$")
HEAD_INITS = {"truncated_normal": "google-research/bert's: truncated normal, stddev 0.02 before the cut at 2 stddev",
              "normal": "transformers': normal, stddev 0.02"}


def scores(result: dict) -> dict:
    """The scores of one run's results (accuracy, F1, exact match), by name."""
    return {k: float(v) for k, v in result.items() if SCORE.search(k) and isinstance(v, (int, float))}


def spread(values: list) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "values": values}


def over_seeds(args, out: dict, config: str, tmp: str, name: str, overrides: dict, hf_args=None) -> None:
    """Each seed of `--seeds`: our run, then transformers' (`hf_args`, without the seed) right
    after it; the first seed's runs fill `bert_jax`/`transformers`/`bert_jax_warm` as before,
    every seed's go to `seeds`, and `scores` has each score's spread over the seeds per side."""
    out["head_init"] = {"bert_jax": HEAD_INITS[args.overrides.get("head_init", "truncated_normal")]}
    if hf_args is not None:
        out["head_init"]["transformers"] = HEAD_INITS["normal"]
    out["seeds"] = []
    for i, seed in enumerate(args.seed_list):
        row = {"seed": seed}

        def theirs(row=row, seed=seed):
            row["transformers"] = run_hf(args.hf_python, [*hf_args, f"--seed={seed}"])

        ours_cold_and_warm(args, row, config, tmp, name, dict(overrides, seed=seed),
                           theirs if hf_args is not None else None, warm=args.warm and i == 0)
        out["seeds"].append(row)
        if i == 0:
            out.update({k: v for k, v in row.items() if k != "seed"})
    sides = [side for side in ("bert_jax", "transformers") if side in out["seeds"][0]]
    out["scores"] = {}
    for side in sides:
        per_seed = [scores(row[side]["results"] if side == "bert_jax" else row[side]) for row in out["seeds"]]
        names = [k for k in per_seed[0] if all(k in p for p in per_seed)]
        out["scores"][side] = {k: spread([p[k] for p in per_seed]) for k in names}


def ours_cold_and_warm(args, out: dict, config: str, tmp: str, name: str, overrides: dict, between=None,
                       warm: bool = False) -> None:
    """bert_jax's run on a fresh compilation cache ("bert_jax"), then `between` (the transformers
    run), then with `--warm` the same run again on that cache ("bert_jax_warm"): a second run
    of the same shapes and hyper-parameters (another seed, a rerun) loads its programs."""
    overrides = dict(overrides)
    overrides.setdefault("compilation_cache", os.path.join(tmp, f"xla_{name}"))
    out["bert_jax"] = run_ours(config, os.path.join(tmp, f"w_{name}_{overrides['seed']}"), overrides)
    out["load_between"] = load_average()
    if between is not None:
        between()
    if warm:
        out["bert_jax_warm"] = run_ours(config, os.path.join(tmp, f"w_{name}_warm"), overrides)


def run_hf(python: str, args: list) -> dict:
    out = tempfile.mktemp(suffix=".json")
    started = time.time()
    proc = subprocess.run([python, "-m", "benchmarks.finetune.hf_reference", *args, f"--out={out}"],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"transformers run failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    result["process_wall_s"] = time.time() - started
    return result


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def sst2(args, tmp) -> dict:
    src = os.path.join(DATA, "glue", "SST-2")
    with open(os.path.join(src, "train.tsv"), encoding="utf-8") as f:
        header, *rows = f.readlines()
    random.Random(0).shuffle(rows)
    rows = rows[:args.sst2_train] if args.sst2_train else rows
    data = os.path.join(tmp, "SST-2")
    os.makedirs(data)
    with open(os.path.join(data, "train.tsv"), "w", encoding="utf-8") as f:
        f.writelines([header] + rows)
    with open(os.path.join(src, "dev.tsv"), encoding="utf-8") as f, \
            open(os.path.join(data, "dev.tsv"), "w", encoding="utf-8") as g:
        g.write(f.read())
    hp = dict(max_seq_length=args.sst2_max_seq_length, global_batch_size=32, num_train_epochs=args.epochs,
              learning_rate=args.lr, eval_batch_size=128)
    out = {"task": "sst2", "train_examples": len(rows), "hyper_parameters": hp, "load_before": load_average()}
    hf = ["--task=sst2", f"--model={args.model}", f"--train={data}/train.tsv", f"--dev={data}/dev.tsv",
          f"--max_seq_length={hp['max_seq_length']}", "--batch=32", f"--epochs={args.epochs}", f"--lr={args.lr}",
          f"--autocast_bf16={int(args.hf_autocast_bf16)}"]
    over_seeds(args, out, "configs/glue.py", tmp, "sst2", dict(
        hp, task="sst2", data_dir=data, init_checkpoint=args.model, predict_test=False, **args.overrides),
        hf if args.hf_python else None)
    out["load_after"] = load_average()
    return out


def conll(args, tmp) -> dict:
    src = os.path.join(DATA, "conll2003")
    data = os.path.join(tmp, "conll2003")
    os.makedirs(data)
    with open(os.path.join(src, "train.txt"), encoding="utf-8") as f:
        text = f.read()
    sentences = [s for s in text.split("\n\n") if s.strip() and not s.startswith("-DOCSTART-")]
    keep = sentences[:args.conll_train] if args.conll_train else sentences
    with open(os.path.join(data, "train.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(keep) + "\n")
    for name in ("valid.txt", "test.txt"):
        with open(os.path.join(src, name), encoding="utf-8") as f, \
                open(os.path.join(data, name), "w", encoding="utf-8") as g:
            g.write(f.read())
    hp = dict(max_seq_length=args.conll_max_seq_length, global_batch_size=32, num_train_epochs=args.epochs,
              learning_rate=args.lr, eval_batch_size=128)
    out = {"task": "conll2003", "train_sentences": len(keep), "hyper_parameters": hp,
           "load_before": load_average()}
    # MiniLM is uncased: its vocabulary has no capitals.
    hf = ["--task=conll2003", f"--model={args.model}", f"--train={data}/train.txt", f"--dev={data}/valid.txt",
          f"--test={data}/test.txt", f"--max_seq_length={hp['max_seq_length']}", "--batch=32",
          f"--epochs={args.epochs}", f"--lr={args.lr}", f"--autocast_bf16={int(args.hf_autocast_bf16)}"]
    over_seeds(args, out, "configs/ner.py", tmp, "conll", dict(
        hp, data_dir=data, init_checkpoint=args.model, predict_test=False, **args.overrides),
        hf if args.hf_python else None)
    out["load_after"] = load_average()
    return out


def squad(args, tmp) -> dict:
    with open(os.path.join(DATA, "squad", "dev-v1.1.json"), encoding="utf-8") as f:
        dev = json.load(f)
    k = args.squad_train_articles
    data = os.path.join(tmp, "squad")
    os.makedirs(data)
    for name, articles in (("train-v1.1.json", dev["data"][:k]), ("dev-v1.1.json", dev["data"][k:])):
        with open(os.path.join(data, name), "w", encoding="utf-8") as f:
            json.dump({"version": dev["version"], "data": articles}, f)
    count = lambda arts: sum(len(p["qas"]) for a in arts for p in a["paragraphs"])
    hp = dict(max_seq_length=args.squad_max_seq_length, global_batch_size=32, num_train_epochs=args.epochs,
              learning_rate=args.lr, eval_batch_size=128)
    out = {"task": "squad_v1", "train_questions": count(dev["data"][:k]),
           "eval_questions": count(dev["data"][k:]), "hyper_parameters": hp, "load_before": load_average()}
    over_seeds(args, out, "configs/squad.py", tmp, "squad", dict(
        hp, data_dir=data, init_checkpoint=args.model, **args.overrides))
    out["load_after"] = load_average()
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(os.path.dirname(ROOT), "minilm"))
    p.add_argument("--tasks", default="sst2,conll2003,squad_v1")
    p.add_argument("--hf_python", default="", help="a Python with torch + transformers (<5 or >=5)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=42, help="both sides: head init, dropout, data order")
    p.add_argument("--seeds", default="", help="comma-separated seeds, each run on both sides (replaces --seed); "
                   "each task's record then has every score's mean and spread (scores)")
    p.add_argument("--sst2_train", type=int, default=10000, help="0 = all 67,349")
    p.add_argument("--sst2_max_seq_length", type=int, default=64)
    p.add_argument("--conll_train", type=int, default=5000, help="0 = all 14,041 sentences")
    p.add_argument("--conll_max_seq_length", type=int, default=128)
    p.add_argument("--squad_train_articles", type=int, default=8)
    p.add_argument("--squad_max_seq_length", type=int, default=256)
    p.add_argument("--hf_autocast_bf16", action="store_true",
                   help="transformers' runs under PyTorch's CPU autocast to bfloat16 (against ours with "
                        "--set cpu_bf16=on: both sides' mixed precision)")
    p.add_argument("--warm", action="store_true",
                   help="run bert_jax a second time on the first run's compilation cache (bert_jax_warm)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for bert_jax's runs (repeatable), e.g. trim_padding_buckets=0")
    p.add_argument("--out", default="", help="also write the results here (JSON)")
    p.add_argument("--json", action="store_true",
                   help="end with all the runs as one JSON line (benchmarks/suite.py reads it)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    args.overrides = {}
    try:
        args.seed_list = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    except ValueError:
        raise SystemExit(f"--seeds={args.seeds!r}: expected comma-separated integers, e.g. 42,1,2") from None
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE (a key of the task's config)")
        args.overrides[key] = value
    if not os.path.isdir(DATA) or not os.path.exists(os.path.join(args.model, "model.safetensors")):
        reason = f"needs {DATA} and the MiniLM model in {args.model} (../shared/tools/fetch_minilm.sh)"
        print(json.dumps({"benchmark": "bench_finetune", "skipped": reason}) if args.json else f"skipped: {reason}")
        return
    results = {"benchmark": "bench_finetune", "date": time.strftime("%Y-%m-%d"), "host_cpus": os.cpu_count(),
               "overrides": args.overrides, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks.split(","):
            run = {"sst2": sst2, "conll2003": conll, "squad_v1": squad}[task](args, tmp)
            print(json.dumps(run), flush=True)
            results["runs"].append(run)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    if args.json:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
