"""A ModernBERT-family encoder (Warner et al. 2024, arXiv 2412.13663) beside BERT, exact to transformers.

What differs from BERT (`bert_jax.model.modeling`), layer by layer, as transformers' `ModernBertModel`
computes it:

* embeddings: token embeddings, then a LayerNorm (no positions, no token types: positions enter
  through rotary embeddings in every attention);
* pre-LayerNorm layers, `x + attn(norm(x))` then `x + mlp(norm(x))`, the first layer without the
  attention norm (the embedding norm is right before it); a final norm after the last layer;
* no biases in the projections and norms (`attention_bias`, `mlp_bias`, `norm_bias`);
* rotary position embeddings on queries and keys (the halves rotated, computed in float32), with a
  theta per attention kind: `global_rope_theta` (160k) and `local_rope_theta` (10k);
* alternating attention: every `global_attn_every_n_layers`-th layer (0, 3, 6, ...) attends over the
  whole sequence, the others within a band of `local_attention // 2` tokens on each side
  (`|query - key| <= local_attention // 2`, transformers' bidirectional sliding window);
* a GeGLU MLP: `Wo(gelu(a) * b)` with `[a, b] = Wi(x)` split in halves;
* the MLM head: dense, GELU, norm, then the decoder tied to the token embeddings (with a bias).

Packed rows (several sequences a row, `pack_ids`) attend within their own sequence, and positions
restart at each sequence's first token, so a packed row computes what the sequences alone would
(unpadded attention's result, with the band mask on CPU).

Which attention computes a layer (`attention_impl`, `local_blocks`; `bert_jax.model.attention`):
"einsum" everywhere, and "dot_product" off TPU and GPU: global layers the masked attention, local
layers by blocks (`attention.banded_attention`) where the row is longer than three blocks, else the band mask.
"dot_product" on TPU: splash attention in every layer (its `LocalMask` in local layers), with the
sequence ids (`make_sequence_ids`: padding queries attend to padding, no real token's output
changes); on GPU: cuDNN's fused kernel on global layers, and on local layers cuDNN's own window
where cuDNN takes a two-sided one (jax 0.10.2 does not: `attention.local_kernel`), else the blocks
or the band mask as on CPU.

Numerics as BERT's: parameters float32, matmuls in `compute_dtype`, LayerNorm, softmax, RoPE and
the logits in float32. On a mesh the activations are constrained at block edges as BERT's; the
parameters' logical axis names are `bert_jax.model.modernbert_axes`' (the training paths box them after
`init`). With `mixed_matmuls` (a float32 model; `config.cpu_bf16` sets it on CPUs with bf16 units)
every matmul, forward and both gradients, takes bfloat16 inputs and accumulates and returns float32
(`bert_jax.model.mixed_precision`, BERT's path): Wqkv, Wo, the MLP's Wi and Wo, the attention's scores
and context (the full-mask path and `attention.banded_attention`'s blocks), the heads' dense layers, the tied
decoder and the task classifier. This module must not import tensorflow.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.model import attention as attention_lib
from bert_jax.model import mixed_precision
from data_pipeline import storage

Array = jax.Array

# Logical names of activations (BERT's, `bert_jax.model.modeling`): the batch over (data, fsdp), heads and
# the GeGLU's features over tensor. The parameters' names: `bert_jax.model.modernbert_axes`.
ACT_EMBED = ("activation_batch", "activation_length", "activation_embed")
ACT_QKV = ("activation_batch", "activation_length", None, "activation_heads", "activation_kv")
ACT_GLU = ("activation_batch", "activation_length", None, "activation_mlp")
ACT_MLP = ("activation_batch", "activation_length", "activation_mlp")

ACTIVATIONS = {"gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "silu": jax.nn.silu, "relu": jax.nn.relu}
ATTENTION_IMPLS = ("einsum", "dot_product")


@dataclasses.dataclass(frozen=True)
class ModernBertConfig:
    """transformers' `ModernBertConfig` fields (same names and defaults: ModernBERT-base), then ours."""

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0
    norm_eps: float = 1e-5
    norm_bias: bool = False
    pad_token_id: int = 50283
    bos_token_id: int = 50281
    eos_token_id: int = 50282
    cls_token_id: int = 50281
    sep_token_id: int = 50282
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    global_attn_every_n_layers: int = 3
    local_attention: int = 128
    attention_bias: bool = False
    attention_dropout: float = 0.0
    embedding_dropout: float = 0.0
    mlp_bias: bool = False
    mlp_dropout: float = 0.0
    decoder_bias: bool = True
    classifier_pooling: str = "cls"
    classifier_dropout: float = 0.0
    classifier_bias: bool = False
    classifier_activation: str = "gelu"
    # --- ours ---
    dtype: str = "float32"  # compute dtype of the matmuls ("bfloat16" on accelerators)
    attention_impl: str = "einsum"
    # Local layers by blocks (`banded_attention`: ~3 x local_attention / 2 keys a query) where the row is
    # longer than three blocks; False: the full attention with the band mask (every query scores every key).
    local_blocks: bool = True
    # Every matmul with bfloat16 inputs and float32 accumulation and output (module docstring); needs
    # dtype="float32". How a run computes, not what the model is: not in config.json.
    mixed_matmuls: bool = False

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} does not divide by num_attention_heads "
                             f"{self.num_attention_heads}")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(f"the head size {self.hidden_size // self.num_attention_heads} is odd: rotary "
                             "embeddings rotate pairs of features")
        for field in ("hidden_activation", "classifier_activation"):
            if getattr(self, field) not in ACTIVATIONS:
                raise ValueError(f"{field}={getattr(self, field)!r}: one of {sorted(ACTIVATIONS)}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r}: one of {ATTENTION_IMPLS}")
        if self.classifier_pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling={self.classifier_pooling!r}: 'cls' or 'mean'")
        if self.global_attn_every_n_layers < 1 or self.local_attention < 0:
            raise ValueError("global_attn_every_n_layers must be >= 1 and local_attention >= 0")
        if self.mixed_matmuls and self.dtype != "float32":
            raise ValueError(f"mixed_matmuls runs the matmuls in bfloat16 within a float32 model: it needs "
                             f"dtype='float32', got dtype={self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    def is_global(self, layer: int) -> bool:
        """Layer 0, n, 2n, ... attend globally (transformers' `layer_types`)."""
        return layer % self.global_attn_every_n_layers == 0

    def layer_types(self) -> list:
        return ["full_attention" if self.is_global(i) else "sliding_attention" for i in range(self.num_hidden_layers)]

    # -- transformers' config.json ------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict, **ours) -> "ModernBertConfig":
        """Reads transformers' `config.json` (the 4.x keys `global_rope_theta`/`local_rope_theta` or the 5.x
        `rope_parameters` and `layer_types`); a layer pattern other than every-n-th global is refused."""
        if d.get("model_type") not in (None, "modernbert"):
            raise ValueError(f"model_type={d.get('model_type')!r} is not a ModernBERT config")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known and k not in ("dtype", "mixed_matmuls")}
        rope = d.get("rope_parameters") or {}
        for kind, field in (("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta")):
            params = rope.get(kind) or {}
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters[{kind!r}] rope_type={params['rope_type']!r}: only 'default'")
            if "rope_theta" in params:
                kwargs[field] = float(params["rope_theta"])
        for key in ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id"):
            if kwargs.get(key) is None:
                kwargs.pop(key, None)
        config = cls(**kwargs, **ours)
        if d.get("layer_types") and list(d["layer_types"]) != config.layer_types():
            raise ValueError(f"layer_types {d['layer_types']} is not global every "
                             f"{config.global_attn_every_n_layers} layers")
        return config

    def to_hf_dict(self) -> dict:
        """transformers' `config.json` for `ModernBertForMaskedLM`, read by transformers 4.48+ and 5."""
        ours = {"dtype", "attention_impl", "local_blocks", "mixed_matmuls"}
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ours}
        d.update(model_type="modernbert", architectures=["ModernBertForMaskedLM"], tie_word_embeddings=True,
                 layer_types=self.layer_types(), torch_dtype="float32",
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": self.global_rope_theta},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": self.local_rope_theta}})
        return d

    @classmethod
    def from_json_file(cls, path: str, **ours) -> "ModernBertConfig":
        return cls.from_hf_dict(json.loads(storage.read_text(path)), **ours)


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------


