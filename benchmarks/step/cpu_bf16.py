"""The matmuls of a BERT-Base step on the CPU in float32, in `model.mixed_matmuls`' form (bfloat16
inputs, float32 accumulation and output) and with a bfloat16 output, each jitted alone.

    python -m benchmarks.step.cpu_bf16 [--batch=8] [--seq_len=128] [--repeats=7] [--json]

Which form XLA's CPU backend runs fast decides what `config.cpu_bf16` can gain (docs/performance.md,
"bf16 on CPU"). Each op is timed as the median of `--repeats` calls after one warm-up call, one op
and one form after another, on the CPU's bf16 units where `/proc/cpuinfo` reports them
(`mixed_precision.bf16_units`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time



def ops(batch: int, length: int, hidden: int = 768, inner: int = 3072, heads: int = 12) -> list:
    """(name, einsum spec, lhs shape, rhs shape): a dense layer forward and both its gradients, and
    attention's two batched products, at BERT-Base's sizes."""
    d = hidden // heads
    return [
        ("dense x @ w", "blh,hf->blf", (batch, length, hidden), (hidden, inner)),
        ("dense g @ w.T (input gradient)", "blf,hf->blh", (batch, length, inner), (hidden, inner)),
        ("dense x.T @ g (weight gradient)", "blh,blf->hf", (batch, length, hidden), (batch, length, inner)),
        ("attention scores", "bqhd,bkhd->bhqk", (batch, length, heads, d), (batch, length, heads, d)),
        ("attention context", "bhqk,bkhd->bqhd", (batch, heads, length, length), (batch, length, heads, d)),
    ]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", action="store_true", help="print one JSON record")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)

    import jax
    import jax.numpy as jnp
    from bert_jax.model import mixed_precision

    forms = {
        "float32": lambda spec: jax.jit(lambda a, b: jnp.einsum(spec, a, b)),
        "bf16_in_f32_out": lambda spec: jax.jit(lambda a, b: mixed_precision.einsum(spec, a, b)),
        "bf16_in_bf16_out": lambda spec: jax.jit(
            lambda a, b: jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))),
    }
    rows = []
    key = jax.random.key(0)
    for name, spec, lhs, rhs in ops(args.batch, args.seq_len):
        ka, kb, key = jax.random.split(key, 3)
        a, b = jax.random.normal(ka, lhs, jnp.float32), jax.random.normal(kb, rhs, jnp.float32)
        row = {"op": name, "spec": spec, "lhs": list(lhs), "rhs": list(rhs)}
        for form, make in forms.items():
            row[f"{form}_ms"] = statistics.median(mixed_precision.call_times(make(spec), a, b, args.repeats)) * 1e3
        row["mixed_speedup"] = row["float32_ms"] / row["bf16_in_f32_out_ms"]
        rows.append(row)
    result = {"benchmark": "bench_cpu_bf16", "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "bf16_units": mixed_precision.bf16_units(), "batch": args.batch, "seq_len": args.seq_len,
              "repeats": args.repeats, "ops": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"bf16 units: {result['bf16_units'] or 'none'}; {os.cpu_count()} cores; jax {jax.__version__}")
    print(f"{'op':34s} {'float32':>9s} {'bf16->f32':>10s} {'bf16->bf16':>11s}  mixed vs float32")
    for r in rows:
        print(f"{r['op']:34s} {r['float32_ms']:7.2f}ms {r['bf16_in_f32_out_ms']:8.2f}ms "
              f"{r['bf16_in_bf16_out_ms']:9.2f}ms  {r['mixed_speedup']:.2f}x")


if __name__ == "__main__":
    main()
