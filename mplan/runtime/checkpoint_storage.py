"""Where DCP puts a checkpoint's bytes, with its metadata as validated JSON instead of a pickle.

Input: a directory. Output: `JsonMetadataWriter` / `JsonMetadataReader`, torch's
`FileSystemWriter` / `FileSystemReader` (one `.distcp` file per rank, each tensor item written
with `torch.save` and read back with `torch.load(weights_only=True)`) except for the global
metadata: torch pickles it into `.metadata` and unpickles it on load, which mplan never does
(DESIGN.md). Here it is `dcp.json`: every tensor's dtype, global size and saved chunks, and where
each chunk's bytes lie (file, start, length). `read_dcp_metadata` validates it field by field
and `check_data_files` that every file it names exists, is a plain name inside the directory,
and is long enough for its items (a truncated file is named before any rank reads it).

Checksums: torch.load does not check the CRC-32 its zip records carry, so bytes flipped inside a
tensor would load silently. Each rank therefore takes the CRC-32 of every item it wrote (read back
from the page cache, right after writing) and `dcp.json` records it; `verify_items` checks the
items a rank is about to read before torch.load sees them (a second read of those bytes, from the
page cache after the first).

Invariants: only tensors are stored (no BytesIO items: they would be pickles); file names are
DCP's own (`__<rank>_<n>.distcp`); every tensor's chunks cover it exactly (no gap, no overlap:
a gap would leave elements of the loading model as they were); the metadata file is written last,
to a temporary name and renamed, so a directory holding `dcp.json` holds every byte it describes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import zlib
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from mplan.json_fields import FieldReader, load_json_file

METADATA_FILE = "dcp.json"
FORMAT = "mplan.dcp-metadata"
DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex64, torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")


class CheckpointError(ValueError):
    """A checkpoint that is missing, malformed, truncated or does not fit this model."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass
class _ChecksummedInfo(_StorageInfo):
    """Where an item lies, and the CRC-32 of its bytes."""

    crc32: int = 0


class JsonMetadataWriter(FileSystemWriter):
    """torch's file-system writer, finishing with `dcp.json` instead of a pickled `.metadata`, and
    recording each item's CRC-32."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        results: list[WriteResult] = super().write_data(plan, planner).wait()
        checked = []
        for wr in results:
            info = wr.storage_data
            with open(os.path.join(str(self.path), info.relative_path), "rb") as handle:
                handle.seek(info.offset)
                crc = zlib.crc32(handle.read(info.length))
            checked.append(dataclasses.replace(wr, storage_data=_ChecksummedInfo(
                relative_path=info.relative_path, offset=info.offset, length=info.length,
                transform_descriptors=info.transform_descriptors, crc32=crc)))
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(checked)
        return done

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        storage = [wr for ranks in results for wr in ranks]
        doc = {"format": FORMAT, "tensors": {}, "storage": []}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{fqn}: only tensors are checkpointed, not {type(md).__name__}")
            doc["tensors"][fqn] = {"dtype": dtype_name(md.properties.dtype), "size": list(md.size),
                                   "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}
        for wr in storage:
            info = wr.storage_data
            if info.transform_descriptors:
                raise CheckpointError(f"{wr.index.fqn}: stream transforms are not part of mplan's format")
            doc["storage"].append({"fqn": wr.index.fqn, "offset": list(wr.index.offset or ()),
                                   "file": info.relative_path, "start": info.offset, "length": info.length,
                                   "crc32": info.crc32})
        path = os.path.join(str(self.path), METADATA_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(doc, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(path + ".tmp", path)


class JsonMetadataReader(FileSystemReader):
    """torch's file-system reader, reading the validated `dcp.json`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_dcp_metadata(str(self.path))


