"""ModernBERT fine-tuning (`config.model_family="modernbert"`, bert_jax/finetune/modernbert_tasks.py): one
task of each family through the loop (`loop.run`, what `bert_jax.main` runs for mode=finetune) from the
tiny transformers ModernBERT of tests/fixtures/modernbert_tiny/ (vocab_size 48: a WordPiece vocabulary
of 47 entries written here), on task files written here.

Each run is checked against what does not go through the loop: the exported `W/transformers/` read back
by `bert_jax.formats.modernbert_hf` and applied by `ModernBertForTask` (the model
tests/model/test_modernbert.py checks against transformers' outputs) gives the loop's evaluation
(its loss recomputed in NumPy from those logits and the gold labels, and every metric); the sequence
head also by hand in NumPy on the encoder's hidden states; the exported config.json is one
transformers reads, naming the task class with the task's labels; with torch installed, transformers
itself predicts from it what the loop predicted.
"""

import csv
import json

import jax
import numpy as np
import pytest

from bert_jax.finetune import loop as finetune
from bert_jax.formats import modernbert_hf
from bert_jax.model.modernbert import ModernBertForTask, ModernBertModel
from configs import glue as glue_config
from configs import ner as ner_config
from configs import squad as squad_config
from configs import swag as swag_config
from tests.helpers import modernbert_fixture
from tests.helpers.finetune_inputs import ENTITIES, WORDS, read_json, sst2_files, tiny

pytestmark = pytest.mark.usefixtures("compilation_cache")  # tests/finetune/conftest.py

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS[:42]  # 47 ids < the fixture's 48


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    """The fixture's transformers ModernBERT folder and a WordPiece vocabulary within its ids."""
    root = tmp_path_factory.mktemp("modernbert")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    return {"dir": modernbert_fixture.checkpoint(str(root / "hf")), "vocab": str(vocab)}


def run(config, task, data, work, modernbert, **overrides):
    config = tiny(config, task, data, modernbert["dir"], model_family="modernbert", vocab_file=modernbert["vocab"],
                  **overrides)
    return finetune.run(config, str(work)), config


def check_learned(work, drop=0.05):
    """The training loss of the last epoch is below the first's (by `drop`), and so is the dev loss."""
    history = read_json(work / "eval_history.json")
    assert len(history) >= 2
    assert history[-1]["train_loss"] < history[0]["train_loss"] - drop, history
    if "loss" in history[0]:
        assert min(h["loss"] for h in history[1:]) < history[0]["loss"], history


def exported_outputs(work, config, task_name):
    """The dev split featurized as the task does, and the outputs `ModernBertForTask` gives on the
    exported checkpoint (unjitted, unsharded), shaped as the loop's."""
    from data_pipeline import tasks as tasks_lib

    mb_config, params, exported = modernbert_hf.load(str(work / "transformers"))
    task = finetune.make_task(config)
    split = tasks_lib.load_split(task, task.eval_splits[0], task.make_tokenizer(config.vocab_file, True),
                                 config.max_seq_length, training=False)
    f = split.features
    logits = np.asarray(ModernBertForTask(mb_config, exported["kind"], exported["num_outputs"]).apply(
        {"params": params}, f["input_ids"], f["input_mask"]))
    if exported["kind"] == "span":
        outputs = {"start_logits": logits[..., 0], "end_logits": logits[..., 1]}
    else:
        outputs = {"logits": logits[..., 0] if task.head == "regression" else logits}
    return task, split, outputs, (mb_config, params, exported)


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


def check_config_json(work, architecture, labels):
    transformers = pytest.importorskip("transformers")
    hf = transformers.ModernBertConfig.from_pretrained(str(work / "transformers"))
    assert hf.architectures == [architecture]
    assert hf.num_labels == len(labels)
    assert [hf.id2label[i] for i in range(hf.num_labels)] == labels
    return hf


def gelu(x):
    from scipy.special import erf
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def layer_norm(x, scale, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * scale


# ---------------------------------------------------------------------------------------------


def test_sequence_classification_packed_trains_exports_and_predicts_the_same(tmp_path, modernbert):
    """SST-2, rows packed several a row (configs/glue.py's default): the loss falls, the export gives
    the loop's dev loss and accuracy, the head equals a NumPy computation, config.json is transformers'."""
    work = tmp_path / "work"
    results, config = run(glue_config.get_config(), "sst2", sst2_files(tmp_path), work, modernbert,
                          num_train_epochs=3, learning_rate=3e-3)
    assert config.packing
    check_learned(work)
    task, split, outputs, (mb_config, params, _) = exported_outputs(work, config, "sst2")
    best = best_epoch(work)
    labels = split.features["label"]
    weight = split.features["weight"].astype(np.float64)
    loss = (cross_entropy(outputs["logits"], labels) * weight).sum() / weight.sum()
    assert best["loss"] == pytest.approx(loss, rel=1e-4)
    check_scores(task, split, outputs, best)
    # The head by hand: the [CLS] row of the encoder's hidden states, dense, GELU, norm, classifier.
    hidden = np.asarray(ModernBertModel(mb_config).apply({"params": params["model"]}, split.features["input_ids"],
                                                         split.features["input_mask"]), np.float64)
    x = hidden[:, 0] @ params["head"]["dense"]["kernel"]
    x = layer_norm(gelu(x), params["head"]["norm"]["scale"], mb_config.norm_eps)
    by_hand = x @ params["classifier"]["kernel"] + params["classifier"]["bias"]
    np.testing.assert_allclose(outputs["logits"], by_hand, rtol=1e-4, atol=1e-5)
    check_config_json(work, "ModernBertForSequenceClassification", [str(x) for x in task.labels])
    # transformers itself, where torch is installed.
    torch = pytest.importorskip("torch")
    import transformers
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(work / "transformers")).eval()
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(split.features["input_ids"], dtype=torch.long),
                       attention_mask=torch.tensor(split.features["input_mask"], dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, outputs["logits"], rtol=1e-4, atol=1e-4)
