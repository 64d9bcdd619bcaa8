"""`config.cpu_bf16` (bert_jax/training/cpu_bf16.py): which CPUs take the mixed-precision matmuls by
default, one decision per run (several processes, a resumed run), and the switches that override it.
The CPU is planted (its /proc/cpuinfo units and the probe's ratio): no test times this machine."""

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys

import ml_collections
import pytest

from bert_jax import layout
from bert_jax.model import model_config
from bert_jax.training import cpu_bf16, run_setup

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def cpu(planted_cpu):
    """Plants this CPU: `cpu(units, speedup)`; returns the list of probes run (tests/helpers/planted_cpu.py)."""
    return planted_cpu


def _config(setting="auto", **model) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"model": model_config.BertConfig(vocab_size=50, **model).to_dict(),
                                      "cpu_bf16": setting, "init_checkpoint": ""})


def test_auto_is_the_default_of_every_config_that_runs_the_model():
    from configs import base, demo, glue, modernbert_base, modernbert_tiny, ner, own_data, pretrain_small, squad, swag
    for module in (base, demo, glue, modernbert_base, modernbert_tiny, ner, own_data, pretrain_small, squad, swag):
        assert module.get_config().cpu_bf16 == "auto", module.__name__


@pytest.mark.parametrize("setting,units,speedup,want", [
    ("auto", [], 2.0, False), ("auto", ["avx512_bf16"], 1.98, True), ("auto", ["avx512_bf16"], 0.57, False),
    ("auto", ["amx_bf16", "avx512_bf16"], 1.1, True), ("auto", ["amx_bf16"], 1.09, False),
    ("on", [], 0.5, True), ("off", ["amx_bf16"], 2.0, False)])
def test_auto_takes_the_path_where_it_pays_and_warns_where_it_does_not(cpu, caplog, setting, units, speedup, want):
    """1.98x: issue 57's AMD EPYC with avx512_bf16; 0.57x: an Intel Xeon with avx512_bf16 and no AMX;
    the threshold 1.1x taken, just under it not."""
    probed = cpu(units, speedup)
    with caplog.at_level(logging.INFO):
        assert run_setup.bert_config_from(_config(setting)).mixed_matmuls is want
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "no bf16 matmul units" in r.message]
    assert bool(warned) == (want and not units), caplog.text
    assert len(probed) == (setting == "auto" and bool(units))  # measured only where it can decide
    if setting != "off":
        assert f"model.mixed_matmuls={want}" in caplog.text  # the log line says what and why
        assert ("needs 1.1x" in caplog.text) == (setting == "auto" and bool(units))


def test_a_cpu_without_units_keeps_todays_float32_program(cpu):
    """On a CPU without bf16 units "auto" is "off": the same model config, so the same programs to the
    bit, and nothing is timed (the probe would fail this test)."""
    probed = cpu([], speedup=None)
    assert run_setup.bert_config_from(_config("auto")) == run_setup.bert_config_from(_config("off"))
    assert run_setup.bert_config_from(_config("auto")).mixed_matmuls is False
    assert probed == []


def test_the_probe_runs_once_per_process(cpu):
    probed = cpu(["amx_bf16"], 3.5)
    for _ in range(3):  # the demo's pretraining, evaluation and fill-mask; fine-tuning's seeds
        assert run_setup.bert_config_from(_config("auto")).mixed_matmuls is True
    assert len(probed) == 1


def test_models_not_in_float32_and_models_set_mixed_are_left_as_set(cpu, monkeypatch):
    probed = cpu(["amx_bf16"], 3.5)
    assert run_setup.bert_config_from(_config("auto", dtype="bfloat16")).mixed_matmuls is False
    cpu([], 0.5)
    monkeypatch.setenv(cpu_bf16.ENV, "off")
    assert run_setup.bert_config_from(_config("auto", mixed_matmuls=True)).mixed_matmuls is True
    assert probed == []


