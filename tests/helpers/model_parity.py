"""The pretraining model under one BertConfig against the same model under another (a fused-kernel
option against the unfused path), and a program as a GPU would compile it: tests/model/test_fused.py,
tests/model/test_fused_ffn.py and tests/model/test_fused_qkv.py."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.model import modeling, pretraining_heads

INPUTS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions")


def model_loss(cfg, params, batch, key):
    out = pretraining_heads.BertForPreTraining(cfg).apply({"params": params}, **{k: batch[k] for k in INPUTS},
                                                          deterministic=False, rngs={"dropout": key})
    return jnp.sum(out.mlm_logits.astype(jnp.float32) ** 2) * 1e-3 + jnp.sum(out.nsp_logits), out


def _with_random_biases(params, seed=3):
    """`params` with every bias (initialized to zeros) drawn ~N(0, 0.1): a kernel that drops or
    misplaces a bias then changes the outputs."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        if jax.tree_util.keystr(path).endswith("['bias']"):
            return jnp.asarray(rng.normal(0, 0.1, leaf.shape), leaf.dtype)
        return leaf
    return jax.tree_util.tree_map_with_path(draw, params)


def assert_trains_alike(cfg, other, *, kernels, logits_atol, loss_rtol, grad_tol, absent=()):
    """`other` has `cfg`'s parameter tree (names, shapes, initial values); with dropout on (the
    same masks), its MLM logits, loss and every gradient equal `cfg`'s within the bounds (each
    gradient's relative to its leaf's largest value, 1e-3 at least: some leaves are zero but for
    noise, e.g. the attention key bias, which the softmax ignores); and its gradient program
    contains each of `kernels` (the options really apply) and none of `absent`. Compared at
    parameters whose biases are drawn at random (initialized they are zeros, and a kernel that
    dropped a bias would pass: the FFN kernels with `b1` left out fail only so)."""
    batch = modeling.dummy_inputs(cfg, batch=2, length=24, predictions=4)
    batch["input_ids"] = jnp.asarray(np.random.default_rng(1).integers(5, cfg.vocab_size, (2, 24)), jnp.int32)
    params = nn.meta.unbox(pretraining_heads.BertForPreTraining(cfg).init(jax.random.key(0), **batch)["params"])
    other_params = nn.meta.unbox(pretraining_heads.BertForPreTraining(other).init(jax.random.key(0), **batch)["params"])
    assert jax.tree.structure(params) == jax.tree.structure(other_params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(other_params)))
    params = _with_random_biases(params)
    key = jax.random.key(7)
    (loss, out), grads = jax.jit(jax.value_and_grad(functools.partial(model_loss, cfg), has_aux=True))(
        params, batch, key)
    other_loss_fn = functools.partial(model_loss, other)
    (o_loss, o_out), o_grads = jax.jit(jax.value_and_grad(other_loss_fn, has_aux=True))(params, batch, key)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: other_loss_fn(*a)[0]))(params, batch, key))
    assert all(name in jaxpr for name in kernels), kernels
    assert not any(name in jaxpr for name in absent), [name for name in absent if name in jaxpr]
    det = pretraining_heads.BertForPreTraining(cfg).apply({"params": params}, **{k: batch[k] for k in INPUTS})
    assert not np.allclose(np.asarray(det.mlm_logits), np.asarray(out.mlm_logits))  # dropout is on
    assert np.abs(np.asarray(out.mlm_logits)).max() > 10 * logits_atol  # the bound is not the logits' size
    np.testing.assert_allclose(np.asarray(o_out.mlm_logits), np.asarray(out.mlm_logits), atol=logits_atol, rtol=0)
    np.testing.assert_allclose(float(o_loss), float(loss), rtol=loss_rtol)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(o_grads), jax.tree.leaves(grads)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, atol=grad_tol * max(1e-3, np.abs(b).max()), rtol=0,
                                   err_msg=jax.tree_util.keystr(path))


def lowered_for_cuda(fn, *args) -> tuple[list, str]:
    """`fn` jitted and lowered for NVIDIA GPUs here (no GPU needed: `jax.export`, Triton's custom
    calls allowed): `(its custom-call lines, the whole module's text)`."""
    exported = jax.export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exported.mlir_module()
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line], text
