"""What the scripts that compare variants of one piece share (benchmarks.step.optimizer, benchmarks.step.dropout and
benchmarks.kernels.fused_layernorm, the last for its timing only): their flags, alternating timed rounds, and the largest difference
between two variants' results."""

from __future__ import annotations

import argparse
import time

from benchmarks.step import pretrain_step


def parse_variant_args(description: str, argv=None):
    """`--step`, `--rounds`, `--steps`; every other flag is this script's. Returns `(args,
    step_args)`, with `args.steps` defaulting to 2 per round with `--step`, else 5."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--step", action="store_true", help="time the whole pretraining step instead")
    p.add_argument("--rounds", type=int, default=5, help="alternating timed rounds per variant")
    p.add_argument("--steps", type=int, default=0, help="timings per round (default 2 with --step, else 5)")
    args, rest = p.parse_known_args(argv)
    args.steps = args.steps or (2 if args.step else 5)
    return args, pretrain_step.parse_args(rest)


def time_alternating(units: dict, rounds: int, steps: int) -> dict:
    """`units`: name -> a callable that runs one timed unit and waits for it. Each is timed
    `steps` times per round, the variants' rounds alternating so that all see the same machine
    load; round 0 warms up. Returns name -> durations in seconds."""
    times = {name: [] for name in units}
    for r in range(rounds + 1):
        for name, unit in units.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                unit()
                if r > 0:
                    times[name].append(time.perf_counter() - t0)
    return times


def max_abs_diff(a, b) -> float:
    """The largest absolute difference between two pytrees of arrays of the same structure."""
    import jax
    import jax.numpy as jnp

    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                               jax.tree_util.tree_leaves(b)))
