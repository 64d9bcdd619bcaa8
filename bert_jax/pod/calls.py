"""Every call of the supervisor's that can hang or fail, bounded in time and retried.

A supervisor meant to outlive a weekend meets a bucket that stalls, gcloud calls that time out and
SSH sessions that hang. None of them may stop it, and none may hold it forever:

- **Child processes** (`run`: gcloud, `launch/tpu_pod.sh`) run in a process group of their own;
  past their limit the whole group is killed (the shell, gcloud, its ssh and scp: not only the
  shell, which would leave them behind), and the call answers as a failed one, exit code 124.
- **Storage** (`Storage`): every read and write of the workdir goes through one thread of its
  own, one call at a time, and the supervisor waits for each at most `timeout` seconds. A failed
  call is tried again with backoff (`tries`, 1 s doubling); one still failing, or still running
  past the limit, raises `Unavailable`, which the supervisor's poll takes as "the bucket cannot be
  reached now" (never as an error of its own). A call left running past its limit (a stalled
  connection) keeps the thread until it returns; meanwhile the next calls fail at once, so no queue
  of calls builds up behind it. One thread also means no two writes of a file race (the appends of
  `attempts.jsonl` rely on it).

No jax here: the supervisor needs Python, gcloud and `data_pipeline.storage`.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import threading
import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def run(argv: list[str], timeout: float, env: Optional[dict] = None, cwd: Optional[str] = None
        ) -> subprocess.CompletedProcess:
    """Runs `argv` to its end or for at most `timeout` seconds; past it, its whole process group is
    killed and the answer is exit code 124 (stderr says so). Never raises for the command's sake."""
    try:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as e:  # no such program, no permission
        return subprocess.CompletedProcess(argv, 127, stdout="", stderr=f"{argv[0]}: {e}")
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(argv, proc.returncode, stdout=out, stderr=err)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a child holding the pipes open outside the group
            out, err = "", ""
        return subprocess.CompletedProcess(
            argv, 124, stdout=out or "",
            stderr=f"{err or ''}\n{os.path.basename(argv[0])} {' '.join(argv[1:3])}: killed after {timeout:.0f} s")


def kill_group(pgid: int) -> None:
    """SIGKILL to every process of a group (those that left it with setsid, as a detached run does, stay)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Unavailable(Exception):
    """Storage could not be reached in time (the call failed every try, or is still running)."""


class Storage:
    """Bounded, retried calls of `data_pipeline.storage`-style functions, one at a time in one thread.

    Args:
        timeout: how long the caller waits for one try.
        tries: tries per call; `FileNotFoundError` is an answer, not a failure, and is raised at once.
        backoff: seconds before the second try, doubling for each next one.
        sleep: what waits between tries (tests replace it).
    """

    def __init__(self, timeout: float = 120.0, tries: int = 3, backoff: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.timeout, self.tries, self.backoff, self._sleep = timeout, max(1, tries), backoff, sleep
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="supervisor-storage")
        self._lock = threading.Lock()
        self._busy: Optional[tuple[str, float, concurrent.futures.Future]] = None  # a call past its limit

    def call(self, what: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` in the storage thread; raises `Unavailable` naming `what` when it
        cannot be done in `tries` tries of at most `timeout` seconds each."""
        if threading.current_thread().name.startswith("supervisor-storage"):
            raise RuntimeError(f"{what}: a storage call made from the storage thread would wait for itself")
        last = None
        for attempt in range(self.tries):
            if attempt:
                self._sleep(self.backoff * 2 ** (attempt - 1))
            with self._lock:
                if self._busy is not None and not self._busy[2].done():
                    raise Unavailable(f"{what}: the storage thread is still waiting on {self._busy[0]} "
                                      f"({time.monotonic() - self._busy[1]:.0f} s)")
                future = self._pool.submit(fn, *args, **kwargs)
                started = time.monotonic()
            try:
                return future.result(timeout=self.timeout)
            except FileNotFoundError:
                raise
            except Exception as e:  # pylint: disable=broad-except  # an outage looks like anything
                if not future.done():  # (the wait timed out: `fn` raising TimeoutError is another case)
                    with self._lock:
                        self._busy = (what, started, future)
                    raise Unavailable(f"{what}: no answer within {self.timeout:.0f} s") from None
                last = e
        raise Unavailable(f"{what}: {type(last).__name__}: {str(last)[:300]}") from last

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
