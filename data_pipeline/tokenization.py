"""Google-exact BERT tokenization, character offsets, and a fast batch path.

This module owns everything that turns raw text into WordPiece tokens and ids:

* `BasicTokenizer`, `WordpieceTokenizer`, `FullTokenizer`: a plain, per-character Python
  implementation of the rules of google-research/bert `tokenization.py` (text cleaning, CJK
  spacing, lower casing with accent stripping, punctuation splitting, greedy longest-match-first
  WordPiece with a 200-character word limit). It is the reference every other path is tested
  against, so it favours being obviously right over being fast.
* `FullTokenizer.tokenize_with_offsets`: the same tokens plus, for each one, the `(start, end)`
  character span it came from in the original text (SQuAD answer mapping, NER label alignment).
* `FastBasicTokenizer`, `FastTokenizer`: the same tokens and ids, 20-30 times faster once
  warm, by memoizing whitespace-delimited chunks (see `_ChunkMemoTokenizer` for why that is
  exact, and benchmarks/RESULTS.md for the numbers).
* `SentencePieceTokenizer`: a trained SentencePiece `.model` behind the same API, for users who
  want an ALBERT/multilingual style tokenizer instead of a WordPiece `vocab.txt`;
  `create_tokenizer` picks between the two by file name.

Nothing here imports jax or bert_jax.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import os
import re
import sys
import unicodedata
import warnings
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

# Special tokens that `keep_special_tokens=True` preserves when a user types them in raw text
# (fill-in-the-blank prompts such as "Paris is the [MASK] of France."). Google's tokenizer
# has no such option and splits them into "[", "mask", "]"; that stays the default.
SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[MASK]", "[UNK]")
UNK_TOKEN = "[UNK]"
MAX_INPUT_CHARS_PER_WORD = 200

Span = Tuple[int, int]


# --- text helpers ---------------------------------------------------------------------


def convert_to_unicode(text: Union[str, bytes]) -> str:
    """Returns `text` as `str`; bytes are decoded as UTF-8 with replacement.

    Invalid bytes become U+FFFD, which the tokenizer then drops like Google's does (Google
    decodes with errors="ignore"; replacing first lets file readers count bad bytes).

    Raises:
      ValueError: if `text` is neither `str` nor `bytes`.
    """
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray)):
        return bytes(text).decode("utf-8", errors="replace")
    raise ValueError(f"Unsupported string type: {type(text)}")


def load_vocab(vocab_file: str) -> "collections.OrderedDict[str, int]":
    """Loads a WordPiece vocabulary: one token per line, stripped, id = line index.

    As in Google's loader, a token repeated on a later line takes that later id.
    """
    vocab: "collections.OrderedDict[str, int]" = collections.OrderedDict()
    if "://" in vocab_file:  # gs:// and other remote file systems, as Google's loader allows.
        import tensorflow as tf

        reader = tf.io.gfile.GFile(vocab_file, "rb")
    else:
        reader = open(vocab_file, "rb")
    repeated = []
    with reader:
        for index, line in enumerate(reader):
            token = convert_to_unicode(line).strip()
            if token in vocab:
                repeated.append((index + 1, token, vocab[token] + 1))
            vocab[token] = index
    if repeated:
        line, token, first = repeated[0]
        logging.warning("%s: %d line(s) repeat an earlier token (first: line %d repeats %r of line %d); as "
                        "in Google's loader the later line's id wins, so ids run to %d with only %d distinct "
                        "tokens", vocab_file, len(repeated), line, token, first, max(vocab.values()), len(vocab))
    return vocab


def require_tokens(vocab: dict, vocab_file: str, tokens: Sequence[str]) -> None:
    """Raises naming `vocab_file` when it lacks any of `tokens` (special tokens a step needs)."""
    missing = [t for t in tokens if t not in vocab]
    if missing:
        size = "it is empty" if not vocab else f"{len(vocab)} tokens"
        raise ValueError(f"{vocab_file}: no {', '.join(missing)} ({size}); a BERT vocab.txt has "
                         "[PAD], [UNK], [CLS], [SEP] and [MASK]")


def whitespace_tokenize(text: str) -> List[str]:
    """Splits on Python whitespace (`str.split()`), as Google's helper does."""
    return text.split()


