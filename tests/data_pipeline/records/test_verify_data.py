"""`verify_data` on a restart: a file hashed once is checked by its identity (size and mtime, or
a bucket's generation) afterwards, and any rewrite is hashed again (`records.known_hashes.KnownHashes`); a bucket's
files also by the hashes a training run keeps in its workdir, on a machine whose local cache is new."""

import os
import time

import pytest

pytest.importorskip("tensorflow")

from data_pipeline.records import manifests, reader as records  # noqa: E402
from data_pipeline.records.reader import CorruptDataError  # noqa: E402
from tests.helpers.numbered_records import write_dataset  # noqa: E402


@pytest.fixture
def hashed(monkeypatch, tmp_path):
    """The files sha256_file reads, in order; the cache in the test's own folder."""
    monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    seen = []
    real = manifests.sha256_file

    def counting(path):
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(manifests, "sha256_file", counting)
    return seen


def check(pattern, verify=True):
    return records.check_files(pattern, process_index=0, process_count=1, verify=verify, skip_corrupt=False,
                               require_files_per_host=True)


def age(path, seconds=60.0):
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_an_unchanged_file_is_hashed_once_and_a_rewrite_again(tmp_path, hashed):
    paths = write_dataset(tmp_path / "d", [3, 4, 5])
    for p in paths:
        age(p)
    hashed.clear()  # the manifest's writer hashed them too
    pattern = str(tmp_path / "d" / "*.tfrecord")
    check(pattern)
    assert sorted(hashed) == ["part-00000.tfrecord", "part-00001.tfrecord", "part-00002.tfrecord"]
    hashed.clear()
    check(pattern)  # a restart: nothing read again
    assert hashed == []
    # One flipped byte, the size unchanged, a later mtime: hashed again, and refused.
    raw = bytearray(open(paths[1], "rb").read())
    raw[len(raw) // 2] ^= 1
    open(paths[1], "wb").write(bytes(raw))
    age(paths[1], 30.0)
    with pytest.raises(CorruptDataError, match=r"part-00001.tfrecord: sha256 differs from the manifest"):
        check(pattern)
    assert hashed == ["part-00001.tfrecord"]
    # The same bytes written back with the remembered mtime: only a full re-hash can tell (the limit
    # of checking by identity); verify="full" (config.rehash_data) reads every file.
    raw[len(raw) // 2] ^= 1
    open(paths[1], "wb").write(bytes(raw))
    age(paths[1], 30.0)
    hashed.clear()
    check(pattern, verify="full")
    assert sorted(hashed) == ["part-00000.tfrecord", "part-00001.tfrecord", "part-00002.tfrecord"]


def test_a_file_written_just_now_is_not_remembered(tmp_path, hashed):
    write_dataset(tmp_path / "d", [3])  # mtime now: a same-tick rewrite could keep it
    hashed.clear()
    pattern = str(tmp_path / "d" / "*.tfrecord")
    check(pattern)
    check(pattern)
    assert hashed == ["part-00000.tfrecord", "part-00000.tfrecord"]


def test_an_unwritable_cache_costs_a_warning_not_the_run(tmp_path, monkeypatch, hashed, caplog):
    paths = write_dataset(tmp_path / "d", [3])
    age(paths[0])
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / "file" / "cache"))  # under a file
    files = check(str(tmp_path / "d" / "*.tfrecord"))
    assert files.read_records == 3
    assert "could not remember the verified data files" in caplog.text


def test_in_a_bucket_the_generation_is_the_identity(tmp_path, bucket, hashed):
    from data_pipeline import storage

    paths = write_dataset(tmp_path / "d", [3, 4])
    for p in paths + [str(tmp_path / "d" / manifests.run_manifest_name(paths))]:
        storage.copy(p, f"{bucket}/d/{os.path.basename(p)}")
    hashed.clear()
    pattern = f"{bucket}/d/*.tfrecord"
    check(pattern)
    assert sorted(hashed) == ["part-00000.tfrecord", "part-00001.tfrecord"]
    hashed.clear()
    check(pattern)  # identities from one listing: nothing downloaded
    assert hashed == []
    # The same bytes uploaded again: a new generation, hashed again (and still intact).
    storage.copy(paths[0], f"{bucket}/d/part-00000.tfrecord")
    check(pattern)
    assert hashed == ["part-00000.tfrecord"]


