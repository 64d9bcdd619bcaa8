"""The fast and SentencePiece tokenizers against references, on text the tests make (runs in CI).

tests/data_pipeline/tokenization/test_tokenization.py pins the rules by hand and compares `FastTokenizer` with
`FullTokenizer` on real BERT vocabularies only when ../shared/data exists, which CI lacks. Here the same
comparison runs everywhere, with nothing downloaded:

* Text: the embedded offline corpus (`corpora.embedded_documents`, Python's pydoc topics),
  `HARD_TEXTS` (accents and marks, CJK, punctuation and symbols, control, format and space
  characters, over-long and unknown words, special tokens, emoji, Arabic, Devanagari, Thai ...)
  and seeded random mixtures of both glued together.
* Vocabularies: two trained by `train_vocab` on that text (uncased and cased; about a second
  each), and the hand-written `HAND_VOCAB` with longest-match traps.
* References: `FullTokenizer` (Google's rules, character by character) for every input, through
  every `FastTokenizer` API; HF `tokenizers`' BERT WordPiece, an independent implementation, where
  its normalizer agrees with Google's by design (`_hf_departure` lists where it does not); and the
  `sentencepiece` library's own `encode` for `SentencePieceTokenizer`.
"""

import io
import random
import re
import unicodedata

import pytest

from data_pipeline import tokenization as tok
from data_pipeline.tokenization.fast import FastTokenizer
from data_pipeline.tokenization.sentencepiece_tokenizer import SentencePieceTokenizer, create_tokenizer
from data_pipeline import train_vocab as tv
from data_pipeline.pretraining_data import corpora

# --- inputs ---------------------------------------------------------------------------------

HARD_TEXTS = [
    # Empty, whitespace-only, and text that cleaning deletes entirely.
    "", " ", " \t\r\n ", "\u00a0\u3000\u2003\u2028\u2029", "\x00", "\ufffd", "\u200b\ufeff\u00ad\u2060",
    "\x00\ufffd\u200b \x1c\x1f\x85",
    # Whitespace of every kind between words, control and format characters inside them.
    "a\tb\rc\nd e", "a\u00a0b\u3000c\u2003d\u202fe", "a\u2028b\u2029c", "a\x00b a\ufffdb",
    "a\u200bb\ufeffc\u00add\u2060e\u180ef", "a\x07b\x1bc\x7fd", "a\x0bb\x0cc\x1cd\x1fe\x85f",
    "x\U000e0001y\u200dz", "a\ue000b \U000f0000", "a\u0378b",
    # Accents and combining marks (uncased strips every Mn after NFD), mixed case.
    "Héllo WÖRLD", "naïve Ångström façade", "cafe\u0301 Café CAFÉ café", "e\u0301\u0327 \u0301 a \u0301 b",
    "HeLLo WoRLD hello HELLO", "İstanbul \u0130I", "Straße \u1e9e", "\ufb01ne ǅ ﬀ Ⅷ ① ＡＢＣ",
    "ΟΔΟΣ ΣΑΣ ΣΑ", "ΟΔΟΣ.ΣΑΣ ΟΔΟΣ,ΣΑ ΟΔΟΣ\u200bΑ ΟΔΟΣ中",
    "\U0001d400\U0001d5a0 \u2126 \u212b",
    # CJK ideographs get spaces around them; kana and Hangul do not; Ext F is outside the ranges.
    "中文ab中", "日本語のテキスト", "한국어 ひらがな カタカナ", "x\uf900y",
    "\u3400x\U00020000y\U0002a700z\U0002b820w\U0002ceb0v",
    # Punctuation: every ASCII symbol splits ("$", "^", "`" are Unicode symbols, still split),
    # Unicode P* splits, other Unicode symbols (S*) stay inside the word.
    "$100^2 `x` a+b=c #1 @me ~/x|y\\z", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "¿Qué? «a» “b” ‘c’ a—b–c （a） a‿b a§b¶c a・b", "a©b €5 a×b 3°C ™ ¥", "don't ...!! x_y",
    # Words longer than max_input_chars_per_word (200) become one [UNK]; length is counted after
    # lower casing and accent stripping (uncased "e\u0301" is one character, cased two).
    "a" * 200, "a" * 201, "a" * 201 + " b", "Hello" * 40, "Hello" * 41 + "!", "e\u0301" * 101,
    # Unknown words and characters; longest match first without backtracking (HAND_VOCAB).
    "☃ ☃☃ snow☃man", "zzzq qqq", "wantx", "unaffable xyzw pqrs", "\U0001f9ea\U0001f9eb",
    # Special tokens (kept whole only with keep_special_tokens, and only upper case).
    "[CLS] the [MASK] is here.[SEP]", "x[CLS]y [mask] [UNK] [PAD]", "[MASK][MASK]ab", "the [ MASK ]",
    "[MA\u200bSK] \x00[SEP]\u200b",
    # Emoji (skin tone Sk, ZWJ Cf, variation selector Mn), flags.
    "😀 👍🏽 a😀b 👨\u200d👩\u200d👧 ❤\ufe0f 🇫🇷",
    # Arabic (harakat are Mn), Hebrew points, Devanagari (virama and vowel signs Mn, Mc kept), Thai.
    "مرحبا بالعالم", "مَرْحَبًا،", "שָׁלוֹם", "नमस्ते दुनिया", "\u0915\u093f\u0902", "สวัสดีชาวโลก",
]

