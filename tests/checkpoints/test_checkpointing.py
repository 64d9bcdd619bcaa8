"""Checkpointing: mesh-changing restore, keep-K, clear errors, failing saves, kill -9 and SIGTERM.

In-process tests run on the 8 fake CPU devices of conftest.py. Tests that kill or signal a
training process run this same file as a worker script (`python tests/checkpoints/test_checkpointing.py MODE
DIR`, see the bottom) in a subprocess with a bounded wall time, escalating SIGTERM to SIGKILL.
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
import optax
import pytest
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from bert_jax.checkpoints.step_dirs import CheckpointRestoreError, CheckpointSaveError
from bert_jax.checkpoints.checkpointer import Checkpointer
from tests.helpers.xla_flags import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array


def _mesh(data, fsdp):
    return Mesh(np.array(jax.devices()[: data * fsdp]).reshape(data, fsdp), ("data", "fsdp"))


# Partition specs per parameter, used on every mesh: on (8, 1) 'fsdp' has size 1.
SPECS = {"kernel": P("fsdp", None), "bias": P(), "embedding": P(None, "fsdp")}


def _make_state(mesh, seed=0):
    rs = np.random.RandomState(seed)
    params = {
        "dense": {"kernel": rs.randn(16, 32).astype(np.float32), "bias": rs.randn(32).astype(np.float32)},
        "embed": {"embedding": rs.randn(64, 16).astype(jnp.bfloat16)},
    }
    params = {
        mod: {name: jax.device_put(v, NamedSharding(mesh, SPECS[name])) for name, v in leaves.items()}
        for mod, leaves in params.items()
    }
    tx = optax.adamw(1e-3)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    opt_state = tx.init(params)
    _, opt_state = tx.update(grads, opt_state, params)  # non-zero moments, count 1
    return TrainState(
        step=jnp.array(7, jnp.int32),
        params=params,
        opt_state=opt_state,
        rng=jax.random.key_data(jax.random.key(seed)),
    )


def _abstract(state, sharding_of):
    """ShapeDtypeStructs of `state` with shardings given per leaf name by `sharding_of(name)`."""

    def leaf(path, x):
        name = getattr(path[-1], "key", getattr(path[-1], "name", None))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(name))

    return jax.tree_util.tree_map_with_path(leaf, state)


def _assert_bitwise_equal(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)} differs"


def _small_state(value=0.0):
    sharding = NamedSharding(_mesh(8, 1), P("data"))
    return {
        "params": {"w": jax.device_put(np.full((8, 4), value, np.float32), sharding),
                   "b": jax.device_put(np.full((4,), value, np.float32), sharding.update(spec=P()))},
        "step": jax.device_put(np.int32(value), sharding.update(spec=P())),
    }


def _abstract_of(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


# ---------------------------------------------------------------------------------------------
# In-process
# ---------------------------------------------------------------------------------------------


def test_restore_onto_other_meshes_is_bitwise(tmp_path):
    saved = _make_state(_mesh(2, 4))
    meta = {"position": 123, "files": ["a.tfrecord", "b.tfrecord"], "config_hash": "abc"}
    with Checkpointer(tmp_path, save_interval_steps=100, max_to_keep=2, handle_sigterm=False) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(7, saved, meta, force=True)
    ckpt = Checkpointer(tmp_path, save_interval_steps=100, max_to_keep=2, handle_sigterm=False)
    assert ckpt.latest_step() == 7

    mesh81 = _mesh(8, 1)
    target = _abstract(saved, lambda name: NamedSharding(mesh81, SPECS.get(name, P())))
    restored, restored_meta = ckpt.restore(target)
    assert isinstance(restored, TrainState) and restored_meta == meta
    _assert_bitwise_equal(restored, saved)
    assert restored.params["dense"]["kernel"].sharding == NamedSharding(mesh81, P("fsdp", None))
    assert restored.params["dense"]["kernel"].sharding.mesh.devices.shape == (8, 1)

    one = SingleDeviceSharding(jax.devices()[3])
    restored, _ = ckpt.restore(_abstract(saved, lambda name: one), step=7)
    _assert_bitwise_equal(restored, saved)
    assert all(x.sharding == one for x in jax.tree.leaves(restored))
    ckpt.close()


def test_reading_only_the_parameters_is_bitwise_and_quiet(tmp_path, caplog):
    """`restore_part` (evaluation, export) reads the parameters alone, read-only, without orbax
    warnings about the checkpoint's other items or about being read-only."""
    from bert_jax.checkpoints import saved_state
    saved = _make_state(_mesh(2, 4))
    with Checkpointer(tmp_path, save_interval_steps=100, max_to_keep=2, handle_sigterm=False) as ckpt:
        assert ckpt.save(3, saved, {"note": "x"}, force=True)
    one = SingleDeviceSharding(jax.devices()[0])
    target = {"params": _abstract(saved, lambda name: one).params}
    with caplog.at_level("INFO"):
        part, step = saved_state.restore_part(tmp_path, target)
        keys = saved_state.saved_keys(tmp_path)
    assert step == 3 and any(k.startswith("params/") for k in keys) and any(k.startswith("opt_state") for k in keys)
    for a, b in zip(jax.tree.leaves(part["params"]), jax.tree.leaves(saved.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    noisy = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert not noisy, noisy


def test_a_stray_step_folder_is_named_with_the_step_to_resume_from(tmp_path):
    saved = _make_state(_mesh(2, 4))
    with Checkpointer(tmp_path, save_interval_steps=100, max_to_keep=2, handle_sigterm=False) as ckpt:
        assert ckpt.save(6, saved, {}, force=True)
    (tmp_path / "99").mkdir()
    (tmp_path / "99" / "garbage").write_text("x")
    ckpt = Checkpointer(tmp_path, save_interval_steps=100, max_to_keep=2, handle_sigterm=False)
    with pytest.raises(CheckpointRestoreError, match=r"/99 has no 'state' item.*to resume from step 6"):
        ckpt.latest_step()
    ckpt.close()
    os.rename(tmp_path / "99", tmp_path.parent / "moved-99")
    with Checkpointer(tmp_path, save_interval_steps=100, max_to_keep=2, handle_sigterm=False) as ckpt:
        assert ckpt.latest_step() == 6


def test_interval_force_keep_k_and_input_state(tmp_path):
    ckpt = Checkpointer(tmp_path, save_interval_steps=3, max_to_keep=2, handle_sigterm=False)
    saved_at = []
    for step in range(1, 11):
        def write(path, step=step):
            with open(os.path.join(path, "iterator.json"), "w") as f:
                json.dump({"step": step}, f)

        if ckpt.save(step, _small_state(step), {"position": step}, force=step == 10,
                     input_state_writer=write):
            saved_at.append(step)
    # A forced final save of an already saved step is a no-op, not an error.
    assert not ckpt.save(10, _small_state(10), {"position": 10}, force=True)
    ckpt.wait_until_finished()
    assert saved_at == [3, 6, 9, 10]
    assert ckpt.all_steps() == [9, 10] and ckpt.latest_step() == 10
    # Input state is pruned together with the steps.
    assert sorted(os.listdir(tmp_path / "input_state")) == ["10", "9"]
    ckpt.close()

    ckpt = Checkpointer(tmp_path, save_interval_steps=3, max_to_keep=2, handle_sigterm=False)
    assert ckpt.latest_step() == 10
    state, meta = ckpt.restore(_abstract_of(_small_state()), step=9)
    assert meta == {"position": 9}
    assert float(state["params"]["w"][0, 0]) == 9.0 and int(state["step"]) == 9
    with open(os.path.join(ckpt.input_state_dir(9), "iterator.json")) as f:
        assert json.load(f) == {"step": 9}
    with pytest.raises(FileNotFoundError, match="step 3"):
        ckpt.restore(_abstract_of(_small_state()), step=3)
    # A step whose input state vanished is refused unless the caller restarts the data.
    (tmp_path / "input_state" / "10" / "process_0" / "iterator.json").unlink()
    with pytest.raises(CheckpointRestoreError, match="input state"):
        ckpt.restore(_abstract_of(_small_state()))
    state, _ = ckpt.restore(_abstract_of(_small_state()), check_input_state=False)
    assert int(state["step"]) == 10
    ckpt.close()


def test_every_step_gets_an_integrity_manifest_sealed_once_committed(tmp_path):
    """Written before orbax's commit (so a committed step always has one), sealed after it."""
    from bert_jax.checkpoints import integrity
    from bert_jax.checkpoints import step_dirs

    with Checkpointer(tmp_path / "sync", save_interval_steps=1, max_to_keep=2, async_save=False,
                      handle_sigterm=False) as ckpt:
        assert ckpt.save(1, _small_state(1), {})
        assert integrity.read_manifest(str(tmp_path / "sync" / "1"))["sealed"]  # synchronous: at once
    ckpt = Checkpointer(tmp_path / "async", save_interval_steps=1, max_to_keep=2, handle_sigterm=False)
    assert ckpt.save(1, _small_state(1), {}, input_state_writer=lambda p: open(os.path.join(p, "x"), "w").close())
    ckpt._mngr.wait_until_finished()  # committed, not yet seen by the Checkpointer
    manifest = integrity.read_manifest(str(tmp_path / "async" / "1"))
    assert not manifest["sealed"] and "input_state/process_0/x" in manifest["files"]
    assert "commit_success.txt" not in manifest["files"]  # written by orbax's rename, after the manifest
    assert step_dirs.check_step(tmp_path / "async", 1) == ("ok", None)  # unsealed still verifies
    ckpt.wait_until_finished()
    manifest = integrity.read_manifest(str(tmp_path / "async" / "1"))
    assert manifest["sealed"] and {"commit_success.txt", "_CHECKPOINT_METADATA"} <= set(manifest["files"])
    state, _ = ckpt.restore(_abstract_of(_small_state()))
    assert float(state["params"]["w"][0, 0]) == 1.0
    ckpt.close()
    assert step_dirs.check_step(tmp_path / "async", 1) == ("ok", None)  # restoring changed no file


def test_state_may_be_donated_as_soon_as_save_returns(tmp_path):
    # pretrain/loop.py jits its step with donate_argnums=0 and runs it right after `save`. JAX then
    # either donates (orbax has its copy) or, while orbax still holds the buffers, skips the
    # donation for that call; the checkpoint must hold the values of save time in both cases.
    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=1, handle_sigterm=False)
    state = _small_state(3.0)
    expected = jax.tree.map(np.asarray, state)
    assert ckpt.save(1, state, {})
    overwrite = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 + 9, s), donate_argnums=0)
    donated = overwrite(state)
    ckpt.wait_until_finished()
    restored, _ = ckpt.restore(_abstract_of(donated))
    _assert_bitwise_equal(restored, expected)
    ckpt.close()


