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

Before any tensor is read or output allocated, :func:`check_dcp_layout` checks every model tensor entry: a dtype a
safetensors file can hold; chunks inside the tensor that do not overlap (:func:`check_chunk_tiling`; :mod:`.plan`
then counts each output's coverage, so a hole fails there); a record per chunk and a chunk per record, each in a
plain, regular file of ``weights/``, holding at least the chunk's bytes, sharing none with another record and with no
storage transform. So a plan allocates at most the bytes the checkpoint holds. Imports the standard library, torch
and the engine only.
"""

import math
import os
import re
import stat
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Set, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from nemo_patch.engine.errors import CorruptShardError, UnknownLayoutError
from nemo_patch.engine.safe_files import UnsafeFileError

__all__ = [
    "SAFETENSORS_DTYPES",
    "check_chunk_tiling",
    "check_dcp_layout",
    "check_no_missing_layer",
    "check_shard_name",
    "resolve_inside",
    "shard_file",
]

#: The dtypes a model weight may have (a safetensors file's name of each): any other (``qint8``, ``bits8``, ``uint1``,
#: ``quint4x2``, complex, ...) has no safetensors encoding and is refused when the layout is checked.
SAFETENSORS_DTYPES = {
    getattr(torch, name): code
    for name, code in zip(
        "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 bool float8_e4m3fn float8_e5m2".split(),
        "F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3 F8_E5M2".split(),
    )
}


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


def _overlapping(key: str, a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> CorruptShardError:
    why = "refusing a layout in which a part of the tensor is stored twice or not at all"
    return CorruptShardError(f"{key}: chunks {_describe(a)} and {_describe(b)} overlap; {why}")


#: Steps every tiling proof may take beyond its O(n log n) budget: a few milliseconds, enough to prove any layout of a
#: few dozen chunks however entangled (a spiral of 40 strips, each cut peeling one, takes about 8,500).
_SPARE_STEPS = 1 << 14


def _cut(group: List[ChunkStorageMetadata], dim: int) -> List[List[ChunkStorageMetadata]]:
    """``group`` cut along ``dim`` where no chunk crosses: runs of chunks whose intervals there chain-overlap."""
    ordered = sorted(group, key=lambda chunk: chunk.offsets[dim])
    parts, end = [[ordered[0]]], ordered[0].offsets[dim] + ordered[0].sizes[dim]
    for chunk in ordered[1:]:
        if chunk.offsets[dim] >= end:
            parts.append([])
        parts[-1].append(chunk)
        end = max(end, chunk.offsets[dim] + chunk.sizes[dim])
    return parts


def check_chunk_tiling(key: str, size: Sequence[int], chunks: Sequence[ChunkStorageMetadata]) -> int:
    """Check that ``chunks`` lie inside a tensor of ``size`` and that no two of them overlap.

    Chunks of no element overlap nothing (two at one offset still share a storage record, and are refused). The others
    are cut apart along any dimension in which a straight cut crosses no chunk (the grid that tensor, pipeline and
    expert parallelism make), and the groups checked each on its own; only chunks no cut separates are compared pair
    by pair, along the dimension with the most distinct offsets. A layout that would take more than about
    ``8 * n * log2(n) * dims`` steps for ``n`` chunks (plus :data:`_SPARE_STEPS`) is refused, so the proof takes
    O(n log n) time whatever the metadata says.

    Args:
        key: the tensor's key (for messages).
        size: its global shape.
        chunks: its stored chunks.

    Returns:
        The steps the proof took (chunks visited and pairs compared).

    Raises:
        CorruptShardError: naming ``key`` and the first chunk that sticks out of the tensor, or a pair that overlaps
            (a repeated chunk included).
        UnknownLayoutError: naming ``key``: chunks whose proof would take more steps than that.
    """
    offsets: Set[Tuple[int, ...]] = set()
    for chunk in chunks:
        if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size):
            raise CorruptShardError(f"{key}: chunk {_describe(chunk)} does not have the tensor's {len(size)} dims")
        if any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, size)):
            raise CorruptShardError(f"{key}: chunk {_describe(chunk)} lies outside the tensor's size {list(size)}")
        if tuple(chunk.offsets) in offsets:
            raise _overlapping(key, chunk, next(c for c in chunks if tuple(c.offsets) == tuple(chunk.offsets)))
        offsets.add(tuple(chunk.offsets))
    if len(chunks) > 1 and not size:
        raise CorruptShardError(f"{key}: a scalar stored as {len(chunks)} chunks")
    boxes = [chunk for chunk in chunks if all(n > 0 for n in chunk.sizes)]
    budget = 8 * len(boxes) * (len(boxes).bit_length() + 1) * max(1, len(size)) + _SPARE_STEPS
    pending: List[Tuple[List[ChunkStorageMetadata], Tuple[int, ...]]] = [(boxes, tuple(range(len(size))))]
    steps = 0
    while pending and steps <= budget:
        group, dims = pending.pop()
        steps += len(group) * (len(dims) + 1)
        if len(group) < 2:
            continue
        dims = tuple(d for d in dims if len({(c.offsets[d], c.sizes[d]) for c in group}) > 1)
        if not dims:  # the same interval in every dimension
            raise _overlapping(key, group[0], group[1])
        for dim in dims:  # a cut costs a sort of the group
            steps, parts = steps + len(group) * len(group).bit_length(), _cut(group, dim)
            if len(parts) > 1:
                break
        if len(parts) > 1:
            pending.extend((part, dims) for part in parts)
            continue
        axis = max(dims, key=lambda dim: len({chunk.offsets[dim] for chunk in group}))
        ordered = sorted(group, key=lambda chunk: chunk.offsets[axis])
        for position, chunk in enumerate(ordered):
            end = chunk.offsets[axis] + chunk.sizes[axis]
            for other in ordered[position + 1 :]:
                if other.offsets[axis] >= end:
                    break
                steps += 1
                if steps > budget:
                    break
                if _overlap(chunk, other):
                    raise _overlapping(key, chunk, other)
            if steps > budget:
                break
    if steps > budget:
        raise UnknownLayoutError(
            f"{key}: proving that its {len(boxes)} chunks do not overlap would take more than {budget} steps (they "
            "are not a grid that a few rounds of straight cuts take apart); refusing a layout no distributed "
            "checkpoint writes"
        )
    return steps


def check_shard_name(name: str) -> None:
    """Check that a storage record's ``relative_path`` is a plain file name of ``weights/``.

    Raises:
        CorruptShardError: it is empty, absolute, has more than one path component, or is ``.``/``..``.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        raise CorruptShardError(f"the metadata names the shard file {name!r}: not a plain file name in weights/")


def shard_file(weights_dir: Path, name: str) -> Tuple[Path, os.stat_result]:
    """The resolved path and status of the shard file a storage record names.

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
    return path, status


def check_dcp_layout(weights_dir: Path, metadata: Metadata, keys: Iterable[str]) -> Dict[str, Tuple[Path, int]]:
    """Check the dtype, the tiling and the storage of every chunk of ``keys`` (see the module docstring). Records are
    compared by the identity of their files (device and inode, links resolved), not by their names.

    Args:
        weights_dir: the DCP directory.
        metadata: its validated metadata (:func:`.metadata_checks.validate_metadata`).
        keys: the tensor entries that will be read.

    Returns:
        Each shard file the chunks' records name -> ``(its resolved path, its size in bytes)``
        (:func:`shard_file`), for the reader to open files by their checked paths only.

    Raises:
        CorruptShardError: naming the tensor and the first bad chunk or record, or the file; a dtype that no
            safetensors file can hold (:data:`SAFETENSORS_DTYPES`).
        UnknownLayoutError: chunks too many and too entangled to prove that they do not overlap
            (:func:`check_chunk_tiling`).
    """
    files: Dict[str, Tuple[Path, os.stat_result]] = {}
    storage = metadata.storage_data or {}
    wanted = dict.fromkeys(keys)
    extents: List[Tuple[Tuple[int, int], int, int, str, str]] = []
    records: Dict[str, List[Tuple[int, ...]]] = {}
    for index in storage:
        if index.fqn in wanted:
            records.setdefault(index.fqn, []).append(tuple(index.offset or ()))
    for key in wanted:
        item = metadata.state_dict_metadata[key]
        if not isinstance(item, TensorStorageMetadata):
            continue
        if item.properties.dtype not in SAFETENSORS_DTYPES:
            raise CorruptShardError(
                f"{key}: dtype {item.properties.dtype} has no safetensors encoding (a model's weights are one of "
                f"{', '.join(sorted(str(dtype).removeprefix('torch.') for dtype in SAFETENSORS_DTYPES))})"
            )
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
            status = files[info.relative_path][1]
            needed = math.prod(chunk.sizes) * element
            if info.offset + info.length > status.st_size:
                raise CorruptShardError(
                    f"{key}: chunk {_describe(chunk)}: its record ends at byte {info.offset + info.length} of "
                    f"{info.relative_path}, which has {status.st_size} bytes (truncated)"
                )
            if info.length < needed:
                raise CorruptShardError(
                    f"{key}: chunk {_describe(chunk)} declares {needed} bytes of data; its record in "
                    f"{info.relative_path} has {info.length}"
                )
            extents.append(((status.st_dev, status.st_ino), info.offset, info.length, key, info.relative_path))
    extents.sort()
    for (file, offset, length, key, name), (other_file, other_offset, _, other_key, other_name) in zip(
        extents, extents[1:]
    ):
        if file == other_file and offset + length > other_offset:
            also = "" if name == other_name else f" ({other_name}, the same file as {name}: a link)"
            raise CorruptShardError(
                f"{other_key}: its record at byte {other_offset} of {other_name} overlaps the record of {key} at "
                f"byte {offset} of {name}{also}; each record holds its own bytes"
            )
    return {name: (path, status.st_size) for name, (path, status) in files.items()}


_STACK = re.compile(r"^module\.(?P<head>(?:.*\.)?layers)\.[^0-9]")


def check_no_missing_layer(metadata: Metadata, keys: Iterable[str]) -> None:
    """Refuse a layer index that no entry of its layer stack holds, below the smallest layer count the stack's entries
    declare (``decoder.layers``, ``mtp.layers``): a hole in the metadata, not a layer of another kind (a dense layer
    among MoE layers is held by another entry), which would otherwise give a smaller model. The layers held are
    merged as intervals (time O(n log n) in the chunks, whatever layer counts they declare).

    Raises:
        CorruptShardError: naming the stack's first missing layer and an entry that declares it, or a module's entry.
    """
    stacks: Dict[str, List[Tuple[int, str, List[Tuple[int, int]]]]] = {}
    for key in keys:
        item, match = metadata.state_dict_metadata[key], _STACK.match(key)
        if match is None or not isinstance(item, TensorStorageMetadata) or not item.size:
            continue
        held = [(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]) for chunk in item.chunks if chunk.sizes[0]]
        stacks.setdefault(match.group("head"), []).append((item.size[0], key, held))
    for head, entries in stacks.items():
        modules: Dict[str, Tuple[str, List[Tuple[int, int]]]] = {}
        for _, key, held in entries:  # a module's entries hold the same layers: one dropped from one is a hole too
            if modules.setdefault(key.rsplit(".", 1)[0], (key, sorted(set(held))))[1] != sorted(set(held)):
                raise CorruptShardError(f"{key}: holds other layers than an entry of the same module: a hole")
        layers, key, _ = min(entries)
        missing = 0
        for start, end in sorted(interval for entry in entries for interval in entry[2]):
            if start > missing:
                break
            missing = max(missing, end)
        if missing < layers:
            raise CorruptShardError(
                f"{key}[{missing}]: no stored chunk of any of the {len(entries)} {head}.* entries holds layer "
                f"{missing} of the {layers} they declare; the metadata leaves a hole, refusing an output without "
                f"layer {missing}"
            )
