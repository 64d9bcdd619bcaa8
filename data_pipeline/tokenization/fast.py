"""The fast batch path: the tokens and ids of `tokenization.FullTokenizer`, 20-30 times faster.

* `FastBasicTokenizer`, `FastTokenizer`: the same output as `BasicTokenizer` / `FullTokenizer`
  (tests/data_pipeline/tokenization/test_tokenization.py pins it, on real corpora too), by memoizing whitespace-delimited
  chunks (see `_ChunkMemoTokenizer` for why that is exact, and benchmarks/data/RESULTS.md for the
  numbers). Per-character rules become whole-string tables and regexes built from the same
  predicates (`char_classes.py`), so the per-character work runs in C.

Nothing here imports jax or bert_jax.
"""

from __future__ import annotations

import functools
import itertools
import re
import sys
import unicodedata
from typing import Dict, Iterable, List, NamedTuple, Sequence, Tuple, Union

from data_pipeline.tokenization.char_classes import CJK_RANGES, is_dropped, is_punctuation
from data_pipeline.tokenization import (UNK_TOKEN, WordpieceTokenizer, _split_special, convert_by_vocab,
                                        convert_to_unicode, load_vocab)

# --- Unicode tables and chunking ------------------------------------------------------------


class _UnicodeTables(NamedTuple):
    dropped: Dict[int, None]  # str.translate table deleting NUL, U+FFFD, Cc and Cf
    dropped_re: "re.Pattern[str]"  # one character that `dropped` deletes
    marks: Dict[int, None]  # str.translate table dropping every Mn character
    cjk_re: "re.Pattern[str]"  # one CJK ideograph
    word_re: "re.Pattern[str]"  # one punctuation character, or a run of anything else


@functools.lru_cache(maxsize=None)
def _unicode_tables() -> _UnicodeTables:
    """Whole-string equivalents of the per-character rules, for non-ASCII text.

    Built once (a fraction of a second) from a scan of every code point through the same
    predicates the plain path uses, so both paths agree on every character of this Python's
    Unicode version.
    """
    dropped: Dict[int, None] = {}
    marks: Dict[int, None] = {}
    punct: List[int] = []
    # One C-speed pass for the categories; the predicates then run only on candidates (a
    # superset of what they accept), which keeps them the single definition of each rule.
    categories = list(map(unicodedata.category, map(chr, range(sys.maxunicode + 1))))
    for cp, category in enumerate(categories):
        first = category[0]
        if category in ("Cc", "Cf") or cp == 0xFFFD:  # not Co/Cn/Cs: 0.9 M code points none drops
            if is_dropped(chr(cp)):
                dropped[cp] = None
        elif category == "Mn":
            marks[cp] = None
        elif (first == "P" or cp < 128) and is_punctuation(chr(cp)):
            punct.append(cp)
    punct_class = _char_class(_ranges(punct))
    return _UnicodeTables(dropped=dropped, dropped_re=re.compile(_char_class(_ranges(dropped))),
                          marks=marks, cjk_re=re.compile(_char_class(CJK_RANGES)),
                          word_re=re.compile(rf"{punct_class}|[^\s{punct_class[1:-1]}]+"))


def _ranges(code_points: Iterable[int]) -> List[Tuple[int, int]]:
    """Sorted code points -> inclusive (low, high) runs."""
    runs: List[List[int]] = []
    for cp in code_points:
        if runs and runs[-1][1] == cp - 1:
            runs[-1][1] = cp
        else:
            runs.append([cp, cp])
    return [(low, high) for low, high in runs]


def _char_class(ranges: Iterable[Sequence[int]]) -> str:
    """A regex character class "[...]" matching the inclusive code point ranges."""
    parts = []
    for low, high in ranges:
        parts.append(re.escape(chr(low)) if low == high
                     else f"{re.escape(chr(low))}-{re.escape(chr(high))}")
    return "[" + "".join(parts) + "]"


# ASCII text needs none of the Unicode tables: these are the same rules restricted to ASCII.
_MAYBE_CJK_RE = re.compile("[\u3400-\U0010ffff]")
_ASCII_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_ASCII_DELETE = {cp: None for cp in range(128) if is_dropped(chr(cp))}
_ASCII_PUNCT = _char_class([(33, 47), (58, 64), (91, 96), (123, 126)])
_ASCII_WORD_RE = re.compile(rf"{_ASCII_PUNCT}|[^\s{_ASCII_PUNCT[1:-1]}]+")


