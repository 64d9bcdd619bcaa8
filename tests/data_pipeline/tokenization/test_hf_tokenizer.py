"""A HuggingFace tokenizer.json in the data pipeline (`data_pipeline/tokenization/hf_tokenizer.py`,
`create_pretraining_data --tokenizer_json`), checked against transformers and our WordPiece.

Real text: 10,000 lines of WikiText-2 and Pride and Prejudice from ../shared/data (skipped without it). A ModernBERT-like byte-level BPE
tokenizer.json is trained on a slice of it with the tokenizers library; the WordPiece one is
bert-base-uncased's own tokenizer.json, read beside its vocab.txt.
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from data_pipeline import create_pretraining_data as cpd  # noqa: E402
from data_pipeline.pretraining_data import shards  # noqa: E402
from data_pipeline.tokenization import hf_tokenizer  # noqa: E402
from data_pipeline.tokenization.fast import FastTokenizer  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
# WikiText-2's 2,891 paragraphs, then Pride and Prejudice's short lines (curly quotes, a BOM): 10,000 lines.
CORPUS = [SHARED_DATA / "corpus" / "wikitext-2-raw" / "wiki.test.raw",
          SHARED_DATA / "corpus" / "gutenberg" / "pg1342_pride_and_prejudice.txt"]
UNCASED = SHARED_DATA / "vocab" / "bert-base-uncased"
SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]  # ModernBERT's, in a BPE file of ours


@pytest.fixture(scope="module")
def lines():
    if not all(p.exists() for p in CORPUS):
        pytest.skip(f"{SHARED_DATA}: no WikiText-2 or Gutenberg text (real text for these tests)")
    out = [line.strip() for p in CORPUS for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(out) >= 10_000
    return out[:10_000]


def train_bpe(lines, path, specials=SPECIALS, template=True):
    """A byte-level BPE tokenizer.json as ModernBERT's is made (NFC, ByteLevel without a prefix space,
    [CLS] $A [SEP]), trained on `lines`."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]" if "[UNK]" in specials else None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=1500, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def bpe_json(lines, tmp_path_factory):
    return train_bpe(lines[:1500], tmp_path_factory.mktemp("bpe") / "tokenizer.json")


@pytest.fixture(scope="module")
def hf_reference(bpe_json):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=bpe_json)


def test_bpe_ids_equal_transformers_and_decode_to_the_text(lines, bpe_json, hf_reference):
    import unicodedata

    tok = hf_tokenizer.HFTokenizer(bpe_json)
    ids = tok.encode_batch(lines)
    assert ids == hf_reference(lines, add_special_tokens=False)["input_ids"]
    assert sum(map(len, ids)) > 200_000  # real work: ~10k lines of text, not a handful of tokens
    for line, row in zip(lines[:500], ids):
        assert tok.tokenize(line) == hf_reference.tokenize(line)
        assert tok.convert_tokens_to_ids(tok.tokenize(line)) == row == tok.encode(line)
        assert tok.convert_ids_to_tokens(row) == hf_reference.convert_ids_to_tokens(row)
        assert hf_reference.decode(row) == unicodedata.normalize("NFC", line)  # byte-level: lossless
    # The special tokens come from the file: transformers' ids for the same names.
    assert (tok.cls_token, tok.sep_token, tok.mask_token, tok.pad_token, tok.unk_token) == (
        "[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]")
    assert tok.special_ids() == {"cls_id": hf_reference.convert_tokens_to_ids("[CLS]"),
                                 "sep_id": hf_reference.convert_tokens_to_ids("[SEP]"),
                                 "mask_id": hf_reference.convert_tokens_to_ids("[MASK]"),
                                 "pad_id": hf_reference.convert_tokens_to_ids("[PAD]"), "vocab_size": len(hf_reference)}
    # Words are the pre-tokenizer's: a token continues a word exactly where transformers' word ids repeat.
    enc = hf_reference(lines[:200], add_special_tokens=False)
    for i, bits in enumerate(tok.word_continuations(lines[:200], ids[:200])):
        words = enc.word_ids(i)
        assert bits == [j > 0 and words[j] == words[j - 1] for j in range(len(words))]


