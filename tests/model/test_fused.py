"""`BertConfig.fused_ops`: the Pallas dropout + residual + LayerNorm kernels (here in Pallas'
interpreter) against the unfused path: one sub-layer end and the whole pretraining model, values
and gradients, in float32 (to float rounding) and bfloat16 (to bf16 rounding), with the same
dropout masks."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.model import dropout, layers, model_config, modeling, pretraining_heads
from bert_jax.model.kernels import fused
from tests.helpers import model_parity


@pytest.fixture(autouse=True)
def _float32_matmuls():
    """float32 matmuls in float32 on every backend: a GPU's default is TF32 (errors ~3e-4, measured
    on an H200), and the float32 bounds here are float32's. No change on CPUs."""
    with jax.default_matmul_precision("float32"):
        yield


def _unfused(cfg, keep, keep_prob, h, x, scale, bias, h_bias=None):
    if h_bias is not None:  # the dense layer's bias, added as flax's Dense does: in the compute dtype
        h = h + h_bias.astype(h.dtype)
    d = h if keep is None else jax.lax.select(keep, h / jnp.asarray(keep_prob, h.dtype), jnp.zeros_like(h))
    return layers.LayerNorm(cfg).apply({"params": {"scale": scale, "bias": bias}}, d + x)


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-6), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("with_dropout", ["mask", "key", None])
@pytest.mark.parametrize("launch", ["gpu", "chunked"])
@pytest.mark.parametrize("with_h_bias", [False, True])
def test_the_kernel_equals_dropout_then_layernorm_values_and_gradients(monkeypatch, dtype, tol, with_dropout,
                                                                       launch, with_h_bias):
    # The GPU's launch shapes (8-row blocks, the backward a row at a time), and blocks the backward
    # walks in two steps: the interpreter runs the kernels as a GPU would launch them. The chunked
    # launch at a hidden size of 112 = 64 + 32 + 16: rows read and written in three column pieces.
    # Dropout's mask given (`keep`), or drawn by the kernels from its key, forward and backward,
    # each block and chunk its own rows: the reference's mask is keep_mask's of the same key.
    shapes = {"gpu": (fused.FORWARD, fused.BACKWARD),
              "chunked": ({"block_rows": 16, "num_warps": 4}, {"block_rows": 32, "chunk_rows": 4, "num_warps": 4})}
    monkeypatch.setattr(fused, "INTERPRET_FORWARD", shapes[launch][0])
    monkeypatch.setattr(fused, "INTERPRET_BACKWARD", shapes[launch][1])
    hidden = {"gpu": 128, "chunked": 112}[launch]
    cfg = model_config.BertConfig(hidden_size=hidden, num_attention_heads=4, dtype=dtype)
    rng = np.random.default_rng(0)
    shape = (3, 40, hidden)  # 120 rows: blocks of 8 (halved from 16 or 32 until they divide)
    h, x, dy = (jnp.asarray(rng.normal(0, 1, shape), cfg.compute_dtype) for _ in range(3))
    scale = jnp.asarray(rng.normal(1, 0.1, (hidden,)), jnp.float32)
    bias = jnp.asarray(rng.normal(0, 0.1, (hidden,)), jnp.float32)
    keep = dropout.keep_mask(jax.random.key(3), 0.9, shape) if with_dropout else None
    key = jax.random.key_data(jax.random.key(3)) if with_dropout == "key" else None
    # The dense layer's bias before the dropout (float32, as its parameter is): large enough that
    # leaving it out, or adding it after the dropout, fails the comparison.
    args = (h, x, scale, bias) + ((jnp.asarray(rng.normal(0, 0.5, (hidden,)), jnp.float32),) if with_h_bias else ())
    ref = functools.partial(_unfused, cfg, keep, 0.9)
    fus = functools.partial(lambda h, x, s, b, hb=None: fused.dropout_add_layernorm(
        h, x, None if key is not None else keep, s, b, keep_prob=0.9, eps=cfg.layer_norm_eps, h_bias=hb, key=key))
    want, want_vjp = jax.vjp(ref, *args)
    got, got_vjp = jax.vjp(fus, *args)
    assert got.dtype == want.dtype == cfg.compute_dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    names = ("dh", "dx", "dscale", "dbias", "dh_bias")[:len(args)]
    got_grads, want_grads = got_vjp(dy), want_vjp(dy)
    for name, a, b in zip(names, got_grads, want_grads, strict=True):
        assert a.dtype == b.dtype, name
        b = np.asarray(b, np.float32)
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=tol * max(1.0, np.abs(b).max()),
                                   rtol=tol, err_msg=name)
    if with_dropout:  # dropped positions get no gradient through h
        assert np.all(np.asarray(got_grads[0], np.float32)[~np.asarray(keep)] == 0)
    if with_h_bias:
        # Autodiff sums dh over the rows in the compute dtype, the kernel in float32: in bfloat16 the
        # check above sees 1.6e-2 of the largest, mostly the reference's own rounding. Against the
        # reference's dh summed exactly the kernel is closer: 3.9e-3 of the largest in bfloat16,
        # 2.4e-7 in float32 (measured 2026-11-28, CPU).
        exact = np.asarray(want_grads[0], np.float64).reshape(-1, shape[-1]).sum(axis=0)
        np.testing.assert_allclose(np.asarray(got_grads[4]), exact, atol=tol / 2 * np.abs(exact).max(), rtol=0)


