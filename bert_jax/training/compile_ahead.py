"""Compiling a run's later programs ahead, on a background thread, while the run goes on.

A first fine-tuning run on a CPU spends much of its wall on XLA's compiler: the training step, then
the evaluation programs (one per batch length), each compiled when first called, with everything
else waiting. `CompileAhead` compiles programs the run will call later (`jit(f).lower(*abstract
args).compile()`) on one thread of its own while the main thread loads, trains or evaluates; the
compiled executable lands in jax's own caches, so the later call with arguments of the same shapes,
dtypes and shardings runs it without compiling again. The programs are the same, compiled earlier:
the results do not change, to the bit (tests/training/test_compile_ahead.py).

Before a call whose program may still be compiling, `wait(key)` waits for it (two threads compiling
the same program would do the work twice), compiling queued programs meanwhile. A program that
fails to compile ahead is logged and left to the call, which compiles it again and raises the error
where it always did.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Hashable, Iterable, Optional

import jax
import numpy as np


def signature(batch: dict) -> tuple:
    """A batch's program key: each array's name, shape and dtype."""
    return tuple(sorted((k, np.shape(v), str(np.asarray(v).dtype)) for k, v in batch.items()))


def global_abstract(batch: dict, process_count: int, sharding=None) -> dict:
    """The global batch's `ShapeDtypeStruct`s of one host's numpy batch (hosts hold equal slices of
    the leading axis), with the `sharding` the call's arrays will have: a program's cache key
    includes its inputs' shardings."""
    return {k: jax.ShapeDtypeStruct((v.shape[0] * process_count, *v.shape[1:]), v.dtype, sharding=sharding)
            for k, v in batch.items()}


class CompileAhead:
    """One background thread compiling programs by key (module docstring).

    `context`: entered around each compile on any thread that compiles ahead (the mesh, flax's
    logical axis rules: thread-local settings the lowering reads). `enabled=False` does nothing:
    every program then compiles at its first call, as without this class.

    Two kinds of work: `submit_each` runs on the background thread in the order given (the
    training step's shapes, needed first); `queue_each` queues programs any idle thread may take:
    the background thread once its own work is done, or a thread in `wait` for a program still
    compiling (on a 2-core CPU the main thread, idle while the training step compiles on the other
    core, compiles the evaluation programs meanwhile instead of leaving them to contend with the
    training steps later)."""

    def __init__(self, enabled: bool = True, context: Callable[[], Any] = contextlib.nullcontext):
        self.enabled = enabled
        self._context = context
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile_ahead")
                      if enabled else None)
        self._futures: dict = {}
        self._pending: collections.deque = collections.deque()  # (key, jitted, args, future) any thread may take
        self._lock = threading.Lock()
        self.compiled: list = []  # (key, seconds) of each program compiled ahead, in order
        self.waited_s = 0.0  # how long the run waited, idle, for a program still compiling

    def submit_each(self, name: str, jitted, fixed_args: tuple, batches: Iterable, process_count: int = 1,
                    limit: Optional[int] = None, sharding=None) -> None:
        """On the background thread: walks `batches` (one host's numpy batches, as the run will make
        them) and compiles `jitted(*fixed_args, batch)` for each batch signature not seen before
        (keys `(name, signature)`), up to `limit` programs; `sharding`: the global batches'."""
        if not self.enabled:
            return

        def walk():
            seen = 0
            for batch in batches:
                key, future = self._claim(name, batch)
                if future is None:
                    continue
                future.set_running_or_notify_cancel()
                self._run(key, jitted, (*fixed_args, global_abstract(batch, process_count, sharding)), future)
                seen += 1
                if limit is not None and seen >= limit:
                    return

        self._pool.submit(self._guarded, walk)

    def queue_each(self, name: str, jitted, fixed_args: tuple, batches: Iterable, process_count: int = 1,
                   sharding=None) -> None:
        """Queues `jitted(*fixed_args, batch)` for each batch signature of `batches` not seen before
        (walked here, now): compiled by the background thread after its own work, or by a thread
        waiting in `wait`."""
        if not self.enabled:
            return
        for batch in batches:
            key, future = self._claim(name, batch)
            if future is not None:
                args = (*fixed_args, global_abstract(batch, process_count, sharding))
                with self._lock:
                    self._pending.append((key, jitted, args, future))
        self._pool.submit(self._guarded, self._drain)

    def wait(self, key: Hashable) -> None:
        """Returns once `key`'s program is compiled (or failed: logged, the call compiles it); at
        once for a key never submitted. While it compiles, this thread compiles queued programs."""
        with self._lock:
            future = self._futures.get(key)
        if future is None:
            return
        while not future.done():
            job = self._take()
            if job is None:
                started = time.perf_counter()
                concurrent.futures.wait([future])
                self.waited_s += time.perf_counter() - started
                break
            self._run(*job)
        if not future.cancelled() and future.exception() is not None:
            logging.warning("compiling %s ahead failed (%s): the call compiles it", key, future.exception())

    def close(self) -> None:
        """Stops: programs not started are dropped, one compiling finishes in the background."""
        if self._pool is not None:
            with self._lock:
                while self._pending:
                    self._pending.popleft()[-1].cancel()
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _claim(self, name: str, batch: dict) -> tuple:
        """`(key, a new future)` for `batch`'s program, now this thread's to compile or queue;
        `(key, None)` if another batch of its signature was claimed before."""
        key = (name, signature(batch))
        with self._lock:
            if key in self._futures:
                return key, None
            future = self._futures[key] = concurrent.futures.Future()
        return key, future

    def _take(self):
        with self._lock:
            while self._pending:
                job = self._pending.popleft()
                if job[-1].set_running_or_notify_cancel():
                    return job
        return None

    def _drain(self) -> None:
        while (job := self._take()) is not None:
            self._run(*job)

    def _run(self, key, jitted, abstract_args, future) -> None:
        try:
            future.set_result(self._compile(key, jitted, abstract_args))
        except BaseException as e:  # noqa: BLE001 (reported by wait; the call compiles again)
            future.set_exception(e)

    def _compile(self, key, jitted, abstract_args):
        started = time.perf_counter()
        with self._context():
            jitted.lower(*abstract_args).compile()
        seconds = time.perf_counter() - started
        self.compiled.append((key, seconds))
        logging.info("compiled ahead: %s in %.1fs on %s", key[0] if isinstance(key, tuple) else key, seconds,
                     threading.current_thread().name)

    @staticmethod
    def _guarded(fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 (a batch walk that fails only loses the head start)
            logging.exception("compiling ahead stopped")
