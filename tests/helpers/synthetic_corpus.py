"""A corpus of made-up words and its WordPiece vocabulary: the inputs of tests/fixtures/reference_records.json
(tests/fixtures/README.md), which tests/data_pipeline/pretraining_data/test_create_pretraining_data.py,
test_fast_mode.py and tests/data_pipeline/records/test_many_runs.py run create_pretraining_data on."""

import random
from pathlib import Path

STEMS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta",
         "river", "stone", "cloud", "light", "night", "paper", "garden", "window", "silver", "morning"]
SUFFIXES = ["", "", "", "s", "ing", "ed", "ly"]


def synthetic_corpus(out: Path) -> tuple[Path, Path]:
    """The fixture's inputs (see tests/fixtures/README.md): 9 documents of made-up words."""
    rng = random.Random(7)
    docs = []
    for _ in range(9):
        doc = []
        for _ in range(rng.randint(1, 7)):
            words = [rng.choice(STEMS) + rng.choice(SUFFIXES) for _ in range(rng.randint(2, 14))]
            doc.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
        docs.append(doc)
    text = out / "input.txt"
    text.write_text("".join("\n".join(doc) + "\n\n" for doc in docs))
    vocab = out / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "!", "?", ","] + STEMS
                               + ["##" + s for s in SUFFIXES if s]) + "\n")
    return text, vocab