# Characters no training text has: words made of them are [UNK] under every vocabulary.
UNSEEN_TEXTS = ["\u2602\u2602 \U0001f9f2", "q\u2602 \u2602q", "\u16a0\u16a1"]


def _glued_mixtures(corpus_lines, count=300, seed=0):
    """Seeded random texts: fragments of HARD_TEXTS and corpus words, glued by odd separators,
    so every hard character also lands inside words, next to punctuation and at word edges."""
    rng = random.Random(seed)
    fragments = [t[:40] for t in HARD_TEXTS if t] + [w for line in corpus_lines[:200] for w in line.split()]
    separators = ["", "", " ", "  ", "\t", "\u3000", "\u00a0", "\u200b", "\x00", "-", "中", "\u0301", ".", "[MASK]"]
    return ["".join(rng.choice(fragments) + rng.choice(separators) for _ in range(rng.randint(1, 12)))
            for _ in range(count)]


# A hand-written vocabulary: pieces in several scripts, and longest-match traps ("xyzw" is
# xyz + ##w, not xy + ##zw; "pqrs" is [UNK] because pqr + ##s fails and there is no backtracking).
HAND_VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    "un", "##aff", "##able", "want", "##ed", "##ing", "xy", "xyz", "##w", "##zw", "pq", "pqr", "##rs",
    "a", "##a", "b", "##b", "c", "e", "##e", "the", "is", "here", "hello", "Hello", "HELLO", "##llo",
    "H", "##é", "é", "cafe", "café", "Café", "naive", "world", "WÖRLD", "snow", "##man", "x", "y",
    ",", "!", ".", "$", "^", "`", "?", "¿", "«", "»", "'", "-", "[", "]", "mask", "MASK", "t", "don",
    "中", "文", "日", "本", "語", "ο", "##δ", "##ο", "##ς", "##σ", "σ", "##α", "##ας",
    "مر", "##حبا", "بال", "##عالم", "न", "##म", "##स", "##त", "##्", "##े", "สวัสดี", "##ชาว",
    "😀", "##😀", "👍", "##🏽", "i", "##tanbul", "straße", "ﬁne",
]


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus_lines():
    # The pydoc topics only (~2,000 sentences, 0.2 s): the stdlib docstrings would take seconds.
    return [s for doc in corpora.embedded_documents(include_stdlib=False) for s in doc]


