"""Every batching decision of a fine-tuning run, planned before it starts (`plan_batches`).

- How many steps a run has and where its epochs end (`train_plan`: epochs over the feature rows,
  or Google's count from the examples).
- Which feature rows each training step takes (`training_rows`): epochs of `batches` (reshuffled
  each epoch, the last batch completed with weight-0 rows), or the stream of passes of
  `stream_batches` (Google's recipe).
- What each step's program is:
  - rows cut short of their padding (`trim_arguments`, `trim`; the lengths each batch needs,
    `training_needs` / `eval_batch_needs`, and of those the ones worth a compile,
    `bucketing.choose_lengths` at `compile_cost`), or
  - rows packed several to a row (`plan_packing`: the rows each step needs, and the counts that
    pay for their compile; `bert_jax.finetune.row_packing` packs them).

Everything here is a function of the data, the seed and the config's numbers, so every host and
a resumed run plan the same. `data_pipeline.tasks` reads and featurizes; the loop
(`bert_jax.finetune.loop`) calls `plan_batches` and iterates what it chose.

This module must not import tensorflow.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional, Sequence

import jax
import ml_collections
import numpy as np

from bert_jax.finetune import bucketing, heads, row_packing
from bert_jax.training import sharding


def stream_batches(features: dict, keys, global_batch_size: int, steps, *, seed: int,
                   process_index: int = 0, process_count: int = 1, lengths=None, sequence_keys=()):
    """The batches of `steps` (step k: rows `[k*B, (k+1)*B)`) of one stream of feature rows: pass
    `p` over the `n` rows is `RandomState(seed + p).permutation(n)` (the permutation the epoch
    loop uses for epoch p), and a batch may span two passes, as Google's `d.repeat()` then
    `d.batch(drop_remainder=True)`. Every row is real (weight as featurized). Each host yields its
    slice `[p*b, (p+1)*b)` of every global batch, as `batches`, which also
    says what `lengths` and `sequence_keys` do (padding past the global batch's longest row cut).
    """
    if global_batch_size % process_count:
        raise ValueError(f"batch size {global_batch_size} must divide by {process_count} processes")
    per_host = global_batch_size // process_count
    for everyone in stream_rows(len(features["weight"]), global_batch_size, steps, seed):
        rows = everyone[process_index * per_host:(process_index + 1) * per_host]
        out = {key: features[key][rows] for key in keys}
        out["weight"] = features["weight"][rows].astype(np.float32)
        yield trim(out, features, everyone, lengths, sequence_keys)


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
    row_length = bucketing.row_lengths(features["input_mask"])
    return bucketing.batch_needs(row_length, batch_size, np.argsort(row_length, kind="stable"))


def batches_per_length(lengths: tuple, needs: np.ndarray) -> str:
    counts = np.bincount(np.searchsorted(lengths, needs), minlength=len(lengths))
    return ", ".join(f"{n}: {int(c)}" for n, c in zip(lengths, counts))


def training_rows(n: int, global_batch_size: int, seed: int, total_steps: int, epochs: int,
                  stream: bool) -> tuple[np.ndarray, np.ndarray]:
    """`[steps, global_batch_size]`: the feature rows of every training step's global batch from
    step 0 (of `batches` per epoch, or of `stream_batches`), and whether each is real (not
    the completion of an epoch's last batch)."""
    if stream:
        rows = stream_rows(n, global_batch_size, range(total_steps), seed)
        return rows, np.ones(rows.shape, bool)
    epochs_rows = [bucketing.batch_rows(np.random.RandomState(seed + e).permutation(n), global_batch_size)
                   for e in range(epochs)]
    return np.concatenate([r for r, _ in epochs_rows]), np.concatenate([real for _, real in epochs_rows])


def training_needs(features: dict, global_batch_size: int, seed: int, total_steps: int, epochs: int,
                   stream: bool) -> np.ndarray:
    """The longest real row of the batch of every training step of the run, from step 0 (the
    batches of `batches` per epoch, or of `stream_batches`)."""
    row_length = bucketing.row_lengths(features["input_mask"])
    rows, _ = training_rows(len(row_length), global_batch_size, seed, total_steps, epochs, stream)
    return row_length[rows].max(axis=1)


def plan_packing(features: dict, rows: np.ndarray, real: np.ndarray, packed_length: int, *, cost: float,
                 batch_shards: int, process_count: Optional[int] = None) -> tuple[np.ndarray, int]:
    """How many rows each training step's packed global batch has, and the most sequences a row
    holds (the same in every step: the head's slots).

    `rows`/`real` are `training_rows`. Each host packs its slice of a global batch
    (`row_packing.pack`); a step has `process_count` times the most rows a host's slice needs, rounded
    up to divide over the `batch_shards` of the mesh. Of those counts, only the ones whose steps
    save more than their compile costs get a program (`bucketing.choose_lengths`; a compile costs
    `cost` unpacked steps of `global_batch_size` rows), each step running at the smallest chosen
    count that holds it.
    """
    process_count = process_count or jax.process_count()
    steps_, batch = rows.shape
    per_host = batch // process_count
    lengths = row_packing.sequence_lengths(features["input_mask"])
    weight = features["weight"][rows] * real
    # [steps, hosts]: what each host's slice of each step's batch takes.
    host_rows, host_slots = row_packing.needs(lengths[rows].reshape(steps_, process_count, per_host),
                                         weight.reshape(steps_, process_count, per_host), packed_length)
    need = np.maximum(host_rows.max(axis=1), 1)
    slots = max(int(host_slots.max()), 1)
    unit = int(np.lcm(process_count, batch_shards))
    need = -(-need * process_count // unit) * unit
    counts = tuple(range(unit, int(need.max()) + 1, unit))
    # A step at `counts[-1]` rows costs counts[-1] / batch unpacked steps.
    chosen = bucketing.choose_lengths(need, counts, cost * batch / counts[-1])
    step_rows = np.asarray(chosen)[np.searchsorted(chosen, need)]
    real_tokens = int((lengths[rows] * (weight != 0)).sum())
    logging.info("training batches of %d rows packed into rows of %d positions (config.packing), %d "
                 "sequences a row at most; rows a step: %s; real tokens fill %.0f%% of the positions "
                 "computed (%.0f%% unpacked)", batch, packed_length, slots, batches_per_length(chosen, need),
                 100 * real_tokens / max(int(step_rows.sum()) * packed_length, 1),
                 100 * real_tokens / max(rows.size * packed_length, 1))
    return step_rows, slots


def trim_arguments(buckets: int, max_seq_length: int, head: str) -> dict:
    """`lengths` and `sequence_keys` for `batches` / `stream_batches` with
    `config.trim_padding_buckets` = `buckets` (none for the span head, or with 0 buckets)."""
    if buckets < 0:
        raise ValueError(f"config.trim_padding_buckets={buckets} must be 0 (rows padded to "
                         "config.max_seq_length) or a number of lengths")
    lengths = bucketing.bucket_lengths(max_seq_length, buckets)
    keys = heads.sequence_keys(head)
    if len(lengths) < 2 or not keys:
        return {"lengths": None, "sequence_keys": ()}
    return {"lengths": lengths, "sequence_keys": keys}


def batches(features: dict[str, np.ndarray], keys: Sequence[str], global_batch_size: int, *,
            process_index: int = 0, process_count: int = 1, shuffle_seed: Optional[int] = None,
            order: Optional[np.ndarray] = None, lengths: Optional[Sequence[int]] = None,
            sequence_keys: Sequence[str] = ()) -> Iterator[dict[str, np.ndarray]]:
    """One pass over `features` in global batches, yielding this host's rows of each.

    Rows are shuffled with `shuffle_seed` (the same permutation on every host), taken in `order`
    (a permutation of the rows), or kept in order. The last batch is completed with weight-0
    copies of row 0, so nothing is dropped and every host yields the same number of batches. Host
    `p` holds rows `[p*b, (p+1)*b)` of each global batch (`b` = global / process_count), so the
    global arrays are in order.

    `lengths` (ascending, the last the features' length): each batch's `sequence_keys` are cut
    to the shortest of them that keeps every real position of the *global* batch's rows
    (`trimmed_length` of its `input_mask`), the same on every host.
    """
    n = len(features["weight"])
    if n == 0:
        raise ValueError("no feature rows to batch")
    if global_batch_size % process_count:
        raise ValueError(f"batch size {global_batch_size} must divide by {process_count} processes")
    if order is None:
        order = np.arange(n) if shuffle_seed is None else np.random.RandomState(shuffle_seed).permutation(n)
    per_host = global_batch_size // process_count
    for idx, real in zip(*bucketing.batch_rows(np.asarray(order), global_batch_size)):
        lo, hi = process_index * per_host, (process_index + 1) * per_host
        rows, keep = idx[lo:hi], real[lo:hi]
        out = {k: features[k][rows] for k in keys}
        out["weight"] = np.where(keep, features["weight"][rows], 0.0).astype(np.float32)
        yield trim(out, features, idx, lengths, sequence_keys)


def trim(batch: dict, features: dict, rows: np.ndarray, lengths: Optional[Sequence[int]],
         sequence_keys: Sequence[str]) -> dict:
    """`batch` with its `sequence_keys` cut to the `trimmed_length` of the `rows` of `features`
    (the global batch's rows: every host cuts its slice to the same length)."""
    if not lengths or not sequence_keys:
        return batch
    mask = features["input_mask"][rows]
    length = bucketing.trimmed_length(mask, lengths)
    if length == mask.shape[-1]:
        return batch
    return {k: v[..., :length] if k in sequence_keys else v for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# The plan of a run: its steps, and what each step's batch is
# ---------------------------------------------------------------------------------------------


STEPS_FROM = ("epochs", "examples")


def train_plan(config: ml_collections.ConfigDict, num_examples: int, num_rows: int) -> tuple[int, int, list]:
    """(total steps, warmup steps, the step at which each epoch ends) for `config`.

    `num_train_steps_from="epochs"`: `num_train_epochs` passes over the `num_rows` feature rows,
    each in `ceil(rows / batch)` batches (the last completed with weight-0 rows).
    `"examples"`: google-research/bert's count, `int(num_examples / batch * epochs)` steps, where
    an example is a question for SQuAD (a feature row is a window of one) and a sentence pair
    for GLUE; the batches are full ones cut from one stream of feature rows (`stream_batches`), and
    an "epoch" (an evaluation) ends with the batch that completes a pass over the rows, or at the
    last step.

    Example: 10 examples (10 rows), batch 4, 3 epochs, warmup_proportion 0.1: "epochs" gives
    3 * 3 = 9 steps and epochs ending at [3, 6, 9]; "examples" gives int(10 / 4 * 3) = 7 steps,
    int(7 * 0.1) = 0 warmup, epochs ending at [3, 5, 7].
    """
    batch, epochs = config.global_batch_size, config.num_train_epochs
    steps_from = config.get("num_train_steps_from", "epochs")
    if steps_from == "epochs":
        if epochs != int(epochs):
            raise ValueError(f"config.num_train_epochs={epochs} must be a whole number with "
                             "num_train_steps_from='epochs' (a fraction needs 'examples')")
        per_epoch = -(-num_rows // batch)
        total = int(epochs) * per_epoch
    elif steps_from == "examples":
        total = int(num_examples / batch * epochs)  # run_classifier.py, run_squad.py
    else:
        raise ValueError(f"config.num_train_steps_from must be one of {STEPS_FROM}, got {steps_from!r}")
    if total <= 0:
        raise ValueError(f"config.num_train_epochs={epochs} with {num_rows} training rows ({num_examples} "
                         f"examples) and global_batch_size={batch} gives no training step "
                         f"(num_train_steps_from={steps_from!r})")
    if not 0 <= config.warmup_proportion <= 1:
        raise ValueError(f"config.warmup_proportion={config.warmup_proportion} must be in [0, 1]")
    if steps_from == "epochs":
        ends = [per_epoch * (e + 1) for e in range(int(epochs))]
    else:
        ends, passes = [], 0
        while not ends or ends[-1] < total:
            passes += 1  # the batch holding the last row of pass `passes` ends an epoch
            end = min(-(-passes * num_rows // batch), total)
            if not ends or end > ends[-1]:
                ends.append(end)
    return total, int(total * config.warmup_proportion), ends


COMPILE_COST_AUTO = {"cpu": 8.0}  # else ACCELERATOR_COMPILE_COST


ACCELERATOR_COMPILE_COST = 1000.0


# An evaluation program (forward only) compiles in about an eighth of the training step's time
# (MiniLM on 2 CPU cores: 1.4-1.8 s against 12.7 s), and a forward pass costs about a third of a
# training step per row: evaluation's compile cost, in its own batches, follows from training's.
FORWARD_COMPILE_SHARE = 1 / 8


FORWARD_STEP_SHARE = 1 / 3


def compile_cost(config: ml_collections.ConfigDict) -> float:
    """What compiling one more length costs, in training steps at `max_seq_length`
    (`config.trim_padding_compile_cost`; -1 = measured defaults for the backend: 8 on CPU, where
    all-MiniLM-L6-v2's step at batch 32, length 64 compiles in 12.7 s and runs in 1.6 s on two
    cores; 1000 on GPUs and TPUs, where BERT-Base's step at batch 128 compiled in ~41 s and ran in
    ~49 ms on an H100, benchmarks/step/RESULTS.md: ~840 steps, and more at fine-tuning's batch 32)."""
    cost = float(config.get("trim_padding_compile_cost", -1))
    if cost == -1:
        return COMPILE_COST_AUTO.get(jax.default_backend(), ACCELERATOR_COMPILE_COST)
    if cost < 0:
        raise ValueError(f"config.trim_padding_compile_cost={cost}: -1 (the backend's default), "
                         "0 (every length a batch needs) or a number of steps")
    return cost


def plan_batches(config: ml_collections.ConfigDict, task, train, evals: list, mesh, total_steps: int,
                  epochs: int, stream: bool, eval_batch: int) -> tuple[dict, dict, Any, Any]:
    """Training's and evaluation's trimming (`batches`' `lengths` and `sequence_keys`) and,
    when training batches are packed (`config.packing`), each step's packed rows and the slots a
    row has (else None, None). Only the lengths and row counts whose steps save more than their
    compile costs are chosen; every choice is a function of the data, the seed and the config: the
    same on every host and on resuming."""
    max_len, batch = config.max_seq_length, config.global_batch_size
    buckets = config.get("trim_padding_buckets", 0)
    trimming = eval_trimming = trim_arguments(buckets, max_len, task.head)
    cost = compile_cost(config)
    asked = bool(config.get("packing", False))
    packing = asked and task.head in heads.PACKED_HEADS
    if asked and not packing:
        logging.info("config.packing: the %s head trains on unpacked rows (packing is for %s)",
                     task.head, heads.PACKED_HEADS)
    step_rows = slots = None
    if packing:
        rows, real = training_rows(len(train.features["weight"]), batch, config.seed,
                                                    total_steps, epochs, stream)
        step_rows, slots = plan_packing(
            train.features, rows, real, max_len, cost=cost,
            batch_shards=sharding.axis_size(mesh, sharding.BATCH_AXES))
    if not trimming["lengths"]:
        return trimming, eval_trimming, step_rows, slots
    eval_needs = np.tile(np.concatenate([eval_batch_needs(s.features, eval_batch) for s in evals]
                                        or [np.zeros(0, np.int64)]), epochs)
    eval_batch_cost = FORWARD_STEP_SHARE * eval_batch / batch  # in training steps
    eval_cost = cost * FORWARD_COMPILE_SHARE / eval_batch_cost
    chosen = {"evaluation": bucketing.choose_lengths(eval_needs, trimming["lengths"], eval_cost)}
    needs = {"evaluation": eval_needs}
    if not packing:
        needs["training"] = training_needs(train.features, batch, config.seed, total_steps,
                                                            epochs, stream)
        chosen["training"] = bucketing.choose_lengths(needs["training"], trimming["lengths"], cost)
    logging.info("batches cut to the shortest length holding their longest row, out of %s "
                 "(config.trim_padding_buckets=%d), where the steps saved pay for the compile (one "
                 "costs %g training steps, config.trim_padding_compile_cost): %s", trimming["lengths"],
                 buckets, cost, "; ".join(f"{k} {batches_per_length(v, needs[k])}"
                                           for k, v in chosen.items()))
    return (dict(trimming, lengths=chosen.get("training")), dict(trimming, lengths=chosen["evaluation"]),
            step_rows, slots)
