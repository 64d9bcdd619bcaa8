"""Google's character classes: what BERT's tokenizer counts as whitespace, control, punctuation, CJK.

The definitions of google-research/bert `tokenization.py`, one predicate each, shared by the plain
tokenizers (`tokenization/__init__.py`, which apply them character by character) and the fast path
(`fast.py`, which compiles them into whole-string tables), so that both agree on every
character. Nothing here imports jax or bert_jax.
"""

from __future__ import annotations

import unicodedata


def is_whitespace(char: str) -> bool:
    """Space, tab, newline, carriage return, or any Unicode space separator (Zs)."""
    # Tab, newline and carriage return are category Cc but are treated as whitespace.
    if char in " \t\n\r":
        return True
    return unicodedata.category(char) == "Zs"


def is_control(char: str) -> bool:
    """Control (Cc) or format (Cf) characters, except tab, newline and carriage return.

    Only Cc and Cf: private-use (Co) and unassigned (Cn) characters are kept, as in Google's code
    (HuggingFace's normalizer drops them too, one reason its full pipeline is not used for
    non-ASCII text in `FastTokenizer`).
    """
    if char in "\t\n\r":
        return False
    return unicodedata.category(char) in ("Cc", "Cf")


def is_punctuation(char: str) -> bool:
    """ASCII non-alphanumeric symbols (33-47, 58-64, 91-96, 123-126) or Unicode P*."""
    cp = ord(char)
    # "$", "+", "^", "`" ... are symbols (S*), not punctuation, in Unicode, but the reference
    # splits every non-alphanumeric printable ASCII character.
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


# The CJK Unified Ideographs blocks of the reference, inclusive. Hangul, Hiragana and Katakana
# are deliberately absent: those scripts separate words with spaces.
CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


def is_cjk_char(cp: int) -> bool:
    """Whether code point `cp` is a CJK ideograph in the reference's sense."""
    for low, high in CJK_RANGES:
        if low <= cp <= high:
            return True
    return False


def is_dropped(char: str) -> bool:
    """Characters the cleaning step deletes: NUL, U+FFFD and control characters."""
    cp = ord(char)
    return cp == 0 or cp == 0xFFFD or is_control(char)
