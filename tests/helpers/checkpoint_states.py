"""Small sharded states that the checkpointer tests save and restore, on the 8 fake CPU devices of
tests/conftest.py: tests/checkpoints/test_checkpointing.py (in-process) and
test_checkpoint_preemption.py (its worker processes and the tests that read what they saved)."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def device_mesh(data, fsdp):
    """A ('data', 'fsdp') mesh of the first data * fsdp devices."""
    return Mesh(np.array(jax.devices()[: data * fsdp]).reshape(data, fsdp), ("data", "fsdp"))


def small_state(value=0.0):
    """{"params": {"w": (8, 4), "b": (4,)}, "step": ()}, every element `value`, on an (8, 1) mesh."""
    sharding = NamedSharding(device_mesh(8, 1), P("data"))
    return {
        "params": {"w": jax.device_put(np.full((8, 4), value, np.float32), sharding),
                   "b": jax.device_put(np.full((4,), value, np.float32), sharding.update(spec=P()))},
        "step": jax.device_put(np.int32(value), sharding.update(spec=P())),
    }


def abstract_of(state):
    """ShapeDtypeStructs of `state`'s arrays, with their shardings: a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
