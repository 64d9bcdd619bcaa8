"""What the ModernBERT fine-tuning tests (tests/finetune/test_modernbert_finetune.py, WordPiece;
test_modernbert_tokenizer_json.py, a tokenizer.json) share: the task files they write, and the checks of
a run's evaluation recomputed in NumPy from the exported model's outputs."""

import csv
import json

import numpy as np
import pytest

from tests.helpers.finetune_inputs import ENTITIES, WORDS, read_json



def squad_overrides() -> dict:
    """The config of the SQuAD runs: short rows, several windows a context."""
    from configs import squad as squad_config
    return dict(max_seq_length=24, task_options=dict(squad_config.get_config().task_options.to_dict(), doc_stride=4,
                                                     max_query_length=6, max_answer_length=5))


def cross_entropy(logits, labels):
    logits = logits.astype(np.float64)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, labels[..., None].astype(np.int64), -1)[..., 0]


def best_epoch(work):
    history = read_json(work / "eval_history.json")
    best = read_json(work / "eval_results.json")["best_epoch"]
    return history[best - 1]


def check_scores(task, split, outputs, results):
    """Every metric of the task on the exported model's outputs is the loop's of the best epoch."""
    scores = task.score(split.examples, task.postprocess(split.examples, split.features, outputs))
    assert scores, "no metric"
    for k, v in scores.items():
        assert results[k] == pytest.approx(float(v), abs=1e-6), k


def loop_loss(head, outputs, f):
    """heads.loss_sums' mean loss, in NumPy (float64) from `outputs` and the gold of features `f`."""
    w = f["weight"].astype(np.float64)
    if head == "token":
        tw = f["label_weights"].astype(np.float64) * w[:, None]
        return (cross_entropy(outputs["logits"], f["label_ids"]) * tw).sum() / tw.sum()
    if head == "span":
        per = 0.5 * (cross_entropy(outputs["start_logits"], f["start_positions"])
                     + cross_entropy(outputs["end_logits"], f["end_positions"]))
    elif head == "regression":
        per = (outputs["logits"].astype(np.float64) - f["label"]) ** 2
    else:
        per = cross_entropy(outputs["logits"], f["label"])
    return (per * w).sum() / w.sum()


def stsb_files(root):
    from data_pipeline.tasks import glue
    from tests.helpers.finetune_inputs import glue_files
    glue_files(root / "glue" / glue.SPECS["stsb"].folder, "stsb", np.random.RandomState(1), n_train=8)
    return root / "glue"


def squad_files(root):
    rng = np.random.RandomState(3)
    data = root / "squad"
    data.mkdir()
    for split, n in (("train", 8), ("dev", 6)):
        articles = []
        for i in range(n):
            words = list(rng.choice(WORDS[12:30], 10))
            name = ["john smith", "paris", "acme corp"][i % 3]
            pos = rng.randint(1, 9)
            context = " ".join(words[:pos]) + f" {name} " + " ".join(words[pos:])
            qa = {"id": f"q{i}", "question": "who did it", "answers": [{"text": name,
                                                                       "answer_start": context.index(name)}]}
            articles.append({"title": "t", "paragraphs": [{"context": context, "qas": [qa]}]})
        (data / f"{split}-v1.1.json").write_text(json.dumps({"version": "1.1", "data": articles}))
    return data


def conll_files(root):
    rng = np.random.RandomState(4)
    data = root / "conll"
    data.mkdir()
    for name, n in (("train.txt", 8), ("valid.txt", 6), ("test.txt", 2)):
        with open(data / name, "w") as f:
            f.write("-DOCSTART- -X- -X- O\n\n")
            for _ in range(n):
                words = rng.choice(WORDS[12:25] + ["paris", "john", "smith", "acme", "corp"], rng.randint(3, 9))
                f.write("".join(f"{w} NN I-NP {'I-' + ENTITIES[w] if w in ENTITIES else 'O'}\n" for w in words) + "\n")
    return data


def swag_files(root):
    rng = np.random.RandomState(5)
    data = root / "swag"
    data.mkdir()
    header = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source",
              "ending0", "ending1", "ending2", "ending3", "label"]
    for name, n in (("train.csv", 8), ("val.csv", 8)):
        with open(data / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            for i in range(n):
                endings = [" ".join(rng.choice(WORDS[12:40], 3)) for _ in range(4)]
                writer.writerow([i, "v", i, "he sat", "he sat on the mat", "then he", "gold", *endings, i % 4])
    return data