def _init(config: ModernBertConfig, std: float):
    """transformers' init: a normal of `std` cut at `initializer_cutoff_factor` stddevs."""
    cut = config.initializer_cutoff_factor
    return lambda key, shape, dtype=jnp.float32: jax.random.truncated_normal(key, -cut, cut, shape, dtype) * std


class LayerNorm(nn.Module):
    """LayerNorm in float32 (two-pass variance), with a bias only where `norm_bias` says."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x = x.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + cfg.norm_eps) * scale
        if cfg.norm_bias:
            y = y + self.param("bias", nn.initializers.zeros, (x.shape[-1],), jnp.float32)
        return y.astype(cfg.compute_dtype)


def _mixed_dot(x: Array, kernel: Array, dimension_numbers, precision=None) -> Array:
    """`nn.Dense`'s matmul (x's last axis against the kernel's first) with bf16 inputs, float32 out."""
    del dimension_numbers, precision  # always nn.Dense's: (((x.ndim - 1,), (0,)), ((), ()))
    return mixed_precision.einsum(mixed_precision.dense_spec(x.ndim, 1, 1), x, kernel)


def _dense(config: ModernBertConfig, features: int, bias: bool, std: float, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=bias, dtype=config.compute_dtype, param_dtype=jnp.float32,
                    kernel_init=_init(config, std), name=name,
                    dot_general=_mixed_dot if config.mixed_matmuls else None)


