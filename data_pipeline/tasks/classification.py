"""Your own text classification and regression: CSV, TSV or JSON Lines, columns chosen by name.

    python -m bert_jax.main --config=configs/own_data.py:classification --workdir=W \\
        --config.init_checkpoint=CKPT --config.split_files.train=reviews.csv \\
        --config.task_options.text_column=review --config.task_options.dev_fraction=0.1

One text (`text_column`) or a pair (`text_b_column`), a label column (`label_column`), an optional
id column (`id_column`, else the row's line number is its id). Splits and formats: `files.py`.

- **classification**: the labels are `labels` (given, in the head's order) or discovered from the
  whole training file (sorted; numerically when all are integers). Scores: accuracy, macro-F1
  (over the labels in gold or predictions, as scikit-learn) and Matthews correlation;
  `primary_metric` (accuracy) picks the best checkpoint.
- **regression**: a number per row. Scores: Pearson and Spearman (`primary_metric`: pearson).

Bad rows name the file, the row and the column: an empty text, a missing or unknown label (a dev
label the training file does not have), a number that is not one, a ragged row. A dev or test
file without the label column (a test file also with it empty) is unlabelled: it is predicted,
not scored (fine-tuning needs a labelled dev split).
Predictions: `<task>_<split>_predictions.csv` with `id,prediction,label` in the file's order.
"""

from __future__ import annotations

import csv
import math
from typing import Optional

import numpy as np

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tasks import DataError, Task
from data_pipeline.tasks.files import (OwnFiles, labels_in_order, parse_labels, read_table, require_columns,
                                       table_format)
from data_pipeline.tasks.glue import METRICS, Example, featurize_texts


