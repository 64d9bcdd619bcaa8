"""Dropout whose masks are `jax.random.bernoulli`'s, bit for bit, drawn in one fused pass.

This module owns `keep_mask` (the Bernoulli keep mask of a threefry key, unrolled), `dropout` (inverted
dropout on an array, used on the attention probabilities) and `Dropout` (`flax.linen.Dropout` with the
same fields, rng stream and masks, used on the hidden states).

Why: jax.random.bernoulli with a threefry key lowers on CPU to a loop of five rounds over the whole
array (JAX's CPU lowering of the threefry hash is "rolled" to keep compile time down), so XLA
cannot fuse the hash with the mask: dropout's random bits took ~10 ns per element, ~0.4 s of a
BERT-base training step (batch 8, length 128) on a 2-core CPU. `keep_mask` computes the same
hash unrolled, as elementwise ops that XLA fuses into one pass (8x faster on CPU; GPU and TPU
already lower it unrolled), and returns exactly jax.random.bernoulli's mask: the same bits, the
same float comparison, so training is unchanged bit for bit.

This module must not import tensorflow.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011).
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = 0x1BD11BDA


def _threefry2x32(k0: Array, k1: Array, x0: Array, x1: Array) -> tuple[Array, Array]:
    """The Threefry-2x32 block function, unrolled: keys `k0, k1` (uint32 scalars) and counters."""
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(_THREEFRY_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r)))
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _threefry_key_data(rng: Array) -> Optional[Array]:
    """`rng`'s uint32[2] data when it is a single threefry key (typed, or raw under the default
    threefry implementation) and JAX draws its bits the partitionable way; None otherwise."""
    if jax.config.jax_enable_x64 or not jax.config.jax_threefry_partitionable:
        return None
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape != () or str(jax.random.key_impl(rng)) != "threefry2x32":
            return None
        return jax.random.key_data(rng)
    if jax.config.jax_default_prng_impl != "threefry2x32" or rng.shape != (2,) or rng.dtype != jnp.uint32:
        return None
    return rng


def threefry_key(rng: Array, size: int) -> Optional[Array]:
    """`rng`'s uint32[2] key data when `keep_mask(rng, p, shape)` of `size` elements is the hash of
    each element's row-major index (`keep_from_index`); None when it goes to jax.random.bernoulli."""
    key = _threefry_key_data(rng)
    return None if key is None or size >= 2 ** 32 else key


def keep_from_index(k0: Array, k1: Array, index: Array, keep_prob: float) -> Array:
    """The keep mask's value at the row-major element indices `index` (uint32) under the threefry
    key `k0, k1`: jax.random.bernoulli's, bit for bit (`keep_mask`). Plain elementwise integer and
    float ops, so a kernel can compute its own block's part (`bert_jax.model.kernels.fused`)."""
    hi, lo = _threefry2x32(k0, k1, np.uint32(0), index)
    bits = hi ^ lo
    # jax.random.uniform's float32 in [0, 1): 23 random mantissa bits under the exponent of 1.0.
    one = np.array(1.0, np.float32).view(np.uint32)
    uniform = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | one, jnp.float32) - np.float32(1.0)
    return uniform < np.float32(keep_prob)


def keep_mask(rng: Array, keep_prob: float, shape: tuple) -> Array:
    """`jax.random.bernoulli(rng, keep_prob, shape)`, bit for bit, in one fused pass.

    For a threefry key (JAX's default), with JAX's partitionable bit layout (its default, and set
    by our training loops), the bits of element i are the hash of the 64-bit counter i; the
    counter is built from broadcast iotas, so a sharded mask is computed shard by shard. Other
    keys (`rbg`, `unsafe_rbg`), 64-bit mode and arrays of 2**32 elements or more go to
    `jax.random.bernoulli` itself.
    """
    key = threefry_key(rng, int(np.prod(shape)))
    if key is None:
        return jax.random.bernoulli(rng, keep_prob, shape)
    # The row-major index of every element (the counter's low word; its high word is 0).
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride)
        stride *= shape[dim]
    return keep_from_index(key[0], key[1], index, keep_prob)


def dropout(x: Array, rate: float, rng: Array, broadcast_dims: tuple = ()) -> Array:
    """Inverted dropout: zero each element with probability `rate`, scale the rest by 1/(1-rate);
    one mask value is shared along `broadcast_dims` (as in `flax.linen.Dropout`)."""
    if rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep_prob = 1.0 - rate
    dims = {d % x.ndim for d in broadcast_dims}
    shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape))
    keep = jnp.broadcast_to(keep_mask(rng, keep_prob, shape), x.shape)
    return jax.lax.select(keep, x / keep_prob, jnp.zeros_like(x))


class Dropout(nn.Dropout):
    """`flax.linen.Dropout` (same fields, same "dropout" rng, same masks) with `keep_mask`."""

    @nn.compact
    def __call__(self, inputs: Array, deterministic: Optional[bool] = None,
                 rng: Optional[Array] = None) -> Array:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if self.rate == 0.0 or deterministic:
            return inputs
        if rng is None and self.rate != 1.0:
            rng = self.make_rng(self.rng_collection)
        return dropout(inputs, self.rate, rng, self.broadcast_dims)
