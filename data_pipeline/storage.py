"""Storage: every path a user gives, local or on Cloud Storage (gs://), through this one module.

bert_jax reads and writes local paths and `gs://bucket/...` paths, and nothing else: every file the
project touches (data, vocabularies, configs, checkpoints and their manifests, logs, TensorBoard
events, evaluation results, exports, predictions, plots) goes through the functions here, and no
other module calls `open`, `os.path.exists`, `os.makedirs`, `glob` or `shutil` on a user's path
(`tests/test_storage.py` scans for them).

Backends, and why:

- **Local paths**: Python's own file functions, with atomic writes (a temporary file in the same
  folder, fsync, `os.replace`).
- **gs://**: fsspec's `gcsfs`, the `[gcs]` extra. It is the client orbax's path library
  (`etils.epath`) uses for gs:// once `EPATH_USE_TF=false`, which this module sets unless the user
  set it: so our files and orbax's checkpoints go through one client, one credential chain (Google's
  application-default credentials: the TPU VM's service account) and one endpoint override
  (`STORAGE_EMULATOR_HOST`, which the tests point at a local fake-gcs-server). `tf.io.gfile` was the
  other candidate: its GCS client has no endpoint override, so nothing written through it could be
  tested off Google's cloud, and the model side of the project must run without TensorFlow.
  (orbax's array data goes through tensorstore's own GCS driver; its endpoint override is
  `TENSORSTORE_GCS_HTTP_URL`.)
- **What only TensorFlow or a C library reads or writes** (the tf.data record readers, TensorBoard
  event files, the tf.data iterator checkpoint, Google TF1 checkpoints): written into a local staging
  folder and uploaded through this module (`writing_dir`, `Mirror`), read from a local copy
  (`reading_dir`, `local_copy`). The one exception is the training records: `tf_path` gives
  TensorFlow the gs:// path itself (its own GCS client streams them on a pod), except when an
  endpoint override is set, which TensorFlow's client cannot follow: then the files are copied into
  the cache once.

Object-store semantics this module hides: no folders (`makedirs` is a no-op, a "folder" exists
while an object has its prefix), no append (`append_text` and `Appender` compose a new object from
the old one and the appended part, under a generation precondition, and check after a failure
whether it landed: no byte is appended twice), no rename (`rename` copies then deletes, per
object, server-side), and a single-object upload is atomic (a write is whole or absent, as
`write_bytes` is locally).

Time: every Cloud Storage request through gcsfs (ours, and orbax's metadata through etils.epath)
ends within `gcs_timeout()` (`$BERT_JAX_GCS_TIMEOUT`, 60 s; gcsfs's own default is none) or
raises `TimeoutError`, which gcsfs does not retry; the errors it retries get six tries, so a call
ends within 6 x the timeout + 36 s. Writes that only feed logs do not wait even that long on the
training step: `data_pipeline.log_writer` does them in the background.

A path with a scheme no backend handles (`s3://`, `hdfs://`, `ram://`, ...) or a gs:// path without
gcsfs installed is refused by `check` with the flag's name and the remedy, before anything runs; so
is a local path with a component such as `gs:` (a gs:// path that lost a slash to `os.path`): no
command of bert_jax creates a local folder named `gs:`.

Local-disk caches, all under `cache_dir()` (`$BERT_JAX_CACHE_DIR`, default `~/.cache/bert_jax`):
`files/` (copies of remote files read by TensorFlow or C code), `staging/` (TensorBoard events of a
remote workdir before upload). Temporary folders (`tempfile`) are removed when done.

This module imports neither jax nor TensorFlow (gcsfs only when a gs:// path is used).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import glob as _glob
import hashlib
import io
import json
import logging
import os
import posixpath
import re
import shutil
import tempfile
import threading
import time
from typing import IO, Iterator, Optional

GCS_TIMEOUT_ENV = "BERT_JAX_GCS_TIMEOUT"
GCS_TIMEOUT_S = 60.0  # gcsfs moves at most 50 MiB per request (bigger uploads go in chunks): >= 0.8 MiB/s


def gcs_timeout() -> Optional[float]:
    """Seconds one Cloud Storage request may take, all of it (`$BERT_JAX_GCS_TIMEOUT`, default 60;
    0 for none, gcsfs's own default).

    gcsfs's default is no limit: one stalled connection then blocks its caller forever (on a pod,
    host 0 in a log write while the others wait for it in the next collective, with no error). A
    request past the limit raises `TimeoutError` (fsspec's `FSTimeoutError`), which gcsfs does not
    retry; the errors it does retry (HTTP 408/429/5xx, dropped connections) get its fixed six tries
    with 1-16 s backoff, so one call ends within 6 x the timeout + 36 s. `read_bytes` fetches a
    whole object in one request: raise the limit to read a large one over a slow link.
    """
    value = os.environ.get(GCS_TIMEOUT_ENV, "").strip()
    try:
        seconds = float(value) if value else GCS_TIMEOUT_S
    except ValueError:
        raise ValueError(f"${GCS_TIMEOUT_ENV}={value!r}: not a number of seconds") from None
    return seconds if seconds > 0 else None


# orbax (etils.epath) then reaches gs:// through gcsfs, as this module does (see the docstring).
# Set before epath first resolves a gs:// backend; a value the user set wins.
os.environ.setdefault("EPATH_USE_TF", "false")
try:  # without a listings cache (tensorstore, other hosts and this module write beside it), and
    # with our request time limit for orbax's gcsfs too (its checkpoint metadata, `_fs` here)
    import fsspec.config as _fsspec_config
    for _protocol in ("gs", "gcs"):
        _fsspec_config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)
        _fsspec_config.conf[_protocol].setdefault("requests_timeout", gcs_timeout())
except ImportError:  # pragma: no cover - fsspec comes with orbax
    pass

REMOTE = {"gs": ("gcsfs", "gcs")}  # scheme -> (the module that serves it, the bert_jax extra)
URL_SCHEMES = ("http", "https")  # downloadable sources (checkpoint zips): only where a caller says so

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# A path component such as "gs:" or "s3:": what os.path.normpath/abspath leave of "gs://bucket".
_SCHEME_COMPONENT = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+:$")


class StorageError(ValueError):
    """A path bert_jax cannot read or write (unsupported scheme, missing backend, mangled URL)."""


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------


def scheme(path) -> Optional[str]:
    """"gs" for gs://bucket/x, None for a local path (file:// counts as local)."""
    m = _SCHEME.match(os.fspath(path))
    if m is None or m.group(1).lower() == "file":
        return None
    return m.group(1).lower()


def is_remote(path) -> bool:
    return scheme(path) is not None


def _strip_file(path: str) -> str:
    return path[len("file://"):] if path.lower().startswith("file://") else path


def check(path, what: str = "path", *, urls: bool = False) -> str:
    """The path, if bert_jax can use it; `StorageError` naming `what` (a flag or config key) otherwise.

    Accepted: local paths, and gs:// when gcsfs is installed; http(s):// only with `urls=True`
    (a caller that downloads, e.g. a checkpoint zip). Refused: other schemes, gs:// without gcsfs
    (the error names `pip install 'bert_jax[gcs]'`), and local paths with a component like `gs:`.
    """
    path = os.fspath(path)
    s = scheme(path)
    if s is None:
        _check_local(path, what)
        return path
    if s in URL_SCHEMES and urls:
        return path
    if s not in REMOTE:
        supported = "local paths and gs:// (Cloud Storage)" + (", or an http(s):// URL" if urls else "")
        raise StorageError(f"{what}={path}: '{s}://' paths are not supported; bert_jax reads and writes "
                           f"{supported}")
    module, extra = REMOTE[s]
    try:
        __import__(module)
    except ImportError:
        raise StorageError(f"{what}={path}: {s}:// paths need the {module} package, which is not installed: "
                           f"pip install 'bert_jax[{extra}]'") from None
    if not path[len(s) + 3:].split("/")[0]:
        raise StorageError(f"{what}={path}: no bucket name after '{s}://'")
    return path


def _check_local(path: str, what: str = "path") -> None:
    for part in _strip_file(path).split(os.sep):
        if _SCHEME_COMPONENT.match(part):
            raise StorageError(
                f"{what}={path}: the component {part!r} looks like a URL scheme that lost a slash "
                f"(e.g. 'gs:/bucket' for 'gs://bucket'); write it as {part}//... , or rename the local folder")


def abspath(path) -> str:
    """Local: absolute, `~` expanded; remote: unchanged (never `os.path.abspath` a URL)."""
    path = os.fspath(path)
    if is_remote(path):
        return path
    return os.path.abspath(os.path.expanduser(_strip_file(path)))


def join(path, *parts) -> str:
    path = os.fspath(path)
    if is_remote(path):
        return posixpath.join(path, *parts)
    return os.path.join(path, *parts)


def dirname(path) -> str:
    """The parent folder; for a remote path, never above its bucket (`gs://b` stays `gs://b`)."""
    path = os.fspath(path)
    if is_remote(path):
        path = path.rstrip("/")
        head = posixpath.dirname(path)
        return head if "://" in head and head.split("://", 1)[1] else path
    return os.path.dirname(path)


def basename(path) -> str:
    path = os.fspath(path)
    return posixpath.basename(path.rstrip("/")) if is_remote(path) else os.path.basename(path)


def relpath(path, start) -> str:
    path, start = os.fspath(path), os.fspath(start)
    if is_remote(path):
        return posixpath.relpath(_key(path), _key(start))
    return os.path.relpath(path, start)


def _key(path: str) -> str:
    """'bucket/object' of a gs:// path (fsspec's form)."""
    return path.split("://", 1)[1].rstrip("/")


def _url(key: str, s: str = "gs") -> str:
    return f"{s}://{key.lstrip('/')}"


def _local_path(path) -> str:
    path = _strip_file(os.path.expanduser(os.fspath(path)))
    _check_local(path)
    return path


# ---------------------------------------------------------------------------------------------
# The remote file system
# ---------------------------------------------------------------------------------------------


_FS_LOCK = threading.Lock()
_FS: dict = {}


def _fs(path):
    """The fsspec file system of a remote path (one per process and scheme; listings never cached:
    other processes and orbax's threads write under the same prefixes; each request limited to
    `gcs_timeout()`)."""
    s = scheme(path)
    key = (s, os.getpid())  # gcsfs holds an event loop thread: never reuse one across a fork
    with _FS_LOCK:
        if key not in _FS:
            check(os.fspath(path))
            if s == "gs":
                import gcsfs
                _FS[key] = gcsfs.GCSFileSystem(use_listings_cache=False, requests_timeout=gcs_timeout())
            else:  # pragma: no cover - check() refuses every other scheme
                raise StorageError(f"no backend for {path}")
        return _FS[key]


def _not_found(e: BaseException) -> bool:
    return isinstance(e, FileNotFoundError)


# ---------------------------------------------------------------------------------------------
# Queries
# ---------------------------------------------------------------------------------------------


def exists(path) -> bool:
    if is_remote(path):
        return _fs(path).exists(_key(os.fspath(path)))
    return os.path.exists(_local_path(path))


def isfile(path) -> bool:
    if is_remote(path):
        return _fs(path).isfile(_key(os.fspath(path)))
    return os.path.isfile(_local_path(path))


def isdir(path) -> bool:
    """Local: a directory. Remote: some object has this prefix (object stores have no folders)."""
    if is_remote(path):
        return _fs(path).isdir(_key(os.fspath(path)))
    return os.path.isdir(_local_path(path))


def listdir(path) -> list[str]:
    """Sorted names (not paths) in a folder; [] when there is no such folder (an object store
    cannot tell an empty folder from none)."""
    path = os.fspath(path)
    if is_remote(path):
        try:
            entries = _fs(path).ls(_key(path), detail=False)
        except FileNotFoundError:
            return []
        base = _key(path)
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != base})
    try:
        return sorted(os.listdir(_local_path(path)))
    except FileNotFoundError:
        return []


