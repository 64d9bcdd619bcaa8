"""Storage paths: what a path a user gives names, and whether bert_jax can use it; no file is touched.

bert_jax reads and writes local paths and `gs://bucket/...` paths, and nothing else (the reasons, and
the functions that read and write them: `data_pipeline.storage`). The functions here only take paths
apart and put them together, so that no caller runs `os.path` on a URL (`os.path.abspath` and
`normpath` turn `gs://bucket` into `gs:/bucket`): every other storage module builds on them, and they
import none of them.

A path with a scheme no backend handles (`s3://`, `hdfs://`, `ram://`, ...) or a gs:// path without
gcsfs installed is refused by `check` with the flag's name and the remedy, before anything runs; so
is a local path with a component such as `gs:` (a gs:// path that lost a slash to `os.path`): no
command of bert_jax creates a local folder named `gs:`.

`object_key`, `object_url` and `local_path` are the other storage modules' forms of a path (fsspec's
'bucket/object'; a checked local path).
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Optional

REMOTE = {"gs": ("gcsfs", "gcs")}  # scheme -> (the module that serves it, the bert_jax extra)
URL_SCHEMES = ("http", "https")  # downloadable sources (checkpoint zips): only where a caller says so

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# A path component such as "gs:" or "s3:": what os.path.normpath/abspath leave of "gs://bucket".
_SCHEME_COMPONENT = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+:$")


class StorageError(ValueError):
    """A path bert_jax cannot read or write (unsupported scheme, missing backend, mangled URL)."""


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
        return posixpath.relpath(object_key(path), object_key(start))
    return os.path.relpath(path, start)


def glob_escape(path) -> str:
    """`path` with glob's special characters escaped, to glob below it literally."""
    return re.sub(r"([*?\[])", r"[\1]", os.fspath(path))


# ---------------------------------------------------------------------------------------------
# The forms the other storage modules hand to their backends
# ---------------------------------------------------------------------------------------------


def object_key(path) -> str:
    """'bucket/object' of a gs:// path (fsspec's form)."""
    return os.fspath(path).split("://", 1)[1].rstrip("/")


def object_url(key: str, s: str = "gs") -> str:
    """The URL of fsspec's 'bucket/object' `key` under scheme `s` (`object_key`'s inverse)."""
    return f"{s}://{key.lstrip('/')}"


def local_path(path) -> str:
    """A local path as Python's file functions take it: `~` expanded, `file://` dropped, checked
    for a component such as `gs:` (`StorageError`)."""
    path = _strip_file(os.path.expanduser(os.fspath(path)))
    _check_local(path)
    return path