# Each bound is a few times the error measured on 2026-11-27 (CPU, the suite's XLA flags): in
# float32 the two paths agree to rounding; in bfloat16 they round at different places. At
# initialization the MLM logits are small (|logit| <= 0.56), so their bound is absolute and is
# checked to be far below them (all-zero logits must not pass).
#   float32:  logits max |diff| 2.4e-7; loss rel 1.1e-6; gradients 3.4e-7 of the leaf's largest.
#   bfloat16: logits max |diff| 2.2e-3 (about one bf16 ulp of the largest logit); loss rel 4.4e-3;
#             gradients 2.2e-2 of the leaf's largest (layer_0 ffn output bias: a bf16 sum over rows).
@pytest.mark.parametrize("dtype,logits_atol,loss_rtol,grad_tol", [
    ("float32", 2e-6, 1e-5, 1e-5), ("bfloat16", 8e-3, 1.5e-2, 6e-2)])
def test_the_fused_model_trains_like_the_unfused_one(dtype, logits_atol, loss_rtol, grad_tol):
    cfg = model_config.BertConfig(vocab_size=300, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=256, dtype=dtype)
    # The kernels draw dropout's masks from its (threefry) key: no int8 mask is made for them.
    model_parity.assert_trains_alike(cfg, cfg.replace(fused_ops=True), kernels=("pallas_call",),
                                     logits_atol=logits_atol, loss_rtol=loss_rtol, grad_tol=grad_tol,
                                     absent=("i8[",))


