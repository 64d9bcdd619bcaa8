"""The step benchmarks (benchmarks/step/) on the tiny config: what they count and compare is right."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks.step import dropout as dropout_bench
from benchmarks.step import fp8 as fp8_bench
from benchmarks.step import optimizer as optimizer_bench
from benchmarks.step import pretrain_step, timing
from bert_jax.model import dropout
from bert_jax.model.model_config import BertConfig
from bert_jax.pretrain import steps
from bert_jax.training import optim, train_state
from tests.helpers.jaxpr_dots import dot_dtypes


# configs/tiny.py with a learning rate that moves the parameters by about 1e-3 a step from the
# first (its own warms up over 10,000 steps: 1e-8 at step 1, too little to tell two updates apart).
MOVING_TINY = """
from configs import tiny


def get_config():
    config = tiny.get_config()
    config.learning_rate, config.warmup_steps = 1e-3, 0
    return config
"""

# Two programs that compute the same update may still round differently: with the suite's XLA
# flags (tests/helpers/xla_flags.py, an older fusion emitter) their fused loops do, by up to a float32 ulp
# of a parameter (1.2e-7 at a LayerNorm scale of 1; bit for bit with XLA's default CPU emitter).
# Another update (another guard, clip or dropout mask) moves them by about the learning rate.
ROUNDING = 2.5e-7
# A whole step (forward and backward through the model, then Adam): 3.0e-7 measured (2026-11-27).
STEP_ROUNDING = 1e-5


def test_bench_optimizer_variants_apply_the_same_update(tmp_path):
    """benchmarks/step/optimizer.py on the tiny config: the `lax.cond` guard moves the parameters
    as the old `jnp.where` guard did, and with our clipping they agree to rounding.
    (Adam's step barely depends on the gradient's scale, so this cannot pin the clipping itself:
    test_clipping_at_global_norm_one does, against optax.)"""
    (tmp_path / "tiny_lr.py").write_text(MOVING_TINY)
    bench = optimizer_bench
    result = bench.main([f"--config={tmp_path / 'tiny_lr.py'}", "--rounds=1", "--steps=2"])
    assert set(result) == {"before", "optax clip, cond guard", "now", "no clip, no guard"}
    assert result["optax clip, cond guard"]["max_param_diff_vs_before"] <= ROUNDING
    assert result["now"]["max_param_diff_vs_before"] <= ROUNDING
    assert optim.clip_by_global_norm is not optax.clip_by_global_norm  # the benchmark restored it
    assert train_state.apply_guarded_update is not bench.where_guarded_update


def test_bench_step_counts_what_each_step_executes():
    """benchmarks/step/pretrain_step.py on the tiny config, ours and HF's: the FLOPs it divides by."""
    bench = pretrain_step
    common = ["--config=configs/tiny.py", "--seq_len=32", "--batch=8", "--predictions=5", "--steps=1",
              "--warmup=0", "--json", "--measure_peak"]
    sparse = bench.main(common + ["--hf"])
    dense = bench.main(common + ["--dense_last_layer"])
    cfg = BertConfig.from_dict(bench.load_config("configs/tiny.py").model.to_dict())
    h, i, t, n = cfg.hidden_size, cfg.intermediate_size, 32, 8
    # The dense step executes the model's count; the sparse one skips the last layer's queries,
    # output projection and feed-forward at the 32 - 6 positions that are neither masked nor [CLS],
    # and their attention scores and context (forward + backward: x3).
    model_count = steps.train_flops_per_sequence(cfg, t, 5) * n
    skipped = 3 * n * (2 * (t - 6) * (2 * h * h + 2 * h * i) + 4 * (t - 6) * t * h)
    assert dense["executed_tflop"] * 1e12 == pytest.approx(model_count)
    assert sparse["executed_tflop"] * 1e12 == pytest.approx(model_count - skipped)
    # HF's step runs its MLM head (transform + decoder) at all 32 positions instead of 5.
    hf_extra = 3 * n * 2 * (t - 5) * (h * h + h * cfg.vocab_size)
    assert sparse["hf_executed_tflop"] * 1e12 == pytest.approx(model_count + hf_extra)
    assert sparse["matmul_peak_tflops"] > 0 and 0 < sparse["matmul_bound_share"] < 1
    # The same loss function on the same batch, from other random weights and dropout masks: at
    # initialization both are near ln(vocab) + ln(2) (uniform MLM and NSP predictions). Measured on
    # 2026-11-27 (CPU): ours 11.0351, HF 11.0360, ln(30522) + ln(2) = 11.0194; our initial loss over
    # 6 init seeds spreads with std 0.019 (max 0.058 above ln(V) + ln(2)). So the bounds come from
    # that spread, not from rounding: 0.1, about 4 standard deviations of a difference of two draws;
    # a missing NSP term (ln 2 = 0.69) fails them, and so does our loss 0.2 too high (checked).
    assert sparse["loss"] == pytest.approx(sparse["hf_loss"], abs=0.1)
    assert sparse["hf_loss"] == pytest.approx(np.log(cfg.vocab_size) + np.log(2), abs=0.1)