@pytest.fixture(scope="module")
def vocabs(corpus_lines, tmp_path_factory):
    """name -> (vocab.txt, SentencePiece .model or None, do_lower_case) for each vocabulary."""
    folder = tmp_path_factory.mktemp("vocabs")
    hand = folder / "hand.txt"
    assert len(set(HAND_VOCAB)) == len(HAND_VOCAB)  # a repeated token would shift ids
    hand.write_text("".join(t + "\n" for t in HAND_VOCAB), encoding="utf-8")
    # Every other corpus line keeps training cheap; the hard texts twice, so their characters
    # reach min_char_count and get entries (WordPiece then splits them instead of [UNK]).
    texts = corpus_lines[::2] + HARD_TEXTS * 2
    out = {"hand": (str(hand), None, None)}
    for name, lower in (("trained-uncased", True), ("trained-cased", False)):
        vocab_file, prefix = folder / f"{name}.txt", folder / name
        tv.train_vocab_from_texts(texts, 1200, str(vocab_file), do_lower_case=lower,
                                  spm_model_prefix=str(prefix))
        out[name] = (str(vocab_file), str(prefix) + ".model", lower)
    return out


def _mismatch(texts, got, want):
    """The first input whose output differs, for the assertion message."""
    for text, g, w in zip(texts, got, want):
        if g != w:
            return f"input {text!r}: got {g}, want {w}"
    return f"lengths differ: {len(got)} != {len(want)}"


def _assert_fast_equals_full(vocab_file, lower, keep, texts):
    """Every FastTokenizer API gives FullTokenizer's tokens and ids on every text."""
    full = tok.FullTokenizer(vocab_file, do_lower_case=lower, keep_special_tokens=keep)
    tokens = [full.tokenize(t) for t in texts]
    ids = [full.convert_tokens_to_ids(t) for t in tokens]
    fast = FastTokenizer(vocab_file, do_lower_case=lower, keep_special_tokens=keep)
    # Cold memo, batch APIs first; then the single-text APIs on the warm memo.
    got = fast.tokenize_batch(texts)
    assert got == tokens, _mismatch(texts, got, tokens)
    got = fast.encode_batch(texts)
    assert got == ids, _mismatch(texts, got, ids)
    for text, want_tokens, want_ids in zip(texts, tokens, ids):
        assert fast.tokenize(text) == want_tokens, repr(text)
        assert fast.encode(text) == want_ids, repr(text)
    # No memo at all (every chunk computed), and UTF-8 bytes in.
    unmemoized = FastTokenizer(vocab_file, do_lower_case=lower, keep_special_tokens=keep,
                                   cache_size=0)
    got = unmemoized.encode_batch([t.encode("utf-8") for t in texts])
    assert got == ids, _mismatch(texts, got, ids)
    return tokens, ids


# --- FastTokenizer == FullTokenizer -----------------------------------------------------------


@pytest.mark.parametrize("name,keep", [("trained-uncased", False), ("trained-cased", True)])
def test_fast_equals_full_on_embedded_corpus(vocabs, corpus_lines, name, keep):
    vocab_file, _, lower = vocabs[name]
    tokens, _ = _assert_fast_equals_full(vocab_file, lower, keep, corpus_lines)
    # The comparison means something only if WordPiece really splits: few [UNK], many "##".
    flat = [t for line in tokens for t in line]
    assert len(flat) > 50_000
    assert flat.count("[UNK]") < len(flat) / 1000
    assert sum(t.startswith("##") for t in flat) > len(flat) / 20


@pytest.mark.parametrize("name", ["trained-uncased", "trained-cased", "hand"])
@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("keep", [False, True])
def test_fast_equals_full_on_hard_texts(vocabs, name, lower, keep):
    # Each vocabulary under both casings: a mismatched vocabulary is still a valid input.
    _assert_fast_equals_full(vocabs[name][0], lower, keep, HARD_TEXTS + UNSEEN_TEXTS)


@pytest.mark.parametrize("name,keep", [("trained-uncased", True), ("trained-cased", False),
                                       ("hand", False)])
def test_fast_equals_full_on_glued_mixtures(vocabs, corpus_lines, name, keep):
    vocab_file, _, lower = vocabs[name]
    for casing in [lower] if lower is not None else [True, False]:  # the hand vocab: both
        _assert_fast_equals_full(vocab_file, casing, keep, _glued_mixtures(corpus_lines))


