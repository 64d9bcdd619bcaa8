"""Timing compiled steps: the `Runner` that steps one (waited for one by one, or dispatched back to
back), `compile_runners` (several lowered steps compiled at once), the device's measured matmul peak,
a `jax.profiler` trace of a few steps summarized, and the progress log every step benchmark writes.

`benchmarks.step.pretrain_step` and the benchmarks built on it (`fp8`, `optimizer`, `dropout`,
`benchmarks.kernels.fused_layernorm`) time their steps with these; `benchmarks.step.builders` makes
the steps.
"""

from __future__ import annotations

import statistics
import sys
import time

_T0 = time.perf_counter()


def log(message: str) -> None:
    """Progress on stderr (stdout stays one JSON object with --json): where a killed run was. Every
    step benchmark's lines start `[pretrain_step <seconds since start>]`, as they always have."""
    print(f"[pretrain_step {time.perf_counter() - _T0:7.1f} s] {message}", file=sys.stderr, flush=True)


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
