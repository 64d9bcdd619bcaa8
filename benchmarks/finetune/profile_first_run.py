"""Where a first fine-tuning run's wall goes: start-up, featurizing, each program's compile, training, evaluation.

    python -m benchmarks.finetune.profile_first_run --model=../minilm [--sst2_train=2000] [--runs=2] \\
        [--set compile_ahead=false ...]

Runs `python -m bert_jax.main --config=configs/glue.py` on the first `--sst2_train` rows of a seeded
shuffle of ../shared/data's SST-2 (as `benchmarks.finetune.end_to_end` does: length 64, batch 32, one epoch,
dev scored) on an empty compilation cache of its own, so every program compiles, as on a first run.
The run is the entry point itself, in a child process that records jax's compile log (each
program's trace, lowering and XLA compile, and on which thread) and bert_jax's own log lines, with
their times since the process started. Prints the table of phases and programs; `--runs=N` repeats
the run (each on a fresh cache) and each `--set` goes to every run (`--set compile_ahead=false`:
today's order, every program compiled at its first call).

The compile wall is what the main thread spent compiling plus what it waited for a program still
compiling on the background thread (`config.compile_ahead`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")

# The child: bert_jax.main with a log handler that keeps every record's time and thread.
CHILD = r"""
import json, logging, os, runpy, sys, time
T0 = time.time()
events = []

class Keep(logging.Handler):
    def emit(self, r):
        events.append((r.created - T0, r.threadName, r.name, r.getMessage()[:2000]))

logging.getLogger().addHandler(Keep(level=logging.DEBUG))
import atexit
atexit.register(lambda: json.dump(events, open(os.environ["PROFILE_OUT"], "w")))
import jax
jax.config.update("jax_log_compiles", True)
events.append((time.time() - T0, "MainThread", "profile", "jax imported"))
sys.argv = ["bert_jax.main", *sys.argv[1:]]
runpy.run_module("bert_jax.main", run_name="__main__")
"""

COMPILE = re.compile(r"Finished (tracing \+ transforming|jaxpr to MLIR module conversion|XLA compilation of) "
                     r"(?:jit\()?([^) ]+)\)? (?:for (?:pjit|jit) )?in ([\d.e-]+) sec")
# Phases by bert_jax's log lines: the first line matching each (the last for "training logged").
PHASES = (("featurized", re.compile(r"featurized in")), ("batches planned", re.compile(r"training steps \(")),
          ("training logged", re.compile(r"^\[\d+\] train/")), ("evaluated", re.compile(r"^\[\d+\] eval_\w+/")),
          ("done", re.compile(r"compilation cache: \d+ of")))
LAST = ("training logged",)


def prepare_sst2(tmp: str, rows: int) -> str:
    src = os.path.join(DATA, "glue", "SST-2")
    with open(os.path.join(src, "train.tsv"), encoding="utf-8") as f:
        header, *lines = f.readlines()
    random.Random(0).shuffle(lines)
    data = os.path.join(tmp, "SST-2")
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, "train.tsv"), "w", encoding="utf-8") as f:
        f.writelines([header] + lines[:rows])
    with open(os.path.join(src, "dev.tsv"), encoding="utf-8") as f, \
            open(os.path.join(data, "dev.tsv"), "w", encoding="utf-8") as g:
        g.write(f.read())
    return data


def profile(events: list) -> dict:
    """The run's programs (name, thread, trace/lower/compile seconds, when done) and phase times."""
    programs, phases = [], {}
    for t, thread, _, message in events:
        m = COMPILE.match(message)
        if m:
            kind = {"tracing": "trace", "jaxpr": "lower", "XLA": "compile"}[m.group(1).split()[0]]
            programs.append({"at": t, "thread": thread, "kind": kind, "program": m.group(2),
                             "seconds": float(m.group(3))})
            continue
        for name, pattern in PHASES:
            if (name not in phases or name in LAST) and pattern.search(message):
                phases[name] = t
    ahead = [e for e in events if "compiled ahead" in e[3] or "compile ahead:" in e[3]]
    waited = sum(float(m.group(1)) for e in ahead for m in [re.search(r"waited ([\d.]+)s", e[3])] if m)
    main = sum(p["seconds"] for p in programs if p["thread"] == "MainThread")
    return {"programs": programs, "phases": phases, "main_thread_compile_s": main, "waited_s": waited,
            "compile_wall_s": main + waited,
            "background_compile_s": sum(p["seconds"] for p in programs if p["thread"] != "MainThread")}


def table(result: dict) -> str:
    lines = [f"wall {result['wall_s']:.1f} s; compile wall {result['compile_wall_s']:.1f} s (main thread "
             f"{result['main_thread_compile_s']:.1f} s + waited {result['waited_s']:.1f} s); background "
             f"{result['background_compile_s']:.1f} s; dev accuracy {result['accuracy']:.4f}",
             "", "| at (s) | phase |", "|---|---|"]
    lines += [f"| {t:.1f} | {name} |" for name, t in sorted(result["phases"].items(), key=lambda kv: kv[1])]
    lines += ["", "| done at (s) | program | step | seconds | thread |", "|---|---|---|---|---|"]
    lines += [f"| {p['at']:.1f} | {p['program']} | {p['kind']} | {p['seconds']:.2f} | {p['thread']} |"
              for p in result["programs"] if p["seconds"] >= 0.05]
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an HF BERT folder (../shared/tools/fetch_minilm.sh DIR)")
    p.add_argument("--sst2_train", type=int, default=2000)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--set", action="append", default=[], help="key=value, a --config.key=value of every run")
    p.add_argument("--out", default="", help="append each run's record (JSON lines) here")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every run (benchmarks.suite)")
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    runs = []
    import time
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_sst2(tmp, args.sst2_train)
        for run in range(args.runs):
            workdir, cache, out = (os.path.join(tmp, f"{x}{run}") for x in ("w", "xla", "events"))
            cmd = [sys.executable, "-c", CHILD, "--config=configs/glue.py", f"--workdir={workdir}",
                   "--config.task=sst2", f"--config.data_dir={data}", f"--config.init_checkpoint={args.model}",
                   "--config.max_seq_length=64", "--config.global_batch_size=32", "--config.num_train_epochs=1",
                   "--config.learning_rate=5e-5", "--config.eval_batch_size=128", "--config.predict_test=False",
                   f"--config.compilation_cache={cache}", *[f"--config.{s}" for s in args.set]]
            started = time.time()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PROFILE_OUT=out))
            wall = time.time() - started
            if proc.returncode:
                raise SystemExit(f"the run failed:\n{proc.stderr[-4000:]}")
            with open(out) as f:
                result = profile(json.load(f))
            with open(os.path.join(workdir, "eval_results.json")) as f:
                result["accuracy"] = json.load(f)["accuracy"]
            result.update(wall_s=wall, settings=args.set, run=run)
            print(table(result), flush=True)
            runs.append({k: v for k, v in result.items() if k != "programs"})
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(result) + "\n")

    if args.json:
        print(json.dumps({"benchmark": "profile_first_run", "sst2_train": args.sst2_train, "settings": args.set,
                          "runs": runs}))


if __name__ == "__main__":
    main()
