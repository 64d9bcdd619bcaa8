"""Fused memory-bound passes as Pallas kernels (`BertConfig.fused_ops`): (dense bias +) dropout +
residual add + LayerNorm in one pass forward and one pass backward.

Every encoder sub-layer ends `LayerNorm(dropout(h) + x)`. XLA runs that as several passes and, in
the backward pass, writes `dy * x_hat` in float32 for the scale gradient before reducing it
(~18 ms of BERT-Large's 178 ms H100 step, benchmarks/step/RESULTS.md). Here one kernel reads `h`, `x`
and the dropout mask once per row block and writes `y` and the row statistics (mean, 1/std); the
backward kernel reads them again, recomputes `x_hat`, and writes `dh`, `dx` and per-block partial
sums of the scale and bias gradients (a `[blocks, hidden]` array, summed after). Given `h_bias`,
the bias of the dense layer that produced `h`, the kernels also fold in its add,
`LayerNorm(dropout(h + h_bias) + x)`, and the backward writes its gradient's partial sums the same
way (without it they compile as before: no extra input or output). Given the dropout's threefry
key instead of its mask, the kernels draw the mask themselves, each block its own rows, from each
element's row-major index (`dropout.keep_from_index`: `keep_mask`'s and jax.random.bernoulli's
mask, bit for bit), and the backward draws it again: no int8 mask is written to memory, kept for
the backward, or read (what it costs and saves on a GPU is not measured yet). Given FP8's gradient
scale, the backward writes `dh` cast to float8_e5m2 and each block's largest |dh|; given the input
scales of the FP8 layers that read `y` (one, or two: the query's and the key/value's), the forward
writes `y` also cast to float8_e4m3fn once per scale and each block's largest |y| (`_fp8`; used by
`bert_jax.model.kernels.fused_fp8`, whose custom VJPs span the FP8 dense layers and these kernels).

The arithmetic is the unfused path's, in its dtypes: the dense bias add (`h_bias` rounded to the
compute dtype first), the dropout scaling and the residual add in the compute dtype, the
normalization in float32, the output cast back (`tests/model/test_fused.py` compares both passes against
`layers.LayerNorm` after `dropout.dropout`, with the same mask).
On GPUs the kernels lower through Triton (named: a bare `pallas_call` would go to Mosaic GPU);
elsewhere they run in Pallas' interpreter (correct, slow: for tests). On an H200 they run at
~3.3 TB/s inside BERT-Large's step and make it 1.064x faster (benchmarks/step/RESULTS.md, 2026-11-26);
with the attention and FFN output biases folded in, 1.070x (1.086x pipelined, 2026-11-28); BERT-Base's
step (rows read as 512 + 256 columns) 1.078-1.089x (1.074-1.086x pipelined, 2026-11-28).
Triton loads and stores power-of-two blocks only, so the kernels read and write each row in
power-of-two column pieces (`pieces`): one for 128, 256, 512, 1024 (BERT-Tiny, -Mini, -Small,
-Large), two for BERT-Base's 768 (512 + 256) and MiniLM's 384; hidden sizes that are not a multiple of
16 or need more than `MAX_PIECES` pieces fall back to the unfused path. XLA cannot split a Triton
call over a mesh (it would gather every operand to every device), so on the mesh of `jax.set_mesh`
the kernels run under `jax.shard_map`, each device on its own rows (the activations' batch axes,
`bert_jax.model.kernels.per_device`), the dropout mask drawn from each element's index in the
whole array (the shard's first row goes in with the key), and the partial sums and amaxes reduced over devices after: the same
results as one device (`tests/model/test_fused_per_shard.py`). Rows that cannot split evenly, or a
sequence or hidden axis split over devices, run as one call (gathered: correct, not fast).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from bert_jax.model import dropout as dropout_lib
from bert_jax.model.kernels import per_device

Array = jax.Array

# Launch shapes, per pass: rows per program (halved until it divides the row count) and Triton warps;
# the backward pass walks its block `chunk_rows` rows at a time and keeps the scale and bias
# gradients' partial sums in registers, one [hidden] partial per block. Set from a sweep on an
# H200 at BERT-Large's shapes (`benchmarks/step/fp8.py --kernel_sweep`, benchmarks/step/RESULTS.md).
FORWARD = {"block_rows": 8, "num_warps": 8}
BACKWARD = {"block_rows": 8, "chunk_rows": 1, "num_warps": 4}
# Pallas' interpreter (CPUs, tests) pays for every program and loop step: few, large blocks there.
INTERPRET_FORWARD = {"block_rows": 256, "num_warps": 4}
INTERPRET_BACKWARD = {"block_rows": 256, "chunk_rows": 256, "num_warps": 4}


def pieces(hidden: int) -> tuple[tuple[int, int], ...]:
    """The hidden axis as power-of-two column pieces, `(offset, width)`, widest first: Triton loads
    and stores power-of-two blocks only, so a row of 768 is read as 512 + 256 columns."""
    out, offset = [], 0
    for bit in reversed(range(hidden.bit_length())):
        if hidden & (1 << bit):
            out.append((offset, 1 << bit))
            offset += 1 << bit
    return tuple(out)


MAX_PIECES = 3


def supported(hidden: int) -> bool:
    """Whether the fused kernels take this hidden size: a multiple of 16 made of at most
    `MAX_PIECES` powers of two (768 = 512 + 256, 384 = 256 + 128, 1024; see the module doc)."""
    return hidden >= 16 and hidden % 16 == 0 and len(pieces(hidden)) <= MAX_PIECES


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


E5M2_MAX = float(jnp.finfo(jnp.float8_e5m2).max)  # 57344
E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


def _fp8(g, scale, dtype=jnp.float8_e5m2):
    """FP8's cast, as `flax.linen.fp8_ops.quantize(g, dtype, scale, g.dtype)` does it: `g / scale`
    in g's dtype (the float32 quotient rounded once: the correctly rounded one), clipped to the
    FP8 type's largest finite value, rounded to nearest even. e5m2 for gradients, e4m3 for inputs."""
    most = float(jnp.finfo(dtype).max)
    q = (g.astype(jnp.float32) / scale.astype(g.dtype).astype(jnp.float32)).astype(g.dtype)
    return jnp.clip(q.astype(jnp.float32), -most, most).astype(dtype)


