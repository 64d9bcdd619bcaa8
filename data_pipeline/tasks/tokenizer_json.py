"""The fine-tuning tasks with a HuggingFace `tokenizer.json` (ModernBERT's BPE, ...) instead of a WordPiece vocab.txt.

`TaskTokenizer` wraps `data_pipeline.tokenization.hf_tokenizer.HFTokenizer` in the interface the task
families featurize with (`FullTokenizer`'s): `tokenize`, `tokenize_batch`, `tokenize_with_offsets`,
`convert_tokens_to_ids`, `vocab`, `inv_vocab`. What changes for each family:

* the special tokens are the file's (its post-processor's classification and separator tokens, its
  padding token): `vocab` maps BERT's names `[CLS]`, `[SEP]`, `[PAD]` (and `[UNK]` where the file has
  an unknown token) to the file's ids, so `[CLS] a [SEP] (b [SEP])` rows are the file's `[CLS] a [SEP]
  b [SEP]` (transformers' `encode(a, b)` for ModernBERT's file) and padding is the file's pad id;
* `tokenize_with_offsets` gives each token's characters in the text from the library's offsets, with
  the whitespace a token carries in front (ByteLevel's "Ġparis" spans " paris") left out, so the span
  is the word's characters only. SQuAD labels answers and cuts predicted answer texts from these
  offsets (`exact_offsets`), and NER puts a word's tag on the first token whose span starts in it;
* there is no casing flag: the file's normalizer decides (`do_lower_case` is ignored).

`make_tokenizer` picks it: a vocabulary path that names a `.json` file is a tokenizer.json. Nothing
here imports jax or bert_jax.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple, Union

from data_pipeline.tokenization import CLS_TOKEN, PAD_TOKEN, SEP_TOKEN, UNK_TOKEN, convert_to_unicode

FILE_NAME = "tokenizer.json"


def is_tokenizer_json(path: str) -> bool:
    """Whether a vocabulary path is a HuggingFace tokenizer.json (not a WordPiece vocab.txt)."""
    return bool(path) and str(path).endswith(".json")


class TaskTokenizer:
    """A `tokenizer.json` behind the tasks' tokenizer interface (module docstring).

    Attributes:
      vocab_file: the file (for messages).
      vocab: token -> id: the file's tokens, and `[CLS]`, `[SEP]`, `[PAD]`, `[UNK]` -> the file's own.
      inv_vocab: id -> the file's token.
      cls_id, sep_id, pad_id: the file's ids.
      exact_offsets: True (SQuAD cuts answers from character offsets).
      required_tokens: the names `check_vocab` requires in `vocab`.
    """

    exact_offsets = True

    def __init__(self, path: str):
        from data_pipeline.tokenization.hf_tokenizer import HFTokenizer

        self.hf = HFTokenizer(path)
        self.vocab_file = path
        if self.hf.pad_token is None:
            raise ValueError(f"{path}: no padding token (a special added token named [PAD] or <pad>, or the "
                             "file's padding.pad_token): fine-tuning rows are padded with it")
        self.vocab = dict(self.hf.vocab)
        self.inv_vocab = self.hf.inv_vocab
        names = {CLS_TOKEN: self.hf.cls_token, SEP_TOKEN: self.hf.sep_token, PAD_TOKEN: self.hf.pad_token,
                 UNK_TOKEN: self.hf.unk_token}
        for name, token in names.items():
            if token is not None:
                self.vocab[name] = self.hf.vocab[token]
        self.required_tokens = tuple(n for n, t in names.items() if t is not None)
        self.cls_id, self.sep_id, self.pad_id = (self.vocab[n] for n in (CLS_TOKEN, SEP_TOKEN, PAD_TOKEN))
        self.do_lower_case = None  # the file's normalizer decides

    def tokenize(self, text: Union[str, bytes]) -> List[str]:
        return self.hf.tokenize(text)

    def tokenize_batch(self, texts: Iterable[Union[str, bytes]]) -> List[List[str]]:
        return self.hf.tokenize_batch(texts)

    def tokenize_with_offsets(self, text: Union[str, bytes]) -> Tuple[List[str], List[Tuple[int, int]]]:
        """The tokens of `text` and each one's `(start, end)` characters (`text[start:end]`), the leading
        whitespace a token carries left out (a token of whitespace only: `start == end`).

        Example (ByteLevel BPE): "the cats" -> ["the", "Ġcats"], [(0, 3), (4, 8)].
        """
        text = convert_to_unicode(text)
        encoding = self.hf._tokenizer.encode(text, add_special_tokens=False)
        spans = []
        for start, end in encoding.offsets:
            while start < end and text[start].isspace():
                start += 1
            spans.append((start, end))
        return list(encoding.tokens), spans

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> List[int]:
        return [self.vocab[t] for t in tokens]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> List[str]:
        return self.hf.convert_ids_to_tokens(ids)


def make_tokenizer(task, vocabulary: str, do_lower_case):
    """The tokenizer `task.featurize` takes: a `TaskTokenizer` for a tokenizer.json, else the task's own
    (WordPiece `vocabulary` with `do_lower_case`)."""
    if is_tokenizer_json(vocabulary):
        return TaskTokenizer(vocabulary)
    return task.make_tokenizer(vocabulary, bool(do_lower_case))


def covering_tokens(spans: Sequence[Tuple[int, int]], start: int, end: int) -> Tuple[int, int]:
    """(first, last) index of the tokens whose characters overlap `[start, end)`; (-1, -1) when none do."""
    hits = [i for i, (s, e) in enumerate(spans) if s < e and s < end and e > start]
    return (hits[0], hits[-1]) if hits else (-1, -1)
