"""SQuAD v1.1 and v2.0: reference featurization and n-best post-processing (scorer: squad_eval).

Featurization follows google-research/bert `run_squad.py` (max_seq_length 384, doc_stride 128,
max_query_length 64): `[CLS] question [SEP] context window [SEP]`, context windows sliding by
`doc_stride` tokens, each token scored in the window where it has the most context on both sides.
Training labels are run_squad.py's: the answer's characters pick whitespace words, the words'
pieces are narrowed to the tokenized answer text when it occurs among them (`_answer_span`), so an
answer inside a word piece keeps the whole piece as Google labels it. A training answer that is
not at its `answer_start`, or that run_squad.py cannot recover from the words (it skips those), is
a bad row (an error naming the file and question, or a counted skip). A training answer outside a
window (and every v2 unanswerable question) points at [CLS].

With a HuggingFace tokenizer.json (`tokenizer_json.py`, ModernBERT's BPE) the labels and answer texts
come from the tokens' character offsets instead: the span is the first to the last token holding a
character of the answer, and a predicted answer is the context's characters under its tokens.

Post-processing is Google's `write_predictions`: the top `n_best_size` (20) start and end logits of
each window, valid spans only (inside the context, end >= start, at most `max_answer_length` (30)
pieces, start piece at its max-context window), best `start + end` over the windows. The answer
text is Google's `get_final_text` (`answer_text`): the span's slice of its whitespace words joined
by single spaces, or all of those words when the alignment fails.
v2: the null score is the smallest `start[CLS] + end[CLS]` over the windows; `null_odds` is null
score minus the best span's score, and the prediction is "" when it exceeds
`null_score_diff_threshold`.

Scoring is the official `evaluate-v1.1.py` / `evaluate-v2.0.py`, in `squad_eval.py` (its names are
re-exported here). The same scorer is a CLI with the official scripts' interface:

    python -m data_pipeline.tasks.squad dev-v1.1.json predictions.json
    python -m data_pipeline.tasks.squad dev-v2.0.json predictions.json --version_2 [--na_prob_file null_odds.json]
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import sys
from typing import Optional, Sequence

import numpy as np

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tokenization import CLS_TOKEN, SEP_TOKEN

from data_pipeline.tasks import Task, check_vocab, pad_id_of, pad_row, read_json, stack, tfds_examples
from data_pipeline.tasks.tokenizer_json import covering_tokens
# The official scorer lives in squad_eval; `python -m data_pipeline.tasks.squad` runs its `main` (below).
from data_pipeline.tasks.squad_eval import evaluate_v1, evaluate_v2, main
from data_pipeline.tasks.squad_windows import doc_windows, is_max_context


@dataclasses.dataclass
class Example:
    qas_id: str
    question: str
    context: str
    answers: list  # [{"text": str, "answer_start": int}], gold answers (empty: unanswerable)
    is_impossible: bool = False
    where: str = ""
    paragraph: int = 0  # the paragraph's number in its file (a seeded dev share takes whole paragraphs)


# ---------------------------------------------------------------------------------------------
# The tasks
# ---------------------------------------------------------------------------------------------


class SquadV1(Task):
    """SQuAD v1.1 (`train-v1.1.json`, `dev-v1.1.json`, or TFDS `squad/v1.1`)."""

    name = "squad_v1"
    head = "span"
    num_outputs = 2
    eval_splits = ("dev",)
    primary_metric = "f1"
    version_2 = False
    tfds_name = "squad/v1.1"
    files = {"train": ("train-v1.1.json", "train.json"), "dev": ("dev-v1.1.json", "dev.json")}

    def __init__(self, data_dir: str = "", *, doc_stride: int = 128, max_query_length: int = 64,
                 n_best_size: int = 20, max_answer_length: int = 30,
                 null_score_diff_threshold: float = 0.0, dev_fraction: float = 0.0, split_seed: int = 0,
                 **kwargs):
        super().__init__(data_dir, **kwargs)
        if not 0.0 <= dev_fraction < 1.0:
            raise ValueError(f"config.task_options.dev_fraction={dev_fraction}: a fraction in [0, 1)")
        self.dev_fraction = float(dev_fraction)
        self.split_seed = int(split_seed)
        self.doc_stride = doc_stride
        self.max_query_length = max_query_length
        self.n_best_size = n_best_size
        self.max_answer_length = max_answer_length
        self.null_score_diff_threshold = null_score_diff_threshold

    # --- reading -------------------------------------------------------------------------------

    def read(self, split: str) -> list[Example]:
        if split not in self.files:
            raise ValueError(f"task {self.name} has no split {split!r}; expected one of {list(self.files)}")
        if self.source == "tfds":
            return self._read_tfds(split)
        if self.dev_fraction and split in ("train", "dev") and "dev" not in self.split_files:
            return self._fraction(split)
        return self._read_file(self._path(split, *self.files[split]))

    def _fraction(self, split: str) -> list[Example]:
        """`dev_fraction` of the training file's paragraphs (seeded; all questions of a paragraph
        on one side, so no context is both trained and scored on)."""
        from data_pipeline.tasks.files import split_rows

        if not hasattr(self, "_train_file_examples"):  # read once for both sides of the split
            self._train_file_examples = self._read_file(self._path("train", *self.files["train"]))
        examples = self._train_file_examples
        paragraphs = sorted({e.paragraph for e in examples})
        train, dev = split_rows(len(paragraphs), self.dev_fraction, self.split_seed)
        keep = {paragraphs[i] for i in (train if split == "train" else dev)}
        return [e for e in examples if e.paragraph in keep]

    def _read_file(self, path: str) -> list[Example]:
        try:
            data = read_json(path)["data"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a SQuAD JSON file ({e})") from e
        examples = []
        number = 0
        for a, article in enumerate(data):
            for p, paragraph in enumerate(article.get("paragraphs", [])):
                number += 1
                context = paragraph.get("context")
                for q, qa in enumerate(paragraph.get("qas", [])):
                    where = f"{path}: data[{a}].paragraphs[{p}].qas[{q}] (id {qa.get('id')})"
                    if not isinstance(context, str) or "id" not in qa or "question" not in qa:
                        self.rows.bad(path, f"data[{a}].paragraphs[{p}].qas[{q}]",
                                      "missing context, id or question")
                        continue
                    examples.append(Example(qa["id"], qa["question"], context, list(qa.get("answers", [])),
                                            bool(qa.get("is_impossible", False)), where, number))
        return examples

    line_format = "a question and its context separated by a tab"
    file_suffixes = (".json",)

    def read_lines(self, path: str) -> list[Example]:
        """One question a line: the question, a tab, the context (its id is the line number)."""
        return [Example(str(number), parts[0], parts[1], [], False, where)
                for number, where, parts in self._lines(path, (2,))]

    def is_labelled(self, examples) -> bool:
        return bool(examples) and all(e.answers or e.is_impossible for e in examples)

    def _read_tfds(self, split: str) -> list[Example]:
        tfds_split = {"train": "train", "dev": "validation"}[split]
        examples = []
        for row, ex in enumerate(tfds_examples(self.tfds_name, tfds_split, self.tfds_data_dir)):
            ans = ex["answers"]
            answers = [{"text": t, "answer_start": int(s)} for t, s in zip(ans["text"], ans["answer_start"])]
            examples.append(Example(ex["id"], ex["question"], ex["context"], answers,
                                    bool(ex.get("is_impossible", False)),
                                    f"tfds {self.tfds_name}:{tfds_split}: row {row} (id {ex['id']})"))
        return examples

    # --- features ------------------------------------------------------------------------------

    def _first_answer(self, ex: Example) -> Optional[tuple[str, int]]:
        """(text, answer_start) of the first gold answer; None (after `bad`) if it is not at its offset."""
        answer = ex.answers[0] if ex.answers else {}
        text, start = answer.get("text", ""), answer.get("answer_start", -1)
        if not ex.answers:
            self.rows.bad(ex.where, "", "an answerable training question without answers")
        elif not isinstance(start, int) or ex.context[start:start + len(text)] != text or not text.strip():
            self.rows.bad(ex.where, "", f"answer {text!r} is not at answer_start={start} in its context "
                          f"(found {ex.context[start:start + len(text)]!r})")
        else:
            return text, start
        return None

    def _answer_span(self, ex: Example, doc: "_Doc", tokenizer) -> Optional[tuple[int, int]]:
        """Word-piece (start, end) of the first gold answer, as run_squad.py labels it; None (after
        `bad`) if it is off.

        Google goes through whitespace words: the answer's first and last characters pick words,
        the span starts at the first piece of the first word and ends at the last piece of the
        last, then shrinks to the first (leftmost start, then longest) run of pieces equal to the
        tokenized answer text, when there is one. An answer that starts or ends inside a word
        piece ("Japan" in "Japanese") keeps the whole piece. With a tokenizer.json: the first to the
        last token holding a character of the answer (its characters exactly at token boundaries).
        """
        checked = self._first_answer(ex)
        if checked is None:
            return None
        text, start = checked
        if getattr(tokenizer, "exact_offsets", False):  # a tokenizer.json: the tokens holding its characters
            first, last = covering_tokens(doc.spans, start, start + len(text))
            if first < 0:
                self.rows.bad(ex.where, "", f"answer {text!r} covers no token of the context")
            return None if first < 0 else (first, last)
        first_word, last_word = doc.char_to_word[start], doc.char_to_word[start + len(text) - 1]
        # run_squad drops an answer whose whitespace-collapsed text is not inside its words (an
        # answer holding a space that only `str.split` knows, such as U+00A0); we name it.
        if " ".join(text.split()) not in " ".join(doc.words[first_word:last_word + 1]):
            self.rows.bad(ex.where, "", f"answer {text!r} cannot be recovered from the context's "
                          "whitespace-separated words (run_squad.py skips such answers)")
            return None
        first = bisect.bisect_left(doc.piece_word, first_word)
        last = bisect.bisect_left(doc.piece_word, last_word + 1) - 1
        if last < first:
            self.rows.bad(ex.where, "", f"answer {text!r} covers no word piece of the context")
            return None
        wanted = tokenizer.tokenize(text)
        n = len(wanted)
        for s in range(first, last - n + 2) if n else ():
            if doc.pieces[s:s + n] == wanted:
                return s, s + n - 1
        return first, last

    def featurize(self, examples, tokenizer, max_seq_length, *, training):
        check_vocab(tokenizer)
        # A tokenizer.json (data_pipeline.tasks.tokenizer_json): answers from character offsets.
        self._by_offsets = bool(getattr(tokenizer, "exact_offsets", False))
        keys = ("input_ids", "input_mask", "segment_ids", "start_positions", "end_positions", "weight",
                "example_index", "token_start_char", "token_end_char", "token_word_index", "token_is_max_context")
        rows = {k: [] for k in keys}
        # postprocess reads the pieces back from input_ids and re-tokenizes answers like Google.
        self._vocab = None if self._by_offsets else (tokenizer.inv_vocab, tokenizer.do_lower_case)
        doc = None
        cls_id, sep_id = tokenizer.vocab[CLS_TOKEN], tokenizer.vocab[SEP_TOKEN]
        for index, ex in enumerate(self._progress(examples, "featurize")):
            if doc is None or doc.context != ex.context:  # consecutive questions share a context
                doc = _Doc.tokenize(ex.context, tokenizer)
            doc_ids, spans = doc.ids, doc.spans
            query = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ex.question)[:self.max_query_length])
            answer = None
            if training and not (self.version_2 and ex.is_impossible):
                answer = self._answer_span(ex, doc, tokenizer)
                if answer is None:
                    continue  # counted by self.rows
            max_doc = max_seq_length - len(query) - 3
            if max_doc <= 0:
                raise ValueError(f"max_seq_length={max_seq_length} leaves no room for the context after "
                                 f"a {len(query)}-piece question (max_query_length={self.max_query_length})")
            windows = doc_windows(len(doc_ids), max_doc, self.doc_stride)
            for w_start, w_len in windows:
                ids = [cls_id] + query + [sep_id] + doc_ids[w_start:w_start + w_len] + [sep_id]
                segments = [0] * (len(query) + 2) + [1] * (w_len + 1)
                offset = len(query) + 2  # where the window's first piece sits
                start_char = np.full(max_seq_length, -1, np.int32)
                end_char = np.full(max_seq_length, -1, np.int32)
                word = np.full(max_seq_length, -1, np.int32)
                max_context = np.zeros(max_seq_length, bool)
                for j in range(w_len):
                    start_char[offset + j], end_char[offset + j] = spans[w_start + j]
                    s, e = spans[w_start + j]
                    # A whitespace-only token (a tokenizer.json's) starts or ends no answer.
                    word[offset + j] = doc.piece_word[w_start + j] if s < e else -1
                    max_context[offset + j] = is_max_context(windows, w_start, w_start + j)
                start_pos = end_pos = 0
                if answer is not None and w_start <= answer[0] and answer[1] < w_start + w_len:
                    start_pos, end_pos = answer[0] - w_start + offset, answer[1] - w_start + offset
                input_ids, mask, seg = pad_row(ids, segments, max_seq_length, pad_id_of(tokenizer))
                for k, v in (("input_ids", input_ids), ("input_mask", mask), ("segment_ids", seg),
                             ("start_positions", start_pos), ("end_positions", end_pos),
                             ("weight", 1.0 if training else 0.0), ("example_index", index),
                             ("token_start_char", start_char), ("token_end_char", end_char),
                             ("token_word_index", word), ("token_is_max_context", max_context)):
                    rows[k].append(v)
        if not rows["input_ids"]:
            raise ValueError(f"task {self.name}: no features (every example was skipped as bad)")
        return stack(rows, {"weight": np.float32, "token_is_max_context": bool})

    # --- predictions ---------------------------------------------------------------------------

    def postprocess(self, examples, features, outputs):
        """{"predictions": id -> text, "nbest": id -> [...], "null_odds": id -> float (v2)}.

        `features` must come from this task's `featurize` (it keeps the vocabulary that turns
        input ids back into the pieces Google's answer text is built from).
        """
        by_offsets = getattr(self, "_by_offsets", None)
        if by_offsets is None:
            raise ValueError(f"task {self.name}: postprocess needs the features of this task's featurize")
        from data_pipeline import tokenization
        inv_vocab, do_lower_case = self._vocab or (None, None)
        basic = None if by_offsets else tokenization.BasicTokenizer(do_lower_case)
        start_logits = np.asarray(outputs["start_logits"], np.float32)
        end_logits = np.asarray(outputs["end_logits"], np.float32)
        by_example = collections.defaultdict(list)
        for row, ex_index in enumerate(features["example_index"]):
            by_example[int(ex_index)].append(row)
        predictions, nbest_all, null_odds = {}, {}, {}
        n = self.n_best_size
        words: list = []
        words_of = None
        for ex_index, ex in enumerate(examples):
            if words_of != ex.context:
                words, _ = whitespace_words(ex.context)
                words_of = ex.context
            # Scores add Python floats (float64), as Google's do, so near ties order the same.
            candidates = []  # (score, start logit, end logit, row, start, end); row -1: the null span
            null = None  # (score, start logit, end logit), the smallest over windows
            for row in by_example.get(ex_index, []):
                s_log, e_log = start_logits[row], end_logits[row]
                if self.version_2:
                    score = float(s_log[0]) + float(e_log[0])
                    if null is None or score < null[0]:
                        null = (score, float(s_log[0]), float(e_log[0]))
                starts = np.argsort(-s_log, kind="stable")[:n]
                ends = np.argsort(-e_log, kind="stable")[:n]
                word = features["token_word_index"][row]
                max_ctx = features["token_is_max_context"][row]
                for s in starts:
                    if word[s] < 0 or not max_ctx[s]:
                        continue
                    for e in ends:
                        if word[e] < 0 or e < s or e - s + 1 > self.max_answer_length:
                            continue
                        candidates.append((float(s_log[s]) + float(e_log[e]), float(s_log[s]), float(e_log[e]),
                                           row, int(s), int(e)))
            if self.version_2 and null is not None:  # the null span competes as (0, 0)
                candidates.append((null[0], null[1], null[2], -1, 0, 0))
            candidates.sort(key=lambda c: -c[0])
            nbest, seen = [], set()
            for score, s_logit, e_logit, row, s, e in candidates:
                if len(nbest) >= n:
                    break
                if row < 0:
                    text = ""
                elif by_offsets:  # the context's characters under the span's tokens
                    text = ex.context[features["token_start_char"][row][s]:features["token_end_char"][row][e]]
                else:
                    ids = features["input_ids"][row][s:e + 1]
                    word = features["token_word_index"][row]
                    text = answer_text([inv_vocab[int(i)] for i in ids], words[word[s]:word[e] + 1], basic)
                if text in seen:
                    continue
                seen.add(text)
                nbest.append({"text": text, "start_logit": s_logit, "end_logit": e_logit})
            if self.version_2 and null is not None:
                if "" not in seen:
                    nbest.append({"text": "", "start_logit": null[1], "end_logit": null[2]})
                if len(nbest) == 1:  # only the null answer (Google's script fails here): a nonce span
                    nbest.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0})
            if not nbest:
                nbest = [{"text": "empty", "start_logit": 0.0, "end_logit": 0.0}]
            totals = np.array([c["start_logit"] + c["end_logit"] for c in nbest])
            probs = np.exp(totals - totals.max())
            probs /= probs.sum()
            for c, p in zip(nbest, probs):
                c["probability"] = float(p)
            best_span = next((c for c in nbest if c["text"]), None)
            if not self.version_2:
                predictions[ex.qas_id] = nbest[0]["text"]
            else:
                diff = null[0] - best_span["start_logit"] - best_span["end_logit"]
                null_odds[ex.qas_id] = diff
                predictions[ex.qas_id] = "" if diff > self.null_score_diff_threshold else best_span["text"]
            nbest_all[ex.qas_id] = nbest
        out = {"predictions": predictions, "nbest": nbest_all}
        if self.version_2:
            out["null_odds"] = null_odds
        return out

    def score(self, examples, predictions):
        # postprocess answers every example: a partial file cannot reach here.
        gold = [(e.qas_id, [a["text"] for a in e.answers]) for e in examples]
        if self.version_2:
            return evaluate_v2(gold, predictions["predictions"], predictions.get("null_odds"))
        return evaluate_v1(gold, predictions["predictions"])

    def write_predictions(self, examples, predictions, directory, split):
        """predictions.json and nbest_predictions.json (+ null_odds.json for v2), Google's files."""
        storage.makedirs(directory)
        prefix = "" if split == "dev" else f"{split}_"
        paths = []
        for key, name in (("predictions", "predictions.json"), ("nbest", "nbest_predictions.json"),
                          ("null_odds", "null_odds.json")):
            if key in predictions:
                path = storage_paths.join(directory, prefix + name)
                values = predictions[key]
                with storage.open(path, "w", encoding="utf-8") as f:
                    json.dump(values, f, indent=2 if key != "predictions" else None)
                paths.append(path)
        return paths