def _sum_input(h, x, keep, keep_prob: float, h_bias=None):
    """`dropout(h + h_bias) + x` exactly as the unfused path computes it: in the compute dtype (the
    float32 `h_bias` rounded to it first, as the dense layer's `h + h_bias.astype(h.dtype)`)."""
    if h_bias is not None:
        h = h + h_bias.astype(h.dtype)[None, :]
    if keep is not None:
        h = jnp.where(keep != 0, _scale_up(h, keep_prob), jnp.zeros_like(h))
    return (h + x).astype(jnp.float32)


def _columns(hidden: int) -> list:
    return [pl.ds(offset, width) for offset, width in pieces(hidden)]


def _row_sum(parts) -> Array:
    """The sum over the hidden axis of a row split into column pieces, `[rows]` float32."""
    return functools.reduce(jnp.add, [jnp.sum(p, axis=1) for p in parts])


def _drawn_keep(key_ref, row0, rows: int, hidden: int, keep_prob: float) -> list:
    """Dropout's keep mask of `rows` rows from row `row0` on, per column piece, drawn from the key
    as `dropout.keep_mask` draws it for the whole `[rows, hidden]` array: the hash of each
    element's row-major index (`dropout.keep_from_index`), so no mask is read or stored. The key's
    third word is the first row of this device's shard (`per_device.per_shard`; 0 on one device)."""
    k0, k1 = key_ref[0], key_ref[1]
    first = key_ref[2] + jnp.asarray(row0).astype(jnp.uint32)
    row = (first + jnp.arange(rows, dtype=jnp.int32).astype(jnp.uint32))[:, None] * np.uint32(hidden)
    return [dropout_lib.keep_from_index(
        k0, k1, row + (offset + jnp.arange(width, dtype=jnp.int32)).astype(jnp.uint32)[None, :], keep_prob)
        for offset, width in pieces(hidden)]


