"""The Beam runner (`--runner=beam`, DirectRunner) against the local path on the shared corpus:
wall and CPU time, and whether the outputs are byte-identical.

    python -m benchmarks.data.beam [--corpus_dir=../shared/data/corpus] \\
        [--vocab_file=../shared/data/vocab/bert-base-uncased/vocab.txt] [--dupe_factors=1,5]

The corpus is converted to Google's format by `benchmarks.data.create_data.convert` (8 shard files). For each
dupe factor, four runs follow each other, each in a fresh process (wall time includes start-up,
Beam's import and pipeline set-up included): the local path with 1 and 2 worker processes, and
the DirectRunner in_memory (`--num_workers=1`: the shards run in the driver process) and
multi_processing with 2 worker processes (`--num_workers=2`). Every run writes 8 output files;
"identical" compares each file's bytes with the local 1-worker run's.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

from benchmarks.data.create_data import ROOT, convert, timed

RUNS = (("local, `--num_workers=1`", ["--num_workers=1"]),
        ("local, `--num_workers=2`", ["--num_workers=2"]),
        ("Beam DirectRunner in_memory (`--num_workers=1`)", ["--runner=beam", "--num_workers=1"]),
        ("Beam DirectRunner multi_processing, 2 workers (`--num_workers=2`)", ["--runner=beam", "--num_workers=2"]))


def file_hashes(directory: str) -> dict:
    return {name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(directory)) if not name.endswith("dataset_info.json")}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus_dir", default=os.path.join(ROOT, "..", "shared", "data", "corpus"))
    ap.add_argument("--vocab_file", default=os.path.join(ROOT, "..", "shared", "data", "vocab",
                                                         "bert-base-uncased", "vocab.txt"))
    ap.add_argument("--out_dir", default=os.path.join(tempfile.gettempdir(), "bench_beam"))
    ap.add_argument("--dupe_factors", default="1,5")
    args = ap.parse_args()
    if not os.path.isdir(args.corpus_dir) or not os.path.exists(args.vocab_file):
        print(f"skipped: no corpus at {args.corpus_dir} or no vocab at {args.vocab_file} (the shared data)")
        return
    if importlib.util.find_spec("apache_beam") is None:  # looked up, not imported (its import logs noise)
        print("skipped: apache_beam is not installed (pip install -e '.[beam]')")
        return
    shutil.rmtree(args.out_dir, ignore_errors=True)
    shards, ndocs, nsent = convert(args.corpus_dir, os.path.join(args.out_dir, "text"))
    print(f"corpus: {ndocs} documents, {nsent} sentences, {len(shards)} shards", flush=True)
    print(f"before: {uptime()}", flush=True)
    rows = []
    for dupe in (int(d) for d in args.dupe_factors.split(",")):
        common = [f"--input_file={os.path.join(args.out_dir, 'text', 'shard-*.txt')}",
                  f"--vocab_file={args.vocab_file}", f"--dupe_factor={dupe}", "--max_seq_length=128",
                  "--max_predictions_per_seq=20", "--num_output_shards=8"]
        baseline = None
        for label, extra in RUNS:
            out = os.path.join(args.out_dir, f"d{dupe}-{len(rows)}")
            secs, cpu, _ = timed([sys.executable, "-m", "data_pipeline.create_pretraining_data", *common,
                                  f"--output_file={os.path.join(out, 'train.tfrecord')}", *extra])
            info = json.load(open(os.path.join(out, "train.dataset_info.json")))
            hashes = file_hashes(out)
            baseline = baseline or hashes
            row = {"dupe_factor": dupe, "run": label, "instances": info["num_instances"], "wall_s": round(secs, 2),
                   "cpu_s": round(cpu, 2), "instances_per_s": round(info["num_instances"] / secs),
                   "identical": hashes == baseline and len(hashes) == 8}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"after: {uptime()}\n")
    print("| dupe factor | run | instances | wall s | CPU s | instances/s | identical to local 1-worker |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dupe_factor']} | {r['run']} | {r['instances']:,} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | "
              f"{r['instances_per_s']:,} | {'yes' if r['identical'] else 'NO'} |")


if __name__ == "__main__":
    main()
