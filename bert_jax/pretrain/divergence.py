"""Loss divergence: the spike rule, its statistic, the decision, and the error that ends a run.

A non-finite step is skipped or stops the run (`config.nonfinite`), but a *finite* loss spike (the
classic failure of large-batch BERT with LAMB) would train on. `DivergenceMonitor` is fed every
step's loss, in step order, and says when the run has diverged; the loop then stops
(`config.on_divergence="stop"`: `DivergenceError`, exit code 81) or rolls back to a checkpoint
before the spike and skips the batches around it ("rollback": `bert_jax.pretrain.rollback`).

The rule (config fields in parentheses, defaults in configs/base.py):

- the statistic is `mean`, an exponential moving average of the earlier finite, non-spike losses
  (decay `divergence_ema_decay`, 0.99); the first such loss starts it;
- once `divergence_warmup_steps` (100) finite non-spike steps have been fed, a step is a *spike
  step* when `loss > mean * (1 + divergence_margin)` (0.5: half again the recent loss); a spike's
  loss is not fed to the mean, so a spike cannot raise the bar it is judged by;
- a non-finite step (`nonfinite="skip"`; under "stop" it ends the run first) counts as a spike step;
- a *divergence* is `divergence_steps` (K, 3) spike steps in a row; any other step breaks the run of them.
  The first spike step is then F = X - K + 1, X the step that completed the run of K.

Floats and counts only, in Python (float64) on every host, from the loss that every host fetches
alike: the hosts decide the same, and a resumed run decides as an uninterrupted one would, since
the monitor's state (`state()`, a small JSON dict) is saved with every checkpoint (meta key
`META_KEY`) and restored with it. The loop feeds every step up to a saved step before the save.

`config.skip_batches` ("C:S,C2:S2": after step C, read and discard S batches) is parsed here too:
the manual form of a rollback's skip (`rollback.SkippedBatches`).

Tests plant a spike through `DivergenceMonitor.observe(self, step, loss, finite)`: tests/helpers/fault_hooks.py's
`SPIKE_AT_STEPS` wraps that method and multiplies `loss`, so keep its name and arguments.
Nothing here imports jax (that hook loads this module at interpreter start).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

# The modes of `config.on_divergence`.
ON_DIVERGENCE = ("off", "stop", "rollback")
# The checkpoint meta key of the monitor's state.
META_KEY = "divergence"


class DivergenceError(RuntimeError):
    """The loss diverged and the run stops: `on_divergence="stop"`, a rollback that cannot be made
    (no checkpoint before the spike in this phase), or the rollback budget spent. Exit code 81
    (`bert_jax.exit_codes.DIVERGED`): the same command would diverge again."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """The divergence fields of a pretraining config, checked (`settings_from`)."""

    action: str  # "stop" | "rollback"
    ema_decay: float
    margin: float
    warmup_steps: int
    steps: int  # K
    rollback_skip_batches: int  # S; 0: as many as the rolled-back steps read
    max_rollbacks: int


@dataclasses.dataclass(frozen=True)
class Divergence:
    """What the monitor found: `steps` spike steps in a row, `first_spike_step` to `step`."""

    step: int  # X: the step that completed the run of K
    first_spike_step: int  # F = X - K + 1
    loss: Optional[float]  # the loss judged at X (None: not finite)
    statistic: Optional[float]  # the moving average it was judged against (None: none yet)
    steps: int
    margin: float

    def describe(self) -> str:
        """One line: the steps, the loss and the statistic."""
        loss = "non-finite" if self.loss is None else f"{self.loss:.6g}"
        if self.statistic is None:
            against = "no moving average yet"
        else:
            against = (f"the moving average of earlier losses {self.statistic:.6g}; a spike is above "
                       f"{self.statistic * (1 + self.margin):.6g} (config.divergence_margin={self.margin})")
        return (f"loss diverged at step {self.step}: {self.steps} spike or non-finite steps in a row from step "
                f"{self.first_spike_step} (config.divergence_steps={self.steps}); loss at step {self.step}: "
                f"{loss}, against {against}")


def settings_from(config) -> Optional[Settings]:
    """The checked divergence settings of `config`; None when `config.on_divergence="off"`.

    Raises:
        ValueError: a field out of range, naming it.
    """
    action = config.get("on_divergence", "off")
    if action not in ON_DIVERGENCE:
        raise ValueError(f"config.on_divergence must be one of {ON_DIVERGENCE}, got {action!r}")
    values = {name: config.get(name, default) for name, default in (
        ("divergence_ema_decay", 0.99), ("divergence_margin", 0.5), ("divergence_warmup_steps", 100),
        ("divergence_steps", 3), ("rollback_skip_batches", 0), ("max_rollbacks", 5))}
    decay, margin = float(values["divergence_ema_decay"]), float(values["divergence_margin"])
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"config.divergence_ema_decay={decay} must be in [0, 1)")
    if not margin > 0.0:
        raise ValueError(f"config.divergence_margin={margin} must be positive (a spike is a loss above "
                         "mean * (1 + margin))")
    for name, least in (("divergence_warmup_steps", 0), ("divergence_steps", 1), ("rollback_skip_batches", 0),
                        ("max_rollbacks", 0)):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"config.{name}={value!r} must be an integer >= {least}")
    if action == "off":
        return None
    return Settings(action, decay, margin, int(values["divergence_warmup_steps"]), int(values["divergence_steps"]),
                    int(values["rollback_skip_batches"]), int(values["max_rollbacks"]))


def parse_skip_batches(text: str) -> dict[int, int]:
    """`config.skip_batches` ("C:S,C2:S2") as {step C: batches S}; "" is {}.

    Raises:
        ValueError: not of that form, a negative step, S < 1, or a step given twice, naming the field.
    """
    skips: dict[int, int] = {}
    for item in (part.strip() for part in (text or "").split(",")):
        if not item:
            continue
        try:
            step, count = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"config.skip_batches={text!r}: {item!r} is not STEP:BATCHES "
                             "(e.g. '4000:200,9000:500': after step 4000, skip 200 batches)") from None
        if step < 0 or count < 1:
            raise ValueError(f"config.skip_batches={text!r}: {item!r} needs a step >= 0 and at least 1 batch")
        if step in skips:
            raise ValueError(f"config.skip_batches={text!r}: step {step} is given twice")
        skips[step] = count
    return skips


class DivergenceMonitor:
    """The statistic and the decision, fed `(step, loss, finite)` once per step in step order.

    Args:
        settings: the rule's settings (`settings_from`).
        state: a `state()` saved with the checkpoint the run resumes from; None starts afresh
            (a fresh run, or a checkpoint saved without one), warming up again.
        step: the step the run is at when `state` is None (the first step fed is the next one).
    """

    def __init__(self, settings: Settings, state: Optional[dict] = None, step: int = 0):
        self.settings = settings
        state = state or {}
        self.mean: Optional[float] = state.get("mean")
        self.normal_steps = int(state.get("normal_steps", 0))  # finite non-spike steps fed (the warm-up)
        self.streak = int(state.get("streak", 0))  # spike or non-finite steps in a row, up to the last step fed
        self.last_step = int(state.get("last_step", step))

    def state(self) -> dict:
        """What a checkpoint saves: the statistic over exactly the steps fed so far."""
        return {"mean": self.mean, "normal_steps": self.normal_steps, "streak": self.streak,
                "last_step": self.last_step}

    def observe(self, step: int, loss: float, finite: bool) -> Optional[Divergence]:
        """Feeds one step's loss; returns the `Divergence` when this step completes K spike steps in a row.

        The stable patch point of tests/helpers/fault_hooks.py's `SPIKE_AT_STEPS` (module docstring).

        Args:
            step: the step the loss is of: the one after the last fed.
            loss: its loss, as every host fetched it.
            finite: whether the step's loss and gradient were finite (its update was applied).

        Raises:
            ValueError: a step fed twice or out of order (a bug of the caller).
        """
        if step != self.last_step + 1:
            raise ValueError(f"divergence monitor: step {step} fed after step {self.last_step} (each step once, "
                             "in order)")
        self.last_step = step
        bad = not finite or not math.isfinite(loss)
        if not bad and self.mean is not None and self.normal_steps >= self.settings.warmup_steps:
            bad = loss > self.mean * (1.0 + self.settings.margin)
        if not bad:
            decay = self.settings.ema_decay
            self.mean = loss if self.mean is None else decay * self.mean + (1.0 - decay) * loss
            self.normal_steps += 1
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < self.settings.steps:
            return None
        return Divergence(step=step, first_spike_step=step - self.streak + 1,
                          loss=loss if math.isfinite(loss) else None, statistic=self.mean,
                          steps=self.settings.steps, margin=self.settings.margin)
