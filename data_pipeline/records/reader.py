"""Record files: which TFRecords a host reads, whether they are intact, and how to read them.

The first step of the training input (`create_pretraining_data` -> TFRecords + a manifest per
run -> **records.reader** -> `input.masking`, `input.packing` -> `input.pretraining`):
comma-separated globs expanded and sorted, the manifests (`<run>.dataset_info.json`, or one
`dataset_info.json` in folders of earlier versions: flags, record shape, per-file
size/sha256/count; `manifests.py`), the per-host share of the files, their check against the
manifests before training, and the tf.data reading of a host's files, the good records of
damaged ones included (found by `scan.scan_tfrecord_file`, which walks a file's framing and
checks every CRC).

- **Files.** Comma-separated globs (or a list of them) are expanded, de-duplicated and *sorted*
  (`*.gz` files are read as gzip-compressed TFRecords, as `--compression=gzip` writes them);
  host `process_index` of `process_count` reads files `sorted_files[process_index::process_count]`
  (disjoint, and complete over the hosts). Never `Dataset.list_files`, which shuffles unseeded.
- **One dataset per glob.** The manifests of the records a glob matches must agree on how they
  were made (vocabulary, casing, lengths, masking: `manifests.check_agree`), else
  `ManifestMismatchError` names both manifests, the field and both values; checked whether or not
  the files are verified.
- **Integrity, before training.** With `verify=True` each file is checked against the manifest
  that lists it (size, sha256, record count; `manifests.py` writes it): a file no manifest lists, or
  a missing, empty, truncated, bit-flipped or garbage file raises `CorruptDataError` naming the file.
  With `skip_corrupt=True` exactly the good records of the bad file are read, in place (no copy:
  `scan_tfrecord_file` walks the record framing, checks every CRC and records where each good
  record lies), and the lost records are counted. Only this host's files are hashed, and an
  unchanged file only once (`known_hashes.KnownHashes`: on local disk, and beside a training run for files in
  a bucket, so a machine recreated after a preemption trusts them too).

This module imports neither jax nor bert_jax.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Optional, Sequence, Union

from data_pipeline.tf_import import tf  # without Keras (data_pipeline/tf_import.py)

from data_pipeline import storage
from data_pipeline.records import known_hashes, manifests
from data_pipeline.records.scan import count_records_by_framing, is_gzip, scan_tfrecord_file
from data_pipeline.storage import paths as storage_paths, staging as storage_staging

log = logging.getLogger(__name__)

FilePatterns = Union[str, Sequence[str]]

_VERIFY_HINT = "set config.verify_data=False (Python API: verify=False)"
# How to go on past bad data, in the error: the training config's field and the Python API's argument.
_SKIP_HINT = "; to train on the intact records set config.skip_corrupt_records=True (Python API: skip_corrupt=True)"


class CorruptDataError(RuntimeError):
    """A data file is missing, unlisted, truncated or corrupt. `path` names the file."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


# ---------------------------------------------------------------------------------------------
# Files and per-host sharding
# ---------------------------------------------------------------------------------------------


def _is_record_file(path: str) -> bool:
    """Not a data manifest (`data/*` matches them too)."""
    return not manifests.is_manifest(storage_paths.basename(path))


def _glob_records(pattern: str) -> list[str]:
    """The files one glob matches, less the data manifests."""
    return [p for p in storage.glob(storage_paths.check(pattern, "input file pattern")) if _is_record_file(p)]


def expand_file_patterns(file_patterns: FilePatterns) -> list[str]:
    """Sorted, de-duplicated files matching the globs (`storage.expand_patterns`, less the
    manifests). Raises naming a pattern that matches nothing.

    Sorting matters: every host must see the same list before taking its share of it.
    """
    return sorted(set(storage.expand_patterns(file_patterns, "input file pattern", keep=_is_record_file)))


def _compression(path: str) -> str:
    return "GZIP" if is_gzip(path) else ""


