"""Local (sliding-window) attention through `attention.attention(..., local_window=w)` (issue 72).

The reference everywhere is the float32 einsum attention with the band `|query - key| <= w` built here
in numpy (not `attention.band`) and ANDed into the padding/packing mask. Checked: the splash kernel's
`LocalMask` run through Pallas's interpreter on CPU (forward and gradients, padding and packing); the
semantics of `local_window_size=(w, w)` that the cuDNN call uses, on XLA's implementation; the
decision (`local_kernel`) on a planted GPU: jax 0.10.2's refusal of cuDNN's two-sided window, and the
cuDNN call a GPU makes where the probe accepts; ModernBERT's local layers reaching the kernel with
their window; and the same model compiled for a TPU slice with libtpu (the splash kernel's custom
call in every layer; skips without libtpu, as tests/pod/test_aot_tpu.py).
"""

import dataclasses
import functools
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.model import attention, modernbert
from tests.helpers.planted_splash import interpreted_splash

ROOT = Path(__file__).resolve().parents[2]
BATCH, LENGTH, HEADS, HEAD_DIM, HALF = 2, 384, 2, 64, 40  # three 128-token tiles: the window skips some


def masks(case: str):
    """`(input_mask, pack_ids)` `[batch, length]`: row 0 padded after 300 tokens, row 1 after 350 (three
    packed sequences with "packing", two of them shorter than the window)."""
    input_mask = np.zeros((BATCH, LENGTH), np.int32)
    input_mask[0, :300] = 1
    input_mask[1, :350] = 1
    pack_ids = None
    if case == "packing":
        pack_ids = np.zeros((BATCH, LENGTH), np.int32)
        pack_ids[0, :300] = np.repeat([1, 2, 3], [30, 250, 20])
        pack_ids[1, :350] = np.repeat([1, 2], [200, 150])
        pack_ids = jnp.asarray(pack_ids)
    return jnp.asarray(input_mask), pack_ids


def qkv(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(BATCH, LENGTH, HEADS, HEAD_DIM)), dtype) for _ in range(3))


def band_reference(q, k, v, input_mask, pack_ids, half=HALF):
    """Float32 einsum attention under the padding/packing mask and a numpy band."""
    i = np.arange(q.shape[1])
    near = jnp.asarray(np.abs(i[:, None] - i[None, :]) <= half)  # [query, key]
    mask = attention.make_attention_mask(input_mask, pack_ids) & near[None, None]
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    return attention.attention(q, k, v, mask, impl="einsum")


def outputs_and_grads(fn, q, k, v, input_mask):
    """`fn(q, k, v)` and the gradients of a random projection of its real-token outputs."""
    out, vjp = jax.vjp(fn, q, k, v)
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=out.shape), out.dtype)
    return out, vjp(cotangent * input_mask[:, :, None, None].astype(out.dtype))


# --- TPU: splash attention's LocalMask, in Pallas's interpreter ---


@pytest.mark.parametrize("case", ["padding", "packing"])
def test_splash_local_mask_equals_the_band_mask_on_real_tokens(case):
    input_mask, pack_ids = masks(case)
    q, k, v = qkv()
    ids = attention.make_sequence_ids(input_mask, pack_ids)
    assert attention._splash_block(LENGTH, HALF) == 128  # not 384's whole row: tiles beyond the window skip
    splash = jax.jit(functools.partial(attention._splash_attention, sequence_ids=ids, causal=False,
                                       local_window=HALF, interpret=True))
    got, got_grads = outputs_and_grads(splash, q, k, v, input_mask)
    want, want_grads = outputs_and_grads(
        jax.jit(lambda q, k, v: band_reference(q, k, v, input_mask, pack_ids)), q, k, v, input_mask)
    real = np.asarray(input_mask, bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5, rtol=0)
    for name, a, b in zip("qkv", got_grads, want_grads):
        # All rows: padding queries carry no cotangent and real queries never see padding keys.
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())), rtol=0, err_msg=f"d{name}")
    # The window matters here: the full (unbanded) attention is far from it.
    full = attention.attention(q, k, v, attention.make_attention_mask(input_mask, pack_ids), impl="einsum")
    assert np.abs(np.asarray(full)[real] - np.asarray(want)[real]).max() > 0.1


# --- GPU: the window as cuDNN takes it, and the decision ---


