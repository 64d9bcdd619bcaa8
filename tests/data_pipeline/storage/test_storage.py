"""data_pipeline.storage and the modules beside it in data_pipeline/storage/: one layer for every path, local and gs://
(against fake-gcs-server), the refusals at startup, and a scan that no other module touches files on
its own."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipeline import storage
from data_pipeline.storage import atomic as storage_atomic, paths as storage_paths, staging as storage_staging

ROOT = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------------------------------------
# The scan: file access outside the storage modules
# ---------------------------------------------------------------------------------------------

# The storage layer: the only modules that may call the file system themselves (not log_writer,
# which writes through them).
STORAGE_MODULES = {f"data_pipeline/storage/{name}.py" for name in ("__init__", "paths", "gcs", "atomic", "staging")}

# Calls that reach the file system by themselves. `open` is the builtin (storage.open is fine).
_FORBIDDEN_ATTRS = {
    "os": {"makedirs", "mkdir", "listdir", "remove", "unlink", "rename", "replace", "rmdir", "removedirs",
           "walk", "scandir", "stat", "open", "fdopen", "chmod", "truncate", "symlink", "link"},
    "os.path": {"exists", "lexists", "isfile", "isdir", "getsize", "getmtime", "getctime", "islink",
                "samefile", "realpath"},
    "io": {"open"}, "gzip": {"open"}, "bz2": {"open"}, "lzma": {"open"}, "builtins": {"open"},
}
_FORBIDDEN_MODULES = {"glob", "shutil", "pathlib", "etils"}  # any use at all
# Third-party readers and writers that take a path: allowed only on a line marked `# storage: local`
# (the path is a local copy or a staging folder that storage made; the marker says so).
_PATH_TAKING = {"savefig", "safe_open", "save_file", "load_file", "load_checkpoint", "SaveV2", "EventAccumulator",
                "SentencePieceProcessor", "SentencePieceTrainer", "ZipFile", "TFRecordWriter",
                "TFRecordDataset", "FixedLengthRecordDataset", "TextLineDataset", "Checkpoint", "load"}
_MARKER = "# storage: local"


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def scan(path: Path) -> list[str]:
    """Every line of `path` that reaches files without storage: `file:line: what`."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)
    bad = []

    def flag(node, what):
        line = lines[node.lineno - 1]
        end = lines[getattr(node, "end_lineno", node.lineno) - 1]
        if what.split()[0] in _PATH_TAKING and (_MARKER in line or _MARKER in end):
            return
        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _FORBIDDEN_MODULES:
                    flag(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            names = {a.name for a in node.names}
            if root in _FORBIDDEN_MODULES:
                flag(node, f"from {node.module} import ...")
            for mod, attrs in _FORBIDDEN_ATTRS.items():
                if node.module == mod and names & attrs:
                    flag(node, f"from {mod} import {sorted(names & attrs)}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name == "open":
                flag(node, "open(...)")
            elif "gfile" in name.split("."):
                flag(node, f"{name}(...)")
            else:
                mod, _, attr = name.rpartition(".")
                if mod.split(".")[0] in _FORBIDDEN_MODULES or attr in _FORBIDDEN_ATTRS.get(mod, ()):
                    flag(node, f"{name}(...)")
                elif attr in _PATH_TAKING and (attr != "load" or mod in ("np", "numpy", "torch")):
                    flag(node, f"{attr} {name}(...) without '{_MARKER}'")
    return bad


def _sources():
    for package in ("bert_jax", "data_pipeline", "configs"):
        for p in sorted((ROOT / package).rglob("*.py")):
            if p.relative_to(ROOT).as_posix() not in STORAGE_MODULES:
                yield p


def test_no_module_but_storage_touches_files_itself():
    bad = [line for p in _sources() for line in scan(p)]
    assert not bad, "file access outside the storage modules:\n" + "\n".join(bad)


def test_the_scan_catches_each_kind_of_access(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    src = tmp_path / "m.py"
    src.write_text(
        "import os, shutil\nfrom glob import glob\nimport tensorflow as tf\n"
        "open('x')\nos.makedirs('d')\nos.path.exists('x')\nshutil.rmtree('d')\n"
        "tf.io.gfile.exists('x')\nfig.savefig('p.png')\nnp.load('a.npy')\n"
        "fig.savefig(local)  # storage: local (a staging folder)\nstorage.open('x')\n")
    found = scan(src)
    for needle in ("import shutil", "from glob", ":4: open", "os.makedirs", "os.path.exists",
                   "shutil.rmtree", "tf.io.gfile.exists", ":9: savefig", ":10: load"):
        assert any(needle in f for f in found), (needle, found)
    assert not any(":11:" in f or ":12:" in f for f in found), found


# ---------------------------------------------------------------------------------------------
# Paths refused before anything runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,needle", [
    ("s3://bucket/run", "'s3://' paths are not supported"),
    ("ram://run", "'ram://' paths are not supported"),
    ("hdfs://nn/run", "'hdfs://' paths are not supported"),
    ("gs:/bucket/run", "looks like a URL scheme that lost a slash"),
    ("/home/me/gs:/bucket/run", "'gs:'"),
    ("gs:///run", "no bucket name"),
])
def test_unusable_paths_are_refused_naming_the_flag(path, needle):
    with pytest.raises(storage_paths.StorageError) as e:
        storage_paths.check(path, "--workdir")
    assert str(e.value).startswith(f"--workdir={path}: ") and needle in str(e.value)


def test_urls_only_where_a_caller_downloads():
    with pytest.raises(storage_paths.StorageError, match="'https://' paths are not supported"):
        storage_paths.check("https://example.com/x.zip", "config.train_data")
    assert storage_paths.check("https://example.com/x.zip", "config.init_checkpoint", urls=True)
    assert storage_paths.check("file:///tmp/x", "f") == "file:///tmp/x" and not storage_paths.is_remote("file:///tmp/x")


def test_gs_without_gcsfs_names_the_extra_and_writes_nothing(tmp_path):
    # A fresh interpreter where `import gcsfs` fails, running the real entry point from an empty
    # folder: the error names the flag and the extra, and no folder `gs:` appears.
    code = ("import sys; sys.modules['gcsfs'] = None\n"
            "from bert_jax import main\n"
            "sys.argv = ['bert_jax.main', '--config=" + str(ROOT / "configs/test.py") + "', "
            "'--workdir=gs://bkt/run', '--config.train_data=/nonexistent/*.tfrecord']\n"
            "main.app.run(main.main, flags_parser=main.parse_flags)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    assert r.returncode != 0
    assert "--workdir=gs://bkt/run: gs:// paths need the gcsfs package" in r.stderr, r.stderr[-2000:]
    assert "pip install 'bert_jax[gcs]'" in r.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Local and gs:// behave alike
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "root")
    return request.getfixturevalue("bucket") + "/root"


def test_files_folders_and_globs(root):
    a, b = storage_paths.join(root, "d", "a.txt"), storage_paths.join(root, "d", "sub", "b.bin")
    storage.write_text(a, "alpha\n")
    storage.write_bytes(b, b"\x00\x01")
    with storage.open(storage_paths.join(root, "d", "c.txt"), "w") as f:
        f.write("gamma")
    assert storage.read_text(a) == "alpha\n" and storage.read_bytes(b) == b"\x00\x01"
    assert storage.isfile(a) and not storage.isdir(a) and storage.isdir(storage_paths.join(root, "d"))
    nothing = storage_paths.join(root, "nothing")
    assert not storage.exists(nothing) and not storage.isdir(nothing)
    assert storage.listdir(storage_paths.join(root, "d")) == ["a.txt", "c.txt", "sub"]
    assert storage.glob(storage_paths.join(root, "d", "*.txt")) == [a, storage_paths.join(root, "d", "c.txt")]
    assert storage.glob(storage_paths.join(root, "**", "*.bin")) == [b]
    assert storage.getsize(a) == 6
    walked = {(storage_paths.relpath(here, root), tuple(dirs), tuple(files))
              for here, dirs, files in storage.walk(root)}
    assert walked == {(".", ("d",), ()), ("d", ("sub",), ("a.txt", "c.txt")), ("d/sub", (), ("b.bin",))}
    info = storage.files_info(root)
    assert sorted(info) == ["d/a.txt", "d/c.txt", "d/sub/b.bin"] and info["d/a.txt"]["size"] == 6
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage_paths.join(root, "nothing"))


