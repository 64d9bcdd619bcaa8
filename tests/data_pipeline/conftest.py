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
