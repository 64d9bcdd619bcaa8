"""The BERT model: parameter counts, parity with HF's Flax BERT, initialization, bf16 compute,
padding, packing, causal attention, dropout, GELU and config files. The options that must not change
outputs (scan, remat, the attention implementations, sparse_last_layer, separate_qkv) are in
test_modeling_options.py."""

import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.model import attention, dropout, layers, modeling
from bert_jax.model.model_config import BertConfig
from bert_jax.model.modeling import BertModel
from bert_jax.model.pretraining_heads import BertForPreTraining
from tests.helpers.tiny_bert import batch, ours, random_params, tiny_config

transformers = pytest.importorskip("transformers")  # a [test] extra: present in CI


# --- an independent mapping into HuggingFace's FlaxBertForPreTraining layout ---


def to_hf(params, config):
    H = config.hidden_size
    b = params["bert"]
    dense = lambda d: {"kernel": np.asarray(d["kernel"]), "bias": np.asarray(d["bias"])}
    ln = lambda d: {"scale": np.asarray(d["scale"]), "bias": np.asarray(d["bias"])}
    layers = {}
    for i in range(config.num_hidden_layers):
        p = b["encoder"][f"layer_{i}"]
        att = p["attention"]
        qkv = {n: {"kernel": np.asarray(att[n]["kernel"]).reshape(H, H),
                   "bias": np.asarray(att[n]["bias"]).reshape(H)} for n in ("query", "key", "value")}
        layers[str(i)] = {
            "attention": {"self": qkv,
                          "output": {"dense": {"kernel": np.asarray(att["output"]["kernel"]).reshape(H, H),
                                               "bias": np.asarray(att["output"]["bias"])},
                                     "LayerNorm": ln(att["output_norm"])}},
            "intermediate": {"dense": dense(p["ffn"]["intermediate"])},
            "output": {"dense": dense(p["ffn"]["output"]), "LayerNorm": ln(p["ffn"]["output_norm"])},
        }
    e = b["embeddings"]
    return {
        "bert": {
            "embeddings": {"word_embeddings": {"embedding": np.asarray(e["word_embeddings"])},
                           "position_embeddings": {"embedding": np.asarray(e["position_embeddings"])},
                           "token_type_embeddings": {"embedding": np.asarray(e["token_type_embeddings"])},
                           "LayerNorm": ln(e["LayerNorm"])},
            "encoder": {"layer": layers},
            "pooler": {"dense": dense(b["pooler"]["dense"])},
        },
        "cls": {
            "predictions": {"transform": {"dense": dense(params["mlm"]["transform"]),
                                          "LayerNorm": ln(params["mlm"]["transform_norm"])},
                            "bias": np.asarray(params["mlm"]["output_bias"])},
            "seq_relationship": dense(params["nsp"]["dense"]),
        },
    }


def hf_model(config):
    hf_config = transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
        layer_norm_eps=config.layer_norm_eps)
    return transformers.FlaxBertForPreTraining(hf_config, seed=0, _do_init=False)


def sequence(config, params, inputs):
    """The last layer at every position (`BertModel`; the pretraining model computes fewer)."""
    return BertModel(config).apply({"params": params["bert"]}, inputs["input_ids"], inputs["input_mask"],
                                   inputs["segment_ids"]).sequence_output


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,pretraining,expected", [
    (dict(), True, 110_106_428),
    (dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
     True, 336_226_108),
    (dict(), False, 109_482_240),
    (dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
     False, 335_141_888),
])
@pytest.mark.parametrize("scan", [False, True])
def test_published_parameter_counts(shape, pretraining, expected, scan):
    config = BertConfig(scan_layers=scan, **shape)  # vocab 30522, 512 positions, 2 token types
    assert config.padded_vocab_size == 30592  # the decoder pads, the parameters do not
    if pretraining:
        init = lambda r: BertForPreTraining(config).init(r, **modeling.dummy_inputs(config))
    else:
        init = lambda r: BertModel(config).init(r, jnp.zeros((1, 8), jnp.int32))
    shapes = jax.eval_shape(init, jax.random.key(0))
    assert modeling.count_params(shapes["params"]) == expected


