"""Exporting a fine-tuned model: the encoder plus its task head, from a fine-tuning workdir.

Each head kind is built with `bert_jax.finetune.heads.BertForTask` (random weights, head bias made non-zero),
saved as `bert_jax.finetune.loop` saves it (`best/<step>/state`, `checkpoints/<step>/state`, `task.json`),
converted with the CLI, and loaded by transformers' Flax task classes, the reference for the HF
side: their logits must be ours. Google's names are read back with TensorFlow's checkpoint reader.
"""

import json
import logging
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bert_jax import convert
from bert_jax.checkpoints import checkpointer
from bert_jax.finetune import heads
from bert_jax.formats.common import tokenizer_config_json, unrolled
from bert_jax.model import modeling
from bert_jax.model.model_config import BertConfig
from bert_jax.training import train_state

transformers = pytest.importorskip("transformers")

CFG = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=32)
LENGTH = 12
# kind -> (num_outputs, labels as task.json holds them, transformers' Flax auto class)
KINDS = {
    "classification": (3, ["negative", "neutral", "positive"], "FlaxAutoModelForSequenceClassification"),
    "regression": (1, [], "FlaxAutoModelForSequenceClassification"),
    "token": (5, ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"], "FlaxAutoModelForTokenClassification"),
    "span": (2, [], "FlaxAutoModelForQuestionAnswering"),
    "multiple_choice": (2, [], "FlaxAutoModelForMultipleChoice"),
}


def task_json(kind):
    n, labels, _ = KINDS[kind]
    return {"task": f"my_{kind}", "head": kind, "num_outputs": n, "labels": labels, "max_seq_length": LENGTH}


def task_params(kind, seed):
    """`BertForTask` parameters, random, with a head bias far from zero (a zero head would show)."""
    params = heads.BertForTask(CFG, kind, KINDS[kind][0]).init(jax.random.key(seed), *inputs(kind))["params"]
    params = nn.meta.unbox(params)
    bias = params["head"]["output"]["bias"]
    params["head"]["output"]["bias"] = jnp.asarray(np.random.default_rng(seed).normal(size=bias.shape), bias.dtype)
    return params


def write_workdir(root, kind, *, best=None, last=None, config=CFG):
    """A fine-tuning workdir as `bert_jax.finetune.loop` leaves it: the best epoch's `{"params": ...}` in
    best/, the last TrainState in checkpoints/ (either may be absent), the model files, task.json."""
    os.makedirs(root)
    config.to_json_file(str(root / "bert_config.json"))
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                              + [f"w{i}" for i in range(CFG.vocab_size - 5)]) + "\n")
    (root / "tokenizer_config.json").write_text(tokenizer_config_json(True))
    (root / "task.json").write_text(json.dumps(task_json(kind)))
    if best is not None:
        with checkpointer.Checkpointer(str(root / "best"), save_interval_steps=1, max_to_keep=1,
                                        async_save=False, handle_sigterm=False) as ckpt:
            ckpt.save(6, {"params": best}, {"epoch": 2, "results": {}}, force=True)
    if last is not None:
        state = train_state.create_train_state(last, optax.adamw(1e-3), jax.random.key(1))
        with checkpointer.Checkpointer(str(root / "checkpoints"), save_interval_steps=1, max_to_keep=1,
                                        handle_sigterm=False) as ckpt:
            ckpt.save(9, state, {"history": [], "best": None}, force=True)
    return str(root)


