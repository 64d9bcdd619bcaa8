"""Fine-tuning tasks: read -> featurize -> (model) -> postprocess -> score, one file per family.

A task is everything about a fine-tuning dataset that is not the network: where its examples come
from (TFDS, or the files as they are distributed), how an example becomes fixed-shape numpy
features with our tokenizer, how the model's outputs become predictions in the dataset's own
terms, and how those are scored with the official metric. `bert_jax.finetune.loop` runs one loop for
all of them; the task tells it only the head kind (`HEAD_KINDS`) and the number of outputs.

    glue.py              CoLA, SST-2, MRPC, STS-B, QQP, MNLI (m/mm), QNLI, RTE, WNLI
    squad.py             SQuAD v1.1 and v2.0 (also the official scorer's CLI)
    squad_eval.py        the official SQuAD v1.1 / v2.0 scorers and their CLI
    ner.py               CoNLL-2003 NER (IOB1/IOB2, conlleval scoring)
    multiple_choice.py   SWAG
    classification.py    your own classification / regression table (CSV, TSV, JSON Lines)
    tagging.py           your own token tagging (CoNLL columns or JSON Lines; BIO, BIOES)
    files.py             reading your own files: tables by column name, splits, seeded dev share
    tokenizer_json.py    featurizing with a HuggingFace tokenizer.json (ModernBERT's BPE) instead of vocab.txt
    squad_windows.py     SQuAD's sliding context windows

Feature arrays (numpy; `N` rows, `L` = max_seq_length, `C` = choices):

    input_ids, input_mask, segment_ids   int32    [N, L]  ([N, C, L] for multiple choice)
    label                                int32    [N]     classification, multiple choice
                                         float32  [N]     regression
    start_positions, end_positions       int32    [N]     span
    label_ids                            int32    [N, L]  token classification
    label_weights                        float32  [N, L]  token classification (first pieces)
    weight                               float32  [N]     1 for a labelled row; 0 unlabelled / padding
    example_index                        int32    [N]     the example a row came from (host only)

Bad input (a malformed row, a label outside the label set, a SQuAD answer that is not at its
offset in the context) raises `DataError` naming the file and row; with `skip_bad_rows=True` the
row is skipped and counted in `task.skipped` (and logged), never silently.

Nothing here imports jax or bert_jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tokenization import CLS_TOKEN, PAD_TOKEN, SEP_TOKEN, UNK_TOKEN

HEAD_KINDS = ("classification", "regression", "span", "token", "multiple_choice")
MODEL_INPUTS = ("input_ids", "input_mask", "segment_ids")


class DataError(ValueError):
    """Malformed task data; the message names the file (or TFDS split) and the row."""


# ---------------------------------------------------------------------------------------------
# The task interface
# ---------------------------------------------------------------------------------------------


class Task:
    """Base class of every task; subclasses set the class attributes and the four methods.

    Attributes:
      name: the config's `task` value (e.g. "sst2").
      head: one of `HEAD_KINDS`: which head `bert_jax.finetune.heads` puts on the encoder.
      num_outputs: classes (classification, token), 1 (regression), 2 (span), choices (multiple
        choice).
      labels: the label set, in the order of the head's outputs (empty for regression and span).
      train_split: the split trained on.
      eval_splits: the splits scored after each epoch (the first one picks the best checkpoint).
      test_splits: unlabelled splits that `predict` writes submission files for.
      primary_metric: the key of `score`'s result that picks the best checkpoint (higher is better).
    """

    name: str = ""
    head: str = "classification"
    num_outputs: int = 2
    labels: tuple = ()
    train_split: str = "train"
    eval_splits: tuple = ("dev",)
    test_splits: tuple = ()
    primary_metric: str = "accuracy"

    def __init__(self, data_dir: str = "", *, source: str = "files", tfds_data_dir: Optional[str] = None,
                 skip_bad_rows: bool = False, split_files: Optional[dict] = None):
        if source not in ("files", "tfds"):
            raise ValueError(f"config.data_source must be 'files' or 'tfds', got {source!r}")
        if source == "files" and not data_dir and not split_files:
            raise ValueError(f"task {self.name}: config.data_dir is empty (the folder of the task's files)")
        self.data_dir = data_dir
        self.source = source
        self.tfds_data_dir = tfds_data_dir or None
        self.rows = BadRows(skip_bad_rows)
        self.split_files = dict(split_files or {})  # split -> path, overriding the usual file names
        self.show_progress = False  # featurization progress bar (set by the fine-tuning loop)

    @property
    def skipped(self) -> dict:
        """Rows skipped as bad, by `where` (file or TFDS split)."""
        return dict(self.rows.counts)

    # --- the four steps ------------------------------------------------------------------------

    def read(self, split: str) -> list:
        """The examples of `split` (from files or TFDS)."""
        raise NotImplementedError

    def featurize(self, examples: Sequence, tokenizer, max_seq_length: int, *,
                  training: bool) -> dict[str, np.ndarray]:
        """Fixed-shape numpy features (module docstring), with `example_index` per row."""
        raise NotImplementedError

    def postprocess(self, examples: Sequence, features: dict[str, np.ndarray],
                    outputs: dict[str, np.ndarray]) -> Any:
        """Model outputs (numpy, one row per feature row) -> predictions in the task's terms."""
        raise NotImplementedError

    def score(self, examples: Sequence, predictions: Any) -> dict[str, float]:
        """The official metric(s) of `predictions` against the examples' gold labels."""
        raise NotImplementedError

    def write_predictions(self, examples: Sequence, predictions: Any, directory: str,
                          split: str) -> list[str]:
        """Writes predictions (and, for test splits, submission files) to `directory`."""
        raise NotImplementedError

    # --- new text, for `mode=predict` --------------------------------------------------------

    # What one line of a plain text file holds for `read_lines` (tab-separated fields).
    line_format: str = "text"
    # Suffixes of files in the task's own format (besides the file names it reads its splits from).
    file_suffixes: tuple = ()

    def file_names(self) -> set:
        """The names of the files the task reads its splits from (`mode=predict` reads a file so
        named, or with one of `file_suffixes`, in the task's format)."""
        return {storage_paths.basename(n) for names in getattr(self, "files", {}).values() for n in names}

    def read_lines(self, path: str) -> list:
        """Unlabelled examples from a plain text file, one a line (`line_format`); blank lines
        are skipped, and a line with the wrong number of fields is a bad row (file and line)."""
        raise NotImplementedError

    def is_labelled(self, examples: Sequence) -> bool:
        """Whether every example has its gold label (then `score` applies)."""
        return bool(examples) and all(getattr(e, "label", None) is not None for e in examples)

    def _lines(self, path: str, fields: Sequence[int]) -> Iterator[tuple[int, str, list[str]]]:
        """(line number, "path:line", its tab-separated fields) of each non-blank line whose number
        of fields is one of `fields`; others are bad rows."""
        for number, line in enumerate(read_text(path, bom=True).split("\n"), 1):
            line = line[:-1] if line.endswith("\r") else line
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) not in fields:
                self.rows.bad(path, number, f"{len(parts)} tab-separated fields, expected "
                                            f"{' or '.join(map(str, fields))} ({self.line_format})")
                continue
            yield number, f"{path}:{number}", parts

    # --- shared --------------------------------------------------------------------------------

    def make_tokenizer(self, vocab_file: str, do_lower_case: bool):
        """Tokenizer used by `featurize` (the Google-exact one, with character offsets)."""
        from data_pipeline import tokenization
        return tokenization.FullTokenizer(vocab_file, do_lower_case)

    def _progress(self, examples: Sequence, what: str):
        """`examples`, iterated under a tqdm bar when `show_progress` (SQuAD's train split takes
        a minute or more to featurize on one CPU core)."""
        if not self.show_progress:
            return examples
        from tqdm import tqdm
        return tqdm(examples, total=len(examples), desc=f"{self.name}: {what}", unit=" examples",
                    dynamic_ncols=True, leave=False)

    def split_name(self, split: str) -> str:
        """A short label of a split for file and metric names."""
        return split

    def _path(self, split: str, *candidates: str) -> str:
        """`split_files[split]`, else the first existing file among `candidates` in `data_dir`."""
        if split in self.split_files:
            if not storage.exists(self.split_files[split]):
                raise FileNotFoundError(f"task {self.name}: {split} file {self.split_files[split]} does not exist")
            return self.split_files[split]
        for name in candidates:
            path = storage_paths.join(self.data_dir, name)
            if storage.exists(path):
                return path
        raise FileNotFoundError(f"task {self.name}: none of {list(candidates)} in {self.data_dir}")


