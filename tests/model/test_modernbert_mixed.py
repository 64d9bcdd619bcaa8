"""`ModernBertConfig.mixed_matmuls` (bert_jax/model/modernbert.py): every matmul of ModernBERT with bfloat16
inputs and float32 accumulation and output, forward and backward, as BERT's (tests/model/test_mixed_precision.py).

Each matmul of each piece (attention on its three paths, the GeGLU MLP, the MLM head with the tied
decoder, a task classifier) against NumPy's float32 product of the same operands rounded to bfloat16
(`ml_dtypes`: an independent rounding), the operands being what the model's modules received (recorded
with `nn.intercept_methods`); the attention's scores and context against NumPy's attention of the
recorded Q/K/V; every dot of the pretraining train step's lowered program and of each task model's
gradient in the mixed form, counted by hand; the whole model against transformers' float32 outputs to
bf16 rounding (tests/fixtures/modernbert_tiny/)."""

import dataclasses
import functools
import os
import re

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from scipy.special import erf

from bert_jax.formats import modernbert_hf
from bert_jax.model import attention as attention_lib
from bert_jax.model import modernbert
from bert_jax.pretrain import model_family, steps
from bert_jax.training import optim, train_state
from tests.helpers import modernbert_fixture
from tests.helpers.jaxpr_dots import dot_dtypes

# Layer 0 global, 1 and 2 local with a band of 4 tokens each side: 24-token rows take `banded_attention`.
CFG = modernbert.ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                  num_attention_heads=2, local_attention=8, max_position_embeddings=64,
                                  pad_token_id=0)
MIXED = dataclasses.replace(CFG, mixed_matmuls=True)
LENGTH = 24


def r(x):
    """`x` rounded to bfloat16 (round to nearest even), back in float32: NumPy through ml_dtypes."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def gelu(x):
    return (0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))).astype(np.float32)


def layer_norm(x, scale, eps):
    mu = x.mean(-1, keepdims=True)
    return ((x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * scale).astype(np.float32)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def randomized(params, seed=0):
    """Weights far from the init's 0.02 (0.3 N(0, 1)): the rounding matters at every matmul."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    rng = np.random.RandomState(seed)
    return jax.tree_util.tree_unflatten(tree, [np.float32(0.3) * rng.standard_normal(x.shape).astype(np.float32)
                                               for x in leaves])


def recorded_apply(module, params, *args):
    """`module.apply`'s output and, per submodule name, what its `__call__` got and returned (`(args, out)`)."""
    calls = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__":
            calls[context.module.name] = (jax.tree.map(np.asarray, args), jax.tree.map(np.asarray, out))
        return out

    with nn.intercept_methods(record):
        out = module.apply({"params": params}, *args)
    return out, calls


def check_close(got, want, real=None):
    """To 1e-5 of the largest value: products of bf16 values are exact in float32, only the sums' order
    differs. `real` selects the rows compared."""
    got, want = np.asarray(got), np.asarray(want)
    if real is not None:
        got, want = got[real], want[real]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def check_dense(calls, name, kernel, bias=None):
    """Module `name`'s output is the float32 product of its recorded input and `kernel`, both rounded."""
    (x, *_), out = calls[name]
    check_close(out, r(x) @ r(kernel) + (0.0 if bias is None else bias))


def inputs(seed=0):
    rng = np.random.RandomState(seed)
    x = rng.standard_normal((2, LENGTH, CFG.hidden_size)).astype(np.float32)
    keys_ok = np.ones((2, LENGTH), np.int32)
    keys_ok[1, 17:] = 0  # padding in row 2
    return x, keys_ok


