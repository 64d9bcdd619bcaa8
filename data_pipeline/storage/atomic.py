"""Storage writes that land whole or not at all, and appends that land once: local and gs://.

A reader of a file bert_jax writes sees the old content or the new, never a part, and a write that
fails leaves the old content: locally a temporary file in the same folder, renamed into place
(`os.replace`); on Cloud Storage one upload (a single-object upload is atomic: the object appears
only once its upload completes). `storage.open` hands out the file objects here for its "w" modes,
and `storage.write_bytes` writes local files through `write_local`.

Object stores have no append: `append_text` and `Appender` compose a new object from the old one
and the appended part, under a generation precondition, and check after a failure whether it
landed: no byte is appended twice.

Compare-and-swap: `read_versioned` and `write_versioned` replace a small file only if it is still
the version that was read (a generation precondition remote, a lock and the file's identity
locally): what a lease needs, so that of two writers racing for one file exactly one wins.

Of the storage modules it imports `paths` and `gcs` (`data_pipeline.storage`
imports it); neither jax nor TensorFlow.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile
import time
from typing import IO, Optional, Union

from data_pipeline.storage.gcs import filesystem
from data_pipeline.storage.paths import is_remote, local_path, object_key


# ---------------------------------------------------------------------------------------------
# Whole or nothing
# ---------------------------------------------------------------------------------------------


class WholeOrNothing:
    """A file open for writing whose content appears whole when the `with` block ends (or
    `close()` is called), or not at all when the block raises (`abort()`): whatever was there
    before stays. Reads and writes go to the file object `self._f`."""

    _f: IO

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class LocalWrite(WholeOrNothing):
    """Local: written under a temporary name in the same folder, renamed into place on close."""

    def __init__(self, path: str, mode: str, **text_args):
        self._path = path
        folder = os.path.dirname(os.path.abspath(path))
        fd, self._tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
        os.close(fd)
        if "b" in mode:
            self._f = builtins.open(self._tmp, "wb")
        else:
            self._f = builtins.open(self._tmp, "w", encoding=text_args.get("encoding") or "utf-8",
                                    newline=text_args.get("newline"), errors=text_args.get("errors"))

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.close()
        os.chmod(self._tmp, 0o644)
        os.replace(self._tmp, self._path)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)


class Upload(WholeOrNothing):
    """Remote: the object is created when the upload completes on close; an aborted upload is
    discarded (a plain fsspec file would upload the part written when its block raises)."""

    def __init__(self, raw, text=None):
        self._raw, self._text = raw, text
        self._f = text if text is not None else raw

    def close(self) -> None:
        self._f.close()

    def abort(self) -> None:
        if self._raw.closed:
            return
        if self._text is not None:
            self._text.detach()  # its buffered characters go to `raw`, which is then dropped
        self._raw.discard()  # cancels a started resumable upload; nothing was sent otherwise
        self._raw.closed = True


def write_local(local: str, data: bytes, *, fsync: bool = False) -> None:
    """Writes the local file `local` (a `storage_paths.local_path`) whole: a temporary file beside
    it, then `os.replace`, so that readers see the old content or the new, never a part (with
    `fsync`, flushed to disk first). Its folder is created if absent."""
    folder = os.path.dirname(os.path.abspath(local))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(local)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, local)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------------------------
# Appends
# ---------------------------------------------------------------------------------------------


def append_text(path, text: str, encoding: str = "utf-8") -> None:
    """Appends to a file (created if absent), once (see `Appender`). Remote: the new part is
    uploaded and composed onto the object server-side (no download of what is there); the object
    is replaced whole."""
    appender = Appender(path)
    appender.add(text.encode(encoding))
    appender.flush()


@dataclasses.dataclass(frozen=True)
class _Attempt:
    """A write of `data` onto an object that may have landed: the generation it was conditioned
    on (0: the object was absent) and the object's size then."""

    generation: int
    size: int
    data: bytes


