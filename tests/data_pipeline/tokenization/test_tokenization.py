"""Tests for data_pipeline.tokenization against hand-written expectations of Google's rules.

Every expected token list below was written from the rules of google-research/bert's
tokenization.py (cleaning, CJK spacing, lower casing + accent stripping, punctuation split,
greedy WordPiece with a 200-character limit), not computed by the code under test. The fast
tokenizers must meet the same expectations, and agree with the plain ones on every BMP code
point and, when ../shared/data is present, on real corpora with the real BERT vocabularies.
"""

import os
import time
from pathlib import Path

import pytest

from data_pipeline import tokenization as tok
from data_pipeline.tokenization.fast import FastBasicTokenizer, FastTokenizer

SHARED_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"

VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",                    # 0-4
    "un", "##aff", "##able", "want", "##ed", "##ing",                  # 5-10
    "xy", "xyz", "##w", "##zw",                                        # 11-14: greedy match
    "pq", "pqr", "##rs",                                               # 15-17: no backtracking
    "a", "##a", "b", "c", "the", "is", "mask", "hello", "world",       # 18-26
    ",", "!", ".", "[", "]", "?", "'", "t", "don",                     # 27-35
    "H", "##é", "##llo", "cafe", "中", "文", "##b", "##c",             # 36-43
]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("".join(token + "\n" for token in VOCAB), encoding="utf-8")
    return str(path)


BASIC_IMPLS = [tok.BasicTokenizer, FastBasicTokenizer]
FULL_IMPLS = [tok.FullTokenizer, FastTokenizer]


def basic(impl, text, lower=True, keep=False):
    return impl(do_lower_case=lower, keep_special_tokens=keep).tokenize(text)


# --- input handling ----------------------------------------------------------------------


def test_convert_to_unicode():
    assert tok.convert_to_unicode("héllo") == "héllo"
    assert tok.convert_to_unicode("héllo".encode("utf-8")) == "héllo"
    assert tok.convert_to_unicode(b"ab\xffcd") == "ab\ufffdcd"
    with pytest.raises(ValueError):
        tok.convert_to_unicode(12)


def test_load_vocab_strips_lines_and_numbers_by_line(tmp_path, caplog):
    path = tmp_path / "v.txt"
    path.write_bytes(b"[PAD]\r\n  hello \nworld\nhello\n")
    with caplog.at_level("WARNING"):
        vocab = tok.load_vocab(str(path))
    # A repeated token takes its later line's id, as in Google's loader, with a warning naming it.
    assert dict(vocab) == {"[PAD]": 0, "hello": 3, "world": 2}
    assert "v.txt: 1 line(s) repeat an earlier token (first: line 4 repeats 'hello' of line 2)" in caplog.text
    assert "ids run to 3 with only 3 distinct tokens" in caplog.text
    with pytest.raises(ValueError, match=r"v.txt: no \[CLS\], \[MASK\] \(3 tokens\)"):
        tok.require_tokens(vocab, str(path), ("[PAD]", "[CLS]", "[MASK]"))
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"v.txt: no \[CLS\] \(it is empty\)"):
        tok.require_tokens(tok.load_vocab(str(path)), str(path), ("[CLS]",))


# --- BasicTokenizer rules, cased and uncased --------------------------------------------

CLEANING_CASES = [
    ("a\x00b c", ["ab", "c"]),
    ("a\ufffdb", ["ab"]),
    ("a\x07b\x1bc\x7fd", ["abcd"]),            # Cc control characters are deleted
    ("a\u200bb\u00adc\ufeffd", ["abcd"]),      # Cf format characters are deleted
    ("a\x0bb\x0cc\x85d\x1fe", ["abcde"]),      # Cc even where Python calls it whitespace
    ("a\tb\nc\rd e", ["a", "b", "c", "d", "e"]),
    ("a\u00a0b\u3000c\u2003d", ["a", "b", "c", "d"]),  # Zs
    ("a\u2028b", ["a", "b"]),                  # Zl survives cleaning; the final split cuts it
    ("a\ue000b", ["a\ue000b"]),                # private use is kept
    ("\x00\ufffd\u200b", []),
    ("", []),
    (" \n\t\r ", []),
]


