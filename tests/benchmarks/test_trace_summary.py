"""benchmarks/common/trace_summary.py: a profiler trace's device time, by kernel and kind, per step."""

import gzip
import json
import os

import pytest

from benchmarks.common import trace_summary
from benchmarks.step import pretrain_step


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _kernel(pid, tid, ts, dur, name):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}


def _gpu_trace():
    """Two steps on a GPU: kernels on two streams, an annotation thread over them, host spans."""
    events = [_meta(1, "/device:GPU:0"), _meta(1, "Stream #14(Compute)", 14), _meta(1, "Stream #17(MemcpyD2H)", 17),
              _meta(1, "XLA Ops", 99), _meta(7, "/host:CPU"), _meta(7, "python3", 5)]
    t = 0.0
    for _ in range(2):
        for dur, name in ((300.0, "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT"),
                          (100.0, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"),
                          (50.0, "loop_convert_multiply_fusion_23"), (40.0, "input_add_reduce_fusion_9"),
                          (10.0, "loop_slice_fusion")):
            events.append(_kernel(1, 14, t, dur, name))
            events.append(_kernel(1, 99, t, dur, "fusion.1"))  # an annotation, not a kernel
            t += dur + 5.0
        events.append(_kernel(1, 17, t, 2.0, "MemcpyD2H"))
        events.append(_kernel(7, 5, 0.0, t, "PjitFunction(train_step)"))  # host time
        t += 100.0
    return events


def test_gpu_trace_is_summed_per_step_by_kernel_and_kind():
    s = trace_summary.summarize(_gpu_trace(), steps=2, top=3)
    assert len(s["threads"]) == 2 and all("Stream" in t for t in s["threads"])
    assert s["busy_ms_per_step"] == pytest.approx(0.502)  # 500 us of kernels + a 2 us copy
    assert s["kinds_ms_per_step"] == pytest.approx({
        "matmul": 0.3, "attention": 0.1, "elementwise fusion": 0.05, "reduction": 0.04,
        "copy/transpose": 0.01, "memcpy/memset": 0.002})
    assert list(s["kinds_ms_per_step"])[0] == "matmul"  # largest first
    assert [k["name"][:5] for k in s["top_kernels"]] == ["nvjet", "cudnn", "loop_"]
    assert s["top_kernels"][0]["calls_per_step"] == 1.0 and s["kernels_per_step"] == 6.0
    # From the first kernel's start (0) to the second step's copy's end (2 x 525 + 100 + 2 us).
    assert s["span_ms_per_step"] == pytest.approx(1.152 / 2)


def test_cpu_trace_counts_thunks_not_their_wrappers():
    events = [_meta(7, "/host:CPU"), _meta(7, "tf_XLAEigen/1", 3), _meta(7, "python", 5),
              _kernel(7, 3, 0.0, 900.0, "ThunkExecutor::Execute"),
              _kernel(7, 3, 10.0, 600.0, "ynn_fusion.70"), _kernel(7, 3, 620.0, 200.0, "multiply_bitcast_fusion.5"),
              _kernel(7, 5, 0.0, 1000.0, "PjitFunction(train_step)")]
    s = trace_summary.summarize(events, steps=1)
    assert s["threads"] == ["tf_XLAEigen/1"]
    assert s["busy_ms_per_step"] == pytest.approx(0.8)
    assert s["kinds_ms_per_step"] == pytest.approx({"matmul": 0.6, "elementwise fusion": 0.2})


def test_summarize_dir_reads_the_newest_perfetto_trace_and_names_a_missing_one(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        trace_summary.summarize_dir(str(tmp_path), steps=1)
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": _gpu_trace()}, f)
    s = trace_summary.summarize_dir(str(tmp_path), steps=2)
    assert s["trace"] == os.path.join(str(run), "perfetto_trace.json.gz")
    assert "matmul" in trace_summary.format_summary(s)


def test_bench_step_profiles_its_step(tmp_path):
    """benchmarks.step.pretrain_step --profile_dir on the tiny config: a real jax.profiler trace, summarized."""
    bench = pretrain_step
    result = bench.main(["--config=configs/tiny.py", "--seq_len=32", "--batch=8", "--steps=1", "--warmup=1",
                         "--json", f"--profile_dir={tmp_path}", "--profile_steps=2"])
    p = result["profile"]
    assert p["steps"] == 2 and p["busy_ms_per_step"] > 0
    assert sum(p["kinds_ms_per_step"].values()) == pytest.approx(p["busy_ms_per_step"])
    assert p["kinds_ms_per_step"].get("matmul", 0) > 0  # the step's dots are there
    times = [k["ms_per_step"] for k in p["top_kernels"]]
    assert times == sorted(times, reverse=True)
    assert not any(k["name"].startswith("ThunkExecutor") for k in p["top_kernels"])
