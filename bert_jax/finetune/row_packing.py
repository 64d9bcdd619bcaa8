"""Fine-tuning rows packed several to a training row: the padding left out of the step.

A fine-tuning batch of short rows is mostly padding: SST-2's rows average 13.5 of the 64 positions
its batches are padded to. Packing lays a batch's rows end to end in fewer rows of the same
length (first fit, longest first), and the model keeps them apart: each token attends only to
its own sequence (`pack_ids`), positions restart at 0 for each (`position_ids`), and the head
reads each sequence's [CLS] (`cls_positions`). The loss of a packed batch is the loss of the
unpacked one to float rounding (tests/finetune/test_packed_rows.py); only dropout's masks, drawn per
shape, differ.

A batch of `b` rows packed into `R` rows of `L` positions, at most `S` sequences a row:

    input_ids, input_mask, segment_ids   [R, L]   the rows' real positions, end to end
    position_ids                         [R, L]   0, 1, ... within each sequence
    pack_ids                             [R, L]   1, 2, ... the sequence's slot + 1, 0 = padding
    cls_positions                        [R, S]   where each slot's sequence starts (0 = empty)
    label, weight                        [R, S]   each slot's label and weight (0 = empty)

or, for a token head (a batch with `label_ids`, `label_weights`: a label per position):

    label_ids, label_weights             [R, L]   at their positions; each weight times its
                                                  row's weight
    weight                               [R]      1 (the weights are in label_weights)

Rows of weight 0 (the completion of a last batch, unlabelled rows) are left out: they change
nothing a step computes. Heads: those that read the pooled [CLS] of each sequence
(`classification`, `regression`) or every position (`token`); not a span head, whose softmax
runs over the whole row, nor multiple choice (a row per choice already).

This module imports neither jax nor tensorflow.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bert_jax.finetune.bucketing import row_lengths

SEQUENCE_KEYS = ("input_ids", "input_mask", "segment_ids")
TOKEN_KEYS = ("label_ids", "label_weights")
SLOT_KEYS = ("label", "weight")


def first_fit(lengths: Sequence[int], row_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row, offset and slot of each sequence of `lengths` packed into rows of `row_length`.

    Longest first (ties in order), each goes into the first row with room for it, or opens a new
    row. Example: lengths [5, 9, 3, 7], rows of 12 -> 9 opens row 0, 7 opens row 1, 5 joins row 1,
    3 joins row 0: rows [1, 0, 0, 1], offsets [7, 0, 9, 0], slots [1, 0, 1, 0].

    `lengths` may also be `[batches, n]`, each batch packed on its own (all at once: planning a
    run packs every step's batch); there a length of 0 is no sequence (row -1).
    """
    lengths = np.asarray(lengths, np.int64)
    many = lengths.ndim == 2
    lengths = lengths if many else lengths[None]
    if lengths.size and (lengths.max() > row_length or lengths.min() < (0 if many else 1)):
        raise ValueError(f"sequence lengths {lengths.min()}..{lengths.max()} must be in 1..{row_length}")
    m, n = lengths.shape
    batch = np.arange(m)
    fill, count = np.zeros((m, n), np.int64), np.zeros((m, n), np.int64)  # n sequences, n rows at most
    row_of, offset_of, slot_of = (np.full((m, n), -1, np.int64) for _ in range(3))
    for i in np.argsort(-lengths, axis=1, kind="stable").T:  # the j-th longest of every batch
        size = lengths[batch, i]
        # An unopened row is empty, so the first row with room is an open one or the next new one.
        r = np.argmax(fill + size[:, None] <= row_length, axis=1)
        here = size > 0
        row_of[batch, i] = np.where(here, r, -1)
        offset_of[batch, i] = np.where(here, fill[batch, r], -1)
        slot_of[batch, i] = np.where(here, count[batch, r], -1)
        fill[batch, r] += size
        count[batch, r] += here
    if not many:
        return row_of[0], offset_of[0], slot_of[0]
    return row_of, offset_of, slot_of


def sequence_lengths(input_mask: np.ndarray) -> np.ndarray:
    """What each row takes in a packed row: up to its last real position (at least 1)."""
    return np.maximum(row_lengths(input_mask), 1)


def needs(lengths: np.ndarray, weight: np.ndarray, packed_length: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows `pack` takes for rows of these `sequence_lengths` and weights (`[..., b]`: the
    batches' rows), and the most sequences in one of them: two arrays `[...]`."""
    lengths = np.where(np.asarray(weight) != 0, lengths, 0)
    row_of, _, slot_of = first_fit(lengths.reshape(int(np.prod(lengths.shape[:-1])), lengths.shape[-1]),
                                   packed_length)
    shape = lengths.shape[:-1]
    return ((row_of.max(axis=-1, initial=-1) + 1).reshape(shape),
            (slot_of.max(axis=-1, initial=-1) + 1).reshape(shape))


def pack(batch: dict, rows: int, slots: int) -> dict:
    """`batch` (`SEQUENCE_KEYS` `[b, L]`, then `SLOT_KEYS` `[b]`, or `TOKEN_KEYS` `[b, L]` and
    `weight` `[b]`; real positions first in each row) packed into `rows` rows of `L` with
    `slots` sequences a row at most (module docstring)."""
    length = batch["input_mask"].shape[-1]
    weight = np.asarray(batch["weight"])
    keep = np.flatnonzero(weight != 0)
    seq_length = sequence_lengths(np.asarray(batch["input_mask"]))[keep]
    row_of, offset_of, slot_of = first_fit(seq_length, length)
    if row_of.max(initial=-1) >= rows or slot_of.max(initial=-1) >= slots:
        raise ValueError(f"a batch packs into {row_of.max() + 1} rows of up to {slot_of.max() + 1} "
                         f"sequences, past the {rows} x {slots} planned")
    token = "label_ids" in batch
    sequence_keys = SEQUENCE_KEYS + (TOKEN_KEYS if token else ())
    out = {k: np.zeros((rows, length), batch[k].dtype) for k in sequence_keys}
    out["position_ids"] = np.zeros((rows, length), np.int32)
    out["pack_ids"] = np.zeros((rows, length), np.int32)
    if not token:
        out["cls_positions"] = np.zeros((rows, slots), np.int32)
        for k in SLOT_KEYS:
            out[k] = np.zeros((rows, slots), batch[k].dtype)
    for i, n, r, o, s in zip(keep, seq_length, row_of, offset_of, slot_of):
        for k in sequence_keys:
            out[k][r, o:o + n] = batch[k][i, :n]
        out["position_ids"][r, o:o + n] = np.arange(n)
        out["pack_ids"][r, o:o + n] = s + 1
        if token:
            out["label_weights"][r, o:o + n] *= weight[i]
        else:
            out["cls_positions"][r, s] = o
            for k in SLOT_KEYS:
                out[k][r, s] = batch[k][i]
    if token:
        out["weight"] = (out["pack_ids"].max(axis=1) > 0).astype(np.float32)
    return out