def test_wordpiece_tokenizer_json_equals_our_google_exact_wordpiece(lines):
    if not (UNCASED / "tokenizer.json").exists():
        pytest.skip(f"{UNCASED}: no bert-base-uncased tokenizer.json")
    tok = hf_tokenizer.HFTokenizer(str(UNCASED / "tokenizer.json"))
    ours = FastTokenizer(str(UNCASED / "vocab.txt"), do_lower_case=True)
    # Our fast path equals Google's reference tokenizer (tests/data_pipeline/tokenization/test_tokenization*.py).
    assert tok.encode_batch(lines) == ours.encode_batch(lines)
    assert tok.vocab == ours.vocab and tok.special_ids() == {"cls_id": 101, "sep_id": 102, "mask_id": 103,
                                                             "pad_id": 0, "vocab_size": 30522}
    # Whole words: a token continues a word exactly where it is a ## piece.
    for line, bits in zip(lines[:300], tok.word_continuations(lines[:300])):
        assert bits == [t.startswith("##") for t in ours.tokenize(line)]


# ---------------------------------------------------------------------------------------------
# create_pretraining_data --tokenizer_json
# ---------------------------------------------------------------------------------------------


def _read(out_dir):
    from data_pipeline.records import schema
    from tests.helpers.pretraining_records import read_records

    (path,) = sorted(Path(out_dir).glob("*.tfrecord"))
    return [schema.decode_example(r) for r in read_records(path)]


@pytest.fixture(scope="module")
def made(lines, bpe_json, tmp_path_factory):
    """Records of 300 lines (documents of 10 lines), with and without whole-word masking."""
    text = tmp_path_factory.mktemp("text") / "corpus.txt"
    docs = [lines[i:i + 10] for i in range(2000, 2300, 10)]
    text.write_text("\n\n".join("\n".join(d) for d in docs) + "\n", encoding="utf-8")
    out = {}
    for wwm in (False, True):
        out_dir = tmp_path_factory.mktemp(f"records_wwm{int(wwm)}")
        info = cpd.create_pretraining_data([str(text)], str(out_dir), None, tokenizer_json=bpe_json,
                                           max_seq_length=64, max_predictions_per_seq=12, dupe_factor=2,
                                           do_whole_word_mask=wwm, random_seed=7)
        out[wwm] = (info, _read(out_dir), out_dir)
    return docs, out


