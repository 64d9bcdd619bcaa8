"""Storage: every path a user gives, local or on Cloud Storage (gs://), read and written here.

bert_jax reads and writes local paths and `gs://bucket/...` paths, and nothing else: every file the
project touches (data, vocabularies, configs, checkpoints and their manifests, logs, TensorBoard
events, evaluation results, exports, predictions, plots) goes through the functions here and in
their sibling modules, and no other module calls `open`, `os.path.exists`, `os.makedirs`, `glob` or
`shutil` on a user's path (`tests/data_pipeline/storage/test_storage.py` scans for them). The file API most callers use is
here: queries, reading, writing, copying, moving and deleting, each dispatching on the path's scheme.
The rest of the stage sits beside it in `data_pipeline/storage/`, each name imported from where
it is defined:

- `paths.py`: naming and checking paths (`join`, `dirname`, `check`, `StorageError`, ...); no I/O.
- `gcs.py`: the gs:// client (gcsfs, shared with orbax) and its request time limit.
- `atomic.py`: the whole-or-nothing writes behind `open` and `write_bytes`, and appends that
  land once (`append_text`, `Appender`).
- `staging.py`: local copies and staging folders for what only TensorFlow or C code reads and
  writes (`tf_path`, `local_copy`, `writing_dir`, `reading_dir`, `Mirror`).
- `log_writer.py`: a run's logs and events written in the background (`LogWriter`).

Imports go one way: `paths` <- `gcs` <- `atomic` <- this module <- `staging` <- `log_writer`.
The bottom stage of data_pipeline: it imports nothing of data_pipeline but itself.

Backends: local paths go through Python's own file functions, with atomic writes (a temporary file
in the same folder, fsync, `os.replace`); gs:// through gcsfs (why: `gcs.py`).

Object-store semantics this module hides: no folders (`makedirs` is a no-op, a "folder" exists
while an object has its prefix), no append (`atomic.py`), no rename (`rename` copies then
deletes, per object, server-side), and a single-object upload is atomic (a write is whole or
absent, as `write_bytes` is locally).

This module imports neither jax nor TensorFlow (gcsfs only when a gs:// path is used).
"""

from __future__ import annotations

import builtins
import contextlib
import glob as _glob
import hashlib
import io
import json
import os
import shutil
from typing import IO, Callable, Iterator, Optional, Sequence, Union

from data_pipeline.storage.atomic import LocalWrite, Upload, write_local
from data_pipeline.storage.gcs import filesystem
from data_pipeline.storage.paths import (StorageError, check, is_remote, join, local_path, object_key, object_url,
                                         scheme)


# ---------------------------------------------------------------------------------------------
# Queries
# ---------------------------------------------------------------------------------------------


def exists(path) -> bool:
    if is_remote(path):
        return filesystem(path).exists(object_key(os.fspath(path)))
    return os.path.exists(local_path(path))


def isfile(path) -> bool:
    if is_remote(path):
        return filesystem(path).isfile(object_key(os.fspath(path)))
    return os.path.isfile(local_path(path))


def isdir(path) -> bool:
    """Local: a directory. Remote: some object has this prefix (object stores have no folders)."""
    if is_remote(path):
        return filesystem(path).isdir(object_key(os.fspath(path)))
    return os.path.isdir(local_path(path))


def listdir(path) -> list[str]:
    """Sorted names (not paths) in a folder; [] when there is no such folder (an object store
    cannot tell an empty folder from none)."""
    path = os.fspath(path)
    if is_remote(path):
        try:
            entries = filesystem(path).ls(object_key(path), detail=False)
        except FileNotFoundError:
            return []
        base = object_key(path)
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != base})
    try:
        return sorted(os.listdir(local_path(path)))
    except FileNotFoundError:
        return []


def glob(pattern) -> list[str]:
    """Sorted paths matching a glob (`*`, `?`, `[...]`; `**` spans folders)."""
    pattern = os.fspath(pattern)
    if is_remote(pattern):
        s = scheme(pattern)
        return sorted(object_url(k, s) for k in filesystem(pattern).glob(object_key(pattern)))
    pattern = local_path(pattern)
    return sorted(_glob.glob(pattern, recursive="**" in pattern))


def split_patterns(patterns: Union[str, Sequence[str]]) -> list[str]:
    """The globs of comma-separated patterns, or of a list of them (each maybe comma-separated), in
    order, blanks dropped: `"a/*.txt, b.txt"` -> `["a/*.txt", "b.txt"]`.

    Raises:
      ValueError: if there is no pattern.
    """
    items = [patterns] if isinstance(patterns, str) else list(patterns)
    found = [p.strip() for item in items for p in str(item).split(",") if p.strip()]
    if not found:
        raise ValueError("no input file pattern given")
    return found