@pytest.mark.parametrize("impl", BASIC_IMPLS)
@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("text,expected", CLEANING_CASES)
def test_cleaning(impl, lower, text, expected):
    assert basic(impl, text, lower) == expected


@pytest.mark.parametrize("impl", BASIC_IMPLS)
def test_cjk_spacing(impl):
    for lower in (True, False):
        assert basic(impl, "ab中文cd", lower) == ["ab", "中", "文", "cd"]
        assert basic(impl, "中文。", lower) == ["中", "文", "。"]
        # Ext A, Ext B and the first Ext E code point are spaced; Ext F (U+2CEB0) is outside
        # the reference's ranges and is not.
        assert basic(impl, "a\u3400b\U00020000c\U0002b820d\U0002ceb0e", lower) == [
            "a", "\u3400", "b", "\U00020000", "c", "\U0002b820", "d\U0002ceb0e"]
    # Hangul and kana are not split.
    assert basic(impl, "한국어中 ひらがな カタカナ", lower=False) == [
        "한국어", "中", "ひらがな", "カタカナ"]
    # Uncased, NFD turns Hangul syllables into conjoining jamo (letters, kept) and strips the
    # kana voicing mark U+3099 (Mn): が -> か.
    assert basic(impl, "한 ひらがな", lower=True) == ["\u1112\u1161\u11ab", "ひらかな"]
    # A CJK compatibility ideograph is spaced, then (uncased) NFD maps it to U+8C48.
    assert basic(impl, "x\uf900y", lower=False) == ["x", "\uf900", "y"]
    assert basic(impl, "x\uf900y", lower=True) == ["x", "\u8c48", "y"]


ACCENT_CASES = [
    # text, uncased, cased
    ("Héllo WÖRLD", ["hello", "world"], ["Héllo", "WÖRLD"]),
    ("naïve Ångström façade", ["naive", "angstrom", "facade"], ["naïve", "Ångström", "façade"]),
    ("cafe\u0301", ["cafe"], ["cafe\u0301"]),
    ("ΟΔΟΣ ΣΑΣ ΣΑ", ["οδος", "σας", "σα"], ["ΟΔΟΣ", "ΣΑΣ", "ΣΑ"]),  # final sigma is ς
    ("İstanbul", ["istanbul"], ["İstanbul"]),
    ("Straße", ["straße"], ["Straße"]),
    ("\ufb01ne", ["\ufb01ne"], ["\ufb01ne"]),              # NFD, not NFKD: the ligature stays
    ("\u0915\u093f\u0902", ["\u0915\u093f"], ["\u0915\u093f\u0902"]),  # Mc kept, Mn dropped
    ("a \u0301 b", ["a", "b"], ["a", "\u0301", "b"]),       # a lone mark vanishes uncased
]


@pytest.mark.parametrize("impl", BASIC_IMPLS)
@pytest.mark.parametrize("text,uncased,cased", ACCENT_CASES)
def test_lower_case_and_accents(impl, text, uncased, cased):
    assert basic(impl, text, lower=True) == uncased
    assert basic(impl, text, lower=False) == cased


ASCII_PUNCTUATION = "!\"#$%&'()*+,-./" + ":;<=>?@" + "[\\]^_`" + "{|}~"


@pytest.mark.parametrize("impl", BASIC_IMPLS)
@pytest.mark.parametrize("char", list(ASCII_PUNCTUATION))
def test_every_ascii_punctuation_is_split(impl, char):
    assert basic(impl, f"Ab{char}cD", lower=True) == ["ab", char, "cd"]
    assert basic(impl, f"Ab{char}cD", lower=False) == ["Ab", char, "cD"]


