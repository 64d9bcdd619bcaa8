"""Tests of data_pipeline.input_pipeline and the modules under it (record_scan, records, masking,
packing): sharding, exactly-once epochs, exact resume, dynamic masking and packing invariants,
corrupt-file detection and lenient skipping, padded eval.

Every record written here carries its own id in token 1 (`ID_BASE + rid`), so a batch tells
which records it holds, even after (re-)masking: restoring `masked_lm_ids` at
`masked_lm_positions` gives the original tokens back.
"""

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from data_pipeline import input_pipeline as ip
from data_pipeline import packing as packing_module, records as records_module, schema

L, P = 32, 5  # max_seq_length, max_predictions_per_seq of the test records
PAD, CLS, SEP, MASK, VOCAB = 0, 101, 102, 103, 30000
SPECIAL = dict(pad_id=PAD, cls_id=CLS, sep_id=SEP, mask_id=MASK, vocab_size=VOCAB)
ID_BASE = 10000


# ---------------------------------------------------------------------------------------------
# Test data
# ---------------------------------------------------------------------------------------------


def make_record(rid: int, length: int | None = None) -> dict:
    """Record `rid`: [CLS] id a.. [SEP] b.. [SEP], statically masked like Google's writer."""
    rng = np.random.default_rng(rid)
    n = length if length is not None else 6 + (rid * 7) % (L - 5)  # 6..L tokens
    ids = np.zeros(L, np.int64)
    ids[:n] = rng.integers(2000, 3000, n)
    sep_a = max(2, n // 2)
    ids[0], ids[1], ids[sep_a], ids[n - 1] = CLS, ID_BASE + rid, SEP, SEP
    segment = np.zeros(L, np.int64)
    segment[sep_a + 1:n] = 1
    candidates = [i for i in range(1, n) if ids[i] not in (CLS, SEP)]
    k = min(P, max(1, int(round(n * 0.15))), len(candidates))
    positions = np.sort(rng.choice(candidates, k, replace=False))
    features = {
        "input_ids": ids.copy(), "input_mask": (np.arange(L) < n).astype(np.int64),
        "segment_ids": segment,
        "masked_lm_positions": np.zeros(P, np.int64), "masked_lm_ids": np.zeros(P, np.int64),
        "masked_lm_weights": np.zeros(P, np.float32),
        "next_sentence_labels": np.array([rid % 2], np.int64),
    }
    features["masked_lm_positions"][:k] = positions
    features["masked_lm_ids"][:k] = ids[positions]
    features["masked_lm_weights"][:k] = 1.0
    features["input_ids"][positions] = MASK
    return features


def write_dataset(directory: Path, counts: list[int], first_id: int = 0, gzip: bool = False) -> list[str]:
    """TFRecord files with `counts[i]` records each plus their manifest (schema's writer:
    `part-00000.dataset_info.json`, named after the first file)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, rid = [], first_id
    for i, count in enumerate(counts):
        path = str(directory / f"part-{i:05d}.tfrecord") + (".gz" if gzip else "")
        with tf.io.TFRecordWriter(path, options="GZIP" if gzip else None) as writer:
            for _ in range(count):
                writer.write(schema.serialize(make_record(rid)))
                rid += 1
        paths.append(path)
    schema.write_dataset_info(str(directory), dict(zip(paths, counts)))
    return paths


def originals(batch: dict) -> np.ndarray:
    """The unmasked tokens of a batch (numpy mirror of `restore_original_ids`)."""
    ids = batch["input_ids"].copy()
    for r in range(ids.shape[0]):
        real = batch["masked_lm_weights"][r] > 0
        ids[r, batch["masked_lm_positions"][r][real]] = batch["masked_lm_ids"][r][real]
    return ids


def record_ids(batch: dict) -> list[int]:
    """Ids of the records in a batch, row by row (and sequence by sequence when packed)."""
    ids = originals(batch)
    if "pack_ids" not in batch:
        return [int(ids[r, 1]) - ID_BASE for r in range(len(ids)) if batch["next_sentence_weights"][r] > 0]
    out = []
    for r in range(len(ids)):
        for s in np.flatnonzero(batch["next_sentence_weights"][r] > 0):
            out.append(int(ids[r, batch["cls_positions"][r, s] + 1]) - ID_BASE)
    return out


def batch_hash(batch: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode() + batch[k].tobytes())
    return h.hexdigest()


def make_input(pattern, **kw) -> ip.PretrainingInput:
    args = dict(per_host_batch_size=4, max_seq_length=L, max_predictions_per_seq=P, seed=0,
                shuffle_buffer_size=16)
    args.update(kw)
    return ip.PretrainingInput(pattern, **args)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, int]:
    """8 files of 3..10 records (52 in all)."""
    directory = tmp_path_factory.mktemp("data")
    counts = [3, 4, 5, 6, 7, 8, 9, 10]
    write_dataset(directory, counts)
    return str(directory / "part-*.tfrecord"), sum(counts)


# ---------------------------------------------------------------------------------------------
# Files and hosts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hosts", [1, 2, 3, 4, 8])
def test_host_file_sets_are_disjoint_and_complete(dataset, hosts):
    pattern, _ = dataset
    every = ip.expand_file_patterns(pattern)
    assert len(every) == 8 and every == sorted(every)
    shares = [make_input(pattern, process_index=h, process_count=hosts).host_files
              for h in range(hosts)]
    flat = [f for share in shares for f in share]
    assert len(flat) == len(set(flat)) == 8  # disjoint
    assert sorted(flat) == every  # complete
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    # The list order given does not matter (hosts that glob differently still agree).
    assert ip.shard_files(every[::-1], 1 % hosts, hosts) == shares[1 % hosts]


def test_more_hosts_than_files_is_an_error(dataset):
    with pytest.raises(ValueError, match="process_count=9"):
        make_input(dataset[0], process_index=0, process_count=9)


def test_a_pattern_matching_nothing_names_the_pattern(tmp_path):
    with pytest.raises(ip.CorruptDataError, match="nothing-here"):
        make_input(str(tmp_path / "nothing-here-*.tfrecord"), verify=False)
    # Verified: the pattern is what is wrong, not a missing manifest.
    with pytest.raises(ip.CorruptDataError, match=r"nothing-here-\*.tfrecord: no input file matches this pattern"):
        make_input(str(tmp_path / "nothing-here-*.tfrecord"))
    (tmp_path / "part-0.tfrecord").write_bytes(b"")
    with pytest.raises(ip.CorruptDataError, match=r"no data manifest .* config.verify_data=False"):
        make_input(str(tmp_path / "part-*.tfrecord"))


# ---------------------------------------------------------------------------------------------
# Exactly once per epoch, determinism, finite epochs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [False, True])
def test_every_record_once_per_epoch_across_hosts(dataset, packing):
    pattern, total = dataset
    hosts, epochs = 3, 3
    seen_by_host = []
    for h in range(hosts):
        ds = make_input(pattern, process_index=h, process_count=hosts, packing=packing,
                        packing_window=8, dynamic_masking=True, special_ids=SPECIAL)
        n = ds.stats["records_in_files"]
        stream = []
        while len(stream) < epochs * n:
            stream += record_ids(next(ds))
        chunks = [stream[e * n:(e + 1) * n] for e in range(epochs)]
        for chunk in chunks:  # each epoch is a permutation of this host's records
            assert sorted(chunk) == sorted(chunks[0]) and len(set(chunk)) == n
        assert chunks[0] != chunks[1]  # and reshuffled between epochs
        seen_by_host.append(set(chunks[0]))
    union = set().union(*seen_by_host)
    assert union == set(range(total))
    assert sum(map(len, seen_by_host)) == total  # hosts disjoint


def test_same_seed_same_batches_other_seed_other_batches(dataset):
    pattern, _ = dataset
    kw = dict(dynamic_masking=True, special_ids=SPECIAL)

    def run(seed):
        ds = make_input(pattern, seed=seed, **kw)
        return [batch_hash(next(ds)) for _ in range(6)]

    reference = run(3)
    assert run(3) == reference
    assert run(4) != reference


@pytest.mark.parametrize("packing", [False, True])
def test_finite_epoch_gives_every_host_the_same_number_of_batches(dataset, packing):
    pattern, _ = dataset
    hosts, b = 3, 4
    counts = []
    for h in range(hosts):
        ds = make_input(pattern, process_index=h, process_count=hosts, repeat=False,
                        per_host_batch_size=b, packing=packing)
        batches = list(ds)
        assert len(batches) == ds.num_batches
        counts.append(len(batches))
    # Files 0,3,6 / 1,4,7 / 2,5 hold 3+6+9, 4+7+10, 5+8 records: the smallest host has 13.
    expected = 13 // b if not packing else -(-13 // 3) // b
    assert counts == [expected] * hosts


# ---------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [False, True])
def test_resume_yields_exactly_the_uninterrupted_batches(dataset, tmp_path, packing):
    """Saved after every batch for ~3 epochs, each state resumes to the uninterrupted hashes.

    Every cut point matters: TF restores some pipelines wrongly only when the iterator was saved
    at an epoch's end (see `_build`).
    """
    pattern, _ = dataset
    kw = dict(packing=packing, packing_window=8, dynamic_masking=True, special_ids=SPECIAL,
              process_index=1, process_count=2, per_host_batch_size=5, cycle_length=2)
    # This host has 4 files (28 records) read 2 at a time, so the file shuffle runs dry
    # mid-epoch; the cuts span ~2 epochs.
    cuts, after = 8, 4
    run = make_input(pattern, **kw)
    reference = []
    for cut in range(cuts + after):
        if cut < cuts:
            run.save_state(str(tmp_path / f"state-{cut}"))
        reference.append(batch_hash(next(run)))
    assert len(set(reference)) == len(reference)
    for cut in range(cuts):
        resumed = make_input(pattern, **kw)
        resumed.restore_state(str(tmp_path / f"state-{cut}"))
        assert resumed.stats["batches"] == cut
        got = [batch_hash(next(resumed)) for _ in range(after)]
        assert got == reference[cut:cut + after], f"resumed after batch {cut}"


def test_gzip_files_read_exactly_like_plain_ones_and_resume(tmp_path):
    """`create_pretraining_data --compression=gzip` output (`*.gz`) trains and evaluates on the
    same batches as the uncompressed records, and a mid-epoch state resumes the same."""
    counts = [3, 5, 4, 6]
    write_dataset(tmp_path / "plain", counts)
    write_dataset(tmp_path / "gz", counts, gzip=True)
    kw = dict(dynamic_masking=True, special_ids=SPECIAL, per_host_batch_size=3, cycle_length=2)
    plain = make_input(str(tmp_path / "plain" / "part-*"), **kw)
    gz = make_input(str(tmp_path / "gz" / "part-*"), **kw)
    assert gz.stats["records_per_epoch"] == plain.stats["records_per_epoch"] == sum(counts)
    reference = [batch_hash(next(plain)) for _ in range(12)]  # ~2 epochs
    got = []
    for i in range(5):
        got.append(batch_hash(next(gz)))
    gz.save_state(str(tmp_path / "state"))
    resumed = make_input(str(tmp_path / "gz" / "part-*"), **kw)
    resumed.restore_state(str(tmp_path / "state"))
    got += [batch_hash(next(resumed)) for _ in range(7)]
    assert got == reference
    evals = [[batch_hash(b) for b in ip.make_eval_iterator(
        str(tmp_path / d / "part-*"), per_host_batch_size=4, max_seq_length=L,
        max_predictions_per_seq=P)] for d in ("plain", "gz")]
    assert evals[0] == evals[1] and len(evals[0]) == 5
    assert ip.record_shape(str(tmp_path / "gz" / "part-*")) == ip.record_shape(
        str(tmp_path / "plain" / "part-*")) == (L, P)


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_gzip_file_is_named_or_its_good_records_kept(tmp_path, verify):
    paths = write_dataset(tmp_path, [4, 6, 5], gzip=True)
    data = Path(paths[1]).read_bytes()
    Path(paths[1]).write_bytes(data[:len(data) * 2 // 3])  # cut inside the deflate stream
    pattern = str(tmp_path / "part-*")
    # Both errors name the file and the config field that goes on past it.
    if verify:
        with pytest.raises(ip.CorruptDataError, match="part-00001.*config.skip_corrupt_records=True"):
            make_input(pattern)
    else:
        with pytest.raises(ip.CorruptDataError, match="part-00001.*config.skip_corrupt_records=True"):
            ds = make_input(pattern, verify=False, shuffle_buffer_size=1)
            for _ in range(10):
                next(ds)
    ds = make_input(pattern, skip_corrupt=True, repeat=False, per_host_batch_size=1, verify=verify)
    seen = sorted(rid for batch in ds for rid in record_ids(batch))
    kept = [rid for rid in range(4, 10) if rid in seen]
    assert kept == list(range(4, 4 + len(kept))) and len(kept) < 6  # a prefix of file 1
    assert seen == sorted(set(range(15)) - set(range(4 + len(kept), 10)))
    if verify:  # the manifest knows how many records were lost
        assert ds.stats["skipped_records"] == 6 - len(kept)


def test_restore_with_other_options_names_them(dataset, tmp_path):
    pattern, _ = dataset
    ds = make_input(pattern)
    next(ds)
    ds.save_state(str(tmp_path / "s"))
    with pytest.raises(ValueError, match="per_host_batch_size"):
        make_input(pattern, per_host_batch_size=2).restore_state(str(tmp_path / "s"))
    with pytest.raises(FileNotFoundError, match="no saved input state"):
        make_input(pattern).restore_state(str(tmp_path / "nothing"))
    # The same file names with other contents (and a fresh manifest) do not resume either.
    write_dataset(tmp_path / "d", [3, 3])
    ds = make_input(str(tmp_path / "d" / "part-*"))
    ds.save_state(str(tmp_path / "s2"))
    write_dataset(tmp_path / "d", [3, 3], first_id=100)
    with pytest.raises(ValueError, match="host_files_sha256"):
        make_input(str(tmp_path / "d" / "part-*")).restore_state(str(tmp_path / "s2"))


# ---------------------------------------------------------------------------------------------
# Dynamic masking
# ---------------------------------------------------------------------------------------------


def _stack(records: list[dict]) -> dict:
    return {k: tf.constant(np.stack([r[k] for r in records]).astype(
        np.float32 if k == "masked_lm_weights" else np.int32)) for k in records[0]}


def test_restore_original_ids_by_hand():
    features = {"input_ids": tf.constant([[CLS, MASK, 7, MASK, SEP]]),
                "masked_lm_positions": tf.constant([[1, 3, 0]]),
                "masked_lm_ids": tf.constant([[5, 9, 0]]),
                "masked_lm_weights": tf.constant([[1.0, 1.0, 0.0]])}
    assert ip.restore_original_ids(features).numpy().tolist() == [[CLS, 5, 7, 9, SEP]]


def test_dynamic_mask_rules_and_rates():
    n_rows, length, preds = 3000, 64, 10
    rng = np.random.default_rng(0)
    real_lengths = rng.integers(3, length + 1, n_rows)
    ids = rng.integers(1000, VOCAB, (n_rows, length)).astype(np.int32)
    mask = (np.arange(length)[None] < real_lengths[:, None]).astype(np.int32)
    for r, n in enumerate(real_lengths):
        ids[r, 0], ids[r, n // 2], ids[r, n - 1] = CLS, SEP, SEP
    ids[mask == 0] = PAD
    features = {"input_ids": tf.constant(ids), "input_mask": tf.constant(mask),
                "segment_ids": tf.zeros_like(ids),
                "masked_lm_positions": tf.zeros([n_rows, preds], tf.int32),
                "masked_lm_ids": tf.zeros([n_rows, preds], tf.int32),
                "masked_lm_weights": tf.zeros([n_rows, preds], tf.float32)}
    out = {k: v.numpy() for k, v in ip.dynamic_mask(
        features, tf.constant([1, 2]), special_ids=SPECIAL, max_predictions_per_seq=preds).items()}
    pos, lab, w, new = (out["masked_lm_positions"], out["masked_lm_ids"],
                        out["masked_lm_weights"], out["input_ids"])
    kinds = {"mask": 0, "keep": 0, "random": 0}
    chosen_total = 0
    for r, n in enumerate(real_lengths):
        special = {0, n // 2, n - 1}
        k = int(w[r].sum())
        # The reference's count: min(P, max(1, round(len(tokens) * 0.15))), then the candidates.
        assert k == min(preds, max(1, int(round(n * 0.15))), n - len(special)), (r, n)
        assert np.all(w[r, :k] == 1) and np.all(w[r, k:] == 0)
        chosen = pos[r, :k]
        assert np.all(np.diff(chosen) > 0)  # sorted, unique
        assert not set(chosen.tolist()) & special and np.all(chosen < n)  # never [CLS]/[SEP]/[PAD]
        assert np.all(pos[r, k:] == 0) and np.all(lab[r, k:] == 0)
        np.testing.assert_array_equal(lab[r, :k], ids[r, chosen])  # labels are the originals
        untouched = np.setdiff1d(np.arange(length), chosen)
        np.testing.assert_array_equal(new[r, untouched], ids[r, untouched])
        for p_, l_ in zip(chosen, lab[r, :k]):
            kinds["mask" if new[r, p_] == MASK else "keep" if new[r, p_] == l_ else "random"] += 1
        chosen_total += k
    # 80 / 10 / 10 within 5 standard deviations of the binomial.
    for kind, prob in (("mask", 0.8), ("keep", 0.1), ("random", 0.1)):
        sd = np.sqrt(chosen_total * prob * (1 - prob))
        assert abs(kinds[kind] - prob * chosen_total) < 5 * sd, kinds
    # Same seed, same masks; another seed, other masks.
    again = ip.dynamic_mask(features, tf.constant([1, 2]), special_ids=SPECIAL,
                            max_predictions_per_seq=preds)
    other = ip.dynamic_mask(features, tf.constant([1, 3]), special_ids=SPECIAL,
                            max_predictions_per_seq=preds)
    np.testing.assert_array_equal(again["input_ids"].numpy(), new)
    assert not np.array_equal(other["masked_lm_positions"].numpy(), pos)


def test_dynamic_mask_hand_cases():
    # 14 real tokens -> round(2.1) = 2 predictions; [CLS] [SEP] [SEP] -> no candidate, none.
    rows = [[CLS] + list(range(2000, 2012)) + [SEP] + [PAD] * 2, [CLS, SEP, SEP] + [PAD] * 13]
    mask = [[1] * 14 + [0] * 2, [1] * 3 + [0] * 13]
    features = {"input_ids": tf.constant(rows), "input_mask": tf.constant(mask),
                "masked_lm_positions": tf.zeros([2, 4], tf.int32),
                "masked_lm_ids": tf.zeros([2, 4], tf.int32),
                "masked_lm_weights": tf.zeros([2, 4], tf.float32)}
    out = ip.dynamic_mask(features, tf.constant([0, 0]), special_ids=SPECIAL, max_predictions_per_seq=4)
    assert out["masked_lm_weights"].numpy().sum(1).tolist() == [2.0, 0.0]
    assert out["input_ids"].numpy()[1].tolist() == rows[1]


def test_dynamic_masking_remasks_each_epoch_and_keeps_the_tokens(dataset):
    pattern, total = dataset
    ds = make_input(pattern, dynamic_masking=True, special_ids=SPECIAL, shuffle_buffer_size=1,
                    per_host_batch_size=total)  # one batch = one epoch
    e1, e2 = next(ds), next(ds)
    by_id = lambda b: {rid: r for r, rid in enumerate(record_ids(b))}
    i1, i2 = by_id(e1), by_id(e2)
    assert set(i1) == set(i2) == set(range(total))
    o1, o2 = originals(e1), originals(e2)
    differ = 0
    for rid in range(total):
        expected = make_record(rid)
        original = expected["input_ids"].copy()
        original[expected["masked_lm_positions"][expected["masked_lm_weights"] > 0]] = \
            expected["masked_lm_ids"][expected["masked_lm_weights"] > 0]
        np.testing.assert_array_equal(o1[i1[rid]], original)  # tokens survive re-masking
        np.testing.assert_array_equal(o2[i2[rid]], original)
        differ += not np.array_equal(e1["masked_lm_positions"][i1[rid]],
                                     e2["masked_lm_positions"][i2[rid]])
    assert differ > total // 2  # new masks in the new epoch


@pytest.mark.parametrize("width", [2 * P, L + 8])  # a packed width may exceed the row length
def test_dynamic_mask_on_packed_rows_masks_each_sequence_on_its_own(width):
    records = [make_record(rid) for rid in range(40)]
    features = _stack(records)
    budget = ip.dynamic_predictions_per_sequence(features, special_ids=SPECIAL,
                                                 max_predictions_per_seq=P)
    packed = ip.pack_window(features, max_seq_length=L, max_seqs_per_pack=3,
                            max_predictions_per_pack=width, prediction_budget=budget)
    out = {k: v.numpy() for k, v in ip.dynamic_mask(
        packed, tf.constant([5, 6]), special_ids=SPECIAL, max_predictions_per_seq=P).items()}
    restored = originals(out)
    for r in range(len(restored)):
        real = out["masked_lm_weights"][r] > 0
        positions = out["masked_lm_positions"][r][real]
        assert out["masked_lm_positions"].shape[1] == width
        assert np.all(np.diff(positions) > 0) and len(positions) <= width
        for s in np.flatnonzero(out["next_sentence_weights"][r]):
            where = np.flatnonzero(out["pack_ids"][r] == s + 1)
            tokens = restored[r, where]
            n_cand = int(np.sum((tokens != CLS) & (tokens != SEP)))
            mine = positions[np.isin(positions, where)]
            # This sequence's own count (its length, its cap), never a special token.
            assert len(mine) == min(P, max(1, int(round(len(where) * 0.15))), n_cand)
            assert not np.isin(restored[r, mine], [CLS, SEP]).any()


# ---------------------------------------------------------------------------------------------
# Whole-word dynamic masking
# ---------------------------------------------------------------------------------------------

SUBWORD_FROM = 2500  # test vocabulary: ids >= 2500 are `##` pieces
SUBWORD = np.arange(VOCAB) >= SUBWORD_FROM


def google_words(ids, n_real: int) -> list[list[int]]:
    """Google's whole-word candidates (instances.py): a `##` piece joins the previous candidate."""
    words: list[list[int]] = []
    for i in range(n_real):
        if ids[i] in (CLS, SEP):
            continue
        if words and ids[i] >= SUBWORD_FROM:
            words[-1].append(i)
        else:
            words.append([i])
    return words


def _word_rows(n_rows: int, length: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Rows of words of 1-4 pieces (some rows with a stray `##` right after [CLS] or [SEP])."""
    ids = np.full((n_rows, length), PAD, np.int32)
    lengths = rng.integers(8, length + 1, n_rows)
    for r, n in enumerate(lengths):
        tokens = [CLS]
        sep_at = int(n) // 2
        while len(tokens) < n - 1:
            if len(tokens) == sep_at:
                tokens.append(SEP)
            start_piece = rng.random() < 0.1 and tokens[-1] in (CLS, SEP)
            tokens.append(int(rng.integers(SUBWORD_FROM, VOCAB) if start_piece else rng.integers(1000, SUBWORD_FROM)))
            for _ in range(rng.choice(4, p=[0.6, 0.25, 0.1, 0.05])):
                tokens.append(int(rng.integers(SUBWORD_FROM, VOCAB)))
        tokens = tokens[:n - 1] + [SEP]
        ids[r, :n] = tokens
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
    return ids, mask


def _blank_features(ids: np.ndarray, mask: np.ndarray, preds: int) -> dict:
    n = len(ids)
    return {"input_ids": tf.constant(ids), "input_mask": tf.constant(mask),
            "segment_ids": tf.zeros_like(ids),
            "masked_lm_positions": tf.zeros([n, preds], tf.int32),
            "masked_lm_ids": tf.zeros([n, preds], tf.int32),
            "masked_lm_weights": tf.zeros([n, preds], tf.float32)}


def test_whole_word_dynamic_mask_rules_rates_and_google_distribution():
    import random

    from data_pipeline import instances

    n_rows, length, preds = 3000, 64, 10
    ids, mask = _word_rows(n_rows, length, np.random.default_rng(0))
    out = {k: v.numpy() for k, v in ip.dynamic_mask(
        _blank_features(ids, mask, preds), tf.constant([3, 4]), special_ids=SPECIAL,
        max_predictions_per_seq=preds, subword=SUBWORD).items()}
    pos, lab, w, new = (out["masked_lm_positions"], out["masked_lm_ids"],
                        out["masked_lm_weights"], out["input_ids"])
    kinds = {"mask": 0, "keep": 0, "random": 0}
    masked_tokens = real_tokens = 0
    ours = {1: [0, 0], 2: [0, 0], 3: [0, 0], 4: [0, 0]}  # word pieces -> [words masked, words]
    for r in range(n_rows):
        n = int(mask[r].sum())
        k = int(w[r].sum())
        chosen = set(pos[r, :k].tolist())
        assert np.all(w[r, :k] == 1) and np.all(w[r, k:] == 0) and np.all(np.diff(pos[r, :k]) > 0)
        assert not any(ids[r, p] in (CLS, SEP, PAD) for p in chosen) and all(p < n for p in chosen)
        np.testing.assert_array_equal(lab[r, :k], ids[r, pos[r, :k]])
        budget = min(preds, max(1, int(round(n * 0.15))))
        assert k <= budget
        words = google_words(ids[r], n)
        for word in words:
            hit = [p in chosen for p in word]
            assert all(hit) or not any(hit), (r, word, sorted(chosen))  # whole words only
            ours[min(len(word), 4)][0] += all(hit)
            ours[min(len(word), 4)][1] += 1
            # Google's greedy pass: a word left out would not have fit what was left.
            assert all(hit) or len(word) > budget - k, (r, word, budget, k)
        untouched = np.setdiff1d(np.arange(length), pos[r, :k])
        np.testing.assert_array_equal(new[r, untouched], ids[r, untouched])
        for p_, l_ in zip(pos[r, :k], lab[r, :k]):
            kinds["mask" if new[r, p_] == MASK else "keep" if new[r, p_] == l_ else "random"] += 1
        masked_tokens += k
        real_tokens += n
    for kind, prob in (("mask", 0.8), ("keep", 0.1), ("random", 0.1)):
        sd = np.sqrt(masked_tokens * prob * (1 - prob))
        assert abs(kinds[kind] - prob * masked_tokens) < 5 * sd, kinds
    rate = masked_tokens / real_tokens
    assert 0.13 < rate <= 0.155, rate  # 15% of the tokens, a little less when words do not fit

    # The same rows through the static whole-word masking of create_pretraining_data
    # (data_pipeline.instances, Google's code path): the same share of words masked, by length.
    vocab_words = [f"w{i}" for i in range(VOCAB)]
    name = lambda t: "[CLS]" if t == CLS else "[SEP]" if t == SEP else (
        f"##{t}" if t >= SUBWORD_FROM else f"w{t}")
    theirs = {1: [0, 0], 2: [0, 0], 3: [0, 0], 4: [0, 0]}
    rng, stats, static_masked = random.Random(0), instances.MaskStats(), 0
    for r in range(n_rows):
        n = int(mask[r].sum())
        tokens = [name(int(t)) for t in ids[r, :n]]
        _, positions, _ = instances.create_masked_lm_predictions(
            tokens, 0.15, preds, vocab_words, rng, True, stats)
        chosen = set(positions)
        static_masked += len(positions)
        for word in google_words(ids[r], n):
            theirs[min(len(word), 4)][0] += all(p in chosen for p in word)
            theirs[min(len(word), 4)][1] += 1
    assert all(ours[k][1] == theirs[k][1] > 50 for k in ours)  # the same words, in numbers
    for pieces in ours:
        a, b = ours[pieces][0] / ours[pieces][1], theirs[pieces][0] / theirs[pieces][1]
        sd = np.sqrt(2 * b * (1 - b) / ours[pieces][1])
        assert abs(a - b) < 5 * sd + 1e-3, (pieces, a, b)
    assert abs(masked_tokens - static_masked) < 0.01 * static_masked, (masked_tokens, static_masked)
    # Token-by-token masking of the same rows splits words: the option does something.
    token_level = ip.dynamic_mask(_blank_features(ids, mask, preds), tf.constant([3, 4]),
                                  special_ids=SPECIAL, max_predictions_per_seq=preds)
    tpos, tw = token_level["masked_lm_positions"].numpy(), token_level["masked_lm_weights"].numpy()
    split = sum(0 < len(set(word) & set(tpos[r][tw[r] > 0].tolist())) < len(word)
                for r in range(200) for word in google_words(ids[r], int(mask[r].sum())))
    assert split > 20


def test_whole_word_dynamic_mask_by_hand():
    # Words: [1..3] [4] [5, 6 + 8 (a ## right after [SEP] joins the word before, as in Google's
    # code)] [9] [10..13] [14]; 16 real tokens -> round(2.4) = 2 tokens: only 1-piece words fit.
    row = ([CLS, 1000, 2501, 2502, 1001, 1002, 2503, SEP, 2504, 1003, 1004, 2505, 2506, 2507, 1005, SEP]
           + [PAD] * 4)
    ids = np.array([row] * 64, np.int32)
    mask = (ids != PAD).astype(np.int32)
    out = ip.dynamic_mask(_blank_features(ids, mask, 6), tf.constant([7, 7]), special_ids=SPECIAL,
                          max_predictions_per_seq=6, subword=SUBWORD)
    pos, w = out["masked_lm_positions"].numpy(), out["masked_lm_weights"].numpy()
    assert np.all(w.sum(1) == 2)
    picked = {tuple(p[:2]) for p in pos.tolist()}
    assert picked == {(4, 9), (4, 14), (9, 14)}  # every pair of the 1-piece words, nothing else


def test_whole_word_dynamic_mask_on_packed_rows_keeps_sequences_apart():
    ids, mask = _word_rows(60, L, np.random.default_rng(1))
    records = []
    for r in range(len(ids)):
        records.append({"input_ids": ids[r], "input_mask": mask[r], "segment_ids": np.zeros(L, np.int32),
                        "masked_lm_positions": np.zeros(P, np.int32), "masked_lm_ids": np.zeros(P, np.int32),
                        "masked_lm_weights": np.zeros(P, np.float32),
                        "next_sentence_labels": np.zeros(1, np.int32)})
    features = _stack(records)
    budget = ip.dynamic_predictions_per_sequence(features, special_ids=SPECIAL, max_predictions_per_seq=P)
    packed = ip.pack_window(features, max_seq_length=L, max_seqs_per_pack=3,
                            max_predictions_per_pack=3 * P, prediction_budget=budget)
    out = {k: v.numpy() for k, v in ip.dynamic_mask(
        packed, tf.constant([5, 6]), special_ids=SPECIAL, max_predictions_per_seq=P,
        subword=SUBWORD).items()}
    restored = originals(out)
    packs = 0
    for r in range(len(restored)):
        chosen = set(out["masked_lm_positions"][r][out["masked_lm_weights"][r] > 0].tolist())
        seqs = np.flatnonzero(out["next_sentence_weights"][r])
        packs += len(seqs) > 1
        for s in seqs:
            where = np.flatnonzero(out["pack_ids"][r] == s + 1)
            words = [[int(where[i]) for i in word] for word in google_words(restored[r, where], len(where))]
            mine = chosen & set(where.tolist())
            assert 0 < len(mine) <= min(P, max(1, int(round(len(where) * 0.15))))
            for word in words:  # words never reach into the sequence before
                assert set(word) <= mine or not set(word) & mine
    assert packs > 0


def _wwm_dataset(directory: Path, recorded) -> str:
    paths = write_dataset(directory, [6, 6])
    info = {"flags": {"do_whole_word_mask": recorded}} if recorded is not None else None
    schema.write_dataset_info(str(directory), {p: 6 for p in paths}, info)
    return str(directory / "part-*.tfrecord")


def _split_words(batch: dict) -> tuple[int, int]:
    """(words partly masked, words fully masked) over a batch (records' ids >= 2500 are ## pieces)."""
    restored, partial, whole = originals(batch), 0, 0
    for r in range(len(restored)):
        chosen = set(batch["masked_lm_positions"][r][batch["masked_lm_weights"][r] > 0].tolist())
        for word in google_words(restored[r], int(batch["input_mask"][r].sum())):
            hit = len(set(word) & chosen)
            partial += 0 < hit < len(word)
            whole += hit == len(word) and len(word) > 1
    return partial, whole


@pytest.mark.parametrize("recorded, asked, expect_whole", [
    (True, None, True),  # the records say whole words: honoured
    (None, True, True),  # the records do not say, the user asks
    (False, True, True),  # the user's explicit choice wins (a warning)
    (True, False, False),
    (None, None, False),  # nothing recorded, nothing asked: token by token, as before
])
def test_pipeline_whole_word_masking_follows_the_records_unless_told(tmp_path, recorded, asked,
                                                                    expect_whole):
    pattern = _wwm_dataset(tmp_path, recorded)
    ds = make_input(pattern, dynamic_masking=True, special_ids=SPECIAL, per_host_batch_size=12,
                    whole_word_mask=asked, subword=SUBWORD, shuffle_buffer_size=1)
    assert ds.whole_word_mask is expect_whole
    partial = whole = 0
    for _ in range(40):  # 40 epochs of the 12 records
        p_, w_ = _split_words(next(ds))
        partial, whole = partial + p_, whole + w_
    if expect_whole:
        assert partial == 0 and whole > 0
    else:
        assert partial > 0


def test_whole_word_masking_option_errors(tmp_path):
    pattern = _wwm_dataset(tmp_path, True)
    with pytest.raises(ValueError, match="subword"):
        make_input(pattern, dynamic_masking=True, special_ids=SPECIAL)
    with pytest.raises(ValueError, match="needs dynamic_masking=True"):
        make_input(pattern, whole_word_mask=True, subword=SUBWORD)
    with pytest.raises(ValueError, match="one bool per vocabulary id"):
        make_input(pattern, dynamic_masking=True, special_ids=SPECIAL, subword=SUBWORD[:100])
    assert make_input(pattern).whole_word_mask is False  # static masks: nothing to decide


def test_subword_table_from_a_vocab_file(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[CLS]\nplay\n##ing\n##s\n#\n")
    assert ip.subword_table(str(vocab)).tolist() == [False, False, False, True, True, False]


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def test_pack_window_by_hand():
    # The docstring example: L=8, S=3.
    def rec(tokens, label, masked):
        f = {"input_ids": tokens + [0] * (8 - len(tokens)), "input_mask": [1] * len(tokens) + [0] * (8 - len(tokens)),
             "segment_ids": [0] * 8, "masked_lm_positions": [masked, 0],
             "masked_lm_ids": [77, 0], "masked_lm_weights": [1.0, 0.0],
             "next_sentence_labels": [label]}
        return {k: np.array(v) for k, v in f.items()}
    a, b = rec([CLS, 5, SEP], 0, 1), rec([CLS, 6, 7, SEP], 1, 2)
    out = {k: v.numpy() for k, v in ip.pack_window(
        _stack([a, b]), max_seq_length=8, max_seqs_per_pack=3, max_predictions_per_pack=4).items()}
    assert out["input_ids"].tolist() == [[CLS, 6, 7, SEP, CLS, 5, SEP, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert out["pack_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 0]]
    assert out["input_mask"].tolist() == [[1] * 7 + [0]]
    assert out["cls_positions"].tolist() == [[0, 4, 0]]
    assert out["next_sentence_labels"].tolist() == [[1, 0, 0]]
    assert out["next_sentence_weights"].tolist() == [[1, 1, 0]]
    assert out["masked_lm_positions"].tolist() == [[2, 5, 0, 0]]  # b's 2, a's 1 + offset 4
    assert out["masked_lm_ids"].tolist() == [[77, 77, 0, 0]]
    assert out["masked_lm_weights"].tolist() == [[1, 1, 0, 0]]


@pytest.mark.parametrize("max_seqs,max_preds", [(3, 15), (4, 7), (1, 5)])
def test_packed_rows_hold_the_original_sequences(max_seqs, max_preds):
    records = [make_record(rid) for rid in range(60)]
    out = {k: v.numpy() for k, v in ip.pack_window(
        _stack(records), max_seq_length=L, max_seqs_per_pack=max_seqs,
        max_predictions_per_pack=max_preds).items()}
    rows = len(out["input_ids"])
    assert rows < len(records) if max_seqs > 1 else rows == len(records)  # something was packed
    restored = originals(out)  # the static masks may cover the id token
    seen = []
    for r in range(rows):
        slots = np.flatnonzero(out["next_sentence_weights"][r])
        assert 1 <= len(slots) <= max_seqs and np.array_equal(slots, np.arange(len(slots)))
        assert np.array_equal(out["pack_ids"][r] > 0, out["input_mask"][r] > 0)
        assert out["masked_lm_weights"][r].sum() <= max_preds
        for s in slots:
            where = np.flatnonzero(out["pack_ids"][r] == s + 1)
            start = out["cls_positions"][r, s]
            assert where[0] == start and np.array_equal(where, start + np.arange(len(where)))
            rid = int(restored[r, start + 1]) - ID_BASE
            rec = records[rid]
            n = int(rec["input_mask"].sum())
            assert len(where) == n
            np.testing.assert_array_equal(out["input_ids"][r, where], rec["input_ids"][:n])
            np.testing.assert_array_equal(out["segment_ids"][r, where], rec["segment_ids"][:n])
            np.testing.assert_array_equal(out["position_ids"][r, where], np.arange(n))
            assert out["next_sentence_labels"][r, s] == rec["next_sentence_labels"][0]
            # This sequence's predictions, shifted by its start.
            mine = (out["masked_lm_weights"][r] > 0) & np.isin(out["masked_lm_positions"][r], where)
            k = int(rec["masked_lm_weights"].sum())
            np.testing.assert_array_equal(out["masked_lm_positions"][r][mine] - start,
                                          rec["masked_lm_positions"][:k])
            np.testing.assert_array_equal(out["masked_lm_ids"][r][mine], rec["masked_lm_ids"][:k])
            seen.append(rid)
        assert np.all(out["masked_lm_positions"][r][out["masked_lm_weights"][r] == 0] == 0)
    assert sorted(seen) == list(range(len(records)))  # none lost, none duplicated
    assert out["input_mask"].sum() == sum(int(r["input_mask"].sum()) for r in records)


def test_xla_packer_equals_the_plain_loop():
    rng = np.random.default_rng(1)
    for trial in range(4):
        n = 40
        lengths = tf.constant(rng.integers(3, L + 1, n), tf.int32)
        preds = tf.constant(rng.integers(0, P + 1, n), tf.int32)
        groups = tf.constant(np.sort(rng.integers(0, 2, n)), tf.int32)
        args = (lengths, preds, groups, tf.constant(L), tf.constant(1 + trial), tf.constant(2 * P))
        plain = [x.numpy() for x in packing_module._first_fit_loop(*args)]
        xla = [x.numpy() for x in packing_module._first_fit_xla(*args)]
        for a, b in zip(plain, xla):
            np.testing.assert_array_equal(a, b)


def test_packed_batch_runs_the_model_like_separate_sequences():
    """The model sees each packed sequence as if alone: same hidden states, own [CLS] pooling."""
    import jax
    import jax.numpy as jnp
    from bert_jax.model import model_config, modeling, pretraining_heads

    cfg = model_config.BertConfig(vocab_size=VOCAB + ID_BASE, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=64,
                              max_position_embeddings=L)
    model = pretraining_heads.BertForPreTraining(cfg)
    records = [make_record(rid, length=n) for rid, n in enumerate([9, 12, 7])]
    packed = {k: jnp.asarray(v.numpy()) for k, v in ip.pack_window(
        _stack(records), max_seq_length=L, max_seqs_per_pack=3, max_predictions_per_pack=15).items()}
    assert packed["input_ids"].shape[0] == 1
    inputs = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "position_ids",
              "pack_ids", "cls_positions")
    params = jax.jit(model.init)(jax.random.key(0), **{k: packed[k] for k in inputs})
    apply = jax.jit(model.apply)
    out = apply(params, **{k: packed[k] for k in inputs})
    separate = {k: jnp.asarray(v.numpy()) for k, v in _stack(records).items()}
    alone = apply(params, separate["input_ids"], separate["input_mask"], separate["segment_ids"],
                  separate["masked_lm_positions"])  # the three records as ordinary rows
    # Every position's hidden state: the encoder alone (the pretraining model's last layer runs at
    # the masked positions and [CLS] only).
    bert = jax.jit(modeling.BertModel(cfg).apply)
    bert_params = {"params": params["params"]["bert"]}
    seq = bert(bert_params, *(packed[k] for k in inputs if k != "masked_lm_positions")).sequence_output
    seq_alone = bert(bert_params, separate["input_ids"], separate["input_mask"],
                     separate["segment_ids"]).sequence_output
    restored = originals({k: np.asarray(v) for k, v in packed.items()})
    for s in range(3):
        start = int(packed["cls_positions"][0, s])
        rid = int(restored[0, start + 1]) - ID_BASE
        n = int(records[rid]["input_mask"].sum())
        np.testing.assert_allclose(seq[0, start:start + n], seq_alone[rid, :n], atol=2e-5)
        np.testing.assert_allclose(out.nsp_logits[0, s], alone.nsp_logits[rid], atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Packed batches train like the same sequences unpacked (issue 43)
# ---------------------------------------------------------------------------------------------

# A small world of its own: a 100-token vocabulary, rows of L = 24 tokens, P = 3 predictions per
# sequence; packed rows of up to S = 4 sequences and Pp = 9 predictions.
_LOSS_L, _LOSS_P, _LOSS_S, _LOSS_PP = 24, 3, 4, 9
_LOSS_CLS, _LOSS_SEP, _LOSS_MASK = 1, 2, 3
# Weights drawn 5x wider than BERT's 0.02: at 0.02 the fresh model attends almost uniformly and its
# loss hardly depends on context (attention leaking across packed sequences moved the MLM loss by
# 1.6e-5 only; at 0.1 by 4e-3).
_LOSS_CONFIG = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, initializer_range=0.1, dtype="float32")


def _loss_record(rid: int, n: int) -> dict:
    """Sequence `rid`: `[CLS] a.. [SEP] b.. [SEP]`, n tokens of ids 5..99, 1 to 3 of them masked."""
    rng = np.random.default_rng(100 + rid)
    ids = np.zeros(_LOSS_L, np.int64)
    ids[:n] = rng.integers(5, 100, n)
    sep_a = n // 2
    ids[0], ids[sep_a], ids[n - 1] = _LOSS_CLS, _LOSS_SEP, _LOSS_SEP
    segment = np.zeros(_LOSS_L, np.int64)
    segment[sep_a + 1:n] = 1
    k = min(_LOSS_P, max(1, (n - 3) // 2))
    positions = np.sort(rng.choice([i for i in range(1, n - 1) if i != sep_a], k, replace=False))
    record = {
        "input_ids": ids.copy(), "input_mask": (np.arange(_LOSS_L) < n).astype(np.int64),
        "segment_ids": segment,
        "masked_lm_positions": np.zeros(_LOSS_P, np.int64),
        "masked_lm_ids": np.zeros(_LOSS_P, np.int64),
        "masked_lm_weights": np.zeros(_LOSS_P, np.float32),
        "next_sentence_labels": np.array([rid % 3 == 0], np.int64),  # 1, 0, 0, 1, 0, 0
    }
    record["masked_lm_positions"][:k] = positions
    record["masked_lm_ids"][:k] = ids[positions]
    record["masked_lm_weights"][:k] = 1.0
    record["input_ids"][positions] = _LOSS_MASK
    return record


def _gradient_catcher():
    """An "optimizer" whose state after a step is that step's gradient (its updates are zero):
    `train_step` itself then hands back the gradient it computed, bit for bit."""
    import jax
    import jax.numpy as jnp
    import optax

    return optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


@pytest.fixture(scope="module")
def unrolled_loss_params():
    """The pretraining model's parameters for `_LOSS_CONFIG`, unrolled layers (initialized once:
    the scanned cases stack the same ones)."""
    import flax.linen as nn
    import jax
    from bert_jax.model import model_config, modeling, pretraining_heads

    cfg = model_config.BertConfig(**_LOSS_CONFIG)
    return nn.meta.unbox(jax.jit(pretraining_heads.BertForPreTraining(cfg).init)(
        jax.random.key(0), **modeling.dummy_inputs(cfg, batch=1, length=8, predictions=1)))["params"]


# `sparse_last_layer` is ignored with `scan_layers` (`BertConfig`; the test checks that the scanned
# encoder then runs every position): three cases cover the three code paths.
@pytest.mark.parametrize("scan_layers,sparse_last_layer", [(False, False), (False, True), (True, True)],
                         ids=["unrolled", "unrolled-sparse", "scanned"])
def test_packed_batch_trains_like_separate_sequences(unrolled_loss_params, scan_layers,
                                                     sparse_last_layer):
    """`train_step` on a packed batch gives the loss and the gradients of the same sequences as
    ordinary rows: block-diagonal attention, restarted positions, one NSP prediction per [CLS].

    The losses are comparable as they stand: `train_step` normalizes MLM by the batch's total
    prediction weight and NSP by its total sequence weight (Google's means over predictions and
    over sequences), not per row, so 12 predictions and 6 sequences count the same whether they
    sit in 6 rows or in 2.
    """
    import functools

    import jax
    from bert_jax.model import model_config, modeling, pretraining_heads
    from bert_jax.pretrain import steps
    from bert_jax.training import train_state

    cfg = model_config.BertConfig(**_LOSS_CONFIG, scan_layers=scan_layers,
                              sparse_last_layer=sparse_last_layer)
    # 6 sequences of 5..10 tokens, 12 predictions; packed (first-fit decreasing) into 2 rows of 3
    # sequences, 8 + 7 + 6 and 10 + 9 + 5 tokens, each row with an empty 4th slot (weight 0).
    records = [_loss_record(rid, n) for rid, n in enumerate([7, 10, 5, 9, 6, 8])]
    unpacked = {k: v.numpy() for k, v in _stack(records).items()}  # [6, L]: the pipeline's rows
    unpacked["next_sentence_weights"] = np.ones(len(records), np.float32)
    packed = {k: v.numpy() for k, v in ip.pack_window(
        _stack(records), max_seq_length=_LOSS_L, max_seqs_per_pack=_LOSS_S,
        max_predictions_per_pack=_LOSS_PP).items()}
    assert packed["input_ids"].shape == (2, _LOSS_L)
    assert packed["input_mask"].sum(1).tolist() == [21, 24]  # rows in order of their first record
    assert packed["next_sentence_weights"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    assert packed["masked_lm_weights"].sum() == unpacked["masked_lm_weights"].sum() == 12
    # The last layer runs as configured: at the [CLS] and masked positions only, or everywhere.
    queries = [modeling.last_layer_queries(cfg, _LOSS_L, _LOSS_P, 1),
               modeling.last_layer_queries(cfg, _LOSS_L, _LOSS_PP, _LOSS_S)]
    assert queries == ([1 + _LOSS_P, _LOSS_S + _LOSS_PP] if sparse_last_layer and not scan_layers
                       else [None, None])

    params = unrolled_loss_params
    if scan_layers:
        params = modeling.stack_layers(params, cfg.num_hidden_layers)
    tx = _gradient_catcher()
    state = train_state.create_train_state(params, tx, jax.random.key(1))
    step = functools.partial(steps.train_step, model=pretraining_heads.BertForPreTraining(cfg), tx=tx,
                             schedule=lambda s: 0.0)
    # Both steps from the same state, in one program (one compilation: ~15% less CPU time).
    (s_unpacked, m_unpacked), (s_packed, m_packed) = jax.jit(
        lambda state, a, b: (step(state, a), step(state, b)))(state, unpacked, packed)
    assert m_unpacked["finite"] == m_packed["finite"] == 1
    assert m_unpacked["mlm_weight"] == m_packed["mlm_weight"] == 12
    assert m_unpacked["nsp_weight"] == m_packed["nsp_weight"] == 6

    # Measured on CPU (float32, all three cases): the MLM losses (4.80) differ by up to 3.2e-7, the
    # NSP losses (0.66) by 0, the totals by 4.8e-7; the gradients by up to 1.4e-7 (the largest is
    # 0.60), a tenth of their tolerance at most. Attention leaking across the packed sequences
    # moves the MLM loss by 4e-3 and a gradient by 2e-2.
    unpacked_loss, packed_loss = steps.summarize(m_unpacked), steps.summarize(m_packed)
    for name in ("masked_lm_loss", "next_sentence_loss"):
        np.testing.assert_allclose(packed_loss[name], unpacked_loss[name], rtol=1e-6, atol=1e-6,
                                   err_msg=name)
    np.testing.assert_allclose(m_packed["loss"], m_unpacked["loss"], rtol=1e-6, atol=1e-6)
    grads_unpacked, grads_packed = s_unpacked.opt_state, s_packed.opt_state
    assert jax.tree.structure(grads_packed) == jax.tree.structure(grads_unpacked)
    leaves = jax.tree_util.tree_leaves_with_path(grads_unpacked)
    assert len(leaves) == (30 if scan_layers else 46)  # every parameter
    for (path, want), got in zip(leaves, jax.tree.leaves(grads_packed)):
        assert np.any(np.asarray(want) != 0), jax.tree_util.keystr(path)  # a real gradient
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_nsp_labels_and_weights_of_packed_and_unpacked_batches():
    """One NSP label per sequence: Google's `[B, 1]` squeezed to `[B]` for ordinary rows; a packed
    row's `[S]` slots kept as they are (even S = 1) with the packer's weights, 0 for empty slots."""
    import jax.numpy as jnp
    from bert_jax.pretrain import steps

    def check(batch, labels, weights):
        got_labels, got_weights = steps.nsp_labels_and_weights(
            {k: jnp.asarray(v) for k, v in batch.items()})
        assert got_labels.tolist() == labels
        assert got_weights.dtype == jnp.float32 and got_weights.tolist() == weights

    # What the packer makes of `[CLS] a [SEP]` (label 0) and `[CLS] b c [SEP]` (label 1) in a row
    # of 3 slots: the longer first, the third slot empty (test_pack_window_by_hand).
    def rec(tokens, label):
        pad = [0] * (8 - len(tokens))
        return {"input_ids": np.array(tokens + pad), "input_mask": np.array([1] * len(tokens) + pad),
                "segment_ids": np.zeros(8, int), "masked_lm_positions": np.array([1, 0]),
                "masked_lm_ids": np.array([77, 0]), "masked_lm_weights": np.array([1.0, 0.0]),
                "next_sentence_labels": np.array([label])}
    packed = {k: v.numpy() for k, v in ip.pack_window(
        _stack([rec([CLS, 5, SEP], 0), rec([CLS, 6, 7, SEP], 1)]), max_seq_length=8,
        max_seqs_per_pack=3, max_predictions_per_pack=4).items()}
    check(packed, [[1, 0, 0]], [[1.0, 1.0, 0.0]])
    # Two packed rows by hand, the second full.
    two_rows = {"next_sentence_labels": [[1, 0, 0], [0, 1, 1]],
                "next_sentence_weights": [[1, 1, 0], [1, 1, 1]],
                "pack_ids": [[1, 1, 2, 2, 0], [1, 2, 2, 3, 3]]}
    check(two_rows, [[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [1, 1, 1]])
    # One sequence per packed row: `[R, 1]` stays `[R, 1]`, like the model's `[R, 1, 2]` NSP logits.
    check({"next_sentence_labels": [[1], [0]], "next_sentence_weights": [[1], [1]],
           "pack_ids": [[1, 1, 0], [1, 1, 1]]}, [[1], [0]], [[1], [1]])
    # Ordinary rows: Google's `[B, 1]` labels, weights 1 when absent, 0 on eval padding rows.
    check({"next_sentence_labels": [[1], [0], [1]]}, [1, 0, 1], [1, 1, 1])
    check({"next_sentence_labels": [[1], [0], [0]], "next_sentence_weights": [1, 1, 0]},
          [1, 0, 0], [1, 1, 0])

# ---------------------------------------------------------------------------------------------
# Corrupt data: the manifest check before training, and lenient skipping
# ---------------------------------------------------------------------------------------------


def _damage(path: str, kind: str) -> None:
    data = bytearray(Path(path).read_bytes())
    first = 12 + int.from_bytes(data[:8], "little") + 4  # bytes of the first record
    if kind == "bit_flip":  # in the payload of the second record
        data[first + 12 + 20] ^= 0x10
    elif kind == "truncated_header":  # cut 5 bytes into the last record's header
        data = data[:_record_offsets(data)[-1] + 5]
    elif kind == "truncated_payload":  # cut inside the last record's payload
        data = data[:_record_offsets(data)[-1] + 30]
    elif kind == "garbage":
        data = bytearray(np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8).tobytes())
    elif kind == "empty":
        data = bytearray()
    elif kind == "header_flip":  # the length field of the second record
        data[first + 2] ^= 0x01
    if kind == "missing":
        os.remove(path)
    else:
        Path(path).write_bytes(bytes(data))


def _record_offsets(data: bytes) -> list[int]:
    offsets, offset = [], 0
    while offset < len(data):
        offsets.append(offset)
        offset += 16 + int.from_bytes(data[offset:offset + 8], "little")
    return offsets


# kind -> records of the damaged 6-record file that lenient mode can still read
DAMAGE = {"bit_flip": 5, "truncated_header": 5, "truncated_payload": 5, "garbage": 0, "empty": 0,
          "missing": 0, "header_flip": 5}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_file_is_caught_before_training_naming_it(tmp_path, kind):
    paths = write_dataset(tmp_path, [4, 6, 5])
    _damage(paths[1], kind)
    with pytest.raises(ip.CorruptDataError) as info:
        make_input(str(tmp_path / "part-*.tfrecord"))
    assert info.value.path == paths[1] and paths[1] in str(info.value)
    assert "skip_corrupt" in str(info.value)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_lenient_mode_skips_exactly_the_bad_records_and_counts_them(tmp_path, kind, monkeypatch):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    paths = write_dataset(tmp_path / "data", [4, 6, 5])
    good_left = DAMAGE[kind]
    _damage(paths[1], kind)
    ds = make_input(str(tmp_path / "data" / "part-*.tfrecord"), skip_corrupt=True, repeat=False,
                    per_host_batch_size=1)
    assert ds.stats["skipped_records"] == 6 - good_left
    assert ds.stats["records_per_epoch"] == 15 - (6 - good_left)
    assert ds.stats["corrupt_files"] == [paths[1]]
    seen = sorted(rid for batch in ds for rid in record_ids(batch))
    lost = {"bit_flip": {5}, "truncated_header": {9}, "truncated_payload": {9},
            "header_flip": {5}}.get(kind, set(range(4, 10)))  # file 1 holds records 4..9
    assert seen == sorted(set(range(15)) - lost)
    # The good records are read in place: no repaired copy anywhere (issue 31).
    # (TensorFlow's autograph may leave its own `__autograph_generated_file*.py` there.)
    ours = [p for p in temp.iterdir() if not p.name.startswith("__autograph_generated_file")]
    assert ours == [] and sorted(os.listdir(tmp_path / "data")) == sorted(
        [os.path.basename(p) for p in paths if os.path.exists(p)] + [schema.run_manifest_name(paths)])


def test_lenient_mode_reads_the_good_records_byte_for_byte_in_runs(tmp_path, monkeypatch):
    # Several damaged stretches, runs cut at a small chunk size: the exact records, in file order.
    monkeypatch.setattr(records_module, "_CHUNK_BYTES", 600)
    paths = write_dataset(tmp_path, [12])
    data = bytearray(Path(paths[0]).read_bytes())
    offsets = _record_offsets(bytes(data))
    for r in (0, 4, 5, 9):  # flip a payload byte of records 0, 4, 5, 9
        data[offsets[r] + 12 + 20] ^= 0x10
    Path(paths[0]).write_bytes(bytes(data))
    good = [bytes(data[o + 12:o + 12 + int.from_bytes(data[o:o + 8], "little")])
            for i, o in enumerate(offsets) if i not in (0, 4, 5, 9)]
    files = records_module.check_files(paths[0], process_index=0, process_count=1, verify=True,
                                       skip_corrupt=True, require_files_per_host=True)
    units, read = records_module.file_datasets(files)
    assert [r.numpy() for r in units.flat_map(read)] == good
    assert len(records_module._good_chunks(files.good_records[paths[0]])) > 3  # really read in several runs


def test_unverified_corruption_raises_while_reading_naming_the_file(tmp_path):
    paths = write_dataset(tmp_path, [4, 6])
    _damage(paths[1], "bit_flip")
    ds = make_input(str(tmp_path / "part-*.tfrecord"), verify=False, shuffle_buffer_size=1)
    with pytest.raises(ip.CorruptDataError, match="part-00001"):
        for _ in range(10):
            next(ds)


def test_a_missing_manifest_or_an_unlisted_file_is_an_error(tmp_path):
    paths = write_dataset(tmp_path, [3, 3])
    Path(tmp_path / "part-00009.tfrecord").write_bytes(Path(paths[0]).read_bytes())
    with pytest.raises(ip.CorruptDataError, match="part-00009.*not listed"):
        make_input(str(tmp_path / "part-*.tfrecord"))
    os.remove(tmp_path / schema.run_manifest_name(paths))
    with pytest.raises(ip.CorruptDataError, match="verify=False"):
        make_input(str(tmp_path / "part-*.tfrecord"))
    assert make_input(str(tmp_path / "part-*.tfrecord"), verify=False).stats["records_in_files"] == 9


def test_wrong_max_seq_length_names_the_flag(dataset):
    with pytest.raises(ValueError, match="max_seq_length=64"):
        next(make_input(dataset[0], max_seq_length=64))


# ---------------------------------------------------------------------------------------------
# Eval
# ---------------------------------------------------------------------------------------------


def test_eval_is_one_padded_pass_with_equal_batch_counts(dataset):
    pattern, total = dataset
    hosts, b = 3, 4
    lengths, seen = [], []
    for h in range(hosts):
        ev = ip.make_eval_iterator(pattern, per_host_batch_size=b, max_seq_length=L,
                                   max_predictions_per_seq=P, process_index=h, process_count=hosts)
        batches = list(ev)
        assert list(ev) and len(list(ev)) == len(batches)  # each iter() is a fresh pass
        lengths.append(len(batches))
        for batch in batches:
            assert batch["input_ids"].shape == (b, L) and batch["next_sentence_labels"].shape == (b, 1)
            pad = batch["next_sentence_weights"] == 0
            assert np.all(batch["masked_lm_weights"][pad] == 0) and np.all(batch["input_mask"][pad] == 0)
            seen += record_ids(batch)
    # Hosts hold 18, 21, 13 records: ceil(21 / 4) = 6 batches each.
    assert lengths == [6, 6, 6]
    assert sorted(seen) == list(range(total))


def test_lenient_eval_keeps_hosts_in_step_and_counts_the_loss(tmp_path):
    paths = write_dataset(tmp_path, [5, 6, 4])  # hosts: files 0, 2 (9 records) and file 1 (6)
    _damage(paths[1], "bit_flip")  # record 6 of file 1 is lost
    lengths, seen = [], []
    for h in range(2):
        ev = ip.make_eval_iterator(str(tmp_path / "part-*.tfrecord"), per_host_batch_size=4,
                                   max_seq_length=L, max_predictions_per_seq=P, process_index=h,
                                   process_count=2, skip_corrupt=True)
        batches = list(ev)
        lengths.append(len(batches))
        assert ev.stats["skipped_records"] == (1 if h == 1 else 0)
        seen += [rid for b in batches for rid in record_ids(b)]
    assert lengths == [3, 3]  # ceil(9 / 4), on both hosts
    assert sorted(seen) == sorted(set(range(15)) - {6})
