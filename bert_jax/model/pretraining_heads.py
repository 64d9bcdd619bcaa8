"""The pretraining heads on the BERT encoder: `MlmHead` (masked LM, its decoder tied to the word
embeddings, applied at the masked positions only), `NspHead` (next-sentence prediction) and
`BertForPreTraining` (`modeling.BertModel` + both heads), returning `PreTrainingOutput`.

The parameter tree is `bert` (the encoder, as in `modeling.BertModel`), `mlm` and `nsp`, the same
names as Google's checkpoints map onto (`bert_jax.formats`). The fine-tuning heads are in
`bert_jax.finetune.heads`.

This module must not import tensorflow.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from bert_jax.model import mixed_precision
from bert_jax.model.model_config import BertConfig
from bert_jax.model.layers import LayerNorm, activation_fn, make_dense, zeros_init
from bert_jax.model.modeling import ACT_EMBED, ACT_MLP, BertModel

Array = jax.Array


class MlmHead(nn.Module):
    """Masked-LM head: transform (dense + activation + LayerNorm), then the decoder tied to the
    word-embedding matrix plus an output bias; float32 logits over the real vocabulary.

    It is applied to the gathered masked positions only, so the vocabulary projection costs
    `num_predictions`, not `length`, rows.
    """

    config: BertConfig

    @nn.compact
    def __call__(self, x: Array, word_embeddings: Array) -> Array:
        cfg = self.config
        h = make_dense(cfg, cfg.hidden_size, ("embed", "mlp"), "transform")(x)  # [batch, predictions, hidden]
        h = nn.with_logical_constraint(h, ACT_MLP)
        h = activation_fn(cfg.hidden_act)(h)
        h = LayerNorm(cfg, name="transform_norm")(h)
        bias = self.param("output_bias", zeros_init(("vocab",)), (cfg.vocab_size,), cfg.params_dtype)
        pad = cfg.padded_vocab_size - cfg.vocab_size
        # The decoder matmul runs on a vocab dim padded to a multiple of vocab_pad_multiple (faster
        # tiles); the parameters keep the real size so checkpoints and counts are exact.
        emb = jnp.pad(word_embeddings, ((0, pad), (0, 0))).astype(cfg.compute_dtype)  # [vocab_p, hidden]
        # [batch, predictions, vocab_p]
        if cfg.mixed_matmuls:  # bf16 inputs, float32 out (bert_jax.model.mixed_precision)
            logits = mixed_precision.einsum("bph,vh->bpv", h, emb)
        elif h.dtype == jnp.float32:
            logits = jnp.einsum("bph,vh->bpv", h, emb, preferred_element_type=jnp.float32)
        else:
            logits = _low_precision_grad_logits(h, emb)
        logits = logits[..., :cfg.vocab_size] + bias.astype(jnp.float32)  # [batch, predictions, vocab]
        return logits


@jax.custom_vjp
def _low_precision_grad_logits(h: Array, emb: Array) -> Array:
    """`einsum("bph,vh->bpv")` of low-precision (bf16/f16) operands with float32 logits, whose
    backward runs in the operands' dtype (float32 accumulation) instead of float32.

    Autodiff of the float32-output einsum would send the float32 logits gradient into both
    transposed matmuls, promoting them to float32 GEMMs (2.2 ms of BERT-Large's H100 step) for
    gradients that are then cast back to bf16 anyway.
    """
    return jnp.einsum("bph,vh->bpv", h, emb, preferred_element_type=jnp.float32)


def _low_precision_grad_logits_fwd(h, emb):
    return _low_precision_grad_logits(h, emb), (h, emb)


def _low_precision_grad_logits_bwd(res, g):
    h, emb = res
    g = g.astype(h.dtype)
    dh = jnp.einsum("bpv,vh->bph", g, emb, preferred_element_type=jnp.float32).astype(h.dtype)
    demb = jnp.einsum("bpv,bph->vh", g, h, preferred_element_type=jnp.float32).astype(emb.dtype)
    return dh, demb


_low_precision_grad_logits.defvjp(_low_precision_grad_logits_fwd, _low_precision_grad_logits_bwd)


class NspHead(nn.Module):
    """Next-sentence prediction: a 2-way classifier on the pooled output (label 1 = random next)."""

    config: BertConfig

    @nn.compact
    def __call__(self, pooled: Array) -> Array:
        cfg = self.config
        logits = make_dense(cfg, 2, ("embed", "classes"), "dense")(pooled)  # [batch, 2] or [batch, num_seqs, 2]
        return logits.astype(jnp.float32)


@dataclasses.dataclass
class PreTrainingOutput:
    mlm_logits: Array  # [batch, max_predictions, vocab_size], float32
    nsp_logits: Array  # [batch, 2] (or [batch, num_seqs, 2] when packed), float32
    # [batch, max_predictions, hidden]: the last layer at masked_lm_positions (the only positions
    # it computes with sparse_last_layer; `BertModel` gives the whole sequence).
    masked_output: Array
    pooled_output: Array


jax.tree_util.register_dataclass(
    PreTrainingOutput, data_fields=["mlm_logits", "nsp_logits", "masked_output", "pooled_output"],
    meta_fields=[])


class BertForPreTraining(nn.Module):
    """`BertModel` + masked-LM head at `masked_lm_positions` + NSP head.

    With `sparse_last_layer` the last encoder layer computes only the masked positions and the
    [CLS] rows: the logits are the same, and BERT-Base at length 128 with 20 predictions skips
    ~70% of one layer's work (about 6% of the step).
    """

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids: Array, input_mask: Array, segment_ids: Array,
                 masked_lm_positions: Array, position_ids: Optional[Array] = None,
                 pack_ids: Optional[Array] = None, cls_positions: Optional[Array] = None, *,
                 deterministic: bool = True) -> PreTrainingOutput:
        cfg = self.config
        # The last layer's output at the masked positions (computed there only where that saves work).
        out = BertModel(cfg, name="bert")(
            input_ids, input_mask, segment_ids, position_ids, pack_ids, cls_positions,
            masked_lm_positions, deterministic=deterministic)
        word_embeddings = self.variables["params"]["bert"]["embeddings"]["word_embeddings"]
        # The decoder reuses the embedding matrix: gather its hidden dim (FSDP) and keep the vocab
        # on the tensor axis, so the logits come out vocab-sharded. Pinning this layout matters for
        # correctness too: without the constraint, XLA's SPMD partitioner (jax 0.10, CPU) gave
        # wrong gradients for the tied matrix on a data x fsdp x tensor = 2x2x2 mesh
        # (tests/training/test_training.py compares every mesh against one device).
        word_embeddings = nn.with_logical_constraint(nn.meta.unbox(word_embeddings), ("vocab", None))
        masked = nn.with_logical_constraint(out.sequence_output, ACT_EMBED)  # [batch, preds, hidden]
        mlm_logits = MlmHead(cfg, name="mlm")(masked, word_embeddings)
        nsp_logits = NspHead(cfg, name="nsp")(out.pooled_output)
        return PreTrainingOutput(mlm_logits=mlm_logits, nsp_logits=nsp_logits, masked_output=masked,
                                 pooled_output=out.pooled_output)
