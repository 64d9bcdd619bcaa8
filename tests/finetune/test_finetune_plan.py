"""The plan of a fine-tuning run (`bert_jax.finetune.batches`, `bert_jax.training.optim`): its steps
counted as Google's scripts count them, the stream of full batches, Google's AdamW and learning
rates, and batches cut short of their padding that train and predict as the full padding does.

The tiny "pretrained" encoder and the compilation cache folder are tests/finetune/conftest.py's (shared
with test_finetune.py), the helpers tests/helpers/finetune_inputs.py's.
"""

import jax
import numpy as np
import pytest

from bert_jax import convert
from bert_jax.finetune import batches as finetune_batches, bucketing, loop as finetune, preparation
from bert_jax.finetune import steps as finetune_steps
from bert_jax.formats.google import to_google
from configs import glue as glue_config
from configs import ner as ner_config
from tests.helpers.finetune_inputs import ENTITIES, WORDS, read_json, sentiment, tiny

pytestmark = pytest.mark.usefixtures("compilation_cache")  # tests/finetune/conftest.py


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
    assert preparation.count_examples(split) == 3


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
    schedule, tx = preparation.make_optimizer(config, 7, 2)
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
    want = adam_weight_decay_reference(to_google(params, cfg),
                                       [to_google(g, cfg) for g in grads], lrs)
    got = to_google(p, cfg)
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
