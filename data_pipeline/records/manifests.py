"""Data manifests, written and read: one per run of `create_pretraining_data`, any number in a
folder; what a run writes into its own, which of them a glob touches, and whether the records they
describe were made alike.

A manifest, next to the TFRecords, records how they were made (all flags, seed, the vocab file's
sha256, statistics: `shards.run_info`) and every output file (records, bytes, sha256) that the
input pipeline checks before training: an empty or truncated TFRecord file reads without error in
tf.data, so only the manifest catches it.

Google's README has users with large inputs "shard the input file and call the script multiple
times", and a cluster's job array writes every shard's records into one folder. So each run
writes its own manifest beside its records, named after its output (`run_manifest_name`:
`--output_file=data/shard-07.tfrecord` -> `data/shard-07.dataset_info.json`), whole or not at all
(`write_dataset_info`): runs started in parallel into one folder never write the same file. A
folder written by an earlier version holds one `dataset_info.json` (`MANIFEST_NAME`), read the
same way.

The trainer reads the records a glob matches as one dataset, so every manifest listing one of them
must record the same settings (`settings`: the vocabulary's sha256, casing, lengths, masking):
records of another vocabulary hold ids that mean other tokens, records of another length do not
parse with the rest. `check_agree` refuses them, naming both manifests, the field and both values.
What may differ between runs is what varies the data and not its meaning: inputs, seed,
dupe_factor, short_seq_prob, worker and shard counts, compression, mode.

`reader.check_files` (before training and evaluation) and `reader.dataset_info` (the flags the
trainer reads: casing, vocabulary, whole-word masking) both go through `touching` and
`check_agree`; `shards.check_output_dir_free` (before a run writes) reads the folder's manifests
through `in_directory`.

This module imports neither jax, bert_jax nor TensorFlow.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
import re
from typing import Any, Iterable, Mapping, Optional, Sequence

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

log = logging.getLogger(__name__)

MANIFEST_NAME = "dataset_info.json"  # a folder's one manifest in earlier versions; every run's name ends with it


class UnreadableManifest(ValueError):
    """A manifest that is not JSON, or whose file list is malformed. `path` names it."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: unreadable data manifest ({reason})")
        self.path, self.reason = path, reason


class ManifestMismatchError(ValueError):
    """Two manifests of the records one glob matches record different settings."""


def is_manifest(name: str) -> bool:
    """Whether a file name is a data manifest: a run's `<stem>.dataset_info.json` or the legacy one."""
    return name == MANIFEST_NAME or name.endswith("." + MANIFEST_NAME)


# ---------------------------------------------------------------------------------------------
# Writing: one run's manifest
# ---------------------------------------------------------------------------------------------


def sha256_file(path: str) -> str:
    """The hex sha256 of a file (local or gs://, through `storage`)."""
    return storage.sha256(path)


def manifest_entry(num_records: int, num_bytes: int, sha256: str) -> dict:
    """One file's manifest entry (what `records.reader` verifies before training)."""
    return {"num_records": int(num_records), "num_bytes": int(num_bytes), "sha256": sha256}


def file_entry(path: str, num_records: int) -> dict:
    """The manifest entry of a written file: its size and sha256 read from it."""
    return manifest_entry(num_records, storage.getsize(path), sha256_file(path))


def dataset_info_json(manifest: Mapping[str, dict], info: Optional[dict] = None) -> str:
    """The text of dataset_info.json: `info`, the schema version and `manifest` {file name: entry}."""
    out = dict(info or {})
    out["schema_version"] = 1
    out["files"] = dict(manifest)
    return json.dumps(out, indent=2, sort_keys=True) + "\n"


_SHARD_NAME = re.compile(r"(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})(?P<ext>.*)")
_RECORD_EXTENSIONS = (".tfrecords", ".tfrecord", ".tfrec")


