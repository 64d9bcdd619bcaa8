"""What the Pallas GEMM kernels share (`bert_jax.model.kernels`: `fused_ffn`, `fused_qkv`).

A kernel here is one `pallas_call` over a grid of output tiles, each program walking the
contraction a block at a time into a float32 accumulator, its epilogue acting on that accumulator
before rounding. On GPUs they lower through Triton; elsewhere they run in Pallas' interpreter
(correct, slow: for tests). A launch shape is a dict: `block_m` x `block_n` output tiles, the
contraction `block_k` at a time, Triton's `num_warps` and software-pipelining `num_stages`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pl_triton

# Pallas' interpreter (CPUs, tests) pays for every program and loop step: few, large tiles there.
INTERPRET = {"block_m": 256, "block_n": 256, "block_k": 1024, "num_warps": 4, "num_stages": 1}

# Rows are padded to a multiple of this (Triton's smallest dot): `pad_rows`.
ROW_MULTIPLE = 16


def interpret() -> bool:
    """Whether the kernels run in Pallas' interpreter (every backend but a GPU)."""
    return jax.default_backend() != "gpu"


def fit(size: int, most: int) -> int:
    """The largest power of two <= `most` dividing `size` (at least 16: Triton's smallest dot)."""
    block = most
    while block > 16 and size % block:
        block //= 2
    return block


def tiles(m: int, n: int, k: int, shape: dict) -> tuple[int, int, int]:
    """`(block_m, block_n, block_k)` of `shape` fitted to an `[m, k] x [k, n]` GEMM."""
    return fit(m, shape["block_m"]), fit(n, shape["block_n"]), fit(k, shape["block_k"])


def backend_args(shape: dict, interpreted: bool) -> dict:
    """`pallas_call`'s backend arguments: the interpreter, or Triton named (a bare `pallas_call`
    lowers through Mosaic GPU on NVIDIA GPUs since jax 0.10) with the shape's warps and stages."""
    if interpreted:
        return {"interpret": True}
    return {"compiler_params": pl_triton.CompilerParams(num_warps=shape["num_warps"],
                                                         num_stages=shape["num_stages"])}


def precision(dtype):
    """float32 inputs multiply in float32 (not TF32: the float32 path's contract); bf16 as it is."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def loop(steps: int, step, carry):
    """`step(s, carry) -> carry` for s in range(steps): a plain call when there is one step (the
    interpreter's usual case), a `fori_loop` else."""
    return step(0, carry) if steps == 1 else jax.lax.fori_loop(0, steps, step, carry)


def pad_rows(x2: jax.Array) -> jax.Array:
    """`[rows, k]` with zero rows appended up to a multiple of `ROW_MULTIPLE` (e.g. the last layer's
    few query positions). Outputs of those rows are cut off by the caller, so their gradient is
    zero and adds nothing to any weight's or bias's."""
    rows = x2.shape[0]
    padded = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
    return x2 if padded == rows else jnp.pad(x2, ((0, padded - rows), (0, 0)))
