"""Attention's Q/K/V projections as one GEMM kernel each way (`BertConfig.fused_qkv`).

Every encoder layer computes `q, k, v = x @ w_q + b_q, x @ w_k + b_k, x @ w_v + b_v`, each then
seen as `[batch, length, heads, head_dim]`. XLA runs it as one GEMM against the three kernels
stacked at run time, then three strided slices of its `[rows, 3, hidden]` output (bias added in a
pass of its own); in the backward it stacks the three gradients again for the input's and the
kernels' GEMMs and sums the bias gradients in passes over them (on an H200 at BERT-Large, 3.4 ms
of bias gradients and stacking and 2.2 ms of slices a step: benchmarks/kernels/RESULTS.md, 2026-11-28).
Here three Pallas kernels (`bert_jax.model.kernels.pallas_gemm`) do that work inside the GEMMs:

- forward: one launch over `[row blocks, 3, column blocks]`: each program multiplies `x` by one
  of the three kernels (read where they are: nothing stacked) and writes, from its float32
  accumulator with the bias added, a tile of q, k or v, already in the `[rows, heads * head_dim]`
  layout that is `[batch, length, heads, head_dim]` without a copy (the head split is the
  epilogue's addressing: no slices);
- backward, the input's gradient: `dx = dq @ w_q.T + dk @ w_k.T + dv @ w_v.T`, one contraction
  walked through the three gradients in turn (nothing stacked);
- backward, the kernels' gradients: `dw_t = x.T @ d_t` over the rows, and in the same pass, from the
  same tiles of `d_t` the program reads for its GEMM, the bias gradient `db_t = sum_rows(d_t)` in
  float32 (no pass of its own; the programs of the kernel's first row block sum it, the others
  read the same tiles and skip the sums).

The arithmetic differs from the unfused path only where this rounds later: XLA rounds the GEMM's
output to the compute dtype before adding the bias (in the compute dtype), and sums the bias
gradient from the compute-dtype gradients; here the bias is added to the float32 accumulator and
its gradient summed in float32 (`tests/model/test_fused_qkv.py` compares both passes against the
unfused path and a float32 reference). The hidden size must divide by 64 (BERT-Base's 768, Large's
1024 do): `supported`. On a mesh of several devices each runs the kernels on its own rows
(`bert_jax.model.kernels.per_device`), the weights whole, their gradients summed over the devices.

Speed: not yet timed on a GPU (`benchmarks/kernels/fused_qkv.py`, `benchmarks/gpu/fused_qkv.sh`).
Pallas' Triton GEMMs ran at 0.65-0.75x cuBLAS's in the FFN kernels (benchmarks/kernels/RESULTS.md,
2026-11-28); these are GEMMs of the same kind, so `fused_qkv` stays off by default until measured.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bert_jax.model.kernels import pallas_gemm, per_device

Array = jax.Array

# Launch shapes per kernel (see `bert_jax.model.kernels.pallas_gemm`): the FFN kernels' fastest at
# BERT-Large's shapes on an H200 (its forward for the forward, its backward for both backward
# kernels) until `benchmarks/kernels/fused_qkv.py --sweep` measures these.
FORWARD = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}
BACKWARD_INPUT = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4}
BACKWARD_WEIGHTS = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4}
INTERPRET = pallas_gemm.INTERPRET

_CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # a[k, m] . b[k, n] -> [m, n]
_CONTRACT_COLS = (((1,), (1,)), ((), ()))  # a[m, k] . b[n, k] -> [m, n]


def _interpret() -> bool:
    return pallas_gemm.interpret()


def _launch(shape: dict) -> dict:
    return INTERPRET if _interpret() else shape


def supported(hidden: int) -> bool:
    """Whether the kernels take this hidden size (see the module doc)."""
    return hidden % 64 == 0


def _each_projection(t, refs, body) -> None:
    """`body(*refs[p])` for the projection `p` (0: query, 1: key, 2: value) that the traced `t`
    names: a Pallas ref cannot be chosen by a traced index, so one branch per projection."""
    for p, group in enumerate(refs):
        pl.when(t == p)(functools.partial(body, *group))


def _forward_kernel(x_ref, wq_ref, wk_ref, wv_ref, bq_ref, bk_ref, bv_ref, q_ref, k_ref, v_ref, *,
                    bm, bn, bk, steps):
    i, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)

    def project(w_ref, b_ref, out_ref):
        def step(s, acc):
            ks = pl.ds(s * bk, bk)
            return acc + jnp.dot(x_ref[rows, ks], w_ref[ks, cols], preferred_element_type=jnp.float32,
                                 precision=pallas_gemm.precision(x_ref.dtype))

        acc = pallas_gemm.loop(steps, step, jnp.zeros((bm, bn), jnp.float32))
        out_ref[rows, cols] = (acc + b_ref[cols].astype(jnp.float32)[None, :]).astype(out_ref.dtype)

    _each_projection(t, ((wq_ref, bq_ref, q_ref), (wk_ref, bk_ref, k_ref), (wv_ref, bv_ref, v_ref)), project)


def _input_grad_kernel(dq_ref, dk_ref, dv_ref, wq_ref, wk_ref, wv_ref, dx_ref, *, bm, bn, bk, steps):
    i, j = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)
    acc = jnp.zeros((bm, bn), jnp.float32)
    for d_ref, w_ref in ((dq_ref, wq_ref), (dk_ref, wk_ref), (dv_ref, wv_ref)):
        def step(s, acc, d_ref=d_ref, w_ref=w_ref):  # d[rows, :] @ w[cols, :].T
            ks = pl.ds(s * bk, bk)
            return acc + jax.lax.dot_general(d_ref[rows, ks], w_ref[cols, ks], _CONTRACT_COLS,
                                             preferred_element_type=jnp.float32,
                                             precision=pallas_gemm.precision(d_ref.dtype))

        acc = pallas_gemm.loop(steps, step, acc)
    dx_ref[rows, cols] = acc.astype(dx_ref.dtype)


def _weight_grad_kernel(x_ref, dq_ref, dk_ref, dv_ref, dwq_ref, dwk_ref, dwv_ref, db_ref, *,
                        bm, bn, bk, steps):
    i, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ins, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)  # the kernel's rows (x's columns), its columns

    def grads(p, d_ref, dw_ref, with_bias: bool):
        def step(s, carry):  # x[rows, ins].T @ d[rows, cols] (and d's column sums) over the rows
            acc, col_sums = carry
            rs = pl.ds(s * bk, bk)
            d = d_ref[rs, cols]
            acc = acc + jax.lax.dot_general(x_ref[rs, ins], d, _CONTRACT_ROWS, preferred_element_type=jnp.float32,
                                            precision=pallas_gemm.precision(x_ref.dtype))
            return acc, (col_sums + jnp.sum(d.astype(jnp.float32), axis=0)) if with_bias else col_sums

        init = (jnp.zeros((bm, bn), jnp.float32), jnp.zeros((bn,), jnp.float32))
        acc, col_sums = pallas_gemm.loop(steps, step, init)
        dw_ref[ins, cols] = acc.astype(dw_ref.dtype)
        if with_bias:
            db_ref[pl.ds(p, 1), cols] = col_sums[None, :]

    # Every row block of the kernel reads the same columns of d: only the first sums them (on a GPU
    # the sums run on the CUDA cores, ~1/128 of the GEMM's operations per row block that does them).
    refs = ((0, dq_ref, dwq_ref), (1, dk_ref, dwk_ref), (2, dv_ref, dwv_ref))
    pl.when(i == 0)(lambda: _each_projection(t, refs, functools.partial(grads, with_bias=True)))
    pl.when(i != 0)(lambda: _each_projection(t, refs, functools.partial(grads, with_bias=False)))


def forward(x: Array, wq: Array, wk: Array, wv: Array, bq: Array, bk: Array, bv: Array) -> tuple[Array, Array, Array]:
    """`(q, k, v)`: `x @ w_t + b_t` for `x` `[m, hidden]` and each `w_t` `[hidden, n]`, `[m, n]` in
    `x`'s dtype (on a mesh, each device on its own rows: `bert_jax.model.kernels.per_device`)."""
    return tuple(per_device.per_shard(_forward_call, (x, wq, wk, wv, bq, bk, bv), row_args=(0,),
                                  multiple=pallas_gemm.ROW_MULTIPLE))


