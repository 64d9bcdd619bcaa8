"""CoNLL-2003 named-entity recognition: column files or TFDS `conll2003`, conlleval scoring.

Reading: one token per line, the word in the first column and the NER tag in the last
(`EU NNP B-NP B-ORG`); a blank line ends a sentence; `-DOCSTART-` lines are skipped. Files:
`train.txt`/`valid.txt`/`test.txt` (the common layout) or the original `eng.train`/`eng.testa`/
`eng.testb`. Tags may be IOB1 (the original release: B- only between two adjacent entities of the
same type) or IOB2 (every entity starts with B-); a tag outside the label set is a bad row.

Featurization (the paper's setup, no CRF): the sentence's words are joined with spaces and
tokenized with character offsets; a word's label sits on its first word piece, the other pieces
carry weight 0. A sentence longer than `max_seq_length - 2` pieces is cut into several rows at
word boundaries (nothing is dropped); a word whose pieces would not fit one row alone keeps only
its leading pieces.

Scoring is conlleval's (the CoNLL shared task's Perl script), reimplemented with the same chunk
start/end rules, so IOB1 and IOB2 both score as the script does: entity-level precision, recall
and F1 (as fractions), token accuracy, and F1 per entity type.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
from typing import Optional, Sequence

import numpy as np

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tokenization import CLS_TOKEN, SEP_TOKEN

from data_pipeline.tasks import Task, check_vocab, pad_id_of, pad_row, read_text, stack, tfds_examples

CONLL_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")


@dataclasses.dataclass
class Example:
    words: list
    tags: Optional[list]  # None when unlabelled
    where: str = ""
    guid: str = ""  # the sentence's own id (tagging.py's JSON Lines id), else its place


# ---------------------------------------------------------------------------------------------
# conlleval
# ---------------------------------------------------------------------------------------------


def _split_tag(tag: str) -> tuple[str, str]:
    """"B-PER" -> ("B", "PER"); "O" -> ("O", "")."""
    if "-" in tag:
        prefix, kind = tag.split("-", 1)
        return prefix, kind
    return tag, ""


def _end_of_chunk(prev_tag, tag, prev_type, type_) -> bool:
    end = (prev_tag, tag) in {("B", "B"), ("B", "O"), ("I", "B"), ("I", "O"), ("E", "E"), ("E", "I"),
                              ("E", "O"), ("I", "O")}
    if prev_tag not in ("O", ".") and prev_type != type_:
        end = True
    return end or prev_tag in ("]", "[")


def _start_of_chunk(prev_tag, tag, prev_type, type_) -> bool:
    start = (prev_tag, tag) in {("B", "B"), ("I", "B"), ("O", "B"), ("O", "I"), ("E", "E"), ("E", "I"),
                                ("O", "E"), ("O", "I")}
    if tag not in ("O", ".") and prev_type != type_:
        start = True
    return start or tag in ("[", "]")


def _end_of_chunk_bioes(prev_tag, tag, prev_type, type_) -> bool:
    """BIOES: E- and S- close their entity; B/I end before B, S or O; a type change ends."""
    end = prev_tag in ("E", "S") or (prev_tag, tag) in {("B", "B"), ("B", "S"), ("B", "O"), ("I", "B"),
                                                          ("I", "S"), ("I", "O")}
    return end or (prev_tag != "O" and prev_type != type_)


def _start_of_chunk_bioes(prev_tag, tag, prev_type, type_) -> bool:
    """BIOES: B- and S- open an entity; I/E open one after O, E or S; a type change opens."""
    start = tag in ("B", "S") or (prev_tag, tag) in {("E", "E"), ("E", "I"), ("S", "E"), ("S", "I"),
                                                       ("O", "E"), ("O", "I")}
    return start or (tag != "O" and prev_type != type_)


CHUNK_RULES = {"bio": (_end_of_chunk, _start_of_chunk), "bioes": (_end_of_chunk_bioes, _start_of_chunk_bioes)}


def conlleval(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]], scheme: str = "bio") -> dict:
    """conlleval's counts over sentences of tags: precision, recall, f1, accuracy, per-type f1.

    Sentence boundaries act as "O" tokens (the script's boundary lines), so no entity spans two
    sentences. `scheme` "bio" is the Perl script's chunk rules (IOB1, IOB2); "bioes" adds S- (a
    one-token entity) and E- (an entity's last token) as seqeval's default mode reads them, with
    the same counting (conlleval.pl has no S- and reads E- as the IOE scheme's).
    """
    if scheme not in CHUNK_RULES:
        raise ValueError(f"tag scheme must be one of {sorted(CHUNK_RULES)}, got {scheme!r}")
    end_of_chunk, start_of_chunk = CHUNK_RULES[scheme]
    correct_chunks = found_gold = found_pred = correct_tags = tokens = 0
    per_type: dict = {}

    def bump(kind, key):
        per_type.setdefault(kind, [0, 0, 0])[key] += 1

    last_gold, last_pred, last_gold_type, last_pred_type = "O", "O", "", ""
    in_correct = False
    stream = []
    for g_sent, p_sent in zip(gold, predicted):
        if len(g_sent) != len(p_sent):
            raise ValueError(f"a sentence has {len(g_sent)} gold tags but {len(p_sent)} predicted")
        stream.extend(zip(g_sent, p_sent, [False] * len(g_sent)))
        stream.append(("O", "O", True))  # the boundary line
    for g, p, boundary in stream:
        g_tag, g_type = _split_tag(g)
        p_tag, p_type = _split_tag(p)
        if in_correct:
            g_end = end_of_chunk(last_gold, g_tag, last_gold_type, g_type)
            p_end = end_of_chunk(last_pred, p_tag, last_pred_type, p_type)
            if g_end and p_end and last_pred_type == last_gold_type:
                in_correct = False
                correct_chunks += 1
                bump(last_gold_type, 0)
            elif g_end != p_end or g_type != p_type:
                in_correct = False
        g_start = start_of_chunk(last_gold, g_tag, last_gold_type, g_type)
        p_start = start_of_chunk(last_pred, p_tag, last_pred_type, p_type)
        if g_start and p_start and p_type == g_type:
            in_correct = True
        if g_start:
            found_gold += 1
            bump(g_type, 1)
        if p_start:
            found_pred += 1
            bump(p_type, 2)
        if not boundary:
            correct_tags += int(g_tag == p_tag and g_type == p_type)
            tokens += 1
        last_gold, last_pred, last_gold_type, last_pred_type = g_tag, p_tag, g_type, p_type
    if in_correct:
        correct_chunks += 1
        bump(last_gold_type, 0)

    def prf(correct, n_gold, n_pred):
        precision = correct / n_pred if n_pred else 0.0
        recall = correct / n_gold if n_gold else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        return precision, recall, f1

    precision, recall, f1 = prf(correct_chunks, found_gold, found_pred)
    out = {"precision": precision, "recall": recall, "f1": f1,
           "accuracy": correct_tags / tokens if tokens else 0.0,
           "entities_gold": found_gold, "entities_predicted": found_pred, "entities_correct": correct_chunks}
    for kind, (c, n_gold, n_pred) in sorted(per_type.items()):
        if kind:
            out[f"f1_{kind}"] = prf(c, n_gold, n_pred)[2]
    return out


# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------


class Conll2003(Task):
    """CoNLL-2003 English NER, token classification on each word's first piece."""

    name = "conll2003"
    head = "token"
    labels = CONLL_LABELS
    num_outputs = len(CONLL_LABELS)
    eval_splits = ("dev", "test")
    primary_metric = "f1"
    files = {"train": ("train.txt", "eng.train"), "dev": ("valid.txt", "dev.txt", "eng.testa"),
             "test": ("test.txt", "eng.testb")}

    def read(self, split: str) -> list[Example]:
        if split not in self.files:
            raise ValueError(f"task {self.name} has no split {split!r}; expected one of {list(self.files)}")
        if self.source == "tfds":
            return self._read_tfds(split)
        path = self._path(split, *self.files[split])
        examples: list = []
        words: list = []
        tags: list = []
        bad = False
        first_line = 0

        def flush():
            if words and not bad:
                examples.append(Example(list(words), list(tags), f"{path}:{first_line}"))

        with io.StringIO(read_text(path)) as f:
            for number, line in enumerate(f, 1):
                fields = line.split()
                if not fields or fields[0] == "-DOCSTART-":
                    flush()
                    words, tags, bad = [], [], False
                    continue
                if not words:
                    first_line = number
                if len(fields) < 2:
                    self.rows.bad(path, number, f"{line.strip()!r} has no tag column")
                    bad = True
                elif fields[-1] not in self.labels:
                    self.rows.bad(path, number, f"tag {fields[-1]!r} is not one of {list(self.labels)}")
                    bad = True
                words.append(fields[0])
                tags.append(fields[-1])
            flush()
        return examples

    def _read_tfds(self, split: str) -> list[Example]:
        names = CONLL_LABELS  # TFDS conll2003's ClassLabel order is the same
        where = f"tfds conll2003:{split}"
        examples = []
        for row, ex in enumerate(tfds_examples("conll2003", split, self.tfds_data_dir)):
            ids = ex["ner"]
            if any(not 0 <= i < len(names) for i in ids):
                self.rows.bad(where, row, f"tag ids {ids} outside 0..{len(names) - 1}")
                continue
            examples.append(Example(list(ex["tokens"]), [names[i] for i in ids], f"{where}:{row}"))
        return examples

    # --- features ------------------------------------------------------------------------------

    def featurize(self, examples, tokenizer, max_seq_length, *, training):
        del training
        check_vocab(tokenizer)
        cls_id, sep_id = tokenizer.vocab[CLS_TOKEN], tokenizer.vocab[SEP_TOKEN]
        keys = ("input_ids", "input_mask", "segment_ids", "label_ids", "label_weights", "weight",
                "example_index", "word_index")
        rows = {k: [] for k in keys}
        room = max_seq_length - 2
        for index, ex in enumerate(self._progress(examples, "featurize")):
            starts, text = [], ""
            for w in ex.words:
                starts.append(len(text) + (1 if text else 0))
                text = f"{text} {w}" if text else w
            pieces, spans = tokenizer.tokenize_with_offsets(text)
            ids = tokenizer.convert_tokens_to_ids(pieces)
            word_of = [bisect.bisect_right(starts, s) - 1 for s, _ in spans]  # word of each piece
            # Rows of at most `room` pieces, cut between words; a word longer than a whole row
            # keeps only its leading pieces.
            by_word: list = []
            for j, w in enumerate(word_of):
                if not by_word or by_word[-1][0] != w:
                    by_word.append((w, []))
                by_word[-1][1].append(j)
            chunks, current = [], []
            for w, js in by_word:
                js = js[:room]
                if current and len(current) + len(js) > room:
                    chunks.append(current)
                    current = []
                current = current + [(w, j, j == js[0]) for j in js]
            chunks.append(current)
            for chunk in chunks:
                label_ids = np.zeros(max_seq_length, np.int32)
                label_weights = np.zeros(max_seq_length, np.float32)
                word_index = np.full(max_seq_length, -1, np.int32)
                for position, (w, _, first) in enumerate(chunk, start=1):
                    if first:
                        word_index[position] = w
                        if ex.tags is not None:
                            label_ids[position] = self.labels.index(ex.tags[w])
                            label_weights[position] = 1.0
                piece_ids = [ids[j] for _, j, _ in chunk]
                input_ids, mask, seg = pad_row([cls_id] + piece_ids + [sep_id], [0] * (len(chunk) + 2),
                                               max_seq_length, pad_id_of(tokenizer))
                for k, v in (("input_ids", input_ids), ("input_mask", mask), ("segment_ids", seg),
                             ("label_ids", label_ids), ("label_weights", label_weights),
                             ("weight", 1.0 if ex.tags is not None else 0.0), ("example_index", index),
                             ("word_index", word_index)):
                    rows[k].append(v)
        return stack(rows, {"label_weights": np.float32, "weight": np.float32})

    line_format = "a sentence, its words separated by spaces"
    file_suffixes = (".conll",)

    def read_lines(self, path: str) -> list[Example]:
        """One sentence a line, its words separated by whitespace (as CoNLL's first column)."""
        return [Example(parts[0].split(), None, where) for _, where, parts in self._lines(path, (1,))]

    def is_labelled(self, examples) -> bool:
        return bool(examples) and all(e.tags is not None for e in examples)

    # --- predictions ---------------------------------------------------------------------------

    def postprocess(self, examples, features, outputs):
        """A tag per word; a word with no word piece (nothing but dropped characters) gets "O"."""
        best = np.argmax(np.asarray(outputs["logits"]), axis=-1)  # [N, L]
        predictions = [["O"] * len(e.words) for e in examples]
        rows, cols = np.nonzero(features["word_index"] >= 0)
        for r, c in zip(rows, cols):
            predictions[features["example_index"][r]][features["word_index"][r, c]] = self.labels[best[r, c]]
        return predictions

    def score(self, examples, predictions):
        return conlleval([e.tags for e in examples], predictions)

    def write_predictions(self, examples, predictions, directory, split):
        """conlleval's input: `word gold predicted` per line, a blank line after each sentence."""
        storage.makedirs(directory)
        path = storage_paths.join(directory, f"{self.name}_{split}_predictions.txt")
        with storage.open(path, "w", encoding="utf-8") as f:
            for e, tags in zip(examples, predictions):
                for i, (w, p) in enumerate(zip(e.words, tags)):
                    f.write(f"{w} {e.tags[i] if e.tags else 'O'} {p}\n")
                f.write("\n")
        return [path]
