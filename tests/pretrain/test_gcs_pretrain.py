"""Pretraining with everything in Cloud Storage, emulated by fake-gcs-server (tests/conftest.py):
records made straight into the bucket, the workdir in the bucket; a bucket that stops answering
during a log write (training goes on, no line lost or doubled) and during a checkpoint save (the
run ends within the save's deadline); kill -9 and resume bitwise; a flipped bit in the newest step in the bucket falls back to the intact one; evaluation mode; the
TensorBoard events and logs land in the bucket; and nothing is written to local disk but the
caches named here (BERT_JAX_CACHE_DIR, the XLA compilation cache).

What reaches the emulator how: gcsfs (our storage layer, and orbax's metadata through
etils.epath) via STORAGE_EMULATOR_HOST; tensorstore (orbax's arrays) via TENSORSTORE_GCS_HTTP_URL.
TensorFlow's own GCS client has no endpoint override: tf.data reads local copies of the bucket's
records (data_pipeline.storage.staging.tf_path), the one place where a real pod takes another path
(TensorFlow reads gs:// itself there). TensorBoard events and the tf.data iterator state are
written locally and uploaded through the storage layer on a pod as here.
"""

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import storage
from data_pipeline.storage import gcs as storage_gcs, staging as storage_staging
from tests.helpers import fault_hooks
from tests.helpers.pretraining_records import kill9_once_logged, logged_losses
from tests.helpers.xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[2]
WORDS = [f"w{i:03d}" for i in range(300)]
SEQ, PREDS = 32, 5


def corpus(rng, docs: int) -> str:
    """Google's text format: a sentence per line, a blank line between documents."""
    out = []
    for _ in range(docs):
        for _ in range(rng.randint(4, 9)):
            out.append(" ".join(rng.choice(WORDS[: rng.randint(60, 300)], rng.randint(5, 12))) + " .")
        out.append("")
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def places(gcs_server, tmp_path_factory):
    """A bucket with a corpus, a vocabulary, and train and eval records made into it by
    `create_pretraining_data` (gs:// in, gs:// out); local folders for the runs."""
    bucket = f"gs://pretrain-{uuid.uuid4().hex[:8]}"
    storage_gcs.filesystem(bucket).mkdir(bucket[5:])
    rng = np.random.RandomState(0)
    for i in range(2):
        storage.write_text(f"{bucket}/corpus/part-{i}.txt", corpus(rng, 24))
    storage.write_text(f"{bucket}/heldout/part-0.txt", corpus(rng, 8))
    storage.write_text(f"{bucket}/vocab.txt", "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."]
                                                        + WORDS) + "\n")
    local = tmp_path_factory.mktemp("gcs_pretrain")
    places = {"bucket": bucket, "local": local, "cache": local / "cache", "xla": local / "xla_cache"}
    for name, inputs, out, dupe in (("train", "corpus/*.txt", "data/train.tfrecord", 3),
                                    ("eval", "heldout/*.txt", "eval/eval.tfrecord", 1)):
        r = run(places, [sys.executable, "-m", "data_pipeline.create_pretraining_data",
                         f"--input_file={bucket}/{inputs}", f"--output_file={bucket}/{out}",
                         f"--vocab_file={bucket}/vocab.txt", f"--max_seq_length={SEQ}",
                         f"--max_predictions_per_seq={PREDS}", f"--dupe_factor={dupe}", "--random_seed=1"])
        assert r.returncode == 0, r.stderr[-3000:]
    assert storage.glob(f"{bucket}/data/train.tfrecord*") and storage.exists(f"{bucket}/data/train.dataset_info.json")
    return places


# The save freeze (tests/helpers/fault_hooks.py), and:
FREEZE = fault_hooks.FREEZE_AT_SAVE + r"""
import os
# The bucket stops answering as the train log's line of step $FAULT_FREEZE_AT_LOG is queued, until
# the freeze has shown what it is for: the next two steps' lines queued (training went on) and a
# write of the log failed (timed out after BERT_JAX_GCS_TIMEOUT); $FAULT_FREEZE_SECONDS is only a
# hang guard. (Not a timer: on a loaded machine two steps may take longer than any timer here.)
# Every queued step and the freeze's start and end go to $FAULT_RECORD (monotonic times). The next
# checkpoint save waits for the bucket to come back: a save's own stall is FREEZE_AT_SAVE's.
_log_step = os.environ.get("FAULT_FREEZE_AT_LOG")
if _log_step:
    import json
    import signal
    import threading
    import time
    import orbax.checkpoint as ocp
    from data_pipeline.storage import log_writer

    _pid = int(os.environ["BERT_JAX_TEST_EMULATOR_PID"])
    _record = open(os.environ["FAULT_RECORD"], "a", encoding="utf-8")
    _frozen, _thawed = threading.Event(), threading.Event()
    _queued_frozen = []  # the steps queued after the frozen one, while frozen

    def _note(what):
        _record.write(json.dumps([what, time.monotonic()]) + "\n")
        _record.flush()

    def _thaw():
        os.kill(_pid, signal.SIGCONT)
        _note("thawed")
        _thawed.set()

    def _thaw_once_shown(writer):
        deadline = time.monotonic() + float(os.environ["FAULT_FREEZE_SECONDS"])
        while not (len(_queued_frozen) >= 2 and writer.failed_writes) and time.monotonic() < deadline:
            time.sleep(0.05)
        _thaw()

    _append = log_writer.LogWriter.append

    def _append_noted(self, path, text):
        if str(path).endswith("/train_log.jsonl"):
            step = json.loads(text.splitlines()[0])["step"]
            _note(step)
            if _frozen.is_set() and not _thawed.is_set() and step > int(_log_step):
                _queued_frozen.append(step)
            if step == int(_log_step) and not _frozen.is_set():
                _frozen.set()
                os.kill(_pid, signal.SIGSTOP)
                _note("frozen")
                threading.Thread(target=_thaw_once_shown, args=(self,), daemon=True).start()
        return _append(self, path, text)

    log_writer.LogWriter.append = _append_noted
    _save_after_thaw = ocp.CheckpointManager.save

    def _save_waiting(self, step, *args, **kwargs):
        if _frozen.is_set():
            _thawed.wait()
        return _save_after_thaw(self, step, *args, **kwargs)

    ocp.CheckpointManager.save = _save_waiting
"""


