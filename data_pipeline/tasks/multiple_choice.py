"""SWAG (multiple choice): the csv files as distributed, four endings scored through [CLS].

`train.csv`, `val.csv`, `test.csv` (rowanz/swagaf `data/`) have the header
`,video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3,label`
(test: no label). Each choice is the pair `[CLS] sent1 [SEP] sent2 + " " + ending_i [SEP]`, as in
the paper's setup (a vector dotted with each choice's C, softmax over the four); features are
`[N, 4, L]`. Metric: accuracy.
"""

from __future__ import annotations

import csv
import dataclasses
import io

import numpy as np

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

from data_pipeline.tasks import Task, check_vocab, encode_pair, read_text, stack, tokenize_all
from data_pipeline.tasks.glue import accuracy

NUM_CHOICES = 4
_COLUMNS = ("sent1", "sent2") + tuple(f"ending{i}" for i in range(NUM_CHOICES))


@dataclasses.dataclass
class Example:
    guid: str
    context: str  # sent1
    start: str  # sent2, the beginning of the second sentence
    endings: list
    label: object  # int, or None when unlabelled
    where: str = ""


class Swag(Task):
    name = "swag"
    head = "multiple_choice"
    num_outputs = NUM_CHOICES
    labels = tuple(range(NUM_CHOICES))
    eval_splits = ("dev",)
    test_splits = ("test",)
    primary_metric = "accuracy"
    files = {"train": ("train.csv",), "dev": ("val.csv", "dev.csv"), "test": ("test.csv",)}

    def make_tokenizer(self, vocab_file, do_lower_case):
        from data_pipeline.tokenization.fast import FastTokenizer
        return FastTokenizer(vocab_file, do_lower_case)

    def read(self, split: str) -> list[Example]:
        if split not in self.files:
            raise ValueError(f"task {self.name} has no split {split!r}; expected one of {list(self.files)}")
        if self.source == "tfds":
            raise ValueError("SWAG is read from its csv files (config.data_source='files')")
        path = self._path(split, *self.files[split])
        examples = []
        with io.StringIO(read_text(path), newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise ValueError(f"{path}: empty file")
            columns = {c: i for i, c in enumerate(header)}
            missing = [c for c in _COLUMNS if c not in columns]
            if missing:
                raise ValueError(f"{path}: header {header} lacks the SWAG columns {missing}")
            labelled = "label" in columns
            for row, fields in enumerate(reader, start=2):
                if len(fields) != len(header):
                    self.rows.bad(path, row, f"{len(fields)} fields, expected {len(header)}")
                    continue
                label = None
                if labelled:
                    value = fields[columns["label"]]
                    if value not in {str(i) for i in range(NUM_CHOICES)}:
                        self.rows.bad(path, row, f"label {value!r} is not one of 0..{NUM_CHOICES - 1}")
                        continue
                    label = int(value)
                guid = fields[0] or str(row - 2)
                examples.append(Example(guid, fields[columns["sent1"]], fields[columns["sent2"]],
                                        [fields[columns[f"ending{i}"]] for i in range(NUM_CHOICES)], label,
                                        f"{path}:{row}"))
        return examples

    file_suffixes = (".csv",)
    line_format = f"the context, the start of the next sentence and its {NUM_CHOICES} endings, separated by tabs"

    def read_lines(self, path: str) -> list[Example]:
        """One example a line: sent1, sent2 and the endings, tab-separated (SWAG's columns)."""
        return [Example(str(number), parts[0], parts[1], parts[2:], None, where)
                for number, where, parts in self._lines(path, (2 + NUM_CHOICES,))]

    def featurize(self, examples, tokenizer, max_seq_length, *, training):
        del training
        check_vocab(tokenizer)
        contexts = tokenize_all(tokenizer, [e.context for e in examples])
        continuations = tokenize_all(tokenizer, [f"{e.start} {end}" for e in examples for end in e.endings])
        rows = {k: [] for k in ("input_ids", "input_mask", "segment_ids", "label", "weight", "example_index")}
        for i, e in enumerate(examples):
            choices = [encode_pair(tokenizer, contexts[i], continuations[i * NUM_CHOICES + c], max_seq_length)
                       for c in range(NUM_CHOICES)]
            for k, j in (("input_ids", 0), ("input_mask", 1), ("segment_ids", 2)):
                rows[k].append(np.stack([c[j] for c in choices]))  # [choices, length]
            rows["label"].append(0 if e.label is None else e.label)
            rows["weight"].append(0.0 if e.label is None else 1.0)
            rows["example_index"].append(i)
        return stack(rows, {"weight": np.float32})

    def postprocess(self, examples, features, outputs):
        return [int(i) for i in np.argmax(np.asarray(outputs["logits"]), axis=-1)]

    def score(self, examples, predictions):
        return {"accuracy": accuracy([e.label for e in examples], predictions)}

    def write_predictions(self, examples, predictions, directory, split):
        storage.makedirs(directory)
        path = storage_paths.join(directory, f"{self.name}_{split}_predictions.csv")
        with storage.open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["id", "pred", "label"])
            for e, p in zip(examples, predictions):
                writer.writerow([e.guid, p, "" if e.label is None else e.label])
        return [path]