def _forward_call(x, wq, wk, wv, bq, bk, bv) -> list:
    m, k = x.shape
    n = wq.shape[1]
    shape = _launch(FORWARD)
    bm, bn, bk_ = pallas_gemm.tiles(m, n, k, shape)
    out = jax.ShapeDtypeStruct((m, n), x.dtype)
    return pl.pallas_call(
        functools.partial(_forward_kernel, bm=bm, bn=bn, bk=bk_, steps=k // bk_),
        grid=(m // bm, 3, n // bn), out_shape=[out, out, out], name="qkv_gemm_bias_fwd",
        **pallas_gemm.backend_args(shape, _interpret()))(x, wq, wk, wv, bq, bk, bv)


def input_grad(dq: Array, dk: Array, dv: Array, wq: Array, wk: Array, wv: Array) -> Array:
    """`dq @ w_q.T + dk @ w_k.T + dv @ w_v.T`, `[m, hidden]` in `dq`'s dtype (per device's rows)."""
    return per_device.per_shard(_input_grad_call, (dq, dk, dv, wq, wk, wv), row_args=(0, 1, 2),
                            multiple=pallas_gemm.ROW_MULTIPLE)


def _input_grad_call(dq, dk, dv, wq, wk, wv) -> Array:
    m, n = dq.shape
    k = wq.shape[0]
    shape = _launch(BACKWARD_INPUT)
    bm, bn, bk = pallas_gemm.tiles(m, k, n, shape)
    return pl.pallas_call(
        functools.partial(_input_grad_kernel, bm=bm, bn=bn, bk=bk, steps=n // bk),
        grid=(m // bm, k // bn), out_shape=jax.ShapeDtypeStruct((m, k), dq.dtype), name="qkv_gemm_dx_bwd",
        **pallas_gemm.backend_args(shape, _interpret()))(dq, dk, dv, wq, wk, wv)


def weight_grads(x: Array, dq: Array, dk: Array, dv: Array) -> tuple[tuple[Array, Array, Array], Array]:
    """`((dw_q, dw_k, dw_v), db)`: each `x.T @ d_t` (`[hidden, n]` in `x`'s dtype) and the bias
    gradients' `[3, n]` column sums of `dq`, `dk`, `dv` in float32 (on a mesh, each device's over its
    own rows, then summed over the devices)."""
    *dws, db = per_device.per_shard(_weight_grads_call, (x, dq, dk, dv), row_args=(0, 1, 2, 3), summed=True,
                                multiple=pallas_gemm.ROW_MULTIPLE)
    return tuple(dws), db


def _weight_grads_call(x, dq, dk, dv) -> list:
    m, k = x.shape
    n = dq.shape[1]
    shape = _launch(BACKWARD_WEIGHTS)
    bm, bn, bk = pallas_gemm.tiles(k, n, m, shape)
    dw = jax.ShapeDtypeStruct((k, n), x.dtype)
    return pl.pallas_call(
        functools.partial(_weight_grad_kernel, bm=bm, bn=bn, bk=bk, steps=m // bk),
        grid=(k // bm, 3, n // bn), name="qkv_gemm_dw_db_bwd",
        out_shape=[dw, dw, dw, jax.ShapeDtypeStruct((3, n), jnp.float32)],
        **pallas_gemm.backend_args(shape, _interpret()))(x, dq, dk, dv)


@jax.custom_vjp
def _qkv(x, wq, wk, wv, bq, bk, bv):
    return forward(x, wq, wk, wv, bq, bk, bv)


def _qkv_fwd(x, wq, wk, wv, bq, bk, bv):
    return forward(x, wq, wk, wv, bq, bk, bv), (x, wq, wk, wv)


def _qkv_bwd(res, g):
    x, wq, wk, wv = res
    dq, dk, dv = g
    dx = input_grad(dq, dk, dv, wq, wk, wv)
    dws, db = weight_grads(x, dq, dk, dv)
    return (dx, *dws, db[0], db[1], db[2])


_qkv.defvjp(_qkv_fwd, _qkv_bwd)


def qkv_projection(x: Array, kernels, biases) -> tuple[Array, Array, Array]:
    """`(q, k, v)`, each `x @ kernel + bias` over `x`'s last axis, `[..., heads, head_dim]` in `x`'s
    dtype, from the query, key and value `kernels` (`[hidden, heads, head_dim]`, in `x`'s dtype)
    and `biases` (`[heads, head_dim]`; their gradients come back in their dtype, summed in float32)."""
    if len(kernels) != 3 or len(biases) != 3:
        raise ValueError(f"fused_qkv: three kernels and three biases (query, key, value), got "
                         f"{len(kernels)} and {len(biases)}")
    lead, hidden = x.shape[:-1], x.shape[-1]
    out_shape = kernels[0].shape[1:]
    n = kernels[0].size // hidden
    x2 = x.reshape(-1, hidden)
    rows = x2.shape[0]
    ws = [w.astype(x.dtype).reshape(hidden, n) for w in kernels]
    bs = [b.astype(jnp.float32).reshape(n) for b in biases]
    q, k, v = _qkv(pallas_gemm.pad_rows(x2), *ws, *bs)
    return tuple(y[:rows].reshape(*lead, *out_shape) for y in (q, k, v))
