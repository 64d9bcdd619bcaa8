"""Host memory on CPU-only machines: freed buffers stay in the process for the next step.

XLA's CPU backend allocates each execution's temporary buffer with `malloc` and frees it when the
execution ends: 1.45 GB for BERT-Base's training step (batch 8, length 128). glibc serves every
block above 32 MB (and every large block of a worker thread's own arena, whatever the settings)
with a fresh `mmap`, and unmaps it on `free`, so each step starts on untouched memory that the
kernel faults in page by page: ~357,000 page faults and ~1 s of kernel time per BERT-Base step on
two cores, ~12% of the CPU time a run spends (`benchmarks/finetune/RESULTS.md`, "Page faults").

`keep_freed_memory()` tells glibc, through `mallopt`, to serve large blocks from the one main
heap (one arena: worker threads included) and to keep what is freed there: from the second step
on, the step reuses its pages. The process's peak memory is unchanged (the step needs the
buffer either way; 3.74 against 3.76 GB for the BERT-Base step); it is returned to the system at
exit rather than after every step. The cost, measured: the phases that compile run slower
(fine-tuning steps 1.20-1.26× faster, its compile phases 6-11 s slower in all), likely because
XLA's compiler threads now share the one arena's lock.

`python -m bert_jax.main` applies it before any computation when the machine has no accelerator
(`config.keep_freed_host_memory`: "auto", "true", "false"), and never over a user's own `MALLOC_*`
settings, which glibc has already read from the environment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

from data_pipeline import storage

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
M_ARENA_MAX = -8

TOP_PAD = 128 << 20  # the heap grows 128 MB past each request: fewer brk calls
TRIM_THRESHOLD = -1  # mallopt's int becomes glibc's size_t: the largest, i.e. never trim the heap's top

ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd")


def has_accelerator() -> bool:
    """Whether JAX will run on something other than the CPU here, decided without starting JAX
    (its backends start threads, and threads pick their malloc arena at their first allocation).
    `JAX_PLATFORMS` decides when set; otherwise the device files of NVIDIA and AMD GPUs and Cloud
    TPUs (`/dev/accel*`, `/dev/vfio/*`)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return any(p.strip() not in ("", "cpu") for p in platforms.split(","))
    return any(storage.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def user_malloc_settings() -> list:
    """The `MALLOC_*` environment variables (and glibc tunables) the user set: theirs to keep."""
    return sorted(k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep and reuse freed large blocks; True if it did (glibc on Linux)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def configure(setting) -> str:
    """Applies `config.keep_freed_host_memory` ("auto", "true", "false"; booleans too).

    Returns what was done, for the log. Call before JAX starts its backend."""
    setting = str(setting).strip().lower()
    if setting not in ("auto", "true", "false"):
        raise ValueError(f"config.keep_freed_host_memory must be 'auto', 'true' or 'false', got {setting!r}")
    if setting == "false":
        return "off (config.keep_freed_host_memory=false)"
    if setting == "auto":
        if has_accelerator():
            return "off: an accelerator is present (config.keep_freed_host_memory=auto)"
        theirs = user_malloc_settings()
        if theirs:
            return f"off: the environment sets {', '.join(theirs)}"
    if not keep_freed_memory():
        return "off: not glibc on Linux"
    return "on: one heap, large blocks kept for reuse (config.keep_freed_host_memory)"