def record_shape(file_patterns: FilePatterns) -> tuple[int, int]:
    """(max_seq_length, max_predictions_per_seq) of the first record the globs match.

    Google-format pretraining records have fixed-length features, so the first record gives the
    shape of all (evaluation at the data's own length, whatever the training phase's is).
    Raises naming the file when it has no record or not the pretraining features.
    """
    files = expand_file_patterns(file_patterns)
    for path in files:
        records = tf.data.TFRecordDataset(storage_staging.tf_path(path),  # storage: local (storage_staging.tf_path)
                                          compression_type=_compression(path))
        for raw in records.take(1):
            example = tf.train.Example.FromString(raw.numpy()).features.feature
            try:
                return (len(example["input_ids"].int64_list.value),
                        len(example["masked_lm_positions"].int64_list.value))
            except KeyError as e:
                raise ValueError(f"{path}: the first record has no feature {e}; not pretraining "
                                 "records (data_pipeline.create_pretraining_data)") from None
    raise ValueError(f"no record in {', '.join(files)}")


def dataset_info(file_patterns: FilePatterns) -> dict:
    """How the records the globs match were made ({} when no manifest says): the first of their
    manifests (`manifests.touched`), once all are checked to agree on the settings that change
    what the model sees (`manifests.check_agree`; raises `ManifestMismatchError`). Its flags
    (casing, lengths, vocabulary) are those of every run; its statistics are its own run's."""
    patterns = storage.split_patterns(file_patterns)
    found = [f for p in patterns for f in _glob_records(p)]
    # Unreadable manifests are skipped with a warning: verify_data names them; the flags are informative.
    touched = manifests.touched(patterns, found, lenient=True)
    manifests.check_agree(touched, ",".join(patterns))
    return dict(touched[0].info) if touched else {}


def host_files(files: Sequence[str], process_index: int, process_count: int) -> list[str]:
    """This host's files: `sorted(files)[process_index::process_count]`.

    Round-robin over the sorted list: the hosts' sets are disjoint, their union is every file,
    and their sizes differ by at most one file.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, process_count={process_count})")
    return sorted(files)[process_index::process_count]



# ---------------------------------------------------------------------------------------------
# The manifests (one per run, `<run>.dataset_info.json`, written by manifests.py next to the TFRecords)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One file's manifest entry (or, without a manifest, what could be measured)."""

    path: str
    num_records: int
    num_bytes: Optional[int] = None
    sha256: Optional[str] = None


def _what_is_there(pattern: str) -> str:
    """What the folder of a pattern that matched nothing holds (a user's first guess at the shard
    names is often near: `train*.tfrecord` for `train-00000-of-00016.tfrecord.gz`)."""
    directory = storage_paths.dirname(pattern)
    if _pattern_has_glob(directory) or not storage.isdir(directory or "."):
        return ""
    names = sorted(n for n in storage.listdir(directory or ".") if not manifests.is_manifest(n))
    if not names:
        return f" ({directory or '.'} is empty)"
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} files)" if len(names) > 3 else "")
    return f" ({directory or '.'} holds {shown})"


def _read_manifests(directory: str) -> list[manifests.Manifest]:
    """The manifests in `directory`; an unreadable one is a `CorruptDataError` naming it."""
    try:
        return manifests.in_directory(directory)
    except manifests.UnreadableManifest as e:
        raise CorruptDataError(e.path, f"unreadable data manifest ({e.reason})") from e


def _file_info(path: str, entry: dict) -> FileInfo:
    return FileInfo(path=path, num_records=int(entry["num_records"]), num_bytes=entry.get("num_bytes"),
                    sha256=entry.get("sha256"))


def load_manifest(directory: str) -> Optional[dict[str, FileInfo]]:
    """The entries of every manifest in `directory` (each run's, or the legacy one) keyed by full
    path, or None if it has none."""
    found = _read_manifests(directory)
    if not found:
        return None
    return {path: _file_info(path, entry) for m in found for path, entry in m.files.items()}


def _pattern_has_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


@dataclasses.dataclass
class HostFiles:
    """The result of checking the files before training (`check_files`): what this host reads."""

    all_files: list  # every expected file, sorted (the list hosts shard)
    infos: dict  # path -> FileInfo: from the manifest, or measured
    read_paths: list  # what this host actually reads (its files less the unreadable ones)
    read_counts: list  # records in each read path; None = unverified, not counted yet
    host_files: list  # this host's share of all_files (original names)
    corrupt_files: list  # this host's files that were missing/corrupt (lenient mode)
    skipped_records: int  # records of this host's files that will not be read
    good_records: dict = dataclasses.field(default_factory=dict)  # damaged path -> _GoodRecords
    # What verifying this host's files took (`KnownHashes.counts`): hashed_files, hashed_bytes, trusted_files.
    verification: dict = dataclasses.field(default_factory=dict)

    def count(self, path: str) -> int:
        """Records in one of `all_files`: the manifest's count, else counted from the framing.

        Unverified files are counted only when a count is needed (finite runs, eval, packing,
        `stats`): it costs a pass over the record headers.
        """
        if path not in self.infos:
            self.infos[path] = FileInfo(path, count_records_by_framing(path))
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
        return [sum(self.count(p) for p in host_files(self.all_files, h, process_count))
                for h in range(process_count)]


