"""The Pallas kernels on a mesh of several devices (`bert_jax.model.kernels.per_device`): each device
runs them on its own rows under `jax.shard_map`. The LayerNorm kernels (`bert_jax.model.kernels.fused`),
with the dropout mask drawn from each element's index in the whole array, equal one device's bit for bit (forward,
backward, FP8's casts and amaxes); the GEMM kernels (`fused_ffn`, `fused_qkv`) equal one device's,
their weight gradients summed over the devices; the program a GPU would compile has each Triton
call take one device's rows; and the whole pretraining model's gradients, dropout on, equal one
device's."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from bert_jax.model import layers, model_config, modeling, pretraining_heads
from bert_jax.model.kernels import fused, fused_ffn, fused_qkv, per_device
from bert_jax.pretrain import steps
from bert_jax.training import sharding
from tests.helpers import model_parity

MESHES = [{"data": 4, "fsdp": 2}, {"data": 2, "fsdp": 2, "tensor": 2}]


def _operands(dtype, b=8, length=12, hidden=112):
    rng = np.random.default_rng(0)
    h, x, dy = (jnp.asarray(rng.normal(0, 1, (b * length, hidden)), dtype) for _ in range(3))
    scale, bias, h_bias = (jnp.asarray(rng.normal(m, 0.1, (hidden,)), jnp.float32) for m in (1, 0, 0))
    return h, x, dy, scale, bias, h_bias


def _passes(h, x, dy, scale, bias, h_bias, key):
    """Both kernels with every optional operand: the dropout key, the dense bias, FP8's scales (two
    e4m3 copies: the next layer's query and key/value inputs)."""
    one = jnp.ones((1,), jnp.float32)
    forward = fused._forward(h, x, None, key, scale, bias, h_bias, 0.9, 1e-12, in_scale=jnp.asarray([0.01, 0.03]))
    y, mean, rstd = forward[:3]
    back = fused._backward(h, x, None, key, scale, h_bias, mean, rstd, dy, 0.9, grad_scale=one * 1e-3)
    return forward + back


