"""Your own data as files: tables (CSV, TSV, JSON Lines) read by column name, and seeded splits.

The generic tasks (`classification.py`, `tagging.py`, `squad.py`'s `qa`) read their splits through
this module:

- **Where each split is.** `config.split_files.{train,dev,test}`, else `train.*`, `dev.*` (or
  `validation.*`, `valid.*`) and `test.*` in `config.data_dir`, with the format's suffix. With no
  dev file and `dev_fraction > 0`, dev is a seeded fraction of the training file (`split_rows`).
- **Tables.** `read_table(path, fmt)` yields `Row`s: the file's row number (the line a CSV record
  starts on, the line of a JSON Lines object) and a dict of column -> value. CSV is RFC 4180 (quoted
  fields may hold commas, quotes and newlines); TSV is GLUE's and Google's `_read_tsv` (no quoting:
  a quote is a character); JSON Lines is one object a line. A row with a different number of fields
  than the header, a line that is not a JSON object, or text that is not UTF-8 is named by file and
  row (and column where there is one).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from typing import Optional, Sequence

import numpy as np

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tasks import BadRows, DataError, read_text

TABLE_FORMATS = ("csv", "tsv", "jsonl")
_SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
SPLIT_NAMES = {"train": ("train",), "dev": ("dev", "validation", "valid", "val"), "test": ("test",)}


@dataclasses.dataclass
class Row:
    number: int  # the file's line the row starts on (1-based)
    values: dict  # column -> value (str for CSV/TSV; any JSON value for JSON Lines)


def table_format(path: str, fmt: str = "auto") -> str:
    """"csv", "tsv" or "jsonl" for `path`: `fmt` unless "auto", else from the file's suffix."""
    if fmt != "auto":
        if fmt not in TABLE_FORMATS:
            raise ValueError(f"config.task_options.format must be auto or one of {TABLE_FORMATS}, got {fmt!r}")
        return fmt
    name = storage_paths.basename(path).lower()
    for suffix, found in _SUFFIXES.items():
        if name.endswith(suffix):
            return found
    raise ValueError(f"{path}: cannot tell the format from the name (expected {', '.join(_SUFFIXES)}); "
                     "set config.task_options.format to csv, tsv or jsonl")


def read_table(path: str, fmt: str, rows: BadRows) -> tuple[list[str], list[Row]]:
    """(columns, rows) of a CSV/TSV file with a header, or of a JSON Lines file (its columns are
    the keys of its first object). Ragged rows and non-object lines are bad rows (`rows.bad`)."""
    if fmt == "jsonl":
        return read_jsonl(path, rows)
    text = read_text(path, bom=True)
    if fmt == "csv":
        reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    else:
        reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    header: Optional[list] = None
    out: list[Row] = []
    try:
        while True:
            start = reader.line_num + 1
            try:
                fields = next(reader)
            except StopIteration:
                break
            if not fields or fields == [""]:
                continue  # a blank line
            if header is None:
                header = [f.strip() for f in fields]
                duplicates = sorted({c for c in header if header.count(c) > 1})
                if duplicates:
                    raise DataError(f"{path}: line {start}: the header repeats column(s) {duplicates}")
                continue
            if len(fields) != len(header):
                rows.bad(path, start, f"{len(fields)} fields, the header has {len(header)} ({', '.join(header)})")
                continue
            out.append(Row(start, dict(zip(header, fields))))
    except csv.Error as e:
        raise DataError(f"{path}: line {reader.line_num}: not valid CSV ({e})") from None
    if header is None:
        raise DataError(f"{path}: empty file (expected a header line naming the columns)")
    return header, out


def read_jsonl(path: str, rows: BadRows) -> tuple[list[str], list[Row]]:
    """(keys in order of appearance, one `Row` per object line); other lines are bad rows."""
    columns: list[str] = []
    out = []
    for number, line in enumerate(read_text(path, bom=True).split("\n"), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            rows.bad(path, number, f"not valid JSON (column {e.colno}: {e.msg})")
            continue
        if not isinstance(value, dict):
            rows.bad(path, number, f"a JSON {type(value).__name__}, expected an object of named fields")
            continue
        for key in value:
            if key not in columns:
                columns.append(key)
        out.append(Row(number, value))
    if not out and not columns:
        raise DataError(f"{path}: no JSON object in the file")
    return columns, out


def require_columns(path: str, columns: Sequence[str], wanted: dict) -> None:
    """Each `option -> column` of `wanted` (non-empty columns only) is among `columns`."""
    for option, column in wanted.items():
        if column and column not in columns:
            raise DataError(f"{path}: no column {column!r} (its columns: {', '.join(map(str, columns))}); "
                            f"set config.task_options.{option}")


def find_split_file(data_dir: str, split: str, suffixes: Sequence[str]) -> Optional[str]:
    """`data_dir/<name><suffix>` for the split's names (`SPLIT_NAMES`), the first that exists."""
    if not data_dir:
        return None
    for name in SPLIT_NAMES.get(split, (split,)):
        for suffix in suffixes:
            path = storage_paths.join(data_dir, name + suffix)
            if storage.exists(path):
                return path
    return None


def split_rows(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, dev) indices of `n` rows: `round(n * fraction)` rows, drawn by
    `RandomState(seed).permutation(n)`, are dev; both keep the file's order.

    The draw depends on `n`, `fraction` and `seed` only, so the same file splits the same way on
    every host and run, and `mode=predict` never needs it.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"config.task_options.dev_fraction={fraction}: a fraction in (0, 1)")
    k = int(round(n * fraction))
    if n and not 0 < k < n:
        raise DataError(f"dev_fraction={fraction} of {n} rows leaves {k} for dev and {n - k} for training: "
                        "both need at least one row")
    dev = np.sort(np.random.RandomState(seed).permutation(n)[:k])
    train = np.setdiff1d(np.arange(n), dev)
    return train, dev


