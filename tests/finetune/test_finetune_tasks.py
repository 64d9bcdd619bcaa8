"""Every task family end to end through the fine-tuning loop: the GLUE tasks from files and from
TFDS (their submission files), SQuAD v1.1 and v2.0, CoNLL-2003 NER, SWAG; each scored against an
independent reference (the official scorers' numbers, conlleval's counts, argmax by hand).

The tiny "pretrained" encoder and the compilation cache folder are tests/finetune/conftest.py's (shared
with test_finetune.py), the helpers tests/helpers/finetune_inputs.py's and finetune_reference.py's.
"""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bert_jax.finetune import loop as finetune, preparation
from configs import glue as glue_config
from configs import ner as ner_config
from configs import squad as squad_config
from configs import swag as swag_config
from tests.helpers.finetune_inputs import ENTITIES, WORDS, glue_files, read_json, tiny, tsv_rows
from tests.helpers.finetune_reference import Reference, assert_argmax

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.usefixtures("compilation_cache")  # tests/finetune/conftest.py


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
    monkeypatch.setattr(preparation.jax, "process_count", lambda: 2)
    monkeypatch.setattr(preparation.jax, "process_index", lambda: process_index)
    monkeypatch.setattr(preparation.multihost_utils, "sync_global_devices", lambda name: events.append(("barrier",)))
    task = tasks_lib.get_task("mnli", source="tfds")
    preparation._prepare_tfds_on_host_zero(task, (task.train_split, *task.eval_splits), task.test_splits)
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
    # What the loop reports is the v2.0 scorer (pinned to evaluate-v2.0.py in tests/data_pipeline/tasks/test_squad.py) on the
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