@pytest.mark.parametrize("wwm", [False, True])
def test_records_hold_the_texts_tokens_and_the_files_mask_id(made, bpe_json, hf_reference, wwm):
    docs, out = made
    info, records, _ = out[wwm]
    cls_id, sep_id, mask_id = (hf_reference.convert_tokens_to_ids(t) for t in ("[CLS]", "[SEP]", "[MASK]"))
    # The independent view: transformers' ids of the text, and its word of each token, one stream.
    enc = hf_reference([s for d in docs for s in d], add_special_tokens=False)
    stream = np.concatenate([np.asarray(ids, np.int32) for ids in enc["input_ids"]])
    word = np.concatenate([np.asarray([-1 if w is None else w for w in enc.word_ids(i)], np.int64) + 10_000 * i
                           for i in range(len(enc["input_ids"]))])
    raw = stream.tobytes()

    def find(segment: np.ndarray) -> int:
        at = raw.find(segment.astype(np.int32).tobytes())
        while at >= 0 and at % 4:  # a match must start on a token
            at = raw.find(segment.astype(np.int32).tobytes(), at + 1)
        return at // 4 if at >= 0 else -1

    assert len(records) == info["num_instances"] > 100
    slots = replaced = 0
    for r in records:
        ids, n = r["input_ids"], int(r["input_mask"].sum())
        used = r["masked_lm_weights"] > 0
        pos, labels = r["masked_lm_positions"][used], r["masked_lm_ids"][used]
        assert ids[0] == cls_id and ids[n - 1] == sep_id and not ids[n:].any()
        original = ids.copy()
        original[pos] = labels
        (seps,) = np.nonzero(original[:n] == sep_id)
        assert len(seps) == 2 and ((r["segment_ids"][:n] == 1) == (np.arange(n) > seps[0])).all()
        assert mask_id not in original  # the text has no [MASK]: every one in a record was put there
        assert set(np.nonzero(ids == mask_id)[0]) <= set(pos)
        slots, replaced = slots + len(pos), replaced + int((ids[pos] == mask_id).sum())
        for a, b, masked in ((1, seps[0], None), (seps[0] + 1, seps[1], None)):
            start = find(original[a:b])
            assert start >= 0, "a segment is not a run of the text's tokens"
            if wwm:  # every word a masked token is in is masked whole, within the segment
                seg_words = word[start:start + b - a]
                masked = np.isin(np.arange(a, b), pos)
                for w in np.unique(seg_words[masked]):
                    assert masked[seg_words == w].all()
    assert 0.75 < replaced / slots < 0.85  # BERT's 80% [MASK]
    assert info["tokenizer"] == {
        "kind": "tokenizer.json", "file": bpe_json, "sha256": hashlib.sha256(Path(bpe_json).read_bytes()).hexdigest(),
        "vocab_size": len(hf_reference), "special_ids": {"cls_id": cls_id, "sep_id": sep_id, "mask_id": mask_id,
                                                         "pad_id": hf_reference.convert_tokens_to_ids("[PAD]"),
                                                         "vocab_size": len(hf_reference)},
        "special_tokens": {"cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]", "pad": "[PAD]", "unk": "[UNK]"}}
    assert info["vocab_sha256"] == info["tokenizer"]["sha256"] and info["flags"]["do_lower_case"] is None


def test_whole_word_masking_masks_more_tokens_per_word_than_tokens_alone(made):
    """BPE splits words into several tokens: with whole-word masking a masked token's neighbours of
    the same word are masked too, so masked positions come in adjacent runs more often."""
    _, out = made

    def adjacent_fraction(records):
        pairs = total = 0
        for r in records:
            pos = np.sort(r["masked_lm_positions"][r["masked_lm_weights"] > 0])
            pairs += int((np.diff(pos) == 1).sum())
            total += len(pos)
        return pairs / total

    assert adjacent_fraction(out[True][1]) > 2 * adjacent_fraction(out[False][1])


def test_the_beam_runner_writes_the_local_runners_files(made, bpe_json, tmp_path):
    """The tokenizer.json travels to Beam's workers as a vocab.txt does (read from a copy there)."""
    beam_pipeline = pytest.importorskip("data_pipeline.pretraining_data.beam_pipeline")
    docs, out = made
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join("\n".join(d) for d in docs[:12]) + "\n", encoding="utf-8")
    opts = shards.Options(vocab_file=None, tokenizer_json=bpe_json, max_seq_length=64, max_predictions_per_seq=12,
                          dupe_factor=1, do_whole_word_mask=True)
    local = cpd.run(opts, sources=[("text", str(text))], outputs=[str(tmp_path / "local" / "part")],
                    reference_compatible=False)
    beam = beam_pipeline.run(opts, sources=[("text", str(text))], outputs=[str(tmp_path / "beam" / "part")])
    assert (tmp_path / "beam" / "part").read_bytes() == (tmp_path / "local" / "part").read_bytes()
    assert beam["num_instances"] == local["num_instances"] > 20
    assert beam["tokenizer"] == local["tokenizer"] == out[False][0]["tokenizer"]  # the driver's file


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_a_tokenizer_json_without_mask_or_cls_sep_is_named(lines, tmp_path):
    no_mask = train_bpe(lines[:200], tmp_path / "no_mask.json", specials=["[UNK]", "[CLS]", "[SEP]", "[PAD]"])
    with pytest.raises(ValueError, match=r"no_mask.json: no mask token .*\[MASK\], <mask>"):
        hf_tokenizer.HFTokenizer(no_mask)
    bare = train_bpe(lines[:200], tmp_path / "bare.json", specials=["[MASK]"], template=False)
    with pytest.raises(ValueError, match=r"bare.json: no cls, sep token .*special tokens it has: \['\[MASK\]'\]"):
        hf_tokenizer.HFTokenizer(bare)
    (tmp_path / "vocab.json").write_text(json.dumps({"the": 0}))
    with pytest.raises(ValueError, match=r"vocab.json: not a HuggingFace tokenizer.json"):
        hf_tokenizer.HFTokenizer(str(tmp_path / "vocab.json"))
    # Classification and separator tokens of any name, from the post-processor (RoBERTa's kind here).
    roberta = tokenizers.Tokenizer(tokenizers.models.BPE())
    roberta.add_special_tokens(["<start>", "<end>", "<pad>", "<mask>"])
    roberta.post_processor = tokenizers.processors.RobertaProcessing(("<end>", 1), ("<start>", 0))
    roberta.save(str(tmp_path / "roberta.json"))
    tok = hf_tokenizer.HFTokenizer(str(tmp_path / "roberta.json"))
    assert (tok.cls_token, tok.sep_token, tok.mask_token, tok.pad_token) == ("<start>", "<end>", "<mask>", "<pad>")