class Appender:
    """Appends to one file, local or remote, with no byte lost or written twice across retries.

    `add` queues bytes; `flush` tries once to write all that is queued and raises if it cannot,
    keeping it queued: call `flush` again to retry, or `discard` to give it up. One thread at a time.

    Remote, where an append is a compose: the queued bytes are uploaded as a part object and
    composed onto the file with `ifGenerationMatch` = the generation they were composed onto (a
    new file is uploaded with `ifGenerationMatch=0`), so each compose can land at most once. A
    flush that failed (a timeout, a lost reply) may still have landed, so the next one first looks:
    if the object's bytes from the old size on are the bytes it sent, they landed and only what
    was queued after them is sent. A precondition failure (HTTP 412, `FileExistsError`) is
    resolved the same way: gcsfs resends a request whose reply was lost, and the resent compose
    fails the precondition when the first one landed. fake-gcs-server enforces `ifGenerationMatch`
    on uploads but not on composes (checked): there a compose still in flight on the server when
    its reply timed out can land after the check and duplicate its bytes; on Cloud Storage the
    precondition rejects it. Writes of one file come from one process (host 0's logs).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self._queued = bytearray()
        self._unresolved: list[_Attempt] = []  # sent, not known to have landed, could still land
        self._known: Optional[tuple[int, int]] = None  # (generation, size) after our last write
        self._parts: list[str] = []  # part objects to delete

    @property
    def queued(self) -> bytes:
        return bytes(self._queued)

    def add(self, data: bytes) -> None:
        self._queued += data

    def discard(self) -> bytes:
        """Gives up what is queued (a send of it in flight may still land); returns it."""
        dropped, self._queued = bytes(self._queued), bytearray()
        self._unresolved.clear()
        self._known = None
        return dropped

    def flush(self) -> None:
        """Writes everything queued; raises (OSError, TimeoutError) with it still queued."""
        if not self._queued:
            return
        if not is_remote(self.path):
            local = local_path(self.path)
            os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
            with builtins.open(local, "ab") as f:
                f.write(self._queued)
            self._queued.clear()
            return
        fs, key = filesystem(self.path), object_key(self.path)
        state = self._resolve(fs, key) if self._unresolved else self._known or _generation_and_size(fs, key)
        for _ in range(3):  # a precondition lost to another writer: compose again onto its object
            if not self._queued:
                return
            attempt = _Attempt(state[0], state[1], bytes(self._queued))
            self._unresolved.append(attempt)
            try:
                self._known = self._send(fs, key, attempt)
            except FileExistsError:  # 412: this compose's precondition no longer holds
                state = self._resolve(fs, key)
                continue
            del self._queued[:len(attempt.data)]
            self._unresolved.clear()
            self._delete_parts(fs)
            return
        raise OSError(f"{self.path}: the object kept changing under the append (another writer?)")

    def _send(self, fs, key: str, attempt: _Attempt) -> Optional[tuple[int, int]]:
        """Writes `attempt`; the object's (generation, size) after it, when the reply says."""
        if attempt.generation == 0:
            fs.pipe_file(key, attempt.data, mode="create")  # ifGenerationMatch=0
            return None
        part = f"{key}.append-{os.getpid()}-{time.time_ns()}"
        self._parts.append(part)
        fs.pipe_file(part, attempt.data)
        bucket, name = key.split("/", 1)
        out = fs.call("POST", "b/{}/o/{}/compose", bucket, name, ifGenerationMatch=str(attempt.generation),
                      headers={"Content-Type": "application/json"}, json_out=True,
                      json={"kind": "storage#composeRequest", "destination": {"name": name, "bucket": bucket},
                            "sourceObjects": [{"name": name}, {"name": part.split("/", 1)[1]}]})
        return int(out["generation"]), int(out["size"])

    def _resolve(self, fs, key: str) -> tuple[int, int]:
        """Settles the unresolved sends against the object as it is: removes from the queue the
        bytes of the one that landed, if one did. Returns the object's (generation, size)."""
        generation, size = _generation_and_size(fs, key)
        for attempt in sorted(self._unresolved, key=lambda a: len(a.data), reverse=True):  # A+B before A
            end = attempt.size + len(attempt.data)
            if generation != attempt.generation and size >= end and \
                    fs.cat_file(key, start=attempt.size, end=end) == attempt.data:
                del self._queued[:len(attempt.data)]
                self._unresolved.clear()
                break
        # A send conditioned on an older generation can no longer land; one on this one still can.
        self._unresolved = [a for a in self._unresolved if a.generation == generation]
        self._known = None
        return generation, size

    def _delete_parts(self, fs) -> None:
        """Deletes the part objects of this file's earlier sends; one that fails waits for the next."""
        kept = []
        for part in self._parts:
            try:
                fs.rm_file(part)
            except FileNotFoundError:
                pass
            except Exception:  # pylint: disable=broad-except  # litter, not an error of the append
                kept.append(part)
        self._parts = kept[-64:]


