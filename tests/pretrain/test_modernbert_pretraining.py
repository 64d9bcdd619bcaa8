"""ModernBERT pretrained through BERT's loop (`config.model_family="modernbert"`, configs/modernbert_tiny.py):
the train step's loss against NumPy's cross-entropy of the model's own logits, the loss going down on a
repeated batch, a run resumed by `bert_jax.main` from a checkpoint ending with the uninterrupted run's
parameters, the export to transformers' format read back with the same logits, `mode=evaluate` of the
workdir and of the export equal to the run's own evaluation at that step, continued pretraining from the
export starting from exactly its parameters, the configs, and the settings ModernBERT refuses. Records are the tests' own (tests/helpers/pretraining_records.py)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from bert_jax.model.modernbert import ModernBertConfig, ModernBertForMaskedLM
from bert_jax.pretrain import loop, model_family, steps
from bert_jax.training import run_setup
from configs import modernbert_base, modernbert_tiny
from tests.helpers.pretraining_records import VOCAB, write_records
from tests.helpers.pretraining_runs import ROOT, env, losses

PREDS = 10  # configs/modernbert_tiny.py's max_predictions_per_seq (30% of 32 tokens)
STEPS = 8


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    d = tmp_path_factory.mktemp("mb_data")
    for i in range(2):
        write_records(d / f"train-{i}.tfrecord", 32, seed=i, PREDS=PREDS)
    write_records(d / "eval-0.tfrecord", 8, seed=9, PREDS=PREDS)
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                           + [f"w{i}" for i in range(VOCAB - 5)]) + "\n")
    return d


def overrides(d) -> dict:
    """What the runs set over configs/modernbert_tiny.py: packed rows, 30% dynamic masking, checkpoints at 4 and 8."""
    return {"train_data": f"{d}/train-*.tfrecord", "eval_data": f"{d}/eval-0.tfrecord", "vocab_file": f"{d}/vocab.txt",
            "verify_data": False, "packing": True, "num_train_steps": STEPS, "checkpoint_every_steps": 4,
            "log_every_steps": 1, "eval_every_steps": 4, "eval_steps": 1, "lr_decay_steps": 2}


def tiny_config(d, **more):
    config = modernbert_tiny.get_config()
    for k, v in dict(overrides(d), **more).items():
        setattr(config, k, v)
    return config


@pytest.fixture(scope="module")
def uninterrupted(records, tmp_path_factory):
    """configs/modernbert_tiny.py for 8 steps in this process (8 fake devices): its workdir."""
    work = tmp_path_factory.mktemp("mb_runs") / "ref"
    metrics = loop.run(tiny_config(records), str(work))
    assert np.isfinite(metrics["loss"]) and metrics["nsp_loss"] == 0.0
    return work


def saved_params(work, step: int) -> dict:
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as c:
        return jax.tree_util.tree_map(np.asarray, c.restore(str(work / "checkpoints" / str(step) / "state"))["params"])


# ---------------------------------------------------------------------------------------------
# The train step: its loss, and training
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(records):
    """The tiny model's state, optimizer and jitted train step (as the loop builds them), on one host."""
    config = tiny_config(records, learning_rate=3e-3, warmup_steps=1, lr_decay_steps=None)
    model_config = run_setup.model_config_from(config)
    model, tx, schedule, init_state = loop.build(config, model_config, mesh=None)
    state = init_state(jax.random.key(0))
    step = jax.jit(lambda s, b: steps.train_step(s, b, model=model, tx=tx, schedule=schedule, use_nsp=False))
    return model_config, state, step