def numpy_attention(qkv, keys_ok, is_global, cfg=CFG):
    """ModernBERT's attention (transformers' definition: RoPE by halves, the band of local layers) in NumPy
    from the Wqkv output, the scores' and the context's operands rounded to bf16."""
    b, length, _ = qkv.shape
    heads, d = cfg.num_attention_heads, cfg.head_dim
    qkv = qkv.reshape(b, length, 3, heads, d)
    theta = cfg.global_rope_theta if is_global else cfg.local_rope_theta
    angle = np.arange(length)[:, None] * (1.0 / theta ** (np.arange(0, d, 2) / d))[None]  # [length, d/2]
    cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]

    def rotate(t):  # the halves rotated by each pair's angle
        t1, t2 = t[..., :d // 2], t[..., d // 2:]
        return np.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1).astype(np.float32)

    q, k, v = rotate(qkv[:, :, 0]), rotate(qkv[:, :, 1]), qkv[:, :, 2]
    logits = np.einsum("bqhd,bkhd->bhqk", r(q), r(k)) / np.float32(np.sqrt(d))
    allowed = keys_ok.astype(bool)[:, None, None, :]
    if not is_global:
        i = np.arange(length)
        allowed = allowed & (np.abs(i[:, None] - i[None, :]) <= cfg.local_attention // 2)
    probs = softmax(np.where(allowed, logits, np.float32(-1e30)))
    return np.einsum("bhqk,bkhd->bqhd", r(probs), r(v)).reshape(b, length, heads * d)


@pytest.mark.parametrize("is_global,local_blocks", [(True, True), (False, True), (False, False)],
                         ids=["global", "local_by_blocks", "local_band_mask"])
def test_attention_equals_numpy_on_bf16_rounded_operands(is_global, local_blocks):
    """Wqkv and Wo on their recorded inputs; the scores and the context (the full-mask path, global and local
    with the band mask, and `banded_attention`'s blocks) at every real query from the recorded Q/K/V (a
    padding query's window differs by blocks). Between the two attention matmuls NumPy's softmax and
    XLA's differ in their last bits, and a probability that lies that close to a bf16 rounding boundary
    rounds to the neighbouring bf16 value in one of them: the context is compared to 1e-4."""
    x, keys_ok = inputs()
    positions = jnp.broadcast_to(jnp.arange(LENGTH), (2, LENGTH))
    mask = attention_lib.make_attention_mask(jnp.asarray(keys_ok))

    def apply(cfg, params=None):
        cos, sin = modernbert.rotary(cfg, positions, is_global)
        layer = modernbert.Attention(cfg, is_global)
        args = (jnp.asarray(x), mask, jnp.asarray(keys_ok), None, None, cos, sin, True)
        params = params or randomized(layer.init(jax.random.key(0), *args)["params"])
        return recorded_apply(layer, params, *args), params

    (got, calls), params = apply(dataclasses.replace(MIXED, local_blocks=local_blocks))
    p = jax.tree.map(np.asarray, params)
    assert got.dtype == jnp.float32
    check_dense(calls, "Wqkv", p["Wqkv"]["kernel"])
    check_dense(calls, "Wo", p["Wo"]["kernel"])
    context, want = calls["Wo"][0][0], numpy_attention(calls["Wqkv"][1], keys_ok, is_global)
    real = keys_ok.astype(bool)
    np.testing.assert_allclose(context[real], want[real], rtol=0, atol=1e-4 * np.abs(want).max())
    (plain, plain_calls), _ = apply(dataclasses.replace(CFG, local_blocks=local_blocks), params)
    plain_context = plain_calls["Wo"][0][0]
    assert np.abs(plain_context[real] - want[real]).max() > 1e-3 * np.abs(want).max()  # really rounded


def test_the_geglu_mlp_equals_numpy_on_bf16_rounded_operands():
    """Wi and Wo on their recorded inputs, and Wo's input `gelu(a) * b` of Wi's output in float32."""
    x, _ = inputs(1)
    mlp = modernbert.MLP(MIXED)
    params = randomized(mlp.init(jax.random.key(0), jnp.asarray(x), True)["params"])
    got, calls = recorded_apply(mlp, params, jnp.asarray(x), True)
    p = jax.tree.map(np.asarray, params)
    check_dense(calls, "Wi", p["Wi"]["kernel"])
    check_dense(calls, "Wo", p["Wo"]["kernel"])
    a, b = np.split(calls["Wi"][1], 2, axis=-1)
    check_close(calls["Wo"][0][0], gelu(a) * b)
    np.testing.assert_array_equal(np.asarray(got), calls["Wo"][1])
    plain = modernbert.MLP(CFG).apply({"params": params}, jnp.asarray(x), True)
    want = r(gelu(a) * b) @ r(p["Wo"]["kernel"])
    assert np.abs(np.asarray(plain) - want).max() > 1e-3 * np.abs(want).max()


def test_the_mlm_head_and_tied_decoder_equal_numpy_on_bf16_rounded_operands():
    """The head's dense layer on the encoder's output, and the decoder tied to the token embeddings on the
    head's output (dense, GELU, norm: float32)."""
    ids = jnp.asarray(np.random.RandomState(2).randint(1, CFG.vocab_size, (2, LENGTH)), jnp.int32)
    mask = jnp.ones_like(ids)
    model = modernbert.ModernBertForMaskedLM(MIXED)
    params = randomized(model.init(jax.random.key(0), ids, mask)["params"])
    (hidden, logits), calls = recorded_apply(model, params, ids, mask)
    p = jax.tree.map(np.asarray, params)
    check_close(calls["dense"][0][0], hidden)
    check_dense(calls, "dense", p["head"]["dense"]["kernel"])
    head = calls["head"][1]
    check_close(head, layer_norm(gelu(calls["dense"][1]), p["head"]["norm"]["scale"], CFG.norm_eps))
    assert logits.dtype == jnp.float32
    check_close(logits, r(head) @ r(p["model"]["tok_embeddings"]["embedding"]).T + p["decoder_bias"])


@pytest.mark.parametrize("kind,num_outputs", [("sequence", 3), ("token", 4)])
def test_a_task_classifier_equals_numpy_on_bf16_rounded_operands(kind, num_outputs):
    """The head's dense layer on the pooled rows of the encoder's output, the classifier on the head's."""
    ids = jnp.asarray(np.random.RandomState(3).randint(1, CFG.vocab_size, (2, LENGTH)), jnp.int32)
    mask = jnp.ones_like(ids)
    model = modernbert.ModernBertForTask(MIXED, kind, num_outputs)
    params = randomized(model.init(jax.random.key(0), ids, mask)["params"])
    logits, calls = recorded_apply(model, params, ids, mask)
    p = jax.tree.map(np.asarray, params)
    hidden = calls["model"][1]
    check_close(calls["dense"][0][0], hidden[:, 0] if kind == "sequence" else hidden)
    check_dense(calls, "dense", p["head"]["dense"]["kernel"])
    check_close(calls["classifier"][0][0], calls["head"][1])
    check_dense(calls, "classifier", p["classifier"]["kernel"], p["classifier"]["bias"])
    np.testing.assert_array_equal(np.asarray(logits), calls["classifier"][1])


# ---------------------------------------------------------------------------------------------
# Every matmul of a training step
# ---------------------------------------------------------------------------------------------

# Per layer Wqkv, the scores, the context, Wo, the MLP's Wi and Wo; the head's dense and the decoder (the
# task models': the head's dense and the classifier): each forward and both gradients.
DOTS = 3 * (6 * CFG.num_hidden_layers + 2)
_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<(?:[0-9]+x)*(\w+)>, tensor<(?:[0-9]+x)*(\w+)>\) -> "
                  r"tensor<(?:[0-9]+x)*(\w+)>")
