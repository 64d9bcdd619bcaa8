"""The fast (default) mode of create_pretraining_data: the numpy protobuf encoder and TFRecord
framing byte for byte against TensorFlow's, the vectorized instances (truncation, masked positions,
segment pairs, masking) against the reference algorithm's rules and statistics, and the same
records for any worker count, in process or from the forked CLI. Its instances one by one:
test_fast_mode_instances.py."""

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
from data_pipeline.pretraining_data import corpora, fast_instances, instances  # noqa: E402
from data_pipeline.records import reader as records  # noqa: E402
from data_pipeline.records import schema, tfrecord  # noqa: E402
from data_pipeline.tokenization.fast import FastTokenizer  # noqa: E402
from tests.helpers.pretraining_records import read_records  # noqa: E402
from tests.helpers.synthetic_corpus import STEMS, SUFFIXES, synthetic_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


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