def run_manifest_name(outputs: Sequence[str]) -> str:
    """The manifest file name of a run writing `outputs` (one folder): `<stem>.dataset_info.json`.

    The stem is the first output's name (sorted) less its record extensions (`.gz`, `.tfrecord`,
    ...), and less the shard number when the outputs are exactly the numbered family one name
    makes (`--num_output_shards`, or the library's `part-*`). A lone numbered file keeps its
    number: a job array whose task i writes `wiki-0000i-of-00100.tfrecord` gives each task its own
    manifest.

    Example: `["d/train-00000-of-00002.tfrecord.gz", "d/train-00001-of-00002.tfrecord.gz"]` ->
    `train.dataset_info.json`; `["d/shard-07.tfrecord"]` -> `shard-07.dataset_info.json`.
    """
    names = sorted(storage_paths.basename(p) for p in outputs)
    if not names:
        raise ValueError("a run writes at least one output file")
    name = names[0]
    family = _SHARD_NAME.fullmatch(name)
    if family and int(family["count"]) == len(names) > 0 and names == [
            f"{family['stem']}-{i:05d}-of-{family['count']}{family['ext']}" for i in range(len(names))]:
        name = family["stem"] + family["ext"]
    for extensions in ((".gz",), _RECORD_EXTENSIONS):
        for ext in extensions:
            if name.endswith(ext) and len(name) > len(ext):
                name = name[: -len(ext)]
                break
    return f"{name}.{MANIFEST_NAME}"


def write_dataset_info(directory: str, files: Mapping[str, int], info: Optional[dict] = None,
                       name: Optional[str] = None) -> str:
    """Writes the run's manifest `directory/<run_manifest_name(files)>`: `info` plus `files`
    {name: {num_records, num_bytes, sha256}}; returns its path.

    Args:
      directory: where the TFRecords are (names in the manifest are relative to it).
      files: file path -> number of records written to it.
      info: flags, seed, vocab sha256, statistics, ... (`shards.run_info` for a create-data run)
      name: the manifest's file name instead (`MANIFEST_NAME`: a folder as earlier versions wrote it).
    """
    manifest = {storage_paths.basename(p): file_entry(p, n) for p, n in sorted(files.items())}
    path = storage_paths.join(directory, name or run_manifest_name(list(files)))
    storage.write_text(path, dataset_info_json(manifest, info))  # whole or not at all
    return path


# ---------------------------------------------------------------------------------------------
# Reading: the manifests a glob touches
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Manifest:
    """One manifest file: its path, everything it holds, and its file entries by full path."""

    path: str
    info: dict  # flags, statistics, "files" as written
    files: dict  # full path -> {num_records, num_bytes, sha256}

    @property
    def legacy(self) -> bool:
        return storage_paths.basename(self.path) == MANIFEST_NAME


def read(path: str, *, lenient: bool = False) -> Manifest:
    """The manifest at `path`. Raises `UnreadableManifest` when it is not a JSON object or its
    file list is malformed; `lenient` reads a missing or malformed file list as none (the flags
    alone are what `reader.dataset_info`'s callers want)."""
    try:
        info = json.loads(storage.read_text(path))
    except (OSError, ValueError) as e:
        raise UnreadableManifest(path, repr(e)) from e
    if not isinstance(info, dict):
        raise UnreadableManifest(path, "not a JSON object")
    entries = info.get("files")
    if not isinstance(entries, dict) or not all(isinstance(e, dict) and "num_records" in e
                                                for e in entries.values()):
        if not lenient:
            bad = ("no file list" if not isinstance(entries, dict) else
                   "entry for " + next(n for n, e in entries.items()
                                       if not isinstance(e, dict) or "num_records" not in e) + " has no num_records")
            raise UnreadableManifest(path, bad)
        entries = {}
    directory = storage_paths.dirname(path)
    files = {name if os.path.isabs(name) or "://" in name else storage_paths.join(directory, name): entry
             for name, entry in entries.items()}
    return Manifest(path=path, info=info, files=files)


def in_directory(directory: str, *, lenient: bool = False) -> list[Manifest]:
    """Every manifest in `directory` (the runs' and the legacy one), sorted by name. `lenient`
    skips an unreadable one with a warning instead of raising."""
    out = []
    for name in storage.listdir(directory or "."):
        if not is_manifest(name):
            continue
        try:
            out.append(read(storage_paths.join(directory, name), lenient=lenient))
        except UnreadableManifest as e:
            if not lenient:
                raise
            log.warning("%s; the settings it records are not checked", e)
    return out


