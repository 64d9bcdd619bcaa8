"""Loss divergence: the spike rule against hand-computed values, its state across a resume, the
settings' checks, the record of skipped batches, and end to end through `bert_jax.main`: a planted
spike rolls the run back and skips the batches an uninterrupted run given the same skip by hand
skips (bit for bit, also when killed right after the rollback and resumed), a spike under
on_divergence=stop exits 81, and a crash still exits 1 (bert_jax/exit_codes.py)."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bert_jax import exit_codes
from bert_jax.pretrain import divergence, rollback
from bert_jax.pretrain.divergence import DivergenceError, DivergenceMonitor, Settings

ROOT = Path(__file__).resolve().parents[2]


def _settings(**kw) -> Settings:
    base = dict(action="rollback", ema_decay=0.5, margin=0.5, warmup_steps=2, steps=3, rollback_skip_batches=0,
                max_rollbacks=2)
    return Settings(**{**base, **kw})


def _feed(monitor, losses, first=1):
    """{step: Divergence} of feeding `losses` (NaN: a non-finite step) from step `first` on."""
    found = {}
    for step, loss in enumerate(losses, first):
        d = monitor.observe(step, loss, math.isfinite(loss))
        if d is not None:
            found[step] = d
    return found


# ---------------------------------------------------------------------------------------------
# The rule, in-process
# ---------------------------------------------------------------------------------------------


def test_the_rule_decides_as_computed_by_hand():
    # decay 0.5, margin 0.5, warm-up 2, K 3. By hand: the mean is 10, 9 (8 is not judged: warm-up),
    # 7.5, 6.75; 20 > 6.75 * 1.5 twice, then 5 breaks the run of spikes (mean 5.875); three
    # times 20 > 8.8125: a divergence at step 10, first spike step 8.
    monitor = DivergenceMonitor(_settings())
    found = _feed(monitor, [10, 8, 6, 6, 20, 20, 5, 20, 20, 20])
    assert list(found) == [10]
    d = found[10]
    assert (d.step, d.first_spike_step, d.loss, d.statistic) == (10, 8, 20, 5.875)
    assert monitor.state() == {"mean": 5.875, "normal_steps": 5, "streak": 3, "last_step": 10}
    assert "loss diverged at step 10: 3 spike or non-finite steps in a row from step 8" in d.describe()
    assert "8.8125" in d.describe()  # the bar: mean * (1 + margin)
    # At the bar (4 * 1.5) is no spike, above it is; during the warm-up nothing is, and all is averaged.
    at_bar, above = DivergenceMonitor(_settings(steps=1)), DivergenceMonitor(_settings(steps=1))
    assert _feed(at_bar, [4, 4, 6]) == {} and at_bar.mean == 5.0
    assert list(_feed(above, [4, 4, 6.5])) == [3] and above.mean == 4.0
    warm = DivergenceMonitor(_settings(steps=1, warmup_steps=3))
    assert _feed(warm, [4, 400, 4]) == {} and warm.mean == 103.0


def test_non_finite_steps_count_and_steps_are_fed_once_in_order():
    monitor = DivergenceMonitor(_settings(steps=2, warmup_steps=100))  # still warming up: only non-finite counts
    found = _feed(monitor, [7.0, float("nan"), 7.0, float("inf"), float("nan")])
    assert list(found) == [5]
    assert (found[5].first_spike_step, found[5].loss, found[5].statistic) == (4, None, 7.0)
    assert "non-finite" in found[5].describe()
    with pytest.raises(ValueError, match="step 5 fed after step 5"):
        monitor.observe(5, 1.0, True)
    with pytest.raises(ValueError, match="step 9 fed after step 5"):
        monitor.observe(9, 1.0, True)


def test_a_monitor_restored_from_its_saved_state_decides_as_an_uninterrupted_one():
    rng = random.Random(3)
    losses = [10.0 / (1 + 0.05 * s) + rng.uniform(0, 0.3) for s in range(80)]
    for s in (20, 21, 22, 40, 41, 60, 61, 62, 63):
        losses[s] *= 3.0  # spikes, two runs of them long enough
    losses[50] = float("nan")
    settings = _settings(ema_decay=0.9, warmup_steps=5)
    whole = DivergenceMonitor(settings)
    want = _feed(whole, losses)
    assert sorted(want) == [23, 63, 64]  # steps 21-23 and 61-64 spiked (41-42: too few in a row)
    for cut in range(0, len(losses) + 1, 7):  # saved after step `cut` (as JSON, as in a checkpoint's meta)
        first = DivergenceMonitor(settings)
        got = _feed(first, losses[:cut])
        saved = json.loads(json.dumps(first.state()))
        resumed = DivergenceMonitor(settings, saved, step=999)  # the state's step wins
        got.update(_feed(resumed, losses[cut:], first=cut + 1))
        assert got == want and resumed.state() == whole.state(), cut
    assert DivergenceMonitor(settings, None, step=12).state() == {"mean": None, "normal_steps": 0, "streak": 0,
                                                                  "last_step": 12}


def test_bad_settings_and_skips_are_named_by_their_field():
    import ml_collections

    from configs import base
    assert divergence.settings_from(base.get_config()) is None  # off by default
    for field, value, message in (("on_divergence", "sometimes", "config.on_divergence must be one of"),
                                  ("divergence_margin", 0.0, "config.divergence_margin=0.0 must be positive"),
                                  ("divergence_ema_decay", 1.0, r"config.divergence_ema_decay=1.0 must be in \[0, 1\)"),
                                  ("divergence_steps", 0, "config.divergence_steps=0 must be an integer >= 1"),
                                  ("max_rollbacks", -1, "config.max_rollbacks=-1 must be an integer >= 0")):
        config = base.get_config()
        config[field] = value
        with pytest.raises(ValueError, match=message):
            divergence.settings_from(config)
    config = ml_collections.ConfigDict(dict(on_divergence="stop", divergence_steps=2))
    assert divergence.settings_from(config) == Settings("stop", 0.99, 0.5, 100, 2, 0, 5)
    assert divergence.parse_skip_batches(" 4:5, 0:1 ") == {4: 5, 0: 1} and divergence.parse_skip_batches("") == {}
    for text, message in (("4", "'4' is not STEP:BATCHES"), ("4:x", "is not STEP:BATCHES"),
                          ("4:0", "at least 1 batch"), ("4:1,4:2", "step 4 is given twice")):
        with pytest.raises(ValueError, match=rf"config.skip_batches={text!r}: .*{message}"):
            divergence.parse_skip_batches(text)


def test_skips_add_up_in_the_workdir_and_by_hand(tmp_path):
    skipped = rollback.SkippedBatches(str(tmp_path), {4: 1, 9: 2})
    assert (skipped.after(4), skipped.after(9), skipped.after(5), skipped.rollbacks) == (1, 2, 0, 0)
    skipped.record(4, 5, {"event": "rollback", "step": 9})
    skipped.record(4, 6, {"event": "rollback", "step": 11})  # a second rollback to the same step adds to it
    again = rollback.SkippedBatches(str(tmp_path), {})  # as a resumed run reads it
    assert (again.after(4), again.rollbacks, [e["step"] for e in again.history]) == (11, 2, [9, 11])
    assert rollback.SkippedBatches(str(tmp_path), {4: 1}).after(4) == 12
    assert json.loads((tmp_path / "skipped_batches.json").read_text())["skipped_after_step"] == {"4": 11}
    (tmp_path / "skipped_batches.json").write_text('{"rollbacks": 1}')
    with pytest.raises(ValueError, match="skipped_batches.json is damaged .*restore it from a copy"):
        rollback.SkippedBatches(str(tmp_path), {})


class _Steps:
    """A Checkpointer's committed steps, and what the rollback asked of it."""

    def __init__(self, steps):
        self.steps, self.calls = steps, []

    def wait_until_finished(self):
        self.calls.append("wait")

    def all_steps(self):
        return self.steps

    def move_steps_aside(self, first):
        self.calls.append(("move", first))


