"""The batches of a fine-tuning run, planned before it starts.

Which feature rows each training step takes (`training_rows`: epochs of `tasks.batches`, or the
stream of passes of `stream_batches`, Google's recipe), and what each step's program is:
- rows cut short of the padding (`trim_arguments`; the lengths each batch needs,
  `training_needs` / `eval_batch_needs`, for `tasks.choose_lengths`), or
- rows packed several to a row (`plan_packing`: the rows each step needs, and the counts that
  pay for their compile; `data_pipeline/tasks/packed.py` packs them).

Everything here is a function of the data, the seed and the config's numbers, so every host and
a resumed run plan the same. The loop (`bert_jax.finetune`) reads the config and calls these.

This module must not import tensorflow.
"""

from __future__ import annotations

import logging
from typing import Optional

import jax
import numpy as np

from bert_jax import heads
from data_pipeline import tasks as tasks_lib
from data_pipeline.tasks import packed


def stream_batches(features: dict, keys, global_batch_size: int, steps, *, seed: int,
                   process_index: int = 0, process_count: int = 1, lengths=None, sequence_keys=()):
    """The batches of `steps` (step k: rows `[k*B, (k+1)*B)`) of one stream of feature rows: pass
    `p` over the `n` rows is `RandomState(seed + p).permutation(n)` (the permutation the epoch
    loop uses for epoch p), and a batch may span two passes, as Google's `d.repeat()` then
    `d.batch(drop_remainder=True)`. Every row is real (weight as featurized). Each host yields its
    slice `[p*b, (p+1)*b)` of every global batch, as `data_pipeline.tasks.batches`, which also
    says what `lengths` and `sequence_keys` do (padding past the global batch's longest row cut).
    """
    if global_batch_size % process_count:
        raise ValueError(f"batch size {global_batch_size} must divide by {process_count} processes")
    per_host = global_batch_size // process_count
    for everyone in stream_rows(len(features["weight"]), global_batch_size, steps, seed):
        rows = everyone[process_index * per_host:(process_index + 1) * per_host]
        out = {key: features[key][rows] for key in keys}
        out["weight"] = features["weight"][rows].astype(np.float32)
        yield tasks_lib.trim(out, features, everyone, lengths, sequence_keys)