def test_bad_option_combinations_are_refused_before_any_work(bpe_json, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("One sentence here.\nAnd another one.\n")
    vocab = str(UNCASED / "vocab.txt")
    for kwargs, match in (
            (dict(vocab_file=vocab, tokenizer_json=bpe_json), "give exactly one"),
            (dict(vocab_file=None), "give exactly one"),
            (dict(vocab_file=None, tokenizer_json=str(tmp_path / "gone.json")), "gone.json: not found"),
            (dict(vocab_file=None, tokenizer_json=bpe_json, do_whole_word_mask=True, chinese_whole_word_mask=True),
             "--chinese_whole_word_mask aligns jieba's words")):
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            shards.Options(**kwargs).validate()
    with pytest.raises(ValueError, match=r"--reference_compatible is Google's program"):
        cpd.create_pretraining_data([str(text)], str(tmp_path / "out"), None, tokenizer_json=bpe_json,
                                    reference_compatible=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, match", [
    (["--tokenizer_json={json}", "--vocab_file={vocab}"], "give one of --vocab_file .*: not both"),
    ([], "give one of --vocab_file"),
    (["--tokenizer_json={json}", "--do_lower_case=false"], "the file's own normalizer decides casing"),
])
def test_cli_flags(bpe_json, tmp_path, flags, match):
    import re

    argv = [f.format(json=bpe_json, vocab=UNCASED / "vocab.txt") for f in flags]
    r = subprocess.run([sys.executable, "-m", "data_pipeline.create_pretraining_data", f"--input_file={bpe_json}",
                        f"--output_file={tmp_path / 'o.tfrecord'}", *argv], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and re.search(match, r.stderr), r.stderr[-2000:]


def test_the_trainer_refuses_a_vocab_txt_or_a_small_model_for_tokenizer_json_records(made):
    from bert_jax.pretrain import startup_checks

    info, _, out_dir = made[1][False]
    size = info["tokenizer"]["vocab_size"]
    startup_checks.check_data_vocab_size(size, [f"{out_dir}/*.tfrecord"])  # the file's size: fine
    with pytest.raises(ValueError, match=rf"config.model.vocab_size={size - 1}, but .* of {size} ids"):
        startup_checks.check_data_vocab_size(size - 1, [f"{out_dir}/*.tfrecord"])
    mask_id = info["tokenizer"]["special_ids"]["mask_id"]
    with pytest.raises(ValueError, match=rf"{out_dir}/\*.tfrecord was made with the tokenizer.json .*tokenizer.json "
                                         rf"\(per its dataset_info.json\): .*\[MASK\] = {mask_id}\)"):
        startup_checks.check_vocab_matches_data(str(UNCASED / "vocab.txt"), [f"{out_dir}/*.tfrecord"])