def glob(pattern) -> list[str]:
    """Sorted paths matching a glob (`*`, `?`, `[...]`; `**` spans folders)."""
    pattern = os.fspath(pattern)
    if is_remote(pattern):
        s = scheme(pattern)
        return sorted(_url(k, s) for k in _fs(pattern).glob(_key(pattern)))
    pattern = _local_path(pattern)
    return sorted(_glob.glob(pattern, recursive="**" in pattern))


def walk(root) -> Iterator[tuple[str, list[str], list[str]]]:
    """(folder, sub-folder names, file names) top-down as `os.walk`, both sorted; nothing if absent."""
    root = os.fspath(root)
    if is_remote(root):
        s = scheme(root)
        try:
            entries = _fs(root).walk(_key(root))
            for here, dirs, files in entries:
                yield _url(here, s), sorted(dirs), sorted(files)
        except FileNotFoundError:
            return
        return
    for here, dirs, files in os.walk(_local_path(root)):
        dirs.sort()
        yield here, dirs, sorted(files)


def files_info(root) -> dict[str, dict]:
    """{path relative to `root`: {"size", "md5" (hex, remote only), "crc32c" (remote), "generation"
    (remote, as `identity` gives it), "path"}} of every file under `root`, in one listing for a
    remote root; {} when there is none."""
    root = os.fspath(root)
    out = {}
    if is_remote(root):
        s = scheme(root)
        base = _key(root)
        try:
            found = _fs(root).find(base, detail=True)
        except FileNotFoundError:
            return {}
        for key, info in found.items():
            if info.get("type") == "directory" or not key.startswith(base + "/"):
                continue
            out[key[len(base) + 1:]] = {"size": int(info["size"]), "md5": _b64_hex(info.get("md5Hash")),
                                        "crc32c": _b64_hex(info.get("crc32c")), "path": _url(key, s),
                                        "generation": str(info.get("generation") or info.get("etag")
                                                          or info.get("updated"))}
        return out
    local = _local_path(root)
    for here, dirs, names in os.walk(local):
        dirs.sort()
        for name in names:
            p = os.path.join(here, name)
            out[os.path.relpath(p, local).replace(os.sep, "/")] = {"size": os.path.getsize(p), "path": p}
    return out