def _upload(tmp_path, bucket, counts) -> list[str]:
    """A dataset written locally, then copied into `bucket/d/` with its manifest: the object paths."""
    from data_pipeline import storage

    paths = write_dataset(tmp_path / "d", counts)
    for p in paths + [str(tmp_path / "d" / manifests.run_manifest_name(paths))]:
        storage.copy(p, f"{bucket}/d/{os.path.basename(p)}")
    return [f"{bucket}/d/{os.path.basename(p)}" for p in paths]


def test_a_new_machine_trusts_the_hashes_kept_in_the_workdir(tmp_path, bucket, hashed, monkeypatch):
    """A TPU VM recreated after a preemption has an empty local cache: the hashes its run kept in
    the workdir (any process's file) spare it the dataset; a rewritten object is hashed again."""
    from data_pipeline import storage

    objects = _upload(tmp_path, bucket, [3, 4, 5])
    sizes = [storage.getsize(p) for p in objects]
    pattern, shared = f"{bucket}/d/*.tfrecord", f"{bucket}/work/verified_data"

    def start(vm, process_index=0, process_count=1):
        monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / vm))  # the machine's local disk
        hashed.clear()
        return records.check_files(pattern, process_index=process_index, process_count=process_count,
                                   verify=True, skip_corrupt=False, require_files_per_host=True,
                                   known_hashes_file=f"{shared}/process_{process_index}.json").verification

    assert start("vm1") == {"hashed_files": 3, "hashed_bytes": sum(sizes), "trusted_files": 0}
    assert sorted(hashed) == ["part-00000.tfrecord", "part-00001.tfrecord", "part-00002.tfrecord"]
    assert storage.listdir(shared) == ["process_0.json"]
    assert start("vm2") == {"hashed_files": 0, "hashed_bytes": 0, "trusted_files": 3} and hashed == []
    # Two hosts now: process 1 trusts what process 0 hashed, and writes its own file.
    assert start("vm3", 1, 2) == {"hashed_files": 0, "hashed_bytes": 0, "trusted_files": 1} and hashed == []
    assert storage.listdir(shared) == ["process_0.json", "process_1.json"]
    # The same bytes uploaded again: a new generation, hashed again on the next new machine, alone.
    storage.copy(str(tmp_path / "d" / "part-00001.tfrecord"), objects[1])
    assert start("vm4") == {"hashed_files": 1, "hashed_bytes": sizes[1], "trusted_files": 2}
    assert hashed == ["part-00001.tfrecord"]
    assert start("vm5") == {"hashed_files": 0, "hashed_bytes": 0, "trusted_files": 3} and hashed == []


def test_the_training_input_keeps_the_hashes_in_the_workdir_and_logs_the_counts(
        tmp_path, bucket, hashed, monkeypatch, caplog):
    """pretrain's input builder: one line per start saying what verification took."""
    import logging

    from bert_jax.pretrain.phases import resolve_phases
    from data_pipeline import storage
    from bert_jax.pretrain.feed import make_train_input
    from configs import test as test_config

    objects = _upload(tmp_path, bucket, [8, 8])
    config = test_config.get_config()
    config.train_data, config.shuffle_buffer_size = f"{bucket}/d/*.tfrecord", 8
    phase = resolve_phases(config)[0]
    size = sum(storage.getsize(p) for p in objects)
    lines = []
    for vm in ("vm1", "vm2"):
        monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / vm))
        caplog.clear()
        with caplog.at_level(logging.INFO):
            make_train_input(config, phase, None, f"{bucket}/work")
        lines += [r.getMessage() for r in caplog.records if r.getMessage().startswith("data verification:")]
    assert lines == [f"data verification: hashed 2 files ({size} bytes), trusted 0 from earlier runs",
                     "data verification: hashed 0 files (0 bytes), trusted 2 from earlier runs"]
