"""Pretraining-data throughput and statistics on real text: ours (fast, 1 and 2 workers; and
reference-compatible) vs google-research/bert's own script, side by side on the same machine.

    python benchmarks/bench_create_data.py --corpus_dir=../shared/data/corpus \\
        --vocab_file=../shared/data/vocab/bert-base-uncased/vocab.txt --out_dir=/tmp/bench_cpd \\
        [--reference_script=/path/to/google-research/bert/create_pretraining_data.py]

The corpus (WikiText-2 raw + Gutenberg) is first converted to Google's format: one sentence per
line (our rule-based splitter), a blank line between documents (WikiText articles; Gutenberg
books cut every 50 paragraphs), in 8 shards. Each configuration runs in its own process;
wall time and that process's peak RSS are reported. The reference script (TF1 code) is run from
a temporary copy with `import tensorflow.compat.v1 as tf`; it is not part of this repository.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data_pipeline import corpora  # noqa: E402


def wikitext_documents(path):
    doc = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if re.match(r"^= [^=].* =$", line):  # a new article
                if doc:
                    yield doc
                doc = []
            elif line and not line.startswith("="):
                doc.extend(corpora.split_sentences(line))
    if doc:
        yield doc


def gutenberg_documents(path, paragraphs_per_doc=50):
    with open(path, encoding="utf-8", errors="replace") as f:
        paras = [p for p in re.split(r"\n\s*\n", f.read()) if p.strip()]
    for i in range(0, len(paras), paragraphs_per_doc):
        doc = [s for p in paras[i:i + paragraphs_per_doc] for s in corpora.split_sentences(p)]
        if doc:
            yield doc


def convert(corpus_dir, out_dir, num_shards=8):
    docs = []
    for p in sorted(glob.glob(os.path.join(corpus_dir, "wikitext-2-raw", "*.raw"))):
        docs.extend(wikitext_documents(p))
    for p in sorted(glob.glob(os.path.join(corpus_dir, "gutenberg", "*.txt"))):
        docs.extend(gutenberg_documents(p))
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i in range(num_shards):
        path = os.path.join(out_dir, f"shard-{i:02d}.txt")
        corpora.write_google_text(path, docs[i::num_shards])
        paths.append(path)
    return paths, len(docs), sum(len(d) for d in docs)


def timed(cmd, env=None):
    start = time.time()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    r = subprocess.run(["/usr/bin/time", "-f", "%M"] + cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.time() - start
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    peak_kb = int(r.stderr.strip().splitlines()[-1])
    del before
    return seconds, peak_kb / 1024, r


def count_records(pattern):
    import tensorflow as tf
    return sum(1 for f in glob.glob(pattern) for _ in tf.data.TFRecordDataset(f))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus_dir", default=os.path.join(ROOT, "..", "shared", "data", "corpus"))
    ap.add_argument("--vocab_file", default=os.path.join(ROOT, "..", "shared", "data", "vocab",
                                                         "bert-base-uncased", "vocab.txt"))
    ap.add_argument("--out_dir", default=os.path.join(tempfile.gettempdir(), "bench_cpd"))
    ap.add_argument("--reference_script", default="")
    ap.add_argument("--dupe_factor", type=int, default=2)
    args = ap.parse_args()
    if not os.path.isdir(args.corpus_dir):
        sys.exit(f"--corpus_dir={args.corpus_dir} not found")
    shutil.rmtree(args.out_dir, ignore_errors=True)
    shards, ndocs, nsent = convert(args.corpus_dir, os.path.join(args.out_dir, "text"))
    print(f"corpus: {ndocs} documents, {nsent} sentences, {len(shards)} shards")
    common = [f"--vocab_file={args.vocab_file}", "--do_lower_case=true", f"--dupe_factor={args.dupe_factor}",
              "--max_seq_length=128", "--max_predictions_per_seq=20"]
    inputs = f"--input_file={os.path.join(args.out_dir, 'text', 'shard-*.txt')}"
    results = {}
    runs = [("ours_fast_1_worker", ["--num_workers=1", "--num_output_shards=8"]),
            ("ours_fast_2_workers", ["--num_workers=2", "--num_output_shards=8"]),
            ("ours_reference_compatible", ["--reference_compatible"])]
    for name, extra in runs:
        out = os.path.join(args.out_dir, name, "train.tfrecord")
        secs, rss, _ = timed([sys.executable, "-m", "data_pipeline.create_pretraining_data", inputs,
                              f"--output_file={out}", *common, *extra])
        info = json.load(open(os.path.join(args.out_dir, name, "dataset_info.json")))
        results[name] = {"seconds": round(secs, 1), "instances": info["num_instances"],
                         "instances_per_s": round(info["num_instances"] / secs, 1),
                         "peak_rss_mb": round(rss), "mask_stats": info["mask_stats"]}
        print(name, json.dumps(results[name]))
    if args.reference_script:
        tmp = tempfile.mkdtemp()
        for src, f in ((args.reference_script, "create_pretraining_data.py"),
                       (os.path.join(os.path.dirname(args.reference_script), "tokenization.py"), "tokenization.py")):
            text = open(src).read().replace("import tensorflow as tf", "import tensorflow.compat.v1 as tf")
            open(os.path.join(tmp, f), "w").write(text)
        out = os.path.join(args.out_dir, "reference", "train.tfrecord")
        os.makedirs(os.path.dirname(out))
        files = ",".join(shards)
        secs, rss, _ = timed([sys.executable, os.path.join(tmp, "create_pretraining_data.py"),
                              f"--input_file={files}", f"--output_file={out}", *common])
        n = count_records(out)
        results["google_reference"] = {"seconds": round(secs, 1), "instances": n,
                                       "instances_per_s": round(n / secs, 1), "peak_rss_mb": round(rss)}
        print("google_reference", json.dumps(results["google_reference"]))
        import tensorflow as tf
        ref = [tf.train.Example.FromString(r.numpy()).SerializeToString(deterministic=True)
               for r in tf.data.TFRecordDataset(out)]
        ours_path = os.path.join(args.out_dir, "ours_reference_compatible", "train.tfrecord")
        ours = [r.numpy() for r in tf.data.TFRecordDataset(ours_path)]
        results["ours_reference_compatible"]["identical_to_reference"] = ref == ours
        for name in ("ours_fast_1_worker", "ours_fast_2_workers", "ours_reference_compatible"):
            results[name]["speedup_vs_reference"] = round(
                results[name]["instances_per_s"] / results["google_reference"]["instances_per_s"], 2)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
