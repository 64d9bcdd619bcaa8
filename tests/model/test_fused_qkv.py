"""`BertConfig.fused_qkv`: the Q/K/V GEMM kernels (here in Pallas' interpreter; on a GPU the real
Triton kernels) against an independent float32 reference and against the unfused path: both
passes of the projections alone, and the whole pretraining model's loss and every gradient."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.model import model_config, modeling, pretraining_heads
from bert_jax.model.kernels import fused_qkv
from tests.helpers import model_parity

# Launch shapes that make the interpreter walk several output tiles of each projection and every
# contraction in two or more steps (the kernels' gradient: two row blocks of the kernel, so that
# only one of them must write the bias gradient), as a GPU launch does.
SMALL_TILES = {"block_m": 32, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 1}
KERNELS = ("qkv_gemm_bias_fwd", "qkv_gemm_dx_bwd", "qkv_gemm_dw_db_bwd")
NAMES = ("q", "k", "v", "dx", "dw_q", "dw_k", "dw_v", "db_q", "db_k", "db_v")


@pytest.fixture(autouse=True)
def _float32_matmuls():
    """float32 matmuls in float32 on every backend (a GPU's default is TF32). No change on CPUs."""
    with jax.default_matmul_precision("float32"):
        yield


def _reference(x, kernels, biases):
    """q, k, v in plain jax, float32: three einsums and their biases, jax's autodiff."""
    return tuple(jnp.einsum("blh,hnd->blnd", x, w, precision="highest") + b for w, b in zip(kernels, biases))


def _unfused(x, kernels, biases):
    """What the model computes without the kernels, in the inputs' dtype (`SelfAttention`'s
    default: one einsum against the stacked kernels, then three slices)."""
    qkv = jnp.einsum("blh,hsnd->blsnd", x, jnp.stack(kernels, axis=1)) + jnp.stack(biases).astype(x.dtype)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def _inputs(dtype, batch=2, length=32, hidden=64, heads=4, seed=0):
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    x = jnp.asarray(rng.normal(0, 1, (batch, length, hidden)), dtype)
    kernels = [jnp.asarray(rng.normal(0, 0.15, (hidden, heads, head_dim)), dtype) for _ in range(3)]
    biases = [jnp.asarray(rng.normal(0, 0.3, (heads, head_dim)), jnp.float32) for _ in range(3)]
    gs = tuple(jnp.asarray(rng.normal(0, 1, (batch, length, heads, head_dim)), dtype) for _ in range(3))
    return (x, kernels, biases), gs


def _errors(fn, args, gs, want):
    """Each output's largest error relative to the reference's largest value, in `NAMES`' order."""
    y, vjp = jax.vjp(fn, *args)
    got = jax.tree.leaves((y, vjp(gs)))
    return [float(np.abs(np.asarray(a, np.float32) - b).max() / max(np.abs(b).max(), 1e-30))
            for a, b in zip(got, want)], got


def _want(args, gs):
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), args)
    y, vjp = jax.vjp(_reference, *f32)
    return [np.asarray(a) for a in jax.tree.leaves((y, vjp(jax.tree.map(lambda g: g.astype(jnp.float32), gs))))]


# Errors measured on 2026-11-29 (CPU, interpreter), relative to each output's largest value:
#   float32: <= 3.6e-7 (the unfused path's <= 5e-7);
#   bfloat16: q, k, v 2.0-3.6e-3 (unfused 4.7-5.0e-3: the bias added after rounding), dx and the
#   kernels' gradients 2.0-2.1e-3 (unfused the same), the bias gradients 0 (unfused 1.0-1.1e-2:
#   summed from bf16 partial sums).
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernels_equal_a_float32_reference_values_and_gradients(monkeypatch, dtype):
    monkeypatch.setattr(fused_qkv, "INTERPRET", SMALL_TILES)
    args, gs = _inputs(jnp.dtype(dtype))
    want = _want(args, gs)
    errors, got = _errors(fused_qkv.qkv_projection, args, gs, want)
    x, kernels, biases = args
    # Each output in its input's dtype (the biases' gradients in float32, like the biases), and
    # `[batch, length, heads, head_dim]` as attention takes them.
    assert [a.dtype for a in got] == [x.dtype] * 4 + [kernels[0].dtype] * 3 + [jnp.float32] * 3
    assert [a.shape for a in got[:3]] == [gs[0].shape] * 3
    if dtype == "float32":
        assert max(errors) < 5e-6, dict(zip(NAMES, errors))
    else:  # no worse than the unfused bf16 path, by more than rounding noise
        unfused_errors, _ = _errors(_unfused, args, gs, want)
        for name, e, u in zip(NAMES, errors, unfused_errors):
            assert e < 1.5 * u + 1e-3, (name, e, u)
            assert e < 1e-2, (name, e)


def test_rows_that_do_not_fill_a_tile_and_each_projection_apart(monkeypatch):
    """Row counts 16 does not divide (padded inside) and q, k, v told apart: a gradient on one of
    them alone reaches only its own kernel and bias."""
    monkeypatch.setattr(fused_qkv, "INTERPRET", SMALL_TILES)
    args, gs = _inputs(jnp.float32, batch=3, length=7)
    x, kernels, biases = args
    for p in range(3):
        only = tuple(g if i == p else jnp.zeros_like(g) for i, g in enumerate(gs))
        errors, got = _errors(fused_qkv.qkv_projection, args, only, _want(args, only))
        assert max(errors[:3] + errors[3:4]) < 5e-6, dict(zip(NAMES, errors))
        for i in range(3):
            dw, db = got[4 + i], got[7 + i]
            if i == p:
                assert max(errors[4 + i], errors[7 + i]) < 5e-6, dict(zip(NAMES, errors))
            else:
                assert not np.any(np.asarray(dw)) and not np.any(np.asarray(db)), (p, i)


