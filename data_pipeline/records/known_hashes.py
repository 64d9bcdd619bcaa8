"""Data files hashed before: their SHA-256 by path and identity, so an unchanged file is trusted
instead of read again (`KnownHashes`, used by `reader.check_files` when it verifies a host's files).

Split from reader.py: which files a host reads and how is the reader's; what this machine (or a
training run's workdir) remembers of the files it hashed is this module's. It imports neither jax
nor bert_jax.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Optional

from data_pipeline import storage
from data_pipeline.records import manifests
from data_pipeline.storage import paths as storage_paths, staging as storage_staging

log = logging.getLogger(__name__)


class KnownHashes:
    """The SHA-256 of data files hashed before, by path and identity (size and mtime on local
    disk, size and generation on Cloud Storage), kept in `storage_staging.cache_dir()`: a restart
    checks an unchanged file by its identity in microseconds instead of reading it again (hours at
    Wikipedia scale on a bucket). Any rewrite changes the identity, and the file is hashed again.
    A local file modified within the last 2 s is not remembered (an mtime that a write in the same
    clock tick would not change: git's "racy clean" case). `fresh=True` hashes every file again
    (`config.rehash_data`).

    `shared_file` (a training run's `WORKDIR/verified_data/process_<i>.json`) keeps the hashes of
    Cloud Storage files beside the run too, where a machine recreated after a preemption (an empty
    local cache) finds them: this process writes the entries it used or read there before, and
    reads every `*.json` of that folder, so a resume on another number of hosts still trusts the
    files other hosts hashed. Local files stay in the local cache only: their mtimes belong to one
    machine.

    Counts what it did (`counts`): files hashed and their bytes, and files trusted by identity.
    """

    NAME = "verified_data_files.json"
    RACY_S = 2.0

    def __init__(self, fresh: bool = False, shared_file: Optional[str] = None):
        self.fresh, self.changed, self._listed, self._known = fresh, False, {}, None
        self.path = storage_paths.join(storage_staging.cache_dir(), self.NAME)
        self.shared_file = shared_file
        self._shared: dict = {}  # path -> [entries of the `shared_file` folder's files]
        self._shared_before: dict = {}  # what `shared_file` held when read
        self._shared_used: dict = {}  # remote entries looked up or hashed now
        self.counts = {"hashed_files": 0, "hashed_bytes": 0, "trusted_files": 0}

    @property
    def known(self) -> dict:
        """The hashes remembered on this machine, read on first use (not at all when nothing is
        verified); the `shared_file` folder's are read with them."""
        if self._known is None:
            self._known = _read_json_dict(self.path)
            if self.shared_file is not None:
                folder, own = storage_paths.dirname(self.shared_file), storage_paths.basename(self.shared_file)
                for name in storage.listdir(folder):
                    if not name.endswith(".json"):
                        continue
                    # A remote file's entry holds on any machine (path, size, generation).
                    entries = {k: v for k, v in _read_json_dict(storage_paths.join(folder, name)).items()
                               if storage_paths.is_remote(k) and isinstance(v, dict)}
                    if name == own:
                        self._shared_before = entries
                    for key, entry in entries.items():
                        self._shared.setdefault(key, []).append(entry)
        return self._known

    def identity(self, path: str) -> list:
        """`storage.identity(path)`; for a remote file, from one listing of its folder (a bucket
        answers one request for a thousand objects, not one each)."""
        if not storage_paths.is_remote(path):
            return list(storage.identity(path))
        folder = storage_paths.dirname(path)
        if folder not in self._listed:
            self._listed[folder] = {info["path"]: [info["size"], info["generation"]]
                                    for rel, info in storage.files_info(folder).items() if "/" not in rel}
        return self._listed[folder].get(path) or list(storage.identity(path))

    def size(self, path: str) -> int:
        return int(self.identity(path)[0])

    def sha256(self, path: str) -> str:
        key = path if storage_paths.is_remote(path) else storage_paths.abspath(path)
        identity = self.identity(path)
        known = self.known  # reads the shared folder too, on first use
        candidates = [known.get(key), *self._shared.get(key, ())]
        entry = next((e for e in candidates if isinstance(e, dict) and e.get("identity") == identity
                      and isinstance(e.get("sha256"), str)), None)
        if not self.fresh and entry is not None:
            self.counts["trusted_files"] += 1
            if storage_paths.is_remote(path):
                self._shared_used[key] = entry
            return entry["sha256"]
        started = time.time()
        digest = manifests.sha256_file(path)
        self.counts["hashed_files"] += 1
        self.counts["hashed_bytes"] += int(identity[0])
        if storage_paths.is_remote(path) or identity[1] / 1e9 < started - self.RACY_S:
            self.known[key] = {"identity": identity, "sha256": digest}
            self.changed = True
            if storage_paths.is_remote(path):
                self._shared_used[key] = self.known[key]
        return digest

    def save(self) -> None:
        if self.changed:
            try:  # written whole; two processes at once lose an entry, not the file
                storage.makedirs(storage_paths.dirname(self.path))
                storage.write_text(self.path, json.dumps(self.known, sort_keys=True))
            except OSError as e:
                log.warning("could not remember the verified data files in %s (%s): the next start hashes "
                            "them again", self.path, e)
            self.changed = False
        shared = {**self._shared_before, **self._shared_used}
        if self.shared_file is not None and shared != self._shared_before:
            try:  # this process's file only: no other process writes it
                storage.makedirs(storage_paths.dirname(self.shared_file))
                storage.write_text(self.shared_file, json.dumps(shared, sort_keys=True))
            except OSError as e:
                log.warning("could not remember the verified data files in %s (%s): a new machine hashes "
                            "them again", self.shared_file, e)
            self._shared_before = shared


def _read_json_dict(path: str) -> dict:
    """The JSON object in `path`; {} when it is missing, unreadable or no object."""
    try:
        value = json.loads(storage.read_text(path))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
