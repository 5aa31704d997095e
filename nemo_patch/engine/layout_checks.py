# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.


"""Prove, from a ``torch_dist`` checkpoint's metadata and file sizes alone, that reading it fills every output byte.

Before any tensor is read or any output is allocated, :func:`check_dcp_layout` checks every model tensor entry
(``module.*``) of the DCP metadata:

* **tiling**: each chunk lies inside the tensor's declared size, no two chunks overlap, and no chunk repeats; the
  coverage of each output tensor is then counted exactly by :mod:`.plan` (a hole fails there, naming
  the tensor). With overlapping or out-of-bounds chunks, adding up volumes would hide a hole, and the output would hold
  whatever memory the hole had;
* **storage**: each chunk has its storage record (``storage_data[MetadataIndex(key, offsets)]``), and each stored
  record of the key has its chunk (a chunk taken out of the metadata would otherwise silently drop a layer: a layer no
  chunk covers has no output, as for the layers of another kind in a heterogeneous or MoE model); the record names a
  plain file of ``weights/`` (one path component, no ``..``, not absolute), which resolves inside ``weights/``
  (symlinks followed) and is a regular file; the record lies inside that file, holds at least the chunk's bytes
  (``torch.save`` stores tensor data uncompressed), shares no byte with another record, and carries no storage
  transform (compression: megatron-core never writes it, and its output size could not be bounded). So the bytes a
  plan allocates are bounded by the bytes the checkpoint holds (a record's members must be uncompressed too:
  :mod:`.dcp_reader`).

What each stored record actually holds (its dtype and shape) is checked when it is read
(:class:`.dcp_reader.DCPRegionReader`).

Imports the standard library, torch and the engine's errors and safe file access only; never NeMo, Lightning or
megatron-core.
"""

import math
import os
import re
import stat
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Tuple, Union

from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from nemo_patch.engine.errors import CorruptShardError
from nemo_patch.engine.safe_files import UnsafeFileError

__all__ = [
    "check_chunk_tiling",
    "check_dcp_layout",
    "check_no_missing_layer",
    "check_shard_name",
    "resolve_inside",
    "shard_file",
]


def resolve_inside(directory: Union[str, Path], name: Union[str, Path]) -> Path:
    """``directory / name`` with every symlink resolved, checked to lie inside ``directory`` (itself resolved).

    Args:
        directory: the directory the file must be in (e.g. a checkpoint's ``weights/``).
        name: a relative name read from the checkpoint.

    Returns:
        The resolved path.

    Raises:
        UnsafeFileError: ``name`` is absolute, or it (or a symlink on its way) leads outside ``directory``.
    """
    base = Path(directory).resolve()
    if Path(name).is_absolute():
        raise UnsafeFileError(f"{name}: an absolute path where a file inside {base} is expected")
    path = (base / name).resolve()
    if path != base and base not in path.parents:
        raise UnsafeFileError(f"{Path(directory) / name} leads outside {base} (to {path})")
    return path


def _describe(chunk: ChunkStorageMetadata) -> str:
    return f"offsets {list(chunk.offsets)} sizes {list(chunk.sizes)}"


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    ) and all(n > 0 for n in (*a.sizes, *b.sizes))


def check_chunk_tiling(key: str, size: Sequence[int], chunks: Sequence[ChunkStorageMetadata]) -> None:
    """Check that ``chunks`` lie inside a tensor of ``size`` and that no two of them overlap.

    Overlap is found with a sweep along the dimension with the most distinct chunk offsets: chunks are sorted by their
    start there, and each is compared only with those whose interval along that dimension it meets.

    Args:
        key: the tensor's key (for messages).
        size: its global shape.
        chunks: its stored chunks.

    Raises:
        CorruptShardError: naming ``key`` and the first chunk that sticks out of the tensor, or the first pair that
            overlaps (a repeated chunk included).
    """
    for chunk in chunks:
        if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size):
            raise CorruptShardError(f"{key}: chunk {_describe(chunk)} does not have the tensor's {len(size)} dims")
        if any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, size)):
            raise CorruptShardError(f"{key}: chunk {_describe(chunk)} lies outside the tensor's size {list(size)}")
    if len(chunks) < 2 or not size:
        if len(chunks) > 1:
            raise CorruptShardError(f"{key}: a scalar stored as {len(chunks)} chunks")
        return
    axis = max(range(len(size)), key=lambda dim: len({chunk.offsets[dim] for chunk in chunks}))
    ordered = sorted(chunks, key=lambda chunk: (chunk.offsets[axis], tuple(chunk.offsets)))
    for position, chunk in enumerate(ordered):
        end = chunk.offsets[axis] + chunk.sizes[axis]
        for other in ordered[position + 1 :]:
            if other.offsets[axis] >= end:
                break
            if _overlap(chunk, other) or tuple(chunk.offsets) == tuple(other.offsets):
                raise CorruptShardError(
                    f"{key}: chunks {_describe(chunk)} and {_describe(other)} overlap; refusing a layout in which "
                    "a part of the tensor is stored twice or not at all"
                )


