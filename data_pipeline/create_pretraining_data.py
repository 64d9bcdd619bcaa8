"""CLI: text -> pre-masked TFRecords in Google's schema, + the run's manifest (`<name>.dataset_info.json`).

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
  its own random stream (`numpy.random.Generator` seeded with (random_seed, shard)): the shard
  is tokenized once into an id array (`FastTokenizer`) and the reference's algorithm runs on
  spans of it, vectorized (`fast_instances.py`: the same distribution of instances, not the same
  draws); records are encoded by `schema.encode_examples` and framed by `tfrecord.py`, so the
  fast mode never imports TensorFlow (files, local or gs://, go through `storage`). The random
  "next sentence" comes from another document of the same shard. Memory is bounded by a shard,
  not the corpus; for a seed and a shard the output does not depend on the worker count (shards
  are written in input order, round-robin over `--num_output_shards` files).

Chinese whole-word masking (`--do_whole_word_mask --chinese_whole_word_mask`, Cui et al. 2019): a
word segmenter (jieba; `--chinese_user_dict` adds words) decides which characters make a word, and
whole-word masking masks them together; the tokens stay single characters (`chinese_words.py`).
Both modes and the Beam runner; in every other respect Google's whole-word masking.

A HuggingFace tokenizer.json (`--tokenizer_json`, instead of `--vocab_file`; ModernBERT's BPE, ...):
the fast mode encodes with it (`tokenization/hf_tokenizer.py`), its special tokens read from the
file, whole words its pre-tokenizer's; the manifest records the file (`tokenizer`: sha256, size in
ids, special ids). Not with `--reference_compatible` or Chinese whole-word masking.

`--runner=beam` runs the fast mode as an Apache Beam pipeline on any Beam runner
(`--beam_runner`, `--beam_pipeline_options`; `beam_pipeline.py`): the same per-shard function
and file assignment (`shards.py`), so the same files as the local path for the same flags, seed and
inputs.

Outputs: the TFRecords (gzip with `--compression=gzip`) and the run's manifest next to them, named
after the output (`--output_file=data/train.tfrecord` -> `data/train.dataset_info.json`;
`manifests.run_manifest_name`): the flags, seed, vocab sha256, reading and masking statistics, and the
records, bytes and sha256 of each file, which the input pipeline verifies before training. Any
number of runs may write into one folder, in parallel too (Google's "shard the input file and call
the script multiple times": one run per input shard, each with its own `--output_file`); the
trainer reads them through one glob once their manifests agree on how the records were made
(`manifests.py`). A run that would overwrite another run's files is refused before any work
(`shards.check_output_dir_free`).
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import random
import shlex
import sys
import time
from typing import Iterable, Iterator, List, Optional, Sequence

from absl import app, flags

from data_pipeline import storage, tokenization
from data_pipeline.pretraining_data import chinese_words, corpora, instances as inst, shards
from data_pipeline.records import manifests, schema, tfrecord
from data_pipeline.storage import paths as storage_paths
# The per-shard work and its options live in shards.py (the Beam runner shares them).
from data_pipeline.pretraining_data.shards import (Options, ShardTotals, check_output_dir_free, init_worker,
                                                   output_dir, output_index, run_info, shard_records)

FLAGS = flags.FLAGS


FLAG_NAMES = ("input_file", "output_file", "vocab_file", "tokenizer_json", "do_lower_case", "do_whole_word_mask",
              "max_seq_length", "max_predictions_per_seq", "random_seed", "dupe_factor",
              "masked_lm_prob", "short_seq_prob", "reference_compatible", "num_workers",
              "num_output_shards", "compression", "input_format", "tfds_name", "tfds_split",
              "tfds_text_key", "tfds_data_dir", "tfds_num_shards", "chinese_whole_word_mask",
              "chinese_user_dict")


def define_flags():
    flags.DEFINE_string("input_file", None, "Input text file glob(s), comma-separated (Google's format: "
                        "one sentence per line, blank line between documents).")
    flags.DEFINE_string("output_file", None, "Output TFRecord file(s), comma-separated; in fast mode "
                        "with --num_output_shards=N>1 one name, numbered per shard (train.tfrecord -> "
                        "train-00000-of-0000N.tfrecord, ...).")
    flags.DEFINE_string("vocab_file", None, "WordPiece vocab.txt (or --tokenizer_json).")
    flags.DEFINE_string("tokenizer_json", None, "A HuggingFace tokenizer.json (BPE, WordPiece, Unigram; e.g. "
                        "ModernBERT's) instead of --vocab_file: its own normalizer decides casing (no "
                        "--do_lower_case), its special tokens are read from it, whole words are its "
                        "pre-tokenizer's. Fast mode (local or Beam runner). pip install -e '.[hf]'.")
    flags.DEFINE_bool("do_lower_case", True, "Lower-case and strip accents (uncased models).")
    flags.DEFINE_bool("do_whole_word_mask", False, "Mask whole words (all their ## pieces).")
    flags.DEFINE_bool("chinese_whole_word_mask", False, "With --do_whole_word_mask: a Chinese word (jieba's "
                      "segmentation of each line) is masked whole, all its characters together (Cui et al. "
                      "2019); the tokens stay single characters. pip install -e '.[chinese]'.")
    flags.DEFINE_string("chinese_user_dict", None, "With --chinese_whole_word_mask: words the segmenter keeps "
                        "whole, one per line (LTP style) or jieba's 'word [freq] [tag]'.")
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
    flags.DEFINE_enum("runner", "local", ["local", "beam"], "local: --num_workers processes on this machine; "
                      "beam: an Apache Beam pipeline (fast mode; pip install -e '.[beam]'), same records.")
    flags.DEFINE_string("beam_runner", "DirectRunner", "With --runner=beam: the Beam runner by name "
                        "(DirectRunner, DataflowRunner, FlinkRunner, SparkRunner, ...). With the DirectRunner, "
                        "--num_workers>1 runs that many worker processes (direct_running_mode=multi_processing).")
    flags.DEFINE_string("beam_pipeline_options", "", "With --runner=beam: more Beam pipeline options in one "
                        "string, split as a shell would, e.g. \"--project=p --region=us-central1 "
                        "--temp_location=gs://b/tmp --setup_file=./setup.py\".")



WRITE_GROUP = 1024  # --reference_compatible: records per file framed and written at once


def _instance_records(instances: List[inst.TrainingInstance], vocab: dict, opts: Options) -> Iterator[bytes]:
    """Each instance's record, in order. An instance is let go (its slot in `instances` emptied) once
    serialized, so the records never sit in memory beside all the instances they came from."""
    for i in range(len(instances)):
        x, instances[i] = instances[i], None
        ids = [vocab[t] for t in x.tokens]
        feats = schema.pad_features(ids, x.segment_ids, x.masked_lm_positions,
                                    [vocab[t] for t in x.masked_lm_labels], int(x.is_random_next),
                                    opts.max_seq_length, opts.max_predictions_per_seq)
        yield schema.serialize(feats)


# ---------------------------------------------------------------------------------------------
# Reference-compatible mode
# ---------------------------------------------------------------------------------------------


def reference_records(input_files: Sequence[str], opts: Options, read_stats: corpora.ReadStats,
                      mask_stats: inst.MaskStats) -> Iterator[bytes]:
    """The reference's records, in its order (whole corpus in memory, one random stream), made as
    they are consumed."""
    tokenizer = tokenization.FullTokenizer(opts.vocab_file, do_lower_case=opts.do_lower_case)
    tokenize = tokenizer.tokenize
    if opts.chinese_whole_word_mask:
        segmenter = chinese_words.ChineseWordSegmenter(opts.chinese_user_dict)
        tokenize = chinese_words.marking_tokenizer(tokenizer, segmenter)
    all_documents: List[List[List[str]]] = []
    # As the reference: one stream of lines over all files, so a file that does not end with a
    # blank line continues its last document into the next file.
    lines = (line for path in input_files for line in corpora.iter_lines(path, read_stats))
    for doc in corpora.documents_from_lines(lines, read_stats):
        toks = [t for t in (tokenize(s) for s in doc) if t]
        if toks:
            all_documents.append(toks)
            read_stats.one_sentence_documents += len(toks) == 1
        else:
            read_stats.documents_without_tokens += 1
    rng = random.Random(opts.random_seed)
    vocab_words = list(tokenizer.vocab.keys())
    instances = inst.create_training_instances(
        all_documents, vocab_words, max_seq_length=opts.max_seq_length, dupe_factor=opts.dupe_factor,
        short_seq_prob=opts.short_seq_prob, masked_lm_prob=opts.masked_lm_prob,
        max_predictions_per_seq=opts.max_predictions_per_seq, rng=rng,
        do_whole_word_mask=opts.do_whole_word_mask, stats=mask_stats)
    return _instance_records(instances, tokenizer.vocab, opts)


# ---------------------------------------------------------------------------------------------
# Fast mode: one shard per task (`shards.shard_records`), over a local process pool
# ---------------------------------------------------------------------------------------------


def _worker_pool(num_workers: int, opts: Options, num_outputs: int):
    """Worker processes, forked from a warm parent where that is safe, else spawned.

    Forking shares what the parent already loaded (modules, the vocabulary, the tokenizer's
    Unicode tables, half a second to build) instead of rebuilding it in every worker. It is
    not safe once a multithreaded runtime (TensorFlow, or JAX in a notebook or a training
    process calling this library) is loaded in the parent: then workers are spawned and each
    initializes itself. Either way the records are the same.
    """
    threaded = any(m in sys.modules for m in ("tensorflow", "jax", "torch"))
    if sys.platform.startswith("linux") and not threaded:
        init_worker(opts, num_outputs)
        if not opts.tokenizer_json:  # (tokenizers' batch encoding starts a thread pool: not before a fork)
            shards._WORKER["tok"].encode_batch(["\u00e9"])  # builds the Unicode tables, once, before forking
        return multiprocessing.get_context("fork").Pool(num_workers)
    return multiprocessing.get_context("spawn").Pool(num_workers, initializer=init_worker,
                                                      initargs=(opts, num_outputs))


def _bounded_imap(pool, fn, tasks, window: int):
    """`pool.imap(fn, tasks)` with at most `window` tasks submitted and not yet consumed, so
    finished shards never pile up in the parent (Pool.imap has no back-pressure)."""
    pending: collections.deque = collections.deque()
    for task in tasks:
        if len(pending) >= window:
            yield pending.popleft().get()
        pending.append(pool.apply_async(fn, (task,)))
    while pending:
        yield pending.popleft().get()


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def output_paths(output_file: str, num_output_shards: int, compression: str) -> List[str]:
    """The files to write: `--output_file`'s comma-separated list, or with `--num_output_shards`
    N > 1 one name made into N, the shard number before a TFRecord extension
    (`data/train.tfrecord` -> `data/train-00000-of-00016.tfrecord`, ...: what `data/train-*.tfrecord`
    and `data/*.tfrecord` match) or after a name without one (`data/train-00000-of-00016`)."""
    outputs = [p for p in output_file.split(",") if p]
    if len(outputs) == 1 and num_output_shards > 1:
        stem, ext = outputs[0], ""
        for known in (".tfrecords", ".tfrecord", ".tfrec"):
            if stem.endswith(known) and len(storage_paths.basename(stem)) > len(known):
                stem, ext = stem[: -len(known)], known
                break
        outputs = [f"{stem}-{i:05d}-of-{num_output_shards:05d}{ext}" for i in range(num_output_shards)]
    if compression == "gzip":
        outputs = [p if p.endswith(".gz") else p + ".gz" for p in outputs]
    return outputs


def run(opts: Options, *, sources: Sequence[tuple], outputs: Sequence[str], reference_compatible: bool,
        num_workers: int = 1, compression: str = "none", flags_used: Optional[dict] = None) -> dict:
    """Writes the records and the run's manifest; returns the info dict."""
    from tqdm import tqdm

    if reference_compatible and opts.tokenizer_json:
        raise ValueError(f"--tokenizer_json={opts.tokenizer_json}: --reference_compatible is Google's program, "
                         "which reads a WordPiece --vocab_file; the fast mode (the default) reads a tokenizer.json")
    opts.validate()
    out_dir = output_dir(outputs)
    replaced = check_output_dir_free(out_dir, outputs)
    tfrecord.makedirs(out_dir)
    writers = [tfrecord.Writer(p, compression) for p in outputs]
    totals = ShardTotals()
    started = time.time()
    written = 0

    def write_records(records: Iterable[bytes]):
        """Round-robin over the files, record by record (the reference's order), each file's
        records framed and written `WRITE_GROUP` at a time as they come (memory: a group per file)."""
        nonlocal written
        group = WRITE_GROUP
        pending: List[List[bytes]] = [[] for _ in writers]
        for record in records:
            w = written % len(writers)
            pending[w].append(record)
            written += 1
            if len(pending[w]) == group:
                writers[w].write(tfrecord.frame_records(pending[w]), group)
                pending[w] = []
        for w, rest in enumerate(pending):
            if rest:
                writers[w].write(tfrecord.frame_records(rest), len(rest))

    def write_shard(result):
        nonlocal written
        chunks, counts, rs, ms, rss = result
        for b, (chunk, n) in enumerate(zip(chunks, counts)):
            if n:
                writers[output_index(written, b, len(writers))].write(chunk, int(n))
        written += int(sum(counts))
        totals.add(rs, ms, rss)
        bar.update(1)
        bar.set_postfix(instances=written, refresh=False)

    try:
        if reference_compatible:
            if any(s[0] != "text" for s in sources):
                raise ValueError("--reference_compatible reads text files only (--input_format=text)")
            write_records(reference_records([s[1] for s in sources], opts, totals.read_stats, totals.mask_stats))
        else:
            tasks = list(enumerate(sources))
            # Workers start before the progress bar, whose monitor thread a fork should not copy.
            pool = _worker_pool(num_workers, opts, len(writers)) if num_workers > 1 else None
            if pool is None:
                init_worker(opts, len(writers))
            bar = tqdm(total=len(tasks), desc="shards", unit="shard", dynamic_ncols=True)
            try:
                for result in (_bounded_imap(pool, shard_records, tasks, 2 * num_workers) if pool
                               else map(shard_records, tasks)):
                    write_shard(result)
            finally:
                bar.close()
                if pool is not None:
                    pool.terminate()
                    pool.join()
    finally:
        for w in writers:
            w.close()
    info = run_info(opts, totals, num_instances=written, seconds=time.time() - started,
                    mode="reference_compatible" if reference_compatible else "fast", compression=compression,
                    flags_used=flags_used, workers_rss=num_workers > 1 and not reference_compatible)
    manifest = manifests.write_dataset_info(out_dir, {w.path: w.num_records for w in writers}, info)
    for path in replaced:  # an earlier version's manifest of these very files, now described by this run's
        storage.remove(path, missing_ok=True)
    if not written:  # the files and statistics are written: they show what was read
        read = totals.read_stats
        raise ValueError(f"no training instance from {len(sources)} input source(s) ({read.lines} lines, "
                         f"{read.documents} documents, {read.documents_without_tokens} without tokens): "
                         f"empty or blank input? (statistics in {manifest})")
    return info


