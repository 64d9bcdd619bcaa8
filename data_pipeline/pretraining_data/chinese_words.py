"""Chinese whole-word masking: a word segmenter's words as "continues the word before" bits per token.

Google's Chinese vocabulary tokenizes Chinese text into single characters (`BasicTokenizer`
spaces out every CJK ideograph), so Google's `--do_whole_word_mask`, which groups a token with
the `##` pieces after it, masks single characters. Chinese whole-word masking (Cui et al. 2019,
"Pre-Training with Whole Word Masking for Chinese BERT") segments the text into words and masks
the characters of a chosen word together. This module owns that grouping:

- `ChineseWordSegmenter`: jieba (`pip install -e '.[chinese]'`) in a `jieba.Tokenizer` of its own
  (a user dictionary never leaks into jieba's global tokenizer), its dictionary cache written
  where it can be, its "Building prefix dict..." chatter kept off stderr (our logger says it at
  debug level). `cut` runs with jieba's HMM on (`HMM`): its new-word detection is a Viterbi
  decode over fixed tables, deterministic, and it finds the unlisted words a statistical
  segmenter (LTP, what Cui et al. used) would.
- `read_user_dict`: `--chinese_user_dict`, LTP style (one word per line) or jieba's
  `word [freq] [tag]`.
- `marking_tokenizer`: the reference mode's tokenizer with those marks on its tokens.
- `ChineseWordSegmenter.continuations`: per token of a line, whether it continues the word of the token before it.
  True only for the 2nd, 3rd, ... character of a segmenter word made of two or more CJK
  ideographs and nothing else (the word test, `is_chinese`, of HuggingFace's Chinese WWM script
  `run_chinese_ref.py`); everything else keeps Google's grouping (a `##` piece still joins the
  token before it, which the masking code checks itself), so text without CJK ideographs is
  masked exactly as Google's `--do_whole_word_mask` masks it. A marked token joins the candidate
  before it exactly as a `##` piece does (`instances.WordContinuation`, `fast_instances`).

Token alignment, and why it is exact: the tokenizer puts spaces around every CJK ideograph before
anything else looks at the text, and each ideograph then becomes exactly one token (itself, or
[UNK] when the vocabulary lacks it). So a line splits into `gap0 c1 gap1 c2 ... cN gapN` at its
ideographs `c_k`, its tokens are `tokens(gap0) + [c1] + tokens(gap1) + ...`, and ideograph k is
token `k - 1 + len(tokens(gap0)) + ... + len(tokens(gap_{k-1}))`. `continuations` takes the gaps'
token counts from the caller's tokenizer (the reference mode's `FullTokenizer`, the fast mode's
`FastTokenizer`), so the bits line up with the very tokens each mode writes.

Nothing here imports jax, bert_jax or tensorflow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import time
from typing import Callable, List, Optional, Sequence, Tuple

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from data_pipeline.tokenization.char_classes import CJK_RANGES

log = logging.getLogger(__name__)

FLAG = "--chinese_whole_word_mask"
USER_DICT_FLAG = "--chinese_user_dict"
HMM = True  # jieba's new-word detection (deterministic); recorded in dataset_info.json

# One CJK ideograph in the tokenizer's sense (`char_classes.is_cjk_char`), as a capturing split.
_CJK_CLASS = "[" + "".join(f"{re.escape(chr(lo))}-{re.escape(chr(hi))}" for lo, hi in CJK_RANGES) + "]"
_CJK_RE = re.compile(_CJK_CLASS)
_CJK_SPLIT_RE = re.compile(f"({_CJK_CLASS})")
_ALL_CJK_RE = re.compile(f"{_CJK_CLASS}{{2,}}")


def _import_jieba():
    try:
        import jieba
    except ImportError as e:
        raise ImportError(f"{FLAG} segments text with jieba: pip install -e '.[chinese]' "
                          f"(or pip install jieba) ({e})") from e
    return jieba


def segmenter_version() -> str:
    return _import_jieba().__version__


# ---------------------------------------------------------------------------------------------
# The user dictionary
# ---------------------------------------------------------------------------------------------


def read_user_dict(path: str) -> List[Tuple[str, Optional[int]]]:
    """`(word, freq or None)` per line of a user dictionary, in file order.

    A line is a word (LTP's format), or jieba's `word freq`, `word freq tag` or `word tag`
    (whitespace separated; a tag is ignored: only the grouping matters here). Blank lines are
    skipped. Without a frequency jieba picks one that keeps the word whole (`suggest_freq`).

    Raises:
      FileNotFoundError: no such file (the message names `--chinese_user_dict` and the path).
      ValueError: a line that is not one of those forms, or not UTF-8 (named by line number).
    """
    where = f"{USER_DICT_FLAG}={path}"
    if not storage.exists(storage_paths.check(path, USER_DICT_FLAG)):
        raise FileNotFoundError(f"{where}: no such file")
    try:
        text = storage.read_bytes(path).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 ({e})") from e
    entries: List[Tuple[str, Optional[int]]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        word, rest = fields[0], fields[1:]
        freq: Optional[int] = None
        if rest and rest[0].isdigit():
            freq = int(rest.pop(0))
            if freq == 0:
                # jieba's "freq 0" force-splits the word in its process-wide HMM tables.
                raise ValueError(f"{where}, line {number}: frequency 0 for {word!r}; give a positive "
                                 "frequency or none (a word listed here is kept whole)")
        if len(rest) > 1 or (rest and rest[0].isdigit()):
            raise ValueError(f"{where}, line {number}: {line.strip()!r} is not 'word', 'word freq', "
                             "'word freq tag' or 'word tag'")
        entries.append((word, freq))
    return entries


# ---------------------------------------------------------------------------------------------
# The segmenter
# ---------------------------------------------------------------------------------------------


def _cache_dir() -> Optional[str]:
    """A writable folder for jieba's dictionary cache (~1.5 s to build, ~0.5 s to load), or None."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for folder in (os.path.join(cache_home, "bert_jax", "jieba"), tempfile.gettempdir()):
        try:
            storage.makedirs(folder)
            if os.access(folder, os.W_OK | os.X_OK):
                return folder
        except OSError:
            continue
    return None


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    """jieba logs to its own stderr handler at DEBUG; keep that off stderr while we initialize."""
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


_DEFAULT_DICTIONARY: Optional[tuple] = None  # jieba's (FREQ, total), loaded once per process


def _default_dictionary(jieba) -> tuple:
    """jieba's default prefix dictionary, `(FREQ, total)`: 1-2 s to load, so once per process."""
    global _DEFAULT_DICTIONARY
    if _DEFAULT_DICTIONARY is None:
        tokenizer = jieba.Tokenizer()
        cache = _cache_dir()
        if cache is None:
            log.warning("no writable folder for jieba's dictionary cache: it is rebuilt each run (~2 s)")
        tokenizer.tmp_dir = cache
        started = time.time()
        with _quiet(logging.getLogger("jieba")):
            tokenizer.initialize()
        log.debug("jieba %s: dictionary loaded in %.2f s", jieba.__version__, time.time() - started)
        _DEFAULT_DICTIONARY = (tokenizer.FREQ, tokenizer.total)
    return _DEFAULT_DICTIONARY


class ChineseWordSegmenter:
    """jieba words of a text, deterministic, with an optional user dictionary.

    Each segmenter is a `jieba.Tokenizer` of its own over the default dictionary (loaded once per
    process and shared; copied before a user dictionary adds to it), so user words never reach
    jieba's global tokenizer or another segmenter.

    Example:
      seg = ChineseWordSegmenter()
      seg.words("我喜欢自然语言处理")  # -> ["我", "喜欢", "自然语言", "处理"]
    """

    def __init__(self, user_dict: Optional[str] = None):
        jieba = _import_jieba()
        entries = read_user_dict(user_dict) if user_dict else []  # a bad file fails before the slow load
        freq, total = _default_dictionary(jieba)
        self._jieba = jieba.Tokenizer()
        # What `initialize()` would load; `cut` only reads it, `add_word` writes it (hence the copy).
        self._jieba.FREQ, self._jieba.total = (dict(freq) if entries else freq), total
        self._jieba.initialized = True
        for word, word_freq in entries:
            self._jieba.add_word(word, word_freq)
        self.user_dict = user_dict

    def words(self, text: str) -> List[str]:
        """The segmenter's words; they concatenate to `text` exactly."""
        return list(self._jieba.cut(text, HMM=HMM))

    def continuations(self, text: str, count_tokens: Callable[[List[str]], Sequence[int]]) -> List[bool]:
        """Per token of `text`: whether it continues the Chinese word of the token before it.

        Args:
          text: one line, as the tokenizer sees it.
          count_tokens: the number of tokens the tokenizer makes of each of a list of texts (the
            text between ideographs), e.g. `lambda gaps: [len(t) for t in fast.encode_batch(gaps)]`.

        Example (each ideograph one token; jieba: 我 / 喜欢 / BERT / 模型):
          "我喜欢BERT模型" with tokens [我, 喜, 欢, bert, 模, 型] -> [F, F, T, F, F, T]
        """
        parts = _CJK_SPLIT_RE.split(text)  # [gap0, c1, gap1, ..., cN, gapN]
        num_cjk = len(parts) // 2
        if not num_cjk:
            return [False] * sum(count_tokens([text]))
        continues = self._cjk_continues(text, num_cjk)
        gaps = parts[0::2]
        nonempty = [i for i, g in enumerate(gaps) if g]
        counts = [0] * len(gaps)
        for i, n in zip(nonempty, count_tokens([gaps[i] for i in nonempty])):
            counts[i] = n
        bits: List[bool] = [False] * counts[0]
        for k in range(num_cjk):
            # Ideograph k continues a word only right after ideograph k - 1 (same word: adjacent),
            # so its previous token is ideograph k - 1's.
            bits.append(continues[k])
            if counts[k + 1]:
                bits.extend([False] * counts[k + 1])
        return bits

    def _cjk_continues(self, text: str, num_cjk: int) -> List[bool]:
        """For each CJK ideograph of `text`, in order: whether it continues a segmenter word of
        two or more ideographs and nothing else (its 2nd, 3rd, ... character)."""
        out: List[bool] = []
        covered = 0
        for word in self._jieba.cut(text, HMM=HMM):
            covered += len(word)
            if len(word) > 1 and _ALL_CJK_RE.fullmatch(word):
                out.append(False)
                out.extend([True] * (len(word) - 1))
            elif not word.isascii():
                out.extend([False] * len(_CJK_RE.findall(word)))
        if covered != len(text) or len(out) != num_cjk:  # jieba's words always cover the text
            raise RuntimeError(f"the segmenter's words do not cover the text {text[:80]!r}")
        return out


def check_alignment(bits: Sequence[bool], num_tokens: int, text: str) -> None:
    """Raises if `continuations` and the tokenizer disagree on the number of tokens of `text`."""
    if len(bits) != num_tokens:
        raise RuntimeError(f"{FLAG}: {len(bits)} word bits for {num_tokens} tokens of {text[:80]!r} "
                           "(tokenizer and segmenter alignment disagree)")


def marking_tokenizer(tokenizer, segmenter: ChineseWordSegmenter) -> Callable[[str], List[str]]:
    """`tokenizer.tokenize` (a `FullTokenizer`: the reference mode's), with every token that
    continues a Chinese word made an `instances.WordContinuation` (the same string: only
    whole-word masking's grouping tells it apart, as it tells a `##` piece apart).

    Example: "我喜欢BERT模型" -> ["我", "喜", WordContinuation("欢"), "bert", "模", WordContinuation("型")]
    """
    from data_pipeline.pretraining_data.instances import WordContinuation

    def count_tokens(texts: List[str]) -> List[int]:
        return [len(tokenizer.tokenize(t)) for t in texts]

    def tokenize(text: str) -> List[str]:
        tokens = tokenizer.tokenize(text)
        bits = segmenter.continuations(text, count_tokens)
        check_alignment(bits, len(tokens), text)
        return [WordContinuation(t) if b else t for t, b in zip(tokens, bits)]
    return tokenize
