"""A few train steps of a tiny FP8 model, shared by tests/model/test_fp8.py, test_fused_fp8.py and
test_fused_fp8_chain.py: the batch, the state and its jitted step, a short run, and the check that
two runs (the fused FP8 kernels against flax's FP8 path) trained alike."""

import functools

import flax.linen as nn
import jax
import numpy as np

from bert_jax.model import layers, model_config, modeling, pretraining_heads
from bert_jax.pretrain import steps
from bert_jax.training import optim, train_state


def batch(seed: int = 0) -> dict:
    """4 rows of 16 tokens (vocabulary 200), 3 predictions each."""
    rng = np.random.default_rng(seed)
    return dict(input_ids=rng.integers(5, 200, (4, 16)).astype(np.int32),
                input_mask=np.ones((4, 16), np.int32), segment_ids=np.zeros((4, 16), np.int32),
                masked_lm_positions=np.tile(np.array([1, 5, 9], np.int32), (4, 1)),
                masked_lm_ids=rng.integers(5, 200, (4, 3)).astype(np.int32),
                masked_lm_weights=np.ones((4, 3), np.float32),
                next_sentence_labels=rng.integers(0, 2, (4, 1)).astype(np.int32))


def state_and_step(cfg, accum_steps: int = 1):
    """`cfg`'s pretraining model initialized (seed 0) with AdamW, and its jitted train step."""
    model = pretraining_heads.BertForPreTraining(cfg)
    variables = nn.meta.unbox(
        model.init(jax.random.key(0), **modeling.dummy_inputs(cfg, batch=4, length=16, predictions=3)))
    tx = optim.make_optimizer("adamw", lambda s: 1e-3, clip_norm=1.0)
    state = train_state.create_train_state(variables["params"], tx, jax.random.key(1),
                                     fp8=variables.get(layers.FP8_COLLECTION))
    step = jax.jit(functools.partial(steps.train_step, model=model, tx=tx, schedule=lambda s: 1e-3,
                                     accum_steps=accum_steps))
    return state, step


def fused_config(**kw) -> model_config.BertConfig:
    """One bf16 FP8 layer with the fused kernels (`fused_ops`), `kw` overriding."""
    return model_config.BertConfig(**{**dict(vocab_size=200, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                             intermediate_size=128, dtype="bfloat16", fp8=True, fused_ops=True), **kw})


def train(cfg, steps_: int):
    """`steps_` train steps from one initialization (`state_and_step`, `batch(1)`): the losses and the state."""
    state, step = state_and_step(cfg)
    losses = []
    for _ in range(steps_):
        state, metrics = step(state, batch(1))
        losses.append(float(metrics["loss"]))
    return losses, state


def assert_trained_alike(got_losses, got, want_losses, want) -> dict:
    """Two `train` runs' losses, parameters and FP8 state equal, in flax's layout and names; returns
    `got`'s amax histories by path. Bit for bit on this CPU (2026-11-29): the bounds leave room for
    one e5m2 or e4m3 tie rounded apart (tests/model/test_fused_fp8.py's `_assert_same_cast`), far
    below what a wrong scale or history does (mutation-checked)."""
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    assert jax.tree.structure(got.fp8) == jax.tree.structure(want.fp8)
    for tree, tol in (("params", 1e-6), ("fp8", 1e-5)):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(getattr(got, tree)),
                                jax.tree.leaves(getattr(want, tree))):
            b = np.asarray(b)
            np.testing.assert_allclose(np.asarray(a), b, rtol=tol, atol=tol * np.abs(b).max(),
                                       err_msg=tree + jax.tree_util.keystr(path))
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(got.fp8)
            if "amax_history" in jax.tree_util.keystr(p)}
