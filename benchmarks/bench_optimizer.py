"""Global-norm clipping: `optax.clip_by_global_norm` against `bert_jax.optim.clip_by_global_norm`.

    python benchmarks/bench_optimizer.py --config=configs/base.py [--rounds=5 --steps=3]
    python benchmarks/bench_optimizer.py --config=configs/base.py --step --seq_len=128 --batch=8

Both variants are timed in one process, their rounds alternating so that both see the same
machine load. Without `--step`: the optimizer update alone (clipping, then `optim.make_optimizer`'s
AdamW with its weight-decay mask, then `optax.apply_updates`, state donated) on the config's full
parameter tree, with a third variant without clipping as the floor. With `--step`: the whole
pretraining step (`bench_step.py`'s, with its flags) built once with each clipping transform.
Prints each variant's median and the ratio to optax's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402  (benchmarks/ is not a package)


def update_runner(tx, params, grads):
    """`tx`'s update and `apply_updates` as one jitted function of (state, grads), state donated."""
    import jax
    import optax

    def update(state, grads):
        params, opt_state = state
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = jax.jit(update, donate_argnums=0)
    state = jax.block_until_ready(jax.tree_util.tree_map(lambda x: x.copy(), (params, tx.init(params))))
    return (lambda state: compiled(state, grads)), state


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step", action="store_true", help="time the whole pretraining step instead")
    p.add_argument("--rounds", type=int, default=5, help="alternating timed rounds per variant")
    p.add_argument("--steps", type=int, default=0, help="timings per round (default 2 with --step, else 5)")
    args, rest = p.parse_known_args(argv)  # the rest are bench_step.py's flags
    step_args = bench_step.parse_args(rest)
    steps_per_round = args.steps or (2 if args.step else 5)
    import statistics

    import jax
    import jax.numpy as jnp
    import optax
    from bert_jax import optim, pretrain, sharding

    config, bert_config, mesh, batch_np, _ = bench_step.setup(step_args)
    ours_clip = optim.clip_by_global_norm
    variants = [("optax.clip_by_global_norm", optax.clip_by_global_norm),
                ("optim.clip_by_global_norm", ours_clip)]
    if not args.step:
        variants.append(("no clipping", None))
    runners = {}
    params = grads = None
    for name, clip in variants:
        optim.clip_by_global_norm = clip or ours_clip  # what make_optimizer chains before AdamW
        try:
            if args.step:
                _, runners[name] = bench_step.bench_ours(step_args, config, bert_config, mesh, batch_np)
                continue
            run_config = config.copy_and_resolve_references()
            if clip is None:
                run_config.clip_norm = 0.0
            _, tx, _, init_state = pretrain.build(run_config, bert_config, mesh)
            if params is None:
                params = sharding.sharded_init(init_state, jax.random.key(0), mesh)[0].params
                grads = jax.tree_util.tree_map(lambda x: jnp.full_like(x, 1e-3), params)
            runners[name] = update_runner(tx, params, grads)
        finally:
            optim.clip_by_global_norm = ours_clip
    times = {name: [] for name in runners}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, runner in runners.items():
            if args.step:
                runner.run(steps_per_round, record=r > 0)
                continue
            compiled, state = runner
            for _ in range(steps_per_round):
                t0 = time.perf_counter()
                state = jax.block_until_ready(compiled(state))
                if r > 0:
                    times[name].append(time.perf_counter() - t0)
            runners[name] = (compiled, state)
    if args.step:
        times = {name: runner.durations for name, runner in runners.items()}
    base = statistics.median(times["optax.clip_by_global_norm"])
    what = "pretraining step" if args.step else "optimizer update"
    print(f"{what}, {step_args.config}, {jax.devices()[0].device_kind}, {len(next(iter(times.values())))} "
          f"timings each (median):")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:28s} {m * 1e3:9.1f} ms   {m / base:.3f}x optax's")


if __name__ == "__main__":
    main()
