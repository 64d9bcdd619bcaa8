"""Pretraining phases: which data, sequence length and steps each part of a run has.

The paper pretrains 90% of the steps at length 128 and 10% at 512; `config.phases` lists such
parts (each a fraction of `config.num_train_steps`, its own `train_data`, `max_seq_length` and
`max_predictions_per_seq`), or is empty for one phase from the top-level keys. One optimizer and
one learning-rate schedule run over all steps; the loop (`loop.py`), the checks
(`startup_checks.py`) and the input (`feed.py`) take the resolved `Phase`s.
"""

from __future__ import annotations

import dataclasses

import ml_collections


@dataclasses.dataclass(frozen=True)
class Phase:
    max_seq_length: int
    max_predictions_per_seq: int
    train_data: str
    start_step: int  # first step (exclusive lower bound: steps start_step+1 .. end_step run here)
    end_step: int


def resolve_phases(config: ml_collections.ConfigDict) -> list[Phase]:
    """The run's phases from `config.phases` (or one phase from the top-level keys)."""
    total = int(config.num_train_steps)
    if not config.phases:
        if not config.train_data:
            raise ValueError("config.train_data is empty: give the training TFRecords (glob, comma-separated)")
        return [Phase(config.max_seq_length, config.max_predictions_per_seq, config.train_data, 0, total)]
    phases, start = [], 0
    fractions = [float(p["fraction"]) for p in config.phases]
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"config.phases: the fractions must add up to 1, got {fractions}")
    for i, p in enumerate(config.phases):
        end = total if i == len(config.phases) - 1 else start + int(round(fractions[i] * total))
        if not p.get("train_data"):
            raise ValueError(f"config.phases[{i}].train_data is empty")
        phases.append(Phase(int(p["max_seq_length"]), int(p["max_predictions_per_seq"]),
                            p["train_data"], start, end))
        start = end
    return phases
