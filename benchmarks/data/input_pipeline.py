"""Input pipeline benchmark: records/s and batches/s of `PretrainingInput`, with and without
dynamic masking and packing, on TFRecords it writes itself.

Owns the input-pipeline numbers in benchmarks/data/RESULTS.md (issue 5). The records are synthetic
but shaped like `create_pretraining_data` output: Google's `short_seq_prob=0.1` leaves ~90% of
the sequences at full length (`--lengths=google`); `--lengths=short` draws every length
uniformly from [8, max_seq_length], the case packing is for. Each configuration builds a fresh
pipeline (the file check with sha256 included in "start"), skips `--warmup` batches, then times
`--batches` batches; the best of `--repeats` such runs is reported (the machine is shared).
Also reported: the packed rows' token fill, and the time and size of
`save_state` (the iterator checkpoint holds the shuffle buffer).

Usage (from the repository root):
  python -m benchmarks.data.input_pipeline [--max_seq_length=128] [--max_predictions_per_seq=20]
      [--batch=256] [--files=8] [--records=40000] [--lengths=google|short|both] [--batches=200]
      [--repeats=3]
"""

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from data_pipeline.input import pretraining as ip  # noqa: E402
from data_pipeline.records import manifests, schema  # noqa: E402

PAD, CLS, SEP, MASK, VOCAB = 0, 101, 102, 103, 30522
SPECIAL = dict(pad_id=PAD, cls_id=CLS, sep_id=SEP, mask_id=MASK, vocab_size=VOCAB)


def synthetic_records(n: int, length: int, preds: int, lengths: str, rng) -> list:
    """Serialized records with Google's layout and static masks (15%, capped)."""
    out = []
    for _ in range(n):
        if lengths == "google":
            real = length if rng.random() >= 0.1 else int(rng.integers(8, length + 1))
        else:
            real = int(rng.integers(8, length + 1))
        ids = rng.integers(1000, VOCAB, real)
        sep_a = int(rng.integers(2, real - 2))
        ids[0], ids[sep_a], ids[real - 1] = CLS, SEP, SEP
        segments = np.zeros(real, np.int64)
        segments[sep_a + 1:] = 1
        candidates = [i for i in range(1, real - 1) if i != sep_a]
        k = min(preds, max(1, int(round(real * 0.15))), len(candidates))
        positions = np.sort(rng.choice(candidates, k, replace=False))
        labels = ids[positions].copy()
        ids[positions] = MASK
        out.append(schema.serialize(schema.pad_features(
            ids.tolist(), segments.tolist(), positions.tolist(), labels.tolist(),
            int(rng.integers(0, 2)), length, preds)))
    return out


def write_data(directory: str, args, lengths: str) -> str:
    rng = np.random.default_rng(0)
    per_file = args.records // args.files
    counts = {}
    for i in range(args.files):
        path = os.path.join(directory, f"train-{i:05d}-of-{args.files:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for record in synthetic_records(per_file, args.max_seq_length,
                                            args.max_predictions_per_seq, lengths, rng):
                writer.write(record)
        counts[path] = per_file
    manifests.write_dataset_info(directory, counts)
    return os.path.join(directory, "train-*.tfrecord")


def measure(pattern: str, args, **options) -> dict:
    start = time.perf_counter()
    ds = ip.PretrainingInput(pattern, per_host_batch_size=args.batch,
                             max_seq_length=args.max_seq_length,
                             max_predictions_per_seq=args.max_predictions_per_seq, seed=0,
                             shuffle_buffer_size=args.shuffle_buffer_size, **options)
    built = time.perf_counter() - start
    for _ in range(args.warmup):
        next(ds)
    sequences, tokens, slots = 0.0, 0.0, 0
    t0 = time.perf_counter()
    for _ in range(args.batches):
        batch = next(ds)
        sequences += float(batch["next_sentence_weights"].sum())
        tokens += float(batch["input_mask"].sum())
        slots += batch["input_mask"].size
    seconds = time.perf_counter() - t0
    state_dir = tempfile.mkdtemp(prefix="bench_input_state_")
    t1 = time.perf_counter()
    ds.save_state(state_dir)
    save_s = time.perf_counter() - t1
    state_mb = sum(p.stat().st_size for p in Path(state_dir).rglob("*") if p.is_file()) / 2**20
    shutil.rmtree(state_dir)
    return {"start_s": built, "batches_s": args.batches / seconds,
            "records_s": sequences / seconds, "seqs_per_row": sequences / (args.batches * args.batch),
            "fill": tokens / slots, "save_s": save_s, "state_mb": state_mb}


CONFIGS = (
    ("static masks", {}),
    ("dynamic masking", dict(dynamic_masking=True, special_ids=SPECIAL)),
    ("packing", dict(packing=True)),
    ("packing + dynamic", dict(packing=True, dynamic_masking=True, special_ids=SPECIAL)),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--max_predictions_per_seq", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256, help="per-host batch size")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--records", type=int, default=40000, help="records in all files")
    parser.add_argument("--lengths", choices=["google", "short", "both"], default="both")
    parser.add_argument("--shuffle_buffer_size", type=int, default=10000)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batches", type=int, default=200, help="timed batches per config")
    parser.add_argument("--repeats", type=int, default=3, help="runs per config (best reported)")
    args = parser.parse_args()

    print(f"# {platform.node()} | {os.cpu_count()} CPUs | python {platform.python_version()} | "
          f"tensorflow {tf.__version__}")
    print(f"# L={args.max_seq_length} P={args.max_predictions_per_seq} batch={args.batch} "
          f"files={args.files} records={args.records} shuffle_buffer={args.shuffle_buffer_size} "
          f"timed batches={args.batches} (best of {args.repeats})")
    kinds = ["google", "short"] if args.lengths == "both" else [args.lengths]
    print("| lengths | pipeline | records/s | batches/s | seqs/row | token fill | start s | "
          "save_state s | state MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix="bench_input_") as directory:
            t = time.perf_counter()
            pattern = write_data(directory, args, kind)
            print(f"# wrote {args.records} '{kind}' records in {time.perf_counter() - t:.1f} s",
                  file=sys.stderr)
            for name, options in CONFIGS:
                r = max((measure(pattern, args, **options) for _ in range(args.repeats)),
                        key=lambda m: m["records_s"])
                print(f"| {kind} | {name} | {r['records_s']:,.0f} | {r['batches_s']:.1f} | "
                      f"{r['seqs_per_row']:.2f} | {r['fill']:.1%} | {r['start_s']:.2f} | "
                      f"{r['save_s']:.2f} | {r['state_mb']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