_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL = re.compile(r"call @([\w.$-]+)\(")


def lowered_dots(text: str) -> list:
    """Every dot_general one run of a lowered (StableHLO) program executes: (lhs, rhs, result) element types,
    a private function's dots counted once per call of it."""
    funcs, name = {}, None
    for line in text.splitlines():
        m = _FUNC.search(line)
        if m:
            name = m.group(1)
            funcs[name] = {"dots": [], "calls": []}
        elif name is not None:
            funcs[name]["dots"] += [d.groups() for d in _DOT.finditer(line)]
            funcs[name]["calls"] += _CALL.findall(line)

    @functools.lru_cache(maxsize=None)
    def executed(f):
        return tuple(funcs[f]["dots"]) + sum((executed(c) for c in funcs[f]["calls"] if c in funcs), ())

    return list(executed("main"))


def train_step_dots(cfg) -> list:
    """The pretraining train step (`bert_jax.pretrain.steps.train_step`, AdamW) of `cfg`, lowered for two
    rows of 24 tokens with 5 predictions each."""
    model = model_family.pretraining_model(cfg)
    tx = optim.make_optimizer("adamw", lambda step: 1e-3, weight_decay=0.01)
    rng = np.random.RandomState(0)
    ids = rng.randint(5, cfg.vocab_size, (2, LENGTH)).astype(np.int32)
    batch = {"input_ids": ids, "input_mask": np.ones_like(ids), "segment_ids": np.zeros_like(ids),
             "masked_lm_positions": np.tile(np.arange(1, 6, dtype=np.int32), (2, 1)),
             "masked_lm_ids": ids[:, 1:6].copy(), "masked_lm_weights": np.ones((2, 5), np.float32),
             "next_sentence_labels": np.zeros((2, 1), np.int32), "next_sentence_weights": np.zeros((2, 1), np.float32)}
    params = model.init(jax.random.key(0), **model_family.dummy_inputs(cfg))["params"]
    state = train_state.create_train_state(params, tx, jax.random.key(1))
    step = jax.jit(functools.partial(steps.train_step, model=model, tx=tx, schedule=lambda step: 1e-3, use_nsp=False))
    return lowered_dots(step.lower(state, batch).as_text())


