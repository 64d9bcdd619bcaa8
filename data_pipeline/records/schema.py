"""THE pretraining TFRecord schema (Google's): the contract of the project.

Writer (`create_pretraining_data`) and reader (`records.reader`, `input.pretraining`) both use this module; it is the
only place the feature names, dtypes and shapes are defined.

Features of one record (google-research/bert `create_pretraining_data.py`), zero-padded:

| feature | dtype | length |
|---|---|---|
| input_ids, input_mask, segment_ids | int64 | max_seq_length |
| masked_lm_positions, masked_lm_ids | int64 | max_predictions_per_seq |
| masked_lm_weights | float32 | max_predictions_per_seq |
| next_sentence_labels | int64 | 1 (1 = the second segment is random) |

The data manifest written beside the records (how they were made, every file's records, bytes and
sha256) is `manifests.py`'s.

This module never imports jax; tensorflow is imported only by the functions that need it (parsing,
`tf.train.Example`): the fast writer runs without it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

INT_FEATURES_SEQ = ("input_ids", "input_mask", "segment_ids")
INT_FEATURES_PRED = ("masked_lm_positions", "masked_lm_ids")
FEATURE_ORDER = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
                 "masked_lm_weights", "next_sentence_labels")


def feature_shapes(max_seq_length: int, max_predictions_per_seq: int) -> dict:
    """Feature name -> (numpy dtype, length)."""
    out = {k: (np.int64, max_seq_length) for k in INT_FEATURES_SEQ}
    out.update({k: (np.int64, max_predictions_per_seq) for k in INT_FEATURES_PRED})
    out["masked_lm_weights"] = (np.float32, max_predictions_per_seq)
    out["next_sentence_labels"] = (np.int64, 1)
    return out


def feature_spec(max_seq_length: int, max_predictions_per_seq: int) -> dict:
    """`tf.io.FixedLenFeature`s for `tf.io.parse_example`."""
    from data_pipeline.tf_import import tf
    return {k: tf.io.FixedLenFeature([n], tf.float32 if dt == np.float32 else tf.int64)
            for k, (dt, n) in feature_shapes(max_seq_length, max_predictions_per_seq).items()}


def parse_example(serialized, max_seq_length: int, max_predictions_per_seq: int) -> dict:
    """Parses a batch (or one) of serialized records into fixed-length tensors."""
    from data_pipeline.tf_import import tf
    spec = feature_spec(max_seq_length, max_predictions_per_seq)
    if serialized.shape.rank == 0:
        return tf.io.parse_single_example(serialized, spec)
    return tf.io.parse_example(serialized, spec)


def pad_features(input_ids: Sequence[int], segment_ids: Sequence[int], masked_lm_positions: Sequence[int],
                 masked_lm_ids: Sequence[int], next_sentence_label: int, max_seq_length: int,
                 max_predictions_per_seq: int) -> dict:
    """One instance's features, zero-padded to the schema's lengths (Google's layout)."""
    n, p = len(input_ids), len(masked_lm_positions)
    if n > max_seq_length:
        raise ValueError(f"{n} tokens exceed max_seq_length={max_seq_length}")
    if p > max_predictions_per_seq:
        raise ValueError(f"{p} predictions exceed max_predictions_per_seq={max_predictions_per_seq}")
    def pad(values, length, dtype):
        out = np.zeros(length, dtype)
        out[:len(values)] = values
        return out
    return {
        "input_ids": pad(input_ids, max_seq_length, np.int64),
        "input_mask": pad([1] * n, max_seq_length, np.int64),
        "segment_ids": pad(segment_ids, max_seq_length, np.int64),
        "masked_lm_positions": pad(masked_lm_positions, max_predictions_per_seq, np.int64),
        "masked_lm_ids": pad(masked_lm_ids, max_predictions_per_seq, np.int64),
        "masked_lm_weights": pad([1.0] * p, max_predictions_per_seq, np.float32),
        "next_sentence_labels": np.array([int(next_sentence_label)], np.int64),
    }


def to_tf_example(features: Mapping[str, Any]):
    """A `tf.train.Example` with the features in Google's order."""
    from data_pipeline.tf_import import tf
    feats = {}
    for name in FEATURE_ORDER:
        values = np.asarray(features[name])
        if name == "masked_lm_weights":
            feats[name] = tf.train.Feature(float_list=tf.train.FloatList(value=values.astype(np.float32).tolist()))
        else:
            feats[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=values.astype(np.int64).tolist()))
    return tf.train.Example(features=tf.train.Features(feature=feats))