def _b64_hex(value: Optional[str]) -> Optional[str]:
    if not value:
        return None
    import base64
    return base64.b64decode(value).hex()


def getsize(path) -> int:
    if is_remote(path):
        return int(_fs(path).info(_key(os.fspath(path)))["size"])
    return os.path.getsize(_local_path(path))


def getmtime(path) -> float:
    if is_remote(path):
        info = _fs(path).info(_key(os.fspath(path)))
        when = info.get("mtime") or info.get("updated")
        if hasattr(when, "timestamp"):
            return when.timestamp()
        from datetime import datetime
        return datetime.fromisoformat(str(when).replace("Z", "+00:00")).timestamp()
    return os.path.getmtime(_local_path(path))


def identity(path) -> tuple:
    """What changes when a file is rewritten: (size, generation) remote, (size, mtime_ns) local."""
    if is_remote(path):
        info = _fs(path).info(_key(os.fspath(path)))
        return int(info["size"]), str(info.get("generation") or info.get("etag") or info.get("updated"))
    st = os.stat(_local_path(path))
    return st.st_size, st.st_mtime_ns


# ---------------------------------------------------------------------------------------------
# Reading and writing
# ---------------------------------------------------------------------------------------------


def open(path, mode: str = "r", encoding: Optional[str] = None, newline: Optional[str] = None,  # noqa: A001
         errors: Optional[str] = None) -> IO:
    """A file object, as `builtins.open`. Remote files: "r", "rb", "w", "wb" (a written object
    appears whole when the file is closed); "a" is refused (use `append_text`)."""
    path = os.fspath(path)
    if not is_remote(path):
        local = _local_path(path)
        if "w" in mode and "+" not in mode:
            return _LocalWrite(local, mode, encoding=encoding, newline=newline, errors=errors)
        if "b" in mode:
            return builtins.open(local, mode)
        return builtins.open(local, mode, encoding=encoding or "utf-8", newline=newline, errors=errors)
    if "a" in mode or "+" in mode:
        raise StorageError(f"{path}: mode {mode!r}: object stores cannot append or update in place "
                           f"(storage.append_text appends)")
    raw = _fs(path).open(_key(path), mode.replace("t", "").replace("b", "") + "b")
    text = None if "b" in mode else io.TextIOWrapper(raw, encoding=encoding or "utf-8", newline=newline,
                                                      errors=errors)
    if "w" in mode:
        return _Upload(raw, text)
    return raw if text is None else text


