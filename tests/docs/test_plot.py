"""bert_jax.plot: reads the scalars a run logged (the loops' metric writer) and draws them into a PNG."""

import struct

import numpy as np
import pytest

from bert_jax import plot


def write_run(workdir):
    from bert_jax import workdir as workdir_files
    w = workdir_files.metric_writer(str(workdir), just_logging=False)
    for step in range(1, 11):
        w.write_scalars(step, {"train/loss": 10.0 / step, "train/mlm_accuracy": 0.05 * step,
                               "train/learning_rate": 1e-4 * min(1, step / 3), "train/grad_norm": 2.0 + step,
                               "train/sequences_per_second": 100.0, "train/input_ms_per_step": 14.0,
                               "train/input_fraction": 0.01})
    for step in (5, 10):
        w.write_scalars(step, {"eval/masked_lm_loss": 3.0 - step / 10, "eval/masked_lm_accuracy": step / 20})
    w.write_scalars(5, {"train/loss": 99.0})  # a step logged again (a resumed run): the last wins
    w.close()


def test_plot_writes_a_png_of_the_logged_values(tmp_path):
    write_run(tmp_path)
    out = tmp_path / "sub" / "curves.png"
    plotted = plot.plot(str(tmp_path), str(out))
    assert set(plotted) == {"train/loss", "train/mlm_accuracy", "train/learning_rate", "train/grad_norm",
                            "eval/masked_lm_loss", "eval/masked_lm_accuracy"}  # throughput and input timing left out
    steps, values = plotted["train/loss"]
    assert steps.tolist() == list(range(1, 11))
    expected = [10.0 / s for s in range(1, 11)]
    expected[4] = 99.0
    np.testing.assert_allclose(values, expected, rtol=1e-6)
    np.testing.assert_allclose(plotted["eval/masked_lm_accuracy"][1], [0.25, 0.5], rtol=1e-6)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width >= 800 and height >= 900  # three panels


def test_plot_cli_and_a_clear_error_without_events(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files"):
        plot.main(["--workdir", str(tmp_path)])
    write_run(tmp_path)
    assert plot.main(["--workdir", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "curves.png").stat().st_size > 10_000
