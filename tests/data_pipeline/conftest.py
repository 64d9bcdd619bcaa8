"""Fixtures several tests/data_pipeline/ modules share."""

import pytest

from tests.helpers.numbered_records import write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, int]:
    """8 files of 3..10 records (52 in all)."""
    directory = tmp_path_factory.mktemp("data")
    counts = [3, 4, 5, 6, 7, 8, 9, 10]
    write_dataset(directory, counts)
    return str(directory / "part-*.tfrecord"), sum(counts)


# The words of the tasks' hand-made examples (test_tasks.py, test_squad.py), after BERT's five specials.
TASK_WORDS = ["the", "cat", "sat", "on", "mat", "john", "smith", "lives", "in", "paris", "cafe", "una", "##ffa",
              "##ble", "who", "where", "is", "was", "a", "dog", ".", ",", "?", "1996", "-", "08"]


@pytest.fixture
def vocab(tmp_path):
    """A vocab.txt of BERT's special tokens and `TASK_WORDS`."""
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + TASK_WORDS) + "\n")
    return str(path)
