"""A tiny BERT with random parameters, a padded batch and a jitted forward pass: what
tests/model/test_modeling.py and test_modeling_options.py run the model on."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.model import modeling
from bert_jax.model.model_config import BertConfig
from bert_jax.model.pretraining_heads import BertForPreTraining


def tiny_config(**kw) -> BertConfig:
    # vocab 99 (not a multiple of 128: exercises the padded decoder), intermediate 37 (not 4H).
    base = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                intermediate_size=37, max_position_embeddings=40, type_vocab_size=2,
                hidden_act="gelu")
    base.update(kw)
    return BertConfig(**base)


def batch(length=12):
    """Two segments, padding, and one all-padding row."""
    rng = np.random.RandomState(0)
    ids = rng.randint(5, 99, size=(4, length)).astype(np.int32)
    mask = np.ones((4, length), np.int32)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    mask[3, :] = 0  # padding only
    seg = np.zeros((4, length), np.int32)
    seg[:, 5:] = 1
    ids = ids * mask
    positions = np.array([[1, 2, 6], [3, 4, 6], [1, 2, 0], [0, 0, 0]], np.int32)
    return dict(input_ids=jnp.asarray(ids), input_mask=jnp.asarray(mask), segment_ids=jnp.asarray(seg * mask),
                masked_lm_positions=jnp.asarray(positions))


def random_params(config, seed=0):
    """Init, then replace every leaf (biases and LayerNorm too) with random values."""
    params = nn.meta.unbox(BertForPreTraining(config).init(
        jax.random.key(seed), **modeling.dummy_inputs(config))["params"])
    paths, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(paths))
    leaves = [0.2 * jax.random.normal(k, x.shape, x.dtype) + (1.0 if path[-1].key == "scale" else 0.0)
              for k, (path, x) in zip(keys, paths)]
    return jax.tree_util.tree_unflatten(tree, leaves)


@functools.partial(jax.jit, static_argnums=0)
def ours(config, params, inputs):
    """The pretraining model's outputs, deterministic (no dropout)."""
    return BertForPreTraining(config).apply({"params": params}, **inputs, deterministic=True)
