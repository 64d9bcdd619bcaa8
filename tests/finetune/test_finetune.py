"""Fine-tuning end to end: SST-2 through the loop (training, evaluation, the best epoch, predictions,
resuming, a bucket), predict mode, the heads' shapes and losses; the other task families are
tests/finetune/test_finetune_tasks.py's, the plan of a run tests/finetune/test_finetune_plan.py's.

One tiny "pretrained" encoder (L=1, H=32) is saved with `bert_jax.convert` and every run loads it
through `config.init_checkpoint`, as a user would. Runs of the same head kind share shapes and
hyper-parameters, so XLA's persistent compilation cache (a temporary folder the fine-tuning modules
share, tests/finetune/conftest.py) compiles each kind once: the module takes about two minutes on
two CPU cores.
"""

import csv
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
from bert_jax.finetune import heads, loop as finetune
from configs import glue as glue_config
from tests.helpers.finetune_inputs import (SST2_TEST_IDS, glue_files, predict_config, read_json, sst2_files, tiny,
                                           tsv_rows)
from tests.helpers.finetune_reference import Reference, assert_argmax

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.usefixtures("compilation_cache")  # tests/finetune/conftest.py


# ---------------------------------------------------------------------------------------------
# GLUE
# ---------------------------------------------------------------------------------------------


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


