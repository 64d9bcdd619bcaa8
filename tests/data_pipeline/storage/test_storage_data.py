"""data_pipeline on Cloud Storage (gs://, against the fake-gcs-server of tests/conftest.py): each
command and reader gives on a bucket exactly what it gives on local disk, and writes no local
folder named `gs:`."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

tf = pytest.importorskip("tensorflow")

from data_pipeline import create_pretraining_data as cpd  # noqa: E402
from data_pipeline import tasks  # noqa: E402
from data_pipeline.input import evaluation, pretraining as ip  # noqa: E402
from data_pipeline.records import reader  # noqa: E402
from data_pipeline.tokenization.sentencepiece_tokenizer import create_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
STEMS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta",
         "river", "stone", "cloud", "light", "night", "paper", "garden", "window", "silver", "morning"]
SUFFIXES = ["", "", "", "s", "ing", "ed", "ly"]


def corpus_texts(num_files: int = 2, docs_per_file: int = 12) -> list[str]:
    """Google-format text files of made-up words (a blank line between documents)."""
    rng = random.Random(3)
    files = []
    for _ in range(num_files):
        docs = []
        for _ in range(docs_per_file):
            sentences = [" ".join(rng.choice(STEMS) + rng.choice(SUFFIXES) for _ in range(rng.randint(3, 12)))
                         .capitalize() + rng.choice(".!?") for _ in range(rng.randint(1, 6))]
            docs.append("\n".join(sentences) + "\n")
        files.append("\n".join(docs))
    return files


def put(root: str, files: dict) -> None:
    """Writes {relative name: text or bytes} under `root` (a local folder or a gs:// prefix)."""
    for name, data in files.items():
        path = storage_paths.join(root, *name.split("/"))
        storage.write_bytes(path, data.encode("utf-8") if isinstance(data, str) else data)


def run_module(module: str, args: list, cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    """`python -m module args` from `cwd`, with the emulator's variables (os.environ) inherited."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), BERT_JAX_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


# ---------------------------------------------------------------------------------------------
# The commands: train_vocab, then create_pretraining_data, every path in the bucket
# ---------------------------------------------------------------------------------------------


def test_train_vocab_and_create_pretraining_data_write_the_same_files_in_a_bucket(bucket, tmp_path):
    texts = {f"corpus/part-{i}.txt": t for i, t in enumerate(corpus_texts())}
    local, remote = str(tmp_path / "local"), bucket + "/run"
    put(local, texts)
    put(remote, texts)
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()

    for root in (local, remote):
        run_module("data_pipeline.train_vocab", [
            f"--input_file={storage_paths.join(root, 'corpus', '*.txt')}", "--vocab_size=60",
            f"--output_file={storage_paths.join(root, 'vocab', 'vocab.txt')}",
            f"--spm_model_prefix={storage_paths.join(root, 'vocab', 'spm')}", "--heldout_every=7"], cwd, cache)
    for name in ("vocab.txt", "spm.vocab", "spm.tokenizer.json"):
        assert storage.read_bytes(storage_paths.join(remote, "vocab", name)) == \
            storage.read_bytes(storage_paths.join(local, "vocab", name)), name
    listed = sorted(os.listdir(storage_paths.join(local, "vocab")))
    assert storage.listdir(storage_paths.join(remote, "vocab")) == listed == [
        "spm.model", "spm.tokenizer.json", "spm.vocab", "vocab.txt"]
    # The SentencePiece model (whose bytes record the paths it was trained from) loads from the
    # bucket and tokenizes as the local one does.
    sp_local = create_tokenizer(storage_paths.join(local, "vocab", "spm.model"))
    sp_remote = create_tokenizer(storage_paths.join(remote, "vocab", "spm.model"))
    sentence = "The silver rivers glinting at morning"
    assert sp_remote.vocab == sp_local.vocab and sp_remote.tokenize(sentence) == sp_local.tokenize(sentence)
    assert len(sp_local.tokenize(sentence)) > 3

    # Records: two output shards, gzip; the bucket's run uses two (forked) workers, the local one
    # none: the files do not depend on the worker count.
    for root, workers in ((local, 1), (remote, 2)):
        run_module("data_pipeline.create_pretraining_data", [
            f"--input_file={storage_paths.join(root, 'corpus', 'part-*.txt')}",
            f"--output_file={storage_paths.join(root, 'records', 'train.tfrecord')}",
            f"--vocab_file={storage_paths.join(root, 'vocab', 'vocab.txt')}", "--max_seq_length=24",
            "--max_predictions_per_seq=4", "--dupe_factor=2", "--num_output_shards=2", "--compression=gzip",
            f"--num_workers={workers}", "--random_seed=5"], cwd, cache)
    names = ["train-00000-of-00002.tfrecord.gz", "train-00001-of-00002.tfrecord.gz", "train.dataset_info.json"]
    assert storage.listdir(storage_paths.join(remote, "records")) == sorted(os.listdir(os.path.join(local, "records")))
    assert storage.listdir(storage_paths.join(remote, "records")) == names
    for name in names[:2]:
        ours = storage.read_bytes(storage_paths.join(remote, "records", name))
        assert ours == storage.read_bytes(storage_paths.join(local, "records", name)) and len(ours) > 1000, name
    info = {root: json.loads(storage.read_text(storage_paths.join(root, "records", "train.dataset_info.json")))
            for root in (local, remote)}
    for key in ("input_file", "output_file", "vocab_file"):  # the flags as given: the paths differ
        assert info[remote]["flags"].pop(key).startswith(remote + "/")
        assert info[local]["flags"].pop(key).startswith(local + "/")
    assert info[remote]["flags"].pop("num_workers") == 2 and info[local]["flags"].pop("num_workers") == 1
    for i in info.values():
        for key in ("seconds", "instances_per_second", "peak_rss_mb"):  # this run's measurements
            del i[key]
    assert info[remote] == info[local]
    assert info[local]["num_instances"] > 50 and len(info[local]["files"]) == 2
    # Nothing was written where the commands ran: no folder "gs:" (nor anything else).
    assert list(cwd.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# The training input over records in a bucket
# ---------------------------------------------------------------------------------------------

L, P = 24, 4
SPECIAL = {"mask_id": 4, "cls_id": 2, "sep_id": 3, "vocab_size": 40}


@pytest.fixture
def records(bucket, tmp_path, monkeypatch):
    """The same records (3 files + part.dataset_info.json) on local disk and in the bucket:
    (local folder, gs:// folder)."""
    monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    texts = corpus_texts(num_files=3, docs_per_file=8)
    put(str(tmp_path / "text"), {f"{i}.txt": t for i, t in enumerate(texts)})
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "!", "?"] + STEMS
                               + ["##" + s for s in SUFFIXES if s]) + "\n")
    local = tmp_path / "records"
    cpd.create_pretraining_data([str(tmp_path / "text" / f"{i}.txt") for i in range(3)], str(local), str(vocab),
                                num_output_shards=3, max_seq_length=L, max_predictions_per_seq=P, dupe_factor=2,
                                random_seed=1)
    remote = bucket + "/records"
    storage.copy_tree(str(local), remote)
    assert storage.listdir(remote) == sorted(os.listdir(local))
    return str(local), remote


