"""data_pipeline.masking_rule on its own: the scalar form on planted draws (the outcomes and how
many draws each took, as Google's script draws), the array form by hand with NumPy and the same
with TensorFlow, the 80/10/10 shares over many seeded draws, and an import of neither library.

That the three maskers follow it bit for bit is the other tests' part: Google's records
(test_create_pretraining_data.py), the fast mode's rates (test_fast_mode_instances.py) and
dynamic masking's (test_dynamic_masking.py).
"""

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

from data_pipeline import masking_rule

ROOT = Path(__file__).resolve().parents[2]


def test_choose_draws_once_for_mask_and_twice_otherwise():
    planted = [0.5, 0.9, 0.2, 0.85, 0.7, 0.79, 0.8, 0.5]
    draws = iter(planted)
    taken = []

    def draw():
        taken.append(next(draws))
        return taken[-1]

    got = []
    for _ in range(5):
        before = len(taken)
        got.append((masking_rule.choose(draw), len(taken) - before))
    # 0.5 < 0.8; 0.9 then 0.2 < 0.5; 0.85 then 0.7 >= 0.5; 0.79 < 0.8; 0.8 is not < 0.8, nor 0.5 < 0.5.
    assert got == [("mask", 1), ("keep", 2), ("random", 2), ("mask", 1), ("random", 2)]
    assert taken == planted


def test_array_form_by_hand_with_numpy():
    u_mask = np.array([0.1, 0.8, 0.9, 0.95, 0.79], np.float32)
    u_keep = np.array([0.9, 0.4, 0.6, 0.0, 0.1], np.float32)  # counts only where u_mask >= 0.8
    is_mask, is_keep = masking_rule.outcomes(u_mask, u_keep)
    assert is_mask.tolist() == [True, False, False, False, True]
    assert is_keep.tolist() == [False, True, False, True, False]
    new = masking_rule.replace(u_mask, u_keep, np.array([11, 12, 13, 14, 15]), np.array([21, 22, 23, 24, 25]),
                               103, np.where)
    assert new.tolist() == [103, 12, 23, 14, 103]


def test_array_form_is_the_same_with_tensorflow():
    from data_pipeline.tf_import import tf

    rng = np.random.default_rng(3)
    u_mask, u_keep = rng.random((2, 4, 50), dtype=np.float32)
    original, random_word = rng.integers(1000, 2000, (2, 4, 50)).astype(np.int32)
    want = masking_rule.replace(u_mask, u_keep, original, random_word, 103, np.where)
    got = masking_rule.replace(tf.constant(u_mask), tf.constant(u_keep), tf.constant(original),
                               tf.constant(random_word), 103, tf.where)
    np.testing.assert_array_equal(got.numpy(), want)
    for ours, theirs in zip(masking_rule.outcomes(tf.constant(u_mask), tf.constant(u_keep)),
                            masking_rule.outcomes(u_mask, u_keep)):
        np.testing.assert_array_equal(ours.numpy(), theirs)


def test_the_shares_are_80_10_10():
    n = 100_000  # each share's sd is at most 0.0013: 0.01 is over 7 of them
    rng = random.Random(0)
    counts = {"mask": 0, "keep": 0, "random": 0}
    for _ in range(n):
        counts[masking_rule.choose(rng.random)] += 1
    gen = np.random.default_rng(0)
    is_mask, is_keep = masking_rule.outcomes(gen.random(n), gen.random(n))
    arrays = {"mask": is_mask.sum(), "keep": is_keep.sum(), "random": (~is_mask & ~is_keep).sum()}
    for kind, share in (("mask", 0.8), ("keep", 0.1), ("random", 0.1)):
        assert abs(counts[kind] / n - share) < 0.01, counts
        assert abs(arrays[kind] / n - share) < 0.01, arrays


def test_the_rule_imports_neither_numpy_nor_tensorflow():
    """It sits at data_pipeline's root layer, below the NumPy and TensorFlow maskers alike."""
    code = ("import sys, data_pipeline.masking_rule; "
            "print(sorted(m for m in ('numpy', 'tensorflow') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