def convert_by_vocab(vocab: Dict, items: Iterable) -> List:
    """Maps tokens to ids or ids to tokens; raises KeyError on a missing item."""
    return [vocab[item] for item in items]


# --- character classes (the reference's definitions) -----------------------------------


def _is_whitespace(char: str) -> bool:
    """Space, tab, newline, carriage return, or any Unicode space separator (Zs)."""
    # Tab, newline and carriage return are category Cc but are treated as whitespace.
    if char in " \t\n\r":
        return True
    return unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    """Control (Cc) or format (Cf) characters, except tab, newline and carriage return.

    Only Cc and Cf: private-use (Co) and unassigned (Cn) characters are kept, as in Google's code
    (HuggingFace's normalizer drops them too, one reason its full pipeline is not used for
    non-ASCII text in `FastTokenizer`).
    """
    if char in "\t\n\r":
        return False
    return unicodedata.category(char) in ("Cc", "Cf")


def _is_punctuation(char: str) -> bool:
    """ASCII non-alphanumeric symbols (33-47, 58-64, 91-96, 123-126) or Unicode P*."""
    cp = ord(char)
    # "$", "+", "^", "`" ... are symbols (S*), not punctuation, in Unicode, but the reference
    # splits every non-alphanumeric printable ASCII character.
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


# The CJK Unified Ideographs blocks of the reference, inclusive. Hangul, Hiragana and Katakana
# are deliberately absent: those scripts separate words with spaces.
_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


def _is_cjk_char(cp: int) -> bool:
    """Whether code point `cp` is a CJK ideograph in the reference's sense."""
    for low, high in _CJK_RANGES:
        if low <= cp <= high:
            return True
    return False


def _is_dropped(char: str) -> bool:
    """Characters the cleaning step deletes: NUL, U+FFFD and control characters."""
    cp = ord(char)
    return cp == 0 or cp == 0xFFFD or _is_control(char)


# --- BasicTokenizer ---------------------------------------------------------------------


