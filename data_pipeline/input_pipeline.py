"""tf.data input for pretraining: TFRecords in Google's schema -> host-local numpy batches.

This module owns everything between the TFRecord files written by `create_pretraining_data` and
the numpy batches the training loop hands to `bert_jax.sharding.to_global`:

- **Files.** Comma-separated globs (or a list of them) are expanded, de-duplicated and *sorted*
  (`*.gz` files are read as gzip-compressed TFRecords, as `--compression=gzip` writes them);
  host `process_index` of `process_count` reads files `sorted_files[process_index::process_count]`
  (disjoint, and complete over the hosts). Never `Dataset.list_files`, which shuffles unseeded.
- **Integrity, before training.** With `verify=True` each file is checked against the
  `dataset_info.json` manifest next to it (size, sha256, record count; `schema.py` writes it): a
  missing, empty, truncated, bit-flipped or garbage file raises `CorruptDataError` naming the file.
  With `skip_corrupt=True` exactly the good records of the bad file are read, in place (no copy:
  `scan_tfrecord_file` walks the record framing, checks every CRC and records where each good
  record lies), and the lost records are counted in `stats`. Only this host's files are hashed.
- **Training stream** (`PretrainingInput`): seeded file-order shuffle -> interleave -> seeded
  record shuffle (of the serialized records: small buffers, small checkpoints) -> `repeat` ->
  [packing] -> `batch(per_host_batch_size, drop_remainder=True)` -> parse -> [dynamic masking]
  -> prefetch. Both shuffles sit before `repeat` (reshuffled each epoch), so every record of
  this host's files appears exactly once per epoch and epochs do not mix. Nothing sits between
  the record shuffle and `repeat`: TF 2.21 restores `shuffle -> batch -> repeat` wrongly when
  the iterator was saved at the end of an epoch.
- **Dynamic masking** (`dynamic_mask`): restores the original tokens from
  `masked_lm_positions`/`masked_lm_ids` and re-masks each batch with the reference's rules (see
  below), with stateless random ops seeded from a `Dataset.random` stream after `repeat`: new
  masks every epoch, the same masks for the same seed, and the stream position is saved with the
  iterator. Packed rows are masked sequence by sequence.
- **Packing** (`pack_window`): first-fit-decreasing within windows of `packing_window`
  consecutive records, in the graph (no `py_function`, so the iterator stays checkpointable; the
  per-record loop is XLA-compiled), MLPerf-style. Records of different epochs never share a row.
- **Evaluation** (`make_eval_iterator` -> `EvalInput`): one finite pass, in file order, padded
  so every host yields the same number of batches; padding rows carry weight 0.

Masking rules (google-research/bert `create_pretraining_data.py`):
the number of predictions is `min(max_predictions_per_seq, max(1, round(num_tokens * 0.15)))`,
where `num_tokens` counts the *real* tokens including [CLS] and [SEP] (as the reference's
`len(tokens)` does; `round` is half-to-even in both), further capped by the number of candidates;
candidates are the real tokens other than [CLS], [SEP] and [PAD]; each chosen position becomes
[MASK] with probability 0.8, else keeps its token with probability 0.5, else becomes an id drawn
uniformly from `[0, vocab_size)`. Positions are sorted ascending and padded with position 0,
id 0, weight 0. With whole-word masking (`whole_word_mask`, by default as the records were made:
`--do_whole_word_mask` in their dataset_info.json) the candidates are words instead, as in the
reference: a word is a token and the `##` pieces after it (a boolean table over the vocabulary,
`subword_table`), words are taken in random order while they fit the count (one that would
overflow it is skipped, not split), and the 80/10/10 draw is made for each token.

Batches (numpy, host-local; `B` = per_host_batch_size, `L` = max_seq_length,
`P` = max_predictions_per_seq, `S` = max_seqs_per_pack, `Pp` = max_predictions_per_pack):

  unpacked training and eval batches (Google's names):
    input_ids, input_mask, segment_ids     int32   [B, L]
    masked_lm_positions, masked_lm_ids     int32   [B, P]
    masked_lm_weights                      float32 [B, P]
    next_sentence_labels                   int32   [B, 1]   (Google's shape; 1 = random next)
    next_sentence_weights                  float32 [B]      (1; 0 for eval padding rows)

  packed training batches:
    input_ids, input_mask, segment_ids     int32   [B, L]
    position_ids                           int32   [B, L]   restarts at 0 for each sequence
    pack_ids                               int32   [B, L]   1, 2, ... per sequence, 0 = padding
    cls_positions                          int32   [B, S]   [CLS] index of each sequence (0 = empty)
    next_sentence_labels                   int32   [B, S]
    next_sentence_weights                  float32 [B, S]   1 per sequence, 0 for empty slots
    masked_lm_positions, masked_lm_ids     int32   [B, Pp]  positions in the packed row
    masked_lm_weights                      float32 [B, Pp]

This module imports neither jax nor bert_jax.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import logging
import os
import struct
import tempfile
import zlib
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from data_pipeline import schema

log = logging.getLogger(__name__)

MANIFEST_NAME = schema.MANIFEST_NAME
_STATE_JSON = "input_state.json"
_ITERATOR_PREFIX = "iterator"

FilePatterns = Union[str, Sequence[str]]


_VERIFY_HINT = "set config.verify_data=False (Python API: verify=False)"
# How to go on past bad data, in the error: the training config's field and the Python API's argument.
_SKIP_HINT = "; to train on the intact records set config.skip_corrupt_records=True (Python API: skip_corrupt=True)"


class CorruptDataError(RuntimeError):
    """A data file is missing, unlisted, truncated or corrupt. `path` names the file."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """Token ids dynamic masking needs (read from vocab.txt by the caller)."""

    mask_id: int
    cls_id: int
    sep_id: int
    vocab_size: int
    pad_id: int = 0

    @classmethod
    def from_any(cls, value: Union["SpecialIds", Mapping[str, int]]) -> "SpecialIds":
        if isinstance(value, SpecialIds):
            return value
        keys = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - keys
        missing = {"mask_id", "cls_id", "sep_id", "vocab_size"} - set(value)
        if unknown or missing:
            raise ValueError(f"special_ids: unknown keys {sorted(unknown)}, missing keys "
                             f"{sorted(missing)}; expected {sorted(keys)}")
        return cls(**{k: int(v) for k, v in value.items()})


# ---------------------------------------------------------------------------------------------
# Files and per-host sharding
# ---------------------------------------------------------------------------------------------


def _split_patterns(file_patterns: FilePatterns) -> list[str]:
    items = [file_patterns] if isinstance(file_patterns, str) else list(file_patterns)
    # Google's flags take comma-separated globs; accept that inside each item too.
    patterns = [p.strip() for item in items for p in str(item).split(",") if p.strip()]
    if not patterns:
        raise ValueError("no input file pattern given")
    return patterns


def expand_file_patterns(file_patterns: FilePatterns) -> list[str]:
    """Sorted, de-duplicated files matching the globs. Raises naming a pattern that matches nothing.

    Sorting matters: every host must see the same list before taking its share of it.
    """
    files = set()
    for pattern in _split_patterns(file_patterns):
        matched = tf.io.gfile.glob(pattern)
        if not matched:
            raise FileNotFoundError(f"input file pattern {pattern!r} matches no file")
        files.update(matched)
    return sorted(files)


def is_gzip(path: str) -> bool:
    """Whether a TFRecord file is gzip-compressed: `create_pretraining_data --compression=gzip`
    names its outputs `*.gz`."""
    return str(path).endswith(".gz")


def _compression(path: str) -> str:
    return "GZIP" if is_gzip(path) else ""


def _record_dataset(path) -> tf.data.Dataset:
    """The records of one file (a path tensor, as `interleave` passes it), gzip or not."""
    compression = tf.where(tf.strings.regex_full_match(path, r".*\.gz"), "GZIP", "")
    return tf.data.TFRecordDataset(path, compression_type=compression)


_SCRATCH: list = []  # a TemporaryDirectory, kept alive while the process runs


def _gunzip(path: str) -> tuple[str, Optional[str]]:
    """(a local uncompressed copy of a gzip TFRecord file, what cut its gzip stream short or None).

    Everything that decompresses is kept, so the framing scan can find the good records of a
    truncated or damaged file. The copy lives in a scratch folder removed when the process exits.
    """
    if not _SCRATCH:
        _SCRATCH.append(tempfile.TemporaryDirectory(prefix="bert_jax_gunzip_"))
    out = os.path.join(_SCRATCH[0].name, hashlib.sha1(path.encode()).hexdigest()[:12] + ".tfrecord")
    error = None
    with tf.io.gfile.GFile(path, "rb") as src, open(out, "wb") as dst:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        started = False
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                break
            started = True
            try:
                dst.write(d.decompress(chunk))
                while d.eof and d.unused_data:  # concatenated gzip members
                    rest = d.unused_data
                    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    dst.write(d.decompress(rest))
            except zlib.error as e:
                error = f"gzip data corrupt ({e})"
                break
        if error is None and started and not d.eof:
            error = "gzip stream truncated"
    return out, error


def record_shape(file_patterns: FilePatterns) -> tuple[int, int]:
    """(max_seq_length, max_predictions_per_seq) of the first record the globs match.

    Google-format pretraining records have fixed-length features, so the first record gives the
    shape of all (evaluation at the data's own length, whatever the training phase's is).
    Raises naming the file when it has no record or not the pretraining features.
    """
    files = expand_file_patterns(file_patterns)
    for path in files:
        for raw in tf.data.TFRecordDataset(path, compression_type=_compression(path)).take(1):
            example = tf.train.Example.FromString(raw.numpy()).features.feature
            try:
                return (len(example["input_ids"].int64_list.value),
                        len(example["masked_lm_positions"].int64_list.value))
            except KeyError as e:
                raise ValueError(f"{path}: the first record has no feature {e}; not pretraining "
                                 "records (data_pipeline.create_pretraining_data)") from None
    raise ValueError(f"no record in {', '.join(files)}")


def dataset_info(file_patterns: FilePatterns) -> dict:
    """The `dataset_info.json` beside the first pattern's files that has one ({} if none does):
    the flags the data was made with (casing, lengths, seed), its statistics and manifest."""
    for pattern in _split_patterns(file_patterns):
        path = os.path.join(os.path.dirname(pattern), MANIFEST_NAME)
        if tf.io.gfile.exists(path):
            try:
                with tf.io.gfile.GFile(path, "r") as f:
                    return json.load(f)
            except ValueError as e:  # verify_data names it; the flags are only informative
                logging.warning("%s: unreadable (%r); its flags (casing, vocabulary) are not checked", path, e)
                return {}
    return {}


def shard_files(files: Sequence[str], process_index: int, process_count: int) -> list[str]:
    """This host's files: `sorted(files)[process_index::process_count]`.

    Round-robin over the sorted list: the hosts' sets are disjoint, their union is every file,
    and their sizes differ by at most one file.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, process_count={process_count})")
    return sorted(files)[process_index::process_count]


