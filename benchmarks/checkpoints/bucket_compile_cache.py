"""What a compilation cache in the run's bucket saves a recreated VM: the pretraining step compiled
into an empty gs:// cache, then compiled again by a new process (nothing in memory, nothing on local
disk) that loads it from the bucket.

    python -m benchmarks.checkpoints.bucket_compile_cache [--config=configs/base.py --seq_len=128 --batch=8]

Each side is `benchmarks.step.pretrain_step --compile_only` (lower + compile of the jitted, sharded train step) in
a process of its own, with `JAX_COMPILATION_CACHE_DIR=gs://.../xla` pointing at fake-gcs-server on
127.0.0.1 (`--emulator`, the default; `--dir=gs://your-bucket/xla` for a real bucket). Prints one
JSON line per side and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/base.py")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dir", default="", help="the cache folder (default: a new bucket of the emulator)")
    args = p.parse_args()
    server = None
    if not args.dir:
        import gcs_emulator
        args.dir = f"gs://cache-{uuid.uuid4().hex[:8]}/xla"
        server = gcs_emulator.start(args.dir)
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=args.dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    results = {}
    try:
        for side in ("empty cache", "loaded from the bucket"):
            r = subprocess.run([sys.executable, "-m", "benchmarks.step.pretrain_step",
                                f"--config={args.config}", f"--seq_len={args.seq_len}", f"--batch={args.batch}",
                                "--compile_only", "--json"], env=env, cwd=ROOT, capture_output=True, text=True,
                               check=True)
            out = json.loads(r.stdout.strip().splitlines()[-1])
            results[side] = out["compile_s"]
            print(json.dumps({"side": side, "compile_s": round(out["compile_s"], 2), "cache": args.dir}), flush=True)
    finally:
        if server is not None:
            server.stop()
    first, second = results["empty cache"], results["loaded from the bucket"]
    print(json.dumps({"compile_s": round(first, 2), "from_bucket_s": round(second, 2),
                      "ratio": round(first / max(second, 1e-9), 1)}))


if __name__ == "__main__":
    main()