def run(places, args, *, popen=False, timeout=300, env=None):
    """Runs a command as a user would, from an empty folder, with a home and a temp folder of its
    own; afterwards (see `assert_nothing_local`) those must still be empty."""
    cwd = places["local"] / f"cwd-{uuid.uuid4().hex[:6]}"
    home, tmp = cwd.with_name(cwd.name + "-home"), cwd.with_name(cwd.name + "-tmp")
    for d in (cwd, home, tmp):
        d.mkdir()
    env = dict(os.environ, **{"PYTHONPATH": str(ROOT), **(env or {})}, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS=xla_flags(2), HOME=str(home), TMPDIR=str(tmp),
               BERT_JAX_CACHE_DIR=str(places["cache"]), JAX_COMPILATION_CACHE_DIR=str(places["xla"]),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               MPLCONFIGDIR=str(places["cache"] / "matplotlib"), KERAS_HOME=str(places["cache"] / "keras"))
    places.setdefault("dirs", []).extend([cwd, home, tmp])
    if popen:
        return subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def assert_nothing_local(places):
    """No run wrote anything into its working folder (no `gs:` folder) or home, and its temp
    folder holds only the modules TensorFlow's autograph writes there for the tf.data functions
    it converts (Keras's `~/.keras` goes to the cache: KERAS_HOME)."""
    leftovers = {str(d): [n for n in sorted(os.listdir(d)) if not n.startswith("__autograph_generated_file")]
                 for d in places.get("dirs", [])}
    assert not any(leftovers.values()), leftovers


def pretrain(places, workdir, *overrides, popen=False, env=None):
    bucket = places["bucket"]
    return run(places, [sys.executable, "-m", "bert_jax.main", f"--config={ROOT / 'configs/test.py'}",
                        f"--workdir={workdir}", f"--config.train_data={bucket}/data/train.tfrecord*",
                        f"--config.eval_data={bucket}/eval/*.tfrecord", f"--config.vocab_file={bucket}/vocab.txt",
                        "--config.log_every_steps=1", "--config.checkpoint_every_steps=4",
                        "--config.num_train_steps=12", "--config.eval_every_steps=12",
                        "--config.shuffle_buffer_size=64", *overrides], popen=popen, env=env)


def losses(workdir) -> dict:
    """step -> loss from the bucket's train_log.jsonl (a resumed run logs some steps again: last one wins)."""
    return logged_losses(storage.read_text(f"{workdir}/train_log.jsonl"))


