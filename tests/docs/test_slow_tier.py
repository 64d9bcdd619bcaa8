"""tests/helpers/slow_tier.py: the tests marked slow skip unless pytest is given --slow or BERT_JAX_SLOW=1."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import pytest

@pytest.mark.slow
def test_rehearsal():
    assert sum([1, 2]) == 3

@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
def test_parametrized_rehearsal(n):
    assert n in (1, 2)

def test_quick():
    assert 1 + 1 == 2
"""


@pytest.mark.parametrize("how, want", [
    ((), "1 passed, 3 skipped"),
    (("--slow",), "4 passed"),
    (("--slow", "-m", "slow"), "3 passed, 1 deselected"),
    (("BERT_JAX_SLOW=1",), "4 passed"),
])
def test_the_slow_tier_runs_only_when_asked(tmp_path, how, want):
    (tmp_path / "test_tiers.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "BERT_JAX_SLOW"}
    env["PYTHONPATH"] = str(ROOT)
    args = [a for a in how if "=" not in a]
    env.update(a.split("=", 1) for a in how if "=" in a)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-p", "tests.helpers.slow_tier", "test_tiers.py", *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert want in r.stdout.splitlines()[-1], r.stdout[-2000:]
    if "skipped" in want:  # the skip says how to run them
        assert "the slow tier: run with --slow" in r.stdout, r.stdout[-2000:]


def test_every_test_the_slow_tier_lists_exists():
    """A renamed test would silently leave the tier; a listed name must be a test function of its file."""
    from tests.helpers import slow_tier
    assert len(set(slow_tier.SLOW)) == len(slow_tier.SLOW)
    for entry in slow_tier.SLOW:
        path, name = entry.split("::")
        source = (ROOT / path).read_text()
        assert f"\ndef {name}(" in source, f"{entry}: no such test"
