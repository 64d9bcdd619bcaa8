"""`BertConfig.mixed_matmuls` (bert_jax/model/mixed_precision.py): every matmul with bfloat16 inputs and
float32 accumulation and output, forward and backward, in a float32 model. Checked against float32
einsums of the same values rounded to bfloat16 (an independent reference), by the form of every
dot in the training step's program, and as a whole model against the float32 one."""

import functools
import logging

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.finetune import heads
from bert_jax.model import attention, mixed_precision, model_config, modeling
from bert_jax.model.pretraining_heads import BertForPreTraining
from tests.helpers.jaxpr_dots import dot_dtypes


def _round(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize("spec,shapes", [
    ("abc,cd->abd", ((2, 5, 16), (16, 24))),                     # a dense layer
    ("bqhd,bkhd->bhqk", ((2, 6, 3, 8), (2, 7, 3, 8))),           # attention scores
    ("bhqk,bkhd->bqhd", ((2, 3, 6, 7), (2, 7, 3, 8))),           # attention context
    ("blh,hsnd->blsnd", ((2, 5, 16), (16, 3, 2, 8))),            # the fused Q/K/V projection
    ("bph,vh->bpv", ((2, 3, 16), (40, 16))),                     # the MLM decoder
])
def test_the_einsum_equals_float32_einsums_of_bf16_rounded_values(spec, shapes):
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)
    out, vjp = jax.vjp(functools.partial(mixed_precision.einsum, spec), a, b)
    g = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    da, db = vjp(g)
    exact = functools.partial(jnp.einsum, spec, precision="highest")
    want, want_vjp = jax.vjp(exact, _round(a), _round(b))
    want_da, want_db = want_vjp(_round(g))  # the output's gradient rounded to bf16 as well
    assert out.dtype == da.dtype == db.dtype == jnp.float32
    for name, got, ref in (("out", out, want), ("da", da, want_da), ("db", db, want_db)):
        # Products of bf16 values are exact in float32: only the sums' order differs.
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()), err_msg=name)
    # ... and they are not the float32 einsum's (the inputs really are rounded).
    assert np.abs(np.asarray(out) - np.asarray(exact(a, b))).max() > 1e-4


def test_einsums_whose_gradient_needs_a_broadcast_are_refused():
    with pytest.raises(ValueError, match="neither the output nor the other input"):
        mixed_precision.einsum("ab,bc->c", jnp.ones((2, 3)), jnp.ones((3, 4)))
    assert mixed_precision.dense_spec(3, 2, 1) == "abc,bcd->ad"


def _step_dots(cfg):
    """Every dot_general of the pretraining model's loss and gradients: (input dtypes, output dtype)."""
    batch = modeling.dummy_inputs(cfg, batch=2, length=16, predictions=3)
    params = nn.meta.unbox(BertForPreTraining(cfg).init(jax.random.key(0), **batch)["params"])

    def loss(p):
        out = BertForPreTraining(cfg).apply({"params": p}, **{k: batch[k] for k in (
            "input_ids", "input_mask", "segment_ids", "masked_lm_positions")})
        return jnp.sum(out.mlm_logits ** 2) + jnp.sum(out.nsp_logits)

    return dot_dtypes(jax.make_jaxpr(jax.value_and_grad(loss))(params)), loss, params


CFG = model_config.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture(scope="module")
def models():
    """The float32 model's and the mixed one's `_step_dots` (traced once for the tests below)."""
    return _step_dots(CFG), _step_dots(CFG.replace(mixed_matmuls=True))


def test_every_matmul_of_the_training_step_takes_bf16_and_returns_float32(models):
    (plain, _, _), (dots, _, _) = models
    # Forward and both gradients of each: per layer the fused Q/K/V, output, FFN in and out and the
    # two attention matmuls (the last layer's query apart: 7), the pooler, the MLM transform and
    # decoder, NSP.
    assert len(dots) >= 3 * (6 + 7 + 4), dots
    assert all(ins == ("bfloat16", "bfloat16") and out == "float32" for ins, out in dots), dots
    assert all(ins == ("float32", "float32") for ins, _ in plain)  # the float32 model is untouched


# Measured on 2026-11-28 (CPU): the loss 4.5e-4 relative from float32's, the gradients 8.3e-3 of each
# leaf's largest value at most; bounds ~10x and ~7x those.
def test_the_mixed_model_is_the_float32_model_to_bf16_rounding(models):
    (_, loss, params), (_, mixed_loss, _) = models
    (l32, g32), (l16, g16) = jax.jit(jax.value_and_grad(loss))(params), jax.jit(jax.value_and_grad(mixed_loss))(params)
    assert jax.tree.structure(g32) == jax.tree.structure(g16)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(g16))
    assert 0 < abs(float(l16) - float(l32)) < 5e-3 * abs(float(l32))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g16), jax.tree.leaves(g32)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, atol=6e-2 * max(1e-3, np.abs(b).max()), rtol=0,
                                   err_msg=jax.tree_util.keystr(path))


