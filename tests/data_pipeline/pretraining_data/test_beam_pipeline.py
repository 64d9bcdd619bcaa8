"""The Beam runner (`data_pipeline.pretraining_data.beam_pipeline`) on the DirectRunner: byte for byte the local
path's files, the same dataset_info.json (timing, RSS and the runner's own fields aside), counters
equal to the local statistics, and errors that name the file or flag.

The files are compared as bytes and their records counted from the TFRecord length headers, so
only the TFDS case imports TensorFlow (the local path's records are checked against TensorFlow's
reader in tests/data_pipeline/pretraining_data/test_create_pretraining_data.py and test_fast_mode.py)."""

import dataclasses
import gzip
import json
import os
import pickle
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("apache_beam")

from data_pipeline import create_pretraining_data as cpd  # noqa: E402
from data_pipeline.pretraining_data import beam_pipeline, corpora  # noqa: E402
from data_pipeline.pretraining_data import shards  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
STEMS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta",
         "river", "stone", "cloud", "light", "night", "paper", "garden", "window", "silver", "morning"]
SUFFIXES = ["", "", "", "s", "ing", "ed", "ly"]
# Fields that differ run to run or say how the job ran, not what it wrote.
RUN_FIELDS = ("seconds", "instances_per_second", "peak_rss_mb", "runner")


def write_corpus(out: Path) -> tuple[list[str], Path]:
    """Four shard files (one empty; one with an invalid UTF-8 line and empty documents) and a
    vocab with ## pieces, so whole-word masking has words of several pieces."""
    rng = random.Random(5)

    def docs(n):
        return [[" ".join(rng.choice(STEMS) + rng.choice(SUFFIXES) for _ in range(rng.randint(3, 18))) + "."
                 for _ in range(rng.randint(1, 8))] for _ in range(n)]

    files = []
    for shard, n in enumerate([14, 0, 11, 16]):
        path = out / f"shard-{shard}.txt"
        corpora.write_google_text(str(path), docs(n))
        files.append(str(path))
    with open(files[2], "ab") as f:
        f.write(b"\n\n\nRiver \xff\xfe stone gardens.\nLight papers.\n")
    vocab = out / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + STEMS
                               + ["##" + s for s in SUFFIXES if s]) + "\n")
    return files, vocab


def count_records(data: bytes) -> int:
    """Records of TFRecord file bytes, walking the length headers (and checking they end exactly)."""
    n = pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        pos += 12 + length + 4
        n += 1
    assert pos == len(data)
    return n


def file_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def without_run_fields(info: dict) -> dict:
    return {k: v for k, v in info.items() if k not in RUN_FIELDS}


def test_bucket_size_and_file_assignment_invert_the_local_rule():
    # _WriteFile inverts output_index: for file f it takes bucket (f - before) % K of each shard.
    for num_outputs in (1, 2, 3, 7):
        for num_records in (0, 1, 5, 20, 23):
            want = np.bincount(np.arange(num_records) % num_outputs, minlength=num_outputs)
            got = [beam_pipeline.bucket_size(num_records, b, num_outputs) for b in range(num_outputs)]
            assert got == want.tolist()
            for before in (0, 4, 11):
                files = [shards.output_index(before, b, num_outputs) for b in range(num_outputs)]
                assert sorted(files) == list(range(num_outputs))  # each bucket its own file


def test_direct_runner_in_process_writes_the_local_paths_files(tmp_path):
    files, vocab = write_corpus(tmp_path)
    opts = shards.Options(vocab_file=str(vocab), max_seq_length=32, max_predictions_per_seq=5, dupe_factor=3,
                       random_seed=17)
    sources = [("text", f) for f in files]
    names = [f"part-{i}" for i in range(3)]
    local = cpd.run(opts, sources=sources, outputs=[str(tmp_path / "local" / n) for n in names],
                    reference_compatible=False)
    beam = beam_pipeline.run(opts, sources=sources, outputs=[str(tmp_path / "beam" / n) for n in names])
    assert local["num_instances"] > 100 and local["read_stats"]["lines_with_bad_utf8"] == 1
    assert local["read_stats"]["empty_documents"] >= 1
    for n in names:
        data = (tmp_path / "beam" / n).read_bytes()
        assert data == (tmp_path / "local" / n).read_bytes(), n
        assert count_records(data) > 30
    local_info = json.loads((tmp_path / "local" / "part-0.dataset_info.json").read_text())  # named after the first
    beam_info = json.loads((tmp_path / "beam" / "part-0.dataset_info.json").read_text())
    assert without_run_fields(beam_info) == without_run_fields(local_info)  # manifest included
    assert beam_info["runner"]["beam_runner"] == "DirectRunner"
    assert beam["peak_rss_mb"]["workers"] is None  # in_memory: the shards ran in this process
    read = local["read_stats"]
    assert beam["runner"]["counters"] == {
        "shards": 4, "documents": read["documents"], "empty_documents": read["empty_documents"],
        "lines_with_bad_utf8": 1, "instances": local["mask_stats"]["instances"],
        "records_written": local["num_instances"]}
    assert sorted(p.name for p in (tmp_path / "beam").iterdir()) == sorted(["part-0.dataset_info.json"] + names)  # no temp dir


