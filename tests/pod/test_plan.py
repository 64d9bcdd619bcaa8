"""bert_jax.pod.planning.planner (`python -m bert_jax.plan`): the pod planner on a compiled program (libtpu, no TPU),
and its recipe arithmetic.

The compile test plans the test-sized model on a v5e 2x2 slice and checks what the planner read
from the program against what the model says it must be (the gradient all-reduce carries every
parameter), and the projection against the stated model computed by hand from those readings.
Skips without libtpu, except in CI (`.ci/run` installs it, BERT_JAX_CI=1).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bert_jax.pod.planning import planner

ROOT = Path(__file__).resolve().parents[2]
_MISSING = None if importlib.util.find_spec("libtpu") else "libtpu not installed (pip install 'libtpu==0.0.42.*')"


def _need_libtpu():
    if _MISSING and os.environ.get("BERT_JAX_CI"):
        pytest.fail(_MISSING, pytrace=False)
    if _MISSING:
        pytest.skip(_MISSING)


PARAMS_SCRIPT = """
import json, jax, numpy as np, flax.linen as nn
from bert_jax.pod.planning import planner
from bert_jax.model import modeling, pretraining_heads
config, bc = planner.load_config("configs/test.py", 64, "bfloat16")
params = jax.eval_shape(lambda: pretraining_heads.BertForPreTraining(bc).init(jax.random.key(0), **modeling.dummy_inputs(bc)))
print(json.dumps({"params": int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(nn.meta.unbox(params)))),
                  "hidden": bc.hidden_size, "vocab": bc.vocab_size}))
