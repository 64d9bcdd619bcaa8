"""Fixtures several tests/pretrain/ modules share."""

import pytest

from tests.helpers.pretraining_records import write_records
from tests.helpers.pretraining_runs import CACHE


@pytest.fixture(scope="session")  # session: the longest tests run first (tests/conftest.py), the rest later
def data(tmp_path_factory):
    """Records in Google's schema (tests/helpers/pretraining_records.py): train-0..3 (64 each),
    eval-0 (40), nan (16, a NaN weight) and, for a second phase, long-0..1 (length 48, 7 predictions).
    test_pretrain.py and test_pretrain_startup_checks.py read them."""
    d = tmp_path_factory.mktemp("data")
    for i in range(4):
        write_records(d / f"train-{i}.tfrecord", 64, seed=i)
    write_records(d / "eval-0.tfrecord", 40, seed=99)
    write_records(d / "nan.tfrecord", 16, seed=5, nan_weight=True)
    for i in range(2):  # phase 2 of a two-phase run: longer sequences, more predictions
        write_records(d / f"long-{i}.tfrecord", 32, seed=10 + i, SEQ=48, PREDS=7)
    return d


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory):
    """One persistent XLA cache for the subprocesses of the modules that use it
    (`pytestmark = pytest.mark.usefixtures("compilation_cache")`): most runs compile the same step of
    configs/test.py, which a cached executable serves in half the run's time. (A cached executable
    is the same program: the kill -9 and multi-process tests still compare bit for bit against a
    run that compiled.)"""
    CACHE["dir"] = str(tmp_path_factory.mktemp("xla_cache"))
    yield CACHE["dir"]
    CACHE.clear()
