"""TFRecord files without TensorFlow: CRC-32C in numpy, record framing, a file writer.

The fast `create_pretraining_data` writes its records with this module so that neither it nor
its worker processes import TensorFlow (a ~6 s import on a small machine, longer than the whole
job on a small corpus). The format (TensorFlow's `core/lib/io/record_writer`):

    uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)

with `masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2**32)`. A gzip-compressed
file (`--compression=gzip`) is one gzip stream of that, as `tf.io.TFRecordOptions("GZIP")` writes.

CRC-32C (Castagnoli) of many records at once: the CRC without its initial and final inversion is
linear over GF(2), so it is the XOR over the message's bytes of a table entry that depends only
on the byte's value and how many bytes follow it: `crc(m) = XOR_i T[len(m) - 1 - i][m_i]`, plus
a term of the inversion that depends only on `len(m)`. One gather and one XOR-reduce per record
batch, no per-byte Python. `google_crc32c` (C) is not needed; tests check the numpy code against
the standard check value and against TensorFlow's own writer and reader.

This module never imports jax; tensorflow only for paths that are not local (gs://...).
"""

from __future__ import annotations

import os
import zlib
from typing import BinaryIO, Optional

import numpy as np

_POLY = 0x82F63B78  # CRC-32C, reflected
_MASK_DELTA = 0xA282EAD8
HEADER_BYTES = 12  # length + its masked CRC
FOOTER_BYTES = 4  # masked CRC of the data


def _byte_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1)
    return table.astype(np.uint32)


_TABLE = _byte_table()


class _DistanceTables:
    """`rows[d][b]`: the raw CRC (no inversions) of byte b followed by d zero bytes; `inv[n]`:
    the raw CRC's term from the initial inversion for an n-byte message. Grown on demand."""

    def __init__(self):
        self.rows = np.zeros((0, 256), np.uint32)
        self.inv = np.full(1, 0xFFFFFFFF, np.uint32)

    @staticmethod
    def _advance(state: np.ndarray, steps: int) -> np.ndarray:
        """States after each of `steps` zero bytes: [steps, *state.shape]."""
        out = np.empty((steps,) + state.shape, np.uint32)
        for i in range(steps):
            state = (state >> np.uint32(8)) ^ _TABLE[state & np.uint32(0xFF)]
            out[i] = state
        return out

    def ensure(self, length: int) -> None:
        have = len(self.rows)
        if length <= have:
            return
        grow = max(length, 2 * have, 1024) - have
        if have == 0:
            first = _TABLE.copy()
            self.rows = np.concatenate([first[None], self._advance(first, grow - 1)])
            self.inv = np.concatenate([self.inv, self._advance(self.inv[-1], grow)])
        else:
            self.rows = np.concatenate([self.rows, self._advance(self.rows[-1], grow)])
            self.inv = np.concatenate([self.inv, self._advance(self.inv[-1], grow)])


_TABLES = _DistanceTables()