# ---------------------------------------------------------------------------------------------
# TFRecord framing: scan a file record by record, checking every CRC
# ---------------------------------------------------------------------------------------------
#
# A TFRecord is `uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)`.
# TF's readers stop at the first bad record (and `ignore_errors` drops the rest of the file), and
# a file cut inside a header reads as a clean end of file. To skip *exactly* the bad records we
# walk the framing ourselves: header CRCs in Python (12 bytes each, cheap), data CRCs through TF's
# random-access reader.


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _random_reader(path: str):
    # TF's random-access record reader verifies the data CRC of the record at a given offset.
    # It is not public API (tensorflow.python), hence this one import site.
    from tensorflow.python.lib.io import tf_record
    return tf_record.tf_record_random_reader(path)


@dataclasses.dataclass
class RecordScan:
    """What `scan_tfrecord_file` found in one file."""

    path: str
    size: int
    good_offsets: list  # byte offset of every record whose header and data CRCs check out
    bad_regions: list  # (offset, reason) of every corrupt or truncated stretch
    good_lengths: list = dataclasses.field(default_factory=list)  # payload bytes of each good record

    @property
    def num_good(self) -> int:
        return len(self.good_offsets)

    @property
    def ok(self) -> bool:
        return not self.bad_regions


def scan_tfrecord_file(path: str, max_resync_bytes: int = 64 << 20) -> RecordScan:
    """Walks a TFRecord file's framing and checks every record's CRCs.

    A record whose data CRC fails is one bad region and the walk goes on after it (its header
    gave its length). A header whose CRC fails cannot be trusted for the length, so the walk
    resynchronizes at the next offset (within `max_resync_bytes`) where a valid header is
    followed by a readable record; everything in between is one bad region. A file cut inside a
    header or a payload ends with a bad region.

    A gzip file (`*.gz`) is decompressed into a local scratch copy first (as far as its stream
    allows; a damaged stream is one more bad region); the scan's `path` and offsets are then the
    copy's.

    Args:
      path: the file (local or any `tf.io.gfile` filesystem).
      max_resync_bytes: how far past a corrupt header to look for the next good record.

    Returns:
      A `RecordScan`; `num_good` records are readable, `bad_regions` lists what was not.
    """
    if is_gzip(path):
        raw, gzip_error = _gunzip(path)
        scan = scan_tfrecord_file(raw, max_resync_bytes)  # offsets into the uncompressed copy
        if gzip_error:
            scan.bad_regions.append((scan.size, gzip_error + f" after {scan.size} uncompressed bytes"))
        return scan
    size = tf.io.gfile.stat(path).length
    good, bad, lengths = [], [], []
    reader = _random_reader(path) if size else None
    with tf.io.gfile.GFile(path, "rb") as f:

        def header_at(offset: int) -> Optional[int]:
            """Length of the record at `offset` if its header is valid, else None."""
            if size - offset < 12:
                return None
            f.seek(offset)
            head = f.read(12)
            length, crc = struct.unpack("<QI", head)
            return length if _masked_crc32c(head[:8]) == crc else None

        def readable(offset: int) -> bool:
            try:
                reader.read(offset)
                return True
            except (tf.errors.DataLossError, IndexError, tf.errors.OutOfRangeError):
                return False

        offset = 0
        while offset < size:
            length = header_at(offset)
            if length is None:
                if size - offset < 12:
                    bad.append((offset, f"truncated record header ({size - offset} trailing bytes)"))
                    break
                # Corrupt header: look for the next offset that starts a good record.
                start = offset
                nxt = _resync(f, offset + 1, min(size, offset + max_resync_bytes), size,
                              lambda c: header_at(c) is not None and readable(c))
                bad.append((start, "corrupt record header"))
                if nxt is None:
                    break
                offset = nxt
                continue
            end = offset + 12 + length + 4
            if end > size:
                bad.append((offset, f"truncated record payload (needs {end - size} more bytes)"))
                break
            if readable(offset):
                good.append(offset)
                lengths.append(length)
            else:
                bad.append((offset, "record data CRC mismatch"))
            offset = end
    return RecordScan(path=path, size=size, good_offsets=good, bad_regions=bad, good_lengths=lengths)


def _resync(f, begin: int, end: int, size: int, accept) -> Optional[int]:
    """First offset in [begin, end) whose 8-byte length fits in the file and that `accept`s.

    The length test runs on whole chunks in numpy (one unaligned uint64 view per chunk): random
    bytes almost never look like a length that fits, so `accept` (header CRC, then reading the
    record) runs on a handful of candidates instead of on every byte.
    """
    chunk = 16 << 20
    pos = begin
    while pos < min(end, size - 16):
        f.seek(pos)
        data = f.read(min(chunk, size - pos))
        n = len(data) - 7  # offsets with 8 bytes of length
        if n <= 0:
            return None
        lengths = np.ndarray((n,), dtype="<u8", buffer=data, strides=(1,))  # [n] overlapping
        offsets = pos + np.arange(n, dtype=np.int64)
        fits = lengths <= (size - 16 - offsets).astype(np.uint64)
        for i in np.flatnonzero(fits):
            candidate = int(offsets[i])
            if candidate >= end:
                return None
            if accept(candidate):
                return candidate
        pos += n
    return None


def _count_records_by_framing(path: str) -> int:
    """Record count from the headers alone (no CRC checks): for files without a manifest."""
    if is_gzip(path):
        return _count_records_by_framing(_gunzip(path)[0])
    size = tf.io.gfile.stat(path).length
    count, offset = 0, 0
    with tf.io.gfile.GFile(path, "rb") as f:
        while offset < size:
            if size - offset < 12:
                return count + 1  # a cut header still stands for a (lost) record
            f.seek(offset)
            (length,) = struct.unpack("<Q", f.read(8))
            count += 1
            offset += 16 + length
    return count


_CHUNK_BYTES = 1 << 20  # good records of a damaged file are read in runs of up to this many bytes


@dataclasses.dataclass(frozen=True)
class _GoodRecords:
    """Where the intact records of a damaged file are: read in place, never copied.

    `source` is the file itself (for a gzip file, the uncompressed scratch copy the scan made);
    `records` the (offset, payload length) of each record that passed its CRC checks.
    """

    source: str
    size: int
    records: tuple


def _good_chunks(good: _GoodRecords) -> list[tuple[int, int, list]]:
    """Runs of adjacent good records: (start, end, [(offset within the run, length)]), each run at
    most `_CHUNK_BYTES` long unless one record is longer."""
    chunks: list = []
    for offset, length in good.records:
        end = offset + 16 + length
        if chunks and chunks[-1][1] == offset and end - chunks[-1][0] <= _CHUNK_BYTES:
            chunks[-1][1] = end
        else:
            chunks.append([offset, end, []])
        chunks[-1][2].append((offset + 12 - chunks[-1][0], length))
    return [tuple(c) for c in chunks]


