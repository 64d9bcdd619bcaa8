"""The supervisor's tests' fake pod (tests/helpers/fake_pod.py): a fresh one for each test that asks for
`pod`. (tests/pod/test_pod_rehearsal.py has a `pod` of its own: real runs in a bucket.)"""

import sys
from pathlib import Path

import pytest

from tests.helpers import fake_pod

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pod(tmp_path):
    """(root, env, workdir): a fake two-worker pod under `tmp_path` whose runs are fake_pod's, the
    environment that points `launch/tpu_pod.sh --watch` at it, and its local workdir; every run it
    started is ended after the test."""
    env, workdir = fake_pod.supervised(tmp_path, sys.executable, str(ROOT))
    yield tmp_path, env, workdir
    fake_pod.stop_runs(tmp_path)
