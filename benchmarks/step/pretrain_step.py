"""Pretraining step throughput: sequences/s, tokens/s, TFLOP/s, MFU and compile time, on CPU, GPU or TPU.

    python -m benchmarks.step.pretrain_step --config=configs/base.py --seq_len=128 --batch=32 \\
        [--dtype=bfloat16 --attention=dot_product --scan --remat=dots --packing] [--steps=20] \\
        [--hf] [--compile_only] [--json]

Times the jitted, sharded `bert_jax.pretrain.steps.train_step` (the one `pretrain.run` compiles: AdamW,
clipping, dropout on, state donated) after compilation, on inputs already on the device; the
median of `--steps` steps, each waited for. FLOPs are the analytic matmul count
(`steps.train_flops_per_sequence`: the MLM head at the masked positions only, the last layer at
every position even though `sparse_last_layer` computes fewer); MFU divides the
achieved rate by the devices' peak (bf16 for bfloat16 runs; `--peak_tflops` overrides, and is
needed on CPU, or `--measure_peak` times a square matmul in the run's dtype and uses its rate).
The script also counts the matmul FLOPs each step really executes (ours with the sparse last
layer; HF's with its MLM head at every position) and, with `--measure_peak`, the share of the
step's time that those matmuls would take at the measured rate: how close each step is to
matmul-bound, and so how far any ratio between the two can go.

`--hf` also times HuggingFace's `FlaxBertForPreTraining` (transformers<5) in the same process on
the same config, batch, inputs, optimizer and dtype, with the same losses (its MLM logits are
computed at every position, then gathered), and reports our speed over its speed; the timed
rounds alternate between the two so that both see the same machine load.

`--hf_process` times HF's step in a fresh process of its own instead (this script with `--hf_only`
and `--host_memory=false`: glibc's default malloc, as a transformers user runs it), between the two
halves of our rounds; ours runs with `--host_memory` as `bert_jax.main` sets it (default `auto`:
freed buffers kept for the next step on a CPU-only machine).

`--packing` builds rows of 3 sequences each (pack_ids, restarted position_ids, one [CLS] per
sequence) and reports effective (non-pad) tokens/s; unpacked rows are all real tokens.
`--attention=dot_product` (cuDNN fused attention on GPUs) runs without attention-probability
dropout, which the fused kernel does not have.

`--profile_dir=DIR` traces `--profile_steps` more steps with `jax.profiler` after the timing and
adds to the result (and logs) the device time per step by kind and the top kernels
(`benchmarks.common.trace_summary`); `XLA_FLAGS=--xla_dump_to=... --xla_dump_hlo_as_text` beside it gives the
optimized HLO that maps the kernels' names to the model's ops.

This module holds the flags, the run's setup and the report; the steps are built in
`benchmarks.step.builders` and timed with `benchmarks.step.timing`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from benchmarks.step import builders, timing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(path: str):
    """`--config`: a file, or a config's name (`base`, `configs/base.py`) from any folder."""
    from bert_jax.config_overrides import load_config as load_config_file
    return load_config_file(path, module_name="bench_config")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/base.py")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences or packed rows)")
    p.add_argument("--predictions", type=int, default=0, help="masked positions per row (0: 20 per 128 tokens)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attention", default="einsum", choices=["einsum", "dot_product"])
    p.add_argument("--scan", action="store_true", help="nn.scan over layers")
    p.add_argument("--remat", default="none", choices=["none", "full", "dots", "dots_no_batch"])
    p.add_argument("--packing", action="store_true")
    p.add_argument("--prng", default="threefry2x32", choices=["threefry2x32", "rbg", "unsafe_rbg"],
                   help="random-bit generator of dropout (config.prng_impl)")
    p.add_argument("--no_dropout", action="store_true", help="dropout off (its cost, measured)")
    p.add_argument("--hidden_act", default="", help="override the config's activation (e.g. gelu_tanh)")
    p.add_argument("--fp8", action="store_true", help="FP8 matmuls with delayed scaling (BertConfig.fp8)")
    p.add_argument("--mixed_matmuls", action="store_true",
                   help="every matmul with bf16 inputs and float32 outputs in a float32 model (BertConfig.mixed_matmuls)")
    p.add_argument("--dense_last_layer", action="store_true",
                   help="config.model.sparse_last_layer=False: the last layer at every position")
    p.add_argument("--layers", type=int, default=0, help="override num_hidden_layers")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="timed rounds of --steps (alternating with --hf)")
    p.add_argument("--hf", action="store_true", help="also time transformers' FlaxBertForPreTraining")
    p.add_argument("--hf_process", action="store_true",
                   help="time transformers' step in a process of its own with glibc's default malloc (as its "
                        "users run it), between the two halves of our rounds")
    p.add_argument("--hf_only", action="store_true", help="time transformers' step alone (what --hf_process runs)")
    p.add_argument("--host_memory", default="auto", choices=["auto", "true", "false"],
                   help="config.keep_freed_host_memory, as bert_jax.main applies it (bert_jax/training/host_memory.py)")
    p.add_argument("--compile_only", action="store_true", help="lower + compile, report the time, stop")
    p.add_argument("--peak_tflops", type=float, default=0.0, help="per-device peak (default: known devices)")
    p.add_argument("--measure_peak", action="store_true",
                   help="time a square matmul in --dtype on the device and use its rate as the peak "
                        "(CPUs have no table entry); also reports each step's share of its matmul-bound time")
    p.add_argument("--profile_dir", default="",
                   help="after timing, trace --profile_steps steps with jax.profiler into this folder and "
                        "sum the device time by kernel and kind (benchmarks/common/trace_summary.py)")
    p.add_argument("--profile_steps", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--hf_pipelined_steps", type=int, default=0,
                   help="with --hf_only: after the waited-for rounds, --rounds rounds of this many steps "
                        "dispatched back to back and waited for once (as benchmarks.step.fp8 --pipelined_steps)")
    p.add_argument("--hf_gpu_lock", default="",
                   help="with --hf_only: a file held locked (flock) while timing, so that a process sharing the "
                        "GPU (benchmarks.step.fp8 --gpu_lock) never times at once")
    return p.parse_args(argv)


