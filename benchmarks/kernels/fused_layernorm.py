"""`benchmarks.step.fp8 --kernel`: the fused dropout + residual + LayerNorm kernel against XLA's passes at
one sub-layer end, forward and backward, each checked against float32 and timed; with
`--kernel_sweep=FILE` first every launch shape of each pass, the fastest accurate one written to
FILE (which `benchmarks.step.fp8 --fused_blocks_from` reads)."""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

from benchmarks.common import gpu_lock, variant_timing
from benchmarks.step import pretrain_step, timing


def _rel_l2(got, want) -> float:
    """‖got − want‖ / ‖want‖, `got` taken to float32."""
    import jax.numpy as jnp

    return float(jnp.linalg.norm((got.astype(jnp.float32) - want).ravel()) / jnp.linalg.norm(want.ravel()))


FORWARD_SHAPES = [(1, 4), (2, 4), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8)]
BACKWARD_SHAPES = [(8, 1, 4), (16, 1, 4), (16, 2, 4), (32, 2, 4), (32, 4, 8), (64, 2, 4), (64, 4, 8),
                   (128, 4, 8), (16, 16, 8)]


def _sweep(args, h, x, keep, scale, bias, dy, keep_prob, eps, ref) -> dict:
    """Each pass of the kernel alone, at each launch shape: median time and relative L2 error
    against the float32 reference (y for the forward, dh for the backward); the fastest shape
    whose error is at bf16 rounding's level wins."""
    import jax
    import jax.numpy as jnp
    from bert_jax.model.kernels import fused

    hidden = h.shape[-1]
    h2, x2, dy2 = (a.reshape(-1, hidden) for a in (h, x, dy))
    keep2 = keep.reshape(-1, hidden).astype(jnp.int8)
    saved = dict(fused.FORWARD), dict(fused.BACKWARD)
    rows = {"forward": [], "backward": []}
    _, mean, rstd = fused._forward(h2, x2, keep2, None, scale, bias, None, keep_prob, eps)  # the residuals, once
    for kind, shapes in (("forward", FORWARD_SHAPES), ("backward", BACKWARD_SHAPES)):
        for shape in shapes:
            if kind == "forward":
                fused.FORWARD = dict(block_rows=shape[0], num_warps=shape[1])
                fn = jax.jit(lambda h, x, k, s, b: fused._forward(h, x, k, None, s, b, None, keep_prob, eps)[0])
                f = functools.partial(fn, h2, x2, keep2, scale, bias)  # arguments, not constants
                want = ref[0].reshape(-1, hidden)
            else:
                fused.BACKWARD = dict(block_rows=shape[0], chunk_rows=shape[1], num_warps=shape[2])
                fn = jax.jit(lambda *a: fused._backward(*a, keep_prob)[0])
                f = functools.partial(fn, h2, x2, keep2, None, scale, None, mean, rstd, dy2)
                want = ref[1].reshape(-1, hidden)
            config = dict(fused.FORWARD if kind == "forward" else fused.BACKWARD)
            try:
                error = _rel_l2(jax.block_until_ready(f()), want)
                with gpu_lock.Lock(args.gpu_lock):
                    times = variant_timing.time_alternating({"k": lambda: jax.block_until_ready(f())}, rounds=1,
                                                        steps=args.kernel_iters)["k"]
                row = {**config, "median_s": statistics.median(times), "rel_l2_error": error}
            except Exception as e:  # a launch shape Triton refuses: noted, not fatal
                row = {**config, "failed": f"{type(e).__name__}: {str(e)[:300]}"}
            rows[kind].append(row)
            timing.log(f"sweep {kind} {row}")
    fused.FORWARD, fused.BACKWARD = saved
    best = {}
    for kind, found in rows.items():
        good = [r for r in found if "median_s" in r and r["rel_l2_error"] < 2e-2]
        if good:
            pick = min(good, key=lambda r: r["median_s"])
            best[kind] = {k: v for k, v in pick.items() if k in ("block_rows", "chunk_rows", "num_warps")}
    return {"rows": rows, "best": best}