def packed_batch(seed: int = 0) -> dict:
    """Two rows of 32: row 0 packs sequences of 13 and 15 tokens (then padding), row 1 one of 30; 6
    predictions each, the last of row 1 padding (weight 0)."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(5, VOCAB, size=(2, 32)).astype(np.int32)
    pack = np.zeros((2, 32), np.int32)
    pack[0, :13], pack[0, 13:28], pack[1, :30] = 1, 2, 1
    ids[pack == 0] = 0
    positions = np.zeros((2, 32), np.int32)
    positions[0, :13], positions[0, 13:28], positions[1, :30] = np.arange(13), np.arange(15), np.arange(30)
    masked = np.array([[1, 5, 11, 14, 20, 27], [2, 3, 9, 17, 29, 0]], np.int32)
    labels = np.take_along_axis(ids, masked, 1).copy()
    np.put_along_axis(ids, masked[:, :5], 4, 1)  # [MASK]
    weights = np.ones((2, 6), np.float32)
    weights[1, 5] = 0.0
    return {"input_ids": ids, "input_mask": (pack > 0).astype(np.int32), "segment_ids": np.zeros_like(ids),
            "pack_ids": pack, "position_ids": positions, "masked_lm_positions": masked, "masked_lm_ids": labels,
            "masked_lm_weights": weights, "next_sentence_labels": np.zeros((2, 3), np.int32),
            "next_sentence_weights": np.zeros((2, 3), np.float32), "cls_positions": np.zeros((2, 3), np.int32)}


def test_the_step_loss_is_numpys_cross_entropy_of_the_models_logits(compiled):
    model_config, state, step = compiled
    batch = packed_batch()
    # Weights far from the init's 0.02 (norm scales 1 + 0.3 N, the rest 0.2 N): packing changes the logits.
    leaves, tree = jax.tree_util.tree_flatten(state.params)
    rng = np.random.RandomState(0)
    state = state.replace(params=jax.tree_util.tree_unflatten(tree, [
        jnp.asarray(rng.standard_normal(x.shape), jnp.float32) * 0.2 + (x.mean() if x.mean() > 0.5 else 0.0)
        for x in leaves]))
    # Every position's logits from the model itself (no gather), then NumPy in float64.
    _, logits = ModernBertForMaskedLM(model_config).apply(
        {"params": state.params}, batch["input_ids"], batch["input_mask"], batch["pack_ids"], batch["position_ids"])
    logits = np.asarray(logits, np.float64)
    picked = np.take_along_axis(logits, batch["masked_lm_positions"][..., None], 1)  # [2, 6, vocab]
    log_probs = picked - picked.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, batch["masked_lm_ids"][..., None], -1)[..., 0]
    w = batch["masked_lm_weights"]
    want = (nll * w).sum() / (w.sum() + 1e-5)  # Google's normalization, as BERT's loss
    _, metrics = step(state, batch)
    assert abs(float(metrics["loss"]) - want) < 1e-5 * want
    assert float(metrics["mlm_weight"]) == 11.0 and float(metrics["nsp_weight"]) == 0.0
    correct = ((picked.argmax(-1) == batch["masked_lm_ids"]) * w).sum()
    assert float(metrics["mlm_correct"]) == correct


def test_the_loss_goes_down_on_a_repeated_batch(compiled):
    _, state, step = compiled
    batch = packed_batch(seed=1)
    seen = []
    for _ in range(10):
        state, metrics = step(state, batch)
        seen.append(float(metrics["loss"]))
    assert seen[-1] < seen[0] - 1.0, seen  # ~log(512) = 6.2 at the start


# ---------------------------------------------------------------------------------------------
# bert_jax.main: resume, export
# ---------------------------------------------------------------------------------------------


def test_main_resumed_from_step_4_ends_with_the_uninterrupted_parameters(records, uninterrupted, tmp_path):
    import subprocess
    import sys

    want = losses(uninterrupted)
    assert sorted(want) == list(range(1, STEPS + 1))
    work = tmp_path / "resumed"
    shutil.copytree(uninterrupted, work)
    for path in (work / "checkpoints" / str(STEPS), work / "checkpoints" / "input_state" / str(STEPS)):
        shutil.rmtree(path)  # as if the run had died between its step-4 and step-8 saves
    (work / "train_log.jsonl").write_text("".join(
        line + "\n" for line in (uninterrupted / "train_log.jsonl").read_text().splitlines()[:4]))
    args = [sys.executable, "-m", "bert_jax.main", f"--config={ROOT / 'configs/modernbert_tiny.py'}",
            f"--workdir={work}"] + [f"--config.{k}={v}" for k, v in overrides(records).items()]
    r = subprocess.run(args, env=env(devices=8), cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 4" in r.stderr
    assert losses(work) == want
    got, ref = saved_params(work, STEPS), saved_params(uninterrupted, STEPS)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, ref)


def test_on_a_bf16_cpu_auto_pretrains_in_the_mixed_form(records, uninterrupted, tmp_path, planted_cpu):
    """`config.cpu_bf16` reaches the loop's ModernBERT: on a planted CPU with avx512_bf16 where bf16 pays,
    "auto" records its decision in the workdir and trains with the mixed matmuls: its 8 steps end near the
    float32 run's loss and parameters, not at them."""
    from bert_jax import layout

    planted_cpu(["avx512_bf16"], 1.8)
    work = tmp_path / "auto"
    loop.run(tiny_config(records), str(work))
    got, want = saved_params(work, STEPS), saved_params(uninterrupted, STEPS)
    assert json.loads((work / layout.CPU_BF16).read_text())["mixed_matmuls"] is True
    leaves = jax.tree_util.tree_leaves
    diff = max(float(np.abs(a - b).max()) for a, b in zip(leaves(got), leaves(want)))
    assert 0 < diff < 2e-3, diff
    loss, float32_loss = losses(work)[STEPS], losses(uninterrupted)[STEPS]
    assert loss != float32_loss and abs(loss - float32_loss) < 1e-2 * float32_loss, (loss, float32_loss)


