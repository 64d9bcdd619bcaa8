"""Many runs of create_pretraining_data into one folder (issue 59: Google's "shard the input file and
call the script multiple times", a cluster's job array): each run writes its own manifest, runs
started at once never clobber each other, the trainer's check reads every manifest a glob touches
and refuses records made otherwise (another vocabulary, length, casing, ...), and a folder of an
earlier version (one dataset_info.json) is still read."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

tf = pytest.importorskip("tensorflow")

from data_pipeline import create_pretraining_data as cpd  # noqa: E402
from data_pipeline.pretraining_data import shards  # noqa: E402
from data_pipeline.records import manifests, reader as records  # noqa: E402
from tests.helpers.pretraining_records import read_records  # noqa: E402
from tests.helpers.synthetic_corpus import synthetic_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]

FLAGS = dict(max_seq_length=32, max_predictions_per_seq=4, dupe_factor=2)


def check(pattern: str, verify=True) -> records.HostFiles:
    """The trainer's check of its data before the first step (`PretrainingInput`, `EvalInput`)."""
    return records.check_files(pattern, process_index=0, process_count=1, verify=verify, skip_corrupt=False,
                               require_files_per_host=True)


def make(tmp_path, text, vocab, name: str, **flags) -> dict:
    """One run, in this process, writing `tmp_path/data/<name>.tfrecord`; its info."""
    opts = shards.Options(vocab_file=str(vocab), **{**FLAGS, **flags})
    return cpd.run(opts, sources=[("text", str(text))], outputs=[str(tmp_path / "data" / f"{name}.tfrecord")],
                   reference_compatible=False)


def test_a_runs_manifest_is_named_after_its_output():
    name = manifests.run_manifest_name
    assert name(cpd.output_paths("d/train.tfrecord", 16, "gzip")) == "train.dataset_info.json"
    assert name(cpd.output_paths("d/train.tfrecord", 1, "none")) == "train.dataset_info.json"
    assert name(["d/shard-07.tfrecord"]) == "shard-07.dataset_info.json"
    # A job array's task writing one file of a numbered family keeps its number: its own manifest.
    assert name(["d/wiki-00003-of-00100.tfrecord"]) == "wiki-00003-of-00100.dataset_info.json"
    assert name(cpd.output_paths("d/b.tfrecord,d/a.tfrecord", 1, "none")) == "a.dataset_info.json"
    assert all(map(manifests.is_manifest, ["train.dataset_info.json", "dataset_info.json"]))
    assert not manifests.is_manifest("train.tfrecord")


