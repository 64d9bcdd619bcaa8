"""The README stays true: its configuration reference lists every field of configs/base.py, and the
test command CI runs is the one it shows."""

import re
from pathlib import Path

from configs import base

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _flatten(d, prefix=""):
    out = set()
    for k, v in d.items():
        if isinstance(v, dict) and k == "model":
            out |= _flatten(v, f"{k}.")
        else:
            out.add(prefix + k)
    return out


def test_configuration_reference_lists_every_base_field():
    section = README.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([\w.]+)` \|", section, re.M))
    fields = _flatten(base.get_config().to_dict())
    assert fields - listed == set(), f"fields missing from the README's reference: {sorted(fields - listed)}"
    assert listed - fields == set(), f"README lists fields base.py does not have: {sorted(listed - fields)}"


def test_ci_runs_the_readme_test_command():
    block = README.split("<!-- test-command -->", 1)[1].split("<!-- /test-command -->", 1)[0]
    assert re.search(r"^python -m pytest -q (-n \d+ )?tests$", block, re.M), block
    assert "test-command" in (ROOT / ".ci" / "run").read_text()
