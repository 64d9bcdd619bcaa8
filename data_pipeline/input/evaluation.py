"""tf.data input for evaluation during pretraining: one finite pass over the eval records, in file
order, padded so that every host yields the same number of batches (`EvalInput`, made by
`make_eval_iterator`); padding rows are all zeros, with `masked_lm_weights` and
`next_sentence_weights` 0. Its batches are the unpacked batches of `data_pipeline.input.pretraining`
(that module's docstring), with the records' own masks.

This module imports neither jax nor bert_jax.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from data_pipeline.input.parsing import deterministic_options, graph_fn, next_batch, parse_batch
from data_pipeline.records.reader import FilePatterns, check_files, file_datasets
from data_pipeline.storage import split_patterns
from data_pipeline.tf_import import tf  # without Keras (data_pipeline/tf_import.py)


class EvalInput:
    """One finite pass over eval records, padded so every host yields `len(self)` batches.

    Iterating gives unpacked batches (module docstring) in file order with the records' own
    masks; padding rows are all zeros, with `masked_lm_weights` and `next_sentence_weights` 0.
    Each `iter()` starts a fresh pass.
    """

    def __init__(self, file_patterns: FilePatterns, *, per_host_batch_size: int,
                 max_seq_length: int, max_predictions_per_seq: int, process_index: int = 0,
                 process_count: int = 1, verify: bool = True, skip_corrupt: bool = False,
                 known_hashes_file: Optional[str] = None):
        if per_host_batch_size <= 0:
            raise ValueError(f"per_host_batch_size={per_host_batch_size} must be positive")
        self.per_host_batch_size = per_host_batch_size
        self.max_seq_length, self.max_predictions_per_seq = max_seq_length, max_predictions_per_seq
        self._patterns = split_patterns(file_patterns)
        # Eval may have fewer files than hosts: a host without files yields padding only.
        self._files = check_files(file_patterns, process_index=process_index,
                                  process_count=process_count, verify=verify,
                                  skip_corrupt=skip_corrupt, require_files_per_host=False,
                                  known_hashes_file=known_hashes_file)
        per_host = self._files.records_per_host(process_count)
        self.num_batches = max(-(-n // per_host_batch_size) for n in per_host)
        self.num_records = self._files.read_records
        self.stats = {"files": len(self._files.host_files),
                      "corrupt_files": list(self._files.corrupt_files),
                      "skipped_records": self._files.skipped_records,
                      "records": self.num_records}

    def __len__(self) -> int:
        return self.num_batches

    def _dataset(self) -> tf.data.Dataset:
        L, P = self.max_seq_length, self.max_predictions_per_seq
        paths = self._files.read_paths

        def real(serialized):
            features = parse_batch(serialized, L, P)
            features["next_sentence_weights"] = tf.ones([tf.shape(serialized)[0]], tf.float32)
            return features

        pad = {"input_ids": tf.zeros([L], tf.int32), "input_mask": tf.zeros([L], tf.int32),
               "segment_ids": tf.zeros([L], tf.int32),
               "masked_lm_positions": tf.zeros([P], tf.int32),
               "masked_lm_ids": tf.zeros([P], tf.int32),
               "masked_lm_weights": tf.zeros([P], tf.float32),
               "next_sentence_labels": tf.zeros([1], tf.int32),
               "next_sentence_weights": tf.zeros([], tf.float32)}
        padding = tf.data.Dataset.from_tensors(pad).repeat()
        if paths:
            units, read = file_datasets(self._files)
            rows = units.flat_map(read).batch(256).map(
                graph_fn(real), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
            rows = rows.concatenate(padding)
        else:
            rows = padding
        ds = rows.batch(self.per_host_batch_size).take(self.num_batches)
        return ds.prefetch(2).with_options(deterministic_options())

    def __iter__(self) -> Iterator[dict]:
        iterator = iter(self._dataset())
        while True:
            try:
                batch = next_batch(iterator, self._files, self._patterns, self.max_seq_length,
                                    self.max_predictions_per_seq)
            except StopIteration:
                return
            yield batch


def make_eval_iterator(file_patterns: FilePatterns, **kwargs: Any) -> EvalInput:
    """`EvalInput(file_patterns, **kwargs)`: the finite, padded eval pass (see `EvalInput`)."""
    return EvalInput(file_patterns, **kwargs)
