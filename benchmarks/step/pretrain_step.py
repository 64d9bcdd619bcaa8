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
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_T0 = time.perf_counter()


def log(message: str) -> None:
    """Progress on stderr (stdout stays one JSON object with --json): where a killed run was."""
    print(f"[pretrain_step {time.perf_counter() - _T0:7.1f} s] {message}", file=sys.stderr, flush=True)


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


class Runner:
    """A compiled step with its (donated, so replaced every step) state."""

    def __init__(self, step, state, batch, mesh=None, compiler_options=None):
        self.step, self.state, self.batch, self.mesh = step, state, batch, mesh
        self.compiler_options = compiler_options or {}  # XLA options for `compile_runners`
        self.durations: list = []
        self.pipelined: list = []  # seconds per step of runs dispatched back to back
        self.loss = float("nan")

    def _mesh(self):
        """The mesh and its logical axis rules, as the step was lowered under (if any)."""
        import contextlib
        import flax.linen as nn
        import jax
        from bert_jax.training import sharding

        ctx = contextlib.ExitStack()
        if self.mesh is not None:
            ctx.enter_context(jax.set_mesh(self.mesh))
            ctx.enter_context(nn.logical_axis_rules(sharding.DEFAULT_RULES))
        return ctx

    def run(self, steps: int, record: bool = True) -> None:
        if steps <= 0:  # --warmup=0
            return
        import jax

        with self._mesh():
            for _ in range(steps):
                t0 = time.perf_counter()
                self.state, metrics = self.step(self.state, self.batch)
                jax.block_until_ready(metrics["loss"])
                if record:
                    self.durations.append(time.perf_counter() - t0)
        self.loss = float(metrics["loss"])

    def run_pipelined(self, steps: int) -> None:
        """`steps` steps dispatched back to back and waited for once, as the training loop runs
        them (it fetches metrics only at its log steps): the host's dispatch of each step overlaps
        the device's previous one, which `run`'s per-step wait exposes. Records seconds per step."""
        import jax

        with self._mesh():
            jax.block_until_ready(self.state)
            t0 = time.perf_counter()
            for _ in range(steps):
                self.state, metrics = self.step(self.state, self.batch)
            jax.block_until_ready((self.state, metrics))
            self.pipelined.append((time.perf_counter() - t0) / steps)
        self.loss = float(metrics["loss"])

    @property
    def median(self) -> float:
        return statistics.median(self.durations)


def measure_matmul_peak(dtype: str, n: int = 0, repeats: int = 7) -> float:
    """FLOP/s of the best of `repeats` jitted n x n x n matmuls in `dtype` on device 0."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    n = n or (2048 if device.platform == "cpu" else 8192)
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(ka, (n, n), jnp.dtype(dtype)), device)
    b = jax.device_put(jax.random.normal(kb, (n, n), jnp.dtype(dtype)), device)
    matmul = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(matmul(a, b))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(matmul(a, b))
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def initial_fp8_state(abstract, shardings):
    """The FP8 scaling state as flax's `Fp8DotGeneralBase` initializes it (scales 1, amax
    histories 0), without compiling the model's initialization again; None stays None."""
    import jax
    import jax.numpy as jnp

    if abstract is None:
        return None
    def init(path, x, s):
        fill = 1.0 if jax.tree_util.keystr(path).endswith("_scale']") else 0.0
        return jax.device_put(jnp.full(x.shape, fill, x.dtype), s)
    return jax.tree_util.tree_map_with_path(init, abstract, shardings)