def test_the_environment_replaces_auto_and_a_setting_wins(cpu, monkeypatch):
    probed = cpu(["amx_bf16"], 3.5)
    monkeypatch.setenv(cpu_bf16.ENV, "off")
    assert run_setup.bert_config_from(_config("auto")).mixed_matmuls is False
    assert run_setup.bert_config_from(_config("on")).mixed_matmuls is True
    cpu([], 0.5)
    monkeypatch.setenv(cpu_bf16.ENV, "on")
    assert run_setup.bert_config_from(_config("auto")).mixed_matmuls is True
    assert run_setup.bert_config_from(_config("off")).mixed_matmuls is False
    assert probed == []
    monkeypatch.setenv(cpu_bf16.ENV, "yes")
    with pytest.raises(ValueError, match="BERT_JAX_CPU_BF16"):
        run_setup.bert_config_from(_config("auto"))


def test_bad_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="config.cpu_bf16"):
        run_setup.bert_config_from(_config("yes"))


def test_a_run_keeps_its_first_decision_when_it_resumes(cpu, tmp_path):
    """The first start records "auto"'s decision in the workdir; a resumed run takes it without timing
    (a probe near the threshold must not change a resumed run's numerics), and says so."""
    probed = cpu(["amx_bf16"], 1.5)
    assert run_setup.bert_config_from(_config(), workdir=str(tmp_path)).mixed_matmuls is True
    recorded = json.loads((tmp_path / layout.CPU_BF16).read_text())
    assert recorded["mixed_matmuls"] is True and "1.50x" in recorded["why"] and recorded["units"] == ["amx_bf16"]
    cpu(["amx_bf16"], 1.0)  # the same CPU timed slower now, e.g. a busy machine
    assert run_setup.bert_config_from(_config(), workdir=str(tmp_path)).mixed_matmuls is True
    assert len(probed) == 1
    assert run_setup.bert_config_from(_config("off"), workdir=str(tmp_path)).mixed_matmuls is False  # a setting wins
    (tmp_path / layout.CPU_BF16).write_text("{not json")
    with pytest.raises(ValueError, match=layout.CPU_BF16):
        run_setup.bert_config_from(_config(), workdir=str(tmp_path))


def test_a_checkpoint_run_by_a_cli_is_decided_here_whatever_it_recorded(cpu):
    """extract_features and fill_mask: a checkpoint trained with mixed matmuls runs in float32 on a CPU
    without the units, and in the mixed form under --cpu_bf16=on."""
    cpu([], 0.5)
    trained = model_config.BertConfig(vocab_size=50, mixed_matmuls=True)
    assert cpu_bf16.for_checkpoint(trained, "auto").mixed_matmuls is False
    assert cpu_bf16.for_checkpoint(trained, "off").mixed_matmuls is False
    assert cpu_bf16.for_checkpoint(trained.replace(mixed_matmuls=False), "on").mixed_matmuls is True
    with pytest.raises(ValueError, match="--cpu_bf16"):
        cpu_bf16.for_checkpoint(trained, "yes")


def _modernbert(setting="auto", **model) -> ml_collections.ConfigDict:
    from configs import modernbert_tiny
    config = modernbert_tiny.get_config()
    config.cpu_bf16 = setting
    config.model.update(model)
    return config


