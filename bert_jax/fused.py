"""Fused memory-bound passes as Pallas kernels (`BertConfig.fused_ops`): (dense bias +) dropout +
residual add + LayerNorm in one pass forward and one pass backward.

Every encoder sub-layer ends `LayerNorm(dropout(h) + x)`. XLA runs that as several passes and, in
the backward pass, writes `dy * x_hat` in float32 for the scale gradient before reducing it
(~18 ms of BERT-Large's 178 ms H100 step, benchmarks/RESULTS.md). Here one kernel reads `h`, `x`
and the dropout mask once per row block and writes `y` and the row statistics (mean, 1/std); the
backward kernel reads them again, recomputes `x_hat`, and writes `dh`, `dx` and per-block partial
sums of the scale and bias gradients (a `[blocks, hidden]` array, summed after). Given `h_bias`,
the bias of the dense layer that produced `h`, the kernels also fold in its add,
`LayerNorm(dropout(h + h_bias) + x)`, and the backward writes its gradient's partial sums the same
way (without it they compile as before: no extra input or output).

The arithmetic is the unfused path's, in its dtypes: the dense bias add (`h_bias` rounded to the
compute dtype first), the dropout scaling and the residual add in the compute dtype, the
normalization in float32, the output cast back (`tests/test_fused.py` compares both passes against
`modeling.LayerNorm` after `dropout.dropout`, with the same mask).
On GPUs the kernels lower through Triton (named: a bare `pallas_call` would go to Mosaic GPU);
elsewhere they run in Pallas' interpreter (correct, slow: for tests). On an H200 they run at
~3.3 TB/s inside BERT-Large's step and make it 1.064x faster (benchmarks/RESULTS.md, 2026-11-26);
with the attention and FFN output biases folded in, 1.070x (1.086x pipelined, 2026-11-28).
The hidden size must be a power of two (Triton's block shapes): 128, 256, 512, 1024 (BERT-Tiny,
-Mini, -Small, -Large); BERT-Base's 768 falls back to the unfused path. The kernels are meant for
one GPU: XLA cannot split a Triton call over a mesh, so on several devices it gathers the operands
to every device first (correct, not fast; running the kernel under `shard_map` over the batch axes
is not built yet).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

Array = jax.Array

# Launch shapes, per pass: rows per program (halved until it divides the row count) and Triton warps;
# the backward pass walks its block `chunk_rows` rows at a time and keeps the scale and bias
# gradients' partial sums in registers, one [hidden] partial per block. Set from a sweep on an
# H200 at BERT-Large's shapes (`benchmarks/bench_fp8.py --kernel_sweep`, benchmarks/RESULTS.md).
FORWARD = {"block_rows": 8, "num_warps": 8}
BACKWARD = {"block_rows": 8, "chunk_rows": 1, "num_warps": 4}
# Pallas' interpreter (CPUs, tests) pays for every program and loop step: few, large blocks there.
INTERPRET_FORWARD = {"block_rows": 256, "num_warps": 4}
INTERPRET_BACKWARD = {"block_rows": 256, "chunk_rows": 256, "num_warps": 4}


def supported(hidden: int) -> bool:
    """Whether the fused kernels take this hidden size (a power of two; see the module doc)."""
    return hidden >= 16 and hidden & (hidden - 1) == 0


def _block_rows(rows: int, most: int) -> int:
    block = most
    while rows % block:
        block //= 2
    return block


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def _launch() -> tuple[dict, dict]:
    """The forward's and the backward's launch shapes on this backend."""
    return (INTERPRET_FORWARD, INTERPRET_BACKWARD) if _interpret() else (FORWARD, BACKWARD)


def _backend_args(num_warps: int) -> dict:
    """Triton, named: since jax 0.10 a `pallas_call` without compiler parameters lowers through
    Mosaic GPU on NVIDIA GPUs, whose copies take at most 256 elements along a dimension."""
    if _interpret():
        return {"interpret": True}
    return {"compiler_params": pl_triton.CompilerParams(num_warps=num_warps, num_stages=1)}


def _scale_up(v, keep_prob: float):
    """`v / keep_prob` rounded to `v`'s dtype. Triton divides no bfloat16 tensors: the quotient in
    float32, rounded once to bfloat16, is the correctly rounded bfloat16 quotient (float32 carries
    more than 2 x 8 + 2 bits), the value XLA's bfloat16 division gives."""
    return (v.astype(jnp.float32) / jnp.float32(keep_prob)).astype(v.dtype)


