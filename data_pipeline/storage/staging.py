"""Storage for what only reads and writes local files: local copies and staging folders.

What only TensorFlow or a C library reads or writes (the tf.data record readers, TensorBoard event
files, the tf.data iterator checkpoint, Google TF1 checkpoints, SentencePiece's trainer, safetensors
and zip files) is written into a local staging folder and uploaded through `data_pipeline.storage`
(`writing_dir`, `Mirror`), and read from a local copy (`reading_dir`, `local_copy`). The one
exception is the training records: `tf_path` gives TensorFlow the gs:// path itself (its own GCS
client streams them on a pod), except when an endpoint override is set, which TensorFlow's client
cannot follow: then the files are copied into the cache once.

Local-disk caches, all under `cache_dir()` (`$BERT_JAX_CACHE_DIR`, default `~/.cache/bert_jax`):
`files/` (copies of remote files read by TensorFlow or C code), `staging/` (TensorBoard events of a
remote workdir before upload). Temporary folders (`tempfile`) are removed when done.

This module imports neither jax nor TensorFlow: it hands TensorFlow paths, and takes back folders.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from typing import Iterator

from data_pipeline.storage import copy, copy_tree, files_info, identity, write_bytes
from data_pipeline.storage.paths import basename, is_remote, join, local_path, scheme


def cache_dir() -> str:
    """Where bert_jax keeps local copies (`$BERT_JAX_CACHE_DIR`, default `~/.cache/bert_jax`)."""
    return os.path.abspath(os.path.expanduser(os.environ.get("BERT_JAX_CACHE_DIR") or "~/.cache/bert_jax"))


def local_copy(path) -> str:
    """A local path with `path`'s content: the path itself when local; for a remote file, a copy in
    `cache_dir()/files/`, downloaded once per version of the object (its generation)."""
    path = os.fspath(path)
    if not is_remote(path):
        return local_path(path)
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
        os.makedirs(local_path(path), exist_ok=True)
        yield local_path(path)
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
        yield local_path(path)
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
            self.local = local_path(self.remote)
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
