"""Apache Beam runner of `create_pretraining_data`'s fast mode (`--runner=beam`).

    python -m data_pipeline.create_pretraining_data --runner=beam --beam_runner=DirectRunner \\
        --input_file='corpus/*.txt' --output_file=out/train.tfrecord --vocab_file=vocab.txt \\
        --num_output_shards=16 [--beam_pipeline_options="--project=... --region=..."]

Any Beam runner by name (DirectRunner, DataflowRunner, FlinkRunner, SparkRunner, ...). Every shard
(an input file, or one of `--tfds_num_shards` slices of a TFDS split) is one element, processed by
the local path's own per-shard function, `shards.shard_records`, with its random stream
`shard_rng(random_seed, shard)`; each output file is then written from the shards' buckets that map
to it (`shards.output_index`), in shard order. So for the same flags, seed and inputs the files are
byte for byte the local path's, whatever the runner or the number of workers, and the run's
manifest (`<output name>.dataset_info.json`, as the local path names it) holds the same fields
(timing and peak RSS aside) plus `runner`.

The pipeline:

    shards  = Create([(shard, source), ...]) | Reshuffle | ParDo(_ProcessShard)
              # shard_records; each non-empty output bucket's framed records go to a temporary file
              # <output dir>/.beam-tmp-<id>/shard-<shard>-bucket-<bucket>; emits a small _ShardDone
    totals  = shards | CombineGlobally(_AddTotals)            # ShardTotals: the statistics
    files   = Create(range(num_output_shards)) | Reshuffle
              | ParDo(_WriteFile, sizes=AsList(shards))       # its buckets, in shard order
    summary = Create([None]) | Map(_write_summary, totals, files, shards)  # a small JSON for the driver

The vocabulary travels inside the shard step (workers elsewhere cannot read the driver's
--vocab_file or --tokenizer_json; nor its --chinese_user_dict, which travels the same way), and one shard at a time
runs per worker process. With --chinese_whole_word_mask the workers need jieba installed too.

Records go from a shard's worker to its file's worker through files, not through a shuffle: no
process holds more than one shard's records (as in the local path), and a retried bundle rewrites
the same bytes (everything is a function of the seed and the shard), so retries are harmless. The
driver reads the summary, writes the run's manifest and deletes the temporary directory.

Counters (namespace "create_pretraining_data", shown by the runner, e.g. Dataflow's job page):
shards, documents, empty_documents, lines_with_bad_utf8, instances, records_written. The
statistics in the run's manifest come from the data itself (the shards' ReadStats/MaskStats added up
by `ShardTotals`), which is exact on every runner; the counters are read back from the pipeline
result where the runner supports it, recorded under `runner.counters` and checked against them.

Files go through `apache_beam.io.filesystems.FileSystems`, so outputs can be on any file system
Beam has (gs:// needs `apache-beam[gcp]`, which the DataflowRunner needs anyway); text inputs
are read as in the local path (`corpora.iter_lines`, through `storage`: local files or gs://).

Apache Beam is an optional extra (`pip install -e '.[beam]'`): this module is the only one that
imports it, and `create_pretraining_data` imports this module only for `--runner=beam`.
This module never imports jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import tempfile
import threading
import time
import uuid
from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple

from absl import logging

try:
    import apache_beam as beam
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.metrics import Metrics
    from apache_beam.metrics.metric import MetricsFilter
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.runner import PipelineState
except ImportError as e:  # the core install does not have Beam
    raise ImportError("--runner=beam needs Apache Beam: pip install -e '.[beam]' "
                      f"(or pip install apache-beam) ({e})") from e

from data_pipeline import storage
from data_pipeline.pretraining_data import corpora, instances as inst
from data_pipeline.records import manifests, tfrecord
from data_pipeline.storage import paths as storage_paths
from data_pipeline.pretraining_data.shards import (Options, ShardTotals, check_output_dir_free, init_worker,
                                                   output_dir, output_index, run_info, shard_records, worker_options)

NAMESPACE = "create_pretraining_data"
COUNTERS = ("shards", "documents", "empty_documents", "lines_with_bad_utf8", "instances", "records_written")
SUMMARY_NAME = "summary.json"


class _ShardDone(NamedTuple):
    """What a processed shard tells the rest of the pipeline (its records are in temporary files)."""

    index: int
    num_records: int
    read_stats: corpora.ReadStats
    mask_stats: inst.MaskStats
    rss_mb: float
    process: Tuple[str, int]  # (host, pid): whether the shard ran outside the driver's process


def _process_id() -> Tuple[str, int]:
    return socket.gethostname(), os.getpid()


def _bucket_path(temp_dir: str, shard: int, bucket: int) -> str:
    return FileSystems.join(temp_dir, f"shard-{shard:07d}-bucket-{bucket:05d}")


def _create(path: str):
    # Explicitly uncompressed: FileSystems would otherwise gzip a path ending in .gz itself, with
    # its own gzip header; the gzip stream is ours (tfrecord.Writer), identical to the local path's.
    return FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED)


def _read(path: str) -> bytes:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


def bucket_size(num_records: int, bucket: int, num_outputs: int) -> int:
    """Records of a shard's bucket: `shard_records` puts its record m in bucket m % num_outputs."""
    return max(0, (num_records - bucket + num_outputs - 1) // num_outputs)


# ---------------------------------------------------------------------------------------------
# The pipeline's steps
# ---------------------------------------------------------------------------------------------


# `shard_records` works on its process's one worker state (`init_worker`), as a pool worker does.
# Runners may run several DoFn threads in one process (Dataflow's Python harness does); the work is
# CPU-bound Python, so two shards at once in one process gain nothing, and one at a time keeps the
# state consistent and the process's memory at one shard.
_SHARD_LOCK = threading.Lock()
_LOADED: Optional[tuple] = None  # (job, the Options this process's worker state was loaded with)


def _load_worker(job: str, opts: Options, num_outputs: int, vocab: bytes, user_dict: Optional[bytes] = None) -> None:
    """`init_worker` from the vocabulary's bytes (and the Chinese user dictionary's), once per
    process and job (call under _SHARD_LOCK).

    Loaded again when something else in the process (the local path, another job in a notebook)
    loaded its own state since.
    """
    global _LOADED
    if _LOADED is not None and _LOADED[0] == job and worker_options() is _LOADED[1]:
        return
    with tempfile.TemporaryDirectory(prefix="bert-vocab-") as tmp:
        field = "tokenizer_json" if opts.tokenizer_json else "vocab_file"  # a tokenizer.json travels the same way
        path = os.path.join(tmp, "tokenizer.json" if opts.tokenizer_json else "vocab.txt")
        storage.write_bytes(path, vocab)
        # Read once, into the tokenizer; shard_records reads no file named in the options.
        worker_opts = dataclasses.replace(opts, **{field: path})
        if user_dict is not None:
            dict_path = os.path.join(tmp, "chinese_user_dict.txt")
            storage.write_bytes(dict_path, user_dict)
            worker_opts = dataclasses.replace(worker_opts, chinese_user_dict=dict_path)
        init_worker(worker_opts, num_outputs)
    _LOADED = (job, worker_opts)


class _ProcessShard(beam.DoFn):
    """One shard: `shards.shard_records`, buckets written to temporary files."""

    def __init__(self, opts: Options, num_outputs: int, temp_dir: str):
        self._opts, self._num_outputs, self._temp_dir = opts, num_outputs, temp_dir
        # The vocabulary travels with the DoFn: workers on other machines cannot read the
        # driver's --vocab_file (dataset_info.json's vocab_sha256 is the driver's file's).
        self._vocab = storage.read_bytes(opts.vocabulary)  # the vocab.txt or the tokenizer.json
        self._user_dict = storage.read_bytes(opts.chinese_user_dict) if opts.chinese_user_dict else None
        self._counters = {name: Metrics.counter(NAMESPACE, name) for name in COUNTERS if name != "records_written"}

    def process(self, task: Tuple[int, tuple]) -> Iterable[_ShardDone]:
        index = task[0]
        with _SHARD_LOCK:
            _load_worker(self._temp_dir, self._opts, self._num_outputs, self._vocab, self._user_dict)
            chunks, counts, read_stats, mask_stats, rss_mb = shard_records(task)
        for bucket, (chunk, n) in enumerate(zip(chunks, counts)):
            if n:
                with _create(_bucket_path(self._temp_dir, index, bucket)) as f:
                    f.write(chunk)
        c = self._counters
        c["shards"].inc()
        c["documents"].inc(read_stats.documents)
        c["empty_documents"].inc(read_stats.empty_documents)
        c["lines_with_bad_utf8"].inc(read_stats.lines_with_bad_utf8)
        c["instances"].inc(mask_stats.instances)
        yield _ShardDone(index, int(sum(counts)), read_stats, mask_stats, rss_mb, _process_id())


class _AddTotals(beam.CombineFn):
    """The shards' statistics added up by the local path's own `ShardTotals`."""

    def create_accumulator(self) -> ShardTotals:
        return ShardTotals()

    def add_input(self, totals: ShardTotals, shard: _ShardDone) -> ShardTotals:
        totals.add(shard.read_stats, shard.mask_stats, shard.rss_mb)
        return totals

    def merge_accumulators(self, accumulators: Iterable[ShardTotals]) -> ShardTotals:
        merged = ShardTotals()
        for t in accumulators:
            merged.add(t.read_stats, t.mask_stats, t.worker_rss_mb)
        return merged

    def extract_output(self, totals: ShardTotals) -> ShardTotals:
        return totals


class _HashingFile:
    """Passes writes through to `file`, hashing and counting them: the manifest's sha256 and size
    without reading the file back (which would mean downloading it again from gs://)."""

    def __init__(self, file):
        self._file = file
        self.sha256 = hashlib.sha256()
        self.num_bytes = 0

    def write(self, data: bytes) -> None:
        self.sha256.update(data)
        self.num_bytes += len(data)
        self._file.write(data)

    def close(self) -> None:
        self._file.close()


class _WriteFile(beam.DoFn):
    """Output file `index`: each shard's bucket that maps to it, in shard order (the local order)."""

    def __init__(self, outputs: Sequence[str], compression: str, temp_dir: str):
        self._outputs, self._compression, self._temp_dir = list(outputs), compression, temp_dir
        self._records_written = Metrics.counter(NAMESPACE, "records_written")

    def process(self, index: int, sizes: List[Tuple[int, int]]) -> Iterable[Tuple[int, dict]]:
        num_outputs = len(self._outputs)
        path = self._outputs[index]
        out = _HashingFile(_create(path))
        writer = tfrecord.Writer(path, self._compression, file=out)
        try:
            before = 0  # records of the shards before this one, all files together
            for shard, num_records in sorted(sizes):
                # The bucket the local driver sends to this file: output_index(before, bucket) == index.
                bucket = (index - before) % num_outputs
                assert output_index(before, bucket, num_outputs) == index
                n = bucket_size(num_records, bucket, num_outputs)
                if n:
                    writer.write(_read(_bucket_path(self._temp_dir, shard, bucket)), n)
                before += num_records
        finally:
            writer.close()
        self._records_written.inc(writer.num_records)
        yield index, manifests.manifest_entry(writer.num_records, out.num_bytes, out.sha256.hexdigest())


def _write_summary(_, path: str, totals: ShardTotals, files: List[Tuple[int, dict]],
                   shards: List[_ShardDone], driver: Tuple[str, int]) -> None:
    summary = {
        "read_stats": dataclasses.asdict(totals.read_stats),
        "mask_stats": dataclasses.asdict(totals.mask_stats),
        "worker_rss_mb": totals.worker_rss_mb,
        "num_instances": sum(s.num_records for s in shards),
        "ran_outside_driver": any(tuple(s.process) != tuple(driver) for s in shards),
        "files": {str(i): entry for i, entry in files},
    }
    with _create(path) as f:
        f.write(json.dumps(summary).encode())


def build(pipeline: "beam.Pipeline", opts: Options, sources: Sequence[tuple], outputs: Sequence[str],
          compression: str, temp_dir: str) -> None:
    """Adds the steps to `pipeline`; its last writes `temp_dir/summary.json` (see the module doc)."""
    num_outputs = len(outputs)
    shards = (pipeline
              | "Shards" >> beam.Create(list(enumerate(sources)))
              # Create is one bundle: without a reshuffle, a runner may process every shard in the
              # worker that read it, one after the other.
              | "SpreadShards" >> beam.Reshuffle()
              | "ProcessShards" >> beam.ParDo(_ProcessShard(opts, num_outputs, temp_dir)))
    totals = shards | "AddTotals" >> beam.CombineGlobally(_AddTotals())
    sizes = shards | "ShardSizes" >> beam.Map(lambda s: (s.index, s.num_records))
    files = (pipeline
             | "OutputFiles" >> beam.Create(list(range(num_outputs)))
             | "SpreadFiles" >> beam.Reshuffle()
             | "WriteFiles" >> beam.ParDo(_WriteFile(outputs, compression, temp_dir),
                                          sizes=beam.pvalue.AsList(sizes)))
    _ = (pipeline
         | "One" >> beam.Create([None])
         | "Summary" >> beam.Map(_write_summary, FileSystems.join(temp_dir, SUMMARY_NAME),
                                 totals=beam.pvalue.AsSingleton(totals), files=beam.pvalue.AsList(files),
                                 shards=beam.pvalue.AsList(shards), driver=_process_id()))


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def is_direct_runner(name: str) -> bool:
    """Beam resolves runner names case-insensitively, with or without "Runner"."""
    return name.lower().removesuffix("runner") == "direct"


def pipeline_options(beam_runner: str, num_workers: int, pipeline_args: Sequence[str] = ()) -> PipelineOptions:
    """Options for `beam_runner`, then `pipeline_args` (which win, coming last).

    With the DirectRunner, `num_workers` > 1 runs that many worker processes
    (`--direct_num_workers`, `--direct_running_mode=multi_processing`); 1 runs the shards in
    this process (`in_memory`). Other runners size themselves from their own options (e.g.
    Dataflow's `--max_num_workers`), passed in `pipeline_args`.
    """
    args = [f"--runner={beam_runner}"]
    if is_direct_runner(beam_runner):
        args += [f"--direct_num_workers={num_workers}",
                 f"--direct_running_mode={'multi_processing' if num_workers > 1 else 'in_memory'}"]
    return PipelineOptions(args + list(pipeline_args))


def counters(result) -> Optional[dict]:
    """The job's counters {name: value} (committed values where the runner has them), or None
    where the runner does not report metrics to the driver."""
    try:
        found = result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))["counters"]
    except (NotImplementedError, AttributeError, KeyError) as e:
        logging.warning("the Beam runner reports no counters (%r); the run's manifest has the statistics", e)
        return None
    out = {name: 0 for name in COUNTERS}
    for m in found:
        value = m.committed if m.committed is not None else m.attempted
        out[m.key.metric.name] = out.get(m.key.metric.name, 0) + int(value or 0)
    return out