def test_the_bf16_units_are_read_from_cpuinfo():
    x86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"
    zen3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma vaes\n"
    assert mixed_precision.bf16_units(x86) == ["avx512_bf16"]
    assert mixed_precision.bf16_units(arm) == ["bf16"]
    assert mixed_precision.bf16_units(zen3) == []


def test_the_speedup_probe_times_the_path_the_model_takes(monkeypatch):
    """`bf16_matmul_speedup` is float32's best time over the best time of `mixed_precision.einsum`
    (the function the model calls), at the shapes asked. Checked without a clock: the timer is
    replaced by one that runs each program once and hands back planted times (a wall-clock ratio
    under a busy second test process failed this test once; no test times the machine)."""
    real, seen, timed = mixed_precision.einsum, [], []

    def einsum(spec, a, b):
        seen.append((spec, a.shape, b.shape))
        return real(spec, a, b)

    def call_times(fn, a, b, repeats):
        before = len(seen)
        out = fn(a, b)
        mixed = len(seen) > before  # traced through mixed_precision.einsum
        timed.append((mixed, out.dtype, repeats))
        return [0.9, 0.3, 0.5] if mixed else [0.8, 0.6, 0.7]

    monkeypatch.setattr(mixed_precision, "einsum", einsum)
    monkeypatch.setattr(mixed_precision, "call_times", call_times)
    speedup = mixed_precision.bf16_matmul_speedup(rows=16, k=24, n=40, repeats=3)
    assert timed == [(False, np.float32, 3), (True, np.float32, 3)]
    assert seen == [("mk,kn->mn", (16, 24), (24, 40))]
    assert speedup == pytest.approx(0.6 / 0.3)  # the best of each


def test_the_speedup_probe_compiles_only_the_two_programs_it_times(monkeypatch):
    """The probe runs at the start of every "auto" run: its operands come from numpy, so XLA
    compiles the float32 matmul and the mixed one and nothing else (`jax.random.normal` compiled
    two more programs, ~0.3 s). Odd shapes, so no earlier test's cached program hides a compile."""
    compiled = []

    class Handler(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of "):
                compiled.append(message.split()[4])

    handler, logger = Handler(level=logging.DEBUG), logging.getLogger("jax")
    logger.addHandler(handler)
    monkeypatch.setattr(mixed_precision, "call_times", lambda fn, a, b, repeats: [np.asarray(fn(a, b)).size])
    jax.config.update("jax_log_compiles", True)
    try:
        mixed_precision.bf16_matmul_speedup(rows=7, k=13, n=11, repeats=1)
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
    assert sorted(compiled) == ["jit(<lambda>)", "jit(<lambda>)"], compiled


def test_bad_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="mixed_matmuls"):
        model_config.BertConfig(mixed_matmuls=True, dtype="bfloat16")


@pytest.mark.parametrize("head,outputs", [("classification", 3), ("regression", 1), ("token", 5),
                                          ("span", 2), ("multiple_choice", 1)])
def test_every_matmul_of_each_fine_tuning_head_takes_bf16_and_returns_float32(head, outputs):
    """The task heads (bert_jax/finetune/heads.py) too: the encoder's and the head's matmuls, forward and
    both gradients, in the mixed form; the float32 model's all in float32."""
    batch = heads.dummy_batch(head, 16, num_choices=2)
    inputs = tuple(batch[k] for k in heads.MODEL_INPUTS)

    def dots(cfg):
        model = heads.BertForTask(cfg, head, outputs)
        params = nn.meta.unbox(model.init(jax.random.key(0), *inputs)["params"])
        loss = lambda p: sum(jnp.sum(v ** 2) for v in model.apply({"params": p}, *inputs).values())  # noqa: E731
        return dot_dtypes(jax.make_jaxpr(jax.grad(loss))(params))

    mixed, plain = dots(CFG.replace(mixed_matmuls=True)), dots(CFG)
    assert len(mixed) == len(plain) >= 3 * 2 * 6, mixed  # the head's own: forward and both gradients
    assert all(ins == ("bfloat16", "bfloat16") and out == "float32" for ins, out in mixed), mixed
    assert all(ins == ("float32", "float32") for ins, _ in plain)


def test_dot_product_attention_takes_the_mixed_matmuls():
    """`attention_impl="dot_product"` with `mixed_matmuls` on a CPU: the einsum, float32 softmax, einsum
    of bf16-rounded values, equal to numpy's float32 computation of those rounded values (an
    independent reference), and not XLA's float32 attention."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 2, 4), jnp.float32) for i in range(3))
    mask = jnp.arange(8)[None, None, None, :] < jnp.array([8, 5])[:, None, None, None]  # padding in row 2
    got = attention.attention(q, k, v, mask, impl="dot_product", mixed_matmuls=True)
    r = lambda x: np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    logits = np.einsum("bqhd,bkhd->bhqk", r(q), r(k)) / np.sqrt(4.0)
    logits = np.where(np.asarray(mask), logits, np.finfo(np.float32).min)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bhqk,bkhd->bqhd", r(jnp.asarray(probs, jnp.float32)), r(v))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-6)
    plain = attention.attention(q, k, v, mask, impl="dot_product")
    assert np.abs(np.asarray(plain) - want).max() > 1e-4  # the reference tells the two apart