def test_no_rollback_without_a_checkpoint_before_the_spike_in_this_phase_or_past_the_budget(tmp_path):
    found = divergence.Divergence(step=30, first_spike_step=28, loss=9.0, statistic=3.0, steps=3, margin=0.5)
    skipped = rollback.SkippedBatches(str(tmp_path), {})
    for steps, phase_start, message in (([], 0, "no checkpoint before step 28 in this phase .there is none"),
                                        ([10, 28], 20, "the newest before it, step 10, is in an earlier phase")):
        ckpt = _Steps(steps)
        with pytest.raises(DivergenceError, match=message) as refused:
            rollback.roll_back(found, _settings(), ckpt, None, skipped, phase_start, None, "")
        assert ckpt.calls == ["wait"] and "loss diverged at step 30" in str(refused.value)  # nothing moved
    skipped.rollbacks = 2
    with pytest.raises(DivergenceError, match=r"2 rollbacks already \(config.max_rollbacks=2"):
        rollback.roll_back(found, _settings(), _Steps([10]), None, skipped, 0, None, "")
    assert exit_codes.of(DivergenceError("x")) == exit_codes.DIVERGED == 81


# ---------------------------------------------------------------------------------------------
# End to end: bert_jax.main with a planted spike (tests/helpers/fault_hooks.py)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tests.helpers.pretraining_records import write_records
    d = tmp_path_factory.mktemp("data")
    for i in range(4):
        write_records(d / f"train-{i}.tfrecord", 64, seed=i)
    return d


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    """A folder with a sitecustomize.py of the spike and kill hooks, and the env that loads it."""
    from tests.helpers import fault_hooks
    folder = tmp_path_factory.mktemp("hooks")
    (folder / "sitecustomize.py").write_text(fault_hooks.SPIKE_AT_STEPS + fault_hooks.KILL_AFTER_ROLLBACK)
    cache = tmp_path_factory.mktemp("xla_cache")  # the runs of this module compile one step: once
    return folder, dict(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _main(hooks, data, workdir, *overrides, **env):
    """`python -m bert_jax.main` on configs/test.py for 12 steps (logged every 3, saved every 4), with
    the hooks loaded and `env` set: the finished process."""
    from tests.helpers.xla_flags import xla_flags
    folder, cache = hooks
    args = [sys.executable, "-m", "bert_jax.main", f"--config={ROOT / 'configs/test.py'}", f"--workdir={workdir}",
            f"--config.train_data={data}/train-*.tfrecord", "--config.log_every_steps=3",
            "--config.checkpoint_every_steps=4", "--config.num_train_steps=12", "--config.shuffle_buffer_size=64",
            "--config.verify_data=false", *overrides]
    e = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2), TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=f"{folder}:{ROOT}", **cache, **env)
    return subprocess.run(args, env=e, cwd=ROOT, timeout=300, capture_output=True, text=True)


