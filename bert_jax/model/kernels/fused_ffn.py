"""The feed-forward block's first half as GEMM kernels with their epilogues (`BertConfig.fused_ffn`).

Every encoder layer computes `gelu(x @ w1 + b1) @ w2`. XLA runs the first GEMM through cuBLAS and
the bias + GELU as a pass of its own that reads the GEMM's output and writes the activation (no
cuBLASLt GELU epilogue is used, benchmarks/step/RESULTS.md, 2026-11-27); in the backward pass it writes
the gradient of the activation, then reads it again with the pre-activation to apply the GELU's
derivative and to sum the bias gradient. Here two Pallas kernels do that work where the GEMMs
produce it:

- forward: `pre = x @ w1 + b1` and `act = gelu(pre)`, both written by the GEMM's program from its
  float32 accumulator (the bias added and the GELU taken before rounding);
- backward: `d_pre = (g @ w2.T) * gelu'(pre)`, the activation's gradient never written, with the
  bias gradient's per-row-block partial sums (`[row blocks, intermediate]`, float32) from the same
  accumulator; `x`'s and `w1`'s gradients from `d_pre`, `w2`'s from `act`, are XLA's GEMMs.

The arithmetic differs from the unfused path only where this rounds later: XLA rounds the GEMM's
output to the compute dtype before the bias and the GELU, here they act on the float32
accumulator (`tests/model/test_fused_ffn.py` compares both passes against the unfused path and a float32
reference). On GPUs the kernels lower through Triton; elsewhere they run in Pallas' interpreter
(correct, slow: for tests). Both GELUs are built (`gelu`, the exact erf form; `gelu_tanh`). The
sizes must divide by the blocks (hidden and intermediate by 64; BERT-Base's 768/3072 and Large's
1024/4096 do); `supported` says. On a mesh of several devices each runs the kernels on its own rows
(`bert_jax.model.kernels.per_device`), the weights whole (a tensor-parallel split of them gathered first).

Measured on an H200 (benchmarks/kernels/RESULTS.md, 2026-11-28): the kernels are more exact than XLA's bf16
path (the bias gradient 26x), but their GEMMs, as Pallas emits them through Triton, run at
0.65-0.75x cuBLAS's (274-363 against ~730 TFLOP/s inside the step), far more than the epilogue
saves: the block runs at 0.81x XLA's speed, BERT-Large's step at 0.90x. So `fused_ffn` is off
by default; what would make it pay is the same epilogue on a GEMM at cuBLAS's speed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bert_jax.model.kernels import pallas_gemm, per_device

Array = jax.Array

# Launch shapes per kernel: an output tile of block_m x block_n, the contraction walked block_k at
# a time, Triton's warps and software-pipelining stages: the fastest of ten each in
# `benchmarks/kernels/fused_ffn.py --sweep` on an H200 at BERT-Large's shapes (benchmarks/kernels/RESULTS.md).
FORWARD = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}
BACKWARD = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4}
INTERPRET = pallas_gemm.INTERPRET

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
ACTIVATIONS = ("gelu", "gelu_tanh", "gelu_new")


def _interpret() -> bool:
    return pallas_gemm.interpret()


def _launch(forward: bool) -> dict:
    if _interpret():
        return INTERPRET
    return FORWARD if forward else BACKWARD


def supported(hidden: int, intermediate: int, activation: str) -> bool:
    """Whether the kernels take these sizes and this activation (see the module doc)."""
    return activation in ACTIVATIONS and hidden % 64 == 0 and intermediate % 64 == 0


# erf by Abramowitz & Stegun's 7.1.26 (absolute error <= 1.5e-7, about float32's rounding): Pallas'
# Triton lowering has no `erf`.
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(v):
    a = jnp.abs(v)
    t = 1.0 / (1.0 + _ERF_P * a)
    poly = t * (_ERF_A[0] + t * (_ERF_A[1] + t * (_ERF_A[2] + t * (_ERF_A[3] + t * _ERF_A[4]))))
    e = 1.0 - poly * jnp.exp(-a * a)
    return jnp.where(v < 0, -e, e)


def _gelu_and_grad(z, activation: str, grad: bool):
    """GELU of float32 `z` (`grad`: its derivative instead), the form `activation` names."""
    if activation == "gelu":
        cdf = 0.5 * (1.0 + _erf(z * _INV_SQRT_2))
        if not grad:
            return z * cdf
        return cdf + z * jnp.exp(-0.5 * z * z) * _INV_SQRT_2PI
    inner = _SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    t = jnp.tanh(inner)
    if not grad:
        return 0.5 * z * (1.0 + t)
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * z * z)


def _forward_kernel(x_ref, w_ref, b_ref, pre_ref, act_ref, *, bm, bn, bk, steps, activation):
    i, j = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)

    def step(s, acc):
        ks = pl.ds(s * bk, bk)
        return acc + jnp.dot(x_ref[rows, ks], w_ref[ks, cols], preferred_element_type=jnp.float32,
                             precision=pallas_gemm.precision(x_ref.dtype))

    acc = pallas_gemm.loop(steps, step, jnp.zeros((bm, bn), jnp.float32))
    z = acc + b_ref[cols].astype(jnp.float32)[None, :]
    pre_ref[rows, cols] = z.astype(pre_ref.dtype)
    act_ref[rows, cols] = _gelu_and_grad(z, activation, grad=False).astype(act_ref.dtype)


def _backward_kernel(g_ref, w_ref, pre_ref, dpre_ref, db_ref, *, bm, bn, bk, steps, activation):
    i, j = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)

    def step(s, acc):  # g[rows, :] @ w[cols, :].T, the contraction over the hidden size
        ks = pl.ds(s * bk, bk)
        return acc + jax.lax.dot_general(g_ref[rows, ks], w_ref[cols, ks], (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32,
                                         precision=pallas_gemm.precision(g_ref.dtype))

    acc = pallas_gemm.loop(steps, step, jnp.zeros((bm, bn), jnp.float32))
    d = acc * _gelu_and_grad(pre_ref[rows, cols].astype(jnp.float32), activation, grad=True)
    dpre_ref[rows, cols] = d.astype(dpre_ref.dtype)
    db_ref[pl.ds(i, 1), cols] = jnp.sum(d, axis=0)[None, :]


def forward(x: Array, w1: Array, b1: Array, activation: str) -> tuple[Array, Array]:
    """`(pre, act)`: `x @ w1 + b1` and its GELU, `[m, intermediate]` in `x`'s dtype (on a mesh, each
    device on its own rows: `bert_jax.model.kernels.per_device`)."""
    return tuple(per_device.per_shard(functools.partial(_forward_call, activation=activation), (x, w1, b1),
                                  row_args=(0,), multiple=pallas_gemm.ROW_MULTIPLE))


def _forward_call(x: Array, w1: Array, b1: Array, activation: str) -> list:
    m, k = x.shape
    n = w1.shape[1]
    shape = _launch(True)
    bm, bn, bk = pallas_gemm.tiles(m, n, k, shape)
    out = jax.ShapeDtypeStruct((m, n), x.dtype)
    return pl.pallas_call(
        functools.partial(_forward_kernel, bm=bm, bn=bn, bk=bk, steps=k // bk, activation=activation),
        grid=(m // bm, n // bn), out_shape=[out, out], name="ffn_gemm_bias_gelu_fwd",
        **pallas_gemm.backend_args(shape, _interpret()))(x, w1, b1)


def backward(g: Array, w2: Array, pre: Array, activation: str) -> tuple[Array, Array]:
    """`(d_pre, d_b1)`: `(g @ w2.T) * gelu'(pre)` in `g`'s dtype and its column sums in float32 (on a
    mesh, each device on its own rows, the column sums' per-block partials summed over all)."""
    dpre, db = per_device.per_shard(functools.partial(_backward_call, activation=activation), (g, w2, pre),
                                row_args=(0, 2), multiple=pallas_gemm.ROW_MULTIPLE)
    return dpre, jnp.sum(db, axis=0)


