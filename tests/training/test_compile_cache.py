"""config.compilation_cache: where JAX's persistent compilation cache goes, and what a run found there.

The two-run check through `python -m bert_jax.main` (the second run loads every program and ends
with the same results to the bit) is `tests/finetune/test_finetune.py::test_main_second_run_loads_its_programs`.
"""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

from bert_jax.training import compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_compilation_cache_max_size",
         "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def jax_settings():
    """configure() changes JAX's process-wide settings: put them back for the next tests."""
    before = {n: getattr(jax.config, n) for n in NAMES}
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    for n, v in before.items():
        jax.config.update(n, v)


def test_auto_uses_the_bert_jax_cache_folder_with_a_size_cap(tmp_path, monkeypatch, jax_settings):
    monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    message = compile_cache.configure("auto")
    folder = str(tmp_path / "cache" / "xla")
    assert jax.config.jax_compilation_cache_dir == folder
    assert jax.config.jax_enable_compilation_cache
    assert jax.config.jax_compilation_cache_max_size == 4 << 30
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0  # every program
    assert os.path.isdir(folder)
    assert folder in message and "4 GiB" in message


def test_auto_keeps_the_users_own_jax_setting(tmp_path, monkeypatch, jax_settings):
    monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    message = compile_cache.configure("auto")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
    assert "JAX's own setting" in message
    assert not (tmp_path / "cache").exists()


def test_off_turns_the_cache_off_whatever_the_environment_says(tmp_path, jax_settings):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    assert compile_cache.configure("off").startswith("off")
    assert not jax.config.jax_enable_compilation_cache


def test_a_folder_is_used_as_given(tmp_path, monkeypatch, jax_settings):
    folder = str(tmp_path / "mine" / "xla")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2.5")  # the user's threshold stays
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
    assert folder in compile_cache.configure(folder)
    assert jax.config.jax_compilation_cache_dir == folder
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5
    assert os.path.isdir(folder)


def test_a_folder_that_cannot_be_made_names_the_key(tmp_path, jax_settings):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"config\.compilation_cache=.*file/xla.*cannot create"):
        compile_cache.configure(str(tmp_path / "file" / "xla"))


def test_auto_under_an_unwritable_cache_folder_runs_without_a_cache(tmp_path, monkeypatch, jax_settings):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("BERT_JAX_CACHE_DIR", str(tmp_path / "file" / "cache"))
    message = compile_cache.configure("auto")
    assert message.startswith("off: cannot create") and "config.compilation_cache" in message
    assert not jax.config.jax_enable_compilation_cache


def test_stats_count_programs_loaded_from_the_cache(tmp_path):
    """In a fresh process (JAX initializes its cache once per process): a program compiled, its
    in-memory copy dropped, compiled again -> the second comes from the folder, and CacheStats
    counts one hit of two requests; with the entry cut in half, the third is compiled again."""
    script = textwrap.dedent(f"""
        import os
        os.environ["BERT_JAX_CACHE_DIR"] = {str(tmp_path / "cache")!r}
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        os.environ.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
        import numpy as np, jax, jax.numpy as jnp
        from bert_jax.training import compile_cache
        print(compile_cache.configure("auto"))
        stats = compile_cache.CacheStats().start()
        f = lambda x: jnp.tanh(x @ x.T).sum()
        x = np.ones((64, 64), np.float32)
        first = jax.jit(f)(x)
        jax.clear_caches()
        second = jax.jit(f)(x)
        assert float(first) == float(second)
        print(stats.hits, stats.requests)
        print(stats.summary())
        # A damaged entry (a run killed while writing it): JAX warns and compiles again.
        folder = jax.config.jax_compilation_cache_dir
        for name in os.listdir(folder):
            if name.endswith("-cache"):
                path = os.path.join(folder, name)
                data = open(path, "rb").read()
                open(path, "wb").write(data[:len(data) // 2])
        jax.clear_caches()
        third = jax.jit(f)(x)
        assert float(third) == float(first)
        print(stats.hits, stats.requests)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert str(tmp_path / "cache" / "xla") in lines[0]
    assert lines[1] == "1 2"
    assert lines[2].startswith("1 of 2 programs loaded from it")
    assert lines[3] == "1 3"  # the damaged entry was not loaded
    assert os.listdir(tmp_path / "cache" / "xla")


def test_the_cache_can_live_in_a_bucket(gcs_server, bucket):
    """A pod's VMs come back empty after a preemption: a cache in the run's bucket is still there.
    JAX reaches it through etils.epath, which bert_jax points at gcsfs (here the emulator)."""
    script = textwrap.dedent(f"""
        import os
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        import numpy as np, jax, jax.numpy as jnp
        from bert_jax.training import compile_cache
        from data_pipeline import storage
        print(compile_cache.configure({bucket + "/xla"!r}))
        stats = compile_cache.CacheStats().start()
        f = lambda x: jnp.tanh(x @ x.T).sum()
        x = np.ones((64, 64), np.float32)
        first = jax.jit(f)(x)
        jax.clear_caches()  # a new VM: nothing in memory, nothing on its disk
        second = jax.jit(f)(x)
        assert float(first) == float(second)
        print(stats.hits, stats.requests)
        print(sum(name.endswith("-cache") for name in storage.listdir({bucket + "/xla"!r})))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith(bucket + "/xla")
    assert lines[1] == "1 2" and lines[2] == "1"  # the second compile was loaded from the bucket
