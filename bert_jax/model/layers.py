"""The encoder's building blocks: `Dense` (FP8 or mixed-precision matmuls where the config says),
`LayerNorm` in float32, the activations, the parameter initializers with their logical axis names,
and `dropout_add_norm`, the end of every sub-layer (`LayerNorm(dropout(out + bias) + residual)`,
one fused kernel each way with `fused_ops`). `bert_jax.model.modeling` builds the encoder from
them; `bert_jax.model.pretraining_heads` and `bert_jax.finetune.heads` their heads.

This module must not import tensorflow.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import flax.linen as nn
from flax.linen import fp8_ops
import jax
import jax.numpy as jnp

from bert_jax.model import mixed_precision
from bert_jax.model.kernels import fused, fused_fp8
from bert_jax.model.dropout import Dropout, keep_mask, threefry_key
from bert_jax.model.model_config import ACTIVATIONS, BertConfig

Array = jax.Array

# The variable collection of the FP8 scaling state (`BertConfig.fp8`): amax histories and scales
# whose "gradient" is their next value (flax's convention).
FP8_COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT


def activation_fn(name: str) -> Callable[[Array], Array]:
    """`gelu` is the exact erf form (HF); `gelu_tanh`/`gelu_new` the tanh form (Google TF1's "gelu")."""
    if name == "gelu":
        return functools.partial(jax.nn.gelu, approximate=False)
    if name in ("gelu_tanh", "gelu_new"):
        return functools.partial(jax.nn.gelu, approximate=True)
    if name == "relu":
        return jax.nn.relu
    raise ValueError(f"unknown hidden_act {name!r}; expected one of {ACTIVATIONS}")


def kernel_init(config: BertConfig, names: tuple):
    # Google: tf.truncated_normal_initializer(stddev=initializer_range), cut at 2 stddev.
    return nn.with_logical_partitioning(
        nn.initializers.truncated_normal(stddev=config.initializer_range), names)


def zeros_init(names: tuple):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def ones_init(names: tuple):
    return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


class LayerNorm(nn.Module):
    """LayerNorm computed in float32 whatever the compute dtype; output cast back to `dtype`.

    Two-pass variance (mean of squared deviations), as in Google's `tf.nn.moments`, rather than
    E[x^2] - E[x]^2, which loses precision when the mean is large.
    """

    config: BertConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        scale = self.param("scale", ones_init(("embed",)), (x.shape[-1],), cfg.params_dtype)
        bias = self.param("bias", zeros_init(("embed",)), (x.shape[-1],), cfg.params_dtype)
        x = x.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + cfg.layer_norm_eps)
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(cfg.compute_dtype)


def dense_params(module: nn.Module, config: BertConfig, in_shape: tuple, out_shape: tuple,
                  names: tuple) -> tuple[Array, Array]:
    """Creates `kernel` (in_shape + out_shape) and `bias` (out_shape) in `module`'s scope."""
    kernel = module.param("kernel", kernel_init(config, names), in_shape + out_shape,
                          config.params_dtype)
    bias = module.param("bias", zeros_init(names[len(in_shape):]), out_shape, config.params_dtype)
    return kernel, bias


class Dense(nn.Module):
    """`y = x @ kernel + bias` contracting the trailing `len(in_shape)` axes of x.

    Parameters are created at their true (multi-axis) shapes so that logical axis names line up
    with the dimensions, e.g. the query kernel is `[hidden, heads, head_dim]`.
    """

    config: BertConfig
    in_shape: tuple
    out_shape: tuple
    names: tuple  # logical names of kernel dims: in_shape's then out_shape's
    # Return `(x @ kernel, bias)`: the caller adds the bias (a fused kernel); with FP8 and the LayerNorm
    # kernels, `(fused_fp8.Fp8Dense, bias)`: the GEMM too, inside `dropout_add_norm`.
    return_bias: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        kernel, bias = dense_params(self, cfg, self.in_shape, self.out_shape, self.names)
        n_in = len(self.in_shape)
        pending = isinstance(x, fused_fp8.PendingNorm)
        x = x if pending else x.astype(cfg.compute_dtype)
        # Contract x's last n_in axes with the kernel's first n_in axes.
        dims = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
        # FP8: the inputs and the kernel quantized to e4m3, the output gradient to e5m2, with the
        # scales of this layer's own state (its submodule "fp8"); XLA rewrites the scaled dot into
        # an FP8 GEMM on Hopper GPUs.
        if cfg.mixed_matmuls:  # bf16 inputs, float32 out (bert_jax.model.mixed_precision)
            y = mixed_precision.einsum(mixed_precision.dense_spec(x.ndim, n_in, len(self.out_shape)), x, kernel)
        elif pending:  # FP8, x a sub-layer's end not yet computed: its LayerNorm kernel runs here and writes
            # x in e4m3 for this GEMM (fused_fp8.Fp8NormInput); x itself is returned beside y.
            x, y = fused_fp8.Fp8NormInput(name="fp8")(x, kernel.astype(cfg.compute_dtype), dims)
        elif self.return_bias and fused_fp8.applies(cfg):
            # The GEMM runs inside the LayerNorm kernel's custom VJP (`dropout_add_norm`), which
            # casts its output gradient to e5m2 (bert_jax.model.kernels.fused_fp8).
            y = fused_fp8.Fp8Operands(name="fp8")(x, kernel.astype(cfg.compute_dtype), dims)
        else:
            dot = fp8_ops.Fp8DirectDotGeneralOp(name="fp8") if cfg.fp8 else jax.lax.dot_general
            y = dot(x, kernel.astype(cfg.compute_dtype), dims)
        if self.return_bias:
            return y, bias
        y = y + bias.astype(cfg.compute_dtype)
        return (x, y) if pending else y