def test_inputs_cover_the_hard_cases(vocabs):
    """Guards the inputs: the hard texts really produce what the cases above are about."""
    uncased = tok.FullTokenizer(vocabs["trained-uncased"][0], do_lower_case=True)
    hand = tok.FullTokenizer(vocabs["hand"][0], do_lower_case=True, keep_special_tokens=True)
    assert uncased.tokenize("a" * 201) == ["[UNK]"]
    assert uncased.tokenize(" ".join(UNSEEN_TEXTS)) == ["[UNK]"] * 5
    assert uncased.tokenize("中文ab中")[:2] == ["中", "文"]
    assert uncased.tokenize("cafe\u0301 Café") == uncased.tokenize("cafe cafe")
    assert hand.tokenize("unaffable xyzw pqrs") == ["un", "##aff", "##able", "xyz", "##w", "[UNK]"]
    assert hand.tokenize("x[CLS]y") == ["x", "[CLS]", "y"]
    assert hand.tokenize("ΟΔΟΣ") == ["ο", "##δ", "##ο", "##ς"]


# --- HF tokenizers' WordPiece, the independent reference --------------------------------------


def _hf_tokenizer(vocab_file, lower, keep):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    hf = Tokenizer(models.WordPiece(vocab=dict(tok.load_vocab(vocab_file)), unk_token="[UNK]",
                                    max_input_chars_per_word=tok.MAX_INPUT_CHARS_PER_WORD))
    hf.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                               strip_accents=lower, lowercase=lower)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if keep:
        # Special tokens matched in the raw text, before normalization: keep_special_tokens.
        hf.add_special_tokens(list(tok.SPECIAL_TOKENS))
    return hf


def _hf_departure(text, lower):
    """Why HF's BertNormalizer departs from Google's on `text` by design, or None.

    Measured with tokenizers 0.22 (and named in FastTokenizer's docstring):
    * uncased, a capital sigma: HF lowercases character by character, so a word-final "Σ"
      becomes "σ"; Google's `str.lower()` on the word gives the final form "ς";
    * private-use characters (Co): HF's cleaning drops them, Google keeps them;
    * CJK Extension E (U+2B820-U+2CEAF): Google spaces it, HF does not.
    """
    if lower and "\u03a3" in text:
        return "final sigma"
    if any(unicodedata.category(c) == "Co" for c in text):
        return "private use"
    if any(0x2B820 <= ord(c) <= 0x2CEAF for c in text):
        return "CJK range"
    return None


@pytest.mark.parametrize("name,lower,keep", [
    ("trained-uncased", True, False), ("trained-uncased", True, True),
    ("trained-cased", False, False), ("trained-cased", False, True),
    ("hand", True, True), ("hand", False, False)])
def test_hf_wordpiece_agrees_where_normalizers_match(vocabs, corpus_lines, name, lower, keep):
    vocab_file = vocabs[name][0]
    texts = HARD_TEXTS + UNSEEN_TEXTS + _glued_mixtures(corpus_lines)
    if name != "hand" and not keep:  # the corpus once per trained vocabulary is enough
        texts += corpus_lines
    compared = [t for t in texts if _hf_departure(t, lower) is None]
    assert len(compared) > 0.8 * len(texts)  # the exclusions stay the exception
    hf = _hf_tokenizer(vocab_file, lower, keep)
    encodings = hf.encode_batch(compared, add_special_tokens=False)
    fast = FastTokenizer(vocab_file, do_lower_case=lower, keep_special_tokens=keep)
    got_tokens = fast.tokenize_batch(compared)
    want_tokens = [e.tokens for e in encodings]
    assert got_tokens == want_tokens, _mismatch(compared, got_tokens, want_tokens)
    got_ids = fast.encode_batch(compared)
    want_ids = [e.ids for e in encodings]
    assert got_ids == want_ids, _mismatch(compared, got_ids, want_ids)


