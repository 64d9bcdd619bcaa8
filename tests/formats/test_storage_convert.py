"""Checkpoint conversion and the tools on gs:// (fake-gcs-server), each compared with the same
operation done on local files: `bert_jax.convert` (bert_jax -> HF and Google, gs:// -> gs://),
`bert_jax.extract_features` (input and output in the bucket) and `bert_jax.plot` (event files
read from the bucket, the PNG written there)."""

import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from bert_jax import convert
from bert_jax.formats.google import from_google
from bert_jax.model.model_config import BertConfig
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths
from tests.helpers.xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[2]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "dog", "ran", "a",
         "big", "red", "##s", "hello", "world", "!", ","]


def tiny_pretrained(tmp_path) -> convert.Pretrained:
    """A random 2-layer BERT with both heads (every variable random: biases and LayerNorms too),
    made from Google's variable names and shapes (no model init: quick)."""
    from bert_jax.formats.google import _table

    config = BertConfig(vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=32, max_position_embeddings=24, hidden_act="gelu_tanh")
    rng = np.random.default_rng(0)
    variables = {e.google: rng.standard_normal(e.google_shape).astype(np.float32) for e in _table(config)}
    params, missing, _ = from_google(variables, config)
    assert missing == ()
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    return convert.Pretrained(config, params, str(vocab), True)


def assert_params_equal(a, b):
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (k, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and np.array_equal(x, y), jax.tree_util.keystr(k)  # bit-exact


def env_for(tmp_path):
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(),
                BERT_JAX_CACHE_DIR=str(tmp_path / "cache"))