def _check_counters(found: dict, info: dict) -> List[str]:
    """Names of counters that differ from the statistics the data carried (none, normally)."""
    want = {"documents": info["read_stats"]["documents"], "empty_documents": info["read_stats"]["empty_documents"],
            "lines_with_bad_utf8": info["read_stats"]["lines_with_bad_utf8"],
            "instances": info["mask_stats"]["instances"], "records_written": info["num_instances"]}
    return [k for k, v in want.items() if found.get(k) != v]


def _check_local_inputs(sources: Sequence[tuple]) -> None:
    # Fails before a job is submitted; remote inputs are checked by the workers that read them.
    for s in sources:
        if s[0] == "text" and not storage_paths.is_remote(s[1]) and not storage.exists(s[1]):
            raise FileNotFoundError(f"input file not found: {s[1]}")


def _delete_temp_dir(path: str) -> None:
    """Deletes the temporary files (flat in `path`) and, where directories exist, `path`."""
    try:
        if "://" not in path:
            storage.rmtree(path)
            return
        found = FileSystems.match([FileSystems.join(path, "*")])[0].metadata_list
        if found:
            FileSystems.delete([m.path for m in found])
    except Exception as e:  # cleanup must not hide the job's own outcome or error
        logging.warning("could not delete the temporary directory %s: %r", path, e)


