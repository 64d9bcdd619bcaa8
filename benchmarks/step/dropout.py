"""Dropout masks: `dropout.keep_mask` against `jax.random.bernoulli`, which it reproduces bit for bit.

    python -m benchmarks.step.dropout --config=configs/base.py --seq_len=128 --batch=8
    python -m benchmarks.step.dropout --config=configs/base.py --seq_len=128 --batch=8 --step

JAX lowers its threefry hash for CPU as a loop of five rounds over the whole array, which XLA
cannot fuse with anything; `keep_mask` computes the same hash unrolled. Two variants, timed in one
process with their rounds alternating so that both see the same machine load:

- "jax.random.bernoulli": the masks as flax's `nn.Dropout` draws them (our model before);
- "keep_mask": `bert_jax.model.dropout.keep_mask`, as the model draws them now.

Without `--step`: every mask one training step of the config draws (the embeddings', two per
layer on the hidden states, one per layer on the attention probabilities), from one key each, in
one jitted function; the two variants' masks are compared element for element. With `--step`:
the whole pretraining step (`benchmarks.step.pretrain_step`'s, with its flags) built with each variant; after the
same steps on the same batch their parameters are compared. Prints each variant's median and the
ratio; `--json` adds one JSON line.
"""

from __future__ import annotations

import functools
import statistics

from benchmarks.common import variant_timing
from benchmarks.step import builders, pretrain_step


def mask_shapes(bert_config, batch: int, seq_len: int) -> list:
    """`(shape, keep_prob)` of each dropout mask one training step draws (dense last layer)."""
    hidden = ((batch, seq_len, bert_config.hidden_size), 1.0 - bert_config.hidden_dropout_prob)
    probs = ((batch, bert_config.num_attention_heads, seq_len, seq_len),
             1.0 - bert_config.attention_probs_dropout_prob)
    shapes = [hidden] if bert_config.hidden_dropout_prob > 0 else []
    for _ in range(bert_config.num_hidden_layers):
        if bert_config.hidden_dropout_prob > 0:
            shapes += [hidden, hidden]
        if bert_config.attention_probs_dropout_prob > 0:
            shapes.append(probs)
    return shapes


class MaskRunner:
    """Every mask of `shapes` drawn with `draw`, from its own key, in one jitted function; each
    call draws them once (a new key per call) and waits."""

    def __init__(self, draw, shapes):
        import jax

        self.fn = jax.jit(lambda key: [draw(k, p, shape) for k, (shape, p) in
                                       zip(jax.random.split(key, len(shapes)), shapes)])
        self.calls = 0

    def __call__(self, key=None):
        import jax

        self.calls += 1
        return jax.block_until_ready(self.fn(jax.random.key(self.calls) if key is None else key))


def main(argv=None):
    args, step_args = variant_timing.parse_variant_args(__doc__.splitlines()[0], argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bert_jax.model import dropout

    config, bert_config, mesh, batch_np, _ = pretrain_step.setup(step_args)
    ours = dropout.keep_mask
    variants = {"jax.random.bernoulli": lambda rng, p, shape: jax.random.bernoulli(rng, p, shape),
                "keep_mask": ours}
    shapes = mask_shapes(bert_config, step_args.batch, step_args.seq_len)
    elements = sum(int(np.prod(shape)) for shape, _ in shapes)
    runners, init_cache = {}, {}  # --step: every variant starts from one initialization
    for name, draw in variants.items():
        if args.step:
            dropout.keep_mask = draw  # looked up when the step is traced, i.e. in bench_ours
            try:
                _, runners[name] = builders.bench_ours(step_args, config, bert_config, mesh, batch_np,
                                                    init_cache=init_cache)
            finally:
                dropout.keep_mask = ours
        else:
            runners[name] = MaskRunner(draw, shapes)
    init_cache.clear()  # the copy's memory back before the timing
    units = {name: (functools.partial(runner.run, 1, record=False) if args.step else runner)
             for name, runner in runners.items()}
    times = variant_timing.time_alternating(units, args.rounds, args.steps)
    if args.step:
        before, now = (runner.state for runner in runners.values())
        diff = variant_timing.max_abs_diff(before.params, now.params)
        check = f"parameters after {int(now.step)} steps differ by at most {diff:.1e}"
    else:
        a, b = (runner(jax.random.key(123)) for runner in runners.values())
        diff = sum(int(jnp.sum(x != y)) for x, y in zip(a, b))
        check = f"masks differing: {diff} of {elements:,} elements"
    base = statistics.median(times["jax.random.bernoulli"])
    what = "pretraining step" if args.step else f"the step's dropout masks ({len(shapes)} arrays, {elements:,} elements)"
    print(f"{what}, {step_args.config}, batch {step_args.batch}, length {step_args.seq_len}, "
          f"{jax.devices()[0].device_kind}, {len(times['keep_mask'])} timings each (median):")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:22s} {m * 1e3:9.1f} ms   {base / m:.2f}x jax.random.bernoulli's speed")
    print(f"  {check}")
    result = {"benchmark": "pretraining step" if args.step else "dropout masks", "config": step_args.config,
              "device": jax.devices()[0].device_kind, "elements": elements,
              ("max_param_diff" if args.step else "masks_differing"): diff,
              "variants": {name: {"median_s": statistics.median(ts)} for name, ts in times.items()}}
    if step_args.json:
        import json
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