@pytest.mark.parametrize("impl", BASIC_IMPLS)
def test_unicode_punctuation_and_symbols(impl):
    cases = {
        "¿Qué?": ["¿", "que", "?"],                   # Po
        "«a»": ["«", "a", "»"],                       # Pi, Pf
        "a—b–c": ["a", "—", "b", "–", "c"],           # Pd
        "“a” ‘b’": ["“", "a", "”", "‘", "b", "’"],    # Pi, Pf
        "（a）": ["（", "a", "）"],                    # Ps, Pe
        "a‿b": ["a", "‿", "b"],                       # Pc
        "a§b¶c": ["a", "§", "b", "¶", "c"],           # Po
        "a・b": ["a", "・", "b"],                      # Po (katakana middle dot)
        # Symbols outside ASCII (S*) are not punctuation and stay inside the word.
        "a©b a€b a×b a°b": ["a©b", "a€b", "a×b", "a°b"],
        "abc123 x_y don't ...!!": ["abc123", "x", "_", "y", "don", "'", "t",
                                   ".", ".", ".", "!", "!"],
    }
    for text, expected in cases.items():
        assert basic(impl, text, lower=True) == expected, text


@pytest.mark.parametrize("impl", BASIC_IMPLS)
def test_special_tokens_option(impl):
    text = "The [MASK] is here.[SEP]"
    assert basic(impl, text) == ["the", "[", "mask", "]", "is", "here", ".", "[", "sep", "]"]
    assert basic(impl, text, keep=True) == ["the", "[MASK]", "is", "here", ".", "[SEP]"]
    assert basic(impl, "x[CLS]y [mask]", keep=True) == ["x", "[CLS]", "y", "[", "mask", "]"]
    assert basic(impl, "[MASK]", lower=False, keep=True) == ["[MASK]"]


# --- WordPiece and the full tokenizer -----------------------------------------------------


@pytest.mark.parametrize("impl", FULL_IMPLS)
def test_wordpiece(impl, vocab_file):
    t = impl(vocab_file)
    cases = {
        "unaffable": ["un", "##aff", "##able"],
        "Wanted WANTING": ["want", "##ed", "want", "##ing"],
        "xyzw": ["xyz", "##w"],          # longest match first, not xy + ##zw
        "pqrs": ["[UNK]"],               # pqr + ##s fails; no backtracking to pq + ##rs
        "wantx": ["[UNK]"],              # "##x" is not in the vocabulary
        "☃ hello": ["[UNK]", "hello"],   # unknown character
        "Hello, world!": ["hello", ",", "world", "!"],
        "Don't": ["don", "'", "t"],
        "中文a": ["中", "文", "a"],
        "Café": ["cafe"],
        "abc": ["a", "##b", "##c"],
        "": [],
        "\x00 \t": [],
    }
    for text, expected in cases.items():
        assert t.tokenize(text) == expected, text


@pytest.mark.parametrize("impl", FULL_IMPLS)
def test_cased_wordpiece(impl, vocab_file):
    t = impl(vocab_file, do_lower_case=False)
    assert t.tokenize("Héllo hello") == ["H", "##é", "##llo", "hello"]
    assert t.tokenize("Cafe") == ["[UNK]"]


@pytest.mark.parametrize("impl", FULL_IMPLS)
def test_max_word_length_is_200_characters(impl, vocab_file):
    t = impl(vocab_file)
    assert t.tokenize("a" * 200) == ["a"] + ["##a"] * 199
    assert t.tokenize("a" * 201) == ["[UNK]"]
    assert t.tokenize("a" * 201 + " b") == ["[UNK]", "b"]


class _CountedVocab(dict):
    """A vocabulary that counts the membership tests made on it."""

    lookups = 0

    def __contains__(self, token):
        self.lookups += 1
        return super().__contains__(token)


