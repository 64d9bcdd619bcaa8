"""A pytest plugin (tests/conftest.py loads it): under BERT_JAX_CI=1, a test or test module that
skips because an import failed (`pytest.importorskip`) fails instead.

`.ci/run` installs the [test] extra, libtpu and the MiniLM encoder, so in CI a missing
transformers, apache_beam, papermill, tensorflow_datasets, ... is a broken install, not a reason
to skip whole files silently. Modules CI does not install (`NOT_INSTALLED_BY_CI`) still skip.
Skips for other reasons (../shared/data absent, a platform) are untouched.
"""

import os
import re

import pytest

# torch: its PyPI wheel pulls gigabytes of CUDA libraries; the tests that need it skip in CI.
NOT_INSTALLED_BY_CI = frozenset({"torch"})


def _fail_missing_import(report) -> None:
    if not (os.environ.get("BERT_JAX_CI") and report.skipped):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    missing = re.search(r"could not import '([\w.]+)'", reason)
    if missing and missing.group(1).split(".")[0] not in NOT_INSTALLED_BY_CI:
        report.outcome = "failed"
        report.longrepr = (f"BERT_JAX_CI=1 and {reason.removeprefix('Skipped: ')}: .ci/run installs the [test] "
                           "extra, so a missing module is a failure there, not a skip")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # a test that skipped (importorskip inside it)
    del item, call
    outcome = yield
    _fail_missing_import(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):  # a module that skipped (importorskip at its top)
    del collector
    outcome = yield
    _fail_missing_import(outcome.get_result())