class BadRows:
    """Raise on bad input, or count and log it (`skip=True`): never a silent drop."""

    def __init__(self, skip: bool):
        self.skip = skip
        self.counts: dict[str, int] = {}

    def bad(self, where: str, row, problem: str) -> None:
        message = f"{where}: row {row}: {problem}"
        if not self.skip:
            raise DataError(message + " (set config.skip_bad_rows=True to skip such rows)")
        self.counts[where] = self.counts.get(where, 0) + 1
        logging.warning("skipped %s", message)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

# name -> (module, class). Explicit, checked when the config is read.
_TASKS = {
    **{n: ("glue", "GlueTask") for n in ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")},
    "squad_v1": ("squad", "SquadV1"),
    "squad_v2": ("squad", "SquadV2"),
    "conll2003": ("ner", "Conll2003"),
    "swag": ("multiple_choice", "Swag"),
    # Your own files (files.py): a CSV/TSV/JSON Lines table, token-per-line columns, SQuAD JSON.
    "classification": ("classification", "Classification"),
    "regression": ("classification", "Regression"),
    "tagging": ("tagging", "Tagging"),
}
TASK_NAMES = tuple(_TASKS)


def _task_class(key: str):
    module, cls = _TASKS[key]
    return getattr(importlib.import_module(f"data_pipeline.tasks.{module}"), cls)


def labels_from_data(name: str) -> bool:
    """Whether task `name` learns its label set from the training file (your own data): then
    `mode=predict` passes the labels recorded at fine-tuning."""
    return name in _TASKS and getattr(_task_class(name), "labels_from_data", False)


def get_task(name: str, data_dir: str = "", **kwargs) -> Task:
    """The task called `name` (see `TASK_NAMES`), reading from `data_dir` or TFDS.

    Keyword args go to the task's constructor: `source` ("files" | "tfds"), `tfds_data_dir`,
    `skip_bad_rows`, and task options (e.g. SQuAD's `null_score_diff_threshold`).
    """
    key = name.lower().replace("-", "").replace(".", "")
    key = {"squad": "squad_v1", "squadv1": "squad_v1", "squad11": "squad_v1", "squadv11": "squad_v1",
           "squadv2": "squad_v2", "squad20": "squad_v2", "squadv20": "squad_v2", "ner": "conll2003",
           "stsb": "stsb", "sst": "sst2"}.get(key, key)
    if key not in _TASKS:
        raise ValueError(f"config.task must be one of {sorted(TASK_NAMES)}, got {name!r}")
    task_cls = _task_class(key)
    return task_cls(key, data_dir, **kwargs) if _TASKS[key][0] == "glue" else task_cls(data_dir, **kwargs)


# ---------------------------------------------------------------------------------------------
# Featurization helpers
# ---------------------------------------------------------------------------------------------


def tokenize_all(tokenizer, texts: Sequence[str]) -> list[list[str]]:
    """Word pieces of each text, through the tokenizer's batch path when it has one."""
    if hasattr(tokenizer, "tokenize_batch"):
        return tokenizer.tokenize_batch(list(texts))
    return [tokenizer.tokenize(t) for t in texts]


def truncate_pair(tokens_a: list, tokens_b: list, max_length: int) -> None:
    """Google's `_truncate_seq_pair`: pop from the longer list until the pair fits (in place)."""
    while len(tokens_a) + len(tokens_b) > max_length:
        (tokens_a if len(tokens_a) > len(tokens_b) else tokens_b).pop()


def encode_pair(tokenizer, tokens_a: list, tokens_b: Optional[list], max_seq_length: int):
    """`[CLS] a [SEP] (b [SEP])` -> padded (input_ids, input_mask, segment_ids), truncating first.

    Example: a = ["the", "cat"], b = ["sat"], L = 8 ->
      ids of [CLS] the cat [SEP] sat [SEP] [PAD] [PAD]; mask 1 1 1 1 1 1 0 0; segments 0 0 0 0 1 1 0 0.
    """
    tokens_a = list(tokens_a)
    tokens_b = list(tokens_b) if tokens_b is not None else None
    if tokens_b is not None:
        truncate_pair(tokens_a, tokens_b, max_seq_length - 3)
    else:
        del tokens_a[max_seq_length - 2:]
    tokens = [CLS_TOKEN] + tokens_a + [SEP_TOKEN]
    segments = [0] * len(tokens)
    if tokens_b is not None:
        tokens += tokens_b + [SEP_TOKEN]
        segments += [1] * (len(tokens_b) + 1)
    return pad_row(tokenizer.convert_tokens_to_ids(tokens), segments, max_seq_length, pad_id_of(tokenizer))


def pad_id_of(tokenizer) -> int:
    """The id padding takes: a tokenizer.json's own (`tokenizer_json.TaskTokenizer.pad_id`), else 0 as
    Google's scripts pad."""
    return getattr(tokenizer, "pad_id", 0)


def pad_row(ids: list, segments: list, max_seq_length: int, pad_id: int = 0):
    n = len(ids)
    input_ids = np.full(max_seq_length, pad_id, np.int32)
    input_ids[:n] = ids
    mask = np.zeros(max_seq_length, np.int32)
    mask[:n] = 1
    seg = np.zeros(max_seq_length, np.int32)
    seg[:n] = segments
    return input_ids, mask, seg


def stack(rows: dict[str, list], dtypes: dict[str, Any]) -> dict[str, np.ndarray]:
    """Lists of per-row values -> arrays with the given dtypes (empty lists keep their shape)."""
    return {k: np.asarray(v, dtype=dtypes.get(k, np.int32)) for k, v in rows.items()}


def check_vocab(tokenizer) -> None:
    from data_pipeline import tokenization
    required = getattr(tokenizer, "required_tokens", (CLS_TOKEN, SEP_TOKEN, PAD_TOKEN, UNK_TOKEN))
    tokenization.require_tokens(tokenizer.vocab, getattr(tokenizer, "vocab_file", "the vocabulary"), required)


# ---------------------------------------------------------------------------------------------
# Reading helpers
# ---------------------------------------------------------------------------------------------


def read_tsv(path: str) -> list[list[str]]:
    """Tab-separated rows as GLUE's tools read them (no quoting; UTF-8, BOM dropped).

    Rows end at "\n" only, as `tf.gfile` lines do in Google's `_read_tsv`; a "\r" before it
    (CRLF files, e.g. MRPC's originals) is dropped, and a stray "\r" inside a field stays in
    the field (the tokenizer reads it as a space) instead of splitting the row in two.
    """
    lines = read_text(path, bom=True).split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last row, it does not start one
    return [(line[:-1] if line.endswith("\r") else line).split("\t") for line in lines]


def read_text(path: str, *, bom: bool = False) -> str:
    """A task file's text; bytes that are not UTF-8 raise `DataError` naming the line and column.

    Labelled data is not decoded with replacement: a mis-encoded file (Latin-1, cp1252) would
    train on U+FFFD silently, so it is named instead.
    """
    data = storage.read_bytes(path)  # local or gs://
    try:
        return data.decode("utf-8-sig" if bom else "utf-8")
    except UnicodeDecodeError as e:
        start = e.start + (3 if bom and data.startswith(b"\xef\xbb\xbf") else 0)  # utf-8-sig skips the BOM
        line = data.count(b"\n", 0, start) + 1
        column = start - (data.rfind(b"\n", 0, start) + 1) + 1
        raise DataError(f"{path}: line {line}, column {column}: byte 0x{data[start]:02x} is not valid UTF-8; "
                        "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def read_json(path: str) -> Any:
    """A JSON file's value; text that is not UTF-8 or not JSON raises `DataError` naming the
    file, line and column."""
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})") from None


