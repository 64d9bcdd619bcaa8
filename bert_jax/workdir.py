"""What a run writes into its workdir besides checkpoints, local or on Cloud Storage.

A workdir holds, next to `checkpoints/`: `bert_config.json`, `vocab.txt`, `tokenizer_config.json`
(the model files that make it loadable by `bert_jax.convert`), `train_log.jsonl` (one line per
step), `eval_results.json` / `eval_history.json`, and TensorBoard event files. Every one goes
through `data_pipeline.storage`: a workdir may be a local folder or `gs://bucket/run`.

Logs are written off the training step: `MetricWriter.append_jsonl` and the TensorBoard uploads
only queue work for one background thread (`data_pipeline.storage.log_writer`), so a stalled or failing
bucket delays or drops log lines (counted, logged) but never stalls or stops training.
TensorBoard's writer only writes local files: for a gs:// workdir the events are written into a
staging folder of the cache and uploaded whole (as TensorFlow's own GCS writer re-uploads a file
at each flush) at once after the first write, then at most every `sync_every_seconds` (5 s) while
writes go on, and at `flush`/`close`, so TensorBoard pointed at the bucket follows the run; a new
event file is started every 4 MiB (`EVENT_FILE_BYTES`) so an upload stays ~0.1 s. A killed run
loses at most the events of its last 5 s plus one upload. `train_log.jsonl` is appended to in
place on local disk and by server-side composition on Cloud Storage (no download of what is
there), at most once a second, each line once (`storage_atomic.Appender`); the loop flushes it (at
most 10 s) before each checkpoint save, so a committed step's lines are in the log.

`check_paths` refuses, before anything runs, a workdir or config path that no installed backend
handles, naming the flag or key (data_pipeline.storage.paths.check).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterable, Mapping, Optional

from bert_jax import layout
from bert_jax.model.model_config import BertConfig
from bert_jax.model.modernbert import ModernBertConfig
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths, staging as storage_staging
from data_pipeline.storage.log_writer import CLOSE_TIMEOUT_S, MIRROR_INTERVAL_S, LogWriter

# A new event file once the current one passes this: a gs:// workdir uploads its newest file
# whole every few seconds, and 4 MiB took 0.1 s against the emulator (a week at 600 bytes per log
# step and log_every_steps=1 would otherwise re-upload hundreds of MB each time).
EVENT_FILE_BYTES = 4 << 20

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
    """Raises `storage_paths.StorageError` naming the flag or config key of the first path bert_jax
    cannot use: the workdir, and every config string that names a scheme (`gs://...`, or a
    mangled `gs:/...`); comma-separated lists are checked item by item."""
    if workdir is not None:
        storage_paths.check(workdir, "--workdir")
    for key, value in _strings(dict(config), "config"):
        for item in value.split(","):
            item = item.strip()
            if "://" in item or ":/" in item:
                storage_paths.check(item, key, urls=key.rsplit(".", 1)[-1] in URL_KEYS)


# ---------------------------------------------------------------------------------------------
# Model files
# ---------------------------------------------------------------------------------------------


def write_model_files(workdir: str, bert_config: BertConfig, vocab_file: str,
                      do_lower_case: Optional[bool] = None, tokenizer_json: str = "") -> None:
    """Makes the workdir self-describing: bert_config.json (for a `ModernBertConfig`:
    modernbert_config.json) + vocab.txt (or, given `tokenizer_json`, that tokenizer.json) +
    tokenizer_config.json (with the casing, when it is known) next to the checkpoints. A file is
    written only when its content changes, so a finished (even read-only) workdir re-runs as a
    no-op. Call it on one process."""
    from bert_jax.formats.common import tokenizer_config_json

    storage.makedirs(workdir)
    if isinstance(bert_config, ModernBertConfig):  # config.model_family="modernbert"
        from bert_jax.formats import modernbert_hf
        write_if_changed(storage_paths.join(workdir, layout.MODERNBERT_CONFIG),
                         modernbert_hf.workdir_config_json(bert_config))
    else:
        config_file = storage_paths.join(workdir, layout.MODEL_CONFIG)
        try:
            unchanged = BertConfig.from_json_file(config_file) == bert_config.replace(fp8=False)
        except (OSError, ValueError):
            unchanged = False
        if not unchanged:
            bert_config.to_json_file(config_file)
    if vocab_file:
        write_if_changed(storage_paths.join(workdir, layout.VOCAB), storage.read_bytes(vocab_file))
    if tokenizer_json:
        write_if_changed(storage_paths.join(workdir, layout.TOKENIZER_JSON), storage.read_bytes(tokenizer_json))
    if do_lower_case is not None:
        write_if_changed(storage_paths.join(workdir, layout.TOKENIZER_CONFIG),
                         tokenizer_config_json(do_lower_case).encode())


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


def jsonl(rows: Iterable[dict]) -> str:
    """One JSON line per row."""
    return "".join(json.dumps(row) + "\n" for row in rows)


def write_json(workdir: str, name: str, value: Any, **kwargs) -> str:
    """`workdir/name` holding `value` as JSON, written whole (never half a file)."""
    path = storage_paths.join(workdir, name)
    storage.write_json(path, value, **kwargs)
    return path


# ---------------------------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------------------------


class _EventFile:
    """TensorBoard's event file, written without TensorFlow (whose import, through clu's writer,
    took 3.7 s of a fine-tuning run's start and was its only use of TensorFlow), as the fast
    record writer does (`data_pipeline.records.tfrecord`): TensorBoard's `Event` protos in TFRecord
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
        name = (f"{layout.EVENTS_PREFIX}.{int(time.time())}.{socket.gethostname()}.{os.getpid()}."
                f"{_EventFile._counter}.v2")
        self._file = storage.open(storage_paths.join(directory, name), "ab")  # pylint: disable=consider-using-with
        self._event = event_pb2.Event
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event) -> None:
        from data_pipeline.records import tfrecord  # the project's TFRecord framing without TensorFlow

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

    def size(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()


class MetricWriter:
    """The console (absl logging, in clu's `LoggingWriter` format), TensorBoard event files in
    `events_dir` unless `just_logging`, and the run's text logs (`append_jsonl`).

    Nothing here waits on storage: the text logs, and the uploads of a staging folder's events
    (`metric_writer`), go through `self.logs`, a `data_pipeline.storage.log_writer.LogWriter` (one
    background thread: coalesced, rate-limited, retried within a budget, then dropped and
    counted). `flush` and `close` wait for it at most `timeout` seconds. A new event file is
    started once the current one passes `EVENT_FILE_BYTES`, so that each upload stays small.
    """

    def __init__(self, events_dir: Optional[str] = None, *, logs: Optional[LogWriter] = None,
                 lock: Optional[threading.Lock] = None):
        self.logs = logs or LogWriter()
        self._events_dir = events_dir
        self._events = _EventFile(events_dir) if events_dir else None
        self._lock = lock or threading.Lock()  # held while event files are written (`storage_staging.Mirror`)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        from absl import logging

        logging.info("[%d] %s", step, ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in sorted(scalars.items())))
        if self._events:
            with self._lock:
                self._events.scalars(step, scalars)
                self._roll()
            self._staged()

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        from absl import logging

        logging.info("[Hyperparameters] %s", dict(hparams))
        if self._events:
            with self._lock:
                self._events.hparams(hparams)
                self._roll()
            self._staged()

    def append_jsonl(self, path: str, rows: Iterable[dict]) -> None:
        """Queues one JSON line per row to be appended to `path` (returns at once)."""
        self.logs.append(path, jsonl(rows))

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Writes everything queued (log lines, event uploads) and waits for it at most `timeout`
        seconds; whether all of it was written."""
        if self._events:
            with self._lock:
                self._events.flush()
            self._staged()
        return self.logs.flush(timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """`flush`, then the background writer stops: what it has not written within `timeout`
        seconds is counted as dropped (`self.logs.dropped_lines`, `.dropped_uploads`)."""
        if self._events:
            with self._lock:
                self._events.close()
            self._staged()
        return self.logs.close(timeout)

    def _roll(self) -> None:
        if self._events.size() > EVENT_FILE_BYTES:
            self._events.close()
            self._events = _EventFile(self._events_dir)

    def _staged(self) -> None:
        """Called after event files changed (a staging folder uploads them)."""


def metric_writer(workdir: str, *, just_logging: bool, sync_every_seconds: float = MIRROR_INTERVAL_S) -> MetricWriter:
    """The console + TensorBoard writer for `workdir` (console only with `just_logging`, for the
    hosts after the first). For a gs:// workdir the event files are staged locally and uploaded by
    the writer's background thread: at once after the first write, then at most every
    `sync_every_seconds` while writes go on, and at `flush`/`close` (bounded by their timeout)."""
    if just_logging:
        return MetricWriter()
    mirror = storage_staging.Mirror(workdir, name="tensorboard")

    class _MirroredWriter(MetricWriter):
        """Writes events into `mirror.local`; the log writer uploads them to the workdir."""

        def __init__(self):
            super().__init__(mirror.local, logs=LogWriter(mirror_interval_s=sync_every_seconds),  # storage: local
                             lock=mirror.lock)

        def _staged(self):
            self.logs.sync(mirror)

        def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
            done = super().close(timeout)
            return mirror.close(upload=False) and done  # the staging folder stays if not all went

    return _MirroredWriter()