def lists_match(manifest: Manifest, patterns: Sequence[str]) -> bool:
    """Whether `manifest` lists a file one of `patterns` matches (the manifest's paths are full,
    so a file deleted since is matched too)."""
    return any(fnmatch.fnmatchcase(path, p) for path in manifest.files for p in patterns)


def touching(manifests: Sequence[Manifest], patterns: Sequence[str]) -> list[Manifest]:
    """The manifests of one folder that describe records `patterns` match: those listing one of
    them; where none does, the legacy `dataset_info.json`, which described its whole folder."""
    out = [m for m in manifests if lists_match(m, patterns)]
    return out or [m for m in manifests if m.legacy]


def folders(patterns: Sequence[str], found: Optional[Iterable[str]] = None) -> list[str]:
    """The folders whose manifests can describe what `patterns` match: those of the files found
    (`found`; globbed when None) and of the patterns whose folder part is literal (a pattern
    whose files all vanished is still checked against its manifest)."""
    if found is None:
        found = [f for p in patterns for f in storage.glob(storage_paths.check(p, "input file pattern"))]
    out = {storage_paths.dirname(f) for f in found}
    out |= {storage_paths.dirname(p) for p in patterns if not any(c in storage_paths.dirname(p) for c in "*?[")}
    return sorted(out)


def touched(patterns: Sequence[str], found: Optional[Iterable[str]] = None, *,
            lenient: bool = True) -> list[Manifest]:
    """The manifests describing the records `patterns` match (`touching`, folder by folder)."""
    return [m for folder in folders(patterns, found)
            for m in touching(in_directory(folder, lenient=lenient), patterns)]


# ---------------------------------------------------------------------------------------------
# The settings records of one glob must share
# ---------------------------------------------------------------------------------------------


# What changes what the model sees (the records' meaning or shape): field -> where the manifest
# keeps it ("flags" or the top level) and the flag a user sets it with.
_SETTINGS = (
    ("vocab_sha256", "top", "--vocab_file"),
    ("schema_version", "top", None),
    ("max_seq_length", "top", "--max_seq_length"),
    ("max_predictions_per_seq", "top", "--max_predictions_per_seq"),
    ("do_lower_case", "flags", "--do_lower_case"),
    ("do_whole_word_mask", "flags", "--do_whole_word_mask"),
    ("masked_lm_prob", "flags", "--masked_lm_prob"),
    ("chinese_whole_word_mask", "flags", "--chinese_whole_word_mask"),
)


def settings(info: Mapping[str, Any]) -> dict:
    """The settings a manifest records (those it does not record are left out: they cannot be
    compared, as in a hand-written or an early manifest)."""
    flags = info.get("flags") if isinstance(info.get("flags"), dict) else {}
    out = {}
    for field, where, _ in _SETTINGS:
        value = info.get(field) if where == "top" else None
        if value is None:
            value = flags.get(field)
        if value is not None:
            out[field] = value
    segmenter = info.get("chinese_segmenter")
    if isinstance(segmenter, dict):  # present with --chinese_whole_word_mask; None: no user dictionary
        out["chinese_user_dict_sha256"] = segmenter.get("user_dict_sha256")
    return out


def check_agree(manifests: Sequence[Manifest], what: str) -> None:
    """Raises `ManifestMismatchError` when two of `manifests` (those of the records `what` names)
    record different settings, naming both manifests, the field and both values."""
    first: dict = {}  # field -> (manifest, value)
    for manifest in manifests:
        for field, value in settings(manifest.info).items():
            if field not in first:
                first[field] = (manifest, value)
                continue
            other, theirs = first[field]
            if theirs == value:
                continue
            flag = dict(((name, f) for name, _, f in _SETTINGS), chinese_user_dict_sha256="--chinese_user_dict")[field]
            how = f"the same {flag}" if flag else "one version of data_pipeline"
            detail = ""
            if field == "vocab_sha256":
                files = [(m.info.get("flags") or {}).get("vocab_file") for m in (other, manifest)]
                detail = f" (vocab_file {files[0]} vs {files[1]})"
            raise ManifestMismatchError(
                f"the records {what} matches were made with different {field}: {theirs!r} per {other.path}, "
                f"{value!r} per {manifest.path}{detail}. One glob is read as one dataset: make its runs with "
                f"{how}, or read these records as another dataset (another phase, the eval data)")