def test_a_beam_run_joins_a_folder_other_runs_wrote_with_its_own_manifest(tmp_path):
    """Google's "call the script multiple times", one of the calls a Beam job: each run's manifest
    beside its records, all of them one dataset (`manifests`: every file listed once, the same
    settings); a Beam run overwriting another run's files is refused before the job starts."""
    from data_pipeline.records import manifests

    files, vocab = write_corpus(tmp_path)
    opts = shards.Options(vocab_file=str(vocab), max_seq_length=32, max_predictions_per_seq=5, dupe_factor=2)
    out = tmp_path / "data"
    cpd.run(opts, sources=[("text", files[0])], outputs=[str(out / "local.tfrecord")], reference_compatible=False)
    beam = [str(out / f"beam-{i:05d}-of-00003.tfrecord") for i in range(3)]
    beam_pipeline.run(opts, sources=[("text", f) for f in files[1:]], outputs=beam)
    assert sorted(p.name for p in out.iterdir()) == ["beam-00000-of-00003.tfrecord", "beam-00001-of-00003.tfrecord",
                                                    "beam-00002-of-00003.tfrecord", "beam.dataset_info.json",
                                                    "local.dataset_info.json", "local.tfrecord"]
    found = manifests.touched([str(out / "*.tfrecord")])
    manifests.check_agree(found, "data/*.tfrecord")
    listed = {path: entry["num_records"] for m in found for path, entry in m.files.items()}
    assert sorted(listed) == sorted(str(p) for p in out.glob("*.tfrecord"))
    assert all(count_records((out / os.path.basename(p)).read_bytes()) == n for p, n in listed.items())
    with pytest.raises(ValueError, match=r"beam\.dataset_info\.json lists 1 of this run's output files "
                                         r"\(beam-00000-of-00003\.tfrecord\)"):
        beam_pipeline.run(opts, sources=[("text", files[0])], outputs=beam[:1])
    assert not list(out.glob(".beam-tmp-*"))


def test_the_shard_step_carries_the_vocab_to_workers_that_cannot_read_the_drivers_file(tmp_path):
    """On Dataflow the workers have no --vocab_file of the driver's machine: the pickled step
    carries the vocabulary. Here the file is moved away between pickling and processing."""
    files, vocab = write_corpus(tmp_path)
    opts = shards.Options(vocab_file=str(vocab), max_seq_length=32, max_predictions_per_seq=5, dupe_factor=2)
    shards.init_worker(opts, 2)
    chunks, counts, _, _, _ = shards.shard_records((3, ("text", files[3])))  # what the local path makes
    step = pickle.dumps(beam_pipeline._ProcessShard(opts, 2, str(tmp_path / "job")))
    vocab.rename(tmp_path / "elsewhere.txt")
    shards.init_worker(dataclasses.replace(opts, vocab_file=str(tmp_path / "elsewhere.txt")), 1)  # other state
    (done,) = pickle.loads(step).process((3, ("text", files[3])))
    assert done.num_records == int(sum(counts)) > 20
    for bucket, chunk in enumerate(chunks):
        assert (tmp_path / "job" / f"shard-0000003-bucket-{bucket:05d}").read_bytes() == chunk


