"""The BERT model's options that change the work, not the outputs: scan, remat and the attention
implementations (cuDNN's fallback to XLA included), `sparse_last_layer` (the last layer at the
positions the heads read only) and `separate_qkv`; same outputs and gradients as the default."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.model import attention, model_config, modeling, pretraining_heads
from bert_jax.model.modeling import BertModel
from bert_jax.model.pretraining_heads import BertForPreTraining
from tests.helpers.tiny_bert import batch, ours, random_params, tiny_config


def test_outputs_do_not_depend_on_scan_remat_or_attention_impl():
    config = tiny_config()
    params = random_params(config)
    inputs = batch()
    want = ours(config, params, inputs)
    stacked = modeling.stack_layers(params, config.num_hidden_layers)
    assert stacked["bert"]["encoder"]["layers"]["ffn"]["intermediate"]["kernel"].shape == (3, 32, 37)
    variants = [
        (config.replace(scan_layers=True), stacked),
        (config.replace(scan_layers=True, remat_policy="full"), stacked),
        (config.replace(remat_policy="dots"), params),
        (config.replace(attention_impl="dot_product"), params),
        (config.replace(attention_impl="dot_product", scan_layers=True), stacked),
    ]
    for cfg, p in variants:
        got = ours(cfg, p, inputs)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=str(cfg))
    # The round trip of the layer stacking is exact.
    back = modeling.unstack_layers(stacked)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)
    # Gradients agree too (remat and scan change the backward pass).
    def loss(cfg, p):
        return jnp.sum(ours(cfg, p, inputs).mlm_logits ** 2)
    g0 = jax.grad(lambda p: loss(config, p))(params)
    g1 = modeling.unstack_layers(jax.grad(lambda p: loss(config.replace(scan_layers=True, remat_policy="full"), p))(stacked))
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
        # float32 summation order differs between the two backward passes: tolerance relative
        # to each gradient's scale.
        np.testing.assert_allclose(a, b, atol=2e-5 * max(1.0, float(np.max(np.abs(a)))), rtol=1e-5)


def test_cudnn_dispatch_falls_back_to_xla_where_cudnn_refuses_a_training_shape(monkeypatch, caplog):
    """On a GPU, `attention_impl='dot_product'` asks `jax.nn.dot_product_attention` for cuDNN.

    cuDNN's rules for training are checked inside its custom VJP's forward rule, traced only for
    a gradient, and inside a `jit` (here `ours`) only after the forward pass, where a try/except
    around the call cannot catch them (with a mask it refuses odd lengths in training and takes
    them in inference). A stand-in with that rule, on CPU: a
    refused shape must go to XLA's attention in every layer, under `jit(grad)`, with the
    outputs and gradients of the einsum path.
    """
    real = jax.nn.dot_product_attention
    calls = []

    def fake_cudnn(query, key, value, mask, scale):
        xla = lambda q, k, v, m: real(q, k, v, mask=m, scale=scale, implementation="xla")

        @jax.custom_vjp
        def kernel(q, k, v, m):
            return xla(q, k, v, m)

        def fwd(q, k, v, m):  # traced only for a gradient: training
            if q.shape[1] % 2 or k.shape[1] % 2:
                calls.append(("refused", q.shape[1]))
                raise NotImplementedError(f"Unsupported sequence length Q {q.shape[1]}, KV {k.shape[1]}.")
            calls.append(("training", q.shape[1]))
            return xla(q, k, v, m), (q, k, v, m)

        def bwd(res, g):
            q, k, v, m = res
            return (*jax.vjp(lambda q, k, v: xla(q, k, v, m), q, k, v)[1](g), None)

        kernel.defvjp(fwd, bwd)
        return kernel(query, key, value, mask)

    def dispatch(query, key, value, *, mask=None, scale=None, implementation=None, **kw):
        if implementation == "cudnn":
            assert query.dtype == jnp.bfloat16 and mask.shape == (query.shape[0], 1, query.shape[1], key.shape[1])
            return fake_cudnn(query, key, value, mask, scale)
        calls.append(("xla", query.shape[1]))
        return real(query, key, value, mask=mask, scale=scale, implementation=implementation, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", dispatch)
    monkeypatch.setattr(attention, "_cudnn_applies", lambda q: q.dtype in (jnp.bfloat16, jnp.float16))
    monkeypatch.setattr(attention, "_cudnn_trains", functools.lru_cache(attention._cudnn_trains.__wrapped__))
    config = tiny_config(dtype="bfloat16", sparse_last_layer=False)
    fused = config.replace(attention_impl="dot_product")
    layers = config.num_hidden_layers
    params = random_params(config)

    def loss(cfg, p, inputs):
        return jnp.sum(ours(cfg, p, inputs).mlm_logits.astype(jnp.float32) ** 2)

    for length in (12, 11):
        inputs = batch(length)
        calls.clear()
        got = jax.jit(jax.value_and_grad(functools.partial(loss, fused)))(params, inputs)
        if length % 2 == 0:  # cuDNN in every layer, its training rule traced
            assert {c[0] for c in calls} == {"training"} and len(calls) >= layers, calls
        else:  # refused once (the probe, cached for the other layers), then XLA's attention in every layer
            assert calls == [("refused", 11)] + [("xla", 11)] * layers, calls
        want = jax.jit(jax.value_and_grad(functools.partial(loss, config)))(params, inputs)
        np.testing.assert_allclose(got[0], want[0], rtol=0.03)
        for a, b in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
            np.testing.assert_allclose(a, b, atol=0.05 * max(1.0, float(np.abs(b).max())), rtol=0)
    assert "Unsupported sequence length Q 11, KV 11" in caplog.text
    assert caplog.text.count("cuDNN fused attention refused") == 1  # logged once
    # Inference at the refused length goes to XLA too: one program with or without a gradient.
    calls.clear()
    BertForPreTraining(fused).apply({"params": params}, **batch(11), deterministic=True)  # not `ours`: cached
    assert calls == [("xla", 11)] * layers, calls


# --- sparse_last_layer: the last layer at the positions the heads read only ---


def _packed_inputs():
    """Two rows of two packed sequences each, padding at the end, masked positions in both."""
    ids = np.random.RandomState(2).randint(5, 99, size=(2, 12)).astype(np.int32)
    pack = np.array([[1] * 6 + [2] * 4 + [0, 0], [1] * 3 + [2] * 8 + [0]])
    pos = np.array([list(range(6)) + list(range(4)) + [0, 0], list(range(3)) + list(range(8)) + [0]])
    return dict(input_ids=jnp.asarray(ids * (pack > 0)), input_mask=jnp.asarray((pack > 0).astype(np.int32)),
                segment_ids=jnp.zeros((2, 12), jnp.int32), masked_lm_positions=jnp.array([[2, 7, 8], [1, 5, 10]]),
                position_ids=jnp.asarray(pos), pack_ids=jnp.asarray(pack), cls_positions=jnp.array([[0, 6], [0, 3]]))


def _flops(fn, *args):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("options,packed", [
    (dict(), False), (dict(), True), (dict(causal_attention=True, remat_policy="full"), False),
    (dict(dtype="bfloat16"), False), (dict(scan_layers=True), True)])
def test_sparse_last_layer_gives_the_same_logits_and_gradients(options, packed):
    config = tiny_config(**options)
    dense_config = config.replace(sparse_last_layer=False)
    params = random_params(tiny_config())
    if config.scan_layers:
        params = modeling.stack_layers(params, config.num_hidden_layers)
    inputs = _packed_inputs() if packed else batch()

    def loss(cfg, p):
        out = BertForPreTraining(cfg).apply({"params": p}, **inputs, deterministic=True)
        return jnp.sum(out.mlm_logits ** 2) + jnp.sum(out.nsp_logits ** 2), out

    # At XLA's own optimization level (not the suite's 0, tests/helpers/xla_flags.py): some of the compared
    # gradients are zero but for float32 noise (the attention key bias: softmax ignores it), and
    # the noise of unoptimized code reaches 1.6e-5, past the 1e-5 the two programs agree to here.
    grad = lambda cfg: jax.jit(jax.value_and_grad(functools.partial(loss, cfg), has_aux=True)).lower(params).compile(
        compiler_options={"xla_backend_optimization_level": 3})
    sparse_step, dense_step = grad(config), grad(dense_config)
    (_, sparse), g_sparse = sparse_step(params)
    (_, dense), g_dense = dense_step(params)
    tol = 0.05 if config.dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(sparse.mlm_logits, dense.mlm_logits, atol=tol, rtol=0)
    np.testing.assert_allclose(sparse.nsp_logits, dense.nsp_logits, atol=tol, rtol=0)
    np.testing.assert_allclose(sparse.masked_output.astype(jnp.float32), dense.masked_output.astype(jnp.float32),
                               atol=tol, rtol=0)
    if config.dtype == "float32":  # bfloat16 gradients differ by rounding (the logits agree above)
        for a, b in zip(jax.tree_util.tree_leaves(g_sparse), jax.tree_util.tree_leaves(g_dense)):
            np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())), rtol=0)
    # The work it saves: the last layer's queries, attention output and feed-forward at 4 of 12
    # positions (3 masked + [CLS]) instead of 12, or 5 of 12 when packed (two [CLS] per row);
    # forward and backward, so at least twice the forward matmuls of the rows skipped.
    flops = lambda step: step.cost_analysis()["flops"]
    saved = flops(dense_step) - flops(sparse_step)
    if config.scan_layers:  # every layer runs in full inside the scan
        assert saved == pytest.approx(0, abs=0.01 * flops(dense_step))
    else:
        h, i = config.hidden_size, config.intermediate_size
        rows = inputs["input_ids"].shape[0] * (12 - (5 if packed else 4))
        assert saved >= 2 * rows * 2 * (2 * h * h + 2 * h * i)


def test_output_positions_equal_the_full_output_gathered():
    config = tiny_config()
    params = random_params(config)["bert"]
    inputs = _packed_inputs()
    model_inputs = {k: v for k, v in inputs.items() if k != "masked_lm_positions"}
    full = BertModel(config).apply({"params": params}, **model_inputs)
    for cfg in (config, config.replace(sparse_last_layer=False)):
        some = BertModel(cfg).apply({"params": params}, **model_inputs,
                                    output_positions=inputs["masked_lm_positions"])
        np.testing.assert_allclose(some.sequence_output,
                                   modeling.gather_positions(full.sequence_output, inputs["masked_lm_positions"]),
                                   atol=1e-5, rtol=0)
        np.testing.assert_allclose(some.pooled_output, full.pooled_output, atol=1e-5, rtol=0)
    none = BertModel(config).apply({"params": params}, **model_inputs,
                                   output_positions=jnp.zeros((2, 0), jnp.int32))
    assert none.sequence_output.shape == (2, 0, config.hidden_size)
    np.testing.assert_allclose(none.pooled_output, full.pooled_output, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="output_hidden_states"):
        BertModel(config).apply({"params": params}, **model_inputs, output_positions=inputs["cls_positions"],
                                output_hidden_states=True)


def test_sentence_heads_compute_the_last_layer_at_cls_only():
    from bert_jax.finetune import heads

    config = tiny_config()
    inputs = {k: batch()[k] for k in ("input_ids", "input_mask", "segment_ids")}
    model = heads.BertForTask(config, "classification", 3)
    params = model.init(jax.random.key(0), **inputs)["params"]
    run = lambda cfg: (lambda p: heads.BertForTask(cfg, "classification", 3).apply({"params": p}, **inputs)["logits"])
    dense_config = config.replace(sparse_last_layer=False)
    np.testing.assert_allclose(run(config)(params), run(dense_config)(params), atol=1e-5, rtol=0)
    h, i = config.hidden_size, config.intermediate_size
    # 11 of 12 rows of 4 skip the query and output projections and the feed-forward.
    assert _flops(run(dense_config), params) - _flops(run(config), params) >= 0.9 * 4 * 11 * 2 * (2 * h * h + 2 * h * i)
    # Token heads read every position: nothing is skipped.
    token = lambda cfg: (lambda p: heads.BertForTask(cfg, "token", 3).apply({"params": p}, **inputs)["logits"])
    tparams = heads.BertForTask(config, "token", 3).init(jax.random.key(0), **inputs)["params"]
    assert _flops(token(config), tparams) == _flops(token(dense_config), tparams)


def test_separate_qkv_matmuls_train_like_the_stacked_kernel():
    """`separate_qkv`: Q, K and V from three matmuls equal the slices of one matmul against the
    stacked kernels (float32: to rounding), logits, loss and every gradient, with dropout on; and
    the program has no stacked Q/K/V kernel left, nor the slices of its output."""
    from tests.helpers import model_parity
    cfg = model_config.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=128, sparse_last_layer=False)
    other = cfg.replace(separate_qkv=True)
    model_parity.assert_trains_alike(cfg, other, kernels=(), logits_atol=2e-6, loss_rtol=1e-6, grad_tol=1e-5)
    batch = modeling.dummy_inputs(cfg, batch=1, length=8, predictions=2)
    params = pretraining_heads.BertForPreTraining(cfg).init(jax.random.key(0), **batch)["params"]

    def ops(c):
        loss = lambda p: pretraining_heads.BertForPreTraining(c).apply({"params": p}, **batch).nsp_logits.sum()
        text = str(jax.make_jaxpr(jax.grad(loss))(params))
        return text.count(" stack["), text.count(" slice[")
    (stacks, slices), (other_stacks, other_slices) = ops(cfg), ops(other)
    layers = cfg.num_hidden_layers  # per layer: the kernels and the biases stacked, three slices
    assert (other_stacks, other_slices) == (stacks - 2 * layers, slices - 3 * layers)
