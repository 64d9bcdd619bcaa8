"""experiments/stableadamw_vs_adamw.py without training: each arm's config, and the table's differences
on a made-up report (worked out by hand)."""

import os

import pytest

from experiments import stableadamw_vs_adamw as exp
from experiments.pretraining_corpus import UNCASED_VOCAB as VOCAB


def test_the_table_gives_each_seeds_end_difference_and_their_mean():
    curve = lambda mid, end: [{"mlm_loss": 9.0}, {"mlm_loss": mid}, {"mlm_loss": end}]
    runs = [{"optimizer": "adamw", "learning_rate": 1e-3, "seed": 0, "curve": curve(8.0, 7.5)},
            {"optimizer": "stableadamw", "learning_rate": 1e-3, "seed": 0, "curve": curve(8.1, 7.6)},
            {"optimizer": "adamw", "learning_rate": 1e-3, "seed": 1, "curve": curve(8.0, 7.4)},
            {"optimizer": "stableadamw", "learning_rate": 1e-3, "seed": 1, "curve": curve(7.9, 7.1)}]
    table = exp.markdown({"runs": runs, "settings": {"rates": [1e-3], "seeds": [0, 1]}}).splitlines()
    assert table[2] == "| 0.001 | 0 | 8.000, 7.500 | 8.100, 7.600 | +0.100 |"
    assert table[3] == "| 0.001 | 1 | 8.000, 7.400 | 7.900, 7.100 | -0.300 |"
    assert table[4] == "| 0.001 | mean | | | -0.100 |"  # (0.1 - 0.3) / 2


@pytest.mark.skipif(not os.path.exists(VOCAB), reason="needs ../shared/data")
def test_the_arms_differ_only_in_optimizer_clipping_and_rate(tmp_path):
    args = exp.parse_args(["--workdir", str(tmp_path), "--steps", "50", "--vocab_file", VOCAB])
    adamw = exp.arm_config("adamw", 1.0, 1e-3, 0, args, "R")
    stable = exp.arm_config("stableadamw", 0.0, 4e-3, 0, args, "R")
    assert (adamw.optimizer, adamw.clip_norm, stable.optimizer, stable.clip_norm) == ("adamw", 1.0, "stableadamw", 0.0)
    assert (adamw.learning_rate, stable.learning_rate) == (1e-3, 4e-3)
    assert adamw.num_train_steps == 50 and adamw.lr_decay_steps == 10 and adamw.lr_decay_shape == "1-sqrt"
    a, s = adamw.to_dict(), stable.to_dict()
    differ = {k for k in a if a[k] != s[k]}
    assert differ == {"optimizer", "clip_norm", "learning_rate"}