def make_input(folder, **kw) -> ip.PretrainingInput:
    args = dict(per_host_batch_size=4, max_seq_length=L, max_predictions_per_seq=P, seed=3,
                shuffle_buffer_size=16, dynamic_masking=True, special_ids=SPECIAL)
    args.update(kw)
    return ip.PretrainingInput(storage_paths.join(folder, "part-*.tfrecord"), **args)


def batches(ds, n: int) -> list[dict]:
    return [next(ds) for _ in range(n)]


def assert_same_batches(ours: list, want: list) -> None:
    assert len(ours) == len(want)
    for a, b in zip(ours, want):
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_pretraining_input_from_a_bucket_saves_and_resumes_there(records, tmp_path):
    local, remote = records
    want = batches(make_input(local), 14)  # over 1 epoch (the files hold ~40 records): reshuffled
    ds = make_input(remote)
    assert ds.host_files == [storage_paths.join(remote, f"part-{i:05d}-of-00003.tfrecord") for i in range(3)]
    first = batches(ds, 5)
    assert_same_batches(first, want[:5])
    assert ds.stats["records_per_epoch"] == make_input(local).stats["records_per_epoch"] > 30

    # Saved into the bucket after 5 batches: the same files as a local save, nothing local left.
    state = storage_paths.join(storage_paths.dirname(remote), "state")  # a sibling prefix in the bucket
    ds.save_state(state)
    local_ds = make_input(local)
    batches(local_ds, 5)
    local_ds.save_state(str(tmp_path / "state"))
    assert storage.listdir(state) == sorted(os.listdir(tmp_path / "state"))
    assert "input_state.json" in storage.listdir(state)
    assert any(n.startswith("iterator.") for n in storage.listdir(state))
    saved = json.loads(storage.read_text(storage_paths.join(state, "input_state.json")))
    assert saved["counters"] == {"batches": 5, "sequences": 20}

    # A new input restored from the bucket continues exactly as the uninterrupted one.
    resumed = make_input(remote)
    resumed.restore_state(state)
    assert_same_batches(batches(resumed, 9), want[5:])
    assert resumed.stats["batches"] == 14
    with pytest.raises(FileNotFoundError, match=f"{remote}/nothing/input_state.json: no saved input state"):
        make_input(remote).restore_state(storage_paths.join(remote, "nothing"))

    # The finite, padded evaluation pass reads the bucket as it reads the disk.
    evals = {root: list(evaluation.make_eval_iterator(storage_paths.join(root, "part-*.tfrecord"),
                                                      per_host_batch_size=8, max_seq_length=L,
                                                      max_predictions_per_seq=P))
             for root in (local, remote)}
    assert len(evals[remote]) > 3
    assert_same_batches(evals[remote], evals[local])
    assert reader.record_shape(storage_paths.join(remote, "part-*.tfrecord")) == (L, P)
    assert reader.dataset_info(storage_paths.join(remote, "part-*.tfrecord")) == reader.dataset_info(
        storage_paths.join(local, "part-*.tfrecord"))