def _chunk_text(text: str) -> List[str]:
    """Google's cleaned, CJK-spaced, whitespace-split chunks of `text`.

    Example: "Hi\x00 there中文" -> ["Hi", "there", "中", "文"]
    """
    if text.isascii():
        if not text.isprintable() and _ASCII_CONTROL_RE.search(text):
            text = text.translate(_ASCII_DELETE)
        return text.split()
    tables = _unicode_tables()
    # Whitespace needs no mapping to " ": every character the reference calls whitespace is
    # also whitespace to `str.split`. The big regexes cost ~20 ns a character, so cheap C-speed
    # tests skip them on usual text: printable text has no Cc/Cf character (U+FFFD is
    # printable, hence its own test), and every CJK range lies above U+3400.
    if (not text.isprintable() or "\ufffd" in text) and tables.dropped_re.search(text):
        text = text.translate(tables.dropped)
    if _MAYBE_CJK_RE.search(text):
        text = tables.cjk_re.sub(r" \g<0> ", text)
    return text.split()


# --- memoized tokenizers ----------------------------------------------------------------------


class _Memo(dict):
    """A dict that computes missing values and stores up to `limit` of them.

    Keys longer than `max_key_chars` are computed every time: they are rarely repeated (long
    URLs, base64 blobs, a 1 MB "word") and would hold memory for nothing.
    """

    def __init__(self, compute, limit: int, max_key_chars: int = 256):
        super().__init__()
        self._compute = compute
        self._limit = limit
        self._max_key_chars = max_key_chars

    def __missing__(self, key):
        value = self._compute(key)
        if len(self) < self._limit and len(key) <= self._max_key_chars:
            self[key] = value
        return value


class _ChunkMemoTokenizer:
    """Per-text machinery of the fast tokenizers: chunk a text, concatenate memoized outputs.

    Why it is exact: Google's pipeline cleans the text and spaces out CJK ideographs, splits on
    whitespace, and from then on treats every whitespace-delimited chunk on its own (lower
    casing, accent stripping, punctuation split and WordPiece never look past a chunk). So the
    tokens of a text are the concatenation of the tokens of its chunks, and a chunk's tokens can
    be computed once and memoized. Natural text repeats chunks (Zipf), so after warm-up almost
    every chunk costs one dict lookup, and the per-character work happens in C inside
    `str.split`, `str.translate` and `re`. Kept special tokens cut the text into segments that
    the reference also tokenizes separately.
    """

    keep_special_tokens: bool

    def _run(self, text: str, memo: _Memo, special) -> List:
        """Outputs of one text through `memo`; `special` maps a kept special token."""
        if not (self.keep_special_tokens and "[" in text):
            return list(itertools.chain.from_iterable(map(memo.__getitem__, _chunk_text(text))))
        output: List = []
        for segment, is_special in _split_special(text, True):
            if is_special:
                output.append(special(segment))
            else:
                output.extend(itertools.chain.from_iterable(
                    map(memo.__getitem__, _chunk_text(segment))))
        return output

    def _batch(self, texts: Iterable[Union[str, bytes]], memo: _Memo, special) -> List[List]:
        # The common case (printable ASCII, no special-token handling) is inlined: at ~14 tokens
        # per line, two more Python calls per text would cost a tenth of the time.
        get = memo.__getitem__
        chain = itertools.chain.from_iterable
        check_special = self.keep_special_tokens
        output: List[List] = []
        append = output.append
        for text in texts:
            if text.__class__ is not str:
                text = convert_to_unicode(text)
            if text.isascii() and text.isprintable() and not (check_special and "[" in text):
                append(list(chain(map(get, text.split()))))
            else:
                append(self._run(text, memo, special))
        return output


class FastBasicTokenizer(_ChunkMemoTokenizer):
    """`BasicTokenizer` with identical output, memoized per whitespace-delimited chunk.

    Used by `FastTokenizer` and by `train_vocab` to pre-split a corpus the way the tokenizer
    will see it.
    """

    def __init__(self, do_lower_case: bool = True, keep_special_tokens: bool = False,
                 cache_size: int = 500_000):
        """Constructs a FastBasicTokenizer.

        Args:
          do_lower_case: as in `BasicTokenizer`.
          keep_special_tokens: as in `BasicTokenizer`.
          cache_size: most chunks memoized (memory bound); past it, new chunks are computed
            every time.
        """
        self.do_lower_case = do_lower_case
        self.keep_special_tokens = keep_special_tokens
        self._chunk_words = _Memo(self.split_chunk, cache_size)

    def split_chunk(self, chunk: str) -> Tuple[str, ...]:
        """Basic tokens of one chunk (a cleaned, CJK-spaced, whitespace-free string).

        Lower casing and accent stripping run on the whole chunk, which equals the reference's
        per-word operations because a chunk is exactly one of its words; the punctuation split
        is a regex built from the same predicate.
        """
        if chunk.isascii():
            word_re = _ASCII_WORD_RE
            if self.do_lower_case:
                chunk = chunk.lower()
        else:
            tables = _unicode_tables()
            word_re = tables.word_re
            if self.do_lower_case:
                chunk = unicodedata.normalize("NFD", chunk.lower()).translate(tables.marks)
        return tuple(word_re.findall(chunk))

    def tokenize(self, text: Union[str, bytes]) -> List[str]:
        """Basic tokens of one text; equal to `BasicTokenizer.tokenize(text)`."""
        return self._run(convert_to_unicode(text), self._chunk_words, str)

    def tokenize_batch(self, texts: Iterable[Union[str, bytes]]) -> List[List[str]]:
        """Basic tokens of each text."""
        return self._batch(texts, self._chunk_words, str)