def _log(workdir) -> list:
    return [json.loads(line) for line in (Path(workdir) / "train_log.jsonl").read_text().splitlines()]


def _meta(step_dir) -> dict:
    return json.loads((Path(step_dir) / "meta" / "metadata").read_text())


def _consumed(workdir) -> dict:
    """{checkpoint step: batches its input had read}, as the input pipeline counted them (its saved position)."""
    states = Path(workdir) / "checkpoints" / "input_state"
    return {int(p.name): json.loads((p / "process_0" / "shard_0" / "input_state.json").read_text())
            ["counters"]["batches"] for p in states.iterdir()}


def test_a_rollback_skips_what_a_skip_by_hand_skips_also_when_killed_before_the_next_save(hooks, data, tmp_path):
    from tests.helpers.pretraining_records import logged_losses
    # The reference: uninterrupted, told to skip 5 batches after step 4.
    ref = _main(hooks, data, tmp_path / "ref", "--config.skip_batches=4:5")
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = logged_losses((tmp_path / "ref" / "train_log.jsonl").read_text())
    assert sorted(want) == list(range(1, 13))
    # Step 4 is saved before the skip (a resume from it skips again), the later steps after it.
    assert _consumed(tmp_path / "ref") == {4: 4, 8: 8 + 5, 12: 12 + 5}

    # Spikes planted at 7, 8, 9 (K=3): judged at step 9 (a log step). Step 8 was saved meanwhile
    # (its statistic fetched for the save: 2 spikes so far); the run rolls back to 4, skips the
    # 9 - 4 = 5 batches steps 5-9 read, logs steps 5 and 6 again, and is killed before saving 8.
    work = tmp_path / "w"
    spiked = (tmp_path / "spiked")
    spiked.mkdir()
    rollback_run = ("--config.on_divergence=rollback", "--config.divergence_warmup_steps=2")
    killed = _main(hooks, data, work, *rollback_run, FAULT_SPIKE_STEPS="7,8,9", FAULT_SPIKE_DIR=str(spiked),
                   FAULT_KILL_AFTER_ROLLBACK="1")
    assert killed.returncode == -9, killed.stderr[-3000:]
    log = _log(work)
    events = [row for row in log if "event" in row]
    assert len(events) == 1
    event = events[0]
    assert set(event) == {"event", "step", "first_spike_step", "loss", "statistic", "restored_step",
                          "skipped_batches", "rollbacks"}
    assert (event["event"], event["step"], event["first_spike_step"], event["restored_step"],
            event["skipped_batches"], event["rollbacks"]) == ("rollback", 9, 7, 4, 5, 1)
    # The statistic: the moving average (decay 0.99) of the real losses of steps 1-6, computed here.
    before = {row["step"]: row["loss"] for row in log[:log.index(event)]}
    assert sorted(before) == list(range(1, 10)) and all(before[s] == want[s] for s in range(1, 5))
    # Steps 5-9 read batches 5-9 here; with the skip, step 5 reads batch 10: it is drawn after the skip.
    assert all(before[s] != want[s] for s in range(5, 10))
    mean = before[1]
    for step in range(2, 7):
        mean = 0.99 * mean + 0.01 * before[step]
        if step == 4:
            assert _meta(work / "checkpoints" / "4")[divergence.META_KEY] == {
                "mean": mean, "normal_steps": 4, "streak": 0, "last_step": 4}
    assert event["statistic"] == mean and event["loss"] == 100 * before[9]  # the loss judged: the hook's
    assert "rolled back to step 4, skipping 5 batches" in killed.stderr
    after = log[log.index(event) + 1:]
    assert [row["step"] for row in after] == [5, 6] and [row["loss"] for row in after] == [want[5], want[6]]
    assert [p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit()] == ["4"]
    diverged = list((work / "checkpoints" / "diverged").iterdir())
    assert [p.name.split("-")[0] for p in diverged] == ["8"]
    # Saved between two log steps, step 8's statistic covers exactly steps 1-8 (7 and 8 spikes so far).
    assert _meta(diverged[0] / "8")[divergence.META_KEY] == {"mean": mean, "normal_steps": 6, "streak": 2,
                                                             "last_step": 8}
    recorded = json.loads((work / "skipped_batches.json").read_text())
    assert (recorded["skipped_after_step"], recorded["rollbacks"], recorded["history"]) == ({"4": 5}, 1, [event])

    # Resumed from step 4: the recorded skip applies again; the spike is spent (its marker exists).
    resumed = _main(hooks, data, work, *rollback_run, FAULT_SPIKE_STEPS="7,8,9", FAULT_SPIKE_DIR=str(spiked))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stderr and "skipping 5 batches after step 4" in resumed.stderr
    assert logged_losses((work / "train_log.jsonl").read_text()) == want  # bitwise, every step
    assert _consumed(work) == {4: 4, 8: 8 + 5, 12: 12 + 5}
    assert len([row for row in _log(work) if "event" in row]) == 1
    assert json.loads((work / "skipped_batches.json").read_text()) == recorded


