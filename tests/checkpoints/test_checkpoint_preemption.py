"""Checkpointing under kill -9, SIGTERM, a failing save and a two-process preemption.

Each test runs this same file as a worker script (`python tests/checkpoints/test_checkpoint_preemption.py
MODE DIR [ARGS]`, see the bottom) in a subprocess with a bounded wall time, escalating SIGTERM to
SIGKILL, then restores what the worker left on the 8 fake CPU devices of conftest.py. The in-process
checkpointing tests are in test_checkpointing.py.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bert_jax.checkpoints.checkpointer import Checkpointer
from tests.helpers.checkpoint_states import abstract_of, device_mesh, small_state
from tests.helpers.xla_flags import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker_env(**extra):
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8),
               PYTHONPATH=os.pathsep.join([REPO, env.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class _Worker:
    """A worker subprocess whose output lines can be awaited with a timeout."""

    def __init__(self, mode, directory, env=None, args=()):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), mode, str(directory), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env=env or _worker_env(), start_new_session=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, prefix, timeout=60.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            if line.startswith(prefix):
                return line
        self.stop()
        pytest.fail(f"worker never printed {prefix!r}; output:\n" + "\n".join(self.lines[-40:]))

    def finish(self, timeout=60.0):
        """Exit code, after draining the output; escalates SIGTERM -> SIGKILL past `timeout`."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail("worker did not exit in time; output:\n" + "\n".join(self.lines[-40:]))
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return rc

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _step_value(step):
    return float(step) * 0.5


def test_kill9_during_async_save_restores_previous_step(tmp_path):
    worker = _Worker("kill_during_save", tmp_path)
    worker.wait_for("SAVING 2")
    assert (tmp_path / "2.orbax-checkpoint-tmp").is_dir()  # we really are mid-save
    worker.proc.send_signal(signal.SIGKILL)
    assert worker.finish() == -signal.SIGKILL

    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=3, handle_sigterm=False)
    assert ckpt.latest_step() == 1
    state, meta = ckpt.restore(abstract_of(small_state()))
    assert meta == {"position": 1}
    assert np.all(np.asarray(state["params"]["w"]) == _step_value(1))
    # The interrupted step can be written again: its leftovers (tmp folder, input state) go.
    assert ckpt.save(2, small_state(_step_value(2)), {"position": 2},
                     input_state_writer=lambda p: open(os.path.join(p, "new"), "w").close())
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [1, 2] and os.listdir(ckpt.input_state_dir(2)) == ["new"]
    ckpt.close()


def test_sigterm_leaves_committed_checkpoint_and_clean_exit(tmp_path):
    worker = _Worker("sigterm_loop", tmp_path)
    worker.wait_for("STEP 3")
    worker.proc.send_signal(signal.SIGTERM)
    stopped = int(worker.wait_for("STOPPED", timeout=30).split()[1])
    assert worker.finish(timeout=30) == 0, "\n".join(worker.lines[-40:])
    assert stopped >= 3

    ckpt = Checkpointer(tmp_path, save_interval_steps=5, max_to_keep=2, handle_sigterm=False)
    assert ckpt.latest_step() == stopped
    state, meta = ckpt.restore(abstract_of(small_state()))
    assert meta == {"position": stopped}
    assert np.all(np.asarray(state["params"]["w"]) == _step_value(stopped))
    with open(os.path.join(ckpt.input_state_dir(stopped), "iterator.json")) as f:
        assert json.load(f) == {"next_batch": stopped + 1}
    ckpt.close()


def test_failing_save_stops_training_nonzero_within_one_interval(tmp_path):
    worker = _Worker("failing_save_loop", tmp_path)
    rc = worker.finish(timeout=60)
    output = "\n".join(worker.lines)
    assert rc not in (0, None), output
    assert "CheckpointSaveError" in output and "Read-only file system" in output, output
    steps = [int(line.split()[1]) for line in worker.lines if line.startswith("STEP ")]
    # Saves at 3 (fine) and 6 (fails in the background); the error stops the loop by step 9.
    assert 6 <= max(steps) <= 9, output
    ckpt = Checkpointer(tmp_path, save_interval_steps=3, max_to_keep=5, handle_sigterm=False)
    assert ckpt.latest_step() == 3
    ckpt.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_multihost_preemption_sync_point_saves_same_step(tmp_path):
    """Two JAX processes; SIGTERM to one; both stop at the agreed step, save it and exit 0."""
    port = str(_free_port())
    env = _worker_env(XLA_FLAGS=xla_flags(), JAX_NUM_CPU_DEVICES="1")
    workers = [_Worker("multihost_loop", tmp_path, env=env, args=(port, str(i))) for i in range(2)]
    try:
        for w in workers:
            w.wait_for("STEP 3", timeout=60)
        workers[1].proc.send_signal(signal.SIGTERM)  # the preemption notice reaches one host
        stopped = [int(w.wait_for("STOPPED", timeout=60).split()[1]) for w in workers]
        rcs = [w.finish(timeout=60) for w in workers]
    finally:
        for w in workers:
            w.stop()
    assert rcs == [0, 0], "\n".join(workers[0].lines[-20:] + workers[1].lines[-20:])
    assert stopped[0] == stopped[1] >= 3

    ckpt = Checkpointer(tmp_path, save_interval_steps=1000, max_to_keep=2, handle_sigterm=False)
    assert ckpt.latest_step() == stopped[0]
    target = {"w": jax.ShapeDtypeStruct((2, 8), jnp.float32, sharding=NamedSharding(device_mesh(8, 1), P()))}
    # The state restores onto this 8-device mesh, in one process; the step says that 2 processes
    # saved input state, and both folders are checked (the loop reads each file shard's position
    # from the folder of the process that saved it: pretrain.input_position).
    state, meta = ckpt.restore(target)
    assert ckpt.input_state_process_count(stopped[0]) == 2
    assert meta == {"position": stopped[0]}
    assert np.all(np.asarray(state["w"]) == float(stopped[0]))
    assert os.path.isdir(ckpt.input_state_dir(stopped[0], 0))
    assert os.path.isdir(ckpt.input_state_dir(stopped[0], 1))
    ckpt.close()