def _closed_form_counts(c: BertConfig) -> tuple[int, int]:
    """(BertModel with pooler, BertForPreTraining) parameters, counted by hand from the shapes."""
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    embeddings = (v + c.max_position_embeddings + c.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * (2 * h)  # q,k,v,out; ffn; 2 LayerNorms
    model = embeddings + c.num_hidden_layers * layer + (h * h + h)  # + pooler
    heads = (h * h + h) + 2 * h + v + (2 * h + 2)  # MLM transform, its LayerNorm, output bias; NSP
    return model, model + heads


@pytest.mark.parametrize("name", ["tiny", "mini", "small", "medium", "base", "large"])
def test_every_config_parameter_count_matches_the_readme_and_a_hand_count(name):
    import importlib
    import pathlib
    import re
    config = BertConfig.from_dict(importlib.import_module(f"configs.{name}").get_config().model.to_dict())
    shapes = jax.eval_shape(lambda r: BertForPreTraining(config).init(r, **modeling.dummy_inputs(config)),
                            jax.random.key(0))["params"]
    encoder = jax.eval_shape(lambda r: BertModel(config).init(r, jnp.zeros((1, 8), jnp.int32)),
                             jax.random.key(0))["params"]
    counted = (modeling.count_params(encoder), modeling.count_params(shapes))
    assert counted == _closed_form_counts(config)
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "model.md").read_text(encoding="utf-8")
    row = re.search(rf"^\| `configs/{name}\.py` \|.*$", page, re.M).group(0)
    numbers = [int(x.replace(",", "")) for x in re.findall(r"\*{0,2}([\d,]{5,})\*{0,2}", row)]
    assert tuple(numbers) == counted, row


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_parity_with_hf_flax_bert(act):
    config = tiny_config(hidden_act=act)
    params = random_params(config)
    inputs = batch()
    out = ours(config, params, inputs)
    hf = hf_model(config)
    ref = hf(inputs["input_ids"], attention_mask=inputs["input_mask"], token_type_ids=inputs["segment_ids"],
             params=to_hf(params, config), output_hidden_states=True)
    # Sequence output at every position, padding and the all-padding row included.
    np.testing.assert_allclose(sequence(config, params, inputs), ref.hidden_states[-1], atol=1e-5, rtol=0)
    nsp = np.asarray(ref.seq_relationship_logits)
    np.testing.assert_allclose(out.nsp_logits, nsp, atol=1e-5, rtol=0)
    mlm_ref = np.take_along_axis(np.asarray(ref.prediction_logits),
                                 np.asarray(inputs["masked_lm_positions"])[..., None], axis=1)
    assert out.mlm_logits.shape == (4, 3, config.vocab_size)
    np.testing.assert_allclose(out.mlm_logits, mlm_ref, atol=1e-5, rtol=0)
    # Pooled output: HF's BertModel pooler on the same weights.
    hf_base = transformers.FlaxBertModel(hf.config, _do_init=False)
    base_ref = hf_base(inputs["input_ids"], attention_mask=inputs["input_mask"],
                       token_type_ids=inputs["segment_ids"], params=to_hf(params, config)["bert"])
    np.testing.assert_allclose(out.pooled_output, base_ref.pooler_output, atol=1e-5, rtol=0)
    # Every layer's hidden states, embeddings first.
    bm = BertModel(config).apply({"params": params["bert"]}, inputs["input_ids"], inputs["input_mask"],
                                 inputs["segment_ids"], output_hidden_states=True)
    assert bm.hidden_states.shape[0] == config.num_hidden_layers + 1
    for mine, theirs in zip(bm.hidden_states, ref.hidden_states):
        np.testing.assert_allclose(mine, theirs, atol=1e-5, rtol=0)


