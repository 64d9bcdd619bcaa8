"""Pretraining records in Google's schema, written with tf.train.Example directly (not our writer),
a record file read back as bytes, and the losses a run logged."""

import json
from pathlib import Path

import numpy as np

SEQ, PREDS, VOCAB = 32, 5, 512


def write_records(path: Path, n: int, seed: int, nan_weight: bool = False, SEQ: int = SEQ,
                  PREDS: int = PREDS) -> None:
    """Records in Google's schema, written with tf.train.Example directly (not our writer)."""
    import tensorflow as tf
    rng = np.random.RandomState(seed)
    with tf.io.TFRecordWriter(str(path)) as w:
        for _ in range(n):
            length = rng.randint(SEQ // 2, SEQ + 1)
            ids = np.zeros(SEQ, np.int64)
            ids[:length] = rng.randint(5, VOCAB, size=length)
            ids[0], ids[length - 1] = 2, 3
            mask = (np.arange(SEQ) < length).astype(np.int64)
            seg = ((np.arange(SEQ) >= length // 2) & (mask > 0)).astype(np.int64)
            npred = rng.randint(1, PREDS + 1)
            pos = np.zeros(PREDS, np.int64)
            pos[:npred] = np.sort(rng.choice(np.arange(1, length - 1), npred, replace=False))
            lab = np.zeros(PREDS, np.int64)
            lab[:npred] = ids[pos[:npred]]
            ids[pos[:npred]] = 4  # [MASK]
            weights = np.zeros(PREDS, np.float32)
            weights[:npred] = 1.0
            if nan_weight:
                weights[0] = np.nan
            feats = {
                "input_ids": ids, "input_mask": mask, "segment_ids": seg, "masked_lm_positions": pos,
                "masked_lm_ids": lab, "next_sentence_labels": np.array([rng.randint(0, 2)], np.int64)}
            f = {k: tf.train.Feature(int64_list=tf.train.Int64List(value=v)) for k, v in feats.items()}
            f["masked_lm_weights"] = tf.train.Feature(float_list=tf.train.FloatList(value=weights))
            w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())


def read_records(path) -> list[bytes]:
    """The serialized records of a TFRecord file (gzipped when its name ends in .gz), in order."""
    import tensorflow as tf
    return [r.numpy() for r in tf.data.TFRecordDataset(str(path), compression_type="GZIP" if str(path).endswith(".gz") else "")]


def logged_losses(text: str) -> dict:
    """step -> loss of a train_log.jsonl's text (a resumed or rolled-back run logs some steps again:
    last one wins); event lines (`{"event": "rollback", ...}`) are not steps."""
    out = {}
    for line in text.splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            out[rec["step"]] = rec["loss"]
    return out


def kill9_once_logged(proc, log: str, steps: int = 6, timeout: float = 300) -> None:
    """SIGKILL `proc` (a `bert_jax.main` run, stderr piped) once its train_log.jsonl (local or gs://)
    holds `steps` lines; fails the test if the run ends first or never gets there."""
    import signal
    import time

    import pytest

    from data_pipeline import storage

    deadline = time.time() + timeout
    while not (storage.exists(log) and len(storage.read_text(log).splitlines()) >= steps):
        if proc.poll() is not None:
            pytest.fail(f"training ended before it could be killed: {proc.stderr.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"step {steps} was not logged within {timeout} s")
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