def test_a_spike_under_stop_exits_81_and_a_crash_exits_1(hooks, data, tmp_path):
    stop = ("--config.on_divergence=stop", "--config.divergence_warmup_steps=1", "--config.divergence_steps=1")
    spiked = tmp_path / "spiked"
    spiked.mkdir()
    stopped = _main(hooks, data, tmp_path / "stop", *stop, FAULT_SPIKE_STEPS="2", FAULT_SPIKE_DIR=str(spiked))
    assert stopped.returncode == exit_codes.DIVERGED == 81, stopped.stderr[-3000:]
    assert ("DivergenceError: loss diverged at step 2: 1 spike or non-finite steps in a row from step 2"
            in stopped.stderr)
    assert "against the moving average of earlier losses" in stopped.stderr
    assert "bert_jax: exit code 81 (diverged: running the same command again would fail" in stopped.stderr
    # Judged when step 3 ended the log window: the window is logged before the run stops, and nothing is saved.
    assert [row["step"] for row in _log(tmp_path / "stop")] == [1, 2, 3]
    assert not [p for p in (tmp_path / "stop" / "checkpoints").iterdir() if p.name.isdigit()]
    # The same run whose hook cannot write its marker (an OSError mid-training): a crash, retried.
    crashed = _main(hooks, data, tmp_path / "crash", *stop, FAULT_SPIKE_STEPS="2",
                    FAULT_SPIKE_DIR=str(tmp_path / "missing"))
    assert crashed.returncode == exit_codes.CRASH == 1, crashed.stderr[-3000:]
    assert "FileNotFoundError" in crashed.stderr and "bert_jax: exit code" not in crashed.stderr
