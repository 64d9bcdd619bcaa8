"""Tests of data_pipeline.input.pretraining and the modules under it (record_scan, records): sharding,
exactly-once epochs, exact resume, corrupt-file detection and lenient skipping, padded eval;
dynamic masking is tests/data_pipeline/input/test_dynamic_masking.py's, packed rows
tests/data_pipeline/input/test_packed_pretraining.py's.

The records (tests/helpers/numbered_records.py) carry their own id in token 1, so a batch tells
which records it holds, even after (re-)masking.
"""

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.input import evaluation
from data_pipeline.records import manifests, reader as records_module
from tests.helpers.numbered_records import L, P, SPECIAL, make_input, record_ids, write_dataset


def batch_hash(batch: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode() + batch[k].tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Files and hosts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hosts", [1, 2, 3, 4, 8])
def test_host_file_sets_are_disjoint_and_complete(dataset, hosts):
    pattern, _ = dataset
    every = records_module.expand_file_patterns(pattern)
    assert len(every) == 8 and every == sorted(every)
    shares = [make_input(pattern, process_index=h, process_count=hosts).host_files
              for h in range(hosts)]
    flat = [f for share in shares for f in share]
    assert len(flat) == len(set(flat)) == 8  # disjoint
    assert sorted(flat) == every  # complete
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    # The list order given does not matter (hosts that glob differently still agree).
    assert records_module.host_files(every[::-1], 1 % hosts, hosts) == shares[1 % hosts]


def test_more_hosts_than_files_is_an_error(dataset):
    with pytest.raises(ValueError, match="process_count=9"):
        make_input(dataset[0], process_index=0, process_count=9)


def test_a_pattern_matching_nothing_names_the_pattern(tmp_path):
    with pytest.raises(records_module.CorruptDataError, match="nothing-here"):
        make_input(str(tmp_path / "nothing-here-*.tfrecord"), verify=False)
    # Verified: the pattern is what is wrong, not a missing manifest.
    with pytest.raises(records_module.CorruptDataError,
                       match=r"nothing-here-\*.tfrecord: no input file matches this pattern"):
        make_input(str(tmp_path / "nothing-here-*.tfrecord"))
    (tmp_path / "part-0.tfrecord").write_bytes(b"")
    with pytest.raises(records_module.CorruptDataError, match=r"no data manifest .* config.verify_data=False"):
        make_input(str(tmp_path / "part-*.tfrecord"))


# ---------------------------------------------------------------------------------------------
# Exactly once per epoch, determinism, finite epochs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [False, True])
def test_every_record_once_per_epoch_across_hosts(dataset, packing):
    pattern, total = dataset
    hosts, epochs = 3, 3
    seen_by_host = []
    for h in range(hosts):
        ds = make_input(pattern, process_index=h, process_count=hosts, packing=packing,
                        packing_window=8, dynamic_masking=True, special_ids=SPECIAL)
        n = ds.stats["records_in_files"]
        stream = []
        while len(stream) < epochs * n:
            stream += record_ids(next(ds))
        chunks = [stream[e * n:(e + 1) * n] for e in range(epochs)]
        for chunk in chunks:  # each epoch is a permutation of this host's records
            assert sorted(chunk) == sorted(chunks[0]) and len(set(chunk)) == n
        assert chunks[0] != chunks[1]  # and reshuffled between epochs
        seen_by_host.append(set(chunks[0]))
    union = set().union(*seen_by_host)
    assert union == set(range(total))
    assert sum(map(len, seen_by_host)) == total  # hosts disjoint


def test_same_seed_same_batches_other_seed_other_batches(dataset):
    pattern, _ = dataset
    kw = dict(dynamic_masking=True, special_ids=SPECIAL)

    def run(seed):
        ds = make_input(pattern, seed=seed, **kw)
        return [batch_hash(next(ds)) for _ in range(6)]

    reference = run(3)
    assert run(3) == reference
    assert run(4) != reference


@pytest.mark.parametrize("packing", [False, True])
def test_finite_epoch_gives_every_host_the_same_number_of_batches(dataset, packing):
    pattern, _ = dataset
    hosts, b = 3, 4
    counts = []
    for h in range(hosts):
        ds = make_input(pattern, process_index=h, process_count=hosts, repeat=False,
                        per_host_batch_size=b, packing=packing)
        batches = list(ds)
        assert len(batches) == ds.num_batches
        counts.append(len(batches))
    # Files 0,3,6 / 1,4,7 / 2,5 hold 3+6+9, 4+7+10, 5+8 records: the smallest host has 13.
    expected = 13 // b if not packing else -(-13 // 3) // b
    assert counts == [expected] * hosts


# ---------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [False, True])
def test_resume_yields_exactly_the_uninterrupted_batches(dataset, tmp_path, packing):
    """Saved after every batch for ~3 epochs, each state resumes to the uninterrupted hashes.

    Every cut point matters: TF restores some pipelines wrongly only when the iterator was saved
    at an epoch's end (see `_build`).
    """
    pattern, _ = dataset
    kw = dict(packing=packing, packing_window=8, dynamic_masking=True, special_ids=SPECIAL,
              process_index=1, process_count=2, per_host_batch_size=5, cycle_length=2)
    # This host has 4 files (28 records) read 2 at a time, so the file shuffle runs dry
    # mid-epoch; the cuts span ~2 epochs.
    cuts, after = 8, 4
    run = make_input(pattern, **kw)
    reference = []
    for cut in range(cuts + after):
        if cut < cuts:
            run.save_state(str(tmp_path / f"state-{cut}"))
        reference.append(batch_hash(next(run)))
    assert len(set(reference)) == len(reference)
    for cut in range(cuts):
        resumed = make_input(pattern, **kw)
        resumed.restore_state(str(tmp_path / f"state-{cut}"))
        assert resumed.stats["batches"] == cut
        got = [batch_hash(next(resumed)) for _ in range(after)]
        assert got == reference[cut:cut + after], f"resumed after batch {cut}"


def test_gzip_files_read_exactly_like_plain_ones_and_resume(tmp_path):
    """`create_pretraining_data --compression=gzip` output (`*.gz`) trains and evaluates on the
    same batches as the uncompressed records, and a mid-epoch state resumes the same."""
    counts = [3, 5, 4, 6]
    write_dataset(tmp_path / "plain", counts)
    write_dataset(tmp_path / "gz", counts, gzip=True)
    kw = dict(dynamic_masking=True, special_ids=SPECIAL, per_host_batch_size=3, cycle_length=2)
    plain = make_input(str(tmp_path / "plain" / "part-*"), **kw)
    gz = make_input(str(tmp_path / "gz" / "part-*"), **kw)
    assert gz.stats["records_per_epoch"] == plain.stats["records_per_epoch"] == sum(counts)
    reference = [batch_hash(next(plain)) for _ in range(12)]  # ~2 epochs
    got = []
    for i in range(5):
        got.append(batch_hash(next(gz)))
    gz.save_state(str(tmp_path / "state"))
    resumed = make_input(str(tmp_path / "gz" / "part-*"), **kw)
    resumed.restore_state(str(tmp_path / "state"))
    got += [batch_hash(next(resumed)) for _ in range(7)]
    assert got == reference
    evals = [[batch_hash(b) for b in evaluation.make_eval_iterator(
        str(tmp_path / d / "part-*"), per_host_batch_size=4, max_seq_length=L,
        max_predictions_per_seq=P)] for d in ("plain", "gz")]
    assert evals[0] == evals[1] and len(evals[0]) == 5
    assert records_module.record_shape(str(tmp_path / "gz" / "part-*")) == records_module.record_shape(
        str(tmp_path / "plain" / "part-*")) == (L, P)


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_gzip_file_is_named_or_its_good_records_kept(tmp_path, verify):
    paths = write_dataset(tmp_path, [4, 6, 5], gzip=True)
    data = Path(paths[1]).read_bytes()
    Path(paths[1]).write_bytes(data[:len(data) * 2 // 3])  # cut inside the deflate stream
    pattern = str(tmp_path / "part-*")
    # Both errors name the file and the config field that goes on past it.
    if verify:
        with pytest.raises(records_module.CorruptDataError, match="part-00001.*config.skip_corrupt_records=True"):
            make_input(pattern)
    else:
        with pytest.raises(records_module.CorruptDataError, match="part-00001.*config.skip_corrupt_records=True"):
            ds = make_input(pattern, verify=False, shuffle_buffer_size=1)
            for _ in range(10):
                next(ds)
    ds = make_input(pattern, skip_corrupt=True, repeat=False, per_host_batch_size=1, verify=verify)
    seen = sorted(rid for batch in ds for rid in record_ids(batch))
    kept = [rid for rid in range(4, 10) if rid in seen]
    assert kept == list(range(4, 4 + len(kept))) and len(kept) < 6  # a prefix of file 1
    assert seen == sorted(set(range(15)) - set(range(4 + len(kept), 10)))
    if verify:  # the manifest knows how many records were lost
        assert ds.stats["skipped_records"] == 6 - len(kept)


def test_restore_with_other_options_names_them(dataset, tmp_path):
    pattern, _ = dataset
    ds = make_input(pattern)
    next(ds)
    ds.save_state(str(tmp_path / "s"))
    with pytest.raises(ValueError, match="per_host_batch_size"):
        make_input(pattern, per_host_batch_size=2).restore_state(str(tmp_path / "s"))
    with pytest.raises(FileNotFoundError, match="no saved input state"):
        make_input(pattern).restore_state(str(tmp_path / "nothing"))
    # The same file names with other contents (and a fresh manifest) do not resume either.
    write_dataset(tmp_path / "d", [3, 3])
    ds = make_input(str(tmp_path / "d" / "part-*"))
    ds.save_state(str(tmp_path / "s2"))
    write_dataset(tmp_path / "d", [3, 3], first_id=100)
    with pytest.raises(ValueError, match="host_files_sha256"):
        make_input(str(tmp_path / "d" / "part-*")).restore_state(str(tmp_path / "s2"))


# ---------------------------------------------------------------------------------------------
# Corrupt data: the manifest check before training, and lenient skipping
# ---------------------------------------------------------------------------------------------


def _damage(path: str, kind: str) -> None:
    data = bytearray(Path(path).read_bytes())
    first = 12 + int.from_bytes(data[:8], "little") + 4  # bytes of the first record
    if kind == "bit_flip":  # in the payload of the second record
        data[first + 12 + 20] ^= 0x10
    elif kind == "truncated_header":  # cut 5 bytes into the last record's header
        data = data[:_record_offsets(data)[-1] + 5]
    elif kind == "truncated_payload":  # cut inside the last record's payload
        data = data[:_record_offsets(data)[-1] + 30]
    elif kind == "garbage":
        data = bytearray(np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8).tobytes())
    elif kind == "empty":
        data = bytearray()
    elif kind == "header_flip":  # the length field of the second record
        data[first + 2] ^= 0x01
    if kind == "missing":
        os.remove(path)
    else:
        Path(path).write_bytes(bytes(data))


def _record_offsets(data: bytes) -> list[int]:
    offsets, offset = [], 0
    while offset < len(data):
        offsets.append(offset)
        offset += 16 + int.from_bytes(data[offset:offset + 8], "little")
    return offsets


# kind -> records of the damaged 6-record file that lenient mode can still read
DAMAGE = {"bit_flip": 5, "truncated_header": 5, "truncated_payload": 5, "garbage": 0, "empty": 0,
          "missing": 0, "header_flip": 5}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_file_is_caught_before_training_naming_it(tmp_path, kind):
    paths = write_dataset(tmp_path, [4, 6, 5])
    _damage(paths[1], kind)
    with pytest.raises(records_module.CorruptDataError) as info:
        make_input(str(tmp_path / "part-*.tfrecord"))
    assert info.value.path == paths[1] and paths[1] in str(info.value)
    assert "skip_corrupt" in str(info.value)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_lenient_mode_skips_exactly_the_bad_records_and_counts_them(tmp_path, kind, monkeypatch):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    paths = write_dataset(tmp_path / "data", [4, 6, 5])
    good_left = DAMAGE[kind]
    _damage(paths[1], kind)
    ds = make_input(str(tmp_path / "data" / "part-*.tfrecord"), skip_corrupt=True, repeat=False,
                    per_host_batch_size=1)
    assert ds.stats["skipped_records"] == 6 - good_left
    assert ds.stats["records_per_epoch"] == 15 - (6 - good_left)
    assert ds.stats["corrupt_files"] == [paths[1]]
    seen = sorted(rid for batch in ds for rid in record_ids(batch))
    lost = {"bit_flip": {5}, "truncated_header": {9}, "truncated_payload": {9},
            "header_flip": {5}}.get(kind, set(range(4, 10)))  # file 1 holds records 4..9
    assert seen == sorted(set(range(15)) - lost)
    # The good records are read in place: no repaired copy anywhere (issue 31).
    # (TensorFlow's autograph may leave its own `__autograph_generated_file*.py` there.)
    ours = [p for p in temp.iterdir() if not p.name.startswith("__autograph_generated_file")]
    assert ours == [] and sorted(os.listdir(tmp_path / "data")) == sorted(
        [os.path.basename(p) for p in paths if os.path.exists(p)] + [manifests.run_manifest_name(paths)])


def test_lenient_mode_reads_the_good_records_byte_for_byte_in_runs(tmp_path, monkeypatch):
    # Several damaged stretches, runs cut at a small chunk size: the exact records, in file order.
    monkeypatch.setattr(records_module, "_CHUNK_BYTES", 600)
    paths = write_dataset(tmp_path, [12])
    data = bytearray(Path(paths[0]).read_bytes())
    offsets = _record_offsets(bytes(data))
    for r in (0, 4, 5, 9):  # flip a payload byte of records 0, 4, 5, 9
        data[offsets[r] + 12 + 20] ^= 0x10
    Path(paths[0]).write_bytes(bytes(data))
    good = [bytes(data[o + 12:o + 12 + int.from_bytes(data[o:o + 8], "little")])
            for i, o in enumerate(offsets) if i not in (0, 4, 5, 9)]
    files = records_module.check_files(paths[0], process_index=0, process_count=1, verify=True,
                                       skip_corrupt=True, require_files_per_host=True)
    units, read = records_module.file_datasets(files)
    assert [r.numpy() for r in units.flat_map(read)] == good
    assert len(records_module._good_chunks(files.good_records[paths[0]])) > 3  # really read in several runs


def test_unverified_corruption_raises_while_reading_naming_the_file(tmp_path):
    paths = write_dataset(tmp_path, [4, 6])
    _damage(paths[1], "bit_flip")
    ds = make_input(str(tmp_path / "part-*.tfrecord"), verify=False, shuffle_buffer_size=1)
    with pytest.raises(records_module.CorruptDataError, match="part-00001"):
        for _ in range(10):
            next(ds)


def test_a_missing_manifest_or_an_unlisted_file_is_an_error(tmp_path):
    paths = write_dataset(tmp_path, [3, 3])
    Path(tmp_path / "part-00009.tfrecord").write_bytes(Path(paths[0]).read_bytes())
    with pytest.raises(records_module.CorruptDataError, match="part-00009.*not listed"):
        make_input(str(tmp_path / "part-*.tfrecord"))
    os.remove(tmp_path / manifests.run_manifest_name(paths))
    with pytest.raises(records_module.CorruptDataError, match="verify=False"):
        make_input(str(tmp_path / "part-*.tfrecord"))
    assert make_input(str(tmp_path / "part-*.tfrecord"), verify=False).stats["records_in_files"] == 9


def test_wrong_max_seq_length_names_the_flag(dataset):
    with pytest.raises(ValueError, match="max_seq_length=64"):
        next(make_input(dataset[0], max_seq_length=64))


# ---------------------------------------------------------------------------------------------
# Eval
# ---------------------------------------------------------------------------------------------


def test_eval_is_one_padded_pass_with_equal_batch_counts(dataset):
    pattern, total = dataset
    hosts, b = 3, 4
    lengths, seen = [], []
    for h in range(hosts):
        ev = evaluation.make_eval_iterator(pattern, per_host_batch_size=b, max_seq_length=L,
                                   max_predictions_per_seq=P, process_index=h, process_count=hosts)
        batches = list(ev)
        assert list(ev) and len(list(ev)) == len(batches)  # each iter() is a fresh pass
        lengths.append(len(batches))
        for batch in batches:
            assert batch["input_ids"].shape == (b, L) and batch["next_sentence_labels"].shape == (b, 1)
            pad = batch["next_sentence_weights"] == 0
            assert np.all(batch["masked_lm_weights"][pad] == 0) and np.all(batch["input_mask"][pad] == 0)
            seen += record_ids(batch)
    # Hosts hold 18, 21, 13 records: ceil(21 / 4) = 6 batches each.
    assert lengths == [6, 6, 6]
    assert sorted(seen) == list(range(total))


def test_lenient_eval_keeps_hosts_in_step_and_counts_the_loss(tmp_path):
    paths = write_dataset(tmp_path, [5, 6, 4])  # hosts: files 0, 2 (9 records) and file 1 (6)
    _damage(paths[1], "bit_flip")  # record 6 of file 1 is lost
    lengths, seen = [], []
    for h in range(2):
        ev = evaluation.make_eval_iterator(str(tmp_path / "part-*.tfrecord"), per_host_batch_size=4,
                                   max_seq_length=L, max_predictions_per_seq=P, process_index=h,
                                   process_count=2, skip_corrupt=True)
        batches = list(ev)
        lengths.append(len(batches))
        assert ev.stats["skipped_records"] == (1 if h == 1 else 0)
        seen += [rid for b in batches for rid in record_ids(b)]
    assert lengths == [3, 3]  # ceil(9 / 4), on both hosts
    assert sorted(seen) == sorted(set(range(15)) - {6})