# The model's bf16 numerics are the kernels' (above); here the wiring, in float32, where the two
# programs agree to rounding: measured on 2026-11-29 (CPU, interpreter), with every bias drawn at
# random (initialized, they are zeros: a dropped bias would not show), logits and loss equal and
# every gradient within 1.3e-7 of its leaf's largest (in bf16: logits 1.8e-3, loss 1.3e-3 relative,
# gradients 1.8e-2). Alone, and with every other kernel on.
@pytest.mark.parametrize("others,activation", [({}, "gelu"), ({"fused_ffn": True, "fused_ops": True}, "gelu_tanh")],
                         ids=["alone", "with_ffn_and_layernorm_kernels"])
def test_the_model_with_the_kernels_trains_like_the_one_without(others, activation):
    cfg = model_config.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, hidden_act=activation)
    more = ("ffn_gemm_bias_gelu_fwd", "dropout_add_layernorm_fwd") if others else ()
    model_parity.assert_trains_alike(cfg, cfg.replace(fused_qkv=True, **others), kernels=KERNELS + more,
                                     logits_atol=2e-6, loss_rtol=1e-5, grad_tol=1e-5)


def test_where_the_kernels_do_not_apply_the_projections_are_unfused():
    assert fused_qkv.supported(768) and fused_qkv.supported(1024) and not fused_qkv.supported(96)
    for changes in ({"hidden_size": 96}, {"fp8": True}):
        cfg = model_config.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=128, fused_qkv=True).replace(**changes)
        batch = modeling.dummy_inputs(cfg, batch=1, length=8, predictions=2)
        # (init traces the forward pass: its program has every layer's projections)
        model = pretraining_heads.BertForPreTraining(cfg)
        jaxpr = str(jax.make_jaxpr(lambda: model.init(jax.random.key(0), **batch))())
        assert "qkv_gemm" not in jaxpr, changes
    with pytest.raises(ValueError, match="fused_qkv"):
        model_config.BertConfig(fused_qkv="yes")


def test_the_kernels_lower_to_triton_for_nvidia_gpus(monkeypatch):
    """What a GPU compiles, lowered here at BERT-Large's shapes: the three kernels become Triton
    calls, and nothing else in the program is a custom call."""
    monkeypatch.setattr(fused_qkv, "_interpret", lambda: False)

    def grads(x, kernels, biases):
        def loss(x, kernels, biases):
            return sum(jnp.sum(y.astype(jnp.float32) ** 2) for y in fused_qkv.qkv_projection(x, kernels, biases))
        return jax.grad(loss, argnums=(0, 1, 2))(x, kernels, biases)

    s = jax.ShapeDtypeStruct
    args = (s((4, 128, 1024), jnp.bfloat16), [s((1024, 16, 64), jnp.bfloat16)] * 3, [s((16, 64), jnp.float32)] * 3)
    calls, text = model_parity.lowered_for_cuda(grads, *args)
    assert len(calls) == 3 and all("@__gpu$xla.gpu.triton" in line for line in calls), calls
    assert "mosaic_gpu" not in text


def test_the_benchmark_times_both_sides_and_writes_the_launch_shapes_it_swept(monkeypatch, tmp_path):
    """benchmarks/kernels/fused_qkv.py (what a GPU session runs), at small shapes in the interpreter:
    every kernel swept and its fastest shape written, the three timings of both sides, and both
    sides' errors against float32 (the kernels' bias gradients, summed in float32, the smaller)."""
    for name in ("FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHTS"):
        monkeypatch.setattr(fused_qkv, name, getattr(fused_qkv, name))  # the sweep sets them: put back after
    from benchmarks.kernels import fused_qkv as bench  # pylint: disable=import-outside-toplevel  (here: the GPU session runs this file)
    blocks = tmp_path / "blocks.json"
    result = bench.main(["--batch=2", "--length=32", "--hidden=128", "--heads=2", "--reps=1", "--calls=1",
                         f"--sweep={blocks}", "--sweep_shapes=1"])
    swept = json.loads(blocks.read_text())
    assert set(swept) == {"forward", "backward_input", "backward_weights"}
    assert all(tuple(swept[k].values()) == bench.SHAPES[0] for k in swept), swept  # (block_m, ..., num_stages)
    assert all(len(result["sweep"][k]) == 1 for k in swept)
    assert set(result["timings"]) == {"forward", "backward", "block_fwd_bwd"}
    assert all(row["fused_ms"] > 0 and row["xla_ms"] > 0 for row in result["timings"].values())
    errors = result["errors_vs_float32"]
    assert all(errors["fused"][n] < 1e-2 for n in NAMES), errors["fused"]
    assert all(errors["fused"][f"db_{p}"] < errors["xla_bf16"][f"db_{p}"] for p in "qkv"), errors
    with pytest.raises(SystemExit):
        bench.main(["--hidden=96", "--heads=2"])