def check_files(file_patterns: FilePatterns, *, process_index: int, process_count: int,
                verify: Union[bool, str], skip_corrupt: bool,
                require_files_per_host: bool, known_hashes_file: Optional[str] = None) -> HostFiles:
    """Lists, shards and (with `verify`) checks the files; finds the good records of bad ones
    when lenient. `verify="full"` hashes every file again; `known_hashes_file` keeps the hashes of
    remote files beside the run too (`KnownHashes`)."""
    patterns = storage.split_patterns(file_patterns)
    hashes = known_hashes.KnownHashes(fresh=verify == "full", shared_file=known_hashes_file)
    found, unmatched = set(), []
    for pattern in patterns:
        matched = _glob_records(pattern)
        if not matched:
            unmatched.append(pattern)
        found.update(matched)
    if unmatched and not verify:
        raise CorruptDataError(unmatched[0], ("no input file matches this pattern"
                               if _pattern_has_glob(unmatched[0]) else "input file is missing")
                               + _what_is_there(unmatched[0]))

    infos: dict[str, FileInfo] = {}
    expected = set(found)
    what = ",".join(patterns)
    if not verify:  # the files unchecked; the manifests there are still one dataset's (cheap to read)
        manifests.check_agree(manifests.touched(patterns, found, lenient=True), what)
    else:
        # Manifests live next to the files (`manifests.folders`). Each run's lists its own files;
        # together they must list every file found and agree on how the records were made.
        touched = []
        for directory in manifests.folders(patterns, found):
            here = _read_manifests(directory)
            if not here:
                if not any(storage_paths.dirname(p) == directory for p in found):  # nothing here at all
                    pattern = next((u for u in unmatched if storage_paths.dirname(u) == directory), directory)
                    raise CorruptDataError(pattern, ("no input file matches this pattern"
                                           if _pattern_has_glob(pattern) else "input file is missing")
                                           + _what_is_there(pattern))
                raise CorruptDataError(
                    storage_paths.join(directory, "*." + manifests.MANIFEST_NAME),
                    "no data manifest next to the input files (create_pretraining_data writes one per run); "
                    "to read them unchecked " + _VERIFY_HINT)
            listed_by: dict[str, str] = {}
            for manifest in here:
                # Every manifest file a pattern names is expected (so a deleted file is noticed).
                for path, entry in manifest.files.items():
                    if not any(fnmatch.fnmatchcase(path, p) for p in patterns):
                        continue
                    if path in listed_by:
                        raise CorruptDataError(path, f"is listed by two data manifests, {listed_by[path]} and "
                                               f"{manifest.path}: one file, two descriptions (a copy, or a "
                                               "manifest of records written over since); delete the stale one")
                    listed_by[path] = manifest.path
                    expected.add(path)
                    infos[path] = _file_info(path, entry)
            touched += manifests.touching(here, patterns)
        manifests.check_agree(touched, what)
        unlisted = sorted(p for p in found if p not in infos)
        if unlisted:
            raise CorruptDataError(unlisted[0], "is not listed in any data manifest of its folder "
                                   f"(*.{manifests.MANIFEST_NAME}; {len(unlisted)} unlisted files); "
                                   "to read it anyway " + _VERIFY_HINT)
        for pattern in unmatched:
            if not any(fnmatch.fnmatchcase(p, pattern) for p in expected):
                raise CorruptDataError(pattern, "no input file (on disk or in the manifest) "
                                       "matches this pattern" + _what_is_there(pattern))

    all_files = sorted(expected)
    if require_files_per_host and len(all_files) < process_count:
        raise ValueError(
            f"{len(all_files)} input files for process_count={process_count}: every host needs at "
            f"least one file (files are sharded per host); write more shards")
    mine = host_files(all_files, process_index, process_count)

    read_paths, read_counts, corrupt, skipped, good_records = [], [], [], 0, {}
    for path in mine:
        info = infos.get(path)
        problem = None
        if path not in found and not storage.exists(path):
            problem = "file is missing"
        elif info is not None:
            size = hashes.size(path)
            if info.num_bytes is not None and size != int(info.num_bytes):
                problem = f"size {size} bytes, manifest says {info.num_bytes}"
            elif info.sha256 and hashes.sha256(path) != info.sha256:
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
            good_records[path] = _GoodRecords(storage_staging.tf_path(scan.path), scan.size,
                                              tuple(zip(scan.good_offsets, scan.good_lengths)))
            read_paths.append(path)
            read_counts.append(scan.num_good)
    hashes.save()
    return HostFiles(all_files=all_files, infos=infos, read_paths=read_paths,
                     read_counts=read_counts, host_files=mine, corrupt_files=corrupt,
                     skipped_records=skipped, good_records=good_records, verification=dict(hashes.counts))