def test_convert_gs_to_gs_equals_the_local_conversion(bucket, tmp_path, monkeypatch):
    from safetensors.numpy import load as load_safetensors

    p = tiny_pretrained(tmp_path)
    local, remote = tmp_path / "local", f"{bucket}/models"
    # Our format written straight into the bucket (orbax through gcsfs and tensorstore), and locally.
    convert.save_bert_jax(p, f"{remote}/bj")
    convert.save_bert_jax(p, str(local / "bj"))
    assert convert.detect_format(f"{remote}/bj") == "bert_jax"
    assert storage.listdir(f"{remote}/bj") == sorted(os.listdir(local / "bj")) == [
        "bert_config.json", "params", "tokenizer_config.json", "vocab.txt"]
    for name in ("bert_config.json", "tokenizer_config.json", "vocab.txt"):
        assert storage.read_bytes(f"{remote}/bj/{name}") == (local / "bj" / name).read_bytes(), name

    # The CLI, gs:// -> gs://, from an empty folder: nothing local appears (no folder "gs:"). HF in
    # a fresh process (with the emulator's variables inherited), Google in this one (its TensorFlow
    # import is paid once for the gs:// and the local conversion).
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    cli = subprocess.Popen([sys.executable, "-m", "bert_jax.convert", f"--input={remote}/bj", f"--output={remote}/hf",
                            "--output_format=hf"], cwd=cwd, env=env_for(tmp_path), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:  # meanwhile, here
        assert convert.main([f"--input={remote}/bj", f"--output={remote}/google", "--output_format=google"]) == 0
        for fmt in ("hf", "google"):
            assert convert.main([f"--input={local / 'bj'}", f"--output={local / fmt}", f"--output_format={fmt}"]) == 0
        out, err = cli.communicate(timeout=300)
    finally:
        cli.kill()
    assert cli.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["input_format"] == "bert_jax" and summary["heads"] == ["mlm", "nsp"], summary
    assert list(cwd.iterdir()) == []

    # HF: the same files and the same tensors; a downloaded copy loads as the original.
    assert storage.listdir(f"{remote}/hf") == sorted(os.listdir(local / "hf")) == [
        "config.json", "model.safetensors", "tokenizer_config.json", "vocab.txt"]
    for name in ("config.json", "tokenizer_config.json", "vocab.txt"):
        assert storage.read_bytes(f"{remote}/hf/{name}") == (local / "hf" / name).read_bytes(), name
    got = load_safetensors(storage.read_bytes(f"{remote}/hf/model.safetensors"))
    want = load_safetensors((local / "hf" / "model.safetensors").read_bytes())
    assert sorted(got) == sorted(want) and len(got) > 30
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    down = tmp_path / "hf_download"
    storage.copy_tree(f"{remote}/hf", str(down))
    downloaded = convert.load_pretrained(str(down))
    assert downloaded.format == "hf" and downloaded.config == p.config
    assert_params_equal(downloaded.params, p.params)

    # Google: read back from the bucket (a local copy of the TF checkpoint) as read locally.
    assert sorted(storage.listdir(f"{remote}/google")) == sorted(os.listdir(local / "google"))
    assert storage.read_bytes(f"{remote}/google/bert_config.json") == (local / "google" / "bert_config.json").read_bytes()
    from_bucket = convert.load_pretrained(f"{remote}/google")
    from_disk = convert.load_pretrained(str(local / "google"))
    assert from_bucket.format == from_disk.format == "google"
    assert from_bucket.config == from_disk.config and from_bucket.config.hidden_act == "gelu_tanh"
    assert from_bucket.do_lower_case is from_disk.do_lower_case is True
    assert from_bucket.vocab_file == f"{remote}/google/vocab.txt"
    assert_params_equal(from_bucket.params, from_disk.params)
    assert_params_equal(from_bucket.params, p.params)
    assert_params_equal(convert.load_pretrained(f"{remote}/google/bert_model.ckpt").params, p.params)  # a prefix
    # A training folder with several checkpoints: the one its `checkpoint` file names (the newer
    # one is damaged, so taking it would fail).
    for name in storage.listdir(f"{remote}/google"):
        if name.startswith("bert_model.ckpt."):
            suffix = name[len("bert_model.ckpt"):]
            storage.copy(f"{remote}/google/{name}", f"{remote}/train/model.ckpt-1{suffix}")
            storage.write_bytes(f"{remote}/train/model.ckpt-2{suffix}", b"damaged")
    storage.copy(f"{remote}/google/bert_config.json", f"{remote}/train/bert_config.json")
    storage.write_text(f"{remote}/train/checkpoint", 'model_checkpoint_path: "model.ckpt-1"\n')
    assert convert.detect_format(f"{remote}/train") == "google"
    assert_params_equal(convert.load_pretrained(f"{remote}/train").params, p.params)
    # ... and HF read back from the bucket, in process, as read locally.
    assert_params_equal(convert.load_pretrained(f"{remote}/hf").params,
                        convert.load_pretrained(str(local / "hf")).params)
    assert convert.load_config(f"{remote}/google") == from_disk.config


def test_gs_paths_are_storage_paths_not_downloads(bucket, tmp_path):
    cache = tmp_path / "cache"
    assert convert.fetch(f"{bucket}/ckpt", str(cache)) == f"{bucket}/ckpt"  # not a URL to download
    assert not cache.exists()
    with pytest.raises(FileNotFoundError, match=f"checkpoint {bucket}/absent: no such file"):
        convert.load_pretrained(f"{bucket}/absent")
    storage.write_text(f"{bucket}/other/notes.txt", "x")
    with pytest.raises(ValueError, match=r"format not recognized \(found \['notes.txt'\]\)"):
        convert.load_pretrained(f"{bucket}/other")
    p = tiny_pretrained(tmp_path)
    convert.save_hf(p, f"{bucket}/hf")
    with pytest.raises(FileExistsError, match=f"{bucket}/hf exists and is not empty"):
        convert.save_hf(p, f"{bucket}/hf")
    with pytest.raises(storage_paths.StorageError, match="looks like a URL scheme that lost a slash"):
        convert.load_pretrained(f"gs:/{bucket[len('gs://'):]}/hf")


def test_extract_features_reads_and_writes_the_bucket_as_local_files(bucket, tmp_path):
    p = tiny_pretrained(tmp_path)
    ckpt = convert.save_hf(p, str(tmp_path / "hf"))
    text = "the cat sat on the mat!\nhello world ||| a big red dogs ran\n\n" + "the " * 30 + "\n"
    (tmp_path / "in.txt").write_text(text)
    storage.write_text(f"{bucket}/in/in.txt", text)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    outputs = {"local": str(tmp_path / "out" / "features.jsonl"), "gs": f"{bucket}/out/features.jsonl"}
    inputs = {"local": str(tmp_path / "in.txt"), "gs": f"{bucket}/in/in.txt"}
    runs = {where: subprocess.Popen(  # both at once
        [sys.executable, "-m", "bert_jax.extract_features", f"--input_file={inputs[where]}",
         f"--output_file={outputs[where]}", f"--init_checkpoint={ckpt}", "--layers=-1,0", "--max_seq_length=16",
         "--batch_size=3", "--sentence_pooling=mean"],
        cwd=cwd, env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for where in ("local", "gs")}
    try:
        done = {where: run.communicate(timeout=300) for where, run in runs.items()}
    finally:
        for run in runs.values():
            run.kill()
    for where, (out, err) in done.items():
        assert runs[where].returncode == 0, err[-3000:]
        assert json.loads(out.splitlines()[-1])["examples"] == 4
    got = storage.read_text(outputs["gs"])
    want = Path(outputs["local"]).read_text()
    assert got == want
    records = [json.loads(line) for line in got.splitlines()]
    assert [r["linex_index"] for r in records] == [0, 1, 2, 3] and len(records[3]["features"]) == 16
    assert storage.listdir(f"{bucket}/out") == ["features.jsonl"]  # no temporary object left
    assert list(cwd.iterdir()) == []


def test_plot_reads_events_from_the_bucket_and_writes_the_png_there(bucket, tmp_path):
    from bert_jax import plot
    from bert_jax import workdir as workdir_files

    run = tmp_path / "run"
    w = workdir_files.metric_writer(str(run), just_logging=False)
    for step in range(1, 8):
        w.write_scalars(step, {"train/loss": 5.0 / step, "train/learning_rate": 1e-3 * step})
    w.write_scalars(7, {"eval/masked_lm_accuracy": 0.5})
    w.close()
    storage.copy_tree(str(run), f"{bucket}/run")
    local = plot.plot(str(run), str(tmp_path / "local.png"))
    remote = plot.plot(f"{bucket}/run", f"{bucket}/plots/curves.png")
    assert sorted(remote) == sorted(local) == ["eval/masked_lm_accuracy", "train/learning_rate", "train/loss"]
    for tag in local:
        np.testing.assert_array_equal(remote[tag][0], local[tag][0])
        np.testing.assert_array_equal(remote[tag][1], local[tag][1])
    np.testing.assert_allclose(remote["train/loss"][1], [5.0 / s for s in range(1, 8)], rtol=1e-6)
    png = storage.read_bytes(f"{bucket}/plots/curves.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    local_png = (tmp_path / "local.png").read_bytes()
    assert struct.unpack(">II", png[16:24]) == struct.unpack(">II", local_png[16:24])
    import matplotlib.image
    np.testing.assert_array_equal(matplotlib.image.imread(io.BytesIO(png), format="png"),
                                  matplotlib.image.imread(io.BytesIO(local_png), format="png"))
    # The CLI's default output: WORKDIR/curves.png, in the bucket.
    assert plot.main(["--workdir", f"{bucket}/run"]) == 0
    assert storage.read_bytes(f"{bucket}/run/curves.png")[:8] == b"\x89PNG\r\n\x1a\n"
