"""`BertConfig.fused_ffn`: the FFN's GEMM + bias + GELU kernels (here in Pallas' interpreter; on a GPU
the real Triton kernels) against an independent float32 reference and against the unfused path:
both passes of the block alone, and the whole pretraining model's loss and every gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.model import layers, model_config, modeling, pretraining_heads
from bert_jax.model.kernels import fused_ffn
from tests.helpers import model_parity

# Launch shapes that make the interpreter walk a grid of 2 x 2 output tiles and the contraction in
# two steps, as a GPU launch does (the GPU's own shapes apply on a GPU).
SMALL_TILES = {"block_m": 32, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 1}


@pytest.fixture(autouse=True)
def _float32_matmuls():
    """float32 matmuls in float32 on every backend: a GPU's default is TF32 (errors ~3e-4, measured
    on an H200), and the float32 bounds here are float32's. No change on CPUs."""
    with jax.default_matmul_precision("float32"):
        yield


def _reference(x, w1, b1, w2, activation):
    """`gelu(x @ w1 + b1) @ w2` in plain jax, float32, with jax's own GELU and autodiff."""
    h = jnp.dot(x, w1, precision="highest") + b1
    h = jax.nn.gelu(h, approximate=activation == "gelu_tanh")
    return jnp.dot(h, w2, precision="highest")


def _unfused(x, w1, b1, w2, activation):
    """What the model computes without the kernels, in the inputs' dtype (`layers.Dense`)."""
    h = jax.lax.dot_general(x, w1, (((1,), (0,)), ((), ()))) + b1.astype(x.dtype)
    h = layers.activation_fn(activation)(h)
    return jax.lax.dot_general(h, w2, (((1,), (0,)), ((), ())))


def _inputs(dtype, rows=64, hidden=64, inner=128, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 1, (rows, hidden)), dtype)
    w1 = jnp.asarray(rng.normal(0, 0.15, (hidden, inner)), dtype)
    b1 = jnp.asarray(rng.normal(0, 0.3, (inner,)), jnp.float32)
    w2 = jnp.asarray(rng.normal(0, 0.1, (inner, hidden)), dtype)
    g = jnp.asarray(rng.normal(0, 1, (rows, hidden)), dtype)
    return (x, w1, b1, w2), g


def _errors(fn, args, g, want, want_grads):
    """Each output's largest error relative to the reference's largest value: y, dx, dw1, db1, dw2."""
    y, vjp = jax.vjp(fn, *args)
    got = (y, *vjp(g))
    return [float(np.abs(np.asarray(a, np.float32) - b).max() / np.abs(b).max())
            for a, b in zip(got, (want, *want_grads))], got


# Errors measured on 2026-11-28 (CPU, interpreter), relative to each output's largest value:
#   float32: <= 6e-7 for both GELUs (the erf GELU through Abramowitz & Stegun's erf, 1.5e-7);
#   bfloat16: y 2.4-2.8e-3, gradients 0.7-3.9e-3, where the unfused bf16 path's are 2.4-5.4e-3.
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernels_equal_a_float32_reference_values_and_gradients(monkeypatch, activation, dtype):
    monkeypatch.setattr(fused_ffn, "INTERPRET", SMALL_TILES)
    args, g = _inputs(jnp.dtype(dtype))
    f32 = [a.astype(jnp.float32) for a in args]
    want, ref_vjp = jax.vjp(functools.partial(_reference, activation=activation), *f32)
    want_grads = [np.asarray(d) for d in ref_vjp(g.astype(jnp.float32))]
    want = np.asarray(want)
    fused = functools.partial(fused_ffn.gemm_bias_gelu_gemm, activation=activation)
    errors, got = _errors(fused, args, g, want, want_grads)
    # Each output in its input's dtype (b1's gradient in float32, like b1).
    assert [a.dtype for a in got] == [args[0].dtype, *(a.dtype for a in args)]
    names = ("y", "dx", "dw1", "db1", "dw2")
    if dtype == "float32":
        assert max(errors) < 5e-6, dict(zip(names, errors))
    else:  # no worse than the unfused bf16 path, by more than rounding noise
        unfused_errors, _ = _errors(functools.partial(_unfused, activation=activation), args, g, want, want_grads)
        for name, e, u in zip(names, errors, unfused_errors):
            assert e < 1.5 * u + 1e-3, (name, e, u)
            assert e < 1.2e-2, (name, e)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_the_gelu_and_its_derivative_match_jax(activation):
    z = jnp.linspace(-9.0, 9.0, 2001, dtype=jnp.float32)
    exact = functools.partial(jax.nn.gelu, approximate=activation == "gelu_tanh")
    np.testing.assert_allclose(fused_ffn._gelu_and_grad(z, activation, grad=False), exact(z), atol=1e-6, rtol=3e-7)
    np.testing.assert_allclose(fused_ffn._gelu_and_grad(z, activation, grad=True), jax.vmap(jax.grad(exact))(z),
                               atol=1e-5, rtol=0)


