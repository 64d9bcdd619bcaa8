"""FP8's Q/K/V input cast inside the LayerNorm forward kernel (`bert_jax.model.kernels.fused_fp8.norm_qkv`,
used with `fp8` and `fused_ops` when the layers are unrolled and not rematerialized:
`fused_fp8.chains_layers`): each layer's FFN LayerNorm is left pending and the next layer's attention
runs it, the kernel writing the input in e4m3 once per input scale (the query's and the key/value's).
In Pallas' interpreter, against flax's `Fp8Einsum`s on the LayerNorm kernel's output: one attention
with two different scaling states (outputs, every gradient, both next scales and histories, bit for
bit), the unrolled model trained for three steps, its hidden states, and the program a GPU would
compile (the Q/K/V GEMMs read the kernel's e4m3 outputs; no other pass casts them)."""

import re

import flax.linen as nn
from flax.linen import fp8_ops
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.model import layers, modeling
from bert_jax.model.kernels import fused, fused_fp8
from tests.helpers import fp8_training, model_parity

DIMS = (((2,), (0,)), ((), ()))  # what jnp.einsum hands the FP8 op for "blh,hnd->blnd" and "blh,hsnd->blsnd"


def _state(input_history, input_scale):
    return {"input_scale": jnp.full((1,), input_scale), "kernel_scale": jnp.ones((1,)),
            "output_grad_scale": jnp.full((1,), 2.0), "input_amax_history": input_history,
            "kernel_amax_history": jnp.zeros((16,)).at[0].set(.2),
            "output_grad_amax_history": jnp.zeros((16,)).at[:3].set(jnp.asarray([4e-3, 7e-3, 5e-3]))}


def test_an_attention_reading_a_pending_ffn_end_trains_as_flax_s_einsums():
    """The FFN output dense, its LayerNorm with dropout, and the next layer's query and key/value
    projections: the forward kernel's two e4m3 copies (`norm_qkv`) against flax's two `Fp8Einsum`s
    (each its own `in_q` pass) on `fused.dropout_add_layernorm`'s output. The two input states
    differ, so a copy cast with the other projection's scale, or one history given the other's amax
    or scale, changes a result."""
    rng = np.random.default_rng(4)
    b, l, inner, hidden, heads, head_dim = 2, 24, 96, 64, 4, 16
    x = jnp.asarray(rng.normal(0, 1, (b, l, inner)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(0, 0.05, (inner, hidden)), jnp.bfloat16)
    kernel_q = jnp.asarray(rng.normal(0, 0.05, (hidden, heads, head_dim)), jnp.bfloat16)
    kernel_kv = jnp.asarray(rng.normal(0, 0.05, (hidden, 2, heads, head_dim)), jnp.bfloat16)
    residual = jnp.asarray(rng.normal(0, 1, (b, l, hidden)), jnp.bfloat16)
    scale, bias, h_bias = (jnp.asarray(rng.normal(m, 0.1, (hidden,)), jnp.float32) for m in (1, 0, 0))
    cotangents = tuple(jnp.asarray(rng.normal(0, 1, shape), jnp.bfloat16)
                       for shape in ((b, l, hidden), (b, l, heads, head_dim), (b, l, 2, heads, head_dim)))
    key = jax.random.key_data(jax.random.key(6))
    norm_args = dict(keep_prob=0.9, eps=1e-12, key=key)
    # The query's scale from a history whose largest entry (2.5) puts some LayerNorm outputs past
    # e4m3's 448 (clipped); the key/value's (6.0) clips none: the two e4m3 copies differ.
    states = {"fp8": _state(jnp.zeros((16,)).at[0].set(3.0), 1.0),
              "query_fp8": _state(jnp.zeros((16,)).at[:2].set(jnp.asarray([2.5, 1.0])), 0.5),
              "key_value_fp8": _state(jnp.zeros((16,)).at[:3].set(jnp.asarray([1.0, 6.0, 2.0])), 0.25)}

    class Op(nn.Module):
        fused_cast: bool

        @nn.compact
        def __call__(self, x, kernel, residual, scale, bias, h_bias, kernel_q, kernel_kv):
            if self.fused_cast:
                dense = fused_fp8.Fp8Operands(name="fp8")(x, kernel, DIMS)
                norm = fused_fp8.dense_dropout_add_layernorm(dense, residual, None, scale, bias, h_bias, pending=True,
                                                             **norm_args)
                return fused_fp8.norm_qkv(norm, fused_fp8.Fp8NormInput(name="query_fp8"),
                                          fused_fp8.Fp8NormInput(name="key_value_fp8"), kernel_q, kernel_kv, DIMS)
            h = fp8_ops.Fp8DirectDotGeneralOp(name="fp8")(x, kernel, DIMS)
            y = fused.dropout_add_layernorm(h, residual, None, scale, bias, h_bias=h_bias, **norm_args)
            return (y, fp8_ops.Fp8Einsum(name="query_fp8")("blh,hnd->blnd", y, kernel_q),
                    fp8_ops.Fp8Einsum(name="key_value_fp8")("blh,hsnd->blsnd", y, kernel_kv))

    def run(fused_cast):
        def f(states, *args):
            return Op(fused_cast).apply({layers.FP8_COLLECTION: states}, *args)
        out, vjp = jax.vjp(f, states, x, kernel, residual, scale, bias, h_bias, kernel_q, kernel_kv)
        return out, vjp(cotangents)

    (out, got), (out_want, want) = run(True), run(False)
    for a, c in zip(out, out_want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
    for (path, a), c in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32),
                                      err_msg=jax.tree_util.keystr(path))
    assert jax.tree.structure(got[0]) == jax.tree.structure(states)
    # Each input scale from its own history before the step; both histories now start with this
    # step's largest |LayerNorm output|, which passes the query's 448 x scale (clipped) only.
    amax = float(jnp.max(jnp.abs(out[0])).astype(jnp.float32))
    assert 2.5 < amax < 6.0
    for name, most in (("query_fp8", 2.5), ("key_value_fp8", 6.0)):
        new, before = got[0][name], states[name]
        np.testing.assert_allclose(float(new["input_scale"][0]), most / fused.E4M3_MAX, rtol=1e-6)
        assert float(new["input_amax_history"][0]) == amax
        np.testing.assert_array_equal(np.asarray(new["input_amax_history"])[1:],
                                      np.roll(np.asarray(before["input_amax_history"]), -1)[1:])