class _WholeOrNothing:
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


class _LocalWrite(_WholeOrNothing):
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


class _Upload(_WholeOrNothing):
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


def read_bytes(path) -> bytes:
    if is_remote(path):
        return _fs(path).cat_file(_key(os.fspath(path)))
    with builtins.open(_local_path(path), "rb") as f:
        return f.read()


def read_text(path, encoding: str = "utf-8") -> str:
    return read_bytes(path).decode(encoding)


def write_bytes(path, data: bytes, *, fsync: bool = False) -> None:
    """Writes a whole file atomically: readers see the old content or the new, never a part.

    Local: a temporary file beside it, then `os.replace` (with `fsync`, flushed to disk first).
    Remote: one upload (an object appears only once its upload completes).
    """
    path = os.fspath(path)
    if is_remote(path):
        _fs(path).pipe_file(_key(path), bytes(data))
        return
    local = _local_path(path)
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


def write_text(path, text: str, encoding: str = "utf-8", *, fsync: bool = False) -> None:
    write_bytes(path, text.encode(encoding), fsync=fsync)


def write_json(path, value, **kwargs) -> None:
    """`json.dumps(value, **kwargs)` + newline, written atomically."""
    write_text(path, json.dumps(value, **kwargs) + "\n")


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
            local = _local_path(self.path)
            os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
            with builtins.open(local, "ab") as f:
                f.write(self._queued)
            self._queued.clear()
            return
        fs, key = _fs(self.path), _key(self.path)
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