def run(opts: Options, *, sources: Sequence[tuple], outputs: Sequence[str], compression: str = "none",
        num_workers: int = 1, beam_runner: str = "DirectRunner", pipeline_args: Sequence[str] = (),
        flags_used: Optional[dict] = None) -> dict:
    """`create_pretraining_data.run`'s fast mode as a Beam pipeline; waits for it to finish.

    Args:
      opts: the instance options (seed included).
      sources: `("text", path)` or `tfds_sources(...)` entries, one per shard.
      outputs: the output files, all in one directory (the run's manifest goes there).
      compression: "none" or "gzip".
      num_workers: the DirectRunner's worker processes (see `pipeline_options`).
      beam_runner: a Beam runner name.
      pipeline_args: more Beam pipeline options, e.g. ["--project=p", "--region=us-central1"].
      flags_used: the command line's flags, recorded in the run's manifest.

    Returns:
      The info dict written to the run's manifest (`manifests.run_manifest_name(outputs)`), without the file list.

    Raises:
      FileNotFoundError: naming a local input file that does not exist.
      RuntimeError: when the job ends in a state other than DONE.
    """
    opts.validate()
    if compression not in ("none", "gzip"):
        raise ValueError(f"--compression={compression!r}: 'none' or 'gzip'")
    _check_local_inputs(sources)
    out_dir = output_dir(outputs)
    replaced = check_output_dir_free(out_dir, outputs)
    temp_dir = FileSystems.join(out_dir, f".beam-tmp-{uuid.uuid4().hex}")
    options = pipeline_options(beam_runner, num_workers, pipeline_args)
    started = time.time()
    try:
        pipeline = beam.Pipeline(options=options)
        build(pipeline, opts, sources, outputs, compression, temp_dir)
        result = pipeline.run()
        state = result.wait_until_finish()
        if state != PipelineState.DONE:
            raise RuntimeError(f"--beam_runner={beam_runner}: the job ended {state}, not DONE")
        summary = json.loads(_read(FileSystems.join(temp_dir, SUMMARY_NAME)))
    finally:
        _delete_temp_dir(temp_dir)
    totals = ShardTotals(corpora.ReadStats(**summary["read_stats"]), inst.MaskStats(**summary["mask_stats"]),
                             summary["worker_rss_mb"])
    info = run_info(opts, totals, num_instances=summary["num_instances"], seconds=time.time() - started,
                    mode="fast", compression=compression, flags_used=flags_used,
                    workers_rss=summary["ran_outside_driver"])
    found = counters(result)
    if found is not None:
        wrong = _check_counters(found, info)
        if wrong:
            logging.warning("Beam counters %s differ from the statistics the data carried: %s; the run's "
                            "manifest has the latter", wrong, found)
    info["runner"] = {"name": "beam", "beam_runner": beam_runner, "pipeline_options": list(pipeline_args),
                      "counters": found}
    manifest = {os.path.basename(outputs[int(i)]): entry for i, entry in summary["files"].items()}
    path = FileSystems.join(out_dir, manifests.run_manifest_name(outputs))  # this run's own: parallel runs write others
    with _create(path + ".tmp") as f:
        f.write(manifests.dataset_info_json(manifest, info).encode())
    FileSystems.rename([path + ".tmp"], [path])
    if replaced:  # an earlier version's manifest of these very files
        FileSystems.delete(replaced)
    return info
