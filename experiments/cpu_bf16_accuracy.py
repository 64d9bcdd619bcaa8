"""Does `cpu_bf16="auto"` hold pretraining accuracy? float32 against the default, several seeds a side (issue 70).

    python -m experiments.cpu_bf16_accuracy --workdir=W [--configs=demo,pretrain_small] \\
        [--steps=300] [--seeds=1,2,3] [--precisions=off,auto]

Each run is `python -m bert_jax.main --config=configs/<name>.py` in its own process, with
`--config.cpu_bf16=<precision>` and `--config.seed=<seed>` (the seed draws the initial weights, the
dropout and the data order): W/<name>/<precision>-<seed>/. What "auto" decided is read back from
each run's W/.../cpu_bf16.json, so a CPU where "auto" stays float32 (no bf16 units, or a probe
under its threshold) is reported as such, not as a comparison. The fine-tuning half of the
question is `benchmarks.finetune.end_to_end --seeds=... --set cpu_bf16=off|auto` (its records
carry each seed's scores).

- demo: configs/demo.py whole (the offline corpus, its 8k vocabulary and records made in each
  workdir, BERT-Tiny, 600 steps); `--steps` does not shorten it unless `--demo_steps` says so.
- pretrain_small: configs/pretrain_small.py on experiments/pretraining_corpus.py's corpus and
  records (made once under W/records, the released uncased vocabulary), `--steps` steps with the
  recipe's 10% warmup.

The report (W/cpu_bf16_accuracy.json, and a markdown table on stdout), per config:
- each run's training loss averaged over windows of `--window` steps (W/.../train_log.jsonl), and
  its held-out masked-LM loss and accuracy at each evaluation (TensorBoard scalars);
- per window: the float32 seeds' spread (max - min) and the gap between the two precisions' means;
  the summary compares the largest gap with the typical spread, and the final held-out losses'
  mean and sample standard deviation per precision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from experiments.pretraining_corpus import CORPUS_DIR, ROOT, UNCASED_VOCAB, log, stage_corpus, stage_records


def run_overrides(name: str, args, records: str, precision: str, seed: int) -> dict:
    """The `--config.` overrides of one run."""
    o = {"cpu_bf16": precision, "seed": seed}
    if name == "pretrain_small":
        o.update({"train_data": os.path.join(records, "train", "*.tfrecord*"),
                  "eval_data": os.path.join(records, "heldout", "*.tfrecord*"),
                  "vocab_file": args.vocab_file, "num_train_steps": args.steps,
                  "warmup_steps": max(1, args.steps // 10), "eval_every_steps": max(1, args.steps // 3),
                  "checkpoint_every_steps": args.steps, "log_every_steps": args.window})
    elif name == "demo" and args.demo_steps:
        o.update({"num_train_steps": args.demo_steps, "eval_every_steps": max(1, args.demo_steps // 3),
                  "checkpoint_every_steps": args.demo_steps})
    return o


def command(name: str, workdir: str, overrides: dict) -> list[str]:
    return ([sys.executable, "-m", "bert_jax.main", f"--config=configs/{name}.py", f"--workdir={workdir}"]
            + [f"--config.{k}={v}" for k, v in overrides.items()])


def run_one(name: str, workdir: str, overrides: dict) -> dict:
    """Runs (or, when finished before, reads) one run: its losses, evaluations and bf16 decision."""
    done = os.path.join(workdir, "accuracy_run.json")
    if os.path.exists(done):
        with open(done, encoding="utf-8") as f:
            return json.load(f)
    env = {k: v for k, v in os.environ.items() if k != "BERT_JAX_CPU_BF16"}  # the config decides
    started = time.time()
    proc = subprocess.run(command(name, workdir, overrides), cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{workdir}: bert_jax.main exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = {"overrides": overrides, "wall_s": round(time.time() - started, 1), **read_run(workdir)}
    with open(done, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return result


def read_run(workdir: str) -> dict:
    from bert_jax import layout, plot

    with open(os.path.join(workdir, layout.TRAIN_LOG), encoding="utf-8") as f:
        losses = {int(r["step"]): float(r["loss"]) for r in map(json.loads, f) if "loss" in r}
    decision_path = os.path.join(workdir, layout.CPU_BF16)
    decision = json.load(open(decision_path, encoding="utf-8")) if os.path.exists(decision_path) else None
    scalars = plot.read_scalars(workdir)
    evals = {tag: [[int(s), float(v)] for s, v in zip(*scalars[tag])]
             for tag in ("eval/masked_lm_loss", "eval/masked_lm_accuracy") if tag in scalars}
    return {"train_loss": sorted(losses.items()), "eval": evals, "cpu_bf16": decision}


def windows(losses: list, window: int) -> dict:
    """`{last step of the window: mean training loss}` over consecutive windows of `window` steps
    (steps 1..window, window+1..2*window, ...); a last, partial window is dropped."""
    sums: dict = {}
    for step, loss in losses:
        k = (int(step) - 1) // window
        sums.setdefault(k, []).append(float(loss))
    return {(k + 1) * window: sum(v) / len(v) for k, v in sorted(sums.items()) if len(v) == window}


def compare(runs: dict, window: int, reference: str = "off") -> dict:
    """`runs`: {precision: {seed: run}}. Per window the reference seeds' spread (max - min) and each
    other precision's gap of means to the reference; final held-out loss mean and sd per precision."""
    curves = {p: {s: windows(r["train_loss"], window) for s, r in by_seed.items()} for p, by_seed in runs.items()}
    steps = sorted(set.intersection(*(set(c) for by_seed in curves.values() for c in by_seed.values())))
    mean = lambda p, step: statistics.fmean(c[step] for c in curves[p].values())
    spread = {step: max(c[step] for c in curves[reference].values()) - min(c[step] for c in curves[reference].values())
              for step in steps}
    out = {"window": window, "steps": steps, "reference": reference,
           "reference_spread": [round(spread[s], 5) for s in steps],
           "mean_loss": {p: [round(mean(p, s), 5) for s in steps] for p in curves}, "final_eval": {}}
    for p in runs:
        finals = [r["eval"]["eval/masked_lm_loss"][-1][1] for r in runs[p].values() if r["eval"].get("eval/masked_lm_loss")]
        accs = [r["eval"]["eval/masked_lm_accuracy"][-1][1] for r in runs[p].values()
                if r["eval"].get("eval/masked_lm_accuracy")]
        out["final_eval"][p] = {
            "masked_lm_loss": finals, "masked_lm_accuracy": accs,
            "loss_mean": round(statistics.fmean(finals), 5) if finals else None,
            "loss_sd": round(statistics.stdev(finals), 5) if len(finals) > 1 else None,
            "decisions": sorted({json.dumps(r["cpu_bf16"], sort_keys=True) for r in runs[p].values()})}
        if p != reference and steps:
            gaps = [abs(mean(p, s) - mean(reference, s)) for s in steps]
            out.setdefault("gap", {})[p] = {
                "per_window": [round(g, 5) for g in gaps], "max": round(max(gaps), 5),
                "windows_within_reference_spread": sum(g <= spread[s] for g, s in zip(gaps, steps)),
                "median_reference_spread": round(statistics.median(spread.values()), 5)}
    return out