def test_mismatched_targets_raise_naming_the_key(tmp_path):
    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=1, handle_sigterm=False)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        ckpt.restore(_abstract_of(_small_state()))
    ckpt.save(1, _small_state(1.0), {})
    ckpt.wait_until_finished()
    good = _abstract_of(_small_state())
    sharding = good["params"]["w"].sharding

    def with_w(shape, dtype):
        w = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        return {**good, "params": {**good["params"], "w": w}}

    with pytest.raises(CheckpointRestoreError,
                       match=r"shape mismatch: 'params/w': checkpoint \(8, 4\) vs target \(16, 4\)"):
        ckpt.restore(with_w((16, 4), jnp.float32))

    extra = {**good, "params": {**good["params"], "gamma": good["params"]["b"]}}
    with pytest.raises(CheckpointRestoreError, match="missing from the checkpoint: 'params/gamma'"):
        ckpt.restore(extra)

    missing = {**good, "params": {"w": good["params"]["w"]}}
    with pytest.raises(CheckpointRestoreError,
                       match="in the checkpoint but not in the target: 'params/b'"):
        ckpt.restore(missing)

    # orbax alone would cast f32 data into a bf16 target silently.
    with pytest.raises(CheckpointRestoreError,
                       match="dtype mismatch.*'params/w': checkpoint float32 vs target bfloat16"):
        ckpt.restore(with_w((8, 4), jnp.bfloat16))

    with pytest.raises(CheckpointRestoreError, match="abstract target"):
        ckpt.restore(None)
    no_sharding = {**good, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    with pytest.raises(CheckpointRestoreError, match="'step' has no sharding"):
        ckpt.restore(no_sharding)

    with pytest.raises(TypeError, match="typed PRNG keys.*'rng'"):
        ckpt.save(2, {"rng": jax.random.key(0)}, {})
    with pytest.raises(ValueError, match="JSON"):
        ckpt.save(2, _small_state(), {"position": object()})
    # None of the above broke the checkpointer.
    state, _ = ckpt.restore(good)
    assert float(state["params"]["w"][0, 0]) == 1.0
    ckpt.close()


def test_background_save_failure_surfaces_within_one_interval(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    ckpt = Checkpointer(tmp_path, save_interval_steps=2, max_to_keep=3, handle_sigterm=False)
    assert ckpt.save(2, _small_state(2), {})
    ckpt.wait_until_finished()

    async def read_only_commit(self):
        # What a workdir that became read-only does to orbax's final rename.
        raise OSError(errno.EROFS, "Read-only file system (injected)", str(self.get()))

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", read_only_commit)
    assert ckpt.save(4, _small_state(4), {})  # the failure happens in the background
    with pytest.raises(CheckpointSaveError, match="step 4.*Read-only file system") as raised:
        ckpt.save(5, _small_state(5), {})
        ckpt.save(6, _small_state(6), {})  # the next interval at the latest
    assert isinstance(raised.value.__cause__, OSError)
    # Latched: every later call raises again, nothing is ever saved on top of a failure.
    with pytest.raises(CheckpointSaveError):
        ckpt.save(8, _small_state(8), {}, force=True)
    with pytest.raises(CheckpointSaveError):
        ckpt.wait_until_finished()
    assert ckpt.latest_step() == 2
    ckpt.close()  # already reported: close does not raise it a third time


def test_close_raises_a_failed_last_save(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    async def read_only_commit(self):
        raise OSError(errno.EROFS, "Read-only file system (injected)", str(self.get()))

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", read_only_commit)
    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=1, handle_sigterm=False)
    assert ckpt.save(1, _small_state(1), {}, force=True)
    with pytest.raises(CheckpointSaveError, match="step 1"):
        ckpt.close()
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.save(2, _small_state(2), {}, force=True)


def test_unwritable_directory_raises_at_save(tmp_path):
    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory, save_interval_steps=1, max_to_keep=1, handle_sigterm=False)
    directory.rmdir()
    directory.write_text("a file where the checkpoint directory must be")  # we run as root: no chmod
    with pytest.raises(CheckpointSaveError, match="step 1"):
        ckpt.save(1, _small_state(1), {})
    with pytest.raises(CheckpointSaveError):
        ckpt.wait_until_finished()
    ckpt.close()


def test_sigterm_sets_stop_and_forces_a_save(tmp_path):
    seen = []
    outer = signal.signal(signal.SIGTERM, lambda *a: seen.append("outer"))  # never kill pytest
    try:
        ckpt = Checkpointer(tmp_path, save_interval_steps=100, max_to_keep=1)
        assert not ckpt.should_stop(4)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 10
        while not ckpt.should_stop(5) and time.time() < deadline:
            time.sleep(0.01)
        assert ckpt.should_stop(5) and seen == []
        assert ckpt.save(5, _small_state(5), {"position": 5})  # off-interval, saved because of the stop
        ckpt.close()
        assert seen == []
        os.kill(os.getpid(), signal.SIGTERM)  # the previous handler is back
        deadline = time.time() + 10
        while not seen and time.time() < deadline:
            time.sleep(0.01)
        assert seen == ["outer"]
        reopened = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=1, handle_sigterm=False)
        assert reopened.latest_step() == 5
        reopened.close()
    finally:
        signal.signal(signal.SIGTERM, outer)