class SquadV2(SquadV1):
    """SQuAD v2.0 (`train-v2.0.json`, `dev-v2.0.json`, or TFDS `squad/v2.0`)."""

    name = "squad_v2"
    version_2 = True
    tfds_name = "squad/v2.0"
    files = {"train": ("train-v2.0.json", "train.json"), "dev": ("dev-v2.0.json", "dev.json")}


# ---------------------------------------------------------------------------------------------
# Google's whitespace words and answer text
# ---------------------------------------------------------------------------------------------

# run_squad.py splits a context into words at these characters only (not at U+00A0 and the other
# separators `str.split` knows); its labels and answer texts are built from those words.
_WORD_BREAKS = frozenset(" \t\r\n\u202f")


def whitespace_words(context: str) -> tuple[list[str], list[int]]:
    """(words, word index of each character) as run_squad.py's reader splits a context.

    A break character belongs to the word before it (-1 before the first word).

    Example: "a  bc\nd" -> (["a", "bc", "d"], [0, 0, 0, 1, 1, 1, 2]).
    """
    words: list[str] = []
    char_to_word: list[int] = []
    in_word = False
    for ch in context:
        if ch in _WORD_BREAKS:
            in_word = False
        elif in_word:
            words[-1] += ch
        else:
            words.append(ch)
            in_word = True
        char_to_word.append(len(words) - 1)
    return words, char_to_word