def test_local_window_size_of_jax_s_attention_is_the_band():
    """`jax.nn.dot_product_attention(..., local_window_size=(w, w))`, the argument the cuDNN call gets,
    on XLA's implementation: `|query - key| <= w`, the same as the band (not `< w`, not one-sided)."""
    input_mask, pack_ids = masks("packing")
    q, k, v = qkv()
    mask = jnp.broadcast_to(attention.make_attention_mask(input_mask, pack_ids), (BATCH, 1, LENGTH, LENGTH))
    got = jax.nn.dot_product_attention(q, k, v, mask=mask, local_window_size=(HALF, HALF), implementation="xla")
    real = np.asarray(input_mask, bool)
    want = band_reference(q, k, v, input_mask, pack_ids)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5, rtol=0)
    narrower = band_reference(q, k, v, input_mask, pack_ids, half=HALF - 1)
    assert np.abs(np.asarray(narrower)[real] - np.asarray(want)[real]).max() > 1e-3


@pytest.fixture
def planted_gpu(monkeypatch):
    """`jax.default_backend()` says "gpu" (what `_cudnn_applies` reads), with a fresh probe cache."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention, "_cudnn_trains", functools.lru_cache(attention._cudnn_trains.__wrapped__))


def test_on_a_gpu_jax_0_10_refuses_cudnn_s_two_sided_window_and_the_band_mask_stays(planted_gpu, caplog):
    q = jax.ShapeDtypeStruct((BATCH, LENGTH, HEADS, HEAD_DIM), jnp.bfloat16)
    assert attention._cudnn_applies(q)
    with caplog.at_level(logging.WARNING):
        assert attention.local_kernel(q, HALF, "dot_product") is None
        assert attention.local_kernel(q, HALF, "dot_product") is None  # probed once
    # jax's own reason, before any GPU is needed: cuDNN's window is one-sided without is_causal.
    assert "doesn't support right window" in caplog.text and "local_window_size (40, 40)" in caplog.text
    assert caplog.text.count("cuDNN fused attention refused") == 1
    assert attention.local_kernel(q, HALF, "einsum") is None


def test_on_a_gpu_where_cudnn_takes_the_window_attention_calls_it_with_the_window(planted_gpu, monkeypatch):
    probes, calls, real_attention = [], [], jax.nn.dot_product_attention

    def probe(shapes, scale, local_window=None):
        probes.append((shapes, local_window))
        return True

    def spy(query, key, value, *, implementation=None, **kwargs):  # records the call, computes it on XLA
        calls.append((implementation, kwargs.get("local_window_size"), kwargs["mask"].shape))
        return real_attention(query, key, value, implementation="xla", **kwargs)

    monkeypatch.setattr(attention, "_cudnn_trains", probe)
    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    input_mask, pack_ids = masks("padding")
    q, k, v = qkv(jnp.bfloat16)
    assert attention.local_kernel(q, HALF, "dot_product") == "cudnn"
    assert probes[-1] == ((((BATCH, LENGTH, HEADS, HEAD_DIM), jnp.dtype(jnp.bfloat16)),) * 3
                          + (((BATCH, 1, LENGTH, LENGTH), jnp.dtype(bool)),), HALF)
    got = attention.attention(q, k, v, attention.make_attention_mask(input_mask, pack_ids), impl="dot_product",
                              local_window=HALF)
    assert calls == [("cudnn", (HALF, HALF), (BATCH, 1, LENGTH, LENGTH))]
    real = np.asarray(input_mask, bool)
    want = band_reference(q, k, v, input_mask, pack_ids)
    # bfloat16 inputs and outputs: 8-bit mantissas.
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(want)[real], atol=2e-2, rtol=0)


def test_off_the_kernels_the_window_is_the_band_mask():
    """CPU: "dot_product" and "einsum" both AND the band into the mask: every row (padding queries too)
    equals the reference; a window with causal, a negative one and cross-attention are refused."""
    input_mask, pack_ids = masks("packing")
    q, k, v = qkv()
    mask = attention.make_attention_mask(input_mask, pack_ids)
    ids = attention.make_sequence_ids(input_mask, pack_ids)
    assert attention.local_kernel(q, HALF, "dot_product", ids) is None
    want = band_reference(q, k, v, input_mask, pack_ids)
    for impl in ("dot_product", "einsum"):
        got = attention.attention(q, k, v, mask, impl=impl, sequence_ids=ids, local_window=HALF)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=impl)
    for bad in (dict(local_window=HALF, causal=True), dict(local_window=-1)):
        with pytest.raises(ValueError, match="local_window"):
            attention.attention(q, k, v, mask, impl="einsum", **bad)
    with pytest.raises(ValueError, match="local_window=40: .*key length 128"):
        attention.attention(q, k[:, :128], v[:, :128], mask[..., :128], impl="einsum", local_window=HALF)


# --- ModernBERT's local layers ---

TINY = modernbert.ModernBertConfig(vocab_size=128, hidden_size=HEADS * HEAD_DIM, intermediate_size=96,
                                   num_hidden_layers=3, num_attention_heads=HEADS, max_position_embeddings=256,
                                   local_attention=64, pad_token_id=0)


def test_modernbert_s_local_layers_reach_the_splash_kernel_with_their_window(monkeypatch):
    """With the kernel planted (`_splash_applies`), layer 0 (global) gets the full mask, layers 1 and 2 (local)
    the window of `local_attention // 2`, and the model equals the einsum model (local layers by blocks)."""
    calls = interpreted_splash(monkeypatch)
    length = 256
    input_mask = np.ones((2, length), np.int32)
    input_mask[1, 200:] = 0
    pack_ids = jnp.asarray(np.where(np.arange(length)[None] < 90, 1, 2) * input_mask)
    ids = jnp.asarray(np.random.default_rng(3).integers(1, 128, size=(2, length)) * input_mask, jnp.int32)
    inputs = dict(input_ids=ids, input_mask=jnp.asarray(input_mask), pack_ids=pack_ids)
    params = jax.jit(lambda: modernbert.ModernBertModel(TINY).init(jax.random.key(0), **inputs)["params"])()
    run = lambda cfg: jax.jit(lambda p: modernbert.ModernBertModel(cfg).apply({"params": p}, **inputs))(params)
    want = run(TINY)
    assert calls == []  # einsum: no kernel
    got = run(dataclasses.replace(TINY, attention_impl="dot_product"))
    windows = [c["local_window"] for c in calls]
    assert windows == [None, 32, 32], windows
    real = input_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-4, rtol=0)


_MISSING = None if importlib.util.find_spec("libtpu") else "libtpu not installed (pip install 'libtpu==0.0.42.*')"

# ModernBERT's forward (TINY's shape) compiled for a v5e 2x2 slice, rows split over the data axis.
AOT_SCRIPT = """
import json, sys
import flax.linen as nn, jax, jax.numpy as jnp
from bert_jax.model import attention, modernbert
from bert_jax.pod.planning import aot
from bert_jax.training import sharding
aot.quiet_libtpu_env()
config = modernbert.ModernBertConfig(**json.loads(sys.argv[1]))
windows, kernel = [], attention._splash_kernel
def spy(heads, length, causal, interpret, local_window=None):
    windows.append(local_window)
    return kernel(heads, length, causal, interpret, local_window)
