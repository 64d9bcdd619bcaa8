"""Per-phase learning rates (`config.phases[i].learning_rate` / `.warmup_steps`, `phases.rate_changes`,
`optim.learning_rate_schedule(rate_changes=...)`), through the schedule `loop.build` makes: phases
without them keep the single schedule bit for bit; ModernBERT's context extension, by hand."""

import numpy as np
import pytest

from bert_jax.pretrain import loop
from bert_jax.pretrain.phases import rate_changes, resolve_phases
from bert_jax.training import optim, run_setup
from configs import base, modernbert_base


def schedule_of(config) -> np.ndarray:
    """The rate of every step (counts 0 .. num_train_steps) of the schedule the loop builds."""
    schedule = loop.build(config, run_setup.model_config_from(config), None)[2]
    return np.asarray(schedule(np.arange(config.num_train_steps + 1)))


def single_schedule(config) -> np.ndarray:
    """Today's one schedule of the top-level keys, for the same steps."""
    schedule = optim.learning_rate_schedule(
        config.learning_rate, config.warmup_steps, config.num_train_steps, power=config.lr_decay_power,
        google_style=config.google_lr_schedule, decay_steps=config.get("lr_decay_steps"),
        decay_shape=config.get("lr_decay_shape", "polynomial"))
    return np.asarray(schedule(np.arange(config.num_train_steps + 1)))


def bert_two_phases(**schedule):
    config = base.get_config()
    config.num_train_steps, config.warmup_steps = 1_000, 100
    config.phases = (dict(max_seq_length=128, max_predictions_per_seq=20, fraction=0.9, train_data="a"),
                     dict(max_seq_length=512, max_predictions_per_seq=80, fraction=0.1, train_data="b"))
    config.update(schedule)
    return config


def by_hand(k: np.ndarray, schedule: dict) -> np.ndarray:
    """configs/base.py's 1e-4 over 1,000 steps, 100 of warmup: each schedule's formula."""
    warm = 1e-4 * k / 100
    if schedule.get("google_lr_schedule"):
        return np.where(k < 100, warm, 1e-4 * (1 - k / 1_000))
    if schedule.get("lr_decay_steps"):  # stable until 800, then 1-sqrt over 200
        return np.where(k < 100, warm, np.where(k < 800, 1e-4, 1e-4 * (1 - np.sqrt(np.clip(k - 800, 0, None) / 200))))
    return np.where(k < 100, warm, 1e-4 * (1 - (k - 100) / 900))


@pytest.mark.parametrize("schedule", [{}, {"google_lr_schedule": True},
                                      {"lr_decay_steps": 200, "lr_decay_shape": "1-sqrt"}])
def test_phases_without_rates_keep_the_single_schedule_bit_for_bit(schedule):
    config = bert_two_phases(**schedule)
    assert rate_changes(config) == []
    got = schedule_of(config)
    np.testing.assert_array_equal(got, single_schedule(config))
    np.testing.assert_allclose(got, by_hand(np.arange(1_001), schedule), rtol=2e-5, atol=1e-11)


def test_modernbert_context_extension_holds_8e4_then_3e4_then_decays_1_sqrt():
    config = modernbert_base.get_config()
    config.phases = modernbert_base.context_extension("a", "b")
    config.lr_decay_steps = modernbert_base.CONTEXT_EXTENSION_DECAY_STEPS
    total = config.num_train_steps
    assert (total, config.warmup_steps, config.lr_decay_steps) == (200_000, 3_000, 5_000)
    # The paper's decoupled decay, 1e-5 a step at the peak, as optax's lr * weight_decay.
    assert config.weight_decay * config.learning_rate == pytest.approx(1e-5, rel=1e-12)
    first, second = resolve_phases(config)
    assert (first.end_step, second.max_seq_length) == (170_000, 8192)  # 85%: the paper's 1.7T of 2T tokens
    lr = schedule_of(config)
    np.testing.assert_allclose(lr[[0, 1_500, 3_000]], [0.0, 4e-4, 8e-4], rtol=1e-6)
    assert np.all(lr[3_000:170_000] == np.float32(8e-4))  # the 1,024 phase: the stable rate, no decay
    assert np.all(lr[170_000:195_000] == np.float32(3e-4))  # the 8,192 phase: a lower constant rate
    k = np.array([0, 1_250, 2_500, 4_999, 5_000])  # then 1-sqrt over the last 5,000 steps, to 0
    np.testing.assert_allclose(lr[195_000 + k], 3e-4 * (1 - np.sqrt(k / 5_000)), rtol=1e-5, atol=1e-10)


def test_a_phase_rewarms_linearly_to_its_rate_or_to_the_rate_before_it():
    config = bert_two_phases(lr_decay_steps=50, learning_rate=1.0)
    config.phases = (dict(config.phases[0]), dict(config.phases[1], learning_rate=0.5, warmup_steps=10))
    lr = schedule_of(config)
    np.testing.assert_allclose(lr[895:915], [1.0] * 5 + [0.05 * i for i in range(10)] + [0.5] * 5, rtol=1e-6)
    np.testing.assert_allclose(lr[[950, 1000]], [0.5, 0.0], atol=1e-7)  # linear decay from 0.5
    np.testing.assert_allclose(lr[975], 0.25, rtol=1e-6)
    config.phases = (dict(config.phases[0]), dict(config.phases[1], learning_rate=None, warmup_steps=4))
    np.testing.assert_allclose(schedule_of(config)[899:906], [1.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize("first,second,schedule,match", [
    ({"learning_rate": 1e-4}, {}, {"lr_decay_steps": 50}, r"config.phases\[0\] sets learning_rate"),
    ({}, {"learning_rate": 1e-4}, {}, r"decay begins at step 100 \(config.lr_decay_steps is not set.*at most 100"),
    ({}, {"learning_rate": 1e-4}, {"lr_decay_steps": 150}, r"decay begins at step 850.*config.phases\[1\]"),
    ({}, {"learning_rate": 1e-4, "warmup_steps": 101}, {"lr_decay_steps": 50}, r"phases\[1\].warmup_steps=101"),
    ({}, {"learning_rate": -1.0}, {"lr_decay_steps": 50}, r"phases\[1\].learning_rate=-1.0 must not be negative"),
    ({}, {"learning_rate": 1e-4}, {"google_lr_schedule": True}, r"config.google_lr_schedule=True do not go"),
    ({}, {"learning_rate": 1e-4}, {"lr_decay_steps": 50, "warmup_steps": 950}, r"phases\[1\] starts at step 900"),
    ({}, {"learning_rte": 1e-4}, {"lr_decay_steps": 50}, r"config.phases\[1\] has unknown key\(s\) \['learning_rte'\]"),
])
def test_bad_phase_rates_are_refused_naming_the_field(first, second, schedule, match):
    config = bert_two_phases(**schedule)
    config.phases = (dict(config.phases[0], **first), dict(config.phases[1], **second))
    with pytest.raises(ValueError, match=match):
        schedule_of(config)