def test_runs_started_at_once_into_one_folder_are_read_through_one_glob(tmp_path):
    text, vocab = synthetic_corpus(tmp_path)
    out = tmp_path / "data"
    runs = [[f"--output_file={out / 'shard-0.tfrecord'}", "--random_seed=1"],
            [f"--output_file={out / 'shard-1.tfrecord'}", "--random_seed=2"],
            [f"--output_file={out / 'shard-2.tfrecord'}", "--random_seed=3", "--num_output_shards=2",
             "--compression=gzip"]]
    procs = [subprocess.Popen([sys.executable, "-m", "data_pipeline.create_pretraining_data", f"--input_file={text}",
                               f"--vocab_file={vocab}", *[f"--{k}={v}" for k, v in FLAGS.items()], *run],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for run in runs]  # all three started before any is waited for
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    assert sorted(os.listdir(out)) == [
        "shard-0.dataset_info.json", "shard-0.tfrecord", "shard-1.dataset_info.json", "shard-1.tfrecord",
        "shard-2-00000-of-00002.tfrecord.gz", "shard-2-00001-of-00002.tfrecord.gz", "shard-2.dataset_info.json"]
    made = sum(json.loads((out / f"shard-{i}.dataset_info.json").read_text())["num_instances"] for i in range(3))
    # `*` matches the manifests too: they are never taken for records.
    files = check(str(out / "*"))
    assert len(files.all_files) == 4
    assert files.read_records == sum(len(read_records(p)) for p in files.all_files) == made > 0
    assert records.dataset_info(str(out / "shard-*"))["max_seq_length"] == 32


@pytest.mark.parametrize("field", ["max_seq_length", "vocab"])
def test_a_run_made_otherwise_is_refused_naming_both_manifests_the_field_and_the_values(tmp_path, field):
    text, vocab = synthetic_corpus(tmp_path)
    make(tmp_path, text, vocab, "a")
    if field == "max_seq_length":
        make(tmp_path, text, vocab, "b", max_seq_length=48)
        message = (r"different max_seq_length: 32 per \S*/data/a\.dataset_info\.json, "
                   r"48 per \S*/data/b\.dataset_info\.json")
    else:
        other = tmp_path / "other_vocab.txt"
        other.write_text(vocab.read_text() + "extra\n")  # another vocabulary: one more token
        make(tmp_path, text, other, "b")
        sha = [hashlib.sha256(v.read_bytes()).hexdigest() for v in (vocab, other)]
        message = (rf"different vocab_sha256: '{sha[0]}' per \S*/data/a\.dataset_info\.json, '{sha[1]}' per "
                   rf"\S*/data/b\.dataset_info\.json \(vocab_file \S*/vocab\.txt vs \S*/other_vocab\.txt\)")
    pattern = str(tmp_path / "data" / "*.tfrecord")
    for verify in (True, False):  # the settings are checked whether or not the files are
        with pytest.raises(manifests.ManifestMismatchError, match=message):
            check(pattern, verify)
    with pytest.raises(manifests.ManifestMismatchError, match=message):
        records.dataset_info(pattern)  # where the trainer reads the casing and the vocabulary's sha256
    # Each run alone is one dataset.
    assert check(str(tmp_path / "data" / "b*.tfrecord")).read_records > 0


def test_a_file_two_manifests_list_is_refused_naming_both(tmp_path):
    text, vocab = synthetic_corpus(tmp_path)
    make(tmp_path, text, vocab, "a")
    data = tmp_path / "data"
    (data / "copy.dataset_info.json").write_bytes((data / "a.dataset_info.json").read_bytes())
    with pytest.raises(records.CorruptDataError, match=r"a\.tfrecord: is listed by two data manifests, "
                                                  r"\S*/a\.dataset_info\.json and \S*/copy\.dataset_info\.json"):
        check(str(data / "*.tfrecord"))


def test_a_folder_of_an_earlier_version_is_still_read_and_new_runs_join_it(tmp_path):
    text, vocab = synthetic_corpus(tmp_path)
    data = tmp_path / "data"
    old = make(tmp_path, text, vocab, "old")["num_instances"]
    (data / "old.dataset_info.json").rename(data / "dataset_info.json")  # as earlier versions named it
    assert check(str(data / "*.tfrecord")).read_records == old
    assert records.dataset_info(str(data / "old.tfrecord"))["num_instances"] == old
    new = make(tmp_path, text, vocab, "new", random_seed=5)["num_instances"]
    assert check(str(data / "*.tfrecord")).read_records == old + new
    make(tmp_path, text, vocab, "odd", do_lower_case=False)
    with pytest.raises(manifests.ManifestMismatchError,
                       match=r"different do_lower_case: True per \S*/data/dataset_info\.json, "
                             r"False per \S*/data/odd\.dataset_info\.json"):
        check(str(data / "*.tfrecord"))
    # A rerun there of the very files the old manifest lists replaces it with the run's own.
    again = make(tmp_path, text, vocab, "old")["num_instances"]
    assert not (data / "dataset_info.json").exists() and (data / "old.dataset_info.json").exists()
    assert check(f"{data / 'old.tfrecord'},{data / 'new.tfrecord'}").read_records == again + new
