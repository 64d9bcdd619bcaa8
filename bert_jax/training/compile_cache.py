"""Compiled programs kept on disk between runs: `config.compilation_cache`.

XLA compiles every program a run executes: each training length, each evaluation length, the
initialization. Fine-tuning all-MiniLM-L6-v2 on 2,000 SST-2 rows on two CPU cores spends ~50 s of
its ~135 s compiling, and a run on a TPU or GPU spends a minute or more compiling BERT-Large
before its first step. A second run with the same shapes and hyper-parameters (another seed, a
resumed or restarted run, a rerun with more epochs of evaluation) compiles the same programs
again. JAX's persistent compilation cache keeps them: a program found there is loaded in a
fraction of a second instead of compiled (`benchmarks/finetune/RESULTS.md`, "Compilation cache").

`configure(value)` sets it up before anything compiles (`python -m bert_jax.main` calls it):
- "auto" (the default): JAX's own setting when the environment or the caller gave one
  (`JAX_COMPILATION_CACHE_DIR`), else `xla/` in bert_jax's cache folder (`$BERT_JAX_CACHE_DIR`,
  default `~/.cache/bert_jax`), kept under `AUTO_MAX_BYTES` (JAX drops the least recently used
  programs past it);
- "off": no cache, whatever the environment says;
- any other value: that folder (local or gs://), unbounded.

Every program enters the cache (JAX's own default keeps only those that took 1 s or more to
compile; `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` in the environment still decides). The key is the program itself with the compiler's version, flags and
devices, so a cached program is what the compiler would build: results are identical to the bit
(tested). `CacheStats` counts what a run found there; the run's last log line says it.
"""

from __future__ import annotations

import importlib.util
import os
import threading

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths, staging as storage_staging

AUTO_MAX_BYTES = 4 << 30  # "auto": at most 4 GiB on disk, least recently used programs dropped first
OFF = ("off", "false", "none", "no")


def configure(value: str) -> str:
    """Point JAX's persistent compilation cache at `value`'s folder; returns what was done, for the log.

    Raises ValueError (naming `config.compilation_cache`) when an explicitly given folder cannot
    be created; with "auto", a folder that cannot be created turns the cache off, with a message."""
    import jax

    value = str(value if value is not None else "auto").strip()
    if value.lower() in OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return "off (config.compilation_cache)"
    if value == "" or value.lower() == "auto":
        own = jax.config.jax_compilation_cache_dir
        if own:
            return f"{own} (JAX's own setting: JAX_COMPILATION_CACHE_DIR or jax.config)"
        folder = storage_paths.join(storage_staging.cache_dir(), "xla")
        try:
            storage.makedirs(folder)
        except OSError as e:
            jax.config.update("jax_enable_compilation_cache", False)
            return f"off: cannot create {folder} ({e}); set config.compilation_cache to a writable folder"
        _use(folder)
        if importlib.util.find_spec("filelock") is None:  # JAX evicts under its file lock
            return f"{folder} (config.compilation_cache=auto; unbounded: install filelock to cap it)"
        jax.config.update("jax_compilation_cache_max_size", AUTO_MAX_BYTES)
        return f"{folder} (config.compilation_cache=auto, at most {AUTO_MAX_BYTES >> 30} GiB)"
    try:
        storage.makedirs(value)
    except (OSError, storage_paths.StorageError) as e:
        raise ValueError(f"config.compilation_cache={value!r}: cannot create the folder ({e}); "
                         "give a writable folder, 'auto' or 'off'") from None
    _use(value)
    return f"{value} (config.compilation_cache)"


def _use(folder: str) -> None:
    import jax

    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    # Every program, not only those over JAX's 1 s: the ones under it (initialization, metrics,
    # short evaluation programs) cost a warm run ~7 s more otherwise (87.0 against 80.1 s, MiniLM
    # on SST-2, 2 cores). A threshold set in the environment stays.
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class CacheStats:
    """Counts, from JAX's monitoring events, the programs that went through the persistent cache
    and those loaded from it, with the compile time those saved. Listens from `start()` on."""

    REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
    HITS = "/jax/compilation_cache/cache_hits"
    SAVED = "/jax/compilation_cache/compile_time_saved_sec"

    def __init__(self):
        self.requests = 0
        self.hits = 0
        self.saved_s = 0.0
        self._lock = threading.Lock()

    def start(self) -> "CacheStats":
        from jax import monitoring

        monitoring.register_event_listener(self._event)
        monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def _event(self, event: str, **_) -> None:
        with self._lock:
            if event == self.REQUESTS:
                self.requests += 1
            elif event == self.HITS:
                self.hits += 1

    def _duration(self, event: str, duration: float, **_) -> None:
        if event == self.SAVED:
            with self._lock:
                self.saved_s += max(duration, 0.0)

    def summary(self) -> str:
        return f"{self.hits} of {self.requests} programs loaded from it, {self.saved_s:.1f}s of compiling saved"
