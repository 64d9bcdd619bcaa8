"""tf.data input for pretraining: TFRecords in Google's schema -> host-local numpy batches.

The last stage of the training input (`records.reader` -> `masking` -> `packing` -> **pretraining**
-> `bert_jax.training.sharding.to_global`): `PretrainingInput`, the endless (or one-epoch) training
stream of one host, with its saved and restored position, built from the modules before it;
beside it, `data_pipeline.input.evaluation` (one padded pass for evaluation) and
`data_pipeline.input.parsing` (what both share: parsing, the next batch as numpy). Their names are
imported from their own modules, not from here.

- **Training stream** (`PretrainingInput`): seeded file-order shuffle -> interleave -> seeded
  record shuffle (of the serialized records: small buffers, small checkpoints) -> `repeat` ->
  [packing] -> `batch(per_host_batch_size, drop_remainder=True)` -> parse -> [dynamic masking]
  -> prefetch. Both shuffles sit before `repeat` (reshuffled each epoch), so every record of
  this host's files appears exactly once per epoch and epochs do not mix. Nothing sits between
  the record shuffle and `repeat`: TF 2.21 restores `shuffle -> batch -> repeat` wrongly when
  the iterator was saved at the end of an epoch.
- **Dynamic masking** (`masking.dynamic_mask`): each batch is re-masked with stateless random
  ops seeded from a `Dataset.random` stream after `repeat`: new masks every epoch, the same masks
  for the same seed, and the stream position is saved with the iterator. Packed rows are masked
  sequence by sequence.
- **Packing** (`packing.pack_window`): first-fit-decreasing within windows of `packing_window`
  consecutive records. Records of different epochs never share a row.
- **Evaluation** (`evaluation.make_eval_iterator` -> `EvalInput`): one finite pass, in file
  order, padded so every host yields the same number of batches; padding rows carry weight 0.

Batches (numpy, host-local; `B` = per_host_batch_size, `L` = max_seq_length,
`P` = max_predictions_per_seq):

  unpacked training and eval batches (Google's names):
    input_ids, input_mask, segment_ids     int32   [B, L]
    masked_lm_positions, masked_lm_ids     int32   [B, P]
    masked_lm_weights                      float32 [B, P]
    next_sentence_labels                   int32   [B, 1]   (Google's shape; 1 = random next)
    next_sentence_weights                  float32 [B]      (1; 0 for eval padding rows)

  packed training batches: the rows of `packing` (its module docstring), `B` of them.

This module imports neither jax nor bert_jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from data_pipeline import storage
from data_pipeline.input.masking import (SpecialIds, dynamic_mask, dynamic_predictions_per_sequence,
                                         resolve_whole_word_mask)
from data_pipeline.input.packing import pack_window
from data_pipeline.input.parsing import deterministic_options, graph_fn, next_batch, parse_batch
from data_pipeline.records.reader import CorruptDataError, FilePatterns, check_files, file_datasets
from data_pipeline.storage import paths as storage_paths, split_patterns, staging as storage_staging
from data_pipeline.tf_import import tf  # without Keras (data_pipeline/tf_import.py)

_STATE_JSON = "input_state.json"
_ITERATOR_PREFIX = "iterator"


# ---------------------------------------------------------------------------------------------
# Training input
# ---------------------------------------------------------------------------------------------


def _mix(*values: int) -> int:
    """A 63-bit hash of ints (splitmix64 steps): independent seeds per host and per use."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & 0x7FFFFFFFFFFFFFFF