def _forward_kernel(*refs, keep_prob: float, eps: float, dropout: Optional[str], with_h_bias: bool, fp8: int,
                    hidden: int):
    # Inputs h, x, [keep | key], scale, bias, [h_bias], [in_scale]; outputs y, mean, rstd, [q_1..q_fp8, amax].
    # Every row is read and written in power-of-two column pieces (`pieces`): one piece when the
    # hidden size is one. With `fp8` scales (in_scale[fp8]), y is also written as float8_e4m3fn once
    # per scale (`_fp8`) and the block's largest |y| (in y's dtype) as `amax`.
    refs = list(refs)
    h_ref, x_ref = refs.pop(0), refs.pop(0)
    mask_ref = refs.pop(0) if dropout else None
    scale_ref, bias_ref = refs.pop(0), refs.pop(0)
    h_bias_ref = refs.pop(0) if with_h_bias else None
    in_scale_ref = refs.pop(0) if fp8 else None
    y_ref, mean_ref, rstd_ref = refs[:3]
    q_refs, amax_ref = refs[3:3 + fp8], (refs[-1] if fp8 else None)
    cols = _columns(hidden)
    rows = h_ref.shape[0]
    if dropout == "key":
        keep = _drawn_keep(mask_ref, pl.program_id(0) * rows, rows, hidden, keep_prob)
    else:
        keep = [None if mask_ref is None else mask_ref[:, c] for c in cols]
    s = [_sum_input(h_ref[:, c], x_ref[:, c], k, keep_prob, None if h_bias_ref is None else h_bias_ref[c])
         for c, k in zip(cols, keep)]  # [rows, width] float32
    mean = _row_sum(s) / np.float32(hidden)
    centered = [p - mean[:, None] for p in s]
    rstd = jax.lax.rsqrt(_row_sum([p * p for p in centered]) / np.float32(hidden) + eps)
    amax = jnp.zeros((), jnp.float32)
    for c, p in zip(cols, centered):
        y = (p * rstd[:, None] * scale_ref[c][None, :] + bias_ref[c][None, :]).astype(y_ref.dtype)
        y_ref[:, c] = y
        for j, q_ref in enumerate(q_refs):
            q_ref[:, c] = _fp8(y, in_scale_ref[j], jnp.float8_e4m3fn)
        if fp8:
            amax = jnp.maximum(amax, jnp.max(jnp.abs(y.astype(jnp.float32))))
    mean_ref[...] = mean
    rstd_ref[...] = rstd
    if fp8:
        amax_ref[...] = jnp.broadcast_to(amax, (1,))


