"""Tests for data_pipeline.train_vocab on a tiny corpus the test writes itself."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipeline import tokenization as tok
from data_pipeline.tokenization.sentencepiece_tokenizer import SentencePieceTokenizer, create_tokenizer
from data_pipeline import train_vocab as tv

WORDS = ["the", "playing", "singing", "walking", "talking", "played", "walked", "talked",
         "Naïve", "Café", "über", "Ångström", "don't", "hello,", "world!", "中文",
         "\ufb01ne"]  # the "fi" ligature: NFKC would rewrite it, the tokenizer does not
# Characters of WORDS after uncased normalization, written out by hand.
UNCASED_CHARS = set("thepaylingswkdnivecfuobrmo'") | {",", "!", "中", "文", "\ufb01"}


def corpus_lines():
    # 240 deterministic lines mixing the words in different orders and counts.
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 5))
            for i in range(240)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    lines = corpus_lines()
    (folder / "a.txt").write_text("\n".join(lines[:120]) + "\n", encoding="utf-8")
    # One line of invalid UTF-8 and one character seen only once (below min_char_count=2).
    (folder / "b.txt").write_bytes(("\n".join(lines[120:]) + "\n").encode("utf-8")
                                   + b"walk\xff\xfeing\n" + "snow☃man\n".encode("utf-8"))
    return folder


@pytest.fixture(scope="module")
def uncased(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "vocab.txt"
    stats, _ = tv.train_vocab(f"{corpus}/a.txt,{corpus}/b*.txt", 120, str(out),
                              do_lower_case=True)
    return out, stats


def test_uncased_vocab_layout_and_coverage(uncased, corpus):
    out, stats = uncased
    tokens = out.read_text(encoding="utf-8").splitlines()
    assert len(tokens) == 120 and len(set(tokens)) == 120
    assert tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    for char in UNCASED_CHARS:
        assert char in tokens and "##" + char in tokens, char
    # Normalized like the tokenizer: nothing uppercase or accented, the rare ☃ left out.
    assert not any(c in t for t in tokens[5:] for c in "ïéüÅöNC☃")
    assert "the" in tokens and "##ing" in tokens and "\ufb01ne" in tokens
    assert stats.files == 2 and stats.lines == 242 and stats.bad_utf8_lines == 1
    assert stats.chars_dropped == 1 and stats.padding == 0


def test_trained_vocab_tokenizes_corpus_without_unk(uncased, corpus):
    out, _ = uncased
    full = tok.FullTokenizer(str(out), do_lower_case=True)
    for line in corpus_lines():
        pieces = full.tokenize(line)
        assert "[UNK]" not in pieces, line
    pieces = full.tokenize("Walking")
    assert pieces[0] == "walk" or not pieces[0].startswith("##")
    assert all(p.startswith("##") for p in pieces[1:])
    assert pieces[0] + "".join(p[2:] for p in pieces[1:]) == "walking"
    assert full.tokenize("snow☃man") == ["[UNK]"]
    assert full.tokenize(b"walk\xff\xfeing") == full.tokenize("walking")


def test_cased_vocab_keeps_case_and_accents(corpus, tmp_path):
    out = tmp_path / "cased.txt"
    tv.train_vocab(str(corpus / "*.txt"), 150, str(out), do_lower_case=False)
    tokens = set(out.read_text(encoding="utf-8").splitlines())
    for char in "NïCéüÅö":
        assert char in tokens and "##" + char in tokens, char
    full = tok.FullTokenizer(str(out), do_lower_case=False)
    assert "[UNK]" not in full.tokenize("Naïve Café Ångström über")


def test_google_layout_at_30522(corpus, tmp_path):
    out = tmp_path / "google.txt"
    stats, _ = tv.train_vocab(str(corpus / "a.txt"), 30522, str(out))
    tokens = out.read_text(encoding="utf-8").splitlines()
    assert len(tokens) == 30522 and len(set(tokens)) == 30522
    assert tokens[0] == "[PAD]" and tokens[1] == "[unused0]" and tokens[99] == "[unused98]"
    assert tokens[100:104] == ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert tokens[104] == "[unused99]" and tokens[998] == "[unused993]"
    # The tiny corpus cannot fill 30k entries: the rest is padding, so the size is exact.
    assert stats.padding > 25000 and tokens[-1].startswith("[unused")
    vocab = tok.FullTokenizer(str(out)).vocab
    assert vocab["[UNK]"] == 100 and vocab["[MASK]"] == 103


def test_vocab_too_small_raises(corpus, tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        tv.train_vocab(str(corpus / "a.txt"), 30, str(tmp_path / "v.txt"))


def test_missing_input_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        tv.train_vocab(str(tmp_path / "nothing*.txt"), 100, str(tmp_path / "v.txt"))
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n")  # no vocab of reserved tokens and [unused] filler
    with pytest.raises(ValueError, match=r"--input_file=.*blank.txt: no word to train on \(2 lines read"):
        tv.train_vocab(str(blank), 100, str(tmp_path / "v.txt"))
    assert not (tmp_path / "v.txt").exists()


def test_heldout_lines_and_unk_rate(corpus, tmp_path):
    out = tmp_path / "v.txt"
    stats, heldout = tv.train_vocab(str(corpus / "a.txt"), 120, str(out), heldout_every=10)
    lines = corpus_lines()[:120]
    assert stats.heldout_lines == 12 and heldout == [lines[i] + "\n" for i in range(9, 120, 10)]
    assert stats.lines == 120
    unknown, total = tv.unk_rate(str(out), heldout + ["snow☃man"])
    assert unknown == 1 and total > 30


def test_from_texts_and_unigram(tmp_path):
    out = tmp_path / "v.txt"
    stats = tv.train_vocab_from_texts(corpus_lines(), 110, str(out), model_type="unigram")
    tokens = out.read_text(encoding="utf-8").splitlines()
    assert len(tokens) == 110 and stats.lines == 0 and stats.distinct_words == len(
        {w for word in WORDS for w in tok.BasicTokenizer().tokenize(word)})


def test_sentencepiece_model_as_tokenizer(corpus, tmp_path):
    prefix = tmp_path / "spm"
    tv.train_vocab(str(corpus / "*.txt"), 120, str(tmp_path / "v.txt"),
                   spm_model_prefix=str(prefix))
    model = str(prefix) + ".model"
    sp = create_tokenizer(model, do_lower_case=True)
    assert isinstance(sp, SentencePieceTokenizer)
    assert isinstance(create_tokenizer(str(tmp_path / "v.txt")), tok.FullTokenizer)
    assert [sp.inv_vocab[i] for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = SentencePieceTokenizer(model, do_lower_case=True,
                                        basic_tokenize=True).tokenize("The WALKING [MASK]")
    assert "[MASK]" in pieces
    assert "".join(pieces).replace("\u2581", "") == "thewalking[MASK]"
    ids = sp.convert_tokens_to_ids(pieces)
    assert sp.convert_ids_to_tokens(ids) == pieces and ids[-1] == 4
    assert sp.tokenize("") == []
    # create_tokenizer reads PREFIX.tokenizer.json: the model was trained on basic-tokenized,
    # lower-cased, accent-stripped words, so the same runs before it (no unknown pieces for
    # accented text); without the file the model sees raw text, and a cased request is overridden.
    text = "Café, naïve WALKING!"
    basic = SentencePieceTokenizer(model, do_lower_case=True, basic_tokenize=True)
    assert sp.tokenize(text) == basic.tokenize(text)
    assert sp.convert_tokens_to_ids(sp.tokenize(text)).count(1) == 0
    with pytest.warns(UserWarning, match="do_lower_case=True"):
        assert create_tokenizer(model, do_lower_case=False).tokenize(text) == basic.tokenize(text)
    os.remove(str(prefix) + ".tokenizer.json")
    raw = create_tokenizer(model, do_lower_case=True)
    assert raw.tokenize(text) != basic.tokenize(text)


def test_cli(corpus, tmp_path):
    out = tmp_path / "cli_vocab.txt"
    repo = Path(__file__).resolve().parents[3]
    result = subprocess.run(
        [sys.executable, "-m", "data_pipeline.train_vocab", f"--input_file={corpus}/*.txt",
         "--vocab_size=100", f"--output_file={out}", "--nodo_lower_case", "--heldout_every=5"],
        cwd=repo, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(out.read_text(encoding="utf-8").splitlines()) == 100
    assert "Held-out [UNK] rate" in result.stderr


def test_write_vocab_is_whole_or_untouched(tmp_path):
    """A write that stops part way leaves the previous vocab.txt as it was."""
    path = tmp_path / "vocab.txt"
    tv.write_vocab(["[PAD]", "[UNK]", "a"], str(path))
    assert path.read_text(encoding="utf-8") == "[PAD]\n[UNK]\na\n"
    with pytest.raises(TypeError):  # the third token is not a string: the write stops there
        tv.write_vocab(["[PAD]", "b", None], str(path))
    assert path.read_text(encoding="utf-8") == "[PAD]\n[UNK]\na\n"
    tv.write_vocab(["[PAD]", "b"], str(path))
    assert path.read_text(encoding="utf-8") == "[PAD]\nb\n"
