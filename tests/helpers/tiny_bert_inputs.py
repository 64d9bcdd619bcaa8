"""A small pretraining batch the conversion tests feed every model they compare."""

import numpy as np


def inputs(vocab_size: int, seed: int = 1):
    """(input_ids, input_mask, segment_ids, masked_lm_positions) of 3 rows of 12: one full row, two
    padded (from 8 and from 5), segment B from position 6, 3 predictions a row."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, (3, 12))
    mask = np.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    seg = np.zeros_like(ids)
    seg[:, 6:] = 1
    positions = np.array([[1, 3, 7], [2, 4, 6], [1, 2, 3]])
    return ids, mask, seg, positions