def bench_ours(args, config, bert_config, mesh, batch_np, init_cache: dict | None = None,
               compile: bool = True, compiler_options: dict | None = None):
    """Compiles our step; returns `({lower_s, compile_s}, Runner)`. Scripts that build several
    variants of the step pass one `init_cache` dict to every call: the first call keeps a copy of
    its freshly initialized state there and the others start from copies of it instead of
    initializing again (BERT-Large's initialization compiles for about a minute on a GPU).
    `compile=False` stops after lowering: the Runner's `step` is the `Lowered` program, for the
    caller to compile (`compile_runners` compiles several at once). `compiler_options`: XLA
    options for this program alone (e.g. `{"xla_gpu_enable_cublaslt": True}`), as `XLA_FLAGS`
    would set them for the whole process."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from bert_jax.pretrain import loop as pretrain, steps
    from bert_jax.training import sharding

    model, tx, schedule, init_state = pretrain.build(config, bert_config, mesh)
    cached = (init_cache or {}).get("state")
    if cached is not None:  # usable if this variant's state has the same structure, shapes and dtypes
        shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
        boxed = jax.eval_shape(init_state, jax.random.key(0))
        fresh = nn.meta.unbox(boxed)
        # The FP8 scaling state apart: a variant with FP8 takes the others' parameters and moments.
        cached = cached if shapes(fresh.replace(fp8=None)) == shapes(cached.replace(fp8=None)) else None
    if cached is not None:
        log("copying the first variant's initial state")
        state_shardings = sharding.logical_to_sharding(boxed, mesh)
        state = jax.tree.map(jnp.copy, cached.replace(fp8=None)).replace(
            fp8=initial_fp8_state(fresh.fp8, state_shardings.fp8))
    else:
        log("initializing the state")
        state, state_shardings = sharding.sharded_init(init_state, jax.random.key(0), mesh)
        if init_cache is not None and not init_cache:  # a copy, before the donation consumes the state
            init_cache.update(state=jax.tree.map(jnp.copy, state), shardings=state_shardings)
    batch_sharding = sharding.batch_sharding(mesh)
    step = functools.partial(steps.train_step, model=model, tx=tx, schedule=schedule, mesh=mesh)
    jitted = jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, None), donate_argnums=0)
    batch = sharding.to_global(batch_np, mesh)
    # The initialization is dispatched asynchronously: timing the compile while it still runs
    # would charge it to the compile (on CPU both share the cores; it grows with the depth).
    jax.block_until_ready((state, batch))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        log("lowering our step")
        t0 = time.perf_counter()
        lowered = jitted.lower(state, batch)
        t1 = time.perf_counter()
        if not compile:
            log(f"lowered in {t1 - t0:.1f} s")
            return {"lower_s": t1 - t0}, Runner(lowered, state, batch, mesh, compiler_options)
        log(f"lowered in {t1 - t0:.1f} s; compiling")
        compiled = lowered.compile(compiler_options=compiler_options or None)
        t2 = time.perf_counter()
        log(f"compiled in {t2 - t1:.1f} s")
    result = {"lower_s": t1 - t0, "compile_s": t2 - t1}
    return result, Runner(compiled, state, batch, mesh)


def compile_runners(runners: dict, infos: dict) -> None:
    """Compiles the lowered steps of `runners` (name -> Runner from `bench_ours(..., compile=False)`)
    in parallel threads (XLA compiles outside Python's lock): the slowest compile instead of their
    sum. Each `infos[name]["compile_s"]` is that program's own compile, timed while the others
    compiled beside it (on a GPU, XLA's GEMM autotuning of each then shares the device)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name):
        t0 = time.perf_counter()
        compiled = runners[name].step.compile(compiler_options=runners[name].compiler_options or None)
        return name, compiled, time.perf_counter() - t0

    log(f"compiling {len(runners)} steps in parallel")
    with ThreadPoolExecutor(max_workers=len(runners)) as pool:
        for name, compiled, seconds in pool.map(one, list(runners)):
            runners[name].step = compiled
            infos[name]["compile_s"] = seconds
            log(f"{name}: compiled in {seconds:.1f} s")


def bench_hf(args, config, bert_config, batch_np):
    """transformers' FlaxBertForPreTraining, same optimizer and losses, one device."""
    import jax
    import jax.numpy as jnp
    import optax
    import transformers
    from bert_jax.pretrain import steps
    from bert_jax.training import optim

    hf_config = transformers.BertConfig(
        vocab_size=bert_config.vocab_size, hidden_size=bert_config.hidden_size,
        num_hidden_layers=bert_config.num_hidden_layers, num_attention_heads=bert_config.num_attention_heads,
        intermediate_size=bert_config.intermediate_size, hidden_act="gelu",
        max_position_embeddings=bert_config.max_position_embeddings)
    model = transformers.FlaxBertForPreTraining(hf_config, dtype=jnp.dtype(args.dtype), seed=0)
    schedule = optim.learning_rate_schedule(1e-4, 10, 10_000)
    tx = optim.make_optimizer("adamw", schedule, clip_norm=1.0)
    state = (model.params, tx.init(model.params), jnp.zeros((), jnp.int32))

    def step(state, batch):
        params, opt_state, count = state

        def loss_fn(params):
            out = model(batch["input_ids"], batch["input_mask"], batch["segment_ids"], params=params,
                        dropout_rng=jax.random.fold_in(jax.random.key(0), count), train=True)
            logits = jnp.take_along_axis(out.prediction_logits,
                                         batch["masked_lm_positions"][..., None], axis=1)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["masked_lm_ids"])
            w = batch["masked_lm_weights"]
            nsp = optax.softmax_cross_entropy_with_integer_labels(
                out.seq_relationship_logits.astype(jnp.float32), batch["next_sentence_labels"][:, 0])
            return jnp.sum(nll * w) / (jnp.sum(w) + 1e-5) + jnp.mean(nsp)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, count + 1), {"loss": loss}

    jitted = jax.jit(step, donate_argnums=0)
    batch = jax.device_put({k: v for k, v in batch_np.items()})
    jax.block_until_ready((state, batch))  # as for ours: the initialization is not the compile's
    log("compiling HF's step")
    t0 = time.perf_counter()
    compiled = jitted.lower(state, batch).compile()
    log(f"compiled HF's step in {time.perf_counter() - t0:.1f} s")
    del steps
    return {"compile_s": time.perf_counter() - t0}, Runner(compiled, state, batch)


