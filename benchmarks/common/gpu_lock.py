"""One GPU, several benchmark processes: a `flock` held while a process times (`--gpu_lock`), and
one held until a process exits (`--slot_lock`: its memory is gone when the next one starts).
Used by benchmarks.step.fp8 and benchmarks.kernels.fused_layernorm."""

from __future__ import annotations

import time

from benchmarks.step import timing


class Lock:
    """`flock` on `path` for the duration of a `with` (no-op without a path)."""

    def __init__(self, path: str):
        self.path, self.file = path, None

    def __enter__(self):
        if self.path:
            import fcntl
            self.file = open(self.path, "a+")
            t0 = time.perf_counter()
            fcntl.flock(self.file, fcntl.LOCK_EX)
            if time.perf_counter() - t0 > 0.5:
                timing.log(f"waited {time.perf_counter() - t0:.1f} s for {self.path}")
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()  # releases the lock
            self.file = None


_HELD: list = []  # open lock files, released when the process exits


def hold_until_exit(path: str) -> None:
    """Takes the lock on `path` (if any) and keeps it until the process, and its memory, are gone."""
    if path:
        _HELD.append(Lock(path).__enter__())
