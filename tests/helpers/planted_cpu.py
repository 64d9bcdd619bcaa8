"""A planted CPU for `config.cpu_bf16`'s decision (bert_jax/training/cpu_bf16.py), so that no test times this
machine: the fixture `planted_cpu` (a pytest plugin of tests/conftest.py) gives `plant(units, speedup)`,
which sets this CPU's /proc/cpuinfo bf16 units and the probe's measured ratio and returns the list of
probes run. The suite's pin of "auto" to float32 (tests/conftest.py's BERT_JAX_CPU_BF16=off) is lifted,
and the per-process decision forgotten before and after."""

import pytest


@pytest.fixture
def planted_cpu(monkeypatch):
    from bert_jax.model import mixed_precision
    from bert_jax.training import cpu_bf16

    monkeypatch.delenv(cpu_bf16.ENV, raising=False)
    cpu_bf16.decide.cache_clear()
    probed = []

    def plant(units, speedup=2.0):
        monkeypatch.setattr(mixed_precision, "bf16_units", lambda: list(units))
        monkeypatch.setattr(mixed_precision, "bf16_matmul_speedup", lambda: probed.append(1) or speedup)
        cpu_bf16.decide.cache_clear()
        return probed

    yield plant
    cpu_bf16.decide.cache_clear()