class BasicTokenizer:
    """Cleaning, CJK spacing, optional lower casing + accent stripping, punctuation split.

    Example (uncased):
      "Héllo,  wörld! 中文" -> ["hello", ",", "world", "!", "中", "文"]
    """

    def __init__(self, do_lower_case: bool = True, keep_special_tokens: bool = False):
        """Constructs a BasicTokenizer.

        Args:
          do_lower_case: lowercase, then NFD and drop combining marks (Mn).
          keep_special_tokens: keep `SPECIAL_TOKENS` typed in raw text as single tokens,
            case-sensitively (off by default, like Google).
        """
        self.do_lower_case = do_lower_case
        self.keep_special_tokens = keep_special_tokens

    # The plain path: one rule per step, in the reference's order.

    def tokenize(self, text: Union[str, bytes]) -> List[str]:
        """Splits `text` into basic tokens (words, punctuation marks, CJK characters)."""
        text = convert_to_unicode(text)
        output: List[str] = []
        for segment, is_special in _split_special(text, self.keep_special_tokens):
            if is_special:
                output.append(segment)
            else:
                output.extend(self._tokenize_plain(segment))
        return output

    def _tokenize_plain(self, text: str) -> List[str]:
        text = self._clean_text(text)
        text = self._space_cjk_chars(text)
        split_tokens: List[str] = []
        for token in whitespace_tokenize(text):
            if self.do_lower_case:
                token = self._strip_accents(token.lower())
            split_tokens.extend(self._split_on_punctuation(token))
        # Stripping accents can empty a token (a lone combining mark); re-splitting drops it.
        return whitespace_tokenize(" ".join(split_tokens))

    @staticmethod
    def _clean_text(text: str) -> str:
        output = []
        for char in text:
            if _is_dropped(char):
                continue
            output.append(" " if _is_whitespace(char) else char)
        return "".join(output)

    @staticmethod
    def _space_cjk_chars(text: str) -> str:
        output = []
        for char in text:
            if _is_cjk_char(ord(char)):
                output.extend((" ", char, " "))
            else:
                output.append(char)
        return "".join(output)

    @staticmethod
    def _strip_accents(text: str) -> str:
        text = unicodedata.normalize("NFD", text)
        return "".join(char for char in text if unicodedata.category(char) != "Mn")

    @staticmethod
    def _split_on_punctuation(text: str) -> List[str]:
        output: List[List[str]] = []
        start_new_word = True
        for char in text:
            if _is_punctuation(char):
                output.append([char])
                start_new_word = True
            else:
                if start_new_word:
                    output.append([])
                start_new_word = False
                output[-1].append(char)
        return ["".join(chars) for chars in output]

    # The offsets path: the same rules applied to (char, start, end) triples, so that every
    # output character remembers which original characters produced it.

    def tokenize_with_offsets(self, text: Union[str, bytes]) -> Tuple[List[str], List[Span]]:
        """Like `tokenize`, plus each token's `(start, end)` span in `text`.

        A lowercased or accent-stripped character keeps the span of its source; a combining
        mark that accent stripping removes widens the span of the character before it, so
        "cafe\\u0301" gives ("cafe", (0, 5)).
        """
        text = convert_to_unicode(text)
        tokens: List[str] = []
        spans: List[Span] = []
        offset = 0
        for segment, is_special in _split_special(text, self.keep_special_tokens):
            if is_special:
                tokens.append(segment)
                spans.append((offset, offset + len(segment)))
            else:
                for token, chars in self._words_with_chars(segment, offset):
                    tokens.append(token)
                    spans.append((min(s for _, s, _ in chars), max(e for _, _, e in chars)))
            offset += len(segment)
        return tokens, spans

    def _words_with_chars(self, text: str, offset: int):
        """Yields (token, [(char, start, end), ...]) for each basic token of `text`."""
        words: List[List[Tuple[str, int, int]]] = []
        current: List[Tuple[str, int, int]] = []
        for index, char in enumerate(text, start=offset):
            if _is_dropped(char):
                continue
            # Google splits with `str.split()`, which also breaks at characters such as U+2028
            # that cleaning does not turn into spaces; `isspace` is that test.
            if _is_whitespace(char) or char.isspace():
                if current:
                    words.append(current)
                current = []
            elif _is_cjk_char(ord(char)):
                if current:
                    words.append(current)
                current = []
                words.append([(char, index, index + 1)])
            else:
                current.append((char, index, index + 1))
        if current:
            words.append(current)

        for word in words:
            if self.do_lower_case:
                word = _strip_accents_chars(_lower_chars(word))
            piece: List[Tuple[str, int, int]] = []
            for item in word:
                if _is_punctuation(item[0]):
                    if piece:
                        yield "".join(c for c, _, _ in piece), piece
                    piece = []
                    yield item[0], [item]
                else:
                    piece.append(item)
            if piece:
                yield "".join(c for c, _, _ in piece), piece


def _lower_chars(word: List[Tuple[str, int, int]]) -> List[Tuple[str, int, int]]:
    """Lowercases a word of (char, start, end) exactly as `str.lower()` on the whole word.

    `str.lower` is context-sensitive only for capital sigma (final form), and that never
    changes the length, so the lowered word can be sliced by per-character lengths.
    """
    lowered = "".join(c for c, _, _ in word).lower()
    output = []
    position = 0
    for char, start, end in word:
        size = len(char.lower())
        for new_char in lowered[position:position + size]:
            output.append((new_char, start, end))
        position += size
    return output