class Classification(OwnFiles, Task):
    """One text or a pair of texts -> one of a set of labels."""

    name = "classification"
    head = "classification"
    suffixes = (".csv", ".tsv", ".jsonl", ".json")
    file_suffixes = suffixes
    metrics = ("accuracy", "macro_f1", "mcc")
    labels_from_data = True  # `mode=predict` passes the labels recorded at fine-tuning

    def __init__(self, data_dir: str = "", *, text_column: str = "text", text_b_column: str = "",
                 label_column: str = "label", id_column: str = "", labels=(), format: str = "auto",
                 dev_fraction: float = 0.0, split_seed: int = 0, primary_metric: str = "",
                 **kwargs):
        super().__init__(data_dir, **kwargs)
        self._own_files(dev_fraction, split_seed)
        self.columns = {"text_column": text_column, "text_b_column": text_b_column,
                        "label_column": label_column, "id_column": id_column}
        if not text_column or not label_column:
            raise ValueError("config.task_options.text_column and label_column name the file's columns; "
                             "neither may be empty")
        self.format = format
        self._labels = parse_labels(labels, "classification") if self.head == "classification" else ()
        self._given = bool(self._labels)
        self.primary_metric = primary_metric or self.metrics[0]
        if self.primary_metric not in self.metrics:
            raise ValueError(f"config.task_options.primary_metric must be one of {self.metrics}, "
                             f"got {primary_metric!r}")

    # --- labels --------------------------------------------------------------------------------

    @property
    def labels(self) -> tuple:
        if self.head == "classification" and not self._labels:
            self._labels = self._discover_labels()
        return self._labels

    @property
    def num_outputs(self) -> int:
        return len(self.labels) if self.head == "classification" else 1

    def _discover_labels(self) -> tuple:
        path = self.split_path("train")
        if path is None:
            raise FileNotFoundError(f"task {self.name}: no training file to read the labels from: set "
                                    "config.split_files.train (or config.task_options.labels)")
        found = [e.label for e in self._read_cached(path, "train")]
        labels = labels_in_order(found)
        if len(labels) < 2:
            raise DataError(f"{path}: column {self.columns['label_column']!r} has {len(labels)} distinct "
                            f"label(s) {list(labels)}: classification needs at least two")
        return labels

    # --- reading -------------------------------------------------------------------------------

    @property
    def line_format(self) -> str:
        return "a text" if not self.columns["text_b_column"] else "two texts separated by a tab"

    def read_file(self, path: str, split: str) -> list[Example]:
        fmt = table_format(path, self.format)
        columns, rows = read_table(path, fmt, self.rows)
        text_a, text_b, label_col, id_col = (self.columns[k] for k in
                                             ("text_column", "text_b_column", "label_column", "id_column"))
        required = {"text_column": text_a, "text_b_column": text_b, "id_column": id_col}
        labelled = label_col in columns
        if split == "train":  # dev and test files without the label column are unlabelled
            required["label_column"] = label_col
        require_columns(path, columns, required)
        # Training file: the given labels, or none yet (they are discovered from it); other files:
        # the training file's.
        known = self._labels if split == "train" or self.head == "regression" else self.labels
        examples = []
        for row in rows:
            texts = []
            for column in (text_a, text_b):
                if not column:
                    texts.append(None)
                    continue
                value = self._text(path, row, column)
                if value is None:
                    break
                texts.append(value)
            else:
                label = self._label(path, row, label_col, split, known) if labelled else None
                if label is False:
                    continue
                guid = str(row.values[id_col]) if id_col else str(row.number)
                examples.append(Example(guid, texts[0], texts[1], label, f"{path}:{row.number}"))
        if not examples:
            raise DataError(f"{path}: no usable row ({len(rows)} rows; {self.rows.counts.get(path, 0)} "
                            "skipped as bad)")
        return examples

    def _text(self, path, row, column) -> Optional[str]:
        value = row.values.get(column)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            self.rows.bad(path, row.number, f"column {column!r} is " +
                          ("empty" if value in (None, "") or isinstance(value, str) else
                           f"a JSON {type(value).__name__}, not text"))
            return None
        return value

    def _label(self, path, row, column, split, known):
        """The row's label; None: unlabelled (test); False: a bad row (counted or raised)."""
        value = row.values.get(column)
        if value is None or (isinstance(value, str) and not value.strip()):
            if split == "test":
                return None
            self.rows.bad(path, row.number, f"column {column!r} (the label) is empty")
            return False
        if self.head == "regression":
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number):
                self.rows.bad(path, row.number, f"column {column!r}: {value!r} is not a finite number")
                return False
            return number
        label = str(value).strip()
        if known and label not in known:
            origin = "config.task_options.labels" if self._given else "the training file's labels"
            self.rows.bad(path, row.number, f"column {column!r}: label {label!r} is not among "
                                            f"{origin} {list(known)}")
            return False
        return label

    def read_lines(self, path: str) -> list[Example]:
        pair = bool(self.columns["text_b_column"])
        return [Example(str(number), parts[0], parts[1] if pair else None, None, where)
                for number, where, parts in self._lines(path, (2,) if pair else (1,))]

    # --- features, predictions, scores ---------------------------------------------------------

    def featurize(self, examples, tokenizer, max_seq_length, *, training):
        del training
        return featurize_texts(examples, tokenizer, max_seq_length, self.labels,
                               pair=bool(self.columns["text_b_column"]))

    def make_tokenizer(self, vocab_file: str, do_lower_case: bool):
        from data_pipeline.tokenization.fast import FastTokenizer  # memoized: the same tokens as FullTokenizer, faster
        return FastTokenizer(vocab_file, do_lower_case)

    def postprocess(self, examples, features, outputs):
        logits = np.asarray(outputs["logits"])
        if self.head == "regression":
            return [float(x) for x in logits.reshape(-1)]
        return [self.labels[int(i)] for i in np.argmax(logits, axis=-1)]

    def score(self, examples, predictions):
        gold = [e.label for e in examples]
        unlabelled = next((e for e in examples if e.label is None), None)
        if unlabelled is not None:
            raise DataError(f"{unlabelled.where}: no label, so the split cannot be scored (its file "
                            f"lacks column {self.columns['label_column']!r} or leaves it empty)")
        return {m: METRICS[m](gold, predictions) for m in self.metrics}

    def write_predictions(self, examples, predictions, directory, split):
        """`<task>_<split>_predictions.csv`: the row's id, the prediction and the gold label."""
        storage.makedirs(directory)
        path = storage_paths.join(directory, f"{self.name}_{split}_predictions.csv")
        fmt = repr if self.head == "regression" else str  # a float in full
        with storage.open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["id", "prediction", "label"])
            for e, p in zip(examples, predictions):
                writer.writerow([e.guid, fmt(p), "" if e.label is None else e.label])
        return [path]


class Regression(Classification):
    """One text or a pair of texts -> a number."""

    name = "regression"
    head = "regression"
    metrics = ("pearson", "spearman")
    labels_from_data = False