@pytest.mark.parametrize("impl", FULL_IMPLS)
def test_one_megabyte_word_is_unk_quickly(impl, vocab_file):
    """Given up on by its length, before a single vocabulary lookup (Google's greedy matching over
    a megabyte would take cubic time), and the whole text in linear work."""
    t = impl(vocab_file)
    # pylint: disable-next=protected-access
    wordpiece = t.wordpiece_tokenizer if impl is tok.FullTokenizer else t._wordpiece
    wordpiece.vocab = counted = _CountedVocab(wordpiece.vocab)
    assert t.tokenize("ab") == ["a", "##b"] and counted.lookups > 0  # (the count sees the lookups)
    counted.lookups = 0
    start = time.thread_time()
    assert t.tokenize("a" * 1_000_000) == ["[UNK]"]
    assert counted.lookups == 0
    # Measured: 1.2-1.6 s (FullTokenizer) on this 2-core machine; the bound catches a pass over the
    # text that is not linear (one quadratic slice per character: 31 s). CPU time, not wall-clock: a
    # loaded machine makes this thread wait for a core, and that is not counted.
    assert time.thread_time() - start < 20


@pytest.mark.parametrize("impl", FULL_IMPLS)
def test_bytes_input(impl, vocab_file):
    t = impl(vocab_file)
    assert t.tokenize("Café".encode("utf-8")) == ["cafe"]
    assert t.tokenize(b"un\xffaff\xfeable") == ["un", "##aff", "##able"]  # U+FFFD is dropped


@pytest.mark.parametrize("impl", FULL_IMPLS)
def test_ids(impl, vocab_file):
    t = impl(vocab_file)
    assert t.vocab["[UNK]"] == 1 and t.inv_vocab[5] == "un"
    assert t.convert_tokens_to_ids(["[CLS]", "un", "##aff", "[SEP]"]) == [2, 5, 6, 3]
    assert t.convert_ids_to_tokens([2, 5, 6, 3]) == ["[CLS]", "un", "##aff", "[SEP]"]
    with pytest.raises(KeyError):
        t.convert_tokens_to_ids(["nope"])


@pytest.mark.parametrize("impl", FULL_IMPLS)
def test_full_special_tokens(impl, vocab_file):
    t = impl(vocab_file, keep_special_tokens=True)
    assert t.tokenize("the [MASK] is a.") == ["the", "[MASK]", "is", "a", "."]
    assert t.tokenize("[UNK][CLS]") == ["[UNK]", "[CLS]"]
    assert impl(vocab_file).tokenize("the [MASK]") == ["the", "[", "mask", "]"]


def test_fast_batch_api(vocab_file):
    fast = FastTokenizer(vocab_file)
    texts = ["Unaffable!", "", b"wanted", "pqrs a"]
    assert fast.tokenize_batch(texts) == [["un", "##aff", "##able", "!"], [], ["want", "##ed"],
                                          ["[UNK]", "a"]]
    assert fast.encode_batch(texts) == [[5, 6, 7, 28], [], [8, 9], [1, 18]]
    assert fast.encode("Unaffable!") == [5, 6, 7, 28]
    # Memoized answers stay right when asked again.
    assert fast.encode_batch(texts) == [[5, 6, 7, 28], [], [8, 9], [1, 18]]


# --- offsets --------------------------------------------------------------------------------


def test_offsets(vocab_file):
    t = tok.FullTokenizer(vocab_file)
    text = "Unaffable,  Héllo中 pqrs cafe\u0301!"
    tokens, spans = t.tokenize_with_offsets(text)
    assert tokens == ["un", "##aff", "##able", ",", "hello", "中", "[UNK]", "cafe", "!"]
    # The accent-stripped é keeps its source span; the stripped U+0301 widens "cafe" to it.
    assert spans == [(0, 2), (2, 5), (5, 9), (9, 10), (12, 17), (17, 18), (19, 23), (24, 29),
                     (29, 30)]
    # A deleted character sits between pieces or inside an [UNK] word's span; a lowercase
    # that grows (İ -> i + U+0307) keeps the source span.
    assert t.tokenize_with_offsets("a\x00b İs pq\x00rs") == (
        ["a", "##b", "is", "[UNK]"], [(0, 1), (2, 3), (4, 6), (7, 12)])
    assert t.tokenize_with_offsets("") == ([], [])


