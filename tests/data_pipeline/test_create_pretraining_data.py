"""Pretraining data: identity with google-research/bert's records, hand-checked masking and
truncation rules, the fast parallel mode, the schema, the manifest, corpora and bad input."""

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from data_pipeline import create_pretraining_data as cpd  # noqa: E402
from data_pipeline.input import evaluation  # noqa: E402
from data_pipeline.pretraining_data import corpora, instances  # noqa: E402
from data_pipeline.pretraining_data import shards  # noqa: E402
from data_pipeline.records import schema  # noqa: E402
from data_pipeline.records import reader as records  # noqa: E402
from tests.helpers.pretraining_records import read_records  # noqa: E402
from tests.helpers.synthetic_corpus import STEMS, SUFFIXES, synthetic_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference_records.json"
@pytest.mark.parametrize("wwm", [False, True])
def test_reference_compatible_mode_writes_the_references_records(tmp_path, wwm):
    text, vocab = synthetic_corpus(tmp_path)
    out = tmp_path / "out"
    cpd.create_pretraining_data([str(text)], str(out), str(vocab), reference_compatible=True,
                                do_whole_word_mask=wwm, max_seq_length=32, max_predictions_per_seq=6,
                                dupe_factor=3, random_seed=12345, masked_lm_prob=0.15, short_seq_prob=0.1)
    ours = read_records(out / "part-00000-of-00001.tfrecord")
    want = json.loads(FIXTURE.read_text())[f"whole_word_mask={wwm}"]
    assert [hashlib.sha256(r).hexdigest() for r in ours] == want
    # Our bytes are already deterministic: re-serializing changes nothing.
    assert all(tf.train.Example.FromString(r).SerializeToString(deterministic=True) == r for r in ours)


def test_reference_compatible_records_are_dealt_round_robin_as_they_are_made(tmp_path, monkeypatch):
    """Several output files: record i of the single-file run goes to file i % 3, in order, also when
    each file's records are written in several groups (WRITE_GROUP 2 here)."""
    text, vocab = synthetic_corpus(tmp_path)
    flags = dict(reference_compatible=True, max_seq_length=32, max_predictions_per_seq=6, dupe_factor=3,
                 random_seed=12345)
    cpd.create_pretraining_data([str(text)], str(tmp_path / "one"), str(vocab), **flags)
    one = read_records(tmp_path / "one" / "part-00000-of-00001.tfrecord")
    monkeypatch.setattr(cpd, "WRITE_GROUP", 2)
    cpd.create_pretraining_data([str(text)], str(tmp_path / "three"), str(vocab), num_output_shards=3, **flags)
    assert len(one) > 3 * 2 * 2  # several groups per file
    for i in range(3):
        assert read_records(tmp_path / "three" / f"part-{i:05d}-of-00003.tfrecord") == one[i::3], i


class ScriptedRng:
    """random.Random stand-in returning scripted values, to hand-check each decision."""

    def __init__(self, randoms=(), randints=()):
        self.randoms, self.randints = list(randoms), list(randints)

    def random(self):
        return self.randoms.pop(0)

    def randint(self, a, b):
        v = self.randints.pop(0)
        assert a <= v <= b
        return v

    def shuffle(self, x):
        pass  # keep order


def test_truncate_seq_pair_trims_the_longer_side_at_random_ends():
    a, b = list("abcdef"), list("xyz")
    instances.truncate_seq_pair(a, b, 6, ScriptedRng(randoms=[0.1, 0.9, 0.7]))
    # random() < 0.5 deletes the front of the longer side, else its back.
    # 9 -> 8: front of a ('a'); 8 -> 7: back of a ('f'); 7 -> 6: a (4) > b (3): back ('e').
    assert a == list("bcd") and b == list("xyz")
    a, b = list("ab"), list("vwxyz")
    # b is longer both times: front ('v'), then back ('z').
    instances.truncate_seq_pair(a, b, 5, ScriptedRng(randoms=[0.2, 0.6]))
    assert a == list("ab") and b == list("wxy")


def test_masking_hand_computed():
    tokens = ["[CLS]", "the", "cat", "##s", "sat", "[SEP]", "on", "mat", "[SEP]"]
    vocab_words = ["[PAD]", "the", "cat", "dog"]
    stats = instances.MaskStats()
    # 9 tokens * 0.3 = 2.7 -> 3 predictions.
    # Candidates in order (no shuffle): the, cat, ##s, sat, on, mat. Decisions for the first 3:
    # 'the' -> [MASK] (0.1); 'cat' -> keep (0.9, 0.3); '##s' -> random word: randint -> 3 'dog'.
    out, pos, labels = instances.create_masked_lm_predictions(
        tokens, 0.3, 20, vocab_words, ScriptedRng(randoms=[0.1, 0.9, 0.3, 0.9, 0.7], randints=[3]),
        do_whole_word_mask=False, stats=stats)
    assert pos == [1, 2, 3] and labels == ["the", "cat", "##s"]
    assert out == ["[CLS]", "[MASK]", "cat", "dog", "sat", "[SEP]", "on", "mat", "[SEP]"]
    assert (stats.replaced_by_mask, stats.kept, stats.replaced_by_random) == (1, 1, 1)
    assert stats.candidates == 6
    # Whole-word: 'cat ##s' is one candidate; with a budget of 3 the order the, [cat ##s] fills it.
    out, pos, labels = instances.create_masked_lm_predictions(
        tokens, 0.3, 20, vocab_words, ScriptedRng(randoms=[0.1, 0.1, 0.1]), do_whole_word_mask=True,
        stats=instances.MaskStats())
    assert pos == [1, 2, 3] and out[1:4] == ["[MASK]"] * 3
    # The cap: max_predictions_per_seq=1 masks one token, never [CLS]/[SEP].
    out, pos, _ = instances.create_masked_lm_predictions(
        tokens, 0.9, 1, vocab_words, random.Random(0), do_whole_word_mask=False, stats=instances.MaskStats())
    assert len(pos) == 1 and tokens[pos[0]] not in ("[CLS]", "[SEP]")