class PretrainingInput:
    """The pretraining batch iterator of one host.

    `next(ds)` gives a dict of numpy arrays (module docstring lists keys, shapes, dtypes). With
    `repeat=True` the stream is endless; with `repeat=False` it is one epoch, cut so that every
    host yields the same number of batches (`num_batches`).

    Example:
      ds = PretrainingInput("gs://bucket/data/train-*.tfrecord", per_host_batch_size=32,
                            max_seq_length=128, max_predictions_per_seq=20, seed=0,
                            process_index=jax.process_index(), process_count=jax.process_count())
      batch = next(ds)
      ds.save_state(workdir + "/input_state/1000/process_0")   # with the model checkpoint
    """

    def __init__(
        self,
        file_patterns: FilePatterns,
        *,
        per_host_batch_size: int,
        max_seq_length: int,
        max_predictions_per_seq: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        shuffle_buffer_size: int = 10_000,
        repeat: bool = True,
        dynamic_masking: bool = False,
        special_ids: Optional[Union[SpecialIds, Mapping[str, int]]] = None,
        masked_lm_prob: float = 0.15,
        whole_word_mask: Optional[bool] = None,
        subword: Optional[Sequence[bool]] = None,
        packing: bool = False,
        max_seqs_per_pack: int = 3,
        max_predictions_per_pack: Optional[int] = None,
        packing_window: int = 512,
        verify: bool = True,
        skip_corrupt: bool = False,
        cycle_length: int = 8,
        known_hashes_file: Optional[str] = None,
    ):
        """Checks the files (see module docstring) and builds the tf.data pipeline.

        Args:
          file_patterns: glob, comma-separated globs, or a list of them.
          per_host_batch_size: rows per batch on this host (global batch / process_count).
          max_seq_length: L of the records (and of packed rows).
          max_predictions_per_seq: P of the records.
          seed: seeds every shuffle and mask; the same seed gives the same batches.
          process_index, process_count: this host and the number of hosts (jax.process_*).
          shuffle_buffer_size: serialized records held for the record-level shuffle (per host).
          repeat: endless epochs (True) or one epoch (False).
          dynamic_masking: re-mask every record each epoch instead of using its stored mask.
          special_ids: `SpecialIds` or a dict with mask_id, cls_id, sep_id, vocab_size[, pad_id];
            required by dynamic masking.
          masked_lm_prob: fraction of tokens dynamic masking predicts.
          whole_word_mask: dynamic masking masks whole words (Google's `--do_whole_word_mask`);
            None = as the records were made (their manifests' flags; token by token when
            not recorded). Needs `subword`.
          subword: `[vocab_size]` bool, True for `##` tokens (`subword_table(vocab.txt)`).
          packing: pack several records per row (packed-batch keys of the module docstring).
          max_seqs_per_pack: S, sequences per packed row at most.
          max_predictions_per_pack: Pp, the packed masked_lm width; default P * S.
          packing_window: records the packer sees at once (larger packs tighter, costs memory).
          verify: check every file against the manifest listing it (`*.dataset_info.json`) before reading.
          skip_corrupt: skip (and count in `stats`) bad records and files instead of raising;
            the good records of a damaged file are read in place (nothing is copied).
          cycle_length: files read concurrently (interleave).
          known_hashes_file: where this process also keeps the hashes of verified files in a
            bucket, beside those of the other processes (`records.known_hashes.KnownHashes`; a training run's
            `WORKDIR/verified_data/process_<i>.json`); None: on local disk only.

        Raises:
          CorruptDataError: a file is missing, unlisted, or fails the manifest check (strict).
          ValueError: an inconsistent option (named in the message).
        """
        if per_host_batch_size <= 0:
            raise ValueError(f"per_host_batch_size={per_host_batch_size} must be positive")
        if not 0 < max_predictions_per_seq <= max_seq_length:
            raise ValueError(f"max_predictions_per_seq={max_predictions_per_seq} must be in "
                             f"[1, max_seq_length={max_seq_length}]")
        if dynamic_masking and special_ids is None:
            raise ValueError("dynamic_masking=True needs special_ids (mask_id, cls_id, sep_id, "
                             "vocab_size; read them from vocab.txt)")
        whole_word_mask = resolve_whole_word_mask(file_patterns, dynamic_masking, whole_word_mask)
        if whole_word_mask:
            if subword is None:
                raise ValueError("whole-word dynamic masking needs subword (which ids are ## "
                                 "pieces: masking.subword_table(vocab.txt))")
            subword = np.asarray(subword, bool)
            if subword.ndim != 1 or len(subword) < SpecialIds.from_any(special_ids).vocab_size:
                raise ValueError(f"subword has shape {subword.shape}: one bool per vocabulary id "
                                 f"expected (vocab_size={SpecialIds.from_any(special_ids).vocab_size})")
        if packing:
            if max_seqs_per_pack < 1:
                raise ValueError(f"max_seqs_per_pack={max_seqs_per_pack} must be >= 1")
            if max_predictions_per_pack is None:
                max_predictions_per_pack = max_predictions_per_seq * max_seqs_per_pack
            if max_predictions_per_pack < max_predictions_per_seq:
                raise ValueError(f"max_predictions_per_pack={max_predictions_per_pack} must be >= "
                                 f"max_predictions_per_seq={max_predictions_per_seq}")
            if packing_window < 1:
                raise ValueError(f"packing_window={packing_window} must be >= 1")
        self.per_host_batch_size = per_host_batch_size
        self.max_seq_length = max_seq_length
        self.max_predictions_per_seq = max_predictions_per_seq
        self.seed = int(seed)
        self.process_index, self.process_count = process_index, process_count
        self.shuffle_buffer_size = shuffle_buffer_size
        self.repeat = repeat
        self.dynamic_masking = dynamic_masking
        self.special_ids = SpecialIds.from_any(special_ids) if special_ids is not None else None
        self.masked_lm_prob = masked_lm_prob
        self.whole_word_mask = whole_word_mask
        self._subword = subword if whole_word_mask else None
        self.packing = packing
        self.max_seqs_per_pack = max_seqs_per_pack
        self.max_predictions_per_pack = max_predictions_per_pack
        self.packing_window = packing_window
        self.cycle_length = cycle_length
        self._patterns = split_patterns(file_patterns)

        self._files = check_files(file_patterns, process_index=process_index,
                                  process_count=process_count, verify=verify,
                                  skip_corrupt=skip_corrupt, require_files_per_host=True,
                                  known_hashes_file=known_hashes_file)
        if not self._files.read_paths:
            raise CorruptDataError(self._patterns[0], f"host {process_index} has no readable file "
                                   f"left ({len(self._files.corrupt_files)} corrupt or missing)")
        if self._files.read_records == 0:  # (an endless repeat of nothing would end at once)
            raise CorruptDataError(self._patterns[0], f"host {process_index}'s files hold no record")
        self.num_batches = self._finite_num_batches() if not repeat else None
        self._counters = {"batches": 0, "sequences": 0}  # saved and restored with the position
        self.dataset = self._build()
        self._iterator = iter(self.dataset)

    # --- pipeline --------------------------------------------------------------------------

    def _finite_num_batches(self) -> int:
        """Batches every host can yield in one epoch (the minimum over hosts)."""
        per_host = self._files.records_per_host(self.process_count)
        per_host[self.process_index] = self._files.read_records
        if self.packing:
            # Packed row counts depend on the data; each host has at least ceil(n / S) rows.
            per_host = [-(-n // self.max_seqs_per_pack) for n in per_host]
        return min(per_host) // self.per_host_batch_size

    def _build(self) -> tf.data.Dataset:
        seed, host = self.seed, self.process_index
        paths = self._files.read_paths
        units, read = file_datasets(self._files)
        files = units.shuffle(len(paths), seed=_mix(seed, host, 1), reshuffle_each_iteration=True)
        records = files.interleave(
            read, cycle_length=min(self.cycle_length, len(paths)),
            block_length=1, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if self.shuffle_buffer_size > 1:
            records = records.shuffle(self.shuffle_buffer_size, seed=_mix(seed, host, 2),
                                      reshuffle_each_iteration=True)
        L, P = self.max_seq_length, self.max_predictions_per_seq

        # Nothing may sit between the reshuffling `shuffle` and `repeat`: in TF 2.21 an iterator
        # saved while e.g. a `batch` there has drained the epoch restores with the wrong next
        # permutation (seen at some cut points only). So packing windows are cut after `repeat`.
        ds = records.repeat() if self.repeat else records
        if self.packing:
            per_epoch = self._files.read_records

            def pack(index, serialized):
                features = parse_batch(serialized, L, P)
                budget = None
                if self.dynamic_masking:
                    budget = dynamic_predictions_per_sequence(
                        features, special_ids=self.special_ids, max_predictions_per_seq=P,
                        masked_lm_prob=self.masked_lm_prob)
                return pack_window(features, max_seq_length=L,
                                   max_seqs_per_pack=self.max_seqs_per_pack,
                                   max_predictions_per_pack=self.max_predictions_per_pack,
                                   prediction_budget=budget,
                                   groups=index // per_epoch)  # the epoch: never mixed in a row

            ds = ds.enumerate().batch(self.packing_window).map(
                graph_fn(pack), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
            ds = ds.batch(self.per_host_batch_size, drop_remainder=True)
        else:
            ds = ds.batch(self.per_host_batch_size, drop_remainder=True).map(
                graph_fn(lambda serialized: dict(
                    parse_batch(serialized, L, P),
                    next_sentence_weights=tf.ones([tf.shape(serialized)[0]], tf.float32))),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if self.dynamic_masking:
            # Masks are drawn per batch from a random stream *after* `repeat`: it runs on across
            # epochs (so every epoch gets new masks) and its position is saved with the iterator.
            # (`Dataset.random(rerandomize_each_iteration=True)` before `repeat` would be simpler,
            # but TF 2.21 does not restore its per-epoch reseeding from a checkpoint.)
            salt = tf.constant(_mix(seed, host, 4), tf.int64)
            subword = None if self._subword is None else tf.constant(self._subword)

            def remask(features, rand):
                return dynamic_mask(features, tf.stack([rand, salt]), special_ids=self.special_ids,
                                    max_predictions_per_seq=P, masked_lm_prob=self.masked_lm_prob,
                                    subword=subword)

            ds = tf.data.Dataset.zip(ds, tf.data.Dataset.random(seed=_mix(seed, host, 3)))
            ds = ds.map(graph_fn(remask), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if self.num_batches is not None:
            ds = ds.take(self.num_batches)
        return ds.prefetch(2).with_options(deterministic_options())

    # --- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> "PretrainingInput":
        return self

    def __next__(self) -> dict:
        try:
            out = next_batch(self._iterator, self._files, self._patterns, self.max_seq_length,
                              self.max_predictions_per_seq)
        except StopIteration:
            if self.num_batches is not None and self._counters["batches"] < self.num_batches:
                raise RuntimeError(
                    f"host {self.process_index} ran out of data after {self._counters['batches']} "
                    f"of {self.num_batches} batches ({self._files.skipped_records} corrupt "
                    f"records skipped): the hosts would disagree on the number of steps")
            raise
        self._counters["batches"] += 1
        self._counters["sequences"] += int(out["next_sentence_weights"].sum())
        return out

    @property
    def stats(self) -> dict:
        """This host's numbers.

        files: files assigned to this host; records_in_files: records they should hold (manifest;
        counted from the framing when unverified); corrupt_files: those missing or corrupt
        (lenient mode); skipped_records: records that will not be read; records_per_epoch: records
        read per epoch; batches, sequences: yielded so far (restored with the position).
        """
        files = self._files
        return {"files": len(files.host_files),
                "records_in_files": sum(files.count(p) for p in files.host_files),
                "corrupt_files": list(files.corrupt_files),
                "skipped_records": files.skipped_records,
                "records_per_epoch": files.read_records,
                **self._counters}

    @property
    def host_files(self) -> list[str]:
        """This host's share of the sorted file list (original names)."""
        return list(self._files.host_files)

    @property
    def verification(self) -> dict:
        """What checking this host's files took: hashed_files, hashed_bytes, and trusted_files
        (unchanged since an earlier run hashed them; all 0 without `verify`)."""
        return dict(self._files.verification)

    # --- state -------------------------------------------------------------------------------

    def _fingerprint(self) -> dict:
        # The files' manifest sha256s too: a rewritten dataset under the same names must not
        # resume as if nothing happened (None per file when unverified).
        digests = [getattr(self._files.infos.get(p), "sha256", None) for p in self._files.host_files]
        return {
            "host_files": self._files.host_files,
            "host_files_sha256": hashlib.sha256(json.dumps(digests).encode()).hexdigest(),
            "process_index": self.process_index, "process_count": self.process_count,
            "per_host_batch_size": self.per_host_batch_size,
            "max_seq_length": self.max_seq_length,
            "max_predictions_per_seq": self.max_predictions_per_seq,
            "seed": self.seed, "shuffle_buffer_size": self.shuffle_buffer_size,
            "repeat": self.repeat, "dynamic_masking": self.dynamic_masking,
            "special_ids": dataclasses.asdict(self.special_ids) if self.special_ids else None,
            "masked_lm_prob": self.masked_lm_prob, "packing": self.packing,
            # Only when on: states saved before the option existed still resume.
            **({"whole_word_mask": True} if self.whole_word_mask else {}),
            "max_seqs_per_pack": self.max_seqs_per_pack if self.packing else None,
            "max_predictions_per_pack": self.max_predictions_per_pack,
            "packing_window": self.packing_window if self.packing else None,
            "cycle_length": self.cycle_length,
            "skipped_records": self._files.skipped_records,
        }

    def save_state(self, directory: str) -> None:
        """Writes the input position into `directory` (created if needed).

        `directory/iterator.*` is a `tf.train.Checkpoint` of the iterator (shuffle buffer,
        file offsets, random streams: it grows with shuffle_buffer_size), and
        `directory/input_state.json` the options it belongs to and the counters. A gs://
        directory is written through `storage`: the checkpoint in a local staging folder, then
        uploaded (`storage_staging.writing_dir`), the JSON last.
        """
        with storage_staging.writing_dir(directory) as local:
            checkpoint = tf.train.Checkpoint(iterator=self._iterator)  # storage: local (storage_staging.writing_dir)
            checkpoint.write(os.path.join(local, _ITERATOR_PREFIX))
        state = {"fingerprint": self._fingerprint(), "counters": self._counters}
        storage.write_text(storage_paths.join(directory, _STATE_JSON), json.dumps(state, indent=1))

    def restore_state(self, directory: str) -> None:
        """Continues from a position written by `save_state` with the same options.

        Raises:
          FileNotFoundError: `directory` holds no saved input state.
          ValueError: the state was saved with different options (the differing ones named).
        """
        state_path = storage_paths.join(directory, _STATE_JSON)
        if not storage.exists(state_path):
            raise FileNotFoundError(f"{state_path}: no saved input state")
        state = json.loads(storage.read_text(state_path))
        saved, now = state["fingerprint"], json.loads(json.dumps(self._fingerprint()))
        diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if diff:
            detail = "; ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in diff[:4])
            raise ValueError(f"{state_path} was saved by an input pipeline with other options "
                             f"({detail})")
        with storage_staging.reading_dir(directory) as local:
            checkpoint = tf.train.Checkpoint(iterator=self._iterator)  # storage: local (storage_staging.reading_dir)
            checkpoint.read(os.path.join(local, _ITERATOR_PREFIX)).assert_consumed()
        self._counters = dict(state["counters"])
