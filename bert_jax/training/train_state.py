"""The train state both loops carry, and the guarded optimizer update both steps end with.

`TrainState` holds the step, the parameters, the optimizer state, the raw RNG key data (so that
it checkpoints) and, with FP8, the scaling state. `apply_guarded_update` applies the optimizer's
update only when the loss and the gradient norm are finite: a non-finite step never touches the
parameters or the optimizer state (the pretraining and fine-tuning loops decide whether to stop).

This module must not import tensorflow.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from bert_jax.model.layers import FP8_COLLECTION

@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any
    opt_state: Any
    rng: jax.Array  # raw uint32 key data (checkpointable); per-step keys are fold_in(rng, step)
    # The FP8 scaling state (`BertConfig.fp8`: the model's `FP8_COLLECTION`), None without FP8.
    # Not trained: each step's backward pass returns its next value in place of a gradient.
    fp8: Any = None


def create_train_state(params: Any, tx: optax.GradientTransformation, rng: jax.Array,
                       fp8: Any = None) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
                      else rng, fp8=fp8)


def model_variables(params: Any, fp8: Any = None) -> dict:
    """The variables `model.apply` takes: the parameters, and the FP8 scaling state if any."""
    return {"params": params} if fp8 is None else {"params": params, FP8_COLLECTION: fp8}


def apply_guarded_update(state: TrainState, grads: Any, loss: jax.Array,
                         tx: optax.GradientTransformation) -> tuple[TrainState, dict]:
    """The optimizer update, applied only when the loss and the gradient norm are finite (else
    the parameters and optimizer state stay as they were; the step counter still advances).

    Returns the new state and `{"grad_norm", "finite"}` for the metrics. Shared by the
    pretraining and fine-tuning steps.
    """
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(params_and_opt_state):
        params, opt_state = params_and_opt_state
        # Clipping gets the norm computed above: inside the conditional XLA could not reuse it and
        # would read every gradient again (transforms without extra arguments ignore it).
        updates, new_opt_state = optax.with_extra_args_support(tx).update(
            grads, opt_state, params, global_norm=grad_norm)
        return optax.apply_updates(params, updates), new_opt_state

    # A conditional, not `jnp.where(finite, new, old)` over the state: selecting keeps the old
    # parameters and moments alive next to the new ones, so XLA copies them before updating in
    # place and reads both again (BERT-base's update on CPU: 358 against 239 ms with optax's
    # clipping, `benchmarks/step/optimizer.py`).
    new_params, new_opt_state = jax.lax.cond(finite, update, lambda operand: operand,
                                             (state.params, state.opt_state))
    new_state = state.replace(step=state.step + 1, params=new_params, opt_state=new_opt_state)
    return new_state, {"grad_norm": grad_norm, "finite": finite.astype(jnp.float32)}
