"""The tiny ModernBERT of `tests/fixtures/modernbert_tiny/`, its weights drawn from a recipe instead of stored.

The fixture holds what transformers wrote and computed (`config.json`; `tensors.json`: the name, shape
and dtype of every tensor its `save_pretrained` wrote and of each task head; `reference.npz` and
`heads.npz`: its outputs) but no weights: `checkpoint(directory)` writes `config.json` and a
`model.safetensors` whose values come from `drawn`, a seeded NumPy recipe. The generator
(tests/helpers/make_modernbert_reference.py) ran transformers on a checkpoint this same function wrote, so
the tests load exactly the file transformers loaded.
"""

import json
import os
import shutil

import numpy as np
import safetensors.numpy

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "modernbert_tiny")
ENCODER_SEED = 0
HEAD_SEEDS = {"sequence": 1, "sequence_mean": 2, "token": 3, "span": 4, "multiple_choice": 5}


def drawn(shapes: dict, seed: int) -> dict:
    """Float32 tensors for {name: shape}, in sorted name order from one seeded generator: norm scales
    1 + 0.3 N(0, 1) (away from 1, so a misplaced norm shows), everything else 0.2 N(0, 1)."""
    rng = np.random.RandomState(seed)
    out = {}
    for name in sorted(shapes):
        x = rng.standard_normal(tuple(shapes[name])).astype(np.float32)
        out[name] = (1.0 + 0.3 * x) if "norm" in name else 0.2 * x
    return out


def shapes() -> dict:
    with open(os.path.join(FIXTURE, "tensors.json")) as f:
        return json.load(f)


def encoder_tensors() -> dict:
    """The MLM model's tensors, named as transformers saved them."""
    return drawn(shapes()["model"], ENCODER_SEED)


def head_tensors(name: str) -> dict:
    """The task head `name` ("sequence", "sequence_mean", "token", "span", "multiple_choice")."""
    return drawn(shapes()[name], HEAD_SEEDS[name])


def checkpoint(directory: str) -> str:
    """Writes the fixture's config.json and its drawn model.safetensors into `directory`; returns it."""
    os.makedirs(directory, exist_ok=True)
    shutil.copy(os.path.join(FIXTURE, "config.json"), os.path.join(directory, "config.json"))
    safetensors.numpy.save_file(encoder_tensors(), os.path.join(directory, "model.safetensors"),
                                metadata={"format": "pt"})
    return directory