def serialize(features: Mapping[str, Any]) -> bytes:
    """Deterministic bytes (sorted feature map), so the same instance always writes the same file."""
    return to_tf_example(features).SerializeToString(deterministic=True)


def decode_example(serialized: bytes) -> dict:
    """Record bytes -> dict of numpy arrays (for tests and tools; training uses `parse_example`)."""
    from data_pipeline.tf_import import tf
    ex = tf.train.Example.FromString(serialized)
    out = {}
    for name, feat in ex.features.feature.items():
        kind = feat.WhichOneof("kind")
        out[name] = np.array(getattr(feat, kind).value,
                             np.float32 if kind == "float_list" else np.int64)
    return out


# ---------------------------------------------------------------------------------------------
# Batch encoder (the fast writer): numpy -> the bytes of SerializeToString(deterministic=True)
# ---------------------------------------------------------------------------------------------
#
# A record is an Example { Features { map<string, Feature> } }. Deterministic serialization
# writes the map sorted by key, each entry as (key, value); a Feature holds one packed list:
#
#   0a <len> {                                        Example.features (field 1)
#     for key in sorted(FEATURE_ORDER):
#       0a <len> {                                    Features.feature map entry (field 1)
#         0a <len(key)> key                           entry key (field 1)
#         12 <len> { 1a|12 <len> { 0a <len> values } }  entry value: Feature.int64_list (3) or
#       }                                             .float_list (2), packed values (field 1)
#   }
#
# Int64 values are varints (7 bits a byte, low first, high bit = more); floats are 4 bytes
# little-endian. Only the varint lengths differ from record to record, so a batch is laid out as
# a [batch, widest record] byte matrix, each piece in a fixed column block as wide as its longest
# varint, with a mask of the bytes actually used; the mask compacts the matrix into the records,
# one after the other. Tested byte for byte against `serialize` (tests/data_pipeline/pretraining_data/test_fast_mode.py).


def _varint_fill(values: np.ndarray, data: np.ndarray, used: Optional[np.ndarray]) -> None:
    """Writes the varints of `values` [batch, n] (non-negative, < 2**64) into `data` [batch, n,
    width] (low 7-bit group first, high bit = more follows) and marks the bytes used in `used`."""
    width = data.shape[2]
    if width == 1:
        data[:, :, 0] = values
        return
    one = values.dtype.type
    for k in range(width):
        rest = values >> one(7 * k) if k else values
        data[:, :, k] = rest & one(0x7F)
        more = rest > 0x7F
        data[:, :, k] |= more.view(np.uint8) << 7
        if k + 1 < width:
            used[:, :, k + 1] = more


