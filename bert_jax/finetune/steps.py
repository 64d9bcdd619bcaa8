"""The fine-tuning steps, pure functions over global arrays that the loop jits: a train step (the
head's summed loss over the summed weights, the guarded update), an eval step (the head's outputs
and summed losses), and `predict_split`, which runs the eval step over a split batch by batch and
returns its outputs in row order.

This module must not import tensorflow.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from bert_jax.finetune import bucketing, heads
from bert_jax.finetune.batches import batches
from bert_jax.training import sharding, train_state


def train_step(state: train_state.TrainState, batch: dict, *, model: heads.BertForTask,
               tx: optax.GradientTransformation, schedule) -> tuple[train_state.TrainState, dict]:
    """One optimizer step; loss = summed head loss / summed weight over the global batch."""
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def loss_fn(params):
        out = model.apply({"params": params}, **heads.model_inputs(batch), deterministic=False,
                          rngs={"dropout": rng})
        sums = heads.loss_sums(model.head, out, batch)
        return sums["loss_sum"] / jnp.maximum(sums["weight"], 1e-6), sums

    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state, guard = train_state.apply_guarded_update(state, grads, loss, tx)
    return new_state, dict(sums, loss=loss, learning_rate=schedule(state.step), **guard)


def eval_step(params: Any, batch: dict, *, model: heads.BertForTask) -> tuple[dict, dict]:
    """The head's outputs (to post-process on the host) and summed losses of one global batch."""
    out = model.apply({"params": params}, **heads.model_inputs(batch), deterministic=True)
    return out, heads.loss_sums(model.head, out, batch)


def predict_batches(split, *, keys, batch_size, lengths=None, sequence_keys=()):
    """This host's batches of `split` as `predict_split` runs them (and `(order, full length)`)."""
    order = None
    if lengths:
        order = np.argsort(bucketing.row_lengths(split.features["input_mask"]), kind="stable")
    rows = batches(split.features, keys, batch_size, process_index=jax.process_index(),
                   process_count=jax.process_count(), order=order, lengths=lengths, sequence_keys=sequence_keys)
    return rows, order


def predict_split(p_eval, params, split, *, mesh, keys, batch_size, lengths=None, sequence_keys=(),
                  before_call=None) -> tuple[dict, dict]:
    """Outputs of every feature row of `split` (numpy, in row order) and the summed losses.

    With `lengths` (`trim_arguments`), the rows go by length (a stable sort of their real
    positions), so each batch is cut to the shortest length holding its longest row; outputs
    with a sequence axis are padded back to the features' length with zeros, and everything is
    returned in row order again. `before_call(batch)` runs before each batch's call (a wait for
    its program, compiled ahead: `bert_jax.training.compile_ahead`)."""
    from tqdm import tqdm

    chunks: list = []
    sums = {"loss_sum": 0.0, "weight": 0.0}
    n = len(split.features["weight"])
    full = split.features["input_mask"].shape[-1]
    rows, order = predict_batches(split, keys=keys, batch_size=batch_size, lengths=lengths,
                                  sequence_keys=sequence_keys)
    for batch in tqdm(rows, total=bucketing.num_batches(n, batch_size), desc=f"predict {split.name}",
                      unit=" batches", leave=False, disable=jax.process_index() > 0, dynamic_ncols=True):
        length = batch["input_mask"].shape[-1]
        if before_call is not None:
            before_call(batch)
        outputs, batch_sums = p_eval(params, sharding.to_global(batch, mesh))
        outputs = multihost_utils.process_allgather(outputs, tiled=True)
        if length < full and "label_ids" in sequence_keys:  # token logits [rows, length, classes]
            outputs = {k: np.pad(v, [(0, 0), (0, full - length)] + [(0, 0)] * (v.ndim - 2))
                       for k, v in outputs.items()}
        chunks.append(outputs)
        for k in sums:
            sums[k] += float(batch_sums[k])
    outputs = {k: np.concatenate([c[k] for c in chunks])[:n] for k in chunks[0]}
    if order is not None:
        outputs = {k: _unsort(v, order) for k, v in outputs.items()}
    return outputs, sums


def _unsort(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    """`values[i]` belongs to row `order[i]`: the values in row order."""
    out = np.empty_like(values)
    out[order] = values
    return out
