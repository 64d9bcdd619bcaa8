"""What every attempt of a supervised run runs: one snapshot of the project, and pinned versions.

**The code.** At its first start the supervisor packs what `launch/tpu_pod.sh` ships to the workers
(`setup.py`, `README.md`, `bert_jax/`, `data_pipeline/`, `configs/`, `launch/`; no `__pycache__`)
into one deterministic tar.gz, stores it in the workdir as `code/<sha256>.tar.gz` and names it in
`code.json` (with the git commit and whether the tree had uncommitted changes, when it is a git
checkout). Every attempt, on this machine or after a restart on another, unpacks that snapshot
(verified against its hash) into `$BERT_JAX_CACHE_DIR/supervisor/code-<sha256>/` and runs its
`launch/tpu_pod.sh` from there: an edit or a branch switch in the supervisor's checkout during the
weekend changes nothing. `--update_code` takes a new snapshot deliberately. Each attempt's record
names the hash.

**The versions.** A reinstall (a recreated or restarted slice) is pinned: to `constraints.txt`, the
`pip freeze` of worker 0 after the first install (the supervisor retries the freeze until it is
recorded); without it, to the versions the newest checkpoint records (jax, jaxlib, flax, optax,
orbax-checkpoint, libtpu: what `bert_jax.versions` checks on resume). A reinstall with neither
while a checkpoint exists is refused: its versions could be refused by the resume, every attempt.
"""

from __future__ import annotations

import datetime
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
from typing import Callable, Optional

from bert_jax import layout
from bert_jax.pod import calls
from bert_jax.pod.progress import newest_committed_step
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

SHIPPED = ("setup.py", "README.md", "bert_jax", "data_pipeline", "configs", "launch")


def project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pack(root: str) -> bytes:
    """The shipped files of the project at `root` as a tar.gz whose bytes depend only on their
    names, contents and executable bits (sorted, no times, no owners)."""
    paths = []
    for top in SHIPPED:
        where = storage_paths.join(root, top)
        if not storage.isdir(where):
            paths.append(where)
            continue
        for here, _, files in storage.walk(where):
            if "__pycache__" not in storage_paths.relpath(here, root).split(os.sep):
                paths.extend(storage_paths.join(here, name) for name in files if not name.endswith(".pyc"))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(paths):
            data = storage.read_bytes(path)
            info = tarfile.TarInfo(storage_paths.relpath(path, root))
            info.size, info.mtime = len(data), 0
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buffer.getvalue(), mtime=0)


def git_state(root: str) -> dict:
    """The checkout's commit and whether it had uncommitted changes (empty outside git)."""
    head = calls.run(["git", "-C", root, "rev-parse", "HEAD"], 30)
    if head.returncode != 0:
        return {}
    dirty = calls.run(["git", "-C", root, "status", "--porcelain", "--", *SHIPPED], 30)
    return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}


class Code:
    """The workdir's project snapshot (`code.json`, `code/<sha256>.tar.gz`) and its local unpacked copy."""

    def __init__(self, workdir: str, io_: calls.Storage, cache: str):
        self.workdir, self._io, self.cache = workdir, io_, cache
        self.pointer = storage_paths.join(workdir, layout.CODE_POINTER)

    def pinned(self, update: bool = False, root: Optional[str] = None) -> tuple[str, str, bool]:
        """(sha256, the local folder to launch from, whether a snapshot was taken now)."""
        try:
            record = None if update else json.loads(self._io.call("reading code.json", storage.read_text, self.pointer))
        except FileNotFoundError:
            record = None
        taken = record is None
        if taken:
            root = root or project_root()
            data = pack(root)
            digest = hashlib.sha256(data).hexdigest()
            self._io.call("storing the project snapshot", storage.write_bytes, self._archive(digest), data)
            record = {"sha256": digest, "from": root, "time": datetime.datetime.now().isoformat(timespec="seconds"),
                      **git_state(root)}
            self._io.call("writing code.json", storage.write_text, self.pointer, json.dumps(record, indent=1) + "\n")
        return record["sha256"], self.unpacked(record["sha256"]), taken

    def _archive(self, digest: str) -> str:
        return storage_paths.join(self.workdir, layout.CODE_DIR, layout.code_archive(digest))

    def unpacked(self, digest: str) -> str:
        """The snapshot unpacked locally (fetched and verified the first time)."""
        folder = storage_paths.join(self.cache, f"code-{digest}")
        if storage.exists(storage_paths.join(folder, "launch", "tpu_pod.sh")):
            return folder
        data = self._io.call("fetching the project snapshot", storage.read_bytes, self._archive(digest))
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"{self._archive(digest)} does not hash to {digest}: refusing to launch it")
        staging = folder + ".partial"
        storage.rmtree(staging)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(storage_paths.local_path(staging), filter="data")
        storage.rmtree(folder)
        storage.rename(staging, folder)
        return folder


