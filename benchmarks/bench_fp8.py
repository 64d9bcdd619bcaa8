"""The GPU step's variants side by side (bf16, tanh GELU, FP8) and FP8's loss curve against bf16's.

    python benchmarks/bench_fp8.py --config=configs/large.py --dtype=bfloat16 --attention=dot_product \\
        --seq_len=128 --batch=256 --variants=bf16,gelu_tanh,fp8,fp8_gelu_tanh [--rounds=3 --steps=5] \\
        [--json=OUT.json]
    python benchmarks/bench_fp8.py --config=configs/base.py --dtype=bfloat16 --attention=dot_product \\
        --parity=batches.npz --parity_steps=300 [--json=OUT.json]
    python benchmarks/bench_fp8.py --make_parity_batches=batches.npz --records='W/records/train/*' \\
        --seq_len=128 --batch=128 --parity_steps=300       # on a machine with tensorflow

Speed (default): every variant's step (`bench_step.py`'s, with its flags) is built in one process
from the same initial parameters and timed in alternating rounds (so all see the same machine
load); each reports its median step, sequences/s and MFU (the bf16 peak: FP8's MFU is counted
against the bf16 peak too, as NVIDIA's MLPerf reports do). For each variant the compiled program
is read: FP8 GEMMs in the optimized HLO (cuBLASLt custom calls with f8 operands) and XLA's cost
analysis (FLOPs and bytes accessed), the latter for the pod planner's calibration
(`docs/pod_planning.md`).

Variants: `bf16` (the config as is: the exact erf GELU), `gelu_tanh` (the tanh GELU that
Google's code uses since 2019, which cuBLASLt can fuse into the GEMM's epilogue), `fp8`
(`BertConfig.fp8`), `fp8_gelu_tanh` (both), `fused` (`BertConfig.fused_ops`: the Pallas
dropout + residual + LayerNorm kernels), `fused_gelu_tanh`.

`--parity`: trains the config from one initialization on the same batches (an .npz written by
`--make_parity_batches` from real pretraining records, so the GPU machine needs no tensorflow)
three times: bf16, bf16 with another dropout seed (the run-to-run noise), and FP8 with the first
seed; writes the three loss curves. FP8 tracks bf16 when its distance from the first run stays
within the second run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402  (benchmarks/ is not a package)

VARIANTS = {
    "bf16": {},
    "gelu_tanh": {"hidden_act": "gelu_tanh"},
    "fp8": {"fp8": True},
    "fp8_gelu_tanh": {"fp8": True, "hidden_act": "gelu_tanh"},
    "fused": {"fused_ops": True},
    "fused_gelu_tanh": {"fused_ops": True, "hidden_act": "gelu_tanh"},
}
BATCH_KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
              "masked_lm_weights", "next_sentence_labels")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="bf16,gelu_tanh,fp8,fp8_gelu_tanh")
    p.add_argument("--rounds", type=int, default=3, help="alternating timed rounds")
    p.add_argument("--parity", default="", help=".npz of batches: run the loss-curve comparison")
    p.add_argument("--parity_steps", type=int, default=300)
    p.add_argument("--make_parity_batches", default="", help="write this .npz from --records and stop")
    p.add_argument("--records", default="", help="pretraining TFRecords (glob) for --make_parity_batches")
    p.add_argument("--out_json", default="", help="also write the result here")
    p.add_argument("--hlo_dir", default="", help="write each variant's optimized HLO here (gzip)")
    args, rest = p.parse_known_args(argv)
    step_args = bench_step.parse_args(rest)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    return args, step_args


def make_parity_batches(args, step_args) -> dict:
    """`parity_steps` batches of `--batch` real instances, in order, as uint16/uint8 arrays."""
    import numpy as np
    from data_pipeline import input_pipeline

    batches = input_pipeline.make_eval_iterator(
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
    return {"cost_flops": float(cost.get("flops", 0.0)),
            "cost_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "cublas_gemms": len(gemms), "fp8_gemms": len(fp8)}


def speed(args, step_args) -> dict:
    import jax
    from bert_jax import pretrain, steps

    config, bert_config, mesh, batch_np, predictions = bench_step.setup(step_args)
    device = jax.devices()[0]
    peak = step_args.peak_tflops * 1e12 or pretrain.peak_flops_per_device()
    cache: dict = {}
    runners, result = {}, {"date": time.strftime("%Y-%m-%d"), "device": device.device_kind,
                           "benchmark": "bench_fp8",
                           "jax": jax.__version__, "config": step_args.config, "seq_len": step_args.seq_len,
                           "batch": step_args.batch, "attention": step_args.attention, "variants": {}}
    for name in args.variants.split(","):
        bench_step.log(f"variant {name}")
        # `bench_ours` builds the model from the BertConfig it is given (config.model unused).
        compile_info, runner = bench_step.bench_ours(step_args, config, bert_config.replace(**VARIANTS[name]),
                                                     mesh, batch_np, cache)
        runners[name] = runner
        facts = _hlo_facts(runner.step)
        if args.hlo_dir:
            import gzip
            os.makedirs(args.hlo_dir, exist_ok=True)
            with gzip.open(os.path.join(args.hlo_dir, f"{name}.hlo.txt.gz"), "wt") as f:
                f.write(runner.step.as_text())
        result["variants"][name] = {**compile_info, **facts}
        bench_step.log(f"{name}: {facts}")
    cache.clear()  # the initial state's spare copy: memory for the steps
    for runner in runners.values():
        runner.run(step_args.warmup, record=False)
    for r in range(args.rounds):
        bench_step.log(f"round {r + 1} of {args.rounds}")
        for runner in runners.values():
            runner.run(step_args.steps)
    flops = steps.train_flops_per_sequence(bert_config, step_args.seq_len, predictions) * step_args.batch
    base = None
    for name, runner in runners.items():
        row = result["variants"][name]
        row.update(step_s=runner.median, median_s=runner.median,  # median_s: bench_suite's table
                   step_min_s=min(runner.durations), loss=runner.loss,
                   sequences_per_s=step_args.batch / runner.median,
                   tflops_per_s=flops / runner.median / 1e12)
        if peak:
            row["mfu"] = flops / runner.median / peak
        base = base or runner.median
        row["speedup_vs_first"] = base / runner.median
        print(f"{name:>14}: {runner.median * 1e3:7.1f} ms  {row['sequences_per_s']:8.1f} seq/s"
              + (f"  MFU {row['mfu']:.1%}" if peak else "")
              + f"  x{row['speedup_vs_first']:.3f}  fp8 GEMMs {row['fp8_gemms']}  loss {runner.loss:.4f}",
              file=sys.stderr)
    return result


def parity(args, step_args) -> dict:
    import jax
    import numpy as np
    from bert_jax import sharding

    data = np.load(args.parity)
    n = min(args.parity_steps, data["input_ids"].shape[0])
    step_args.batch, step_args.seq_len = data["input_ids"].shape[1], data["input_ids"].shape[2]
    config, bert_config, mesh, _, _ = bench_step.setup(step_args)
    config.num_train_steps, config.warmup_steps = n, max(1, n // 10)
    device = jax.devices()[0]
    result = {"date": time.strftime("%Y-%m-%d"), "device": device.device_kind, "jax": jax.__version__,
              "benchmark": "bench_fp8 --parity", "config": step_args.config, "steps": n,
              "batch": step_args.batch, "seq_len": step_args.seq_len,
              "learning_rate": config.learning_rate, "warmup_steps": config.warmup_steps, "runs": {}}
    batches = [{k: np.asarray(data[k][i], np.float32 if k == "masked_lm_weights" else np.int32)
                for k in BATCH_KEYS} for i in range(n)]
    cache: dict = {}  # every run starts from the first one's initial parameters
    for name, fp8, seed in (("bf16", False, 0), ("bf16_seed1", False, 1), ("fp8", True, 0)):
        _, runner = bench_step.bench_ours(step_args, config, bert_config.replace(fp8=fp8), mesh,
                                          batches[0], cache)
        # The dropout seed: the same initial parameters, another stream of dropout masks.
        state = runner.state.replace(rng=jax.random.key_data(jax.random.key(seed)))
        losses, mlm_acc, times = [], [], []
        bench_step.log(f"parity run {name}: {n} steps")
        for b in batches:
            t0 = time.perf_counter()
            state, metrics = runner.step(state, sharding.to_global(b, mesh))
            losses.append(float(metrics["loss"]))  # waits for the step
            times.append(time.perf_counter() - t0)
            mlm_acc.append(float(metrics["mlm_correct"]) / max(float(metrics["mlm_weight"]), 1e-9))
        result["runs"][name] = {"loss": losses, "mlm_accuracy": mlm_acc,
                                "median_step_s": statistics.median(times[5:])}
        bench_step.log(f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                       f"median step {result['runs'][name]['median_step_s'] * 1e3:.1f} ms")
        del state, runner
    result.update(parity_summary(result["runs"]))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1), file=sys.stderr)
    return result


def parity_summary(runs: dict, window: int = 20) -> dict:
    """Mean |difference| of the loss curves (moving averages over `window` steps) over the last
    half of the run: FP8 against bf16, and bf16 against itself with another dropout seed (noise)."""
    import numpy as np

    def smooth(x):
        x = np.asarray(x, np.float64)
        return np.convolve(x, np.ones(window) / window, mode="valid")

    ref = smooth(runs["bf16"]["loss"])
    half = len(ref) // 2
    out = {}
    for name in ("bf16_seed1", "fp8"):
        out[f"{name}_vs_bf16_mean_abs_diff"] = float(np.mean(np.abs(smooth(runs[name]["loss"]) - ref)[half:]))
    out["final_loss"] = {name: float(np.mean(run["loss"][-window:])) for name, run in runs.items()}
    out["fp8_within_noise"] = out["fp8_vs_bf16_mean_abs_diff"] <= 1.5 * out["bf16_seed1_vs_bf16_mean_abs_diff"]
    return out


def main(argv=None):
    args, step_args = parse(argv)
    if args.make_parity_batches:
        print(json.dumps(make_parity_batches(args, step_args)))
        return
    result = parity(args, step_args) if args.parity else speed(args, step_args)
    if args.out_json:
        with open(args.out_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if step_args.json:  # one line, for bench_suite.py
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
