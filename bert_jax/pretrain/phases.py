"""Pretraining phases: which data, sequence length, steps and learning rate each part of a run has.

The paper pretrains 90% of the steps at length 128 and 10% at 512; `config.phases` lists such
parts (each a fraction of `config.num_train_steps`, its own `train_data`, `max_seq_length` and
`max_predictions_per_seq`), or is empty for one phase from the top-level keys. One optimizer runs
over all steps, and one learning-rate schedule (`optim.learning_rate_schedule`), which a phase
after the first may change: its optional `learning_rate` holds from the phase's first step (after
a linear warmup from 0 over its optional `warmup_steps`), and the final decay
(`config.lr_decay_steps`) starts from the last phase's rate (ModernBERT: 8e-4 at length 1,024,
3e-4 at 8,192, then the 1-sqrt decay; `rate_changes`). Phases without those keys keep the single
schedule of the top-level keys. The loop (`loop.py`), the checks (`startup_checks.py`) and the
input (`feed.py`) take the resolved `Phase`s.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from bert_jax.training import optim

KEYS = ("fraction", "train_data", "max_seq_length", "max_predictions_per_seq")  # each phase's
RATE_KEYS = ("learning_rate", "warmup_steps")  # optional, not in the first phase


@dataclasses.dataclass(frozen=True)
class Phase:
    max_seq_length: int
    max_predictions_per_seq: int
    train_data: str
    start_step: int  # first step (exclusive lower bound: steps start_step+1 .. end_step run here)
    end_step: int


def _spans(config: ml_collections.ConfigDict) -> list[tuple[int, int]]:
    """Each of `config.phases`' (start_step, end_step), its keys checked."""
    total = int(config.num_train_steps)
    for i, p in enumerate(config.phases):
        unknown = sorted(set(p.keys()) - set(KEYS) - set(RATE_KEYS))
        if unknown:
            raise ValueError(f"config.phases[{i}] has unknown key(s) {unknown}: a phase has {', '.join(KEYS)} "
                             f"and optionally (after the first) {', '.join(RATE_KEYS)}")
        if "fraction" not in p:
            raise ValueError(f"config.phases[{i}].fraction is missing")
    fractions = [float(p["fraction"]) for p in config.phases]
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"config.phases: the fractions must add up to 1, got {fractions}")
    spans, start = [], 0
    for i in range(len(fractions)):
        end = total if i == len(fractions) - 1 else start + int(round(fractions[i] * total))
        spans.append((start, end))
        start = end
    return spans


def resolve_phases(config: ml_collections.ConfigDict) -> list[Phase]:
    """The run's phases from `config.phases` (or one phase from the top-level keys)."""
    total = int(config.num_train_steps)
    if not config.phases:
        if not config.train_data:
            raise ValueError("config.train_data is empty: give the training TFRecords (glob, comma-separated)")
        return [Phase(config.max_seq_length, config.max_predictions_per_seq, config.train_data, 0, total)]
    phases = []
    for i, (p, (start, end)) in enumerate(zip(config.phases, _spans(config))):
        if not p.get("train_data"):
            raise ValueError(f"config.phases[{i}].train_data is empty")
        phases.append(Phase(int(p["max_seq_length"]), int(p["max_predictions_per_seq"]),
                            p["train_data"], start, end))
    return phases


def rate_changes(config: ml_collections.ConfigDict) -> list[optim.RateChange]:
    """The phases' own learning rates (`optim.learning_rate_schedule(rate_changes=...)`): one per phase
    after the first that has `learning_rate` or `warmup_steps`; none without `config.phases`."""
    if not config.phases:
        return []
    changes = []
    for i, (p, (start, end)) in enumerate(zip(config.phases, _spans(config))):
        if not any(key in p for key in RATE_KEYS):
            continue
        if i == 0:
            raise ValueError("config.phases[0] sets learning_rate / warmup_steps: the first phase's are "
                             "config.learning_rate and config.warmup_steps")
        rate = p.get("learning_rate")
        changes.append(optim.RateChange(f"config.phases[{i}]", start, end, None if rate is None else float(rate),
                                        int(p.get("warmup_steps", 0))))
    return changes