def test_init_distribution():
    config = tiny_config(vocab_size=2000, hidden_size=64, num_attention_heads=4, intermediate_size=64)
    params = nn.meta.unbox(BertForPreTraining(config).init(jax.random.key(3), **modeling.dummy_inputs(config))["params"])
    emb = np.asarray(params["bert"]["embeddings"]["word_embeddings"])
    # Truncated at two standard deviations; the truncated normal's std is 0.8796 of the untruncated one.
    assert np.abs(emb).max() <= 2 * 0.02
    assert abs(emb.std() - 0.02 * 0.87962566) < 0.02 * 0.02
    assert abs(emb.mean()) < 1e-3
    flat = {"/".join(str(k.key) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    for name, value in flat.items():
        if name.endswith("bias"):
            assert np.all(np.asarray(value) == 0), name
        if name.endswith("scale"):
            assert np.all(np.asarray(value) == 1), name
        assert value.dtype == jnp.float32, name


def test_logical_axis_names_on_every_parameter():
    config = tiny_config(scan_layers=True)
    boxed = jax.eval_shape(lambda r: BertForPreTraining(config).init(r, **modeling.dummy_inputs(config)),
                           jax.random.key(0))["params"]
    leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
    for x in leaves:
        assert len(x.names) == len(x.value.shape)
    names = {x.names for x in leaves}
    assert ("layers", "embed", "heads", "kv") in names  # scanned q/k/v kernels
    assert ("vocab", "embed") in names


def test_bfloat16_compute_keeps_float32_params_logits_layernorm_and_softmax():
    config = tiny_config(dtype="bfloat16")
    params = random_params(config)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    out = ours(config, params, batch())
    assert out.mlm_logits.dtype == jnp.float32 and out.nsp_logits.dtype == jnp.float32
    assert out.masked_output.dtype == jnp.bfloat16 and sequence(config, params, batch()).dtype == jnp.bfloat16
    want = ours(tiny_config(), params, batch())
    # bfloat16 against float32 compute: the error is bf16's own. Measured 0.046 on 2026-11-27 (CPU,
    # the suite's XLA flags), about 1.5 bf16 ulps of the largest logit (4.06); the bound is 2x that
    # and far below the logits (zero logits, or logits scaled by 0.9, fail it).
    assert np.abs(want.mlm_logits).max() > 20 * 0.1
    np.testing.assert_allclose(out.mlm_logits, want.mlm_logits, atol=0.1, rtol=0)
    # LayerNorm in float32, alone: a bf16 input with a large mean (as in the residual stream) gives
    # the float32 result rounded once to bf16, at most half a bf16 ulp (2**-8 relative; measured
    # max |diff| 0.0074 at |y| <= 3.8); statistics computed in bf16 are off by 0.19 here. The bound
    # is one ulp.
    ln = {"scale": params["bert"]["embeddings"]["LayerNorm"]["scale"],
          "bias": params["bert"]["embeddings"]["LayerNorm"]["bias"]}
    x = jnp.asarray(32.0 + np.random.RandomState(0).normal(0, 1, (6, config.hidden_size)), jnp.bfloat16)
    y = layers.LayerNorm(config).apply({"params": ln}, x)
    y32 = layers.LayerNorm(tiny_config()).apply({"params": ln}, x.astype(jnp.float32))
    assert y.dtype == jnp.bfloat16 and np.abs(y32).max() > 1
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=2 ** -7, atol=1e-6)
    # The attention softmax in float32, alone: bf16 queries, keys and values (as the bf16 model
    # passes them) and one-hot values (value j of each head is unit vector j), so that the output
    # is the probabilities, each the float32 one rounded once to bf16: at most half an ulp (2**-8
    # relative; the matmul adds one exact term; measured 0.0038). The logits reach 20, where a bf16
    # logit is off by up to 0.06, 6% of its probability: a softmax computed in bf16 (with a finite
    # mask fill, so no NaN) is off by 0.14 here. The bound is one ulp. Key 6 of row 1 is padding.
    rng = np.random.RandomState(1)
    q, k = (jnp.asarray(rng.normal(0, 2.5, (2, 8, 2, 8)), jnp.bfloat16) for _ in range(2))
    v = jnp.broadcast_to(jnp.eye(8, dtype=jnp.bfloat16)[None, :, None, :], (2, 8, 2, 8))
    mask = np.ones((2, 1, 1, 8), bool)
    mask[1, ..., 6] = False
    probs = attention.attention(q, k, v, jnp.asarray(mask), impl="einsum")  # [batch, query, heads, key]
    logits = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(8)
    assert np.abs(logits).max() > 20
    logits = np.where(mask, logits, -np.inf)
    want = np.exp(logits - logits.max(-1, keepdims=True))
    want = (want / want.sum(-1, keepdims=True)).transpose(0, 2, 1, 3)
    assert probs.dtype == jnp.bfloat16 and np.all(np.asarray(probs)[1, :, :, 6] == 0)
    np.testing.assert_allclose(np.asarray(probs, np.float64), want, rtol=2 ** -7, atol=1e-30)


def test_padding_masks_keys_and_all_padding_rows_are_finite():
    config = tiny_config()
    params = random_params(config)
    inputs = batch()
    out = sequence(config, params, inputs)
    assert np.all(np.isfinite(out))
    # Changing a padded token must not change any real position's output.
    changed = dict(inputs, input_ids=inputs["input_ids"].at[1, 9].set(50))
    out2 = sequence(config, params, changed)
    np.testing.assert_allclose(out2[1, :7], out[1, :7], atol=1e-6)


def test_packed_row_matches_its_sequences_run_alone():
    config = tiny_config()
    params = random_params(config)
    bert = BertModel(config)
    rng = np.random.RandomState(1)
    a = rng.randint(5, 99, size=6).astype(np.int32)
    b = rng.randint(5, 99, size=4).astype(np.int32)
    seg_a, seg_b = np.array([0, 0, 0, 1, 1, 1]), np.array([0, 0, 1, 1])
    ids = np.zeros((1, 12), np.int32)
    ids[0, :6], ids[0, 6:10] = a, b
    seg = np.zeros((1, 12), np.int32)
    seg[0, :6], seg[0, 6:10] = seg_a, seg_b
    pack = np.array([[1] * 6 + [2] * 4 + [0, 0]])
    pos = np.array([list(range(6)) + list(range(4)) + [0, 0]])
    packed = bert.apply({"params": params["bert"]}, ids, (pack > 0).astype(np.int32), seg, pos, pack,
                        np.array([[0, 6]]))
    alone_a = bert.apply({"params": params["bert"]}, a[None], None, seg_a[None])
    alone_b = bert.apply({"params": params["bert"]}, b[None], None, seg_b[None])
    np.testing.assert_allclose(packed.sequence_output[0, :6], alone_a.sequence_output[0], atol=1e-5)
    np.testing.assert_allclose(packed.sequence_output[0, 6:10], alone_b.sequence_output[0], atol=1e-5)
    np.testing.assert_allclose(packed.pooled_output[0, 0], alone_a.pooled_output[0], atol=1e-5)
    np.testing.assert_allclose(packed.pooled_output[0, 1], alone_b.pooled_output[0], atol=1e-5)


def test_causal_attention_ignores_the_future():
    config = tiny_config(causal_attention=True)
    params = random_params(config)
    inputs = batch()
    out = sequence(config, params, inputs)
    changed = dict(inputs, input_ids=inputs["input_ids"].at[0, 8].set(42))
    out2 = sequence(config, params, changed)
    np.testing.assert_allclose(out2[0, :8], out[0, :8], atol=1e-6)
    assert not np.allclose(out2[0, 8:], out[0, 8:])


def test_dropout_is_active_only_in_training():
    config = tiny_config()
    params = random_params(config)
    inputs = batch()
    model = BertForPreTraining(config)
    a = model.apply({"params": params}, **inputs, deterministic=False, rngs={"dropout": jax.random.key(1)})
    b = model.apply({"params": params}, **inputs, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(a.mlm_logits, b.mlm_logits)
    with pytest.raises(ValueError, match="attention_probs_dropout_prob"):
        BertForPreTraining(config.replace(attention_impl="dot_product")).apply(
            {"params": params}, **inputs, deterministic=False, rngs={"dropout": jax.random.key(1)})


@pytest.mark.parametrize("scan", [False, True])
def test_training_outputs_equal_those_with_flax_dropout_and_jax_bernoulli(monkeypatch, scan):
    """Our dropout changes speed, not results: the same masks as flax's nn.Dropout (same module
    names, so the same keys) and as jax.random.bernoulli in the attention probabilities."""
    config = tiny_config(scan_layers=scan)
    params = random_params(config)  # stacked layers under scan
    inputs = batch()

    def run():
        out = BertForPreTraining(config).apply({"params": params}, **inputs, deterministic=False,
                                               rngs={"dropout": jax.random.key(5)})
        return np.asarray(out.mlm_logits), np.asarray(out.nsp_logits)

    ours = run()
    monkeypatch.setattr(modeling, "Dropout", nn.Dropout)
    monkeypatch.setattr(dropout, "keep_mask", lambda rng, p, shape: jax.random.bernoulli(rng, p, shape))
    reference = run()
    for a, b in zip(ours, reference):
        # One dropped element more or less would move logits by ~0.1; XLA may fuse the float ops
        # around the masks differently (inside scan's loop it does), which moves them by ~1e-6.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    deterministic = BertForPreTraining(config).apply({"params": params}, **inputs, deterministic=True)
    assert not np.allclose(ours[0], deterministic.mlm_logits)


def test_gelu_variants():
    x = jnp.array([-3.0, -1.0, 0.5, 2.0])
    erf = 0.5 * x * (1 + jax.scipy.special.erf(x / np.sqrt(2)))
    tanh = 0.5 * x * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(layers.activation_fn("gelu")(x), erf, atol=1e-6)
    np.testing.assert_allclose(layers.activation_fn("gelu_tanh")(x), tanh, atol=1e-6)
    np.testing.assert_allclose(layers.activation_fn("gelu_new")(x), tanh, atol=1e-6)
    assert not np.allclose(erf, tanh, atol=1e-4)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be divisible by BertConfig.num_attention_heads"):
        BertConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden_act"):
        BertConfig(hidden_act="swish")
    with pytest.raises(ValueError, match="attention_impl"):
        BertConfig(attention_impl="flash")
    with pytest.raises(ValueError, match="vocab_size"):
        BertConfig(vocab_size=0)
    with pytest.raises(ValueError, match="sequence length 50 exceeds max_position_embeddings=40"):
        cfg = tiny_config()
        BertModel(cfg).init(jax.random.key(0), jnp.zeros((1, 50), jnp.int32))


def test_config_files_google_hf_and_ours(tmp_path):
    google = {"attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
              "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
              "max_position_embeddings": 512, "num_attention_heads": 12, "num_hidden_layers": 12,
              "type_vocab_size": 2, "vocab_size": 30522}
    (tmp_path / "bert_config.json").write_text(json.dumps(google))
    cfg = BertConfig.from_json_file(tmp_path / "bert_config.json")
    # Google's "gelu": by default the exact erf form its 2018 checkpoints were trained with
    # (docs/checkpoints.md); google_gelu="tanh" for models trained with its code since 2019-02.
    assert cfg.hidden_act == "gelu"
    assert cfg == BertConfig()
    assert BertConfig.from_json_file(tmp_path / "bert_config.json", google_gelu="tanh") == BertConfig(
        hidden_act="gelu_tanh")
    hf = dict(google, model_type="bert", architectures=["BertForMaskedLM"], layer_norm_eps=1e-12,
              pad_token_id=0, position_embedding_type="absolute", transformers_version="4.57")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = BertConfig.from_json_file(tmp_path / "config.json", dtype="bfloat16")
    assert cfg.hidden_act == "gelu" and cfg.dtype == "bfloat16"
    mine = BertConfig(hidden_act="gelu", scan_layers=True, num_hidden_layers=4)
    mine.to_json_file(tmp_path / "ours.json")
    assert BertConfig.from_json_file(tmp_path / "ours.json") == mine
    (tmp_path / "bad.json").write_text(json.dumps(dict(google, hidden_size=100)))
    with pytest.raises(ValueError, match="bad.json.*hidden_size"):
        BertConfig.from_json_file(tmp_path / "bad.json")


def test_every_config_file_builds_a_valid_model():
    import importlib
    for name in ("base", "large", "tiny", "mini", "small", "medium", "test"):
        config = importlib.import_module(f"configs.{name}").get_config()
        cfg = BertConfig.from_dict(config.model.to_dict())
        assert cfg.intermediate_size in (4 * cfg.hidden_size, 2 * cfg.hidden_size)
    large = BertConfig.from_dict(importlib.import_module("configs.large").get_config().model.to_dict())
    assert (large.num_hidden_layers, large.hidden_size, large.num_attention_heads) == (24, 1024, 16)


def test_modeling_does_not_import_tensorflow():
    code = "import bert_jax.model.modeling, sys; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