_PREPARE_ONLY = [False]


@contextlib.contextmanager
def prepare_tfds_only():
    """Within it, `tfds_examples` only downloads and prepares the dataset it is asked for and
    yields no example, so `task.read(split)` prepares what the split needs and returns [].

    Multi-host fine-tuning runs this on host 0 before the other hosts read: N hosts preparing
    one dataset at once into a shared `tfds_data_dir` would collide.
    """
    _PREPARE_ONLY[0] = True
    try:
        yield
    finally:
        _PREPARE_ONLY[0] = False


def tfds_examples(name: str, split: str, data_dir: Optional[str]) -> Iterator[dict]:
    """`tfds.load(name, split)` as dicts of Python values (bytes decoded to str)."""
    from data_pipeline import tf_import

    with tf_import.keras_deferred():  # tfds imports TensorFlow: without Keras
        import tensorflow_datasets as tfds

    if _PREPARE_ONLY[0]:
        tfds.builder(name, data_dir=data_dir).download_and_prepare()
        return
    ds = tfds.load(name, split=split, data_dir=data_dir, shuffle_files=False)
    for ex in tfds.as_numpy(ds):
        yield _decode(ex)


def _decode(value):
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray) and value.dtype == object:
        return [_decode(v) for v in value.tolist()]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


@dataclasses.dataclass
class Split:
    """One split, read and featurized: what the loop evaluates and postprocesses."""

    name: str
    examples: list
    features: dict


def load_split(task: Task, split: str, tokenizer, max_seq_length: int, *, training: bool) -> Split:
    examples = task.read(split)
    if not examples:
        raise ValueError(f"task {task.name}: split {split!r} has no examples")
    return Split(split, examples, task.featurize(examples, tokenizer, max_seq_length, training=training))
