"""The steps a benchmark times: ours (`bench_ours`: `bert_jax.pretrain.steps.train_step` jitted and
sharded as `pretrain.run` compiles it, state donated; several variants may share one initial state)
and transformers' `FlaxBertForPreTraining` with the same optimizer and losses (`bench_hf`). Each
comes back as a `timing.Runner` with its compile time.
"""

from __future__ import annotations

import functools
import time

from benchmarks.step.timing import Runner, log


def initial_fp8_state(abstract, shardings):
    """The FP8 scaling state as flax's `Fp8DotGeneralBase` initializes it (scales 1, amax
    histories 0), without compiling the model's initialization again; None stays None."""
    import jax
    import jax.numpy as jnp

    if abstract is None:
        return None
    def init(path, x, s):
        fill = 1.0 if jax.tree_util.keystr(path).endswith("_scale']") else 0.0
        return jax.device_put(jnp.full(x.shape, fill, x.dtype), s)
    return jax.tree_util.tree_map_with_path(init, abstract, shardings)


def bench_ours(args, config, bert_config, mesh, batch_np, init_cache: dict | None = None,
               compile: bool = True, compiler_options: dict | None = None):
    """Compiles our step; returns `({lower_s, compile_s}, Runner)`. Scripts that build several
    variants of the step pass one `init_cache` dict to every call: the first call keeps a copy of
    its freshly initialized state there and the others start from copies of it instead of
    initializing again (BERT-Large's initialization compiles for about a minute on a GPU).
    `compile=False` stops after lowering: the Runner's `step` is the `Lowered` program, for the
    caller to compile (`compile_runners` compiles several at once). `compiler_options`: XLA
    options for this program alone (e.g. `{"xla_gpu_enable_cublaslt": True}`), as `XLA_FLAGS`
    would set them for the whole process."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from bert_jax.pretrain import loop as pretrain, steps
    from bert_jax.training import sharding

    model, tx, schedule, init_state = pretrain.build(config, bert_config, mesh)
    cached = (init_cache or {}).get("state")
    if cached is not None:  # usable if this variant's state has the same structure, shapes and dtypes
        shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
        boxed = jax.eval_shape(init_state, jax.random.key(0))
        fresh = nn.meta.unbox(boxed)
        # The FP8 scaling state apart: a variant with FP8 takes the others' parameters and moments.
        cached = cached if shapes(fresh.replace(fp8=None)) == shapes(cached.replace(fp8=None)) else None
    if cached is not None:
        log("copying the first variant's initial state")
        state_shardings = sharding.logical_to_sharding(boxed, mesh)
        state = jax.tree.map(jnp.copy, cached.replace(fp8=None)).replace(
            fp8=initial_fp8_state(fresh.fp8, state_shardings.fp8))
    else:
        log("initializing the state")
        state, state_shardings = sharding.sharded_init(init_state, jax.random.key(0), mesh)
        if init_cache is not None and not init_cache:  # a copy, before the donation consumes the state
            init_cache.update(state=jax.tree.map(jnp.copy, state), shardings=state_shardings)
    batch_sharding = sharding.batch_sharding(mesh)
    step = functools.partial(steps.train_step, model=model, tx=tx, schedule=schedule, mesh=mesh)
    jitted = jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, None), donate_argnums=0)
    batch = sharding.to_global(batch_np, mesh)
    # The initialization is dispatched asynchronously: timing the compile while it still runs
    # would charge it to the compile (on CPU both share the cores; it grows with the depth).
    jax.block_until_ready((state, batch))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        log("lowering our step")
        t0 = time.perf_counter()
        lowered = jitted.lower(state, batch)
        t1 = time.perf_counter()
        if not compile:
            log(f"lowered in {t1 - t0:.1f} s")
            return {"lower_s": t1 - t0}, Runner(lowered, state, batch, mesh, compiler_options)
        log(f"lowered in {t1 - t0:.1f} s; compiling")
        compiled = lowered.compile(compiler_options=compiler_options or None)
        t2 = time.perf_counter()
        log(f"compiled in {t2 - t1:.1f} s")
    result = {"lower_s": t1 - t0, "compile_s": t2 - t1}
    return result, Runner(compiled, state, batch, mesh)


def bench_hf(args, config, bert_config, batch_np):
    """transformers' FlaxBertForPreTraining, same optimizer and losses, one device."""
    import jax
    import jax.numpy as jnp
    import optax
    import transformers
    from bert_jax.pretrain import steps
    from bert_jax.training import optim

    hf_config = transformers.BertConfig(
        vocab_size=bert_config.vocab_size, hidden_size=bert_config.hidden_size,
        num_hidden_layers=bert_config.num_hidden_layers, num_attention_heads=bert_config.num_attention_heads,
        intermediate_size=bert_config.intermediate_size, hidden_act="gelu",
        max_position_embeddings=bert_config.max_position_embeddings)
    model = transformers.FlaxBertForPreTraining(hf_config, dtype=jnp.dtype(args.dtype), seed=0)
    schedule = optim.learning_rate_schedule(1e-4, 10, 10_000)
    tx = optim.make_optimizer("adamw", schedule, clip_norm=1.0)
    state = (model.params, tx.init(model.params), jnp.zeros((), jnp.int32))

    def step(state, batch):
        params, opt_state, count = state

        def loss_fn(params):
            out = model(batch["input_ids"], batch["input_mask"], batch["segment_ids"], params=params,
                        dropout_rng=jax.random.fold_in(jax.random.key(0), count), train=True)
            logits = jnp.take_along_axis(out.prediction_logits,
                                         batch["masked_lm_positions"][..., None], axis=1)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["masked_lm_ids"])
            w = batch["masked_lm_weights"]
            nsp = optax.softmax_cross_entropy_with_integer_labels(
                out.seq_relationship_logits.astype(jnp.float32), batch["next_sentence_labels"][:, 0])
            return jnp.sum(nll * w) / (jnp.sum(w) + 1e-5) + jnp.mean(nsp)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, count + 1), {"loss": loss}

    jitted = jax.jit(step, donate_argnums=0)
    batch = jax.device_put({k: v for k, v in batch_np.items()})
    jax.block_until_ready((state, batch))  # as for ours: the initialization is not the compile's
    log("compiling HF's step")
    t0 = time.perf_counter()
    compiled = jitted.lower(state, batch).compile()
    log(f"compiled HF's step in {time.perf_counter() - t0:.1f} s")
    del steps
    return {"compile_s": time.perf_counter() - t0}, Runner(compiled, state, batch)
