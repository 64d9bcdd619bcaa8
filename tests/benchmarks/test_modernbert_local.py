"""benchmarks/step/modernbert_local.py and benchmarks/gpu/modernbert_local.sh, the GPU script of issue 72, on CPU:
the script's own argument handling (the GPU part needs a lent GPU), and the benchmark at a tiny shape, where
the local layers get no kernel ("none": the blocks) against the band mask, and both agree."""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "modernbert_local.sh"


def _bash(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_the_gpu_script_explains_itself_and_refuses_bad_arguments_before_touching_a_gpu(tmp_path):
    r = _bash("--help")
    assert r.returncode == 0, r.stderr
    assert "bash benchmarks/gpu/modernbert_local.sh OUT_DIR [BUDGET_S]" in r.stdout
    assert "benchmarks/step/modernbert_local.py" in r.stdout and "set -u" not in r.stdout
    missing = _bash()
    assert missing.returncode != 0 and "an output folder" in missing.stderr
    budget = _bash(str(tmp_path / "out"), "ten")
    assert budget.returncode == 2 and "BUDGET_S must be a number of seconds, got 'ten'" in budget.stderr
    option = _bash("--out=x")
    assert option.returncode == 2 and "unknown option --out=x" in option.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_the_benchmark_times_both_variants_and_checks_they_agree(tmp_path, capsys):
    from benchmarks.step import modernbert_local as bench

    out = tmp_path / "local.json"
    args = bench.parse_args(["--lengths=128", "--batch_tokens=256", "--hidden=64", "--intermediate=64", "--layers=2",
                             "--heads=1", "--vocab=100", "--local_attention=32", "--dtype=float32", "--rounds=1",
                             "--steps=1", f"--json={out}"])
    results = bench.run(args)
    assert json.loads(out.read_text()) == results
    (row,) = results["rows"]
    # On CPU no kernel takes the window: the local layer runs by blocks (128 > 3 x 16), the band variant masks.
    assert row["length"] == 128 and row["rows"] == 2 and row["local_kernel"] == "none"
    assert row["window_ms"] > 0 and row["band_ms"] > 0
    assert row["agree"] and row["logit_diff_rel"] < 1e-5, row
    # The comparison sees a window one key narrower, by far (float32).
    assert row["resolves_one_key"] and row["control_diff_rel"] > 100 * row["logit_diff_rel"], row
    assert row["loss_window"] == pytest.approx(row["loss_band"], rel=1e-5)
    with pytest.raises(SystemExit):
        bench.parse_args(["--lengths=512", "--batch_tokens=256"])
    assert "--lengths: 512 needs --batch_tokens >= it (got 256)" in capsys.readouterr().err
