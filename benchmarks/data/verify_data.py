"""What `verify_data` costs when a run starts: the first start hashes every file, a restart checks
each unchanged file by its identity (`records.known_hashes.KnownHashes`), `rehash_data` hashes them all again.

    python -m benchmarks.data.verify_data [--shards=100] [--shard_mb=4] [--dir=/tmp/bench_verify]
    python -m benchmarks.data.verify_data --emulator [--dir=gs://bench/verify]   # Cloud Storage, emulated

Writes `--shards` files of `--shard_mb` random bytes with their manifest, train.dataset_info.json (verification
checks sizes and SHA-256s against it and parses no record, so the bytes need not be records), then
times `records.check_files` as a pretraining start calls it: first start (empty cache of verified
files), restart (the cache from the first), and `verify="full"` (config.rehash_data). Prints one
JSON object; times in seconds, each the median of `--repeats` runs (the first start: each run with
an emptied cache).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from data_pipeline import storage
from data_pipeline.records import manifests, reader as records
from data_pipeline.storage import paths as storage_paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--shard_mb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    from benchmarks.common import gcs_emulator
    gcs_emulator.add_flags(parser, "/tmp/bench_verify", "gs://bench/verify")
    args = parser.parse_args(argv)
    server = gcs_emulator.start_if_asked(args, "/tmp/bench_verify", "gs://bench/verify")
    cache = tempfile.mkdtemp(prefix="bench_verify_cache_")
    os.environ["BERT_JAX_CACHE_DIR"] = cache
    try:
        size = int(args.shard_mb * 2**20)
        paths = []
        for i in range(args.shards):
            path = storage_paths.join(args.dir, f"train-{i:05d}-of-{args.shards:05d}.tfrecord")
            storage.write_bytes(path, os.urandom(size))
            paths.append(path)
        manifests.write_dataset_info(args.dir, {p: 1 for p in paths})
        if not args.emulator:
            past = time.time() - 60  # written a minute ago (files written within 2 s are not remembered)
            for p in paths:
                os.utime(p, (past, past))

        def check(verify):
            started = time.perf_counter()
            files = records.check_files(storage_paths.join(args.dir, "*.tfrecord"), process_index=0, process_count=1,
                                        verify=verify, skip_corrupt=False, require_files_per_host=True)
            assert len(files.read_paths) == args.shards
            return time.perf_counter() - started

        first, restart, full = [], [], []
        for _ in range(args.repeats):
            shutil.rmtree(cache, ignore_errors=True)
            first.append(check(True))
            restart.append(check(True))
            full.append(check("full"))
        out = {"where": "emulated bucket" if args.emulator else "local disk", "shards": args.shards,
               "total_mb": round(args.shards * size / 2**20), "first_start_s": statistics.median(first),
               "restart_s": statistics.median(restart), "rehash_s": statistics.median(full)}
        out["restart_speedup"] = out["first_start_s"] / out["restart_s"]
        print(json.dumps(out))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if not args.emulator:
            shutil.rmtree(args.dir, ignore_errors=True)
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
