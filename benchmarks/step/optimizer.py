"""The optimizer update as the train step applies it, before and after two rewrites.

    python -m benchmarks.step.optimizer --config=configs/base.py [--rounds=5 --steps=5]
    python -m benchmarks.step.optimizer --config=configs/base.py --step --seq_len=128 --batch=8

`steps.apply_guarded_update` (clipping, the config's optimizer, `optax.apply_updates`, skipped
when the loss or gradient norm is not finite) used to clip with `optax.clip_by_global_norm` and to
skip with `jnp.where(finite, new, old)` over the whole state; it now clips with
`optim.clip_by_global_norm` (one scalar factor) and skips with `lax.cond`. Variants, timed in one
process with their rounds alternating so that all see the same machine load:

- "before": optax's clipping and the `jnp.where` guard;
- "optax clip, cond guard": only the guard rewritten;
- "now": `steps.apply_guarded_update` as it is;
- "no clip, no guard": optax's update alone (the floor; without `--step` only).

Without `--step`: the update alone on the config's full parameter tree (fixed random gradients
of global norm > 1, state donated). With `--step`: the whole pretraining step (`benchmarks.step.pretrain_step`'s, with its flags) built with
each variant. Prints each variant's median and its ratio to "before".
"""

from __future__ import annotations

import functools

from benchmarks.common import variant_timing
from benchmarks.step import builders, pretrain_step


def where_guarded_update(state, grads, loss, tx):
    """The guard as it was: the update computed always, then selected element-wise."""
    import jax
    import jax.numpy as jnp
    import optax

    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = state.replace(step=state.step + 1, params=keep(new_params, state.params),
                              opt_state=keep(new_opt_state, state.opt_state))
    return new_state, {"grad_norm": grad_norm, "finite": finite.astype(jnp.float32)}


def unguarded_update(state, grads, loss, tx):
    import optax

    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state), {}


class UpdateRunner:
    """`guarded_update` as one jitted function of the state (donated) on fixed gradients; each
    call applies it once and waits."""

    def __init__(self, guarded_update, tx, state, grads):
        import jax
        import jax.numpy as jnp

        self.compiled = jax.jit(lambda state, grads: guarded_update(state, grads, jnp.float32(1.0), tx=tx)[0],
                                donate_argnums=0)
        state = state.replace(opt_state=tx.init(state.params))  # this variant's chain
        self.state = jax.block_until_ready(jax.tree_util.tree_map(lambda x: x.copy(), state))
        self.grads = grads

    def __call__(self) -> None:
        import jax

        self.state = jax.block_until_ready(self.compiled(self.state, self.grads))


def main(argv=None):
    args, step_args = variant_timing.parse_variant_args(__doc__.splitlines()[0], argv)
    import statistics

    import jax
    import optax
    from bert_jax.pretrain import loop as pretrain, steps
    from bert_jax.training import optim, sharding

    config, bert_config, mesh, batch_np, _ = pretrain_step.setup(step_args)
    ours_clip, ours_guard = optim.clip_by_global_norm, steps.apply_guarded_update
    variants = [("before", optax.clip_by_global_norm, where_guarded_update),
                ("optax clip, cond guard", optax.clip_by_global_norm, ours_guard),
                ("now", ours_clip, ours_guard)]
    if not args.step:
        variants.append(("no clip, no guard", None, unguarded_update))
    runners, init_cache = {}, {}  # --step: every variant starts from one initialization
    state = grads = None
    for name, clip, guard in variants:
        # What make_optimizer chains before the optimizer, and what train_step applies it with.
        optim.clip_by_global_norm, steps.apply_guarded_update = clip or ours_clip, guard
        try:
            if args.step:
                _, runners[name] = builders.bench_ours(step_args, config, bert_config, mesh, batch_np,
                                                    init_cache=init_cache)
                continue
            run_config = config.copy_and_resolve_references()
            if clip is None:
                run_config.clip_norm = 0.0
            _, tx, _, init_state = pretrain.build(run_config, bert_config, mesh)
            if state is None:
                state = sharding.sharded_init(init_state, jax.random.key(0), mesh)[0]
                leaves, treedef = jax.tree_util.tree_flatten(state.params)
                keys = jax.random.split(jax.random.key(1), len(leaves))
                grads = jax.tree_util.tree_unflatten(treedef, [  # global norm > 1: clipping acts
                    0.01 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
            runners[name] = UpdateRunner(guard, tx, state, grads)
        finally:
            optim.clip_by_global_norm, steps.apply_guarded_update = ours_clip, ours_guard
    init_cache.clear()  # the copy's memory back before the timing
    units = {name: (functools.partial(runner.run, 1, record=False) if args.step else runner)
             for name, runner in runners.items()}
    times = variant_timing.time_alternating(units, args.rounds, args.steps)
    # Every variant applied the same updates to the same state: their parameters must agree (but
    # for the floor's, which were not clipped).
    diffs = {name: variant_timing.max_abs_diff(runner.state.params, runners["before"].state.params)
             for name, runner in runners.items()}
    base = statistics.median(times["before"])
    what = "pretraining step" if args.step else "optimizer update"
    print(f"{what}, {step_args.config}, {jax.devices()[0].device_kind}, {len(next(iter(times.values())))} "
          f"timings each (median):")
    for name, ts in times.items():
        m = statistics.median(ts)
        diff = f"   parameters differ from before's by at most {diffs[name]:.1e}" if name != "before" else ""
        print(f"  {name:24s} {m * 1e3:9.1f} ms   {m / base:.3f}x before{diff}")
    result = {name: {"median_s": statistics.median(ts), "max_param_diff_vs_before": diffs[name]}
              for name, ts in times.items()}
    if step_args.json:  # one line for benchmarks.suite
        import json
        print(json.dumps({"benchmark": what, "config": step_args.config, "device": jax.devices()[0].device_kind,
                          "timings_each": len(next(iter(times.values()))), "variants": result}))
    return result


if __name__ == "__main__":
    main()
