"""bert_jax/checkpoints/save_deadline.py: a save not committed within its limit ends the process (exit 124),
one committed in time does not; the same for a restore (through `Checkpointer.restore`, its read
held up in-process); and orbax's own save timeout lies past ours. The end-to-end case (the emulator
frozen as a real save starts) is in tests/pretrain/test_gcs_pretrain.py.

The deadline's clock is planted (`_Clock`): it moves only when a test moves it, so no test here
measures how fast anything ran, and a loaded machine cannot make a save look late or in time. The
watchdog thread itself still polls in real time (every 0.5 s); the tests wait for its polls, with
waits that only a hang would run out of."""

import logging
import threading
import time
import types

import jax.numpy as jnp
import numpy as np

from bert_jax.checkpoints import orbax_manager, save_deadline
from bert_jax.checkpoints.checkpointer import Checkpointer
from bert_jax.checkpoints.save_deadline import EXIT_CODE, Deadline

HANG_S = 60  # every wait below: expected within a poll or two (0.5 s each); only a hang runs out


class _Clock:
    """`save_deadline`'s `time.monotonic`, planted: it reads `now`, which only the test moves, and
    counts the watchdog threads' readings of each value (`read_by_watch`)."""

    def __init__(self):
        self.now = 1000.0
        self._lock = threading.Lock()
        self._reads: dict = {}

    def monotonic(self) -> float:
        with self._lock:
            if threading.current_thread().name.endswith("-deadline"):  # bert_jax-{save,restore}-deadline
                self._reads[self.now] = self._reads.get(self.now, 0) + 1
            return self.now

    def set(self, now: float) -> None:
        with self._lock:
            self.now = now

    def read_by_watch(self, now: float) -> int:
        with self._lock:
            return self._reads.get(now, 0)


def _plant_clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(save_deadline, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    return clock


def _polls(watch: Deadline) -> list:
    """The watchdog's polls, counted: each one waits on `_stop` first. Call before `arm` (which
    starts the thread); returns a list that grows by one per poll."""
    polls = []

    class Counted(threading.Event):
        def wait(self, timeout=None):
            polls.append(1)
            return super().wait(timeout)

    watch._stop = Counted()  # pylint: disable=protected-access
    return polls


def _deadline(seconds, saving):
    exits = []
    return Deadline(seconds, "gs://b/run/checkpoints", saving, exit=exits.append), exits


def _wait(predicate, timeout=HANG_S):
    deadline = time.time() + timeout
    while not predicate() and time.time() < deadline:
        time.sleep(0.02)


def _not_yet_fired(clock, exits, now):
    """Moves the clock to `now` (short of the limit) and waits until the watchdog has read it
    twice: its second reading proves the first did not fire (firing ends the thread)."""
    clock.set(now)
    _wait(lambda: exits or clock.read_by_watch(now) >= 2)
    return exits == [] and clock.read_by_watch(now) >= 2


def test_a_save_that_never_commits_ends_the_process_after_its_limit(capfd, monkeypatch):
    clock = _plant_clock(monkeypatch)
    watch, exits = _deadline(1.0, lambda: True)  # the background write never finishes
    watch.arm(8)  # at 1000.0: the limit is 1001.0
    watch.started()
    assert _not_yet_fired(clock, exits, 1000.999)  # not before its limit, however long that took here
    clock.set(1001.001)
    _wait(lambda: exits)
    assert exits == [EXIT_CODE]  # past it: fired
    err = capfd.readouterr().err
    assert "_watch" in err  # every thread's stack, the watchdog's own among them


def test_a_stalled_call_in_the_callers_thread_is_bounded_too(monkeypatch):
    clock = _plant_clock(monkeypatch)
    watch, exits = _deadline(0.6, lambda: False)  # orbax's thread idle: the caller's part hangs
    watch.arm(4)  # never `started()`: the caller is still inside the save
    assert _not_yet_fired(clock, exits, 1000.5)  # (`saving` False lifts only a `started()` save)
    clock.set(1000.601)
    _wait(lambda: exits)
    assert exits == [EXIT_CODE]


def test_saves_committed_in_time_are_left_alone(monkeypatch):
    clock = _plant_clock(monkeypatch)
    saving, answers = {"now": True}, []

    def in_flight():
        answers.append(saving["now"])
        return saving["now"]

    watch, exits = _deadline(1.0, in_flight)
    polls = _polls(watch)
    watch.arm(4)
    watch.started()
    _wait(lambda: True in answers)  # the watchdog sees the save in flight
    saving["now"] = False  # committed in the background: the deadline lifts by itself
    _wait(lambda: False in answers)
    clock.set(1005.0)  # long past step 4's limit
    seen = len(polls)
    _wait(lambda: exits or len(polls) >= seen + 3)  # the watchdog has looked since (firing ends its polls)
    assert exits == [] and len(polls) >= seen + 3
    watch.arm(8)  # at 1005.0: the limit is 1006.0
    watch.disarm()  # committed, seen by the caller's wait
    clock.set(1010.0)
    seen = len(polls)
    _wait(lambda: exits or len(polls) >= seen + 3)
    assert exits == [] and len(polls) >= seen + 3
    watch.close()
    off, off_exits = _deadline(0, lambda: True)  # no limit
    off.arm(12)
    assert off._thread is None and off_exits == []  # pylint: disable=protected-access


def _saved(tmp_path, **kwargs) -> Checkpointer:
    """A Checkpointer over `tmp_path` holding step 2 of a small state."""
    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=2, handle_sigterm=False, **kwargs)
    ckpt.save(2, {"w": jnp.arange(4.0)}, {"position": 2})
    ckpt.wait_until_finished()
    return ckpt


