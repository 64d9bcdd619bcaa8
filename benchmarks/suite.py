"""A named set of benchmark runs, each in its own process with a time limit, results kept as they come.

    python -m benchmarks.suite --suite=gpu --out=$OUT/gpu.jsonl [--timeout_s=240] [--budget_s=570]
    python -m benchmarks.suite --suite=gpu --only=large_128,large_512_packed   # a subset, in suite order
    python -m benchmarks.suite --table=gpu.jsonl                                # re-render a results file
    python -m benchmarks.suite --list                                           # the suites and their runs
    python -m benchmarks.suite --suite=cpu --hf_python=VENV/bin/python --timeout_s=600 --budget_s=1800

Written for a lent GPU's few device-minutes, where one run that hangs must not cost the others:

- every run is a fresh process (`benchmarks.step.pretrain_step`, `benchmarks.step.fp8`, `benchmarks.step.optimizer`,
  `benchmarks.step.dropout` or `benchmarks.finetune.end_to_end` with `--json`; `--minilm` and `--hf_python` fill the
  cpu suite's fine-tuning run, which is skipped without `--hf_python`), killed with its whole process group when it passes `--timeout_s` or what is left of
  `--budget_s`;
- each run's record (status `ok`, `timeout`, `error` or `skipped`, wall seconds, the parsed JSON
  result, and the tail of its stderr, where `benchmarks.step.pretrain_step` logs its phases: so a timeout says
  whether it was still compiling or already stepping) is appended to `--out` as one JSON line the
  moment the run ends: whatever the device call's own limit cuts off, the finished runs are there;
- runs are in priority order (the issue's targets first), and a run that cannot get 30 s of the
  budget is recorded as skipped, not started.

At the end (and with `--table`) it prints a markdown table of the records in RESULTS.md's columns.
On the device tool's image (jax with CUDA, flax, optax, orbax; no ml_collections or tensorflow),
carry an ml_collections wheel in an ignored folder and install it first, e.g.
`pip install -q --no-deps .whl/*.whl && python -m benchmarks.suite --suite=gpu --out=$OUT/gpu.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the runs start here: python -m benchmarks...

_LARGE = ["--config=configs/large.py", "--dtype=bfloat16"]
_BASE = ["--config=configs/base.py", "--dtype=bfloat16"]
_GPU = ["--prng=rbg", "--steps=8", "--warmup=2"]

# The modules the runs start (`python -m MODULE` from the repository root).
_STEP = "benchmarks.step.pretrain_step"
_FP8 = "benchmarks.step.fp8"
_OPTIMIZER = "benchmarks.step.optimizer"
_DROPOUT = "benchmarks.step.dropout"
_CPU_BF16 = "benchmarks.step.cpu_bf16"
_FINETUNE = "benchmarks.finetune.end_to_end"
_FIRST_RUN = "benchmarks.finetune.profile_first_run"

# name -> (module, flags). Order is priority: a budget that runs out cuts the end of the list.
SUITES: dict = {
    "gpu": [
        # The issue's two H100 targets: BERT-large length 128 (>= 2,050 seq/s), packed 512 (>= 850).
        ("large_128", _STEP, _LARGE + _GPU + ["--seq_len=128", "--batch=256", "--attention=dot_product"]),
        ("large_512_packed", _STEP, _LARGE + _GPU + [
            "--seq_len=512", "--batch=32", "--attention=dot_product", "--packing"]),
        ("base_128", _STEP, _BASE + _GPU + ["--seq_len=128", "--batch=256", "--attention=dot_product"]),
        # Issue 30: the fused kernels (Pallas/Triton), the tanh GELU and FP8 against bf16, the variants
        # of one model in one process, compiled side by side, timed in alternating rounds.
        ("large_128_variants", _FP8, _LARGE + _GPU + [
            "--seq_len=128", "--batch=256", "--attention=dot_product", "--rounds=3", "--steps=5",
            "--parallel_compile", "--variants=bf16,gelu_tanh,fused_gelu_tanh,fp8_gelu_tanh,fp8_fused_gelu_tanh"]),
        ("large_512_packed_variants", _FP8, _LARGE + _GPU + [
            "--seq_len=512", "--batch=32", "--attention=dot_product", "--packing", "--rounds=3", "--steps=5",
            "--parallel_compile", "--variants=bf16,fused_gelu_tanh"]),
        ("base_128_variants", _FP8, _BASE + _GPU + [
            "--seq_len=128", "--batch=256", "--attention=dot_product", "--rounds=3", "--steps=5",
            "--parallel_compile", "--variants=bf16,gelu_tanh,fp8_gelu_tanh"]),
        # The dropout + residual + LayerNorm kernel alone against XLA's passes (its launch shapes swept).
        ("large_fused_kernel", _FP8, _LARGE + [
            "--seq_len=128", "--batch=256", "--kernel", "--kernel_sweep=/tmp/bert_jax_fused_blocks.json"]),
        # Attention implementations compared (XLA's einsum path, with attention dropout).
        ("base_128_einsum", _STEP, _BASE + _GPU + ["--seq_len=128", "--batch=256"]),
        # What sparse_last_layer and the optimizer rewrite bought on this device.
        ("large_128_dense_last_layer", _STEP, _LARGE + _GPU + [
            "--seq_len=128", "--batch=256", "--attention=dot_product", "--dense_last_layer"]),
        ("base_128_optimizer_variants", _OPTIMIZER, _BASE + [
            "--step", "--seq_len=128", "--batch=256", "--attention=dot_product", "--prng=rbg",
            "--rounds=3", "--steps=4"]),
        ("large_512_packed_scan_remat", _STEP, _LARGE + _GPU + [
            "--seq_len=512", "--batch=32", "--attention=dot_product", "--packing", "--scan", "--remat=dots"]),
        ("large_512_packed_batch_64", _STEP, _LARGE + _GPU + [
            "--seq_len=512", "--batch=64", "--attention=dot_product", "--packing"]),
        ("large_128_scan_remat", _STEP, _LARGE + _GPU + [
            "--seq_len=128", "--batch=256", "--attention=dot_product", "--scan", "--remat=dots"]),
    ],
    "cpu": [
        # The issue's CPU target: ours vs HF's FlaxBertForPreTraining, BERT-base, length 128, float32.
        ("base_128_vs_hf", _STEP, ["--config=configs/base.py", "--seq_len=128", "--batch=8",
                                             "--steps=2", "--rounds=3", "--warmup=1", "--hf", "--measure_peak"]),
        # The same with HF's step in a process of its own, as its users run it (glibc's default
        # malloc; ours keeps freed buffers for the next step, as bert_jax.main does on CPU).
        ("base_128_vs_hf_own_process", _STEP, ["--config=configs/base.py", "--seq_len=128", "--batch=8",
                                                         "--steps=3", "--rounds=2", "--warmup=1", "--hf_process"]),
        # Issue 57: bf16 on the CPU. The matmuls in each form, then the step with every matmul in
        # bf16 (float32 model: model.mixed_matmuls), and ours against HF's in bf16, side by side.
        ("cpu_bf16_matmuls", _CPU_BF16, ["--batch=8", "--seq_len=128"]),
        ("base_128_mixed_matmuls", _STEP, ["--config=configs/base.py", "--seq_len=128", "--batch=8",
                                                     "--steps=2", "--rounds=3", "--warmup=1", "--mixed_matmuls"]),
        ("base_128_bf16_vs_hf", _STEP, ["--config=configs/base.py", "--seq_len=128", "--batch=8",
                                                  "--steps=2", "--rounds=3", "--warmup=1", "--dtype=bfloat16", "--hf"]),
        # Dropout masks: keep_mask against jax.random.bernoulli (the masks alone, then the step).
        ("base_128_dropout_masks", _DROPOUT, ["--config=configs/base.py", "--seq_len=128", "--batch=8"]),
        ("base_128_dropout_step", _DROPOUT, ["--config=configs/base.py", "--seq_len=128", "--batch=8",
                                                       "--step", "--rounds=3"]),
        # Compile time: BERT-large <= 60 s, and 24 layers vs 12 <= 1.3x (with nn.scan; unrolled alongside).
        *[(f"large_compile_{kind}{suffix}", _STEP, ["--config=configs/large.py", "--batch=8",
                                                            "--compile_only", *flags, *layers])
          for kind, flags in (("scan", ["--scan"]), ("unrolled", []))
          for suffix, layers in (("", []), ("_12_layers", ["--layers=12"]))],
        # Fine-tuning end to end against transformers + PyTorch (issue 44's target: 1.5x the wall
        # clock): needs ../shared/data, --minilm and --hf_python; ~6 min, so --timeout_s=600.
        # --warm: ours once more on the first run's compilation cache (a rerun, another seed).
        ("finetune_sst2_vs_transformers", _FINETUNE, ["--tasks=sst2", "--sst2_train=2000", "--warm",
                                                                "--model={minilm}", "--hf_python={hf_python}"]),
        # ... ours in float32 whatever the CPU (on a CPU where "auto" takes bf16, the run above is not).
        ("finetune_sst2_float32_vs_transformers", _FINETUNE, [
            "--tasks=sst2", "--sst2_train=2000", "--warm", "--set", "cpu_bf16=off",
            "--model={minilm}", "--hf_python={hf_python}"]),
        # Where the first run's wall goes, compiling ahead (the default) and each program at its first
        # call, one after the other (issue 70's profile).
        *[(f"finetune_sst2_first_run_profile{suffix}", _FIRST_RUN, [
            "--model={minilm}", "--sst2_train=2000", *flags]) for suffix, flags in (
                ("", []), ("_no_compile_ahead", ["--set", "compile_ahead=false"]))],
        # ... both sides in bf16: ours with every matmul in bf16, PyTorch under its CPU autocast.
        ("finetune_sst2_bf16_vs_transformers_autocast", _FINETUNE, [
            "--tasks=sst2", "--sst2_train=2000", "--set", "cpu_bf16=on", "--hf_autocast_bf16",
            "--model={minilm}", "--hf_python={hf_python}"]),
    ],
    # Seconds on any machine: what the tests run.
    "smoke": [
        ("tiny_unrolled", _STEP, ["--config=configs/test.py", "--seq_len=32", "--batch=8",
                                            "--steps=2", "--warmup=1"]),
        ("tiny_scan_packed", _STEP, ["--config=configs/test.py", "--seq_len=32", "--batch=8",
                                               "--steps=2", "--warmup=1", "--scan", "--packing"]),
    ],
}

MIN_RUN_S = 30.0  # a run offered less than this is skipped, not started


def tail(text: str, lines: int = 15, chars: int = 3000) -> str:
    return "\n".join(text.splitlines()[-lines:])[-chars:]


# The CPU flags each record names: the vector and matrix units that decide float32 and bf16 speed.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "bf16")


def cpu_description(cpuinfo: str | None = None) -> dict:
    """This machine's CPU for a record: its model name, core count and `CPU_FLAGS` it reports."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in CPU_FLAGS if f in flags]}


