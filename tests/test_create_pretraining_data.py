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

from data_pipeline import corpora, create_pretraining_data as cpd, input_pipeline, instances, schema  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "reference_records.json"
STEMS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta",
         "river", "stone", "cloud", "light", "night", "paper", "garden", "window", "silver", "morning"]
SUFFIXES = ["", "", "", "s", "ing", "ed", "ly"]


def synthetic_corpus(out: Path) -> tuple[Path, Path]:
    """The fixture's inputs (see tests/fixtures/README.md): 9 documents of made-up words."""
    rng = random.Random(7)
    docs = []
    for _ in range(9):
        doc = []
        for _ in range(rng.randint(1, 7)):
            words = [rng.choice(STEMS) + rng.choice(SUFFIXES) for _ in range(rng.randint(2, 14))]
            doc.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
        docs.append(doc)
    text = out / "input.txt"
    text.write_text("".join("\n".join(doc) + "\n\n" for doc in docs))
    vocab = out / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "!", "?", ","] + STEMS
                               + ["##" + s for s in SUFFIXES if s]) + "\n")
    return text, vocab


def read_records(path) -> list[bytes]:
    return [r.numpy() for r in tf.data.TFRecordDataset(str(path), compression_type="GZIP" if str(path).endswith(".gz") else "")]


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
    ds = input_pipeline.EvalInput(str(tmp_path / "w1" / "*.tfrecord"), per_host_batch_size=16,
                                  max_seq_length=48, max_predictions_per_seq=8)
    assert ds.num_records == one["num_instances"]
    # ... and refuses a truncated one, naming it.
    bad = tmp_path / "w1" / "part-00001-of-00002.tfrecord"
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(input_pipeline.CorruptDataError, match="part-00001-of-00002"):
        input_pipeline.EvalInput(str(tmp_path / "w1" / "*.tfrecord"), per_host_batch_size=16,
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


def test_cli_with_googles_flags_and_gzip(tmp_path):
    text, vocab = synthetic_corpus(tmp_path)
    out = tmp_path / "cli" / "train.tfrecord"
    r = subprocess.run([sys.executable, "-m", "data_pipeline.create_pretraining_data", f"--input_file={text}",
                        f"--output_file={out}", f"--vocab_file={vocab}", "--max_seq_length=32",
                        "--max_predictions_per_seq=6", "--dupe_factor=2", "--compression=gzip"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads((tmp_path / "cli" / "dataset_info.json").read_text())
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