def test_cli_beam_worker_processes_equal_the_local_worker_pool_gzip_whole_word(tmp_path):
    """Both CLIs with 2 worker processes: the local fork pool, and the DirectRunner's
    multi_processing mode asked for through --beam_pipeline_options (with --num_workers=1, so
    the pass-through options are what made it multi-process)."""
    files, vocab = write_corpus(tmp_path)
    common = [f"--input_file={tmp_path}/shard-*.txt", f"--vocab_file={vocab}", "--max_seq_length=24",
              "--max_predictions_per_seq=4", "--dupe_factor=2", "--random_seed=3", "--do_whole_word_mask",
              "--compression=gzip", "--num_output_shards=2"]
    runs = {"local": ["--num_workers=2"],
            "beam": ["--runner=beam", "--beam_runner=DirectRunner", "--num_workers=1",
                     "--beam_pipeline_options=--direct_num_workers=2 --direct_running_mode=multi_processing"]}
    for name, extra in runs.items():
        r = subprocess.run([sys.executable, "-m", "data_pipeline.create_pretraining_data", *common,
                            f"--output_file={tmp_path / name / 'train.tfrecord'}", *extra],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
    outputs = [f"train-{i:05d}-of-00002.tfrecord.gz" for i in range(2)]
    for n in outputs:
        data = (tmp_path / "beam" / n).read_bytes()
        assert data == (tmp_path / "local" / n).read_bytes(), n
        assert count_records(file_bytes(tmp_path / "beam" / n)) > 20
    local = json.loads((tmp_path / "local" / "train.dataset_info.json").read_text())
    beam = json.loads((tmp_path / "beam" / "train.dataset_info.json").read_text())
    assert list(beam["files"]) == outputs
    assert local["flags"].pop("num_workers") == 2 and beam["flags"].pop("num_workers") == 1
    assert local["flags"].pop("output_file").startswith(str(tmp_path / "local"))
    assert beam["flags"].pop("output_file").startswith(str(tmp_path / "beam"))
    assert beam["flags"]["do_whole_word_mask"] is True
    assert without_run_fields(beam) == without_run_fields(local)
    assert beam["runner"]["pipeline_options"] == ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]
    assert beam["peak_rss_mb"]["workers"] > 0  # the shards ran in the DirectRunner's worker processes
    assert beam["runner"]["counters"]["records_written"] == local["num_instances"] > 40


def test_missing_input_and_flag_misuse_are_errors_naming_them(tmp_path):
    files, vocab = write_corpus(tmp_path)
    opts = shards.Options(vocab_file=str(vocab), max_seq_length=32, max_predictions_per_seq=5, dupe_factor=1)
    missing = str(tmp_path / "no-such-shard.txt")
    with pytest.raises(FileNotFoundError, match="no-such-shard.txt"):
        beam_pipeline.run(opts, sources=[("text", files[0]), ("text", missing)],
                          outputs=[str(tmp_path / "out" / "train.tfrecord")])
    assert not (tmp_path / "out" / "train.dataset_info.json").exists()
    base = [sys.executable, "-m", "data_pipeline.create_pretraining_data", f"--input_file={files[0]}",
            f"--vocab_file={vocab}", f"--output_file={tmp_path / 'cli' / 'train.tfrecord'}"]
    for extra, message in ((["--runner=beam", "--reference_compatible"], "--reference_compatible"),
                           (["--beam_pipeline_options=--project=p"], "--beam_pipeline_options needs --runner=beam")):
        r = subprocess.run(base + extra, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]


def test_beam_stays_optional():
    """The local path never imports Beam; without it, --runner=beam says how to install it."""
    code = ("import sys\n"
            "from data_pipeline import create_pretraining_data\n"
            "assert 'apache_beam' not in sys.modules\n"
            "sys.modules['apache_beam'] = None  # as if not installed\n"
            "from data_pipeline.pretraining_data import beam_pipeline\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "AssertionError" not in r.stderr, r.stderr[-2000:]
    assert "pip install -e '.[beam]'" in r.stderr.splitlines()[-1]


def test_tfds_shards_as_sources_give_the_local_paths_file(tmp_path):
    """`--input_format=tfds` sources (slices of a split) through Beam, on a mocked TFDS dataset."""
    tfds = pytest.importorskip("tensorflow_datasets")
    vocab = tmp_path / "vocab.txt"
    letters = list("abcdefghij")
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + letters
                               + ["##" + c for c in letters]) + "\n")
    opts = shards.Options(vocab_file=str(vocab), max_seq_length=24, max_predictions_per_seq=4, dupe_factor=2)
    with tfds.testing.mock_data(num_examples=30):
        sources = cpd.tfds_sources("wikipedia/20230601.en", "train", "text", None, 3)
        local = cpd.run(opts, sources=sources, outputs=[str(tmp_path / "local" / "train.tfrecord")],
                        reference_compatible=False)
        beam = beam_pipeline.run(opts, sources=sources, outputs=[str(tmp_path / "beam" / "train.tfrecord")])
    data = (tmp_path / "beam" / "train.tfrecord").read_bytes()
    assert data == (tmp_path / "local" / "train.tfrecord").read_bytes()
    assert count_records(data) == beam["num_instances"] == local["num_instances"] > 90
    # mock_data serves 30 examples for any split it is asked for, here each of the 3 even parts.
    assert beam["read_stats"]["documents"] == beam["runner"]["counters"]["documents"] == 3 * 30