# --- SentencePieceTokenizer against the sentencepiece library ---------------------------------


@pytest.fixture(scope="module")
def raw_spm_model(corpus_lines, tmp_path_factory):
    """An ALBERT-style model (its own nmt_nfkc normalizer on raw text), trained in memory."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines[::2] + HARD_TEXTS), model_writer=model, vocab_size=600,
        model_type="unigram", user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"], num_threads=2,
        minloglevel=2)
    path = tmp_path_factory.mktemp("spm") / "raw.model"
    path.write_bytes(model.getvalue())
    return str(path)


def _assert_round_trip(sp, pieces):
    ids = sp.convert_tokens_to_ids(pieces)
    # ids -> pieces -> ids always; pieces -> ids -> pieces except where a piece was unknown.
    assert sp.convert_tokens_to_ids(sp.convert_ids_to_tokens(ids)) == ids
    unk = sp.vocab["[UNK]"] if "[UNK]" in sp.vocab else sp.vocab["<unk>"]
    assert [p for p, i in zip(sp.convert_ids_to_tokens(ids), ids) if i != unk] == [
        p for p, i in zip(pieces, ids) if i != unk]
    return ids


def _lower_outside_specials(text):
    """`text.lower()` except the special tokens, which the model's user symbols must match."""
    parts = re.split(r"(\[CLS\]|\[SEP\]|\[MASK\]|\[UNK\])", text)
    return "".join(part if i % 2 else part.lower() for i, part in enumerate(parts))


@pytest.mark.parametrize("lower", [False, True])
def test_sentencepiece_raw_model_equals_library(raw_spm_model, corpus_lines, lower):
    import sentencepiece

    library = sentencepiece.SentencePieceProcessor(model_file=raw_spm_model)
    sp = SentencePieceTokenizer(raw_spm_model, do_lower_case=lower)
    assert isinstance(create_tokenizer(raw_spm_model), SentencePieceTokenizer)
    for text in HARD_TEXTS + UNSEEN_TEXTS + corpus_lines[1::20]:
        source = _lower_outside_specials(text) if lower else text
        pieces = sp.tokenize(text)
        assert pieces == library.encode(source, out_type=str), repr(text)
        assert sp.tokenize(text.encode("utf-8")) == pieces
        ids = _assert_round_trip(sp, pieces)
        assert ids == library.encode(source), repr(text)
        if library.unk_id() not in ids:
            # Text round trip: the pieces spell the model's normalized text.
            assert "".join(pieces).replace("\u2581", " ").strip() == library.decode(ids), repr(text)
    # A user symbol stays whole in raw text, lower casing or not (the class docstring's promise).
    pieces = sp.tokenize("[CLS] Paris is the [MASK]. [SEP]")
    assert {"[CLS]", "[MASK]", "[SEP]"} <= set(pieces), pieces


@pytest.mark.parametrize("name", ["trained-uncased", "trained-cased"])
def test_sentencepiece_model_of_train_vocab_equals_library(vocabs, corpus_lines, name):
    """train_vocab's model learned from BasicTokenizer output; create_tokenizer reads the sidecar
    and runs the same basic tokenization, which must equal the library on Google's basic tokens."""
    import sentencepiece

    _, model_file, lower = vocabs[name]
    library = sentencepiece.SentencePieceProcessor(model_file=model_file)
    sp = create_tokenizer(model_file, do_lower_case=lower)
    assert isinstance(sp, SentencePieceTokenizer)
    basic = tok.BasicTokenizer(do_lower_case=lower, keep_special_tokens=True)
    for text in HARD_TEXTS + UNSEEN_TEXTS + corpus_lines[1::20]:
        words = basic.tokenize(text)
        pieces = sp.tokenize(text)
        assert pieces == library.encode(" ".join(words), out_type=str), repr(text)
        assert _assert_round_trip(sp, pieces) == library.encode(" ".join(words)), repr(text)
        # Identity normalization: the pieces spell the basic tokens exactly, unknown ones too.
        assert "".join(pieces).replace("\u2581", " ").split() == words, repr(text)