def make_batch(rng, batch, seq_len, predictions, vocab, packing):
    import numpy as np
    ids = rng.integers(5, vocab, (batch, seq_len))
    b = dict(input_ids=ids, input_mask=np.ones_like(ids), segment_ids=np.zeros_like(ids),
             masked_lm_positions=np.sort(rng.choice(np.arange(1, seq_len), (batch, predictions)), axis=1),
             masked_lm_weights=np.ones((batch, predictions), np.float32))
    b["masked_lm_ids"] = rng.integers(5, vocab, (batch, predictions))
    b["segment_ids"][:, seq_len // 2:] = 1
    if not packing:
        b["next_sentence_labels"] = rng.integers(0, 2, (batch, 1))
        return {k: np.asarray(v, np.float32 if k == "masked_lm_weights" else np.int32) for k, v in b.items()}
    # 3 sequences per row with random lengths, the rest padding.
    seqs = 3
    pack = np.zeros((batch, seq_len), np.int32)
    pos = np.zeros((batch, seq_len), np.int32)
    cls = np.zeros((batch, seqs), np.int32)
    mask = np.zeros((batch, seq_len), np.int32)
    for r in range(batch):
        cuts = np.sort(rng.choice(np.arange(8, seq_len - 8), seqs - 1, replace=False))
        end = rng.integers(int(seq_len * 0.85), seq_len + 1)
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [end]])
        for s, (a, e) in enumerate(zip(starts, ends)):
            pack[r, a:e] = s + 1
            pos[r, a:e] = np.arange(e - a)
            cls[r, s] = a
        mask[r, :end] = 1
    b.update(input_mask=mask, pack_ids=pack, position_ids=pos, cls_positions=cls,
             next_sentence_labels=rng.integers(0, 2, (batch, seqs)),
             next_sentence_weights=np.ones((batch, seqs), np.float32))
    b["masked_lm_weights"] = (np.take_along_axis(mask, b["masked_lm_positions"], 1) > 0).astype(np.float32)
    return {k: np.asarray(v, np.float32 if k.endswith("weights") else np.int32) for k, v in b.items()}


def setup(args):
    """The run's config, model config, one-axis data mesh and host batch, from the flags."""
    import jax
    import numpy as np
    from bert_jax.model.model_config import BertConfig
    from bert_jax.training import sharding

    config = load_config(args.config)
    jax.config.update("jax_default_prng_impl", args.prng)
    config.model.dtype = args.dtype
    if args.no_dropout:
        config.model.hidden_dropout_prob = config.model.attention_probs_dropout_prob = 0.0
    config.model.attention_impl = args.attention
    if args.attention == "dot_product":  # the fused kernel has no attention-probability dropout
        config.model.attention_probs_dropout_prob = 0.0
    config.model.scan_layers = args.scan
    config.model.sparse_last_layer = not args.dense_last_layer
    config.model.remat_policy = args.remat
    if args.layers:
        config.model.num_hidden_layers = args.layers
    if args.hidden_act:
        config.model.hidden_act = args.hidden_act
    config.model.fp8 = args.fp8
    config.model.mixed_matmuls = args.mixed_matmuls
    config.global_batch_size = args.batch
    config.max_seq_length = args.seq_len
    predictions = args.predictions or max(1, round(args.seq_len * 20 / 128))
    bert_config = BertConfig.from_dict(config.model.to_dict())
    mesh = sharding.create_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    batch_np = make_batch(np.random.default_rng(0), args.batch, args.seq_len, predictions,
                          bert_config.vocab_size, args.packing)
    return config, bert_config, mesh, batch_np, predictions