def _sum_input(h, x, keep, keep_prob: float, h_bias=None):
    """`dropout(h + h_bias) + x` exactly as the unfused path computes it: in the compute dtype (the
    float32 `h_bias` rounded to it first, as the dense layer's `h + h_bias.astype(h.dtype)`)."""
    if h_bias is not None:
        h = h + h_bias.astype(h.dtype)[None, :]
    if keep is not None:
        h = jnp.where(keep != 0, _scale_up(h, keep_prob), jnp.zeros_like(h))
    return (h + x).astype(jnp.float32)


def _forward_kernel(*refs, keep_prob: float, eps: float, dropout: bool, with_h_bias: bool):
    # Inputs h, x, [keep], scale, bias, [h_bias]; outputs y, mean, rstd.
    refs = list(refs)
    h_ref, x_ref = refs.pop(0), refs.pop(0)
    keep = refs.pop(0)[...] if dropout else None
    scale_ref, bias_ref = refs.pop(0), refs.pop(0)
    h_bias = refs.pop(0)[...] if with_h_bias else None
    y_ref, mean_ref, rstd_ref = refs
    s = _sum_input(h_ref[...], x_ref[...], keep, keep_prob, h_bias)  # [rows, hidden] float32
    mean = jnp.mean(s, axis=1)
    centered = s - mean[:, None]
    rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=1) + eps)
    y = centered * rstd[:, None] * scale_ref[...][None, :] + bias_ref[...][None, :]
    y_ref[...] = y.astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _backward_kernel(*refs, keep_prob: float, dropout: bool, with_h_bias: bool, chunk: int, chunks: int):
    # Inputs h, x, [keep], scale, [h_bias], mean, rstd, dy; outputs dh, dx, dscale, dbias, [dh_bias].
    refs = list(refs)
    h_ref, x_ref = refs.pop(0), refs.pop(0)
    keep_ref = refs.pop(0) if dropout else None
    scale_ref = refs.pop(0)
    h_bias = refs.pop(0)[...] if with_h_bias else None
    mean_ref, rstd_ref, dy_ref, dh_ref, dx_ref, dscale_ref, dbias_ref = refs[:7]
    dh_bias_ref = refs[7] if with_h_bias else None
    scale = scale_ref[...][None, :]

    def rows(i, carry):
        r = pl.ds(i * chunk, chunk)
        keep = None if keep_ref is None else keep_ref[r, :]
        s = _sum_input(h_ref[r, :], x_ref[r, :], keep, keep_prob, h_bias)
        rstd = rstd_ref[r][:, None]
        x_hat = (s - mean_ref[r][:, None]) * rstd
        dy = dy_ref[r, :].astype(jnp.float32)
        g = dy * scale
        ds = rstd * (g - jnp.mean(g, axis=1)[:, None] - x_hat * jnp.mean(g * x_hat, axis=1)[:, None])
        ds = ds.astype(dx_ref.dtype)  # the gradient of the sum, in the compute dtype as autodiff has it
        dx_ref[r, :] = ds
        dh = ds if keep is None else jnp.where(keep != 0, _scale_up(ds, keep_prob), jnp.zeros_like(ds))
        dh_ref[r, :] = dh
        sums = carry[0] + jnp.sum(dy * x_hat, axis=0), carry[1] + jnp.sum(dy, axis=0)
        if with_h_bias:  # the gradient of h + h_bias is dh's (in the compute dtype), summed in float32
            sums += (carry[2] + jnp.sum(dh.astype(jnp.float32), axis=0),)
        return sums

    zero = jnp.zeros(scale_ref.shape, jnp.float32)
    zeros = (zero,) * (3 if with_h_bias else 2)
    if chunks == 1:  # the whole block at once (the interpreter's launch): no loop to run
        partials = rows(0, zeros)
    else:
        partials = jax.lax.fori_loop(0, chunks, rows, zeros)
    for ref, partial in zip((dscale_ref, dbias_ref, dh_bias_ref), partials):
        ref[...] = partial[None, :]


def _specs(rows_block: int, hidden: int):
    row = pl.BlockSpec((rows_block, hidden), lambda i: (i, 0))
    vec = pl.BlockSpec((hidden,), lambda i: (0,))
    stat = pl.BlockSpec((rows_block,), lambda i: (i,))
    return row, vec, stat


def _forward(h, x, keep, scale, bias, h_bias, keep_prob, eps):
    rows, hidden = h.shape
    shape = _launch()[0]
    block = _block_rows(rows, shape["block_rows"])
    row, vec, stat = _specs(block, hidden)
    dropout, with_h_bias = keep is not None, h_bias is not None
    inputs = (h, x) + ((keep,) if dropout else ()) + (scale, bias) + ((h_bias,) if with_h_bias else ())
    in_specs = [row, row] + ([row] if dropout else []) + [vec, vec] + ([vec] if with_h_bias else [])
    return pl.pallas_call(
        functools.partial(_forward_kernel, keep_prob=keep_prob, eps=eps, dropout=dropout,
                          with_h_bias=with_h_bias),
        grid=(rows // block,), in_specs=in_specs, out_specs=[row, stat, stat],
        out_shape=[jax.ShapeDtypeStruct((rows, hidden), h.dtype),
                   jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.float32)],
        name="dropout_add_layernorm_fwd", **_backend_args(shape["num_warps"]))(*inputs)


