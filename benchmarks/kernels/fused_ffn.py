"""The FFN's GEMM + bias + GELU kernels (`bert_jax.model.kernels.fused_ffn`) against XLA's GEMMs and passes.

    python -m benchmarks.kernels.fused_ffn [--rows=32768 --hidden=1024 --intermediate=4096] \\
        [--activation=gelu_tanh] [--sweep=blocks.json] [--out_json=kernel.json]

At a config's shapes (default BERT-Large, 256 x 128 rows), in bfloat16, timed per call with 20
calls dispatched back to back and waited for once (median of `--reps`):

- forward: the kernel's `(pre, act)` against XLA's `x @ w1 + b1` and its GELU, the same two outputs;
- backward: the kernel's `(d_pre, d_b1)` against XLA's `g @ w2.T`, the GELU's derivative by
  autodiff and the bias gradient's sum;
- block: the whole `gelu(x @ w1 + b1) @ w2`, forward and backward (`jax.vjp`), fused against unfused:
  what the pretraining step gains per layer;
- errors: every output of both against the same computation in float32 (largest error relative to
  the largest value).

`--sweep`: first each kernel alone over a set of launch shapes (tile, contraction step, warps,
pipelining stages); the fastest of each is used for the rest and written to the file, which
`benchmarks.step.fp8 --fused_ffn_blocks_from` reads. Needs a GPU for meaningful times (on a CPU the kernels
run in Pallas' interpreter).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.model.kernels import fused_ffn

# (block_m, block_n, block_k, num_warps, num_stages)
SHAPES = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
          (256, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 256, 32, 8, 4), (64, 128, 64, 4, 4),
          (256, 128, 32, 8, 4), (64, 256, 64, 4, 3)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed(fn, args, calls: int = 20, reps: int = 5) -> float:
    """Seconds per call: `calls` dispatched back to back, waited for once; median of `reps`."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def xla_forward(x, w1, b1, activation):
    pre = jax.lax.dot_general(x, w1, (((1,), (0,)), ((), ()))) + b1.astype(x.dtype)
    return pre, jax.nn.gelu(pre, approximate=activation == "gelu_tanh")


def xla_backward(g, w2, pre, activation):
    d = jax.lax.dot_general(g, w2, (((1,), (1,)), ((), ())))
    _, vjp = jax.vjp(functools.partial(jax.nn.gelu, approximate=activation == "gelu_tanh"), pre)
    dpre = vjp(d)[0]
    return dpre, jnp.sum(dpre.astype(jnp.float32), axis=0)


def unfused_block(x, w1, b1, w2, activation):
    pre, act = xla_forward(x, w1, b1, activation)
    return jax.lax.dot_general(act, w2, (((1,), (0,)), ((), ())))


def launch(shape) -> dict:
    """A `SHAPES` tuple as the kernels' launch-shape dict (`bert_jax.model.kernels.pallas_gemm`)."""
    bm, bn, bk, warps, stages = shape
    return {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}


def sweep_shapes(which: str, shapes, use, make_fn, args, results: dict) -> dict:
    """The fastest of `shapes` for one kernel: for each, `use(launch)` sets it and `make_fn()` jits
    the kernel, timed on `args`; shapes that fail to compile are logged and skipped. The fastest is
    set (`use`) and returned; every timing goes into `results[which]`."""
    best = None
    for shape in shapes:
        use(launch(shape))
        try:
            t = timed(make_fn(), args, reps=3)
        except Exception as e:  # a shape Triton cannot compile (shared memory, registers): skipped
            log(f"sweep {which} {shape}: failed: {str(e).splitlines()[0][:200]}")
            continue
        results.setdefault(which, []).append({"shape": shape, "ms": t * 1e3})
        log(f"sweep {which} {shape}: {t * 1e3:.3f} ms")
        if best is None or t < best[1]:
            best = (shape, t)
    if best is None:
        raise RuntimeError(f"no launch shape of the {which} kernel compiled")
    use(launch(best[0]))
    return launch(best[0])


def sweep(which: str, args, activation: str, results: dict) -> dict:
    name = "FORWARD" if which == "forward" else "BACKWARD"
    kernel = fused_ffn.forward if which == "forward" else fused_ffn.backward
    return sweep_shapes(which, SHAPES, lambda shape: setattr(fused_ffn, name, shape),
                        lambda: jax.jit(functools.partial(kernel, activation=activation)), args, results)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def time_pairs(pairs: dict, gemm_flops: dict, calls: int = 20, reps: int = 5) -> dict:
    """`{name: (fused_fn, xla_fn, fused_args, xla_args)}` timed side by side (`timed`): ms, the
    speedup and the TFLOP/s that `gemm_flops[name]` (the GEMMs' FLOPs per call) makes of each."""
    rows = {}
    for name, (fused_j, xla_j, fused_in, xla_in) in pairs.items():
        tf, tx = timed(fused_j, fused_in, calls=calls, reps=reps), timed(xla_j, xla_in, calls=calls, reps=reps)
        flops = gemm_flops[name]
        rows[name] = {"fused_ms": tf * 1e3, "xla_ms": tx * 1e3, "speedup": tx / tf,
                      "fused_tflops": flops / tf / 1e12, "xla_tflops": flops / tx / 1e12}
        log(f"{name}: fused {tf * 1e3:.3f} ms ({rows[name]['fused_tflops']:.0f} TFLOP/s) / XLA {tx * 1e3:.3f} ms "
            f"({rows[name]['xla_tflops']:.0f}) = x{tx / tf:.3f}")
    return rows