def _backward_call(g: Array, w2: Array, pre: Array, activation: str) -> list:
    """`d_pre` and the per-block partial column sums `[row blocks, intermediate]`."""
    m, k = g.shape
    n = w2.shape[0]
    shape = _launch(False)
    bm, bn, bk = pallas_gemm.tiles(m, n, k, shape)
    return pl.pallas_call(
        functools.partial(_backward_kernel, bm=bm, bn=bn, bk=bk, steps=k // bk, activation=activation),
        grid=(m // bm, n // bn), name="ffn_gemm_gelu_bwd",
        out_shape=[jax.ShapeDtypeStruct((m, n), g.dtype), jax.ShapeDtypeStruct((m // bm, n), jnp.float32)],
        **pallas_gemm.backend_args(shape, _interpret()))(g, w2, pre)


def _contract(a: Array, b: Array, a_axis: int, b_axis: int) -> Array:
    """`a` and `b` contracted over one axis each, in their dtype (as `Dense` and autodiff do)."""
    return jax.lax.dot_general(a, b, (((a_axis,), (b_axis,)), ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ffn(x, w1, b1, w2, activation):
    _, act = forward(x, w1, b1, activation)
    return _contract(act, w2, 1, 0)


def _ffn_fwd(x, w1, b1, w2, activation):
    pre, act = forward(x, w1, b1, activation)
    return _contract(act, w2, 1, 0), (x, w1, b1, w2, pre, act)


def _ffn_bwd(activation, res, g):
    x, w1, b1, w2, pre, act = res
    dw2 = _contract(act, g, 0, 0)                 # [intermediate, hidden]
    dpre, db1 = backward(g, w2, pre, activation)  # [m, intermediate], [intermediate]
    dx = _contract(dpre, w1, 1, 1)                # [m, hidden]
    dw1 = _contract(x, dpre, 0, 0)                # [hidden, intermediate]
    return dx, dw1, db1.astype(b1.dtype), dw2


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


def gemm_bias_gelu_gemm(x: Array, w1: Array, b1: Array, w2: Array, *, activation: str) -> Array:
    """`gelu(x @ w1 + b1) @ w2` over `x`'s last axis (the second layer's bias is the caller's).
    `x`, `w1` and `w2` in the compute dtype; `b1` float32 (its gradient comes back in float32)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_ffn: activation must be one of {ACTIVATIONS}, got {activation!r}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    x2 = pallas_gemm.pad_rows(x2)  # (zero rows: their outputs are cut off below)
    act = "gelu_tanh" if activation == "gelu_new" else activation
    y = _ffn(x2, w1, b1, w2, act)
    return y[:rows].reshape(*lead, w2.shape[1])
