"""DCP storage for checkpoints: raw tensor bytes, JSON metadata, a CRC-32 per record.

``torch.distributed.checkpoint`` splits its work in two: planners decide
what each rank writes and which saved chunks each rank reads (resharding,
replica de-duplication: ``chunks`` and DCP's default planners do that), and a
``StorageWriter``/``StorageReader`` moves the bytes. This is our storage
layer, written by hand because DCP's ``FileSystemWriter``/``Reader`` cannot
give three things we need:

- no deserializer on load: they ``pickle`` the metadata (``.metadata``,
  read back with ``pickle.load``, which runs whatever a tampered file says)
  and ``torch.save`` each chunk as a zip record that must be parsed again.
  Here a record is the chunk's bytes, C-contiguous, native byte order, and
  ``metadata.json`` says what they are (dtype, global shape, each chunk's box,
  file, offset, length): loading reads bytes and JSON, nothing else;
- checksums from memory: the CRC-32 of each record is computed from the
  tensor's memory as it is written (their format would have to be read back
  from disk), and checked on load against the bytes just read, so a rank
  checks exactly the records it reads (see ``manifest`` for why CRC-32);
- speed: a ``torch.save`` per chunk through a Python stream costs several
  times a plain write (measured with ``scripts/bench_checkpoint.py``).

One file per rank, ``__<rank>_0.distcp``, its records back to back (so the
records' checksums cover every byte), fsynced before the rank reports done.

Fault injection (tests only): ``SBP_CKPT_PAUSE_IN_WRITE="<rank>:<marker>"``
makes that rank, after writing its data file but before the checkpoint is
complete, write its pid to the file ``<marker>`` and sleep, so a test can
kill it mid-save.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _dist, manifest
from .errors import CheckpointError

METADATA_NAME = "metadata.json"
FORMAT = "raw-records/1"
CHECKSUM = manifest.ALGORITHM
PAUSE_ENV = "SBP_CKPT_PAUSE_IN_WRITE"
_BYTEORDER = sys.byteorder


@dataclasses.dataclass(frozen=True)
class Record:
    """Where one saved chunk's bytes are, and their CRC-32 (hex)."""

    file: str
    offset: int
    length: int
    crc32: str


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r}")
    return dtype


def encode_metadata(state_md: dict, storage_md: dict) -> dict:
    """JSON form of DCP's metadata: per tensor its dtype, global size and chunks (box + record)."""
    tensors, sizes = {}, {}
    for fqn, md in state_md.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{fqn}: only tensors go to tensor storage (other values go to state.json)")
        tensors[fqn] = {"dtype": _dtype_name(md.properties.dtype), "size": list(md.size), "chunks": []}
        sizes[fqn] = {tuple(c.offsets): list(c.sizes) for c in md.chunks}
    for index, rec in storage_md.items():
        tensors[index.fqn]["chunks"].append({
            "offsets": list(index.offset), "sizes": sizes[index.fqn][tuple(index.offset)],
            "file": rec.file, "offset": rec.offset, "length": rec.length, CHECKSUM: rec.crc32})
    for entry in tensors.values():
        entry["chunks"].sort(key=lambda c: c["offsets"])
    return {"format": FORMAT, "byteorder": _BYTEORDER, "tensors": tensors}


def decode_metadata(doc: dict, where: str) -> Metadata:
    """DCP's ``Metadata`` (``storage_data``: chunk index -> :class:`Record`) from :func:`encode_metadata`'s JSON."""
    if doc.get("format") != FORMAT or doc.get("byteorder") != _BYTEORDER:
        raise CheckpointError(f"{where}: format {doc.get('format')!r} ({doc.get('byteorder')}-endian); this reader "
                              f"knows {FORMAT!r} ({_BYTEORDER}-endian)")
    state_md, storage_md = {}, {}
    try:
        for fqn, entry in doc["tensors"].items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                      for c in entry["chunks"]]
            state_md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_dtype(entry["dtype"], where)),
                size=torch.Size(entry["size"]), chunks=chunks)
            for c in entry["chunks"]:
                storage_md[MetadataIndex(fqn, c["offsets"])] = Record(c["file"], int(c["offset"]), int(c["length"]),
                                                                      c[CHECKSUM])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: malformed metadata ({type(exc).__name__}: {exc})") from None
    return Metadata(state_dict_metadata=state_md, storage_data=storage_md, storage_meta=StorageMeta())



def add_alias(md: Metadata, alias: str, target: str) -> None:
    """Let DCP read tensor ``target``'s chunks under the name ``alias`` (a tied parameter's other name)."""
    md.state_dict_metadata[alias] = md.state_dict_metadata[target]
    for c in md.state_dict_metadata[target].chunks:
        md.storage_data[MetadataIndex(alias, c.offsets)] = md.storage_data[MetadataIndex(target, c.offsets)]


def _pause_for_tests() -> None:
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    who, _, marker = spec.partition(":")
    if int(who) == _dist.rank():
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)