@pytest.mark.parametrize("mesh_shape", MESHES, ids=["data4_fsdp2", "data2_fsdp2_tensor2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_kernels_run_per_shard_and_equal_one_device(monkeypatch, mesh_shape, dtype):
    # Blocks of 4 rows on one device and on each of 8 (12 rows each), as a GPU's launch shape is
    # the same whatever the rows.
    monkeypatch.setattr(fused, "INTERPRET_FORWARD", {"block_rows": 4, "num_warps": 4})
    monkeypatch.setattr(fused, "INTERPRET_BACKWARD", {"block_rows": 4, "chunk_rows": 4, "num_warps": 4})
    h, x, dy, scale, bias, h_bias = _operands(dtype)
    key = jax.random.key_data(jax.random.key(7))
    want = jax.jit(_passes)(h, x, dy, scale, bias, h_bias, key)
    mesh = sharding.create_mesh(mesh_shape)
    rows = NamedSharding(mesh, P(sharding.BATCH_AXES))
    step = jax.jit(_passes, in_shardings=(rows, rows, rows) + (NamedSharding(mesh, P()),) * 4)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        assert per_device.row_axes(h.shape[0]) == sharding.BATCH_AXES
        assert "shard_map" in str(jax.make_jaxpr(step)(h, x, dy, scale, bias, h_bias, key))
        got = step(h, x, dy, scale, bias, h_bias, key)
    assert got[0].sharding.is_equivalent_to(rows, 2)  # y stays split by rows
    names = ("y", "mean", "rstd", "q", "q2", "amax", "dh", "dx", "dscale", "dbias", "dh_bias", "grad_amax")
    for name, a, b in zip(names, got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if name in ("dscale", "dbias", "dh_bias"):  # sums of per-device partials: float32 reordering
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=name)
        elif name == "dx" and dtype == "float32":  # to float32 rounding of its largest terms: XLA's CPU
            # code for the interpreter's loop over 3 blocks and over 24 rounds differently (the same
            # kernel program on a GPU)
            np.testing.assert_allclose(a, b, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(b).max(), err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    # The mask is the whole array's: each device's rows draw different bits (a shard that drew
    # from row 0 would repeat the first device's mask, and fail above).
    dropped = np.asarray(got[names.index("dh")], np.float32) == 0
    by_device = dropped.reshape(8, -1)
    assert 0.05 < dropped.mean() < 0.15 and not all((by_device[0] == d).all() for d in by_device[1:])


def test_the_kernels_run_as_one_call_where_rows_cannot_split():
    assert per_device.row_axes(96) is None  # no mesh
    with jax.set_mesh(sharding.create_mesh({"data": 1}, devices=jax.devices()[:1])):
        with nn.logical_axis_rules(sharding.DEFAULT_RULES):
            assert per_device.row_axes(96) is None  # one device (one GPU's run): its program as it was
    mesh = sharding.create_mesh({"data": 4, "fsdp": 2})
    rules = dict(sharding.DEFAULT_RULES)
    with jax.set_mesh(mesh):
        with nn.logical_axis_rules(sharding.DEFAULT_RULES):
            assert per_device.row_axes(96) == ("data", "fsdp")
            assert per_device.row_axes(100) is None  # 100 rows over 8 devices
        for split in ({"activation_embed": "tensor"}, {"activation_length": "data", "activation_batch": "fsdp"}):
            with nn.logical_axis_rules(tuple({**rules, **split}.items())):
                assert per_device.row_axes(96) is None, split  # a LayerNorm row or a sequence across devices
        h, x, dy, scale, bias, h_bias = _operands("float32", b=25, length=4)  # 100 rows: one call, still right
        with nn.logical_axis_rules(sharding.DEFAULT_RULES):
            got = jax.jit(_passes)(h, x, dy, scale, bias, h_bias, jax.random.key_data(jax.random.key(7)))
    want = _passes(h, x, dy, scale, bias, h_bias, jax.random.key_data(jax.random.key(7)))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)


def _gemm_operands(b=8, length=16, hidden=64, inner=128, heads=4):
    rng = np.random.default_rng(1)
    normal = lambda *shape, s=1.0: jnp.asarray(rng.normal(0, s, shape), jnp.float32)
    return dict(x=normal(b, length, hidden), w1=normal(hidden, inner, s=0.05), b1=normal(inner, s=0.1),
                w2=normal(inner, hidden, s=0.05), kernels=[normal(hidden, heads, hidden // heads, s=0.05) for _ in "qkv"],
                biases=[normal(heads, hidden // heads, s=0.1) for _ in "qkv"])


def _ffn_and_qkv(x, w1, b1, w2, kernels, biases):
    """The FFN kernels' and the Q/K/V kernels' outputs and every gradient of a loss on them."""
    def loss(x, w1, b1, w2, kernels, biases):
        y = fused_ffn.gemm_bias_gelu_gemm(x, w1, b1, w2, activation="gelu_tanh")
        q, k, v = fused_qkv.qkv_projection(x, kernels, biases)
        return jnp.sum(y ** 2) + sum(jnp.sum(t * t * (i + 1)) for i, t in enumerate((q, k, v))), (y, q, k, v)
    return jax.grad(loss, argnums=range(6), has_aux=True)(x, w1, b1, w2, kernels, biases)


def test_the_gemm_kernels_run_per_shard_and_equal_one_device():
    """The FFN's GEMM + bias + GELU kernels and the Q/K/V kernels, 8 devices (16 rows each) against
    one: the outputs and the input gradient row for row, the weight and bias gradients (each device's
    sums over its rows, summed over the devices) to float32 rounding."""
    ops = _gemm_operands()
    assert fused_ffn.supported(64, 128, "gelu_tanh") and fused_qkv.supported(64)
    want_grads, want = jax.jit(_ffn_and_qkv)(**ops)
    mesh = sharding.create_mesh({"data": 4, "fsdp": 2})
    placed = jax.device_put(ops, {k: NamedSharding(mesh, P(sharding.BATCH_AXES) if k == "x" else P()) for k in ops})
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        jaxpr = str(jax.make_jaxpr(_ffn_and_qkv)(**placed))
        assert jaxpr.count("shard_map") == 5  # the two FFN kernels and the three Q/K/V kernels
        got_grads, got = jax.jit(_ffn_and_qkv)(**placed)
    for name, a, b in zip(("y", "q", "k", "v"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6, err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got_grads)[0], jax.tree.leaves(want_grads)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * np.abs(b).max(),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("per_shard", [True, False])
@pytest.mark.parametrize("kernels", ["layernorm", "ffn_and_qkv"])
def test_on_a_mesh_the_triton_calls_take_one_device_s_rows(monkeypatch, per_shard, kernels):
    """What a GPU would compile on 8 devices, batch split over (data, fsdp): each Triton call reads
    its device's 64 of the 512 rows. Without the shard_map (`row_axes` None, as before) XLA cannot
    split the call and each device's reads all 512 (its operands gathered)."""
    for module in (fused, fused_ffn, fused_qkv):
        monkeypatch.setattr(module, "_interpret", lambda: False)
    if not per_shard:
        monkeypatch.setattr(per_device, "row_axes", lambda rows, multiple=1: None)
    hidden, mesh = 768, sharding.create_mesh({"data": 4, "fsdp": 2})
    shape, rows, whole = jax.ShapeDtypeStruct, NamedSharding(mesh, P(sharding.BATCH_AXES)), NamedSharding(mesh, P())
    act = shape((8, 64, hidden), jnp.bfloat16, sharding=rows)
    if kernels == "layernorm":
        def grads(h, x, key, scale, bias, h_bias):
            def loss(h, x, scale, bias, h_bias):
                y = fused.dropout_add_layernorm(h, x, None, scale, bias, keep_prob=0.9, eps=1e-12, h_bias=h_bias,
                                                key=key)
                return jnp.sum(y.astype(jnp.float32) ** 2)
            return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(h, x, scale, bias, h_bias)
        args = (act, act, shape((2,), jnp.uint32, sharding=whole), *[shape((hidden,), jnp.float32, sharding=whole)] * 3)
        names = ("dropout_add_layernorm_fwd", "dropout_add_layernorm_bwd")
    else:
        def grads(x, w1, b1, w2, kernels, biases):
            return _ffn_and_qkv(x, w1, b1, w2, kernels, biases)[0]
        weight = lambda *dims: shape(dims, jnp.bfloat16, sharding=whole)
        args = (act, weight(hidden, 3072), shape((3072,), jnp.float32, sharding=whole), weight(3072, hidden),
                [weight(hidden, 12, 64)] * 3, [shape((12, 64), jnp.bfloat16, sharding=whole)] * 3)
        names = ("ffn_gemm_bias_gelu_fwd", "ffn_gemm_gelu_bwd", "qkv_gemm_bias_fwd", "qkv_gemm_dx_bwd",
                 "qkv_gemm_dw_db_bwd")
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        calls, _ = model_parity.lowered_for_cuda(grads, *args)
    lines = {name: [line for line in calls if f'name = "{name}"' in line] for name in names}
    assert all(len(found) == 1 and "@__gpu$xla.gpu.triton" in found[0] for found in lines.values()), calls
    read = {name: re.search(r": \(tensor<(\d+)x", found[0])[1] for name, found in lines.items()}
    assert set(read.values()) == ({"64"} if per_shard else {"512"}), read


@pytest.mark.parametrize("fp8", [False, True])
def test_the_pretraining_model_with_the_kernels_on_a_mesh_has_one_device_s_gradients(fp8):
    """BERT with `fused_ops`, dropout on (the kernels draw the masks), 2 x 2 x 2 devices against one:
    the loss and every gradient (dropout's masks per device would give other gradients); with FP8
    too, its casts in the kernels (`fused_fp8`; the second layer's Q/K/V inputs written by the first's
    LayerNorm kernel), the next scaling state (amaxes over every device)."""
    cfg = model_config.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, fused_ops=True, fp8=fp8)
    model = pretraining_heads.BertForPreTraining(cfg)
    rng = np.random.default_rng(0)
    batch = dict(input_ids=rng.integers(5, 120, (8, 16)).astype(np.int32), input_mask=np.ones((8, 16), np.int32),
                 segment_ids=np.zeros((8, 16), np.int32), masked_lm_positions=np.tile(np.arange(1, 5), (8, 1)),
                 masked_lm_ids=rng.integers(5, 120, (8, 4)).astype(np.int32),
                 masked_lm_weights=np.ones((8, 4), np.float32),
                 next_sentence_labels=rng.integers(0, 2, (8, 1)).astype(np.int32))
    variables = nn.meta.unbox(model.init(jax.random.key(0), **modeling.dummy_inputs(cfg)))
    assert (layers.FP8_COLLECTION in variables) == fp8

    def loss(v, b):
        out = model.apply(v, **steps._model_inputs(b), deterministic=False, rngs={"dropout": jax.random.key(3)})
        sums = steps.pretraining_sums(out, b)
        return steps.combine_loss(sums, jnp.sum(b["masked_lm_weights"]), 8.0, use_nsp=True)

    want_loss, want = jax.jit(jax.value_and_grad(loss))(variables, batch)
    mesh = sharding.create_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    abstract = jax.eval_shape(lambda r: model.init(r, **modeling.dummy_inputs(cfg)), jax.random.key(0))
    placed = (jax.device_put(variables, sharding.logical_to_sharding(abstract, mesh)), sharding.to_global(batch, mesh))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        step = jax.jit(jax.value_and_grad(loss))
        assert "shard_map" in str(jax.make_jaxpr(step)(*placed))
        got_loss, got = step(*placed)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
