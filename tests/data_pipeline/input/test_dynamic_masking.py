"""Dynamic masking in the input pipeline (data_pipeline.input.masking): Google's 80/10/10 rules and rates,
hand cases, a new mask each epoch over the same tokens, packed rows masked sequence by sequence,
and whole-word masking (the records' setting unless told otherwise, Google's distribution, the
subword table from a vocab file).

The test records and their helpers are tests/helpers/numbered_records.py's.
"""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from data_pipeline.input import masking, packing
from data_pipeline.records import manifests
from tests.helpers.numbered_records import (CLS, L, MASK, P, PAD, SEP, SPECIAL, VOCAB, make_input, make_record,
                                            originals, record_ids, stack_records, write_dataset)


def test_restore_original_ids_by_hand():
    features = {"input_ids": tf.constant([[CLS, MASK, 7, MASK, SEP]]),
                "masked_lm_positions": tf.constant([[1, 3, 0]]),
                "masked_lm_ids": tf.constant([[5, 9, 0]]),
                "masked_lm_weights": tf.constant([[1.0, 1.0, 0.0]])}
    assert masking.restore_original_ids(features).numpy().tolist() == [[CLS, 5, 7, 9, SEP]]


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
    out = {k: v.numpy() for k, v in masking.dynamic_mask(
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
    again = masking.dynamic_mask(features, tf.constant([1, 2]), special_ids=SPECIAL,
                            max_predictions_per_seq=preds)
    other = masking.dynamic_mask(features, tf.constant([1, 3]), special_ids=SPECIAL,
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
    out = masking.dynamic_mask(features, tf.constant([0, 0]), special_ids=SPECIAL, max_predictions_per_seq=4)
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
    features = stack_records(records)
    budget = masking.dynamic_predictions_per_sequence(features, special_ids=SPECIAL,
                                                 max_predictions_per_seq=P)
    packed = packing.pack_window(features, max_seq_length=L, max_seqs_per_pack=3,
                            max_predictions_per_pack=width, prediction_budget=budget)
    out = {k: v.numpy() for k, v in masking.dynamic_mask(
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

    from data_pipeline.pretraining_data import instances

    n_rows, length, preds = 3000, 64, 10
    ids, mask = _word_rows(n_rows, length, np.random.default_rng(0))
    out = {k: v.numpy() for k, v in masking.dynamic_mask(
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
    # (data_pipeline.pretraining_data.instances, Google's code path): the same share of words masked, by length.
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
    token_level = masking.dynamic_mask(_blank_features(ids, mask, preds), tf.constant([3, 4]),
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
    out = masking.dynamic_mask(_blank_features(ids, mask, 6), tf.constant([7, 7]), special_ids=SPECIAL,
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
    features = stack_records(records)
    budget = masking.dynamic_predictions_per_sequence(features, special_ids=SPECIAL, max_predictions_per_seq=P)
    packed = packing.pack_window(features, max_seq_length=L, max_seqs_per_pack=3,
                            max_predictions_per_pack=3 * P, prediction_budget=budget)
    out = {k: v.numpy() for k, v in masking.dynamic_mask(
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
    manifests.write_dataset_info(str(directory), {p: 6 for p in paths}, info)
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
    assert masking.subword_table(str(vocab)).tolist() == [False, False, False, True, True, False]