def _file_datasets(files: "_HostFiles"):
    """(a dataset of this host's read units, a function from one unit to its records' dataset).

    Without damaged files the units are the paths and the function `_record_dataset` (the plain
    pipeline). With some (lenient mode), a unit is (path, index): an intact file is read with
    `TFRecordDataset`, a damaged one as runs of its good records (`FixedLengthRecordDataset` over
    each run's byte range, cut into records at the offsets the scan found): nothing is copied.
    """
    paths = files.read_paths
    if not files.good_records:
        return tf.data.Dataset.from_tensor_slices(paths), _record_dataset
    chunk_lo, chunk_hi, sources, starts, nbytes, footers, rec_lo, rec_hi = [], [], [], [], [], [], [], []
    rel, lens = [], []
    for path in paths:
        chunk_lo.append(len(starts))
        good = files.good_records.get(path)
        for start, end, records in (_good_chunks(good) if good else []):
            sources.append(good.source)
            starts.append(start)
            nbytes.append(end - start)
            footers.append(good.size - end)
            rec_lo.append(len(rel))
            rel.extend(r for r, _ in records)
            lens.extend(n for _, n in records)
            rec_hi.append(len(rel))
        chunk_hi.append(len(starts))
    i64 = lambda x: tf.constant(x, tf.int64)
    chunk_lo, chunk_hi, starts, nbytes, footers = map(i64, (chunk_lo, chunk_hi, starts, nbytes, footers))
    rec_lo, rec_hi, rel, lens = map(i64, (rec_lo, rec_hi, rel, lens))
    sources = tf.constant(sources, tf.string)

    def read_chunk(c):
        cut = lambda blob: tf.data.Dataset.from_tensor_slices(tf.strings.substr(
            blob, rel[rec_lo[c]:rec_hi[c]], lens[rec_lo[c]:rec_hi[c]]))  # [records in the run]
        return tf.data.FixedLengthRecordDataset(
            sources[c], nbytes[c], header_bytes=starts[c], footer_bytes=footers[c]).flat_map(cut)

    def read(path, i):
        intact = tf.cast(tf.equal(chunk_lo[i], chunk_hi[i]), tf.int32)  # 1: a plain file
        whole = tf.data.TFRecordDataset(
            tf.reshape(path, [1])[:intact],
            compression_type=tf.where(tf.strings.regex_full_match(path, r".*\.gz"), "GZIP", ""))
        return whole.concatenate(tf.data.Dataset.range(chunk_lo[i], chunk_hi[i]).flat_map(read_chunk))

    units = tf.data.Dataset.from_tensor_slices((paths, tf.range(len(paths), dtype=tf.int64)))
    return units, read


# ---------------------------------------------------------------------------------------------
# The manifest (dataset_info.json, written by schema.py next to the TFRecords)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One file's manifest entry (or, without a manifest, what could be measured)."""

    path: str
    num_records: int
    num_bytes: Optional[int] = None
    sha256: Optional[str] = None


def load_manifest(directory: str) -> Optional[dict[str, FileInfo]]:
    """The manifest of the TFRecords in `directory` keyed by full path, or None if it has none."""
    path = os.path.join(directory, MANIFEST_NAME)
    if not tf.io.gfile.exists(path):
        return None
    entries = _manifest_file_entries(path)
    out = {}
    for name, entry in entries.items():
        full = name if os.path.isabs(name) or "://" in name else os.path.join(directory, name)
        out[full] = FileInfo(path=full, num_records=int(entry["num_records"]),
                             num_bytes=entry.get("num_bytes"), sha256=entry.get("sha256"))
    return out


def _manifest_file_entries(path: str) -> dict[str, dict]:
    """{file name: {num_records, num_bytes, sha256}} of a dataset_info.json (`schema.write_dataset_info`).

    schema.py writes the manifest but has no reader yet; this is the one place that knows its layout.
    """
    try:
        with tf.io.gfile.GFile(path, "r") as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptDataError(path, f"unreadable data manifest ({e!r})") from e
    for name, entry in files.items():
        if not isinstance(entry, dict) or "num_records" not in entry:
            raise CorruptDataError(path, f"manifest entry for {name} has no num_records")
    return files


def _pattern_has_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


@dataclasses.dataclass
class _HostFiles:
    """The result of checking the files before training."""

    all_files: list  # every expected file, sorted (the list hosts shard)
    infos: dict  # path -> FileInfo: from the manifest, or measured
    read_paths: list  # what this host actually reads (its files less the unreadable ones)
    read_counts: list  # records in each read path; None = unverified, not counted yet
    host_files: list  # this host's share of all_files (original names)
    corrupt_files: list  # this host's files that were missing/corrupt (lenient mode)
    skipped_records: int  # records of this host's files that will not be read
    good_records: dict = dataclasses.field(default_factory=dict)  # damaged path -> _GoodRecords

    def count(self, path: str) -> int:
        """Records in one of `all_files`: the manifest's count, else counted from the framing.

        Unverified files are counted only when a count is needed (finite runs, eval, packing,
        `stats`): it costs a pass over the record headers.
        """
        if path not in self.infos:
            self.infos[path] = FileInfo(path, _count_records_by_framing(path))
        return self.infos[path].num_records

    @property
    def read_records(self) -> int:
        """Records this host reads per epoch."""
        for i, n in enumerate(self.read_counts):
            if n is None:
                self.read_counts[i] = self.count(self.read_paths[i])
        return sum(self.read_counts)

    def records_per_host(self, process_count: int) -> list[int]:
        """Expected records of every host's files (the same numbers on every host)."""
        return [sum(self.count(p) for p in shard_files(self.all_files, h, process_count))
                for h in range(process_count)]


def _check_files(file_patterns: FilePatterns, *, process_index: int, process_count: int,
                 verify: bool, skip_corrupt: bool,
                 require_files_per_host: bool) -> _HostFiles:
    """Lists, shards and (with `verify`) checks the files; finds the good records of bad ones
    when lenient."""
    patterns = _split_patterns(file_patterns)
    found, unmatched = set(), []
    for pattern in patterns:
        matched = tf.io.gfile.glob(pattern)
        if not matched:
            unmatched.append(pattern)
        found.update(matched)
    if unmatched and not verify:
        raise CorruptDataError(unmatched[0], "no input file matches this pattern"
                               if _pattern_has_glob(unmatched[0]) else "input file is missing")

    infos: dict[str, FileInfo] = {}
    expected = set(found)
    if verify:
        # Manifests live next to the files: the directories of the files found, and of the
        # patterns whose directory part is literal (so a pattern whose files all vanished is
        # still checked against its manifest).
        directories = {os.path.dirname(p) for p in found}
        directories |= {os.path.dirname(p) for p in patterns if not _pattern_has_glob(os.path.dirname(p))}
        for directory in sorted(directories):
            manifest = load_manifest(directory)
            if manifest is None:
                if not any(os.path.dirname(p) == directory for p in found):  # nothing here at all
                    pattern = next((u for u in unmatched if os.path.dirname(u) == directory), directory)
                    raise CorruptDataError(pattern, "no input file matches this pattern"
                                           if _pattern_has_glob(pattern) else "input file is missing")
                raise CorruptDataError(
                    os.path.join(directory, MANIFEST_NAME),
                    "no data manifest next to the input files (create_pretraining_data writes one); "
                    "to read them unchecked " + _VERIFY_HINT)
            # Every manifest file a pattern names is expected (so a deleted file is noticed).
            for path, info in manifest.items():
                if any(fnmatch.fnmatchcase(path, p) for p in patterns):
                    expected.add(path)
                    infos[path] = info
        unlisted = sorted(p for p in found if p not in infos)
        if unlisted:
            raise CorruptDataError(unlisted[0], f"is not listed in its {MANIFEST_NAME} "
                                   f"({len(unlisted)} unlisted files); to read it anyway " + _VERIFY_HINT)
        for pattern in unmatched:
            if not any(fnmatch.fnmatchcase(p, pattern) for p in expected):
                raise CorruptDataError(pattern, "no input file (on disk or in the manifest) "
                                       "matches this pattern")

    all_files = sorted(expected)
    if require_files_per_host and len(all_files) < process_count:
        raise ValueError(
            f"{len(all_files)} input files for process_count={process_count}: every host needs at "
            f"least one file (files are sharded per host); write more shards")
    mine = shard_files(all_files, process_index, process_count)

    read_paths, read_counts, corrupt, skipped, good_records = [], [], [], 0, {}
    for path in mine:
        info = infos.get(path)
        problem = None
        if path not in found and not tf.io.gfile.exists(path):
            problem = "file is missing"
        elif info is not None:
            size = tf.io.gfile.stat(path).length
            if info.num_bytes is not None and size != int(info.num_bytes):
                problem = f"size {size} bytes, manifest says {info.num_bytes}"
            elif info.sha256 and schema.sha256_file(path) != info.sha256:
                problem = "sha256 differs from the manifest"
        scan = None
        if problem is None and info is None and skip_corrupt:
            # No manifest to compare with: the framing scan is the only check there is.
            scan = scan_tfrecord_file(path)
            if not scan.ok:
                problem = f"{len(scan.bad_regions)} corrupt stretch(es), first: {scan.bad_regions[0]}"
        if problem is None:
            read_paths.append(path)
            if scan is not None:
                infos[path] = FileInfo(path, scan.num_good)
            read_counts.append(infos[path].num_records if path in infos else None)
            continue
        if not skip_corrupt:
            raise CorruptDataError(path, problem + _SKIP_HINT)
        corrupt.append(path)
        if problem == "file is missing":
            lost = infos[path].num_records
            log.warning("skipping %s: %s (%d records)", path, problem, lost)
            skipped += lost
            continue
        scan = scan or scan_tfrecord_file(path)
        expected_records = info.num_records if info is not None else scan.num_good + len(scan.bad_regions)
        if info is None:
            infos[path] = FileInfo(path, expected_records)
        lost = max(expected_records - scan.num_good, 0)
        skipped += lost
        log.warning("%s: %s; reading its %d good records, skipping %d", path, problem,
                    scan.num_good, lost)
        if scan.num_good:
            # Read in place (no copy to clean up): the scan's offsets locate every good record.
            good_records[path] = _GoodRecords(scan.path, scan.size,
                                              tuple(zip(scan.good_offsets, scan.good_lengths)))
            read_paths.append(path)
            read_counts.append(scan.num_good)
    return _HostFiles(all_files=all_files, infos=infos, read_paths=read_paths,
                      read_counts=read_counts, host_files=mine, corrupt_files=corrupt,
                      skipped_records=skipped, good_records=good_records)


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------