# Bounds a few times the differences measured on 2026-11-28 (CPU, interpreter):
#   float32: logits 3e-7, loss rel 2e-7, gradients 4e-7 of the leaf's largest;
#   bfloat16: logits 4e-3, loss rel 3e-3, gradients 2.2e-2 of the leaf's largest (bf16 sums).
@pytest.mark.parametrize("dtype,logits_atol,loss_rtol,grad_tol", [
    ("float32", 2e-6, 1e-5, 1e-5), ("bfloat16", 1.5e-2, 1.5e-2, 6e-2)])
def test_the_model_with_the_kernels_trains_like_the_one_without(dtype, logits_atol, loss_rtol, grad_tol):
    cfg = model_config.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=128, hidden_act="gelu_tanh", dtype=dtype)
    model_parity.assert_trains_alike(cfg, cfg.replace(fused_ffn=True),
                                     kernels=("ffn_gemm_bias_gelu_fwd", "ffn_gemm_gelu_bwd"),
                                     logits_atol=logits_atol, loss_rtol=loss_rtol, grad_tol=grad_tol)


def test_where_the_kernels_do_not_apply_the_layer_is_unfused():
    assert fused_ffn.supported(768, 3072, "gelu") and fused_ffn.supported(1024, 4096, "gelu_tanh")
    assert not fused_ffn.supported(96, 3072, "gelu") and not fused_ffn.supported(1024, 4096, "relu")
    for changes in ({"hidden_size": 96, "intermediate_size": 128}, {"hidden_act": "relu"}):
        cfg = model_config.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=128, fused_ffn=True).replace(**changes)
        batch = modeling.dummy_inputs(cfg, batch=1, length=8, predictions=2)
        # (init traces the forward pass: its program has every layer's FFN)
        jaxpr = str(jax.make_jaxpr(lambda: pretraining_heads.BertForPreTraining(cfg).init(jax.random.key(0), **batch))())
        assert "pallas_call" not in jaxpr, changes
    with pytest.raises(ValueError, match="fused_ffn"):
        model_config.BertConfig(fused_ffn="yes")


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_the_kernels_lower_to_triton_for_nvidia_gpus(monkeypatch, activation):
    """What a GPU compiles, lowered here: both kernels become Triton calls (Pallas' Triton lowering
    has no `erf`; the exact GELU's kernels must lower all the same)."""
    monkeypatch.setattr(fused_ffn, "_interpret", lambda: False)

    def grads(x, w1, b1, w2):
        def loss(x, w1, b1, w2):
            y = fused_ffn.gemm_bias_gelu_gemm(x, w1, b1, w2, activation=activation)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, w1, b1, w2)

    args = (jax.ShapeDtypeStruct((4, 128, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((4096,), jnp.float32), jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16))
    calls, text = model_parity.lowered_for_cuda(grads, *args)
    assert len(calls) == 2 and all("@__gpu$xla.gpu.triton" in line for line in calls), calls
    assert "mosaic_gpu" not in text