def test_append_rename_copy_and_remove(root, tmp_path):
    log = storage_paths.join(root, "log.jsonl")
    for i in range(3):
        storage_atomic.append_text(log, f'{{"step": {i}}}\n')
    assert storage.read_text(log).splitlines() == ['{"step": 0}', '{"step": 1}', '{"step": 2}']
    assert storage.listdir(root) == ["log.jsonl"]  # no part objects left behind
    storage.write_text(storage_paths.join(root, "x", "1"), "one")
    storage.write_text(storage_paths.join(root, "x", "y", "2"), "two")
    storage.rename(storage_paths.join(root, "x"), storage_paths.join(root, "moved"))
    assert not storage.exists(storage_paths.join(root, "x"))
    assert storage.read_text(storage_paths.join(root, "moved", "y", "2")) == "two"
    storage.copy_tree(storage_paths.join(root, "moved"), str(tmp_path / "down"))
    assert (tmp_path / "down" / "y" / "2").read_text() == "two"
    storage.rmtree(storage_paths.join(root, "moved"))
    storage.rmtree(storage_paths.join(root, "moved"))  # absent: nothing to do
    assert storage.listdir(root) == ["log.jsonl"]
    storage.remove(log)
    storage.remove(log, missing_ok=True)
    with pytest.raises(FileNotFoundError):
        storage.remove(log)