def _backward_kernel(*refs, keep_prob: float, dropout: Optional[str], with_h_bias: bool, fp8: bool, chunk: int,
                     chunks: int, hidden: int):
    # Inputs h, x, [keep | key], scale, [h_bias], mean, rstd, dy, [grad_scale]; outputs dh, dx, dscale,
    # dbias, [dh_bias], [amax]. With `fp8`, dh is written as float8_e5m2 (`_fp8`) and the block's
    # largest |dh| (before the cast) as `amax`.
    refs = list(refs)
    h_ref, x_ref = refs.pop(0), refs.pop(0)
    mask_ref = refs.pop(0) if dropout else None
    scale_ref = refs.pop(0)
    h_bias_ref = refs.pop(0) if with_h_bias else None
    mean_ref, rstd_ref, dy_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    grad_scale_ref = refs.pop(0) if fp8 else None
    dh_ref, dx_ref, dscale_ref, dbias_ref = refs[:4]
    dh_bias_ref = refs[4] if with_h_bias else None
    amax_ref = refs[-1] if fp8 else None
    cols = _columns(hidden)
    scale = [scale_ref[c][None, :] for c in cols]
    h_bias = [None if h_bias_ref is None else h_bias_ref[c] for c in cols]
    n = np.float32(hidden)
    first_row = pl.program_id(0) * (chunk * chunks)  # (outside the loop: the interpreter's program ids are top-level)

    def rows(i, carry):
        carry, amax = carry
        r = pl.ds(i * chunk, chunk)
        if dropout == "key":  # the forward's mask, drawn again
            keep = _drawn_keep(mask_ref, first_row + i * chunk, chunk, hidden, keep_prob)
        else:
            keep = [None if mask_ref is None else mask_ref[r, c] for c in cols]
        rstd = rstd_ref[r][:, None]
        mean = mean_ref[r][:, None]
        x_hat = [(_sum_input(h_ref[r, c], x_ref[r, c], k, keep_prob, hb) - mean) * rstd
                 for c, k, hb in zip(cols, keep, h_bias)]
        dy = [dy_ref[r, c].astype(jnp.float32) for c in cols]
        g = [d * sc for d, sc in zip(dy, scale)]
        mean_g = (_row_sum(g) / n)[:, None]
        mean_gx = (_row_sum([a * b for a, b in zip(g, x_hat)]) / n)[:, None]
        sums = []
        for j, c in enumerate(cols):
            ds = rstd * (g[j] - mean_g - x_hat[j] * mean_gx)
            ds = ds.astype(dx_ref.dtype)  # the gradient of the sum, in the compute dtype as autodiff has it
            dx_ref[r, c] = ds
            dh = ds if keep[j] is None else jnp.where(keep[j] != 0, _scale_up(ds, keep_prob), jnp.zeros_like(ds))
            if fp8:
                dh_ref[r, c] = _fp8(dh, grad_scale_ref[0])
                amax = jnp.maximum(amax, jnp.max(jnp.abs(dh.astype(jnp.float32))))
            else:
                dh_ref[r, c] = dh
            part = carry[j]
            part = (part[0] + jnp.sum(dy[j] * x_hat[j], axis=0), part[1] + jnp.sum(dy[j], axis=0))
            if with_h_bias:  # the gradient of h + h_bias is dh's (in the compute dtype), summed in float32
                part += (carry[j][2] + jnp.sum(dh.astype(jnp.float32), axis=0),)
            sums.append(part)
        return tuple(sums), amax

    zeros = tuple((jnp.zeros((width,), jnp.float32),) * (3 if with_h_bias else 2) for _, width in pieces(hidden))
    carry = (zeros, jnp.zeros((), jnp.float32))
    if chunks == 1:  # the whole block at once (the interpreter's launch): no loop to run
        partials, amax = rows(0, carry)
    else:
        partials, amax = jax.lax.fori_loop(0, chunks, rows, carry)
    for c, piece in zip(cols, partials):
        for ref, partial in zip((dscale_ref, dbias_ref, dh_bias_ref), piece):
            ref[:, c] = partial[None, :]
    if fp8:
        amax_ref[...] = jnp.broadcast_to(amax, (1,))


def _specs(rows_block: int, hidden: int):
    row = pl.BlockSpec((rows_block, hidden), lambda i: (i, 0))
    vec = pl.BlockSpec((hidden,), lambda i: (0,))
    stat = pl.BlockSpec((rows_block,), lambda i: (i,))
    return row, vec, stat


def _mask_input(keep, key, row, first_row) -> tuple[Optional[str], tuple, list]:
    """The dropout operand (`keep` mask rows, or the 2-word key whole with the shard's first row as a
    third word), its kind and its spec."""
    if key is not None:
        return "key", (jnp.concatenate([key, first_row.astype(jnp.uint32).reshape(1)]),), [
            pl.BlockSpec((3,), lambda i: (0,))]
    if keep is not None:
        return "mask", (keep,), [row]
    return None, (), []


def _forward(h, x, keep, key, scale, bias, h_bias, keep_prob, eps, in_scale=None):
    """y, mean and 1/std; given `in_scale` (float32 `[n]`: the input scales of the FP8 layers that
    read y, one or two), also y as float8_e4m3fn divided by each (`_fp8`), then its largest |value|
    (FP8's input amax, the same for every scale)."""
    out = per_device.per_shard(functools.partial(_forward_call, keep_prob=keep_prob, eps=eps),
                           (h, x, keep, key, scale, bias, h_bias, in_scale), row_args=(0, 1, 2), first_row=True)
    if in_scale is not None:
        *out, amax = out
        return (*out, jnp.max(amax))
    return tuple(out)


