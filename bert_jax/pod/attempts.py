"""What the supervisor keeps in the workdir about itself: `attempts.jsonl`, and the lease that makes
it the only supervisor of that workdir.

**attempts.jsonl**, one JSON line per event (an attempt's start and end, a failure, a recreation, a
create that failed, a rollback the run made, maintenance announced, the end of supervision), each
with a unique `id`. A line is never lost and never written twice: it is queued for the workdir and
copied at once into a local spool file (`$BERT_JAX_CACHE_DIR/supervisor/<workdir hash>.pending`);
each flush appends what is queued through `storage_atomic.Appender` (which knows whether a failed
append landed), and empties the spool once it did. A bucket outage delays lines, it never drops
them; a supervisor killed with lines queued sends them when it starts again, except those whose
`id` the file already holds.

**The lease** (`supervisor.lease`): a small JSON object naming the supervisor that holds the
workdir (host, pid, since) and when it last renewed it (`heartbeat`). It is created only if absent
and renewed only if unchanged since it was read (`storage_atomic.write_versioned`: a generation
precondition on Cloud Storage), from a thread of its own every `interval` seconds, so that a long
gcloud call of the supervisor's never lets it go stale. A second supervisor on the same workdir
refuses to start and names the first; it may take the lease over (`--takeover`) once the heartbeat
is older than `stale_after`, or at once when the holder ran on this machine and its process is
gone (a supervisor restarted by systemd after a crash). A holder whose lease was taken over sees it
at its next renewal and stops.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Callable, Optional

from bert_jax.pod import calls
from data_pipeline import storage
from data_pipeline.storage import atomic as storage_atomic


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def local_state_dir() -> str:
    """The supervisor's local folder (spooled lines, the project snapshots it ships)."""
    cache = os.environ.get("BERT_JAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "bert_jax")
    return os.path.join(cache, "supervisor")


class Attempts:
    """The workdir's `attempts.jsonl`: every line read at start, every line written once."""

    def __init__(self, path: str, io: calls.Storage, log: Callable[[str], None]):
        self.path, self._io, self._log = path, io, log
        self.rows: list[dict] = []
        self._appender = storage_atomic.Appender(path)
        self._pending: list[dict] = []  # queued, not known to have landed
        self._failing = False  # the last flush could not reach storage
        key = hashlib.sha256(path.encode()).hexdigest()[:16]
        self._spool = os.path.join(local_state_dir(), f"{key}.pending")

    def load(self) -> list[dict]:
        """Reads the file (raises `calls.Unavailable` when storage cannot be reached), then queues
        the lines a previous supervisor spooled and never sent."""
        try:
            text = self._io.call(f"reading {self.path}", storage.read_text, self.path)
        except FileNotFoundError:
            text = ""
        self.rows = []
        for line in text.splitlines():
            try:
                self.rows.append(json.loads(line))
            except ValueError:  # a torn line cannot happen (appends are whole); a hand edit can
                self._log(f"{self.path}: skipping a line that is not JSON: {line[:200]!r}")
        known = {row.get("id") for row in self.rows}
        for row in self._spooled():
            if row.get("id") not in known:
                self._queue(row)
                self.rows.append(row)
        return self.rows

    def record(self, **fields) -> dict:
        """Queues one line (with `id` and `time`), spools it, and sends what is queued, unless the
        last try failed (the next `flush`, once a poll, tries again: an outage does not slow each
        line by the storage calls' time limit)."""
        row = {"id": uuid.uuid4().hex[:12], "time": now_iso(), **fields}
        self.rows.append(row)
        self._queue(row)
        if not self._failing:
            self.flush()
        return row

    def flush(self) -> bool:
        """Sends what is queued; False (logged) when storage cannot be reached: it stays queued."""
        if not self._pending:
            return True
        try:
            self._io.call(f"appending to {self.path}", self._appender.flush)
        except calls.Unavailable as e:
            self._failing = True
            self._log(f"{len(self._pending)} line(s) of {self.path} wait for storage: {e}")
            return False
        self._failing = False
        self._pending.clear()
        self._write_spool()
        return True

    def _queue(self, row: dict) -> None:
        self._pending.append(row)
        self._appender.add((json.dumps(row) + "\n").encode())
        self._write_spool()

    def _spooled(self) -> list[dict]:
        try:
            return [json.loads(line) for line in storage.read_text(self._spool).splitlines() if line.strip()]
        except (OSError, ValueError):
            return []

    def _write_spool(self) -> None:
        try:
            storage.write_bytes(self._spool, "".join(json.dumps(r) + "\n" for r in self._pending).encode(), fsync=True)
        except OSError as e:
            self._log(f"could not spool pending lines to {self._spool}: {e}")


class LeaseHeld(Exception):
    """Another supervisor holds the workdir."""


def _alive_here(pid: int) -> bool:
    """Whether a supervisor process `pid` runs on this machine."""
    try:
        return b"supervisor" in storage.read_bytes(f"/proc/{pid}/cmdline")
    except OSError:
        return False


class Lease:
    """One supervisor per workdir: acquire at start, renewed in the background, released at exit."""

    def __init__(self, path: str, *, interval: float, stale_after: float, log: Callable[[str], None]):
        self.path, self.interval, self.stale_after, self._log = path, interval, stale_after, log
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "since": now_iso(), "token": uuid.uuid4().hex}
        self._version: Optional[storage_atomic.Version] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[str] = None  # why the lease is no longer ours (set by the renewing thread)

    def _body(self) -> bytes:
        return json.dumps({**self.me, "heartbeat": now_iso(), "heartbeat_unix": time.time()}).encode()

    def acquire(self, takeover: bool = False) -> None:
        """Takes the lease, or raises `LeaseHeld` naming its holder (OSError/TimeoutError when
        storage cannot be reached: the caller retries)."""
        data, version = storage_atomic.read_versioned(self.path)
        if data is not None:
            holder = self._parse(data)
            age = time.time() - float(holder.get("heartbeat_unix") or 0)
            gone_here = holder.get("host") == self.me["host"] and not _alive_here(int(holder.get("pid") or 0))
            if not (holder.get("released") or gone_here or (takeover and age > self.stale_after)):
                hint = ("start again with --takeover to take it over" if age > self.stale_after else
                        f"--takeover can take it over once its heartbeat is older than {self.stale_after:.0f} s")
                raise LeaseHeld(f"{self.path}: another supervisor holds this workdir: host {holder.get('host')}, "
                                f"pid {holder.get('pid')}, since {holder.get('since')}, last heartbeat {age:.0f} s ago; "
                                f"stop it first, or {hint}")
            if not holder.get("released"):
                self._log(f"taking over the lease of host {holder.get('host')} pid {holder.get('pid')} "
                          f"(heartbeat {age:.0f} s ago{', its process is gone' if gone_here else ''})")
        try:
            self._version = storage_atomic.write_versioned(self.path, self._body(), version)
        except storage_atomic.VersionChanged:
            raise LeaseHeld(f"{self.path}: another supervisor took this workdir at the same moment") from None
        self._thread = threading.Thread(target=self._renew_loop, name="supervisor-lease", daemon=True)
        self._thread.start()

    @staticmethod
    def _parse(data: bytes) -> dict:
        try:
            return json.loads(data)
        except ValueError:
            return {}

    def renew(self) -> None:
        """One heartbeat; sets `lost` when another supervisor holds the lease now."""
        try:
            self._version = storage_atomic.write_versioned(self.path, self._body(), self._version)
        except storage_atomic.VersionChanged:
            try:
                holder = self._parse(storage_atomic.read_versioned(self.path)[0] or b"{}")
            except Exception:  # pylint: disable=broad-except
                holder = {}
            self.lost = (f"the lease {self.path} was taken over by host {holder.get('host')} pid {holder.get('pid')}"
                         if holder.get("token") != self.me["token"] else None)
            if self.lost is None:  # our own write landed but its reply was lost: read back our version
                self._version = storage_atomic.read_versioned(self.path)[1]
        except Exception as e:  # pylint: disable=broad-except  # an outage: the next heartbeat tries again
            self._log(f"could not renew the lease {self.path}: {type(e).__name__}: {str(e)[:200]}")

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.renew()
            if self.lost:
                return

    def release(self) -> None:
        """Marks the lease released (the next supervisor starts at once); best effort."""
        self._stop.set()
        if self.lost or self._version is None:
            return
        try:
            storage_atomic.write_versioned(self.path, json.dumps({**self.me, "released": True,
                                                                  "released_at": now_iso()}).encode(), self._version)
        except Exception as e:  # pylint: disable=broad-except
            self._log(f"could not release the lease {self.path}: {type(e).__name__}: {str(e)[:200]}")
