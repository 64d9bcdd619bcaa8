"""bert_jax/checkpoints/save_deadline.py: a save not committed within its limit ends the process (exit 124),
one committed in time does not; the same for a restore (through `Checkpointer.restore`, its read
held up in-process); and orbax's own save timeout lies past ours. The end-to-end case (the emulator
frozen as a real save starts) is in tests/pretrain/test_gcs_pretrain.py."""

import logging
import threading
import time

import jax.numpy as jnp
import numpy as np

from bert_jax.checkpoints import checkpointing
from bert_jax.checkpoints.checkpointing import Checkpointer
from bert_jax.checkpoints.save_deadline import EXIT_CODE, Deadline


def _deadline(seconds, saving):
    exits = []
    return Deadline(seconds, "gs://b/run/checkpoints", saving, exit=exits.append), exits


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


def _saved(tmp_path, **kwargs) -> Checkpointer:
    """A Checkpointer over `tmp_path` holding step 2 of a small state."""
    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=2, handle_sigterm=False, **kwargs)
    ckpt.save(2, {"w": jnp.arange(4.0)}, {"position": 2})
    ckpt.wait_until_finished()
    return ckpt


def test_a_restore_that_stalls_ends_the_process_after_its_limit(tmp_path, caplog, capfd):
    ckpt = _saved(tmp_path, restore_timeout_s=1.0)
    exits = []
    ckpt._restore_deadline._exit = exits.append  # pylint: disable=protected-access
    read, unfrozen = ckpt._reader.read, threading.Event()  # pylint: disable=protected-access

    def frozen_read(*args, **kwargs):  # tensorstore waiting on a store that stopped answering
        unfrozen.wait(30)
        return read(*args, **kwargs)

    ckpt._reader.read = frozen_read  # pylint: disable=protected-access
    target = {"w": jnp.zeros(4)}
    done = []
    with caplog.at_level(logging.ERROR):
        restoring = threading.Thread(target=lambda: done.append(ckpt.restore_latest(target)))
        restoring.start()
        _wait(lambda: exits, 10)
        unfrozen.set()  # (os._exit would have ended the process here)
        restoring.join(30)
    assert exits == [EXIT_CODE]
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"restoring step 2 from {ckpt.directory} did not finish within 1 s" in message, message
    assert "config.checkpoint_restore_timeout_seconds" in message
    assert "_watch" in capfd.readouterr().err  # every thread's stack
    assert done and done[0][0] == 2  # the held-up read itself was left to finish

    # A restore in time, then time past the limit: nothing fires (the deadline lifted at its end).
    ckpt._reader.read = read  # pylint: disable=protected-access
    exits_in_time = []
    ckpt._restore_deadline = Deadline(1.0, ckpt.directory, exit=exits_in_time.append, kind="restore")
    step, state, meta = ckpt.restore_latest(target)
    time.sleep(2.0)
    ckpt.close()
    assert (step, meta, exits_in_time) == (2, {"position": 2}, [])
    np.testing.assert_array_equal(state["w"], np.arange(4.0))


def test_orbax_gives_a_save_longer_than_our_deadline(tmp_path):
    orbax_default = checkpointing.ocp.AsyncOptions().timeout_secs
    for seconds, want in ((1800, max(orbax_default, 1800 + checkpointing.ORBAX_TIMEOUT_MARGIN_S)),
                          (60, orbax_default), (None, checkpointing.ORBAX_TIMEOUT_WITHOUT_DEADLINE_S)):
        assert checkpointing.orbax_timeout_s(seconds) == want
        assert want > (seconds or 0) + 60
    # What orbax's background save thread is given: 1800 s of ours plus the margin.
    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=1, handle_sigterm=False, save_timeout_s=1800)
    try:
        # pylint: disable=protected-access
        assert ckpt._mngr._checkpointer._async_manager._timeout_secs == checkpointing.orbax_timeout_s(1800) > 1800
    finally:
        ckpt.close()