def read_error(files: HostFiles, patterns: Sequence[str], error: tf.errors.DataLossError) -> CorruptDataError:
    """The error for a `DataLossError` while reading `files`, which TF raises without saying
    which file: names the first of this host's files that fails a scan."""
    for path in (p for p in files.read_paths if p not in files.good_records):
        scan = scan_tfrecord_file(path)
        if not scan.ok:
            offset, reason = scan.bad_regions[0]
            return CorruptDataError(path, f"{reason} at byte {offset} (found while reading)" + _SKIP_HINT)
    return CorruptDataError(",".join(patterns), f"data loss while reading: {error.message}")


# ---------------------------------------------------------------------------------------------
# Reading this host's records (the good ones of damaged files in place)
# ---------------------------------------------------------------------------------------------


def _record_dataset(path) -> tf.data.Dataset:
    """The records of one file (a path tensor, as `interleave` passes it: a `storage_staging.tf_path`), gzip or not."""
    compression = tf.where(tf.strings.regex_full_match(path, r".*\.gz"), "GZIP", "")
    return tf.data.TFRecordDataset(path, compression_type=compression)  # storage: local (a storage_staging.tf_path)


_CHUNK_BYTES = 1 << 20  # good records of a damaged file are read in runs of up to this many bytes


@dataclasses.dataclass(frozen=True)
class _GoodRecords:
    """Where the intact records of a damaged file are: read in place, never copied.

    `source` is the file as TensorFlow opens it (`storage_staging.tf_path`; for a gzip file, the
    uncompressed scratch copy the scan made);
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


def file_datasets(files: "HostFiles"):
    """(a dataset of this host's read units, a function from one unit to its records' dataset).

    Without damaged files the units are the paths and the function `_record_dataset` (the plain
    pipeline). With some (lenient mode), a unit is (path, index): an intact file is read with
    `TFRecordDataset`, a damaged one as runs of its good records (`FixedLengthRecordDataset` over
    each run's byte range, cut into records at the offsets the scan found): nothing is copied.
    """
    # TensorFlow opens the files itself: gs:// paths as they are, or local copies where its own
    # GCS client cannot reach the store (an emulator); the order, hence the shuffles, is the same.
    paths = [storage_staging.tf_path(p) for p in files.read_paths]
    if not files.good_records:
        return tf.data.Dataset.from_tensor_slices(paths), _record_dataset
    chunk_lo, chunk_hi, sources, starts, nbytes, footers, rec_lo, rec_hi = [], [], [], [], [], [], [], []
    rel, lens = [], []
    for path in files.read_paths:
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
        return tf.data.FixedLengthRecordDataset(  # storage: local (sources are storage_staging.tf_path)
            sources[c], nbytes[c], header_bytes=starts[c], footer_bytes=footers[c]).flat_map(cut)

    def read(path, i):
        intact = tf.cast(tf.equal(chunk_lo[i], chunk_hi[i]), tf.int32)  # 1: a plain file
        whole = tf.data.TFRecordDataset(  # storage: local (paths are storage_staging.tf_path)
            tf.reshape(path, [1])[:intact],
            compression_type=tf.where(tf.strings.regex_full_match(path, r".*\.gz"), "GZIP", ""))
        return whole.concatenate(tf.data.Dataset.range(chunk_lo[i], chunk_hi[i]).flat_map(read_chunk))

    units = tf.data.Dataset.from_tensor_slices((paths, tf.range(len(paths), dtype=tf.int64)))
    return units, read
