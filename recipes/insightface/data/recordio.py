"""MXNet's indexed RecordIO (``train.rec`` + ``train.idx``) and its image-record header, in pure Python.

The format (dmlc-core ``recordio``), which InsightFace's datasets use:

- a record is ``magic (u32 0xced7230a) | lrec (u32) | payload | zero padding
  to 4 bytes``, little-endian; ``lrec`` holds a continuation flag in its top
  3 bits and the payload length in the low 29;
- flag 0 is a whole record. A payload that contains the magic number at a
  4-byte-aligned offset is written in parts (flag 1 first, 2 middle, 3 last)
  split at those words, which are dropped and re-inserted between the parts
  on reading, so a reader resynchronising on the magic never stops inside a
  payload;
- the ``.idx`` file lists ``key<TAB>byte offset`` per line.

An image record's payload starts with the header ``IRHeader`` (``<IfQQ``:
``flag``, ``label``, ``id``, ``id2``; 24 bytes); ``flag > 0`` means ``flag``
float32 labels follow it (``label`` is then 0), else ``label`` is the label.
The image bytes (JPEG or PNG) come after.

Every error names the file, the record's key and its byte offset.
"""
from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_LENGTH_BITS = 29
_MAX_LENGTH = (1 << _LENGTH_BITS) - 1
WHOLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3
_HEADER = struct.Struct("<IfQQ")


class RecordIOError(ValueError):
    """A ``.rec``/``.idx`` file is corrupt, truncated or inconsistent."""


@dataclass(frozen=True)
class ImageHeader:
    flag: int
    label: object  # a float, or a tuple of floats when flag > 0
    id: int = 0
    id2: int = 0


def pack_image(label, image: bytes, id: int = 0, id2: int = 0) -> bytes:
    """An image record's payload: the header (a number or a sequence of labels), then ``image``."""
    if isinstance(label, (int, float)):
        return _HEADER.pack(0, float(label), id, id2) + image
    labels = tuple(float(v) for v in label)
    return _HEADER.pack(len(labels), 0.0, id, id2) + struct.pack(f"<{len(labels)}f", *labels) + image


def unpack_image(payload: bytes) -> tuple:
    """``(ImageHeader, image bytes)`` of an image record's payload; ``ValueError`` if it is too short."""
    if len(payload) < _HEADER.size:
        raise ValueError(f"an image record needs a {_HEADER.size}-byte header, this payload has {len(payload)} bytes")
    flag, label, id_, id2 = _HEADER.unpack_from(payload)
    rest = payload[_HEADER.size:]
    if flag > 0:
        if len(rest) < 4 * flag:
            raise ValueError(f"header flag {flag} announces {flag} labels but only {len(rest)} bytes follow")
        label = struct.unpack_from(f"<{flag}f", rest)
        rest = rest[4 * flag:]
    return ImageHeader(flag, label, id_, id2), rest


class RecordWriter:
    """Appends records to ``rec_path`` and their offsets to ``idx_path`` (``with RecordWriter(...) as w:``)."""

    def __init__(self, rec_path: str, idx_path: str):
        self.rec_path = rec_path
        self._rec = open(rec_path, "wb")
        self._idx = open(idx_path, "w")

    def write(self, key: int, payload: bytes) -> None:
        if len(payload) > _MAX_LENGTH:
            raise ValueError(f"a record holds at most {_MAX_LENGTH} bytes, got {len(payload)}")
        self._idx.write(f"{key}\t{self._rec.tell()}\n")
        start, aligned = 0, len(payload) // 4 * 4
        for i in range(0, aligned, 4):
            if payload[i:i + 4] == _MAGIC_BYTES:  # split here; the reader puts the word back
                self._part(FIRST if start == 0 else MIDDLE, payload[start:i])
                start = i + 4
        self._part(WHOLE if start == 0 else LAST, payload[start:])

    def _part(self, flag: int, data: bytes) -> None:
        self._rec.write(_MAGIC_BYTES + struct.pack("<I", (flag << _LENGTH_BITS) | len(data)) + data)
        self._rec.write(b"\0" * (-len(data) % 4))

    def close(self) -> None:
        self._rec.close()
        self._idx.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_index(idx_path: str) -> dict:
    """``{key: byte offset}`` from a ``.idx`` file."""
    offsets = {}
    with open(idx_path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split("\t")
            try:
                offsets[int(parts[0])] = int(parts[1])
            except (IndexError, ValueError):
                raise RecordIOError(f"{idx_path} line {line_no}: expected 'key<TAB>offset', got {line.rstrip()!r}") from None
    return offsets


class RecordReader:
    """Random access to the records of an indexed ``.rec`` file by key.

    Opens the file lazily per process and thread (again after a fork, and in
    each thread that reads: a handle's seek and read are not shared), so a
    reader can be handed to data-pipeline actors and read-ahead threads.
    """

    def __init__(self, rec_path: str, idx_path: str):
        for p in (rec_path, idx_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"RecordIO file {p} does not exist")
        self.rec_path, self.idx_path = rec_path, idx_path
        self.offsets = read_index(idx_path)
        self.size = os.path.getsize(rec_path)
        bad = [k for k, off in self.offsets.items() if not 0 <= off < self.size]
        if bad:
            raise RecordIOError(f"{idx_path}: record {bad[0]} points at byte {self.offsets[bad[0]]}, past the end of "
                                f"{rec_path} ({self.size} bytes)")
        self._files: dict = {}  # (process id, thread id) -> the file open there

    def __getstate__(self):
        return {**self.__dict__, "_files": {}}

    def keys(self) -> list:
        return sorted(self.offsets)

    def _handle(self):
        key = (os.getpid(), threading.get_ident())
        f = self._files.get(key)
        if f is None:
            f = self._files[key] = open(self.rec_path, "rb")
        return f

    def read(self, key: int) -> bytes:
        """The payload of record ``key``; ``RecordIOError`` naming the file, key and offset if it is bad."""
        if key not in self.offsets:
            raise KeyError(f"{self.idx_path} has no record {key}")
        f, offset = self._handle(), self.offsets[key]
        f.seek(offset)
        parts = []
        while True:
            head = f.read(8)
            where = f"{self.rec_path}: record {key} (byte {offset})"
            if len(head) < 8:
                raise RecordIOError(f"{where}: truncated, the file ends inside a record header")
            magic, lrec = struct.unpack("<II", head)
            if magic != MAGIC:
                raise RecordIOError(f"{where}: corrupt, expected the magic 0x{MAGIC:08x} at byte {f.tell() - 8}, "
                                    f"found 0x{magic:08x}")
            flag, length = lrec >> _LENGTH_BITS, lrec & _MAX_LENGTH
            if flag > LAST or (flag in (MIDDLE, LAST)) != bool(parts):
                raise RecordIOError(f"{where}: corrupt, continuation flag {flag} out of sequence")
            data = f.read(length + (-length % 4))
            if len(data) < length:
                raise RecordIOError(f"{where}: truncated, the record announces {length} bytes and the file holds "
                                    f"{len(data)}")
            parts.append(data[:length])
            if flag in (WHOLE, LAST):
                return _MAGIC_BYTES.join(parts)
