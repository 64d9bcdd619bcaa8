"""GLUE: the nine tasks, from the tsv folders as distributed or from TFDS `glue/*`, official metrics.

| task | folder | text columns | label | metric(s) | submission |
|---|---|---|---|---|---|
| cola | CoLA  | sentence (col. 3, no header) | 0/1 | Matthews corr. | CoLA.tsv |
| sst2 | SST-2 | sentence | 0/1 | accuracy | SST-2.tsv |
| mrpc | MRPC  | #1 String, #2 String | Quality 0/1 | accuracy, F1 | MRPC.tsv |
| stsb | STS-B | sentence1, sentence2 | score 0-5 (regression) | Pearson, Spearman | STS-B.tsv |
| qqp  | QQP   | question1, question2 | is_duplicate | accuracy, F1 | QQP.tsv |
| mnli | MNLI  | sentence1, sentence2 | gold_label (3) | accuracy (matched, mismatched) | MNLI-m.tsv, MNLI-mm.tsv, AX.tsv |
| qnli | QNLI  | question, sentence | entailment/not_entailment | accuracy | QNLI.tsv |
| rte  | RTE   | sentence1, sentence2 | entailment/not_entailment | accuracy | RTE.tsv |
| wnli | WNLI  | sentence1, sentence2 | 0/1 | accuracy | WNLI.tsv |

Files are read by header name (GLUE's `download_glue_data.py` layout: `train.tsv`, `dev.tsv`,
`test.tsv`; MNLI `dev_matched.tsv` etc.), with the original releases as fallbacks: CoLA's
`in_domain_train.tsv`/`in_domain_dev.tsv` (CoLA has no header in train/dev, positional columns),
MRPC's `msr_paraphrase_train.txt`/`msr_paraphrase_test.txt`; the diagnostic set
(`diagnostic/diagnostic.tsv` next to `MNLI/`, TFDS `glue/ax`) is MNLI's split `test_ax`. A test
file without a label column is unlabelled: its predictions go to the GLUE server's submission
file (`index\\tprediction`).

Each task's `score` also reports `score`, the mean of its official metrics (the GLUE
leaderboard's per-task number, as a fraction), which picks the best checkpoint. F1 is of the
positive class "1" (MRPC equivalent, QQP duplicate), as the GLUE server computes it.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from typing import Optional, Sequence

import numpy as np

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tasks import DataError, Task, encode_pair, read_tsv, stack, tfds_examples, tokenize_all, check_vocab


@dataclasses.dataclass
class Example:
    guid: str  # the row's id (GLUE "index"/"id", or the row number)
    text_a: str
    text_b: Optional[str]
    label: object  # str for classification, float for regression, None when unlabelled
    where: str = ""  # file:row or tfds split:row


@dataclasses.dataclass(frozen=True)
class Spec:
    folder: str
    text_a: str
    text_b: Optional[str]
    label: str
    labels: tuple  # () = regression
    metrics: tuple
    tfds_keys: tuple  # (text_a, text_b or None)
    tfds_label_names: tuple  # TFDS ClassLabel names, mapped to `labels` by name or index
    submission: dict  # split -> file name on the GLUE server
    splits: dict  # split -> candidate file names
    tfds_splits: dict  # split -> TFDS split


_STD_SPLITS = {"train": ("train.tsv",), "dev": ("dev.tsv",), "test": ("test.tsv",)}
_STD_TFDS = {"train": "train", "dev": "validation", "test": "test"}

SPECS = {
    "cola": Spec("CoLA", "sentence", None, "label", ("0", "1"), ("mcc",), ("sentence", None),
                 ("unacceptable", "acceptable"), {"test": "CoLA.tsv"},
                 {"train": ("train.tsv", "in_domain_train.tsv"), "dev": ("dev.tsv", "in_domain_dev.tsv"),
                  "test": ("test.tsv",)}, _STD_TFDS),
    "sst2": Spec("SST-2", "sentence", None, "label", ("0", "1"), ("accuracy",), ("sentence", None),
                 ("negative", "positive"), {"test": "SST-2.tsv"}, _STD_SPLITS, _STD_TFDS),
    "mrpc": Spec("MRPC", "#1 String", "#2 String", "Quality", ("0", "1"), ("accuracy", "f1"),
                 ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), {"test": "MRPC.tsv"},
                 {"train": ("train.tsv", "msr_paraphrase_train.txt"), "dev": ("dev.tsv",),
                  "test": ("test.tsv", "msr_paraphrase_test.txt")}, _STD_TFDS),
    "stsb": Spec("STS-B", "sentence1", "sentence2", "score", (), ("pearson", "spearman"),
                 ("sentence1", "sentence2"), (), {"test": "STS-B.tsv"}, _STD_SPLITS, _STD_TFDS),
    "qqp": Spec("QQP", "question1", "question2", "is_duplicate", ("0", "1"), ("accuracy", "f1"),
                ("question1", "question2"), ("not_duplicate", "duplicate"), {"test": "QQP.tsv"},
                _STD_SPLITS, _STD_TFDS),
    "mnli": Spec("MNLI", "sentence1", "sentence2", "gold_label", ("contradiction", "entailment", "neutral"),
                 ("accuracy",), ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"),
                 {"test_matched": "MNLI-m.tsv", "test_mismatched": "MNLI-mm.tsv", "test_ax": "AX.tsv"},
                 {"train": ("train.tsv",), "dev_matched": ("dev_matched.tsv",),
                  "dev_mismatched": ("dev_mismatched.tsv",), "test_matched": ("test_matched.tsv",),
                  "test_mismatched": ("test_mismatched.tsv",),
                  # GLUE's diagnostic set, predicted by the MNLI model (the server wants AX.tsv).
                  "test_ax": (os.path.join("..", "diagnostic", "diagnostic.tsv"), "diagnostic.tsv")},
                 {"train": "train", "dev_matched": "validation_matched",
                  "dev_mismatched": "validation_mismatched", "test_matched": "test_matched",
                  "test_mismatched": "test_mismatched", "test_ax": "ax:test"}),
    "qnli": Spec("QNLI", "question", "sentence", "label", ("entailment", "not_entailment"), ("accuracy",),
                 ("question", "sentence"), ("entailment", "not_entailment"), {"test": "QNLI.tsv"},
                 _STD_SPLITS, _STD_TFDS),
    "rte": Spec("RTE", "sentence1", "sentence2", "label", ("entailment", "not_entailment"), ("accuracy",),
                ("sentence1", "sentence2"), ("entailment", "not_entailment"), {"test": "RTE.tsv"},
                _STD_SPLITS, _STD_TFDS),
    "wnli": Spec("WNLI", "sentence1", "sentence2", "label", ("0", "1"), ("accuracy",),
                 ("sentence1", "sentence2"), ("not_entailment", "entailment"), {"test": "WNLI.tsv"},
                 _STD_SPLITS, _STD_TFDS),
}


def _join(folder: str, name: str) -> str:
    """`folder/name`. A name that goes up (MNLI's `../diagnostic/diagnostic.tsv`) is resolved for a
    gs:// folder, whose object names no file system resolves; a local path keeps its `..`."""
    path = storage_paths.join(folder, name)
    if storage_paths.is_remote(path) and ".." in name.split("/"):
        s, rest = path.split("://", 1)
        path = f"{s}://{posixpath.normpath(rest)}"
    return path


# CoLA's train/dev files have no header: source, label, original label (or blank), sentence.
_COLA_POSITIONAL = {"label": 1, "sentence": 3}


# ---------------------------------------------------------------------------------------------
# Metrics (numpy; tests check them against scikit-learn and scipy)
# ---------------------------------------------------------------------------------------------


def accuracy(gold: Sequence, pred: Sequence) -> float:
    gold, pred = np.asarray(gold), np.asarray(pred)
    return float(np.mean(gold == pred)) if len(gold) else 0.0


def f1_binary(gold: Sequence, pred: Sequence, positive="1") -> float:
    gold, pred = np.asarray(gold) == positive, np.asarray(pred) == positive
    tp = np.sum(gold & pred)
    denom = 2 * tp + np.sum(~gold & pred) + np.sum(gold & ~pred)
    return float(2 * tp / denom) if denom else 0.0


def macro_f1(gold: Sequence, pred: Sequence) -> float:
    """F1 averaged over the labels found in gold or predictions (scikit-learn's `average="macro"`)."""
    gold, pred = np.asarray(gold), np.asarray(pred)
    scores = []
    for label in sorted(set(gold.tolist()) | set(pred.tolist())):
        g, p = gold == label, pred == label
        tp = np.sum(g & p)
        denom = 2 * tp + np.sum(~g & p) + np.sum(g & ~p)
        scores.append(2 * tp / denom if denom else 0.0)
    return float(np.mean(scores)) if scores else 0.0


def matthews_corrcoef(gold: Sequence, pred: Sequence) -> float:
    """Matthews correlation, multi-class form (Gorodkin 2004); 0 when undefined, as scikit-learn."""
    classes = sorted(set(gold) | set(pred))
    index = {c: i for i, c in enumerate(classes)}
    c = np.zeros((len(classes), len(classes)), np.float64)
    for g, p in zip(gold, pred):
        c[index[g], index[p]] += 1
    t, p = c.sum(1), c.sum(0)  # true and predicted counts per class
    n, correct = c.sum(), np.trace(c)
    cov_ytyp = correct * n - t @ p
    cov_ypyp = n * n - p @ p
    cov_ytyt = n * n - t @ t
    if cov_ypyp * cov_ytyt == 0:
        return 0.0
    return float(cov_ytyp / np.sqrt(cov_ytyt * cov_ypyp))


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    x, y = x - x.mean(), y - y.mean()
    denom = np.sqrt(np.sum(x * x) * np.sum(y * y))
    return float(np.sum(x * y) / denom) if denom else 0.0


def rankdata(x: Sequence[float]) -> np.ndarray:
    """Ranks 1..n, ties get their average rank."""
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), np.float64)
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    return pearson(rankdata(x), rankdata(y))


