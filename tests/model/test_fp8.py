"""FP8 training (`BertConfig.fp8`): the quantized matmul against a hand-computed one (ml_dtypes'
float8 and bfloat16 in numpy), the scaling state the train step carries (one amax per step, the
kernel's own largest value), and that state saved and restored exactly by a resumed pretraining run."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from bert_jax.model import layers, model_config, pretraining_heads
from bert_jax.training import train_state
from tests.helpers import fp8_training, pretraining_records, pretraining_runs

ROOT = Path(__file__).resolve().parents[2]
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def _reference_fp8_dense(x, kernel, bias, x_scale, k_scale):
    """y = dequant(q(x / sx) @ q(k / sk)) + b, every step in the dtype the recipe names: the
    division in bf16, the float8_e4m3fn cast (round to nearest even), the product of the
    float8 values accumulated exactly (float64) and rounded to bf16, scaled by sx * sk in bf16."""
    xs = (_bf16(x) / _bf16(x_scale)).astype(np.float32)
    ks = (_bf16(kernel) / _bf16(k_scale)).astype(np.float32)
    xq = np.clip(xs, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    kq = np.clip(ks, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    y = _bf16(xq @ kq)
    y = (y.astype(np.float32) * np.float32(_bf16(x_scale * k_scale))).astype(ml_dtypes.bfloat16)
    return (y.astype(np.float32) + _bf16(bias).astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)


def _fp8_state(x_amax: float, k_amax: float, history: int = 1024) -> dict:
    def hist(a):
        return jnp.zeros((history,), jnp.float32).at[0].set(a)
    return {"input_amax_history": hist(x_amax), "kernel_amax_history": hist(k_amax),
            "output_grad_amax_history": hist(1.0), "input_scale": jnp.ones((1,), jnp.float32),
            "kernel_scale": jnp.ones((1,), jnp.float32), "output_grad_scale": jnp.ones((1,), jnp.float32)}


def test_an_fp8_dense_layer_equals_the_hand_quantized_matmul_with_delayed_scales():
    cfg = model_config.BertConfig(hidden_size=32, num_attention_heads=4, dtype="bfloat16", fp8=True)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 3.0, (6, 32)).astype(np.float32)
    kernel = rng.normal(0, 0.05, (32, 16)).astype(np.float32)
    bias = rng.normal(0, 0.1, (16,)).astype(np.float32)
    layer = layers.Dense(cfg, (32,), (16,), ("embed", "mlp"))
    # Delayed scaling: the scales come from the history (the amax of earlier steps), not from x.
    x_amax, k_amax = 7.5, 0.2
    variables = {"params": {"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)},
                 layers.FP8_COLLECTION: {"fp8": _fp8_state(x_amax, k_amax)}}
    got = np.asarray(layer.apply(variables, jnp.asarray(x)), np.float32)
    want = _reference_fp8_dense(x, kernel, bias, x_amax / E4M3_MAX, k_amax / E4M3_MAX)
    np.testing.assert_allclose(got, want, rtol=1.6e-2, atol=1e-3)  # one bf16 ulp from rounding order
    # ... and the quantization is real: the same layer in plain bf16 is further away than that.
    plain = layers.Dense(cfg.replace(fp8=False), (32,), (16,), ("embed", "mlp"))
    exact = np.asarray(plain.apply({"params": variables["params"]}, jnp.asarray(x)), np.float32)
    assert np.max(np.abs(got - exact)) > 5 * np.max(np.abs(got - want))
    # Relative to the output's size, FP8's error stays within e4m3's 3-bit mantissa.
    assert np.max(np.abs(got - exact)) < 0.1 * np.max(np.abs(exact))


def _tiny(fp8: bool, **kw) -> model_config.BertConfig:
    return model_config.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, dtype="bfloat16", fp8=fp8, **kw)


def _fp8_leaves(tree: dict, name: str) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)
            if jax.tree_util.keystr(p).endswith(f"['{name}']")}


def _kernel_of(params: dict, fp8_path: str) -> np.ndarray:
    """The kernel(s) an FP8 op multiplies: `['bert']...['intermediate']['fp8']['kernel_amax_history']`
    -> params `...['intermediate']['kernel']`; the attention's query_fp8 / key_value_fp8 -> the
    query / key and value kernels."""
    keys = [k.strip("'") for k in fp8_path.strip("[]").split("][")][:-1]
    owner, op = keys[:-1], keys[-1]
    node = params
    for k in owner:
        node = node[k]
    if op == "fp8":
        return np.asarray(node["kernel"])
    names = {"query_fp8": ["query"], "key_value_fp8": ["key", "value"]}[op]
    return np.stack([np.asarray(node[n]["kernel"]) for n in names])


def test_the_train_step_carries_the_scaling_state_one_amax_per_step():
    state, step = fp8_training.state_and_step(_tiny(True))
    init_params = jax.tree.map(np.asarray, state.params)
    init_fp8 = jax.tree.map(np.asarray, state.fp8)
    batch = fp8_training.batch()
    state, metrics = step(state, batch)
    histories = _fp8_leaves(state.fp8, "kernel_amax_history")
    # Every dense layer of the encoder and the heads: 2 layers x (query, key/value, attention
    # output, intermediate, output) + the MLM transform, the pooler and the NSP classifier.
    assert len(histories) == 2 * 5 + 3
    for path, history in histories.items():
        # The first step's kernel amax is the largest |value| of the initial kernel, exactly.
        assert history[0] == np.max(np.abs(_kernel_of(init_params, path).astype(ml_dtypes.bfloat16)
                                            .astype(np.float32))), path
        assert np.count_nonzero(history) == 1, path
    for _ in range(2):
        state, metrics = step(state, batch)
    for path, history in _fp8_leaves(state.fp8, "input_amax_history").items():
        assert np.count_nonzero(history) == 3, path  # one entry per step, newest first
    histories = _fp8_leaves(state.fp8, "kernel_amax_history")
    for path, scale in _fp8_leaves(state.fp8, "kernel_scale").items():  # scale = amax / 448
        history = histories[path.replace("kernel_scale", "kernel_amax_history")]
        # The scale in the state is the one the last step used: from the two steps before it.
        np.testing.assert_allclose(scale[0], np.max(history[1:]) / E4M3_MAX, rtol=1e-6)
    # The state is part of the computation: the same parameters and batch with the initial
    # scales give another loss (so a resume that lost the state would not repeat the run).
    with_state = float(jax.jit(_loss, static_argnums=0)(_tiny(True), state.params, state.fp8, batch))
    with_initial = float(jax.jit(_loss, static_argnums=0)(_tiny(True), state.params, init_fp8, batch))
    assert with_state != with_initial
    assert np.isfinite(float(metrics["loss"]))


def _loss(cfg, params, fp8, batch):
    out = pretraining_heads.BertForPreTraining(cfg).apply(train_state.model_variables(params, fp8), **{
        k: batch[k] for k in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions")})
    return jnp.sum(out.mlm_logits)


def test_fp8_training_tracks_bf16_and_accumulation_advances_the_state_per_micro_batch():
    batch = fp8_training.batch(1)
    losses = {}
    for fp8 in (False, True):
        state, step = fp8_training.state_and_step(_tiny(fp8))
        losses[fp8] = []
        for _ in range(6):
            state, metrics = step(state, batch)
            losses[fp8].append(float(metrics["loss"]))
    assert losses[True] != losses[False]  # FP8 really runs
    # FP8's quantization error, measured on 2026-11-27 (CPU, the suite's XLA flags): the six losses
    # (6.04 falling to 5.06) differ by at most 5.9e-3, rel 1.1e-3; the bound is 3.5x that.
    np.testing.assert_allclose(losses[True], losses[False], rtol=4e-3)
    assert losses[True][-1] < losses[True][0] - 0.1  # and it learns
    state, step = fp8_training.state_and_step(_tiny(True), accum_steps=2)
    state, _ = step(state, batch)
    for path, history in _fp8_leaves(state.fp8, "input_amax_history").items():
        assert np.count_nonzero(history) == 2, path  # two micro-batches, two amax entries


def test_scanned_layers_stack_the_state_and_the_config_file_leaves_fp8_out(tmp_path):
    state, step = fp8_training.state_and_step(_tiny(True, scan_layers=True))
    state, _ = step(state, fp8_training.batch())
    layers = state.fp8["bert"]["encoder"]["layers"]
    assert layers["ffn"]["intermediate"]["fp8"]["kernel_amax_history"].shape == (2, 1024)
    cfg = _tiny(True)
    cfg.to_json_file(tmp_path / "bert_config.json")
    assert "fp8" not in json.loads((tmp_path / "bert_config.json").read_text())
    assert model_config.BertConfig.from_json_file(tmp_path / "bert_config.json") == cfg.replace(fp8=False)
    with pytest.raises(ValueError, match="fp8"):
        model_config.BertConfig(fp8="yes")


def test_a_resumed_fp8_run_repeats_the_uninterrupted_one_bit_for_bit(tmp_path, monkeypatch):
    pytest.importorskip("tensorflow")  # the records and the input pipeline

    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        pretraining_records.write_records(data / f"train-{i}.tfrecord", 64, seed=i)
    fp8 = ("--config.model.fp8=true", "--config.model.dtype=bfloat16")
    # The two runs share a compilation cache (as test_pretrain's runs do): the resume loads the step.
    monkeypatch.setitem(pretraining_runs.CACHE, "dir", str(tmp_path / "xla_cache"))
    ref = pretraining_runs.run(pretraining_runs.cmd(tmp_path / "ref", data, *fp8))
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = pretraining_runs.losses(tmp_path / "ref")
    assert sorted(want) == list(range(1, 13))
    # The same run interrupted after its step-4 checkpoint: the later checkpoints gone.
    shutil.copytree(tmp_path / "ref", tmp_path / "resumed")
    for later in ("8", "12"):
        shutil.rmtree(tmp_path / "resumed" / "checkpoints" / later)
    resumed = pretraining_runs.run(pretraining_runs.cmd(tmp_path / "resumed", data, *fp8))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stderr
    assert pretraining_runs.losses(tmp_path / "resumed") == want  # steps 5-12 again, the same floats
    assert "fp8" not in json.loads((tmp_path / "ref" / "bert_config.json").read_text())
    # Fine-tuning is not an FP8 path: said before anything runs.
    from bert_jax.finetune import loop as finetune
    from configs import glue
    config = glue.get_config()
    config.model.fp8 = True
    with pytest.raises(ValueError, match="config.model.fp8"):
        finetune.run(config, str(tmp_path / "ft"))