def parse_batch(serialized: tf.Tensor, max_seq_length: int, max_predictions_per_seq: int) -> dict:
    """Parses `[N]` serialized tf.Examples into int32/float32 `[N, ...]` tensors (schema names)."""
    parsed = schema.parse_example(serialized, max_seq_length, max_predictions_per_seq)
    out = {}
    for name, value in parsed.items():
        out[name] = tf.cast(value, tf.float32 if value.dtype.is_floating else tf.int32)
    return out


# ---------------------------------------------------------------------------------------------
# Dynamic masking
# ---------------------------------------------------------------------------------------------


def _row_index(x: tf.Tensor) -> tf.Tensor:
    n, m = tf.shape(x)[0], tf.shape(x)[1]
    return tf.broadcast_to(tf.range(n)[:, None], [n, m])  # [N, M]


def restore_original_ids(features: Mapping[str, tf.Tensor]) -> tf.Tensor:
    """`[N, L]` input_ids with every real masked position set back to its original token."""
    ids = features["input_ids"]
    valid = features["masked_lm_weights"] > 0  # [N, P]
    idx = tf.stack([_row_index(valid), features["masked_lm_positions"]], -1)  # [N, P, 2]
    return tf.tensor_scatter_nd_update(ids, tf.boolean_mask(idx, valid),
                                       tf.boolean_mask(features["masked_lm_ids"], valid))


def _num_predictions(num_real: tf.Tensor, num_candidates: tf.Tensor, max_predictions_per_seq: int,
                     masked_lm_prob: float) -> tf.Tensor:
    """The reference's `min(P, max(1, round(len(tokens) * prob)))`, capped by the candidates.

    `tf.round` rounds half to even like Python's `round`; float64 keeps `n * 0.15` identical.
    """
    wanted = tf.round(tf.cast(num_real, tf.float64) * masked_lm_prob)
    wanted = tf.maximum(tf.cast(wanted, tf.int32), 1)
    count = tf.minimum(tf.minimum(wanted, max_predictions_per_seq), num_candidates)
    return tf.where(num_real > 0, count, 0)


def _mask_candidates(original: tf.Tensor, real: tf.Tensor, sp: SpecialIds) -> tf.Tensor:
    return (real & tf.not_equal(original, sp.cls_id) & tf.not_equal(original, sp.sep_id)
            & tf.not_equal(original, sp.pad_id))


def dynamic_predictions_per_sequence(features: Mapping[str, tf.Tensor], *,
                                     special_ids: Union[SpecialIds, Mapping[str, int]],
                                     max_predictions_per_seq: int,
                                     masked_lm_prob: float = 0.15) -> tf.Tensor:
    """`[N]` number of predictions `dynamic_mask` will make for each unpacked record."""
    sp = SpecialIds.from_any(special_ids)
    original = restore_original_ids(features)
    real = features["input_mask"] > 0
    num_real = tf.reduce_sum(tf.cast(real, tf.int32), 1)
    num_candidates = tf.reduce_sum(tf.cast(_mask_candidates(original, real, sp), tf.int32), 1)
    return _num_predictions(num_real, num_candidates, max_predictions_per_seq, masked_lm_prob)


def subword_table(vocab_file: str) -> np.ndarray:
    """`[vocab_size]` bool, True where the token is a WordPiece continuation (`##...`).

    Whole-word masking groups a word's pieces with it: a token whose id is True here belongs to
    the word before it (google-research/bert's `token.startswith("##")`).
    """
    from data_pipeline import tokenization  # data_pipeline's own loader (Google's rules)
    vocab = tokenization.load_vocab(vocab_file)
    table = np.zeros(max(vocab.values()) + 1 if vocab else 0, bool)
    for token, index in vocab.items():
        table[index] = token.startswith("##")
    return table


def recorded_whole_word_mask(file_patterns: FilePatterns) -> Optional[bool]:
    """`do_whole_word_mask` the records were made with, per the dataset_info.json beside each
    pattern's files; None when none records it. Raises when the patterns' data disagree."""
    found = {}
    for pattern in _split_patterns(file_patterns):
        value = dataset_info(pattern).get("flags", {}).get("do_whole_word_mask")
        if isinstance(value, bool):
            found[pattern] = value
    if len(set(found.values())) > 1:
        raise ValueError(f"the input patterns' data disagree on do_whole_word_mask ({found}): set "
                         "whole_word_mask (config.dynamic_whole_word_mask) explicitly")
    return next(iter(found.values()), None)


def _whole_word_choice(original: tf.Tensor, group: tf.Tensor, candidate: tf.Tensor,
                       num_pred: tf.Tensor, num_groups: int, subword: tf.Tensor, seed: tf.Tensor,
                       max_steps: int) -> tf.Tensor:
    """`[N, L]` bool: the tokens whole-word masking picks, Google's `do_whole_word_mask` rules.

    A word is a candidate that is not a `##` piece (or the first candidate of its sequence)
    followed by the `##` candidates after it; as in the reference, a `##` piece right after a
    [SEP] joins the last word before that [SEP]. Words are taken in a uniformly random order
    while they fit the sequence's `num_pred` tokens; a word that would overflow is skipped, not
    split. That greedy pass is run as "take the first word in the order that still fits", once
    per taken word (at most `max_steps` rounds: every word takes at least one token); the words
    it takes are those of the pass, in the same order.
    """
    shape = tf.shape(original)
    n, length = shape[0], shape[1]
    pos = tf.broadcast_to(tf.range(length)[None, :], shape)  # [N, L]
    ids = tf.clip_by_value(original, 0, tf.size(subword) - 1)
    piece = tf.gather(subword, ids) & candidate  # [N, L] a `##` continuation
    before = tf.cumsum(tf.cast(candidate, tf.int32), axis=1, exclusive=True)  # [N, L]
    cand_order = tf.argsort(tf.where(candidate, pos, length + pos), axis=1, stable=True)  # [N, L]
    prev = tf.gather(cand_order, tf.maximum(before - 1, 0), batch_dims=1)  # previous candidate
    same_seq = (before > 0) & tf.equal(tf.gather(group, prev, batch_dims=1), group)
    start = candidate & ~(piece & same_seq)  # [N, L] first piece of a word
    word = tf.cumsum(tf.cast(start, tf.int32), axis=1)  # [N, L] 1-based word number
    start_order = tf.argsort(tf.where(start, pos, length + pos), axis=1, stable=True)  # [N, L]
    word_start = tf.where(candidate, tf.gather(start_order, tf.maximum(word - 1, 0), batch_dims=1),
                          pos)  # [N, L] the position of each candidate's word start
    rows = tf.broadcast_to(tf.range(n)[:, None], shape)  # [N, L]
    word_len = tf.reshape(tf.math.unsorted_segment_sum(
        tf.reshape(tf.cast(candidate, tf.int32), [-1]), tf.reshape(rows * length + word_start, [-1]),
        n * length), shape)  # [N, L] pieces of the word starting here (0 elsewhere)
    # A uniformly random order of the words: unique ranks, word starts first.
    score = tf.where(start, tf.random.stateless_uniform(shape, seed), 2.0)  # [N, L]
    rank = tf.argsort(tf.argsort(score, axis=1, stable=True), axis=1)  # [N, L]
    segment = tf.reshape(rows * (num_groups + 1) + group, [-1])  # [N * L] (row, sequence)
    num_segments = n * (num_groups + 1)

    def per_sequence(x, reduce):  # [N, L] -> [N, G+1]
        return tf.reshape(reduce(tf.reshape(x, [-1]), segment, num_segments), [n, num_groups + 1])

    def step(k, taken, remaining, progressed):
        room = tf.gather(remaining, group, batch_dims=1)  # [N, L]
        eligible = start & ~taken & (word_len <= room)
        best = per_sequence(tf.where(eligible, rank, length), tf.math.unsorted_segment_min)
        pick = eligible & tf.equal(rank, tf.gather(best, group, batch_dims=1))  # [N, L]
        used = per_sequence(tf.where(pick, word_len, 0), tf.math.unsorted_segment_sum)
        return k + 1, taken | pick, remaining - used, tf.reduce_any(pick)

    _, taken, _, _ = tf.while_loop(
        lambda k, taken, remaining, progressed: (k < max_steps) & progressed, step,
        (0, tf.zeros_like(start), num_pred, tf.constant(True)))
    return candidate & tf.gather(taken, word_start, batch_dims=1)


