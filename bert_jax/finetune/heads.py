"""Fine-tuning heads on the BERT encoder, and their losses.

`BertForTask(config, head, num_outputs)` is the encoder (`params["bert"]`, the same tree as in
pretraining, so a pretrained encoder drops in) plus one small head (`params["head"]`):

| head | on | output | loss |
|---|---|---|---|
| classification | pooled [CLS] (dropout) | logits [batch, classes] | cross-entropy |
| regression | pooled [CLS] (dropout) | logits [batch] | squared error |
| span | every token | start_logits, end_logits [batch, length] | mean of start and end cross-entropy |
| token | every token (dropout) | logits [batch, length, classes] | cross-entropy on weighted tokens |
| multiple_choice | pooled [CLS] of each choice (dropout) | logits [batch, choices] | cross-entropy over choices |

Packed rows (several sequences a row, `bert_jax/finetune/row_packing.py`: `position_ids`, `pack_ids`)
feed the classification and regression heads, with `cls_positions` `[batch, slots]`: logits
`[batch, slots(, classes)]`, a label and weight per slot; and the token head, its labels and
weights per position as unpacked.

These are google-research/bert's `run_classifier.py` / `run_squad.py` output layers (truncated
normal 0.02 kernels, zero biases, dropout `hidden_dropout_prob` before the layer; SQuAD has none;
`config.head_init="normal"` draws the kernel as transformers does, `draw_head`)
and the paper's token and multiple-choice setups. Logits and losses are float32.

`loss_sums(head, outputs, batch)` returns sums plus weights (`loss_sum`, `weight`, `correct`), so
they average correctly over steps, hosts and padding rows (`batch["weight"]` 0).

This module must not import tensorflow.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from bert_jax.model.dropout import Dropout
from bert_jax.model.model_config import BertConfig
from bert_jax.model.layers import Dense
from bert_jax.model.modeling import BertModel
from data_pipeline.tasks import HEAD_KINDS, MODEL_INPUTS

# The head kinds and the model's inputs are the tasks' (`data_pipeline.tasks`): one list for both sides.
# Packed rows (bert_jax/finetune/row_packing.py), several sequences a row, also give these: for the
# heads that read each sequence's [CLS] (a label and weight per slot) or every position.
PACKED_INPUTS = ("position_ids", "pack_ids", "cls_positions")
PACKED_HEADS = ("classification", "regression", "token")
LABEL_KEYS = {
    "classification": ("label",),
    "regression": ("label",),
    "multiple_choice": ("label",),
    "span": ("start_positions", "end_positions"),
    "token": ("label_ids", "label_weights"),
}


# How the head's kernel starts (`config.head_init`): google-research/bert's truncated normal (stddev
# `initializer_range` before the cut at 2 stddev: 0.0176 after it for 0.02), or transformers' BERT
# (`_init_weights`: a plain normal of stddev `initializer_range`). The biases start at zero either way.
HEAD_INITS = ("truncated_normal", "normal")


def check_head_init(how: str) -> None:
    if how not in HEAD_INITS:
        raise ValueError(f"config.head_init={how!r}: expected one of {HEAD_INITS} (truncated_normal: "
                         "google-research/bert's head, normal: transformers')")


def draw_head(params: dict, how: str, rng: jax.Array, stddev: float) -> dict:
    """`params` (as `BertForTask.init` made them, the head's kernel a truncated normal) with the
    head's kernel drawn `how` (`HEAD_INITS`); the encoder and the head's bias as they were."""
    check_head_init(how)
    if how == "truncated_normal":
        return params
    kernel = params["head"]["output"]["kernel"]  # boxed with its logical axis names
    value = kernel.unbox()
    output = dict(params["head"]["output"],
                  kernel=kernel.replace_boxed(stddev * jax.random.normal(rng, value.shape, value.dtype)))
    return dict(params, head=dict(params["head"], output=output))


def model_inputs(batch: dict) -> dict:
    """The arguments of `BertForTask` a batch (packed or not) holds."""
    return {k: batch[k] for k in MODEL_INPUTS + PACKED_INPUTS if k in batch}


def batch_keys(head: str) -> tuple:
    """The feature arrays a step of `head` reads (everything else stays on the host)."""
    return MODEL_INPUTS + LABEL_KEYS[head] + ("weight",)


def sequence_keys(head: str) -> tuple:
    """The arrays of `batch_keys(head)` whose last axis is the sequence, when padding past a batch's
    longest row can be cut off without changing what a step computes: every head but "span", whose
    softmax runs over every position, padding included (as google-research/bert's run_squad.py)."""
    if head == "span":
        return ()
    return MODEL_INPUTS + (LABEL_KEYS[head] if head == "token" else ())


class OutputLayer(nn.Module):
    """Dropout then a dense layer `[..., hidden] -> [..., num_outputs]`, float32 logits."""

    config: BertConfig
    num_outputs: int
    dropout: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        cfg = self.config
        if self.dropout:
            x = Dropout(rate=cfg.hidden_dropout_prob)(x, deterministic=deterministic)
        logits = Dense(cfg, (cfg.hidden_size,), (self.num_outputs,), ("embed", "classes"), name="output")(x)
        return logits.astype(jnp.float32)


class BertForTask(nn.Module):
    """The encoder plus one fine-tuning head (module docstring)."""

    config: BertConfig
    head: str
    num_outputs: int

    @nn.compact
    def __call__(self, input_ids: jax.Array, input_mask: jax.Array, segment_ids: jax.Array,
                 position_ids: Optional[jax.Array] = None, pack_ids: Optional[jax.Array] = None,
                 cls_positions: Optional[jax.Array] = None, *, deterministic: bool = True) -> dict:
        if self.head not in HEAD_KINDS:
            raise ValueError(f"head must be one of {HEAD_KINDS}, got {self.head!r}")
        if pack_ids is not None and self.head not in PACKED_HEADS:
            raise ValueError(f"packed rows are for the {PACKED_HEADS} heads, not {self.head!r}")
        cfg = self.config
        choices = None
        if self.head == "multiple_choice":
            choices = input_ids.shape[1]
            # [batch, choices, length] -> [batch * choices, length]
            input_ids, input_mask, segment_ids = (
                x.reshape((-1, x.shape[-1])) for x in (input_ids, input_mask, segment_ids))
        # Sentence-level heads read the pooled [CLS] only: no other position of the last layer is
        # computed (`sparse_last_layer`).
        sentence = self.head in ("classification", "regression", "multiple_choice")
        out = BertModel(cfg, name="bert")(
            input_ids, input_mask, segment_ids, position_ids, pack_ids, cls_positions,
            output_positions=jnp.zeros((input_ids.shape[0], 0), jnp.int32) if sentence else None,
            deterministic=deterministic)
        if self.head in ("classification", "regression"):
            # [batch(, slots), classes]
            logits = OutputLayer(cfg, self.num_outputs, name="head")(out.pooled_output, deterministic)
            return {"logits": logits[..., 0] if self.head == "regression" else logits}
        if self.head == "multiple_choice":
            scores = OutputLayer(cfg, 1, name="head")(out.pooled_output, deterministic)  # [batch * choices, 1]
            return {"logits": scores.reshape((-1, choices))}  # [batch, choices]
        if self.head == "token":
            return {"logits": OutputLayer(cfg, self.num_outputs, name="head")(
                out.sequence_output, deterministic)}  # [batch, length, classes]
        # span: [batch, length, 2] -> two [batch, length]
        logits = OutputLayer(cfg, 2, dropout=False, name="head")(out.sequence_output, deterministic)
        return {"start_logits": logits[..., 0], "end_logits": logits[..., 1]}


def dummy_batch(head: str, max_seq_length: int, num_choices: int = 4) -> dict:
    """Zero inputs of one row, for `init` and `eval_shape`."""
    shape = (1, num_choices, max_seq_length) if head == "multiple_choice" else (1, max_seq_length)
    zeros = jnp.zeros(shape, jnp.int32)
    return {"input_ids": zeros, "input_mask": jnp.ones_like(zeros), "segment_ids": zeros}


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels.astype(jnp.int32))
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return nll, correct


def loss_sums(head: str, outputs: dict, batch: dict) -> dict:
    """Summed loss, weight and correct predictions (not for regression) of a batch (float32 scalars).

    `batch["weight"]` ([batch]) is 0 for padding and unlabelled rows; token heads also weight each
    position (`label_weights`: 1 on a word's first piece).
    """
    w = batch["weight"].astype(jnp.float32)
    if head in ("classification", "multiple_choice"):
        nll, correct = _cross_entropy(outputs["logits"], batch["label"])
        return {"loss_sum": jnp.sum(nll * w), "weight": jnp.sum(w), "correct": jnp.sum(correct * w)}
    if head == "regression":
        err = jnp.square(outputs["logits"] - batch["label"].astype(jnp.float32))
        return {"loss_sum": jnp.sum(err * w), "weight": jnp.sum(w)}  # no accuracy for a score
    if head == "span":
        s_nll, s_ok = _cross_entropy(outputs["start_logits"], batch["start_positions"])
        e_nll, e_ok = _cross_entropy(outputs["end_logits"], batch["end_positions"])
        return {"loss_sum": jnp.sum(0.5 * (s_nll + e_nll) * w), "weight": jnp.sum(w),
                "correct": jnp.sum(s_ok * e_ok * w)}
    if head == "token":
        tw = batch["label_weights"].astype(jnp.float32) * w[:, None]  # [batch, length]
        nll, correct = _cross_entropy(outputs["logits"], batch["label_ids"])
        return {"loss_sum": jnp.sum(nll * tw), "weight": jnp.sum(tw), "correct": jnp.sum(correct * tw)}
    raise ValueError(f"head must be one of {HEAD_KINDS}, got {head!r}")