def test_masking_never_touches_special_tokens_and_keeps_whole_words_together():
    rng = random.Random(3)
    words = [["[CLS]"] + [w for _ in range(20) for w in (rng.choice(STEMS), "##" + rng.choice(["s", "ed"]))] + ["[SEP]"]]
    for seed in range(30):
        tokens = words[0]
        out, pos, labels = instances.create_masked_lm_predictions(
            tokens, 0.15, 20, ["x", "y"], random.Random(seed), do_whole_word_mask=True, stats=instances.MaskStats())
        assert 0 not in pos and len(tokens) - 1 not in pos
        assert pos == sorted(pos) and len(pos) == round(len(tokens) * 0.15)
        for p in pos:  # a masked ## piece's head is masked too, and vice versa
            if tokens[p].startswith("##"):
                assert p - 1 in pos
            elif p + 1 < len(tokens) and tokens[p + 1].startswith("##"):
                assert p + 1 in pos


def test_instances_follow_the_pair_format():
    rng = random.Random(5)
    docs = [[[f"w{d}{s}{t}" for t in range(rng.randint(1, 9))] for s in range(rng.randint(1, 6))] for d in range(6)]
    stats = instances.MaskStats()
    out = instances.create_training_instances([list(d) for d in docs], ["a", "b"], max_seq_length=24,
                                              dupe_factor=2, short_seq_prob=0.1, masked_lm_prob=0.15,
                                              max_predictions_per_seq=4, rng=rng, do_whole_word_mask=False,
                                              stats=stats)
    assert len(out) == stats.instances > 0
    for x in out:
        assert len(x.tokens) <= 24 and x.tokens[0] == "[CLS]" and x.tokens[-1] == "[SEP]"
        sep = x.tokens.index("[SEP]")
        assert x.segment_ids == [0] * (sep + 1) + [1] * (len(x.tokens) - sep - 1)
        assert 0 < len(x.masked_lm_positions) <= 4


def test_fast_mode_is_independent_of_the_worker_count_and_has_the_reference_statistics(tmp_path):
    files = []
    rng = random.Random(11)
    for shard in range(3):
        docs = [[" ".join(rng.choice(STEMS) + rng.choice(SUFFIXES) for _ in range(rng.randint(4, 16))) + "."
                 for _ in range(rng.randint(2, 8))] for _ in range(25)]
        path = tmp_path / f"shard{shard}.txt"
        corpora.write_google_text(str(path), docs)
        files.append(str(path))
    _, vocab = synthetic_corpus(tmp_path)
    kw = dict(max_seq_length=48, max_predictions_per_seq=8, dupe_factor=4, random_seed=1, num_output_shards=2)
    one = cpd.create_pretraining_data(files, str(tmp_path / "w1"), str(vocab), num_workers=1, **kw)
    two = cpd.create_pretraining_data(files, str(tmp_path / "w2"), str(vocab), num_workers=2, **kw)
    for i in range(2):
        name = f"part-{i:05d}-of-00002.tfrecord"
        assert read_records(tmp_path / "w1" / name) == read_records(tmp_path / "w2" / name)
    assert one["num_instances"] == two["num_instances"] > 300
    m = one["mask_stats"]
    assert abs(m["masked_fraction_of_candidates"] - 0.15) < 0.02
    assert abs(m["mask_fraction"] - 0.8) < 0.03 and abs(m["keep_fraction"] - 0.1) < 0.03
    # Above 50%: a one-sentence chunk always takes a random next segment (as in the reference).
    assert 0.45 < m["random_next_fraction"] < 0.7
    # The manifest is what the input pipeline verifies: it reads the files without complaint...
    ds = evaluation.EvalInput(str(tmp_path / "w1" / "*.tfrecord"), per_host_batch_size=16,
                                  max_seq_length=48, max_predictions_per_seq=8)
    assert ds.num_records == one["num_instances"]
    # ... and refuses a truncated one, naming it.
    bad = tmp_path / "w1" / "part-00001-of-00002.tfrecord"
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(records.CorruptDataError, match="part-00001-of-00002"):
        evaluation.EvalInput(str(tmp_path / "w1" / "*.tfrecord"), per_host_batch_size=16,
                                 max_seq_length=48, max_predictions_per_seq=8)