def tensorboard_scalars(workdir) -> dict:
    """{tag: {step: value}} of the event files in the bucket."""
    import tensorflow as tf
    out: dict = {}
    for path in storage.glob(f"{workdir}/events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(storage_staging.local_copy(path)):
            for v in event.summary.value:
                value = tf.make_ndarray(v.tensor)
                if value.ndim == 0 and value.dtype.kind == "f":  # scalars (not the hparams' text)
                    out.setdefault(v.tag, {})[event.step] = float(value)
    return out


def test_pretraining_in_a_bucket_resumes_bitwise_after_kill9_and_past_a_flipped_bit(places):
    bucket = places["bucket"]
    faults = places["local"] / "faults"
    faults.mkdir(exist_ok=True)
    (faults / "sitecustomize.py").write_text(FREEZE)
    # The reference run, through a stalled log write: the bucket stops answering as step 1's line
    # is queued (before the first save: an asynchronous save in flight would stall too, the other
    # scenario), until steps 2 and 3 are queued and a write has timed out (the 2 s request
    # timeout); 120 s at most, a hang guard. Training goes on, the failed writes are retried and
    # counted, and no line is lost or written twice.
    record = places["local"] / "log_freeze.jsonl"
    ref = pretrain(places, f"{bucket}/ref", env={
        "PYTHONPATH": f"{faults}:{ROOT}", "FAULT_FREEZE_AT_LOG": "1", "FAULT_FREEZE_SECONDS": "120",
        "FAULT_RECORD": str(record), "BERT_JAX_GCS_TIMEOUT": "2"})
    os.kill(int(os.environ["BERT_JAX_TEST_EMULATOR_PID"]), signal.SIGCONT)  # (thawed already)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert f"log writer: writing {bucket}/ref/train_log.jsonl failed (" in ref.stderr, ref.stderr[-3000:]
    notes = [json.loads(line) for line in record.read_text().splitlines()]
    times = {what: t for what, t in notes if isinstance(what, str)}
    queued_while_frozen = [what for what, t in notes if isinstance(what, int) and times["frozen"] < t < times["thawed"]]
    assert {2, 3} <= set(queued_while_frozen), notes  # the steps went on while the bucket did not answer
    lines = storage.read_text(f"{bucket}/ref/train_log.jsonl").splitlines()
    assert sorted(json.loads(line)["step"] for line in lines) == list(range(1, 13))  # each step once
    want = losses(f"{bucket}/ref")
    assert sorted(want) == list(range(1, 13)) and want[12] < want[1]
    names = storage.listdir(f"{bucket}/ref")
    assert {"bert_config.json", "vocab.txt", "tokenizer_config.json", "checkpoints", "train_log.jsonl"} <= set(names)
    assert storage.read_bytes(f"{bucket}/ref/vocab.txt") == storage.read_bytes(f"{bucket}/vocab.txt")
    assert storage.listdir(f"{bucket}/ref/checkpoints") == ["12", "4", "8", "input_state"]
    assert "bert_jax_integrity.json" in storage.listdir(f"{bucket}/ref/checkpoints/12")
    scalars = tensorboard_scalars(f"{bucket}/ref")  # uploaded from the staging folder
    assert sorted(scalars["train/loss"]) == list(range(1, 13)) and 12 in scalars["eval/masked_lm_accuracy"]

    # kill -9 after step 6 is logged (after the step-4 checkpoint), then the same command again.
    work = f"{bucket}/killed"
    kill9_once_logged(pretrain(places, work, popen=True), f"{work}/train_log.jsonl")
    # The resumed run: the bucket stops answering as step 8's save starts. The save's deadline
    # ends the run (its exit code and words: not how long that took, which is the machine's; a
    # run that hung would meet `run`'s limit), naming the step; the same command then resumes
    # from step 4 again.
    try:
        stalled = pretrain(places, work, "--config.checkpoint_save_timeout_seconds=5",
                           env={"PYTHONPATH": f"{faults}:{ROOT}", "FAULT_FREEZE_AT_SAVE": "8"})
    finally:
        os.kill(int(os.environ["BERT_JAX_TEST_EMULATOR_PID"]), signal.SIGCONT)
    assert stalled.returncode == 124, stalled.stderr[-3000:]
    assert f"saving step 8 to {work}/checkpoints did not finish within 5 s" in stalled.stderr
    resumed = pretrain(places, work)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stderr
    assert losses(work) == want  # bitwise: the same floats, step for step

    # A flipped bit in the newest step's array data, in the bucket: moved aside, step 8 resumed,
    # and steps 9-12 trained again give the uninterrupted losses.
    data = max((info for rel, info in storage.files_info(f"{work}/checkpoints/12").items() if "/d/" in rel),
               key=lambda info: info["size"])
    blob = bytearray(storage.read_bytes(data["path"]))
    blob[len(blob) // 2] ^= 0x10
    storage.write_bytes(data["path"], bytes(blob))
    again = pretrain(places, work)
    assert again.returncode == 0, again.stderr[-3000:]
    rel = data["path"][len(f"{work}/checkpoints/12/"):]
    assert f"checkpoint step 12 in {work}/checkpoints is damaged: {rel}" in again.stderr, again.stderr[-3000:]
    assert "checksum mismatch" in again.stderr and "resume from step 8" in again.stderr
    assert [name.split("-")[0] for name in storage.listdir(f"{work}/checkpoints/damaged")] == ["12"]
    got = losses(work)
    assert got == want

    # Evaluation mode on the bucket's checkpoint: the scores training logged at step 12.
    evaluated = run(places, [sys.executable, "-m", "bert_jax.main", f"--config={ROOT / 'configs/test.py'}",
                             f"--workdir={bucket}/eval_out", "--config.mode=evaluate",
                             f"--config.init_checkpoint={bucket}/ref", f"--config.eval_data={bucket}/eval/*.tfrecord"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    results = json.loads(storage.read_text(f"{bucket}/eval_out/eval_results.json"))
    for key in ("masked_lm_accuracy", "masked_lm_loss", "next_sentence_accuracy"):
        assert results[key] == pytest.approx(scalars[f"eval/{key}"][12], rel=1e-6), key
    assert_nothing_local(places)