def test_every_matmul_of_the_train_step_takes_bf16_and_returns_float32():
    mixed, plain = train_step_dots(MIXED), train_step_dots(CFG)
    assert len(mixed) == len(plain) == DOTS, (len(mixed), len(plain))
    assert all(dot == ("bf16", "bf16", "f32") for dot in mixed), mixed
    assert all(dot == ("f32", "f32", "f32") for dot in plain), plain  # the float32 model is untouched


@pytest.mark.parametrize("kind,num_outputs,shape", [("sequence", 3, (2, LENGTH)), ("span", 2, (2, LENGTH)),
                                                    ("multiple_choice", 1, (2, 2, LENGTH))])
def test_every_matmul_of_a_task_models_gradient_takes_bf16_and_returns_float32(kind, num_outputs, shape):
    ids = jnp.asarray(np.random.RandomState(4).randint(1, CFG.vocab_size, shape), jnp.int32)
    mask = jnp.ones_like(ids)

    def dots(cfg):
        model = modernbert.ModernBertForTask(cfg, kind, num_outputs)
        params = nn.meta.unbox(model.init(jax.random.key(0), ids, mask)["params"])
        loss = lambda p: jnp.sum(model.apply({"params": p}, ids, mask) ** 2)  # noqa: E731
        return dot_dtypes(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)

    mixed, plain = dots(MIXED), dots(CFG)
    assert len(mixed) == len(plain) == DOTS, (len(mixed), len(plain))
    assert all(d == (("bfloat16", "bfloat16"), "float32") for d in mixed), mixed
    assert all(d == (("float32", "float32"), "float32") for d in plain), plain


# ---------------------------------------------------------------------------------------------
# The whole model
# ---------------------------------------------------------------------------------------------


def test_the_mixed_model_is_transformers_float32_model_to_bf16_rounding(tmp_path):
    """tests/fixtures/modernbert_tiny: transformers' float32 outputs on its own weights. The mixed model is
    within bf16 rounding of them, and not equal to them as the float32 model is (test_modernbert.py: 1e-5)."""
    config, params, _ = modernbert_hf.load(modernbert_fixture.checkpoint(str(tmp_path)), mixed_matmuls=True)
    ref = np.load(os.path.join(modernbert_fixture.FIXTURE, "reference.npz"))
    hidden, logits = modernbert.ModernBertForMaskedLM(config).apply(
        {"params": params}, jnp.asarray(ref["input_ids"]), jnp.asarray(ref["attention_mask"]))
    real = ref["attention_mask"].astype(bool)
    for name, got, want in (("hidden", hidden, ref["last_hidden_state"]), ("logits", logits, ref["logits"])):
        err = np.abs(np.asarray(got)[real] - want[real]).max() / np.abs(want[real]).max()
        assert 1e-4 < err < 2e-2, (name, err)