@dataclasses.dataclass
class _Doc:
    """A context's word pieces (strings, ids, character spans) and whitespace words."""

    context: str
    pieces: list
    ids: list
    spans: list
    words: list
    char_to_word: list
    piece_word: list  # the whitespace word each piece comes from (non-decreasing)

    @classmethod
    def tokenize(cls, context: str, tokenizer) -> "_Doc":
        # A piece never crosses a word break (all five are whitespace to the basic tokenizer), so
        # tokenizing the whole context gives the pieces run_squad.py gets word by word.
        pieces, spans = tokenizer.tokenize_with_offsets(context)
        words, char_to_word = whitespace_words(context)
        return cls(context, pieces, tokenizer.convert_tokens_to_ids(pieces), spans, words, char_to_word,
                   [char_to_word[start] for start, _ in spans])


def answer_text(pieces: Sequence[str], words: Sequence[str], basic_tokenizer) -> str:
    """The answer text of a predicted span, as run_squad.py's `get_final_text` makes it.

    `pieces` are the span's word pieces, `words` the whitespace words they come from. The pieces
    are glued back into normalized text ("john smith"); the words, joined by single spaces, are
    the original text ("John Smith's"). If the normalized text is found in the basic-tokenized
    original and both have the same characters besides spaces, the characters line up one to one
    and the answer is the original's slice under the match ("John Smith"); otherwise (an [UNK]
    piece, a character that normalization drops or expands) it is the whole original text.
    """
    normalized = " ".join(pieces).replace(" ##", "").replace("##", "")
    normalized = " ".join(normalized.split())
    original = " ".join(words)
    tokenized = " ".join(basic_tokenizer.tokenize(original))
    at = tokenized.find(normalized)  # the first match, as Google's: not necessarily the span's own
    if at < 0:
        return original
    original_chars = [i for i, ch in enumerate(original) if ch != " "]
    tokenized_rank = {i: k for k, i in enumerate(j for j, ch in enumerate(tokenized) if ch != " ")}
    if len(original_chars) != len(tokenized_rank):
        return original
    first, last = tokenized_rank.get(at), tokenized_rank.get(at + len(normalized) - 1)
    if first is None or last is None:
        return original
    return original[original_chars[first]:original_chars[last] + 1]


if __name__ == "__main__":
    sys.exit(main())