def dynamic_mask(features: Mapping[str, tf.Tensor], seed: tf.Tensor, *,
                 special_ids: Union[SpecialIds, Mapping[str, int]], max_predictions_per_seq: int,
                 masked_lm_prob: float = 0.15, subword: Optional[Any] = None) -> dict:
    """Re-masks a batch of rows with the reference's rules (see module docstring).

    Works on unpacked rows and on packed rows (with `pack_ids`): each packed sequence is masked
    as if it were alone, with its own count and its own `max_predictions_per_seq` cap.

    Args:
      features: `[N, ...]` parsed records or packed rows (`input_ids`, `input_mask`,
        `masked_lm_*`, and `pack_ids` + `cls_positions` when packed).
      seed: `[2]` int seed of the stateless random ops; same seed, same masks.
      special_ids: the [MASK]/[CLS]/[SEP]/[PAD] ids and the vocabulary size.
      max_predictions_per_seq: P, the per-sequence cap.
      masked_lm_prob: fraction of the real tokens to predict.
      subword: `[vocab_size]` bool (`subword_table(vocab.txt)`): given, whole words are masked
        (Google's `--do_whole_word_mask`: a word's `##` pieces with it, words that would
        overflow the count skipped); None masks token by token.

    Returns:
      `features` with new `input_ids`, `masked_lm_positions`, `masked_lm_ids`,
      `masked_lm_weights` (same widths as given; positions ascending, padded with 0).

    Example: a row `[CLS] a b c d e f g h i j k l [SEP] [PAD]...` has 14 real tokens, so
    `round(14 * 0.15) = 2` of `a..l` are chosen; each becomes [MASK] (80%), stays (10%) or
    becomes a random id (10%).
    """
    sp = SpecialIds.from_any(special_ids)
    original = restore_original_ids(features)  # [N, L]
    shape = tf.shape(original)
    length = shape[1]
    width = features["masked_lm_positions"].shape[1]  # P, or the packed width
    if "pack_ids" in features:
        group = features["pack_ids"]  # [N, L] 1..S, 0 = padding
        num_groups = features["cls_positions"].shape[1]
    else:
        group = tf.cast(features["input_mask"] > 0, tf.int32)
        num_groups = 1
    real = group > 0
    candidate = _mask_candidates(original, real, sp)  # [N, L]
    onehot = tf.cast(group[:, :, None] == tf.range(num_groups + 1)[None, None, :], tf.int32)  # [N, L, G+1]
    group_size = tf.reduce_sum(onehot, 1)  # [N, G+1], column 0 = padding
    group_candidates = tf.reduce_sum(onehot * tf.cast(candidate, tf.int32)[:, :, None], 1)
    num_pred = _num_predictions(group_size, group_candidates, max_predictions_per_seq,
                                masked_lm_prob)  # [N, G+1]
    num_pred = tf.concat([tf.zeros_like(num_pred[:, :1]), num_pred[:, 1:]], 1)  # padding: none

    seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 4)
    positions_axis = tf.range(length)[None, :]  # [1, L]
    if subword is not None:
        table = tf.convert_to_tensor(np.asarray(subword, bool)) if not tf.is_tensor(subword) else subword
        chosen_tokens = _whole_word_choice(original, group, candidate, num_pred, num_groups, table,
                                           seeds[0], max_predictions_per_seq)  # [N, L]
        picked = tf.where(chosen_tokens, positions_axis, length)
    elif num_groups == 1:
        # One sequence per row: the `num_pred` lowest uniform scores among the candidates.
        score = tf.where(candidate, tf.random.stateless_uniform(shape, seeds[0]), 2.0)  # [N, L]
        _, lowest = tf.math.top_k(-score, k=min(width, original.shape[1] or width))  # [N, k]
        take = tf.range(tf.shape(lowest)[1])[None, :] < num_pred[:, 1:2]  # [N, k]
        picked = tf.where(take, lowest, length)
    else:
        # Sort tokens by (sequence, score), candidates before the rest of their sequence:
        # within each sequence the candidates come out in a uniformly random order.
        score = tf.random.stateless_uniform(shape, seeds[0], dtype=tf.float64)  # [N, L]
        key = tf.cast(group, tf.float64) + tf.where(candidate, 0.5 * score, 0.75)
        order = tf.argsort(key, axis=1, stable=True)  # [N, L]
        sorted_group = tf.gather(group, order, batch_dims=1)  # [N, L]
        starts = tf.cumsum(group_size, axis=1, exclusive=True)  # [N, G+1] first sorted index
        rank = positions_axis - tf.gather(starts, sorted_group, batch_dims=1)  # [N, L]
        take = rank < tf.gather(num_pred, sorted_group, batch_dims=1)  # [N, L] in sorted order
        picked = tf.where(take, order, length)  # the chosen token positions, else L

    # The chosen positions, ascending, padded with `length` then cut to the width.
    positions = tf.sort(picked, axis=1)
    positions = positions[:, :width]  # [N, W]
    if positions.shape[1] is not None and positions.shape[1] < width:  # fewer tokens than W
        positions = tf.pad(positions, [[0, 0], [0, width - positions.shape[1]]],
                           constant_values=length)
    chosen = positions < length
    positions = tf.where(chosen, positions, 0)
    labels = tf.where(chosen, tf.gather(original, positions, batch_dims=1), 0)  # [N, W]

    pshape = tf.shape(positions)
    r_mask = tf.random.stateless_uniform(pshape, seeds[1])
    r_keep = tf.random.stateless_uniform(pshape, seeds[2])
    random_ids = tf.random.stateless_uniform(pshape, seeds[3], minval=0, maxval=sp.vocab_size,
                                             dtype=tf.int32)
    replacement = tf.where(r_mask < 0.8, sp.mask_id, tf.where(r_keep < 0.5, labels, random_ids))
    idx = tf.stack([_row_index(positions), positions], -1)  # [N, W, 2]
    input_ids = tf.tensor_scatter_nd_update(original, tf.boolean_mask(idx, chosen),
                                            tf.boolean_mask(replacement, chosen))
    return dict(features, input_ids=input_ids, masked_lm_positions=positions,
                masked_lm_ids=labels, masked_lm_weights=tf.cast(chosen, tf.float32))


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def _first_fit_loop(lengths, num_preds, groups, max_seq_length, max_seqs_per_pack,
                    max_predictions_per_pack):
    """Bin, slot, token offset and prediction offset of each sequence (graph-mode loop).

    Sequences are taken longest first; each goes into the first open row of its group with room
    for its tokens, its predictions and one more sequence, else opens a new row. A sequence too
    long to share a row with even the window's shortest one gets a row of its own without
    entering the loop: with Google's data (~90% full-length sequences) that is most of them,
    and the loop (one small step per sequence) is the packer's cost.
    """
    w = tf.shape(lengths)[0]
    alone = (lengths + tf.reduce_min(lengths) > max_seq_length) | (max_seqs_per_pack == 1)
    num_loop = w - tf.reduce_sum(tf.cast(alone, tf.int32))
    # Longest first within each group (the group is the major key); the alone ones last.
    key = groups * (max_seq_length + 1) + (max_seq_length - lengths)
    order = tf.argsort(tf.where(alone, tf.reduce_max(key) + 1, key), stable=True)
    zeros = tf.zeros([w], tf.int32)

    def body(k, fill, count, preds, num_bins, bin_group, bin_of, off_of, slot_of, pred_off_of):
        # tf.gather, not x[i]: XLA wants strided-slice bounds as compile-time constants and would
        # recompile for every window.
        i = tf.gather(order, k)
        n, p, g = tf.gather(lengths, i), tf.gather(num_preds, i), tf.gather(groups, i)
        fits = ((fill + n <= max_seq_length) & (count < max_seqs_per_pack)
                & (preds + p <= max_predictions_per_pack) & (tf.range(w) < num_bins)
                & tf.equal(bin_group, g))
        found = tf.reduce_any(fits)
        b = tf.where(found, tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32), num_bins)
        at_i, at_b = [[i]], [[b]]
        bin_group = tf.tensor_scatter_nd_update(bin_group, at_b, [g])
        bin_of = tf.tensor_scatter_nd_update(bin_of, at_i, [b])
        off_of = tf.tensor_scatter_nd_update(off_of, at_i, [tf.gather(fill, b)])
        slot_of = tf.tensor_scatter_nd_update(slot_of, at_i, [tf.gather(count, b)])
        pred_off_of = tf.tensor_scatter_nd_update(pred_off_of, at_i, [tf.gather(preds, b)])
        fill = tf.tensor_scatter_nd_add(fill, at_b, [n])
        count = tf.tensor_scatter_nd_add(count, at_b, [1])
        preds = tf.tensor_scatter_nd_add(preds, at_b, [p])
        num_bins = num_bins + tf.cast(tf.logical_not(found), tf.int32)
        return k + 1, fill, count, preds, num_bins, bin_group, bin_of, off_of, slot_of, pred_off_of

    out = tf.while_loop(lambda k, *_: k < num_loop, body,
                        (0, zeros, zeros, zeros, 0, zeros, zeros, zeros, zeros, zeros))
    _, _, _, _, num_bins, _, bin_of, off_of, slot_of, pred_off_of = out
    # The alone ones: rows num_bins, num_bins + 1, ... at offset 0, slot 0.
    alone_rank = tf.cumsum(tf.cast(alone, tf.int32), exclusive=True)
    bin_of = tf.where(alone, num_bins + alone_rank, bin_of)
    off_of, slot_of, pred_off_of = (tf.where(alone, 0, x) for x in (off_of, slot_of, pred_off_of))
    return w - num_loop + num_bins, bin_of, off_of, slot_of, pred_off_of


