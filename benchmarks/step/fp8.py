"""The GPU step's variants side by side (bf16, tanh GELU, FP8) and FP8's loss curve against bf16's.

    python -m benchmarks.step.fp8 --config=configs/large.py --dtype=bfloat16 --attention=dot_product \\
        --seq_len=128 --batch=256 --variants=bf16,gelu_tanh,fp8,fp8_gelu_tanh [--rounds=3 --steps=5] \\
        [--json=OUT.json]
    python -m benchmarks.step.fp8 --config=configs/base.py --dtype=bfloat16 --attention=dot_product \\
        --parity=batches.npz --parity_steps=300 [--json=OUT.json]
    python -m benchmarks.step.fp8 --make_parity_batches=batches.npz --records='W/records/train/*' \\
        --seq_len=128 --batch=128 --parity_steps=300       # on a machine with tensorflow

Speed (default): every variant's step (`benchmarks.step.pretrain_step`'s, with its flags) is built in one process
from the same initial parameters and timed in alternating rounds (so all see the same machine
load); each reports its median step, sequences/s and MFU (the bf16 peak: FP8's MFU is counted
against the bf16 peak too, as NVIDIA's MLPerf reports do). For each variant the compiled program
is read: FP8 GEMMs in the optimized HLO (cuBLASLt custom calls with f8 operands) and XLA's cost
analysis (FLOPs and bytes accessed), the latter for the pod planner's calibration
(`docs/pod_planning.md`).

Variants: `bf16` (the config as is: the exact erf GELU), `gelu_tanh` (the tanh GELU that
Google's code uses since 2019; cuBLASLt has a GEMM epilogue for it, which XLA did not use on
2026-11-27), `fp8`
(`BertConfig.fp8`), `fp8_gelu_tanh` (both), `fused` (`BertConfig.fused_ops`: the Pallas
dropout + residual + LayerNorm kernels), `fused_gelu_tanh`, `fused_ffn` and `fused_ffn_gelu_tanh`
(those with `BertConfig.fused_ffn`'s GEMM + bias + GELU kernels as well), `gelu_tanh_separate_qkv` and
`fused_gelu_tanh_separate_qkv` (`BertConfig.separate_qkv`: Q, K and V as three matmuls),
`fused_qkv_gelu_tanh` and `fused_qkv_ffn_gelu_tanh` (`BertConfig.fused_qkv`'s Q/K/V GEMM kernels,
without and with the FFN's). A variant may add XLA options for its
own program after `+`, e.g. `fused_gelu_tanh+xla_gpu_enable_triton_gemm=false` (cuBLAS for every
GEMM, the biases in their epilogues); several `+`s may follow one another (benchmarks/step/RESULTS.md,
"One H100, 2026-11-27": neither that nor `xla_gpu_enable_cublaslt` changed the step).

Each variant is timed two ways: every step waited for (`step`, the figures of earlier rows), and
`--pipelined_steps` steps dispatched back to back and waited for once (`pipelined`), as
`bert_jax.main` runs them: it fetches metrics only at its log steps, so the host's dispatch of a
step overlaps the device's previous one.

`--parity`: trains the config from one initialization on the same batches (an .npz written by
`--make_parity_batches` from real pretraining records, so the GPU machine needs no tensorflow)
three times: bf16, bf16 with another dropout seed (the run-to-run noise), and FP8 with the first
seed; writes the three loss curves. FP8 tracks bf16 when its distance from the first run stays
within the second run's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import sys
import time

from benchmarks.common import gpu_lock
from benchmarks.kernels import fused_layernorm  # --kernel
from benchmarks.step import builders, pretrain_step, timing

# A variant's key that is not a BertConfig field: whether FP8 layers take their gradient's e5m2
# cast, and the FFN's first layer (unrolled, the next layer's Q/K/V projections too) its input's
# e4m3 cast, from the LayerNorm kernels (`fused_fp8.ENABLED`, read when the step is traced).
CAST_IN_KERNEL = "fp8_cast_in_kernel"

VARIANTS = {
    "bf16": {},
    "gelu_tanh": {"hidden_act": "gelu_tanh"},
    "fp8": {"fp8": True},
    "fp8_gelu_tanh": {"fp8": True, "hidden_act": "gelu_tanh"},
    "fused": {"fused_ops": True},
    "fused_gelu_tanh": {"fused_ops": True, "hidden_act": "gelu_tanh"},
    "fp8_fused_gelu_tanh": {"fp8": True, "fused_ops": True, "hidden_act": "gelu_tanh"},
    # ... with the output denses' gradient cast to e5m2 and the FFN's and Q/K/V inputs' casts to e4m3,
    # and their amax, by XLA's passes (flax's op), not by the LayerNorm kernels (bert_jax/model/kernels/fused_fp8.py):
    # what the kernels' casts save
    "fp8_fused_cast_apart_gelu_tanh": {"fp8": True, "fused_ops": True, "hidden_act": "gelu_tanh",
                                       CAST_IN_KERNEL: False},
    # + the FFN's GEMM + bias + GELU kernels (`BertConfig.fused_ffn`, bert_jax/model/kernels/fused_ffn.py)
    "fused_ffn": {"fused_ops": True, "fused_ffn": True},
    "fused_ffn_gelu_tanh": {"fused_ops": True, "fused_ffn": True, "hidden_act": "gelu_tanh"},
    # Q, K and V as three matmuls (`BertConfig.separate_qkv`: no stacked kernel, no slices)
    "gelu_tanh_separate_qkv": {"hidden_act": "gelu_tanh", "separate_qkv": True},
    "fused_gelu_tanh_separate_qkv": {"fused_ops": True, "hidden_act": "gelu_tanh", "separate_qkv": True},
    # + the Q/K/V GEMM kernels (`BertConfig.fused_qkv`, bert_jax/model/kernels/fused_qkv.py), without and
    # with the FFN's
    "fused_qkv_gelu_tanh": {"fused_ops": True, "fused_qkv": True, "hidden_act": "gelu_tanh"},
    "fused_qkv_ffn_gelu_tanh": {"fused_ops": True, "fused_qkv": True, "fused_ffn": True, "hidden_act": "gelu_tanh"},
}


def variant_spec(name: str) -> tuple[dict, dict]:
    """`NAME[+xla_option=value...]` -> (BertConfig changes, XLA compiler options)."""
    base, *options = name.split("+")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {base!r} in {name!r}; known: {', '.join(VARIANTS)}")
    xla = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key.startswith("xla_"):
            raise ValueError(f"{name!r}: {option!r} is not xla_<option>=<value>")
        lowered = value.lower()
        xla[key] = (True if lowered == "true" else False if lowered == "false"
                    else int(value) if value.lstrip("-").isdigit() else value)
    return VARIANTS[base], xla


BATCH_KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
              "masked_lm_weights", "next_sentence_labels")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="bf16,gelu_tanh,fp8,fp8_gelu_tanh")
    p.add_argument("--rounds", type=int, default=3, help="alternating timed rounds")
    p.add_argument("--pipelined_steps", type=int, default=10,
                   help="per round and variant, after the waited-for rounds: this many steps dispatched "
                        "back to back, waited for once (0: skip)")
    p.add_argument("--parity", default="", help=".npz of batches: run the loss-curve comparison")
    p.add_argument("--parity_steps", type=int, default=300)
    p.add_argument("--make_parity_batches", default="", help="write this .npz from --records and stop")
    p.add_argument("--records", default="", help="pretraining TFRecords (glob) for --make_parity_batches")
    p.add_argument("--out_json", default="", help="also write the result here")
    p.add_argument("--hlo_dir", default="", help="write each variant's optimized HLO here (gzip)")
    p.add_argument("--parallel_compile", action="store_true",
                   help="lower every variant, then compile them all at once in threads")
    p.add_argument("--gpu_lock", default="",
                   help="a file to hold locked (flock) while timing or stepping, so that two processes "
                        "sharing one GPU compile side by side but never time at once")
    p.add_argument("--slot_lock", default="",
                   help="a file locked from the first timed step to the process's exit: processes that each "
                        "need most of the GPU's memory for their steps compile side by side, then step one "
                        "after the other")
    p.add_argument("--plot", default="", help="a --parity result (JSON): draw its curves beside it (.png) and stop")
    p.add_argument("--profile_variants", default="", help="with --profile_dir: only these (comma-separated)")
    p.add_argument("--kernel", action="store_true",
                   help="time the fused dropout + residual + LayerNorm kernel against XLA's passes "
                        "(forward + backward, --batch x --seq_len rows of the config's hidden size) and "
                        "check both against a float32 reference")
    p.add_argument("--kernel_iters", type=int, default=50)
    p.add_argument("--kernel_sweep", default="",
                   help="with --kernel: first time each pass alone over a set of launch shapes (rows per "
                        "program, warps, the backward's rows per step), keep the fastest of each and write "
                        "them to this JSON file")
    p.add_argument("--fused_blocks_from", default="",
                   help="a JSON file written by --kernel_sweep: the fused kernels' launch shapes (waits up to "
                        "--fused_blocks_wait s for it, e.g. from a sweep running beside; else the defaults)")
    p.add_argument("--fused_blocks_wait", type=float, default=150.0)
    p.add_argument("--fused_ffn_blocks_from", default="",
                   help="a JSON file written by benchmarks.kernels.fused_ffn --sweep: the FFN kernels' launch shapes "
                        "(if it exists; else the defaults)")
    p.add_argument("--fused_qkv_blocks_from", default="",
                   help="a JSON file written by benchmarks.kernels.fused_qkv --sweep: the Q/K/V kernels' launch shapes "
                        "(if it exists; else the defaults)")
    args, rest = p.parse_known_args(argv)
    step_args = pretrain_step.parse_args(rest)
    for v in args.variants.split(","):
        try:
            variant_spec(v)
        except ValueError as e:
            p.error(f"--variants: {e}")
    return args, step_args


def make_parity_batches(args, step_args) -> dict:
    """`parity_steps` batches of `--batch` real instances, in order, as uint16/uint8 arrays."""
    import numpy as np
    from data_pipeline.input import evaluation

    batches = evaluation.make_eval_iterator(
        args.records, per_host_batch_size=step_args.batch, max_seq_length=step_args.seq_len,
        max_predictions_per_seq=step_args.predictions or max(1, round(step_args.seq_len * 20 / 128)))
    rows = {k: [] for k in BATCH_KEYS}
    for i, batch in enumerate(batches):
        if i == args.parity_steps:
            break
        for k in BATCH_KEYS:
            rows[k].append(batch[k])
    if len(rows["input_ids"]) < args.parity_steps:
        raise SystemExit(f"{args.records}: only {len(rows['input_ids'])} batches of {step_args.batch}, "
                         f"--parity_steps={args.parity_steps} asked")
    small = {"input_ids": np.uint16, "masked_lm_ids": np.uint16, "masked_lm_positions": np.uint16,
             "input_mask": np.uint8, "segment_ids": np.uint8, "next_sentence_labels": np.uint8,
             "masked_lm_weights": np.float32}
    out = {k: np.stack(v).astype(small[k]) for k, v in rows.items()}
    np.savez_compressed(args.make_parity_batches, **out)
    return {k: list(v.shape) for k, v in out.items()}


def _hlo_facts(compiled) -> dict:
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    gemms = re.findall(r'custom_call_target="(__cublas\$lt\$matmul[^"]*|__cublas\$gemm)"', text)
    # cuBLASLt's FP8 GEMMs (XLA's gemm rewriter), and any GEMM-like instruction reading f8 operands.
    fp8 = [line for line in text.splitlines()
           if "__cublas$lt$matmul$f8" in line
           or ("f8e4m3fn" in line and ("__cublas" in line or "triton_gemm" in line or " dot(" in line))]
    lines = text.splitlines()
    epilogues: dict = {}  # cuBLASLt epilogues XLA fused into GEMMs (BIAS, GELU, GELU_AUX, ...)
    for line in lines:
        if "__cublas$lt$matmul" in line:
            m = re.search(r'"epilogue":"([A-Z_]+)"', line)
            key = m.group(1) if m else "?"
            epilogues[key] = epilogues.get(key, 0) + 1
    return {"cost_flops": float(cost.get("flops", 0.0)),
            "cost_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "cublas_gemms": len(gemms), "fp8_gemms": len(fp8),
            # Fusions XLA emits with Triton (GEMM fusions among them; the kind's name varies by version).
            "triton_fusions": sum(bool(re.search(r'"kind":"__triton', line)) for line in lines),
            "cublaslt_epilogues": epilogues}


def speed(args, step_args) -> dict:
    import jax
    from bert_jax.model.kernels import fused_fp8
    from bert_jax.pretrain import steps
    from bert_jax.training import run_setup

    config, bert_config, mesh, batch_np, predictions = pretrain_step.setup(step_args)
    device = jax.devices()[0]
    peak = step_args.peak_tflops * 1e12 or run_setup.peak_flops_per_device()
    cache: dict = {}
    runners, result = {}, {"date": time.strftime("%Y-%m-%d"), "device": device.device_kind,
                           "benchmark": "bench_fp8",
                           "jax": jax.__version__, "config": step_args.config, "seq_len": step_args.seq_len,
                           "batch": step_args.batch, "attention": step_args.attention,
                           "layers": bert_config.num_hidden_layers, "scan": step_args.scan,
                           "packing": step_args.packing, "parallel_compile": args.parallel_compile,
                           "variants": {}}
    for name in args.variants.split(","):
        timing.log(f"variant {name}")
        changes, xla = variant_spec(name)
        if changes.get("fused_ops") and args.fused_blocks_from and "fused_blocks" not in result:
            result["fused_blocks"] = _load_fused_blocks(args.fused_blocks_from, args.fused_blocks_wait)
        if changes.get("fused_ffn") and args.fused_ffn_blocks_from and "fused_ffn_blocks" not in result:
            result["fused_ffn_blocks"] = _load_gemm_blocks(args.fused_ffn_blocks_from, "fused_ffn",
                                                           {"forward": "FORWARD", "backward": "BACKWARD"})
        if changes.get("fused_qkv") and args.fused_qkv_blocks_from and "fused_qkv_blocks" not in result:
            result["fused_qkv_blocks"] = _load_gemm_blocks(
                args.fused_qkv_blocks_from, "fused_qkv",
                {"forward": "FORWARD", "backward_input": "BACKWARD_INPUT", "backward_weights": "BACKWARD_WEIGHTS"})
        changes = dict(changes)
        fused_fp8.ENABLED = changes.pop(CAST_IN_KERNEL, True)
        # `bench_ours` builds the model from the BertConfig it is given (config.model unused), and
        # traces and lowers the step (the module flag above is read then).
        compile_info, runner = builders.bench_ours(step_args, config, bert_config.replace(**changes),
                                                mesh, batch_np, cache, compile=not args.parallel_compile,
                                                compiler_options=xla)
        fused_fp8.ENABLED = True
        runners[name] = runner
        result["variants"][name] = dict(compile_info, xla_options=xla)
    if args.parallel_compile:
        timing.compile_runners(runners, result["variants"])
    for name, runner in runners.items():
        facts = _hlo_facts(runner.step)
        if args.hlo_dir:
            import gzip
            os.makedirs(args.hlo_dir, exist_ok=True)
            with gzip.open(os.path.join(args.hlo_dir, f"{name}.hlo.txt.gz"), "wt") as f:
                f.write(runner.step.as_text())
        result["variants"][name].update(facts)
        timing.log(f"{name}: {facts}")
    cache.clear()  # the initial state's spare copy: memory for the steps
    gpu_lock.hold_until_exit(args.slot_lock)
    with gpu_lock.Lock(args.gpu_lock):
        for runner in runners.values():
            runner.run(step_args.warmup, record=False)
        for r in range(args.rounds):
            timing.log(f"round {r + 1} of {args.rounds}")
            for runner in runners.values():
                runner.run(step_args.steps)
        for r in range(args.rounds if args.pipelined_steps > 0 else 0):
            timing.log(f"pipelined round {r + 1} of {args.rounds}: {args.pipelined_steps} steps each")
            for runner in runners.values():
                runner.run_pipelined(args.pipelined_steps)
        if step_args.profile_dir:  # pretrain_step's flag: a subfolder per variant
            chosen = args.profile_variants.split(",") if args.profile_variants else list(runners)
            for name, runner in ((n, r) for n, r in runners.items() if n in chosen):
                result["variants"][name]["profile"] = timing.profile(
                    runner, os.path.join(step_args.profile_dir, name), step_args.profile_steps)
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:  # this process's, all variants' states included
        result["peak_gb_in_use"] = stats["peak_bytes_in_use"] / 1e9
    flops = steps.train_flops_per_sequence(bert_config, step_args.seq_len, predictions) * step_args.batch
    sequences = step_args.batch * (3 if step_args.packing else 1)  # pretrain_step's packed rows: 3 each
    base = pipe_base = None
    for name, runner in runners.items():
        row = result["variants"][name]
        row.update(step_s=runner.median, median_s=runner.median,  # median_s: benchmarks.suite's table
                   step_min_s=min(runner.durations), loss=runner.loss,
                   sequences_per_s=sequences / runner.median,
                   tflops_per_s=flops / runner.median / 1e12)
        if peak:
            row["mfu"] = flops / runner.median / peak
        base = base or runner.median
        row["speedup_vs_first"] = base / runner.median
        pipelined = ""
        if runner.pipelined:
            p_s = statistics.median(runner.pipelined)
            row.update(pipelined_step_s=p_s, pipelined_sequences_per_s=sequences / p_s)
            if peak:
                row["pipelined_mfu"] = flops / p_s / peak
            pipe_base = pipe_base or p_s
            row["pipelined_speedup_vs_first"] = pipe_base / p_s
            pipelined = (f"  | pipelined {p_s * 1e3:6.1f} ms {sequences / p_s:8.1f} seq/s"
                         + (f" MFU {row['pipelined_mfu']:.1%}" if peak else "")
                         + f" x{row['pipelined_speedup_vs_first']:.3f}")
        print(f"{name:>16}: {runner.median * 1e3:7.1f} ms  {row['sequences_per_s']:8.1f} seq/s"
              + (f"  MFU {row['mfu']:.1%}" if peak else "")
              + f"  x{row['speedup_vs_first']:.3f}  fp8 GEMMs {row['fp8_gemms']}  loss {runner.loss:.4f}"
              + f"  compile {row['compile_s']:.0f} s" + pipelined, file=sys.stderr)
    return result


def _load_gemm_blocks(path: str, module: str, attributes: dict) -> dict:
    """Sets the GEMM kernels' launch shapes (`bert_jax.model.<module>`, `attributes`: the sweep
    file's key -> the module's attribute) from a `benchmarks.kernels.fused_ffn`/`benchmarks.kernels.fused_qkv --sweep`
    file, if there is one; returns the shapes in use."""
    kernels = importlib.import_module(f"bert_jax.model.{module}")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            best = json.load(f)
        for key, attribute in attributes.items():
            setattr(kernels, attribute, best[key])
    shapes = {key: getattr(kernels, attribute) for key, attribute in attributes.items()}
    timing.log(f"{module} launch shapes: {shapes}")
    return shapes


def _load_fused_blocks(path: str, wait_s: float) -> dict:
    """Sets `fused.FORWARD`/`BACKWARD` from a --kernel_sweep file, once it exists."""
    from bert_jax.model.kernels import fused

    t0 = time.perf_counter()
    while not os.path.exists(path) and time.perf_counter() - t0 < wait_s:
        time.sleep(1.0)
    best = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            best = json.load(f)
    if not best.get("forward") or not best.get("backward"):  # not written in time, or the sweep found none
        timing.log(f"{path}: no launch shapes after {wait_s:.0f} s at most; the kernels' defaults")
        return {"forward": dict(fused.FORWARD), "backward": dict(fused.BACKWARD), "from": "defaults"}
    fused.FORWARD, fused.BACKWARD = dict(best["forward"]), dict(best["backward"])
    timing.log(f"fused launch shapes from {path}: {best['forward']} / {best['backward']}")
    return {"forward": fused.FORWARD, "backward": fused.BACKWARD, "from": path}


def parity(args, step_args) -> dict:
    import jax
    import numpy as np
    from bert_jax.training import sharding

    data = np.load(args.parity)
    n = min(args.parity_steps, data["input_ids"].shape[0])
    step_args.batch, step_args.seq_len = data["input_ids"].shape[1], data["input_ids"].shape[2]
    config, bert_config, mesh, _, _ = pretrain_step.setup(step_args)
    config.num_train_steps, config.warmup_steps = n, max(1, n // 10)
    device = jax.devices()[0]
    result = {"date": time.strftime("%Y-%m-%d"), "device": device.device_kind, "jax": jax.__version__,
              "benchmark": "bench_fp8 --parity", "config": step_args.config, "steps": n,
              "scan": step_args.scan, "prng": step_args.prng,
              "batch": step_args.batch, "seq_len": step_args.seq_len,
              "learning_rate": config.learning_rate, "warmup_steps": config.warmup_steps, "runs": {}}
    batches = [{k: np.asarray(data[k][i], np.float32 if k == "masked_lm_weights" else np.int32)
                for k in BATCH_KEYS} for i in range(n)]
    cache: dict = {}  # every run starts from the first one's initial parameters
    compiled: dict = {}  # fp8 -> the compiled step (the second bf16 run reuses the first's)
    for name, fp8, seed in (("bf16", False, 0), ("bf16_seed1", False, 1), ("fp8", True, 0)):
        info, runner = builders.bench_ours(step_args, config, bert_config.replace(fp8=fp8), mesh,
                                        batches[0], cache, compile=fp8 not in compiled)
        compiled.setdefault(fp8, runner.step)
        # The dropout seed: the same initial parameters, another stream of dropout masks.
        state = runner.state.replace(rng=jax.random.key_data(jax.random.key(seed)))
        step = compiled[fp8]
        losses, mlm_acc, times = [], [], []
        timing.log(f"parity run {name}: {n} steps")
        with gpu_lock.Lock(args.gpu_lock):
            for b in batches:
                t0 = time.perf_counter()
                state, metrics = step(state, sharding.to_global(b, mesh))
                losses.append(float(metrics["loss"]))  # waits for the step
                times.append(time.perf_counter() - t0)
                mlm_acc.append(float(metrics["mlm_correct"]) / max(float(metrics["mlm_weight"]), 1e-9))
        result["runs"][name] = {"loss": losses, "mlm_accuracy": mlm_acc, "compile_s": info.get("compile_s"),
                                "median_step_s": statistics.median(times[5:])}
        timing.log(f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                f"median step {result['runs'][name]['median_step_s'] * 1e3:.1f} ms")
        del state, runner
    result.update(parity_summary(result["runs"]))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1), file=sys.stderr)
    return result


def parity_summary(runs: dict) -> dict:
    """How far FP8's loss curve is from bf16's, against how far bf16 is from itself with another
    dropout seed (the run-to-run noise): the median over steps of the per-step |difference|, in
    each half of the run. Medians, because a single-step loss spike (seen in bf16 runs) would
    dominate a mean. FP8 tracks bf16 when its second-half median is within 1.5x the noise's."""
    import numpy as np

    ref = np.asarray(runs["bf16"]["loss"], np.float64)
    half = len(ref) // 2
    out = {}
    for name in ("bf16_seed1", "fp8"):
        diff = np.abs(np.asarray(runs[name]["loss"], np.float64) - ref)
        out[f"{name}_vs_bf16_median_abs_diff"] = [float(np.median(diff[:half])), float(np.median(diff[half:]))]
    out["final_loss"] = {name: float(np.median(run["loss"][-20:])) for name, run in runs.items()}
    out["fp8_within_noise"] = (out["fp8_vs_bf16_median_abs_diff"][1]
                               <= 1.5 * out["bf16_seed1_vs_bf16_median_abs_diff"][1])
    return out


