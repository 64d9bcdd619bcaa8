"""CLI: a run's logged metrics -> a PNG of its curves.

    python -m bert_jax.plot --workdir=W [--output=W/curves.png]

Reads the TensorBoard event files the training loops write under `W` (`bert_jax.workdir.metric_writer`:
`train/...` and `eval/...` scalars) and draws, step on the x axis: the losses (train and eval),
the accuracies and task metrics (train and eval), and the learning rate with the gradient norm.
Throughput figures are left out (they are on the console and in TensorBoard).
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Optional, Sequence

import numpy as np

from bert_jax import layout
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

_SKIP = ("per_second", "mfu", "finite", "steps_per", "input_ms", "input_fraction")


def read_scalars(workdir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`{tag: (steps, values)}` from every event file under `workdir`, local or gs:// (sorted by
    step; a step logged twice, as after a resume, keeps its last value). A remote event file is read
    from a temporary local copy (TensorBoard's reader opens local files)."""
    from tensorboard.backend.event_processing import event_accumulator

    files = storage.glob(storage_paths.join(workdir, "**", layout.EVENTS_PREFIX + ".*"))
    if not files:
        raise FileNotFoundError(f"--workdir={workdir}: no TensorBoard event files (events.out.tfevents.*) "
                                f"found; is it a bert_jax training workdir?")
    series: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bert_jax_plot_") as tmp:
        for i, path in enumerate(files):
            local = path
            if storage_paths.is_remote(path):
                local = os.path.join(tmp, str(i), storage_paths.basename(path))
                storage.copy(path, local)
            _read_events(event_accumulator, local, series)
    return {tag: (np.array(sorted(d)), np.array([d[s] for s in sorted(d)])) for tag, d in series.items()}


def _read_events(event_accumulator, local: str, series: dict) -> None:
    """Adds the scalars of the local event file `local` to `series` (`{tag: {step: value}}`)."""
    acc = event_accumulator.EventAccumulator(  # storage: local (a local file, or a tempfile copy)
        local, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in tags.get("tensors", []):
        for e in acc.Tensors(tag):
            value = np.asarray(_tensor_value(e.tensor_proto))
            if value.size == 1:
                series.setdefault(tag, {})[int(e.step)] = float(value.reshape(()))
    for tag in tags.get("scalars", []):
        for e in acc.Scalars(tag):
            series.setdefault(tag, {})[int(e.step)] = float(e.value)


def _tensor_value(proto):
    from tensorboard.util import tensor_util
    return tensor_util.make_ndarray(proto)


def _panel(tag: str) -> Optional[str]:
    name = tag.split("/")[-1]
    if any(s in name for s in _SKIP):
        return None
    if "loss" in name:
        return "loss"
    if name in ("learning_rate", "grad_norm"):
        return "optimizer"
    return "metrics"


def plot(workdir: str, output: Optional[str] = None, tags: Optional[Sequence[str]] = None) -> dict:
    """Draws the curves into `output` (default `workdir/curves.png`); returns what it plotted,
    `{tag: (steps, values)}`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output = output or storage_paths.join(workdir, layout.CURVES)
    series = read_scalars(workdir)
    if tags:
        series = {t: v for t, v in series.items() if t in tags}
    panels: dict[str, list[str]] = {"loss": [], "metrics": [], "optimizer": []}
    for tag in sorted(series):
        panel = _panel(tag)
        if panel:
            panels[panel].append(tag)
    panels = {k: v for k, v in panels.items() if v}
    if not panels:
        raise ValueError(f"--workdir={workdir}: no loss or metric scalars to plot (found {sorted(series)})")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), sharex=True, squeeze=False)
    plotted = {}
    titles = {"loss": "losses", "metrics": "accuracy and metrics", "optimizer": "optimizer"}
    for ax, (panel, panel_tags) in zip(axes[:, 0], panels.items()):
        for tag in panel_tags:
            steps, values = series[tag]
            style = "o-" if tag.startswith("eval") or len(steps) < 30 else "-"
            ax.plot(steps, values, style, label=tag, markersize=3, linewidth=1.2)
            plotted[tag] = (steps, values)
        if panel == "optimizer" and len(panel_tags) == 2:
            ax.set_yscale("log")
        ax.set_title(titles[panel], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(storage_paths.basename(storage_paths.abspath(workdir)), fontsize=11)
    fig.tight_layout()
    # Drawn in memory, then written whole (local or gs://); the format from the extension, as
    # savefig(path) does (png without one).
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format=os.path.splitext(output)[1][1:].lower() or "png")  # storage: local (a BytesIO)
    plt.close(fig)
    storage.write_bytes(output, image.getvalue())
    return plotted


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bert_jax.plot", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="a pretraining or fine-tuning workdir")
    p.add_argument("--output", default=None, help="PNG path (default: WORKDIR/curves.png)")
    args = p.parse_args(argv)
    storage_paths.check(args.workdir, "--workdir")
    if args.output:
        storage_paths.check(args.output, "--output")
    output = args.output or storage_paths.join(args.workdir, layout.CURVES)
    plotted = plot(args.workdir, output)
    print(f"wrote {output}: {', '.join(sorted(plotted))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
