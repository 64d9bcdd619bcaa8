"""Which `config.model` keys apply on top of an init checkpoint (`run_setup.bert_config_from`, used
by pretraining, evaluation and fine-tuning): the run's compute options always, a training setting
when it is given on the command line, an architecture key never (a different value given is
refused, naming the key). The checkpoint here is a HuggingFace folder whose values all differ from
the config file's defaults, so that each key shows where its value came from."""

import dataclasses
import json

import pytest

from bert_jax import config_overrides
from bert_jax.model.model_config import BertConfig
from bert_jax.training import run_setup
from configs import glue

CHECKPOINT = {  # HF's config.json of a small BERT; every value unlike configs/glue.py's model
    "model_type": "bert", "vocab_size": 99, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
    "intermediate_size": 80, "hidden_act": "gelu_new", "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.05, "max_position_embeddings": 40, "type_vocab_size": 3,
    "initializer_range": 0.05, "layer_norm_eps": 1e-7,
}
# A value for each key that differs from both the checkpoint's and the config file's.
OTHER = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
         "intermediate_size": 96, "hidden_act": "relu", "max_position_embeddings": 64, "type_vocab_size": 4,
         "layer_norm_eps": 1e-5, "hidden_dropout_prob": 0.3, "attention_probs_dropout_prob": 0.25,
         "causal_attention": True, "initializer_range": 0.01, "dtype": "bfloat16", "param_dtype": "bfloat16",
         "scan_layers": True, "remat_policy": "full", "attention_impl": "dot_product", "vocab_pad_multiple": 64,
         "sparse_last_layer": False, "fp8": True, "fused_ops": True, "fused_ffn": True, "mixed_matmuls": True,
         "separate_qkv": True, "fused_qkv": True}


@pytest.fixture
def config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CHECKPOINT))
    (tmp_path / "model.safetensors").write_bytes(b"")  # the config is all that is read
    c = glue.get_config()
    c.init_checkpoint = str(tmp_path)
    return c


def test_every_field_is_in_exactly_one_group():
    groups = (run_setup.RUN_KEYS, run_setup.SETTING_KEYS, run_setup.ARCHITECTURE_KEYS)
    names = [k for g in groups for k in g]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(BertConfig))
    assert set(OTHER) == set(names)


def test_without_flags_the_checkpoint_gives_architecture_and_settings(config):
    # (mixed_matmuls, a float32 model's option, cannot go with OTHER's bfloat16 and fp8: applied alone below)
    run_keys = [k for k in run_setup.RUN_KEYS if k != "mixed_matmuls"]
    for key in run_keys:
        config.model[key] = OTHER[key]
    got = run_setup.bert_config_from(config, given=())
    for key in run_setup.ARCHITECTURE_KEYS + run_setup.SETTING_KEYS:
        want = {"hidden_act": "gelu_tanh", "causal_attention": False}.get(key, CHECKPOINT.get(key))
        assert getattr(got, key) == want, key
    for key in run_keys:  # the config's, whether given or not: no checkpoint names them
        assert getattr(got, key) == OTHER[key], key


@pytest.mark.parametrize("key", run_setup.SETTING_KEYS + run_setup.RUN_KEYS)
def test_a_given_setting_applies(config, key):
    config.model[key] = OTHER[key]
    assert getattr(run_setup.bert_config_from(config, given=[f"config.model.{key}"]), key) == OTHER[key]


@pytest.mark.parametrize("key", run_setup.ARCHITECTURE_KEYS)
def test_a_given_architecture_key_must_match_the_checkpoint(config, key):
    config.model[key] = OTHER[key]
    with pytest.raises(ValueError, match=rf"--config\.model\.{key}=.*the init checkpoint .* has {key}="):
        run_setup.bert_config_from(config, given=[f"config.model.{key}"])
    # The checkpoint's own value given is no conflict.
    config.model[key] = {"hidden_act": "gelu_tanh"}.get(key, CHECKPOINT.get(key))
    assert getattr(run_setup.bert_config_from(config, given=[f"config.model.{key}"]), key) == config.model[key]


def test_the_command_line_decides_what_is_given(config):
    config.model.attention_probs_dropout_prob = 0.0  # what fast attention needs (the checkpoint: 0.05)
    config.model.hidden_dropout_prob = 0.2
    config.model.hidden_size = 768  # the config file's default, not given: the checkpoint's 48 wins
    config_overrides.record_command_line(["main.py", "--config=configs/glue.py", "--workdir=/tmp/w",
                                          "--config.model.hidden_dropout_prob=0.2",
                                          "--config.model.attention_probs_dropout_prob=0"])
    try:
        got = run_setup.bert_config_from(config)
    finally:
        config_overrides.record_command_line([])
    assert (got.hidden_dropout_prob, got.attention_probs_dropout_prob, got.hidden_size) == (0.2, 0.0, 48)


def test_prng_impl_is_checked_and_set():
    import jax
    import ml_collections

    with pytest.raises(ValueError, match=r"config\.prng_impl must be one of .*'rbg'.*got 'philox'"):
        run_setup.use_prng_impl(ml_collections.ConfigDict({"prng_impl": "philox"}))
    run_setup.use_prng_impl(ml_collections.ConfigDict({"prng_impl": "threefry2x32"}))
    assert jax.config.jax_default_prng_impl == "threefry2x32"
    assert glue.get_config().prng_impl == "threefry2x32"


def test_only_multi_process_cpu_runs_wait_for_every_step():
    """The per-step wait is gloo's CPU deadlock workaround; on TPU and GPU it would stop the host
    from dispatching ahead of the device."""
    from bert_jax.pretrain.loop import blocks_every_step
    assert blocks_every_step("cpu", 2) and blocks_every_step("cpu", 4)
    assert not blocks_every_step("cpu", 1)
    assert not any(blocks_every_step(backend, n) for backend in ("tpu", "gpu") for n in (1, 2, 64))