def profile(runner, profile_dir: str, steps: int) -> dict:
    """Traces `steps` more steps of `runner`; the device time by kind and the top kernels, per step."""
    import jax

    from benchmarks.common import trace_summary

    log(f"tracing {steps} step(s) into {profile_dir}")
    with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
        runner.run(steps, record=False)
    summary = trace_summary.summarize_dir(profile_dir, steps, top=25)
    log(trace_summary.format_summary(summary))
    return summary


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
    hf, runner = bench_hf(args, config, bert_config, batch_np)
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
    log("timing HF's step in a process of its own")
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
    log(f"host memory: {memory}")
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
    log(f"{jax.device_count()} x {device.device_kind}; setting up")
    measured_peak = measure_matmul_peak(args.dtype) if args.measure_peak else None
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
    ours, runner = bench_ours(args, config, bert_config, mesh, batch_np)
    result.update(ours)
    tokens = int(batch_np["input_mask"].sum())
    sequences = args.batch * (3 if args.packing else 1)
    if not args.compile_only:
        hf_runner = None
        if args.hf:
            hf, hf_runner = bench_hf(args, config, bert_config, batch_np)
            result["hf_compile_s"] = hf["compile_s"]
        # Rounds alternate ours and HF so that both see the same machine load.
        log(f"{args.warmup} warm-up step(s)")
        runner.run(args.warmup, record=False)
        if hf_runner:
            hf_runner.run(args.warmup, record=False)
        hf_alone_result = None
        for r in range(args.rounds):
            if args.hf_process and r == (args.rounds + 1) // 2:
                hf_alone_result = hf_in_its_own_process(argv)
            log(f"timing round {r + 1} of {args.rounds}: {args.steps} step(s)")
            runner.run(args.steps)
            if hf_runner:
                hf_runner.run(args.steps)
        if args.hf_process and hf_alone_result is None:  # one round: HF's after ours
            hf_alone_result = hf_in_its_own_process(argv)
        log(f"done: median step {runner.median * 1e3:.1f} ms")
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
            result["profile"] = profile(runner, args.profile_dir, args.profile_steps)
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