def test_a_rewrite_is_whole_or_absent(root):
    p = storage_paths.join(root, "f.json")
    storage.write_json(p, {"a": 1})
    with pytest.raises(RuntimeError):
        with storage.open(p, "w") as f:
            f.write("{partial")
            raise RuntimeError("crash while writing")
    # Locally a temporary file that was never renamed into place; remotely an upload that never
    # completed: either way the previous content is still there.
    assert storage.read_text(p) == '{"a": 1}\n'
    storage.write_text(p, "new")
    assert storage.read_text(p) == "new"
    assert storage.listdir(root) == ["f.json"]  # no temporary file left beside it


def test_a_byte_range_is_read_in_one_bounded_request(root):
    p = storage_paths.join(root, "log.txt")
    storage.write_bytes(p, bytes(range(100)))
    assert storage.read_range(p, 0, 10) == bytes(range(10))
    assert storage.read_range(p, 90, 200) == bytes(range(90, 100))  # past the end: what there is
    assert storage.read_range(p, 5, 5) == b""
    with pytest.raises(ValueError):
        storage.read_range(p, 10, 5)


def test_of_two_writers_racing_for_one_version_exactly_one_wins(root):
    p = storage_paths.join(root, "lease.json")
    assert storage_atomic.read_versioned(p) == (None, None)
    first = storage_atomic.write_versioned(p, b"one", None)  # created: it was absent
    with pytest.raises(storage_atomic.VersionChanged):
        storage_atomic.write_versioned(p, b"two", None)  # a second creator loses
    assert storage_atomic.read_versioned(p) == (b"one", first)
    second = storage_atomic.write_versioned(p, b"three", first)  # replaced: still the version read
    assert second != first
    with pytest.raises(storage_atomic.VersionChanged):
        storage_atomic.write_versioned(p, b"stale", first)  # a writer holding the old version loses
    assert storage_atomic.read_versioned(p) == (b"three", second)
    storage.write_bytes(p, b"someone else")  # an unconditional write is a new version too
    with pytest.raises(storage_atomic.VersionChanged):
        storage_atomic.write_versioned(p, b"four", second)
    assert storage.read_bytes(p) == b"someone else"


def test_staging_for_tensorflow_and_c_readers(root, monkeypatch, tmp_path):
    monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    with storage_staging.writing_dir(storage_paths.join(root, "state")) as local:
        assert os.path.isdir(local)
        Path(local, "iterator.index").write_bytes(b"idx")
        Path(local, "sub").mkdir()
        Path(local, "sub", "x").write_text("x")
    assert storage.read_bytes(storage_paths.join(root, "state", "iterator.index")) == b"idx"
    with storage_staging.reading_dir(storage_paths.join(root, "state")) as local:
        assert Path(local, "sub", "x").read_text() == "x"
    index = storage_paths.join(root, "state", "iterator.index")
    copy = storage_staging.local_copy(index)
    assert Path(copy).read_bytes() == b"idx"
    if storage_paths.is_remote(root):
        assert copy.startswith(str(tmp_path / "cache"))
        storage.write_bytes(index, b"changed")
        assert Path(storage_staging.local_copy(index)).read_bytes() == b"changed"
        assert not storage_staging.tf_reaches(root)  # the emulator: TensorFlow's GCS client cannot follow
        assert storage_staging.tf_path(index).startswith(str(tmp_path / "cache"))
    mirror = storage_staging.Mirror(storage_paths.join(root, "events"))
    Path(mirror.local, "events.out").write_bytes(b"1")
    mirror.sync()
    Path(mirror.local, "events.out").write_bytes(b"12")
    mirror.close()
    assert storage.read_bytes(storage_paths.join(root, "events", "events.out")) == b"12"


def test_tensorflow_reads_gs_itself_without_an_endpoint_override(monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    assert storage_staging.tf_reaches("gs://bucket/data/train-0.tfrecord")
    assert storage_staging.tf_path("gs://bucket/data/train-0.tfrecord") == "gs://bucket/data/train-0.tfrecord"
    assert storage_staging.tf_path("/data/x") == "/data/x"


def test_remote_appends_and_updates_in_place_are_refused(bucket):
    for mode in ("a", "r+", "ab"):
        with pytest.raises(storage_paths.StorageError, match="append_text"):
            storage.open(bucket + "/x", mode)