class _KeyValueStore:
    """jax's distributed client as the hosts' agreement uses it: a dict whose get waits for the key."""

    def __init__(self):
        self.values, self._changed = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self._changed:
            assert key not in self.values, f"{key} set twice"
            self.values[key] = value
            self._changed.notify_all()

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self._changed:
            if not self._changed.wait_for(lambda: key in self.values, timeout=5):
                raise TimeoutError(f"no {key}")
            return self.values[key]


def _two_hosts(tmp_path, monkeypatch):
    """Two `HostAgreement`s of one directory, hosts 0 and 1 of 2, sharing a fake coordination service."""
    import orbax.checkpoint as ocp

    from bert_jax.checkpoints.host_agreement import HostAgreement

    store = _KeyValueStore()
    monkeypatch.setattr(ocp.multihost, "get_jax_distributed_client", lambda: store)
    return store, [HostAgreement(str(tmp_path), process_index=i, process_count=2) for i in range(2)]


def _on_both(hosts, steps, call):
    """`call(host, step)` on both hosts at once (threads), each with its step: results or exceptions."""
    results = [None, None]

    def host(i):
        try:
            results[i] = call(hosts[i], steps[i])
        except Exception as e:  # pylint: disable=broad-except
            results[i] = e

    threads = [threading.Thread(target=host, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_hosts_agreeing_about_different_steps_raise_naming_both(tmp_path, monkeypatch):
    """Two hosts (threads) exchange verdicts through a fake coordination service: about the same
    step they combine them, under keys naming the step; about different steps (their exchanges
    drifted apart) each raises, naming both steps, instead of pairing them."""
    from bert_jax.checkpoints.integrity import Damage

    store, hosts = _two_hosts(tmp_path, monkeypatch)
    damage = Damage("state/d/0", "checksum mismatch")
    verdicts = _on_both(hosts, [8, 8], lambda h, step: h.verdict(
        step, *(("damaged", damage) if h is hosts[1] else ("ok", None))))
    assert verdicts == [("damaged", Damage("state/d/0", "checksum mismatch (found by host 1)")), ("damaged", damage)]
    found = [key for key in store.values if not key.rsplit("/", 2)[-2] == "step"]  # the verdicts' keys
    assert len(found) == 2 and all("/step_8/" in key for key in found), sorted(store.values)

    for call in ("verdict", "failure"):
        args = ("ok", None) if call == "verdict" else (None,)
        drifted = _on_both(hosts, [8, 4], lambda h, step: getattr(h, call)(step, *args))
        for error in drifted:
            assert isinstance(error, CheckpointRestoreError), drifted
            assert "about step 8" in str(error) and "about step 4" in str(error), str(error)


def test_a_restore_failing_on_one_host_fails_on_every_host(tmp_path, monkeypatch):
    """The restores' outcomes are combined: a host whose own read succeeded gets the failing host's
    error (a corrupt read as `CheckpointCorruptError` carrying the step, so that it falls back too);
    a corrupt failure outranks a mismatch; all ok stays ok; one process exchanges nothing."""
    from bert_jax.checkpoints.step_dirs import CheckpointCorruptError
    from bert_jax.checkpoints.host_agreement import HostAgreement

    _, hosts = _two_hosts(tmp_path, monkeypatch)
    unreadable = CheckpointCorruptError("chunk 3 unreadable")
    outcomes = _on_both(hosts, [5, 5], lambda h, step: h.failure(step, unreadable if h is hosts[1] else None))
    assert outcomes[1] is unreadable
    assert type(outcomes[0]) is CheckpointCorruptError and outcomes[0].step == 5, outcomes
    assert str(outcomes[0]) == "host 1: chunk 3 unreadable" and "host 1 could not restore it" in str(outcomes[0].damage)

    mismatch = CheckpointRestoreError("no key 'params/x'")
    outcomes = _on_both(hosts, [6, 6], lambda h, step: h.failure(step, mismatch if h is hosts[0] else unreadable))
    assert outcomes[1] is unreadable and type(outcomes[0]) is CheckpointCorruptError, outcomes
    assert str(outcomes[0]) == "host 1: chunk 3 unreadable"

    assert _on_both(hosts, [7, 7], lambda h, step: h.failure(step, None)) == [None, None]
    alone = HostAgreement(str(tmp_path), process_index=0, process_count=1)
    assert alone.failure(7, None) is None and alone.failure(7, mismatch) is mismatch


def test_hosts_meet_at_barriers_of_one_name_and_one_process_at_none(tmp_path, monkeypatch):
    """After the same exchanges, every host's barrier has the same key (the hosts' calls in step);
    a single process waits at no barrier."""
    import orbax.checkpoint as ocp

    from bert_jax.checkpoints.host_agreement import HostAgreement

    _, hosts = _two_hosts(tmp_path, monkeypatch)
    met = []
    monkeypatch.setattr(ocp.multihost, "sync_global_processes",
                        lambda key, timeout, processes: met.append((key, sorted(processes))))
    _on_both(hosts, [3, 3], lambda h, step: h.verdict(step, "ok", None))
    for host in hosts:
        host.barrier("moved_damaged")
    assert len(met) == 2 and met[0] == met[1] and met[0][1] == [0, 1], met
    assert met[0][0].endswith("/2/moved_damaged"), met  # the second exchange of this directory

    HostAgreement(str(tmp_path), process_index=0, process_count=1).barrier("moved_damaged")
    assert len(met) == 2, met


# ---------------------------------------------------------------------------------------------
# Subprocesses: kill -9, SIGTERM, failing saves, two-process preemption
# ---------------------------------------------------------------------------------------------


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
    state, meta = ckpt.restore(_abstract_of(_small_state()))
    assert meta == {"position": 1}
    assert np.all(np.asarray(state["params"]["w"]) == _step_value(1))
    # The interrupted step can be written again: its leftovers (tmp folder, input state) go.
    assert ckpt.save(2, _small_state(_step_value(2)), {"position": 2},
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
    state, meta = ckpt.restore(_abstract_of(_small_state()))
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
    target = {"w": jax.ShapeDtypeStruct((2, 8), jnp.float32, sharding=NamedSharding(_mesh(8, 1), P()))}
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
# Worker entry points (run as `python tests/checkpoints/test_checkpointing.py MODE DIR [ARGS]`)
# ---------------------------------------------------------------------------------------------


def _write_position(step):
    def write(path):
        with open(os.path.join(path, "iterator.json"), "w") as f:
            json.dump({"next_batch": step + 1}, f)

    return write


def _worker_kill_during_save(directory):
    from orbax.checkpoint._src.path import atomicity

    ckpt = Checkpointer(directory, save_interval_steps=1, max_to_keep=3)
    ckpt.save(1, _small_state(_step_value(1)), {"position": 1}, input_state_writer=_write_position(1))
    ckpt.wait_until_finished()

    async def never_commit(self):
        # Hold the save between "data written" and "renamed" so the kill lands mid-save.
        import asyncio

        await asyncio.sleep(3600)

    atomicity.AtomicRenameTemporaryPath.finalize = never_commit
    ckpt.save(2, _small_state(_step_value(2)), {"position": 2}, input_state_writer=_write_position(2))
    print("SAVING 2", flush=True)
    time.sleep(600)


def _worker_sigterm_loop(directory):
    ckpt = Checkpointer(directory, save_interval_steps=5, max_to_keep=2)
    for step in range(1, 100_000):
        time.sleep(0.02)  # a training step
        stop = ckpt.should_stop(step)
        ckpt.save(step, _small_state(_step_value(step)), {"position": step}, force=stop,
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
        ckpt.save(step, _small_state(_step_value(step)), {"position": step})
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
