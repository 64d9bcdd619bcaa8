"""End to end: the pretraining entry point in subprocesses (resume after kill -9, SIGTERM, multi-host,
config mismatch, non-finite loss, evaluation mode, two phases, packing, the offline demo) on small
TFRecords the tests write themselves (the `data` fixture, conftest.py). What it checks and records
before it trains (bad settings, data, vocabularies) is in test_pretrain_startup_checks.py."""

import json
import logging
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tests.helpers.pretraining_records import VOCAB, kill9_once_logged
from tests.helpers.pretraining_runs import ROOT, cmd, env, losses, run
from tests.helpers.xla_flags import xla_flags

pytestmark = pytest.mark.usefixtures("compilation_cache")  # conftest.py: one XLA cache for the runs


@pytest.fixture(scope="session")  # session, as `data`: the longest tests run first, the rest later
def uninterrupted(data, tmp_path_factory):
    """configs/test.py for 12 steps, checkpoints at 4, 8 and 12: the workdir and the process's
    result. Read it, or copy it before writing (`shutil.copytree`)."""
    work = tmp_path_factory.mktemp("uninterrupted") / "ref"
    r = run(cmd(work, data))
    assert r.returncode == 0, r.stderr[-3000:]
    return work, r


def test_kill9_and_a_flipped_bit_resume_with_the_uninterrupted_loss_sequence(data, uninterrupted, tmp_path, caplog):
    want = losses(uninterrupted[0])
    assert sorted(want) == list(range(1, 13))
    assert want[12] < want[1]

    work = tmp_path / "killed"
    proc = subprocess.Popen(cmd(work, data), env=env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    kill9_once_logged(proc, str(work / "train_log.jsonl"))  # after step 6: past the step-4 checkpoint
    resumed = run(cmd(work, data))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = losses(work)
    assert got == want  # bitwise: the same floats, step for step

    # One flipped bit in the newest step's parameter/optimizer data (the checksums of
    # integrity): a reader (convert) takes step 8 read-only; the same command again
    # moves step 12 aside, resumes from 8, and steps 9-12 trained again give the same losses.
    logged = len((work / "train_log.jsonl").read_text().splitlines())
    ckpt_dir = work / "checkpoints"
    victim = max((p for p in (ckpt_dir / "12" / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
                 key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0x04
    victim.write_bytes(bytes(raw))
    from bert_jax import convert
    with caplog.at_level(logging.ERROR):
        convert.load_bert_jax(str(work))
    assert any("step 12" in r.getMessage() and "reading step 8 instead" in r.getMessage() for r in caplog.records)
    assert not (ckpt_dir / "damaged").exists()
    again = run(cmd(work, data))
    assert again.returncode == 0, again.stderr[-3000:]
    damaged_lines = [line for line in again.stderr.splitlines() if "is damaged" in line]
    assert len(damaged_lines) == 1 and "step 12" in damaged_lines[0] and "resume from step 8" in damaged_lines[0], \
        again.stderr[-3000:]
    assert [p.name.split("-")[0] for p in (ckpt_dir / "damaged").iterdir()] == ["12"]
    retrained = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()[logged:]]
    assert [r["step"] for r in retrained] == [9, 10, 11, 12]
    assert {r["step"]: r["loss"] for r in retrained} == {s: want[s] for s in (9, 10, 11, 12)}  # bitwise


def test_a_changed_schedule_on_resume_and_a_zero_learning_rate_are_reported(data, uninterrupted, tmp_path):
    first_work, first = uninterrupted
    assert "config.learning_rate=0:" not in first.stderr
    # Its step-4 checkpoint, resumed by a run that reports both: the changed keys against the
    # checkpoint's, and the zero rate.
    shutil.copytree(first_work, tmp_path / "w")
    for later in ("8", "12", "input_state/8", "input_state/12"):
        shutil.rmtree(tmp_path / "w" / "checkpoints" / later)
    longer = run(cmd(tmp_path / "w", data, "--config.num_train_steps=6", "--config.learning_rate=0",
                     "--config.lr_decay_steps=2", "--config.lr_decay_shape=1-sqrt"))
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "resumed from step 4" in longer.stderr
    assert ("resuming step 4 with config.num_train_steps=6; the checkpoint was trained with "
            "config.num_train_steps=12") in longer.stderr
    assert "config.learning_rate=0.0; the checkpoint was trained with config.learning_rate=0.0001" in longer.stderr
    # Warmup-stable-decay from the command line: the new schedule keys are compared too.
    assert "config.lr_decay_steps=2; the checkpoint was trained with config.lr_decay_steps=None" in longer.stderr
    assert "config.lr_decay_shape='1-sqrt'; the checkpoint was trained with config.lr_decay_shape='polynomial'" \
        in longer.stderr
    assert "warmup_steps" not in longer.stderr  # unchanged keys are not reported
    assert "config.learning_rate=0: the parameters will not change" in longer.stderr


def test_a_resume_under_other_library_versions_is_refused_unless_allowed(data, uninterrupted, tmp_path,
                                                                         monkeypatch, caplog):
    """Its finished checkpoint (step 12 of 12: a resume compiles nothing) resumed in-process where
    jax and orbax-checkpoint seem to have been upgraded: refused naming both versions of each, then
    resumed with config.allow_version_change, warning about them."""
    from bert_jax import exit_codes, versions
    from bert_jax.checkpoints.step_dirs import CheckpointRestoreError
    from bert_jax.pretrain import loop as pretrain
    from configs import test as test_config

    saved = versions.installed()
    meta = json.loads((uninterrupted[0] / "checkpoints" / "12" / "meta" / "metadata").read_text())
    assert meta["versions"] == saved
    upgraded = {**saved, "jax": "99.0", "orbax-checkpoint": "98.0", "optax": "97.0"}
    monkeypatch.setattr(versions, "installed", lambda: upgraded)
    shutil.copytree(uninterrupted[0], tmp_path / "w")
    cfg = test_config.get_config()
    cfg.train_data, cfg.verify_data, cfg.num_train_steps = f"{data}/train-*.tfrecord", False, 12
    cfg.checkpoint_every_steps = 4
    with pytest.raises(CheckpointRestoreError) as refused:
        pretrain.run(cfg, str(tmp_path / "w"))
    message = str(refused.value)
    assert f"jax {saved['jax']} (installed: 99.0)" in message, message
    assert f"orbax-checkpoint {saved['orbax-checkpoint']} (installed: 98.0)" in message, message
    assert "optax" not in message and "--config.allow_version_change=true" in message, message
    # Through the entry point, jax "upgraded" in its sitecustomize: exit code 79, which a supervisor
    # does not retry (a refusal before training that is not a bad config's 78).
    (tmp_path / "upgraded").mkdir()
    (tmp_path / "upgraded" / "sitecustomize.py").write_text(
        "from bert_jax import versions\n_installed = versions.installed\n"
        "versions.installed = lambda: {**_installed(), 'jax': '99.0'}\n")
    hooked = dict(env(), PYTHONPATH=f"{tmp_path / 'upgraded'}:{ROOT}")
    refused_run = subprocess.run(cmd(tmp_path / "w", data), env=hooked, cwd=ROOT, timeout=300, capture_output=True,
                                 text=True)
    assert refused_run.returncode == exit_codes.VERSION == 79, refused_run.stderr[-3000:]
    assert f"jax {saved['jax']} (installed: 99.0)" in refused_run.stderr

    cfg.allow_version_change = True
    with caplog.at_level(logging.WARNING):
        pretrain.run(cfg, str(tmp_path / "w"))
    warned = [r.getMessage() for r in caplog.records if "other library versions" in r.getMessage()]
    assert len(warned) == 2 and "jax" in warned[0] and "optax" in warned[1], warned
    # A step saved before versions were recorded: one warning, and on.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        versions.check_resume(None, allow_change=False, where="checkpoint step 4 in W")
    assert [r.getMessage() for r in caplog.records] == [
        "checkpoint step 4 in W records no library versions (saved by an older bert_jax): resuming without "
        "checking them"]


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(data, tmp_path):
    # With the hardware random-bit generator of the speed tables (config.prng_impl=rbg): its
    # key (4 words; threefry's has 2) is what the step carries and the checkpoint holds.
    work = tmp_path / "w"
    proc = subprocess.Popen(cmd(work, data, "--config.num_train_steps=100000",
                                "--config.checkpoint_every_steps=100000", "--config.prng_impl=rbg"),
                            env=env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = work / "train_log.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=300)  # a hang guard (a save and an exit: seconds), not a time it must meet
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("SIGTERM did not stop the run within 300 s")
    assert code == 0, proc.stderr.read()[-3000:]
    steps = sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] >= 3
    assert max(losses(work)) == steps[-1]  # it saved the step it stopped at
    import orbax.checkpoint as ocp
    metadata = ocp.StandardCheckpointer().metadata(str(work / "checkpoints" / str(steps[-1]) / "state"))
    assert getattr(metadata, "item_metadata", metadata)["rng"].shape == (4,)


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("devices_per_process", [1])
def test_two_processes_match_one_process_with_the_same_devices(data, tmp_path, devices_per_process):
    # One process with all the devices, reading the same two file shards (data_shards=2) as the
    # two processes do. Two processes of 2 devices each (where the loop must block on every
    # step: 2+ CPU devices per process deadlocked otherwise, ../shared/RELIABILITY.md) train three
    # times in tests/pod/test_pod_rehearsal.py, so that case is not run here again.
    one = run(cmd(tmp_path / "one", data, "--config.num_train_steps=6", "--config.data_shards=2"),
              devices=2 * devices_per_process)
    assert one.returncode == 0, one.stderr[-3000:]
    e = dict(env(1), XLA_FLAGS=xla_flags(), NUM_PROCESSES="2", DEVICES_PER_PROCESS=str(devices_per_process),
             PORT=str(_port()), PYTHON=sys.executable, KILL_AFTER="5")
    two = subprocess.run(["bash", str(ROOT / "launch/local_multihost.sh"),
                          *cmd(tmp_path / "two", data, "--config.num_train_steps=6", "--config.data_shards=2")[3:]],
                         env=e, cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(a) == list(range(1, 7))
    np.testing.assert_allclose([b[s] for s in sorted(a)], [a[s] for s in sorted(a)], rtol=1e-6)

    # The two processes' step 4 resumed by one process (a smaller slice after a preemption): each
    # file shard's position is read from the folder of the process that saved it, so steps 5-6
    # see the batches the two processes saw.
    import shutil
    shutil.copytree(tmp_path / "two", tmp_path / "fewer")
    for later in ("6", "input_state/6"):
        shutil.rmtree(tmp_path / "fewer" / "checkpoints" / later)
    fewer = run(cmd(tmp_path / "fewer", data, "--config.num_train_steps=6", "--config.data_shards=2"),
                devices=2 * devices_per_process)
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    assert "resumed from step 4" in fewer.stderr
    c = losses(tmp_path / "fewer")
    np.testing.assert_allclose([c[s] for s in (5, 6)], [a[s] for s in (5, 6)], rtol=1e-6)
    # Without data_shards, one process would read one shard: another split of the files, refused
    # before compiling, with the setting that resumes it.
    shutil.rmtree(tmp_path / "fewer" / "checkpoints" / "6")
    refused = run(cmd(tmp_path / "fewer", data, "--config.num_train_steps=6"), devices=2 * devices_per_process)
    assert refused.returncode == 78  # a config that does not fit the checkpoint (bert_jax/exit_codes.py): not retried
    assert ("saved by 2 processes reading 2 file shards; this run has 1 processes and 1 shards" in refused.stderr
            and "set config.data_shards=2 to resume it" in refused.stderr), refused.stderr[-3000:]


def test_a_host_with_a_different_config_stops_every_host_before_compiling(data, tmp_path):
    port = _port()
    procs = []
    for pid, lr in ((0, "1e-4"), (1, "2e-4")):
        e = dict(env(1), XLA_FLAGS=xla_flags(), BERT_JAX_COORDINATOR=f"127.0.0.1:{port}", BERT_JAX_NUM_PROCESSES="2",
                 BERT_JAX_PROCESS_ID=str(pid), JAX_NUM_CPU_DEVICES="1")
        procs.append(subprocess.Popen(cmd(tmp_path / f"w{pid}", data, f"--config.learning_rate={lr}"),
                                      env=e, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=240))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("hosts with different configs did not exit")
    errors = [p.stderr.read() for p in procs]
    assert codes == [78, 78], [e[-2000:] for e in errors]  # a refused config on every host: not retried
    for text in errors:  # each host names the key and both values, not hash bytes
        assert "config mismatch across hosts" in text
        assert "process 1 vs process 0: config.learning_rate: 0.0002 != 0.0001" in text, text[-2000:]
    assert not (tmp_path / "w0" / "train_log.jsonl").exists()


def test_nonfinite_loss_stops_with_a_diagnostic(data, tmp_path):
    r = run(cmd(tmp_path / "w", data, f"--config.train_data={data}/nan.tfrecord", "--config.num_train_steps=3"))
    assert r.returncode == 80, r.stderr[-3000:]  # NONFINITE (bert_jax/exit_codes.py): not retried
    assert "non-finite loss or gradient" in r.stderr


def _log_softmax64(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)  # numpy: float64 without jax_enable_x64
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_evaluate_mode_writes_the_reference_metrics(data, uninterrupted, tmp_path):
    shutil.copytree(uninterrupted[0], tmp_path / "train")  # this test writes into its checkpoints folder
    r = run([sys.executable, "-m", "bert_jax.main", f"--config={ROOT / 'configs/test.py'}",
             f"--workdir={tmp_path / 'eval'}", "--config.mode=evaluate",
             f"--config.init_checkpoint={tmp_path / 'train'}", f"--config.eval_data={data}/eval-0.tfrecord",
             "--config.global_batch_size=16", "--config.verify_data=false"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "host memory: on" in r.stderr  # a CPU-only run keeps freed buffers (tests/training/test_host_memory.py)
    results = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    assert set(results) == {"masked_lm_loss", "masked_lm_accuracy", "next_sentence_loss", "next_sentence_accuracy"}
    # Independent check: the same weights scored record by record in numpy.
    import jax
    from bert_jax.model import pretraining_heads
    from bert_jax.pretrain import checkpoint_eval
    from bert_jax.training import run_setup
    from configs import test as test_config
    cfg = test_config.get_config()
    cfg.init_checkpoint = str(tmp_path / "train")
    bert_config = run_setup.bert_config_from(cfg)
    from bert_jax.training import sharding
    params, _ = run_setup.load_params(cfg, bert_config, sharding.create_mesh({"data": -1}, devices=jax.devices()[:1]))
    nll_sum = w_sum = correct = nsp_nll = nsp_correct = n = 0.0
    for raw in tf.data.TFRecordDataset(str(data / "eval-0.tfrecord")).as_numpy_iterator():
        ex = tf.train.Example.FromString(raw).features.feature
        get = lambda k: np.array(ex[k].int64_list.value)[None]
        out = pretraining_heads.BertForPreTraining(bert_config).apply(
            {"params": params}, get("input_ids"), get("input_mask"), get("segment_ids"), get("masked_lm_positions"))
        logp = _log_softmax64(out.mlm_logits[0])
        w = np.array(ex["masked_lm_weights"].float_list.value)
        lab = get("masked_lm_ids")[0]
        nll_sum += float(-(logp[np.arange(len(lab)), lab] * w).sum())
        correct += float(((logp.argmax(-1) == lab) * w).sum())
        w_sum += w.sum()
        nsp = _log_softmax64(out.nsp_logits[0])
        label = int(get("next_sentence_labels")[0, 0])
        nsp_nll += -nsp[label]
        nsp_correct += float(nsp.argmax() == label)
        n += 1
    assert n == 40
    np.testing.assert_allclose(results["masked_lm_loss"], nll_sum / w_sum, rtol=1e-4)
    np.testing.assert_allclose(results["masked_lm_accuracy"], correct / w_sum, rtol=1e-6)
    np.testing.assert_allclose(results["next_sentence_loss"], nsp_nll / n, rtol=1e-4)
    np.testing.assert_allclose(results["next_sentence_accuracy"], nsp_correct / n, rtol=1e-6)

    # Scored by a config that trains differently (LAMB, no clipping: another optimizer state) and
    # lays the layers out scanned: only the parameters are read, and restacked. An unfinished save
    # (a training run still writing there) is left alone.
    unfinished = tmp_path / "train" / "checkpoints" / "99.orbax-checkpoint-tmp-1"
    unfinished.mkdir()
    other_cfg = test_config.get_config()
    other_cfg.init_checkpoint, other_cfg.optimizer, other_cfg.clip_norm = str(tmp_path / "train"), "lamb", 0.0
    other_cfg.model.scan_layers = True
    other_cfg.eval_data, other_cfg.global_batch_size, other_cfg.verify_data = f"{data}/eval-0.tfrecord", 16, False
    scanned = checkpoint_eval.evaluate(other_cfg, str(tmp_path / "eval_scanned"))
    for k, v in results.items():
        np.testing.assert_allclose(scanned[k], v, rtol=1e-5, err_msg=f"scanned: {k}")
    assert unfinished.is_dir()

    # The same weights exported to Google's and HF's formats load identically and score the same.
    from bert_jax import convert
    pretrained = convert.load_pretrained(str(tmp_path / "train"))
    for fmt in ("google", "hf"):
        out = convert.save_pretrained(pretrained, str(tmp_path / fmt), fmt)
        cfg.init_checkpoint = out
        other, _ = run_setup.load_params(cfg, run_setup.bert_config_from(cfg),
                                        sharding.create_mesh({"data": -1}, devices=jax.devices()[:1]))
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(other)):
            np.testing.assert_array_equal(a, b)
        cfg.eval_data, cfg.global_batch_size, cfg.verify_data = f"{data}/eval-0.tfrecord", 16, False
        again = checkpoint_eval.evaluate(cfg, str(tmp_path / f"eval_{fmt}"))
        for k, v in results.items():
            np.testing.assert_allclose(again[k], v, rtol=1e-5, err_msg=f"{fmt}: {k}")


def test_pretraining_continues_from_an_encoder_only_hf_checkpoint(data, tmp_path):
    """init_checkpoint in HF format, no heads: the encoder starts from its weights (learning rate 0
    keeps them), the heads from a fresh initialization."""
    import jax
    from bert_jax import convert
    from bert_jax.formats.common import unrolled
    from bert_jax.model import model_config, modeling
    config = model_config.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=64)
    params = modeling.BertModel(config).init(jax.random.key(7), np.zeros((1, 8), np.int32))["params"]
    src = convert.Pretrained(config, {"bert": unrolled(params)}, None, True)
    convert.save_hf(src, str(tmp_path / "hf"))
    r = run(cmd(tmp_path / "w", data, f"--config.init_checkpoint={tmp_path / 'hf'}", "--config.num_train_steps=1",
                "--config.learning_rate=0.0", "--config.warmup_steps=0"))
    assert r.returncode == 0, r.stderr[-3000:]
    trained = convert.load_pretrained(str(tmp_path / "w"))
    assert trained.heads == ("mlm", "nsp")
    for a, b in zip(jax.tree_util.tree_leaves(trained.params["bert"]), jax.tree_util.tree_leaves(src.params["bert"])):
        np.testing.assert_array_equal(a, b)


def _eval_steps(workdir) -> list[int]:
    """Steps at which TensorBoard got a finite eval/masked_lm_loss."""
    from tensorflow.core.util import event_pb2
    steps = []
    for path in sorted(Path(workdir).rglob("events.out.tfevents*")):
        for raw in tf.data.TFRecordDataset(str(path)):
            event = event_pb2.Event.FromString(raw.numpy())
            for value in event.summary.value:
                if value.tag == "eval/masked_lm_loss":
                    number = value.simple_value if value.HasField("simple_value") else float(
                        tf.make_ndarray(value.tensor))
                    assert np.isfinite(number)
                    steps.append(event.step)
    return sorted(steps)


def test_two_phases_resume_across_the_boundary(data, tmp_path):
    """Phase 1 then phase 2 (its own data and length, its own compiled step), evaluated every 2
    steps on the same held-out records (their own length); kill -9 inside phase 2 and resume from
    the checkpoint at the boundary: the loss sequence equals the uninterrupted run's."""
    cfg = tmp_path / "two_phase.py"
    cfg.write_text(
        "from configs import test\n\n"
        "def get_config():\n"
        "    c = test.get_config()\n"
        f"    c.phases = (dict(max_seq_length=32, max_predictions_per_seq=5, fraction=0.5,\n"
        f"                     train_data='{data}/train-[01].tfrecord'),\n"
        f"                dict(max_seq_length=48, max_predictions_per_seq=7, fraction=0.5,\n"
        f"                     train_data='{data}/long-*.tfrecord'))\n"
        "    return c\n")

    def two_phase_cmd(workdir):
        args = cmd(workdir, data, "--config.num_train_steps=8", f"--config.eval_data={data}/eval-0.tfrecord",
                   "--config.eval_every_steps=2", "--config.eval_steps=1")
        args[3] = f"--config={cfg}"
        return [a for a in args if not a.startswith("--config.train_data")]

    ref = run(two_phase_cmd(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = losses(tmp_path / "ref")
    assert sorted(want) == list(range(1, 9))
    assert _eval_steps(tmp_path / "ref") == [2, 4, 6, 8]  # at length 32 in both phases
    work = tmp_path / "killed"
    proc = subprocess.Popen(two_phase_cmd(work), env=env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    log, deadline = work / "train_log.jsonl", time.time() + 300
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 6):
        if proc.poll() is not None:
            pytest.fail(proc.stderr.read()[-3000:])
        time.sleep(0.2)
    proc.kill()
    proc.wait(timeout=30)
    resumed = run(two_phase_cmd(work))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(work) == want


def test_packing_dynamic_masking_and_the_ablations_train(data, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]) + "\n")
    for name, extra in (("packed", ["--config.packing=true", "--config.dynamic_masking=true",
                                    f"--config.vocab_file={vocab}", "--config.max_seqs_per_pack=3"]),
                        ("ltr", ["--config.objective=ltr", "--config.model.causal_attention=true",
                                 "--config.use_nsp=false"])):
        r = run(cmd(tmp_path / name, data, "--config.num_train_steps=3", *extra))
        assert r.returncode == 0, (name, r.stderr[-3000:])
        got = losses(tmp_path / name)
        assert sorted(got) == [1, 2, 3] and all(np.isfinite(list(got.values())))
    # The LTR model predicts every next token: its loss starts near log(vocab).
    assert abs(losses(tmp_path / "ltr")[1] - np.log(VOCAB)) < 0.5


def test_offline_demo_end_to_end_shortened(tmp_path):
    """The README's first command, shortened: corpus -> vocab -> TFRecords -> pretrain -> [MASK]; run
    as a user runs it from their own folder, outside the checkout: `--config=configs/demo.py` (no
    such file there: the installed configs package's, `config_overrides.resolve_config`) and a
    relative workdir."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert ROOT not in elsewhere.resolve().parents and not (elsewhere / "configs").exists()
    r = subprocess.run([sys.executable, "-m", "bert_jax.main", "--config=configs/demo.py", "--workdir=demo",
                        "--config.num_train_steps=40", "--config.demo.vocab_size=2000",
                        "--config.demo.dupe_factor=1", "--config.log_every_steps=5", "--config.eval_every_steps=40",
                        "--config.checkpoint_every_steps=40", "--config.global_batch_size=16"],
                       env=env(), cwd=elsewhere, timeout=600, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in elsewhere.iterdir()) == ["demo"]
    tmp_path = elsewhere / "demo"
    assert "[MASK] ->" in r.stdout
    guesses = json.loads((tmp_path / "fill_mask.json").read_text())
    assert len(guesses) == 4 and all(len(g["guesses"][0]) == 5 for g in guesses)
    assert len((tmp_path / "vocab.txt").read_text().splitlines()) <= 2000
    assert json.loads((tmp_path / "data" / "train" / "part.dataset_info.json").read_text())["num_instances"] > 100
    # The casing of the data is recorded in the workdir, so conversions and fill_mask know it.
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["do_lower_case"] is True
    log = losses(tmp_path)
    assert sorted(log) == list(range(1, 41))
    assert np.mean([log[s] for s in range(31, 41)]) < np.mean([log[s] for s in range(1, 11)]) - 0.5
    assert set(json.loads((tmp_path / "eval_results.json").read_text())) >= {"masked_lm_accuracy"}
    assert "training curves: demo/curves.png" in r.stdout  # the workdir as given
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # The host's wait for input is logged per window: a share of the window's time and ms per step.
    from bert_jax import plot
    scalars = plot.read_scalars(str(tmp_path))
    steps_logged, fraction = scalars["train/input_fraction"]
    assert list(steps_logged) == list(range(5, 41, 5))
    assert all(0.0 <= f < 1.0 for f in fraction)
    assert all(ms > 0.0 for ms in scalars["train/input_ms_per_step"][1])
