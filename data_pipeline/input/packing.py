"""Sequence packing: several records per row of `max_seq_length` tokens, first-fit-decreasing.

The third step of the training input (`records.reader` -> `masking` -> **packing** ->
`pretraining`): `pack_window` packs a window of parsed records into rows, MLPerf-style, in
the graph (no `py_function`, so the iterator stays checkpointable; the per-record loop is
XLA-compiled when XLA is available). Records of different groups (the pipeline passes the epoch)
never share a row.

Packed rows (`R` rows, `L` = max_seq_length, `S` = max_seqs_per_pack, `Pp` =
max_predictions_per_pack):

    input_ids, input_mask, segment_ids     int32   [R, L]
    position_ids                           int32   [R, L]   restarts at 0 for each sequence
    pack_ids                               int32   [R, L]   1, 2, ... per sequence, 0 = padding
    cls_positions                          int32   [R, S]   [CLS] index of each sequence (0 = empty)
    next_sentence_labels                   int32   [R, S]
    next_sentence_weights                  float32 [R, S]   1 per sequence, 0 for empty slots
    masked_lm_positions, masked_lm_ids     int32   [R, Pp]  positions in the packed row
    masked_lm_weights                      float32 [R, Pp]

This module imports neither jax nor bert_jax.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional

from data_pipeline.tf_import import tf  # without Keras (data_pipeline/tf_import.py)

log = logging.getLogger(__name__)


def _first_fit_loop(lengths, num_preds, groups, max_seq_length, max_seqs_per_pack,
                    max_predictions_per_pack):
    """Bin, slot, token offset and prediction offset of each sequence (graph-mode loop).

    Sequences are taken longest first; each goes into the first open row of its group with room
    for its tokens, its predictions and one more sequence, else opens a new row. A sequence too
    long to share a row with even the window's shortest one gets a row of its own without
    entering the loop: with Google's data (~90% full-length sequences) that is most of them,
    and the loop (one small step per sequence) is the packer's cost.
    """
    w = tf.shape(lengths)[0]
    alone = (lengths + tf.reduce_min(lengths) > max_seq_length) | (max_seqs_per_pack == 1)
    num_loop = w - tf.reduce_sum(tf.cast(alone, tf.int32))
    # Longest first within each group (the group is the major key); the alone ones last.
    key = groups * (max_seq_length + 1) + (max_seq_length - lengths)
    order = tf.argsort(tf.where(alone, tf.reduce_max(key) + 1, key), stable=True)
    zeros = tf.zeros([w], tf.int32)

    def body(k, fill, count, preds, num_bins, bin_group, bin_of, off_of, slot_of, pred_off_of):
        # tf.gather, not x[i]: XLA wants strided-slice bounds as compile-time constants and would
        # recompile for every window.
        i = tf.gather(order, k)
        n, p, g = tf.gather(lengths, i), tf.gather(num_preds, i), tf.gather(groups, i)
        fits = ((fill + n <= max_seq_length) & (count < max_seqs_per_pack)
                & (preds + p <= max_predictions_per_pack) & (tf.range(w) < num_bins)
                & tf.equal(bin_group, g))
        found = tf.reduce_any(fits)
        b = tf.where(found, tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32), num_bins)
        at_i, at_b = [[i]], [[b]]
        bin_group = tf.tensor_scatter_nd_update(bin_group, at_b, [g])
        bin_of = tf.tensor_scatter_nd_update(bin_of, at_i, [b])
        off_of = tf.tensor_scatter_nd_update(off_of, at_i, [tf.gather(fill, b)])
        slot_of = tf.tensor_scatter_nd_update(slot_of, at_i, [tf.gather(count, b)])
        pred_off_of = tf.tensor_scatter_nd_update(pred_off_of, at_i, [tf.gather(preds, b)])
        fill = tf.tensor_scatter_nd_add(fill, at_b, [n])
        count = tf.tensor_scatter_nd_add(count, at_b, [1])
        preds = tf.tensor_scatter_nd_add(preds, at_b, [p])
        num_bins = num_bins + tf.cast(tf.logical_not(found), tf.int32)
        return k + 1, fill, count, preds, num_bins, bin_group, bin_of, off_of, slot_of, pred_off_of

    out = tf.while_loop(lambda k, *_: k < num_loop, body,
                        (0, zeros, zeros, zeros, 0, zeros, zeros, zeros, zeros, zeros))
    _, _, _, _, num_bins, _, bin_of, off_of, slot_of, pred_off_of = out
    # The alone ones: rows num_bins, num_bins + 1, ... at offset 0, slot 0.
    alone_rank = tf.cumsum(tf.cast(alone, tf.int32), exclusive=True)
    bin_of = tf.where(alone, num_bins + alone_rank, bin_of)
    off_of, slot_of, pred_off_of = (tf.where(alone, 0, x) for x in (off_of, slot_of, pred_off_of))
    return w - num_loop + num_bins, bin_of, off_of, slot_of, pred_off_of


# The loop takes one small step per sequence: as TF ops that is ~45 us a step, compiled by XLA
# ~3 us (15x on the 2-core benchmark machine). One module-level function with tensor arguments,
# so every pipeline of the process shares its compilations (one per window size).
_first_fit_xla = tf.function(
    _first_fit_loop, jit_compile=True,
    input_signature=[tf.TensorSpec([None], tf.int32)] * 3 + [tf.TensorSpec([], tf.int32)] * 3)
_XLA_OK: Optional[bool] = None


def _xla_works() -> bool:
    """Whether XLA can compile the packer here (probed once per process, on a tiny window)."""
    global _XLA_OK
    if _XLA_OK is None:
        try:
            with tf.init_scope():  # run it now, eagerly, even when called while tracing a map fn
                one = tf.constant([3, 2], tf.int32)
                _first_fit_xla(one, one, tf.zeros_like(one), tf.constant(8), tf.constant(2),
                               tf.constant(8))
            _XLA_OK = True
        except Exception as e:  # an XLA-less TensorFlow build: fall back to the graph loop
            log.warning("XLA is unavailable (%s); packing runs as a slower graph loop", e)
            _XLA_OK = False
    return _XLA_OK


def _first_fit_decreasing(lengths, num_preds, groups, max_seq_length, max_seqs_per_pack,
                          max_predictions_per_pack):
    """`_first_fit_loop`, XLA-compiled when available (identical results either way)."""
    args = (lengths, num_preds, groups, tf.constant(max_seq_length, tf.int32),
            tf.constant(max_seqs_per_pack, tf.int32), tf.constant(max_predictions_per_pack, tf.int32))
    return (_first_fit_xla if _xla_works() else _first_fit_loop)(*args)


def pack_window(features: Mapping[str, tf.Tensor], *, max_seq_length: int, max_seqs_per_pack: int,
                max_predictions_per_pack: int,
                prediction_budget: Optional[tf.Tensor] = None,
                groups: Optional[tf.Tensor] = None) -> dict:
    """Packs a window of `[W, ...]` parsed records into `[R, ...]` rows, R <= W.

    Records must have their real tokens first (Google's layout: `input_mask` is 1 then 0).
    Rows come out in the order of their earliest record in the window, so a shuffled input
    stays shuffled.

    Args:
      features: parsed records (see `parse_batch`), after dynamic masking if any.
      max_seq_length: L, the row length.
      max_seqs_per_pack: S, sequences per row at most.
      max_predictions_per_pack: Pp, masked-LM predictions per row at most (>= P).
      prediction_budget: `[W]` predictions to reserve per record (default: its stored ones);
        dynamic masking passes what it will need, so re-masked rows fit Pp too.
      groups: `[W]` int group of each record (the pipeline passes the epoch): records of
        different groups never share a row.

    Returns:
      The packed-batch dict of the module docstring, with a leading dimension R.

    Example (L=8, S=3): records `[CLS] a [SEP]` (3 tokens, label 0) and `[CLS] b c [SEP]`
    (4 tokens, label 1) become one row `[CLS] b c [SEP] [CLS] a [SEP] [PAD]` with
    position_ids `0 1 2 3 0 1 2 0`, pack_ids `1 1 1 1 2 2 2 0`, cls_positions `[0, 4, 0]`,
    next_sentence_labels `[1, 0, 0]` and next_sentence_weights `[1, 1, 0]`.
    """
    L, S, Pp = max_seq_length, max_seqs_per_pack, max_predictions_per_pack
    mask = features["input_mask"]  # [W, L]
    lengths = tf.reduce_sum(mask, 1)  # [W]
    mlm_valid = features["masked_lm_weights"] > 0  # [W, P]
    num_preds = tf.reduce_sum(tf.cast(mlm_valid, tf.int32), 1)  # [W]
    budget = num_preds if prediction_budget is None else tf.maximum(num_preds, prediction_budget)
    if groups is None:
        groups = tf.zeros_like(lengths)
    num_bins, bin_of, off_of, slot_of, pred_off_of = _first_fit_decreasing(
        lengths, budget, tf.cast(groups, tf.int32), L, S, Pp)

    # Row order: by each row's earliest record in the (shuffled) window. This also keeps groups
    # in stream order, since a window holds the end of one epoch before the start of the next.
    first = tf.math.unsorted_segment_min(tf.range(tf.shape(bin_of)[0]), bin_of, num_bins)  # [R]
    new_row = tf.scatter_nd(tf.argsort(first)[:, None], tf.range(num_bins), [num_bins])  # [R]
    bin_of = tf.gather(new_row, bin_of)  # [W]

    # Tokens: record i's token t goes to (bin_of[i], off_of[i] + t). The five per-token fields
    # travel together as one [W, L, 5] tensor: one gather and one scatter instead of five.
    tok = mask > 0  # [W, L]
    t = tf.broadcast_to(tf.range(L)[None, :], tf.shape(mask))  # [W, L]
    rows = tf.broadcast_to(bin_of[:, None], tf.shape(mask))  # [W, L]
    tok_idx = tf.boolean_mask(tf.stack([rows, off_of[:, None] + t], -1), tok)  # [T, 2]
    fields = tf.stack([features["input_ids"], tf.ones_like(mask), features["segment_ids"], t,
                       tf.broadcast_to(slot_of[:, None] + 1, tf.shape(mask))], -1)  # [W, L, 5]
    tokens = tf.scatter_nd(tok_idx, tf.boolean_mask(fields, tok), tf.stack([num_bins, L, 5]))
    out = {name: tokens[:, :, j] for j, name in enumerate(
        ("input_ids", "input_mask", "segment_ids", "position_ids", "pack_ids"))}  # [R, L] each

    # Per-sequence slots: (bin_of[i], slot_of[i]).
    seq_idx = tf.stack([bin_of, slot_of], -1)  # [W, 2]
    seq = tf.scatter_nd(seq_idx, tf.stack([off_of, features["next_sentence_labels"][:, 0],
                                           tf.ones_like(off_of)], -1),
                        tf.stack([num_bins, S, 3]))  # [R, S, 3]
    out["cls_positions"] = seq[:, :, 0]
    out["next_sentence_labels"] = seq[:, :, 1]
    out["next_sentence_weights"] = tf.cast(seq[:, :, 2], tf.float32)

    # Predictions: record i's j-th real prediction goes to (bin_of[i], pred_off_of[i] + j).
    rank = tf.cumsum(tf.cast(mlm_valid, tf.int32), axis=1) - 1  # [W, P]
    prow = tf.broadcast_to(bin_of[:, None], tf.shape(rank))
    pred_idx = tf.boolean_mask(tf.stack([prow, pred_off_of[:, None] + rank], -1), mlm_valid)
    pred_fields = tf.stack([features["masked_lm_positions"] + off_of[:, None],
                            features["masked_lm_ids"], tf.ones_like(rank)], -1)  # [W, P, 3]
    preds = tf.scatter_nd(pred_idx, tf.boolean_mask(pred_fields, mlm_valid),
                          tf.stack([num_bins, Pp, 3]))  # [R, Pp, 3]
    out["masked_lm_positions"] = preds[:, :, 0]
    out["masked_lm_ids"] = preds[:, :, 1]
    out["masked_lm_weights"] = tf.cast(preds[:, :, 2], tf.float32)
    return out