METRICS = {"accuracy": accuracy, "f1": f1_binary, "macro_f1": macro_f1, "mcc": matthews_corrcoef,
           "pearson": pearson, "spearman": spearman}


def featurize_texts(examples: Sequence, tokenizer, max_seq_length: int, labels: tuple, *,
                    pair: bool) -> dict:
    """`[CLS] a [SEP] (b [SEP])` rows of examples with `text_a`, `text_b` and `label` (a label of
    `labels`, a float when `labels` is empty, or None: weight 0)."""
    check_vocab(tokenizer)
    tokens_a = tokenize_all(tokenizer, [e.text_a for e in examples])
    tokens_b = tokenize_all(tokenizer, [e.text_b for e in examples]) if pair else [None] * len(examples)
    index = {label: i for i, label in enumerate(labels)}
    rows = {k: [] for k in ("input_ids", "input_mask", "segment_ids", "label", "weight", "example_index")}
    for i, (e, a, b) in enumerate(zip(examples, tokens_a, tokens_b)):
        ids, mask, seg = encode_pair(tokenizer, a, b, max_seq_length)
        rows["input_ids"].append(ids)
        rows["input_mask"].append(mask)
        rows["segment_ids"].append(seg)
        if e.label is None:
            rows["label"].append(0)
        else:
            rows["label"].append(index[e.label] if labels else float(e.label))
        rows["weight"].append(0.0 if e.label is None else 1.0)
        rows["example_index"].append(i)
    return stack(rows, {"label": np.int32 if labels else np.float32, "weight": np.float32})


# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------


class GlueTask(Task):
    """One GLUE task; `name` picks the row of `SPECS`."""

    def __init__(self, name: str, data_dir: str = "", **kwargs):
        if name not in SPECS:
            raise ValueError(f"unknown GLUE task {name!r}; expected one of {sorted(SPECS)}")
        self.name = name
        self.spec = SPECS[name]
        super().__init__(data_dir, **kwargs)
        self.labels = self.spec.labels
        self.head = "classification" if self.labels else "regression"
        self.num_outputs = len(self.labels) if self.labels else 1
        self.primary_metric = "score"
        self.eval_splits = tuple(s for s in self.spec.splits if s.startswith("dev"))
        self.test_splits = tuple(s for s in self.spec.splits if s.startswith("test"))

    def make_tokenizer(self, vocab_file: str, do_lower_case: bool):
        from data_pipeline.tokenization.fast import FastTokenizer  # memoized: same tokens as FullTokenizer, much faster
        return FastTokenizer(vocab_file, do_lower_case)

    def _folder(self) -> str:
        nested = storage_paths.join(self.data_dir, self.spec.folder)
        return nested if storage.isdir(nested) else self.data_dir

    # --- reading -------------------------------------------------------------------------------

    def read(self, split: str) -> list[Example]:
        if split not in self.spec.splits:
            raise ValueError(f"task {self.name} has no split {split!r}; expected one of {list(self.spec.splits)}")
        if self.source == "tfds":
            return self._read_tfds(split)
        folder = self._folder()
        if split in self.split_files:
            return self._read_file(self._path(split))
        for name in self.spec.splits[split]:
            path = _join(folder, name)
            if storage.exists(path):
                return self._read_file(path)
        raise FileNotFoundError(f"task {self.name}: no {' or '.join(self.spec.splits[split])} in {folder}")

    def _label(self, value: str, where: str, row) -> object:
        """A checked label: in the label set, or a float in [0, 5] for STS-B; None = bad row."""
        if not self.labels:
            try:
                score = float(value)
            except ValueError:
                score = float("nan")
            if not 0.0 <= score <= 5.0:
                self.rows.bad(where, row, f"similarity score {value!r} is not a number in [0, 5]")
                return None
            return score
        if value not in self.labels:
            self.rows.bad(where, row, f"label {value!r} is not one of {list(self.labels)}")
            return None
        return value

    def _read_file(self, path: str) -> list[Example]:
        spec = self.spec
        lines = read_tsv(path)
        if not lines:
            raise ValueError(f"{path}: empty file")
        header = lines[0]
        headerless = self.name == "cola" and spec.text_a not in header
        if headerless:
            columns, body, first_row = _COLA_POSITIONAL, lines, 1
        else:
            columns, body, first_row = {c: i for i, c in enumerate(header)}, lines[1:], 2
        for needed in (spec.text_a, spec.text_b):
            if needed is not None and needed not in columns:
                raise ValueError(f"{path}: header {header} has no column {needed!r}")
        labelled = spec.label in columns
        id_column = next((columns[c] for c in ("index", "id") if c in columns), None)
        width = len(header) if not headerless else 4
        examples = []
        for offset, fields in enumerate(body):
            row = first_row + offset  # 1-based line number
            if fields == [""]:
                continue  # a trailing blank line
            if len(fields) != width:  # missing or extra columns: which text is which is unknown
                self.rows.bad(path, row, f"{len(fields)} tab-separated fields, expected {width}")
                continue
            label = self._label(fields[columns[spec.label]], path, row) if labelled else None
            if labelled and label is None:
                continue
            guid = fields[id_column] if id_column is not None else str(row - first_row)
            text_b = fields[columns[spec.text_b]] if spec.text_b else None
            examples.append(Example(guid, fields[columns[spec.text_a]], text_b, label, f"{path}:{row}"))
        if not examples:
            rows = sum(fields != [""] for fields in body)
            raise DataError(f"{path}: no rows after the header" if not rows else
                            f"{path}: none of its {rows} rows is usable ({self.rows.counts.get(path, 0)} "
                            "skipped as bad)")
        return examples

    def _read_tfds(self, split: str) -> list[Example]:
        spec = self.spec
        config, tfds_split = self.name, spec.tfds_splits[split]
        if ":" in tfds_split:  # another GLUE config (MNLI's diagnostic: glue/ax)
            config, tfds_split = tfds_split.split(":")
        where = f"tfds glue/{config}:{tfds_split}"
        examples = []
        for row, ex in enumerate(tfds_examples(f"glue/{config}", tfds_split, self.tfds_data_dir)):
            raw = ex["label"]
            if self.labels:
                if raw == -1:  # TFDS marks unlabelled test examples with -1
                    label = None
                elif not 0 <= raw < len(spec.tfds_label_names):
                    self.rows.bad(where, row, f"label id {raw} outside 0..{len(spec.tfds_label_names) - 1}")
                    continue
                else:
                    name = spec.tfds_label_names[raw]
                    label = name if name in self.labels else str(raw)
            else:
                label = None if split.startswith("test") else self._label(str(raw), where, row)
                if label is None and not split.startswith("test"):
                    continue
            a, b = spec.tfds_keys
            examples.append(Example(str(ex.get("idx", row)), ex[a], ex[b] if b else None, label,
                                    f"{where}:{row}"))
        return examples

    file_suffixes = (".tsv",)

    def file_names(self) -> set:
        return {storage_paths.basename(n) for names in self.spec.splits.values() for n in names}

    @property
    def line_format(self) -> str:
        return "a sentence" if self.spec.text_b is None else "two texts separated by a tab"

    def read_lines(self, path: str) -> list[Example]:
        """One example a line: a sentence, or for a pair task the two texts separated by a tab;
        its id is the line number."""
        fields = (1,) if self.spec.text_b is None else (2,)
        return [Example(str(number), parts[0], parts[1] if self.spec.text_b else None, None, where)
                for number, where, parts in self._lines(path, fields)]

    # --- features ------------------------------------------------------------------------------

    def featurize(self, examples, tokenizer, max_seq_length, *, training):
        del training
        return featurize_texts(examples, tokenizer, max_seq_length, self.labels, pair=self.spec.text_b is not None)

    # --- predictions and scores ----------------------------------------------------------------

    def postprocess(self, examples, features, outputs):
        """A label (or a score, for STS-B) per example, from `outputs["logits"]`."""
        logits = np.asarray(outputs["logits"])
        if not self.labels:
            return [float(x) for x in logits.reshape(-1)]
        return [self.labels[int(i)] for i in np.argmax(logits, axis=-1)]

    def score(self, examples, predictions):
        gold = [e.label for e in examples]
        if any(g is None for g in gold):
            raise ValueError(f"task {self.name}: cannot score unlabelled examples")
        results = {m: METRICS[m](gold, predictions) for m in self.spec.metrics}
        results["score"] = float(np.mean(list(results.values())))
        return results

    def split_name(self, split: str) -> str:
        return {"dev_matched": "dev_m", "dev_mismatched": "dev_mm"}.get(split, split)

    def write_predictions(self, examples, predictions, directory, split):
        """`<split>_predictions.tsv` (index, prediction, label); test splits: the server's file too."""
        storage.makedirs(directory)
        fmt = (lambda p: f"{p:.6f}") if not self.labels else str
        path = storage_paths.join(directory, f"{self.name}_{split}_predictions.tsv")
        with storage.open(path, "w", encoding="utf-8") as f:
            f.write("index\tprediction\tlabel\n")
            for e, p in zip(examples, predictions):
                f.write(f"{e.guid}\t{fmt(p)}\t{'' if e.label is None else e.label}\n")
        paths = [path]
        if split in self.spec.submission:
            paths.append(self.write_submission(examples, predictions, directory, split))
        return paths

    def write_submission(self, examples, predictions, directory, split) -> str:
        """The GLUE server's format: `index\\tprediction`, in the test file's order."""
        path = storage_paths.join(directory, self.spec.submission[split])
        with storage.open(path, "w", encoding="utf-8") as f:
            f.write("index\tprediction\n")
            for e, p in zip(examples, predictions):
                value = f"{min(max(p, 0.0), 5.0):.3f}" if not self.labels else p
                f.write(f"{e.guid}\t{value}\n")
        return path