def test_modernbert_pretraining_takes_the_decision_as_bert_does(cpu, tmp_path, monkeypatch):
    """`run_setup.model_config_from` (the model `bert_jax.pretrain.loop` builds) of configs/modernbert_tiny.py:
    "auto" takes the mixed matmuls where they pay and records it in the workdir; "off", a CPU without the
    units, a bfloat16 model and BERT_JAX_CPU_BF16=off keep the float32 model; "on" takes them anywhere."""
    probed = cpu(["avx512_bf16"], 1.8)
    assert run_setup.model_config_from(_modernbert(), workdir=str(tmp_path)).mixed_matmuls is True
    assert json.loads((tmp_path / layout.CPU_BF16).read_text())["mixed_matmuls"] is True
    assert run_setup.model_config_from(_modernbert("off")).mixed_matmuls is False
    assert run_setup.model_config_from(_modernbert(dtype="bfloat16")).mixed_matmuls is False
    assert len(probed) == 1
    cpu([], 0.5)
    plain = run_setup.model_config_from(_modernbert())
    assert plain == run_setup.model_config_from(_modernbert("off")) and plain.mixed_matmuls is False
    assert run_setup.model_config_from(_modernbert("on")).mixed_matmuls is True
    cpu(["avx512_bf16"], 1.8)
    monkeypatch.setenv(cpu_bf16.ENV, "off")
    assert run_setup.model_config_from(_modernbert()).mixed_matmuls is False
    assert len(probed) == 1
    with pytest.raises(ValueError, match="dtype='float32'"):
        run_setup.model_config_from(_modernbert("on", dtype="bfloat16"))


def test_a_modernbert_checkpoint_runs_as_this_runs_decision_says(cpu, tmp_path):
    """Fine-tuning from a transformers ModernBERT (`modernbert_tasks.load`), predicting with a fine-tuned one
    and evaluating one (`run_setup.modernbert_cpu_bf16`): this run's decision, recorded in its workdir,
    whatever the checkpoint's own run computed with."""
    from bert_jax.finetune import modernbert_tasks
    from configs import glue
    from tests.helpers import modernbert_fixture

    config = glue.get_config()
    config.model_family = "modernbert"
    config.init_checkpoint = modernbert_fixture.checkpoint(str(tmp_path / "hf"))
    cpu(["amx_bf16"], 2.0)
    assert modernbert_tasks.load(config, str(tmp_path / "w"))[0].mixed_matmuls is True
    assert json.loads((tmp_path / "w" / layout.CPU_BF16).read_text())["mixed_matmuls"] is True
    config.cpu_bf16 = "off"
    trained = modernbert_tasks.load(config)[0]
    assert trained.mixed_matmuls is False
    recorded_mixed = dataclasses.replace(trained, mixed_matmuls=True)  # e.g. a checkpoint trained with them
    assert run_setup.modernbert_cpu_bf16(config, recorded_mixed).mixed_matmuls is False
    config.cpu_bf16 = "on"
    assert run_setup.modernbert_cpu_bf16(config, trained).mixed_matmuls is True


_HOST = """
import sys, jax
jax.distributed.initialize(f"localhost:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2]),
                           initialization_timeout=60)
from bert_jax.model import mixed_precision
from bert_jax.training import cpu_bf16
mixed_precision.bf16_units = lambda: ["amx_bf16"] if sys.argv[3] != "0" else []
mixed_precision.bf16_matmul_speedup = lambda: float(sys.argv[3])
chosen, why = cpu_bf16.decide()
print("DECIDED", chosen, why, flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.parametrize("speedups,want", [(("2.0", "1.5"), True), (("2.0", "0.9"), False), (("3.0", "0"), False)])
def test_hosts_agree_on_the_slowest_hosts_decision(speedups, want):
    """Two real processes (jax.distributed on 127.0.0.1), each with its own planted CPU: the slowest
    host's ratio decides for both (a host without units counts as 0x), so every host compiles the same
    program."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=REPO)
    env.pop(cpu_bf16.ENV, None)
    hosts = [subprocess.Popen([sys.executable, "-c", _HOST, port, str(i), speedups[i]], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [h.communicate(timeout=180)[0] for h in hosts]
    decided = [[line for line in out.splitlines() if line.startswith("DECIDED")] for out in outputs]
    assert all(len(d) == 1 for d in decided), outputs
    assert [d[0].split()[1] for d in decided] == [str(want)] * 2, outputs
    slowest = min(float(s) for s in speedups)
    assert all(f"the slowest of 2 hosts {slowest:.2f}x" in d[0] for d in decided), decided