def test_on_a_bf16_cpu_off_pretrains_the_float32_parameters_to_the_bit(records, uninterrupted, tmp_path, planted_cpu):
    """`config.cpu_bf16="off"` on the same planted CPU: nothing decided, and the float32 run's parameters to
    the bit."""
    from bert_jax import layout

    planted_cpu(["avx512_bf16"], 1.8)
    work = tmp_path / "off"
    loop.run(tiny_config(records, cpu_bf16="off"), str(work))
    assert not (work / layout.CPU_BF16).exists()
    jax.tree_util.tree_map(np.testing.assert_array_equal, saved_params(work, STEPS), saved_params(uninterrupted, STEPS))


def test_the_hf_export_reads_back_with_the_trained_logits(uninterrupted, tmp_path):
    import transformers

    from bert_jax import convert
    from bert_jax.formats import modernbert_hf

    out = tmp_path / "hf"
    assert convert.main([f"--input={uninterrupted}", f"--output={out}", "--output_format=hf"]) == 0
    assert (out / "vocab.txt").read_text() == (uninterrupted / "vocab.txt").read_text()
    config, params, task = modernbert_hf.load(str(out))
    assert task is None and config == run_setup.model_config_from(modernbert_tiny.get_config())
    hf = transformers.ModernBertConfig(**json.loads((out / "config.json").read_text()))
    assert (hf.hidden_size, hf.num_hidden_layers, hf.local_attention, hf.global_attn_every_n_layers,
            hf.vocab_size, hf.intermediate_size) == (64, 2, 8, 2, VOCAB, 96)
    trained = saved_params(uninterrupted, STEPS)
    batch = packed_batch(seed=2)
    args = (batch["input_ids"], batch["input_mask"], batch["pack_ids"])
    _, want = ModernBertForMaskedLM(config).apply({"params": trained}, *args)
    _, got = ModernBertForMaskedLM(config).apply({"params": params}, *args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="--output_format=bert_jax: a ModernBERT workdir"):
        convert.main([f"--input={uninterrupted}", f"--output={tmp_path / 'x'}", "--output_format=bert_jax"])


# ---------------------------------------------------------------------------------------------
# A checkpoint read back: mode=evaluate, continued pretraining
# ---------------------------------------------------------------------------------------------


