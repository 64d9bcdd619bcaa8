"""Pallas splash attention (attention_impl="dot_product" on TPU), run on CPU in Pallas interpret mode.

The kernel is checked against the einsum path on real tokens (padding queries attend differently by
design, see `attention.make_sequence_ids`): forward and gradients, float32 and bfloat16, with padding,
packing and the causal mask; under `shard_map` on a (data, fsdp, tensor) mesh of 8 CPU devices; and
inside the model, where the sequence ids travel through the scanned encoder. tests/pod/test_aot_tpu.py
compiles it for a TPU slice.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from bert_jax.model import attention
from bert_jax.model.model_config import BertConfig
from bert_jax.model.modeling import BertModel
from bert_jax.training import sharding
from tests.helpers.planted_splash import interpreted_splash

BATCH, LENGTH, HEADS, HEAD_DIM = 4, 128, 2, 64


def masks(case: str):
    """`(input_mask, pack_ids, causal)` `[batch, length]`: ragged padding and an all-padding row."""
    input_mask = np.ones((BATCH, LENGTH), np.int32)
    input_mask[1, 100:] = 0
    input_mask[2, 7:] = 0
    input_mask[3, :] = 0
    pack_ids = None
    if case in ("packing", "causal"):
        pack_ids = np.zeros((BATCH, LENGTH), np.int32)
        pack_ids[0] = np.repeat([1, 2, 3], [50, 60, 18])
        pack_ids[1, :100] = np.repeat([1, 2], [30, 70])
        pack_ids[2, :7] = 1
    return jnp.asarray(input_mask), None if pack_ids is None else jnp.asarray(pack_ids), case == "causal"


def qkv(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(BATCH, LENGTH, HEADS, HEAD_DIM)), dtype) for _ in range(3))


def outputs_and_grads(fn, q, k, v, input_mask):
    """`fn(q, k, v)` and the gradients of a random projection of its real-token outputs."""
    out, vjp = jax.vjp(fn, q, k, v)
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=out.shape), out.dtype)
    cotangent = cotangent * input_mask[:, :, None, None].astype(out.dtype)  # real tokens only
    return out, vjp(cotangent)


def test_sequence_ids_worked_example():
    ids = attention.make_sequence_ids(jnp.array([[1, 1, 1, 1, 0]]), jnp.array([[1, 1, 2, 2, 0]]))
    np.testing.assert_array_equal(ids, [[1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(attention.make_sequence_ids(jnp.array([[1, 1, 0]])), [[1, 1, 0]])


@pytest.mark.parametrize("case", ["padding", "packing", "causal"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_splash_matches_einsum_on_real_tokens(case, dtype):
    input_mask, pack_ids, causal = masks(case)
    q, k, v = qkv(dtype)
    mask = attention.make_attention_mask(input_mask, pack_ids, causal)
    ids = attention.make_sequence_ids(input_mask, pack_ids)
    splash = jax.jit(functools.partial(attention._splash_attention, sequence_ids=ids, causal=causal,
                                       interpret=True))
    # The reference: float32 einsum on the same (for bfloat16, already rounded) inputs.
    einsum = jax.jit(lambda q, k, v: attention.attention(q, k, v, mask, impl="einsum"))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    got, got_grads = outputs_and_grads(splash, q, k, v, input_mask)
    want, want_grads = outputs_and_grads(einsum, *f32, input_mask)
    assert got.dtype == q.dtype and not np.isnan(np.asarray(got, np.float32)).any()
    real = np.asarray(input_mask, bool)  # [batch, length]
    # bfloat16: 8-bit mantissas in the scaled queries and the outputs (at most 0.008 seen here; the
    # einsum path itself in bfloat16 is off by up to 0.013 on these inputs).
    atol = 1e-5 if dtype == "float32" else 1.5e-2
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(want)[real], atol=atol, rtol=0)
    for name, a, b in zip("qkv", got_grads, want_grads):
        a, b = np.asarray(a, np.float32), np.asarray(b)
        scale = float(np.abs(b).max())
        tol = 1e-5 * max(1.0, scale) if dtype == "float32" else 1.5e-2 * scale  # 0.0064 seen
        # All rows: padding queries carry no cotangent and real queries never see padding keys.
        np.testing.assert_allclose(a, b, atol=tol, rtol=0, err_msg=f"d{name}")


def test_splash_under_shard_map_matches_one_device():
    mesh = sharding.create_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    input_mask, pack_ids, causal = masks("causal")
    ids = attention.make_sequence_ids(input_mask, pack_ids)
    q, k, v = qkv("float32")
    splash = functools.partial(attention._splash_attention, causal=causal, interpret=True)
    want, want_grads = outputs_and_grads(lambda q, k, v: splash(q, k, v, ids), q, k, v, input_mask)
    heads = NamedSharding(mesh, P(sharding.BATCH_AXES, None, "tensor", None))
    rows = NamedSharding(mesh, P(sharding.BATCH_AXES, None))
    step = jax.jit(lambda q, k, v, ids, m: outputs_and_grads(lambda q, k, v: splash(q, k, v, ids), q, k, v, m),
                   in_shardings=(heads, heads, heads, rows, rows))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        # q, k, v split over (data, fsdp) and tensor: each device runs the kernel on its own
        # examples and heads (XLA cannot partition a Mosaic kernel itself).
        assert attention._splash_shards(q) == P(sharding.BATCH_AXES, None, "tensor", None)
        assert "shard_map" in str(jax.make_jaxpr(step)(q, k, v, ids, input_mask))
        got, got_grads = step(q, k, v, ids, input_mask)
    assert got.sharding.is_equivalent_to(heads, got.ndim)  # and stays split
    for a, b in zip((got, *got_grads), (want, *want_grads)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_splash_is_not_used_where_it_cannot_run_per_shard():
    q = jax.ShapeDtypeStruct((BATCH, LENGTH, HEADS, HEAD_DIM), jnp.float32)
    assert attention._splash_shards(q) == P()  # no mesh: one device
    rules = dict(sharding.DEFAULT_RULES)
    with jax.set_mesh(sharding.create_mesh({"data": 2, "fsdp": 1, "tensor": 4})):
        with nn.logical_axis_rules(sharding.DEFAULT_RULES):
            assert attention._splash_shards(q) is None  # 2 heads over a tensor axis of 4
        with nn.logical_axis_rules(tuple({**rules, "activation_length": "data"}.items())):
            assert attention._splash_shards(q) is None  # a split sequence: keys on other devices


def test_dot_product_off_tpu_stays_xla_attention():
    """On CPU (and GPU) "dot_product" is what it was: the sequence ids are ignored, every row
    (padding queries included) equals the einsum path."""
    assert attention._target_platform() == "cpu"
    input_mask, pack_ids, causal = masks("causal")
    q, k, v = qkv("float32")
    assert not attention._splash_applies(q)
    mask = attention.make_attention_mask(input_mask, pack_ids, causal)
    got = attention.attention(q, k, v, mask, impl="dot_product", causal=causal,
                              sequence_ids=attention.make_sequence_ids(input_mask, pack_ids))
    np.testing.assert_allclose(got, attention.attention(q, k, v, mask, impl="einsum"), atol=1e-5, rtol=0)
    # The platform compiled for is the mesh's: a TPU mesh on a CPU host (ahead-of-time compiles).
    tpu = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("data",), abstract_device=tpu)):
        assert attention._target_platform() == "tpu"


def test_model_with_splash_matches_einsum(monkeypatch):
    """The sequence ids reach the kernel through the scanned encoder; packed rows with padding."""
    calls = interpreted_splash(monkeypatch)
    config = BertConfig(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=256, max_position_embeddings=LENGTH, scan_layers=True,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    input_mask, pack_ids, _ = masks("packing")
    input_ids = jnp.asarray(np.random.default_rng(2).integers(1, 128, size=(BATCH, LENGTH)), jnp.int32)
    inputs = dict(input_ids=input_ids * input_mask, input_mask=input_mask, pack_ids=pack_ids)
    params = jax.jit(lambda: BertModel(config).init(jax.random.key(0), **inputs)["params"])()
    run = lambda cfg: jax.jit(lambda p: BertModel(cfg).apply({"params": p}, **inputs).sequence_output)
    want = run(config)(params)
    got = run(config.replace(attention_impl="dot_product"))(params)
    assert calls and not any(c["causal"] for c in calls)  # the splash path ran, without the causal mask
    real = np.asarray(input_mask, bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-4, rtol=0)
