"""`config.cpu_bf16`: whether a run on a CPU takes the mixed-precision matmuls (`model.mixed_matmuls`).

- "auto" (the default of every program that runs the model): the path is taken where the CPU
  reports bf16 matmul units (`mixed_precision.bf16_units`) and a BERT-Base dense layer's matmul,
  timed both ways once per process (`mixed_precision.bf16_matmul_speedup`, ~0.5 s), runs at least
  `AUTO_MIN_SPEEDUP` times float32's. A CPU without the units is not timed and stays float32: its
  programs are today's, to the bit. So does a model in bfloat16 or FP8, and any backend but the CPU
  (a TPU already runs float32 matmuls with bf16 inputs by default; GPUs take `model.dtype`).
- "on" takes the path on any CPU; "off" leaves `model.mixed_matmuls` as the config sets it (so does
  "auto" where the config sets it True).

The numeric contract of the path: every matmul's inputs rounded to bfloat16, accumulated and
returned in float32; parameters, activations, LayerNorm, softmax, logits, losses and the optimizer
stay float32 (`bert_jax.model.mixed_precision`).

One decision per run:
- several processes: each host times its own matmul and the slowest host's ratio decides for all
  (gathered across processes), so every host compiles the same program;
- a run with a workdir records the decision (`layout.CPU_BF16`) and a resumed run takes the recorded
  one instead of timing again: a probe near the threshold cannot flip a resumed run's numerics;
- the environment variable `BERT_JAX_CPU_BF16` (off | on) replaces "auto" for every program
  started with it: one answer on a cluster of mixed CPUs, or in a test suite that must give the same
  results on every CPU it runs on (tests/conftest.py sets "off"). In a run of several processes
  set it on every host or none: the hosts that decide by timing gather each other's ratios.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Optional

import jax
import numpy as np

from bert_jax import layout
from bert_jax.model import mixed_precision
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

SETTINGS = ("off", "on", "auto")
# "auto" takes the bf16 path where its measured matmul is at least this much faster than float32's.
AUTO_MIN_SPEEDUP = 1.1
# Replaces "auto" where set (off | on): module docstring.
ENV = "BERT_JAX_CPU_BF16"


def check(setting: str, flag: str = "config.cpu_bf16") -> None:
    if setting not in SETTINGS:
        raise ValueError(f"{flag} must be one of {SETTINGS}, got {setting!r}")


def resolve(model: dict, setting: str, workdir: Optional[str] = None, flag: str = "config.cpu_bf16") -> dict:
    """`model` (BertConfig fields) with `mixed_matmuls` as `setting` decides on this backend (module
    docstring); `workdir`: where a run's "auto" decision is recorded and read back on resume. Logs the
    decision and why; warns about a bf16 setting on a CPU without the units (slower than float32)."""
    check(setting, flag)
    env = _env_setting()
    chosen = bool(model.get("mixed_matmuls", False))
    on_cpu = jax.default_backend() == "cpu"
    units = mixed_precision.bf16_units() if on_cpu else []
    if on_cpu and setting != "off":
        if setting == "on":
            chosen, why = True, "on"
        elif chosen:
            why = "config.model.mixed_matmuls=True asks for it"
        elif env is not None:
            chosen, why = env == "on", f"{ENV}={env} replaces auto"
        elif model.get("dtype", "float32") != "float32" or model.get("fp8"):
            why = f"model.dtype={model.get('dtype')}, fp8={bool(model.get('fp8'))}: not float32"
        else:
            chosen, why = _decided(workdir)
        logging.info("%s=%s: model.mixed_matmuls=%s (%s)", flag, setting, chosen, why)
    if on_cpu and not units and (chosen or model.get("dtype") == "bfloat16"):
        what = "model.mixed_matmuls" if chosen else "model.dtype=bfloat16"
        logging.warning("%s on a CPU that reports no bf16 matmul units (no avx512_bf16, amx_bf16 or bf16 in "
                        "/proc/cpuinfo): its bfloat16 matmuls are converted in software, slower than float32 here "
                        "(0.66x for a BERT-base dense layer on an AMD EPYC Zen 3, docs/performance.md)", what)
    return dict(model, mixed_matmuls=chosen)


def _env_setting() -> Optional[str]:
    value = os.environ.get(ENV)
    if value is None or value == "auto":
        return None
    if value not in ("off", "on"):
        raise ValueError(f"the environment variable {ENV}={value!r}: off or on (or unset: auto)")
    return value


def _decided(workdir: Optional[str]) -> tuple:
    """(take the path, why) for "auto": the workdir's recorded decision, else measured (and recorded)."""
    path = storage_paths.join(workdir, layout.CPU_BF16) if workdir else None
    # With several processes every host measures first (a collective), then reads: a host that saw
    # the file process 0 just wrote and skipped the gather would leave the others waiting.
    measured = decide() if jax.process_count() > 1 else None
    if path and storage.exists(path):
        try:
            recorded = json.loads(storage.read_text(path))
            chosen = recorded["mixed_matmuls"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a recorded cpu_bf16 decision ({e}); delete it to decide again") from e
        return bool(chosen), f"recorded by this run's first start in {path}: {recorded.get('why', '')}"
    chosen, why = measured or decide()
    if path and jax.process_index() == 0:
        storage.makedirs(workdir)
        storage.write_text(path, json.dumps({"mixed_matmuls": chosen, "why": why,
                                             "units": mixed_precision.bf16_units()}, indent=2) + "\n")
    return chosen, why


@functools.lru_cache(maxsize=None)
def decide() -> tuple:
    """(take the path, why) on this CPU, measured once per process; with several processes the
    slowest host's ratio decides for all (every process must call this: it gathers)."""
    units = mixed_precision.bf16_units()
    speedup = mixed_precision.bf16_matmul_speedup() if units else 0.0
    why = (f"this CPU reports {', '.join(units)}; a dense layer's matmul ran {speedup:.2f}x float32's in bf16"
           if units else "this CPU reports no bf16 matmul units")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        speeds = np.asarray(multihost_utils.process_allgather(np.float32(speedup))).reshape(-1)
        speedup = float(speeds.min())
        why += f"; the slowest of {speeds.size} hosts {speedup:.2f}x"
    elif not units:
        return False, why
    return speedup >= AUTO_MIN_SPEEDUP, f"{why} (needs {AUTO_MIN_SPEEDUP}x)"


def for_checkpoint(bert_config, setting: str, flag: str = "--cpu_bf16"):
    """A checkpoint's `BertConfig` for a program that only runs it (feature extraction, fill-mask):
    `mixed_matmuls` as `setting` decides here, whatever the training run recorded (how a run
    computed, not what the model is)."""
    model = resolve({**bert_config.to_dict(), "fp8": False, "mixed_matmuls": False}, setting, flag=flag)
    return bert_config.replace(mixed_matmuls=model["mixed_matmuls"])
