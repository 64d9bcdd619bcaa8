"""bert_jax/checkpoints/save_deadline.py: a save not committed within its limit ends the process (exit 124),
one committed in time does not. The end-to-end case (the emulator frozen as a real save starts) is
in tests/pretrain/test_gcs_pretrain.py."""

import time

from bert_jax.checkpoints.save_deadline import EXIT_CODE, SaveDeadline


def _deadline(seconds, saving):
    exits = []
    return SaveDeadline(seconds, "gs://b/run/checkpoints", saving, exit=exits.append), exits


def _wait(predicate, timeout):
    deadline = time.time() + timeout
    while not predicate() and time.time() < deadline:
        time.sleep(0.05)


def test_a_save_that_never_commits_ends_the_process_after_its_limit(capfd):
    watch, exits = _deadline(1.0, lambda: True)  # the background write never finishes
    started = time.monotonic()
    watch.arm(8)
    watch.started()
    _wait(lambda: exits, 10)
    assert exits == [EXIT_CODE] and 1.0 <= time.monotonic() - started < 3.0
    err = capfd.readouterr().err
    assert "_watch" in err  # every thread's stack, the watchdog's own among them


def test_a_stalled_call_in_the_callers_thread_is_bounded_too():
    watch, exits = _deadline(0.6, lambda: False)  # orbax's thread idle: the caller's part hangs
    watch.arm(4)  # never `started()`: the caller is still inside the save
    _wait(lambda: exits, 10)
    assert exits == [EXIT_CODE]


def test_saves_committed_in_time_are_left_alone():
    saving = {"now": True}
    watch, exits = _deadline(1.0, lambda: saving["now"])
    watch.arm(4)
    watch.started()
    time.sleep(0.3)
    saving["now"] = False  # committed in the background: the deadline lifts by itself
    time.sleep(1.5)
    watch.arm(8)
    watch.disarm()  # committed, seen by the caller's wait
    time.sleep(1.5)
    watch.close()
    assert exits == []
    off, off_exits = _deadline(0, lambda: True)  # no limit
    off.arm(12)
    assert off._thread is None and off_exits == []  # pylint: disable=protected-access