def test_a_restore_that_stalls_ends_the_process_after_its_limit(tmp_path, caplog, capfd, monkeypatch):
    clock = _plant_clock(monkeypatch)
    ckpt = _saved(tmp_path, restore_timeout_s=1.0)
    exits = []
    ckpt._restorer.deadline._exit = exits.append  # pylint: disable=protected-access
    read, reading, unfrozen = ckpt._restorer.reader.read, threading.Event(), threading.Event()  # pylint: disable=protected-access

    def frozen_read(*args, **kwargs):  # tensorstore waiting on a store that stopped answering
        reading.set()
        unfrozen.wait(HANG_S)
        return read(*args, **kwargs)

    ckpt._restorer.reader.read = frozen_read  # pylint: disable=protected-access
    target = {"w": jnp.zeros(4)}
    done = []
    with caplog.at_level(logging.ERROR):
        restoring = threading.Thread(target=lambda: done.append(ckpt.restore_latest(target)))
        restoring.start()
        try:
            assert reading.wait(HANG_S)  # armed at 1000.0 (the limit: 1001.0), now held in the read
            assert _not_yet_fired(clock, exits, 1000.999)
            clock.set(1001.001)
            _wait(lambda: exits)
        finally:
            unfrozen.set()  # (os._exit would have ended the process here)
            restoring.join(HANG_S)
    assert exits == [EXIT_CODE]
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"restoring step 2 from {ckpt.directory} did not finish within 1 s" in message, message
    assert "config.checkpoint_restore_timeout_seconds" in message
    assert "_watch" in capfd.readouterr().err  # every thread's stack
    assert done and done[0][0] == 2  # the held-up read itself was left to finish

    # A restore in time, then time past the limit: nothing fires (the deadline lifted at its end).
    ckpt._restorer.reader.read = read  # pylint: disable=protected-access
    exits_in_time = []
    ckpt._restorer.deadline = Deadline(1.0, ckpt.directory, exit=exits_in_time.append, kind="restore")
    polls = _polls(ckpt._restorer.deadline)  # pylint: disable=protected-access
    clock.set(2000.0)
    step, state, meta = ckpt.restore_latest(target)  # armed at 2000.0, however long the read took here
    clock.set(2005.0)  # long past its limit
    seen = len(polls)
    _wait(lambda: exits_in_time or len(polls) >= seen + 3)  # the watchdog has looked since
    assert exits_in_time == [] and len(polls) >= seen + 3
    ckpt.close()
    assert (step, meta, exits_in_time) == (2, {"position": 2}, [])
    np.testing.assert_array_equal(state["w"], np.arange(4.0))


def test_orbax_gives_a_save_longer_than_our_deadline(tmp_path):
    orbax_default = orbax_manager.ocp.AsyncOptions().timeout_secs
    for seconds, want in ((1800, max(orbax_default, 1800 + orbax_manager.ORBAX_TIMEOUT_MARGIN_S)),
                          (60, orbax_default), (None, orbax_manager.ORBAX_TIMEOUT_WITHOUT_DEADLINE_S)):
        assert orbax_manager.orbax_timeout_s(seconds) == want
        assert want > (seconds or 0) + 60
    # What orbax's background save thread is given: 1800 s of ours plus the margin.
    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=1, handle_sigterm=False, save_timeout_s=1800)
    try:
        # pylint: disable=protected-access
        assert ckpt._mngr._checkpointer._async_manager._timeout_secs == orbax_manager.orbax_timeout_s(1800) > 1800
    finally:
        ckpt.close()