class DenseParams(nn.Module):
    """A dense layer's `(kernel, bias)`, unapplied: lets a caller fuse several projections into
    one matmul while each keeps its own parameters (and checkpoint names)."""

    config: BertConfig
    in_shape: tuple
    out_shape: tuple
    names: tuple

    @nn.compact
    def __call__(self) -> tuple[Array, Array]:
        return dense_params(self, self.config, self.in_shape, self.out_shape, self.names)


def make_dense(config: BertConfig, features, names: tuple, name: str, return_bias: bool = False) -> Dense:
    """A dense layer from `hidden_size` (or `names`' first dim) to `features` (int or tuple)."""
    out_shape = (features,) if isinstance(features, int) else tuple(features)
    in_dim = {"embed": config.hidden_size, "mlp": config.intermediate_size}[names[0]]
    return Dense(config, (in_dim,), out_shape, names, name=name, return_bias=return_bias)


class _DropoutRng(nn.Module):
    """Draws the "dropout" key that a `Dropout` module of the same name would draw."""

    @nn.compact
    def __call__(self) -> Array:
        return self.make_rng("dropout")


class _NormParams(nn.Module):
    """`LayerNorm`'s `scale` and `bias`, unapplied (same names, shapes and initializers)."""

    config: BertConfig

    @nn.compact
    def __call__(self) -> tuple[Array, Array]:
        cfg = self.config
        return (self.param("scale", ones_init(("embed",)), (cfg.hidden_size,), cfg.params_dtype),
                self.param("bias", zeros_init(("embed",)), (cfg.hidden_size,), cfg.params_dtype))


def folds_output_bias(cfg: BertConfig) -> bool:
    """Whether `dropout_add_norm` takes the sub-layer's output bias into its fused kernel."""
    return cfg.fused_ops and fused.supported(cfg.hidden_size)


def dropout_add_norm(cfg: BertConfig, deterministic: bool, out: Array, residual: Array,
                     out_bias: Optional[Array] = None, pending: bool = False) -> Array:
    """`LayerNorm(dropout(out + out_bias) + residual)`, the end of every sub-layer (call it from a
    module's compact `__call__`: it creates the submodules "Dropout_0" and "output_norm" there).
    With `cfg.fused_ops` where `bert_jax.model.kernels.fused` applies (`folds_output_bias`): one Pallas kernel
    each way, the bias add inside it, with the same parameters and the same dropout mask (drawn
    inside the kernels from a threefry key: never stored). With `pending` and an FP8 `out`, a
    `fused_fp8.PendingNorm` that the next FP8 dense layer computes (`Dense`)."""
    rate = cfg.hidden_dropout_prob
    if folds_output_bias(cfg):
        keep = key = None
        if not deterministic and rate > 0.0:
            # A threefry key: the kernels draw the mask themselves (again in the backward), the
            # one keep_mask gives; other keys' masks are drawn here and read.
            rng = _DropoutRng(name="Dropout_0")()
            key = threefry_key(rng, out.size)
            keep = keep_mask(rng, 1.0 - rate, out.shape) if key is None else None
        scale, bias = _NormParams(cfg, name="output_norm")()
        if isinstance(out, fused_fp8.Fp8Dense):
            return fused_fp8.dense_dropout_add_layernorm(out, residual, keep, scale, bias, out_bias,
                                                         keep_prob=1.0 - rate, eps=cfg.layer_norm_eps, key=key,
                                                         pending=pending)
        return fused.dropout_add_layernorm(out, residual, keep, scale, bias, keep_prob=1.0 - rate,
                                           eps=cfg.layer_norm_eps, h_bias=out_bias, key=key)
    if out_bias is not None:
        out = out + out_bias.astype(out.dtype)
    out = Dropout(rate=rate, name="Dropout_0")(out, deterministic=deterministic)
    return LayerNorm(cfg, name="output_norm")(out + residual)