def stream_rows(n: int, global_batch_size: int, steps, seed: int) -> np.ndarray:
    """`[len(steps), global_batch_size]`: the rows of each step's global batch in the stream of
    `stream_batches` (step k: positions `[k*B, (k+1)*B)`; pass p is `RandomState(seed + p)`'s
    permutation of the `n` rows)."""
    positions = np.asarray(list(steps), np.int64)[:, None] * global_batch_size + np.arange(global_batch_size)
    rows = np.empty_like(positions)
    for p in np.unique(positions // n):
        here = positions // n == p
        rows[here] = np.random.RandomState(seed + int(p)).permutation(n)[positions[here] % n]
    return rows


def eval_batch_needs(features: dict, batch_size: int) -> np.ndarray:
    """The longest real row of each batch `_predict` makes of a split (its rows by length)."""
    row_length = tasks_lib.row_lengths(features["input_mask"])
    return tasks_lib.batch_needs(row_length, batch_size, np.argsort(row_length, kind="stable"))


def batches_per_length(lengths: tuple, needs: np.ndarray) -> str:
    counts = np.bincount(np.searchsorted(lengths, needs), minlength=len(lengths))
    return ", ".join(f"{n}: {int(c)}" for n, c in zip(lengths, counts))


def training_rows(n: int, global_batch_size: int, seed: int, total_steps: int, epochs: int,
                  stream: bool) -> tuple[np.ndarray, np.ndarray]:
    """`[steps, global_batch_size]`: the feature rows of every training step's global batch from
    step 0 (of `tasks.batches` per epoch, or of `stream_batches`), and whether each is real (not
    the completion of an epoch's last batch)."""
    if stream:
        rows = stream_rows(n, global_batch_size, range(total_steps), seed)
        return rows, np.ones(rows.shape, bool)
    epochs_rows = [tasks_lib.batch_rows(np.random.RandomState(seed + e).permutation(n), global_batch_size)
                   for e in range(epochs)]
    return np.concatenate([r for r, _ in epochs_rows]), np.concatenate([real for _, real in epochs_rows])


def training_needs(features: dict, global_batch_size: int, seed: int, total_steps: int, epochs: int,
                   stream: bool) -> np.ndarray:
    """The longest real row of the batch of every training step of the run, from step 0 (the
    batches of `tasks.batches` per epoch, or of `stream_batches`)."""
    row_length = tasks_lib.row_lengths(features["input_mask"])
    rows, _ = training_rows(len(row_length), global_batch_size, seed, total_steps, epochs, stream)
    return row_length[rows].max(axis=1)


def plan_packing(features: dict, rows: np.ndarray, real: np.ndarray, packed_length: int, *, cost: float,
                 batch_shards: int, process_count: Optional[int] = None) -> tuple[np.ndarray, int]:
    """How many rows each training step's packed global batch has, and the most sequences a row
    holds (the same in every step: the head's slots).

    `rows`/`real` are `training_rows`. Each host packs its slice of a global batch
    (`packed.pack`); a step has `process_count` times the most rows a host's slice needs, rounded
    up to divide over the `batch_shards` of the mesh. Of those counts, only the ones whose steps
    save more than their compile costs get a program (`tasks.choose_lengths`; a compile costs
    `cost` unpacked steps of `global_batch_size` rows), each step running at the smallest chosen
    count that holds it.
    """
    process_count = process_count or jax.process_count()
    steps_, batch = rows.shape
    per_host = batch // process_count
    lengths = packed.sequence_lengths(features["input_mask"])
    weight = features["weight"][rows] * real
    # [steps, hosts]: what each host's slice of each step's batch takes.
    host_rows, host_slots = packed.needs(lengths[rows].reshape(steps_, process_count, per_host),
                                         weight.reshape(steps_, process_count, per_host), packed_length)
    need = np.maximum(host_rows.max(axis=1), 1)
    slots = max(int(host_slots.max()), 1)
    unit = int(np.lcm(process_count, batch_shards))
    need = -(-need * process_count // unit) * unit
    counts = tuple(range(unit, int(need.max()) + 1, unit))
    # A step at `counts[-1]` rows costs counts[-1] / batch unpacked steps.
    chosen = tasks_lib.choose_lengths(need, counts, cost * batch / counts[-1])
    step_rows = np.asarray(chosen)[np.searchsorted(chosen, need)]
    real_tokens = int((lengths[rows] * (weight != 0)).sum())
    logging.info("training batches of %d rows packed into rows of %d positions (config.packing), %d "
                 "sequences a row at most; rows a step: %s; real tokens fill %.0f%% of the positions "
                 "computed (%.0f%% unpacked)", batch, packed_length, slots, batches_per_length(chosen, need),
                 100 * real_tokens / max(int(step_rows.sum()) * packed_length, 1),
                 100 * real_tokens / max(rows.size * packed_length, 1))
    return step_rows, slots


def trim_arguments(buckets: int, max_seq_length: int, head: str) -> dict:
    """`lengths` and `sequence_keys` for `tasks.batches` / `stream_batches` with
    `config.trim_padding_buckets` = `buckets` (none for the span head, or with 0 buckets)."""
    if buckets < 0:
        raise ValueError(f"config.trim_padding_buckets={buckets} must be 0 (rows padded to "
                         "config.max_seq_length) or a number of lengths")
    lengths = tasks_lib.bucket_lengths(max_seq_length, buckets)
    keys = heads.sequence_keys(head)
    if len(lengths) < 2 or not keys:
        return {"lengths": None, "sequence_keys": ()}
    return {"lengths": lengths, "sequence_keys": keys}
