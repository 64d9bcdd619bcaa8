"""Fine-tuning end to end: every task, from files it writes here and from TFDS (mock_data).

One tiny "pretrained" encoder (L=1, H=32) is saved with `bert_jax.convert` and every run loads it
through `config.init_checkpoint`, as a user would. Runs of the same head kind share shapes and
hyper-parameters, so XLA's persistent compilation cache (a per-module temporary folder) compiles
each kind once: the module takes about two minutes on two CPU cores.
"""

import csv
import json
import os
import re
import subprocess
import sys

from flax import traverse_util
import flax.linen as nn
import jax
import numpy as np
import pytest

from bert_jax import convert
from bert_jax.finetune import batches as finetune_batches, bucketing, heads, loop as finetune, steps as finetune_steps
from bert_jax.model import model_config, modeling, pretraining_heads
from configs import glue as glue_config
from configs import ner as ner_config
from configs import squad as squad_config
from configs import swag as swag_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = ("good bad movie film the a was is plot actor great awful very really man woman dog cat sat ran "
         "on mat park in paris john smith acme corp went to city he she it what where who did yes no "
         "then walks away sits down opens door eats food").split()
ENTITIES = {"paris": "LOC", "john": "PER", "smith": "PER", "acme": "ORG", "corp": "ORG"}


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """Each head kind compiles once per module (same shapes and hyper-parameters -> same HLO)."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}
    cache = str(tmp_path_factory.mktemp("xla_cache"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield cache
    for n, v in before.items():
        jax.config.update(n, v)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny encoder in bert_jax's export format and in HuggingFace's, with its vocab."""
    root = tmp_path_factory.mktemp("pretrained")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + list(".,?!'-")) + "\n")
    cfg = model_config.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=64)
    params = pretraining_heads.BertForPreTraining(cfg).init(jax.random.key(0), **modeling.dummy_inputs(cfg))["params"]
    params = nn.meta.unbox(params)
    pretrained = convert.Pretrained(cfg, jax.tree_util.tree_map(np.asarray, params), str(vocab), True)
    paths = {fmt: convert.save_pretrained(pretrained, str(root / fmt), fmt) for fmt in ("bert_jax", "hf")}
    return {"vocab": str(vocab), "config": cfg, "params": pretrained.params, **paths}


def tiny(config, task, data_dir, init, **overrides):
    config.task = task
    config.data_dir = str(data_dir)
    config.init_checkpoint = init
    config.max_seq_length = 16
    config.global_batch_size = 8
    config.num_train_epochs = 1
    config.learning_rate = 1e-3
    config.log_every_steps = 1
    config.async_checkpointing = False
    config.xla_backend_optimization_level = 0  # ~3x faster compiles; these models are tiny
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# The reference: the saved model applied here, outside the loop
# ---------------------------------------------------------------------------------------------


