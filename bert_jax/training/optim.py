"""Optimizers and learning-rate schedules for pretraining and fine-tuning, on optax.

- `learning_rate_schedule`: linear warmup, then linear or polynomial decay. `google_style=True`
  reproduces google-research/bert's `optimization.py` exactly: the decay runs from step 0 over
  all `num_train_steps` and warmup simply overrides it (so after warmup the rate is
  `peak * (1 - step / total) ** power`, not a fresh decay from the peak).
- `weight_decay_mask`: decay everything except LayerNorm parameters and biases (Google's
  `exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"]`; embeddings *are* decayed).
- `clip_by_global_norm`: TF's global-norm clipping as one scalar factor (faster than optax's
  select form on CPU; same values).
- `make_optimizer`: global-norm clipping (1.0) then AdamW, Google's AdamWeightDecay (no bias
  correction, epsilon 1e-6, decay 0.01), StableAdamW (`stable_adamw`) or LAMB.
- StableAdamW (Wortsman et al. 2023, Algorithm 2; ModernBERT's optimizer): optax's AdamW chain
  with each tensor's step (Adam's direction and the weight decay) divided by
  `max(1, RMS_t)`, `RMS_t = sqrt(mean(g_t^2 / max(v_t, eps^2)))` over the tensor, `v_t` the
  bias-corrected second moment after this step's update (the paper's Algorithm 2 updates `u_t`
  with bias-corrected betas, which is the bias-corrected moment, before taking the RMS):
  AdaFactor's update clipping, per tensor, in place of global-norm gradient clipping. A scanned
  encoder's leaves get one RMS per layer, as an unrolled one would.
- LAMB (You et al. 2019, as in the LAMB paper's BERT code and NVIDIA's): optax's `lamb` chain
  with the trust ratio replaced by `scale_by_layerwise_trust_ratio`, which (1) leaves LayerNorm
  parameters and biases at ratio 1, like weight decay (the LAMB authors' TF optimizer defaults
  `exclude_from_layer_adaptation` to `exclude_from_weight_decay`; NVIDIA's FusedLAMB skips the
  ratio where the decay is 0), and (2) takes one ratio per layer also when the encoder is scanned
  (`stacked_layers_mask`). optax.lamb applies one ratio to every leaf, a stacked one included.

Clipping note: original BERT clipped each replica's gradient before the cross-replica average;
we clip the averaged (global-batch) gradient, which does not depend on the number of devices.

Gradient accumulation lives in `bert_jax.pretrain.steps` (a scan over micro-batches inside one jitted
step, normalizing by the whole batch's weights) rather than `optax.MultiSteps`: MultiSteps averages
per-micro-batch means, which differs from the large batch's loss whenever micro-batches hold
different numbers of masked tokens.

This module must not import tensorflow.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

OPTIMIZERS = ("adamw", "google_adamw", "stableadamw", "lamb")
NO_DECAY_NAMES = ("bias", "scale", "output_bias", "decoder_bias")  # LayerNorm scale/bias, every bias
# Where `modeling.Encoder` puts the layers of `nn.scan` (`scan_layers=True`): `encoder/layers/...`,
# every leaf with a leading layer axis (`modeling.stack_layers`); unrolled, `encoder/layer_{i}/...`.
STACKED_LAYERS_PATH = ("encoder", "layers")


DECAY_SHAPES = ("polynomial", "1-sqrt")


class RateChange(NamedTuple):
    """A pretraining phase's own rate (`config.phases[i].learning_rate` / `.warmup_steps`)."""
    where: str  # the config's name for it, for errors: "config.phases[1]"
    start_step: int  # the phase's first step counts from here (its steps are start_step+1 ..)
    end_step: int
    learning_rate: Optional[float]  # None: the rate in force before the phase
    warmup_steps: int  # 0: the rate from the phase's first step; else a linear warmup from 0


