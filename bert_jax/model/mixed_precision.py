"""Matmuls with bfloat16 inputs and float32 accumulation and outputs (`BertConfig.mixed_matmuls`).

On CPUs with bf16 matmul units (x86's `avx512_bf16` or `amx_bf16`, Arm's `bf16`) XLA's CPU backend
has a fast kernel for a dot that takes bfloat16 inputs and produces float32; a dot that produces
bfloat16 falls on a slow path (issue 57's table, an AMD EPYC with avx512_bf16: 1.98x against
float32 for `[1024, 768] x [768, 3072]`, and slower than float32 with a bf16 output). So this path
keeps the model in float32 (parameters, activations, LayerNorm, softmax, losses, the optimizer)
and runs only the matmuls with their inputs rounded to bfloat16: forward, and both gradients of
each matmul in the backward (the output's gradient rounded to bfloat16 too), every one of them
accumulating and returning float32. Autodiff alone would not: the transpose of a dot with a
float32 output takes the float32 cotangent against a bfloat16 operand, a float32 dot.

`einsum(spec, a, b)` is that matmul for any two-operand einsum whose every input index appears in
the output or in the other input (all of BERT's). Numerically it equals the float32 einsum of
`a` and `b` rounded to bfloat16, and its gradients the float32 ones of the same rounded values
(tests/model/test_mixed_precision.py).

On a CPU without bf16 units the bfloat16 inputs are converted in software and the path is slower
than float32 (an AMD EPYC Zen 3, 2026-11-28: 0.66x for the dense layer above, docs/performance.md);
and the units alone do not make it faster: an Intel Xeon with `avx512_bf16` but no AMX runs it at
0.57x (2026-11-29). `bf16_units()` tells which CPU this is and `bf16_matmul_speedup()` measures
what the path gains on it: `config.cpu_bf16="auto"` turns the path on only where the CPU reports
the units and the measured matmul is faster, and a bfloat16 setting on a CPU without them is warned
about (`bert_jax.training.run_setup.bert_config_from`).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from data_pipeline import storage

Array = jax.Array

# /proc/cpuinfo flags of bf16 matmul units: x86 (AVX512-BF16, AMX-BF16) and Arm (FEAT_BF16).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def bf16_units(cpuinfo: Optional[str] = None) -> list[str]:
    """The bf16 matmul flags this CPU reports (`/proc/cpuinfo`'s flags or features; [] if none
    or unknown, e.g. not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = storage.read_text("/proc/cpuinfo")
        except (OSError, UnicodeDecodeError):
            return []
    found: set = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            found.update(flag for flag in value.split() if flag in BF16_FLAGS)
    return sorted(found)


def bf16_matmul_speedup(rows: int = 512, k: int = 768, n: int = 3072, repeats: int = 5) -> float:
    """How much faster this CPU runs `einsum` (bf16 inputs, float32 out) than the float32 einsum,
    measured: a BERT-Base dense layer's `[rows, k] x [k, n]`, each form jitted and called once to
    warm up, then the best of `repeats` calls (~0.3 s in all on 2 cores). Reporting the units is not
    enough: an Intel Xeon (family 6 model 207) with `avx512_bf16` but no AMX ran this matmul 0.57x
    as fast as float32, and PyTorch's bf16 matmul (oneDNN) 0.63x (2026-11-29, docs/performance.md).
    The operands are drawn by numpy: `jax.random.normal` would compile two programs (~0.3 s) at the
    start of every run that decides "auto"."""
    rng = np.random.default_rng(0)
    a, b = (jax.device_put(rng.standard_normal(shape, np.float32)) for shape in ((rows, k), (k, n)))
    f32 = min(call_times(jax.jit(lambda a, b: a @ b), a, b, repeats))
    return f32 / min(call_times(jax.jit(lambda a, b: einsum("mk,kn->mn", a, b)), a, b, repeats))


def call_times(fn, a: Array, b: Array, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls `fn(a, b)`, after one call to compile and warm up."""
    import time

    fn(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return times


def _check(spec: str) -> tuple[str, str, str]:
    inputs, _, out = spec.replace(" ", "").partition("->")
    lhs, _, rhs = inputs.partition(",")
    if not out or not rhs or "." in spec:
        raise ValueError(f"mixed_precision.einsum takes 'lhs,rhs->out' without ellipses, got {spec!r}")
    for name, operand, other in (("first", lhs, rhs), ("second", rhs, lhs)):
        lost = set(operand) - set(out) - set(other)
        if lost:
            raise ValueError(f"mixed_precision.einsum {spec!r}: the {name} input's index {sorted(lost)} is in "
                             "neither the output nor the other input (its gradient would need a broadcast)")
    return lhs, rhs, out


def _bf16(x: Array) -> Array:
    return x.astype(jnp.bfloat16)


def _matmul(spec: str, a: Array, b: Array) -> Array:
    """`einsum(spec, a, b)` of bfloat16 `a`, `b` into float32, as one batched matmul
    `[batch, m, k] x [batch, k, n]`: each operand transposed to that layout first. XLA's CPU
    backend (jax 0.10.2) runs some bfloat16 x bfloat16 -> float32 dots in other layouts not at all
    ("Unsupported element type for DotThunk::Execute", e.g. `bqhd,bhqk->bkhd`); this form it runs."""
    lhs, rhs, out = _check(spec)
    batch = [c for c in out if c in lhs and c in rhs]
    contract = [c for c in lhs if c in rhs and c not in out]
    m = [c for c in lhs if c not in batch and c not in contract]
    n = [c for c in rhs if c not in batch and c not in contract]
    size = {**dict(zip(lhs, a.shape)), **dict(zip(rhs, b.shape))}

    def prod(chars):
        return int(np.prod([size[c] for c in chars], dtype=np.int64))

    a3 = jnp.transpose(a, [lhs.index(c) for c in batch + m + contract]).reshape(prod(batch), prod(m), prod(contract))
    b3 = jnp.transpose(b, [rhs.index(c) for c in batch + contract + n]).reshape(prod(batch), prod(contract), prod(n))
    # The barriers keep XLA from folding the transposes back into the dot (its operands' or, as
    # the dot of the swapped operands, its output's): those forms are the unsupported ones.
    a3, b3 = jax.lax.optimization_barrier((a3, b3))
    c3 = jax.lax.dot_general(a3, b3, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    c3 = jax.lax.optimization_barrier(c3)
    c = c3.reshape([size[ch] for ch in batch + m + n])
    order = batch + m + n
    return jnp.transpose(c, [order.index(ch) for ch in out])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum(spec: str, a: Array, b: Array) -> Array:
    return _matmul(spec, _bf16(a), _bf16(b))


def _einsum_fwd(spec, a, b):
    # The rounded inputs are what the backward needs (half the bytes); empty arrays carry the
    # inputs' dtypes (a residual must be an array).
    a16, b16 = _bf16(a), _bf16(b)
    return _matmul(spec, a16, b16), (a16, b16, jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))


def _einsum_bwd(spec, res, g):
    a16, b16, a_dtype, b_dtype = res
    lhs, rhs, out = _check(spec)
    g16 = _bf16(g)
    da = _matmul(f"{out},{rhs}->{lhs}", g16, b16)
    db = _matmul(f"{lhs},{out}->{rhs}", a16, g16)
    return da.astype(a_dtype.dtype), db.astype(b_dtype.dtype)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def einsum(spec: str, a: Array, b: Array) -> Array:
    """`jnp.einsum(spec, a, b)` with both inputs rounded to bfloat16, accumulated and returned in
    float32; its gradients the same way (each comes back in its input's dtype)."""
    _check(spec)
    return _einsum(spec.replace(" ", ""), a, b)


def dense_spec(x_ndim: int, n_in: int, n_out: int) -> str:
    """The einsum of `layers.Dense`: `x`'s trailing `n_in` axes against the kernel's leading ones."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    batch = letters[:x_ndim - n_in]
    contract = letters[x_ndim - n_in:x_ndim]
    outs = letters[x_ndim:x_ndim + n_out]
    return f"{batch}{contract},{contract}{outs}->{batch}{outs}"