# The loop takes one small step per sequence: as TF ops that is ~45 us a step, compiled by XLA
# ~3 us (15x on the 2-core benchmark machine). One module-level function with tensor arguments,
# so every pipeline of the process shares its compilations (one per window size).
_first_fit_xla = tf.function(
    _first_fit_loop, jit_compile=True,
    input_signature=[tf.TensorSpec([None], tf.int32)] * 3 + [tf.TensorSpec([], tf.int32)] * 3)
_XLA_OK: Optional[bool] = None


def _xla_works() -> bool:
    """Whether XLA can compile the packer here (probed once per process, on a tiny window)."""
    global _XLA_OK
    if _XLA_OK is None:
        try:
            with tf.init_scope():  # run it now, eagerly, even when called while tracing a map fn
                one = tf.constant([3, 2], tf.int32)
                _first_fit_xla(one, one, tf.zeros_like(one), tf.constant(8), tf.constant(2),
                               tf.constant(8))
            _XLA_OK = True
        except Exception as e:  # an XLA-less TensorFlow build: fall back to the graph loop
            log.warning("XLA is unavailable (%s); packing runs as a slower graph loop", e)
            _XLA_OK = False
    return _XLA_OK


def _first_fit_decreasing(lengths, num_preds, groups, max_seq_length, max_seqs_per_pack,
                          max_predictions_per_pack):
    """`_first_fit_loop`, XLA-compiled when available (identical results either way)."""
    args = (lengths, num_preds, groups, tf.constant(max_seq_length, tf.int32),
            tf.constant(max_seqs_per_pack, tf.int32), tf.constant(max_predictions_per_pack, tf.int32))
    return (_first_fit_xla if _xla_works() else _first_fit_loop)(*args)


def pack_window(features: Mapping[str, tf.Tensor], *, max_seq_length: int, max_seqs_per_pack: int,
                max_predictions_per_pack: int,
                prediction_budget: Optional[tf.Tensor] = None,
                groups: Optional[tf.Tensor] = None) -> dict:
    """Packs a window of `[W, ...]` parsed records into `[R, ...]` rows, R <= W.

    Records must have their real tokens first (Google's layout: `input_mask` is 1 then 0).
    Rows come out in the order of their earliest record in the window, so a shuffled input
    stays shuffled.

    Args:
      features: parsed records (see `parse_batch`), after dynamic masking if any.
      max_seq_length: L, the row length.
      max_seqs_per_pack: S, sequences per row at most.
      max_predictions_per_pack: Pp, masked-LM predictions per row at most (>= P).
      prediction_budget: `[W]` predictions to reserve per record (default: its stored ones);
        dynamic masking passes what it will need, so re-masked rows fit Pp too.
      groups: `[W]` int group of each record (the pipeline passes the epoch): records of
        different groups never share a row.

    Returns:
      The packed-batch dict of the module docstring, with a leading dimension R.

    Example (L=8, S=3): records `[CLS] a [SEP]` (3 tokens, label 0) and `[CLS] b c [SEP]`
    (4 tokens, label 1) become one row `[CLS] b c [SEP] [CLS] a [SEP] [PAD]` with
    position_ids `0 1 2 3 0 1 2 0`, pack_ids `1 1 1 1 2 2 2 0`, cls_positions `[0, 4, 0]`,
    next_sentence_labels `[1, 0, 0]` and next_sentence_weights `[1, 1, 0]`.
    """
    L, S, Pp = max_seq_length, max_seqs_per_pack, max_predictions_per_pack
    mask = features["input_mask"]  # [W, L]
    lengths = tf.reduce_sum(mask, 1)  # [W]
    mlm_valid = features["masked_lm_weights"] > 0  # [W, P]
    num_preds = tf.reduce_sum(tf.cast(mlm_valid, tf.int32), 1)  # [W]
    budget = num_preds if prediction_budget is None else tf.maximum(num_preds, prediction_budget)
    if groups is None:
        groups = tf.zeros_like(lengths)
    num_bins, bin_of, off_of, slot_of, pred_off_of = _first_fit_decreasing(
        lengths, budget, tf.cast(groups, tf.int32), L, S, Pp)

    # Row order: by each row's earliest record in the (shuffled) window. This also keeps groups
    # in stream order, since a window holds the end of one epoch before the start of the next.
    first = tf.math.unsorted_segment_min(tf.range(tf.shape(bin_of)[0]), bin_of, num_bins)  # [R]
    new_row = tf.scatter_nd(tf.argsort(first)[:, None], tf.range(num_bins), [num_bins])  # [R]
    bin_of = tf.gather(new_row, bin_of)  # [W]

    # Tokens: record i's token t goes to (bin_of[i], off_of[i] + t). The five per-token fields
    # travel together as one [W, L, 5] tensor: one gather and one scatter instead of five.
    tok = mask > 0  # [W, L]
    t = tf.broadcast_to(tf.range(L)[None, :], tf.shape(mask))  # [W, L]
    rows = tf.broadcast_to(bin_of[:, None], tf.shape(mask))  # [W, L]
    tok_idx = tf.boolean_mask(tf.stack([rows, off_of[:, None] + t], -1), tok)  # [T, 2]
    fields = tf.stack([features["input_ids"], tf.ones_like(mask), features["segment_ids"], t,
                       tf.broadcast_to(slot_of[:, None] + 1, tf.shape(mask))], -1)  # [W, L, 5]
    tokens = tf.scatter_nd(tok_idx, tf.boolean_mask(fields, tok), tf.stack([num_bins, L, 5]))
    out = {name: tokens[:, :, j] for j, name in enumerate(
        ("input_ids", "input_mask", "segment_ids", "position_ids", "pack_ids"))}  # [R, L] each

    # Per-sequence slots: (bin_of[i], slot_of[i]).
    seq_idx = tf.stack([bin_of, slot_of], -1)  # [W, 2]
    seq = tf.scatter_nd(seq_idx, tf.stack([off_of, features["next_sentence_labels"][:, 0],
                                           tf.ones_like(off_of)], -1),
                        tf.stack([num_bins, S, 3]))  # [R, S, 3]
    out["cls_positions"] = seq[:, :, 0]
    out["next_sentence_labels"] = seq[:, :, 1]
    out["next_sentence_weights"] = tf.cast(seq[:, :, 2], tf.float32)

    # Predictions: record i's j-th real prediction goes to (bin_of[i], pred_off_of[i] + j).
    rank = tf.cumsum(tf.cast(mlm_valid, tf.int32), axis=1) - 1  # [W, P]
    prow = tf.broadcast_to(bin_of[:, None], tf.shape(rank))
    pred_idx = tf.boolean_mask(tf.stack([prow, pred_off_of[:, None] + rank], -1), mlm_valid)
    pred_fields = tf.stack([features["masked_lm_positions"] + off_of[:, None],
                            features["masked_lm_ids"], tf.ones_like(rank)], -1)  # [W, P, 3]
    preds = tf.scatter_nd(pred_idx, tf.boolean_mask(pred_fields, mlm_valid),
                          tf.stack([num_bins, Pp, 3]))  # [R, Pp, 3]
    out["masked_lm_positions"] = preds[:, :, 0]
    out["masked_lm_ids"] = preds[:, :, 1]
    out["masked_lm_weights"] = tf.cast(preds[:, :, 2], tf.float32)
    return out


# ---------------------------------------------------------------------------------------------
# Training input
# ---------------------------------------------------------------------------------------------


def _next_batch(iterator, files: _HostFiles, patterns: list, max_seq_length: int,
                max_predictions_per_seq: int) -> dict:
    """`next(iterator)` as numpy, with TF's anonymous read errors turned into named ones."""
    try:
        return _to_numpy(next(iterator))
    except tf.errors.DataLossError as e:
        # TF does not say which file: find it (the first of this host's files that fails a scan).
        for path in (p for p in files.read_paths if p not in files.good_records):
            scan = scan_tfrecord_file(path)
            if not scan.ok:
                offset, reason = scan.bad_regions[0]
                raise CorruptDataError(path, f"{reason} at byte {offset} (found while reading)" + _SKIP_HINT) from e
        raise CorruptDataError(",".join(patterns), f"data loss while reading: {e.message}") from e
    except tf.errors.InvalidArgumentError as e:
        raise ValueError(
            f"records in {patterns} do not parse with max_seq_length={max_seq_length}, "
            f"max_predictions_per_seq={max_predictions_per_seq}: {e.message}") from e