def makedirs(path) -> None:
    """Creates a local folder and its parents (exists_ok); nothing for an object store."""
    if is_remote(path):
        check(os.fspath(path))
        return
    os.makedirs(_local_path(path), exist_ok=True)


def remove(path, missing_ok: bool = False) -> None:
    try:
        if is_remote(path):
            _fs(path).rm_file(_key(os.fspath(path)))
        else:
            os.remove(_local_path(path))
    except FileNotFoundError:
        if not missing_ok:
            raise


def rmtree(path) -> None:
    """Deletes a folder and everything under it; nothing if absent."""
    if is_remote(path):
        fs, key = _fs(path), _key(os.fspath(path))
        with contextlib.suppress(FileNotFoundError):
            if fs.isdir(key):
                fs.rm(key, recursive=True)
            elif fs.isfile(key):
                fs.rm_file(key)
        return
    shutil.rmtree(_local_path(path), ignore_errors=True)


def rmdir(path) -> None:
    """Removes an empty local folder (OSError if not empty); nothing for an object store."""
    if not is_remote(path):
        os.rmdir(_local_path(path))


def rename(src, dst) -> None:
    """Moves a file or folder. Local: `os.rename` (atomic within a file system); remote: each object
    copied server-side then deleted (not atomic: callers order their moves so that a crash in
    between leaves something they detect)."""
    src, dst = os.fspath(src), os.fspath(dst)
    if is_remote(src) != is_remote(dst):
        raise StorageError(f"cannot rename {src} to {dst}: different file systems (storage.copy copies)")
    if not is_remote(src):
        os.rename(_local_path(src), _local_path(dst))
        return
    fs = _fs(src)
    if fs.isdir(_key(src)):
        for rel, info in sorted(files_info(src).items()):
            fs.copy(_key(info["path"]), _key(join(dst, rel)))
        fs.rm(_key(src), recursive=True)
    else:
        fs.mv(_key(src), _key(dst))


def copy(src, dst) -> None:
    """Copies one file, any direction between local and remote (server-side within a store)."""
    src, dst = os.fspath(src), os.fspath(dst)
    if is_remote(src) and is_remote(dst) and scheme(src) == scheme(dst):
        _fs(src).copy(_key(src), _key(dst))
        return
    if not is_remote(dst):
        os.makedirs(os.path.dirname(os.path.abspath(_local_path(dst))), exist_ok=True)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 16 << 20)


def copy_tree(src, dst) -> None:
    """Copies every file under `src` to the same relative names under `dst` (any direction)."""
    for rel, info in sorted(files_info(src).items()):
        copy(info["path"], join(dst, *rel.split("/")))


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Local copies and staging, for what only TensorFlow or C code reads and writes
# ---------------------------------------------------------------------------------------------


def cache_dir() -> str:
    """Where bert_jax keeps local copies (`$BERT_JAX_CACHE_DIR`, default `~/.cache/bert_jax`)."""
    return os.path.abspath(os.path.expanduser(os.environ.get("BERT_JAX_CACHE_DIR") or "~/.cache/bert_jax"))


def local_copy(path) -> str:
    """A local path with `path`'s content: the path itself when local; for a remote file, a copy in
    `cache_dir()/files/`, downloaded once per version of the object (its generation)."""
    path = os.fspath(path)
    if not is_remote(path):
        return _local_path(path)
    size, generation = identity(path)
    digest = hashlib.sha256(f"{path}\0{generation}\0{size}".encode()).hexdigest()[:24]
    target = os.path.join(cache_dir(), "files", digest, basename(path))
    if os.path.isfile(target) and os.path.getsize(target) == size:
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.part{os.getpid()}"
    try:
        copy(path, tmp)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return target