def labels_in_order(values: Sequence[str]) -> tuple:
    """The distinct labels, sorted: numerically when every one is an integer ("2" < "10"), else as
    strings, so the head's outputs keep one order however the file is shuffled."""
    distinct = set(values)
    try:
        return tuple(sorted(distinct, key=int))
    except ValueError:
        return tuple(sorted(distinct))


def parse_labels(option, where: str) -> tuple:
    """`config.task_options.labels` as a tuple: a tuple/list, or one comma-separated string."""
    if option in (None, "", ()):
        return ()
    labels = tuple(str(x).strip() for x in (option.split(",") if isinstance(option, str) else option))
    if any(not x for x in labels) or len(set(labels)) != len(labels):
        raise ValueError(f"config.task_options.labels={option!r} ({where}): distinct, non-empty labels")
    return labels


class OwnFiles:
    """The splits of a task on your own files (mixed into a `Task`): `train`, `dev` and an
    optional `test`, from `split_files`, `data_dir`, or a seeded `dev_fraction` of the training
    file. Subclasses set `suffixes` and implement `read_file(path, split) -> examples`.

    Each file is read once (training file: for its labels, then for the train and dev parts).
    """

    suffixes: tuple = ()
    eval_splits = ("dev",)

    def _own_files(self, dev_fraction: float, split_seed: int) -> None:
        self.dev_fraction = float(dev_fraction or 0.0)
        self.split_seed = int(split_seed)
        if not 0.0 <= self.dev_fraction < 1.0:
            raise ValueError(f"config.task_options.dev_fraction={dev_fraction}: a fraction in [0, 1) "
                             "(0: the dev file is given)")
        self._cache: dict = {}

    def split_path(self, split: str) -> Optional[str]:
        """The file of `split`, or None when there is none (dev then comes from `dev_fraction`)."""
        if split in self.split_files:
            if not storage.exists(self.split_files[split]):
                raise FileNotFoundError(f"task {self.name}: config.split_files.{split}="
                                        f"{self.split_files[split]} does not exist")
            return self.split_files[split]
        return find_split_file(self.data_dir, split, self.suffixes)

    @property
    def test_splits(self) -> tuple:
        return ("test",) if self.split_path("test") else ()

    def _fraction_split(self) -> bool:
        return bool(self.dev_fraction) and self.split_path("dev") is None

    def read(self, split: str) -> list:
        if split not in SPLIT_NAMES:
            raise ValueError(f"task {self.name} has no split {split!r}; expected one of {list(SPLIT_NAMES)}")
        if self.source != "files":
            raise ValueError(f"task {self.name} reads your own files: config.data_source must be 'files'")
        fraction = self._fraction_split() and split in ("train", "dev")
        path = self.split_path("train" if fraction else split)
        if path is None:
            where = f"config.split_files.{split}" + (f" or {split}.* in {self.data_dir}" if self.data_dir else "")
            extra = (" (or config.task_options.dev_fraction, a seeded share of the training file)"
                     if split == "dev" else "")
            raise FileNotFoundError(f"task {self.name}: no {split} file: set {where}{extra}")
        examples = self._read_cached(path, split)
        if fraction:
            train, dev = split_rows(len(examples), self.dev_fraction, self.split_seed)
            examples = [examples[i] for i in (train if split == "train" else dev)]
        return examples

    def _read_cached(self, path: str, split: str) -> list:
        key = (path, split == "test")
        if key not in self._cache:
            self._cache[key] = self.read_file(path, split)
        return self._cache[key]

    def read_file(self, path: str, split: str) -> list:
        raise NotImplementedError

    def file_names(self) -> set:
        return {storage_paths.basename(p) for p in self.split_files.values()}
