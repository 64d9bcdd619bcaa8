"""BERT's 80/10/10 rule: what becomes of a position chosen for masked-LM prediction.

The paper (Devlin et al. 2018, section 3.1; other mixes ablated in appendix C.2) replaces a chosen token with [MASK]
80% of the time, with a random word 10% of the time, and leaves it unchanged 10% of the time.
Google's create_pretraining_data.py (`create_masked_lm_predictions`) draws it in two steps, and
this module keeps its order:

    if rng.random() < 0.8:        [MASK]                      (first draw)
    elif rng.random() < 0.5:      the original token          (second draw, only when not [MASK])
    else:                         vocab_words[rng.randint(0, len(vocab_words) - 1)]

so a position takes one uniform draw when it becomes [MASK] and two otherwise, and the random word
is drawn only when it is used. The reference-compatible records are byte-identical to Google's
script only while these draws come in this order (`tests/fixtures/reference_records.json`).

The three maskers follow this one rule: `pretraining_data/instances.py` (Google's, one position
at a time: `choose`), `pretraining_data/fast_instances.py` (NumPy, a batch at once: `outcomes`)
and `input/masking.py` (TensorFlow, dynamic masking: `replace`). The array forms take both
uniforms for every position, drawn in advance, and use only `<`, `&` and `~`, which mean the same
on NumPy boolean arrays and TensorFlow boolean tensors; `replace` takes the library's `where`. So
this module imports neither library and sits at data_pipeline's root layer, below both.
"""

from typing import Callable

MASK_PROB = 0.8  # a chosen position becomes [MASK] with this probability ...
KEEP_PROB = 0.5  # ... else keeps its token with this one, else becomes a random word: 80/10/10


def choose(draw: Callable[[], float]) -> str:
    """"mask", "keep" or "random" for one chosen position, drawing as Google's script does:
    `draw()` (a uniform in [0, 1), e.g. `random.Random.random`) is called once for "mask", twice
    otherwise. The caller draws the random word after a "random", as the reference does."""
    if draw() < MASK_PROB:
        return "mask"
    if draw() < KEEP_PROB:
        return "keep"
    return "random"


def outcomes(u_mask, u_keep):
    """(is_mask, is_keep), boolean arrays or tensors, from two uniforms per position (NumPy arrays
    or TensorFlow tensors of one shape); a position that is neither becomes a random word.
    `u_keep` counts only where `u_mask` did not choose [MASK], as the reference's second draw."""
    is_mask = u_mask < MASK_PROB
    return is_mask, ~is_mask & (u_keep < KEEP_PROB)


def replace(u_mask, u_keep, original, random_word, mask_id, where):
    """Each position's new id under the rule: `mask_id`, its `original` id or its `random_word`,
    chosen by `outcomes(u_mask, u_keep)`; `where` is `np.where` or `tf.where`."""
    is_mask, is_keep = outcomes(u_mask, u_keep)
    return where(is_mask, mask_id, where(is_keep, original, random_word))
