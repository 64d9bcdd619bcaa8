"""`bert_jax.main` pretraining configs/test.py in a subprocess, as tests/pretrain/test_pretrain.py,
test_pretrain_startup_checks.py and tests/model/test_fp8.py run it: the command, its environment
(with a shared XLA compilation cache when a test sets one in `CACHE`: tests/pretrain/conftest.py's
`compilation_cache`), the run, and the losses it logged."""

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.pretraining_records import logged_losses
from tests.helpers.xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[2]

CACHE = {}  # {"dir": folder}: the persistent compilation cache the runs share (unset: none)


def env(devices: int = 2) -> dict:
    """A run's environment: `devices` fake CPU devices, the checkout importable, `CACHE`'s cache."""
    e = dict(os.environ)
    e.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices),
             TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    if "dir" in CACHE:
        e.update(JAX_COMPILATION_CACHE_DIR=CACHE["dir"], JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return e


def cmd(workdir, data, *overrides) -> list:
    """configs/test.py for 12 steps on `data`/train-*.tfrecord, a checkpoint every 4, then `overrides`."""
    return [sys.executable, "-m", "bert_jax.main", f"--config={ROOT / 'configs/test.py'}",
            f"--workdir={workdir}", f"--config.train_data={data}/train-*.tfrecord",
            "--config.log_every_steps=1", "--config.checkpoint_every_steps=4",
            "--config.num_train_steps=12", "--config.shuffle_buffer_size=64",
            "--config.verify_data=false", *overrides]


def losses(workdir) -> dict:
    """step -> loss from train_log.jsonl (a resumed run logs some steps again: last one wins)."""
    return logged_losses((Path(workdir) / "train_log.jsonl").read_text())


def run(args, timeout=300, devices=2, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env(devices), cwd=ROOT, timeout=timeout, capture_output=True,
                          text=True, **kw)
