"""The Pallas kernels on a mesh of several devices: each device runs them on its own rows.

XLA cannot split a Triton (or Mosaic) call over a mesh: it gathers every operand to every device
and runs the whole call on each. The kernels of `bert_jax.model.kernels.fused`, `fused_ffn` and
`fused_qkv` all work on `[rows, features]` activations whose rows are examples' positions, split
over the activations' batch axes like the examples; so on the mesh of `jax.set_mesh` they run
under `jax.shard_map` (`per_shard`), each device on its own rows. Weights go in whole (under FSDP
XLA gathers them first, as for any layer; a tensor-parallel split of them is gathered too), row
results come back split as the rows, and a result summed over the rows (a weight's gradient) is
summed over the devices. `tests/model/test_fused_per_shard.py` compares each kernel on a mesh with
one device's.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# The logical names of the kernels' `[batch x length, hidden]` rows (as `layers`' ACT_EMBED names
# the activations they come from).
_ROW_NAMES = ("activation_batch", "activation_length", "activation_embed")


def row_axes(rows: int, multiple: int = 1) -> Optional[tuple]:
    """The mesh axes `rows` split over, each device running a kernel on its own `rows / devices`
    (a multiple of `multiple`: a GEMM kernel's smallest tile): the activations' batch axes on the
    mesh of `jax.set_mesh` (from the logical axis rules, as the model constrains its activations).
    None: no mesh, or no batch axis on it (or one of one device), or rows that do not split so, or
    the sequence or hidden axis split (a row's LayerNorm needs the whole row); the kernel then runs
    as one call (on several devices, one whose operands XLA gathers to every device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    batch, length, hidden = nn.logical_to_mesh_axes(_ROW_NAMES)
    if length is not None or hidden is not None or batch is None:
        return None
    axes = (batch,) if isinstance(batch, str) else tuple(batch)
    if any(a not in mesh.axis_names for a in axes):
        return None
    devices = math.prod(mesh.shape[a] for a in axes)
    if devices == 1 or rows % (devices * multiple):  # one device's program as it was, without the shard_map
        return None
    return axes


def per_shard(call: Callable, args: tuple, row_args: tuple, *, summed: bool = False, multiple: int = 1,
              first_row: bool = False):
    """`call(*args)` where `args` (None: absent) at `row_args` are `[rows, ...]` arrays and the rest
    are taken whole. On a mesh (`row_axes`), under `jax.shard_map`: each device calls it on its own
    rows, and its results come back split by their first axis as the rows are, or, `summed` (sums
    over the rows: a weight's gradient), summed over the devices. With `first_row`, `call` also
    takes `first_row=`: the index of the device's first row in the whole array (a uint32; 0 on one
    device), for kernels that number the elements (dropout's mask)."""
    def run(local, first):
        return call(*local, first_row=first) if first_row else call(*local)

    axes = row_axes(args[0].shape[0], multiple)
    if axes is None:
        return run(args, jnp.zeros((), jnp.uint32))
    present = [i for i, a in enumerate(args) if a is not None]

    def body(*shards):
        local = list(args)
        for i, a in zip(present, shards):
            local[i] = a
        out = run(local, jax.lax.axis_index(axes).astype(jnp.uint32) * np.uint32(local[0].shape[0]))
        return jax.tree.map(lambda o: jax.lax.psum(o, axes), out) if summed else out

    spec = jax.sharding.PartitionSpec
    # check_vma=False: pallas_call does not declare how its results vary over the mesh; each is
    # per shard (or summed), as out_specs says.
    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=tuple(spec(axes) if i in row_args else spec() for i in present),
                         out_specs=spec() if summed else spec(axes), check_vma=False)(*(args[i] for i in present))