def logged_eval(work, step: int) -> dict:
    """The eval metrics the run wrote to TensorBoard at `step`."""
    out = {}
    for path in sorted(work.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for v in event.summary.value:
                value = tf.make_ndarray(v.tensor)
                if event.step == step and v.tag.startswith("eval/") and value.ndim == 0:
                    out[v.tag[len("eval/"):]] = float(value)
    return out


@pytest.fixture(scope="module")
def exported(uninterrupted, tmp_path_factory):
    """The run's step-8 checkpoint as transformers' ModernBertForMaskedLM folder."""
    from bert_jax import convert
    out = tmp_path_factory.mktemp("mb_export") / "hf"
    assert convert.main([f"--input={uninterrupted}", f"--output={out}", "--output_format=hf"]) == 0
    return out


def test_mode_evaluate_of_a_workdir_or_its_export_equals_the_runs_logged_eval(records, uninterrupted, exported,
                                                                              tmp_path):
    from bert_jax.pretrain import checkpoint_eval
    want = logged_eval(uninterrupted, STEPS)  # the run's evaluation of its step-8 parameters
    assert set(want) == {"masked_lm_loss", "masked_lm_accuracy", "next_sentence_loss", "next_sentence_accuracy"}
    for name, path in (("workdir", uninterrupted), ("hf", exported)):
        got = checkpoint_eval.evaluate(tiny_config(records, mode="evaluate", init_checkpoint=str(path)),
                                       str(tmp_path / name))
        assert got == pytest.approx(want, rel=2e-7, abs=1e-9), name  # TensorBoard keeps float32: half an ulp
        assert json.loads((tmp_path / name / "eval_results.json").read_text()) == got


def test_continued_pretraining_starts_from_exactly_the_checkpoints_parameters(records, exported, tmp_path):
    from bert_jax.formats import modernbert_hf
    work = tmp_path / "continued"
    # Learning rate 0: the step-1 checkpoint holds the parameters the run started from.
    loop.run(tiny_config(records, init_checkpoint=str(exported), learning_rate=0.0, num_train_steps=1,
                         warmup_steps=0, lr_decay_steps=1, checkpoint_every_steps=1, eval_every_steps=0), str(work))
    _, want, _ = modernbert_hf.load(str(exported))
    jax.tree_util.tree_map(np.testing.assert_array_equal, saved_params(work, 1), want)


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_key(records, exported, tmp_path):
    config = tiny_config(records, init_checkpoint=str(exported))
    config.model.intermediate_size = 128
    with pytest.raises(ValueError, match=rf"config.model.intermediate_size=128, but the init checkpoint {exported} "
                                         "has intermediate_size=96"):
        loop.run(config, str(tmp_path / "w"))


def test_a_fine_tuning_workdir_as_init_checkpoint_is_refused_by_name(exported, tmp_path):
    """A ModernBERT fine-tuning workdir also holds modernbert_config.json; its task.json names it."""
    work = tmp_path / "sst2"
    shutil.copytree(exported, work)
    (work / "modernbert_config.json").write_text((exported / "config.json").read_text())
    (work / "task.json").write_text(json.dumps({"task": "sst2", "model_family": "modernbert"}))
    with pytest.raises(ValueError, match=rf"init_checkpoint={work} is a ModernBERT fine-tuning workdir"):
        model_family.load_modernbert(str(work))


# ---------------------------------------------------------------------------------------------
# Configs and refusals
# ---------------------------------------------------------------------------------------------


def test_the_configs_are_modernbert_base_and_a_tiny_one_with_a_window_shorter_than_its_rows():
    base = modernbert_base.get_config()
    assert run_setup.model_config_from(base) == ModernBertConfig()  # transformers' ModernBERT-base defaults
    assert (base.use_nsp, base.masked_lm_prob, base.dynamic_masking, base.packing, base.max_seq_length,
            base.lr_decay_shape, base.optimizer) == (False, 0.3, True, True, 1024, "1-sqrt", "adamw")
    phases = modernbert_base.context_extension("a", "b")
    assert [p["max_seq_length"] for p in phases] == [1024, 8192]
    tiny = run_setup.model_config_from(modernbert_tiny.get_config())
    assert [tiny.is_global(i) for i in range(tiny.num_hidden_layers)] == [True, False]
    assert tiny.local_attention < modernbert_tiny.get_config().max_seq_length


def test_modernbert_base_flops_count_by_hand():
    c = ModernBertConfig()
    h, i, v, t = 768, 1152, 50368, 1024
    dense = 2 * t * (4 * h * h + 3 * h * i)  # Wqkv + Wo, Wi (2I) + Wo
    attention = {True: 4 * t * t * h, False: 4 * t * 129 * h}  # a band of 64 each side
    layers = sum(dense + attention[layer % 3 == 0] for layer in range(22))
    want = 3 * (layers + 2 * 307 * (h * h + h * v))
    assert model_family.train_flops_per_sequence(c, 1024, 307) == want


@pytest.mark.parametrize("key,value,match", [
    ("use_nsp", True, "config.use_nsp=True: ModernBERT pretrains with masked LM only"),
    ("objective", "ltr", "config.objective='ltr'"),
    ("masked_lm_prob", 1.5, r"config.masked_lm_prob=1.5 must be in \(0, 1\)"),
])
def test_what_modernbert_cannot_do_is_refused_before_training(records, tmp_path, key, value, match):
    from bert_jax import exit_codes
    with pytest.raises(ValueError, match=match) as e:
        loop.run(tiny_config(records, **{key: value}), str(tmp_path / "w"))
    assert exit_codes.of(e.value) == exit_codes.CONFIG


def test_a_bert_only_model_key_is_refused_naming_it(records):
    config = tiny_config(records)
    config.model.fp8 = False
    with pytest.raises(ValueError, match=r"config.model.fp8 .*not a field of ModernBertConfig"):
        run_setup.model_config_from(config)
    config = tiny_config(records, model_family="gpt")
    with pytest.raises(ValueError, match="config.model_family='gpt'"):
        run_setup.model_config_from(config)


@pytest.mark.parametrize("prob", [0.15, 0.3])
def test_config_masked_lm_prob_is_the_share_dynamic_masking_predicts(records, prob):
    from bert_jax.pretrain import feed
    from bert_jax.pretrain.phases import resolve_phases
    from bert_jax.pretrain.startup_checks import special_token_ids
    config = tiny_config(records, packing=False, masked_lm_prob=prob)
    batch = next(feed.make_train_input(config, resolve_phases(config)[0], special_token_ids(config.vocab_file)))
    real = batch["input_mask"].sum(1)  # [CLS] ... [SEP]: every row has more candidates than predictions
    want = np.minimum(PREDS, np.maximum(1, np.round(real * prob)))  # Google's count, by hand
    np.testing.assert_array_equal(batch["masked_lm_weights"].sum(1), want)