def crc32c(buffer: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """CRC-32C of each message `buffer[starts[i]:starts[i] + lengths[i]]` (uint8 buffer).

    Example:
      >>> hex(int(crc32c(np.frombuffer(b"123456789", np.uint8), np.array([0]), np.array([9]))[0]))
      '0xe3069283'
    """
    starts = np.asarray(starts, np.int64)
    lengths = np.asarray(lengths, np.int64)
    if len(starts) == 0:
        return np.zeros(0, np.uint32)
    longest = int(lengths.max())
    _TABLES.ensure(longest + 1)
    out = _TABLES.inv[lengths].copy()
    nonempty = lengths > 0
    if nonempty.any():
        s, n = starts[nonempty], lengths[nonempty]
        total = int(n.sum())
        small = max(total, len(buffer)) < 2**31 and longest < 2**23
        itype = np.int32 if small else np.int64
        first = np.zeros(len(n), np.int64)
        np.cumsum(n[:-1], out=first[1:])
        # Byte j of the concatenated messages: how many bytes follow it in its message, and its
        # offset in `buffer`.
        j = np.arange(total, dtype=itype)
        after = np.repeat((first + n - 1).astype(itype), n)
        after -= j
        offset = np.repeat((s - first).astype(itype), n)
        offset += j
        index = after << 8
        index |= buffer[offset]
        contrib = _TABLES.rows.reshape(-1)[index]
        out[nonempty] ^= np.bitwise_xor.reduceat(contrib, first)
    return out ^ np.uint32(0xFFFFFFFF)


def mask_crc(crc: np.ndarray) -> np.ndarray:
    crc = np.asarray(crc, np.uint32)
    return ((crc >> np.uint32(15)) | (crc << np.uint32(17))) + np.uint32(_MASK_DELTA)


def _crc32c_packed(buffer: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`crc32c` of messages that follow each other in `buffer` with only zero bytes between them
    (and before the first): every byte is charged to the next message end, the zeros add nothing,
    so no per-byte offsets into `buffer` are needed."""
    ends = starts + lengths
    total = int(ends[-1])
    segment = np.diff(ends, prepend=0)  # bytes charged to each message: gap + message
    _TABLES.ensure(int(segment.max()) + 1)
    itype = np.int32 if total < 2**31 and len(_TABLES.rows) < 2**23 else np.int64
    index = np.repeat((ends - 1).astype(itype), segment)
    index -= np.arange(total, dtype=itype)  # bytes after it in its message (gap bytes: more)
    index <<= 8
    index |= buffer[:total]
    raw = np.bitwise_xor.reduceat(_TABLES.rows.reshape(-1)[index], ends - segment)
    return raw ^ _TABLES.inv[lengths] ^ np.uint32(0xFFFFFFFF)


def frame(buffer: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Writes the TFRecord framing in place around records laid out with `HEADER_BYTES` free
    (zero) before and `FOOTER_BYTES` after each, one after the other (as
    `schema.encode_examples(..., head=12, tail=4)` returns them): after it, `buffer` is the
    records' TFRecord file bytes."""
    starts = np.asarray(starts, np.int64)
    lengths = np.asarray(lengths, np.int64)
    if not len(starts):
        return
    data_crc = mask_crc(_crc32c_packed(buffer, starts, lengths))  # while the gaps are still zero
    heads = starts - HEADER_BYTES
    length_bytes = lengths.astype("<u8").view(np.uint8).reshape(-1, 8)
    buffer[heads[:, None] + np.arange(8)] = length_bytes
    length_crc = mask_crc(crc32c(buffer, heads, np.full(len(starts), 8, np.int64)))
    buffer[heads[:, None] + np.arange(8, 12)] = length_crc.astype("<u4").view(np.uint8).reshape(-1, 4)
    buffer[(starts + lengths)[:, None] + np.arange(4)] = data_crc.astype("<u4").view(np.uint8).reshape(-1, 4)


def frame_records(records) -> bytes:
    """TFRecord file bytes of a list of `bytes` records (small batches, tests, the reference mode)."""
    lengths = np.array([len(r) for r in records], np.int64)
    slot = HEADER_BYTES + lengths + FOOTER_BYTES
    starts = np.zeros(len(records), np.int64)
    np.cumsum(slot[:-1], out=starts[1:])
    starts += HEADER_BYTES
    buffer = np.zeros(int(slot.sum()), np.uint8)
    for r, s in zip(records, starts):
        buffer[s:s + len(r)] = np.frombuffer(r, np.uint8)
    frame(buffer, starts, lengths)
    return buffer.tobytes()


def _is_local(path: str) -> bool:
    return "://" not in path


class Writer:
    """Appends framed TFRecord bytes to a file (local, or any `tf.io.gfile` path), optionally gzip.

    The gzip stream is the one TensorFlow writes and reads (`compression_type="GZIP"`): deflate at
    zlib's default level, gzip header with no name and time 0, so files are the same run to run.

    Args:
      path: the file (its name, when `file` is given).
      compression: "none" or "gzip".
      file: an open binary file to write to instead of opening `path` (the Beam runner passes one
        from `apache_beam.io.filesystems.FileSystems.create`, so any file system Beam has works);
        `close()` closes it.
    """

    def __init__(self, path: str, compression: str = "none", file: Optional[BinaryIO] = None):
        if compression not in ("none", "gzip"):
            raise ValueError(f"compression={compression!r}: 'none' or 'gzip'")
        self.path = path
        self.num_records = 0
        if file is not None:
            self._file = file
        elif _is_local(path):
            self._file: BinaryIO = open(path, "wb")
        else:
            import tensorflow as tf
            self._file = tf.io.gfile.GFile(path, "wb")
        self._zip: Optional["zlib._Compress"] = (
            zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, 31) if compression == "gzip" else None)

    def write(self, framed: bytes, num_records: int) -> None:
        """Appends framed records (bytes from `frame` / `frame_records`)."""
        self.num_records += num_records
        self._file.write(self._zip.compress(framed) if self._zip else framed)

    def close(self) -> None:
        if self._zip is not None:
            self._file.write(self._zip.flush())
            self._zip = None
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def makedirs(path: str) -> None:
    if _is_local(path):
        os.makedirs(path, exist_ok=True)
    else:
        import tensorflow as tf
        tf.io.gfile.makedirs(path)