def _varint_values(values) -> tuple:
    """(values as uint32/uint64, varint width of the largest)."""
    v = np.asarray(values)
    if v.dtype.kind not in "iub":
        raise TypeError(f"int64 feature with dtype {v.dtype}")
    if v.dtype.kind == "i" and v.size and v.min() < 0:  # int64's two's complement, as protobuf
        v = v.astype(np.int64).view(np.uint64)
    top = int(v.max()) if v.size else 0
    width = max(1, (top.bit_length() + 6) // 7)
    return v.astype(np.uint32 if top < 2**32 else np.uint64, copy=False), width


def encode_examples(features: Mapping[str, Any], head: int = 0, tail: int = 0):
    """A batch of records in the schema -> their deterministic `tf.train.Example` bytes.

    Args:
      features: feature name -> array [batch, length] (the layout of `pad_features`, batched):
        int64 features any integer dtype, `masked_lm_weights` float.
      head, tail: bytes left free (zero) before and after each record, for the caller's framing.

    Returns:
      (buffer uint8 [total], starts int64 [batch], lengths int64 [batch]): record i is
      `buffer[starts[i]:starts[i] + lengths[i]]`, equal to `serialize` of its features; its head
      bytes are just before it, its tail bytes just after, then the next record's head.
    """
    keys = sorted(FEATURE_ORDER)
    batch = len(np.asarray(features[keys[0]]))
    # Pieces of a record in order: bytes (the same in every record), ("raw", uint8 [batch, w]),
    # ("varints", values [batch, n], width), ("len", lengths [batch]).
    pieces: list = [("raw", np.zeros((batch, head), np.uint8))] if head else []
    pieces.append(b"\x0a")
    features_at = len(pieces)
    pieces.append(None)  # the length of Features, known at the end of the loop
    features_len = np.zeros(batch, np.int64)
    for key in keys:
        arr = np.asarray(features[key])
        if arr.ndim != 2 or len(arr) != batch:
            raise ValueError(f"{key}: expected [batch={batch}, length], got shape {arr.shape}")
        if key == "masked_lm_weights":
            raw = np.ascontiguousarray(arr, dtype="<f4").view(np.uint8).reshape(batch, -1)
            payload, tag, payload_len = ("raw", raw), b"\x12", np.full(batch, raw.shape[1], np.int64)
        else:
            values, width = _varint_values(arr)
            payload_len = np.full(batch, arr.shape[1], np.int64)
            for k in range(1, width):
                payload_len += np.count_nonzero(values >= values.dtype.type(1 << (7 * k)), axis=1)
            payload, tag = ("varints", values, width), b"\x1a"
        list_len = 1 + _nbytes(payload_len) + payload_len
        feature_len = 1 + _nbytes(list_len) + list_len
        key_bytes = key.encode()
        entry_len = 2 + len(key_bytes) + 1 + _nbytes(feature_len) + feature_len
        features_len += 1 + _nbytes(entry_len) + entry_len
        pieces += [b"\x0a", ("len", entry_len), b"\x0a" + bytes([len(key_bytes)]) + key_bytes + b"\x12",
                   ("len", feature_len), tag, ("len", list_len), b"\x0a", ("len", payload_len), payload]
    pieces[features_at] = ("len", features_len)
    record_len = 1 + _nbytes(features_len) + features_len
    if tail:
        pieces.append(("raw", np.zeros((batch, tail), np.uint8)))
    # Runs of constant bytes merge; lengths become varints of their own width.
    # A length that is the same in every record of the batch (all but those around the
    # variable-width lists) is a constant too, which leaves a few wide blocks to fill.
    merged: list = []
    for piece in pieces:
        if isinstance(piece, tuple) and piece[0] == "len" and batch and piece[1].min() == piece[1].max():
            piece = _varint_bytes(int(piece[1][0]))
        if isinstance(piece, bytes) and merged and isinstance(merged[-1], bytes):
            merged[-1] += piece
        elif isinstance(piece, tuple) and piece[0] == "len":
            top = int(piece[1].max()) if batch else 0
            merged.append(("varints", piece[1][:, None], max(1, (top.bit_length() + 6) // 7)))
        else:
            merged.append(piece)

    def columns(piece) -> int:
        if isinstance(piece, bytes):
            return len(piece)
        return piece[1].shape[1] * (piece[2] if piece[0] == "varints" else 1)

    total_width = sum(columns(p) for p in merged)
    matrix = np.empty((batch, total_width), np.uint8)
    used = np.ones((batch, total_width), bool)
    col = 0
    for piece in merged:
        w = columns(piece)
        if isinstance(piece, bytes):
            matrix[:, col:col + w] = np.frombuffer(piece, np.uint8)
        elif piece[0] == "raw":
            matrix[:, col:col + w] = piece[1]
        else:
            _, values, width = piece
            shape = (batch, values.shape[1], width)
            _varint_fill(values.astype(np.uint64 if values.dtype == np.int64 else values.dtype, copy=False),
                         matrix[:, col:col + w].reshape(shape),
                         used[:, col:col + w].reshape(shape) if width > 1 else None)
        col += w
    out = matrix[used]
    slot = head + record_len + tail
    starts = np.zeros(batch, np.int64)
    np.cumsum(slot[:-1], out=starts[1:])
    starts += head
    return out, starts, record_len


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _nbytes(lengths: np.ndarray) -> np.ndarray:
    """Varint bytes of non-negative lengths."""
    out = np.ones(lengths.shape, np.int64)
    for k in (7, 14, 21, 28, 35, 42, 49, 56):
        out += lengths >= (1 << k)
    return out