def learning_rate_schedule(peak: float, warmup_steps: int, total_steps: int, *, power: float = 1.0,
                           end_value: float = 0.0, google_style: bool = False,
                           decay_steps: Optional[int] = None, decay_shape: str = "polynomial",
                           rate_changes: Sequence[RateChange] = ()) -> optax.Schedule:
    """Linear warmup from 0 to `peak`, then polynomial decay (power 1 = linear) to `end_value`.

    With `decay_steps` (`config.lr_decay_steps`), warmup-stable-decay: the rate holds at `peak`
    after warmup and decays only over the last `decay_steps` steps ("trapezoidal"/WSD, as
    ModernBERT trained: a run can be extended, or a checkpoint taken before the decay resumed with
    another length, without redoing its warmup). `decay_shape` "1-sqrt" decays as
    `peak * (1 - sqrt(t))` over the decay's fraction `t` (the shape Hägele et al. 2024 found best
    for WSD, and ModernBERT used); "polynomial" as `(1 - t) ** power`.

    `rate_changes` (the pretraining phases' own rates, `RateChange`): from each one's start the
    rate holds at its `learning_rate` (after a linear warmup from 0 over its `warmup_steps`), and
    the final decay starts from the last phase's rate: ModernBERT's 8e-4 at length 1,024, then
    3e-4 at 8,192, then the 1-sqrt decay. They need the decay to begin after the last change has
    warmed up (`decay_steps`: warmup-stable-decay) and the first warmup to end before the first
    change. Without them, the schedule is the one described above, unchanged.
    """
    if not peak >= 0:
        raise ValueError(f"config.learning_rate={peak} must not be negative")
    if peak == 0:
        logging.warning("config.learning_rate=0: the parameters will not change")
    if total_steps <= 0:
        raise ValueError(f"config.num_train_steps must be positive, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"config.warmup_steps={warmup_steps} must be in [0, num_train_steps={total_steps}]")
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(f"config.lr_decay_shape={decay_shape!r}: one of {', '.join(DECAY_SHAPES)}")
    if google_style and (decay_steps is not None or decay_shape != "polynomial"):
        raise ValueError("config.lr_decay_steps / config.lr_decay_shape and config.google_lr_schedule=True do not "
                         "go together: Google's decay is polynomial over every step")
    if decay_steps is not None:
        if not 0 < decay_steps <= total_steps - warmup_steps:
            raise ValueError(f"config.lr_decay_steps={decay_steps} must be in [1, num_train_steps - warmup_steps = "
                             f"{total_steps - warmup_steps}]")
    if rate_changes:
        return _phased_schedule(peak, warmup_steps, total_steps, rate_changes, google_style=google_style,
                                decay_steps=decay_steps, decay_shape=decay_shape, power=power, end_value=end_value)
    if decay_steps is None and decay_shape != "polynomial":
        decay_steps = max(total_steps - warmup_steps, 1)  # no stable phase: the decay begins after warmup
    if google_style:
        decay = optax.polynomial_schedule(peak, end_value, power, total_steps)

        def schedule(step):
            step = jnp.asarray(step, jnp.float32)
            warm = peak * step / max(warmup_steps, 1)
            return jnp.where(step < warmup_steps, warm, decay(step))

        return schedule
    warmup = optax.linear_schedule(0.0, peak, warmup_steps)
    if decay_steps is None:
        decay = optax.polynomial_schedule(peak, end_value, power, max(total_steps - warmup_steps, 1))
        return optax.join_schedules([warmup, decay], [warmup_steps])
    stable_end = max(total_steps - decay_steps, warmup_steps)
    wsd_decay = _decay(peak, end_value, decay_steps, decay_shape, power)
    return optax.join_schedules([warmup, optax.constant_schedule(peak), wsd_decay], [warmup_steps, stable_end])


def _phased_schedule(peak: float, warmup_steps: int, total_steps: int, changes: Sequence[RateChange], *,
                     google_style: bool, decay_steps: Optional[int], decay_shape: str, power: float,
                     end_value: float) -> optax.Schedule:
    """`learning_rate_schedule` with `rate_changes`: warmup, the peak, then each change's (warmup and)
    constant rate, then the decay from the last rate, joined by `optax.join_schedules`."""
    first = changes[0]
    if google_style:
        raise ValueError(f"{first.where}.learning_rate / .warmup_steps and config.google_lr_schedule=True do not "
                         "go together: Google's decay runs over every step")
    schedules = [optax.linear_schedule(0.0, peak, warmup_steps), optax.constant_schedule(peak)]
    boundaries = [warmup_steps]
    rate, held_from = peak, warmup_steps
    for change in changes:
        if change.start_step < held_from:
            raise ValueError(f"{change.where} starts at step {change.start_step}, before the rate before it holds "
                             f"(step {held_from}: config.warmup_steps={warmup_steps} or an earlier phase's "
                             f"warmup_steps); its learning_rate / warmup_steps need the warmup over")
        if change.learning_rate is not None:
            if not change.learning_rate >= 0:
                raise ValueError(f"{change.where}.learning_rate={change.learning_rate} must not be negative")
            rate = float(change.learning_rate)
        if not 0 <= change.warmup_steps <= change.end_step - change.start_step:
            raise ValueError(f"{change.where}.warmup_steps={change.warmup_steps} must be in [0, the phase's "
                             f"{change.end_step - change.start_step} steps]")
        if change.warmup_steps:
            schedules.append(optax.linear_schedule(0.0, rate, change.warmup_steps))
            boundaries.append(change.start_step)
        schedules.append(optax.constant_schedule(rate))
        held_from = change.start_step + change.warmup_steps
        boundaries.append(held_from)
    if decay_steps is None:
        decay_steps, how = max(total_steps - warmup_steps, 1), "config.lr_decay_steps is not set: after the warmup"
    else:
        how = f"config.num_train_steps={total_steps} - config.lr_decay_steps={decay_steps}"
    decay_start = total_steps - decay_steps
    if decay_start < held_from:
        raise ValueError(f"the decay begins at step {decay_start} ({how}), before {changes[-1].where}'s rate holds "
                         f"(step {held_from}): with per-phase rates, set config.lr_decay_steps to at most "
                         f"{total_steps - held_from} (warmup-stable-decay)")
    schedules.append(_decay(rate, end_value, decay_steps, decay_shape, power))
    boundaries.append(decay_start)
    return optax.join_schedules(schedules, boundaries)


def _decay(start_value: float, end_value: float, decay_steps: int, shape: str, power: float) -> optax.Schedule:
    """From `start_value` to `end_value` over `decay_steps`: 1-sqrt or polynomial (`learning_rate_schedule`)."""

    def decay(count):  # `count`: steps since the decay began
        t = jnp.clip(jnp.asarray(count, jnp.float32) / decay_steps, 0.0, 1.0)
        fraction = 1.0 - jnp.sqrt(t) if shape == "1-sqrt" else (1.0 - t) ** power
        return end_value + (start_value - end_value) * fraction

    return decay


def _names(path) -> tuple[str, ...]:
    """The dict keys of a pytree path (attribute keys such as a flax box's `.value` dropped)."""
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def weight_decay_mask(params: Any) -> Any:
    """True for parameters that get weight decay (kernels and embeddings)."""

    def keep(path, _):
        names = _names(path)
        return not names or names[-1] not in NO_DECAY_NAMES

    return jax.tree_util.tree_map_with_path(keep, params)


def _is_stacked(names: tuple[str, ...]) -> bool:
    n = len(STACKED_LAYERS_PATH)
    return any(names[i:i + n] == STACKED_LAYERS_PATH for i in range(len(names) - n + 1))


def stacked_layers_mask(params: Any) -> Any:
    """True for leaves of scanned encoder layers (leading axis = layer), by their path
    `.../encoder/layers/...` (`STACKED_LAYERS_PATH`); works for a model, a pretraining or a
    fine-tuning tree."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _is_stacked(_names(path)), params)


class ScaleByAdamNoBiasCorrectionState(NamedTuple):
    mu: Any
    nu: Any


def scale_by_adam_without_bias_correction(b1: float = 0.9, b2: float = 0.999,
                                          eps: float = 1e-6) -> optax.GradientTransformation:
    """Adam's direction without bias correction, as Google's `AdamWeightDecayOptimizer` computes it.

    optax's `scale_by_adam` always bias-corrects; this is the one piece optax does not offer.
    """

    def init(params):
        zeros = lambda p: jnp.zeros_like(p, dtype=jnp.float32)
        return ScaleByAdamNoBiasCorrectionState(jax.tree_util.tree_map(zeros, params),
                                                jax.tree_util.tree_map(zeros, params))

    def update(updates, state, params=None):
        del params
        mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
        out = jax.tree_util.tree_map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return out, ScaleByAdamNoBiasCorrectionState(mu, nu)

    return optax.GradientTransformation(init, update)


def scale_by_layerwise_trust_ratio(mask: Any = weight_decay_mask) -> optax.GradientTransformation:
    """LAMB's trust ratio `||w|| / ||update||` (1 where either norm is 0), one per layer.

    `optax.scale_by_trust_ratio` per leaf, except that:
    - leaves where `mask(params)` is False (LayerNorm parameters and biases, by default the weight
      decay mask) are left unscaled, i.e. ratio 1, as in the LAMB paper's BERT code and NVIDIA's;
    - leaves of scanned layers (`stacked_layers_mask`) get one ratio per slice of their leading
      layer axis (norms over the other axes), so a scanned encoder trains like an unrolled one
      rather than sharing one norm across all its layers.

    Stateless (`EmptyState`, as optax's), so the optimizer state has optax.lamb's structure.
    """
    per_leaf = optax.scale_by_trust_ratio()

    def ratio(update, param):
        return per_leaf.update(update, optax.EmptyState(), param)[0]

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_layerwise_trust_ratio needs the parameters")

        def scale(path, u, p, adapt):
            if not adapt:
                return u
            return jax.vmap(ratio)(u, p) if _is_stacked(_names(path)) else ratio(u, p)

        adapt = mask(params) if callable(mask) else mask
        return jax.tree_util.tree_map_with_path(scale, updates, params, adapt), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def stable_adamw(schedule: optax.Schedule, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
                 weight_decay: float = 0.01, mask: Any = weight_decay_mask) -> optax.GradientTransformation:
    """StableAdamW (Wortsman et al. 2023, Algorithm 2): AdamW whose step for each tensor is divided
    by `max(1, RMS_t)`, `RMS_t = sqrt(mean(g_t**2 / max(v_t, eps**2)))`.

    `v_t` is the bias-corrected second moment including this step's gradient, the one Adam's
    direction divides by; the factor scales the whole step, weight decay included, as the paper's
    `eta_t = alpha_t / max(1, RMS_t)` does. RMS_t is 1 when `g_t**2` equals its running average,
    and grows when a tensor's gradient jumps above what its second moment has seen: that step
    shrinks. The leaves of scanned layers (`stacked_layers_mask`) get one factor per layer.

    The chain and its state are `optax.adamw`'s (`ScaleByAdamState`, the masked decay, the learning
    rate): the clipping reads Adam's new second moment from that state and keeps none of its own
    (no extra memory; the state's tree is adamw's).
    """
    adamw = optax.chain(
        optax.scale_by_adam(b1, b2, eps),
        optax.add_decayed_weights(weight_decay, mask=mask),
        optax.scale_by_learning_rate(schedule),
    )

    def factor(path, grad, nu_hat):
        ratio = jnp.square(grad.astype(jnp.float32)) / jnp.maximum(nu_hat.astype(jnp.float32), eps * eps)
        # One RMS per tensor; per layer for a scanned leaf [layers, ...].
        axes = tuple(range(1, ratio.ndim)) if _is_stacked(_names(path)) else None
        rms = jnp.sqrt(jnp.mean(ratio, axis=axes, keepdims=axes is not None))
        return 1.0 / jnp.maximum(1.0, rms)

    def update(updates, state, params=None):
        steps, new_state = adamw.update(updates, state, params)
        adam_state = new_state[0]  # optax.ScaleByAdamState: count already counts this step
        nu_hat = optax.tree.bias_correction(adam_state.nu, b2, adam_state.count)
        factors = jax.tree_util.tree_map_with_path(factor, updates, nu_hat)
        steps = jax.tree_util.tree_map(lambda u, f: u * f.astype(u.dtype), steps, factors)
        return steps, new_state

    return optax.GradientTransformation(adamw.init, update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scales the updates by `max_norm / max(global_norm, max_norm)`: TF's `clip_by_global_norm`.

    The same clipping as `optax.clip_by_global_norm`, written as one scalar factor instead of
    optax's `select(norm < max_norm, g, g / norm * max_norm)`. XLA does not repeat the division in
    the three fusions that read the clipped gradient (Adam's two moments and the parameter update),
    so optax's form writes `g / norm` out as a full-size array and reads both it and `g` again; a
    scalar factor fuses into those consumers. For BERT-base's AdamW update on CPU this halves the
    optimizer's time (239 -> 126 ms, benchmarks/step/RESULTS.md). Below the threshold the factor is
    exactly 1 (x / x), so the gradients pass unchanged, as with optax; above it the result equals
    optax's to rounding. optax's source keeps this form, marked as the faster one, commented out
    until its effect on differentiating through the update (meta-gradients) is analyzed; a
    training loop does not differentiate through its optimizer. The state is optax's
    `EmptyState`, so checkpoints written with optax's transform restore unchanged.

    A caller that has already computed the updates' global norm passes it as the extra argument
    `global_norm` (`optax.chain` forwards extra arguments; the other transforms ignore it):
    `steps.apply_guarded_update` needs the norm outside its conditional, and XLA does not share
    one computation across the conditional's boundary, so it would otherwise read every gradient
    twice.
    """

    def update(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if global_norm is None else global_norm
        scale = max_norm / jnp.maximum(norm, max_norm)
        return jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def make_optimizer(name: str, schedule: optax.Schedule, *, weight_decay: float = 0.01,
                   b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
                   clip_norm: float | None = 1.0) -> optax.GradientTransformation:
    """Clipping + the named optimizer, with weight decay masked off LayerNorm and biases.

    Args:
      name: "adamw" (optax.adamw, bias-corrected), "google_adamw" (Google's AdamWeightDecay:
        no bias correction, decoupled decay added before the learning rate), "stableadamw"
        (`stable_adamw`: AdamW with per-tensor update clipping; ModernBERT's), or "lamb"
        (bias-corrected Adam direction plus decay, times the layer-wise trust ratio of
        `scale_by_layerwise_trust_ratio`; LayerNorm parameters and biases get neither).
      schedule: learning-rate schedule.
      clip_norm: global-norm clipping threshold; None disables it (StableAdamW clips its
        updates itself and needs none; ModernBERT trained it without).
    """
    if name == "adamw":
        opt = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                          mask=weight_decay_mask)
    elif name == "google_adamw":
        opt = optax.chain(
            scale_by_adam_without_bias_correction(b1, b2, eps),
            optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
            optax.scale_by_learning_rate(schedule),
        )
    elif name == "stableadamw":
        opt = stable_adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    elif name == "lamb":
        # optax.lamb's chain (same state), with the trust ratio masked and per layer.
        opt = optax.chain(
            optax.scale_by_adam(b1, b2, eps),
            optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
            scale_by_layerwise_trust_ratio(weight_decay_mask),
            optax.scale_by_learning_rate(schedule),
        )
    else:
        raise ValueError(f"config.optimizer must be one of {OPTIMIZERS}, got {name!r}")
    if clip_norm is not None and clip_norm > 0:
        opt = optax.chain(clip_by_global_norm(clip_norm), opt)
    return opt