def kernel(args, step_args) -> dict:
    """The fused kernel against XLA's passes at one sub-layer end: `LayerNorm(dropout(h) + x)`,
    forward and backward (the gradients of h, x, scale and bias for a fixed random dy), rows =
    batch x length. Both are checked against the same function in float32 on the same bf16 inputs
    (relative L2 error of y and every gradient), fresh random inputs, then timed (median of
    `--kernel_iters` calls each, alternating)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bert_jax.model import dropout, layers, model_config
    from bert_jax.model.kernels import fused

    config = pretrain_step.load_config(step_args.config)
    hidden = config.model.hidden_size
    cfg = model_config.BertConfig(hidden_size=hidden, num_attention_heads=config.model.num_attention_heads,
                              dtype=step_args.dtype)
    keep_prob = 1.0 - config.model.hidden_dropout_prob
    shape = (step_args.batch, step_args.seq_len, hidden)
    ks = jax.random.split(jax.random.key(1), 6)
    h, x, dy = (jax.random.normal(k, shape, jnp.float32).astype(cfg.compute_dtype) for k in ks[:3])
    scale = 1.0 + 0.1 * jax.random.normal(ks[3], (hidden,), jnp.float32)
    bias = 0.1 * jax.random.normal(ks[4], (hidden,), jnp.float32)
    keep = dropout.keep_mask(ks[5], keep_prob, shape)
    mask_key = jax.random.key_data(ks[5])  # "fused_key": the kernels draw that mask themselves

    def unfused(h, x, scale, bias, keep):
        d = jax.lax.select(keep, h / jnp.asarray(keep_prob, h.dtype), jnp.zeros_like(h))
        return layers.LayerNorm(cfg.replace(dtype=str(h.dtype))).apply(
            {"params": {"scale": scale, "bias": bias}}, d + x)

    def kern(h, x, scale, bias, keep):
        return fused.dropout_add_layernorm(h, x, keep, scale, bias, keep_prob=keep_prob, eps=cfg.layer_norm_eps)

    def kern_key(h, x, scale, bias, keep):  # `keep` unused: the kernels hash the key for each element
        del keep
        return fused.dropout_add_layernorm(h, x, None, scale, bias, keep_prob=keep_prob, eps=cfg.layer_norm_eps,
                                           key=mask_key)

    def fwd_bwd(f):
        def run(h, x, scale, bias, dy, keep):  # every array an argument: no baked-in constants
            y, vjp = jax.vjp(functools.partial(f, keep=keep), h, x, scale, bias)
            return (y, *vjp(dy))
        return jax.jit(run)

    ref = fwd_bwd(unfused)(*(a.astype(jnp.float32) for a in (h, x)), scale, bias, dy.astype(jnp.float32), keep)
    out = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "benchmark": "bench_fp8 --kernel", "rows": int(np.prod(shape[:2])), "hidden": hidden,
           "dtype": step_args.dtype, "keep_prob": keep_prob, "impl": {}}
    if args.kernel_sweep:
        out["sweep"] = _sweep(args, h, x, keep, scale, bias, dy, keep_prob, cfg.layer_norm_eps, ref)
        best = {"forward": out["sweep"]["best"].get("forward", dict(fused.FORWARD)),
                "backward": out["sweep"]["best"].get("backward", dict(fused.BACKWARD))}
        fused.FORWARD, fused.BACKWARD = dict(best["forward"]), dict(best["backward"])
        with open(args.kernel_sweep + ".tmp", "w", encoding="utf-8") as f:
            json.dump(best, f)
        os.replace(args.kernel_sweep + ".tmp", args.kernel_sweep)  # whole, for a reader waiting on it
        timing.log(f"sweep: fastest {best}")
    out["launch"] = {"forward": dict(fused.FORWARD), "backward": dict(fused.BACKWARD)}
    runs = {"xla": fwd_bwd(unfused), "fused": fwd_bwd(kern), "fused_key": fwd_bwd(kern_key)}
    names = ("y", "dh", "dx", "dscale", "dbias")
    for name, f in runs.items():
        got = jax.block_until_ready(f(h, x, scale, bias, dy, keep))
        out["impl"][name] = {"rel_l2_error_vs_float32": {n: _rel_l2(g, r) for n, g, r in zip(names, got, ref)}}
    with gpu_lock.Lock(args.gpu_lock):
        times = variant_timing.time_alternating({n: (lambda f=f: jax.block_until_ready(f(h, x, scale, bias, dy, keep)))
                                             for n, f in runs.items()}, rounds=1, steps=args.kernel_iters)
    # The fewest bytes one forward + backward must move: read h, x, mask; write y (forward); read
    # h, x, mask, dy; write dh, dx (backward); the row statistics and vectors are small.
    item = jnp.dtype(cfg.compute_dtype).itemsize
    elems = int(np.prod(shape))
    min_bytes = elems * (3 * item + 1) + elems * (4 * item + 1 + 2 * item)
    for name, t in times.items():
        median = statistics.median(t)
        out["impl"][name].update(median_s=median, gb_per_s_at_min_bytes=min_bytes / median / 1e9)
    out["min_bytes"] = min_bytes
    out["speedup_fused_vs_xla"] = out["impl"]["xla"]["median_s"] / out["impl"]["fused"]["median_s"]
    # The mask drawn inside the kernels (twice: forward and backward) against the mask read.
    out["speedup_fused_key_vs_fused"] = out["impl"]["fused"]["median_s"] / out["impl"]["fused_key"]["median_s"]
    for name, row in out["impl"].items():
        errs = ", ".join(f"{k} {v:.1e}" for k, v in row["rel_l2_error_vs_float32"].items())
        print(f"kernel {name:>9}: {row['median_s'] * 1e3:7.3f} ms fwd+bwd "
              f"({row['gb_per_s_at_min_bytes']:.0f} GB/s at the minimum bytes); error vs float32: {errs}",
              file=sys.stderr)
    print(f"kernel: fused x{out['speedup_fused_vs_xla']:.2f} XLA's passes; the mask drawn in the kernels "
          f"x{out['speedup_fused_key_vs_fused']:.2f} the mask read", file=sys.stderr)
    return out
