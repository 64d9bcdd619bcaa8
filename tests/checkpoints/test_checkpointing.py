"""Checkpointing in-process: mesh-changing restore, keep-K, clear errors, failing saves, SIGTERM's
stop, and the hosts' agreement about a restore.

Runs on the 8 fake CPU devices of conftest.py. The tests that kill or signal a training process
(kill -9, SIGTERM, a failing save, two-process preemption) are in test_checkpoint_preemption.py.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from bert_jax.checkpoints.step_dirs import CheckpointRestoreError, CheckpointSaveError
from bert_jax.checkpoints.checkpointer import Checkpointer
from tests.helpers.checkpoint_states import abstract_of, device_mesh, small_state


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array


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


# ---------------------------------------------------------------------------------------------
# In-process
# ---------------------------------------------------------------------------------------------


def test_restore_onto_other_meshes_is_bitwise(tmp_path):
    saved = _make_state(device_mesh(2, 4))
    meta = {"position": 123, "files": ["a.tfrecord", "b.tfrecord"], "config_hash": "abc"}
    with Checkpointer(tmp_path, save_interval_steps=100, max_to_keep=2, handle_sigterm=False) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(7, saved, meta, force=True)
    ckpt = Checkpointer(tmp_path, save_interval_steps=100, max_to_keep=2, handle_sigterm=False)
    assert ckpt.latest_step() == 7

    mesh81 = device_mesh(8, 1)
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
    saved = _make_state(device_mesh(2, 4))
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
    saved = _make_state(device_mesh(2, 4))
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

        if ckpt.save(step, small_state(step), {"position": step}, force=step == 10,
                     input_state_writer=write):
            saved_at.append(step)
    # A forced final save of an already saved step is a no-op, not an error.
    assert not ckpt.save(10, small_state(10), {"position": 10}, force=True)
    ckpt.wait_until_finished()
    assert saved_at == [3, 6, 9, 10]
    assert ckpt.all_steps() == [9, 10] and ckpt.latest_step() == 10
    # Input state is pruned together with the steps.
    assert sorted(os.listdir(tmp_path / "input_state")) == ["10", "9"]
    ckpt.close()

    ckpt = Checkpointer(tmp_path, save_interval_steps=3, max_to_keep=2, handle_sigterm=False)
    assert ckpt.latest_step() == 10
    state, meta = ckpt.restore(abstract_of(small_state()), step=9)
    assert meta == {"position": 9}
    assert float(state["params"]["w"][0, 0]) == 9.0 and int(state["step"]) == 9
    with open(os.path.join(ckpt.input_state_dir(9), "iterator.json")) as f:
        assert json.load(f) == {"step": 9}
    with pytest.raises(FileNotFoundError, match="step 3"):
        ckpt.restore(abstract_of(small_state()), step=3)
    # A step whose input state vanished is refused unless the caller restarts the data.
    (tmp_path / "input_state" / "10" / "process_0" / "iterator.json").unlink()
    with pytest.raises(CheckpointRestoreError, match="input state"):
        ckpt.restore(abstract_of(small_state()))
    state, _ = ckpt.restore(abstract_of(small_state()), check_input_state=False)
    assert int(state["step"]) == 10
    ckpt.close()


def test_every_step_gets_an_integrity_manifest_sealed_once_committed(tmp_path):
    """Written before orbax's commit (so a committed step always has one), sealed after it."""
    from bert_jax.checkpoints import integrity
    from bert_jax.checkpoints import step_dirs

    with Checkpointer(tmp_path / "sync", save_interval_steps=1, max_to_keep=2, async_save=False,
                      handle_sigterm=False) as ckpt:
        assert ckpt.save(1, small_state(1), {})
        assert integrity.read_manifest(str(tmp_path / "sync" / "1"))["sealed"]  # synchronous: at once
    ckpt = Checkpointer(tmp_path / "async", save_interval_steps=1, max_to_keep=2, handle_sigterm=False)
    assert ckpt.save(1, small_state(1), {}, input_state_writer=lambda p: open(os.path.join(p, "x"), "w").close())
    ckpt._mngr.wait_until_finished()  # committed, not yet seen by the Checkpointer
    manifest = integrity.read_manifest(str(tmp_path / "async" / "1"))
    assert not manifest["sealed"] and "input_state/process_0/x" in manifest["files"]
    assert "commit_success.txt" not in manifest["files"]  # written by orbax's rename, after the manifest
    assert step_dirs.check_step(tmp_path / "async", 1) == ("ok", None)  # unsealed still verifies
    ckpt.wait_until_finished()
    manifest = integrity.read_manifest(str(tmp_path / "async" / "1"))
    assert manifest["sealed"] and {"commit_success.txt", "_CHECKPOINT_METADATA"} <= set(manifest["files"])
    state, _ = ckpt.restore(abstract_of(small_state()))
    assert float(state["params"]["w"][0, 0]) == 1.0
    ckpt.close()
    assert step_dirs.check_step(tmp_path / "async", 1) == ("ok", None)  # restoring changed no file