def create_pretraining_data(input_files: Sequence[str], output_dir: str, vocab_file: Optional[str], *,
                            num_output_shards: int = 1, reference_compatible: bool = False,
                            num_workers: int = 1, compression: str = "none", **options) -> dict:
    """Library entry point: text files -> `output_dir/part-*.tfrecord` + `output_dir/part.dataset_info.json`.

    `vocab_file` None and `tokenizer_json=PATH` in `options`: the ids are a HuggingFace tokenizer.json's."""
    opts = Options(vocab_file=vocab_file, **options)
    ext = ".tfrecord.gz" if compression == "gzip" else ".tfrecord"
    outputs = [storage_paths.join(output_dir, f"part-{i:05d}-of-{num_output_shards:05d}{ext}")
               for i in range(num_output_shards)]
    sources = [("text", f) for f in storage.expand_patterns(list(input_files), "--input_file")]
    return run(opts, sources=sources, outputs=outputs, reference_compatible=reference_compatible,
               num_workers=num_workers, compression=compression)


def tfds_sources(name: str, split: str = "train", text_key: str = "text", data_dir: Optional[str] = None,
                 num_shards: int = 16, *, prepare: bool = True) -> List[tuple]:
    """`run` sources reading a TFDS text dataset in `num_shards` even parts (one per task).

    With `prepare` (the local runner: workers on this machine, sharing its TFDS folder) the
    dataset is downloaded and prepared here, once, if `data_dir` does not hold it yet, and the
    workers only read it. Without (Beam workers on other machines) each worker loads it with
    TFDS's default download, as `tfds.load` does.
    """
    if num_shards < 1:
        raise ValueError(f"--tfds_num_shards={num_shards} must be >= 1")
    if prepare:
        corpora.prepare_tfds(name, data_dir)
    return [("tfds", name, split, text_key, data_dir, num_shards, not prepare) for _ in range(num_shards)]