def test_hidden_sizes_the_kernels_cannot_read_use_the_unfused_path():
    assert fused.pieces(768) == ((0, 512), (512, 256)) and fused.pieces(1024) == ((0, 1024),)
    assert all(fused.supported(h) for h in (1024, 768, 384, 128, 112))
    assert not any(fused.supported(h) for h in (120, 8, 240))  # not a multiple of 16; four pieces
    cfg = model_config.BertConfig(vocab_size=100, hidden_size=120, num_hidden_layers=1, num_attention_heads=4,
                              intermediate_size=128, fused_ops=True)
    batch = modeling.dummy_inputs(cfg, batch=1, length=8, predictions=2)
    params = pretraining_heads.BertForPreTraining(cfg).init(jax.random.key(0), **batch)["params"]
    jaxpr = str(jax.make_jaxpr(lambda p: pretraining_heads.BertForPreTraining(cfg).apply({"params": p}, **batch))(params))
    assert "pallas_call" not in jaxpr
    with pytest.raises(ValueError, match="fused_ops"):
        model_config.BertConfig(fused_ops=1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("with_dropout", ["mask", "key", None])
@pytest.mark.parametrize("with_h_bias", [False, True])
def test_the_kernels_lower_to_triton_for_nvidia_gpus(monkeypatch, dtype, with_dropout, with_h_bias):
    """What a GPU would compile, lowered here: both passes become Triton calls. Since jax 0.10 a
    `pallas_call` with no compiler parameters lowers through Mosaic GPU (which rejects these
    blocks), and Triton's lowering has no bfloat16 division (the dropout scaling). In bfloat16 at
    BERT-Base's hidden size, 768: rows in two column pieces (Triton loads power-of-two blocks).
    With the key, the threefry hash lowers into both kernels and no int8 mask is an operand."""
    monkeypatch.setattr(fused, "_interpret", lambda: False)
    hidden = {"bfloat16": 768, "float32": 1024}[dtype]
    shape = (4, 64, hidden)

    def grads(h, x, keep, key, scale, bias, h_bias):
        def loss(h, x, scale, bias, h_bias):
            y = fused.dropout_add_layernorm(h, x, keep if with_dropout == "mask" else None, scale, bias,
                                            keep_prob=0.9, eps=1e-12, h_bias=h_bias if with_h_bias else None,
                                            key=key if with_dropout == "key" else None)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4) if with_h_bias else (0, 1, 2, 3))(h, x, scale, bias, h_bias)

    args = (jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)),
            jax.ShapeDtypeStruct(shape, jnp.bool_), jax.ShapeDtypeStruct((2,), jnp.uint32),
            jax.ShapeDtypeStruct((hidden,), jnp.float32),
            jax.ShapeDtypeStruct((hidden,), jnp.float32), jax.ShapeDtypeStruct((hidden,), jnp.float32))
    calls, text = model_parity.lowered_for_cuda(grads, *args)
    names = sorted(name for line in calls for name in ("dropout_add_layernorm_fwd", "dropout_add_layernorm_bwd")
                   if f'name = "{name}"' in line)
    assert names == ["dropout_add_layernorm_bwd", "dropout_add_layernorm_fwd"], calls
    assert all("@__gpu$xla.gpu.triton" in line for line in calls if "dropout_add_layernorm" in line)
    assert "mosaic_gpu" not in text
    # h_bias goes into both kernels (its add is not an XLA pass of its own) and the backward writes
    # one more [blocks, hidden] partial sum; without it the kernels take and write what they did.
    for name, operands, results in (("fwd", 4 + bool(with_dropout) + with_h_bias, 3),
                                    ("bwd", 6 + bool(with_dropout) + with_h_bias, 4 + with_h_bias)):
        line, = (line for line in calls if f'name = "dropout_add_layernorm_{name}"' in line)
        types = re.search(r": \(([^()]*)\) -> \(([^()]*)\)", line)
        assert (types[1].count("tensor<"), types[2].count("tensor<")) == (operands, results), (name, types[0])
        assert ("xi8>" in types[1]) == (with_dropout == "mask"), (name, types[0])  # the mask's rows
        # The key's two words and the first row of the device's shard (0 here: one device).
        assert ("tensor<3xui32>" in types[1]) == (with_dropout == "key"), (name, types[0])


def test_the_kernel_benchmark_times_the_mask_read_and_the_mask_drawn_against_xla():
    """`benchmarks.step.fp8 --kernel` (what a GPU session times): XLA's passes, the kernel reading the
    mask and the kernel drawing it from its key, all three within float32 rounding of the float32
    reference: the same mask on every side."""
    from benchmarks.step import fp8 as bench  # pylint: disable=import-outside-toplevel  (here: the GPU session runs this file)
    out = bench.main(["--config=configs/test.py", "--kernel", "--batch=2", "--seq_len=16", "--kernel_iters=1",
                      "--dtype=float32"])
    assert set(out["impl"]) == {"xla", "fused", "fused_key"}
    for name, row in out["impl"].items():
        assert row["median_s"] > 0 and max(row["rel_l2_error_vs_float32"].values()) < 1e-6, (name, row)
    assert out["speedup_fused_key_vs_fused"] > 0
