"""The arithmetic of a fine-tuning run's lengths: each row's real length, the lengths a batch may be
cut to, what each batch needs, and which lengths (or packed row counts) are worth a compiled
program. Pure numpy on host arrays; `bert_jax.finetune.batches` makes the decisions with these.

This module imports neither jax nor tensorflow.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

def num_batches(num_rows: int, global_batch_size: int) -> int:
    return max(1, math.ceil(num_rows / global_batch_size))


def bucket_lengths(max_seq_length: int, buckets: int) -> tuple[int, ...]:
    """The lengths a batch may be cut to: `buckets` evenly spaced lengths up to `max_seq_length`,
    each rounded up to a multiple of 8 (0 or 1 bucket: `max_seq_length` alone).

    Example: 64 and 4 buckets -> (16, 32, 48, 64); 128 and 4 -> (32, 64, 96, 128); 100 and 3 ->
    (40, 72, 100).
    """
    if buckets < 0:
        raise ValueError(f"buckets={buckets} must be 0 (no trimming) or more")
    if buckets <= 1:
        return (max_seq_length,)
    lengths = {min(max_seq_length, 8 * math.ceil(math.ceil(max_seq_length * (i + 1) / buckets) / 8))
               for i in range(buckets)}
    return tuple(sorted(lengths | {max_seq_length}))


def row_lengths(input_mask: np.ndarray) -> np.ndarray:
    """Each row's last real position + 1 (`input_mask`: `[rows, ..., max_len]`; over every choice of
    a multiple-choice row); 0 for a row without one."""
    real = np.asarray(input_mask).reshape(len(input_mask), -1, input_mask.shape[-1]).any(axis=1)
    return np.where(real.any(axis=1), real.shape[1] - np.argmax(real[:, ::-1], axis=1), 0)


def trimmed_length(input_mask: np.ndarray, lengths: Sequence[int]) -> int:
    """The shortest of `lengths` (ascending) that keeps every real position of the rows
    `input_mask` (`[rows, ..., max_len]`, 1 on real positions): past it every row is padding."""
    need = int(row_lengths(input_mask).max(initial=1))
    return next((n for n in lengths if n >= need), input_mask.shape[-1])


def batch_needs(row_length: np.ndarray, global_batch_size: int, order: np.ndarray) -> np.ndarray:
    """The longest real row of each global batch `batches` makes of the rows in `order` (its last
    batch completed with row 0, as there): per batch, what `trimmed_length` cuts to.

    Example: row lengths [5, 9, 3, 7, 2], batch 2, order [4, 2, 0, 1, 3] -> batches (4, 2), (0, 1),
    (3, 0) -> [3, 9, 7]."""
    rows, _ = batch_rows(np.asarray(order, np.int64), global_batch_size)
    return np.asarray(row_length)[rows].max(axis=1)


def batch_rows(order: np.ndarray, global_batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`order` cut into global batches, the last completed with row 0: `[batches, size]` row
    indices and whether each is real (False for the completion)."""
    full = num_batches(len(order), global_batch_size) * global_batch_size
    rows = np.concatenate([order, np.zeros(full - len(order), order.dtype)]).reshape(-1, global_batch_size)
    real = (np.arange(full) < len(order)).reshape(-1, global_batch_size)
    return rows, real


def choose_lengths(needs: Sequence[int], lengths: Sequence[int], compile_cost: float) -> tuple[int, ...]:
    """The lengths worth a compiled program, out of `lengths` (ascending), for batches whose
    longest rows are `needs` (every batch of a run, in any order).

    Each batch runs at the shortest chosen length that holds it. A step is assumed to cost in
    proportion to its length, one at `lengths[-1]` costing 1, and compiling a length
    `compile_cost` such steps. The choice minimizes compiles plus steps, exactly (dynamic
    programming over the lengths some batch needs; ties go to fewer lengths). `compile_cost=0`
    gives every length some batch needs, as if compiling were free.

    Example: lengths (16, 32, 48, 64), 11 batches need 32, 43 need 48, 9 need 64. Compiling costs
    8 steps: (48, 64) costs 16 + 54 * 0.75 + 9 = 65.5, against 71 for (64,) alone and 70.75 for
    all three.
    """
    lengths = [int(n) for n in lengths]
    if not lengths or lengths != sorted(set(lengths)):
        raise ValueError(f"lengths {lengths} must be ascending and distinct")
    if compile_cost < 0:
        raise ValueError(f"compile_cost={compile_cost} must not be negative")
    needs = np.asarray(needs, np.int64)
    if needs.size == 0:
        return (lengths[-1],)
    if needs.max() > lengths[-1]:
        raise ValueError(f"a batch needs {needs.max()} positions, past the longest length {lengths[-1]}")
    counts = np.bincount(np.searchsorted(lengths, needs), minlength=len(lengths))
    used = [j for j in range(len(lengths)) if counts[j]]  # an unused length never pays for its compile
    top = lengths[-1]
    best: dict = {-1: (0.0, ())}  # used[k] chosen as the longest so far -> (cost, chosen lengths)
    for k, j in enumerate(used):
        options = []
        for i in range(-1, k):
            below = used[i] if i >= 0 else -1
            served = int(counts[below + 1:j + 1].sum())
            cost, chosen = best[i]
            options.append((cost + compile_cost + served * lengths[j] / top, len(chosen) + 1, chosen + (lengths[j],)))
        cost, _, chosen = min(options)
        best[k] = (cost, chosen)
    return best[len(used) - 1][1]
