"""FP8's casts inside the LayerNorm kernels (`BertConfig.fp8` with `fused_ops`).

With FP8 (flax's `Fp8DirectDotGeneralOp`, delayed scaling) every dense layer's backward pass first
reads its output gradient `g` twice more: once for its largest |value| (the amax that joins the
layer's history) and once to cast it to float8_e5m2 for the two gradient GEMMs. Those memory-bound
passes cost about what the FP8 GEMMs save (benchmarks/step/RESULTS.md: 0.998x at 4 layers on an H100).
For the two dense layers whose output goes straight into `LayerNorm(dropout(h + b) + x)` (the
attention output and the FFN output), `g` is `dh`, which the LayerNorm backward kernel
(`bert_jax.model.kernels.fused`) computes anyway: here that kernel writes `dh` already cast to e5m2 (one
byte where it wrote two) with its block's amax, and the dense layer's backward takes them as they
are. One `custom_vjp` spans the layer's FP8 GEMM and the LayerNorm kernels, so that the e5m2
gradient never passes through a bfloat16 cotangent.

The forward has the same pass on its side: flax's `in_q` reads each dense layer's input once more
for its amax and its e4m3 cast. The FFN's first layer reads the attention's LayerNorm output, so
that LayerNorm is left pending (`PendingNorm`) and run by that layer (`Fp8NormInput`), which hands
the forward kernel its input scale: the kernel writes the output in e4m3 beside the compute dtype
(one byte more per element, two fewer read) with its block's amax, and flax's `quantized_dot`
reads them. The FFN's LayerNorm feeds the next layer's Q/K/V projections, whose two input scales
(flax's `Fp8Einsum`s `query_fp8` and `key_value_fp8`) belong to the next layer. With the layers
unrolled (`chains_layers`), each layer leaves that LayerNorm pending and the next layer's attention
runs it (`norm_qkv`): the kernel writes the input in e4m3 once per scale, with one amax for both
histories. Scanned, the input crosses `nn.scan`'s carry, where the kernel would need the scaling
state kept by the layer that produces the input (a new checkpoint layout): those keep flax's `in_q`,
as do the first layer's (the embeddings') and a last layer run at a few queries.

The arithmetic is flax's, operation for operation: the inputs and the kernel quantized by flax's
`in_q` (their own amax and scales, as before), the forward GEMM on the e4m3 values dequantized by
both scales, the gradient's scale computed from its history before the step (`compute_scale`), `g`
divided by it in the compute dtype, clipped and rounded to e5m2, the history rolled with this
step's amax, and the two gradient GEMMs on the e5m2 gradient (flax's own transposes), dequantized;
for the input cast, its scale from the history before the step, the division, clip and rounding
of `quantize`, and the history rolled with the largest |output| in the compute dtype. The state
keeps flax's layout and names (the same six variables in the layer's "fp8" scope), so a run
switches between this path and flax's freely. `tests/model/test_fused_fp8.py` compares the
kernels' e5m2 gradient, e4m3 input and amaxes with flax's on the same tensors, and the whole FP8
model, loss, every gradient and the next scaling state, with the kernels' casts against without;
`tests/model/test_fused_fp8_chain.py` the Q/K/V casts and the unrolled model chained so.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

from flax import struct
from flax.linen import fp8_ops
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.model.kernels import fused

Array = jax.Array

# Whether FP8 layers feeding the LayerNorm kernel take their gradient's cast from it, and the FFN's
# first layer its input's cast (benchmarks switch it off to time flax's own passes in the same
# call: `benchmarks.step.fp8`'s `fp8_fused_cast_apart_*`).
ENABLED = True


@struct.dataclass
class Fp8Dense:
    """A dense layer's FP8 GEMM, not yet computed: its inputs, quantized by flax's `in_q`, and the
    gradient's scaling state. `dropout_add_norm` computes it inside `dense_dropout_add_layernorm`.
    A pytree whose leaves are its arrays (it crosses `nn.remat`'s boundary within a layer, and a
    `PendingNorm` holding it crosses the layers': `modeling.Encoder`)."""
    x: Array              # the input, in the compute dtype
    q_x: Array            # ... as float8_e4m3fn, and its scale
    x_scale: Array
    kernel: Array         # the kernel, in the compute dtype
    q_kernel: Array       # ... as float8_e4m3fn, and its scale
    kernel_scale: Array
    grad_scale: Array     # the output gradient's scale and amax history (the step before's)
    grad_history: Array
    dims: tuple = struct.field(pytree_node=False)  # dot_general's dimension numbers

    @property
    def shape(self) -> tuple:
        contract = self.dims[0][0]
        kept = [d for i, d in enumerate(self.x.shape) if i not in contract]
        return tuple(kept) + tuple(d for i, d in enumerate(self.kernel.shape) if i not in self.dims[0][1])

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class Fp8Operands(fp8_ops.Fp8DotGeneralBase):
    """flax's FP8 dense op (`Fp8DirectDotGeneralOp`: the same variables and scaling), stopped
    before its GEMM: returns the quantized operands as an `Fp8Dense`."""

    def __call__(self, x: Array, kernel: Array, dims: tuple) -> Fp8Dense:
        dtype = kernel.dtype
        x = x.astype(dtype)
        q_x, x_scale = fp8_ops.in_q(dtype, self.e4m3_dtype, x, self.input_scale.value,
                                    self.input_amax_history.value)
        q_k, k_scale = fp8_ops.in_q(dtype, self.e4m3_dtype, kernel, self.kernel_scale.value,
                                    self.kernel_amax_history.value)
        return Fp8Dense(x, q_x, x_scale, kernel, q_k, k_scale, self.output_grad_scale.value,
                        self.output_grad_amax_history.value, dims)


def _gemm(q_x, x_scale, q_kernel, kernel_scale, dims, dtype):
    """flax's forward: the e4m3 product in `dtype`, dequantized by both scales (`out_dq`)."""
    y = jax.lax.dot_general(q_x, q_kernel, dims, precision=jax.lax.Precision.DEFAULT, preferred_element_type=dtype)
    return fp8_ops.dequantize(y, dtype, x_scale * kernel_scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(15, 16, 17))
def _dense_norm(*args):
    return _dense_norm_fwd(*args)[0]


def _dense_norm_fwd(x, q_x, x_scale, kernel, q_kernel, kernel_scale, grad_scale, grad_history,
                    residual, keep, key, scale, bias, h_bias, in_scale, dims, keep_prob, eps):
    # With `in_scale` (the next FP8 layer's input scale): y, y in e4m3 and its amax (`PendingNorm`).
    h = _gemm(q_x, x_scale, q_kernel, kernel_scale, dims, x.dtype)  # the dense layer's output shape
    y, mean, rstd, *cast = fused._forward(h.reshape(residual.shape), residual, keep, key, scale, bias, h_bias,
                                          keep_prob, eps, in_scale=in_scale)
    return (y, *cast) if cast else y, (x, q_x, x_scale, kernel, q_kernel, kernel_scale, grad_scale, grad_history,
                                       h, residual, keep, key, scale, h_bias, in_scale, mean, rstd)


def _dense_norm_bwd(dims, keep_prob, eps, res, dy):
    (x, q_x, x_scale, kernel, q_kernel, kernel_scale, grad_scale, grad_history,
     h, residual, keep, key, scale, h_bias, in_scale, mean, rstd) = res
    if in_scale is not None:  # the e4m3 copy and its amax feed `_recorded_input`, whose backward gives them none
        dy = dy[0]
    e5m2_max = fp8_ops.get_fp8_max(jnp.float8_e5m2, jnp.float32)
    # This step's scale, from the history before it (flax's `update_fp8_meta`): known before dh is.
    new_scale = fp8_ops.compute_scale(jnp.max(grad_history, axis=0), grad_scale, e5m2_max)
    q_g, dx, dscale, dbias, dh_bias, amax = fused._backward(h.reshape(residual.shape), residual, keep, key, scale,
                                                           h_bias, mean, rstd, dy, keep_prob, grad_scale=new_scale)
    new_history = _rolled(grad_history, amax)
    q_g = q_g.reshape(h.shape)
    highest = jax.lax.Precision.HIGHEST
    grad_x = fp8_ops.dequantize(
        fp8_ops.dot_general_transpose_lhs(q_g, x, q_kernel, dimension_numbers=dims, precision=highest,
                                          preferred_element_type=x.dtype), x.dtype, kernel_scale * new_scale)
    grad_kernel = fp8_ops.dequantize(
        fp8_ops.dot_general_transpose_rhs(q_g, q_x, kernel, dimension_numbers=dims, precision=highest,
                                          preferred_element_type=x.dtype), x.dtype, x_scale * new_scale)
    dkeep, dkey = (None if a is None else np.zeros(a.shape, jax.dtypes.float0) for a in (keep, key))
    d_in_scale = None if in_scale is None else jnp.zeros_like(in_scale)  # a stop_gradient'ed scale
    return (grad_x, None, None, grad_kernel, None, None, new_scale, new_history,
            dx, dkeep, dkey, dscale.astype(scale.dtype), dbias.astype(scale.dtype), dh_bias.astype(h_bias.dtype),
            d_in_scale)


_dense_norm.defvjp(_dense_norm_fwd, _dense_norm_bwd)


def _rolled(history: Array, amax: Array) -> Array:
    """flax's `compute_amax_history`: the history rolled one step, this step's amax first."""
    return jnp.roll(history, shift=-1, axis=0).at[0].set(amax.astype(history.dtype))


@struct.dataclass
class PendingNorm:
    """`LayerNorm(dropout(dense + h_bias) + residual)` with `dense` an FP8 GEMM (`Fp8Dense`), not yet
    computed: the FP8 layer(s) that read it run it (`Fp8NormInput`, `norm_qkv`), so that the kernel
    writing the LayerNorm's output also writes it in e4m3 with their input scales. The operands as
    `dense_dropout_add_layernorm` takes them (`fused.kernel_operands`); a pytree of its arrays."""
    dense: Fp8Dense
    residual: Array            # [rows, hidden], the compute dtype
    keep: Optional[Array]      # int8 rows, or None
    key: Optional[Array]       # uint32[2], or None
    scale: Array               # the LayerNorm's scale and bias, float32 [hidden]
    bias: Array
    h_bias: Array              # the dense layer's bias, float32 [hidden]
    keep_prob: float = struct.field(pytree_node=False)
    eps: float = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple:
        return self.dense.shape

    @property
    def ndim(self) -> int:
        return len(self.dense.shape)

    def __call__(self, in_scale: Optional[Array] = None):
        """The LayerNorm's output (in the dense layer's output shape); given `in_scale` (float32 `[n]`,
        n = 1 or 2), also that output as float8_e4m3fn divided by each scale, then its largest
        |value| (`fused._forward`)."""
        d = self.dense
        out = _dense_norm(d.x, d.q_x, d.x_scale, d.kernel, d.q_kernel, d.kernel_scale, d.grad_scale, d.grad_history,
                          self.residual, self.keep, self.key, self.scale, self.bias, self.h_bias, in_scale, d.dims,
                          self.keep_prob, self.eps)
        if in_scale is None:
            return out.reshape(self.shape)
        y, *qs, amax = out
        return (y.reshape(self.shape), *(q.reshape(self.shape) for q in qs), amax)


def dense_dropout_add_layernorm(dense: Fp8Dense, residual: Array, keep: Optional[Array], scale: Array,
                                bias: Array, h_bias: Array, *, keep_prob: float, eps: float,
                                key: Optional[Array] = None, pending: bool = False):
    """`LayerNorm(dropout(dense + h_bias) + residual)` where `dense` is an FP8 GEMM (`Fp8Dense`):
    `fused.dropout_add_layernorm` of its output, whose backward kernel also casts the GEMM's
    output gradient to e5m2 and takes its amax (the module doc). Same arguments otherwise. With
    `pending`, not computed: a `PendingNorm` for the FP8 layer that reads it (`Fp8NormInput`)."""
    residual2, keep2, key = fused.kernel_operands(residual, keep, key, dense.x.dtype, dense.shape[-1],
                                                  "dense_dropout_add_layernorm")
    norm = PendingNorm(dense, residual2, keep2, key, scale.astype(jnp.float32), bias.astype(jnp.float32),
                       h_bias.astype(jnp.float32), float(keep_prob), float(eps))
    return norm if pending else norm()


@jax.custom_vjp
def _recorded_input(q, amax, new_scale, scale, history):
    """The input's e4m3 values and this step's scale as flax's `in_q` returns them, here written by
    the LayerNorm kernel; the backward, as `in_q`'s, hands the layer's next scale and amax history
    (this step's amax rolled in) to the "fp8" collection as their gradients, and nothing else."""
    return q, new_scale


def _recorded_input_fwd(q, amax, new_scale, scale, history):
    return (q, new_scale), (new_scale, _rolled(history, amax))


def _recorded_input_bwd(res, _):
    new_scale, new_history = res
    return None, None, None, new_scale, new_history


_recorded_input.defvjp(_recorded_input_fwd, _recorded_input_bwd)


class Fp8NormInput(fp8_ops.Fp8DotGeneralBase):
    """flax's FP8 dense op (`Fp8DirectDotGeneralOp`: the same variables, scaling and GEMM, its
    `quantized_dot` and `out_dq`) for a layer whose input is a `PendingNorm`: the LayerNorm kernel
    runs here with this layer's input scale (from the history before the step, as `in_q` takes it)
    and writes the input in e4m3 with its amax; flax's `in_q` pass over the input is not run.
    Returns the LayerNorm's output (the sub-layer's residual) and the GEMM's."""

    def __call__(self, x: PendingNorm, kernel: Array, dims: tuple) -> tuple[Array, Array]:
        in_scale = self.next_input_scale()
        y, q_x, amax = x(in_scale)
        return y, self.gemm(y, q_x, amax, in_scale, kernel, dims)

    def next_input_scale(self) -> Array:
        """This step's input scale, from the history before it (`in_q`'s `update_fp8_meta`); float32 [1]."""
        e4m3_max = fp8_ops.get_fp8_max(self.e4m3_dtype, jnp.float32)
        return jax.lax.stop_gradient(fp8_ops.compute_scale(jnp.max(self.input_amax_history.value, axis=0),
                                                           self.input_scale.value, e4m3_max))

    def gemm(self, y: Array, q_x: Array, amax: Array, in_scale: Array, kernel: Array, dims: tuple) -> Array:
        """flax's GEMM of `y`, given as the kernel wrote it in e4m3 (`q_x`, divided by `in_scale`,
        this layer's `next_input_scale`) with its largest |value| (`amax`, rolled into the history)."""
        dtype = kernel.dtype
        q_x, x_scale = _recorded_input(q_x, amax, in_scale, self.input_scale.value, self.input_amax_history.value)
        q_k, k_scale = fp8_ops.in_q(dtype, self.e4m3_dtype, kernel, self.kernel_scale.value,
                                    self.kernel_amax_history.value)
        out = fp8_ops.quantized_dot(y.astype(dtype), q_x, x_scale, kernel, q_k, k_scale, self.output_grad_scale.value,
                                    self.output_grad_amax_history.value, dims, dtype)
        return fp8_ops.out_dq(dtype, x_scale, k_scale, out)


def norm_qkv(x: PendingNorm, query: Fp8NormInput, key_value: Fp8NormInput, kernel_q: Array, kernel_kv: Array,
             dims: tuple) -> tuple[Array, Array, Array]:
    """An attention's Q/K/V GEMMs whose input is the layer before's FFN end left pending (unrolled
    layers: `chains_layers`): the forward kernel runs once with both input scales (the query's and
    the key/value's: flax's `Fp8Einsum`s "query_fp8" and "key_value_fp8", `query` and `key_value`
    here) and writes the input twice in e4m3, with one amax for both histories (flax's two `in_q`
    passes read the same input). Returns the input (the attention's residual) and the two GEMMs'
    outputs, as the einsums give them (`dims`: theirs)."""
    scales = query.next_input_scale(), key_value.next_input_scale()
    y, q_q, q_kv, amax = x(jnp.concatenate(scales))
    return (y, query.gemm(y, q_q, amax, scales[0], kernel_q, dims),
            key_value.gemm(y, q_kv, amax, scales[1], kernel_kv, dims))


def applies(cfg) -> bool:
    """Whether `cfg`'s sub-layer output denses take this path: FP8 with the LayerNorm kernels
    (`layers.folds_output_bias`), unless switched off (`ENABLED`)."""
    return bool(ENABLED and cfg.fp8 and cfg.fused_ops and fused.supported(cfg.hidden_size))


def chains_layers(cfg) -> bool:
    """Whether each layer leaves its FFN's LayerNorm pending for the next layer's Q/K/V projections
    (`norm_qkv`): where this path `applies`, with the layers unrolled (scanned, the input crosses
    `nn.scan`'s carry) and not rematerialized (a remat'd layer keeps one tensor between layers, what
    remat is for; a pending one holds the FFN output's operands)."""
    return applies(cfg) and not cfg.scan_layers and cfg.remat_policy == "none"