def read_dcp_metadata(directory: str) -> Metadata:
    """The validated DCP metadata of a checkpoint directory (`CheckpointError` naming the field)."""
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (not an mplan checkpoint, or a save that did not finish)")
    r = FieldReader(load_json_file(path, CheckpointError), file=path, path="", error=CheckpointError)
    if r.string("format") != FORMAT:
        raise r.error("format", f"must be {FORMAT!r}")
    tensors: dict[str, Any] = {}
    listed = r.obj("tensors")
    for fqn in list(r.raw("tensors")):
        t = listed.obj(fqn)
        dtype = t.string("dtype", choices=sorted(DTYPES))
        size = _int_list(t.raw("size"), None, f"{path}: tensors.{fqn}.size")
        chunks = []
        for k, chunk in enumerate(t.raw("chunks") if isinstance(t.raw("chunks"), list) else [None]):
            if not (isinstance(chunk, list) and len(chunk) == 2):
                raise t.error(f"chunks[{k}]", "must be [offsets, sizes]")
            offsets, sizes = (_int_list(v, len(size), f"{path}: tensors.{fqn}.chunks[{k}]") for v in chunk)
            if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
                raise t.error(f"chunks[{k}]", f"lies outside the tensor's size {size}")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        t.finish()
        tensors[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=DTYPES[dtype]),
                                             size=torch.Size(size), chunks=chunks)
    storage = {}
    entries = r.raw("storage")
    if not isinstance(entries, list):
        raise r.error("storage", "must list where each chunk is stored")
    for k, entry in enumerate(entries):
        e = FieldReader(entry, file=path, path=f"storage[{k}]", error=CheckpointError)
        fqn, file = e.string("fqn"), e.string("file")
        if fqn not in tensors:
            raise e.error("fqn", f"names {fqn!r}, which tensors does not list")
        if not _DATA_FILE.fullmatch(file):
            raise e.error("file", "must be a DCP data file name (__<rank>_<n>.distcp)")
        offset = _int_list(e.raw("offset"), len(tensors[fqn].size), f"{path}: storage[{k}].offset")
        info = _ChecksummedInfo(relative_path=file, offset=e.integer("start", minimum=0),
                                length=e.integer("length", minimum=0), crc32=e.integer("crc32", minimum=0))
        if info.offset + info.length >= 1 << 63:
            raise e.error("length", "with start must lie within a file (under 2**63 bytes)")
        if info.crc32 >= 1 << 32:
            raise e.error("crc32", "must be a CRC-32 (under 2**32)")
        storage[MetadataIndex(fqn, offset)] = info
        e.finish()
    r.finish()
    for fqn, md in tensors.items():
        for chunk in md.chunks:
            index = MetadataIndex(fqn, chunk.offsets)
            if index not in storage:
                raise CheckpointError(f"{path}: chunk {list(chunk.offsets)} of {fqn} has no storage entry")
            need = math.prod(chunk.sizes) * md.properties.dtype.itemsize  # the raw bytes torch.save stores
            if need > storage[index].length:
                raise CheckpointError(f"{path}: chunk {list(chunk.offsets)} of {fqn} needs {need} bytes, its "
                                      f"storage entry holds {storage[index].length}")
        _check_cover(path, fqn, md)
    return Metadata(state_dict_metadata=tensors, storage_data=storage)


def _check_cover(path: str, fqn: str, md: TensorStorageMetadata) -> None:
    """The chunks of a tensor cover it exactly: their volumes add up to its own and no two overlap
    (pairs are compared only where their first-dimension ranges meet, after sorting by it)."""
    total = math.prod(md.size)
    if sum(math.prod(c.sizes) for c in md.chunks) != total:
        raise CheckpointError(f"{path}: the chunks of {fqn} hold {sum(math.prod(c.sizes) for c in md.chunks)} "
                              f"elements, the tensor {total}: they do not cover it exactly")
    if len(md.size) == 0:
        return
    ordered = sorted(md.chunks, key=lambda c: c.offsets[0])
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if all(bo < ao + az and ao < bo + bz for ao, az, bo, bz in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                raise CheckpointError(f"{path}: chunks {list(a.offsets)} and {list(b.offsets)} of {fqn} overlap")


def verify_items(directory: str, plan: LoadPlan, storage: dict[Any, Any]) -> None:
    """The CRC-32 of every item `plan` reads matches the one recorded when it was written."""
    by_file: dict[str, dict[Any, Any]] = {}
    for item in plan.items:  # several reads of one stored chunk (resharding) check it once
        info = storage[item.storage_index]
        by_file.setdefault(info.relative_path, {})[item.storage_index] = info
    for name, items in by_file.items():
        with open(os.path.join(directory, name), "rb") as handle:
            for index, info in items.items():
                handle.seek(info.offset)
                if zlib.crc32(handle.read(info.length)) != info.crc32:
                    raise CheckpointError(f"{os.path.join(directory, name)}: the bytes of {index.fqn} at "
                                          f"{list(index.offset or ())} changed after they were written "
                                          f"(checksum mismatch)")


def check_data_files(directory: str, metadata: Metadata) -> None:
    """Every data file the metadata names exists and holds its items' bytes (else one line naming it)."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(need.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (the checkpoint's metadata stores tensors in it)")
        size = os.path.getsize(path)
        if size < length:
            raise CheckpointError(f"{path}: truncated: {size} bytes, its items need {length}")


def _int_list(value: Any, n: int | None, where: str) -> list[int]:
    if not (isinstance(value, list) and (n is None or len(value) == n)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        count = "" if n is None else f"{n} "
        raise CheckpointError(f"{where}: must be a list of {count}non-negative integers, got {str(value)[:60]}")
    return value
