"""bert_jax/training/compile_ahead.py: programs compiled on a background thread are the ones the later
calls run (no second compile), with the same results to the bit; failures are left to the call."""

import logging
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.training import compile_ahead


@pytest.fixture
def compiles(monkeypatch):
    """The names of the programs XLA compiles from here on, and on which thread (jax's own log)."""
    seen = []

    class Handler(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of "):
                seen.append((message.split()[4], threading.current_thread().name))

    handler = Handler(level=logging.DEBUG)
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    yield seen
    jax.config.update("jax_log_compiles", False)
    logger.removeHandler(handler)


def _step(w, batch):
    h = jnp.tanh(batch["x"] @ w)
    return w - 0.1 * (h.T @ batch["x"]).T, jnp.sum(h * batch["weight"][:, None])


def _batches(lengths):
    rng = np.random.RandomState(0)
    return [{"x": rng.randn(4, n).astype(np.float32), "weight": np.ones(4, np.float32)} for n in lengths]


def test_programs_compiled_ahead_are_not_compiled_again_and_compute_the_same(compiles):
    batches = _batches([8, 8, 8, 8])  # one shape
    w = jnp.ones((8, 8), jnp.float32) * 0.01
    step = jax.jit(_step)
    ahead = compile_ahead.CompileAhead()
    ahead.submit_each("step", step, (jax.ShapeDtypeStruct(w.shape, w.dtype),), iter(batches))
    ahead.wait(("step", compile_ahead.signature(batches[0])))
    assert [name for name, thread in compiles if "_step" in name] == ["jit(_step)"]
    assert all(thread.startswith("compile_ahead") for name, thread in compiles if "_step" in name)
    got, losses = w, []
    for b in batches:
        got, loss = step(got, b)
        losses.append(loss)
    assert [name for name, _ in compiles].count("jit(_step)") == 1, compiles  # no compile at the calls
    want, want_losses = w, []
    for b in batches:  # an independent reference: the plain function, not jitted
        want, loss = _step(want, {k: jnp.asarray(v) for k, v in b.items()})
        want_losses.append(loss)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    fresh = jax.jit(_step)  # and bit for bit the program compiled at its first call
    again = w
    for b in batches:
        again, _ = fresh(again, b)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))
    ahead.close()


def test_each_new_batch_signature_is_compiled_once_while_the_caller_waits_only_for_its_own(compiles):
    batches = _batches([16, 8, 16, 24, 8])
    w = {n: jnp.ones((n, n), jnp.float32) for n in (8, 16, 24)}
    step = jax.jit(lambda b: jnp.sum(jnp.tanh(b["x"]) * b["weight"][:, None]))
    ahead = compile_ahead.CompileAhead()
    ahead.submit_each("eval", step, (), iter(batches), limit=None)
    for b in batches:
        ahead.wait(("eval", compile_ahead.signature(b)))
        step(b)
    ahead.close()
    ours = [t for name, t in compiles if name == "jit(<lambda>)"]
    assert len(ours) == 3 and all(t.startswith("compile_ahead") for t in ours), compiles  # 16, 8, 24
    assert [k[1] for k, _ in ahead.compiled] == [compile_ahead.signature(batches[i]) for i in (0, 1, 3)]
    del w


def test_a_limit_stops_the_walk():
    batches = _batches([8, 16, 24])
    ahead = compile_ahead.CompileAhead()
    ahead.submit_each("eval", jax.jit(lambda b: b["x"].sum()), (), iter(batches), limit=2)
    ahead.wait(("eval", compile_ahead.signature(batches[1])))
    ahead._pool.shutdown(wait=True)
    assert len(ahead.compiled) == 2


def test_a_failed_compile_ahead_is_left_to_the_call(caplog):
    bad = jax.jit(lambda b: b["x"] @ b["x"])  # [4, 8] @ [4, 8]: a shape error at tracing
    ahead = compile_ahead.CompileAhead()
    batch = _batches([8])[0]
    ahead.submit_each("bad", bad, (), iter([batch]))
    with caplog.at_level(logging.WARNING):
        ahead.wait(("bad", compile_ahead.signature(batch)))
    assert "ahead failed" in caplog.text
    with pytest.raises(TypeError):
        bad(batch)
    ahead.close()


def test_disabled_compiles_nothing(compiles):
    ahead = compile_ahead.CompileAhead(enabled=False)
    ahead.submit_each("eval", jax.jit(lambda b: b["x"].sum()), (), iter(_batches([8])))
    ahead.queue_each("eval", jax.jit(lambda b: b["x"].sum()), (), iter(_batches([16])))
    ahead.wait(("eval", compile_ahead.signature(_batches([16])[0])))
    assert compiles == [] and ahead.compiled == []


class _Fake:
    """A jitted function whose lowering's compile runs `fn` (what each compile does, and on which thread)."""

    def __init__(self, fn):
        self.fn = fn

    def lower(self, *args):
        return types.SimpleNamespace(compile=self.fn)


def test_a_thread_waiting_for_a_program_compiles_the_queued_ones_meanwhile():
    """The training step compiles on the background thread; the main thread, waiting for it, compiles
    the queued evaluation programs instead of idling (here the queued one lets the first finish: were
    it left to the background thread, the wait would never end)."""
    gate, ran = threading.Event(), []
    slow = _Fake(lambda: (gate.wait(60), ran.append(("train", threading.current_thread().name))))
    quick = _Fake(lambda: (ran.append(("eval", threading.current_thread().name)), gate.set()))
    ahead = compile_ahead.CompileAhead()
    ahead.submit_each("train", slow, (), iter(_batches([24])))
    ahead.queue_each("eval", quick, (), iter(_batches([8])))
    ahead.wait(("train", compile_ahead.signature(_batches([24])[0])))
    assert gate.is_set()
    assert ran == [("eval", threading.current_thread().name), ("train", "compile_ahead_0")]
    ahead.wait(("eval", compile_ahead.signature(_batches([8])[0])))  # done: returns at once
    ahead.close()


def test_queued_programs_left_at_close_are_dropped_and_never_waited_for():
    ahead = compile_ahead.CompileAhead()
    gate = threading.Event()
    ahead.submit_each("busy", _Fake(lambda: gate.wait(60)), (), iter(_batches([24])))  # the background thread busy
    ahead.queue_each("eval", _Fake(lambda: None), (), iter(_batches([8, 16])))
    ahead.close()
    gate.set()
    waiter = threading.Thread(target=lambda: [ahead.wait(("eval", compile_ahead.signature(_batches([n])[0])))
                                              for n in (8, 16)], daemon=True)
    waiter.start()
    waiter.join(60)  # a hang guard: cancelled, the waits return at once
    assert not waiter.is_alive(), "a wait for a program dropped at close never returned"
    assert [k[0] for k, _ in ahead.compiled] in ([], ["busy"])