"""


def test_plan_a_v5e_2x2_slice(tmp_path):
    _need_libtpu()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "bert_jax.plan", "--config=configs/test.py", "--topology=v5e-4",
                        "--mesh=data,fsdp,tensor", "--seq_len=64", "--batch_per_chip=4", f"--json={out}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    data, fsdp, tensor = report["plans"]
    assert (data["mesh"], tensor["mesh"]) == ({"data": 4, "fsdp": 1, "tensor": 1}, {"data": 1, "fsdp": 1, "tensor": 4})
    assert data["global_batch"] == 16 and tensor["global_batch"] == 4 and data["flop_count_loops"] == 0
    assert data["flop_count_slice"] == fsdp["flop_count_slice"] == "v5e:2x2"

    # Data parallel: the gradient all-reduce carries every parameter once, plus the tied word
    # embedding's decoder half (the MLM decoder's gradient is reduced apart from the lookup's,
    # at the padded vocabulary) and a few scalars (loss sums).
    model = json.loads(subprocess.run([sys.executable, "-c", PARAMS_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                                      text=True, check=True).stdout.splitlines()[-1])
    padded_vocab = -(-model["vocab"] // 128) * 128
    assert set(data["comm"]) == {"all-reduce"}
    extra = data["comm"]["all-reduce"]["elements"] - model["params"] - padded_vocab * model["hidden"]
    assert 0 <= extra <= 16, extra
    # FSDP: every parameter gathered at least once (forward), at most three times (again for the
    # backward, and the tied embedding for both its uses); a collective counted once per
    # iteration of a loop it was only sunk into would break the upper bound.
    gathered = fsdp["comm"]["all-gather"]["elements"]
    assert model["params"] <= gathered <= 3 * (model["params"] + padded_vocab * model["hidden"]), gathered

    # The projection, by hand from what the planner read: v5e 2x2 has no wraparound (axes of 2),
    # 5e10 B/s per link; an all-reduce over both axes, buffer in 2 parts, each 1/2 then 1/4 of
    # its part per axis, twice (reduce-scatter + all-gather), 1 us per ring step.
    ar = data["comm"]["all-reduce"]
    expected = 2 * (ar["bytes"] / 2) * (1 / 2 + 1 / 4) / 5e10 + ar["executions"] * 2 * 2 * 1e-6
    assert data["comm_s"] == pytest.approx(expected, rel=1e-9)
    for row in (data, fsdp, tensor):
        assert row["compute_s"] == pytest.approx(row["xla_flops"] / 197e12)
        assert row["memory_s"] == pytest.approx(row["hbm_bytes"] / 819e9)
        # The step reads and writes the float32 parameters and both Adam moments at least once
        # (wherever the compiler keeps them).
        assert row["hbm_bytes"] + row["on_chip_bytes"] >= 6 * 4 * model["params"] / (1 if row is data else 4)
        core = row["compute_s"] + row["memory_s"]
        assert row["step_s"] == pytest.approx(max(core, row["comm_s"]) + row["comm_s"] / 2)
        assert row["step_s_no_overlap"] == pytest.approx(core + row["comm_s"])
        assert row["sequences_per_s"] == pytest.approx(row["global_batch"] / row["step_s"])
        a = row["achieved"]
        assert row["step_s_calibrated"] == pytest.approx(max(core / a, row["comm_s"]) + row["comm_s"] / 2)
        assert row["sequences_per_s_calibrated"] == pytest.approx(row["global_batch"] / row["step_s_calibrated"])
        assert 0 < row["mfu"] < 1 and row["xla_flops"] >= row["model_flops"]
    # Tensor parallel: activations reduced inside the 4-chip group, which grow with the batch.
    assert tensor["batch_comm_s"] > 0 and data["batch_comm_s"] == 0
    assert report["recommended"]["64"]["v5e-4"] in ("data", "tensor")


def row(**kw):
    base = {"slice": "v4-16", "chips": 8, "mesh_kind": "data", "seq_len": 128, "batch_per_chip": 32,
            "global_batch": 256, "compute_s": 0.08, "memory_s": 0.04, "hbm_bytes": 4e10, "fixed_bytes": 1e10,
            "hbm_bw": 1e12, "comm_s": 0.03, "batch_comm_s": 0.0, "layers": 24, "sequences_per_s": 1000.0}
    base.update(kw)
    return base


def test_scaled_step_and_recipes_by_hand():
    r = row()
    # half the rows: compute 0.04, traffic 1e10 + 3e10/2 = 2.5e10 -> 0.025 s, comm fixed 0.03
    # overlap: max(0.065, 0.03) + 0.03/24
    assert planner.scaled_step_s(r, 16) == pytest.approx(0.065 + 0.03 / 24)
    assert planner.scaled_step_s(r, 16, overlap=False) == pytest.approx(0.065 + 0.03)
    tp = row(mesh_kind="tensor", batch_comm_s=0.02)  # activation collectives scale with the rows
    assert planner.scaled_step_s(tp, 64, overlap=False) == pytest.approx(0.16 + 0.07 + 0.05)

    phases = [{"seq_len": 128, "steps": 1000, "batch": 512}, {"seq_len": 512, "steps": 100, "batch": 64}]
    rows = {128: [row(), row(mesh_kind="fsdp", sequences_per_s=900.0)],
            512: [row(seq_len=512, batch_per_chip=8, global_batch=64, sequences_per_s=300.0)]}
    (entry,) = planner.recipe_plan("toy", phases, rows)
    p1, p2 = entry["phases"]
    # phase 1: 512 rows over 8 chips = 64 per chip, 32 fit: 2 passes of 32 (accumulation)
    assert (p1["mesh"], p1["batch_per_chip"], p1["accumulation"]) == ("data", 64, 2)
    assert p1["step_s"] == pytest.approx(2 * planner.scaled_step_s(rows[128][0], 32))
    assert (p2["batch_per_chip"], p2["accumulation"]) == (8, 1)
    assert entry["wall_s"] == pytest.approx(1000 * p1["step_s"] + 100 * p2["step_s"])
    assert entry["chip_hours"] == pytest.approx(entry["wall_s"] * 8 / 3600)
    # calibrated: compute and traffic at training.chips.ACHIEVED of the peaks, the collectives not
    from bert_jax.training import chips
    a = chips.ACHIEVED
    assert planner.scaled_step_s(r, 16, achieved=a) == pytest.approx(max(0.065 / a, 0.03) + 0.03 / 24)
    # both phases' programs at their own batch: core 0.08 + 0.04 = 0.12 s, at a of the peaks; 2 passes at 128
    assert entry["calibrated"]["wall_s"] == pytest.approx((1000 * 2 + 100) * (max(0.12 / a, 0.03) + 0.03 / 24))

    small = [{"seq_len": 128, "steps": 10, "batch": 4}]  # 4 rows over 8 chips: impossible
    (entry,) = planner.recipe_plan("tiny", small, {128: [row()]})
    assert "under one row per chip" in entry["error"]


def test_a_data_parallel_plan_counts_flops_on_the_chips_4_chip_slice():
    from bert_jax.training import chips

    for name, want in (("v4-2048", "v4:2x2x1"), ("v5p-16", "v5p:2x2x1"), ("v5e-256", "v5e:2x2"), ("v6e-8", "v6e:2x2")):
        small = chips.smallest_slice(chips.parse_slice(name))
        assert (small.topology_name, small.chips) == (want, 4)
        again = chips.parse_slice(small.name)  # a name aot.slice_devices takes
        assert (again.dims, again.chip) == (small.dims, small.chip)


def test_bad_flags_name_the_flag(capsys):
    for argv, message in ((["--topology=v4-7"], "TensorCores"), (["--topology=v9-8"], "expected e.g."),
                          (["--topology=v5e-12"], "no standard TPU v5e shape of 12 chips"),
                          (["--mesh=pipeline"], "unknown mesh"), (["--recipes=paper"], "needs --seq_len"),
                          (["--config=nope.py"], "no such file")):
        with pytest.raises(SystemExit):
            planner.parse_args(argv)
        assert message in capsys.readouterr().err
    for argv, message in ((["--config.model.attention_imp=dot_product"], "nearest: config.model.attention_impl"),
                          (["--config.model.num_hidden_layers=two"], "expected an integer"),
                          (["--config.model.scan_layers=false"], "the planner sets it"),
                          (["--config.max_seq_length=512"], "--seq_len"), (["--bogus=1"], "unrecognized")):
        with pytest.raises(SystemExit):
            planner.parse_args(argv)
        assert message in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "bert_jax.plan", "--topology=v4-7"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--topology 'v4-7'" in r.stderr and "TensorCores" in r.stderr


def test_config_overrides_reach_the_planned_model():
    """`--config.key=value` as bert_jax.main takes it: parsed as the field's type, applied before
    the planner's own settings (dtype, length, scanned layers)."""
    args = planner.parse_args(["--config=configs/test.py", "--config.model.attention_impl=dot_product",
                            "--config.model.num_hidden_layers=3", "--config.model.fused_ops=true",
                            "--config.learning_rate=2e-4", "--seq_len=64"])
    config, bc = planner.load_config(args.config, 64, "bfloat16", args.overrides)
    assert (bc.attention_impl, bc.num_hidden_layers, bc.fused_ops) == ("dot_product", 3, True)
    assert config.learning_rate == 2e-4 and isinstance(config.learning_rate, float)
    assert (bc.dtype, bc.scan_layers, config.max_seq_length) == ("bfloat16", True, 64)
    plain, plain_bc = planner.load_config(args.config, 64, "bfloat16")
    assert (plain_bc.attention_impl, plain_bc.num_hidden_layers, plain_bc.fused_ops) != ("dot_product", 3, True)