def _mix(*values: int) -> int:
    """A 63-bit hash of ints (splitmix64 steps): independent seeds per host and per use."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & 0x7FFFFFFFFFFFFFFF


def _options() -> tf.data.Options:
    options = tf.data.Options()
    options.deterministic = True
    return options


def _graph_fn(fn):
    # Our map functions are plain TF ops (explicit tf.while_loop): skipping autograph's source
    # conversion makes building a pipeline several times faster.
    return tf.autograph.experimental.do_not_convert(fn)


def _to_numpy(batch: dict) -> dict:
    return {k: v.numpy() for k, v in batch.items()}


class PretrainingInput:
    """The pretraining batch iterator of one host.

    `next(ds)` gives a dict of numpy arrays (module docstring lists keys, shapes, dtypes). With
    `repeat=True` the stream is endless; with `repeat=False` it is one epoch, cut so that every
    host yields the same number of batches (`num_batches`).

    Example:
      ds = PretrainingInput("gs://bucket/data/train-*.tfrecord", per_host_batch_size=32,
                            max_seq_length=128, max_predictions_per_seq=20, seed=0,
                            process_index=jax.process_index(), process_count=jax.process_count())
      batch = next(ds)
      ds.save_state(workdir + "/input_state/1000/process_0")   # with the model checkpoint
    """

    def __init__(
        self,
        file_patterns: FilePatterns,
        *,
        per_host_batch_size: int,
        max_seq_length: int,
        max_predictions_per_seq: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        shuffle_buffer_size: int = 10_000,
        repeat: bool = True,
        dynamic_masking: bool = False,
        special_ids: Optional[Union[SpecialIds, Mapping[str, int]]] = None,
        masked_lm_prob: float = 0.15,
        whole_word_mask: Optional[bool] = None,
        subword: Optional[Sequence[bool]] = None,
        packing: bool = False,
        max_seqs_per_pack: int = 3,
        max_predictions_per_pack: Optional[int] = None,
        packing_window: int = 512,
        verify: bool = True,
        skip_corrupt: bool = False,
        cycle_length: int = 8,
    ):
        """Checks the files (see module docstring) and builds the tf.data pipeline.

        Args:
          file_patterns: glob, comma-separated globs, or a list of them.
          per_host_batch_size: rows per batch on this host (global batch / process_count).
          max_seq_length: L of the records (and of packed rows).
          max_predictions_per_seq: P of the records.
          seed: seeds every shuffle and mask; the same seed gives the same batches.
          process_index, process_count: this host and the number of hosts (jax.process_*).
          shuffle_buffer_size: serialized records held for the record-level shuffle (per host).
          repeat: endless epochs (True) or one epoch (False).
          dynamic_masking: re-mask every record each epoch instead of using its stored mask.
          special_ids: `SpecialIds` or a dict with mask_id, cls_id, sep_id, vocab_size[, pad_id];
            required by dynamic masking.
          masked_lm_prob: fraction of tokens dynamic masking predicts.
          whole_word_mask: dynamic masking masks whole words (Google's `--do_whole_word_mask`);
            None = as the records were made (their dataset_info.json flags; token by token when
            not recorded). Needs `subword`.
          subword: `[vocab_size]` bool, True for `##` tokens (`subword_table(vocab.txt)`).
          packing: pack several records per row (packed-batch keys of the module docstring).
          max_seqs_per_pack: S, sequences per packed row at most.
          max_predictions_per_pack: Pp, the packed masked_lm width; default P * S.
          packing_window: records the packer sees at once (larger packs tighter, costs memory).
          verify: check every file against its dataset_info.json before reading.
          skip_corrupt: skip (and count in `stats`) bad records and files instead of raising;
            the good records of a damaged file are read in place (nothing is copied).
          cycle_length: files read concurrently (interleave).

        Raises:
          CorruptDataError: a file is missing, unlisted, or fails the manifest check (strict).
          ValueError: an inconsistent option (named in the message).
        """
        if per_host_batch_size <= 0:
            raise ValueError(f"per_host_batch_size={per_host_batch_size} must be positive")
        if not 0 < max_predictions_per_seq <= max_seq_length:
            raise ValueError(f"max_predictions_per_seq={max_predictions_per_seq} must be in "
                             f"[1, max_seq_length={max_seq_length}]")
        if dynamic_masking and special_ids is None:
            raise ValueError("dynamic_masking=True needs special_ids (mask_id, cls_id, sep_id, "
                             "vocab_size; read them from vocab.txt)")
        whole_word_mask = self._resolve_whole_word_mask(file_patterns, dynamic_masking,
                                                        whole_word_mask)
        if whole_word_mask:
            if subword is None:
                raise ValueError("whole-word dynamic masking needs subword (which ids are ## "
                                 "pieces: input_pipeline.subword_table(vocab.txt))")
            subword = np.asarray(subword, bool)
            if subword.ndim != 1 or len(subword) < SpecialIds.from_any(special_ids).vocab_size:
                raise ValueError(f"subword has shape {subword.shape}: one bool per vocabulary id "
                                 f"expected (vocab_size={SpecialIds.from_any(special_ids).vocab_size})")
        if packing:
            if max_seqs_per_pack < 1:
                raise ValueError(f"max_seqs_per_pack={max_seqs_per_pack} must be >= 1")
            if max_predictions_per_pack is None:
                max_predictions_per_pack = max_predictions_per_seq * max_seqs_per_pack
            if max_predictions_per_pack < max_predictions_per_seq:
                raise ValueError(f"max_predictions_per_pack={max_predictions_per_pack} must be >= "
                                 f"max_predictions_per_seq={max_predictions_per_seq}")
            if packing_window < 1:
                raise ValueError(f"packing_window={packing_window} must be >= 1")
        self.per_host_batch_size = per_host_batch_size
        self.max_seq_length = max_seq_length
        self.max_predictions_per_seq = max_predictions_per_seq
        self.seed = int(seed)
        self.process_index, self.process_count = process_index, process_count
        self.shuffle_buffer_size = shuffle_buffer_size
        self.repeat = repeat
        self.dynamic_masking = dynamic_masking
        self.special_ids = SpecialIds.from_any(special_ids) if special_ids is not None else None
        self.masked_lm_prob = masked_lm_prob
        self.whole_word_mask = whole_word_mask
        self._subword = subword if whole_word_mask else None
        self.packing = packing
        self.max_seqs_per_pack = max_seqs_per_pack
        self.max_predictions_per_pack = max_predictions_per_pack
        self.packing_window = packing_window
        self.cycle_length = cycle_length
        self._patterns = _split_patterns(file_patterns)

        self._files = _check_files(file_patterns, process_index=process_index,
                                   process_count=process_count, verify=verify,
                                   skip_corrupt=skip_corrupt, require_files_per_host=True)
        if not self._files.read_paths:
            raise CorruptDataError(self._patterns[0], f"host {process_index} has no readable file "
                                   f"left ({len(self._files.corrupt_files)} corrupt or missing)")
        if self._files.read_records == 0:  # (an endless repeat of nothing would end at once)
            raise CorruptDataError(self._patterns[0], f"host {process_index}'s files hold no record")
        self.num_batches = self._finite_num_batches() if not repeat else None
        self._counters = {"batches": 0, "sequences": 0}  # saved and restored with the position
        self.dataset = self._build()
        self._iterator = iter(self.dataset)

    # --- pipeline --------------------------------------------------------------------------

    @staticmethod
    def _resolve_whole_word_mask(file_patterns: FilePatterns, dynamic_masking: bool,
                                 asked: Optional[bool]) -> bool:
        """Whether dynamic masking masks whole words: as asked, else as the records were made."""
        if not dynamic_masking:
            if asked:
                raise ValueError("whole_word_mask=True needs dynamic_masking=True (without it the "
                                 "records' own masks are used, as they were written)")
            return False
        recorded = recorded_whole_word_mask(file_patterns)
        if asked is None:
            if recorded:
                log.info("the records were made with do_whole_word_mask=True: dynamic masking "
                         "masks whole words too (whole_word_mask=False to mask token by token)")
            return bool(recorded)
        if recorded is not None and recorded != asked:
            log.warning("dynamic masking with whole_word_mask=%s although the records were made "
                        "with do_whole_word_mask=%s", asked, recorded)
        return bool(asked)

    def _finite_num_batches(self) -> int:
        """Batches every host can yield in one epoch (the minimum over hosts)."""
        per_host = self._files.records_per_host(self.process_count)
        per_host[self.process_index] = self._files.read_records
        if self.packing:
            # Packed row counts depend on the data; each host has at least ceil(n / S) rows.
            per_host = [-(-n // self.max_seqs_per_pack) for n in per_host]
        return min(per_host) // self.per_host_batch_size

    def _build(self) -> tf.data.Dataset:
        seed, host = self.seed, self.process_index
        paths = self._files.read_paths
        units, read = _file_datasets(self._files)
        files = units.shuffle(len(paths), seed=_mix(seed, host, 1), reshuffle_each_iteration=True)
        records = files.interleave(
            read, cycle_length=min(self.cycle_length, len(paths)),
            block_length=1, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if self.shuffle_buffer_size > 1:
            records = records.shuffle(self.shuffle_buffer_size, seed=_mix(seed, host, 2),
                                      reshuffle_each_iteration=True)
        L, P = self.max_seq_length, self.max_predictions_per_seq

        # Nothing may sit between the reshuffling `shuffle` and `repeat`: in TF 2.21 an iterator
        # saved while e.g. a `batch` there has drained the epoch restores with the wrong next
        # permutation (seen at some cut points only). So packing windows are cut after `repeat`.
        ds = records.repeat() if self.repeat else records
        if self.packing:
            per_epoch = self._files.read_records

            def pack(index, serialized):
                features = parse_batch(serialized, L, P)
                budget = None
                if self.dynamic_masking:
                    budget = dynamic_predictions_per_sequence(
                        features, special_ids=self.special_ids, max_predictions_per_seq=P,
                        masked_lm_prob=self.masked_lm_prob)
                return pack_window(features, max_seq_length=L,
                                   max_seqs_per_pack=self.max_seqs_per_pack,
                                   max_predictions_per_pack=self.max_predictions_per_pack,
                                   prediction_budget=budget,
                                   groups=index // per_epoch)  # the epoch: never mixed in a row

            ds = ds.enumerate().batch(self.packing_window).map(
                _graph_fn(pack), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
            ds = ds.batch(self.per_host_batch_size, drop_remainder=True)
        else:
            ds = ds.batch(self.per_host_batch_size, drop_remainder=True).map(
                _graph_fn(lambda serialized: dict(
                    parse_batch(serialized, L, P),
                    next_sentence_weights=tf.ones([tf.shape(serialized)[0]], tf.float32))),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if self.dynamic_masking:
            # Masks are drawn per batch from a random stream *after* `repeat`: it runs on across
            # epochs (so every epoch gets new masks) and its position is saved with the iterator.
            # (`Dataset.random(rerandomize_each_iteration=True)` before `repeat` would be simpler,
            # but TF 2.21 does not restore its per-epoch reseeding from a checkpoint.)
            salt = tf.constant(_mix(seed, host, 4), tf.int64)
            subword = None if self._subword is None else tf.constant(self._subword)

            def remask(features, rand):
                return dynamic_mask(features, tf.stack([rand, salt]), special_ids=self.special_ids,
                                    max_predictions_per_seq=P, masked_lm_prob=self.masked_lm_prob,
                                    subword=subword)

            ds = tf.data.Dataset.zip(ds, tf.data.Dataset.random(seed=_mix(seed, host, 3)))
            ds = ds.map(_graph_fn(remask), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if self.num_batches is not None:
            ds = ds.take(self.num_batches)
        return ds.prefetch(2).with_options(_options())

    # --- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> "PretrainingInput":
        return self

    def __next__(self) -> dict:
        try:
            out = _next_batch(self._iterator, self._files, self._patterns, self.max_seq_length,
                              self.max_predictions_per_seq)
        except StopIteration:
            if self.num_batches is not None and self._counters["batches"] < self.num_batches:
                raise RuntimeError(
                    f"host {self.process_index} ran out of data after {self._counters['batches']} "
                    f"of {self.num_batches} batches ({self._files.skipped_records} corrupt "
                    f"records skipped): the hosts would disagree on the number of steps")
            raise
        self._counters["batches"] += 1
        self._counters["sequences"] += int(out["next_sentence_weights"].sum())
        return out

    @property
    def stats(self) -> dict:
        """This host's numbers.

        files: files assigned to this host; records_in_files: records they should hold (manifest;
        counted from the framing when unverified); corrupt_files: those missing or corrupt
        (lenient mode); skipped_records: records that will not be read; records_per_epoch: records
        read per epoch; batches, sequences: yielded so far (restored with the position).
        """
        files = self._files
        return {"files": len(files.host_files),
                "records_in_files": sum(files.count(p) for p in files.host_files),
                "corrupt_files": list(files.corrupt_files),
                "skipped_records": files.skipped_records,
                "records_per_epoch": files.read_records,
                **self._counters}

    @property
    def host_files(self) -> list[str]:
        """This host's share of the sorted file list (original names)."""
        return list(self._files.host_files)

    # --- state -------------------------------------------------------------------------------

    def _fingerprint(self) -> dict:
        # The files' manifest sha256s too: a rewritten dataset under the same names must not
        # resume as if nothing happened (None per file when unverified).
        digests = [getattr(self._files.infos.get(p), "sha256", None) for p in self._files.host_files]
        return {
            "host_files": self._files.host_files,
            "host_files_sha256": hashlib.sha256(json.dumps(digests).encode()).hexdigest(),
            "process_index": self.process_index, "process_count": self.process_count,
            "per_host_batch_size": self.per_host_batch_size,
            "max_seq_length": self.max_seq_length,
            "max_predictions_per_seq": self.max_predictions_per_seq,
            "seed": self.seed, "shuffle_buffer_size": self.shuffle_buffer_size,
            "repeat": self.repeat, "dynamic_masking": self.dynamic_masking,
            "special_ids": dataclasses.asdict(self.special_ids) if self.special_ids else None,
            "masked_lm_prob": self.masked_lm_prob, "packing": self.packing,
            # Only when on: states saved before the option existed still resume.
            **({"whole_word_mask": True} if self.whole_word_mask else {}),
            "max_seqs_per_pack": self.max_seqs_per_pack if self.packing else None,
            "max_predictions_per_pack": self.max_predictions_per_pack,
            "packing_window": self.packing_window if self.packing else None,
            "cycle_length": self.cycle_length,
            "skipped_records": self._files.skipped_records,
        }

    def save_state(self, directory: str) -> None:
        """Writes the input position into `directory` (created if needed).

        `directory/iterator.*` is a `tf.train.Checkpoint` of the iterator (shuffle buffer,
        file offsets, random streams: it grows with shuffle_buffer_size), and
        `directory/input_state.json` the options it belongs to and the counters.
        """
        tf.io.gfile.makedirs(directory)
        tf.train.Checkpoint(iterator=self._iterator).write(os.path.join(directory, _ITERATOR_PREFIX))
        state = {"fingerprint": self._fingerprint(), "counters": self._counters}
        with tf.io.gfile.GFile(os.path.join(directory, _STATE_JSON), "w") as f:
            json.dump(state, f, indent=1)

    def restore_state(self, directory: str) -> None:
        """Continues from a position written by `save_state` with the same options.

        Raises:
          FileNotFoundError: `directory` holds no saved input state.
          ValueError: the state was saved with different options (the differing ones named).
        """
        state_path = os.path.join(directory, _STATE_JSON)
        if not tf.io.gfile.exists(state_path):
            raise FileNotFoundError(f"{state_path}: no saved input state")
        with tf.io.gfile.GFile(state_path, "r") as f:
            state = json.load(f)
        saved, now = state["fingerprint"], json.loads(json.dumps(self._fingerprint()))
        diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if diff:
            detail = "; ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in diff[:4])
            raise ValueError(f"{state_path} was saved by an input pipeline with other options "
                             f"({detail})")
        status = tf.train.Checkpoint(iterator=self._iterator).read(
            os.path.join(directory, _ITERATOR_PREFIX))
        status.assert_consumed()
        self._counters = dict(state["counters"])


# ---------------------------------------------------------------------------------------------
# Evaluation input
# ---------------------------------------------------------------------------------------------


class EvalInput:
    """One finite pass over eval records, padded so every host yields `len(self)` batches.

    Iterating gives unpacked batches (module docstring) in file order with the records' own
    masks; padding rows are all zeros, with `masked_lm_weights` and `next_sentence_weights` 0.
    Each `iter()` starts a fresh pass.
    """

    def __init__(self, file_patterns: FilePatterns, *, per_host_batch_size: int,
                 max_seq_length: int, max_predictions_per_seq: int, process_index: int = 0,
                 process_count: int = 1, verify: bool = True, skip_corrupt: bool = False):
        if per_host_batch_size <= 0:
            raise ValueError(f"per_host_batch_size={per_host_batch_size} must be positive")
        self.per_host_batch_size = per_host_batch_size
        self.max_seq_length, self.max_predictions_per_seq = max_seq_length, max_predictions_per_seq
        self._patterns = _split_patterns(file_patterns)
        # Eval may have fewer files than hosts: a host without files yields padding only.
        self._files = _check_files(file_patterns, process_index=process_index,
                                   process_count=process_count, verify=verify,
                                   skip_corrupt=skip_corrupt, require_files_per_host=False)
        per_host = self._files.records_per_host(process_count)
        self.num_batches = max(-(-n // per_host_batch_size) for n in per_host)
        self.num_records = self._files.read_records
        self.stats = {"files": len(self._files.host_files),
                      "corrupt_files": list(self._files.corrupt_files),
                      "skipped_records": self._files.skipped_records,
                      "records": self.num_records}

    def __len__(self) -> int:
        return self.num_batches

    def _dataset(self) -> tf.data.Dataset:
        L, P = self.max_seq_length, self.max_predictions_per_seq
        paths = self._files.read_paths

        def real(serialized):
            features = parse_batch(serialized, L, P)
            features["next_sentence_weights"] = tf.ones([tf.shape(serialized)[0]], tf.float32)
            return features

        pad = {"input_ids": tf.zeros([L], tf.int32), "input_mask": tf.zeros([L], tf.int32),
               "segment_ids": tf.zeros([L], tf.int32),
               "masked_lm_positions": tf.zeros([P], tf.int32),
               "masked_lm_ids": tf.zeros([P], tf.int32),
               "masked_lm_weights": tf.zeros([P], tf.float32),
               "next_sentence_labels": tf.zeros([1], tf.int32),
               "next_sentence_weights": tf.zeros([], tf.float32)}
        padding = tf.data.Dataset.from_tensors(pad).repeat()
        if paths:
            units, read = _file_datasets(self._files)
            rows = units.flat_map(read).batch(256).map(
                _graph_fn(real), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
            rows = rows.concatenate(padding)
        else:
            rows = padding
        ds = rows.batch(self.per_host_batch_size).take(self.num_batches)
        return ds.prefetch(2).with_options(_options())

    def __iter__(self) -> Iterator[dict]:
        iterator = iter(self._dataset())
        while True:
            try:
                batch = _next_batch(iterator, self._files, self._patterns, self.max_seq_length,
                                    self.max_predictions_per_seq)
            except StopIteration:
                return
            yield batch


def make_eval_iterator(file_patterns: FilePatterns, **kwargs: Any) -> EvalInput:
    """`EvalInput(file_patterns, **kwargs)`: the finite, padded eval pass (see `EvalInput`)."""
    return EvalInput(file_patterns, **kwargs)
