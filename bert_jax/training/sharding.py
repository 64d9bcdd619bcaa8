"""Device mesh, logical-axis rules, sharded initialization and host-to-global batches.

The mesh has at most three axes: `data` (pure data parallelism), `fsdp` (data parallelism with
parameters and optimizer state sharded along the embedding dimension) and `tensor` (Megatron-style
tensor parallelism over heads, the feed-forward and the vocabulary). Parameters carry logical axis
names (`bert_jax.model.modeling`; ModernBERT's `bert_jax.model.modernbert_axes`); `DEFAULT_RULES` maps
them onto mesh axes. Multi-slice TPU jobs add DCN (between-slice) sizes for the same three axes.

Never materialize before sharding: `sharded_init` runs `jax.eval_shape`, derives shardings from
the logical names, then jits the initializer with those `out_shardings`, so no device ever holds a
whole unsharded copy of the parameters.

This module must not import tensorflow.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical axis -> mesh axis (t5x style). Anything not listed is replicated.
DEFAULT_RULES = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("length", None),
    ("layers", None),
    ("position", None),
    ("type_vocab", None),
    ("classes", None),
    # ModernBERT's fused kernels' outputs (`bert_jax.model.modernbert_axes`): not split over tensor.
    ("qkv", None),
    ("mlp_glu", None),
    # Activations: batch over the data-parallel axes, heads and feed-forward over tensor.
    ("activation_batch", BATCH_AXES),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
)


# ---------------------------------------------------------------------------------------------
# Mesh
# ---------------------------------------------------------------------------------------------


def resolve_axis_sizes(sizes: dict, num_devices: int, field: str = "config.mesh") -> dict:
    """Fills in one `-1` so that the product of the axis sizes is `num_devices`.

    Raises a ValueError naming the config field when the sizes cannot work.
    """
    sizes = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
    unknown = [a for a, s in sizes.items() if s == -1]
    if len(unknown) > 1:
        raise ValueError(f"{field}: at most one axis may be -1, got {sizes}")
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ValueError(f"{field}.{a} must be a positive size or -1, got {s}")
    known = int(np.prod([s for s in sizes.values() if s != -1]))
    if unknown:
        if num_devices % known:
            raise ValueError(f"{field}: {num_devices} devices cannot be split into {sizes}")
        sizes[unknown[0]] = num_devices // known
    if int(np.prod(list(sizes.values()))) != num_devices:
        raise ValueError(f"{field}: the product of {sizes} must equal the number of devices "
                         f"({num_devices}); set one axis to -1 to fill in")
    return sizes


def create_mesh(ici: dict, dcn: Optional[dict] = None, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """Builds the (data, fsdp, tensor) mesh.

    Args:
      ici: per-slice axis sizes, e.g. `{"data": -1, "fsdp": 1, "tensor": 1}`.
      dcn: between-slice (multi-slice) sizes; `None` or all ones for a single slice.
      devices: defaults to all devices of all processes.
    """
    devices = list(jax.devices() if devices is None else devices)
    dcn = {a: int((dcn or {}).get(a, 1)) for a in MESH_AXES}
    num_slices = int(np.prod(list(dcn.values())))
    if len(devices) % num_slices:
        raise ValueError(f"config.dcn_mesh: {len(devices)} devices cannot form {num_slices} slices")
    ici = resolve_axis_sizes(ici, len(devices) // num_slices, "config.mesh")
    ici_shape = [ici[a] for a in MESH_AXES]
    if num_slices > 1:
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici_shape, [dcn[a] for a in MESH_AXES], devices=devices)
    else:
        try:
            device_array = mesh_utils.create_device_mesh(ici_shape, devices=devices)
        except (AssertionError, NotImplementedError, ValueError):
            # Topology-aware placement is only known for TPUs/GPUs; elsewhere keep device order.
            device_array = np.asarray(devices).reshape(ici_shape)
    return Mesh(device_array, MESH_AXES)


def axis_size(mesh: Mesh, axes) -> int:
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return int(np.prod([mesh.shape[a] for a in axes]))


def check_divisibility(mesh: Mesh, *, global_batch_size: int, num_attention_heads: int,
                       intermediate_size: int, hidden_size: int,
                       batch_field: str = "config.global_batch_size") -> None:
    """Checks, before anything compiles, that the batch and the model split over the mesh."""
    batch_shards = axis_size(mesh, BATCH_AXES)
    if global_batch_size % batch_shards:
        raise ValueError(
            f"{batch_field}={global_batch_size} must be divisible by the data-parallel size "
            f"data*fsdp={batch_shards} (mesh {dict(mesh.shape)})")
    if global_batch_size % jax.process_count():
        raise ValueError(f"{batch_field}={global_batch_size} must be divisible by the number of "
                         f"processes ({jax.process_count()})")
    tensor = mesh.shape["tensor"]
    for field, value in (("config.model.num_attention_heads", num_attention_heads),
                         ("config.model.intermediate_size", intermediate_size)):
        if value % tensor:
            raise ValueError(f"{field}={value} must be divisible by the tensor-parallel size "
                             f"config.mesh.tensor={tensor}")
    if hidden_size % mesh.shape["fsdp"]:
        raise ValueError(f"config.model.hidden_size={hidden_size} must be divisible by "
                         f"config.mesh.fsdp={mesh.shape['fsdp']}")


# ---------------------------------------------------------------------------------------------
# Parameter shardings
# ---------------------------------------------------------------------------------------------


def logical_to_sharding(abstract_boxed: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """NamedShardings for a tree of (boxed) abstract values with logical axis names.

    A dimension whose size does not divide by its mesh axes is replicated instead (with a log
    line), e.g. the 30,522-row vocabulary on a tensor axis of 4.
    """
    specs = nn.get_partition_spec(abstract_boxed)
    mesh_specs = nn.logical_to_mesh(specs, rules)
    shapes = nn.meta.unbox(abstract_boxed)

    def fix(spec, shape):
        if shape is None:  # an empty field (e.g. TrainState.fp8 without FP8) stays empty
            return None
        if not isinstance(spec, P):
            return NamedSharding(mesh, P())
        dims = list(spec) + [None] * (len(shape.shape) - len(spec))
        for i, (axes, size) in enumerate(zip(dims, shape.shape)):
            if axes is not None and size % axis_size(mesh, axes):
                logging.info("replicating a dimension of size %d: not divisible by mesh axes %s",
                             size, axes)
                dims[i] = None
        return NamedSharding(mesh, P(*dims))

    return jax.tree_util.tree_map(fix, mesh_specs, shapes,
                                  is_leaf=lambda x: isinstance(x, P) or x is None)


def sharded_init(init_fn: Callable[[jax.Array], Any], rng: jax.Array, mesh: Mesh,
                 rules=DEFAULT_RULES) -> tuple[Any, Any]:
    """Initializes directly into shards: eval_shape -> shardings -> jit(init, out_shardings).

    Args:
      init_fn: `rng -> tree` of (boxed, logically named) values, e.g. a model's `init` plus
        the optimizer's `init`.
    Returns:
      (unboxed values placed on the mesh, their NamedShardings)
    """
    abstract = jax.eval_shape(init_fn, rng)
    shardings = logical_to_sharding(abstract, mesh, rules)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        values = jax.jit(lambda r: nn.meta.unbox(init_fn(r)), out_shardings=shardings)(rng)
    return values, shardings


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    """`jax.ShapeDtypeStruct`s carrying shardings: the restore target for checkpoints."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def place(tree: Any, shardings: Any) -> Any:
    """Host numpy values that every process holds in full -> global arrays with `shardings`.

    Each device takes its slice from the local copy (`make_array_from_callback`), which is right
    on one host and on many (`jax.device_put` would need the value to be addressable everywhere).
    """
    return jax.tree_util.tree_map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx, x=x: np.asarray(x)[idx]),
        tree, shardings)


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The batch dimension over (data, fsdp); everything else replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def to_global(batch: dict, mesh: Mesh) -> dict:
    """Host-local numpy batch -> global jax arrays sharded over the batch axes.

    Every process passes its own rows; the global batch is their concatenation in process order.
    Never `jnp.asarray(batch)` in a multi-host loop: each host would claim to hold the whole batch.
    """
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}