def tf_reaches(path) -> bool:
    """Whether TensorFlow's own file system opens `path` at the store this module writes to:
    always for local paths; for gs:// unless an endpoint override (an emulator) is set, which
    TensorFlow's GCS client has no setting for."""
    return not is_remote(path) or (scheme(path) == "gs" and not os.environ.get("STORAGE_EMULATOR_HOST"))


def tf_path(path) -> str:
    """The path TensorFlow's readers (tf.data) should open for `path`: itself when TensorFlow
    reaches it (`tf_reaches`), else a local copy (`local_copy`)."""
    path = os.fspath(path)
    return path if tf_reaches(path) else local_copy(path)


@contextlib.contextmanager
def writing_dir(path) -> Iterator[str]:
    """A local folder to write into for `path`: the folder itself when local (created); for a
    remote one a temporary folder, uploaded file by file when the block ends without error."""
    path = os.fspath(path)
    if not is_remote(path):
        os.makedirs(_local_path(path), exist_ok=True)
        yield _local_path(path)
        return
    with tempfile.TemporaryDirectory(prefix="bert_jax_upload_") as tmp:
        yield tmp
        copy_tree(tmp, path)


@contextlib.contextmanager
def reading_dir(path) -> Iterator[str]:
    """A local folder with `path`'s files: the folder itself when local; for a remote one a
    temporary download, deleted when the block ends."""
    path = os.fspath(path)
    if not is_remote(path):
        yield _local_path(path)
        return
    with tempfile.TemporaryDirectory(prefix="bert_jax_download_") as tmp:
        copy_tree(path, tmp)
        yield tmp


class Mirror:
    """A local folder whose files are uploaded to a remote folder at each `sync()`.

    For writers that only append to local files (TensorBoard's event writer): they write into
    `.local`, holding `.lock` while they write; `sync` uploads each file whose size or
    modification time changed since the last sync, whole (as TensorFlow's own GCS writer does at
    each flush), up to the size it had under the lock (so another thread may sync while the writer
    goes on: no upload ends in half a record). For a local `remote`, `.local` is `remote` itself
    and `sync` does nothing.
    """

    def __init__(self, remote, name: str = ""):
        self.remote = os.fspath(remote)
        self.lock = threading.Lock()
        if not is_remote(self.remote):
            self.local = _local_path(self.remote)
            os.makedirs(self.local, exist_ok=True)
        else:
            digest = hashlib.sha256(f"{self.remote}\0{name}".encode()).hexdigest()[:16]
            self.local = os.path.join(cache_dir(), "staging", f"{digest}-{os.getpid()}")
            os.makedirs(self.local, exist_ok=True)
        self._seen: dict[str, tuple] = {}

    def _changed(self) -> list[tuple[str, str, tuple]]:
        """(name, local path, (size, mtime)) of each file changed since its last upload."""
        with self.lock:
            marks = {rel: (info["path"], os.stat(info["path"])) for rel, info in files_info(self.local).items()}
        return [(rel, p, (st.st_size, st.st_mtime_ns)) for rel, (p, st) in sorted(marks.items())
                if self._seen.get(rel) != (st.st_size, st.st_mtime_ns)]

    def sync(self) -> None:
        if not is_remote(self.remote):
            return
        for rel, path, mark in self._changed():
            with builtins.open(path, "rb") as f:
                data = f.read(mark[0])
            write_bytes(join(self.remote, *rel.split("/")), data)
            self._seen[rel] = mark

    def close(self, upload: bool = True) -> bool:
        """Last sync (unless not `upload`), then the staging folder is removed (remote only) if
        every file in it is uploaded; else it is kept (and named in a warning). Returns whether
        every file is uploaded."""
        if upload:
            self.sync()
        if not is_remote(self.remote):
            return True
        left = [rel for rel, _, _ in self._changed()]
        if left:
            logging.warning("%d file(s) for %s were not uploaded: left in %s", len(left), self.remote, self.local)
            return False
        shutil.rmtree(self.local, ignore_errors=True)
        return True


def epath(path):
    """`etils.epath.Path` of a path, for the orbax calls that take one (orbax reaches local and
    gs:// paths through it)."""
    from etils import epath as _epath
    return _epath.Path(os.fspath(path))


def glob_escape(path) -> str:
    """`path` with glob's special characters escaped, to glob below it literally."""
    return re.sub(r"([*?\[])", r"[\1]", os.fspath(path))
