"""Your own sequence tagging (NER, chunking, any token labels): CoNLL-style columns or JSON Lines.

    python -m bert_jax.main --config=configs/own_data.py:tagging --workdir=W \\
        --config.init_checkpoint=CKPT --config.split_files.train=train.conll \\
        --config.split_files.dev=dev.conll

Files (splits: `files.py`):

- **conll** (any other suffix): one token a line, its tag in column `tag_column` (-1: the last)
  and the token in `token_column` (0); columns are tab-separated when the line has a tab (so a
  token may be a space-like character, as in character-per-line Chinese files), else split at
  whitespace. A blank line ends a sentence; `-DOCSTART-` lines are skipped. A test file may have
  the token column only (unlabelled; so may a dev file given to `mode=predict`).
- **jsonl** (`.jsonl`, `.json`): one sentence an object, `{"tokens": [...], "tags": [...]}` (keys
  `tokens_key`, `tags_key`; `id_key` names an id field, else the line number is the id).

The tag set is `labels` or discovered from the whole training file ("O" first, then by entity
type and B, I, E, S). `tag_scheme`: "bio" (IOB1 or IOB2), "bioes" (S- single-token entities, E-
ends), or "auto" (bioes when the training tags have an S- or E- tag). A tag that is neither "O"
nor `PREFIX-TYPE` with the scheme's prefixes, or a dev tag the training file does not have, is a
bad row naming the file and line.

Featurization, the head and post-processing are CoNLL-2003's (`ner.py`): a token's tag sits on
its first word piece, long sentences are cut into several rows at token boundaries. Scores: entity
precision/recall/F1 as conlleval counts them (BIOES: `ner.conlleval(scheme="bioes")`), token
accuracy and F1 per entity type. Predictions: conlleval's column file, and JSON Lines with each
sentence's id and predicted tags.
"""

from __future__ import annotations

import io
import json

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tasks import DataError, read_text
from data_pipeline.tasks.files import OwnFiles, parse_labels, read_jsonl
from data_pipeline.tasks.ner import Conll2003, Example, conlleval

SCHEMES = {"bio": ("B", "I"), "bioes": ("B", "I", "E", "S")}
_PREFIX_ORDER = {"B": 0, "I": 1, "E": 2, "S": 3}


def tag_order(tags) -> tuple:
    """"O" first, then by entity type, then B, I, E, S."""
    def key(tag):
        if tag == "O":
            return (0, "", 0)
        prefix, kind = tag.split("-", 1)
        return (1, kind, _PREFIX_ORDER.get(prefix, 9))
    return tuple(sorted(set(tags), key=key))


