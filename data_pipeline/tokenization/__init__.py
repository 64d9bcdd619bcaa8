"""Tokenization: text -> WordPiece tokens and ids, Google-exact; the stage above `storage`.

The package's face (`from data_pipeline import tokenization`) is the reference tokenizer, here;
the rest of the stage lives beside it, each name imported from its own module:

* `char_classes.py`: the character classes (whitespace, control, punctuation, CJK) every path shares.
* `fast.py`: `FastBasicTokenizer`, `FastTokenizer`, the same tokens and ids 20-30 times faster
  once warm (the batch path of data preparation and fine-tuning).
* `sentencepiece_tokenizer.py`: `SentencePieceTokenizer` and `create_tokenizer`, which picks
  between a SentencePiece `.model` and a WordPiece `vocab.txt` by file name.
* `hf_tokenizer.py`: `HFTokenizer`, a HuggingFace `tokenizer.json` (ModernBERT's BPE, ...) through
  the `tokenizers` library, its special tokens and pre-tokenizer words read from the file.

What is here, the reference rules that turn raw text into WordPiece tokens and ids:

* `BasicTokenizer`, `WordpieceTokenizer`, `FullTokenizer`: a plain, per-character Python
  implementation of the rules of google-research/bert `tokenization.py` (text cleaning, CJK
  spacing, lower casing with accent stripping, punctuation splitting, greedy longest-match-first
  WordPiece with a 200-character word limit), over the character classes of `char_classes.py`.
  It is the reference every other path is tested against, so it favours being obviously right
  over being fast.
* `FullTokenizer.tokenize_with_offsets`: the same tokens plus, for each one, the `(start, end)`
  character span it came from in the original text (SQuAD answer mapping, NER label alignment).
* `load_vocab`, `require_tokens`: reading a WordPiece `vocab.txt` as Google's loader does.

This package imports only `data_pipeline.storage` below it; never jax or bert_jax.
"""

from __future__ import annotations

import collections
import logging
import re
import unicodedata
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from data_pipeline import storage
from data_pipeline.tokenization.char_classes import is_cjk_char, is_dropped, is_punctuation, is_whitespace

# BERT's special tokens, each named once for data_pipeline (instances, tasks, vocabulary training).
CLS_TOKEN, SEP_TOKEN, MASK_TOKEN, PAD_TOKEN, UNK_TOKEN = "[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]"
# Special tokens that `keep_special_tokens=True` preserves when a user types them in raw text
# (fill-in-the-blank prompts such as "Paris is the [MASK] of France."). Google's tokenizer
# has no such option and splits them into "[", "mask", "]"; that stays the default.
SPECIAL_TOKENS = (CLS_TOKEN, SEP_TOKEN, MASK_TOKEN, UNK_TOKEN)
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
    repeated = []
    with storage.open(vocab_file, "rb") as reader:  # local or gs://, as Google's loader allows
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
            if is_dropped(char):
                continue
            output.append(" " if is_whitespace(char) else char)
        return "".join(output)

    @staticmethod
    def _space_cjk_chars(text: str) -> str:
        output = []
        for char in text:
            if is_cjk_char(ord(char)):
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
            if is_punctuation(char):
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
            if is_dropped(char):
                continue
            # Google splits with `str.split()`, which also breaks at characters such as U+2028
            # that cleaning does not turn into spaces; `isspace` is that test.
            if is_whitespace(char) or char.isspace():
                if current:
                    words.append(current)
                current = []
            elif is_cjk_char(ord(char)):
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
                if is_punctuation(item[0]):
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