def _as_bytes(t: torch.Tensor):
    """A zero-copy byte view of a tensor's memory (C-contiguous, on the CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


class Writer(StorageWriter):
    """Each rank writes its records to one file, checksummed from memory and fsynced; rank 0 the metadata."""

    def __init__(self, path: str):
        super().__init__()
        self.path = str(path)
        self.digests: dict = {}
        self.metadata_digest: dict | None = None

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = str(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return [dataclasses.replace(p, storage_data=f"__{i}_0.distcp") for i, p in enumerate(plans)]

    def write_data(self, plan, planner) -> Future:
        name = plan.storage_data
        results, pos = [], 0
        with open(os.path.join(self.path, name), "wb") as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise CheckpointError(f"{item.index.fqn}: not a tensor; plain values are saved in state.json")
                data = _as_bytes(planner.resolve_data(item))
                f.write(data)
                results.append(WriteResult(index=item.index, size_in_bytes=len(data),
                                           storage_data=Record(name, pos, len(data),
                                                               manifest.hex_checksum(manifest.checksum(data)))))
                pos += len(data)
            f.flush()
            os.fsync(f.fileno())
        self.digests[name] = {"bytes": pos, "records": len(results)}
        _pause_for_tests()
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list) -> None:
        storage_md = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}
        path = os.path.join(self.path, METADATA_NAME)
        manifest.write_json_durably(path, encode_metadata(metadata.state_dict_metadata, storage_md))
        self.metadata_digest = manifest.file_digest(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def _read_record(f, path: str, rec: Record, buf=None):
    """A record's bytes (into ``buf`` if given: a writable buffer of its length), after checking
    their length and CRC-32."""
    f.seek(rec.offset)
    buf = bytearray(rec.length) if buf is None else buf
    got = f.readinto(buf)
    if got != rec.length:
        raise CheckpointError(f"{path}: the record at byte {rec.offset} is cut short ({got} of {rec.length} "
                              "bytes): truncated")
    crc = manifest.hex_checksum(manifest.checksum(buf))
    if crc != rec.crc32:
        raise CheckpointError(f"{path}: checksum mismatch in the record at byte {rec.offset} (corrupted: "
                              f"crc32 {crc}, {METADATA_NAME} records {rec.crc32})")
    return buf


def _is_whole_record(target: torch.Tensor, item, dtype, sizes) -> bool:
    return (target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
            and tuple(target.shape) == tuple(sizes) and not any(item.storage_offsets))


class Reader(StorageReader):
    """Reads the records a rank's load plan names, checking each one's CRC-32 before using its bytes."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__()
        self.path = str(path)
        self.metadata = metadata

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = str(checkpoint_id)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: no per-rank metadata in this format")
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return plans

    def _chunk(self, index: MetadataIndex) -> tuple:
        md = self.metadata.state_dict_metadata[index.fqn]
        for c in md.chunks:
            if c.offsets == index.offset:
                return md.properties.dtype, c.sizes
        raise CheckpointError(f"{self.path}: {index.fqn} has no chunk at {list(index.offset)}")

    def read_data(self, plan, planner) -> Future:
        by_file: dict = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"{item.storage_index.fqn}: this format stores no pickled objects")
            rec = self.metadata.storage_data[item.storage_index]
            by_file.setdefault(rec.file, []).append((rec, item))
        for name, reads in sorted(by_file.items()):
            path = os.path.join(self.path, name)
            cache: dict = {}  # one record may feed several reads (a box split across template chunks)
            with open(path, "rb") as f:
                for rec, item in sorted(reads, key=lambda r: r[0].offset):
                    dtype, sizes = self._chunk(item.storage_index)
                    if rec.offset not in cache:
                        target = planner.resolve_tensor(item).detach()
                        if rec.length and _is_whole_record(target, item, dtype, sizes):
                            # Loading into the layout it was saved in: the bytes go straight to their place.
                            _read_record(f, path, rec, target.view(-1).view(torch.uint8).numpy().data)
                            planner.commit_tensor(item, target)
                            cache = {rec.offset: target}
                            continue
                        buf = _read_record(f, path, rec)
                        cache = {rec.offset: (torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(sizes)
                                              if rec.length else torch.empty(sizes, dtype=dtype))}
                    src = cache[rec.offset]
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        src = src.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.shape != src.shape:
                        raise CheckpointError(f"{path}: {item.storage_index.fqn} read {list(src.shape)} for a "
                                              f"destination of {list(target.shape)}")
                    target.copy_(src)
                    planner.commit_tensor(item, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def verify_records(ckpt_dir: str, md: Metadata, body: dict) -> None:
    """Check every record of every data file, and that the records tile each file (``verify``)."""
    by_file: dict = {}
    for rec in md.storage_data.values():
        by_file.setdefault(rec.file, {})[rec.offset] = rec  # aliases share records
    for name, entry in sorted(body["files"].items()):
        if not name.endswith(".distcp"):
            continue
        path = os.path.join(ckpt_dir, name)
        pos = 0
        with open(path, "rb") as f:
            for offset, rec in sorted(by_file.get(name, {}).items()):
                if offset != pos:
                    raise CheckpointError(f"{path}: bytes {pos}..{offset} belong to no record")
                pos += len(_read_record(f, path, rec))
        if pos != entry["bytes"]:
            raise CheckpointError(f"{path}: records cover {pos} of its {entry['bytes']} bytes")
