"""Where a step's device time goes: a `jax.profiler` trace summed by kernel and by kind.

    python -m benchmarks.common.trace_summary PROFILE_DIR [--steps=3] [--top=40] [--json]

`benchmarks.step.pretrain_step --profile_dir=DIR` traces a few steps after its timing and calls this on DIR. It reads
the newest `perfetto_trace.json.gz` that `jax.profiler.trace(..., create_perfetto_trace=True)` wrote
under DIR, keeps the complete events ("ph": "X") of the device threads (a GPU's streams; on CPU,
XLA's thunk threads, since there is no device process), sums their durations by kernel name and by
kind (matmul, attention, random bits, copy/transpose, reduction, elementwise fusion, memcpy/memset,
other) and divides by the number of traced steps. The busy time of the device threads against the
step's wall time tells how much of the step the device waited on the host (launch gaps, host
syncs). Kernels overlapping on two streams are counted on each; the summary says how many
streams it saw.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

# (kind, pattern) in order: the first match names a kernel's kind.
KINDS = [
    ("attention", re.compile(r"cudnn|fmha|flash|sdpa|splash|dot_product_attention", re.I)),
    ("matmul", re.compile(r"gemm|xmma|cutlass|cublas|nvjet|sm\d+_.*(mma|gmma)|dot|matmul|convolution|"
                          r"ynn|onednn|eigen.*contract", re.I)),
    ("random bits", re.compile(r"rng|philox|threefry|random", re.I)),
    ("memcpy/memset", re.compile(r"memcpy|memset|MemcpyD2D|MemcpyH2D|MemcpyD2H", re.I)),
    ("copy/transpose", re.compile(r"copy|transpose|concatenate|dynamic.update.slice|pad|slice|gather|scatter", re.I)),
    ("reduction", re.compile(r"reduce|reduction|softmax|norm", re.I)),
    ("elementwise fusion", re.compile(r"fusion|loop_|elementwise|add|multiply|select|convert", re.I)),
]


# Spans around the kernels on XLA's CPU threads.
WRAPPERS = ("ThunkExecutor",)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def find_trace(profile_dir: str) -> str:
    paths = glob.glob(os.path.join(profile_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"{profile_dir}: no perfetto_trace.json.gz under it "
                                "(trace with jax.profiler.trace(dir, create_perfetto_trace=True))")
    return max(paths, key=os.path.getmtime)


def device_threads(events: list) -> dict:
    """(pid, tid) -> thread label, for the threads where the device's work runs."""
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device_pids = {pid for pid, name in processes.items() if "/device:" in name and "CPU" not in name}
    if device_pids:
        chosen = {key: f"{processes[key[0]]} {name}" for key, name in threads.items() if key[0] in device_pids}
        # A GPU process also holds annotation threads (XLA ops, modules, steps) over the kernels:
        # keep the streams.
        streams = {k: v for k, v in chosen.items() if re.search(r"stream", v, re.I)}
        return streams or chosen
    # CPU: XLA runs its thunks on the client's and Eigen's threads.
    return {key: name for key, name in threads.items() if re.search(r"XLA|Eigen", name)}


def summarize(events: list, steps: int, top: int = 40) -> dict:
    """Sums the device threads' complete events by name and kind, per step."""
    threads = device_threads(events)
    per_name = collections.defaultdict(lambda: [0.0, 0])
    per_kind = collections.defaultdict(float)
    busy = 0.0
    start, end = float("inf"), float("-inf")
    for e in events:
        if e.get("ph") != "X" or (e.get("pid"), e.get("tid")) not in threads:
            continue
        if e.get("name", "").startswith(WRAPPERS):  # spans that hold the kernels, not kernels
            continue
        dur = float(e.get("dur", 0.0))
        name = e.get("name", "?")
        per_name[name][0] += dur
        per_name[name][1] += 1
        per_kind[kind_of(name)] += dur
        busy += dur
        start, end = min(start, float(e["ts"])), max(end, float(e["ts"]) + dur)
    if not per_name:
        raise ValueError("the trace has no events on a device thread")
    ms = 1e-3 / steps  # trace times are in microseconds
    kernels = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {
        "steps": steps,
        "threads": sorted(threads.values()),
        "busy_ms_per_step": busy * ms,
        "span_ms_per_step": (end - start) * ms,
        "kinds_ms_per_step": {k: v * ms for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "kernels_per_step": sum(n for _, n in per_name.values()) / steps,
        "top_kernels": [{"name": name, "ms_per_step": total * ms, "calls_per_step": calls / steps,
                         "kind": kind_of(name)} for name, (total, calls) in kernels[:top]],
    }


def summarize_dir(profile_dir: str, steps: int, top: int = 40) -> dict:
    path = find_trace(profile_dir)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    summary = summarize(events, steps, top)
    summary["trace"] = path
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"device threads: {len(summary['threads'])}; per step: busy {summary['busy_ms_per_step']:.1f} ms "
             f"over a span of {summary['span_ms_per_step']:.1f} ms, {summary['kernels_per_step']:.0f} kernels"]
    for kind, v in summary["kinds_ms_per_step"].items():
        lines.append(f"  {kind:<20} {v:9.2f} ms  {v / summary['busy_ms_per_step']:6.1%}")
    lines.append("top kernels (ms per step, calls per step, kind):")
    for k in summary["top_kernels"]:
        lines.append(f"  {k['ms_per_step']:9.3f}  {k['calls_per_step']:6.1f}  {k['kind']:<18} {k['name'][:110]}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile_dir")
    p.add_argument("--steps", type=int, default=1, help="steps the trace holds")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    summary = summarize_dir(args.profile_dir, args.steps, args.top)
    print(json.dumps(summary) if args.json else format_summary(summary))


if __name__ == "__main__":
    main()