def _forward_call(h, x, keep, key, scale, bias, h_bias, in_scale, *, first_row, keep_prob, eps):
    rows, hidden = h.shape
    shape = _launch()[0]
    block = _block_rows(rows, shape["block_rows"])
    row, vec, stat = _specs(block, hidden)
    with_h_bias, fp8 = h_bias is not None, (0 if in_scale is None else in_scale.shape[0])
    dropout, mask, mask_spec = _mask_input(keep, key, row, first_row)
    inputs = (h, x) + mask + (scale, bias) + ((h_bias,) if with_h_bias else ()) + ((in_scale,) if fp8 else ())
    scales = pl.BlockSpec((fp8,), lambda i: (0,))
    in_specs = [row, row] + mask_spec + [vec, vec] + ([vec] if with_h_bias else []) + ([scales] if fp8 else [])
    blocks = rows // block
    return pl.pallas_call(
        functools.partial(_forward_kernel, keep_prob=keep_prob, eps=eps, dropout=dropout,
                          with_h_bias=with_h_bias, fp8=fp8, hidden=hidden),
        grid=(blocks,), in_specs=in_specs,
        out_specs=[row, stat, stat] + [row] * fp8 + ([pl.BlockSpec((1,), lambda i: (i,))] if fp8 else []),
        out_shape=[jax.ShapeDtypeStruct((rows, hidden), h.dtype),
                   jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.float32)]
        + [jax.ShapeDtypeStruct((rows, hidden), jnp.float8_e4m3fn)] * fp8
        + ([jax.ShapeDtypeStruct((blocks,), jnp.float32)] if fp8 else []),
        name="dropout_add_layernorm_fwd", **_backend_args(shape["num_warps"]))(*inputs)


def _backward(h, x, keep, key, scale, h_bias, mean, rstd, dy, keep_prob, grad_scale=None):
    """dh, dx and the summed gradients of scale, bias and (None without it) h_bias; given
    `grad_scale` (float32 `[1]`), dh as float8_e5m2 scaled by it (`_fp8`), and its largest |value|
    before the cast as a sixth result (FP8's gradient amax)."""
    fp8 = grad_scale is not None
    dh, dx, *partials = per_device.per_shard(functools.partial(_backward_call, keep_prob=keep_prob),
                                         (h, x, keep, key, scale, h_bias, mean, rstd, dy, grad_scale),
                                         row_args=(0, 1, 2, 6, 7, 8), first_row=True)
    amax = jnp.max(partials.pop()) if fp8 else None
    dscale, dbias, dh_bias = ([jnp.sum(p, axis=0) for p in partials] + [None])[:3]
    return (dh, dx, dscale, dbias, dh_bias) + ((amax,) if fp8 else ())


