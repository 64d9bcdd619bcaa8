"""bert_jax/pod/progress.py: the hang clock on a fake clock, against a workdir the test writes (a
train_log.jsonl growing, checkpoints committing, a bucket that cannot be read): the budgets it
states, the signals it names, the time it cannot see, and the run's event lines."""

import json

import pytest

from bert_jax.pod import calls
from bert_jax.pod.progress import Progress, read_signals


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class FlakyStorage(calls.Storage):
    """A storage thread that fails while `down`, taking `takes` seconds of the fake clock a call."""

    def __init__(self, clock):
        super().__init__(timeout=30)
        self.clock, self.down, self.takes = clock, False, 0.0

    def call(self, what, fn, *args, **kwargs):
        self.clock.now += self.takes
        if self.down:
            raise calls.Unavailable(f"{what}: the bucket is frozen")
        return super().call(what, fn, *args, **kwargs)


@pytest.fixture
def run(tmp_path):
    clock = Clock()
    io = FlakyStorage(clock)
    log = tmp_path / "train_log.jsonl"

    def step(n):
        with open(log, "a") as f:
            f.write(json.dumps({"step": n, "loss": 2.0}) + "\n")

    def save(n):
        (tmp_path / "checkpoints" / str(n)).mkdir(parents=True)

    yield clock, io, step, save, tmp_path
    io.close()


def test_the_budget_is_the_start_s_then_a_multiple_of_the_longest_gap_between_signals(run):
    clock, io, step, save, workdir = run
    progress = Progress(str(workdir), io, hang_min=60, factor=5, startup=600, clock=clock)
    progress.observe()  # the baseline
    clock.now += 599
    progress.observe()
    assert progress.hung() is None and progress.budget() == 600  # nothing yet: the start's budget
    clock.now += 2
    cause = progress.hung()
    assert cause.startswith("hung: no progress for 601 s (budget 600 s from the start to the first signal)")
    step(1)  # the first signal, 601 s after the start
    progress.observe()
    assert progress.hung() is None and progress.budget() == 60  # no gap seen yet: the floor
    for n in range(2, 5):  # a signal every 20 s: the budget becomes 5 x 20 s = 100 s
        clock.now += 20
        step(n)
        progress.observe()
    assert progress.budget() == 100
    clock.now += 30
    save(4)
    progress.observe()  # a commit is a signal too
    assert progress.budget() == 150 and progress.last_what == "checkpoint step 4 committed"
    clock.now += 151
    assert progress.hung() == ("hung: no progress for 151 s (budget 150 s); the last signal: checkpoint step 4 "
                               "committed, 151 s ago")
    progress.start()  # the next attempt: its start has the longest start seen (601 s) x 5 as budget
    assert progress.budget() == 5 * 601


def test_a_fixed_budget_and_time_the_workdir_could_not_be_read_does_not_count(run):
    clock, io, step, save, workdir = run
    progress = Progress(str(workdir), io, hang_seconds=50, startup=600, clock=clock)
    progress.observe()
    step(1)
    progress.observe()
    assert progress.budget() == 50
    io.down, io.takes = True, 10  # a frozen bucket: each failed read takes 10 s
    for _ in range(8):
        clock.now += 5
        with pytest.raises(calls.Unavailable):
            progress.observe()
    assert progress.hung() is None  # 120 s without a signal, all of it blind
    io.down, io.takes = False, 0
    clock.now += 40
    progress.observe()
    assert progress.hung() is None
    clock.now += 11
    assert progress.hung().startswith("hung: no progress for 51 s (budget 50 s); the last signal: "
                                      "train_log.jsonl at step 1, 171 s ago")


def test_event_lines_are_handed_over_once_and_the_tail_read_is_bounded(run, monkeypatch):
    clock, io, step, save, workdir = run
    from bert_jax.pod import progress as module
    monkeypatch.setattr(module, "TAIL_BYTES", 256)  # a log far longer than the tail read
    progress = Progress(str(workdir), io, clock=clock)
    for n in range(1, 40):
        step(n)
    rollback = {"event": "rollback", "step": 40, "restored_step": 36, "skipped_batches": 4}
    with open(workdir / "train_log.jsonl", "a") as f:
        f.write(json.dumps(rollback) + "\n")
    assert progress.observe() == [rollback]
    step(37)
    assert progress.observe() == []  # seen once
    signals = read_signals(str(workdir))
    assert signals.log_step == 37 and signals.saved_step is None
    assert signals.log_identity[0] > 256 * 4  # the whole log is long; only its tail was parsed


def test_only_committed_steps_count_on_cloud_storage(bucket):
    """On Cloud Storage a step folder exists from its first object on; orbax's commit_success.txt
    marks it committed. A save killed midway leaves a newer folder without one: not progress."""
    from data_pipeline import storage
    from bert_jax.pod.progress import newest_committed_step
    storage.write_text(f"{bucket}/w/checkpoints/8/commit_success.txt", "")
    storage.write_text(f"{bucket}/w/checkpoints/8/state/x", "data")
    storage.write_text(f"{bucket}/w/checkpoints/12/state/x", "half a save")
    storage.write_text(f"{bucket}/w/checkpoints/damaged/4-20261207/x", "")
    assert newest_committed_step(f"{bucket}/w/checkpoints") == 8
    assert newest_committed_step(f"{bucket}/w/nothing") is None