def _rolling_median(x, window: int):
    import numpy as np

    x = np.asarray(x, np.float64)
    return np.median(np.lib.stride_tricks.sliding_window_view(x, window), axis=1)


def plot_parity(result: dict, path: str, window: int = 21) -> None:
    """The three loss curves of a --parity result and FP8's and the second seed's per-step
    difference from the first bf16 run (rolling medians over `window` steps), as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = result["runs"]
    steps = np.arange(len(runs["bf16"]["loss"]))[window // 2: len(runs["bf16"]["loss"]) - window // 2]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    styles = {"bf16": ("bf16", "C0"), "bf16_seed1": ("bf16, other dropout seed", "C1"),
              "fp8": ("FP8 (delayed scaling)", "C2")}
    for name, (label, color) in styles.items():
        top.plot(steps, _rolling_median(runs[name]["loss"], window), label=label, color=color, lw=1.2)
    top.set_ylabel(f"loss (rolling median, {window} steps)")
    top.legend()
    top.set_title(f"{result['config']}, batch {result['batch']} x {result['seq_len']}, {result['device']}")
    ref = np.asarray(runs["bf16"]["loss"], np.float64)
    for name in ("bf16_seed1", "fp8"):
        label, color = styles[name]
        bottom.plot(steps, _rolling_median(np.asarray(runs[name]["loss"]) - ref, window),
                    label=label + " - bf16", color=color, lw=1.0)
    bottom.axhline(0.0, color="grey", lw=0.5)
    bottom.set_ylabel("difference")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args, step_args = parse(argv)
    if args.plot:
        with open(args.plot, encoding="utf-8") as f:
            plot_parity(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return
    if args.make_parity_batches:
        print(json.dumps(make_parity_batches(args, step_args)))
        return
    result = (parity(args, step_args) if args.parity else fused_layernorm.kernel(args, step_args) if args.kernel
              else speed(args, step_args))
    if args.out_json:
        with open(args.out_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if step_args.json:  # one line, for benchmarks.suite
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