def _strip_accents_chars(word: List[Tuple[str, int, int]]) -> List[Tuple[str, int, int]]:
    """NFD + drop Mn on a word of (char, start, end), exactly as on the whole word.

    NFD of a word is the per-character decompositions with combining marks canonically
    reordered, which keeps the length; characters therefore take the span of the decomposition
    slot they land in. Dropped marks widen the previous kept character's span.
    """
    decomposed = unicodedata.normalize("NFD", "".join(c for c, _, _ in word))
    slots = []
    for char, start, end in word:
        slots.extend([(start, end)] * len(unicodedata.normalize("NFD", char)))
    output: List[Tuple[str, int, int]] = []
    for char, (start, end) in zip(decomposed, slots):
        if unicodedata.category(char) == "Mn":
            if output:
                prev_char, prev_start, prev_end = output[-1]
                output[-1] = (prev_char, min(prev_start, start), max(prev_end, end))
            continue
        output.append((char, start, end))
    return output


_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


def _split_special(text: str, keep_special_tokens: bool):
    """Yields (segment, is_special) pieces of `text`, in order, covering it exactly."""
    if not keep_special_tokens or "[" not in text:
        yield text, False
        return
    for index, segment in enumerate(_SPECIAL_RE.split(text)):
        # re.split with one capturing group alternates plain text and matches.
        if segment:
            yield segment, index % 2 == 1


# --- WordpieceTokenizer ------------------------------------------------------------------


class WordpieceTokenizer:
    """Greedy longest-match-first WordPiece over an already basic-tokenized text.

    Example:
      "unaffable" -> ["un", "##aff", "##able"]
    A word longer than `max_input_chars_per_word` characters, or one some part of which no
    vocabulary entry covers, becomes a single `unk_token`.
    """

    def __init__(self, vocab: Dict[str, int], unk_token: str = UNK_TOKEN,
                 max_input_chars_per_word: int = MAX_INPUT_CHARS_PER_WORD):
        self.vocab = vocab
        self.unk_token = unk_token
        self.max_input_chars_per_word = max_input_chars_per_word
        # No entry is longer than this, so longer candidates need not be looked up; this only
        # saves time (a 200-character word costs ~200 lookups per piece, not ~20,000).
        self._max_piece_chars = max((len(t) for t in vocab), default=0)

    def tokenize(self, text: Union[str, bytes]) -> List[str]:
        """Splits whitespace-separated words of `text` into word pieces."""
        output: List[str] = []
        for word in whitespace_tokenize(convert_to_unicode(text)):
            pieces = self.split_word(word)
            if pieces is None:
                output.append(self.unk_token)
            else:
                output.extend(pieces)
        return output

    def split_word(self, word: str) -> Optional[List[str]]:
        """Pieces of one word, or None when the word becomes `unk_token`."""
        if len(word) > self.max_input_chars_per_word:
            return None
        pieces = []
        start = 0
        while start < len(word):
            end = min(len(word), start + self._max_piece_chars)
            match = None
            while start < end:
                candidate = word[start:end] if start == 0 else "##" + word[start:end]
                if candidate in self.vocab:
                    match = candidate
                    break
                end -= 1
            if match is None:
                return None
            pieces.append(match)
            start = end
        return pieces


# --- FullTokenizer -----------------------------------------------------------------------


