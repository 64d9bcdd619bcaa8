"""FP8's gradient cast inside the LayerNorm backward kernel (`bert_jax.model.kernels.fused_fp8`, used by
`BertConfig.fp8` with `fused_ops`), in Pallas' interpreter: the kernel's e5m2 gradient and amax
against flax's `quantize` and `jnp.max(|g|)` of the same gradient, the whole FP8 model trained with
the kernel's cast against flax's own passes (loss, parameters and the next scaling state, bit for
bit), and the program a GPU would compile (the gradient GEMMs read the kernel's e5m2 output)."""

import functools
import re

import flax.linen as nn
from flax.linen import fp8_ops
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.model import dropout, layers
from bert_jax.model.kernels import fused, fused_fp8
from tests.helpers import fp8_training, model_parity


def _assert_same_cast(got, want, g, scale):
    """`got` and `want` (float8_e5m2 or e4m3fn) are the same cast of `g / scale`, bit for bit, but at
    ties: XLA's CPU divides vectors 1 ulp off the correctly rounded quotient (measured: 11264.0 for
    11263.9994, the midpoint of e5m2's 10240 and 12288), so where the exact quotient lies within
    a few float32 ulps of a midpoint between two FP8 values the two may round apart, one step."""
    got, want = np.asarray(got), np.asarray(want)
    apart = got.view(np.uint8) != want.view(np.uint8)
    exact = np.asarray(g, np.float64)[apart] / np.float64(np.asarray(scale, np.float32)[0])
    a, b = got[apart].astype(np.float64), want[apart].astype(np.float64)
    assert np.all(np.abs(np.abs(exact) - (np.abs(a) + np.abs(b)) / 2) <= 4 * np.spacing(np.abs(exact).astype(np.float32))), (
        exact, a, b)
    assert apart.sum() <= apart.size // 1000, apart.sum()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("with_dropout", ["key", None])
