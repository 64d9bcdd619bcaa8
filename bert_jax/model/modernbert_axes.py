"""ModernBERT's parameters' logical axis names (`bert_jax.model.modernbert`), in BERT's vocabulary.

`bert_jax.training.sharding.DEFAULT_RULES` maps the names onto the mesh as for BERT: "embed" over
fsdp, "heads", "mlp" and "vocab" over tensor. `with_logical_axes` boxes a parameter tree (of
`ModernBertForMaskedLM` or `ModernBertForTask`) with them, which the training paths do right after
`init` (`pretrain.model_family.ModernBertPreTraining.init`, the fine-tuning loop's state), so that
`sharding.sharded_init` and `sharding.logical_to_sharding` split its parameters and optimizer state.

Why after `init` and not at creation as BERT's modules do (`nn.with_logical_partitioning`): the modules'
`init` gives plain arrays, the tree transformers' weights convert to and from
(`bert_jax.formats.modernbert_hf`), which the parity tests and any caller index and read as arrays.
Names are looked up by the parameter's place in the tree; a parameter the table does not know is an
error naming its path, so a new one cannot go unsharded silently.

The two fused kernels are split over fsdp only ("embed"), not over tensor: `Wqkv`'s output is
`[3, heads, head_dim]` flattened, `Wi`'s `[2, intermediate]` (GeGLU's input and gate), so a contiguous
split of the flattened dimension would give one tensor rank whole blocks (all the queries, or all of
the gate) instead of its heads' queries, keys and values, or both halves of its share of the
intermediate features. Named "qkv" and "mlp_glu" (no mesh axis), they are replicated over tensor;
the model constrains their outputs by heads and by intermediate feature (`modernbert.Attention`,
`modernbert.MLP`), so each tensor rank multiplies only its own columns of the kernel (a local slice:
no transfer forward; the kernel's gradient is gathered over tensor). `Wo` (attention) takes
`[heads x head_dim]` in head-major order, so "heads" splits it along whole heads; the MLP's `Wo` takes
the intermediate features ("mlp") in the order the constrained GeGLU output has them.

This module must not import tensorflow.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

# (module, parameter) -> logical names of the parameter's dimensions. Kernels are [in, out].
_BY_NAME = {
    ("tok_embeddings", "embedding"): ("vocab", "embed"),
    ("Wqkv", "kernel"): ("embed", "qkv"),
    ("Wqkv", "bias"): ("qkv",),
    ("Wi", "kernel"): ("embed", "mlp_glu"),
    ("Wi", "bias"): ("mlp_glu",),
    # The prediction head's dense layer, as BERT's masked-LM transform (`pretraining_heads`).
    ("dense", "kernel"): ("embed", "mlp"),
    ("dense", "bias"): ("mlp",),
    ("classifier", "kernel"): ("embed", "classes"),
    ("classifier", "bias"): ("classes",),
}
# Wo is the attention's output projection or the MLP's: told apart by the module above it.
_WO = {"attn": {"kernel": ("heads", "embed"), "bias": ("embed",)},
       "mlp": {"kernel": ("mlp", "embed"), "bias": ("embed",)}}
_NORMS = ("embedding_norm", "attn_norm", "mlp_norm", "final_norm", "norm")


def axes_of(path: tuple) -> tuple:
    """The logical names of the parameter at `path` (its keys in the params tree, e.g.
    `("model", "layers_1", "attn", "Wqkv", "kernel")`); ValueError naming the path if unknown."""
    path = tuple(path)
    if path == ("decoder_bias",):
        return ("vocab",)
    if len(path) >= 2 and path[-2] in _NORMS and path[-1] in ("scale", "bias"):
        return ("embed",)
    if len(path) >= 3 and path[-2] == "Wo" and path[-3] in _WO and path[-1] in _WO[path[-3]]:
        return _WO[path[-3]][path[-1]]
    if len(path) >= 2 and path[-2:] in _BY_NAME:
        return _BY_NAME[path[-2:]]
    raise ValueError(f"ModernBERT parameter {'/'.join(path)} has no logical axis names "
                     "(bert_jax/model/modernbert_axes.py)")


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)


def logical_axes(params: Any) -> Any:
    """The tree of `params` with each array replaced by its logical names (`axes_of`)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: axes_of(_keys(path)), params)


def with_logical_axes(params: Any) -> Any:
    """`params` with every array boxed in `nn.LogicallyPartitioned` with its names (ValueError where
    a name's count is not the array's rank, naming the path)."""

    def box(path, x):
        keys = _keys(path)
        names = axes_of(keys)
        if len(names) != len(x.shape):
            raise ValueError(f"ModernBERT parameter {'/'.join(keys)} has shape {tuple(x.shape)} but logical "
                             f"names {names}")
        return nn.LogicallyPartitioned(x, names)

    return jax.tree_util.tree_map_with_path(box, params)