def main(argv):
    del argv
    if not FLAGS.output_file:
        raise app.UsageError("--output_file is required")
    if bool(FLAGS.vocab_file) == bool(FLAGS.tokenizer_json):
        raise app.UsageError("give one of --vocab_file (a WordPiece vocab.txt) and --tokenizer_json (a HuggingFace "
                             f"tokenizer.json){': not both' if FLAGS.vocab_file else ''}")
    if FLAGS.tokenizer_json:
        if FLAGS["do_lower_case"].present:
            raise app.UsageError(f"--do_lower_case with --tokenizer_json={FLAGS.tokenizer_json}: the file's own "
                                 "normalizer decides casing; drop --do_lower_case")
    if FLAGS.runner == "beam" and FLAGS.reference_compatible:
        raise app.UsageError("--reference_compatible is one random stream over the whole corpus, in one "
                             "process; --runner=beam runs the fast mode only")
    if FLAGS.runner == "local":
        for name in ("beam_runner", "beam_pipeline_options"):
            if FLAGS[name].present:
                raise app.UsageError(f"--{name} needs --runner=beam")
    opts = Options(
        vocab_file=FLAGS.vocab_file, do_lower_case=FLAGS.do_lower_case,
        do_whole_word_mask=FLAGS.do_whole_word_mask, max_seq_length=FLAGS.max_seq_length,
        max_predictions_per_seq=FLAGS.max_predictions_per_seq, random_seed=FLAGS.random_seed,
        dupe_factor=FLAGS.dupe_factor, masked_lm_prob=FLAGS.masked_lm_prob,
        short_seq_prob=FLAGS.short_seq_prob, chinese_whole_word_mask=FLAGS.chinese_whole_word_mask,
        chinese_user_dict=FLAGS.chinese_user_dict, tokenizer_json=FLAGS.tokenizer_json)
    if FLAGS.input_format == "text":
        if not FLAGS.input_file:
            raise app.UsageError("--input_file is required with --input_format=text")
        sources = [("text", f) for f in storage.expand_patterns(FLAGS.input_file, "--input_file")]
    else:
        if not FLAGS.tfds_name:
            raise app.UsageError("--tfds_name is required with --input_format=tfds")
        opts.validate()  # a bad --vocab_file is named before a download, not after
        sources = tfds_sources(FLAGS.tfds_name, FLAGS.tfds_split, FLAGS.tfds_text_key, FLAGS.tfds_data_dir,
                               FLAGS.tfds_num_shards, prepare=FLAGS.runner == "local")
    outputs = output_paths(FLAGS.output_file, 1 if FLAGS.reference_compatible else FLAGS.num_output_shards,
                           FLAGS.compression)
    used = {name: FLAGS[name].value for name in FLAG_NAMES}
    if FLAGS.tokenizer_json:
        used["do_lower_case"] = None  # not used: the tokenizer.json's normalizer decides
    if FLAGS.runner == "beam":
        from data_pipeline.pretraining_data import beam_pipeline  # Beam is an optional extra; only this path needs it

        info = beam_pipeline.run(opts, sources=sources, outputs=outputs, compression=FLAGS.compression,
                                 num_workers=FLAGS.num_workers, beam_runner=FLAGS.beam_runner,
                                 pipeline_args=shlex.split(FLAGS.beam_pipeline_options), flags_used=used)
    else:
        info = run(opts, sources=sources, outputs=outputs, reference_compatible=FLAGS.reference_compatible,
                   num_workers=FLAGS.num_workers, compression=FLAGS.compression, flags_used=used)
    print(json.dumps({k: info[k] for k in ("num_instances", "instances_per_second", "read_stats", "mask_stats")},
                     indent=2))


if __name__ == "__main__":
    define_flags()
    app.run(main)