def test_fitting_step_halves_the_batch_until_the_program_fits():
    """`pod.planning.aot.fitting_step`, the planner's and aot_check's: a refused compile (RESOURCE_EXHAUSTED)
    and a program over the chip's HBM both halve the batch; any other error is raised."""
    from unittest import mock

    from bert_jax.pod.planning import aot

    def compile_step(config, bert_config, devices, mesh_kind, b, seq_len, predictions):
        if b == 32:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of HBM")
        return f"program at {b}", 1.5, 4 * b, "mesh"

    def analyze(compiled, hbm_gib):
        return {"fits": compiled == "program at 8", "hbm_gib": 1.0}

    with mock.patch.object(aot, "compile_step", compile_step), mock.patch.object(aot, "analyze", analyze):
        compiled, analysis, b, mesh = aot.fitting_step(None, None, [], "data", 32, 128, 20, 16, "v5e-4 data")
        assert (compiled, b, mesh, analysis["global_batch"], analysis["compile_s"]) == ("program at 8", 8, "mesh", 32, 1.5)
        with pytest.raises(RuntimeError, match="v5e-4 data: a per-chip batch of 1 does not fit at length 128"):
            aot.fitting_step(None, None, [], "data", 4, 128, 20, 16, "v5e-4 data")
    with mock.patch.object(aot, "compile_step", side_effect=ValueError("not a memory error")):
        with pytest.raises(ValueError):
            aot.fitting_step(None, None, [], "data", 4, 128, 20, 16, "v5e-4 data")