def _flip_a_payload_byte(data: bytes) -> bytes:
    """The file with one byte of its second record's payload flipped (its data CRC then fails)."""
    first = int.from_bytes(data[:8], "little")
    at = 16 + first + 12 + 5  # second record: header at 16 + first, payload 12 bytes later
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


def test_a_corrupt_file_in_a_bucket_is_named_or_its_good_records_read(records, tmp_path):
    local, remote = records
    name = "part-00001-of-00003.tfrecord"
    bad = _flip_a_payload_byte(storage.read_bytes(storage_paths.join(local, name)))
    storage.write_bytes(storage_paths.join(remote, name), bad)
    storage.write_bytes(storage_paths.join(local, name), bad)

    with pytest.raises(reader.CorruptDataError, match="sha256 differs from the manifest") as e:
        make_input(remote)
    assert e.value.path == storage_paths.join(remote, name) and str(e.value).startswith(f"{remote}/{name}: ")

    # Lenient: the same good records as from the damaged local file, in the same batches.
    kw = dict(skip_corrupt=True, repeat=False, dynamic_masking=False, per_host_batch_size=2)
    ours, want = make_input(remote, **kw), make_input(local, **kw)
    assert ours.stats["corrupt_files"] == [storage_paths.join(remote, name)]
    assert want.stats["corrupt_files"] == [storage_paths.join(local, name)]
    assert ours.stats["skipped_records"] == want.stats["skipped_records"] == 1
    assert_same_batches(list(ours), list(want))

    # Unverified, the damage is found while reading and named (a gs:// path, scanned through storage).
    with pytest.raises(reader.CorruptDataError, match="record data CRC mismatch") as e:
        list(make_input(remote, verify=False, repeat=False, shuffle_buffer_size=1, cycle_length=1))
    assert e.value.path == storage_paths.join(remote, name)


# ---------------------------------------------------------------------------------------------
# A fine-tuning task's files in a bucket
# ---------------------------------------------------------------------------------------------


def test_glue_task_reads_and_writes_predictions_in_a_bucket(bucket, tmp_path):
    files = {
        "MNLI/train.tsv": "index\tsentence1\tsentence2\tgold_label\n0\tThe cat sat.\tA cat sat.\tentailment\n"
                          "1\tA dog ran.\tNo dog ran.\tcontradiction\n2\tIt rained.\tIt was cold.\tneutral\n",
        "MNLI/dev_matched.tsv": "index\tsentence1\tsentence2\tgold_label\n7\tJohn sat.\tJohn was on the mat."
                                "\tentailment\n",
        "MNLI/test_matched.tsv": "index\tsentence1\tsentence2\n0\tCaf\u00e9 in Paris.\tA caf\u00e9.\n",
        # The diagnostic set sits beside the task's folder: read as MNLI/../diagnostic/diagnostic.tsv.
        "diagnostic/diagnostic.tsv": "index\tsentence1\tsentence2\n0\tSmith lives.\tSmith is.\n1\ta\tb\n",
    }
    local, remote = str(tmp_path / "glue"), bucket + "/glue"
    put(local, files)
    put(remote, files)
    out = {}
    for root in (local, remote):
        task = tasks.get_task("mnli", root)
        read = {split: task.read(split) for split in ("train", "dev_matched", "test_matched", "test_ax")}
        for split, examples in read.items():
            for e in examples:  # the source location names the file read
                assert e.where.startswith(root + "/") and e.where.count("..") == (split == "test_ax") * (root == local)
        out[root] = {split: [dataclass_fields(e) for e in examples] for split, examples in read.items()}
        preds = {"test_matched": ["neutral"], "test_ax": ["entailment", "contradiction"],
                 "dev_matched": ["entailment"]}
        written = [p for split, pred in preds.items()
                   for p in task.write_predictions(read[split], pred, storage_paths.join(root, "predictions"), split)]
        assert all(p.startswith(storage_paths.join(root, "predictions") + "/") for p in written)
    assert out[remote] == out[local] and len(out[local]["train"]) == 3 and len(out[local]["test_ax"]) == 2
    names = storage.listdir(storage_paths.join(remote, "predictions"))
    assert names == sorted(os.listdir(os.path.join(local, "predictions"))) == [
        "AX.tsv", "MNLI-m.tsv", "mnli_dev_matched_predictions.tsv", "mnli_test_ax_predictions.tsv",
        "mnli_test_matched_predictions.tsv"]
    for name in names:
        assert storage.read_bytes(storage_paths.join(remote, "predictions", name)) == \
            storage.read_bytes(os.path.join(local, "predictions", name)), name
    assert storage.read_text(storage_paths.join(remote, "predictions", "AX.tsv")) == \
        "index\tprediction\n0\tentailment\n1\tcontradiction\n"


def dataclass_fields(example) -> tuple:
    """An example's fields, less `where` (file:row, which names the root it was read from)."""
    import dataclasses
    return tuple((f.name, getattr(example, f.name)) for f in dataclasses.fields(example) if f.name != "where")