class Reference:
    """A run's saved parameters (`which`: "best" or "last", through `convert.load_finetuned`)
    applied to texts featurized here, not by the task: Google's FullTokenizer (the loop uses
    FastTokenizer), `[CLS] a [SEP] b [SEP]` truncated as run_classifier.py's _truncate_seq_pair,
    a word's tag read at its first piece (data_pipeline/tasks/ner.py's documented convention),
    one unsharded `BertForTask.apply` (the loop's is jitted over the 8-device mesh)."""

    ROWS = 16  # inputs are padded to a multiple of this: one compile per head kind and width

    def __init__(self, work, which, vocab, max_seq_length=16):
        from data_pipeline import tokenization
        p = convert.load_finetuned(str(work), which)
        assert p.task["max_seq_length"] == max_seq_length
        self.task, self.max_len = p.task, max_seq_length
        self.model = heads.BertForTask(p.config, p.task["head"], p.task["num_outputs"])
        self.params = convert.model_params(p)
        self.tokenizer = tokenization.FullTokenizer(vocab, do_lower_case=True)

    def _logits(self, tokens):
        """Logits of each token list `[CLS] ... [SEP] (... [SEP])` (segment 1 after the first [SEP])."""
        n = len(tokens)
        ids, mask, segments = (np.zeros((-(-n // self.ROWS) * self.ROWS, self.max_len), np.int32) for _ in range(3))
        for i, row in enumerate(tokens):
            assert len(row) <= self.max_len, row
            ids[i, :len(row)] = [self.tokenizer.vocab[t] for t in row]
            mask[i, :len(row)] = 1
            first_sep = row.index("[SEP]")
            segments[i, first_sep + 1:len(row)] = 1
        out = jax.jit(self.model.apply)({"params": self.params}, ids, mask, segments)
        return np.asarray(out["logits"])[:n]

    def sentence_logits(self, pairs):
        """[examples(, classes)] for (text_a, text_b or None) pairs."""
        rows = []
        for a, b in pairs:
            a = self.tokenizer.tokenize(a)
            b = self.tokenizer.tokenize(b) if b is not None else None
            if b is None:
                a = a[:self.max_len - 2]
            else:
                while len(a) + len(b) > self.max_len - 3:  # _truncate_seq_pair: the longer one loses its last
                    (a if len(a) > len(b) else b).pop()
            rows.append(["[CLS]"] + a + ["[SEP]"] + (b + ["[SEP]"] if b is not None else []))
        return self._logits(rows)

    def word_logits(self, sentences):
        """[words, tags] per sentence (a list of words): the logits at each word's first piece."""
        rows, firsts = [], []
        for words in sentences:
            pieces = [self.tokenizer.tokenize(w) for w in words]
            assert all(pieces) and sum(map(len, pieces)) <= self.max_len - 2, words  # one row each
            firsts.append(1 + np.cumsum([0] + [len(p) for p in pieces[:-1]]))
            rows.append(["[CLS]"] + [t for p in pieces for t in p] + ["[SEP]"])
        logits = self._logits(rows)
        return [logits[i, first] for i, first in enumerate(firsts)]


def assert_argmax(predicted, logits, labels, what, tie=1e-4):
    """Each predicted label is `labels[argmax]` of its row of logits; where the top two are within
    `tie` (two compilations may round them apart) either of those two is accepted."""
    logits = np.asarray(logits).reshape(-1, len(labels))
    predicted = np.asarray(predicted).reshape(-1)
    assert len(predicted) == len(logits), (what, len(predicted), len(logits))
    top2 = np.argsort(-logits, axis=-1)[:, :2]
    for i, (p, row, (first, second)) in enumerate(zip(predicted, logits, top2)):
        allowed = {labels[first]} | ({labels[second]} if row[first] - row[second] < tie else set())
        assert p in allowed, (what, i, p, labels[first], row.tolist())


# ---------------------------------------------------------------------------------------------
# GLUE
# ---------------------------------------------------------------------------------------------


def sentiment(rng, n):
    """'good' -> 1, 'bad' -> 0, among filler words: learnable from one token."""
    rows = []
    for i in range(n):
        words = list(rng.choice(WORDS[2:10], 5))
        words.insert(rng.randint(6), "good" if i % 2 else "bad")
        rows.append((" ".join(words), i % 2))
    return rows


def sst2_files(root):
    rng = np.random.RandomState(0)
    folder = root / "glue" / "SST-2"
    folder.mkdir(parents=True)
    for split, n in (("train", 64), ("dev", 16)):
        (folder / f"{split}.tsv").write_text(
            "sentence\tlabel\n" + "".join(f"{s} \t{l}\n" for s, l in sentiment(rng, n)))
    # Test ids out of row order: a submission numbered by row, or off by one, maps rows to other examples.
    (folder / "test.tsv").write_text("index\tsentence\n" + "".join(
        f"{i}\t{s}\n" for i, (s, _) in zip(SST2_TEST_IDS, sentiment(rng, 5))))
    return root / "glue"


SST2_TEST_IDS = ("3", "0", "4", "1", "2")


def sst2_config(data, checkpoint):
    return tiny(glue_config.get_config(), "sst2", data, checkpoint["bert_jax"],
                num_train_epochs=6, learning_rate=1e-2, global_batch_size=16)


@pytest.fixture(scope="module")
def sst2_run(tmp_path_factory, checkpoint):
    """An uninterrupted 6-epoch run on a toy sentiment task (learnable from one word)."""
    root = tmp_path_factory.mktemp("sst2")
    data = sst2_files(root)
    work = root / "work"
    return data, work, finetune.run(sst2_config(data, checkpoint), str(work))


def test_sst2_learns_and_writes_everything(sst2_run, checkpoint):
    data, work, results = sst2_run
    history = read_json(work / "eval_history.json")
    assert [h["epoch"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert history[-1]["train_loss"] < 0.5 * history[0]["train_loss"]
    assert results["accuracy"] >= 0.9 and results["score"] == results["accuracy"]
    assert read_json(work / "eval_results.json") == results
    assert results["best_epoch"] == max(history, key=lambda h: h["accuracy"])["epoch"]
    assert results["best_epoch_score"] == max(h["score"] for h in history)
    # Predictions (last epoch and best epoch), GLUE server file, model files, checkpoints, TensorBoard.
    dev = list(csv.reader(open(work / "sst2_dev_predictions.tsv"), delimiter="\t"))
    assert dev[0] == ["index", "prediction", "label"] and len(dev) == 17
    assert os.path.exists(work / "best_predictions" / "sst2_dev_predictions.tsv")
    server = (work / "SST-2.tsv").read_text().splitlines()
    assert server[0] == "index\tprediction" and len(server) == 6
    assert all(line.split("\t")[1] in ("0", "1") for line in server[1:])
    assert sorted(os.listdir(work / "checkpoints")) == ["24"]
    assert len(os.listdir(work / "best")) == 1
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(work))
    assert convert.load_config(str(work)) == checkpoint["config"]
    # The fine-tuned workdir is itself a checkpoint: its encoder loads, the head is reported.
    loaded = convert.load_pretrained(str(work))
    assert loaded.task_head == "classification" and loaded.finetuned == "best" and "head" in loaded.params
    assert not np.allclose(loaded.params["bert"]["pooler"]["dense"]["kernel"],
                           checkpoint["params"]["bert"]["pooler"]["dense"]["kernel"])
    # Against references outside the loop: gold from the dev.tsv written above, predictions of the
    # saved parameters (last: the last epoch's file and the submission; best: best_predictions/)
    # applied by `Reference`, accuracy from scikit-learn.
    from sklearn import metrics as skm
    dev = [line.split("\t") for line in (data / "SST-2" / "dev.tsv").read_text().splitlines()[1:]]
    test = [line.split("\t") for line in (data / "SST-2" / "test.tsv").read_text().splitlines()[1:]]
    last, best = (Reference(work, which, checkpoint["vocab"]) for which in ("last", "best"))
    for reference, path, accuracy in ((last, work / "sst2_dev_predictions.tsv", results["accuracy"]),
                                      (best, work / "best_predictions" / "sst2_dev_predictions.tsv",
                                       results["best_epoch_score"])):
        rows = tsv_rows(path)
        assert [r["index"] for r in rows] == [str(i) for i in range(16)]  # no id column: the row number
        assert [r["label"] for r in rows] == [label for _, label in dev]
        predicted = [r["prediction"] for r in rows]
        assert_argmax(predicted, reference.sentence_logits([(s, None) for s, _ in dev]), ["0", "1"], str(path))
        assert accuracy == pytest.approx(skm.accuracy_score([label for _, label in dev], predicted), abs=1e-9)
    # The server file: the test file's ids in its order, each with the prediction for that id's sentence.
    server = tsv_rows(work / "SST-2.tsv")
    assert [r["index"] for r in server] == [i for i, _ in test] == list(SST2_TEST_IDS)
    by_id = dict(test)
    assert_argmax([r["prediction"] for r in server],
                  last.sentence_logits([(by_id[r["index"]], None) for r in server]), ["0", "1"], "SST-2.tsv")
    assert len({r["prediction"] for r in server}) == 2  # both labels: a row mix-up shows


def predict_config(work, path, **overrides):
    config = glue_config.get_config()
    config.mode = "predict"
    config.predict_input = str(path)
    config.predict_output_dir = str(work / "predict_out")
    config.global_batch_size = 8
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def tsv_rows(path):
    return list(csv.DictReader(open(path, encoding="utf-8"), delimiter="\t"))


def test_the_loop_starts_from_the_checkpoint_and_a_fresh_head(tmp_path, checkpoint):
    """At learning rate 0 nothing moves, so the saved state is the initial one: the encoder is the
    checkpoint's bit for bit, the head flax's initialization from the first half of the seed's key
    (the loop compiles the head's initialization alone; the encoder's is dead code there)."""
    config = sst2_config(sst2_files(tmp_path), checkpoint)
    config.learning_rate, config.num_train_epochs = 0.0, 1
    finetune.run(config, str(tmp_path / "work"))
    saved = convert.load_finetuned(str(tmp_path / "work"), "last")
    flat = lambda tree: {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}  # noqa: E731
    encoder = flat(saved.params["bert"])
    assert encoder.keys() == flat(checkpoint["params"]["bert"]).keys()
    for key, value in flat(checkpoint["params"]["bert"]).items():
        np.testing.assert_array_equal(encoder[key], value, err_msg=str(key))
    model = heads.BertForTask(checkpoint["config"], "classification", 2)
    dummy = heads.dummy_batch("classification", config.max_seq_length)
    fresh = nn.meta.unbox(model.init(jax.random.split(jax.random.key(config.seed))[0],
                                     *(dummy[k] for k in heads.MODEL_INPUTS))["params"])
    head = flat(saved.params["head"])
    assert head.keys() == flat(fresh["head"]).keys() and len(head) == 2  # kernel, bias
    for key, value in flat(fresh["head"]).items():  # another program's truncated normal: an ulp apart
        np.testing.assert_allclose(head[key], value, rtol=0, atol=1e-8, err_msg=str(key))
    assert np.abs(head[("output", "kernel")]).max() > 0.01  # drawn (stddev 0.02), not zeros


def test_predict_mode_gives_the_loops_predictions_from_text_or_the_tasks_files(sst2_run, tmp_path):
    from bert_jax.finetune import predict
    data, work, _ = sst2_run
    description = read_json(work / "task.json")
    assert description == {"task": "sst2", "head": "classification", "num_outputs": 2, "labels": ["0", "1"],
                           "max_seq_length": 16, "task_options": {}}
    history = read_json(work / "eval_history.json")
    best = max(history, key=lambda h: h["score"])
    # The dev file in the task's format (labelled): the best epoch's predictions and score, as the
    # loop wrote them when that epoch was evaluated.
    out = predict.run(predict_config(tmp_path, data / "SST-2" / "dev.tsv"), str(work))
    assert out["format"] == "task" and out["examples"] == 16
    assert out["scores"]["accuracy"] == pytest.approx(best["accuracy"], abs=1e-9)
    rows = tsv_rows(tmp_path / "predict_out" / "sst2_dev_predictions.tsv")
    loop = tsv_rows(work / "best_predictions" / "sst2_dev_predictions.tsv")
    assert [r["prediction"] for r in rows] == [r["prediction"] for r in loop]
    assert [r["label"] for r in rows] == [line.split("\t")[1] for line in
                                          (data / "SST-2" / "dev.tsv").read_text().splitlines()[1:]]
    # The same sentences as plain text, one a line (and a blank line): the same predictions,
    # numbered by line, no labels and no scores.
    sentences = [line.split("\t")[0] for line in (data / "SST-2" / "dev.tsv").read_text().splitlines()[1:]]
    text = tmp_path / "new reviews.txt"
    text.write_text("\n".join(sentences[:3] + [""] + sentences[3:]) + "\n")
    out = predict.run(predict_config(tmp_path, text), str(work))
    assert out["format"] == "text" and "scores" not in out
    rows = tsv_rows(tmp_path / "predict_out" / "sst2_new_reviews_predictions.tsv")
    assert [r["index"] for r in rows] == ["1", "2", "3"] + [str(i) for i in range(5, 18)]
    assert [r["prediction"] for r in rows] == [r["prediction"] for r in loop]
    assert all(r["label"] == "" for r in rows)
    # params=last: the last epoch's state, whose predictions the loop wrote into the workdir.
    out = predict.run(predict_config(tmp_path, data / "SST-2" / "dev.tsv", predict_params="last"), str(work))
    assert out["scores"]["accuracy"] == pytest.approx(history[-1]["accuracy"], abs=1e-9)
    rows = tsv_rows(tmp_path / "predict_out" / "sst2_dev_predictions.tsv")
    assert [r["prediction"] for r in rows] == [r["prediction"] for r in tsv_rows(work / "sst2_dev_predictions.tsv")]
    # A line that does not fit the task names the file and line; a pretraining workdir is refused.
    bad = tmp_path / "pairs.txt"
    bad.write_text("a good film\nthe plot\tthe actor\n")
    with pytest.raises(ValueError, match=r"pairs.txt: row 2: 2 tab-separated fields, expected 1"):
        predict.run(predict_config(tmp_path, bad), str(work))
    with pytest.raises(FileNotFoundError, match="task.json not found"):
        predict.run(predict_config(tmp_path, text), str(tmp_path))


def test_fine_tuning_in_a_bucket_writes_what_a_local_run_writes(bucket, sst2_run, checkpoint, monkeypatch,
                                                               tmp_path):
    """Data, the pretrained checkpoint and the workdir in Cloud Storage (the emulator of
    tests/conftest.py): the same results and the same files as the local run, in the bucket."""
    from data_pipeline import storage
    data, work, results = sst2_run
    monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    storage.copy_tree(str(data), f"{bucket}/glue")
    storage.copy_tree(checkpoint["bert_jax"], f"{bucket}/pretrained")
    gs_work = f"{bucket}/work"
    got = finetune.run(sst2_config(f"{bucket}/glue", {**checkpoint, "bert_jax": f"{bucket}/pretrained"}), gs_work)
    assert got == results  # the same floats
    for rel in ("eval_results.json", "eval_history.json", "sst2_dev_predictions.tsv", "SST-2.tsv",
                "best_predictions/sst2_dev_predictions.tsv", "bert_config.json", "vocab.txt", "tokenizer_config.json"):
        assert storage.read_bytes(f"{gs_work}/{rel}") == (work / rel).read_bytes(), rel
    assert [n for n in storage.listdir(f"{gs_work}/checkpoints") if n.isdigit()] == ["24"]
    assert len([n for n in storage.listdir(f"{gs_work}/best") if n.isdigit()]) == 1
    assert any(name.startswith("events.out.tfevents") for name in storage.listdir(gs_work))
    # The fine-tuned workdir in the bucket is a checkpoint too: the same encoder as the local one.
    np.testing.assert_array_equal(
        convert.load_pretrained(gs_work).params["bert"]["pooler"]["dense"]["kernel"],
        convert.load_pretrained(str(work)).params["bert"]["pooler"]["dense"]["kernel"])


def test_a_resume_under_another_jax_is_refused(tmp_path, sst2_run, checkpoint, monkeypatch):
    """The finished run's last state, resumed where jax seems upgraded: refused before training,
    naming the checkpoint's version and the installed one (bert_jax/versions.py)."""
    import shutil

    from bert_jax import versions
    from bert_jax.checkpoints.checkpoint_steps import CheckpointRestoreError
    data, work, _ = sst2_run
    saved = versions.installed()
    monkeypatch.setattr(versions, "installed", lambda: {**saved, "jax": "99.0"})
    shutil.copytree(work, tmp_path / "work")
    with pytest.raises(CheckpointRestoreError, match=re.escape(f"jax {saved['jax']} (installed: 99.0)")):
        finetune.run(sst2_config(data, checkpoint), str(tmp_path / "work"))


def test_resume_after_sigterm_mid_epoch(tmp_path, sst2_run, checkpoint, monkeypatch):
    """SIGTERM at step 6 (mid epoch 2) saves and exits; the rerun resumes there and ends exactly
    where the uninterrupted run ended (same batches, same dropout keys)."""
    import signal

    from bert_jax.training import sharding
    data, _, uninterrupted = sst2_run
    calls = {"n": 0}
    to_global = sharding.to_global

    def signalling(batch, mesh):
        calls["n"] += 1
        if calls["n"] == 7:  # 4 training batches, 1 eval batch, then the 2nd batch of epoch 2
            os.kill(os.getpid(), signal.SIGTERM)
        return to_global(batch, mesh)

    work = tmp_path / "work"
    monkeypatch.setattr(sharding, "to_global", signalling)
    finetune.run(sst2_config(data, checkpoint), str(work))
    monkeypatch.setattr(sharding, "to_global", to_global)
    assert sorted(os.listdir(work / "checkpoints")) == ["6"] and not (work / "eval_results.json").exists()
    resumed = finetune.run(sst2_config(data, checkpoint), str(work))
    for key in ("loss", "accuracy", "step", "best_epoch"):
        assert resumed[key] == uninterrupted[key], key
    assert [h["loss"] for h in read_json(work / "eval_history.json")] == [
        h["loss"] for h in read_json(sst2_run[1] / "eval_history.json")]
    # A finished workdir: the rerun trains nothing and reports the same results.
    assert finetune.run(sst2_config(data, checkpoint), str(work)) == resumed

    # Killed without warning during step 8 (mid epoch 2) with checkpoint_every_steps=3: the run
    # resumes from step 6, saved mid-epoch, and still ends where the uninterrupted run ended.
    class Killed(Exception):
        pass

    calls["n"] = 0

    def dying(batch, mesh):
        calls["n"] += 1
        if calls["n"] == 9:  # 4 + 1 eval + 4: the 4th batch of epoch 2 (step 8)
            raise Killed
        return to_global(batch, mesh)

    config = sst2_config(data, checkpoint)
    config.checkpoint_every_steps = 3
    work = tmp_path / "killed"
    monkeypatch.setattr(sharding, "to_global", dying)
    with pytest.raises(Killed):
        finetune.run(config, str(work))
    monkeypatch.setattr(sharding, "to_global", to_global)
    assert sorted(os.listdir(work / "checkpoints")) == ["6"]
    again = finetune.run(config, str(work))
    for key in ("loss", "accuracy", "step", "best_epoch"):
        assert again[key] == uninterrupted[key], key


@pytest.mark.parametrize("field,value,message", [
    ("num_train_epochs", 0, "config.num_train_epochs=0"),
    ("warmup_proportion", 1.5, "config.warmup_proportion=1.5"),
    ("checkpoint_every_steps", -1, "config.checkpoint_every_steps=-1"),
    ("learning_rate", -1e-3, "config.learning_rate=-0.001 must not be negative"),
    ("global_batch_size", 0, "config.global_batch_size=0 must be at least 1"),
    ("eval_batch_size", -4, "config.eval_batch_size=-4 must be at least 1"),
])
def test_bad_schedule_settings_name_the_fine_tuning_field(tmp_path, checkpoint, field, value, message):
    config = sst2_config(sst2_files(tmp_path), checkpoint)
    config[field] = value
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        finetune.run(config, str(tmp_path / "work"))
    assert not (tmp_path / "work" / "checkpoints").exists()


TEST_IDS = ("2", "0", "1")  # GLUE test rows' ids, out of row order: a submission numbered by row shows


def glue_files(folder, task, rng, n_train=8, n_dev=8):
    """Tiny GLUE folders in the distributed formats (random words; labels valid).

    Returns what it wrote, the tests' gold: split -> [(id, text_a, text_b, label)], the id being
    the row's index/id column or else its row number, the label None in test splits. STS-B's
    first sentence ends in "good" (score 4-5) or "bad" (0-1): learnable, so that a few epochs
    spread its predictions far beyond float32 rounding.
    """

    def text():
        return " ".join(rng.choice(WORDS, rng.randint(2, 7)))

    os.makedirs(folder, exist_ok=True)
    written = {}

    def w(name, header, split, records, line):
        written[split] = records
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(header + "".join(line(*r) for r in records))

    labelled = (("train", n_train), ("dev", n_dev))
    if task == "cola":  # no header in train/dev
        for split, n in labelled:
            w(f"{split}.tsv", "", split, [(str(i), text(), None, str(i % 2)) for i in range(n)],
              lambda i, a, b, l: f"gj04\t{l}\t{'' if l == '1' else '*'}\t{a}\n")
        w("test.tsv", "index\tsentence\n", "test", [(i, text(), None, None) for i in TEST_IDS],
          lambda i, a, b, l: f"{i}\t{a}\n")
    elif task == "mrpc":
        for split, n in labelled:
            w(f"{split}.tsv", "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n", split,
              [(str(i), text(), text(), str(i % 2)) for i in range(n)],
              lambda i, a, b, l: f"{l}\t{i}\t{int(i) + 100}\t{a}\t{b}\n")
        w("test.tsv", "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n", "test",
          [(i, text(), text(), None) for i in TEST_IDS], lambda i, a, b, l: f"{i}\t1\t2\t{a}\t{b}\n")
    elif task == "stsb":
        head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
        row = lambda i, a, b: f"{i}\tg\tf\t2012\t{i}\tnone\tnone\t{a}\t{b}"
        for split, n in labelled:
            w(f"{split}.tsv", head + "\tscore\n", split,
              [(str(i), f"{text()} {'good' if i % 2 else 'bad'}", text(), float(f"{4 * (i % 2) + rng.rand():.3f}"))
               for i in range(n)], lambda i, a, b, l: f"{row(i, a, b)}\t{l:.3f}\n")
        w("test.tsv", head + "\n", "test",
          [(i, f"{text()} {'good' if int(i) % 2 else 'bad'}", text(), None) for i in TEST_IDS],
          lambda i, a, b, l: row(i, a, b) + "\n")
    elif task == "qqp":
        for split, n in labelled:
            w(f"{split}.tsv", "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n", split,
              [(str(i), f"{text()}?", f"{text()}?", str(i % 2)) for i in range(n)],
              lambda i, a, b, l: f"{i}\t1\t2\t{a}\t{b}\t{l}\n")
        w("test.tsv", "id\tquestion1\tquestion2\n", "test", [(i, text(), text(), None) for i in TEST_IDS],
          lambda i, a, b, l: f"{i}\t{a}\t{b}\n")
    elif task == "mnli":
        labels = ("contradiction", "entailment", "neutral")
        head = "index\tpromptID\tpairID\tgenre\ts1bp\ts2bp\ts1p\ts2p\tsentence1\tsentence2"
        line = lambda i, a, b, extra: f"{i}\t1\t1a\tfiction\t()\t()\t()\t()\t{a}\t{b}{extra}\n"
        w("train.tsv", head + "\tlabel1\tgold_label\n", "train",
          [(str(i), text(), text(), labels[i % 3]) for i in range(n_train)],
          lambda i, a, b, l: line(i, a, b, f"\t{l}\t{l}"))
        for split in ("dev_matched", "dev_mismatched"):
            w(f"{split}.tsv", head + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n", split,
              [(str(i), text(), text(), labels[i % 3]) for i in range(n_dev)],
              lambda i, a, b, l: line(i, a, b, "\tneutral" * 5 + f"\t{l}"))
        for split in ("test_matched", "test_mismatched"):
            w(f"{split}.tsv", head + "\n", split, [(i, text(), text(), None) for i in TEST_IDS],
              lambda i, a, b, l: line(i, a, b, ""))
        os.makedirs(os.path.join(folder, "..", "diagnostic"), exist_ok=True)
        w(os.path.join("..", "diagnostic", "diagnostic.tsv"), "index\tsentence1\tsentence2\n", "test_ax",
          [(i, text(), text(), None) for i in TEST_IDS], lambda i, a, b, l: f"{i}\t{a}\t{b}\n")
    else:  # qnli, rte, wnli
        cols = {"qnli": ("question", "sentence"), "rte": ("sentence1", "sentence2"), "wnli": ("sentence1", "sentence2")}[task]
        labels = {"qnli": ("entailment", "not_entailment"), "rte": ("entailment", "not_entailment"), "wnli": ("0", "1")}[task]
        for split, n in labelled:
            w(f"{split}.tsv", f"index\t{cols[0]}\t{cols[1]}\tlabel\n", split,
              [(str(i), text(), text(), labels[i % 2]) for i in range(n)], lambda i, a, b, l: f"{i}\t{a}\t{b}\t{l}\n")
        w("test.tsv", f"index\t{cols[0]}\t{cols[1]}\n", "test", [(i, text(), text(), None) for i in TEST_IDS],
          lambda i, a, b, l: f"{i}\t{a}\t{b}\n")
    return written


GLUE_EXPECTED = {  # task -> (metric keys, submission file -> test split)
    "cola": ({"mcc"}, {"CoLA.tsv": "test"}),
    "mrpc": ({"accuracy", "f1"}, {"MRPC.tsv": "test"}),
    "stsb": ({"pearson", "spearman"}, {"STS-B.tsv": "test"}),
    "qqp": ({"accuracy", "f1"}, {"QQP.tsv": "test"}),
    "mnli": ({"accuracy", "dev_mm_accuracy"},
             {"MNLI-m.tsv": "test_matched", "MNLI-mm.tsv": "test_mismatched", "AX.tsv": "test_ax"}),
    "qnli": ({"accuracy"}, {"QNLI.tsv": "test"}),
    "rte": ({"accuracy"}, {"RTE.tsv": "test"}),
    "wnli": ({"accuracy"}, {"WNLI.tsv": "test"}),
}


@pytest.mark.parametrize("task", sorted(GLUE_EXPECTED))
def test_glue_task_end_to_end_from_files(tmp_path, checkpoint, task):
    """Every GLUE task from the files written here, checked against references outside the loop:
    gold from what `glue_files` wrote, predictions of the run's last state (which wrote the last
    epoch's dev files and the submissions) applied by `Reference`, row by row and by id, and the
    metrics of scikit-learn / scipy on them. STS-B trains longer (512 rows, 2 epochs, a higher
    rate; its own compile anyway: the only regression head here) until it tells "good" from
    "bad": an untrained regressor's outputs differ in the 5th decimal, where float32 rounding
    (the loop's compilation against this one's) moves its correlations in the 4th."""
    import scipy.stats
    from sklearn import metrics as skm

    from data_pipeline.tasks import glue
    stsb = task == "stsb"
    written = glue_files(tmp_path / "data" / glue.SPECS[task].folder, task, np.random.RandomState(1),
                         n_train=512 if stsb else 8)
    work = tmp_path / "work"
    epochs = 2 if stsb else 1
    # STS-B's toy training at this rate is bistable: over 8 seeds it settled on a constant in 2
    # unpacked and in 2 packed (other seeds, other draws of dropout); this seed learns unpacked.
    # Packed, the loss is the same to float rounding (test_packed_rows.py).
    results = finetune.run(tiny(glue_config.get_config(), task, tmp_path / "data", checkpoint["bert_jax"],
                                num_train_epochs=epochs, learning_rate=1e-2 if stsb else 1e-3,
                                packing=not stsb), str(work))
    metrics, submissions = GLUE_EXPECTED[task]
    assert metrics <= set(results) and "score" in results and results["epoch"] == epochs
    reference = Reference(work, "last", checkpoint["vocab"])
    labels = reference.task["labels"]  # the head's outputs, in order ([] for STS-B)
    assert labels == [] if stsb else set(labels) == {label for *_, label in written["train"]}
    independent = {"accuracy": skm.accuracy_score,
                   "f1": lambda gold, pred: skm.f1_score(gold, pred, pos_label="1", zero_division=0.0),
                   "mcc": skm.matthews_corrcoef,
                   "pearson": lambda gold, pred: scipy.stats.pearsonr(gold, pred)[0],
                   "spearman": lambda gold, pred: scipy.stats.spearmanr(gold, pred)[0]}
    main = sorted(m for m in metrics if m in independent)
    dev_splits = [s for s in written if s.startswith("dev")]  # MNLI: matched, then mismatched (dev_mm_)
    for split, prefix in zip(dev_splits, ("", "dev_mm_")):
        examples = written[split]
        gold = [label for *_, label in examples]
        rows = tsv_rows(work / f"{task}_{split}_predictions.tsv")
        assert [r["index"] for r in rows] == [i for i, *_ in examples]  # every dev row, in order, none padded in
        logits = reference.sentence_logits([(a, b) for _, a, b, _ in examples])
        if stsb:
            assert [float(r["label"]) for r in rows] == gold
            np.testing.assert_allclose([float(r["prediction"]) for r in rows], logits, atol=5e-6)  # 6 decimals
            # A spread 1e6 times float32's rounding (a few 1e-7): the correlations do not feel it.
            assert np.std(logits) > 0.1, f"STS-B did not learn, predictions {logits}: nothing to correlate"
            predicted = logits  # the model's values (the file rounds them)
        else:
            assert [r["label"] for r in rows] == gold
            predicted = [r["prediction"] for r in rows]
            assert_argmax(predicted, logits, labels, split)
        for m in main:
            want = independent[m](gold, predicted)
            assert results[prefix + m] == pytest.approx(0.0 if np.isnan(want) else want, abs=1e-5), (
                m, results[prefix + m], want)
    assert results["score"] == pytest.approx(np.mean([results[m] for m in main]), abs=1e-9)
    # Submission files: the test file's ids in its order, each with the prediction for that id's texts
    # (STS-B: clipped to [0, 5], 3 decimals).
    for name, split in submissions.items():
        examples = written[split]
        assert (work / name).read_text().splitlines()[0] == "index\tprediction", name
        rows = tsv_rows(work / name)
        assert [r["index"] for r in rows] == [i for i, *_ in examples], name
        by_id = {i: (a, b) for i, a, b, _ in examples}
        logits = reference.sentence_logits([by_id[r["index"]] for r in rows])
        if stsb:
            np.testing.assert_allclose([float(r["prediction"]) for r in rows], np.clip(logits, 0, 5), atol=5.1e-4)
            assert np.ptp(logits) > 0.1, name  # a row mix-up shows
        else:
            assert_argmax([r["prediction"] for r in rows], logits, labels, name)


def _tfds_dataset(builder, split, make):
    import tensorflow as tf
    examples = make(builder, str(split))
    return tf.data.Dataset.from_generator(lambda: iter(examples), output_types=builder.info.features.dtype,
                                          output_shapes=builder.info.features.shape)


def test_glue_from_tfds(tmp_path, checkpoint):
    """glue/cola through tfds.load (mock_data serves the examples; no download)."""
    tfds = pytest.importorskip("tensorflow_datasets")
    rng = np.random.RandomState(2)

    def make(builder, split):
        assert builder.builder_config.name == "cola"
        n = {"train": 8, "validation": 8}.get(split, 3)
        return [{"idx": i, "sentence": " ".join(rng.choice(WORDS, 4)),
                 "label": -1 if split == "test" else i % 2} for i in range(n)]

    config = tiny(glue_config.get_config(), "cola", "", checkpoint["hf"], data_source="tfds")
    with tfds.testing.mock_data(as_dataset_fn=lambda self, split, **kw: _tfds_dataset(self, split, make)):
        results = finetune.run(config, str(tmp_path / "work"))
    assert {"mcc", "score", "loss"} <= set(results)
    assert len((tmp_path / "work" / "CoLA.tsv").read_text().splitlines()) == 4


@pytest.mark.parametrize("process_index", [0, 1])
def test_tfds_datasets_are_prepared_by_host_zero_before_the_others_read(monkeypatch, process_index):
    """Two hosts (simulated): host 0 prepares every TFDS dataset the run reads (MNLI's train,
    dev and test splits: glue/mnli, and glue/ax for the diagnostic) and only then meets the
    others at the barrier; host 1 prepares nothing itself before the barrier."""
    tfds = pytest.importorskip("tensorflow_datasets")
    from data_pipeline import tasks as tasks_lib
    events = []

    class Builder:
        def __init__(self, name):
            self.name = name

        def download_and_prepare(self):
            events.append(("prepare", self.name))

    monkeypatch.setattr(tfds, "builder", lambda name, data_dir=None: Builder(name))
    monkeypatch.setattr(tfds, "load", lambda *a, **k: pytest.fail("read, not only prepared"))
    monkeypatch.setattr(finetune.jax, "process_count", lambda: 2)
    monkeypatch.setattr(finetune.jax, "process_index", lambda: process_index)
    monkeypatch.setattr(finetune.multihost_utils, "sync_global_devices", lambda name: events.append(("barrier",)))
    task = tasks_lib.get_task("mnli", source="tfds")
    finetune._prepare_tfds_on_host_zero(task, (task.train_split, *task.eval_splits), task.test_splits)
    if process_index == 0:
        names = [e[1] for e in events[:-1]]
        assert set(names) == {"glue/mnli", "glue/ax"} and names.index("glue/ax") == len(names) - 1
        assert events[-1] == ("barrier",) and len(names) == 1 + len(task.eval_splits) + len(task.test_splits)
    else:
        assert events == [("barrier",)]
    assert not task.skipped
    with tasks_lib.prepare_tfds_only():
        assert task.read("train") == []


# ---------------------------------------------------------------------------------------------
# SQuAD
# ---------------------------------------------------------------------------------------------


def squad_examples(rng, n, v2):
    """Contexts of filler words with one name; the question asks for it."""
    out = []
    for i in range(n):
        words = list(rng.choice(WORDS[12:30], 12))
        name = ["John Smith", "Paris", "Acme Corp"][i % 3]
        pos = rng.randint(1, 11)
        context = " ".join(words[:pos]) + f" {name} " + " ".join(words[pos:]) + "."
        impossible = v2 and i % 4 == 3
        start = context.index(name)
        answers = [] if impossible else [{"text": name, "answer_start": start}]
        qa = {"id": f"q{i}", "question": "who did it ?", "answers": answers}
        if v2:
            qa["is_impossible"] = impossible
        out.append({"title": "t", "paragraphs": [{"context": context, "qas": [qa]}]})
    return out


def test_squad_v1_from_files_and_v2_from_tfds(tmp_path, checkpoint):
    tfds = pytest.importorskip("tensorflow_datasets")
    rng = np.random.RandomState(3)
    data = tmp_path / "squad"
    data.mkdir()
    for split, n in (("train", 8), ("dev", 6)):
        (data / f"{split}-v1.1.json").write_text(json.dumps({"version": "1.1", "data": squad_examples(rng, n, False)}))
    overrides = dict(max_seq_length=24, task_options=dict(squad_config.get_config().task_options.to_dict(),
                                                          doc_stride=4, max_query_length=6, max_answer_length=5))
    work = tmp_path / "v1"
    config = tiny(squad_config.get_config(), "squad_v1", data, checkpoint["bert_jax"], **overrides)
    results = finetune.run(config, str(work))
    assert {"exact_match", "f1"} <= set(results)
    predictions = read_json(work / "predictions.json")
    assert sorted(predictions) == [f"q{i}" for i in range(6)]
    # The official scorer's CLI on the written predictions agrees with the loop.
    cli = subprocess.run([sys.executable, "-m", "data_pipeline.tasks.squad", str(data / "dev-v1.1.json"),
                          str(work / "predictions.json")], capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(cli.stdout) == pytest.approx({"exact_match": results["exact_match"], "f1": results["f1"]})
    # ... and that CLI gives the official evaluate-v1.1.py's numbers on a perturbed fixture
    # (tests/fixtures/official_scorers.json, computed by the official script).
    official = read_json(os.path.join(REPO, "tests", "fixtures", "official_scorers.json"))["squad_v1.1"]
    (tmp_path / "official_dev.json").write_text(json.dumps(official["data"]))
    (tmp_path / "official_pred.json").write_text(json.dumps(official["predictions"]))
    cli = subprocess.run([sys.executable, "-m", "data_pipeline.tasks.squad", str(tmp_path / "official_dev.json"),
                          str(tmp_path / "official_pred.json")], capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(cli.stdout) == pytest.approx(official["official"], abs=1e-9)

    dev_rows = []

    def make(builder, split):
        dataset = squad_examples(rng, 8 if "train" in split else 6, True)
        rows = dev_rows if "train" not in split else []
        for article in dataset:
            p = article["paragraphs"][0]
            qa = p["qas"][0]
            ans = {"text": [a["text"] for a in qa["answers"]], "answer_start": [a["answer_start"] for a in qa["answers"]]}
            rows.append({"id": qa["id"], "title": "t", "context": p["context"], "question": qa["question"],
                         "answers": ans, "is_impossible": qa["is_impossible"],
                         "plausible_answers": {"text": [], "answer_start": []}})
        return rows

    work = tmp_path / "v2"
    config = tiny(squad_config.get_config(), "squad_v2", "", checkpoint["bert_jax"], data_source="tfds", **overrides)
    with tfds.testing.mock_data(as_dataset_fn=lambda self, split, **kw: _tfds_dataset(self, split, make)):
        results = finetune.run(config, str(work))
    for key in ("exact", "f1", "total", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1",
                "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"):
        assert key in results, key
    assert results["total"] == 6
    # What the loop reports is the v2.0 scorer (pinned to evaluate-v2.0.py in test_tasks.py) on the
    # files it wrote, against the gold answers TFDS served: predictions.json and null_odds.json are
    # the scored ones. The best epoch's f1 has its own key and does not overwrite it.
    from data_pipeline.tasks import squad
    gold = [(r["id"], [] if r["is_impossible"] else list(r["answers"]["text"])) for r in dev_rows]
    assert len(gold) == 6
    official = squad.evaluate_v2(gold, read_json(work / "predictions.json"), read_json(work / "null_odds.json"))
    assert {k: results[k] for k in official} == pytest.approx(official, abs=1e-9)
    history = read_json(work / "eval_history.json")
    assert results["best_epoch_f1"] == max(h["f1"] for h in history)
    assert sorted(read_json(work / "null_odds.json")) == sorted(read_json(work / "predictions.json"))


# ---------------------------------------------------------------------------------------------
# NER and SWAG
# ---------------------------------------------------------------------------------------------


def conll_sentences(rng, n):
    sentences = []
    for _ in range(n):
        words = list(rng.choice(WORDS[12:25] + ["paris", "john", "smith", "acme", "corp"], rng.randint(3, 9)))
        tags, prev = [], None
        for word in words:  # IOB1: I- everywhere, B- only after an entity of the same type
            kind = ENTITIES.get(word)
            tags.append("O" if kind is None else ("B-" if prev == kind else "I-") + kind)
            prev = kind
        sentences.append(list(zip(words, tags)))
    return sentences


def entity_scores(gold, predicted):
    """Entity-level precision, recall and F1 (and per type), token accuracy, entity counts, from the
    CoNLL-2000/2003 definition of a chunk: it starts at B-X, or at I-X after O or after a tag of
    another type (so IOB1 and IOB2 read alike), and takes the I-X that follow; an entity is correct
    when a predicted chunk has the gold chunk's first word, last word and type."""

    def chunks(tags):
        found, start, kind = [], None, None
        for i, tag in enumerate(list(tags) + ["O"]):
            prefix, _, t = tag.partition("-")
            if kind is not None and (prefix != "I" or t != kind):
                found.append((start, i - 1, kind))
                kind = None
            if prefix in ("B", "I") and kind is None:
                start, kind = i, t
        return found

    g = {(n, *c) for n, tags in enumerate(gold) for c in chunks(tags)}
    p = {(n, *c) for n, tags in enumerate(predicted) for c in chunks(tags)}

    def prf(g, p):
        precision = len(g & p) / len(p) if p else 0.0
        recall = len(g & p) / len(g) if g else 0.0
        return precision, recall, 2 * precision * recall / (precision + recall) if precision + recall else 0.0

    out = dict(zip(("precision", "recall", "f1"), prf(g, p)))
    out.update(entities_gold=len(g), entities_predicted=len(p), entities_correct=len(g & p),
               accuracy=np.mean([a == b for gs, ps in zip(gold, predicted) for a, b in zip(gs, ps, strict=True)]))
    for kind in {c[3] for c in g | p}:
        out[f"f1_{kind}"] = prf({c for c in g if c[3] == kind}, {c for c in p if c[3] == kind})[2]
    return out


def test_ner_from_files_and_tfds(tmp_path, checkpoint):
    tfds = pytest.importorskip("tensorflow_datasets")
    rng = np.random.RandomState(4)
    data = tmp_path / "conll"
    data.mkdir()
    written = {}
    for name, n in (("train.txt", 8), ("valid.txt", 6), ("test.txt", 6)):
        written[name] = conll_sentences(rng, n)
        with open(data / name, "w") as f:
            f.write("-DOCSTART- -X- -X- O\n\n")
            for sentence in written[name]:
                f.write("".join(f"{w} NN I-NP {t}\n" for w, t in sentence) + "\n")
    work = tmp_path / "files"
    results = finetune.run(tiny(ner_config.get_config(), "conll2003", data, checkpoint["bert_jax"]), str(work))
    assert {"precision", "recall", "f1", "accuracy", "test_f1"} <= set(results)
    lines = (work / "conll2003_dev_predictions.txt").read_text().split("\n\n")
    assert len([s for s in lines if s.strip()]) == 6
    # Both eval files against references outside the loop: words and gold tags as written above,
    # each predicted tag the argmax at its word's first piece of the saved last state applied by
    # `Reference`, and the scores of `entity_scores` (CoNLL's chunk definition, written here).
    reference = Reference(work, "last", checkpoint["vocab"])
    labels = reference.task["labels"]  # the head's outputs, in order
    assert sorted(labels) == sorted(["O"] + [f"{p}-{k}" for p in "BI" for k in ("PER", "ORG", "LOC", "MISC")])
    for name, split, prefix in (("valid.txt", "dev", ""), ("test.txt", "test", "test_")):
        sentences = written[name]
        got = [[line.split(" ") for line in block.splitlines()] for block in
               (work / f"conll2003_{split}_predictions.txt").read_text().split("\n\n") if block.strip()]
        assert [[t[:2] for t in s] for s in got] == [[list(pair) for pair in s] for s in sentences], split
        predicted = [[t[2] for t in s] for s in got]
        logits = reference.word_logits([[w for w, _ in s] for s in sentences])
        for i, (tags, word_logits) in enumerate(zip(predicted, logits, strict=True)):
            assert_argmax(tags, word_logits, labels, f"{split} sentence {i}")
        want = entity_scores([[t for _, t in s] for s in sentences], predicted)
        assert {k: results[prefix + k] for k in want} == pytest.approx(want, abs=1e-9), split
        types = {k[len(prefix):] for k in results if k.startswith(prefix + "f1_")}
        assert types == {k for k in want if k.startswith("f1_")}, split
    # mode=predict on the dev file (CoNLL columns) and on its sentences as plain text: the loop's tags.
    from bert_jax.finetune import predict
    loop = [[line.split(" ") for line in block.splitlines()] for block in lines if block.strip()]
    text = tmp_path / "sentences.txt"
    text.write_text("".join(" ".join(w for w, _, _ in s) + "\n" for s in loop))
    for path, name in ((data / "valid.txt", "valid"), (text, "sentences")):
        config = ner_config.get_config()
        config.update(mode="predict", predict_input=str(path), predict_output_dir=str(tmp_path / "out"))
        predict.run(config, str(work))
        got = [[line.split(" ") for line in block.splitlines()] for block in
               (tmp_path / "out" / f"conll2003_{name}_predictions.txt").read_text().split("\n\n") if block.strip()]
        assert [[t[2] for t in s] for s in got] == [[t[2] for t in s] for s in loop], name
        assert [[t[0] for t in s] for s in got] == [[t[0] for t in s] for s in loop], name

    def make(builder, split):
        names = list(builder.info.features["ner"].feature.names)
        n = 8 if split == "train" else 6
        def iob2(s):  # TFDS conll2003 is IOB2
            return [t.replace("I-", "B-") if i == 0 or s[i - 1][1][2:] != t[2:] else t for i, (_, t) in enumerate(s)]

        return [{"tokens": [w for w, _ in s], "ner": [names.index(t) for t in iob2(s)],
                 "pos": [0] * len(s), "chunks": [0] * len(s)} for s in conll_sentences(rng, n)]

    config = tiny(ner_config.get_config(), "conll2003", "", checkpoint["bert_jax"], data_source="tfds")
    with tfds.testing.mock_data(as_dataset_fn=lambda self, split, **kw: _tfds_dataset(self, split, make)):
        results = finetune.run(config, str(tmp_path / "tfds"))
    assert "test_f1" in results
    # conlleval (pinned to the Perl script in test_tasks.py) on the dev predictions the loop wrote.
    from data_pipeline.tasks import ner
    sentences = [[line.split(" ") for line in block.splitlines()]
                 for block in (tmp_path / "tfds" / "conll2003_dev_predictions.txt").read_text().split("\n\n")
                 if block.strip()]
    assert len(sentences) == 6
    scored = ner.conlleval([[t[1] for t in s] for s in sentences], [[t[2] for t in s] for s in sentences])
    for key in ("precision", "recall", "f1", "accuracy"):
        assert results[key] == pytest.approx(scored[key], abs=1e-9), key


def test_swag_from_files(tmp_path, checkpoint):
    rng = np.random.RandomState(5)
    data = tmp_path / "swag"
    data.mkdir()
    header = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source",
              "ending0", "ending1", "ending2", "ending3"]
    for name, n, labelled in (("train.csv", 8, True), ("val.csv", 8, True), ("test.csv", 3, False)):
        with open(data / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header + (["label"] if labelled else []))
            for i in range(n):
                endings = [" ".join(rng.choice(WORDS, 3)) for _ in range(4)]
                writer.writerow([i, "v", i, "he sat", "he sat on the mat .", "then he", "gold", *endings]
                                + ([i % 4] if labelled else []))
    work = tmp_path / "work"
    results = finetune.run(tiny(swag_config.get_config(), "swag", data, checkpoint["bert_jax"]), str(work))
    assert "loss" in results
    # The dev predictions' labels are the ones written above (i % 4), and the accuracy is theirs.
    rows = list(csv.DictReader(open(work / "swag_dev_predictions.csv", newline="")))
    assert [int(r["label"]) for r in rows] == [i % 4 for i in range(8)]
    assert results["accuracy"] == pytest.approx(np.mean([r["pred"] == r["label"] for r in rows]), abs=1e-9)
    assert len((work / "swag_test_predictions.csv").read_text().splitlines()) == 4


# ---------------------------------------------------------------------------------------------
# The command line, heads
# ---------------------------------------------------------------------------------------------


def test_main_second_run_loads_its_programs(tmp_path, checkpoint):
    """`python -m bert_jax.main` twice, the same run: the first compiles its programs into
    config.compilation_cache's "auto" folder ($BERT_JAX_CACHE_DIR/xla), the second loads every one
    of them from there, and its results are the first's to the bit."""
    glue_files(tmp_path / "data" / "RTE", "rte", np.random.RandomState(6))
    env = dict(os.environ, BERT_JAX_CACHE_DIR=str(tmp_path / "cache"))
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(name, None)
    runs = []
    for n in range(2):
        work = tmp_path / f"work{n}"
        cmd = [sys.executable, "-m", "bert_jax.main", "--config=configs/glue.py", "--config.task=rte",
               f"--config.data_dir={tmp_path / 'data'}", f"--config.init_checkpoint={checkpoint['bert_jax']}",
               f"--workdir={work}", "--config.max_seq_length=16", "--config.global_batch_size=8",
               "--config.num_train_epochs=1", "--config.learning_rate=1e-3", "--config.log_every_steps=1",
               "--config.async_checkpointing=false", "--config.xla_backend_optimization_level=0"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"compilation cache: {tmp_path / 'cache' / 'xla'} (config.compilation_cache=auto" in proc.stderr
        loaded = re.search(r"compilation cache: (\d+) of (\d+) programs loaded from it", proc.stderr)
        assert loaded, proc.stderr[-3000:]
        runs.append(dict(hits=int(loaded[1]), programs=int(loaded[2]), results=read_json(work / "eval_results.json"),
                         predictions=(work / "RTE.tsv").read_text()))
    first, second = runs
    assert "accuracy" in first["results"]
    assert first["hits"] == 0 and first["programs"] >= 3  # init, training, evaluation at least
    assert second["hits"] == second["programs"] == first["programs"]
    assert second["results"] == first["results"]
    assert second["predictions"] == first["predictions"]


@pytest.mark.parametrize("head,outputs,shape", [
    ("classification", 3, {"logits": (2, 3)}),
    ("regression", 1, {"logits": (2,)}),
    ("span", 2, {"start_logits": (2, 8), "end_logits": (2, 8)}),
    ("token", 5, {"logits": (2, 8, 5)}),
    ("multiple_choice", 4, {"logits": (2, 4)}),
])
def test_heads_shapes_and_losses(head, outputs, shape, checkpoint):
    cfg = checkpoint["config"]
    model = heads.BertForTask(cfg, head, outputs)
    dummy = heads.dummy_batch(head, 8, outputs)
    params = nn.meta.unbox(jax.eval_shape(lambda: model.init(jax.random.key(1), *dummy.values())["params"]))
    assert set(params) == {"bert", "head"}
    assert jax.tree_util.tree_structure(params["bert"]) == jax.tree_util.tree_structure(checkpoint["params"]["bert"])
    ids = jax.ShapeDtypeStruct((2,) + dummy["input_ids"].shape[1:], np.int32)
    out = jax.eval_shape(lambda p, x: model.apply({"params": p}, x, x, x), params, ids)
    assert {k: v.shape for k, v in out.items()} == shape
    rng = np.random.RandomState(0)
    out = {k: rng.randn(*v.shape).astype(np.float32) for k, v in out.items()}
    labels = {"label": np.array([1, 0]) if head != "regression" else np.array([1.5, 2.0], np.float32),
              "start_positions": np.array([1, 2]), "end_positions": np.array([3, 2]),
              "label_ids": np.ones((2, 8), np.int32), "label_weights": np.ones((2, 8), np.float32)}
    batch = {k: labels[k] for k in heads.LABEL_KEYS[head]}
    # Row 1 padding (weight 0): the sums are row 0's alone.
    sums = heads.loss_sums(head, out, dict(batch, weight=np.array([1.0, 0.0], np.float32)))
    one = heads.loss_sums(head, {k: v[:1] for k, v in out.items()},
                          dict({k: v[:1] for k, v in batch.items()}, weight=np.ones(1, np.float32)))
    np.testing.assert_allclose(sums["loss_sum"], one["loss_sum"], rtol=1e-6)
    np.testing.assert_allclose(sums["weight"], one["weight"])
    assert ("correct" in sums) == (head != "regression")  # no train/accuracy logged for a score
    # An independent numpy loss for row 0.
    def xent(logits, label):
        logits = logits - logits.max()
        return float(np.log(np.exp(logits).sum()) - logits[label])
    expected = {
        "classification": lambda: xent(out["logits"][0], 1),
        "multiple_choice": lambda: xent(out["logits"][0], 1),
        "regression": lambda: (out["logits"][0] - 1.5) ** 2,
        "span": lambda: 0.5 * (xent(out["start_logits"][0], 1) + xent(out["end_logits"][0], 3)),
        "token": lambda: sum(xent(out["logits"][0, i], 1) for i in range(8)),
    }[head]()
    np.testing.assert_allclose(float(sums["loss_sum"]), expected, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Google's recipe: run_classifier.py / run_squad.py's optimizer, schedule and number of steps
# ---------------------------------------------------------------------------------------------


def google_lr(step, peak, total, warmup):
    """optimization.py by hand: polynomial_decay(peak, step, total, 0, power 1), warmup overriding."""
    if warmup and step < warmup:
        return peak * step / warmup
    return peak * (1 - min(step, total) / total)


def adam_weight_decay_reference(params, grads, lrs, *, weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-6,
                                clip_norm=1.0):
    """google-research/bert optimization.py in numpy, on TF1 variable names: tf.clip_by_global_norm,
    then AdamWeightDecayOptimizer (no bias correction; `weight_decay * param` added to the Adam
    direction unless the name matches "LayerNorm", "layer_norm" or "bias"; times the rate)."""
    import re
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    for g, lr in zip(grads, lrs):
        g = {k: np.asarray(x, np.float64) for k, x in g.items()}
        norm = np.sqrt(sum(np.sum(x ** 2) for x in g.values()))
        g = {k: x * clip_norm / max(norm, clip_norm) for k, x in g.items()}
        for k in w:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            update = m[k] / (np.sqrt(v[k]) + eps)
            if not any(re.search(r, k) for r in ("LayerNorm", "layer_norm", "bias")):
                update = update + weight_decay * w[k]
            w[k] = w[k] - lr * update
    return w


def google_recipe(config):
    config.optimizer = "google_adamw"
    config.google_lr_schedule = True
    config.num_train_steps_from = "examples"
    return config


def test_train_plan_counts_steps_as_googles_scripts():
    config = glue_config.get_config()
    config.global_batch_size, config.num_train_epochs, config.warmup_proportion = 4, 3, 0.1
    # GLUE-like: 10 examples, one row each. Ours: 3 epochs of ceil(10 / 4) = 3 batches (padded).
    assert finetune_batches.train_plan(config, 10, 10) == (9, 0, [3, 6, 9])
    # Google: int(10 / 4 * 3) = 7 steps of full batches, int(7 * 0.1) = 0 warmup steps; an
    # evaluation after the batch that completes each pass over the rows (rows 10, 20) and at the end.
    google_recipe(config)
    assert finetune_batches.train_plan(config, 10, 10) == (7, 0, [3, 5, 7])
    config.warmup_proportion = 0.3
    assert finetune_batches.train_plan(config, 10, 10) == (7, 2, [3, 5, 7])  # int(2.1) = 2
    # SQuAD-like: 10 questions in 13 windows, 2 epochs: int(10 / 4 * 2) = 5 steps (not
    # ceil(13 / 4) * 2 = 8), fewer than two passes over the windows; a float number of epochs.
    config.num_train_epochs, config.warmup_proportion = 2, 0.1
    assert finetune_batches.train_plan(config, 10, 13) == (5, 0, [4, 5])
    config.num_train_epochs = 2.5
    assert finetune_batches.train_plan(config, 10, 13) == (6, 0, [4, 6])
    # SQuAD v1.1's 87,599 training questions (more windows), batch 32, 3 epochs, warmup 0.1.
    config.global_batch_size, config.num_train_epochs = 32, 3.0
    assert finetune_batches.train_plan(config, 87599, 88641)[:2] == (8212, 821)
    config.num_train_steps_from = "epochs"
    with pytest.raises(ValueError, match="config.num_train_epochs=3.5 must be a whole number"):
        config.num_train_epochs = 3.5
        finetune_batches.train_plan(config, 10, 10)
    config.num_train_steps_from = "features"
    with pytest.raises(ValueError, match="config.num_train_steps_from"):
        finetune_batches.train_plan(config, 10, 10)
    # Examples are counted as those that gave feature rows (a SQuAD question gives several).
    split = type("Split", (), {"examples": list("abcd"), "features": {"example_index": np.array([0, 0, 1, 3, 3])}})
    assert finetune.count_examples(split) == 3


def test_stream_batches_are_full_batches_of_passes_one_after_another():
    n, batch, seed = 10, 4, 7
    features = {"input_ids": np.arange(n)[:, None] * np.ones((1, 3), int), "weight": np.ones(n, np.float32)}
    keys = ("input_ids", "weight")
    got = list(finetune_batches.stream_batches(features, keys, batch, range(7), seed=seed))
    rows = np.concatenate([b["input_ids"][:, 0] for b in got])
    passes = [np.random.RandomState(seed + p).permutation(n) for p in range(3)]
    np.testing.assert_array_equal(rows, np.concatenate(passes)[:28])  # 7 * 4 rows; no padding
    assert all(b["weight"].dtype == np.float32 and b["weight"].tolist() == [1.0] * batch for b in got)
    # Resuming at step 3 gives the same batches; two hosts hold the halves of each batch.
    tail = list(finetune_batches.stream_batches(features, keys, batch, range(3, 7), seed=seed))
    for a, b in zip(tail, got[3:]):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    halves = [list(finetune_batches.stream_batches(features, keys, batch, range(7), seed=seed, process_index=p,
                                           process_count=2)) for p in range(2)]
    for a, b, whole in zip(*halves, got):
        np.testing.assert_array_equal(np.concatenate([a["input_ids"], b["input_ids"]]), whole["input_ids"])


def test_google_recipe_trains_googles_steps_at_googles_learning_rates(tmp_path, checkpoint, monkeypatch):
    """20 sentences, batch 8, 3 epochs, warmup 0.3: int(20 / 8 * 3) = 7 steps (the default: 9),
    int(7 * 0.3) = 2 warmup steps, the rates of optimization.py at each step."""
    rng = np.random.RandomState(3)
    folder = tmp_path / "glue" / "SST-2"
    folder.mkdir(parents=True)
    for split, n in (("train", 20), ("dev", 8)):
        (folder / f"{split}.tsv").write_text(
            "sentence\tlabel\n" + "".join(f"{s}\t{l}\n" for s, l in sentiment(rng, n)))
    config = google_recipe(tiny(glue_config.get_config(), "sst2", tmp_path / "glue", checkpoint["bert_jax"],
                                num_train_epochs=3, warmup_proportion=0.3, learning_rate=1e-3,
                                predict_test=False))
    seen = []
    log = finetune._log

    def spy(pending, step, *args):
        seen.extend((step - len(pending) + i, float(m["learning_rate"]), float(np.sum(m["weight"])))
                    for i, m in enumerate(jax.device_get(pending)))
        return log(pending, step, *args)

    monkeypatch.setattr(finetune, "_log", spy)
    results = finetune.run(config, str(tmp_path / "work"))
    assert results["step"] == 7
    assert [h["step"] for h in read_json(tmp_path / "work" / "eval_history.json")] == [3, 5, 7]
    assert [s for s, _, _ in seen] == list(range(7))
    np.testing.assert_allclose([lr for _, lr, _ in seen], [google_lr(s, 1e-3, 7, 2) for s in range(7)],
                               rtol=1e-6, atol=1e-12)
    assert [w for _, _, w in seen] == [8.0] * 7  # full batches, no weight-0 padding


def test_google_adamw_of_the_loop_matches_optimization_py(checkpoint):
    """Three updates of the optimizer the loop builds for Google's recipe (7 steps, 2 warmup), on
    the tiny BERT, against optimization.py in numpy on the TF1 variable names."""
    config = google_recipe(glue_config.get_config())
    config.learning_rate = 1e-2
    schedule, tx = finetune.make_optimizer(config, 7, 2)
    params = jax.tree_util.tree_map(np.asarray, checkpoint["params"])
    rng = np.random.RandomState(0)
    grads = [jax.tree_util.tree_map(lambda x: (rng.randn(*x.shape) * scale).astype(np.float32), params)
             for scale in (1.0, 1e-3, 0.3)]  # clipped (norm ~ 100), not clipped (~0.1), clipped
    lrs = [google_lr(s, 1e-2, 7, 2) for s in range(3)]
    np.testing.assert_allclose([float(schedule(s)) for s in range(3)], lrs, rtol=1e-6)
    state, p = tx.init(params), params
    for g in grads:
        updates, state = jax.jit(tx.update)(g, state, p)
        p = jax.tree_util.tree_map(lambda a, u: np.asarray(a + u), p, updates)
    cfg = checkpoint["config"]
    want = adam_weight_decay_reference(convert.to_google(params, cfg),
                                       [convert.to_google(g, cfg) for g in grads], lrs)
    got = convert.to_google(p, cfg)
    assert sorted(got) == sorted(want)
    assert any("LayerNorm" in k for k in want) and any(k.endswith("bias") for k in want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)


# ---------------------------------------------------------------------------------------------
# Batches cut short of the padding (config.trim_padding_buckets)
# ---------------------------------------------------------------------------------------------


def varied_files(folder, kind, rng):
    """SST-2 or CoNLL files whose rows run from 3 to 14 pieces: some batches need all 16 positions,
    others fit in 8."""
    folder.mkdir(parents=True)
    for split, n in (("train", 40), ("dev", 24)):
        rows = []
        for i in range(n):
            short = rng.rand() < 0.6
            words = list(rng.choice(WORDS[2:25] + list(ENTITIES), rng.randint(1, 5) if short else rng.randint(7, 13)))
            if kind == "sst2":
                words.insert(rng.randint(len(words) + 1), "good" if i % 2 else "bad")
                rows.append(f"{' '.join(words)}\t{i % 2}\n")
            else:
                rows.append("".join(f"{w} NN I-NP {'I-' + ENTITIES[w] if w in ENTITIES else 'O'}\n" for w in words) + "\n")
        if kind == "sst2":
            (folder / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(rows))
        else:
            for name in ((f"{split}.txt",) if split == "train" else ("valid.txt", "test.txt")):
                (folder / name).write_text("-DOCSTART- -X- -X- O\n\n" + "".join(rows))


@pytest.mark.parametrize("kind", ["sst2", "conll2003"])
def test_batches_cut_short_of_the_padding_train_and_predict_as_full_padding(tmp_path, checkpoint, monkeypatch, kind):
    """With dropout off (its masks are drawn per shape), a run whose batches are cut to 8 or 16
    positions (trim_padding_buckets=4 at length 16) gives the parameters, scores, predictions and
    each evaluation row's logits (in row order, at its real positions) of the same run padded to
    16, to float rounding; the cut really happens, in training and evaluation. So does a run whose
    training rows are packed several to a row (config.packing)."""
    from bert_jax.training import sharding
    folder = tmp_path / "data" / ("SST-2" if kind == "sst2" else "conll")
    varied_files(folder, kind, np.random.RandomState(5))
    widths, shapes, evaluated = [], [], []
    to_global = sharding.to_global
    monkeypatch.setattr(sharding, "to_global", lambda b, mesh: (
        widths.append(b["input_ids"].shape[-1]), shapes.append((b["input_ids"].shape, "pack_ids" in b)),
        to_global(b, mesh))[2])
    predict = finetune_steps.predict_split

    def spy(p_eval, params, split, **kw):  # each evaluation's logits and its rows' input masks
        outputs, sums = predict(p_eval, params, split, **kw)
        evaluated.append((outputs["logits"], split.features["input_mask"]))
        return outputs, sums

    monkeypatch.setattr(finetune_steps, "predict_split", spy)

    def real(logits, mask):  # token logits at padding positions (zeros where cut) set to 0
        return np.where(mask[..., None] > 0, logits, 0.0) if logits.ndim == 3 else logits
    bert_config = checkpoint["config"].replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base = glue_config.get_config() if kind == "sst2" else ner_config.get_config()
    runs = {}
    # "4 free": every length some batch needs (compiles counted as free); "4": the default choice,
    # where on CPU a compile costs 8 steps and cutting 10 steps to 8 positions saves at most 5.
    # "4 packed": training rows packed several to a row (config.packing), evaluation as "4".
    for buckets, cost in ((0, -1.0), ("4 free", 0.0), (4, -1.0), ("4 packed", -1.0)):
        config = tiny(base.copy_and_resolve_references(), kind, folder.parent if kind == "sst2" else folder,
                      "", num_train_epochs=2, learning_rate=1e-2, trim_padding_buckets=int(str(buckets)[0]),
                      trim_padding_compile_cost=cost, predict_test=False, packing=buckets == "4 packed")
        work = tmp_path / f"work{buckets}".replace(" ", "_")
        widths.clear()
        shapes.clear()
        evaluated.clear()
        results = finetune.train_and_evaluate(config, str(work), finetune.make_task(config), bert_config,
                                              {"bert": checkpoint["params"]["bert"]}, checkpoint["vocab"], True)
        params = convert.model_params(convert.load_finetuned(str(work), "last"))
        predictions = (work / (f"{kind}_dev_predictions." + ("tsv" if kind == "sst2" else "txt"))).read_text()
        runs[buckets] = results, params, predictions, list(widths), list(shapes), list(evaluated)
    assert set(runs[0][3]) == {16}
    assert set(runs["4 free"][3]) == {8, 16}, runs["4 free"][3]  # cut where a whole batch fits in 8
    assert set(runs[4][3]) == {16}  # not worth a second compile
    assert not any(p for _, p in runs[4][4])
    # 10 training steps (40 rows, 2 epochs) packed, evaluation not. Each step's rows are rounded
    # up to the mesh's 8 devices (test_packed_rows.py checks the packing plan on smaller meshes).
    trained = [shape for shape, p in runs["4 packed"][4] if p]
    assert trained == [(8, 16)] * 10, trained
    assert len(runs["4 packed"][4]) == len(runs[4][4])
    for cut in ("4 free", 4, "4 packed"):
        assert len(runs[cut][3]) == len(runs[0][3])  # the same batches, training and evaluation
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=0), runs[cut][1], runs[0][1])
        assert runs[cut][2] == runs[0][2]
        assert runs[cut][0] == pytest.approx(runs[0][0], abs=2e-5)
    assert not np.allclose(runs[0][1]["head"]["output"]["kernel"], 0.0)  # trained, not empty
    # Each evaluation's logits, row by row, in row order: the cut runs' rows go by length and back
    # (measured: equal, or off by at most 5e-7 with packing). The tiny model predicts one class for
    # every row (SST-2 all "1", CoNLL all "O"), so the predictions above cannot tell the rows
    # apart, but their logits can: in length order they are off by 3.6e-4 (SST-2) to 0.49 (CoNLL)
    # here, checked to stay over 10x the bound.
    evaluations = 2 if kind == "sst2" else 4  # after each epoch: dev (CoNLL: valid and test)
    assert [len(runs[b][5]) for b in runs] == [evaluations] * len(runs)
    for (logits, mask), *cuts in zip(*(runs[b][5] for b in (0, "4 free", 4, "4 packed"))):
        order = np.argsort(bucketing.row_lengths(mask), kind="stable")
        assert np.abs(real(logits[order], mask) - real(logits, mask)).max() > 10 * 5e-6
        for cut_logits, cut_mask in cuts:
            assert cut_logits.shape == logits.shape and np.array_equal(cut_mask, mask)
            np.testing.assert_allclose(real(cut_logits, mask), real(logits, mask), atol=5e-6, rtol=0)


@pytest.mark.parametrize("steps_from", ["epochs", "examples"])
def test_training_needs_are_the_lengths_the_training_batches_are_cut_to(steps_from):
    """What the length choice counts, per step of the whole run, is what the loop's batches (of
    `batches.batches` per epoch, or `stream_batches`) are cut to when every length is allowed."""
    rng = np.random.RandomState(4)
    lengths = rng.randint(1, 17, size=21)
    mask = (np.arange(16)[None] < lengths[:, None]).astype(np.int32)
    features = {"input_ids": mask, "input_mask": mask, "weight": np.ones(21, np.float32)}
    every = dict(lengths=tuple(range(1, 17)), sequence_keys=("input_ids",))
    if steps_from == "epochs":
        total, epochs = 9, 3  # 3 batches of 8 per epoch, the last completed with row 0
        batches = [b for e in range(epochs) for b in finetune_batches.batches(features, ["input_ids"], 8, shuffle_seed=5 + e, **every)]
    else:
        total, epochs = 7, 3  # int(21 / 8 * 2.7): 56 rows from a stream of passes
        batches = list(finetune_batches.stream_batches(features, ["input_ids"], 8, range(total), seed=5, **every))
    needs = finetune_batches.training_needs(features, 8, 5, total, epochs, steps_from == "examples")
    assert needs.tolist() == [b["input_ids"].shape[1] for b in batches]
