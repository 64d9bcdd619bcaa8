"""Code several test modules share, one module per subject: test data (records, corpora, inputs),
stand-ins (a fake TPU pod, planted faults), comparisons (model parity) and the settings of the
processes tests start (XLA flags). Tests import it as `from tests.helpers import fake_pod`; a test
module never imports another test module, and fixtures that a folder's tests share live in that
folder's conftest.py (tests/docs/test_architecture.py checks both)."""
