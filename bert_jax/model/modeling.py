"""The BERT encoder (`BertModel`: embeddings, encoder, pooler), exact to Google's reference.

This module owns the network and nothing else: the embeddings, self-attention,
feed-forward, the encoder over L layers (optionally through `nn.scan` and `nn.remat`), the pooler,
and the parameter-tree utilities around them (counts, stacking layers for `nn.scan`). The heads
on top have modules of their own: the pretraining ones (masked LM, next-sentence prediction,
`BertForPreTraining`) in `bert_jax.model.pretraining_heads`, the fine-tuning ones in `bert_jax.finetune.heads`.

Four subjects it uses live beside it: `bert_jax.model.model_config` (`BertConfig`, a frozen dataclass
with the fields of Google's `bert_config.json` plus our performance options), `bert_jax.model.layers`
(`Dense`, `LayerNorm`, the activations and initializers, `dropout_add_norm`: the building blocks),
`bert_jax.model.attention` (the masks and the attention kernels: einsum, cuDNN, TPU splash) and
`bert_jax.model.dropout` (`keep_mask`, `Dropout`); import their names from them
(`bert_jax.model.model_config.BertConfig`).

Numerics: parameters are created in `param_dtype` (float32); matmuls run in the compute `dtype`
(bfloat16 on accelerators); LayerNorm, the attention softmax and all logits are float32.

Every parameter carries logical axis names (see `bert_jax.training.sharding` for the rule table); without a
mesh the names are inert and the model runs unsharded.

This module must not import tensorflow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
from flax.linen import fp8_ops
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.model import mixed_precision
from bert_jax.model.kernels import fused_ffn, fused_fp8, fused_qkv
from bert_jax.model.attention import ACT_HEADS, attention, make_attention_mask, make_sequence_ids
from bert_jax.model.dropout import Dropout
from bert_jax.model.layers import (FP8_COLLECTION, Dense, DenseParams, LayerNorm, activation_fn, dropout_add_norm,
                                   folds_output_bias, kernel_init, make_dense)
from bert_jax.model.model_config import BertConfig

Array = jax.Array

# Logical names of activations (distinct from the parameters' names: the batch of activations is
# sharded over (data, fsdp), so their hidden dimension must not also be sharded over fsdp). q, k and
# v's, ACT_HEADS, are `bert_jax.model.attention`'s.
ACT_EMBED = ("activation_batch", "activation_length", "activation_embed")
ACT_MLP = ("activation_batch", "activation_length", "activation_mlp")


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class Embeddings(nn.Module):
    """Word + learned position + token-type (segment) embeddings, LayerNorm, dropout."""

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids: Array, segment_ids: Array, position_ids: Array,
                 deterministic: bool) -> Array:
        cfg = self.config
        word = self.param("word_embeddings", kernel_init(cfg, ("vocab", "embed")),
                          (cfg.vocab_size, cfg.hidden_size), cfg.params_dtype)
        position = self.param("position_embeddings", kernel_init(cfg, ("position", "embed")),
                              (cfg.max_position_embeddings, cfg.hidden_size), cfg.params_dtype)
        token_type = self.param("token_type_embeddings", kernel_init(cfg, ("type_vocab", "embed")),
                                (cfg.type_vocab_size, cfg.hidden_size), cfg.params_dtype)
        # Gathers: [batch, length, hidden] each.
        x = (jnp.take(word, input_ids, axis=0) + jnp.take(position, position_ids, axis=0)
             + jnp.take(token_type, segment_ids, axis=0))
        x = LayerNorm(cfg, name="LayerNorm")(x)
        x = Dropout(rate=cfg.hidden_dropout_prob)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, ACT_EMBED)


class SelfAttention(nn.Module):
    """Multi-head self-attention + output projection + dropout + residual + LayerNorm (post-LN)."""

    config: BertConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: Array, mask: Array, sequence_ids: Optional[Array] = None,
                 query_positions: Optional[Array] = None) -> Array:
        """`query_positions` (`[batch, queries]`): queries (and the output) at these positions only;
        keys and values still at every position. Returns `[batch, queries, hidden]` then.

        `x` may be the layer before's FFN end left pending (a `fused_fp8.PendingNorm`: `Encoder`);
        its kernel then runs here, writing the Q/K/V GEMMs' e4m3 input, and the result is
        `(output, x as computed here)`."""
        cfg = self.config
        pending_input = isinstance(x, fused_fp8.PendingNorm)
        # Its kernel writes the Q/K/V input in e4m3; at a few queries, flax's casts of the gathered input.
        chained = pending_input and query_positions is None
        computed = None  # a pending input, as computed here
        if pending_input and not chained:
            x = computed = x()
        heads, head_dim = cfg.num_attention_heads, cfg.head_dim
        qkv_names = ("embed", "heads", "kv")
        # Fused QKV: one matmul against the kernels stacked at run time (the parameters and their
        # checkpoint names stay query/key/value).
        kernels, params_biases = zip(*(
            DenseParams(cfg, (cfg.hidden_size,), (heads, head_dim), qkv_names, name=n)()
            for n in ("query", "key", "value")))
        kernels = [k.astype(cfg.compute_dtype) for k in kernels]
        biases = [b.astype(cfg.compute_dtype) for b in params_biases]
        xc = x if chained else x.astype(cfg.compute_dtype)
        impl, seq_ids = cfg.attention_impl, sequence_ids
        einsum = mixed_precision.einsum if cfg.mixed_matmuls else jnp.einsum
        # FP8 (see Dense): the query and the key/value projections always as two matmuls, so that
        # the layer has the same scaling state whether or not it runs at a few query positions.
        if query_positions is None and not cfg.fp8 and cfg.fused_qkv and fused_qkv.supported(cfg.hidden_size):
            # One Pallas GEMM writing q, k and v with their biases (bert_jax.model.kernels.fused_qkv).
            q, k, v = fused_qkv.qkv_projection(xc, kernels, params_biases)
        elif query_positions is None and not cfg.fp8 and cfg.separate_qkv:
            # Each: [batch, length, heads, head_dim], written where attention reads it.
            q, k, v = (einsum("blh,hnd->blnd", xc, kern) + b for kern, b in zip(kernels, biases))
        elif query_positions is None and not cfg.fp8:
            kernel = jnp.stack(kernels, axis=1)  # [hidden, 3, heads, head_dim]
            # [batch, length, 3, heads, head_dim]
            qkv = einsum("blh,hsnd->blsnd", xc, kernel) + jnp.stack(biases)
            # Each: [batch, length, heads, head_dim]
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            kernel_kv = jnp.stack(kernels[1:], axis=1)  # [hidden, 2, heads, head_dim]
            if chained:  # FP8: the input's LayerNorm kernel runs here (bert_jax.model.kernels.fused_fp8.norm_qkv)
                x, q, kv = fused_fp8.norm_qkv(x, fused_fp8.Fp8NormInput(name="query_fp8"),
                                              fused_fp8.Fp8NormInput(name="key_value_fp8"), kernels[0], kernel_kv,
                                              (((2,), (0,)), ((), ())))  # the einsums' dimension numbers
                x = computed = nn.with_logical_constraint(x, ACT_EMBED)
            else:
                einsum_q = fp8_ops.Fp8Einsum(name="query_fp8") if cfg.fp8 else einsum
                einsum_kv = fp8_ops.Fp8Einsum(name="key_value_fp8") if cfg.fp8 else einsum
                if query_positions is not None:
                    x = gather_positions(x, query_positions)  # the residual, [batch, queries, hidden]
                q = einsum_q("blh,hnd->blnd", x.astype(cfg.compute_dtype), kernels[0])
                kv = einsum_kv("blh,hsnd->blsnd", xc, kernel_kv)
            # [batch, queries, heads, head_dim] (queries: every position without query_positions)
            q = q + biases[0]
            kv = kv + jnp.stack(biases[1:])  # [batch, length, 2, heads, head_dim]
            k, v = kv[:, :, 0], kv[:, :, 1]  # each [batch, length, heads, head_dim]
        if query_positions is not None:
            if mask.shape[2] != 1:  # per-query rows (packing, causal): those of the queries kept
                # [batch, 1, queries, key]
                mask = jnp.take_along_axis(
                    mask, query_positions.astype(jnp.int32)[:, None, :, None], axis=2)
            # A few queries against every key: the explicit path (the fused kernels want equal
            # lengths); it costs little at this size.
            impl, seq_ids = "einsum", None
        q = nn.with_logical_constraint(q, ACT_HEADS)
        k = nn.with_logical_constraint(k, ACT_HEADS)
        v = nn.with_logical_constraint(v, ACT_HEADS)
        train_dropout = not self.deterministic and cfg.attention_probs_dropout_prob > 0.0
        # [batch, length, heads, head_dim] (length: the queries')
        ctx = attention(q, k, v, mask, impl=impl, sequence_ids=seq_ids, mixed_matmuls=cfg.mixed_matmuls,
                        causal=cfg.causal_attention, dropout_rate=cfg.attention_probs_dropout_prob,
                        dropout_rng=self.make_rng("dropout") if train_dropout else None)
        # [batch, length, heads, head_dim] -> [batch, length, hidden]
        fold = folds_output_bias(cfg)
        out = Dense(cfg, (heads, head_dim), (cfg.hidden_size,), ("heads", "kv", "embed"),
                    name="output", return_bias=fold)(ctx)
        out, out_bias = out if fold else (out, None)
        # Under FP8 with the kernels, not computed yet (a PendingNorm): FeedForward's first dense layer
        # runs it, so that the LayerNorm kernel also writes its output in e4m3 for that GEMM.
        out = dropout_add_norm(cfg, self.deterministic, out, x, out_bias, pending=True)
        return (out, computed) if pending_input else out


class FeedForward(nn.Module):
    """Dense(intermediate) + activation + Dense(hidden) + dropout + residual + LayerNorm."""

    config: BertConfig
    deterministic: bool = True
    # Under FP8 with the kernels, return the end not computed (a `fused_fp8.PendingNorm`): the next
    # layer's Q/K/V projections compute it (`Encoder`).
    pending: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        if cfg.fused_ffn and not cfg.fp8 and fused_ffn.supported(cfg.hidden_size, cfg.intermediate_size,
                                                                   cfg.hidden_act):
            hidden, inner = (cfg.hidden_size,), (cfg.intermediate_size,)
            w1, b1 = DenseParams(cfg, hidden, inner, ("embed", "mlp"), name="intermediate")()
            w2, b2 = DenseParams(cfg, inner, hidden, ("mlp", "embed"), name="output")()
            dtype = cfg.compute_dtype
            out = fused_ffn.gemm_bias_gelu_gemm(x.astype(dtype), w1.astype(dtype), b1, w2.astype(dtype),
                                                activation=cfg.hidden_act)
            return dropout_add_norm(cfg, self.deterministic, out, x, b2)
        # [batch, length, intermediate]
        h = make_dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "intermediate")(x)
        if isinstance(x, fused_fp8.PendingNorm):  # computed by the dense layer (see SelfAttention)
            x, h = h
        h = activation_fn(cfg.hidden_act)(h)
        h = nn.with_logical_constraint(h, ACT_MLP)
        fold = folds_output_bias(cfg)
        out = make_dense(cfg, cfg.hidden_size, ("mlp", "embed"), "output", return_bias=fold)(h)  # [b, length, hidden]
        out, out_bias = out if fold else (out, None)
        return dropout_add_norm(cfg, self.deterministic, out, x, out_bias, pending=self.pending)


class EncoderLayer(nn.Module):
    """One post-LayerNorm transformer block. Returns `(x, x)` so it can be the body of `nn.scan`.

    Chained (`fused_fp8.chains_layers`, `Encoder`): the input may be the layer before's end left
    pending, computed here, and with `pending_output` so is the output; returns `(output, input as
    computed here)` when the input was pending."""

    config: BertConfig
    deterministic: bool = True
    pending_output: bool = False

    @nn.compact
    def __call__(self, x: Array, mask: Array, sequence_ids: Optional[Array] = None,
                 query_positions: Optional[Array] = None):
        pending_input = isinstance(x, fused_fp8.PendingNorm)
        x = SelfAttention(self.config, self.deterministic, name="attention")(
            x, mask, sequence_ids, query_positions)
        x, computed = x if pending_input else (x, None)
        x = FeedForward(self.config, self.deterministic, self.pending_output, name="ffn")(x)
        if not isinstance(x, fused_fp8.PendingNorm):
            x = nn.with_logical_constraint(x, ACT_EMBED)
        return x, (computed if pending_input else x)


# ---------------------------------------------------------------------------------------------
# Encoder and model
# ---------------------------------------------------------------------------------------------


def _remat_policy(name: str):
    return {
        "full": None,  # save nothing: recompute the whole layer in the backward pass
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    }[name]


class Encoder(nn.Module):
    """L encoder layers; through `nn.scan` (params stacked on a leading "layers" axis) or unrolled.

    Takes the boolean mask of `make_attention_mask` and, for `attention_impl="dot_product"`, the
    same mask as `make_sequence_ids` (the TPU kernel's form; None: the boolean mask only).
    Returns the final hidden states and, stacked `[layers, batch, length, hidden]`, each layer's output.

    With `query_positions` (`[batch, queries]`) the final hidden states are those positions' only
    and the layer outputs are None. Unrolled, the last layer then computes only those queries
    (keys and values at every position, so the result is the same); scanned, every layer runs in
    full and the positions are gathered after.

    Unrolled under FP8 with the kernels (`fused_fp8.chains_layers`), each layer but the last leaves
    its FFN's LayerNorm pending and the next layer's attention runs it, its kernel writing the
    Q/K/V GEMMs' e4m3 input: each layer's output is collected where the next layer computes it.
    """

    config: BertConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: Array, mask: Array, sequence_ids: Optional[Array] = None,
                 query_positions: Optional[Array] = None):
        cfg = self.config
        layer_cls = EncoderLayer
        if cfg.remat_policy != "none":
            layer_cls = nn.remat(layer_cls, policy=_remat_policy(cfg.remat_policy),
                                 prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            scanned = nn.scan(
                layer_cls,
                variable_axes={"params": 0, FP8_COLLECTION: 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=nn.broadcast,
                length=cfg.num_hidden_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            # [batch, length, hidden]; states [layers, batch, length, hidden]
            x, states = scanned(cfg, self.deterministic, name="layers")(x, mask, sequence_ids)
            if query_positions is not None:
                return gather_positions(x, query_positions), None
            return x, states
        states = []
        last = cfg.num_hidden_layers - 1
        chain = fused_fp8.chains_layers(cfg)
        for i in range(cfg.num_hidden_layers):
            out, computed = layer_cls(cfg, self.deterministic, pending_output=chain and i < last, name=f"layer_{i}")(
                x, mask, sequence_ids, query_positions if i == last else None)
            if isinstance(x, fused_fp8.PendingNorm):  # the layer before's output, computed by this one
                states.append(computed)
            x = out
            if not isinstance(x, fused_fp8.PendingNorm):
                states.append(x)
        return x, (None if query_positions is not None else jnp.stack(states))


class Pooler(nn.Module):
    """Dense + tanh on the hidden state of the [CLS] token (or of given positions, for packing)."""

    config: BertConfig

    @nn.compact
    def __call__(self, sequence_output: Array, cls_positions: Optional[Array] = None) -> Array:
        cfg = self.config
        if cls_positions is None:
            first = sequence_output[:, 0]  # [batch, hidden]
        else:
            # [batch, num_seqs, hidden]
            first = jnp.take_along_axis(sequence_output, cls_positions[..., None], axis=1)
        pooled = make_dense(cfg, cfg.hidden_size, ("embed", "mlp"), "dense")(first)  # as `first`
        return jnp.tanh(pooled.astype(jnp.float32)).astype(cfg.compute_dtype)


@dataclasses.dataclass
class BertOutput:
    sequence_output: Array  # [batch, length, hidden], the last layer
    pooled_output: Array  # [batch, hidden] (or [batch, num_seqs, hidden] with cls_positions)
    hidden_states: Optional[Array] = None  # [layers + 1, batch, length, hidden]: embeddings, each layer


jax.tree_util.register_dataclass(
    BertOutput, data_fields=["sequence_output", "pooled_output", "hidden_states"], meta_fields=[])


def _default_inputs(input_ids, input_mask, segment_ids, position_ids):
    if input_mask is None:
        input_mask = jnp.ones_like(input_ids)
    if segment_ids is None:
        segment_ids = jnp.zeros_like(input_ids)
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
    return input_mask, segment_ids, position_ids


class BertModel(nn.Module):
    """The BERT encoder with its pooler.

    Inputs are `[batch, length]` int arrays with Google's names: `input_ids`, `input_mask` (1 real,
    0 padding), `segment_ids` (token types). Packed rows also give `position_ids` (restarting at each
    sequence), `pack_ids` (which sequence each token belongs to) and `cls_positions`.

    `output_positions` (`[batch, P]`, P may be 0) asks for the last layer at those positions only:
    `sequence_output` is then `[batch, P, hidden]`, the same values as the full output gathered
    there. Where `last_layer_queries` says it saves work (`sparse_last_layer`, unrolled layers, fewer
    positions than `length`), the last layer then computes only those queries and the [CLS] ones
    the pooler reads.
    """

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids: Array, input_mask: Optional[Array] = None,
                 segment_ids: Optional[Array] = None, position_ids: Optional[Array] = None,
                 pack_ids: Optional[Array] = None, cls_positions: Optional[Array] = None,
                 output_positions: Optional[Array] = None, *,
                 deterministic: bool = True, output_hidden_states: bool = False) -> BertOutput:
        cfg = self.config
        if output_positions is not None and output_hidden_states:
            raise ValueError("output_hidden_states needs every position: leave output_positions unset")
        if input_ids.shape[-1] > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {input_ids.shape[-1]} exceeds "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        input_mask, segment_ids, position_ids = _default_inputs(
            input_ids, input_mask, segment_ids, position_ids)
        # [batch, length, hidden]
        x = Embeddings(cfg, name="embeddings")(input_ids, segment_ids, position_ids, deterministic)
        # [batch, 1, 1 or length (query), length (key)]
        mask = make_attention_mask(input_mask, pack_ids, cfg.causal_attention)
        # The same mask as one id per token, for the TPU kernel of "dot_product" (see `attention`).
        sequence_ids = (make_sequence_ids(input_mask, pack_ids)
                        if cfg.attention_impl == "dot_product" else None)
        encoder = Encoder(cfg, deterministic, name="encoder")
        n_cls = 1 if cls_positions is None else cls_positions.shape[1]
        if output_positions is None or last_layer_queries(
                cfg, input_ids.shape[-1], output_positions.shape[1], n_cls) is None:
            seq, states = encoder(x, mask, sequence_ids)  # [batch, length, hidden]
            pooled = Pooler(cfg, name="pooler")(seq, cls_positions)
            if output_positions is not None:
                seq = gather_positions(seq, output_positions)  # [batch, P, hidden]
        else:
            # The [CLS] rows first (the pooler's), then the positions asked for.
            batch = input_ids.shape[0]
            cls = jnp.zeros((batch, 1), jnp.int32) if cls_positions is None else cls_positions
            # [batch, n_cls + P]
            queries = jnp.concatenate([cls.astype(jnp.int32), output_positions.astype(jnp.int32)], axis=1)
            out, states = encoder(x, mask, sequence_ids, queries)  # [batch, n_cls + P, hidden]
            pooled = Pooler(cfg, name="pooler")(
                out, None if cls_positions is None else jnp.broadcast_to(jnp.arange(n_cls), cls.shape))
            seq = out[:, n_cls:]  # [batch, P, hidden]
        # [layers + 1, batch, length, hidden]
        hidden = jnp.concatenate([x[None], states]) if output_hidden_states else None
        return BertOutput(sequence_output=seq, pooled_output=pooled, hidden_states=hidden)


# ---------------------------------------------------------------------------------------------
# Positions the heads read
# ---------------------------------------------------------------------------------------------


def gather_positions(sequence: Array, positions: Array) -> Array:
    """`[batch, length, hidden]` at `[batch, num_positions]` -> `[batch, num_positions, hidden]`."""
    return jnp.take_along_axis(sequence, positions[..., None].astype(jnp.int32), axis=1)


def last_layer_queries(config: BertConfig, length: int, num_positions: int, num_cls: int = 1) -> Optional[int]:
    """How many positions the last layer computes when the heads read `num_positions` positions and
    `num_cls` [CLS] rows of `length`: None when it computes all `length` (`sparse_last_layer` off,
    scanned layers, or about every position asked for, as the left-to-right objective does)."""
    queries = num_positions + num_cls
    if not config.sparse_last_layer or config.scan_layers or queries >= length:
        return None
    return queries


# ---------------------------------------------------------------------------------------------
# Parameter utilities
# ---------------------------------------------------------------------------------------------


def count_params(params: Any) -> int:
    """Number of scalar parameters in a (possibly boxed) parameter tree."""
    leaves = jax.tree_util.tree_leaves(nn.meta.unbox(params))
    return int(sum(np.prod(x.shape) for x in leaves))


def dummy_inputs(config: BertConfig, batch: int = 1, length: int = 8, predictions: int = 2) -> dict:
    """Small int32 inputs for `init` / `eval_shape`."""
    del config
    ids = jnp.zeros((batch, length), jnp.int32)
    return dict(input_ids=ids, input_mask=jnp.ones_like(ids), segment_ids=ids,
                masked_lm_positions=jnp.zeros((batch, predictions), jnp.int32))


def _encoder_params(params: dict) -> tuple[dict, dict]:
    """Returns (the dict that holds "encoder", the encoder dict) for a BertModel or pretraining tree."""
    holder = params["bert"] if "bert" in params else params
    return holder, holder["encoder"]


def stack_layers(params: dict, num_layers: int) -> dict:
    """Unrolled (`encoder/layer_{i}`) parameters -> scanned (`encoder/layers`, leading layer axis)."""
    params = jax.tree_util.tree_map(lambda x: x, nn.meta.unbox(params))  # shallow copy of the dicts
    holder, enc = _encoder_params(params)
    layers = [enc[f"layer_{i}"] for i in range(num_layers)]
    holder["encoder"] = {"layers": jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)}
    return params


def unstack_layers(params: dict) -> dict:
    """Scanned parameters (`encoder/layers`) -> unrolled (`encoder/layer_{i}`)."""
    params = jax.tree_util.tree_map(lambda x: x, nn.meta.unbox(params))
    holder, enc = _encoder_params(params)
    stacked = enc["layers"]
    num_layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    holder["encoder"] = {
        f"layer_{i}": jax.tree_util.tree_map(lambda x, i=i: x[i], stacked) for i in range(num_layers)}
    return params
