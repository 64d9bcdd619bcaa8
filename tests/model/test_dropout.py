"""Dropout: `keep_mask` draws jax.random.bernoulli's masks bit for bit in one fused pass, and `Dropout`
is flax's `nn.Dropout` (same rng, same masks). The model-level check, training outputs equal to those
with flax's dropout, is in tests/model/test_modeling.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.model import dropout


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 4, 16, 16), (2, 3, 1, 5)])
@pytest.mark.parametrize("keep_prob", [0.9, 0.5, 0.013])
def test_keep_mask_is_jax_bernoulli_bit_for_bit(shape, keep_prob):
    typed = jax.random.key(7)
    for rng in (typed, jax.random.key_data(typed), jax.random.key(2 ** 31 + 5)):
        ours = jax.jit(dropout.keep_mask, static_argnums=(1, 2))(rng, keep_prob, shape)
        assert ours.dtype == jnp.bool_ and ours.shape == shape
        np.testing.assert_array_equal(ours, jax.random.bernoulli(rng, keep_prob, shape))
    # Batched keys (vmap), as nn.scan and vmapped code hand them out.
    keys = jax.random.split(typed, 3)
    np.testing.assert_array_equal(
        jax.vmap(lambda k: dropout.keep_mask(k, keep_prob, shape))(keys),
        jax.vmap(lambda k: jax.random.bernoulli(k, keep_prob, shape))(keys))
    # Other generators are handed to jax.random itself.
    rbg = jax.random.key(3, impl="rbg")
    np.testing.assert_array_equal(dropout.keep_mask(rbg, keep_prob, shape),
                                  jax.random.bernoulli(rbg, keep_prob, shape))


def test_keep_mask_is_one_fused_pass_on_cpu_and_sharded_computes_its_shard_only():
    """JAX's own CPU lowering of the threefry hash is a loop of five passes over the array."""
    hlo = jax.jit(lambda k: dropout.keep_mask(k, 0.9, (64, 128))).lower(jax.random.key(0)).compile().as_text()
    assert "while" not in hlo
    # Over 8 devices, each computes its [2, 128] rows: no full-size counter is ever built.
    sharded = jax.sharding.NamedSharding(jax.make_mesh((8,), ("data",)), jax.sharding.PartitionSpec("data"))
    draw = jax.jit(lambda k: dropout.keep_mask(k, 0.9, (16, 128)), out_shardings=sharded)
    hlo = draw.lower(jax.random.key(0)).compile().as_text()
    assert "u32[2,128]" in hlo and "u32[16,128]" not in hlo
    mask = draw(jax.random.key(0))
    assert mask.sharding == sharded
    np.testing.assert_array_equal(mask, jax.random.bernoulli(jax.random.key(0), 0.9, (16, 128)))


def test_dropout_module_equals_flax_dropout():
    x = jax.random.normal(jax.random.key(0), (4, 6, 10), jnp.bfloat16)
    for rate, dims in [(0.1, ()), (0.5, (-2,)), (0.3, (0, 2)), (1.0, ()), (0.0, ())]:
        for deterministic in (False, True):
            rng = jax.random.key(11)
            ours = dropout.Dropout(rate, dims).apply({}, x, deterministic, rng=rng)
            flax = nn.Dropout(rate, dims).apply({}, x, deterministic, rng=rng)
            assert ours.dtype == flax.dtype
            np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(flax, np.float32))
            if not deterministic and 0.0 < rate < 1.0:
                zeros = float(np.mean(np.asarray(ours) == 0))
                assert 0.0 < zeros < 1.0

    # Inside a parent, through make_rng: both are auto-named Dropout_0, so both draw the same key.
    class Parent(nn.Module):
        dropout_cls: type

        @nn.compact
        def __call__(self, x):
            return self.dropout_cls(0.2)(x, deterministic=False)

    rngs = {"dropout": jax.random.key(4)}
    ours = Parent(dropout.Dropout).apply({}, x, rngs=rngs)
    np.testing.assert_array_equal(np.asarray(ours, np.float32),
                                  np.asarray(Parent(nn.Dropout).apply({}, x, rngs=rngs), np.float32))
    assert 0.1 < float(np.mean(np.asarray(ours) == 0)) < 0.3