def test_offsets_with_special_tokens(vocab_file):
    t = tok.FullTokenizer(vocab_file, keep_special_tokens=True)
    assert t.tokenize_with_offsets("a[MASK] b") == (["a", "[MASK]", "b"],
                                                    [(0, 1), (1, 7), (8, 9)])


def test_basic_offsets_cased():
    tokens, spans = tok.BasicTokenizer(do_lower_case=False).tokenize_with_offsets(" Héllo, wörld")
    assert tokens == ["Héllo", ",", "wörld"]
    assert spans == [(1, 6), (6, 7), (8, 13)]


# --- fast == plain on every character ---------------------------------------------------------


def _char_probe_lines(code_points):
    """Each code point between letters and next to punctuation, 128 probes per line."""
    words = [f"A{chr(cp)}b {chr(cp)}. Σ{chr(cp)}" for cp in code_points]
    return [" ".join(words[i:i + 128]) for i in range(0, len(words), 128)]


@pytest.mark.parametrize("lower", [True, False])
def test_fast_basic_equals_plain_on_every_bmp_character(lower):
    code_points = [cp for cp in range(0x10000) if not 0xD800 <= cp <= 0xDFFF]
    code_points += list(range(0x10000, 0x110000, 97))  # a sample of the other planes
    lines = _char_probe_lines(code_points)
    plain = tok.BasicTokenizer(do_lower_case=lower)
    fast = FastBasicTokenizer(do_lower_case=lower)
    expected = [plain.tokenize(line) for line in lines]
    assert fast.tokenize_batch(lines) == expected
    # The offsets path re-implements the rules on (char, span) triples; same tokens.
    for line, tokens in zip(lines[::4], expected[::4]):
        assert plain.tokenize_with_offsets(line)[0] == tokens


# --- real corpora and vocabularies (optional) -------------------------------------------------


def _corpus_lines():
    lines = []
    for path in sorted((SHARED_DATA / "corpus").glob("*/*")):
        if path.is_file() and "README" not in path.name:
            lines.extend(path.read_bytes().decode("utf-8", errors="replace").splitlines())
    return lines


@pytest.mark.skipif(not (SHARED_DATA / "corpus").is_dir(), reason="../shared/data is absent")
@pytest.mark.parametrize("name,lower", [("bert-base-uncased", True), ("bert-base-cased", False)])
def test_fast_equals_full_on_real_corpora(name, lower):
    """Every 25th corpus line by default; every line with BERT_JAX_FULL_CORPUS_TEST=1 (~30 s)."""
    vocab_file = str(SHARED_DATA / "vocab" / name / "vocab.txt")
    step = 1 if os.environ.get("BERT_JAX_FULL_CORPUS_TEST") == "1" else 25
    lines = _corpus_lines()[::step]
    full = tok.FullTokenizer(vocab_file, do_lower_case=lower)
    fast = FastTokenizer(vocab_file, do_lower_case=lower)
    expected = [full.convert_tokens_to_ids(full.tokenize(line)) for line in lines]
    assert fast.encode_batch(lines) == expected
    # Offsets: same tokens, and each span's text re-tokenizes to the piece it produced.
    basic = tok.BasicTokenizer(do_lower_case=lower)
    for line, ids in zip(lines[::10], expected[::10]):
        tokens, spans = full.tokenize_with_offsets(line)
        assert full.convert_tokens_to_ids(tokens) == ids
        for token, (start, end) in zip(tokens, spans):
            if token != "[UNK]":
                piece = token[2:] if token.startswith("##") and len(token) > 2 else token
                assert "".join(basic.tokenize(line[start:end])) == piece, (line, token)