def _plan_modernbert_tiny(tmp_path, meshes: str) -> list:
    """configs/modernbert_tiny.py planned on a v5e 2x2 slice at length 32, 4 rows a chip: the plan rows."""
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "bert_jax.plan", "--config=configs/modernbert_tiny.py",
                        "--topology=v5e-4", f"--mesh={meshes}", "--seq_len=32", "--batch_per_chip=4", f"--json={out}"],
                       cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())["plans"]


def _modernbert_tiny_params() -> int:
    import flax.linen as nn
    import jax
    import numpy as np

    from bert_jax.pretrain import model_family

    mcfg = planner.load_config("configs/modernbert_tiny.py", 32, "bfloat16")[1]
    shapes = jax.eval_shape(lambda: model_family.pretraining_model(mcfg).init(
        jax.random.key(0), **model_family.dummy_inputs(mcfg)))
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(nn.meta.unbox(shapes))))


def test_plan_modernbert_tiny_on_a_v5e_2x2_slice(tmp_path):
    """configs/modernbert_tiny.py (2 layers, H 64, GeGLU 96, vocabulary 512; layer 0 global, layer 1
    local with an 8-token window, run by blocks at length 32) compiles for a v5e 2x2 slice, unrolled
    (ModernBERT has no scanned encoder), on the data mesh: two compiles, the fit and one FLOP count at
    its own depth (the fsdp and tensor meshes: the next test, in the slow tier)."""
    _need_libtpu()
    (row,) = _plan_modernbert_tiny(tmp_path, "data")
    assert row["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1} and row["global_batch"] == 16 and row["layers"] == 2
    assert row["flop_count_loops"] == 0 and row["unknown_trip_counts"] == 0
    # The model's FLOPs by hand: per layer and token Wqkv 3*64*64 + Wo 64*64 + Wi 64*192 + Wo 96*64
    # (2 FLOPs a multiply-add); attention scores and context 2 * 2 * keys * 64, 32 keys in the global
    # layer and the band's 9 (4 each side) in the local one; the head at ceil(0.3 * 32) = 10
    # positions: dense 64*64, decoder 64*512; x3 for the backward; 16 rows over 4 chips.
    layer = 2 * 32 * (3 * 64 * 64 + 64 * 64 + 64 * 192 + 96 * 64)
    attention = 2 * 2 * 32 * 64 * (32 + 9)
    head = 2 * 10 * (64 * 64 + 64 * 512)
    assert row["model_flops"] == 3 * (2 * layer + attention + head) * 16 / 4 == 66_355_200
    # XLA's FLOPs (of the unrolled program) are at least the matmul count (as for BERT's test model).
    assert 1.0 <= row["xla_flops"] / row["model_flops"] < 6.0, row
    assert 0 < row["mfu"] < 1 and row["hbm_gib"] <= row["hbm_capacity_gib"]
    # Data parallel: the gradient all-reduce carries every parameter once, the tied decoder's
    # gradient apart from the lookup's (vocabulary x hidden) and a few scalars (loss sums).
    params = _modernbert_tiny_params()
    assert set(row["comm"]) == {"all-reduce"}
    extra = row["comm"]["all-reduce"]["elements"] - params - 512 * 64
    assert 0 <= extra <= 16, extra


def test_plan_modernbert_tiny_on_the_fsdp_and_tensor_meshes(tmp_path):
    """ModernBERT's parameters carry logical axis names (bert_jax/model/modernbert_axes.py), so FSDP
    gathers them and tensor parallelism reduces activations inside the group; replicated parameters
    (before issue 72's names) would gather none. What they shard: tests/pretrain/test_modernbert_sharding.py."""
    _need_libtpu()
    fsdp, tensor = _plan_modernbert_tiny(tmp_path, "fsdp,tensor")
    assert (fsdp["mesh"], tensor["mesh"]) == ({"data": 1, "fsdp": 4, "tensor": 1}, {"data": 1, "fsdp": 1, "tensor": 4})
    params = _modernbert_tiny_params()
    # Every parameter split over fsdp (all but the decoder's bias: "vocab" is tensor's) gathered at
    # least once (forward), at most three times (again for the backward, and the tied embedding for
    # both its uses).
    gathered = fsdp["comm"]["all-gather"]["elements"]
    assert params - 512 <= gathered <= 3 * (params + 512 * 64), gathered
    assert tensor["batch_comm_s"] > 0 and fsdp["batch_comm_s"] == 0
    for row in (fsdp, tensor):
        assert 0 < row["mfu"] < 1 and row["hbm_gib"] <= row["hbm_capacity_gib"] and row["flop_count_loops"] == 0


def test_flop_count_depths_and_extrapolation_by_hand():
    """`aot.counting_depths` / `aot.extrapolate`: BERT's layers are alike (1 and 2 layers, linear);
    ModernBERT-base's 22 alternate (global every 3rd: 8 global, 14 local), counted from 1, 2 and 4
    layers (a global; + a local; + a local and a global)."""
    from bert_jax.model.model_config import BertConfig
    from bert_jax.model.modernbert import ModernBertConfig
    from bert_jax.pod.planning import aot

    rest, glob, local = 5e9, 3e9, 1e9  # made-up costs of the rest of the step and of each layer kind
    mb = ModernBertConfig()
    assert aot.counting_depths(mb) == (1, 2, 4)
    counts = [{"flops": rest + glob, "bytes": 1.0}, {"flops": rest + glob + local, "bytes": 2.0},
              {"flops": rest + 2 * glob + 2 * local, "bytes": 4.0}]
    got = aot.extrapolate(counts, (1, 2, 4), mb)
    assert got["flops"] == pytest.approx(rest + 8 * glob + 14 * local, rel=1e-12)
    bert = BertConfig(num_hidden_layers=24)
    assert aot.counting_depths(bert) == (1, 2)
    got = aot.extrapolate([{"flops": 7.0, "bytes": 3.0}, {"flops": 10.0, "bytes": 5.0}], (1, 2), bert)
    assert got == pytest.approx({"flops": 7.0 + 23 * 3.0, "bytes": 3.0 + 23 * 2.0})
    shallow = ModernBertConfig(num_hidden_layers=2, global_attn_every_n_layers=2)
    assert aot.counting_depths(shallow) == (2,) and aot.extrapolate([{"flops": 4.0}], (2,), shallow) == {"flops": 4.0}


def test_modernbert_plans_every_mesh_and_its_masking_rate():
    args = planner.parse_args(["--config=configs/modernbert_tiny.py", "--seq_len=32"])
    assert args.meshes == ["data", "fsdp", "tensor"] == planner.parse_args(["--config=configs/tiny.py"]).meshes
    assert planner.parse_args(["--config=configs/modernbert_tiny.py", "--mesh=fsdp"]).meshes == ["fsdp"]
    # 30% of the row: the 308 predictions configs/modernbert_base.py sets at 1,024; BERT's 20 per 128.
    config, mcfg = planner.load_config("configs/modernbert_base.py", 1024, "bfloat16")
    assert planner.predictions_per_row(config, 1024) == config.max_predictions_per_seq == 308
    assert (mcfg.num_hidden_layers, mcfg.dtype) == (22, "bfloat16")
    assert planner.predictions_per_row(planner.load_config("configs/tiny.py", 512, "bfloat16")[0], 512) == 80
    from bert_jax.pod.planning import aot_check

    with pytest.raises(SystemExit, match="config.model_family='modernbert'.*python -m bert_jax.plan"):
        aot_check.load_configs(aot_check.parse_args(["--config=configs/modernbert_tiny.py"]))