def _decision(recorded: str) -> str:
    """One run's W/cpu_bf16.json, as a table cell: none is written where the setting is not "auto"."""
    d = json.loads(recorded)
    if d is None:
        return "none recorded (not auto)"
    return f"{'bf16 matmuls' if d['mixed_matmuls'] else 'float32'}: {d.get('why', '')}"


def markdown(report: dict) -> str:
    lines = []
    for name, c in report["configs"].items():
        lines.append(f"\n{name} (training loss in windows of {c['window']} steps; held-out masked LM at the end)\n")
        lines.append("| precision | bf16 decision | held-out MLM loss per seed | mean ± sd | largest gap of mean "
                     "training loss to float32 | windows within float32's seed spread |")
        lines.append("|---|---|---|---|---|---|")
        for p, f in c["final_eval"].items():
            gap = c.get("gap", {}).get(p)
            sd = f"{f['loss_sd']:.4f}" if f["loss_sd"] is not None else "-"
            mean_sd = f"{f['loss_mean']:.4f} ± {sd}" if f["loss_mean"] is not None else "-"
            lines.append(f"| {p} | {'; '.join(_decision(d) for d in f['decisions'])} | {', '.join(f'{x:.4f}' for x in f['masked_lm_loss'])} | "
                         f"{mean_sd} | {gap['max'] if gap else '-'} | "
                         f"{(str(gap['windows_within_reference_spread']) + ' of ' + str(len(c['steps']))) if gap else '-'} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--configs", default="demo,pretrain_small")
    p.add_argument("--precisions", default="off,auto", help="cpu_bf16 values; the first is the reference")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=300, help="pretrain_small's steps")
    p.add_argument("--demo_steps", type=int, default=0, help="0 = configs/demo.py's 600")
    p.add_argument("--window", type=int, default=25, help="steps per averaged training-loss point")
    p.add_argument("--corpus_dir", default=CORPUS_DIR)
    p.add_argument("--vocab_file", default=UNCASED_VOCAB)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    precisions = args.precisions.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    records = os.path.join(args.workdir, "records")
    report = {"issue": 70, "args": vars(args), "configs": {}}
    for name in args.configs.split(","):
        if name == "pretrain_small":
            corpus = os.path.join(args.workdir, "corpus")
            stage_corpus(args.corpus_dir, corpus)
            stage_records(corpus, records, args.vocab_file, dupe_factor=5, seq_len=128, predictions=20, workers=2)
        runs: dict = {p: {} for p in precisions}
        for seed in seeds:  # precisions alternate, so a load change hits both sides alike
            for p in precisions:
                wd = os.path.join(args.workdir, name, f"{p}-{seed}")
                log(f"{name}: cpu_bf16={p} seed={seed} -> {wd}")
                runs[p][seed] = run_one(name, wd, run_overrides(name, args, records, p, seed))
        report["configs"][name] = compare(runs, args.window, reference=precisions[0])
        report["configs"][name]["wall_s"] = {p: [r["wall_s"] for r in runs[p].values()] for p in precisions}
        with open(os.path.join(args.workdir, "cpu_bf16_accuracy.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
