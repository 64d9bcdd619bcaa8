"""Pretraining-data throughput, memory and statistics on real text: ours (fast mode, 1 and 2
workers; reference-compatible mode) vs google-research/bert's own script, side by side.

    python -m benchmarks.data.create_data --corpus_dir=../shared/data/corpus \\
        --vocab_file=../shared/data/vocab/bert-base-uncased/vocab.txt --out_dir=/tmp/bench_cpd \\
        --reference_script=/path/to/google-research/bert/create_pretraining_data.py --dupe_factors=1,10

The corpus (WikiText-2 raw + Gutenberg) is first converted to Google's format: one sentence per
line (our rule-based splitter), a blank line between documents (WikiText articles; Gutenberg
books cut every 50 paragraphs), in 8 shards. Each configuration runs in its own fresh process
(wall time includes start-up); for each dupe factor the runs follow each other, reference
included, so they share the machine's load; CPU seconds (user + system of the process and its
workers) are reported too, being less sensitive than wall time to other jobs. Peak RSS: the
parent's and the largest worker's, from the run's manifest (`train.dataset_info.json`; each process's `getrusage`
maximum); for the reference, its one process. The memory runs then feed the same fast mode 4x the corpus as 4x the shards
(`--memory_scale`): peak RSS per process should not grow with the number of shards.

`--suite=chinese` times Chinese whole-word masking (`--do_whole_word_mask --chinese_whole_word_mask`,
jieba words) against Google's whole-word masking on the same Chinese text, where it masks single
characters (`--do_whole_word_mask` alone), each pair run back to back:

    python -m benchmarks.data.create_data --suite=chinese [--chinese_csv=../shared/data/zh/waimai_10k.csv]

The text is the CSV's `review` column, one review per line, a blank line every 20 lines (a
document), in 2 shard files written by the benchmark; bert-base-chinese's vocab. It skips (exit 0)
when the CSV or the vocab is absent.

The reference script (TF1 code, not part of this repository) is run from a temporary copy with
`import tensorflow.compat.v1 as tf`. Its records are counted from the TFRecord length headers;
at the smallest dupe factor the reference-compatible run's records are compared with its,
byte for byte after `SerializeToString(deterministic=True)`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data_pipeline.pretraining_data import corpora  # noqa: E402


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
    return write_shards(out_dir, docs, num_shards), len(docs), sum(len(d) for d in docs)


def write_shards(out_dir: str, docs: list, num_shards: int) -> list[str]:
    """`docs` dealt round-robin into out_dir/shard-NN.txt (Google's text format); their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i in range(num_shards):
        path = os.path.join(out_dir, f"shard-{i:02d}.txt")
        corpora.write_google_text(path, docs[i::num_shards])
        paths.append(path)
    return paths


def timed(cmd):
    """(wall seconds, CPU seconds (user + system, the process and its workers), peak RSS MB of
    the largest process as /usr/bin/time reports it)."""
    start = time.time()
    r = subprocess.run(["/usr/bin/time", "-f", "%U %S %M"] + cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.time() - start
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    user, system, rss_kb = r.stderr.strip().splitlines()[-1].split()
    return seconds, float(user) + float(system), int(rss_kb) / 1024


def count_records(path):
    """Records of an uncompressed TFRecord file, from its length headers (no TensorFlow)."""
    n = 0
    with open(path, "rb") as f:
        while True:
            head = f.read(12)
            if not head:
                return n
            (length,) = struct.unpack("<Q", head[:8])
            f.seek(length + 4, os.SEEK_CUR)
            n += 1


def run_ours(name, out_dir, inputs, common, extra):
    out = os.path.join(out_dir, name, "train.tfrecord")
    secs, cpu, tree_rss = timed([sys.executable, "-m", "data_pipeline.create_pretraining_data", inputs,
                                 f"--output_file={out}", *common, *extra])
    info = json.load(open(os.path.join(out_dir, name, "train.dataset_info.json")))
    rss = info.get("peak_rss_mb", {})
    m = info["mask_stats"]
    return {"seconds": round(secs, 2), "cpu_seconds": round(cpu, 2), "instances": info["num_instances"],
            "instances_per_s": round(info["num_instances"] / secs),
            "instances_per_cpu_s": round(info["num_instances"] / cpu),
            "peak_rss_mb_parent": round(rss.get("parent") or tree_rss),
            "peak_rss_mb_workers": round(rss["workers"]) if rss.get("workers") else None,
            "masked_of_candidates": round(m["masked_fraction_of_candidates"], 4),
            "mask_keep_random": [round(m["mask_fraction"], 4), round(m["keep_fraction"], 4),
                                 round(m["random_fraction"], 4)],
            "random_next": round(m["random_next_fraction"], 4)}


def prepare_reference(script):
    tmp = tempfile.mkdtemp()
    for src, f in ((script, "create_pretraining_data.py"),
                   (os.path.join(os.path.dirname(script), "tokenization.py"), "tokenization.py")):
        text = open(src).read()
        if "tensorflow.compat.v1" not in text:
            text = text.replace("import tensorflow as tf", "import tensorflow.compat.v1 as tf")
        open(os.path.join(tmp, f), "w").write(text)
    return os.path.join(tmp, "create_pretraining_data.py")


def same_records(reference_path, ours_path):
    import tensorflow as tf
    ref = [tf.train.Example.FromString(r.numpy()).SerializeToString(deterministic=True)
           for r in tf.data.TFRecordDataset(reference_path)]
    ours = [r.numpy() for r in tf.data.TFRecordDataset(ours_path)]
    return ref == ours


def chinese_corpus(csv_path, out_dir, lines_per_doc=20, num_shards=2):
    """The CSV's reviews in Google's format (a review a line, a document every `lines_per_doc`)."""
    import csv

    with open(csv_path, encoding="utf-8", newline="") as f:
        reviews = [" ".join(row["review"].split()) for row in csv.DictReader(f)]
    reviews = [r for r in reviews if r]
    docs = [reviews[i:i + lines_per_doc] for i in range(0, len(reviews), lines_per_doc)]
    return write_shards(out_dir, docs, num_shards), len(docs), len(reviews), sum(map(len, reviews))


def chinese_suite(args):
    """Chinese whole-word masking vs character masking (Google's --do_whole_word_mask on Chinese)."""
    vocab = args.chinese_vocab_file
    for path, what in ((args.chinese_csv, "--chinese_csv"), (vocab, "--chinese_vocab_file")):
        if not os.path.isfile(path):
            print(f"{what}={path} not found: the Chinese suite is skipped")
            return None
    shutil.rmtree(args.out_dir, ignore_errors=True)
    shards, ndocs, nlines, nchars = chinese_corpus(args.chinese_csv, os.path.join(args.out_dir, "text"))
    print(f"corpus: {ndocs} documents, {nlines} reviews, {nchars} characters, {len(shards)} shards", flush=True)
    inputs = f"--input_file={os.path.join(args.out_dir, 'text', 'shard-*.txt')}"
    results = {"corpus": {"documents": ndocs, "reviews": nlines, "characters": nchars, "shards": len(shards)},
               "runs": {}}
    for dupe in (int(d) for d in args.dupe_factors.split(",")):
        common = [f"--vocab_file={vocab}", "--do_lower_case=true", f"--dupe_factor={dupe}", "--max_seq_length=128",
                  "--max_predictions_per_seq=20", "--do_whole_word_mask"]
        configs = [("fast_1_worker", ["--num_workers=1"]), ("fast_2_workers", ["--num_workers=2"])]
        if dupe <= args.skip_reference_compatible_above:
            configs.append(("reference_compatible", ["--reference_compatible"]))
        runs = {}
        for name, extra in configs:
            pair = {}
            for masking, flag in (("characters", []), ("chinese_words", ["--chinese_whole_word_mask"])):
                pair[masking] = run_ours(f"{name}_{masking}_d{dupe}", args.out_dir, inputs, common, extra + flag)
                print(dupe, name, masking, json.dumps(pair[masking]), flush=True)
            pair["chinese_words_over_characters_seconds"] = round(
                pair["chinese_words"]["seconds"] / pair["characters"]["seconds"], 2)
            runs[name] = pair
        results["runs"][f"dupe_factor={dupe}"] = runs
    print(json.dumps(results, indent=1))
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=["english", "chinese"], default="english",
                    help="english: ours vs the reference on WikiText + Gutenberg; chinese: Chinese whole-word "
                         "masking vs character masking on --chinese_csv")
    ap.add_argument("--chinese_csv", default=os.path.join(ROOT, "..", "shared", "data", "zh", "waimai_10k.csv"))
    ap.add_argument("--chinese_vocab_file", default=os.path.join(ROOT, "..", "shared", "data", "vocab",
                                                                 "bert-base-chinese", "vocab.txt"))
    ap.add_argument("--corpus_dir", default=os.path.join(ROOT, "..", "shared", "data", "corpus"))
    ap.add_argument("--vocab_file", default=os.path.join(ROOT, "..", "shared", "data", "vocab",
                                                         "bert-base-uncased", "vocab.txt"))
    ap.add_argument("--out_dir", default=os.path.join(tempfile.gettempdir(), "bench_cpd"))
    ap.add_argument("--reference_script", default="")
    ap.add_argument("--dupe_factors", default="1,10")
    ap.add_argument("--skip_reference_compatible_above", type=int, default=1,
                    help="run our reference-compatible mode only at dupe factors up to this")
    ap.add_argument("--memory_scale", type=int, default=4, help="0: no memory runs")
    ap.add_argument("--json_out", default="")
    args = ap.parse_args()
    if args.suite == "chinese":
        results = chinese_suite(args)
        if results and args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(results, f, indent=1)
        return
    if not os.path.isdir(args.corpus_dir):
        sys.exit(f"--corpus_dir={args.corpus_dir} not found")
    shutil.rmtree(args.out_dir, ignore_errors=True)
    text_dir = os.path.join(args.out_dir, "text")
    shards, ndocs, nsent = convert(args.corpus_dir, text_dir)
    print(f"corpus: {ndocs} documents, {nsent} sentences, {len(shards)} shards", flush=True)
    inputs = f"--input_file={os.path.join(text_dir, 'shard-*.txt')}"
    reference = prepare_reference(args.reference_script) if args.reference_script else None
    results = {"corpus": {"documents": ndocs, "sentences": nsent, "shards": len(shards)}, "runs": {}}
    dupes = [int(d) for d in args.dupe_factors.split(",")]
    for dupe in dupes:
        common = [f"--vocab_file={args.vocab_file}", "--do_lower_case=true", f"--dupe_factor={dupe}",
                  "--max_seq_length=128", "--max_predictions_per_seq=20"]
        runs = {}
        if reference:
            out = os.path.join(args.out_dir, f"reference_d{dupe}", "train.tfrecord")
            os.makedirs(os.path.dirname(out))
            secs, cpu, rss = timed([sys.executable, reference, f"--input_file={','.join(shards)}",
                                    f"--output_file={out}", *common])
            n = count_records(out)
            runs["google_reference"] = {"seconds": round(secs, 2), "cpu_seconds": round(cpu, 2), "instances": n,
                                        "instances_per_s": round(n / secs), "instances_per_cpu_s": round(n / cpu),
                                        "peak_rss_mb_parent": round(rss)}
            print(dupe, "google_reference", json.dumps(runs["google_reference"]), flush=True)
        configs = [("fast_1_worker", ["--num_workers=1", "--num_output_shards=8"]),
                   ("fast_2_workers", ["--num_workers=2", "--num_output_shards=8"])]
        if dupe <= args.skip_reference_compatible_above:
            configs.append(("reference_compatible", ["--reference_compatible"]))
        for name, extra in configs:
            runs[name] = run_ours(f"{name}_d{dupe}", args.out_dir, inputs, common, extra)
            print(dupe, name, json.dumps(runs[name]), flush=True)
        if reference:
            base = runs["google_reference"]
            for name, r in runs.items():
                r["vs_reference"] = round(r["instances_per_s"] / base["instances_per_s"], 2)
                r["vs_reference_per_cpu_s"] = round(r["instances_per_cpu_s"] / base["instances_per_cpu_s"], 2)
            if "reference_compatible" in runs:
                runs["reference_compatible"]["identical_to_reference"] = same_records(
                    os.path.join(args.out_dir, f"reference_d{dupe}", "train.tfrecord"),
                    os.path.join(args.out_dir, f"reference_compatible_d{dupe}", "train.tfrecord"))
        results["runs"][f"dupe_factor={dupe}"] = runs
    if args.memory_scale:
        # The same shards repeated: memory_scale x the corpus in memory_scale x the shards.
        big = os.path.join(args.out_dir, "text_x")
        os.makedirs(big)
        for k in range(args.memory_scale):
            for p in shards:
                shutil.copy(p, os.path.join(big, f"{k}-{os.path.basename(p)}"))
        dupe = max(dupes)
        common = [f"--vocab_file={args.vocab_file}", f"--dupe_factor={dupe}", "--num_output_shards=8"]
        mem = {}
        for workers in (1, 2):
            for label, pattern in ((f"{len(shards)} shards", inputs),
                                   (f"{len(shards) * args.memory_scale} shards",
                                    f"--input_file={os.path.join(big, '*.txt')}")):
                name = f"memory_{workers}w_{len(glob.glob(pattern.split('=', 1)[1]))}"
                mem[f"{workers} worker(s), {label}"] = r = run_ours(name, args.out_dir, pattern, common,
                                                                   [f"--num_workers={workers}"])
                print("memory", workers, label, json.dumps(r), flush=True)
        results["memory"] = {"dupe_factor": dupe, "runs": mem}
    print(json.dumps(results, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