def _generation_and_size(fs, key: str) -> tuple[int, int]:
    """(generation, size) of an object; (0, 0) when there is none."""
    try:
        info = fs.info(key)
    except FileNotFoundError:
        return 0, 0
    return int(info.get("generation") or 0), int(info["size"])


# ---------------------------------------------------------------------------------------------
# Compare-and-swap
# ---------------------------------------------------------------------------------------------

# What identifies one version of a file: the object's generation (remote); locally its inode,
# size and modification time (every write replaces the file, so a new inode).
Version = Union[int, str]


class VersionChanged(FileExistsError):
    """`write_versioned`'s precondition failed: the file is no longer the version it was given."""


def read_versioned(path) -> tuple[Optional[bytes], Optional[Version]]:
    """(content, version) of a file; (None, None) when there is none."""
    path = os.fspath(path)
    if is_remote(path):
        fs, key = filesystem(path), object_key(path)
        try:
            generation = int(fs.info(key).get("generation") or 0)
            # The bytes of that generation, not of one written since the info.
            return fs.cat_file(key, generation=generation), generation
        except FileNotFoundError:
            return None, None
    local = local_path(path)
    with _locked(local):
        return _read_local(local)


def write_versioned(path, data: bytes, expected: Optional[Version]) -> Version:
    """Writes `path` whole if it is still version `expected` (None: if it does not exist); returns
    the new version. Raises `VersionChanged` when another writer got there first."""
    path = os.fspath(path)
    if not is_remote(path):
        local = local_path(path)
        with _locked(local):
            if _read_local(local)[1] != expected:
                raise VersionChanged(f"{path} changed since it was read (expected version {expected})")
            write_local(local, data, fsync=True)
            return _read_local(local)[1]
    fs, key = filesystem(path), object_key(path)
    bucket, name = key.split("/", 1)
    # One multipart upload with ifGenerationMatch (0: only if absent), made as gcsfs makes its own:
    # Cloud Storage answers 412, which gcsfs raises as FileExistsError, when the object is no longer
    # that generation (fake-gcs-server enforces it on multipart uploads, not on media ones).
    boundary = b"--==0=="
    body = b"\n".join([boundary, b"Content-Type: application/json; charset=UTF-8", b"",
                       json.dumps({"name": name}).encode(), boundary, b"Content-Type: application/octet-stream",
                       b"", bytes(data), boundary + b"--"])
    try:
        out = fs.call("POST", f"{fs._location}/upload/storage/v1/b/{bucket}/o",  # pylint: disable=protected-access
                      uploadType="multipart", ifGenerationMatch=str(expected or 0), data=body, json_out=True,
                      headers={"Content-Type": 'multipart/related; boundary="==0=="'})
    except FileExistsError as e:
        raise VersionChanged(f"{path} changed since it was read (expected generation {expected or 0})") from e
    return int(out["generation"])


@contextlib.contextmanager
def _locked(local: str):
    """An exclusive lock beside a local file (`<file>.lock`) for its read-compare-write."""
    os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
    with builtins.open(local + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_local(local: str) -> tuple[Optional[bytes], Optional[str]]:
    try:
        with builtins.open(local, "rb") as f:
            st = os.fstat(f.fileno())
            return f.read(), f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"
    except FileNotFoundError:
        return None, None