class FullTokenizer:
    """BasicTokenizer followed by WordpieceTokenizer, with vocabulary lookups.

    Attributes:
      vocab: token -> id, in file order.
      inv_vocab: id -> token.
    """

    def __init__(self, vocab_file: str, do_lower_case: bool = True,
                 keep_special_tokens: bool = False):
        self.vocab_file = vocab_file
        self.vocab = load_vocab(vocab_file)
        self.inv_vocab = {index: token for token, index in self.vocab.items()}
        self.do_lower_case = do_lower_case
        self.keep_special_tokens = keep_special_tokens
        self.basic_tokenizer = BasicTokenizer(do_lower_case, keep_special_tokens)
        self.wordpiece_tokenizer = WordpieceTokenizer(self.vocab)

    def tokenize(self, text: Union[str, bytes]) -> List[str]:
        """Word pieces of `text`; `[]` for empty or all-whitespace text."""
        output: List[str] = []
        for token in self.basic_tokenizer.tokenize(text):
            if self.keep_special_tokens and token in SPECIAL_TOKENS:
                # A kept special token is a whole vocabulary entry, never word-pieced.
                output.append(token if token in self.vocab else UNK_TOKEN)
            else:
                output.extend(self.wordpiece_tokenizer.tokenize(token))
        return output

    def tokenize_with_offsets(self, text: Union[str, bytes]) -> Tuple[List[str], List[Span]]:
        """Word pieces of `text` and each piece's `(start, end)` span in `text`.

        `text[start:end]` is the original text a piece came from, before lower casing, accent
        stripping or cleaning; `[UNK]` spans its whole word. The tokens equal `tokenize(text)`.

        Example (uncased):
          "Unaffable Café" -> ["una", "##ffa", "##ble", "cafe"],
                              [(0, 3), (3, 6), (6, 9), (10, 14)]
          (the pieces depend on the vocabulary).
        """
        text = convert_to_unicode(text)
        tokens: List[str] = []
        spans: List[Span] = []
        basic = self.basic_tokenizer
        offset = 0
        for segment, is_special in _split_special(text, self.keep_special_tokens):
            if is_special:
                tokens.append(segment if segment in self.vocab else UNK_TOKEN)
                spans.append((offset, offset + len(segment)))
                offset += len(segment)
                continue
            for word, chars in basic._words_with_chars(segment, offset):
                pieces = self.wordpiece_tokenizer.split_word(word)
                if pieces is None:
                    tokens.append(UNK_TOKEN)
                    spans.append((min(s for _, s, _ in chars), max(e for _, _, e in chars)))
                    continue
                position = 0
                for piece in pieces:
                    size = len(piece) - 2 if piece.startswith("##") and position else len(piece)
                    piece_chars = chars[position:position + size]
                    tokens.append(piece)
                    spans.append((min(s for _, s, _ in piece_chars),
                                  max(e for _, _, e in piece_chars)))
                    position += size
            offset += len(segment)
        return tokens, spans

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> List[int]:
        return convert_by_vocab(self.vocab, tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> List[str]:
        return convert_by_vocab(self.inv_vocab, ids)


# --- FastTokenizer -----------------------------------------------------------------------


class _UnicodeTables(NamedTuple):
    dropped: Dict[int, None]  # str.translate table deleting NUL, U+FFFD, Cc and Cf
    dropped_re: "re.Pattern[str]"  # one character that `dropped` deletes
    marks: Dict[int, None]  # str.translate table dropping every Mn character
    cjk_re: "re.Pattern[str]"  # one CJK ideograph
    word_re: "re.Pattern[str]"  # one punctuation character, or a run of anything else


@functools.lru_cache(maxsize=None)
def _unicode_tables() -> _UnicodeTables:
    """Whole-string equivalents of the per-character rules, for non-ASCII text.

    Built once (half a second) from a scan of every code point through the same predicates the
    plain path uses, so both paths agree on every character of this Python's Unicode version.
    """
    dropped: Dict[int, None] = {}
    marks: Dict[int, None] = {}
    punct: List[int] = []
    # One C-speed pass for the categories; the predicates then run only on candidates (a
    # superset of what they accept), which keeps them the single definition of each rule.
    categories = list(map(unicodedata.category, map(chr, range(sys.maxunicode + 1))))
    for cp, category in enumerate(categories):
        first = category[0]
        if first == "C" or cp == 0xFFFD:
            if _is_dropped(chr(cp)):
                dropped[cp] = None
        elif category == "Mn":
            marks[cp] = None
        elif (first == "P" or cp < 128) and _is_punctuation(chr(cp)):
            punct.append(cp)
    punct_class = _char_class(_ranges(punct))
    return _UnicodeTables(dropped=dropped, dropped_re=re.compile(_char_class(_ranges(dropped))),
                          marks=marks, cjk_re=re.compile(_char_class(_CJK_RANGES)),
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
_ASCII_DELETE = {cp: None for cp in range(128) if _is_dropped(chr(cp))}
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
    at a few times the plain speed, and later text at 20-30 times (benchmarks/RESULTS.md).

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


# --- SentencePiece ------------------------------------------------------------------------


class SentencePieceTokenizer:
    """A trained SentencePiece `.model` behind the `FullTokenizer` API (ALBERT style).

    The model's own normalizer runs; `do_lower_case` lowercases first (as ALBERT's uncased
    models expect). For a model saved by `train_vocab --spm_model_prefix`, which was trained on
    `BasicTokenizer` output, pass `basic_tokenize=True` and the same `do_lower_case`.
    Special tokens the model defines as user symbols ("[CLS]", "[SEP]", "[MASK]") are kept
    whole wherever they appear in raw text; that is SentencePiece's own behaviour.

    Attributes:
      vocab: piece -> id, in id order.
      inv_vocab: id -> piece.
    """

    def __init__(self, model_file: str, do_lower_case: bool = False,
                 basic_tokenize: bool = False):
        import sentencepiece  # Optional dependency: only this class needs it.

        self._model = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.do_lower_case = do_lower_case
        self._basic = FastBasicTokenizer(do_lower_case, True) if basic_tokenize else None
        self.vocab = collections.OrderedDict(
            (self._model.id_to_piece(i), i) for i in range(self._model.get_piece_size()))
        self.inv_vocab = {index: piece for piece, index in self.vocab.items()}

    def tokenize(self, text: Union[str, bytes]) -> List[str]:
        """Pieces of `text` ("\u2581" marks a word start); `[]` for empty text."""
        text = convert_to_unicode(text)
        if self._basic is not None:
            text = " ".join(self._basic.tokenize(text))
        elif self.do_lower_case:
            text = text.lower()
        return self._model.encode(text, out_type=str)

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> List[int]:
        """Ids of pieces; a piece the model lacks maps to its unknown id."""
        return [self._model.piece_to_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> List[str]:
        return convert_by_vocab(self.inv_vocab, ids)


SPM_SIDECAR_SUFFIX = ".tokenizer.json"  # train_vocab writes PREFIX.tokenizer.json beside PREFIX.model


def create_tokenizer(vocab_file: str, do_lower_case: bool = True,
                     keep_special_tokens: bool = False, basic_tokenize: Optional[bool] = None):
    """`SentencePieceTokenizer` for a `.model` file, `FullTokenizer` for a vocab.txt.

    For a `.model`, `basic_tokenize=None` reads `PREFIX.tokenizer.json` when it exists (written by
    `train_vocab --spm_model_prefix=PREFIX`, whose model learned from `BasicTokenizer` output):
    its `basic_tokenize` and `do_lower_case` are the ones the model was trained with, and win over
    `do_lower_case` here (with a warning when they differ). Without that file the model's own
    normalizer runs on the raw text (an ALBERT-style model).
    """
    if vocab_file.endswith(".model"):
        sidecar = vocab_file[: -len(".model")] + SPM_SIDECAR_SUFFIX
        if basic_tokenize is None and os.path.exists(sidecar):
            import json
            with open(sidecar, encoding="utf-8") as f:
                trained = json.load(f)
            basic_tokenize = bool(trained.get("basic_tokenize", False))
            if "do_lower_case" in trained and bool(trained["do_lower_case"]) != bool(do_lower_case):
                warnings.warn(f"{vocab_file} was trained with do_lower_case={trained['do_lower_case']} "
                              f"({sidecar}); using that, not do_lower_case={do_lower_case}")
                do_lower_case = bool(trained["do_lower_case"])
        return SentencePieceTokenizer(vocab_file, do_lower_case=do_lower_case,
                                      basic_tokenize=bool(basic_tokenize))
    return FullTokenizer(vocab_file, do_lower_case, keep_special_tokens)
