"""The pretraining losses, and the pure train / eval steps.

Steps are pure functions `train_step(state, batch) -> (state, metrics)` over global arrays; the loop
module jits them once with in/out shardings and donation. Metrics come back as *sums plus weights*
(`mlm_loss_sum`, `mlm_weight`, ...) so that they average correctly over steps, hosts and padding.

Losses follow google-research/bert's `run_pretraining.py`:
- masked LM: `sum(weights * nll) / (sum(weights) + 1e-5)` over the real predictions of the batch;
- next sentence: mean cross-entropy over examples (label 1 = the second segment is random);
- total = masked LM + next sentence (the NSP term is dropped by `use_nsp=False`, the paper's
  "No NSP" ablation). `objective="ltr"` trains a left-to-right language model instead (predict
  token t+1 at position t; use with `causal_attention=True`), the paper's "LTR & No NSP" ablation.

Gradient accumulation splits the global batch into `accum_steps` interleaved micro-batches inside
one jitted step (`lax.scan`) and normalizes by the *whole* batch's weights, so the update equals
the one of the undivided batch (up to float summation order).

Non-finite steps never touch the parameters or the optimizer state: the update is dropped and the
`finite` metric is 0; the loop decides whether to stop or to go on.

This module must not import tensorflow.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from bert_jax.model.model_config import BertConfig
from bert_jax.training.sharding import BATCH_AXES
from bert_jax.training.train_state import TrainState, apply_guarded_update, model_variables

MODEL_INPUTS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "position_ids",
                "pack_ids", "cls_positions")


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def _nll_and_correct(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position negative log-likelihood and 0/1 correctness, float32."""
    logits = logits.astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels.astype(jnp.int32))
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return nll, correct


def nsp_labels_and_weights(batch: dict) -> tuple[jax.Array, jax.Array]:
    labels = batch["next_sentence_labels"]
    if labels.ndim == 2 and "pack_ids" not in batch:
        labels = labels[:, 0]  # Google's [batch, 1]
    weights = batch.get("next_sentence_weights")
    if weights is None:
        weights = jnp.ones(labels.shape, jnp.float32)
    return labels, weights.astype(jnp.float32)


def restore_original_ids(batch: dict) -> jax.Array:
    """The unmasked tokens: `input_ids` with each real masked position set back to its label."""
    ids = batch["input_ids"]
    pos = batch["masked_lm_positions"].astype(jnp.int32)
    real = batch["masked_lm_weights"] > 0
    rows = jnp.arange(ids.shape[0])[:, None]
    # Padding predictions point at position 0 ([CLS]) with weight 0: write [CLS] back unchanged.
    values = jnp.where(real, batch["masked_lm_ids"], ids[rows, pos]).astype(ids.dtype)
    return ids.at[rows, pos].set(values)


def ltr_targets(batch: dict) -> dict:
    """Left-to-right LM: inputs are the original tokens, the target at position t is token t+1."""
    ids = restore_original_ids(batch)
    length = ids.shape[1]
    positions = jnp.broadcast_to(jnp.arange(length - 1, dtype=jnp.int32), (ids.shape[0], length - 1))
    weights = (batch["input_mask"][:, 1:] > 0).astype(jnp.float32)
    return dict(batch, input_ids=ids, masked_lm_positions=positions, masked_lm_ids=ids[:, 1:],
                masked_lm_weights=weights)


def pretraining_sums(outputs, batch: dict) -> dict:
    """Sums and weights of the masked-LM and NSP losses and accuracies (float32); the NSP ones are 0
    for a model without NSP logits (`nsp_logits` None: ModernBERT, `pretrain/model_family.py`)."""
    mlm_nll, mlm_correct = _nll_and_correct(outputs.mlm_logits, batch["masked_lm_ids"])
    w = batch["masked_lm_weights"].astype(jnp.float32)
    sums = {"mlm_loss_sum": jnp.sum(mlm_nll * w), "mlm_correct": jnp.sum(mlm_correct * w), "mlm_weight": jnp.sum(w)}
    if outputs.nsp_logits is None:
        return dict(sums, **{k: jnp.zeros((), jnp.float32) for k in ("nsp_loss_sum", "nsp_correct", "nsp_weight")})
    labels, nsp_w = nsp_labels_and_weights(batch)
    nsp_nll, nsp_correct = _nll_and_correct(outputs.nsp_logits, labels)
    return dict(sums, nsp_loss_sum=jnp.sum(nsp_nll * nsp_w), nsp_correct=jnp.sum(nsp_correct * nsp_w),
                nsp_weight=jnp.sum(nsp_w))


def combine_loss(sums: dict, mlm_total: jax.Array, nsp_total: jax.Array, use_nsp: bool) -> jax.Array:
    """Google's normalization: MLM over (total weight + 1e-5), NSP mean over examples."""
    loss = sums["mlm_loss_sum"] / (mlm_total + 1e-5)
    if use_nsp:
        loss = loss + sums["nsp_loss_sum"] / jnp.maximum(nsp_total, 1.0)
    return loss


def _model_inputs(batch: dict) -> dict:
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------


def _split_micro_batches(batch: dict, k: int, mesh=None) -> dict:
    """[B, ...] -> [k, B/k, ...], micro-batch i = rows i, i+k, i+2k, ...

    Interleaving keeps every device's contiguous block of rows spread over all micro-batches, so
    each micro-step is balanced across the data-parallel devices.
    """
    def split(x):
        b = x.shape[0]
        if b % k:
            raise ValueError(f"batch of {b} rows is not divisible by config.grad_accum_steps={k}")
        y = x.reshape((b // k, k) + x.shape[1:])  # [B/k, k, ...]
        y = jnp.swapaxes(y, 0, 1)  # [k, B/k, ...]
        if mesh is None:
            return y
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, BATCH_AXES)))

    return jax.tree_util.tree_map(split, batch)