def run_one(cmd: list, timeout_s: float, env: dict | None = None) -> dict:
    """Runs `cmd` in a new session; past `timeout_s` the whole group is killed. Never raises."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=env, cwd=ROOT)
    except OSError as e:
        return {"status": "error", "wall_s": 0.0, "stderr_tail": f"could not start {cmd[0]!r}: {e}"}
    try:
        out, err = proc.communicate(timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else "error"
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and anything it started
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        status = "timeout"
    record = {"status": status, "wall_s": round(time.perf_counter() - t0, 2), "returncode": proc.returncode}
    result = None
    for line in reversed((out or "").splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    if result is not None:
        record["result"] = result
    elif status == "ok":
        record["status"] = "error"
        record["stdout_tail"] = tail(out or "")
    record["stderr_tail"] = tail(err or "")
    return record


def fill(flags: list, values: dict) -> tuple[list, str]:
    """`{name}` in a flag -> `values[name]`; returns the flags and what is missing ("" if nothing)."""
    out, missing = [], []
    for flag in flags:
        names = [n for n in values if "{" + n + "}" in flag]
        missing += [f"--{n}" for n in names if not values[n]]
        out.append(flag.format(**values) if names else flag)
    return out, ", ".join(missing)


def run_suite(runs: list, out_path: str | None, timeout_s: float, budget_s: float,
              python: str = sys.executable, values: dict | None = None) -> list:
    """Runs `(name, module, flags)` in order (a module run from the repository root, or a script's path);
    appends each record to `out_path` as it ends.
    `values` fills the flags' `{name}` fields; a run missing one is recorded as skipped."""
    start = time.perf_counter()
    records = []
    cpu = cpu_description()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    for name, module, flags in runs:
        left = budget_s - (time.perf_counter() - start)
        flags, missing = fill(flags, values or {})
        cmd = [python, *([module] if module.endswith(".py") else ["-m", module]), *flags, "--json"]
        if missing:
            record = {"status": "skipped", "wall_s": 0.0, "stderr_tail": f"needs {missing} (benchmarks.suite's flags)"}
        elif left < MIN_RUN_S:
            record = {"status": "skipped", "wall_s": 0.0,
                      "stderr_tail": f"{left:.0f} s of the {budget_s:.0f} s budget left (< {MIN_RUN_S:.0f} s)"}
        else:
            limit = min(timeout_s, left)
            print(f"[{time.perf_counter() - start:6.0f} s] {name}: {' '.join(flags)} (limit {limit:.0f} s)",
                  file=sys.stderr, flush=True)
            record = run_one(cmd, limit, env)
            record["limit_s"] = round(limit, 1)
        record = {"name": name, "module": module, "flags": flags, "cpu": cpu, **record}
        print(f"[{time.perf_counter() - start:6.0f} s] {name}: {record['status']} in {record['wall_s']:.0f} s",
              file=sys.stderr, flush=True)
        if record["status"] != "ok":
            print("  " + record["stderr_tail"].replace("\n", "\n  "), file=sys.stderr, flush=True)
        records.append(record)
        if out_path:
            with open(out_path, "a") as f:
                f.write(json.dumps(record) + "\n")
    return records


def read_records(path: str) -> list:
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{n}: not a JSON record ({e.msg})") from None
    return records


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table(records: list) -> str:
    """Markdown rows: one per record; records with variants (or a kernel's implementations) list
    their medians."""
    head = ("| run | device | model | T | batch | dtype | attention | layers | dropout | step ms | "
            "sequences/s | TFLOP/s | MFU | lower + compile s | status |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        r = rec.get("result") or {}
        status = rec["status"] if rec["status"] == "ok" else f"{rec['status']} ({rec['wall_s']:.0f} s)"
        if r.get("benchmark") == "bench_finetune":  # end to end, ours against transformers
            if r.get("skipped"):
                lines.append(f"| {rec['name']} | fine-tuning: skipped, {r['skipped']} |" + " |" * 12 + f" {status} |")
            for run in r.get("runs", []):
                ours, theirs = run["bert_jax"], run.get("transformers")
                text = (f"fine-tuning {run['task']} ({run['train_examples']} rows): ours {ours['wall_s']:.0f} s wall, "
                        f"{ours['train_sequences_per_s']:.3g} training seq/s")
                if theirs:
                    wall = theirs.get("process_wall_s", theirs["wall_s"])
                    text += (f"; transformers {wall:.0f} s, {theirs['train_sequences_per_s']:.3g} seq/s; "
                             f"wall ratio {wall / ours['wall_s']:.2f}x")
                warm = run.get("bert_jax_warm")
                if warm:
                    text += f"; ours again on its compilation cache {warm['wall_s']:.0f} s"
                    if theirs:
                        text += f" ({wall / warm['wall_s']:.2f}x)"
                lines.append(f"| {rec['name']} | {text} |" + " |" * 12 + f" {status} |")
            continue
        if r.get("benchmark") == "profile_first_run":  # a first fine-tuning run's wall, where it goes
            text = "; ".join(f"first run {x['wall_s']:.0f} s wall, compile wall {x['compile_wall_s']:.1f} s "
                             f"({x['background_compile_s']:.1f} s compiled ahead)" for x in r["runs"])
            lines.append(f"| {rec['name']} | {text} |" + " |" * 12 + f" {status} |")
            continue
        if r.get("benchmark") == "bench_cpu_bf16":  # each matmul: bf16 in, float32 out, against float32
            parts = [f"{op['op']} {op['float32_ms']:.3g} / {op['bf16_in_f32_out_ms']:.3g} ms "
                     f"({op['mixed_speedup']:.2f}x)" for op in r["ops"]]
            lines.append(f"| {rec['name']} | CPU, bf16 units: {', '.join(r['bf16_units']) or 'none'} | matmuls in "
                         "float32 / bf16 in, float32 out: " + "; ".join(parts) + " |" + " |" * 12 + f" {status} |")
            continue
        if "variants" in r or "impl" in r:  # benchmarks.step.fp8, benchmarks.step.optimizer, benchmarks.step.dropout
            parts = [f"{k} {v['median_s'] * 1e3:.3g} ms" for k, v in (r.get("variants") or r["impl"]).items()]
            lines.append(f"| {rec['name']} | {r.get('device', '')} | {r.get('benchmark', '')} variants: "
                         + "; ".join(parts) + " |" + " |" * 12 + f" {status} |")
            continue
        model = f"L={r['layers']} H={r['hidden']}" if "layers" in r else ""
        layers = ("scan" if r.get("scan") else "unrolled") if r else ""
        if r.get("remat", "none") != "none":
            layers += f" + remat {r['remat']}"
        if r and not r.get("sparse_last_layer", True):
            layers += ", dense last layer"
        rate = r.get("sequences_per_s")
        seqs = _fmt(rate, ",.0f" if rate is not None and rate >= 100 else ".3g")
        if r.get("packing"):
            seqs += " (packed, 3 per row)"
        step = _fmt(r["step_s"] * 1e3 if "step_s" in r else None, ".1f")
        compile_s = (f"{r['lower_s']:.1f} + {r['compile_s']:.1f}" if "lower_s" in r
                     else _fmt(r.get("compile_s"), ".1f"))
        dropout = "" if not r else ("on" if r.get("dropout") else "off")
        if r.get("speedup_vs_hf"):
            status += (f"; {r['speedup_vs_hf']:.2f}x HF's {r['hf_step_s'] * 1e3:.0f} ms"
                       + (" (its own process)" if r.get("hf_process") else ""))
        lines.append(
            f"| {rec['name']} | {r.get('device', '')} | {model} | {r.get('seq_len', '')} | {r.get('batch', '')} | "
            f"{r.get('dtype', '')}{' (bf16 matmuls)' if r.get('mixed_matmuls') else ''} | {r.get('attention', '')} | "
            f"{layers} | {dropout} | {step} | {seqs} | "
            f"{_fmt(r.get('tflops_per_s'), '.3g')} | {_fmt(r.get('mfu'), '.1%')} | "
            f"{compile_s} | {status} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=sorted(SUITES))
    p.add_argument("--only", default="", help="comma-separated run names (suite order kept)")
    p.add_argument("--out", default="", help="JSON-lines file the records are appended to")
    p.add_argument("--timeout_s", type=float, default=240.0, help="limit per run")
    p.add_argument("--budget_s", type=float, default=570.0, help="limit for the whole suite")
    p.add_argument("--table", default="", help="print the table of an existing results file and stop")
    p.add_argument("--list", action="store_true", help="print the suites and stop")
    p.add_argument("--minilm", default=os.path.join(os.path.dirname(ROOT), "minilm"),
                   help="the cpu suite's fine-tuning run: all-MiniLM-L6-v2 (../shared/tools/fetch_minilm.sh DIR)")
    p.add_argument("--hf_python", default="", help="the cpu suite's fine-tuning run: a Python with torch + "
                   "transformers (without it that run is skipped)")
    args = p.parse_args(argv)
    if args.list:
        for suite, runs in SUITES.items():
            print(f"{suite}:")
            for name, module, flags in runs:
                print(f"  {name:30s} {module} {' '.join(flags)}")
        return None
    if args.table:
        print(table(read_records(args.table)))
        return None
    if not args.suite:
        p.error("give --suite (or --table / --list)")
    runs = SUITES[args.suite]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {name for name, _, _ in runs})
        if unknown:
            p.error(f"--only: no run named {', '.join(unknown)} in suite {args.suite!r} "
                    f"(it has {', '.join(name for name, _, _ in runs)})")
        runs = [run for run in runs if run[0] in wanted]
    records = run_suite(runs, args.out or None, args.timeout_s, args.budget_s,
                        values={"minilm": args.minilm, "hf_python": args.hf_python})
    print(table(records))
    return records


if __name__ == "__main__":
    main()