attention._splash_kernel = spy
mesh = sharding.create_mesh({"data": 4, "fsdp": 1, "tensor": 1}, devices=aot.slice_devices("v5e-4"))
rows = sharding.batch_sharding(mesh)
batch = {k: jax.ShapeDtypeStruct((8, 256), jnp.int32, sharding=rows) for k in ("input_ids", "input_mask")}
model = modernbert.ModernBertModel(config)
with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
    params = jax.eval_shape(lambda b: model.init(jax.random.key(0), **b), batch)
    windows.clear()  # the init's trace ran the kernels too
    text = jax.jit(lambda p, b: model.apply(p, **b)).lower(params, batch).compile().as_text()
calls = [l for l in text.splitlines() if 'custom_call_target="tpu_custom_call"' in l]
print(json.dumps({"windows": windows, "kernels": len(calls), "per_chip_qkv": all("[2,2,256,64]" in c for c in calls)}))
"""


@pytest.mark.skipif(_MISSING is not None and not os.environ.get("BERT_JAX_CI"), reason=str(_MISSING))
def test_modernbert_compiled_for_a_tpu_slice_runs_splash_in_every_layer():
    assert _MISSING is None, _MISSING  # CI installs libtpu (.ci/run): missing there is a failure
    fields = {**{k: getattr(TINY, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                "num_hidden_layers", "num_attention_heads", "local_attention",
                                                "pad_token_id")}, "dtype": "bfloat16", "attention_impl": "dot_product"}
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in sys.path if p]))
    r = subprocess.run([sys.executable, "-c", AOT_SCRIPT, json.dumps(fields)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout.splitlines()[-1])
    # The global layer's kernel has no window, the two local layers' LocalMask has 32 a side.
    assert row["windows"] == [None, 32, 32], row
    # One forward kernel a layer, each on its chip's 2 rows: [rows, heads, length, head_dim].
    assert row["kernels"] == 3 and row["per_chip_qkv"], row