def expand_patterns(patterns: Union[str, Sequence[str]], what: str = "input file pattern",
                    keep: Optional[Callable[[str], bool]] = None) -> list[str]:
    """The files of comma-separated globs (or a list of them), data_pipeline's one globber.

    As google-research/bert's scripts read `--input_file` (`for p in FLAGS.input_file.split(","):
    files.extend(tf.gfile.Glob(p))`): each pattern in the order given, its matches sorted (as `glob`
    gives them), and a file two patterns match listed twice. `create_pretraining_data` and
    `train_vocab` read their inputs in this order (the records depend on it); `records.reader`
    sorts and de-duplicates the list, since every host must see the same one.

    Args:
      patterns: comma-separated globs, or a list of them; local paths or gs://.
      what: how errors name the patterns (`"--input_file"`).
      keep: if given, only the matches it keeps count (`records.reader` leaves out manifests).

    Raises:
      ValueError: if there is no pattern.
      FileNotFoundError: naming the first pattern that matches no (kept) file.
    """
    files: list[str] = []
    for pattern in split_patterns(patterns):
        matched = [p for p in glob(check(pattern, what)) if keep is None or keep(p)]
        if not matched:
            raise FileNotFoundError(f"{what} {pattern!r} matches no file")
        files.extend(matched)
    return files


def utf8_lines(path) -> Iterator[tuple[str, bool]]:
    """The lines of a text file, local or gs://, as data_pipeline reads every corpus: each decoded as
    UTF-8 with its line ending, paired with whether it was not valid UTF-8 (then its bad bytes are
    U+FFFD, which the tokenizer drops as google-research/bert's `errors="ignore"` decoding does).

    Raises:
      FileNotFoundError: naming `path` if there is no such file (when called, not when iterated).
    """
    path = os.fspath(path)
    if not exists(path):
        raise FileNotFoundError(f"input file not found: {path}")
    return _utf8_lines(path)


def _utf8_lines(path: str) -> Iterator[tuple[str, bool]]:
    with open(path, "rb") as f:
        for raw in f:
            try:
                line, bad = raw.decode("utf-8"), False
            except UnicodeDecodeError:
                line, bad = raw.decode("utf-8", errors="replace"), True
            yield line, bad


def walk(root) -> Iterator[tuple[str, list[str], list[str]]]:
    """(folder, sub-folder names, file names) top-down as `os.walk`, both sorted; nothing if absent."""
    root = os.fspath(root)
    if is_remote(root):
        s = scheme(root)
        try:
            entries = filesystem(root).walk(object_key(root))
            for here, dirs, files in entries:
                yield object_url(here, s), sorted(dirs), sorted(files)
        except FileNotFoundError:
            return
        return
    for here, dirs, files in os.walk(local_path(root)):
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
        base = object_key(root)
        try:
            found = filesystem(root).find(base, detail=True)
        except FileNotFoundError:
            return {}
        for key, info in found.items():
            if info.get("type") == "directory" or not key.startswith(base + "/"):
                continue
            out[key[len(base) + 1:]] = {"size": int(info["size"]), "md5": _b64_hex(info.get("md5Hash")),
                                        "crc32c": _b64_hex(info.get("crc32c")), "path": object_url(key, s),
                                        "generation": str(info.get("generation") or info.get("etag")
                                                          or info.get("updated"))}
        return out
    local = local_path(root)
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
        return int(filesystem(path).info(object_key(os.fspath(path)))["size"])
    return os.path.getsize(local_path(path))


def getmtime(path) -> float:
    if is_remote(path):
        info = filesystem(path).info(object_key(os.fspath(path)))
        when = info.get("mtime") or info.get("updated")
        if hasattr(when, "timestamp"):
            return when.timestamp()
        from datetime import datetime
        return datetime.fromisoformat(str(when).replace("Z", "+00:00")).timestamp()
    return os.path.getmtime(local_path(path))


def identity(path) -> tuple:
    """What changes when a file is rewritten: (size, generation) remote, (size, mtime_ns) local."""
    if is_remote(path):
        info = filesystem(path).info(object_key(os.fspath(path)))
        return int(info["size"]), str(info.get("generation") or info.get("etag") or info.get("updated"))
    st = os.stat(local_path(path))
    return st.st_size, st.st_mtime_ns


# ---------------------------------------------------------------------------------------------
# Reading and writing
# ---------------------------------------------------------------------------------------------


def open(path, mode: str = "r", encoding: Optional[str] = None, newline: Optional[str] = None,  # noqa: A001
         errors: Optional[str] = None) -> IO:
    """A file object, as `builtins.open`. Remote files: "r", "rb", "w", "wb" (a written object
    appears whole when the file is closed); "a" is refused (use `storage_atomic.append_text`)."""
    path = os.fspath(path)
    if not is_remote(path):
        local = local_path(path)
        if "w" in mode and "+" not in mode:
            return LocalWrite(local, mode, encoding=encoding, newline=newline, errors=errors)
        if "b" in mode:
            return builtins.open(local, mode)
        return builtins.open(local, mode, encoding=encoding or "utf-8", newline=newline, errors=errors)
    if "a" in mode or "+" in mode:
        raise StorageError(f"{path}: mode {mode!r}: object stores cannot append or update in place "
                           f"(storage_atomic.append_text appends)")
    raw = filesystem(path).open(object_key(path), mode.replace("t", "").replace("b", "") + "b")
    text = None if "b" in mode else io.TextIOWrapper(raw, encoding=encoding or "utf-8", newline=newline,
                                                      errors=errors)
    if "w" in mode:
        return Upload(raw, text)
    return raw if text is None else text


