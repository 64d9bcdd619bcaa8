"""data_pipeline.tf_import: TensorFlow and tensorflow_datasets imported without Keras, and Keras still
there after; bert_jax.workdir's TensorBoard events written without TensorFlow.

In a fresh process (the test process has TensorFlow already): reading records, importing
tensorflow_datasets as the task and corpus readers do, and writing TensorBoard events through the
library's own modules loads no module of Keras, scikit-learn or matplotlib; the records read back
and the events are written; then `import keras` gives working optimizers.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from data_pipeline import tf_import
from data_pipeline.records import reader as records
from data_pipeline.tf_import import tf
assert tf is sys.modules["tensorflow"]
from bert_jax import workdir
writer = workdir.metric_writer(sys.argv[2], just_logging=False)
writer.write_hparams({"learning_rate": 0.5})
writer.write_scalars(1, {"loss": 2.5})
writer.close()
with tf_import.keras_deferred():  # as data_pipeline.tasks and corpora import it
    import tensorflow_datasets
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("keras", "sklearn", "matplotlib"))
assert loaded == [], loaded[:10]
assert "keras.src.optimizers" not in sys.modules  # the blocking entry is gone once the imports are done
from tensorboard.backend.event_processing import event_accumulator
events = event_accumulator.EventAccumulator(sys.argv[2])
events.Reload()
assert [e.step for e in events.Tensors("loss")] == [1], events.Tags()

path = sys.argv[1]
example = tf.train.Example(features=tf.train.Features(feature={
    "input_ids": tf.train.Feature(int64_list=tf.train.Int64List(value=[101, 7, 102]))}))
with tf.io.TFRecordWriter(path) as w:
    w.write(example.SerializeToString())
read = [tf.train.Example.FromString(r.numpy()) for r in tf.data.TFRecordDataset(path)]
assert list(read[0].features.feature["input_ids"].int64_list.value) == [101, 7, 102]

import keras
opt = keras.optimizers.SGD(learning_rate=0.5)
v = keras.Variable([1.0, 2.0])
opt.apply_gradients([(tf.constant([1.0, 1.0]), v)])
assert v.numpy().tolist() == [0.5, 1.5], v.numpy()
print("ok")
"""


def test_records_and_metric_writers_import_no_keras_and_keras_still_imports(tmp_path):
    pytest.importorskip("keras")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "one.tfrecord"), str(tmp_path / "events")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2"))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


WRITER = """
import sys
from bert_jax import workdir
writer = workdir.metric_writer(sys.argv[1], just_logging=False)
writer.write_hparams({"learning_rate": 0.5, "task": "sst2", "fp8": False, "steps": 3})
writer.write_scalars(2, {"train/loss": 2.5, "train/accuracy": 0.25})
writer.write_scalars(3, {"train/loss": 1.5})
writer.close()
assert "tensorflow" not in sys.modules, "the metric writer imported TensorFlow"
print("ok")
"""


def test_the_metric_writer_needs_no_tensorflow_and_tensorflow_reads_its_events(tmp_path):
    """A fine-tuning run imports TensorFlow for nothing else: its events are written without it
    (fresh process), and TensorFlow's own reader and TensorBoard's hparams plugin read them."""
    r = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path / "events")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2"))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    tf = pytest.importorskip("tensorflow")
    from tensorboard.plugins.hparams import metadata

    files = sorted((tmp_path / "events").glob("events.out.tfevents.*"))
    assert len(files) == 1
    events = list(tf.compat.v1.train.summary_iterator(str(files[0])))  # checks each record's CRCs
    assert events[0].file_version == "brain.Event:2"
    scalars = [(e.step, v.tag, float(tf.make_ndarray(v.tensor)))
               for e in events[1:] for v in e.summary.value if v.metadata.plugin_data.plugin_name == "scalars"]
    assert scalars == [(2, "train/loss", 2.5), (2, "train/accuracy", 0.25), (3, "train/loss", 1.5)]
    hparams = [v for e in events for v in e.summary.value if v.metadata.plugin_data.plugin_name == "hparams"]
    assert len(hparams) == 1
    info = metadata.parse_session_start_info_plugin_data(hparams[0].metadata.plugin_data.content)
    assert (info.hparams["learning_rate"].number_value, info.hparams["task"].string_value,
            info.hparams["fp8"].bool_value, info.hparams["steps"].number_value) == (0.5, "sst2", False, 3.0)