def _forward_sizes(monkeypatch) -> list:
    """Records, for each forward LayerNorm kernel traced, how many e4m3 copies it writes."""
    sizes, original = [], fused._forward

    def forward(*args, in_scale=None):
        sizes.append(0 if in_scale is None else in_scale.shape[0])
        return original(*args, in_scale=in_scale)
    monkeypatch.setattr(fused, "_forward", forward)
    return sizes


# Per trace: the copies each forward kernel writes, layer after layer (attention's end, then FFN's).
_THREE_LAYERS = [1, 2, 1, 0, 1, 0]  # the last layer at a few queries: its input computed whole first
_TWO_LAYERS = [1, 2, 1, 0]          # the last layer at every position: its output computed at the end
_REMAT = [1, 0, 1, 0]               # a remat'd layer keeps one tensor between layers: no chain


@pytest.mark.parametrize("shape,sizes", [
    (dict(num_hidden_layers=3), _THREE_LAYERS),
    (dict(num_hidden_layers=2, sparse_last_layer=False), _TWO_LAYERS),
    (dict(num_hidden_layers=2, remat_policy="full"), _REMAT),
], ids=["three_layers", "two_layers_every_position", "two_layers_remat_full"])
def test_the_unrolled_fp8_model_trains_as_with_flax_s_casts_when_each_layer_s_kernel_casts_the_next_s_input(
        monkeypatch, shape, sizes):
    """Three steps (the scales then come from histories the kernels filled): the losses, every
    parameter and every scaling-state leaf equal those of flax's own passes (`ENABLED` off)."""
    assert fused_fp8.chains_layers(fp8_training.fused_config(**shape)) == (sizes != _REMAT)
    assert not fused_fp8.chains_layers(fp8_training.fused_config(num_hidden_layers=2, scan_layers=True))
    traced = _forward_sizes(monkeypatch)
    got_losses, got = fp8_training.train(fp8_training.fused_config(**shape), 3)
    # traced twice (the initialization and the step); remat traces its layers again for the backward
    assert traced[:len(sizes)] == sizes and traced[len(traced) - len(sizes):] == sizes, traced
    monkeypatch.setattr(fused_fp8, "ENABLED", False)
    chained = len(traced)
    want_losses, want = fp8_training.train(fp8_training.fused_config(**shape), 3)
    assert len(traced) > chained and not any(traced[chained:])  # flax's casts: the kernels write no e4m3
    histories = fp8_training.assert_trained_alike(got_losses, got, want_losses, want)
    assert any("layer_1" in p and "query_fp8']['input_amax_history" in p for p in histories)
    assert all(np.all(np.count_nonzero(h, axis=-1) == 3) for h in histories.values())  # an amax per step