def _backward(h, x, keep, scale, h_bias, mean, rstd, dy, keep_prob):
    """dh, dx and the summed gradients of scale, bias and (None without it) h_bias."""
    rows, hidden = h.shape
    shape = _launch()[1]
    block = _block_rows(rows, shape["block_rows"])
    chunk = min(shape["chunk_rows"], block)
    row, vec, stat = _specs(block, hidden)
    part = pl.BlockSpec((1, hidden), lambda i: (i, 0))
    dropout, with_h_bias = keep is not None, h_bias is not None
    inputs = ((h, x) + ((keep,) if dropout else ()) + (scale,) + ((h_bias,) if with_h_bias else ())
              + (mean, rstd, dy))
    in_specs = [row, row] + ([row] if dropout else []) + [vec] + ([vec] if with_h_bias else []) + [stat, stat, row]
    blocks = rows // block
    parts = 3 if with_h_bias else 2  # [blocks, hidden] partial sums: dscale, dbias[, dh_bias]
    dh, dx, *partials = pl.pallas_call(
        functools.partial(_backward_kernel, keep_prob=keep_prob, dropout=dropout, with_h_bias=with_h_bias,
                          chunk=chunk, chunks=block // chunk),
        grid=(blocks,), in_specs=in_specs, out_specs=[row, row] + [part] * parts,
        out_shape=[jax.ShapeDtypeStruct((rows, hidden), h.dtype), jax.ShapeDtypeStruct((rows, hidden), x.dtype)]
        + [jax.ShapeDtypeStruct((blocks, hidden), jnp.float32)] * parts,
        name="dropout_add_layernorm_bwd", **_backend_args(shape["num_warps"]))(*inputs)
    dscale, dbias, dh_bias = ([jnp.sum(p, axis=0) for p in partials] + [None])[:3]
    return dh, dx, dscale, dbias, dh_bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _fused(h, x, keep, scale, bias, h_bias, keep_prob, eps):
    return _forward(h, x, keep, scale, bias, h_bias, keep_prob, eps)[0]


def _fused_fwd(h, x, keep, scale, bias, h_bias, keep_prob, eps):
    y, mean, rstd = _forward(h, x, keep, scale, bias, h_bias, keep_prob, eps)
    return y, (h, x, keep, scale, h_bias, mean, rstd)


def _fused_bwd(keep_prob, eps, res, dy):
    h, x, keep, scale, h_bias, mean, rstd = res
    dh, dx, dscale, dbias, dh_bias = _backward(h, x, keep, scale, h_bias, mean, rstd, dy, keep_prob)
    dkeep = None if keep is None else np.zeros(keep.shape, jax.dtypes.float0)  # an integer input
    dh_bias = None if h_bias is None else dh_bias.astype(h_bias.dtype)
    return dh, dx, dkeep, dscale.astype(scale.dtype), dbias.astype(scale.dtype), dh_bias


_fused.defvjp(_fused_fwd, _fused_bwd)


def dropout_add_layernorm(h: Array, x: Array, keep: Optional[Array], scale: Array, bias: Array, *,
                          keep_prob: float, eps: float, h_bias: Optional[Array] = None) -> Array:
    """`LayerNorm(dropout(h + h_bias) + x)` over the last axis, fused; `keep` is dropout's boolean
    mask (None: no dropout), `h_bias` the bias of the dense layer that produced `h` (None: none;
    added as the dense layer would, `h + h_bias.astype(h.dtype)`). `h` and `x` in the compute dtype;
    `scale`, `bias` and `h_bias` float32 `[hidden]`. Returns the compute dtype, like
    `modeling.LayerNorm`."""
    shape = h.shape
    hidden = shape[-1]
    h2, x2 = h.reshape(-1, hidden), x.astype(h.dtype).reshape(-1, hidden)
    keep2 = None if keep is None else keep.reshape(-1, hidden).astype(jnp.int8)
    h_bias = None if h_bias is None else h_bias.astype(jnp.float32)
    y = _fused(h2, x2, keep2, scale.astype(jnp.float32), bias.astype(jnp.float32), h_bias, float(keep_prob),
               float(eps))
    return y.reshape(shape)