def rotary(config: ModernBertConfig, positions: Array, is_global: bool) -> tuple[Array, Array]:
    """cos and sin `[batch, length, head_dim]` in float32 for `positions` `[batch, length]`."""
    theta = config.global_rope_theta if is_global else config.local_rope_theta
    d = config.head_dim
    inv_freq = (1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: Array, cos: Array, sin: Array) -> Array:
    """`x` `[batch, length, heads, head_dim]` rotated (halves: `x * cos + [-x2, x1] * sin`), in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def positions_of(input_mask: Array, pack_ids: Optional[Array]) -> Array:
    """Each token's position in its own sequence: 0, 1, ... restarting where a packed sequence starts."""
    length = input_mask.shape[-1]
    index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), input_mask.shape)
    if pack_ids is None:
        return index
    starts = jnp.concatenate([jnp.ones_like(pack_ids[:, :1], bool), pack_ids[:, 1:] != pack_ids[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return index - first


class Attention(nn.Module):
    config: ModernBertConfig
    is_global: bool

    @nn.compact
    def __call__(self, x: Array, mask: Array, keys_ok: Array, pack_ids: Optional[Array],
                 sequence_ids: Optional[Array], cos: Array, sin: Array, deterministic: bool) -> Array:
        cfg = self.config
        batch, length, _ = x.shape
        heads, head_dim = cfg.num_attention_heads, cfg.head_dim
        out_std = cfg.initializer_range / np.sqrt(2.0 * cfg.num_hidden_layers)
        qkv = _dense(cfg, 3 * cfg.hidden_size, cfg.attention_bias, cfg.initializer_range, "Wqkv")(x)
        # [batch, length, 3, heads, head_dim]: split by heads over tensor (modernbert_axes: each rank
        # multiplies only its heads' columns of Wqkv)
        qkv = nn.with_logical_constraint(qkv.reshape(batch, length, 3, heads, head_dim), ACT_QKV)
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        rate = 0.0 if deterministic else cfg.attention_dropout
        rng = self.make_rng("dropout") if rate > 0.0 else None
        window = None if self.is_global else cfg.local_attention // 2
        # A local layer: the kernel that takes the window (splash on TPU, cuDNN where it takes it),
        # else blocks where the row is long enough, else the band mask (`attention_lib.local_kernel`).
        if (window is not None and cfg.local_blocks and length > 3 * max(window, 1)
                and attention_lib.local_kernel(query, window, cfg.attention_impl, sequence_ids) is None):
            context = attention_lib.banded_attention(query, key, value, keys_ok, pack_ids, window, rate, rng,
                                                     cfg.mixed_matmuls)
        else:
            context = attention_lib.attention(query, key, value, mask, impl=cfg.attention_impl,
                                              sequence_ids=sequence_ids, local_window=window,
                                              dropout_rate=rate, dropout_rng=rng, mixed_matmuls=cfg.mixed_matmuls)
        context = nn.with_logical_constraint(context, attention_lib.ACT_HEADS)
        out = _dense(cfg, cfg.hidden_size, cfg.attention_bias, out_std, "Wo")(
            context.reshape(batch, length, cfg.hidden_size))  # [batch, length, hidden]
        return nn.Dropout(cfg.attention_dropout)(out, deterministic=deterministic)


class MLP(nn.Module):
    """GeGLU: `Wo(act(a) * b)`, `[a, b] = Wi(x)`."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x: Array, deterministic: bool) -> Array:
        cfg = self.config
        out_std = cfg.initializer_range / np.sqrt(2.0 * cfg.num_hidden_layers)
        ab = _dense(cfg, 2 * cfg.intermediate_size, cfg.mlp_bias, cfg.initializer_range, "Wi")(x)
        # [batch, length, 2, intermediate]: a and b, each split by feature over tensor (modernbert_axes)
        ab = nn.with_logical_constraint(ab.reshape(*ab.shape[:-1], 2, cfg.intermediate_size), ACT_GLU)
        a, b = ab[..., 0, :], ab[..., 1, :]
        h = ACTIVATIONS[cfg.hidden_activation](a.astype(jnp.float32)).astype(cfg.compute_dtype) * b
        h = nn.with_logical_constraint(h, ACT_MLP)  # [batch, length, intermediate]
        h = nn.Dropout(cfg.mlp_dropout)(h, deterministic=deterministic)
        return _dense(cfg, cfg.hidden_size, cfg.mlp_bias, out_std, "Wo")(h)


class Layer(nn.Module):
    config: ModernBertConfig
    index: int

    @nn.compact
    def __call__(self, x: Array, mask: Array, keys_ok: Array, pack_ids: Optional[Array],
                 sequence_ids: Optional[Array], rope: dict, deterministic: bool) -> Array:
        cfg = self.config
        is_global = cfg.is_global(self.index)
        normed = x if self.index == 0 else LayerNorm(cfg, name="attn_norm")(x)
        x = x + Attention(cfg, is_global, name="attn")(normed, mask, keys_ok, pack_ids, sequence_ids,
                                                   *rope[is_global], deterministic)
        x = nn.with_logical_constraint(x, ACT_EMBED)
        x = x + MLP(cfg, name="mlp")(LayerNorm(cfg, name="mlp_norm")(x), deterministic)
        return nn.with_logical_constraint(x, ACT_EMBED)


class ModernBertModel(nn.Module):
    """The encoder: `(input_ids, input_mask[, pack_ids, positions])` -> the final-normed hidden states."""

    config: ModernBertConfig

    def setup(self):
        cfg = self.config
        self.tok_embeddings = nn.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=jnp.float32,
                                       embedding_init=_init(cfg, cfg.initializer_range), name="tok_embeddings")
        self.embedding_norm = LayerNorm(cfg, name="embedding_norm")
        self.embedding_dropout = nn.Dropout(cfg.embedding_dropout)
        self.layers = [Layer(cfg, i, name=f"layers_{i}") for i in range(cfg.num_hidden_layers)]
        self.final_norm = LayerNorm(cfg, name="final_norm")

    def __call__(self, input_ids: Array, input_mask: Array, pack_ids: Optional[Array] = None,
                 positions: Optional[Array] = None, deterministic: bool = True) -> Array:
        cfg = self.config
        if positions is None:
            positions = positions_of(input_mask, pack_ids)
        x = self.embedding_norm(self.tok_embeddings(input_ids))
        x = nn.with_logical_constraint(self.embedding_dropout(x, deterministic=deterministic), ACT_EMBED)
        mask = attention_lib.make_attention_mask(input_mask, pack_ids)
        # The mask as the TPU kernel takes it (`attention_lib.make_sequence_ids`), for "dot_product" only.
        sequence_ids = (attention_lib.make_sequence_ids(input_mask, pack_ids)
                        if cfg.attention_impl == "dot_product" else None)
        rope = {kind: rotary(cfg, positions, kind) for kind in {cfg.is_global(i) for i in range(cfg.num_hidden_layers)}}
        for layer in self.layers:
            x = layer(x, mask, input_mask, pack_ids, sequence_ids, rope, deterministic)
        return self.final_norm(x)

    def attend(self, hidden: Array) -> Array:
        """Logits over the vocabulary by the tied embedding, in float32 (`nn.Embed.attend`'s product).

        On a mesh the embedding is gathered over fsdp, the vocabulary kept on tensor, as BERT's MLM
        head pins it (`pretraining_heads`): without the constraint XLA's SPMD partitioner (jax 0.10,
        CPU) gave wrong gradients for the tied matrix on a 2x2x2 mesh, with the right loss
        (tests/pretrain/test_modernbert_sharding.py)."""
        embedding = nn.with_logical_constraint(self.tok_embeddings.embedding, ("vocab", None))  # [vocab, hidden]
        if self.config.mixed_matmuls:  # [..., hidden] x [vocab, hidden] -> [..., vocab]
            rows = "abcdefg"[:hidden.ndim - 1]
            return mixed_precision.einsum(f"{rows}h,vh->{rows}v", hidden, embedding)
        return jnp.dot(hidden.astype(jnp.float32), embedding.T)  # [..., vocab]


class PredictionHead(nn.Module):
    """transformers' `ModernBertPredictionHead`: dense, activation, norm (the MLM and task heads share its form)."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        out_std = cfg.initializer_range / np.sqrt(2.0 * cfg.num_hidden_layers)
        x = _dense(cfg, cfg.hidden_size, cfg.classifier_bias, out_std, "dense")(x)
        x = ACTIVATIONS[cfg.classifier_activation](x.astype(jnp.float32)).astype(cfg.compute_dtype)
        return LayerNorm(cfg, name="norm")(x)


class ModernBertForMaskedLM(nn.Module):
    """The encoder and the MLM head with the decoder tied to the token embeddings: logits in float32.

    `masked_positions` `[batch, predictions]` (optional) gathers those rows before the head, as a
    pretraining step needs; without it every position gets logits."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, input_ids: Array, input_mask: Array, pack_ids: Optional[Array] = None,
                 positions: Optional[Array] = None, masked_positions: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, Array]:
        cfg = self.config
        encoder = ModernBertModel(cfg, name="model")
        hidden = encoder(input_ids, input_mask, pack_ids, positions, deterministic)
        rows = hidden if masked_positions is None else jnp.take_along_axis(
            hidden, masked_positions[..., None].astype(jnp.int32), axis=1)
        rows = nn.with_logical_constraint(rows, ACT_EMBED)  # [batch, predictions or length, hidden]
        logits = encoder.attend(PredictionHead(cfg, name="head")(rows))
        if cfg.decoder_bias:
            logits = logits + self.param("decoder_bias", nn.initializers.zeros, (cfg.vocab_size,), jnp.float32)
        return hidden, logits


# ---------------------------------------------------------------------------------------------
# Task heads, as transformers defines them
# ---------------------------------------------------------------------------------------------

# kind -> transformers' class: what `ModernBertForTask` computes and what an export says it is.
TASK_CLASSES = {"sequence": "ModernBertForSequenceClassification", "token": "ModernBertForTokenClassification",
                "span": "ModernBertForQuestionAnswering", "multiple_choice": "ModernBertForMultipleChoice"}


class ModernBertForTask(nn.Module):
    """The encoder, `PredictionHead` and a `classifier` (with a bias), transformers' four task models:

    * "sequence": the `[CLS]` row (or the mean over real tokens, `classifier_pooling="mean"`),
      `num_outputs` logits (1: regression);
    * "token": every row, `num_outputs` logits per token;
    * "span": every row, start and end logits (`num_outputs` 2), returned `[batch, length, 2]`;
    * "multiple_choice": inputs `[batch, choices, length]`, one logit per choice from the pooled row
      (the first real token under "cls", as transformers takes it), returned `[batch, choices]`.

    Packed rows (`pack_ids`, several sequences a row) give "sequence" one `[CLS]` per sequence:
    `cls_positions` `[batch, slots]` picks those rows, logits `[batch, slots, num_outputs]` (each what
    the sequence alone gives: `ModernBertModel` keeps a packed sequence to itself; "cls" pooling only).

    Logits in float32; the classifier drawn as transformers does (std `hidden_size ** -0.5`, cut at 2 std).
    """

    config: ModernBertConfig
    kind: str
    num_outputs: int

    @nn.compact
    def __call__(self, input_ids: Array, input_mask: Array, pack_ids: Optional[Array] = None,
                 deterministic: bool = True, cls_positions: Optional[Array] = None) -> Array:
        cfg = self.config
        if self.kind not in TASK_CLASSES:
            raise ValueError(f"kind={self.kind!r}: one of {sorted(TASK_CLASSES)}")
        if cls_positions is not None and (self.kind != "sequence" or cfg.classifier_pooling != "cls"):
            raise ValueError(f"cls_positions (packed rows) are for kind 'sequence' with classifier_pooling='cls', "
                             f"not kind={self.kind!r}, classifier_pooling={cfg.classifier_pooling!r}")
        choices = input_ids.shape[1] if self.kind == "multiple_choice" else None
        if choices is not None:
            input_ids, input_mask = input_ids.reshape(-1, input_ids.shape[-1]), input_mask.reshape(-1, input_mask.shape[-1])
        hidden = ModernBertModel(cfg, name="model")(input_ids, input_mask, pack_ids, None, deterministic)
        if cls_positions is not None:  # [batch, slots, hidden]: each packed sequence's [CLS]
            hidden = jnp.take_along_axis(hidden, cls_positions[..., None].astype(jnp.int32), axis=1)
        elif self.kind in ("sequence", "multiple_choice"):
            if cfg.classifier_pooling == "mean":
                m = input_mask.astype(jnp.float32)[..., None]
                hidden = (hidden.astype(jnp.float32) * m).sum(1) / m.sum(1)
            else:
                first = jnp.argmax(input_mask, axis=-1) if self.kind == "multiple_choice" else jnp.zeros(
                    input_mask.shape[:1], jnp.int32)
                hidden = jnp.take_along_axis(hidden, first[:, None, None], axis=1)[:, 0]
        x = PredictionHead(cfg, name="head")(hidden)
        x = nn.Dropout(cfg.classifier_dropout)(x, deterministic=deterministic)
        width = 1 if self.kind == "multiple_choice" else self.num_outputs
        logits = nn.Dense(width, dtype=jnp.float32, param_dtype=jnp.float32, name="classifier",
                          kernel_init=_init(cfg, cfg.hidden_size ** -0.5),
                          dot_general=_mixed_dot if cfg.mixed_matmuls else None)(x.astype(jnp.float32))
        if choices is not None:
            return logits.reshape(-1, choices)
        return logits