def test_state_may_be_donated_as_soon_as_save_returns(tmp_path):
    # pretrain/loop.py jits its step with donate_argnums=0 and runs it right after `save`. JAX then
    # either donates (orbax has its copy) or, while orbax still holds the buffers, skips the
    # donation for that call; the checkpoint must hold the values of save time in both cases.
    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=1, handle_sigterm=False)
    state = small_state(3.0)
    expected = jax.tree.map(np.asarray, state)
    assert ckpt.save(1, state, {})
    overwrite = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 + 9, s), donate_argnums=0)
    donated = overwrite(state)
    ckpt.wait_until_finished()
    restored, _ = ckpt.restore(abstract_of(donated))
    _assert_bitwise_equal(restored, expected)
    ckpt.close()


def test_mismatched_targets_raise_naming_the_key(tmp_path):
    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=1, handle_sigterm=False)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        ckpt.restore(abstract_of(small_state()))
    ckpt.save(1, small_state(1.0), {})
    ckpt.wait_until_finished()
    good = abstract_of(small_state())
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
        ckpt.save(2, small_state(), {"position": object()})
    # None of the above broke the checkpointer.
    state, _ = ckpt.restore(good)
    assert float(state["params"]["w"][0, 0]) == 1.0
    ckpt.close()


def test_background_save_failure_surfaces_within_one_interval(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    ckpt = Checkpointer(tmp_path, save_interval_steps=2, max_to_keep=3, handle_sigterm=False)
    assert ckpt.save(2, small_state(2), {})
    ckpt.wait_until_finished()

    async def read_only_commit(self):
        # What a workdir that became read-only does to orbax's final rename.
        raise OSError(errno.EROFS, "Read-only file system (injected)", str(self.get()))

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", read_only_commit)
    assert ckpt.save(4, small_state(4), {})  # the failure happens in the background
    with pytest.raises(CheckpointSaveError, match="step 4.*Read-only file system") as raised:
        ckpt.save(5, small_state(5), {})
        ckpt.save(6, small_state(6), {})  # the next interval at the latest
    assert isinstance(raised.value.__cause__, OSError)
    # Latched: every later call raises again, nothing is ever saved on top of a failure.
    with pytest.raises(CheckpointSaveError):
        ckpt.save(8, small_state(8), {}, force=True)
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
    assert ckpt.save(1, small_state(1), {}, force=True)
    with pytest.raises(CheckpointSaveError, match="step 1"):
        ckpt.close()
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.save(2, small_state(2), {}, force=True)


def test_unwritable_directory_raises_at_save(tmp_path):
    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory, save_interval_steps=1, max_to_keep=1, handle_sigterm=False)
    directory.rmdir()
    directory.write_text("a file where the checkpoint directory must be")  # we run as root: no chmod
    with pytest.raises(CheckpointSaveError, match="step 1"):
        ckpt.save(1, small_state(1), {})
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
        assert ckpt.save(5, small_state(5), {"position": 5})  # off-interval, saved because of the stop
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