class FastTokenizer(_ChunkMemoTokenizer):
    """Batch tokenizer whose tokens and ids equal `FullTokenizer`'s, many times faster.

    Chunks of text (see `_ChunkMemoTokenizer`) are memoized to their word pieces and ids; a
    missed chunk goes through `FastBasicTokenizer.split_chunk`, and each of its words through
    `WordpieceTokenizer`, itself memoized per word. The first pass over a corpus therefore runs
    at a few times the plain speed, and later text at 20-30 times (benchmarks/data/RESULTS.md).

    HuggingFace `tokenizers` was measured and not used: on this 2-core machine it is about 4x
    slower than the memoized path, and its BERT normalizer departs from Google's outside ASCII
    (a final capital sigma becomes "σ" not "ς"; private-use and unassigned characters are
    dropped; the CJK range U+2B820-U+2B91F is not spaced).

    Example:
      fast = FastTokenizer("vocab.txt")
      fast.encode_batch(["Hello, world!", ""])  # -> [[7592, 1010, 2088, 999], []]
    """

    def __init__(self, vocab_file: str, do_lower_case: bool = True,
                 keep_special_tokens: bool = False, cache_size: int = 500_000):
        """Constructs a FastTokenizer.

        Args:
          vocab_file: WordPiece vocab.txt.
          do_lower_case: as in `FullTokenizer`.
          keep_special_tokens: as in `FullTokenizer`.
          cache_size: most chunks (and, separately, words) memoized, about 150 bytes each;
            past it, new chunks are computed every time. Natural text's frequent chunks fit
            well within the default.
        """
        self.vocab_file = vocab_file
        self.vocab = load_vocab(vocab_file)
        self.inv_vocab = {index: token for token, index in self.vocab.items()}
        self.do_lower_case = do_lower_case
        self.keep_special_tokens = keep_special_tokens
        self.basic_tokenizer = FastBasicTokenizer(do_lower_case, keep_special_tokens, cache_size)
        self._wordpiece = WordpieceTokenizer(self.vocab)
        self._word_pieces = _Memo(self._split_word, cache_size)
        self._chunk_tokens = _Memo(self._tokenize_chunk, cache_size)
        self._chunk_ids = _Memo(self._encode_chunk, cache_size)

    def _split_word(self, word: str) -> Tuple[str, ...]:
        pieces = self._wordpiece.split_word(word)
        return (UNK_TOKEN,) if pieces is None else tuple(pieces)

    def _tokenize_chunk(self, chunk: str) -> Tuple[str, ...]:
        pieces: List[str] = []
        for word in self.basic_tokenizer.split_chunk(chunk):
            pieces.extend(self._word_pieces[word])
        return tuple(pieces)

    def _encode_chunk(self, chunk: str) -> Tuple[int, ...]:
        # Not through the token memo: batches of ids should not pay memory for strings too.
        return tuple(self.vocab[token] for token in self._tokenize_chunk(chunk))

    def _special_token(self, token: str) -> str:
        # A kept special token is a whole vocabulary entry, never word-pieced.
        return token if token in self.vocab else UNK_TOKEN

    def _special_id(self, token: str) -> int:
        return self.vocab[self._special_token(token)]

    def tokenize(self, text: Union[str, bytes]) -> List[str]:
        """Word pieces of one text; equal to `FullTokenizer.tokenize(text)`."""
        return self._run(convert_to_unicode(text), self._chunk_tokens, self._special_token)

    def encode(self, text: Union[str, bytes]) -> List[int]:
        """Ids of one text; equal to `FullTokenizer.convert_tokens_to_ids(tokenize(text))`."""
        return self._run(convert_to_unicode(text), self._chunk_ids, self._special_id)

    def tokenize_batch(self, texts: Iterable[Union[str, bytes]]) -> List[List[str]]:
        """Word pieces of each text."""
        return self._batch(texts, self._chunk_tokens, self._special_token)

    def encode_batch(self, texts: Iterable[Union[str, bytes]]) -> List[List[int]]:
        """Ids of each text."""
        return self._batch(texts, self._chunk_ids, self._special_id)

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> List[int]:
        return convert_by_vocab(self.vocab, tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> List[str]:
        return convert_by_vocab(self.inv_vocab, ids)
