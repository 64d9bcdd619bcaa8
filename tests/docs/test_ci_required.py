"""tests/helpers/ci_required.py: under BERT_JAX_CI=1 a missing test dependency fails instead of skipping."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MODULE_SKIP = """
import pytest
pytest.importorskip("no_such_module_for_bert_jax")
def test_never_collected():
    pass
"""

TEST_SKIPS = """
import pytest
def test_needs_a_missing_module():
    pytest.importorskip("no_such_module_for_bert_jax.sub")
def test_needs_torch():
    pytest.importorskip("torch")
def test_needs_shared_data():
    pytest.skip("../shared/data is absent")
"""


@pytest.mark.parametrize("ci", [True, False])
def test_a_missing_test_dependency_fails_in_ci_and_skips_elsewhere(tmp_path, ci):
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    (tmp_path / "test_skips.py").write_text(TEST_SKIPS)
    env = {k: v for k, v in os.environ.items() if k != "BERT_JAX_CI"}
    env.update(PYTHONPATH=str(ROOT), **({"BERT_JAX_CI": "1"} if ci else {}))
    for name, want in (("test_module_skip.py", "1 error" if ci else "1 skipped"),
                       ("test_skips.py", "1 failed, 2 skipped" if ci else "3 skipped")):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                            "-p", "tests.helpers.ci_required", name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert want in r.stdout.splitlines()[-1], r.stdout[-2000:]
        if ci:  # the failure names the module and the reason
            assert "BERT_JAX_CI=1 and could not import 'no_such_module_for_bert_jax" in r.stdout, r.stdout[-2000:]
            assert "../shared/data is absent" in r.stdout or name == "test_module_skip.py"
