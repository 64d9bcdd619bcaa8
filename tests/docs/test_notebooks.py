"""The notebooks run top to bottom on CPU with tiny settings and local data (papermill injects the
parameters), so they never rot. Each has a time limit."""

import json
import math
import os
import zipfile
from pathlib import Path

import pytest

papermill = pytest.importorskip("papermill")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[2]


def execute(name, tmp_path, **parameters):
    out = tmp_path / f"out_{name}"
    papermill.execute_notebook(str(ROOT / "notebooks" / name), str(out), cwd=str(ROOT), kernel_name="python3",
                               parameters=dict(REPO_DIR=str(ROOT), **parameters), progress_bar=False,
                               execution_timeout=600)
    nb = nbformat.read(str(out), as_version=4)
    texts = []
    for cell in nb.cells:
        # A stream's text is joined back whole: the kernel flushes stdout on a timer, so one print
        # can land in two outputs, with stderr's logging between them on a loaded machine.
        streams: dict = {}
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                streams[o["name"]] = streams.get(o["name"], "") + o["text"]
            else:
                texts.append(str(o.get("data", {}).get("text/plain", "")))
        texts.extend(streams.values())
    return "\n".join(texts)


def test_pretrain_notebook(tmp_path):
    work = tmp_path / "work"
    text = execute("pretrain_small_bert.ipynb", tmp_path, WORKDIR=str(work), CORPUS="embedded",
                   CONFIG="configs/test.py", VOCAB_SIZE=2000, MAX_SEQ_LENGTH=64, MAX_PREDICTIONS=10, DUPE_FACTOR=1,
                   NUM_TRAIN_STEPS=24, GLOBAL_BATCH_SIZE=16, LEARNING_RATE=1e-3, LOG_EVERY_STEPS=4)
    assert (work / "run" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    results = json.loads((work / "eval" / "eval_results.json").read_text())
    vocab_size = len((work / "vocab.txt").read_text().splitlines())
    assert vocab_size <= 2000
    # 24 steps learn the tokens' frequencies: below the uniform guess's loss ln(V) (7.6 for 2,000 tokens;
    # measured 7.37) and far above its accuracy 1/V (measured 0.044). An untrained or mislabelled run fails.
    assert results["masked_lm_loss"] < math.log(vocab_size) - 0.15, results
    assert 20 / vocab_size < results["masked_lm_accuracy"] < 0.5, results
    assert "She [MASK] a letter to her friend. ->" in text


def release_zip(tmp_path, words=None):
    """A release-style zip of a tiny random Google checkpoint, to 'download' from a file:// URL."""
    import jax
    from bert_jax import convert
    from bert_jax.formats.common import unrolled
    from bert_jax.model.model_config import BertConfig
    from bert_jax.model.modeling import dummy_inputs
    from bert_jax.model.pretraining_heads import BertForPreTraining
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + (words or (
        "the a man is playing guitar someone an instrument stock market fell sharply today . capital of "
        "france she poured into glass and drank it").split())
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    cfg = BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    params = BertForPreTraining(cfg).init(jax.random.key(0), **dummy_inputs(cfg))["params"]
    src = convert.save_google(convert.Pretrained(cfg, unrolled(params), str(tmp_path / "vocab.txt"), True),
                              str(tmp_path / "google"))
    archive = tmp_path / "uncased_L-2_H-32_A-4.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in os.listdir(src):
            z.write(os.path.join(src, f), f)
    return archive


def test_fill_mask_and_features_notebook(tmp_path):
    archive = release_zip(tmp_path)
    work = tmp_path / "work"
    text = execute("fill_mask_and_features.ipynb", tmp_path, WORKDIR=str(work), CHECKPOINT=archive.as_uri())
    assert "google checkpoint: L=2 H=32 A=4" in text and "do_lower_case=True" in text
    assert "The capital of France is [MASK].\n    [MASK] ->" in text
    assert "concat_last_four features per token: 64" in text  # 2 layers x 32
    assert "round trip bit-exact: True" in text
    assert len((work / "features.jsonl").read_text().splitlines()) == 3
    assert sorted(os.listdir(work / "hf")) == ["config.json", "model.safetensors", "tokenizer_config.json", "vocab.txt"]


def test_finetune_glue_notebook(tmp_path):
    archive = release_zip(tmp_path)
    data = tmp_path / "SST-2"
    data.mkdir()
    good, bad = ["a man is playing guitar", "the capital of france"], ["the stock market fell sharply", "she drank it"]
    rows = lambda n: "".join(f"{(good if i % 2 else bad)[i % 4 // 2]}\t{i % 2}\n" for i in range(n))
    (data / "train.tsv").write_text("sentence\tlabel\n" + rows(64))
    (data / "dev.tsv").write_text("sentence\tlabel\n" + rows(16))
    (data / "test.tsv").write_text("index\tsentence\n" + "".join(f"{i}\t{good[i % 2]}\n" for i in range(8)))
    work = tmp_path / "work"
    text = execute("finetune_glue.ipynb", tmp_path, WORKDIR=str(work), CHECKPOINT=archive.as_uri(), TASK="sst2",
                   DATA_SOURCE="files", DATA_DIR=str(data), NUM_TRAIN_EPOCHS=4, GLOBAL_BATCH_SIZE=16,
                   LEARNING_RATE=1e-2, MAX_SEQ_LENGTH=32, LOG_EVERY_STEPS=2)
    run = work / "sst2_run"
    history = json.loads((run / "eval_history.json").read_text())
    # Four distinct sentences, two per label: 16 steps fit them (measured: dev accuracy 0.5 after the first
    # epoch, 1.0 from the second; dev loss 0.69 -> 0.13). A loop that does not learn, or mixes up the labels,
    # fails; the best epoch is the first one with the best score.
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert history[-1]["accuracy"] == 1.0 and history[-1]["loss"] < 0.35, history
    assert history[-1]["loss"] < history[0]["loss"] - 0.3, history
    best = max(h["score"] for h in history)
    assert history[-1]["best_epoch"] == next(h["epoch"] for h in history if h["score"] == best)
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert len((run / "SST-2.tsv").read_text().splitlines()) == 9  # GLUE server file: header + 8
    assert "task head: classification from the best parameters; labels: ['0', '1']" in text
    assert sorted(os.listdir(work / "sst2_hf")) == ["config.json", "model.safetensors", "tokenizer_config.json",
                                                    "vocab.txt"]


def test_finetune_your_data_notebook(tmp_path):
    """A Chinese CSV of its own (ids, a quoted review, labels named in Chinese, one empty review) ->
    a released checkpoint -> fine-tuned -> dev scores -> predictions of new text -> HF export."""
    import csv
    import random
    chars = list("房间服务早餐位置价格干净安静") + ["好", "差"]
    archive = release_zip(tmp_path, chars)
    rng = random.Random(0)

    def review(good):
        text = [rng.choice(chars[:-2]) for _ in range(5)]
        text.insert(rng.randint(0, 5), "好" if good else "差")
        return "".join(text)

    rows = [(f"h{i}", review(i % 2), "好评" if i % 2 else "差评") for i in range(200)] + [("h200", "", "好评")]
    data = tmp_path / "reviews.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([("id", "review", "label"), *rows])
    work = tmp_path / "work"
    text = execute("finetune_your_data.ipynb", tmp_path, WORKDIR=str(work), CHECKPOINT=archive.as_uri(),
                   DATA_FILE=str(data), ID_COLUMN="id", DEV_FRACTION=0.2, NUM_TRAIN_EPOCHS=4, GLOBAL_BATCH_SIZE=8,
                   LEARNING_RATE=3e-3, MAX_SEQ_LENGTH=16, LOG_EVERY_STEPS=2, NEW_TEXTS=["房间好干净", "价格差"])
    assert "labels ['好评', '差评']; 160 training rows, 40 dev rows; skipped" in text
    assert "reviews.csv': 1}" in text  # the empty review: skipped and counted
    history = json.loads((work / "run" / "eval_history.json").read_text())
    # One character decides the label: 80 steps at 3e-3 fit it (measured: dev accuracy 1.0; at 1e-2 this
    # network stalls at 0.5). A loop that does not learn, or mixes up the labels, fails.
    assert history[-1]["accuracy"] >= 0.9, history
    assert "好评\t房间好干净" in text and "差评\t价格差" in text
    dev = list(csv.DictReader(open(work / "run" / "classification_dev_predictions.csv", encoding="utf-8")))
    assert len(dev) == 40 and all(r["id"].startswith("h") for r in dev)
    assert "id2label: {'0': '好评', '1': '差评'}" in text
    assert (work / "run" / "curves.png").read_bytes()[:4] == b"\x89PNG"
