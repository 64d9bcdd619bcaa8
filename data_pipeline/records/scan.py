"""Scan and repair of TFRecord files: walk a file's record framing, checking every CRC.

The lowest step of the training input, under `reader` (**scan** -> `reader` ->
`input.masking`, `input.packing` -> `input.pretraining`): `scan_tfrecord_file` finds where every intact record
of a damaged file lies (and what is wrong with the rest), so that `records` can read exactly the
good records in place; a gzip file is first decompressed as far as its stream allows. The CRC-32C
is `tfrecord`'s (google-crc32c), the one implementation: header CRCs of a run of records are checked in
one call, data CRCs by TF's random-access reader.

A TFRecord is `uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)`.
TF's readers stop at the first bad record (and `ignore_errors` drops the rest of the file), and
a file cut inside a header reads as a clean end of file: to skip *exactly* the bad records this
module walks the framing itself.

This module imports neither jax nor bert_jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import tempfile
import zlib
from typing import Optional

import numpy as np
from data_pipeline.tf_import import tf  # without Keras (data_pipeline/tf_import.py)

from data_pipeline import storage
from data_pipeline.records import tfrecord
from data_pipeline.storage import staging as storage_staging


def is_gzip(path: str) -> bool:
    """Whether a TFRecord file is gzip-compressed: `create_pretraining_data --compression=gzip`
    names its outputs `*.gz`."""
    return str(path).endswith(".gz")


_SCRATCH: list = []  # a TemporaryDirectory, kept alive while the process runs


def _gunzip(path: str) -> tuple[str, Optional[str]]:
    """(a local uncompressed copy of a gzip TFRecord file, what cut its gzip stream short or None).

    Everything that decompresses is kept, so the framing scan can find the good records of a
    truncated or damaged file. The copy lives in a scratch folder removed when the process exits.
    """
    if not _SCRATCH:
        _SCRATCH.append(tempfile.TemporaryDirectory(prefix="bert_jax_gunzip_"))
    out = os.path.join(_SCRATCH[0].name, hashlib.sha1(path.encode()).hexdigest()[:12] + ".tfrecord")
    error = None
    with storage.open(path, "rb") as src, storage.open(out, "wb") as dst:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        started = False
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                break
            started = True
            try:
                dst.write(d.decompress(chunk))
                while d.eof and d.unused_data:  # concatenated gzip members
                    rest = d.unused_data
                    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    dst.write(d.decompress(rest))
            except zlib.error as e:
                error = f"gzip data corrupt ({e})"
                break
        if error is None and started and not d.eof:
            error = "gzip stream truncated"
    return out, error


def _random_reader(path: str):
    # TF's random-access record reader verifies the data CRC of the record at a given offset.
    # It is not public API (tensorflow.python), hence this one import site. TensorFlow opens the
    # file itself: `storage_staging.tf_path` gives it the path, or a local copy where it cannot
    # reach it.
    from tensorflow.python.lib.io import tf_record
    return tf_record.tf_record_random_reader(storage_staging.tf_path(path))  # storage: local (storage_staging.tf_path)


class _Headers:
    """`headers(offset)`: the length of the record at `offset` if its header's CRC checks out,
    else None; the CRCs of a run of records checked in one call.

    An offset not yet checked starts a batch: the next `n` headers are read as if each length
    were right (each header at the end of the record before) and their CRCs computed together
    (`tfrecord.crc32c`, one call per batch). `n` doubles
    while the headers check out (a run of good records) and is 1 again after a bad one, so a
    resynchronization over garbage reads no more than one header per candidate offset.
    """

    _MAX_BATCH = 4096

    def __init__(self, f, size: int):
        self._f, self._size = f, size
        self._known: dict = {}  # offset -> length or None, of the last batch
        self._batch = 1

    def __call__(self, offset: int) -> Optional[int]:
        if self._size - offset < 12:
            return None
        if offset not in self._known:
            offsets, heads, at = [], [], offset
            while len(offsets) < self._batch and self._size - at >= 12:
                self._f.seek(at)
                heads.append(self._f.read(12))
                offsets.append(at)
                at += 16 + struct.unpack("<Q", heads[-1][:8])[0]
            head = np.frombuffer(b"".join(heads), np.uint8).reshape(-1, 12)  # [n, 12]
            n = len(offsets)
            crc = tfrecord.mask_crc(tfrecord.crc32c(head.reshape(-1), np.arange(n) * 12,
                                                    np.full(n, 8)))  # [n]
            ok = crc == head[:, 8:].copy().view("<u4")[:, 0]  # [n]
            lengths = head[:, :8].copy().view("<u8")[:, 0]  # [n]
            self._known = {o: int(k) if v else None for o, k, v in zip(offsets, lengths, ok)}
            self._batch = min(2 * self._batch, self._MAX_BATCH) if ok.all() else 1
        return self._known[offset]


@dataclasses.dataclass
class RecordScan:
    """What `scan_tfrecord_file` found in one file."""

    path: str
    size: int
    good_offsets: list  # byte offset of every record whose header and data CRCs check out
    bad_regions: list  # (offset, reason) of every corrupt or truncated stretch
    good_lengths: list = dataclasses.field(default_factory=list)  # payload bytes of each good record

    @property
    def num_good(self) -> int:
        return len(self.good_offsets)

    @property
    def ok(self) -> bool:
        return not self.bad_regions


def scan_tfrecord_file(path: str, max_resync_bytes: int = 64 << 20) -> RecordScan:
    """Walks a TFRecord file's framing and checks every record's CRCs.

    A record whose data CRC fails is one bad region and the walk goes on after it (its header
    gave its length). A header whose CRC fails cannot be trusted for the length, so the walk
    resynchronizes at the next offset (within `max_resync_bytes`) where a valid header is
    followed by a readable record; everything in between is one bad region. A file cut inside a
    header or a payload ends with a bad region.

    A gzip file (`*.gz`) is decompressed into a local scratch copy first (as far as its stream
    allows; a damaged stream is one more bad region); the scan's `path` and offsets are then the
    copy's.

    Args:
      path: the file (local or gs://, read through `storage`).
      max_resync_bytes: how far past a corrupt header to look for the next good record.

    Returns:
      A `RecordScan`; `num_good` records are readable, `bad_regions` lists what was not.
    """
    if is_gzip(path):
        raw, gzip_error = _gunzip(path)
        scan = scan_tfrecord_file(raw, max_resync_bytes)  # offsets into the uncompressed copy
        if gzip_error:
            scan.bad_regions.append((scan.size, gzip_error + f" after {scan.size} uncompressed bytes"))
        return scan
    size = storage.getsize(path)
    good, bad, lengths = [], [], []
    reader = _random_reader(path) if size else None
    with storage.open(path, "rb") as f:
        header_at = _Headers(f, size)

        def readable(offset: int) -> bool:
            try:
                reader.read(offset)
                return True
            except (tf.errors.DataLossError, IndexError, tf.errors.OutOfRangeError):
                return False

        offset = 0
        while offset < size:
            length = header_at(offset)
            if length is None:
                if size - offset < 12:
                    bad.append((offset, f"truncated record header ({size - offset} trailing bytes)"))
                    break
                # Corrupt header: look for the next offset that starts a good record.
                start = offset
                nxt = _resync(f, offset + 1, min(size, offset + max_resync_bytes), size,
                              lambda c: header_at(c) is not None and readable(c))
                bad.append((start, "corrupt record header"))
                if nxt is None:
                    break
                offset = nxt
                continue
            end = offset + 12 + length + 4
            if end > size:
                bad.append((offset, f"truncated record payload (needs {end - size} more bytes)"))
                break
            if readable(offset):
                good.append(offset)
                lengths.append(length)
            else:
                bad.append((offset, "record data CRC mismatch"))
            offset = end
    return RecordScan(path=path, size=size, good_offsets=good, bad_regions=bad, good_lengths=lengths)


def _resync(f, begin: int, end: int, size: int, accept) -> Optional[int]:
    """First offset in [begin, end) whose 8-byte length fits in the file and that `accept`s.

    The length and header-CRC tests run on whole chunks in numpy (one unaligned uint64 view per
    chunk, one `crc32c` call over the offsets whose length fits): random bytes almost never pass
    both, nor do zeroed blocks (whose zero lengths all fit), so `accept` (reading the record) runs
    on a handful of candidates instead of on every byte.
    """
    chunk = 16 << 20
    pos = begin
    while pos < min(end, size - 16):
        f.seek(pos)
        data = f.read(min(chunk, size - pos))
        n = len(data) - 7  # offsets with 8 bytes of length
        if n <= 0:
            return None
        lengths = np.ndarray((n,), dtype="<u8", buffer=data, strides=(1,))  # [n] overlapping
        offsets = pos + np.arange(n, dtype=np.int64)
        fits = np.flatnonzero(lengths <= (size - 16 - offsets).astype(np.uint64))
        buf = np.frombuffer(data, np.uint8)
        for lo in range(0, len(fits), 1 << 18):  # bounded batches: a zeroed block fits everywhere
            part = fits[lo:lo + (1 << 18)]
            whole = part[part + 12 <= len(data)]  # header CRC in this chunk (else `accept` checks it)
            crc = tfrecord.mask_crc(tfrecord.crc32c(buf, whole, np.full(len(whole), 8)))
            stored = buf[whole[:, None] + np.arange(8, 12)].copy().view("<u4")[:, 0]  # [len(whole)]
            for i in np.union1d(whole[crc == stored], part[len(whole):]):
                candidate = int(offsets[i])
                if candidate >= end:
                    return None
                if accept(candidate):
                    return candidate
        pos += n
    return None


def count_records_by_framing(path: str) -> int:
    """Record count from the headers alone (no CRC checks): for files without a manifest."""
    if is_gzip(path):
        return count_records_by_framing(_gunzip(path)[0])
    size = storage.getsize(path)
    count, offset = 0, 0
    with storage.open(path, "rb") as f:
        while offset < size:
            if size - offset < 12:
                return count + 1  # a cut header still stands for a (lost) record
            f.seek(offset)
            (length,) = struct.unpack("<Q", f.read(8))
            count += 1
            offset += 16 + length
    return count