def train_step(state: TrainState, batch: dict, *, model, tx: optax.GradientTransformation,
               schedule: Callable, accum_steps: int = 1, use_nsp: bool = True,
               objective: str = "mlm", mesh=None) -> tuple[TrainState, dict]:
    """One optimizer step on a global batch; returns the new state and summed metrics.

    `mesh` (optional) keeps accumulation micro-batches sharded over the batch axes.
    """
    if objective == "ltr":
        batch = ltr_targets(batch)
    elif objective != "mlm":
        raise ValueError(f"config.objective must be 'mlm' or 'ltr', got {objective!r}")
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    mlm_total = jnp.sum(batch["masked_lm_weights"].astype(jnp.float32))
    nsp_total = jnp.sum(nsp_labels_and_weights(batch)[1])

    def loss_fn(params, fp8, micro, key):
        out = model.apply(model_variables(params, fp8), **_model_inputs(micro), deterministic=False,
                          rngs={"dropout": key})
        sums = pretraining_sums(out, micro)
        return combine_loss(sums, mlm_total, nsp_total, use_nsp), sums

    # The FP8 state's "gradient" is its next value (None without FP8).
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    if accum_steps == 1:
        (loss, sums), (grads, fp8) = grad_fn(state.params, state.fp8, batch, rng)
    else:
        micro_batches = _split_micro_batches(batch, accum_steps, mesh)

        def body(carry, xs):
            i, micro = xs
            g, l, s, fp8_i = carry
            # Each micro-batch scales with the state the one before it left (as separate steps would).
            (loss_i, sums_i), (grads_i, fp8_i) = grad_fn(state.params, fp8_i, micro,
                                                         jax.random.fold_in(rng, i))
            return (jax.tree_util.tree_map(jnp.add, g, grads_i), l + loss_i,
                    jax.tree_util.tree_map(jnp.add, s, sums_i), fp8_i), None

        zeros_g = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        zeros_s = {k: jnp.zeros((), jnp.float32) for k in
                   ("mlm_loss_sum", "mlm_correct", "mlm_weight", "nsp_loss_sum", "nsp_correct", "nsp_weight")}
        (grads, loss, sums, fp8), _ = jax.lax.scan(
            body, (zeros_g, jnp.zeros((), jnp.float32), zeros_s, state.fp8),
            (jnp.arange(accum_steps), micro_batches))

    new_state, guard = apply_guarded_update(state, grads, loss, tx)
    if fp8 is not None:  # a non-finite step leaves the scales as they were, like the parameters
        finite = guard["finite"] > 0
        new_state = new_state.replace(fp8=jax.tree_util.tree_map(
            lambda new, old: jnp.where(finite, new, old), fp8, state.fp8))
    metrics = dict(sums, loss=loss, learning_rate=schedule(state.step), **guard)
    return new_state, metrics


def eval_step(params: Any, batch: dict, *, model, objective: str = "mlm") -> dict:
    """Summed losses and accuracies on one global batch (padding rows carry weight 0)."""
    if objective == "ltr":
        batch = ltr_targets(batch)
    out = model.apply({"params": params}, **_model_inputs(batch), deterministic=True)
    return pretraining_sums(out, batch)


def summarize(sums: dict) -> dict:
    """Weighted means from summed metrics (what the reference's metric_fn reports)."""
    mlm_w = max(float(sums["mlm_weight"]), 1e-9)
    nsp_w = max(float(sums["nsp_weight"]), 1e-9)
    return {
        "masked_lm_loss": float(sums["mlm_loss_sum"]) / mlm_w,
        "masked_lm_accuracy": float(sums["mlm_correct"]) / mlm_w,
        "next_sentence_loss": float(sums["nsp_loss_sum"]) / nsp_w,
        "next_sentence_accuracy": float(sums["nsp_correct"]) / nsp_w,
    }


# ---------------------------------------------------------------------------------------------
# FLOPs (for MFU)
# ---------------------------------------------------------------------------------------------


def train_flops_per_sequence(config: BertConfig, seq_len: int, num_predictions: int,
                             last_layer_positions: Optional[int] = None) -> float:
    """Matmul FLOPs of one training step per sequence (forward + backward = 3x forward).

    Per layer: Q/K/V/output projections 4·H², feed-forward 2·H·I, per token; attention scores and
    context 2·T²·H. The MLM head runs at `num_predictions` positions only: transform H² and the
    decoder H·V. BERT-large at T=128 with 20 predictions: ~241 GFLOP.

    This is the model's count, the one the usual MFU figures use: the last layer counts at every
    position even when `sparse_last_layer` computes it at the masked positions and [CLS] only
    (BERT-Large then runs ~3% fewer FLOPs than this, BERT-Base ~6%). `last_layer_positions=Q`
    counts what such a step executes instead: the last layer's keys and values at all T positions,
    its queries, attention, output projection and feed-forward at Q.
    """
    h, i, t, v = config.hidden_size, config.intermediate_size, seq_len, config.vocab_size

    def layer(q):  # q query positions attending over t keys
        return 2 * t * 2 * h * h + 2 * q * (2 * h * h + 2 * h * i) + 2 * 2 * q * t * h

    last = layer(t if last_layer_positions is None else last_layer_positions)
    head = 2 * num_predictions * (h * h + h * v) + 2 * (h * h + 2 * h)  # MLM + pooler/NSP
    return 3.0 * ((config.num_hidden_layers - 1) * layer(t) + last + head)