def test_schema_round_trip_and_parse():
    feats = schema.pad_features([2, 7, 4, 3], [0, 0, 1, 1], [2], [9], 1, max_seq_length=6, max_predictions_per_seq=3)
    raw = schema.serialize(feats)
    back = schema.decode_example(raw)
    np.testing.assert_array_equal(back["input_ids"], [2, 7, 4, 3, 0, 0])
    np.testing.assert_array_equal(back["input_mask"], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(back["masked_lm_weights"], [1, 0, 0])
    np.testing.assert_array_equal(back["next_sentence_labels"], [1])
    parsed = schema.parse_example(tf.constant([raw, raw]), 6, 3)
    assert parsed["segment_ids"].shape == (2, 6) and parsed["masked_lm_weights"].dtype == tf.float32
    with pytest.raises(ValueError, match="max_seq_length=3"):
        schema.pad_features([1, 2, 3, 4], [0] * 4, [], [], 0, max_seq_length=3, max_predictions_per_seq=3)


def test_bad_input_is_counted_or_named(tmp_path):
    _, vocab = synthetic_corpus(tmp_path)
    text = tmp_path / "bad.txt"
    text.write_bytes(b"Alpha beta \xff\xfe gamma.\n\n\n\nDelta omega.\n" + b"\n" + b"river " * 20000 + b"\n\n")
    stats = corpora.ReadStats()
    docs = list(corpora.read_google_text(str(text), stats))
    assert stats.lines_with_bad_utf8 == 1 and stats.empty_documents >= 1 and len(docs) == 3
    info = cpd.create_pretraining_data([str(text)], str(tmp_path / "o"), str(vocab), dupe_factor=2,
                                       max_seq_length=16, max_predictions_per_seq=3)
    assert info["num_instances"] > 0 and info["read_stats"]["lines_with_bad_utf8"] == 1
    with pytest.raises(FileNotFoundError, match="missing-file"):
        cpd.create_pretraining_data([str(tmp_path / "missing-file.txt")], str(tmp_path / "o2"), str(vocab))
    with pytest.raises(ValueError, match="--max_seq_length=4"):
        cpd.create_pretraining_data([str(text)], str(tmp_path / "o3"), str(vocab), max_seq_length=4)
    # Blank input: an error naming what was read (the statistics are still written), not an
    # empty file with exit status 0; a vocab without [MASK] is named.
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n  \n")
    with pytest.raises(ValueError, match=r"no training instance from 1 input source\(s\) \(3 lines, 0 documents"):
        cpd.create_pretraining_data([str(blank)], str(tmp_path / "o4"), str(vocab))
    assert (tmp_path / "o4" / "part.dataset_info.json").exists()
    no_mask = tmp_path / "no_mask.txt"
    no_mask.write_text("\n".join(t for t in vocab.read_text().splitlines() if t != "[MASK]") + "\n")
    with pytest.raises(ValueError, match=r"--vocab_file=.*no_mask.txt: no \[MASK\]"):
        cpd.create_pretraining_data([str(text)], str(tmp_path / "o5"), str(no_mask))


@pytest.mark.parametrize("reference_compatible", [True, False])
def test_documents_without_tokens_and_one_sentence_documents_are_counted(tmp_path, reference_compatible):
    """A document whose lines are all dropped by tokenization (a zero-width space, a BEL control
    character) is dropped as the reference drops it, and counted; so are one-sentence documents
    (their next-sentence pairs always take B from another document). Hand counted."""
    _, vocab = synthetic_corpus(tmp_path)
    text = tmp_path / "docs.txt"
    text.write_text("Alpha beta.\nGamma delta.\n\n\u200b\u200b\n\x07\n\nRiver stone.\n\nCloud light.\nNight.\n")
    info = cpd.create_pretraining_data([str(text)], str(tmp_path / "o"), str(vocab), dupe_factor=1,
                                       max_seq_length=16, max_predictions_per_seq=3,
                                       reference_compatible=reference_compatible)
    stats = info["read_stats"]
    assert (stats["documents"], stats["documents_without_tokens"], stats["one_sentence_documents"]) == (4, 1, 1)
    assert stats["lines"] == 10 and stats["empty_documents"] == 0


def test_tfds_dataset_is_prepared_once_by_the_parent(monkeypatch, tmp_path):
    """`tfds_sources` (the parent) prepares the dataset once; N workers would otherwise each
    download and build it into the same folder."""
    tfds = pytest.importorskip("tensorflow_datasets")
    calls = []

    class FakeBuilder:
        data_dir = str(tmp_path)

        def is_prepared(self):
            return False

        def download_and_prepare(self):
            calls.append("prepare")

    monkeypatch.setattr(tfds, "builder", lambda name, data_dir=None: calls.append((name, data_dir)) or FakeBuilder())
    sources = cpd.tfds_sources("toy/1.0", "train", "text", str(tmp_path), num_shards=4)
    assert calls == [("toy/1.0", str(tmp_path)), "prepare"] and len(sources) == 4
    assert all(source[-1] is False for source in sources)  # the workers: download=False
    # Beam workers may be other machines without this one's folder: no preparing here, and
    # each worker keeps TFDS's default download.
    remote = cpd.tfds_sources("toy/1.0", "train", "text", str(tmp_path), num_shards=4, prepare=False)
    assert len(calls) == 2 and all(source[-1] is True for source in remote)


def test_tfds_text_counts_bad_utf8_and_empty_examples(monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")
    from data_pipeline.pretraining_data import corpora
    texts = [b"Good text. Two sentences.", b"Bad \xff byte here.", b"   ", "Fine \ufffd kept.".encode()]
    monkeypatch.setattr(tfds, "load", lambda name, split, data_dir=None, shuffle_files=False, download=True:
                        tf.data.Dataset.from_tensor_slices({"text": texts}))
    stats = corpora.ReadStats()
    docs = list(corpora.read_tfds_documents("toy", "train", stats=stats))
    assert docs[1] == ["Bad \ufffd byte here."] and len(docs) == 3
    # A U+FFFD already in the text is not a decoding error.
    assert (stats.documents, stats.empty_documents, stats.lines_with_bad_utf8) == (3, 1, 1)


def test_cli_with_googles_flags_and_gzip(tmp_path):
    text, vocab = synthetic_corpus(tmp_path)
    out = tmp_path / "cli" / "train.tfrecord"
    r = subprocess.run([sys.executable, "-m", "data_pipeline.create_pretraining_data", f"--input_file={text}",
                        f"--output_file={out}", f"--vocab_file={vocab}", "--max_seq_length=32",
                        "--max_predictions_per_seq=6", "--dupe_factor=2", "--compression=gzip"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads((tmp_path / "cli" / "train.dataset_info.json").read_text())
    assert info["flags"]["dupe_factor"] == 2 and info["flags"]["random_seed"] == 12345
    assert list(info["files"]) == ["train.tfrecord.gz"]
    assert len(read_records(tmp_path / "cli" / "train.tfrecord.gz")) == info["files"]["train.tfrecord.gz"]["num_records"]


def test_sentence_splitter_and_embedded_corpus(tmp_path):
    assert corpora.split_sentences("Dr. Smith arrived. It was 5 p.m. He left!  Then? \"Yes.\" No.") == [
        "Dr. Smith arrived.", "It was 5 p.m. He left!", "Then?", "\"Yes.\"", "No."]
    assert corpora.split_sentences("e.g. this stays whole. A new one") == ["e.g. this stays whole.", "A new one"]
    paths = corpora.write_embedded_corpus(str(tmp_path / "a"), num_shards=2, include_stdlib=False)
    again = corpora.write_embedded_corpus(str(tmp_path / "b"), num_shards=2, include_stdlib=False)
    assert [Path(p).read_text() for p in paths] == [Path(p).read_text() for p in again]
    docs = [d for p in paths for d in corpora.read_google_text(p)]
    assert len(docs) > 40 and sum(len(d) for d in docs) > 1000
    assert all(len(d) >= 2 for d in docs)


def test_reference_mode_continues_a_document_across_files_like_the_reference(tmp_path):
    """google-research/bert reads all files as one stream of lines: only a blank line ends a
    document, so a file without a trailing blank line runs on into the next file."""
    _, vocab = synthetic_corpus(tmp_path)
    (tmp_path / "a.txt").write_text("Alpha beta.\nGamma delta.\n")  # no blank line at the end
    (tmp_path / "b.txt").write_text("Omega sigma.\n\nKappa theta.\nRiver stone.\n")
    stats = corpora.ReadStats()
    lines = (l for p in ("a.txt", "b.txt") for l in corpora.iter_lines(str(tmp_path / p), stats))
    docs = list(corpora.documents_from_lines(lines, stats))
    assert docs == [["Alpha beta.", "Gamma delta.", "Omega sigma."], ["Kappa theta.", "River stone."]]
    # Per file (the fast mode's shards), the file's end ends the document.
    assert list(corpora.read_google_text(str(tmp_path / "a.txt"))) == [["Alpha beta.", "Gamma delta."]]


# ---------------------------------------------------------------------------------------------
# The fast mode: numpy protobuf encoder, TFRecord framing, vectorized instances
# ---------------------------------------------------------------------------------------------

from data_pipeline.pretraining_data import fast_instances  # noqa: E402
from data_pipeline.records import tfrecord  # noqa: E402
from data_pipeline.tokenization.fast import FastTokenizer  # noqa: E402


def test_encode_examples_writes_the_tf_serializers_bytes():
    rng = np.random.default_rng(0)
    batch, seq, preds = 64, 24, 5
    n = rng.integers(5, seq + 1, batch)
    ar = np.arange(seq)
    feats = {
        "input_ids": (rng.integers(0, 40000, (batch, seq)) * (ar < n[:, None])).astype(np.int32),
        "input_mask": ar < n[:, None],
        "segment_ids": ((ar >= n[:, None] // 2) & (ar < n[:, None])).astype(np.int64),
        "masked_lm_positions": rng.integers(0, seq, (batch, preds)),
        "masked_lm_ids": rng.integers(0, 200, (batch, preds)),
        "masked_lm_weights": (rng.random((batch, preds)) < 0.7).astype(np.float32),
        "next_sentence_labels": rng.integers(0, 2, (batch, 1)) > 0,
    }
    # Varints of 1 to 10 bytes: a 41-bit value, a negative one (two's complement), a negative float.
    feats["input_ids"] = feats["input_ids"].astype(np.int64)
    feats["input_ids"][0, 0] = 2**40
    feats["masked_lm_ids"][1, 0] = -3
    feats["masked_lm_weights"][2, 0] = -0.25
    buf, starts, lengths = schema.encode_examples(feats, head=12, tail=4)
    assert starts[0] == 12 and len(buf) == int((lengths + 16).sum())
    records = [bytes(buf[s:s + n]) for s, n in zip(starts, lengths)]
    for i, record in enumerate(records):
        assert record == schema.serialize({k: v[i] for k, v in feats.items()}), i
    parsed = schema.parse_example(tf.constant(records), seq, preds)
    for key, value in feats.items():
        np.testing.assert_array_equal(parsed[key].numpy(), np.asarray(value).astype(parsed[key].dtype.as_numpy_dtype))


def test_tfrecord_framing_is_tensorflows(tmp_path):
    assert int(tfrecord.crc32c(np.frombuffer(b"123456789", np.uint8), [0], [9])[0]) == 0xE3069283
    rng = np.random.default_rng(1)
    records = [rng.integers(0, 256, n).astype(np.uint8).tobytes() for n in (0, 1, 7, 300, 5000, 40)]
    with tf.io.TFRecordWriter(str(tmp_path / "tf.tfrecord")) as w:
        for r in records:
            w.write(r)
    framed = tfrecord.frame_records(records)
    assert framed == (tmp_path / "tf.tfrecord").read_bytes()
    with tfrecord.Writer(str(tmp_path / "ours.tfrecord.gz"), "gzip") as w:
        w.write(framed[:len(framed) // 2], 0)  # any split of the bytes: one gzip stream
        w.write(framed[len(framed) // 2:], len(records))
    assert read_records(tmp_path / "ours.tfrecord.gz") == records
    # TF checks our CRCs: one flipped bit in a record is a DataLossError.
    bad = bytearray(framed)
    bad[-30] ^= 1
    (tmp_path / "bad.tfrecord").write_bytes(bytes(bad))
    with pytest.raises(tf.errors.DataLossError):
        read_records(tmp_path / "bad.tfrecord")


def test_truncation_closed_form_is_the_reference_loop():
    for max_num_tokens in range(2, 14):
        len_a, len_b = np.meshgrid(np.arange(1, 30), np.arange(1, 30))
        len_a, len_b = len_a.ravel(), len_b.ravel()
        trim_a, trim_b = fast_instances.truncation(len_a, len_b, max_num_tokens)
        for a, b, ta, tb in zip(len_a, len_b, trim_a, trim_b):
            x, y = list(range(a)), list(range(b))
            instances.truncate_seq_pair(x, y, max_num_tokens, random.Random(0))
            assert (a - len(x), b - len(y)) == (ta, tb), (a, b, max_num_tokens)


def test_uniform_subsets_are_uniform():
    # 4 candidates in A, 2 in B ([SEP] at position 5); 2 of the 6 drawn: all 15 pairs equally likely.
    rows = 30_000
    len_a = np.full(rows, 4, np.int32)
    pos = fast_instances._uniform_subsets(len_a, np.full(rows, 6), np.full(rows, 2), 3, 10,
                                          np.random.default_rng(0))
    assert (pos[:, 2] == 10).all() and (pos[:, 0] < pos[:, 1]).all()
    assert set(np.unique(pos[:, :2])) == {1, 2, 3, 4, 6, 7}
    _, counts = np.unique(pos[:, 0] * 16 + pos[:, 1], return_counts=True)
    assert len(counts) == 15 and abs(counts / rows - 1 / 15).max() < 0.01  # sd ~0.0014


def _synthetic_documents(seed: int, num_docs: int):
    rng = random.Random(seed)
    return [[" ".join(rng.choice(STEMS) + rng.choice(SUFFIXES) for _ in range(rng.randint(2, 30))) + "."
             for _ in range(rng.randint(1, 14))] for _ in range(num_docs)]


def _pair_stats(len_a, len_b, is_random, max_num_tokens):
    total = len_a + len_b
    return {"random_next": np.mean(is_random), "len_a": np.mean(len_a), "len_b": np.mean(len_b),
            "full": np.mean(total == max_num_tokens)}


def test_fast_pairs_have_the_reference_algorithms_distribution(tmp_path):
    """Segment lengths (short_seq_prob, split points, random-next B, truncation) and the NSP
    share of the vectorized algorithm against the reference's, on the same documents."""
    _, vocab = synthetic_corpus(tmp_path)
    tok = FastTokenizer(str(vocab))
    docs = _synthetic_documents(3, 40)
    shard = fast_instances.tokenize_shard(docs, tok.encode_batch)
    token_docs = [d for d in ([t for t in tok.tokenize_batch(doc) if t] for doc in docs) if d]
    assert shard.num_documents == len(token_docs)
    seq, dupes = 32, 40
    ref = instances.create_training_instances(
        [list(d) for d in token_docs], list(tok.vocab), max_seq_length=seq, dupe_factor=dupes, short_seq_prob=0.1,
        masked_lm_prob=0.15, max_predictions_per_seq=5, rng=random.Random(0), do_whole_word_mask=False,
        stats=instances.MaskStats())
    sep = np.array([x.tokens.index("[SEP]") for x in ref])
    ref_stats = _pair_stats(sep - 1, np.array([len(x.tokens) for x in ref]) - sep - 2,
                            [x.is_random_next for x in ref], seq - 3)
    rng = np.random.default_rng(0)
    pairs = fast_instances.truncate_pairs(fast_instances.make_pairs(
        shard, max_seq_length=seq, short_seq_prob=0.1, dupe_factor=dupes, rng=rng), seq - 3, rng)
    fast_stats = _pair_stats(pairs.a_end - pairs.a_start, pairs.b_end - pairs.b_start, pairs.is_random_next, seq - 3)
    # ~7,000 instances each: the count's sd is ~1% (short_seq_prob), the shares' ~0.6%.
    assert abs(len(pairs) / len(ref) - 1) < 0.05, (len(pairs), len(ref))
    assert abs(fast_stats["random_next"] - ref_stats["random_next"]) < 0.03, (fast_stats, ref_stats)
    # Above 1/2 in both: a one-sentence chunk always takes a random B (many here: sentences of up
    # to ~40 tokens against a 29-token budget).
    assert fast_stats["random_next"] > 0.55
    for key in ("len_a", "len_b"):
        assert abs(fast_stats[key] / ref_stats[key] - 1) < 0.05, (key, fast_stats, ref_stats)
    assert abs(fast_stats["full"] - ref_stats["full"]) < 0.04, (fast_stats, ref_stats)
    # Spans stay inside the id array and within the length budget.
    assert (pairs.a_start < pairs.a_end).all() and (pairs.b_start < pairs.b_end).all()
    assert ((pairs.a_end - pairs.a_start) + (pairs.b_end - pairs.b_start) <= seq - 3).all()
    assert pairs.b_end.max() <= len(shard.ids)
    # With chunks of several sentences only, the random-next choice is a fair coin.
    # Here a chunk has one sentence only at a document's end (~2% of the pairs).
    long_docs = [["Alpha beta."] * 40 for _ in range(6)]
    many = fast_instances.tokenize_shard(long_docs, tok.encode_batch)
    p = fast_instances.make_pairs(many, max_seq_length=64, short_seq_prob=0.0, dupe_factor=200,
                                  rng=np.random.default_rng(1))
    assert 0.5 < p.is_random_next.mean() < 0.55, p.is_random_next.mean()  # ~4,000 pairs


@pytest.mark.parametrize("wwm", [False, True])
def test_fast_masking_rules_and_statistics(tmp_path, wwm):
    _, vocab_file = synthetic_corpus(tmp_path)
    tok = FastTokenizer(str(vocab_file))
    vocab = fast_instances.Vocab.from_dict(tok.vocab)
    shard = fast_instances.tokenize_shard(_synthetic_documents(5, 60), tok.encode_batch)
    seq, preds = 48, 6
    rng = np.random.default_rng(2)
    pairs = fast_instances.truncate_pairs(fast_instances.make_pairs(
        shard, max_seq_length=seq, short_seq_prob=0.1, dupe_factor=10, rng=rng), seq - 3, rng)
    stats = instances.MaskStats()
    f = fast_instances.masked_features(shard.ids, pairs, vocab, max_seq_length=seq, max_predictions_per_seq=preds,
                                       masked_lm_prob=0.15, do_whole_word_mask=wwm, rng=rng, stats=stats)
    batch = len(pairs)
    assert batch > 2000 and stats.instances == batch
    la = pairs.a_end - pairs.a_start
    n = la + (pairs.b_end - pairs.b_start) + 3
    ids = f["input_ids"]
    # The unmasked sequence: [CLS] A [SEP] B [SEP], zero padding, segment ids, input mask.
    original = np.zeros_like(ids)
    for i in range(batch):
        row = [vocab.cls_id, *shard.ids[pairs.a_start[i]:pairs.a_end[i]], vocab.sep_id,
               *shard.ids[pairs.b_start[i]:pairs.b_end[i]], vocab.sep_id]
        original[i, :len(row)] = row
    np.testing.assert_array_equal(f["input_mask"].sum(1), n)
    np.testing.assert_array_equal(f["segment_ids"].sum(1), n - la - 2)
    weights = f["masked_lm_weights"]
    count = weights.sum(1).astype(int)
    positions = f["masked_lm_positions"]
    budget = np.minimum(preds, np.maximum(1, np.rint(n * 0.15))).astype(int)
    if wwm:
        assert (count <= budget).all() and (count >= 1).all()
    else:
        np.testing.assert_array_equal(count, np.minimum(budget, n - 3))
    unmasked = np.ones_like(ids, bool)
    for i in range(batch):
        pos = positions[i, :count[i]]
        assert (np.diff(pos) > 0).all() and (positions[i, count[i]:] == 0).all()
        assert 0 not in pos and la[i] + 1 not in pos and (pos < n[i] - 1).all()  # never [CLS]/[SEP]
        np.testing.assert_array_equal(f["masked_lm_ids"][i, :count[i]], original[i, pos])
        unmasked[i, pos] = False
        if wwm:  # a "##" piece is masked exactly when the candidate before it is
            sub = vocab.is_subword[original[i, :n[i]]]
            sub[[0, 1, la[i] + 1, n[i] - 1]] = False  # [CLS], A's first token (no candidate before), [SEP]s
            masked_row = ~unmasked[i, :n[i]]
            joined = np.flatnonzero(sub)
            before = np.where(joined == la[i] + 2, la[i], joined - 1)  # B's first piece joins A's last
            np.testing.assert_array_equal(masked_row[joined], masked_row[before])
    np.testing.assert_array_equal(ids[unmasked], original[unmasked])
    # 80% [MASK], 10% the original token, 10% a random vocabulary word (~15,000 masked tokens).
    got = ids[~unmasked]
    orig = original[~unmasked]
    assert abs(np.mean(got == vocab.mask_id) - 0.8) < 0.015
    assert abs(np.mean(got == orig) - 0.1) < 0.015 + 1 / len(tok.vocab)
    assert stats.masked == count.sum() and stats.candidates == (n - 3).sum()
    assert abs(stats.replaced_by_random / stats.masked - 0.1) < 0.015
    assert 0.12 < stats.masked / stats.candidates < 0.16  # 15%, rounded per sequence, capped at 6


def test_fast_mode_forked_cli_equals_in_process_and_skips_empty_shards(tmp_path):
    """The CLI (no TensorFlow in the process: workers forked) with 2 workers writes what one
    in-process worker writes; an empty input shard is harmless."""
    _, vocab = synthetic_corpus(tmp_path)
    files = []
    for shard in range(3):
        path = tmp_path / f"s{shard}.txt"
        corpora.write_google_text(str(path), _synthetic_documents(10 + shard, 12) if shard != 1 else [])
        files.append(str(path))
    flags_ = dict(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=3, random_seed=7)
    one = cpd.create_pretraining_data(files, str(tmp_path / "lib"), str(vocab), num_output_shards=2, **flags_)
    out = tmp_path / "cli" / "train.tfrecord"
    r = subprocess.run([sys.executable, "-m", "data_pipeline.create_pretraining_data", f"--input_file={tmp_path}/s*.txt",
                        f"--output_file={out}", f"--vocab_file={vocab}", "--num_workers=2", "--num_output_shards=2",
                        *[f"--{k}={v}" for k, v in flags_.items()]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tensorflow" not in r.stderr.lower()
    info = json.loads((tmp_path / "cli" / "train.dataset_info.json").read_text())
    assert info["num_instances"] == one["num_instances"] > 100
    assert info["peak_rss_mb"]["workers"] > 0 and info["peak_rss_mb"]["parent"] > 0
    for i in range(2):
        ours = read_records(tmp_path / "lib" / f"part-{i:05d}-of-00002.tfrecord")
        assert read_records(tmp_path / "cli" / f"train-{i:05d}-of-00002.tfrecord") == ours
        assert all(tf.train.Example.FromString(x).SerializeToString(deterministic=True) == x for x in ours[:50])


def test_tfds_shards_read_only_their_even_part_of_the_split(monkeypatch):
    """Each of N workers asks TFDS for its own contiguous part (`tfds.even_splits`), so no worker
    reads the whole split; the parts cover every example once, in order."""
    tfds = pytest.importorskip("tensorflow_datasets")
    from data_pipeline.pretraining_data import corpora
    examples = [f"Doc {i} first. Doc {i} second." for i in range(10)]
    asked = []

    def fake_load(name, split, data_dir=None, shuffle_files=False, download=True):
        assert download is False  # a local worker never builds the dataset (prepare_tfds did, once)
        asked.append(split)
        assert isinstance(split, type(tfds.even_splits("train", n=2)[0])) and split.count == 3
        per = [4, 3, 3][split.index]  # what TFDS's even split of 10 examples gives
        start = sum([4, 3, 3][:split.index])
        return tf.data.Dataset.from_tensor_slices({"text": examples[start:start + per]})

    monkeypatch.setattr(tfds, "load", fake_load)
    docs = [doc for k in range(3)
            for doc in corpora.read_tfds_documents("toy", "train", num_shards=3, shard_index=k, download=False)]
    assert [split.index for split in asked] == [0, 1, 2] and {s.split for s in asked} == {"train"}
    assert [d[0] for d in docs] == [f"Doc {i} first." for i in range(10)]


def test_tfds_input_end_to_end(tmp_path):
    """`--input_format=tfds` on a TFDS text dataset, without a download (tfds.testing.mock_data
    makes random examples from the builder's features: words of the letters a-j)."""
    tfds = pytest.importorskip("tensorflow_datasets")
    vocab = tmp_path / "vocab.txt"
    letters = list("abcdefghij")
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + letters + ["##" + c for c in letters]) + "\n")
    opts = shards.Options(vocab_file=str(vocab), max_seq_length=24, max_predictions_per_seq=4, dupe_factor=2)
    with tfds.testing.mock_data(num_examples=30):
        info = cpd.run(opts, sources=cpd.tfds_sources("wikipedia/20230601.en", "train", "text", None, 3),
                       outputs=[str(tmp_path / "out" / "train.tfrecord")], reference_compatible=False)
    # mock_data serves 30 examples for any split it is asked for, here each of the 3 even parts.
    assert info["read_stats"]["documents"] == 3 * 30
    records = read_records(tmp_path / "out" / "train.tfrecord")
    manifest = json.loads((tmp_path / "out" / "train.dataset_info.json").read_text())["files"]
    assert len(records) == info["num_instances"] == manifest["train.tfrecord"]["num_records"] > 90
    ex = schema.decode_example(records[0])
    assert ex["input_ids"][0] == 2 and (ex["input_ids"] == 1).sum() == 0  # [CLS], no [UNK]
    with pytest.raises(KeyError, match="no_such_key"):
        with tfds.testing.mock_data(num_examples=3):
            cpd.run(opts, sources=cpd.tfds_sources("wikipedia/20230601.en", "train", "no_such_key", None, 1),
                    outputs=[str(tmp_path / "bad" / "train.tfrecord")], reference_compatible=False)


def test_shard_names_match_the_documented_globs():
    assert cpd.output_paths("data/train.tfrecord", 16, "none")[::15] == [
        "data/train-00000-of-00016.tfrecord", "data/train-00015-of-00016.tfrecord"]
    assert cpd.output_paths("gs://b/d/train.tfrecord", 2, "gzip") == [
        "gs://b/d/train-00000-of-00002.tfrecord.gz", "gs://b/d/train-00001-of-00002.tfrecord.gz"]
    assert cpd.output_paths("data/train", 2, "none") == ["data/train-00000-of-00002", "data/train-00001-of-00002"]
    assert cpd.output_paths("data/.tfrecord", 2, "none") == ["data/.tfrecord-00000-of-00002",
                                                             "data/.tfrecord-00001-of-00002"]
    assert cpd.output_paths("a.tfrecord,b.tfrecord", 4, "none") == ["a.tfrecord", "b.tfrecord"]  # named: as named


def test_a_run_that_would_leave_a_manifest_wrong_is_refused_before_any_work(tmp_path):
    """Runs share a folder (tests/data_pipeline/test_many_runs.py); refused are only a rerun that would leave its
    earlier run's files unlisted, and a run writing files another run's manifest lists. The
    messages name the manifest and the files, and suggest no path (they once suggested a folder
    named after a shard, `part-00000-of-00002/part-00000-of-00002.tfrecord`)."""
    text, vocab = synthetic_corpus(tmp_path)
    kw = dict(max_seq_length=32, max_predictions_per_seq=4, dupe_factor=2, random_seed=1)
    out = tmp_path / "data"
    cpd.create_pretraining_data([str(text)], str(out), str(vocab), num_output_shards=2, **kw)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["part-00000-of-00002.tfrecord", "part-00001-of-00002.tfrecord", "part.dataset_info.json"]
    with pytest.raises(ValueError, match=r"part\.dataset_info\.json, the manifest this run writes, lists other records "
                                         r"that are still there \(2 files: part-00000-of-00002\.tfrecord, "
                                         r"part-00001-of-00002") as refused:
        cpd.create_pretraining_data([str(text)], str(out), str(vocab), num_output_shards=1, **kw)
    opts = shards.Options(vocab_file=str(vocab), **kw)
    with pytest.raises(ValueError, match=r"part\.dataset_info\.json lists 1 of this run's output files "
                                         r"\(part-00001-of-00002\.tfrecord\)") as clash:
        cpd.run(opts, sources=[("text", str(text))], reference_compatible=False,
                outputs=[str(out / "a.tfrecord"), str(out / "part-00001-of-00002.tfrecord")])
    for e in (refused, clash):
        assert "--output_file=" not in str(e.value).split(":", 1)[1] and "-of-00002/" not in str(e.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing lost, nothing written
    # The same dataset again (a rerun) replaces itself; a run of another name joins the folder.
    cpd.create_pretraining_data([str(text)], str(out), str(vocab), num_output_shards=2, **kw)
    assert {p.name: p.read_bytes() for p in out.iterdir()}.keys() == before.keys()
    cpd.run(opts, sources=[("text", str(text))], outputs=[str(out / "eval.tfrecord")], reference_compatible=False)
    assert sorted(set(p.name for p in out.iterdir()) - set(before)) == ["eval.dataset_info.json", "eval.tfrecord"]
    # A pattern that matches nothing says what the folder holds (records, not their manifests).
    with pytest.raises(records.CorruptDataError, match=r"matches this pattern \(.*data holds eval\.tfrecord, "
                                                              r"part-00000-of-00002\.tfrecord, part-00001.*\)$"):
        evaluation.EvalInput(str(out / "train-*.tfrecord"), per_host_batch_size=4, max_seq_length=32,
                                 max_predictions_per_seq=4)
