"""CLI: text -> pre-masked TFRecords in Google's schema, + dataset_info.json.

    python -m data_pipeline.create_pretraining_data --input_file='corpus/*.txt' \\
        --output_file=out/train.tfrecord --vocab_file=vocab.txt [--num_workers=2 --num_output_shards=8]

Google's flags and defaults (`--do_lower_case=true --max_seq_length=128
--max_predictions_per_seq=20 --random_seed=12345 --dupe_factor=10 --masked_lm_prob=0.15
--short_seq_prob=0.1 --do_whole_word_mask=false`) plus ours.

Two modes:

- `--reference_compatible`: google-research/bert's program exactly: every input file read into
  one corpus in memory, one `random.Random(random_seed)` drawn call for call (document shuffle,
  dupes, instance shuffle), instances written round-robin over the `--output_file` list. With the
  same inputs, vocab and flags the records are the reference's, serialized deterministically.
- default (fast): each input file is a shard processed by one of `--num_workers` processes with
  its own random stream `Random(random_seed, shard)` and the fast batch tokenizer; the random
  "next sentence" comes from another document of the same shard. Memory is bounded by a shard,
  not the corpus; for a seed and a shard the output does not depend on the worker count
  (shards are written in input order, round-robin over `--num_output_shards` files).

Outputs: the TFRecords (gzip with `--compression=gzip`) and `dataset_info.json` next to them: the
flags, seed, vocab sha256, reading and masking statistics, and the manifest (records, bytes, sha256
per file) that the input pipeline verifies before training.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import multiprocessing
import os
import random
import sys
import time
from typing import Iterable, List, Optional, Sequence

from absl import app, flags

from data_pipeline import corpora, instances as inst, schema, tokenization

FLAGS = flags.FLAGS


FLAG_NAMES = ("input_file", "output_file", "vocab_file", "do_lower_case", "do_whole_word_mask",
              "max_seq_length", "max_predictions_per_seq", "random_seed", "dupe_factor",
              "masked_lm_prob", "short_seq_prob", "reference_compatible", "num_workers",
              "num_output_shards", "compression", "input_format", "tfds_name", "tfds_split",
              "tfds_text_key", "tfds_data_dir", "tfds_num_shards")


def define_flags():
    flags.DEFINE_string("input_file", None, "Input text file glob(s), comma-separated (Google's format: "
                        "one sentence per line, blank line between documents).")
    flags.DEFINE_string("output_file", None, "Output TFRecord file(s), comma-separated; in fast mode "
                        "with --num_output_shards>1, a path prefix.")
    flags.DEFINE_string("vocab_file", None, "WordPiece vocab.txt.")
    flags.DEFINE_bool("do_lower_case", True, "Lower-case and strip accents (uncased models).")
    flags.DEFINE_bool("do_whole_word_mask", False, "Mask whole words (all their ## pieces).")
    flags.DEFINE_integer("max_seq_length", 128, "Maximum sequence length.")
    flags.DEFINE_integer("max_predictions_per_seq", 20, "Maximum masked LM predictions per sequence.")
    flags.DEFINE_integer("random_seed", 12345, "Random seed.")
    flags.DEFINE_integer("dupe_factor", 10, "Number of times to duplicate the input with different masks.")
    flags.DEFINE_float("masked_lm_prob", 0.15, "Masked LM probability.")
    flags.DEFINE_float("short_seq_prob", 0.1, "Probability of a shorter-than-maximum sequence.")
    flags.DEFINE_bool("reference_compatible", False, "Reproduce google-research/bert's output exactly.")
    flags.DEFINE_integer("num_workers", 1, "Worker processes (fast mode).")
    flags.DEFINE_integer("num_output_shards", 1, "Output files (fast mode).")
    flags.DEFINE_enum("compression", "none", ["none", "gzip"], "TFRecord compression.")
    flags.DEFINE_enum("input_format", "text", ["text", "tfds"], "Google-format text files or a TFDS dataset.")
    flags.DEFINE_string("tfds_name", None, "TFDS dataset, e.g. wikipedia/20230601.en.")
    flags.DEFINE_string("tfds_split", "train", "TFDS split.")
    flags.DEFINE_string("tfds_text_key", "text", "TFDS feature holding the text.")
    flags.DEFINE_string("tfds_data_dir", None, "TFDS data_dir.")
    flags.DEFINE_integer("tfds_num_shards", 16, "Shards a TFDS split is read in (fast mode).")


@dataclasses.dataclass(frozen=True)
class Options:
    vocab_file: str
    do_lower_case: bool = True
    do_whole_word_mask: bool = False
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    random_seed: int = 12345
    dupe_factor: int = 10
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1

    def validate(self) -> None:
        if self.max_seq_length < 5:
            raise ValueError(f"--max_seq_length={self.max_seq_length}: needs room for [CLS] A [SEP] B [SEP] (>= 5)")
        if self.max_predictions_per_seq < 1:
            raise ValueError(f"--max_predictions_per_seq={self.max_predictions_per_seq} must be >= 1")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"--masked_lm_prob={self.masked_lm_prob} must be in (0, 1)")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"--short_seq_prob={self.short_seq_prob} must be in [0, 1]")
        if self.dupe_factor < 1:
            raise ValueError(f"--dupe_factor={self.dupe_factor} must be >= 1")
        if not os.path.exists(self.vocab_file):
            raise FileNotFoundError(f"--vocab_file={self.vocab_file}: not found")


def expand_inputs(patterns: str | Sequence[str]) -> List[str]:
    """Globs in order (each glob's matches sorted); a pattern matching nothing is an error naming it."""
    import tensorflow as tf
    if isinstance(patterns, str):
        patterns = [p for p in patterns.split(",") if p]
    files: List[str] = []
    for p in patterns:
        matched = sorted(tf.io.gfile.glob(p))
        if not matched:
            raise FileNotFoundError(f"--input_file: nothing matches {p!r}")
        files.extend(matched)
    return files


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tokenize_documents(docs: Iterable[List[str]], tokenize_batch) -> List[List[List[str]]]:
    out = []
    for doc in docs:
        toks = [t for t in tokenize_batch(doc) if t]
        if toks:
            out.append(toks)
    return out


def _instance_records(instances: Sequence[inst.TrainingInstance], vocab: dict, opts: Options) -> List[bytes]:
    records = []
    for x in instances:
        ids = [vocab[t] for t in x.tokens]
        feats = schema.pad_features(ids, x.segment_ids, x.masked_lm_positions,
                                    [vocab[t] for t in x.masked_lm_labels], int(x.is_random_next),
                                    opts.max_seq_length, opts.max_predictions_per_seq)
        records.append(schema.serialize(feats))
    return records


# ---------------------------------------------------------------------------------------------
# Reference-compatible mode
# ---------------------------------------------------------------------------------------------


def reference_records(input_files: Sequence[str], opts: Options, read_stats: corpora.ReadStats,
                      mask_stats: inst.MaskStats) -> List[bytes]:
    """The reference's records, in its order (whole corpus in memory, one random stream)."""
    tokenizer = tokenization.FullTokenizer(opts.vocab_file, do_lower_case=opts.do_lower_case)
    all_documents: List[List[List[str]]] = []
    # As the reference: one stream of lines over all files, so a file that does not end with a
    # blank line continues its last document into the next file.
    lines = (line for path in input_files for line in corpora.iter_lines(path, read_stats))
    for doc in corpora.documents_from_lines(lines, read_stats):
        toks = [t for t in (tokenizer.tokenize(s) for s in doc) if t]
        if toks:
            all_documents.append(toks)
    rng = random.Random(opts.random_seed)
    vocab_words = list(tokenizer.vocab.keys())
    instances = inst.create_training_instances(
        all_documents, vocab_words, max_seq_length=opts.max_seq_length, dupe_factor=opts.dupe_factor,
        short_seq_prob=opts.short_seq_prob, masked_lm_prob=opts.masked_lm_prob,
        max_predictions_per_seq=opts.max_predictions_per_seq, rng=rng,
        do_whole_word_mask=opts.do_whole_word_mask, stats=mask_stats)
    return _instance_records(instances, tokenizer.vocab, opts)


# ---------------------------------------------------------------------------------------------
# Fast mode: one shard per task
# ---------------------------------------------------------------------------------------------


_WORKER: dict = {}


def _init_worker(opts: Options) -> None:
    _WORKER["opts"] = opts
    _WORKER["tok"] = tokenization.FastTokenizer(opts.vocab_file, do_lower_case=opts.do_lower_case)


def shard_records(task) -> tuple:
    """(records, read stats, mask stats) of one input shard, with the shard's own random stream."""
    shard_index, source = task
    opts: Options = _WORKER["opts"]
    tok = _WORKER["tok"]
    read_stats, mask_stats = corpora.ReadStats(), inst.MaskStats()
    if source[0] == "text":
        docs = corpora.read_google_text(source[1], read_stats)
    else:
        _, name, split, key, data_dir, num_shards = source
        docs = corpora.read_tfds_documents(name, split, key, data_dir, shard_index, num_shards)
    all_documents = _tokenize_documents(docs, tok.tokenize_batch)
    if source[0] != "text":
        read_stats.documents = len(all_documents)
    rng = random.Random(f"{opts.random_seed}/{shard_index}")
    instances = inst.create_training_instances(
        all_documents, list(tok.vocab.keys()), max_seq_length=opts.max_seq_length,
        dupe_factor=opts.dupe_factor, short_seq_prob=opts.short_seq_prob,
        masked_lm_prob=opts.masked_lm_prob, max_predictions_per_seq=opts.max_predictions_per_seq,
        rng=rng, do_whole_word_mask=opts.do_whole_word_mask, stats=mask_stats)
    return _instance_records(instances, tok.vocab, opts), read_stats, mask_stats


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def output_paths(output_file: str, num_output_shards: int, compression: str) -> List[str]:
    outputs = [p for p in output_file.split(",") if p]
    if len(outputs) == 1 and num_output_shards > 1:
        stem = outputs[0]
        outputs = [f"{stem}-{i:05d}-of-{num_output_shards:05d}" for i in range(num_output_shards)]
    if compression == "gzip":
        outputs = [p if p.endswith(".gz") else p + ".gz" for p in outputs]
    return outputs


def run(opts: Options, *, sources: Sequence[tuple], outputs: Sequence[str], reference_compatible: bool,
        num_workers: int = 1, compression: str = "none", flags_used: Optional[dict] = None) -> dict:
    """Writes the records and dataset_info.json; returns the info dict."""
    import tensorflow as tf
    from tqdm import tqdm

    opts.validate()
    out_dirs = {os.path.dirname(os.path.abspath(p)) for p in outputs}
    if len(out_dirs) != 1:
        raise ValueError("--output_file: all outputs must be in one directory (dataset_info.json goes there)")
    out_dir = out_dirs.pop()
    os.makedirs(out_dir, exist_ok=True)
    options = tf.io.TFRecordOptions(compression_type="GZIP" if compression == "gzip" else "")
    writers = [tf.io.TFRecordWriter(p, options) for p in outputs]
    counts = [0] * len(outputs)
    read_stats, mask_stats = corpora.ReadStats(), inst.MaskStats()
    started = time.time()
    written = 0

    def write(records):
        nonlocal written
        for r in records:
            k = written % len(writers)
            writers[k].write(r)
            counts[k] += 1
            written += 1

    try:
        if reference_compatible:
            if any(s[0] != "text" for s in sources):
                raise ValueError("--reference_compatible reads text files only (--input_format=text)")
            write(reference_records([s[1] for s in sources], opts, read_stats, mask_stats))
        else:
            tasks = list(enumerate(sources))
            bar = tqdm(total=len(tasks), desc="shards", unit="shard", dynamic_ncols=True)
            if num_workers > 1:
                ctx = multiprocessing.get_context("spawn")
                with ctx.Pool(num_workers, initializer=_init_worker, initargs=(opts,)) as pool:
                    for records, rs, ms in pool.imap(shard_records, tasks):
                        write(records)
                        read_stats.add(rs)
                        mask_stats.add(ms)
                        bar.update(1)
                        bar.set_postfix(instances=written, refresh=False)
            else:
                _init_worker(opts)
                for task in tasks:
                    records, rs, ms = shard_records(task)
                    write(records)
                    read_stats.add(rs)
                    mask_stats.add(ms)
                    bar.update(1)
                    bar.set_postfix(instances=written, refresh=False)
            bar.close()
    finally:
        for w in writers:
            w.close()
    seconds = time.time() - started
    info = {
        "flags": flags_used or dataclasses.asdict(opts),
        "random_seed": opts.random_seed,
        "mode": "reference_compatible" if reference_compatible else "fast",
        "vocab_sha256": _sha256(opts.vocab_file),
        "max_seq_length": opts.max_seq_length,
        "max_predictions_per_seq": opts.max_predictions_per_seq,
        "compression": compression,
        "read_stats": dataclasses.asdict(read_stats),
        "mask_stats": mask_stats.summary(),
        "num_instances": written,
        "seconds": seconds,
        "instances_per_second": written / max(seconds, 1e-9),
    }
    schema.write_dataset_info(out_dir, dict(zip(outputs, counts)), info)
    return info


def create_pretraining_data(input_files: Sequence[str], output_dir: str, vocab_file: str, *,
                            num_output_shards: int = 1, reference_compatible: bool = False,
                            num_workers: int = 1, compression: str = "none", **options) -> dict:
    """Library entry point: text files -> `output_dir/part-*.tfrecord` + dataset_info.json."""
    opts = Options(vocab_file=vocab_file, **options)
    ext = ".tfrecord.gz" if compression == "gzip" else ".tfrecord"
    outputs = [os.path.join(output_dir, f"part-{i:05d}-of-{num_output_shards:05d}{ext}")
               for i in range(num_output_shards)]
    return run(opts, sources=[("text", f) for f in expand_inputs(list(input_files))], outputs=outputs,
               reference_compatible=reference_compatible, num_workers=num_workers, compression=compression)


def main(argv):
    del argv
    for name in ("output_file", "vocab_file"):
        if not getattr(FLAGS, name):
            raise app.UsageError(f"--{name} is required")
    opts = Options(
        vocab_file=FLAGS.vocab_file, do_lower_case=FLAGS.do_lower_case,
        do_whole_word_mask=FLAGS.do_whole_word_mask, max_seq_length=FLAGS.max_seq_length,
        max_predictions_per_seq=FLAGS.max_predictions_per_seq, random_seed=FLAGS.random_seed,
        dupe_factor=FLAGS.dupe_factor, masked_lm_prob=FLAGS.masked_lm_prob,
        short_seq_prob=FLAGS.short_seq_prob)
    if FLAGS.input_format == "text":
        if not FLAGS.input_file:
            raise app.UsageError("--input_file is required with --input_format=text")
        sources = [("text", f) for f in expand_inputs(FLAGS.input_file)]
    else:
        if not FLAGS.tfds_name:
            raise app.UsageError("--tfds_name is required with --input_format=tfds")
        n = FLAGS.tfds_num_shards
        sources = [("tfds", FLAGS.tfds_name, FLAGS.tfds_split, FLAGS.tfds_text_key, FLAGS.tfds_data_dir, n)
                   for _ in range(n)]
    outputs = output_paths(FLAGS.output_file, 1 if FLAGS.reference_compatible else FLAGS.num_output_shards,
                           FLAGS.compression)
    used = {name: FLAGS[name].value for name in FLAG_NAMES}
    info = run(opts, sources=sources, outputs=outputs, reference_compatible=FLAGS.reference_compatible,
               num_workers=FLAGS.num_workers, compression=FLAGS.compression, flags_used=used)
    print(json.dumps({k: info[k] for k in ("num_instances", "instances_per_second", "mask_stats")}, indent=2))


if __name__ == "__main__":
    define_flags()
    app.run(main)