def test_bench_dropout_variants_draw_the_same_masks_and_make_the_same_steps(tmp_path):
    """benchmarks/step/dropout.py on the tiny config: keep_mask's masks equal
    jax.random.bernoulli's element for element, and the steps built on each move the parameters
    identically (to STEP_ROUNDING, where a step moves them by about 1e-3)."""
    (tmp_path / "tiny_lr.py").write_text(MOVING_TINY)
    bench = dropout_bench
    flags = [f"--config={tmp_path / 'tiny_lr.py'}", "--seq_len=32", "--batch=8", "--rounds=1", "--steps=1"]
    masks = bench.main(flags)
    cfg = BertConfig.from_dict(pretrain_step.load_config("configs/tiny.py").model.to_dict())
    hidden = 8 * 32 * cfg.hidden_size
    probs = 8 * cfg.num_attention_heads * 32 * 32
    assert masks["elements"] == hidden * (1 + 2 * cfg.num_hidden_layers) + probs * cfg.num_hidden_layers
    assert masks["masks_differing"] == 0
    step = bench.main(flags + ["--step"])
    assert set(step["variants"]) == {"jax.random.bernoulli", "keep_mask"}
    assert step["max_param_diff"] <= STEP_ROUNDING
    assert dropout.keep_mask.__module__ == "bert_jax.model.dropout"  # the benchmark put it back


def test_bench_fp8_variants_carry_their_own_xla_options_and_time_pipelined_steps(tmp_path):
    """benchmarks/step/fp8.py: `NAME+xla_option=value` compiles that variant's program (alone)
    with the option, and the pipelined timing really runs its steps back to back."""
    bench = fp8_bench
    changes, xla = bench.variant_spec("fused_gelu_tanh+xla_gpu_enable_cublaslt=true+xla_gpu_autotune_level=0"
                                      "+xla_dump_hlo_as_text=false+xla_dump_to=/x")
    assert changes == {"fused_ops": True, "hidden_act": "gelu_tanh"}
    assert xla == {"xla_gpu_enable_cublaslt": True, "xla_gpu_autotune_level": 0,
                   "xla_dump_hlo_as_text": False, "xla_dump_to": "/x"}
    with pytest.raises(ValueError, match="unknown variant 'fp16'"):
        bench.variant_spec("fp16")
    with pytest.raises(ValueError, match="is not xla_<option>=<value>"):
        bench.variant_spec("bf16+cublaslt")

    step = jax.jit(lambda state, batch: (state + batch, {"loss": jnp.sum(state)}))
    lowered = step.lower(jnp.zeros(3), jnp.ones(3))
    dump = tmp_path / "dump"
    runners = {"plain": timing.Runner(lowered, jnp.zeros(3), jnp.ones(3)),
               "dumped": timing.Runner(lowered, jnp.zeros(3), jnp.ones(3),
                                       compiler_options={"xla_dump_to": str(dump)})}
    infos = {"plain": {}, "dumped": {}}
    timing.compile_runners(runners, infos)
    assert infos["plain"]["compile_s"] > 0 and infos["dumped"]["compile_s"] > 0
    assert len(list(dump.iterdir())) > 0  # the option reached XLA for that program
    runners["dumped"].run_pipelined(3)
    runners["dumped"].run(2)
    np.testing.assert_array_equal(runners["dumped"].state, np.full(3, 5.0))  # 3 + 2 steps ran
    assert runners["dumped"].loss == 12.0  # the last step's loss: sum of the state before it (4 x 3)
    assert len(runners["dumped"].pipelined) == 1 and len(runners["dumped"].durations) == 2


