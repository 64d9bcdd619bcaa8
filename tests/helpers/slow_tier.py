"""A pytest plugin (tests/conftest.py loads it): the slow tier, `@pytest.mark.slow`.

The README's test command (what CI runs) must finish inside CI's budget on 2 cores; the tests
marked `slow` are the long end-to-end rehearsals whose every part a faster test also covers at
a smaller scale (the pod rehearsed with chaos, kill -9 in a bucket, the README's whole
pretraining path, ...). They skip, saying how to run them, unless pytest is given `--slow` (or
`BERT_JAX_SLOW=1` is set): `python -m pytest -q -n 2 tests --slow` runs everything,
`python -m pytest -q -n 2 tests --slow -m slow` the slow tier alone. Run it before a release
and after changing what those tests rehearse (bert_jax/pod/, bert_jax/checkpoints/, launch/).
"""

import os

import pytest

REASON = "the slow tier: run with --slow (or BERT_JAX_SLOW=1); tests/helpers/slow_tier.py"


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow (the long rehearsals; tests/helpers/slow_tier.py)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long end-to-end rehearsal, run only with --slow "
                                       "(tests/helpers/slow_tier.py)")


def runs_slow_tier(config) -> bool:
    return bool(config.getoption("--slow") or os.environ.get("BERT_JAX_SLOW"))


def pytest_collection_modifyitems(config, items):
    if runs_slow_tier(config):
        return
    skip = pytest.mark.skip(reason=REASON)
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
