"""benchmarks/suite.py: one process per run, killed at its limit, records kept as runs end.

No test times this machine: a run's limit counts from the moment it is ready to be killed
(`_counting_from_ready`), the budget is kept on a planted clock, and every other wait is a hang
guard (`HANG_S`)."""

import json
import os
import subprocess
import sys
import textwrap
import time
import types

import pytest

import benchmarks.suite
from benchmarks.finetune import end_to_end, profile_first_run
from benchmarks.step import cpu_bf16, fp8, pretrain_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG_S = 60  # waits for what takes well under a second here: only a hang runs out


@pytest.fixture
def suite():
    return benchmarks.suite


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _alive(pid):
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


def _counting_from_ready(monkeypatch, suite):
    """`suite.run_one`'s limit for a run counts from when the run is ready: when its script has
    created `<its path>.ready`, or has ended (waiting at most `HANG_S` for either). However slowly
    a loaded machine starts a run, it is killed where the test means it to be, and a run meant to
    end is never killed."""

    class Popen(subprocess.Popen):
        def communicate(self, input=None, timeout=None):  # pylint: disable=redefined-builtin
            if timeout is not None:
                ready, deadline = f"{self.args[1]}.ready", time.time() + HANG_S
                while not os.path.exists(ready) and self.poll() is None and time.time() < deadline:
                    time.sleep(0.02)
            return super().communicate(input, timeout)

    monkeypatch.setattr(suite, "subprocess", types.SimpleNamespace(
        Popen=Popen, PIPE=subprocess.PIPE, TimeoutExpired=subprocess.TimeoutExpired))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_hung_run_is_killed_with_what_it_started_and_says_where_it_was(suite, tmp_path, monkeypatch):
    """Killed at its limit with the child it started (which, left alone, would sleep its 120 s
    out and say so): no test of how long the kill took."""
    pid_file, ready, slept_out = tmp_path / "grandchild.pid", tmp_path / "hang.py.ready", tmp_path / "slept_out"
    hang = _script(tmp_path, "hang.py", f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
                                  "import time; time.sleep(120); open({str(slept_out)!r}, 'w').close()"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("[pretrain_step 1.0 s] compiled in 0.5 s", file=sys.stderr, flush=True)
        print("[pretrain_step 1.1 s] timing round 1 of 1", file=sys.stderr, flush=True)
        open({str(ready)!r}, "w").close()
        time.sleep(120)
    """)
    _counting_from_ready(monkeypatch, suite)
    record = suite.run_one([sys.executable, hang], timeout_s=3)
    assert record["status"] == "timeout" and "result" not in record
    assert record["stderr_tail"].splitlines()[-1].endswith("timing round 1 of 1")
    grandchild = int(pid_file.read_text())
    deadline = time.time() + HANG_S
    while _alive(grandchild) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the run's own child survived the kill"
    assert not slept_out.exists(), "the run's own child was waited for, not killed"


def test_failures_and_missing_output_are_errors_with_their_tails(suite, tmp_path):
    boom = _script(tmp_path, "boom.py", """
        import sys
        print("half a line of output")
        sys.exit("RESOURCE_EXHAUSTED: out of memory allocating 56 GiB")
    """)
    record = suite.run_one([sys.executable, boom], timeout_s=60)
    assert record["status"] == "error" and record["returncode"] == 1
    assert "RESOURCE_EXHAUSTED" in record["stderr_tail"]
    silent = _script(tmp_path, "silent.py", "print('no json here')\n")
    record = suite.run_one([sys.executable, silent], timeout_s=60)
    assert record["status"] == "error" and record["returncode"] == 0
    assert record["stdout_tail"] == "no json here"
    missing = suite.run_one([str(tmp_path / "no_such_program")], timeout_s=60)
    assert missing["status"] == "error" and "no_such_program" in missing["stderr_tail"]


def test_the_budget_skips_runs_it_cannot_fit_and_every_record_is_written_as_it_ends(suite, tmp_path, monkeypatch):
    ok = _script(tmp_path, "ok.py", """
        import json, sys
        print("some text first")
        print(json.dumps({"flags": sys.argv[1:], "step_s": 0.5}))
    """)
    slow = _script(tmp_path, "slow.py", f"open({str(tmp_path / 'slow.py.ready')!r}, 'w').close()\n"
                                        "import time; time.sleep(60)\n")
    out = tmp_path / "sub" / "results.jsonl"
    out.parent.mkdir()
    out.write_text(json.dumps({"name": "earlier", "status": "ok", "wall_s": 1.0}) + "\n")  # appended to
    runs = [("first", ok, ["--a=1"]), ("slow", slow, []), ("never", ok, [])]
    _counting_from_ready(monkeypatch, suite)  # 'first' ends before its limit counts: never killed
    # The budget's clock, planted: a run that ends takes 1 s of it, one killed its limit (the
    # processes and the kill are real; how long a loaded machine took over them does not count).
    clock, run_one = types.SimpleNamespace(now=100.0), suite.run_one

    def timed_run_one(cmd, timeout_s, env=None):
        record = run_one(cmd, timeout_s, env)
        clock.now += timeout_s if record["status"] == "timeout" else 1.0
        return record

    monkeypatch.setattr(suite, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(suite, "run_one", timed_run_one)
    # 'slow' gets the 4 s limit; afterwards < MIN_RUN_S of the budget is left, so 'never' is skipped.
    records = suite.run_suite(runs, str(out), timeout_s=4, budget_s=suite.MIN_RUN_S + 3)
    assert [r["status"] for r in records] == ["ok", "timeout", "skipped"]
    assert records[0]["result"] == {"flags": ["--a=1", "--json"], "step_s": 0.5}
    assert records[1]["limit_s"] == 4
    assert all(r["cpu"] == suite.cpu_description() for r in records)  # the machine's CPU and units in each
    assert [r["name"] for r in suite.read_records(str(out))] == ["earlier", "first", "slow", "never"]
    assert suite.read_records(str(out))[1:] == records


def test_a_real_bench_step_run_and_its_table_row(suite, tmp_path):
    (name, module, flags), = [run for run in suite.SUITES["smoke"] if run[0] == "tiny_unrolled"]
    out = tmp_path / "smoke.jsonl"
    # Limits as hang guards (the run takes ~20 s on an idle 2-core machine): it is not timed here.
    suite.main(["--suite=smoke", "--only=tiny_unrolled", f"--out={out}", "--timeout_s=1200", "--budget_s=1200"])
    (record,) = suite.read_records(str(out))
    assert record["status"] == "ok", record["stderr_tail"]
    result = record["result"]
    assert (result["layers"], result["seq_len"], result["batch"], result["timed_steps"]) == (2, 32, 8, 2)
    assert result["sequences_per_s"] == pytest.approx(8 / result["step_s"])
    # benchmarks.step.pretrain_step logged its phases to stderr: a run killed later would show the last one.
    assert "compiled in" in record["stderr_tail"] and "done: median step" in record["stderr_tail"]
    row = suite.table([record]).splitlines()[2].split("|")
    assert row[1].strip() == "tiny_unrolled" and row[-2].strip() == "ok"
    assert row[10].strip() == f"{result['step_s'] * 1e3:.1f}"
    rate = result["sequences_per_s"]  # (the table gives 3 digits below 100 sequences/s: a loaded machine)
    assert row[11].strip() == format(rate, ",.0f" if rate >= 100 else ".3g")


def test_only_names_unknown_runs(suite, capsys):
    with pytest.raises(SystemExit):
        suite.main(["--suite=gpu", "--only=large_128,larg_512"])
    err = capsys.readouterr().err
    assert "larg_512" in err and "large_512_packed" in err


def test_every_suite_run_parses_with_its_modules_flags(suite):
    """A typo in a suite's flags would cost a device-minute; parse them all here."""
    for runs in suite.SUITES.values():
        for name, module, flags in runs:
            assert os.path.exists(os.path.join(ROOT, *module.split(".")) + ".py"), name
            flags, missing = suite.fill(flags, {"minilm": "/m", "hf_python": "/py"})
            assert not missing and not any("{" in f for f in flags), name
            if module == "benchmarks.finetune.end_to_end":  # its own parser alone
                args = end_to_end.parse(flags + ["--json"])
                assert (args.model, args.hf_python, args.json) == ("/m", "/py", True), name
                continue
            if module == "benchmarks.step.cpu_bf16":  # its own parser alone
                assert cpu_bf16.parse(flags + ["--json"]).json, name
                continue
            if module == "benchmarks.finetune.profile_first_run":  # its own parser alone
                args = profile_first_run.parse(flags + ["--json"])
                assert args.model == "/m" and args.json, name
                continue
            if module in ("benchmarks.step.optimizer", "benchmarks.step.dropout"):  # own flags; the rest are pretrain_step's
                own = {"--step", "--rounds", "--steps"}
                flags = [f for f in flags if f.split("=")[0] not in own]
            if module == "benchmarks.step.fp8":  # its own parser, then pretrain_step's for the rest
                _, args = fp8.parse(flags + ["--json"])
            else:
                args = pretrain_step.parse_args(flags + ["--json"])
            assert os.path.exists(os.path.join(ROOT, args.config)), name


def test_the_fine_tuning_run_is_skipped_without_its_python_and_tabled_with_its_ratio(suite, tmp_path):
    """The cpu suite's end-to-end run: skipped (and said why) without --hf_python; its record's
    row shows both sides' wall clocks and their ratio."""
    runs = [(n, s, f) for n, s, f in suite.SUITES["cpu"] if s == "benchmarks.finetune.end_to_end"]
    assert len(runs) == 3 and "--hf_autocast_bf16" in runs[2][2]  # the last: both sides in bf16
    assert "cpu_bf16=off" in runs[1][2] and "cpu_bf16=off" not in runs[0][2]  # ours in float32; ours as default
    runs = runs[:1]
    records = suite.run_suite(runs, str(tmp_path / "r.jsonl"), 60, 60, values={"minilm": "/m", "hf_python": ""})
    assert records[0]["status"] == "skipped" and "--hf_python" in records[0]["stderr_tail"]
    result = {"benchmark": "bench_finetune", "runs": [{
        "task": "sst2", "train_examples": 2000,
        "bert_jax": {"wall_s": 100.0, "train_sequences_per_s": 20.0},
        "transformers": {"wall_s": 149.0, "process_wall_s": 150.0, "train_sequences_per_s": 16.5},
        "bert_jax_warm": {"wall_s": 60.0, "train_sequences_per_s": 20.0}}]}
    row = suite.table([{"name": runs[0][0], "status": "ok", "wall_s": 260.0, "result": result}]).splitlines()[-1]
    assert "ours 100 s wall, 20 training seq/s; transformers 150 s, 16.5 seq/s; wall ratio 1.50x" in row
    assert "ours again on its compilation cache 60 s (2.50x)" in row
    assert "--warm" in runs[0][2]
    skipped = suite.table([{"name": runs[0][0], "status": "ok", "wall_s": 1.0,
                            "result": {"benchmark": "bench_finetune", "skipped": "needs ../shared/data"}}])
    assert "skipped, needs ../shared/data" in skipped


def test_fine_tuning_over_seeds_runs_both_sides_per_seed_and_reports_each_scores_spread(monkeypatch):
    """`benchmarks.finetune.end_to_end --seeds`: each seed runs ours then transformers' with that seed; the first
    seed's runs stay the record's `bert_jax`/`transformers`; `scores` has each score's mean and
    sample standard deviation per side (here from hand-picked scores), and `head_init` names both
    sides' head draws (ours as `--set head_init` says)."""
    bench = end_to_end
    calls = []

    def ours(config, workdir, overrides):
        calls.append(("ours", overrides["seed"], overrides.get("head_init")))
        f1 = {42: 0.10, 1: 0.20, 2: 0.60}[overrides["seed"]]
        return {"results": {"conll2003/dev/f1": f1, "conll2003/dev/loss": 1.0}, "wall_s": 1.0}

    def theirs(python, args):
        seed = int(next(a for a in args if a.startswith("--seed="))[7:])
        calls.append(("hf", seed, python))
        return {"dev_f1": {42: 0.30, 1: 0.30, 2: 0.30}[seed], "wall_s": 2.0}

    monkeypatch.setattr(bench, "run_ours", ours)
    monkeypatch.setattr(bench, "run_hf", theirs)
    args = bench.parse(["--seeds=42,1,2", "--hf_python=/py", "--warm", "--set", "head_init=normal"])
    args.overrides, args.seed_list = {"head_init": "normal"}, [42, 1, 2]
    out = {}
    bench.over_seeds(args, out, "configs/ner.py", "/tmp", "conll", {"head_init": "normal"}, ["--task=conll2003"])
    # Seed by seed, ours then theirs; ours once more on its cache after the first (--warm).
    assert calls == [("ours", 42, "normal"), ("hf", 42, "/py"), ("ours", 42, "normal"),
                     ("ours", 1, "normal"), ("hf", 1, "/py"), ("ours", 2, "normal"), ("hf", 2, "/py")]
    assert [row["seed"] for row in out["seeds"]] == [42, 1, 2]
    assert out["bert_jax"] is out["seeds"][0]["bert_jax"] and "bert_jax_warm" in out
    ours_f1 = out["scores"]["bert_jax"]["conll2003/dev/f1"]
    assert ours_f1["mean"] == pytest.approx(0.30) and ours_f1["std"] == pytest.approx(0.26457513, rel=1e-6)
    assert (ours_f1["min"], ours_f1["max"], ours_f1["values"]) == (0.10, 0.60, [0.10, 0.20, 0.60])
    assert "conll2003/dev/loss" not in out["scores"]["bert_jax"]  # scores only
    assert out["scores"]["transformers"]["dev_f1"]["std"] == 0.0
    assert out["head_init"]["bert_jax"].startswith("transformers'")
    assert out["head_init"]["transformers"].startswith("transformers'")
    with pytest.raises(SystemExit, match="--seeds"):
        bench.main(["--seeds=1,x"])


def test_the_cpu_bf16_matmul_run_times_each_form_and_tables_its_ratios(suite, capsys):
    """`benchmarks.step.cpu_bf16` (issue 57: which matmul form pays on this CPU), at a tiny size: every op in
    each form, its ratio float32 over bf16-in-float32-out, and the suite's row naming them."""
    bench = cpu_bf16
    bench.main(["--batch=1", "--seq_len=8", "--repeats=1", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [op["op"] for op in result["ops"]] == [name for name, *_ in bench.ops(1, 8)]
    for op in result["ops"]:
        assert min(op["float32_ms"], op["bf16_in_f32_out_ms"], op["bf16_in_bf16_out_ms"]) > 0
        assert op["mixed_speedup"] == pytest.approx(op["float32_ms"] / op["bf16_in_f32_out_ms"])
    row = suite.table([{"name": "cpu_bf16_matmuls", "status": "ok", "wall_s": 1.0, "result": result}]).splitlines()[-1]
    first = result["ops"][0]
    assert f"dense x @ w {first['float32_ms']:.3g} / {first['bf16_in_f32_out_ms']:.3g} ms" in row
    assert row.count("x);") == len(result["ops"]) - 1


def test_each_record_names_the_cpu_and_its_units(suite):
    """The CPU decides float32's and bf16's speed: every record carries its model and units."""
    xeon = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n"
            "flags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile\nprocessor\t: 1\n")
    zen3 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma\n"
    assert suite.cpu_description(xeon)["flags"] == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert suite.cpu_description(xeon)["model"] == "Intel(R) Xeon(R) Platinum 8488C"
    assert suite.cpu_description(zen3) == {"model": "AMD EPYC 7B13", "cores": os.cpu_count(), "flags": ["avx2", "fma"]}