# ---------------------------------------------------------------------------------------------
# Worker entry points (run as `python tests/checkpoints/test_checkpoint_preemption.py MODE DIR [ARGS]`)
# ---------------------------------------------------------------------------------------------


def _write_position(step):
    def write(path):
        with open(os.path.join(path, "iterator.json"), "w") as f:
            json.dump({"next_batch": step + 1}, f)

    return write


def _worker_kill_during_save(directory):
    from orbax.checkpoint._src.path import atomicity

    ckpt = Checkpointer(directory, save_interval_steps=1, max_to_keep=3)
    ckpt.save(1, small_state(_step_value(1)), {"position": 1}, input_state_writer=_write_position(1))
    ckpt.wait_until_finished()

    async def never_commit(self):
        # Hold the save between "data written" and "renamed" so the kill lands mid-save.
        import asyncio

        await asyncio.sleep(3600)

    atomicity.AtomicRenameTemporaryPath.finalize = never_commit
    ckpt.save(2, small_state(_step_value(2)), {"position": 2}, input_state_writer=_write_position(2))
    print("SAVING 2", flush=True)
    time.sleep(600)


def _worker_sigterm_loop(directory):
    ckpt = Checkpointer(directory, save_interval_steps=5, max_to_keep=2)
    for step in range(1, 100_000):
        time.sleep(0.02)  # a training step
        stop = ckpt.should_stop(step)
        ckpt.save(step, small_state(_step_value(step)), {"position": step}, force=stop,
                  input_state_writer=_write_position(step))
        print(f"STEP {step}", flush=True)
        if stop:
            ckpt.close()
            print(f"STOPPED {step}", flush=True)
            return
    raise SystemExit("never stopped")


def _worker_failing_save_loop(directory):
    from orbax.checkpoint._src.path import atomicity

    ckpt = Checkpointer(directory, save_interval_steps=3, max_to_keep=5)
    for step in range(1, 100):
        if step == 4:  # the workdir turns read-only once step 3 is committed
            ckpt.wait_until_finished()

            async def read_only_commit(self):
                raise OSError(errno.EROFS, "Read-only file system (injected)", str(self.get()))

            atomicity.AtomicRenameTemporaryPath.finalize = read_only_commit
        time.sleep(0.05)  # a training step
        ckpt.save(step, small_state(_step_value(step)), {"position": step})
        print(f"STEP {step}", flush=True)
    ckpt.close()


def _worker_multihost_loop(directory, port, process_id):
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=int(process_id),
                               initialization_timeout=60, heartbeat_timeout_seconds=30)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    state = {"w": jax.make_array_from_process_local_data(sharding, np.zeros((1, 8), np.float32))}
    increment = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), out_shardings={"w": sharding})
    ckpt = Checkpointer(directory, save_interval_steps=1000, max_to_keep=2)
    for step in range(1, 100_000):
        state = jax.block_until_ready(increment(state))  # blocking each step avoids gloo deadlocks
        time.sleep(0.02)
        stop = ckpt.should_stop(step)
        ckpt.save(step, state, {"position": step}, force=stop, input_state_writer=_write_position(step))
        print(f"STEP {step}", flush=True)
        if stop:
            ckpt.close()
            print(f"STOPPED {step}", flush=True)
            jax.distributed.shutdown()
            return
    raise SystemExit("never stopped")


if __name__ == "__main__":
    _mode, _directory, *_args = sys.argv[1:]
    {
        "kill_during_save": _worker_kill_during_save,
        "sigterm_loop": _worker_sigterm_loop,
        "failing_save_loop": _worker_failing_save_loop,
        "multihost_loop": _worker_multihost_loop,
    }[_mode](_directory, *_args)
