"""From serialized records to host-local numpy batches: what the training stream
(`data_pipeline.input.pretraining`) and the evaluation pass (`data_pipeline.input.evaluation`)
share. `parse_batch` parses a batch of tf.Examples into int32/float32 tensors under the schema's
names; `next_batch` takes the next batch of a tf.data iterator as numpy, with TensorFlow's
anonymous read and parse errors turned into errors that name the files; `deterministic_options`
and `graph_fn` are how both build their pipelines.

This module imports neither jax nor bert_jax.
"""

from __future__ import annotations

from data_pipeline.records import schema
from data_pipeline.records.reader import HostFiles, read_error
from data_pipeline.tf_import import tf  # without Keras (data_pipeline/tf_import.py)


def parse_batch(serialized: tf.Tensor, max_seq_length: int, max_predictions_per_seq: int) -> dict:
    """Parses `[N]` serialized tf.Examples into int32/float32 `[N, ...]` tensors (schema names)."""
    parsed = schema.parse_example(serialized, max_seq_length, max_predictions_per_seq)
    out = {}
    for name, value in parsed.items():
        out[name] = tf.cast(value, tf.float32 if value.dtype.is_floating else tf.int32)
    return out


def next_batch(iterator, files: HostFiles, patterns: list, max_seq_length: int,
               max_predictions_per_seq: int) -> dict:
    """`next(iterator)` as numpy, with TF's anonymous read errors turned into named ones."""
    try:
        return _to_numpy(next(iterator))
    except tf.errors.DataLossError as e:
        raise read_error(files, patterns, e) from e
    except tf.errors.InvalidArgumentError as e:
        raise ValueError(
            f"records in {patterns} do not parse with max_seq_length={max_seq_length}, "
            f"max_predictions_per_seq={max_predictions_per_seq}: {e.message}") from e


def deterministic_options() -> tf.data.Options:
    options = tf.data.Options()
    options.deterministic = True
    return options


def graph_fn(fn):
    # Our map functions are plain TF ops (explicit tf.while_loop): skipping autograph's source
    # conversion makes building a pipeline several times faster.
    return tf.autograph.experimental.do_not_convert(fn)


def _to_numpy(batch: dict) -> dict:
    return {k: v.numpy() for k, v in batch.items()}