def checkpoint_versions(workdir: str) -> tuple[Optional[int], Optional[dict]]:
    """(the newest committed step, the library versions its meta records) of a pretraining workdir."""
    step = newest_committed_step(storage_paths.join(workdir, layout.CHECKPOINTS))
    if step is None:
        return None, None
    try:
        meta = json.loads(storage.read_text(storage_paths.join(workdir, layout.CHECKPOINTS, str(step), "meta",
                                                               "metadata")))
    except (FileNotFoundError, ValueError):
        return step, None
    versions = meta.get("versions") if isinstance(meta, dict) else None
    return step, versions if isinstance(versions, dict) else None


def pins_of(versions: dict) -> list[str]:
    """`name==version` lines for pip's constraints (packages recorded as not installed are left out)."""
    return [f"{name}=={version}" for name, version in sorted(versions.items()) if version]


def freeze_pins(stdout: str) -> list[str]:
    """The `name==version` lines of `pip freeze`'s output."""
    return [line.strip() for line in stdout.splitlines() if re.match(r"^[A-Za-z0-9_.\-\[\]]+==\S+$", line.strip())]



class Unpinned(Exception):
    """A reinstall with no versions to pin it to, while a checkpoint exists."""


class Versions:
    """The versions an install is pinned to (`constraints.txt`, else the newest checkpoint's), and
    their record after the first install (worker 0's `pip freeze`)."""

    def __init__(self, workdir: str, io_: calls.Storage, log: Callable[[str], None]):
        self.workdir, self._io, self._log = workdir, io_, log
        self.constraints_file = storage_paths.join(workdir, layout.CONSTRAINTS)

    def recorded(self) -> bool:
        return self._io.call("looking for constraints.txt", storage.exists, self.constraints_file)

    def for_install(self, first_install: bool) -> tuple[Optional[str], Optional[str]]:
        """(pip constraints text, where it came from) for an install (None, None: unpinned, which only
        a first install or one before any checkpoint may be).

        Raises:
            Unpinned: a reinstall while a checkpoint exists, with no versions to pin it to.
            calls.Unavailable: storage cannot be reached (the launch waits for the next poll).
        """
        try:
            return self._io.call(f"reading {layout.CONSTRAINTS}", storage.read_text, self.constraints_file), layout.CONSTRAINTS
        except FileNotFoundError:
            pass
        step, versions = self._io.call("reading the newest checkpoint's versions", checkpoint_versions, self.workdir)
        if versions:
            return "\n".join(pins_of(versions)) + "\n", f"checkpoint step {step}"
        if step is None or first_install:
            return None, None  # nothing saved yet: no versions to keep
        raise Unpinned(f"refusing an unpinned reinstall: {self.constraints_file} is missing and checkpoint step {step} "
                       f"records no versions; write the versions that saved it to {self.constraints_file} (pip's "
                       "name==version lines) and start again")

    def record(self, freeze: Optional[subprocess.CompletedProcess]) -> bool:
        """Writes `tpu_pod.sh --freeze`'s pins to constraints.txt; whether they are recorded (None:
        they were already)."""
        if freeze is None:
            return True
        found = freeze_pins(freeze.stdout)
        if freeze.returncode != 0 or not found:
            self._log(f"could not record the installed versions yet: {(freeze.stderr or freeze.stdout).strip()[-300:]}")
            return False
        self._io.call("writing constraints.txt", storage.write_text, self.constraints_file, "\n".join(found) + "\n")
        versions = {p.split("==")[0].lower(): p.split("==")[1] for p in found}
        self._log(f"recorded {len(found)} installed versions in {self.constraints_file} (jax {versions.get('jax')}, "
                  f"libtpu {versions.get('libtpu')}, orbax {versions.get('orbax-checkpoint')})")
        return True
