"""AOT compilation of the sharded train step for a real TPU topology, on CPU (skips without libtpu).

`benchmarks/aot_tpu.py` compiles against `jax.experimental.topologies` devices; libtpu (the TPU
compiler, from PyPI) needs no TPU. This compiles the test-sized config for a v5e 2x2 slice.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu not installed (pip install 'libtpu==0.0.42.*')")


def test_tiny_config_compiles_for_a_v5e_2x2_slice():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in sys.path if p]))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "aot_tpu.py"), "--config=configs/test.py",
                        "--topology=v5e-4", "--mesh=data,fsdp", "--seq_len=32", "--batch_per_chip=4",
                        "--max_batch_per_chip=8", "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["mesh"] for row in rows] == [{"data": 4, "fsdp": 1, "tensor": 1}, {"data": 1, "fsdp": 4, "tensor": 1}]
    for row in rows:
        assert row["chips"] == 4 and row["global_batch"] == 16 and row["fits"]
        assert 0 < row["hbm_gib"] < 0.1
        # XLA FLOPs (extrapolated from 1 and 2 unrolled layers) are at least our matmul count.
        assert 1.0 <= row["xla_over_analytic"] < 6.0  # a tiny H=32 model: non-matmul work is large
        assert row["max_batch_per_chip"] == 8  # capped by --max_batch_per_chip
        assert 0.0 < row["mfu_upper_bound"] <= 1.0
    assert "all-reduce" in rows[0]["collectives"]  # data parallel: gradients all-reduced
    assert "all-gather" in rows[1]["collectives"]  # FSDP: parameters gathered