@pytest.mark.parametrize("launch", ["whole", "chunked"])
def test_the_kernel_casts_dh_to_e5m2_and_takes_its_amax_as_flax_does(monkeypatch, dtype, with_dropout, launch):
    # "chunked": blocks of 32 rows walked 4 at a time (the amax carried through the loop, as on a
    # GPU) at a hidden size of 112 = 64 + 32 + 16 (three column pieces).
    if launch == "chunked":
        monkeypatch.setattr(fused, "INTERPRET_BACKWARD", {"block_rows": 32, "chunk_rows": 4, "num_warps": 4})
    hidden = {"whole": 128, "chunked": 112}[launch]
    rng = np.random.default_rng(0)
    rows = 96
    h, x = (jnp.asarray(rng.normal(0, 1, (rows, hidden)), dtype) for _ in range(2))
    dy = jnp.asarray(rng.normal(0, 1, (rows, hidden)) * rng.choice([1e-11, 1.0], (rows, 1)), dtype)
    scale, bias, h_bias = (jnp.asarray(rng.normal(m, 0.1, (hidden,)), jnp.float32) for m in (1, 0, 0))
    key = jax.random.key_data(jax.random.key(3)) if with_dropout else None
    keep_prob = 0.9 if with_dropout else 1.0
    y, mean, rstd = fused._forward(h, x, None, key, scale, bias, h_bias, keep_prob, 1e-12)
    plain = fused._backward(h, x, None, key, scale, h_bias, mean, rstd, dy, keep_prob)
    dh = np.asarray(plain[0], np.float32)
    # A scale under which the largest gradients reach 1e5, past 61,440 (where e5m2's rounding
    # gives inf: the clip to 57,344 decides), and the smallest fall below its subnormals (to zero).
    grad_scale = jnp.asarray([np.abs(dh).max() / 1e5], jnp.float32)
    q, dx, dscale, dbias, dh_bias, amax = fused._backward(h, x, None, key, scale, h_bias, mean, rstd, dy,
                                                          keep_prob, grad_scale=grad_scale)
    want = fp8_ops.quantize(plain[0], jnp.float8_e5m2, grad_scale, plain[0].dtype)
    assert q.dtype == jnp.float8_e5m2 and q.shape == (rows, hidden)
    _assert_same_cast(q, want, dh, grad_scale)
    assert np.sum(np.abs(np.asarray(want, np.float32)) == fused.E5M2_MAX) > 0  # some clipped
    assert np.sum((np.asarray(want, np.float32) == 0) & (dh != 0)) > 0  # some flushed to zero
    # flax's amax of the same gradient (`compute_amax_history`): |dh| after the dropout's scaling.
    assert float(amax) == float(jnp.max(jnp.abs(plain[0])).astype(jnp.float32))
    # Everything else the kernel writes is what it writes without the cast, bit for bit (the bias
    # gradient from dh before the cast).
    for name, a, b in zip(("dx", "dscale", "dbias", "dh_bias"), (dx, dscale, dbias, dh_bias), plain[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("with_dropout", ["key", None])
@pytest.mark.parametrize("launch", ["whole", "blocks"])
@pytest.mark.parametrize("scales", [1, 2])
def test_the_forward_kernel_casts_y_to_e4m3_and_takes_its_amax_as_flax_s_in_q_does(monkeypatch, dtype, with_dropout,
                                                                                 launch, scales):
    # "blocks": 3 blocks of 32 rows (the amax reduced over blocks) at a hidden size of 112 = 64 + 32 + 16.
    # Two scales (the next layer's query and key/value inputs): y written in e4m3 once per scale.
    if launch == "blocks":
        monkeypatch.setattr(fused, "INTERPRET_FORWARD", {"block_rows": 32, "num_warps": 4})
    hidden = {"whole": 128, "blocks": 112}[launch]
    rng = np.random.default_rng(1)
    rows = 96
    h, x = (jnp.asarray(rng.normal(0, 1, (rows, hidden)), dtype) for _ in range(2))
    # Rows of LayerNorm scales far apart, so that some outputs pass e4m3's 448 (the clip decides)
    # and some fall below its subnormals (to zero).
    scale = jnp.asarray(rng.normal(1, 0.1, (hidden,)), jnp.float32)
    bias, h_bias = (jnp.asarray(rng.normal(0, 0.1, (hidden,)), jnp.float32) for _ in range(2))
    scale = scale * jnp.asarray(rng.choice([1e-6, 1.0, 300.0], (hidden,)), jnp.float32)
    key = jax.random.key_data(jax.random.key(3)) if with_dropout else None
    keep_prob = 0.9 if with_dropout else 1.0
    plain = fused._forward(h, x, None, key, scale, bias, h_bias, keep_prob, 1e-12)
    most = float(jnp.max(jnp.abs(plain[0].astype(jnp.float32))))
    in_scale = jnp.asarray([most / 2000, most / 700][:scales], jnp.float32)
    y, mean, rstd, *qs, amax = fused._forward(h, x, None, key, scale, bias, h_bias, keep_prob, 1e-12,
                                              in_scale=in_scale)
    for name, a, b in zip(("y", "mean", "rstd"), (y, mean, rstd), plain):  # unchanged, bit for bit
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    assert len(qs) == scales
    for q, s in zip(qs, in_scale):
        # flax's `in_q` of the same input: `quantize` in the compute dtype, and `compute_amax_history`'s amax.
        want = fp8_ops.quantize(plain[0], jnp.float8_e4m3fn, s[None], plain[0].dtype)
        assert q.dtype == jnp.float8_e4m3fn and q.shape == (rows, hidden)
        _assert_same_cast(q, want, np.asarray(plain[0], np.float32), s[None])
        assert np.sum(np.abs(np.asarray(want, np.float32)) == fused.E4M3_MAX) > 0  # some clipped
        assert np.sum((np.asarray(want, np.float32) == 0) & (np.asarray(plain[0], np.float32) != 0)) > 0  # flushed
    assert float(amax) == float(jnp.max(jnp.abs(plain[0])).astype(jnp.float32))


@pytest.mark.parametrize("shape", [{}, dict(num_hidden_layers=2, scan_layers=True, remat_policy="full")],
                         ids=["one_layer", "two_layers_scanned_with_full_remat"])
def test_the_fp8_model_trains_as_with_flax_s_cast_when_the_kernel_casts(monkeypatch, shape):
    """Three steps (the gradient scales then come from amax histories the kernel filled): the
    losses, every parameter and every scaling-state leaf equal those of flax's own passes. Only FP8
    with the LayerNorm kernels takes the path (without them, or at a hidden size they cannot read,
    the output denses keep flax's op)."""
    assert fused_fp8.applies(fp8_training.fused_config())
    assert not any(fused_fp8.applies(fp8_training.fused_config(**kw))
                   for kw in ({"fused_ops": False}, {"fp8": False}, {"hidden_size": 120, "num_attention_heads": 4}))
    casts, input_casts = [], []  # the kernels traced that cast dh to e5m2, and y to e4m3

    def backward(*args, grad_scale=None, **kw):
        casts.append(grad_scale is not None)
        return original(*args, grad_scale=grad_scale, **kw)

    def forward(*args, in_scale=None):
        input_casts.append(in_scale is not None)
        return original_forward(*args, in_scale=in_scale)
    original, original_forward = fused._backward, fused._forward
    monkeypatch.setattr(fused, "_backward", backward)
    monkeypatch.setattr(fused, "_forward", forward)
    got_losses, got = fp8_training.train(fp8_training.fused_config(**shape), 3)
    # The attention output and the FFN output, each traced once (or per layer, or again by remat).
    # The attention's LayerNorm writes the FFN's e4m3 input; the FFN's (the next layer's Q/K/V
    # input, two scales, across nn.scan) does not.
    assert casts and all(casts) and input_casts == [True, False] * (len(input_casts) // 2)
    if not shape:  # traced twice: the initialization and the step
        assert len(casts) == 2 and len(input_casts) == 4
    traced = len(casts), len(input_casts)
    monkeypatch.setattr(fused_fp8, "ENABLED", False)
    want_losses, want = fp8_training.train(fp8_training.fused_config(**shape), 3)
    assert not any(casts[traced[0]:] + input_casts[traced[1]:]) and len(input_casts) == 2 * traced[1]
    histories = fp8_training.assert_trained_alike(got_losses, got, want_losses, want)
    assert any("intermediate" in p and "input_amax_history" in p for p in histories)
    assert all(np.all(np.count_nonzero(h, axis=-1) == 3) for h in histories.values())  # an amax per step and layer


def test_the_fp8_kernels_lower_to_triton_and_the_gemms_read_their_e5m2_and_e4m3(monkeypatch):
    """What a GPU would compile, at BERT-Base's sizes (768 = 512 + 256 columns), lowered here: the
    backward kernel's first result is the e5m2 gradient and both gradient GEMMs take it as it is
    (an f8E5M2 operand: cuBLASLt's FP8 GEMM); the kernel also returns the amax partials. The forward
    kernel writes the next FP8 layer's e4m3 input, which that layer's forward GEMM and kernel
    gradient GEMM read as they are: no other pass casts a hidden-wide tensor to e4m3."""
    monkeypatch.setattr(fused, "_interpret", lambda: False)
    hidden, inner = 768, 1024
    dims = (((2,), (0,)), ((), ()))

    def grads(x, kernel, kernel2, residual, key, scale, bias, h_bias, grad_scale, grad_history):
        def loss(x, kernel, kernel2, residual, scale, bias, h_bias, grad_scale, grad_history):
            quant = functools.partial(fp8_ops.in_q, jnp.bfloat16, jnp.float8_e4m3fn)
            q_x, x_scale = quant(x, jnp.ones((1,)), jnp.ones((16,)))
            q_k, k_scale = quant(kernel, jnp.ones((1,)), jnp.ones((16,)))
            dense = fused_fp8.Fp8Dense(x, q_x, x_scale, kernel, q_k, k_scale, grad_scale, grad_history, dims)
            norm = fused_fp8.dense_dropout_add_layernorm(dense, residual, None, scale, bias, h_bias, keep_prob=0.9,
                                                         eps=1e-12, key=key, pending=True)
            state = {f"{t}_{v}": jnp.ones(shape) for t in ("input", "kernel", "output_grad")
                     for v, shape in (("scale", (1,)), ("amax_history", (16,)))}
            y, out = fused_fp8.Fp8NormInput().apply({layers.FP8_COLLECTION: state}, norm, kernel2, dims)
            return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=tuple(range(9)))(x, kernel, kernel2, residual, scale, bias, h_bias, grad_scale,
                                                       grad_history)

    shape = jax.ShapeDtypeStruct
    calls, text = model_parity.lowered_for_cuda(
        grads, shape((4, 64, inner), jnp.bfloat16), shape((inner, hidden), jnp.bfloat16),
        shape((hidden, inner), jnp.bfloat16), shape((4, 64, hidden), jnp.bfloat16), shape((2,), jnp.uint32),
        *[shape((hidden,), jnp.float32)] * 3, shape((1,), jnp.float32), shape((16,), jnp.float32))
    line, = (line for line in calls if 'name = "dropout_add_layernorm_bwd"' in line)
    assert "@__gpu$xla.gpu.triton" in line and "mosaic_gpu" not in text
    results = re.search(r"-> \(([^()]*)\)", line)[1].split(", ")
    assert results[0] == "tensor<256x768xf8E5M2>" and results[1] == "tensor<256x768xbf16>", results
    assert results[-1] == f"tensor<{256 // fused.BACKWARD['block_rows']}xf32>", results  # amax per block
    line, = (line for line in calls if 'name = "dropout_add_layernorm_fwd"' in line)
    results = re.search(r"-> \(([^()]*)\)", line)[1].split(", ")
    assert results[0] == "tensor<256x768xbf16>" and results[3] == "tensor<256x768xf8E4M3FN>", results
    assert results[4] == f"tensor<{256 // fused.FORWARD['block_rows']}xf32>", results  # amax per block
    gemms = [g for g in text.splitlines() if "stablehlo.dot_general" in g]
    assert len(gemms) == 6 and sum("(tensor<4x64x768xf8E5M2>" in g for g in gemms) == 2, gemms
    assert sum("tensor<4x64x768xf8E4M3FN>" in g for g in gemms) == 2, gemms  # forward and kernel gradient
    casts = [g for g in text.splitlines() if "stablehlo.convert" in g and re.search(r"-> tensor<(4x64x|256x)768xf8E4M3FN>", g)]
    assert not casts, casts


@pytest.mark.parametrize("next_layer", [False, True])
def test_a_sub_layer_with_dropout_trains_as_flax_s_fp8_dense_then_the_kernel(next_layer):
    """One sub-layer end with dropout on (the mask drawn in both kernels) and every output of the
    custom VJP: the input, kernel, residual, LayerNorm and bias gradients and the gradient's next
    scale and history equal flax's `Fp8DirectDotGeneralOp` followed by `fused.dropout_add_layernorm`.
    With `next_layer`, an FP8 dense layer reads the LayerNorm's output (the FFN's first, as
    `FeedForward` does): its e4m3 input from the forward kernel (`Fp8NormInput`) against flax's
    `in_q` pass, the outputs, every gradient and that layer's next input scale and history too."""
    rng = np.random.default_rng(2)
    b, l, inner, hidden = 2, 24, 96, 64
    dims = (((2,), (0,)), ((), ()))
    x = jnp.asarray(rng.normal(0, 1, (b, l, inner)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(0, 0.05, (inner, hidden)), jnp.bfloat16)
    kernel2 = jnp.asarray(rng.normal(0, 0.05, (hidden, inner)), jnp.bfloat16)
    residual = jnp.asarray(rng.normal(0, 1, (b, l, hidden)), jnp.bfloat16)
    scale, bias, h_bias = (jnp.asarray(rng.normal(m, 0.1, (hidden,)), jnp.float32) for m in (1, 0, 0))
    dy = jnp.asarray(rng.normal(0, 1, (b, l, hidden)), jnp.bfloat16)
    dout = jnp.asarray(rng.normal(0, 1, (b, l, inner)), jnp.bfloat16)
    key = jax.random.key_data(jax.random.key(5))
    state = {"input_scale": jnp.ones((1,)), "kernel_scale": jnp.ones((1,)), "output_grad_scale": jnp.full((1,), 2.0),
             "input_amax_history": jnp.zeros((16,)).at[0].set(3.0), "kernel_amax_history": jnp.zeros((16,)).at[0].set(.2),
             "output_grad_amax_history": jnp.zeros((16,)).at[:3].set(jnp.asarray([4e-3, 7e-3, 5e-3]))}
    # The next layer's input scale from a history whose largest entry (2.5) puts some of the
    # LayerNorm's outputs past e4m3's 448 (clipped): a scale from this step's amax instead would not.
    next_state = {**state, "input_amax_history": jnp.zeros((16,)).at[:2].set(jnp.asarray([2.5, 1.0])),
                  "input_scale": jnp.full((1,), 0.5)}
    norm_args = dict(keep_prob=0.9, eps=1e-12, key=key)

    class Op(nn.Module):
        fused_cast: bool

        @nn.compact
        def __call__(self, x, kernel, residual, scale, bias, h_bias, kernel2):
            if self.fused_cast:
                dense = fused_fp8.Fp8Operands(name="fp8")(x, kernel, dims)
                y = fused_fp8.dense_dropout_add_layernorm(dense, residual, None, scale, bias, h_bias,
                                                          pending=next_layer, **norm_args)
                return fused_fp8.Fp8NormInput(name="next")(y, kernel2, dims) if next_layer else y
            h = fp8_ops.Fp8DirectDotGeneralOp(name="fp8")(x, kernel, dims)
            y = fused.dropout_add_layernorm(h, residual, None, scale, bias, h_bias=h_bias, **norm_args)
            return (y, fp8_ops.Fp8DirectDotGeneralOp(name="next")(y, kernel2, dims)) if next_layer else y

    def run(fused_cast):
        def f(states, *args):
            return Op(fused_cast).apply({layers.FP8_COLLECTION: states}, *args)
        states = {"fp8": state, "next": next_state} if next_layer else {"fp8": state}
        y, vjp = jax.vjp(f, states, x, kernel, residual, scale, bias, h_bias, kernel2)
        return y, vjp((dy, dout) if next_layer else dy)

    (y, got), (y_want, want) = run(True), run(False)
    for a, c in zip(jax.tree.leaves(y), jax.tree.leaves(y_want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
    keep = np.asarray(dropout.keep_mask(jax.random.wrap_key_data(key), 0.9, (b, l, hidden)))
    assert 0 < keep.mean() < 1
    for (path, a), c in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32),
                                      err_msg=jax.tree_util.keystr(path))
    new = got[0]["fp8"]
    # The gradient's scale came from its history before the step (amax 7e-3 / 57,344), and the
    # history now starts with this step's amax: the largest |dh|, the dropout's scaling included.
    np.testing.assert_allclose(float(new["output_grad_scale"][0]), 7e-3 / fused.E5M2_MAX, rtol=1e-6)
    history = np.asarray(new["output_grad_amax_history"])
    np.testing.assert_array_equal(history[1:], np.roll(np.asarray(state["output_grad_amax_history"]), -1)[1:])
    assert history[0] > 0
    if next_layer:
        # The next layer's input scale from its history before the step (2.5 / 448); its history now
        # starts with the largest |LayerNorm output| of this step, which passes 448 x that scale.
        new = got[0]["next"]
        np.testing.assert_allclose(float(new["input_scale"][0]), 2.5 / fused.E4M3_MAX, rtol=1e-6)
        amax = float(jnp.max(jnp.abs(y[0])).astype(jnp.float32))
        assert float(new["input_amax_history"][0]) == amax > 2.5
        np.testing.assert_array_equal(np.asarray(new["input_amax_history"])[1:],
                                      np.roll(np.asarray(next_state["input_amax_history"]), -1)[1:])