class Tagging(OwnFiles, Conll2003):
    """A tag per token, on each token's first word piece."""

    name = "tagging"
    suffixes = (".conll", ".txt", ".tsv", ".bio", ".bioes", ".iob", ".jsonl", ".json")
    file_suffixes = (".conll", ".bio", ".bioes", ".iob", ".jsonl", ".json")
    primary_metric = "f1"
    labels_from_data = True

    def __init__(self, data_dir: str = "", *, format: str = "auto", token_column: int = 0,
                 tag_column: int = -1, tokens_key: str = "tokens", tags_key: str = "tags", id_key: str = "",
                 tag_scheme: str = "auto", labels=(), dev_fraction: float = 0.0, split_seed: int = 0,
                 text_tokens: str = "words", **kwargs):
        super().__init__(data_dir, **kwargs)
        self._own_files(dev_fraction, split_seed)
        if format not in ("auto", "conll", "jsonl"):
            raise ValueError(f"config.task_options.format must be auto, conll or jsonl, got {format!r}")
        if tag_scheme not in ("auto", *SCHEMES):
            raise ValueError(f"config.task_options.tag_scheme must be auto, bio or bioes, got {tag_scheme!r}")
        if text_tokens not in ("words", "characters"):
            raise ValueError(f"config.task_options.text_tokens must be words or characters, got {text_tokens!r}")
        self.format, self.token_column, self.tag_column = format, int(token_column), int(tag_column)
        self.tokens_key, self.tags_key, self.id_key = tokens_key, tags_key, id_key
        self.text_tokens = text_tokens
        self._labels = tag_order(parse_labels(labels, "tagging")) if labels else ()
        self._given = bool(self._labels)
        self._scheme = tag_scheme if tag_scheme != "auto" else (self._scheme_of(self._labels) if labels else "")

    @staticmethod
    def _scheme_of(tags) -> str:
        return "bioes" if any(t[:2] in ("S-", "E-") for t in tags) else "bio"

    @property
    def scheme(self) -> str:
        if not self._scheme:
            self._scheme = self._scheme_of(self.labels)
        return self._scheme

    @property
    def labels(self) -> tuple:
        if not self._labels:
            path = self.split_path("train")
            if path is None:
                raise FileNotFoundError(f"task {self.name}: no training file to read the tags from: set "
                                        "config.split_files.train (or config.task_options.labels)")
            self._labels = tag_order(t for e in self._read_cached(path, "train") for t in e.tags)
            if len(self._labels) < 2:
                raise DataError(f"{path}: {len(self._labels)} distinct tag(s) {list(self._labels)}: "
                                "tagging needs at least two")
        return self._labels

    @property
    def num_outputs(self) -> int:
        return len(self.labels)

    # --- reading -------------------------------------------------------------------------------

    def _format(self, path: str) -> str:
        if self.format != "auto":
            return self.format
        return "jsonl" if storage_paths.basename(path).lower().endswith((".jsonl", ".json")) else "conll"

    def read_file(self, path: str, split: str) -> list[Example]:
        reader = self._read_jsonl if self._format(path) == "jsonl" else self._read_conll
        examples = [e for e in reader(path, split) if self._check(path, e, split)]
        if not examples:
            raise DataError(f"{path}: no usable sentence ({self.rows.counts.get(path, 0)} skipped as bad)")
        return examples

    def _check(self, path: str, ex: Example, split: str) -> bool:
        """Whether each tag is well formed and (outside the training file) a known tag."""
        if ex.tags is None:
            return True
        line = int(ex.where.rsplit(":", 1)[1])
        prefixes = SCHEMES.get(self._scheme or "bioes")
        known = self._labels if split == "train" else self.labels
        per_line = self._format(path) == "conll"  # a token a line: tag i is on line + i
        for i, tag in enumerate(ex.tags):
            prefix, _, kind = tag.partition("-")
            at = line + i if per_line else line
            if tag != "O" and (prefix not in prefixes or not kind):
                scheme = self._scheme or "bio or bioes"
                self.rows.bad(path, at, f"tag {tag!r} is neither O nor {'/'.join(prefixes)}-TYPE ({scheme})")
                return False
            if known and tag not in known:
                origin = "config.task_options.labels" if self._given else "the training file's tags"
                self.rows.bad(path, at, f"tag {tag!r} is not among {origin} {list(known)}")
                return False
        return True

    def _read_conll(self, path: str, split: str) -> list[Example]:
        examples: list = []
        words: list = []
        tags: list = []
        state = {"first": 0, "bad": False, "labelled": None}

        def flush():
            if words and not state["bad"]:
                examples.append(Example(list(words), list(tags) if state["labelled"] else None,
                                        f"{path}:{state['first']}", str(state["first"])))
            words.clear()
            tags.clear()
            state["bad"] = False

        for number, line in enumerate(io.StringIO(read_text(path, bom=True)), 1):
            line = line.rstrip("\r\n")
            fields = line.split("\t") if "\t" in line else line.split()
            if not line.strip() or fields[0] == "-DOCSTART-":
                flush()
                continue
            if not words:
                state["first"] = number
            labelled = len(fields) > 1
            if split == "train" and not labelled:
                self.rows.bad(path, number, f"{line!r} has no tag column")
                state["bad"] = True
            elif state["labelled"] is None:
                state["labelled"] = labelled
            try:
                word = fields[self.token_column]
                tag = fields[self.tag_column] if labelled else None
            except IndexError:
                self.rows.bad(path, number, f"{len(fields)} columns, token_column={self.token_column} and "
                                            f"tag_column={self.tag_column} need more")
                state["bad"] = True
                word, tag = "", None
            words.append(word)
            tags.append(tag)
            if labelled != state["labelled"] and not state["bad"]:
                self.rows.bad(path, number, "a line without a tag in a tagged sentence (or the reverse)")
                state["bad"] = True
        flush()
        return examples

    def _read_jsonl(self, path: str, split: str) -> list[Example]:
        examples = []
        for row in read_jsonl(path, self.rows)[1]:
            number, obj = row.number, row.values
            tokens, tags = obj.get(self.tokens_key), obj.get(self.tags_key)
            if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
                self.rows.bad(path, number, f"field {self.tokens_key!r} is not a non-empty list of strings")
                continue
            if tags is None and split != "train":
                pass  # an unlabelled sentence (predicted, not scored)
            elif (not isinstance(tags, list) or len(tags) != len(tokens)
                  or not all(isinstance(t, str) for t in tags)):
                self.rows.bad(path, number, f"field {self.tags_key!r} is not a list of {len(tokens)} strings "
                                            f"(one per token of {self.tokens_key!r})")
                continue
            if self.id_key and self.id_key not in obj:
                self.rows.bad(path, number, f"no field {self.id_key!r} (config.task_options.id_key)")
                continue
            examples.append(Example(list(tokens), list(tags) if tags is not None else None, f"{path}:{number}",
                                    str(obj[self.id_key]) if self.id_key else str(number)))
        return examples

    @property
    def line_format(self) -> str:
        return ("a sentence, each non-space character a token" if self.text_tokens == "characters"
                else "a sentence, its tokens separated by spaces")

    def read_lines(self, path: str) -> list[Example]:
        out = []
        for number, where, parts in self._lines(path, (1,)):
            tokens = list("".join(parts[0].split())) if self.text_tokens == "characters" else parts[0].split()
            out.append(Example(tokens, None, where, str(number)))
        return out

    # --- scores and predictions ----------------------------------------------------------------

    def score(self, examples, predictions):
        unlabelled = next((e for e in examples if e.tags is None), None)
        if unlabelled is not None:
            raise DataError(f"{unlabelled.where}: a sentence without tags, so the split cannot be scored")
        return conlleval([e.tags for e in examples], predictions, scheme=self.scheme)

    def write_predictions(self, examples, predictions, directory, split):
        """conlleval's column file (`ner.py`), and `<task>_<split>_predictions.jsonl`: each
        sentence's id, tokens and predicted tags."""
        paths = super().write_predictions(examples, predictions, directory, split)
        path = storage_paths.join(directory, f"{self.name}_{split}_predictions.jsonl")
        with storage.open(path, "w", encoding="utf-8") as f:
            for e, tags in zip(examples, predictions):
                f.write(json.dumps({"id": e.guid, "tokens": e.words, "tags": tags},
                                   ensure_ascii=False) + "\n")
        return paths + [path]
