"""Fixtures several tests/formats/ modules share."""

import pytest

from tests.helpers.google_checkpoint import google_variables, write_tf1_checkpoint


@pytest.fixture(scope="module")
def google_dir(tmp_path_factory):
    """(directory, variables) of a random Google TF1 checkpoint (tests/helpers/google_checkpoint.py):
    test_convert.py and test_convert_hf.py convert it."""
    pytest.importorskip("tensorflow")
    d = str(tmp_path_factory.mktemp("google") / "uncased_L-2_H-16_A-4")
    variables = google_variables()
    write_tf1_checkpoint(d, variables)
    return d, variables