def read_bytes(path) -> bytes:
    if is_remote(path):
        return filesystem(path).cat_file(object_key(os.fspath(path)))
    with builtins.open(local_path(path), "rb") as f:
        return f.read()


def read_text(path, encoding: str = "utf-8") -> str:
    return read_bytes(path).decode(encoding)


def read_range(path, start: int, end: int) -> bytes:
    """Bytes `[start, end)` of a file in one request (fewer at its end): a bounded read of a log's
    head or tail, however large the file has grown."""
    if start < 0 or end < start:
        raise ValueError(f"{path}: bad byte range [{start}, {end})")
    if end == start:
        return b""
    if is_remote(path):
        return filesystem(path).cat_file(object_key(os.fspath(path)), start=start, end=end)
    with builtins.open(local_path(path), "rb") as f:
        f.seek(start)
        return f.read(end - start)


def write_bytes(path, data: bytes, *, fsync: bool = False) -> None:
    """Writes a whole file atomically: readers see the old content or the new, never a part.

    Local: a temporary file beside it, then `os.replace` (with `fsync`, flushed to disk first).
    Remote: one upload (an object appears only once its upload completes).
    """
    path = os.fspath(path)
    if is_remote(path):
        filesystem(path).pipe_file(object_key(path), bytes(data))
        return
    write_local(local_path(path), data, fsync=fsync)


def write_text(path, text: str, encoding: str = "utf-8", *, fsync: bool = False) -> None:
    write_bytes(path, text.encode(encoding), fsync=fsync)


def write_json(path, value, **kwargs) -> None:
    """`json.dumps(value, **kwargs)` + newline, written atomically."""
    write_text(path, json.dumps(value, **kwargs) + "\n")


# ---------------------------------------------------------------------------------------------
# Folders, moves, copies, deletions
# ---------------------------------------------------------------------------------------------


def makedirs(path) -> None:
    """Creates a local folder and its parents (exists_ok); nothing for an object store."""
    if is_remote(path):
        check(os.fspath(path))
        return
    os.makedirs(local_path(path), exist_ok=True)


def remove(path, missing_ok: bool = False) -> None:
    try:
        if is_remote(path):
            filesystem(path).rm_file(object_key(os.fspath(path)))
        else:
            os.remove(local_path(path))
    except FileNotFoundError:
        if not missing_ok:
            raise


def rmtree(path) -> None:
    """Deletes a folder and everything under it; nothing if absent."""
    if is_remote(path):
        fs, key = filesystem(path), object_key(os.fspath(path))
        with contextlib.suppress(FileNotFoundError):
            if fs.isdir(key):
                fs.rm(key, recursive=True)
            elif fs.isfile(key):
                fs.rm_file(key)
        return
    shutil.rmtree(local_path(path), ignore_errors=True)


def rmdir(path) -> None:
    """Removes an empty local folder (OSError if not empty); nothing for an object store."""
    if not is_remote(path):
        os.rmdir(local_path(path))


def rename(src, dst) -> None:
    """Moves a file or folder. Local: `os.rename` (atomic within a file system); remote: each object
    copied server-side then deleted (not atomic: callers order their moves so that a crash in
    between leaves something they detect)."""
    src, dst = os.fspath(src), os.fspath(dst)
    if is_remote(src) != is_remote(dst):
        raise StorageError(f"cannot rename {src} to {dst}: different file systems (storage.copy copies)")
    if not is_remote(src):
        os.rename(local_path(src), local_path(dst))
        return
    fs = filesystem(src)
    if fs.isdir(object_key(src)):
        for rel, info in sorted(files_info(src).items()):
            fs.copy(object_key(info["path"]), object_key(join(dst, rel)))
        fs.rm(object_key(src), recursive=True)
    else:
        fs.mv(object_key(src), object_key(dst))


def copy(src, dst) -> None:
    """Copies one file, any direction between local and remote (server-side within a store)."""
    src, dst = os.fspath(src), os.fspath(dst)
    if is_remote(src) and is_remote(dst) and scheme(src) == scheme(dst):
        filesystem(src).copy(object_key(src), object_key(dst))
        return
    if not is_remote(dst):
        os.makedirs(os.path.dirname(os.path.abspath(local_path(dst))), exist_ok=True)
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


def epath(path):
    """`etils.epath.Path` of a path, for the orbax calls that take one (orbax reaches local and
    gs:// paths through it)."""
    from etils import epath as _epath
    return _epath.Path(os.fspath(path))