def inputs(kind, seed=0):
    """Random ids, a padded second row, both segments: [2, length], or for multiple_choice one
    question with two choices [1, 2, length] (the same [2, length] rows inside: the model runs the
    same shapes for every kind, so JAX compiles each operation once for the whole module)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, CFG.vocab_size, size=(2, LENGTH)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 8:] = 0
    ids[1, 8:] = 0
    seg = np.zeros_like(ids)
    seg[0, 6:], seg[1, 5:8] = 1, 1
    if kind == "multiple_choice":
        assert KINDS[kind][0] == 2
        return ids[None], mask[None], seg[None]
    return ids, mask, seg


def ours(kind, params, ids, mask, seg):
    out = heads.BertForTask(CFG, kind, KINDS[kind][0]).apply({"params": params}, ids, mask, seg, deterministic=True)
    return {k: np.asarray(v) for k, v in out.items()}


def flat(tree):
    return {"/".join(str(k.key) for k in path): np.asarray(x)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_trees_equal(got, want):
    got, want = flat(got), flat(unrolled(want))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def cli(capsys, *argv):
    assert convert.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def load_transformers(cls_name, directory, caplog):
    caplog.clear()
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING, logger="transformers"):
            model = getattr(transformers, cls_name).from_pretrained(directory)
    finally:
        transformers.logging.disable_propagation()
    return model, caplog.text


# ---------------------------------------------------------------------------------------------
# HuggingFace
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_hf_export_of_each_head_gives_transformers_our_logits(kind, tmp_path, capsys, caplog):
    params = task_params(kind, seed=1)
    work = write_workdir(tmp_path / "work", kind, best=params)
    out = str(tmp_path / "hf")
    summary = cli(capsys, "--input", work, "--output", out, "--output_format", "hf")
    assert summary["task_head"] == kind and summary["finetuned"] == "best"
    assert summary["task"]["labels"] == KINDS[kind][1] and summary["skipped"] == []
    assert summary["heads"] == [] and summary["missing_heads"] == ["mlm", "nsp"]

    hf_config = json.load(open(os.path.join(out, "config.json")))
    n, labels, cls_name = KINDS[kind]
    arch = {"classification": "BertForSequenceClassification", "regression": "BertForSequenceClassification",
            "token": "BertForTokenClassification", "span": "BertForQuestionAnswering",
            "multiple_choice": "BertForMultipleChoice"}[kind]
    assert hf_config["architectures"] == [arch] and hf_config["finetuning_task"] == f"my_{kind}"
    want_labels = labels or [f"LABEL_{i}" for i in range(n)]
    assert hf_config["id2label"] == {str(i): x for i, x in enumerate(want_labels)}
    assert hf_config["label2id"] == {x: i for i, x in enumerate(want_labels)}
    assert hf_config.get("problem_type") == {"classification": "single_label_classification",
                                             "regression": "regression"}.get(kind)

    model, log = load_transformers(cls_name, out, caplog)
    assert "newly initialized" not in log, log  # every weight of the task class came from the file
    assert type(model).__name__ == "Flax" + arch and model.config.num_labels == n
    if kind in ("classification", "token"):
        assert model.config.id2label == dict(enumerate(labels))
    ids, mask, seg = inputs(kind)
    mine = ours(kind, params, ids, mask, seg)
    theirs = model(ids, attention_mask=mask, token_type_ids=seg)
    if kind == "span":
        real = mask.astype(bool)
        np.testing.assert_allclose(np.asarray(theirs.start_logits)[real], mine["start_logits"][real], atol=1e-5)
        np.testing.assert_allclose(np.asarray(theirs.end_logits)[real], mine["end_logits"][real], atol=1e-5)
        # Start and end differ (a swapped export would fail the two lines above).
        assert np.abs(mine["start_logits"] - mine["end_logits"])[real].min() > 1e-3
        logits = mine["start_logits"]
    else:
        theirs = np.asarray(theirs.logits)
        if kind == "regression":
            assert theirs.shape == (2, 1)
            theirs = theirs[:, 0]
        real = mask.astype(bool) if kind == "token" else slice(None)
        np.testing.assert_allclose(theirs[real], mine["logits"][real], atol=1e-5)
        logits = mine["logits"]
    assert np.abs(logits).min() > 1e-3  # no head of zeros would pass the comparison above

    # HF -> bert_jax: the same parameters and the same task back.
    back = convert.load_pretrained(out)
    assert back.format == "hf" and back.task_head == kind and back.skipped == ()
    assert {k: back.task[k] for k in ("task", "head", "num_outputs", "labels")} == {
        k: task_json(kind)[k] for k in ("task", "head", "num_outputs", "labels")}
    assert_trees_equal(back.params, params)


def test_bert_jax_export_round_trips_the_head_and_task(tmp_path, capsys):
    params = task_params("token", seed=2)
    work = write_workdir(tmp_path / "work", "token", best=params)
    out = str(tmp_path / "export")
    cli(capsys, "--input", work, "--output", out, "--output_format", "bert_jax")
    assert json.load(open(os.path.join(out, "task.json"))) == task_json("token")
    back = convert.load_pretrained(out)
    assert back.task == task_json("token") and back.finetuned is None
    assert_trees_equal(back.params, params)
    # model_params is what BertForTask applies.
    ids, mask, seg = inputs("token")
    np.testing.assert_array_equal(ours("token", convert.model_params(back), ids, mask, seg)["logits"],
                                  ours("token", params, ids, mask, seg)["logits"])
    with pytest.raises(ValueError, match="export"):
        convert.load_pretrained(out, finetuned="last")
    # --drop_heads drops the fine-tuning head too: an encoder, and no task.json.
    enc = str(tmp_path / "enc")
    summary = cli(capsys, "--input", out, "--output", enc, "--output_format", "hf", "--drop_heads")
    assert summary["task_head"] is None and summary["task"] is None
    assert json.load(open(os.path.join(enc, "config.json")))["architectures"] == ["BertModel"]
    assert convert.load_pretrained(enc).task is None


def test_finetuned_best_or_last(tmp_path, capsys):
    """Default: the best epoch (best/); finetuned='last' (--finetuned=last) the last state; a workdir
    with only checkpoints/ (here with scanned layers) reads its last state by default."""
    best, last = task_params("classification", seed=3), task_params("classification", seed=4)
    work = write_workdir(tmp_path / "work", "classification", best=best, last=last)
    p = convert.load_pretrained(work)
    assert p.finetuned == "best" and p.task_head == "classification"
    assert_trees_equal(p.params, best)
    p = convert.load_pretrained(work, finetuned="last")
    assert p.finetuned == "last"
    assert_trees_equal(p.params, last)
    # What a predict mode calls: the same two choices, the task with them.
    for which, want in (("best", best), ("last", last)):
        p = convert.load_finetuned(work, which=which)
        assert p.finetuned == which and p.task == task_json("classification")
        assert_trees_equal(convert.model_params(p), want)
    assert not np.allclose(p.params["head"]["output"]["bias"], best["head"]["output"]["bias"])
    summary = cli(capsys, "--input", work, "--output", str(tmp_path / "hf_last"), "--output_format", "hf",
                  "--finetuned", "last")
    assert summary["finetuned"] == "last"
    assert_trees_equal(convert.load_pretrained(str(tmp_path / "hf_last")).params, last)

    only_last = task_params("span", seed=5)
    scanned = CFG.replace(scan_layers=True)
    work2 = write_workdir(tmp_path / "work2", "span", last=modeling.stack_layers(only_last, CFG.num_hidden_layers),
                          config=scanned)
    p = convert.load_pretrained(work2)
    assert p.finetuned == "last" and p.task_head == "span"
    assert "layers" not in p.params["bert"]["encoder"]  # unrolled, as every format holds them
    assert_trees_equal(p.params, only_last)
    with pytest.raises(FileNotFoundError, match="finetuned='last'"):
        convert.load_pretrained(work2, finetuned="best")
    with pytest.raises(FileNotFoundError, match="finetuned='last'"):
        convert.load_finetuned(work2)
    assert convert.load_finetuned(work2, which="last").task_head == "span"


def test_head_shape_and_task_are_checked(tmp_path):
    params = task_params("classification", seed=6)
    work = write_workdir(tmp_path / "work", "classification", best=params)
    with open(os.path.join(work, "task.json"), "w") as f:
        json.dump({**task_json("classification"), "num_outputs": 4, "labels": []}, f)
    with pytest.raises(ValueError, match=r"head/output/kernel has shape \(32, 3\)"):
        convert.load_pretrained(work)
    with open(os.path.join(work, "task.json"), "w") as f:
        json.dump({**task_json("classification"), "head": "ranking"}, f)
    with pytest.raises(ValueError, match="'ranking' is not one of"):
        convert.load_pretrained(work)
    # A head nothing describes is not exported under a guessed name.
    os.remove(os.path.join(work, "task.json"))
    p = convert.load_pretrained(work)
    assert p.task is None and "head" in p.skipped and "head" not in p.params
    with pytest.raises(ValueError, match="not a fine-tuned model"):
        convert.load_finetuned(work)
    with pytest.raises(ValueError, match="no task says what it is"):
        convert.save_hf(convert.Pretrained(CFG, unrolled(params)), str(tmp_path / "x"))


# ---------------------------------------------------------------------------------------------
# Google
# ---------------------------------------------------------------------------------------------


def test_google_export_names_of_the_heads(tmp_path, capsys):
    tf = pytest.importorskip("tensorflow")
    for kind, prefix in (("classification", "output"), ("span", "cls/squad/output")):
        params = task_params(kind, seed=7)
        work = write_workdir(tmp_path / f"work_{kind}", kind, best=params)
        out = str(tmp_path / f"google_{kind}")
        cli(capsys, "--input", work, "--output", out, "--output_format", "google")
        reader = tf.train.load_checkpoint(os.path.join(out, "bert_model.ckpt"))
        shapes = reader.get_variable_to_shape_map()
        width = KINDS[kind][0]
        assert shapes[f"{prefix}_weights"] == [width, CFG.hidden_size] and shapes[f"{prefix}_bias"] == [width]
        head = params["head"]["output"]
        np.testing.assert_array_equal(reader.get_tensor(f"{prefix}_weights"), np.asarray(head["kernel"]).T)
        np.testing.assert_array_equal(reader.get_tensor(f"{prefix}_bias"), np.asarray(head["bias"]))
        assert not [n for n in shapes if n.startswith("cls/predictions") or n.startswith("cls/seq_relationship")]
        back = convert.load_pretrained(out)  # task.json beside it says what the head is
        assert back.format == "google" and back.task_head == kind and back.skipped == ()
        assert_trees_equal(back.params, params)
    params = task_params("multiple_choice", seed=8)
    work = write_workdir(tmp_path / "work_mc", "multiple_choice", best=params)
    with pytest.raises(ValueError, match="multiple_choice head has no name in Google's format.*--output_format=hf"):
        convert.main(["--input", work, "--output", str(tmp_path / "g_mc"), "--output_format", "google"])
    assert not os.path.exists(tmp_path / "g_mc")
    summary = cli(capsys, "--input", work, "--output", str(tmp_path / "g_mc"), "--output_format", "google",
                  "--drop_heads")
    assert summary["task_head"] is None
