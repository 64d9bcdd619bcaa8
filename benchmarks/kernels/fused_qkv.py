"""The Q/K/V GEMM kernels (`bert_jax.model.kernels.fused_qkv`) against XLA's GEMM, bias and slices.

    python -m benchmarks.kernels.fused_qkv [--batch=256 --length=128 --hidden=1024 --heads=16] \\
        [--sweep=blocks.json] [--out_json=kernel.json]

At a config's shapes (default BERT-Large, 256 x 128 rows), in bfloat16, timed per call with 20
calls dispatched back to back and waited for once (median of `--reps`), each against what the
model runs without the kernels (one einsum against the stacked kernels, the bias, three slices):

- forward: the kernel's `(q, k, v)` against XLA's;
- backward: the two gradient kernels (`dx`; the kernels' gradients with the bias gradients)
  against XLA's pullback of the same projections;
- block: forward and backward together (`jax.vjp`): what the pretraining step gains per layer;
- errors: every output of both against the same computation in float32 (largest error relative to
  the largest value).

`--sweep`: first each kernel alone over `benchmarks.kernels.fused_ffn.SHAPES` (tile, contraction step, warps,
pipelining stages); the fastest of each is used for the rest and written to the file, which
`benchmarks.step.fp8 --fused_qkv_blocks_from` reads. Needs a GPU for meaningful times (on a CPU the
kernels run in Pallas' interpreter: use small shapes).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.model.kernels import fused_qkv
from benchmarks.kernels.fused_ffn import SHAPES, errors_vs_float32, log, report, sweep_shapes, time_pairs

KERNELS = ("forward", "backward_input", "backward_weights")
_LAUNCH_NAMES = {"forward": "FORWARD", "backward_input": "BACKWARD_INPUT", "backward_weights": "BACKWARD_WEIGHTS"}


def xla_projection(x, kernels, biases):
    """What `SelfAttention` runs without the kernels: one einsum against the stacked kernels, the
    bias in the compute dtype, three slices."""
    qkv = jnp.einsum("blh,hsnd->blsnd", x, jnp.stack(kernels, axis=1)) + jnp.stack(biases).astype(x.dtype)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def kernel_fn(which: str):
    """The kernel `which` alone, on 2-D operands, jitted."""
    return jax.jit({"forward": fused_qkv.forward, "backward_input": fused_qkv.input_grad,
                    "backward_weights": fused_qkv.weight_grads}[which])


def sweep(which: str, args, shapes, results: dict) -> dict:
    """The fastest of `shapes` for kernel `which` (set in `fused_qkv` and returned)."""
    return sweep_shapes(which, shapes, lambda shape: setattr(fused_qkv, _LAUNCH_NAMES[which], shape),
                        lambda: kernel_fn(which), args, results)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--sweep", default="", help="sweep launch shapes first; write the fastest here (JSON)")
    p.add_argument("--sweep_shapes", type=int, default=len(SHAPES), help="the first N of benchmarks.kernels.fused_ffn.SHAPES")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out_json", default="")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden={args.hidden} does not divide by --heads={args.heads}")
    if not fused_qkv.supported(args.hidden):
        p.error(f"--hidden={args.hidden}: the kernels take hidden sizes that 64 divides")
    rng = np.random.default_rng(0)
    b, t, h, heads = args.batch, args.length, args.hidden, args.heads
    m, bf = b * t, jnp.bfloat16
    x = jnp.asarray(rng.normal(0, 1, (b, t, h)), bf)
    kernels = [jnp.asarray(rng.normal(0, 0.02, (h, heads, h // heads)), bf) for _ in range(3)]
    biases = [jnp.asarray(rng.normal(0, 0.02, (heads, h // heads)), jnp.float32) for _ in range(3)]
    gs = tuple(jnp.asarray(rng.normal(0, 1, (b, t, heads, h // heads)), bf) for _ in range(3))
    x2, ws, g2 = x.reshape(m, h), [w.reshape(h, h) for w in kernels], [g.reshape(m, h) for g in gs]
    operands = {"forward": (x2, *ws, *(bias.reshape(h) for bias in biases)), "backward_input": (*g2, *ws),
                "backward_weights": (x2, *g2)}
    result = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "batch": b, "length": t, "hidden": h, "heads": heads, "dtype": "bfloat16"}
    if args.sweep:
        result["sweep"] = {}
        best = {which: sweep(which, operands[which], SHAPES[:args.sweep_shapes], result["sweep"])
                for which in KERNELS}
        with open(args.sweep, "w") as f:
            json.dump(best, f)
        log(f"sweep: fastest {best}")
    result["launch"] = {which: getattr(fused_qkv, _LAUNCH_NAMES[which]) for which in KERNELS}

    def fused_bwd(*a):
        return fused_qkv.input_grad(*a[:3], *a[3:6]), fused_qkv.weight_grads(a[6], *a[:3])

    def xla_bwd(*a):
        _, pullback = jax.vjp(xla_projection, a[0], a[1:4], a[4:7])
        return pullback(a[7:])

    pairs = {
        "forward": (jax.jit(fused_qkv.forward), jax.jit(xla_projection), operands["forward"], (x, kernels, biases)),
        "backward": (jax.jit(fused_bwd), jax.jit(xla_bwd), (*g2, *ws, x2), (x, *kernels, *biases, *gs)),
        "block_fwd_bwd": (jax.jit(lambda x, k, bb, g: jax.vjp(fused_qkv.qkv_projection, x, k, bb)[1](g)),
                          jax.jit(lambda x, k, bb, g: jax.vjp(xla_projection, x, k, bb)[1](g)),
                          (x, kernels, biases, gs), (x, kernels, biases, gs)),
    }
    flops = 3 * 2.0 * m * h * h  # one of the three passes' GEMMs: three projections
    gemms = {"forward": 1, "backward": 2, "block_fwd_bwd": 3}
    result["timings"] = time_pairs(pairs, {name: n * flops for name, n in gemms.items()}, calls=args.calls,
                                   reps=args.reps)
    # Errors against float32 on up to 32 examples (the same inputs' first).
    k = min(b, 32)
    result["errors_vs_float32"] = errors_vs_float32(
        {"fused": fused_qkv.qkv_projection, "xla_bf16": xla_projection}, xla_projection, (x[:k], kernels, biases),
        tuple(g[:k] for g in gs), ("q", "k", "v", "dx", "dw_q", "dw_k", "dw_v", "db_q", "db_k", "db_v"))
    return report(result, args.out_json)


if __name__ == "__main__":
    main()