def test_modernbert_vs_bert_compares_equal_widths_and_feed_forward_parameters():
    """benchmarks/step/modernbert_vs_bert.py: the two models share width, depth and heads, and GeGLU's
    two-thirds intermediate size gives ModernBERT's feed-forward exactly BERT's weights (96: divisible
    by 3); one timed step of each trains on the same masked positions (the loss moves)."""
    from benchmarks.step import modernbert_vs_bert as bench

    args = bench.parse_args(["--lengths=32", "--hidden=96", "--layers=3", "--heads=2", "--vocab=200",
                             "--local_attention=8", "--rounds=1", "--steps=1"])
    bert_cfg, modern_cfg = bench.models(args, 32)
    assert (bert_cfg.hidden_size, bert_cfg.num_hidden_layers, bert_cfg.num_attention_heads) == \
        (modern_cfg.hidden_size, modern_cfg.num_hidden_layers, modern_cfg.num_attention_heads)
    bert_ffn = 2 * bert_cfg.hidden_size * bert_cfg.intermediate_size  # two matrices
    modern_ffn = 3 * modern_cfg.hidden_size * modern_cfg.intermediate_size  # Wi (two halves) and Wo
    assert bert_ffn == modern_ffn == 73_728
    ids = jnp.asarray(np.arange(64, dtype=np.int32).reshape(2, 32) % 200)
    positions = jnp.asarray(np.array([[1, 5, 9], [2, 6, 30]], np.int32))
    labels = jnp.take_along_axis(ids, positions, 1)
    modern = bench.modernbert.ModernBertForMaskedLM(modern_cfg)
    params = modern.init(jax.random.key(0), ids, jnp.ones_like(ids), masked_positions=positions)["params"]
    step = bench.make_step(lambda p, b: modern.apply({"params": p}, b["input_ids"], jnp.ones_like(b["input_ids"]),
                                                     masked_positions=b["positions"])[1], params)
    batch = {"input_ids": ids, "positions": positions, "labels": labels}
    first, second = float(step(batch)), float(step(batch))
    assert second < first  # AdamW moved the parameters downhill on the same batch


def test_modernbert_vs_bert_mixed_variants_are_each_family_with_bf16_matmuls(monkeypatch):
    """benchmarks/step/modernbert_vs_bert.py --mixed_matmuls: the two extra variants start from the float32
    variants' parameters, and every dot of their loss's gradient takes bf16 and returns float32 (traced,
    not timed)."""
    import jax.extend

    from benchmarks.step import modernbert_vs_bert as bench

    args = bench.parse_args(["--lengths=16", "--hidden=32", "--layers=3", "--heads=2", "--vocab=64",
                             "--local_attention=4", "--mixed_matmuls"])
    bert_cfg, modern_cfg = bench.models(args, 16)
    ids = jnp.asarray(np.arange(32, dtype=np.int32).reshape(2, 16) % 64)
    batch = {"input_ids": ids, "input_mask": jnp.ones_like(ids), "segment_ids": jnp.zeros_like(ids),
             "positions": jnp.asarray([[1, 5], [2, 9]], jnp.int32)}
    bert_params = bench.BertForPreTraining(bert_cfg).init(jax.random.key(0), ids, batch["input_mask"],
                                                          batch["segment_ids"], batch["positions"])["params"]
    modern_params = bench.modernbert.ModernBertForMaskedLM(modern_cfg).init(
        jax.random.key(0), ids, batch["input_mask"], masked_positions=batch["positions"])["params"]
    made = []
    monkeypatch.setattr(bench, "make_step", lambda logits, params: made.append((logits, params)) or (lambda b: None))
    assert sorted(bench.mixed_units(bert_cfg, modern_cfg, bert_params, modern_params, batch)) == [
        "bert_mixed", "modernbert_mixed"]
    assert made[0][1] is bert_params and made[1][1] is modern_params

    for logits, params in made:
        found = dot_dtypes(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(logits(p, batch) ** 2)))(params).jaxpr)
        assert len(found) >= 3 * 6 * 3 and all(d == (("bfloat16", "bfloat16"), "float32") for d in found), found
