"""Dynamic masking: re-drawing the masked-LM positions of a batch, token by token or whole words.

The second step of the training input (`records.reader` -> **masking** -> `packing` ->
`pretraining`): `dynamic_mask` restores the original tokens of parsed records (or packed rows)
from `masked_lm_positions`/`masked_lm_ids` and masks them again with the reference's rules, in
tf graph code with stateless random ops (the caller passes the seed); `subword_table` gives the
`##`-piece table whole-word masking needs, `recorded_whole_word_mask` what the records were made
with.

Masking rules (google-research/bert `create_pretraining_data.py`):
the number of predictions is `min(max_predictions_per_seq, max(1, round(num_tokens * 0.15)))`,
where `num_tokens` counts the *real* tokens including [CLS] and [SEP] (as the reference's
`len(tokens)` does; `round` is half-to-even in both), further capped by the number of candidates;
candidates are the real tokens other than [CLS], [SEP] and [PAD]; each chosen position becomes
[MASK] with probability 0.8, else keeps its token with probability 0.5, else becomes an id drawn
uniformly from `[0, vocab_size)` (`data_pipeline/masking_rule.py`, the rule all three maskers share). Positions are sorted ascending and padded with position 0,
id 0, weight 0. With whole-word masking (`whole_word_mask`, by default as the records were made:
`--do_whole_word_mask` in their manifests) the candidates are words instead, as in the
reference: a word is a token and the `##` pieces after it (a boolean table over the vocabulary,
`subword_table`), words are taken in random order while they fit the count (one that would
overflow it is skipped, not split), and the 80/10/10 draw is made for each token.

Records made with Chinese whole-word masking (`--chinese_whole_word_mask`: words from a word
segmenter, their characters single tokens with no `##`) cannot be re-masked by whole words here:
the records do not carry the segmenter's words, and the `##` table would mask single characters.
`resolve_whole_word_mask` refuses that combination, naming `config.dynamic_whole_word_mask`.

This module imports neither jax nor bert_jax.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional, Union

import numpy as np
from data_pipeline.tf_import import tf  # without Keras (data_pipeline/tf_import.py)

from data_pipeline import masking_rule
from data_pipeline.records.reader import FilePatterns, dataset_info
from data_pipeline.storage import split_patterns

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """Token ids dynamic masking needs (read from vocab.txt by the caller)."""

    mask_id: int
    cls_id: int
    sep_id: int
    vocab_size: int
    pad_id: int = 0

    @classmethod
    def from_any(cls, value: Union["SpecialIds", Mapping[str, int]]) -> "SpecialIds":
        if isinstance(value, SpecialIds):
            return value
        keys = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - keys
        missing = {"mask_id", "cls_id", "sep_id", "vocab_size"} - set(value)
        if unknown or missing:
            raise ValueError(f"special_ids: unknown keys {sorted(unknown)}, missing keys "
                             f"{sorted(missing)}; expected {sorted(keys)}")
        return cls(**{k: int(v) for k, v in value.items()})


def _row_index(x: tf.Tensor) -> tf.Tensor:
    n, m = tf.shape(x)[0], tf.shape(x)[1]
    return tf.broadcast_to(tf.range(n)[:, None], [n, m])  # [N, M]


def restore_original_ids(features: Mapping[str, tf.Tensor]) -> tf.Tensor:
    """`[N, L]` input_ids with every real masked position set back to its original token."""
    ids = features["input_ids"]
    valid = features["masked_lm_weights"] > 0  # [N, P]
    idx = tf.stack([_row_index(valid), features["masked_lm_positions"]], -1)  # [N, P, 2]
    return tf.tensor_scatter_nd_update(ids, tf.boolean_mask(idx, valid),
                                       tf.boolean_mask(features["masked_lm_ids"], valid))


def _num_predictions(num_real: tf.Tensor, num_candidates: tf.Tensor, max_predictions_per_seq: int,
                     masked_lm_prob: float) -> tf.Tensor:
    """The reference's `min(P, max(1, round(len(tokens) * prob)))`, capped by the candidates.

    `tf.round` rounds half to even like Python's `round`; float64 keeps `n * 0.15` identical.
    """
    wanted = tf.round(tf.cast(num_real, tf.float64) * masked_lm_prob)
    wanted = tf.maximum(tf.cast(wanted, tf.int32), 1)
    count = tf.minimum(tf.minimum(wanted, max_predictions_per_seq), num_candidates)
    return tf.where(num_real > 0, count, 0)


def _mask_candidates(original: tf.Tensor, real: tf.Tensor, sp: SpecialIds) -> tf.Tensor:
    return (real & tf.not_equal(original, sp.cls_id) & tf.not_equal(original, sp.sep_id)
            & tf.not_equal(original, sp.pad_id))


def dynamic_predictions_per_sequence(features: Mapping[str, tf.Tensor], *,
                                     special_ids: Union[SpecialIds, Mapping[str, int]],
                                     max_predictions_per_seq: int,
                                     masked_lm_prob: float = 0.15) -> tf.Tensor:
    """`[N]` number of predictions `dynamic_mask` will make for each unpacked record."""
    sp = SpecialIds.from_any(special_ids)
    original = restore_original_ids(features)
    real = features["input_mask"] > 0
    num_real = tf.reduce_sum(tf.cast(real, tf.int32), 1)
    num_candidates = tf.reduce_sum(tf.cast(_mask_candidates(original, real, sp), tf.int32), 1)
    return _num_predictions(num_real, num_candidates, max_predictions_per_seq, masked_lm_prob)


def subword_table(vocab_file: str) -> np.ndarray:
    """`[vocab_size]` bool, True where the token is a WordPiece continuation (`##...`).

    Whole-word masking groups a word's pieces with it: a token whose id is True here belongs to
    the word before it (google-research/bert's `token.startswith("##")`).
    """
    from data_pipeline import tokenization  # data_pipeline's own loader (Google's rules)
    vocab = tokenization.load_vocab(vocab_file)
    table = np.zeros(max(vocab.values()) + 1 if vocab else 0, bool)
    for token, index in vocab.items():
        table[index] = token.startswith("##")
    return table


def recorded_whole_word_mask(file_patterns: FilePatterns) -> Optional[bool]:
    """`do_whole_word_mask` the records were made with, per the manifests of each pattern's records
    (`records.dataset_info`); None when none records it. Raises when the patterns' data disagree."""
    found = {}
    for pattern in split_patterns(file_patterns):
        value = dataset_info(pattern).get("flags", {}).get("do_whole_word_mask")
        if isinstance(value, bool):
            found[pattern] = value
    if len(set(found.values())) > 1:
        raise ValueError(f"the input patterns' data disagree on do_whole_word_mask ({found}): set "
                         "whole_word_mask (config.dynamic_whole_word_mask) explicitly")
    return next(iter(found.values()), None)


def recorded_chinese_whole_word_mask(file_patterns: FilePatterns) -> list:
    """The patterns whose records' manifests say they were made with
    `--chinese_whole_word_mask` (words from a segmenter, which the records do not carry)."""
    return [pattern for pattern in split_patterns(file_patterns)
            if dataset_info(pattern).get("flags", {}).get("chinese_whole_word_mask") is True]


def resolve_whole_word_mask(file_patterns: FilePatterns, dynamic_masking: bool,
                            asked: Optional[bool]) -> bool:
    """Whether dynamic masking masks whole words: as asked, else as the records were made.

    Raises:
      ValueError: whole words asked (or recorded, and not overridden) for records made with
        `--chinese_whole_word_mask`, whose words dynamic masking cannot know.
    """
    if not dynamic_masking:
        if asked:
            raise ValueError("whole_word_mask=True needs dynamic_masking=True (without it the "
                             "records' own masks are used, as they were written)")
        return False
    chinese = recorded_chinese_whole_word_mask(file_patterns)
    if chinese and asked is not False:
        raise ValueError(
            f"the records of {chinese[0]} were made with --chinese_whole_word_mask: their whole words are a "
            "segmenter's Chinese words, which the records do not carry, so dynamic masking cannot re-draw them "
            "(its whole words are ## pieces: it would mask single characters). Set "
            "config.dynamic_whole_word_mask=False (PretrainingInput(whole_word_mask=False)) to re-mask "
            "character by character, or config.dynamic_masking=False to train on the records' own "
            "whole-word masks")
    recorded = recorded_whole_word_mask(file_patterns)
    if asked is None:
        if recorded:
            log.info("the records were made with do_whole_word_mask=True: dynamic masking "
                     "masks whole words too (whole_word_mask=False to mask token by token)")
        return bool(recorded)
    if recorded is not None and recorded != asked:
        log.warning("dynamic masking with whole_word_mask=%s although the records were made "
                    "with do_whole_word_mask=%s", asked, recorded)
    return bool(asked)


def _whole_word_choice(original: tf.Tensor, group: tf.Tensor, candidate: tf.Tensor,
                       num_pred: tf.Tensor, num_groups: int, subword: tf.Tensor, seed: tf.Tensor,
                       max_steps: int) -> tf.Tensor:
    """`[N, L]` bool: the tokens whole-word masking picks, Google's `do_whole_word_mask` rules.

    A word is a candidate that is not a `##` piece (or the first candidate of its sequence)
    followed by the `##` candidates after it; as in the reference, a `##` piece right after a
    [SEP] joins the last word before that [SEP]. Words are taken in a uniformly random order
    while they fit the sequence's `num_pred` tokens; a word that would overflow is skipped, not
    split. That greedy pass is run as "take the first word in the order that still fits", once
    per taken word (at most `max_steps` rounds: every word takes at least one token); the words
    it takes are those of the pass, in the same order.
    """
    shape = tf.shape(original)
    n, length = shape[0], shape[1]
    pos = tf.broadcast_to(tf.range(length)[None, :], shape)  # [N, L]
    ids = tf.clip_by_value(original, 0, tf.size(subword) - 1)
    piece = tf.gather(subword, ids) & candidate  # [N, L] a `##` continuation
    before = tf.cumsum(tf.cast(candidate, tf.int32), axis=1, exclusive=True)  # [N, L]
    cand_order = tf.argsort(tf.where(candidate, pos, length + pos), axis=1, stable=True)  # [N, L]
    prev = tf.gather(cand_order, tf.maximum(before - 1, 0), batch_dims=1)  # previous candidate
    same_seq = (before > 0) & tf.equal(tf.gather(group, prev, batch_dims=1), group)
    start = candidate & ~(piece & same_seq)  # [N, L] first piece of a word
    word = tf.cumsum(tf.cast(start, tf.int32), axis=1)  # [N, L] 1-based word number
    start_order = tf.argsort(tf.where(start, pos, length + pos), axis=1, stable=True)  # [N, L]
    word_start = tf.where(candidate, tf.gather(start_order, tf.maximum(word - 1, 0), batch_dims=1),
                          pos)  # [N, L] the position of each candidate's word start
    rows = tf.broadcast_to(tf.range(n)[:, None], shape)  # [N, L]
    word_len = tf.reshape(tf.math.unsorted_segment_sum(
        tf.reshape(tf.cast(candidate, tf.int32), [-1]), tf.reshape(rows * length + word_start, [-1]),
        n * length), shape)  # [N, L] pieces of the word starting here (0 elsewhere)
    # A uniformly random order of the words: unique ranks, word starts first.
    score = tf.where(start, tf.random.stateless_uniform(shape, seed), 2.0)  # [N, L]
    rank = tf.argsort(tf.argsort(score, axis=1, stable=True), axis=1)  # [N, L]
    segment = tf.reshape(rows * (num_groups + 1) + group, [-1])  # [N * L] (row, sequence)
    num_segments = n * (num_groups + 1)

    def per_sequence(x, reduce):  # [N, L] -> [N, G+1]
        return tf.reshape(reduce(tf.reshape(x, [-1]), segment, num_segments), [n, num_groups + 1])

    def step(k, taken, remaining, progressed):
        room = tf.gather(remaining, group, batch_dims=1)  # [N, L]
        eligible = start & ~taken & (word_len <= room)
        best = per_sequence(tf.where(eligible, rank, length), tf.math.unsorted_segment_min)
        pick = eligible & tf.equal(rank, tf.gather(best, group, batch_dims=1))  # [N, L]
        used = per_sequence(tf.where(pick, word_len, 0), tf.math.unsorted_segment_sum)
        return k + 1, taken | pick, remaining - used, tf.reduce_any(pick)

    _, taken, _, _ = tf.while_loop(
        lambda k, taken, remaining, progressed: (k < max_steps) & progressed, step,
        (0, tf.zeros_like(start), num_pred, tf.constant(True)))
    return candidate & tf.gather(taken, word_start, batch_dims=1)


def dynamic_mask(features: Mapping[str, tf.Tensor], seed: tf.Tensor, *,
                 special_ids: Union[SpecialIds, Mapping[str, int]], max_predictions_per_seq: int,
                 masked_lm_prob: float = 0.15, subword: Optional[Any] = None) -> dict:
    """Re-masks a batch of rows with the reference's rules (see module docstring).

    Works on unpacked rows and on packed rows (with `pack_ids`): each packed sequence is masked
    as if it were alone, with its own count and its own `max_predictions_per_seq` cap.

    Args:
      features: `[N, ...]` parsed records or packed rows (`input_ids`, `input_mask`,
        `masked_lm_*`, and `pack_ids` + `cls_positions` when packed).
      seed: `[2]` int seed of the stateless random ops; same seed, same masks.
      special_ids: the [MASK]/[CLS]/[SEP]/[PAD] ids and the vocabulary size.
      max_predictions_per_seq: P, the per-sequence cap.
      masked_lm_prob: fraction of the real tokens to predict.
      subword: `[vocab_size]` bool (`subword_table(vocab.txt)`): given, whole words are masked
        (Google's `--do_whole_word_mask`: a word's `##` pieces with it, words that would
        overflow the count skipped); None masks token by token.

    Returns:
      `features` with new `input_ids`, `masked_lm_positions`, `masked_lm_ids`,
      `masked_lm_weights` (same widths as given; positions ascending, padded with 0).

    Example: a row `[CLS] a b c d e f g h i j k l [SEP] [PAD]...` has 14 real tokens, so
    `round(14 * 0.15) = 2` of `a..l` are chosen; each becomes [MASK] (80%), stays (10%) or
    becomes a random id (10%).
    """
    sp = SpecialIds.from_any(special_ids)
    original = restore_original_ids(features)  # [N, L]
    shape = tf.shape(original)
    length = shape[1]
    width = features["masked_lm_positions"].shape[1]  # P, or the packed width
    if "pack_ids" in features:
        group = features["pack_ids"]  # [N, L] 1..S, 0 = padding
        num_groups = features["cls_positions"].shape[1]
    else:
        group = tf.cast(features["input_mask"] > 0, tf.int32)
        num_groups = 1
    real = group > 0
    candidate = _mask_candidates(original, real, sp)  # [N, L]
    onehot = tf.cast(group[:, :, None] == tf.range(num_groups + 1)[None, None, :], tf.int32)  # [N, L, G+1]
    group_size = tf.reduce_sum(onehot, 1)  # [N, G+1], column 0 = padding
    group_candidates = tf.reduce_sum(onehot * tf.cast(candidate, tf.int32)[:, :, None], 1)
    num_pred = _num_predictions(group_size, group_candidates, max_predictions_per_seq,
                                masked_lm_prob)  # [N, G+1]
    num_pred = tf.concat([tf.zeros_like(num_pred[:, :1]), num_pred[:, 1:]], 1)  # padding: none

    seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 4)
    positions_axis = tf.range(length)[None, :]  # [1, L]
    if subword is not None:
        table = tf.convert_to_tensor(np.asarray(subword, bool)) if not tf.is_tensor(subword) else subword
        chosen_tokens = _whole_word_choice(original, group, candidate, num_pred, num_groups, table,
                                           seeds[0], max_predictions_per_seq)  # [N, L]
        picked = tf.where(chosen_tokens, positions_axis, length)
    elif num_groups == 1:
        # One sequence per row: the `num_pred` lowest uniform scores among the candidates.
        score = tf.where(candidate, tf.random.stateless_uniform(shape, seeds[0]), 2.0)  # [N, L]
        _, lowest = tf.math.top_k(-score, k=min(width, original.shape[1] or width))  # [N, k]
        take = tf.range(tf.shape(lowest)[1])[None, :] < num_pred[:, 1:2]  # [N, k]
        picked = tf.where(take, lowest, length)
    else:
        # Sort tokens by (sequence, score), candidates before the rest of their sequence:
        # within each sequence the candidates come out in a uniformly random order.
        score = tf.random.stateless_uniform(shape, seeds[0], dtype=tf.float64)  # [N, L]
        key = tf.cast(group, tf.float64) + tf.where(candidate, 0.5 * score, 0.75)
        order = tf.argsort(key, axis=1, stable=True)  # [N, L]
        sorted_group = tf.gather(group, order, batch_dims=1)  # [N, L]
        starts = tf.cumsum(group_size, axis=1, exclusive=True)  # [N, G+1] first sorted index
        rank = positions_axis - tf.gather(starts, sorted_group, batch_dims=1)  # [N, L]
        take = rank < tf.gather(num_pred, sorted_group, batch_dims=1)  # [N, L] in sorted order
        picked = tf.where(take, order, length)  # the chosen token positions, else L

    # The chosen positions, ascending, padded with `length` then cut to the width.
    positions = tf.sort(picked, axis=1)
    positions = positions[:, :width]  # [N, W]
    if positions.shape[1] is not None and positions.shape[1] < width:  # fewer tokens than W
        positions = tf.pad(positions, [[0, 0], [0, width - positions.shape[1]]],
                           constant_values=length)
    chosen = positions < length
    positions = tf.where(chosen, positions, 0)
    labels = tf.where(chosen, tf.gather(original, positions, batch_dims=1), 0)  # [N, W]

    pshape = tf.shape(positions)
    r_mask = tf.random.stateless_uniform(pshape, seeds[1])
    r_keep = tf.random.stateless_uniform(pshape, seeds[2])
    random_ids = tf.random.stateless_uniform(pshape, seeds[3], minval=0, maxval=sp.vocab_size,
                                             dtype=tf.int32)
    replacement = masking_rule.replace(r_mask, r_keep, labels, random_ids, sp.mask_id, tf.where)
    idx = tf.stack([_row_index(positions), positions], -1)  # [N, W, 2]
    input_ids = tf.tensor_scatter_nd_update(original, tf.boolean_mask(idx, chosen),
                                            tf.boolean_mask(replacement, chosen))
    return dict(features, input_ids=input_ids, masked_lm_positions=positions,
                masked_lm_ids=labels, masked_lm_weights=tf.cast(chosen, tf.float32))