def _backward_call(h, x, keep, key, scale, h_bias, mean, rstd, dy, grad_scale, *, first_row, keep_prob):
    """The backward kernel on these rows: dh, dx, the per-block partial sums, [the per-block amax]."""
    rows, hidden = h.shape
    shape = _launch()[1]
    block = _block_rows(rows, shape["block_rows"])
    chunk = min(shape["chunk_rows"], block)
    row, vec, stat = _specs(block, hidden)
    part = pl.BlockSpec((1, hidden), lambda i: (i, 0))
    with_h_bias, fp8 = h_bias is not None, grad_scale is not None
    dropout, mask, mask_spec = _mask_input(keep, key, row, first_row)
    inputs = ((h, x) + mask + (scale,) + ((h_bias,) if with_h_bias else ()) + (mean, rstd, dy)
              + ((grad_scale,) if fp8 else ()))
    in_specs = ([row, row] + mask_spec + [vec] + ([vec] if with_h_bias else []) + [stat, stat, row]
                + ([pl.BlockSpec((1,), lambda i: (0,))] if fp8 else []))
    blocks = rows // block
    parts = 3 if with_h_bias else 2  # [blocks, hidden] partial sums: dscale, dbias[, dh_bias]
    return pl.pallas_call(
        functools.partial(_backward_kernel, keep_prob=keep_prob, dropout=dropout, with_h_bias=with_h_bias,
                          fp8=fp8, chunk=chunk, chunks=block // chunk, hidden=hidden),
        grid=(blocks,), in_specs=in_specs,
        out_specs=[row, row] + [part] * parts + ([pl.BlockSpec((1,), lambda i: (i,))] if fp8 else []),
        out_shape=[jax.ShapeDtypeStruct((rows, hidden), jnp.float8_e5m2 if fp8 else h.dtype),
                   jax.ShapeDtypeStruct((rows, hidden), x.dtype)]
        + [jax.ShapeDtypeStruct((blocks, hidden), jnp.float32)] * parts
        + ([jax.ShapeDtypeStruct((blocks,), jnp.float32)] if fp8 else []),
        name="dropout_add_layernorm_bwd", **_backend_args(shape["num_warps"]))(*inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _fused(h, x, keep, key, scale, bias, h_bias, keep_prob, eps):
    return _forward(h, x, keep, key, scale, bias, h_bias, keep_prob, eps)[0]


def _fused_fwd(h, x, keep, key, scale, bias, h_bias, keep_prob, eps):
    y, mean, rstd = _forward(h, x, keep, key, scale, bias, h_bias, keep_prob, eps)
    return y, (h, x, keep, key, scale, h_bias, mean, rstd)  # the key's 8 bytes, not the mask's rows x hidden


def _fused_bwd(keep_prob, eps, res, dy):
    h, x, keep, key, scale, h_bias, mean, rstd = res
    dh, dx, dscale, dbias, dh_bias = _backward(h, x, keep, key, scale, h_bias, mean, rstd, dy, keep_prob)
    # The mask and the key are integer inputs: no gradient.
    dkeep, dkey = (None if a is None else np.zeros(a.shape, jax.dtypes.float0) for a in (keep, key))
    dh_bias = None if h_bias is None else dh_bias.astype(h_bias.dtype)
    return dh, dx, dkeep, dkey, dscale.astype(scale.dtype), dbias.astype(scale.dtype), dh_bias


_fused.defvjp(_fused_fwd, _fused_bwd)


def kernel_operands(x: Array, keep: Optional[Array], key: Optional[Array], dtype, hidden: int, caller: str):
    """The residual, the dropout mask and the key as the kernels take them: `[rows, hidden]` rows
    in `dtype`, int8 rows, uint32[2] (a mask or a key, not both)."""
    if keep is not None and key is not None:
        raise ValueError(f"{caller}: give the dropout mask (keep) or its key, not both")
    return (x.astype(dtype).reshape(-1, hidden), None if keep is None else keep.reshape(-1, hidden).astype(jnp.int8),
            None if key is None else jnp.asarray(key, jnp.uint32).reshape(2))


def dropout_add_layernorm(h: Array, x: Array, keep: Optional[Array], scale: Array, bias: Array, *,
                          keep_prob: float, eps: float, h_bias: Optional[Array] = None,
                          key: Optional[Array] = None) -> Array:
    """`LayerNorm(dropout(h + h_bias) + x)` over the last axis, fused; `keep` is dropout's boolean
    mask (None: no dropout), `h_bias` the bias of the dense layer that produced `h` (None: none;
    added as the dense layer would, `h + h_bias.astype(h.dtype)`). `h` and `x` in the compute dtype;
    `scale`, `bias` and `h_bias` float32 `[hidden]`. Returns the compute dtype, like
    `layers.LayerNorm`.

    Or, instead of `keep`, `key`: a threefry key's uint32[2] data (`dropout.threefry_key`); the
    kernels then draw the mask `dropout.keep_mask(key, keep_prob, h.shape)` would give, bit for
    bit, each for its own rows (the backward draws it again): no mask is written, stored or read."""
    shape = h.shape
    h2 = h.reshape(-1, shape[-1])
    x2, keep2, key = kernel_operands(x, keep, key, h.dtype, shape[-1], "dropout_add_layernorm")
    h_bias = None if h_bias is None else h_bias.astype(jnp.float32)
    y = _fused(h2, x2, keep2, key, scale.astype(jnp.float32), bias.astype(jnp.float32), h_bias, float(keep_prob),
               float(eps))
    return y.reshape(shape)