def test_the_chained_model_s_hidden_states_are_each_layer_s_output(monkeypatch):
    """With dropout on, every layer's output (`output_hidden_states`, collected where the next
    layer computes it) and the pooled output equal the model's without the chain, bit for bit."""
    cfg = fp8_training.fused_config(num_hidden_layers=3)
    ids = jnp.asarray(np.random.default_rng(7).integers(5, 200, (2, 16)), jnp.int32)
    model = modeling.BertModel(cfg)
    variables = model.init(jax.random.key(0), ids)

    def run():
        out = model.apply(variables, ids, deterministic=False, output_hidden_states=True,
                          rngs={"dropout": jax.random.key(2)})
        return out.hidden_states, out.pooled_output

    traced = _forward_sizes(monkeypatch)
    (hidden, pooled) = run()
    assert 2 in traced
    monkeypatch.setattr(fused_fp8, "ENABLED", False)
    chained = len(traced)
    (hidden_want, pooled_want) = run()
    assert len(traced) > chained and not any(traced[chained:])
    assert hidden.shape == (4, 2, 16, cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(hidden, np.float32), np.asarray(hidden_want, np.float32))
    np.testing.assert_array_equal(np.asarray(pooled, np.float32), np.asarray(pooled_want, np.float32))
    assert len({float(jnp.sum(h.astype(jnp.float32))) for h in hidden}) == 4  # four different states


def _e4m3_casts(text: str, hidden: int) -> list:
    return [g for g in text.splitlines()
            if "stablehlo.convert" in g and re.search(rf"-> tensor<(2x64x|128x){hidden}xf8E4M3FN>", g)]


def test_the_q_k_v_gemms_read_the_kernel_s_e4m3_copies_in_what_a_gpu_compiles(monkeypatch):
    """Two unrolled FP8 layers' train gradients, lowered for CUDA here: the first layer's FFN
    LayerNorm kernel (run by the second layer) returns the input twice as f8E4M3FN beside the bf16
    one, and the second layer's query and key/value GEMMs read those; the only hidden-wide
    activations cast to e4m3 by other passes are the first layer's Q/K/V inputs (the embeddings').
    Without the kernels' casts, every layer's three are."""
    monkeypatch.setattr(fused, "_interpret", lambda: False)
    hidden = 256
    cfg = fp8_training.fused_config(num_hidden_layers=2, hidden_size=hidden, intermediate_size=512,
                               sparse_last_layer=False)
    model = modeling.BertModel(cfg)
    ids = jnp.zeros((2, 64), jnp.int32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), ids))

    def lowered():  # a new function each time: jax reuses a function's trace
        def grads(variables, ids):
            def loss(params):
                out = model.apply({**variables, "params": params}, ids, deterministic=False,
                                  rngs={"dropout": jax.random.key(1)})
                return jnp.sum(out.sequence_output.astype(jnp.float32) ** 2)
            return jax.grad(loss)(variables["params"])
        return model_parity.lowered_for_cuda(grads, variables, jax.ShapeDtypeStruct(ids.shape, ids.dtype))

    calls, text = lowered()
    forwards = [line for line in calls if 'name = "dropout_add_layernorm_fwd"' in line]
    two = [line for line in forwards if re.search(r"-> \(([^()]*)\)", line)[1].count("f8E4M3FN") == 2]
    assert len(forwards) == 4 and len(two) == 1, forwards
    results = re.search(r"-> \(([^()]*)\)", two[0])[1].split(", ")
    assert results[0] == f"tensor<128x{hidden}xbf16>" and results[3:5] == [f"tensor<128x{hidden}xf8E4M3FN>"] * 2
    gemms = [g for g in text.splitlines() if "stablehlo.dot_general" in g and f"tensor<2x64x{hidden}xf8E4M3FN>" in g]
    # Per layer, the query's, the key/value's and the FFN's first forward GEMMs and their kernel-gradient
    # GEMMs read an e4m3 activation; only the first layer's query and key/value inputs are cast by a
    # pass of their own: the rest are the forward kernels' outputs.
    assert len(gemms) == 12, gemms
    assert len(_e4m3_casts(text, hidden)) == 2, _e4m3_casts(text, hidden)
    monkeypatch.setattr(fused_fp8, "ENABLED", False)
    assert len(_e4m3_casts(lowered()[1], hidden)) == 6
