"""THE pretraining TFRecord schema (Google's), and the data manifest: the contract of the project.

Writer (`create_pretraining_data`) and reader (`input_pipeline`) both use this module; it is the
only place the feature names, dtypes and shapes are defined.

Features of one record (google-research/bert `create_pretraining_data.py`), zero-padded:

| feature | dtype | length |
|---|---|---|
| input_ids, input_mask, segment_ids | int64 | max_seq_length |
| masked_lm_positions, masked_lm_ids | int64 | max_predictions_per_seq |
| masked_lm_weights | float32 | max_predictions_per_seq |
| next_sentence_labels | int64 | 1 (1 = the second segment is random) |

`dataset_info.json`, next to the TFRecords, records how they were made (all flags, seed, the vocab
file's sha256, statistics) and a manifest of every output file (records, bytes, sha256) that the
input pipeline checks before training: an empty or truncated TFRecord file reads without error in
tf.data, so only the manifest catches it.

This module never imports jax; tensorflow is imported only by the functions that need it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np

MANIFEST_NAME = "dataset_info.json"
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
    import tensorflow as tf
    return {k: tf.io.FixedLenFeature([n], tf.float32 if dt == np.float32 else tf.int64)
            for k, (dt, n) in feature_shapes(max_seq_length, max_predictions_per_seq).items()}


def parse_example(serialized, max_seq_length: int, max_predictions_per_seq: int) -> dict:
    """Parses a batch (or one) of serialized records into fixed-length tensors."""
    import tensorflow as tf
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
    import tensorflow as tf
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
    import tensorflow as tf
    ex = tf.train.Example.FromString(serialized)
    out = {}
    for name, feat in ex.features.feature.items():
        kind = feat.WhichOneof("kind")
        out[name] = np.array(getattr(feat, kind).value,
                             np.float32 if kind == "float_list" else np.int64)
    return out


# ---------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    import tensorflow as tf
    with tf.io.gfile.GFile(path, "rb") as f:
        while True:
            chunk = f.read(8 << 20)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def file_entry(path: str, num_records: int) -> dict:
    import tensorflow as tf
    return {"num_records": int(num_records), "num_bytes": int(tf.io.gfile.stat(path).length),
            "sha256": sha256_file(path)}


def write_dataset_info(directory: str, files: Mapping[str, int], info: Optional[dict] = None) -> str:
    """Writes `directory/dataset_info.json`: `info` plus `files` {name: {num_records, num_bytes, sha256}}.

    Args:
      directory: where the TFRecords are (names in the manifest are relative to it).
      files: file path -> number of records written to it.
      info: flags, seed, vocab sha256, statistics, ...
    """
    import tensorflow as tf
    manifest = {os.path.basename(p): file_entry(p, n) for p, n in sorted(files.items())}
    out = dict(info or {})
    out["schema_version"] = 1
    out["files"] = manifest
    path = os.path.join(directory, MANIFEST_NAME)
    tmp = path + ".tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        f.write(json.dumps(out, indent=2, sort_keys=True) + "\n")
    tf.io.gfile.rename(tmp, path, overwrite=True)
    return path