def errors_vs_float32(fns: dict, reference, args, cotangent, names) -> dict:
    """Each of `fns` (`{label: fn}`), its value and its pullback of `cotangent` at `args`, against
    `reference`'s at `args` and `cotangent` in float32: `{label: {name: rel_err}}`, the outputs
    (flattened: values, then gradients) named by `names`."""
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (args, cotangent))
    want, ref_vjp = jax.vjp(reference, *f32[0])
    want = jax.tree.leaves((want, ref_vjp(f32[1])))
    errors = {}
    for label, fn in fns.items():
        y, vjp = jax.vjp(fn, *args)
        got = jax.tree.leaves((y, vjp(cotangent)))
        errors[label] = {nm: rel_err(a, w) for nm, a, w in zip(names, got, want)}
    log(f"errors vs float32: {errors}")
    return errors


def report(result: dict, out_json: str) -> dict:
    """`result` printed as JSON, and written to `out_json` if given."""
    print(json.dumps(result))
    if out_json:
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--activation", default="gelu_tanh", choices=["gelu", "gelu_tanh"])
    p.add_argument("--sweep", default="", help="sweep launch shapes first; write the fastest here (JSON)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out_json", default="")
    args = p.parse_args(argv)
    act = args.activation
    rng = np.random.default_rng(0)
    m, h, n = args.rows, args.hidden, args.intermediate
    bf = jnp.bfloat16
    x = jnp.asarray(rng.normal(0, 1, (m, h)), bf)
    w1 = jnp.asarray(rng.normal(0, 0.02, (h, n)), bf)
    b1 = jnp.asarray(rng.normal(0, 0.02, (n,)), jnp.float32)
    w2 = jnp.asarray(rng.normal(0, 0.02, (n, h)), bf)
    g = jnp.asarray(rng.normal(0, 1, (m, h)), bf)
    pre = jnp.asarray(rng.normal(0, 1, (m, n)), bf)
    result = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "rows": m, "hidden": h, "intermediate": n, "activation": act, "dtype": "bfloat16"}
    if args.sweep:
        result["sweep"] = {}
        best_f = sweep("forward", (x, w1, b1), act, result["sweep"])
        best_b = sweep("backward", (g, w2, pre), act, result["sweep"])
        fused_ffn.FORWARD, fused_ffn.BACKWARD = best_f, best_b
        with open(args.sweep, "w") as f:
            json.dump({"forward": best_f, "backward": best_b}, f)
        log(f"sweep: fastest forward {best_f}, backward {best_b}")
    result["launch"] = {"forward": fused_ffn.FORWARD, "backward": fused_ffn.BACKWARD}
    flops = 2.0 * m * h * n
    pairs = {
        "forward": (jax.jit(functools.partial(fused_ffn.forward, activation=act)),
                    jax.jit(functools.partial(xla_forward, activation=act)), (x, w1, b1), (x, w1, b1)),
        "backward": (jax.jit(functools.partial(fused_ffn.backward, activation=act)),
                     jax.jit(functools.partial(xla_backward, activation=act)), (g, w2, pre), (g, w2, pre)),
    }
    fused_fn = functools.partial(fused_ffn.gemm_bias_gelu_gemm, activation=act)
    unfused_fn = functools.partial(unfused_block, activation=act)
    pairs["block_fwd_bwd"] = (jax.jit(lambda *a: jax.vjp(fused_fn, *a[:4])[1](a[4])),
                              jax.jit(lambda *a: jax.vjp(unfused_fn, *a[:4])[1](a[4])), (x, w1, b1, w2, g),
                              (x, w1, b1, w2, g))
    gemms = {"forward": 1, "backward": 1, "block_fwd_bwd": 6}
    result["timings"] = time_pairs(pairs, {name: n * flops for name, n in gemms.items()}, reps=args.reps)
    # Errors against float32 on 4,096 rows (the same inputs' first rows).
    k = min(m, 4096)
    result["errors_vs_float32"] = errors_vs_float32(
        {"fused": fused_fn, "xla_bf16": unfused_fn}, lambda *a: unfused_block(*a, act), (x[:k], w1, b1, w2), g[:k],
        ("y", "dx", "dw1", "db1", "dw2"))
    return report(result, args.out_json)


if __name__ == "__main__":
    main()