def check_shard_name(name: str) -> None:
    """Check that a storage record's ``relative_path`` is a plain file name of ``weights/``.

    Raises:
        CorruptShardError: it is empty, absolute, has more than one path component, or is ``.``/``..``.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        raise CorruptShardError(f"the metadata names the shard file {name!r}: not a plain file name in weights/")


def shard_file(weights_dir: Path, name: str) -> Tuple[Path, int]:
    """The resolved path and size of the shard file a storage record names.

    Raises:
        CorruptShardError: a name that is not a plain file name, that leads outside ``weights_dir``, that is missing,
            or that is not a regular file (a FIFO, device, directory); the message names it.
    """
    check_shard_name(name)
    try:
        path = resolve_inside(weights_dir, name)
        status = path.stat()
    except UnsafeFileError as error:
        raise CorruptShardError(f"shard file {name}: {error}") from None
    except OSError as error:
        raise CorruptShardError(f"shard file {Path(weights_dir) / name}: {error.strerror}") from None
    if not stat.S_ISREG(status.st_mode):
        raise CorruptShardError(f"shard file {Path(weights_dir) / name} is not a regular file")
    return path, status.st_size


def check_dcp_layout(weights_dir: Path, metadata: Metadata, keys: Iterable[str]) -> Dict[str, Tuple[Path, int]]:
    """Check the tiling and the storage of every chunk of ``keys`` (see the module docstring).

    Args:
        weights_dir: the DCP directory.
        metadata: its validated metadata (:func:`.metadata_checks.validate_metadata`).
        keys: the tensor entries that will be read.

    Returns:
        Each shard file the chunks' records name -> ``(its resolved path, its size in bytes)``
        (:func:`shard_file`), for the reader to open files by their checked paths only.

    Raises:
        CorruptShardError: naming the tensor and the first bad chunk or record, or the file.
    """
    files: Dict[str, Tuple[Path, int]] = {}
    storage = metadata.storage_data or {}
    wanted = set(keys)
    extents: List[Tuple[str, int, int, str]] = []
    records: Dict[str, List[Tuple[int, ...]]] = {}
    for index in storage:
        if index.fqn in wanted:
            records.setdefault(index.fqn, []).append(tuple(index.offset or ()))
    for key in wanted:
        item = metadata.state_dict_metadata[key]
        if not isinstance(item, TensorStorageMetadata):
            continue
        check_chunk_tiling(key, item.size, item.chunks)
        orphans = set(records.get(key, ())) - {tuple(chunk.offsets) for chunk in item.chunks}
        if orphans:
            raise CorruptShardError(
                f"{key}: a stored record at offsets {list(min(orphans))} belongs to no chunk of the metadata (a chunk "
                "was removed from it); refusing an output with that part left out"
            )
        element = item.properties.dtype.itemsize
        for chunk in item.chunks:
            info = storage.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise CorruptShardError(f"{key}: chunk {_describe(chunk)} has no storage record in the metadata")
            if getattr(info, "transform_descriptors", None):
                raise CorruptShardError(
                    f"{key}: chunk {_describe(chunk)} is stored with transforms {list(info.transform_descriptors)} "
                    "(compression); megatron-core writes none, and their size cannot be checked"
                )
            if info.relative_path not in files:
                files[info.relative_path] = shard_file(weights_dir, info.relative_path)
            _, file_size = files[info.relative_path]
            needed = math.prod(chunk.sizes) * element
            if info.offset + info.length > file_size:
                raise CorruptShardError(
                    f"{key}: chunk {_describe(chunk)}: its record ends at byte {info.offset + info.length} of "
                    f"{info.relative_path}, which has {file_size} bytes (truncated)"
                )
            if info.length < needed:
                raise CorruptShardError(
                    f"{key}: chunk {_describe(chunk)} declares {needed} bytes of data; its record in "
                    f"{info.relative_path} has {info.length}"
                )
            extents.append((info.relative_path, info.offset, info.length, key))
    extents.sort()
    for (name, offset, length, key), (other_name, other_offset, _, other_key) in zip(extents, extents[1:]):
        if name == other_name and offset + length > other_offset:
            raise CorruptShardError(
                f"{other_key}: its record at byte {other_offset} of {name} overlaps the record of {key} at byte "
                f"{offset}; each record holds its own bytes"
            )
    return files


_STACK = re.compile(r"^module\.(?P<head>(?:.*\.)?layers)\.[^0-9]")


def check_no_missing_layer(metadata: Metadata, keys: Iterable[str]) -> None:
    """Refuse a layer index that no entry of its layer stack holds, below the smallest layer count the stack's entries
    declare (``decoder.layers``, ``mtp.layers``): a hole in the metadata, not a layer of another kind (a dense layer
    among MoE layers is held by another entry), which would otherwise give a smaller model.

    Raises:
        CorruptShardError: naming the stack's first missing layer and an entry that declares it.
    """
    stacks: Dict[str, List[Tuple[int, str, set]]] = {}
    for key in keys:
        item, match = metadata.state_dict_metadata[key], _STACK.match(key)
        if match is None or not isinstance(item, TensorStorageMetadata) or not item.size:
            continue
        held = {layer for chunk in item.chunks for layer in range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])}
        stacks.setdefault(match.group("head"), []).append((item.size[0], key, held))
    for head, entries in stacks.items():
        layers, key, _ = min(entries)
        covered = set().union(*(entry[2] for entry in entries))
        missing = next(layer for layer in range(len(covered) + 1) if layer not in covered)
        if missing < layers:
            raise CorruptShardError(
                f"{key}[{missing}]: no stored chunk of any of the {len(entries)} {head}.* entries holds layer "
                f"{missing} of the {layers} they declare; the metadata leaves a hole, refusing an output without "
                f"layer {missing}"
            )
