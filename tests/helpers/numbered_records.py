"""Pretraining records that carry their own id in token 1 (`ID_BASE + rid`), so that a batch tells
which records it holds, even after (re-)masking: restoring `masked_lm_ids` at `masked_lm_positions`
gives the original tokens back. Written through data_pipeline.schema's writer with a manifest;
tests/data_pipeline/input/test_input_pipeline.py, test_dynamic_masking.py, test_packed_pretraining.py and
tests/data_pipeline/records/test_verify_data.py read them."""

from pathlib import Path

import numpy as np
import tensorflow as tf

from data_pipeline.input import pretraining as ip
from data_pipeline.records import manifests, schema

L, P = 32, 5  # max_seq_length, max_predictions_per_seq of the test records
PAD, CLS, SEP, MASK, VOCAB = 0, 101, 102, 103, 30000
SPECIAL = dict(pad_id=PAD, cls_id=CLS, sep_id=SEP, mask_id=MASK, vocab_size=VOCAB)
ID_BASE = 10000


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
    manifests.write_dataset_info(str(directory), dict(zip(paths, counts)))
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


def stack_records(records: list[dict]) -> dict:
    return {k: tf.constant(np.stack([r[k] for r in records]).astype(
        np.float32 if k == "masked_lm_weights" else np.int32)) for k in records[0]}


def make_input(pattern, **kw) -> ip.PretrainingInput:
    args = dict(per_host_batch_size=4, max_seq_length=L, max_predictions_per_seq=P, seed=0,
                shuffle_buffer_size=16)
    args.update(kw)
    return ip.PretrainingInput(pattern, **args)
