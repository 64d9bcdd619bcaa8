"""Pretraining data: identity with google-research/bert's records, hand-checked masking and
truncation rules, the schema, the manifest, corpora (text files, TFDS) and bad input. The fast
parallel mode's encoder, framing and instances are in test_fast_mode.py."""

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
from tests.helpers.synthetic_corpus import STEMS, synthetic_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = Path(__file__).parents[2] / "fixtures" / "reference_records.json"


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
    """Runs share a folder (tests/data_pipeline/records/test_many_runs.py); refused are only a rerun that would leave its
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
