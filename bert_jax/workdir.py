"""What a run writes into its workdir besides checkpoints, local or on Cloud Storage.

A workdir holds, next to `checkpoints/`: `bert_config.json`, `vocab.txt`, `tokenizer_config.json`
(the model files that make it loadable by `bert_jax.convert`), `train_log.jsonl` (one line per
step), `eval_results.json` / `eval_history.json`, and TensorBoard event files. Every one goes
through `data_pipeline.storage`: a workdir may be a local folder or `gs://bucket/run`.

TensorBoard's writer only writes local files: for a gs:// workdir the events are written into a
staging folder of the cache and uploaded at every `flush` and at most `sync_every_seconds` after a
write (as TensorFlow's own GCS writer re-uploads a file at each flush), so TensorBoard pointed at
the bucket follows the run. `train_log.jsonl` is appended to in place on local disk and by
server-side composition on Cloud Storage (no download of what is there).

`check_paths` refuses, before anything runs, a workdir or config path that no installed backend
handles, naming the flag or key (data_pipeline.storage.check).
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable, Mapping, Optional

from bert_jax.modeling import BertConfig
from data_pipeline import storage

# Config keys whose value may be an http(s):// URL (a checkpoint zip bert_jax downloads).
URL_KEYS = ("init_checkpoint",)


# ---------------------------------------------------------------------------------------------
# Paths, checked before anything runs
# ---------------------------------------------------------------------------------------------


def _strings(value: Any, key: str) -> Iterable[tuple[str, str]]:
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{key}[{i}]")


def check_paths(config: Mapping, workdir: Optional[str]) -> None:
    """Raises `storage.StorageError` naming the flag or config key of the first path bert_jax
    cannot use: the workdir, and every config string that names a scheme (`gs://...`, or a
    mangled `gs:/...`); comma-separated lists are checked item by item."""
    if workdir is not None:
        storage.check(workdir, "--workdir")
    for key, value in _strings(dict(config), "config"):
        for item in value.split(","):
            item = item.strip()
            if "://" in item or ":/" in item:
                storage.check(item, key, urls=key.rsplit(".", 1)[-1] in URL_KEYS)


# ---------------------------------------------------------------------------------------------
# Model files
# ---------------------------------------------------------------------------------------------


def write_model_files(workdir: str, bert_config: BertConfig, vocab_file: str,
                      do_lower_case: Optional[bool] = None) -> None:
    """Makes the workdir self-describing: bert_config.json (+ vocab.txt, + tokenizer_config.json
    with the casing when it is known) next to the checkpoints. A file is written only when its
    content changes, so a finished (even read-only) workdir re-runs as a no-op. Call it on one
    process."""
    from bert_jax import convert

    storage.makedirs(workdir)
    config_file = storage.join(workdir, "bert_config.json")
    try:
        unchanged = BertConfig.from_json_file(config_file) == bert_config.replace(fp8=False)
    except (OSError, ValueError):
        unchanged = False
    if not unchanged:
        bert_config.to_json_file(config_file)
    if vocab_file:
        write_if_changed(storage.join(workdir, "vocab.txt"), storage.read_bytes(vocab_file))
    if do_lower_case is not None:
        write_if_changed(storage.join(workdir, "tokenizer_config.json"),
                         convert.tokenizer_config_json(do_lower_case).encode())


def write_if_changed(path: str, data: bytes) -> None:
    try:
        if storage.read_bytes(path) == data:
            return
    except OSError:
        pass
    storage.write_bytes(path, data)


# ---------------------------------------------------------------------------------------------
# Logs and results
# ---------------------------------------------------------------------------------------------


def append_jsonl(path: str, rows: Iterable[dict]) -> None:
    """Appends one JSON line per row (one append: one request on Cloud Storage)."""
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if text:
        storage.append_text(path, text)


def write_json(workdir: str, name: str, value: Any, **kwargs) -> str:
    """`workdir/name` holding `value` as JSON, written whole (never half a file)."""
    path = storage.join(workdir, name)
    storage.write_json(path, value, **kwargs)
    return path


# ---------------------------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------------------------


class _EventFile:
    """TensorBoard's event file, written without TensorFlow (whose import, through clu's writer,
    took 3.7 s of a fine-tuning run's start and was its only use of TensorFlow), as the fast
    record writer does (`data_pipeline.tfrecord`): TensorBoard's `Event` protos in TFRecord
    framing, scalars as float32 tensors of the "scalars" plugin and the hyper-parameters as the
    "hparams" plugin's summary (`tensorboard.plugins.hparams.summary_v2.hparams_pb`), as
    `tf.summary` writes them."""

    _counter = 0

    def __init__(self, directory: str):
        import os
        import socket

        from tensorboard.compat.proto import event_pb2

        storage.makedirs(directory)  # a local folder (the workdir's, or gs://'s staging folder)
        _EventFile._counter += 1
        name = (f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}."
                f"{_EventFile._counter}.v2")
        self._file = storage.open(storage.join(directory, name), "ab")  # pylint: disable=consider-using-with
        self._event = event_pb2.Event
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event) -> None:
        from data_pipeline import tfrecord  # the project's TFRecord framing without TensorFlow

        self._file.write(tfrecord.frame_records([event.SerializeToString()]))
        self._file.flush()  # a few events per log step: TensorBoard follows a local run as it goes

    def scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

        plugin = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
        values = [summary_pb2.Summary.Value(
            tag=tag, metadata=plugin,
            tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=tensor_shape_pb2.TensorShapeProto(),
                                          float_val=[float(value)]))
            for tag, value in scalars.items()]
        self._write(self._event(wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=values)))

    def hparams(self, hparams: Mapping[str, Any]) -> None:
        from tensorboard.plugins.hparams import summary_v2

        self._write(self._event(wall_time=time.time(), step=0, summary=summary_v2.hparams_pb(dict(hparams))))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MetricWriter:
    """The console (absl logging, in clu's `LoggingWriter` format) and, unless `just_logging`,
    TensorBoard event files in `events_dir`."""

    def __init__(self, events_dir: Optional[str] = None):
        self._events = _EventFile(events_dir) if events_dir else None

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        from absl import logging

        logging.info("[%d] %s", step, ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in sorted(scalars.items())))
        if self._events:
            self._events.scalars(step, scalars)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        from absl import logging

        logging.info("[Hyperparameters] %s", dict(hparams))
        if self._events:
            self._events.hparams(hparams)

    def flush(self) -> None:
        if self._events:
            self._events.flush()

    def close(self) -> None:
        if self._events:
            self._events.close()


def metric_writer(workdir: str, *, just_logging: bool, sync_every_seconds: float = 60.0) -> MetricWriter:
    """The console + TensorBoard writer for `workdir` (console only with `just_logging`, for the
    hosts after the first). For a gs:// workdir the event files are staged locally and uploaded at
    each `flush`/`close` and at most `sync_every_seconds` after a write."""
    if just_logging:
        return MetricWriter()
    mirror = storage.Mirror(workdir, name="tensorboard")

    class _MirroredWriter(MetricWriter):
        """Writes events into `mirror.local`, uploads them to the workdir when flushed."""

        def __init__(self):
            super().__init__(mirror.local)  # storage: local (the staging folder)
            self._synced = time.monotonic()

        def _maybe_sync(self):
            if storage.is_remote(workdir) and time.monotonic() - self._synced > sync_every_seconds:
                self.flush()

        def write_scalars(self, step, scalars):
            super().write_scalars(step, scalars)
            self._maybe_sync()

        def write_hparams(self, hparams):
            super().write_hparams(hparams)
            self._maybe_sync()

        def flush(self):
            super().flush()
            mirror.sync()
            self._synced = time.monotonic()

        def close(self):
            super().close()
            mirror.close()

    return _MirroredWriter()