def hf_alone(args) -> dict:
    """`--hf_only`: HF's step timed alone (warm-up, then `--rounds` x `--steps`), printed as JSON."""
    config, bert_config, _, batch_np, _ = setup(args)
    hf, runner = builders.bench_hf(args, config, bert_config, batch_np)
    lock = None
    if args.hf_gpu_lock:
        import fcntl
        lock = open(args.hf_gpu_lock, "a+")
        fcntl.flock(lock, fcntl.LOCK_EX)
    runner.run(args.warmup, record=False)
    for _ in range(args.rounds):
        runner.run(args.steps)
    for _ in range(args.rounds if args.hf_pipelined_steps else 0):
        runner.run_pipelined(args.hf_pipelined_steps)
    if lock is not None:
        lock.close()
    result = {"hf_step_s": runner.median, "hf_compile_s": hf["compile_s"], "hf_loss": runner.loss,
              "hf_timed_steps": len(runner.durations), "hf_sequences_per_s": args.batch / runner.median}
    if runner.pipelined:
        result["hf_pipelined_step_s"] = statistics.median(runner.pipelined)
        result["hf_pipelined_sequences_per_s"] = args.batch / result["hf_pipelined_step_s"]
    print(json.dumps(result))
    return result


def hf_in_its_own_process(argv: list) -> dict:
    """HF's step timed by a fresh process of this script (`--hf_only --host_memory=false`)."""
    import subprocess

    drop = ("--hf", "--hf_process", "--json", "--measure_peak", "--host_memory", "--profile_dir")
    flags = [a for a in argv if a.split("=")[0] not in drop]
    timing.log("timing HF's step in a process of its own")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step.pretrain_step", *flags, "--hf_only",
                           "--host_memory=false"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"HF's process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from bert_jax.training import host_memory  # before JAX starts its threads, as bert_jax.main
    memory = host_memory.configure(args.host_memory)
    timing.log(f"host memory: {memory}")
    if args.hf_only:
        return hf_alone(args)
    import jax
    from bert_jax.model import modeling
    from bert_jax.pretrain import steps
    from bert_jax.training import run_setup

    config, bert_config, mesh, batch_np, predictions = setup(args)
    if args.packing and (args.hf or args.hf_process):
        raise SystemExit("--hf does not support --packing (HF's BERT has no packed attention)")
    if args.hf and args.hf_process:
        raise SystemExit("--hf (in this process) or --hf_process (in its own), not both")

    device = jax.devices()[0]
    peak = run_setup.peak_flops_per_device()
    if peak and args.dtype == "float32" and device.platform == "gpu":
        peak = None  # the table holds bf16 peaks; fp32 MFU on GPU needs --peak_tflops or --measure_peak
    timing.log(f"{jax.device_count()} x {device.device_kind}; setting up")
    measured_peak = timing.measure_matmul_peak(args.dtype) if args.measure_peak else None
    peak = args.peak_tflops * 1e12 or measured_peak or peak
    result = {
        "date": time.strftime("%Y-%m-%d"), "device": device.device_kind, "platform": device.platform,
        "num_devices": jax.device_count(), "host_cpus": os.cpu_count(), "python": platform.python_version(),
        "jax": jax.__version__, "config": args.config, "layers": bert_config.num_hidden_layers,
        "hidden": bert_config.hidden_size, "seq_len": args.seq_len, "batch": args.batch,
        "predictions": predictions, "dtype": args.dtype, "attention": args.attention, "scan": args.scan,
        "remat": args.remat, "packing": args.packing, "prng": args.prng,
        "dropout": not args.no_dropout, "hidden_act": bert_config.hidden_act, "fp8": bert_config.fp8,
        "mixed_matmuls": bert_config.mixed_matmuls,
        "host_memory": memory,
    }
    # The positions the last layer computes: the masked ones and each row's [CLS] (3 when packed).
    queries = modeling.last_layer_queries(bert_config, args.seq_len, predictions, 3 if args.packing else 1)
    result["sparse_last_layer"] = queries is not None
    if measured_peak:
        result["matmul_peak_tflops"] = measured_peak / 1e12
    ours, runner = builders.bench_ours(args, config, bert_config, mesh, batch_np)
    result.update(ours)
    tokens = int(batch_np["input_mask"].sum())
    sequences = args.batch * (3 if args.packing else 1)
    if not args.compile_only:
        hf_runner = None
        if args.hf:
            hf, hf_runner = builders.bench_hf(args, config, bert_config, batch_np)
            result["hf_compile_s"] = hf["compile_s"]
        # Rounds alternate ours and HF so that both see the same machine load.
        timing.log(f"{args.warmup} warm-up step(s)")
        runner.run(args.warmup, record=False)
        if hf_runner:
            hf_runner.run(args.warmup, record=False)
        hf_alone_result = None
        for r in range(args.rounds):
            if args.hf_process and r == (args.rounds + 1) // 2:
                hf_alone_result = hf_in_its_own_process(argv)
            timing.log(f"timing round {r + 1} of {args.rounds}: {args.steps} step(s)")
            runner.run(args.steps)
            if hf_runner:
                hf_runner.run(args.steps)
        if args.hf_process and hf_alone_result is None:  # one round: HF's after ours
            hf_alone_result = hf_in_its_own_process(argv)
        timing.log(f"done: median step {runner.median * 1e3:.1f} ms")
        ours["step_s"] = result["step_s"] = runner.median
        result["loss"] = runner.loss
        flops = steps.train_flops_per_sequence(bert_config, args.seq_len, predictions) * args.batch
        result.update(sequences_per_s=sequences / ours["step_s"], tokens_per_s=tokens / ours["step_s"],
                      tflops_per_s=flops / ours["step_s"] / 1e12, timed_steps=len(runner.durations))
        if peak:
            result["mfu"] = flops / ours["step_s"] / (peak * jax.device_count())
        # What each step executes: ours with the sparse last layer where it applies, HF's with its
        # MLM head at every position.
        executed = steps.train_flops_per_sequence(
            bert_config, args.seq_len, predictions, last_layer_positions=queries) * args.batch
        result["executed_tflop"] = executed / 1e12
        if measured_peak:
            result["matmul_bound_share"] = executed / (measured_peak * jax.device_count()) / ours["step_s"]
        if hf_runner or hf_alone_result:
            hf_step = hf_runner.median if hf_runner else hf_alone_result["hf_step_s"]
            if hf_alone_result:
                result.update(hf_compile_s=hf_alone_result["hf_compile_s"], hf_process="own, glibc's default malloc")
            hf_executed = steps.train_flops_per_sequence(bert_config, args.seq_len, args.seq_len) * args.batch
            result.update(hf_step_s=hf_step, hf_loss=hf_runner.loss if hf_runner else hf_alone_result["hf_loss"],
                          hf_sequences_per_s=sequences / hf_step,
                          speedup_vs_hf=hf_step / ours["step_s"], hf_executed_tflop=hf_executed / 1e12,
                          executed_flop_ratio_hf_over_ours=hf_executed / executed)
            if measured_peak:
                result["hf_matmul_bound_share"] = hf_executed / measured_peak / hf_step
        if args.profile_dir:
            result["profile"] = timing.profile(runner, args.profile_dir, args.profile_steps)
    if args.json:
        print(json.dumps(result))
        return result
    print(f"{result['device']} x{result['num_devices']}  L={result['layers']} H={result['hidden']} "
          f"T={args.seq_len} batch={args.batch} {args.dtype} attention={args.attention} scan={args.scan} "
          f"remat={args.remat} packing={args.packing} prng={args.prng} dropout={not args.no_dropout} "
          f"sparse_last_layer={result['sparse_last_layer']}")
    print(f"  compile {ours['compile_s']:.1f} s (lower {ours['lower_s']:.1f} s)")
    if "step_s" in ours:
        print(f"  step {ours['step_s'] * 1e3:.1f} ms: {result['sequences_per_s']:.1f} sequences/s, "
              f"{result['tokens_per_s']:,.0f} tokens/s, {result['tflops_per_s']:.2f} TFLOP/s"
              + (f", MFU {result['mfu']:.1%}" if "mfu" in result else ""))
        print(f"  executes {result['executed_tflop'] * 1e3:.1f} GFLOP of matmuls per step"
              + (f"; measured {args.dtype} matmul peak {result['matmul_peak_tflops']:.3f} TFLOP/s per device, "
                 f"step at {result['matmul_bound_share']:.0%} of its matmul-bound time"
                 if measured_peak else ""))
    if "hf_step_s" in result:
        print(f"  HF FlaxBertForPreTraining{' (own process)' if args.hf_process else ''}: "
              f"step {result['hf_step_s'] * 1e3:.1f} ms "
              f"({result['hf_sequences_per_s']:.1f} sequences/s); ours is {result['speedup_vs_hf']:.2f}x")
        print(f"  HF executes {result['hf_executed_tflop'] * 1e3:.1f} GFLOP of matmuls per step "
              f"({result['executed_flop_ratio_hf_over_ours']:.2f}x ours)"
              + (f", at {result['hf_matmul_bound_share']:.0%} of its matmul-bound time"
                 if measured_peak else ""))
    return result


if __name__ == "__main__":
    main()