def test_the_loop_starts_from_the_checkpoint_and_a_fresh_head(tmp_path, checkpoint):
    """At learning rate 0 nothing moves, so the saved state is the initial one: the encoder is the
    checkpoint's bit for bit, the head drawn as `config.head_init="normal"` says (transformers' way:
    a plain normal of stddev initializer_range, from the first half of the seed's key folded with 1;
    the bias zero). The loop compiles the head's initialization alone (the encoder's is dead code there)."""
    config = sst2_config(sst2_files(tmp_path), checkpoint)
    config.learning_rate, config.num_train_epochs, config.head_init = 0.0, 1, "normal"
    finetune.run(config, str(tmp_path / "work"))
    saved = convert.load_finetuned(str(tmp_path / "work"), "last")
    flat = lambda tree: {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}  # noqa: E731
    encoder = flat(saved.params["bert"])
    assert encoder.keys() == flat(checkpoint["params"]["bert"]).keys()
    for key, value in flat(checkpoint["params"]["bert"]).items():
        np.testing.assert_array_equal(encoder[key], value, err_msg=str(key))
    head = flat(saved.params["head"])
    hidden = checkpoint["config"].hidden_size
    assert head.keys() == {("output", "kernel"), ("output", "bias")}
    params_key = jax.random.split(jax.random.key(config.seed))[0]
    want = 0.02 * np.asarray(jax.random.normal(jax.random.fold_in(params_key, 1), (hidden, 2)))
    np.testing.assert_allclose(head[("output", "kernel")], want, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(head[("output", "bias")], np.zeros(2, np.float32))


def test_the_head_is_drawn_as_google_or_transformers_draw_it(checkpoint):
    """`truncated_normal` (the default) keeps flax's draw, cut at 2 stddev as Google's; `normal`
    replaces the kernel alone with a plain normal; anything else is refused, naming the flag."""
    model = heads.BertForTask(checkpoint["config"], "token", 512)
    dummy = heads.dummy_batch("token", 8)
    params = model.init(jax.random.key(3), *(dummy[k] for k in heads.MODEL_INPUTS))["params"]
    assert heads.draw_head(params, "truncated_normal", jax.random.key(4), 0.02) is params
    google = np.asarray(nn.meta.unbox(params["head"]["output"]["kernel"]))
    drawn = nn.meta.unbox(heads.draw_head(params, "normal", jax.random.key(4), 0.02))
    kernel = np.asarray(drawn["head"]["output"]["kernel"])
    assert kernel.shape == google.shape and not np.array_equal(kernel, google)
    # A normal's tails pass 2 stddev (~4.6% of the values); a truncated normal's never do.
    assert np.abs(google).max() <= 0.04 and (np.abs(kernel) > 0.04).mean() > 0.03
    assert abs(kernel.std() - 0.02) < 0.001 and abs(google.std() - 0.0176) < 0.001
    np.testing.assert_array_equal(drawn["head"]["output"]["bias"], nn.meta.unbox(params["head"]["output"]["bias"]))
    assert traverse_util.flatten_dict(drawn["bert"]).keys() == traverse_util.flatten_dict(params["bert"]).keys()
    for key, value in traverse_util.flatten_dict(nn.meta.unbox(params["bert"])).items():
        np.testing.assert_array_equal(traverse_util.flatten_dict(drawn["bert"])[key], value)
    with pytest.raises(ValueError, match=r"config.head_init='xavier'"):
        heads.draw_head(params, "xavier", jax.random.key(4), 0.02)


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
    from bert_jax.checkpoints.step_dirs import CheckpointRestoreError
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
    with pytest.raises(ValueError, match=message.replace(".", r"\.")) as refused:
        finetune.run(config, str(tmp_path / "work"))
    assert not (tmp_path / "work" / "checkpoints").exists()
    from bert_jax import exit_codes
    assert exit_codes.of(refused.value) == exit_codes.CONFIG  # raised before training: exit 78, not retried


def test_programs_compiled_ahead_change_nothing_but_when_they_compile(tmp_path, checkpoint):
    """`config.compile_ahead` (bert_jax/training/compile_ahead.py): the training step compiles on the
    background thread and every evaluation length ahead (there, or on the main thread while it waits
    for the training step), none again at its call; the run's results and predictions are those of
    a run that compiles each at its first call, to the bit. Trimming gives evaluation several
    lengths; jax's compile log names the thread, bert_jax's what it compiled ahead."""
    glue_files(tmp_path / "data" / "RTE", "rte", np.random.RandomState(7), n_train=16, n_dev=128)
    runs = {}
    for ahead in (True, False):
        work = tmp_path / f"work_{ahead}"
        cmd = [sys.executable, "-m", "bert_jax.main", "--config=configs/glue.py", "--config.task=rte",
               f"--config.data_dir={tmp_path / 'data'}", f"--config.init_checkpoint={checkpoint['bert_jax']}",
               f"--workdir={work}", "--config.max_seq_length=32", "--config.global_batch_size=8",
               "--config.num_train_epochs=2", "--config.learning_rate=1e-3", "--config.eval_batch_size=8",
               "--config.trim_padding_buckets=8", "--config.trim_padding_compile_cost=0",
               "--config.async_checkpointing=false", f"--config.compile_ahead={ahead}", "--config.compilation_cache="]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                              env=dict(os.environ, JAX_LOG_COMPILES="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        main_thread = re.search(r"^I\d+ [\d:.]+ (\d+) main\.py", proc.stderr, re.M)[1]
        compiled = re.findall(r"^\w\d+ [\d:.]+ (\d+) \S+\] Finished XLA compilation of jit\((train_step|eval_step)\)",
                              proc.stderr, re.M)
        runs[ahead] = dict(results=read_json(work / "eval_results.json"), history=read_json(work / "eval_history.json"),
                           predictions=(work / "RTE.tsv").read_text(), compiled=compiled, main=main_thread,
                           log=re.findall(r"compile ahead: (\d+) programs", proc.stderr),
                           ahead=re.findall(r"compiled ahead: (train|eval) in", proc.stderr))
        runs["plan"] = re.findall(r"batches cut to.*", proc.stderr)
    on, off = runs[True], runs[False]
    assert on["results"] == off["results"] and on["history"] == off["history"]
    assert on["predictions"] == off["predictions"]
    assert sorted(name for _, name in on["compiled"]) == sorted(name for _, name in off["compiled"])
    evaluation_lengths = [name for _, name in on["compiled"]].count("eval_step")
    assert evaluation_lengths >= 2, (on["compiled"], runs["plan"])
    assert [t for t, name in on["compiled"] if name == "train_step"] != [on["main"]], on["compiled"]
    assert sorted(on["ahead"]) == ["eval"] * evaluation_lengths + ["train"]  # each compile was one ahead
    assert all(thread == off["main"] for thread, _ in off["compiled"]) and off["ahead"] == []
    assert on["log"] == [str(1 + evaluation_lengths)] and off["log"] == []


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
