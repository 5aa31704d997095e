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

"""Read tensors, or layers of them, from a megatron-core ``zarr`` distributed checkpoint, checking every chunk file.

megatron-core's ``zarr`` strategy writes one Zarr v2 array per tensor into ``weights/``: ``<key>/.zarray`` (JSON) and
one file of raw bytes per chunk, ``<key>/<i>.<j>...``. Zarr stores no checksum, so the layout is checked: a
``.zarray`` this reader does not understand raises :class:`~.errors.UnsupportedFormatError`, and a chunk file a read
needs that is missing (zarr would return the fill value), of another size, a hard link to another chunk or reached
through a symbolic link raises :class:`~.errors.CorruptShardError` (``docs/security.md``). :func:`read_zarr_metadata`
describes the arrays as DCP ``Metadata``, so output planning is the same for both formats; :class:`ZarrRegionReader`
has the interface of :class:`.dcp_reader.DCPRegionReader`. Imports the standard library, torch and the engine only.
"""

import errno
import itertools
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from nemo_patch.engine.errors import CorruptShardError, UnsupportedFormatError
from nemo_patch.engine.safe_files import UnsafeFileError

__all__ = ["ZARR_DTYPES", "ZarrRegionReader", "read_zarr_metadata"]

#: ``.zarray`` dtype -> torch dtype: what megatron-core's zarr strategy writes (little-endian or byte-sized).
ZARR_DTYPES: Dict[str, torch.dtype] = {
    "|b1": torch.bool,
    "|u1": torch.uint8,
    "|i1": torch.int8,
    "<i2": torch.int16,
    "<i4": torch.int32,
    "<i8": torch.int64,
    "<f2": torch.float16,
    "<f4": torch.float32,
    "<f8": torch.float64,
    "bfloat16": torch.bfloat16,
}
_ARRAY_FILE = ".zarray"
#: Flags of the walk below ``weights/`` (0 where the platform has no such flag: the module still imports there).
_NOFOLLOW, _DIRECTORY, _CLOEXEC, _NONBLOCK = (
    getattr(os, flag, 0) for flag in ("O_NOFOLLOW", "O_DIRECTORY", "O_CLOEXEC", "O_NONBLOCK")
)
_MAX_ZARRAY_BYTES = 1 << 20


def _open_below(root: Path, parts: Tuple[str, ...]) -> int:
    """A file descriptor of ``root/parts[0]/.../parts[-1]``, each component opened relative to the one before it
    without following a symbolic link (the last one without blocking: a FIFO is refused later by ``fstat``); raises
    :class:`CorruptShardError` for a symbolic link (or not a directory where one is needed), else ``OSError``."""
    if os.open not in os.supports_dir_fd or not _NOFOLLOW:  # pragma: no cover - not Linux/macOS: check, then open
        for depth in range(1, len(parts) + 1):
            if os.path.islink(root.joinpath(*parts[:depth])):
                raise CorruptShardError(f"{root.joinpath(*parts[:depth])} is a symbolic link; refusing to read it")
        return os.open(root.joinpath(*parts), os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        for depth, part in enumerate(parts, 1):
            last = depth == len(parts)
            flags = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | (_NONBLOCK if last else _DIRECTORY)
            try:
                opened = os.open(part, flags, dir_fd=fd)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    where = root.joinpath(*parts[:depth])
                    kind = "a symbolic link" if os.path.islink(where) else "not a directory"
                    raise CorruptShardError(
                        f"{where} is {kind} (reading {root.joinpath(*parts)}); every path component of a chunk must "
                        "lie in weights/ itself: refusing to read it"
                    ) from None
                raise
            os.close(fd)
            fd = opened
        return fd
    except BaseException:
        os.close(fd)
        raise


def _chunk_inodes(array: "_Array", seen: Dict[Tuple[int, int], Path]) -> int:
    """The number of files in an array's directory, walked never following a link (:class:`CorruptShardError` for
    a symbolic link in it, or a chunk file that is the same file as another in ``seen``, which gets their inodes)."""
    count = 0
    for directory, dirs, files in os.walk(array.path, followlinks=False):
        for name in dirs + files:
            path = Path(directory) / name
            status = os.lstat(path)
            if stat.S_ISLNK(status.st_mode):
                raise CorruptShardError(f"{path} is a symbolic link in zarr array {array.key}; refusing to read it")
            if name in dirs:
                continue
            count += 1
            if name == _ARRAY_FILE or not stat.S_ISREG(status.st_mode):
                continue
            other = seen.setdefault((status.st_dev, status.st_ino), path)
            if other != path:
                raise CorruptShardError(
                    f"{path} is a hard link to the same file as {other} (zarr array {array.key}): each chunk holds "
                    "its own bytes; refusing to read it"
                )
    return count


@dataclass(frozen=True)
class _Array:
    key: str
    path: Path
    shape: Tuple[int, ...]
    chunks: Tuple[int, ...]
    dtype: torch.dtype
    separator: str

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def chunk_count(self) -> int:
        return math.prod(math.ceil(size / chunk) for size, chunk in zip(self.shape, self.chunks))

    def chunk_file(self, index: Tuple[int, ...]) -> Path:
        return self.path / (self.separator.join(str(i) for i in index) if index else "0")

    def chunk_indices(self, leading: Tuple[int, ...] = ()) -> List[Tuple[int, ...]]:
        """The chunk grid indices (all of them, or those covering ``[leading]`` along the leading dimensions)."""
        grids = [range(math.ceil(size / chunk)) for size, chunk in zip(self.shape, self.chunks)]
        for dim, position in enumerate(leading):
            grids[dim] = range(position // self.chunks[dim], position // self.chunks[dim] + 1)
        return list(itertools.product(*grids))


def _parse_array(key: str, path: Path, inodes: Optional[Dict[Tuple[int, int], Path]] = None) -> _Array:
    where = f"zarr array {key} ({path / _ARRAY_FILE})"
    try:
        if path.is_symlink():
            raise UnsafeFileError(f"{path} is a symlink; an array directory must lie in weights/ itself")
        with open(_open_below(path.parent, (path.name, _ARRAY_FILE)), "rb") as handle:  # never following a link
            status = os.fstat(handle.fileno())
            if not stat.S_ISREG(status.st_mode) or status.st_size > _MAX_ZARRAY_BYTES:
                raise UnsafeFileError(
                    f"{path / _ARRAY_FILE} is not a regular file of at most {_MAX_ZARRAY_BYTES} bytes"
                )
            meta = json.loads(handle.read(_MAX_ZARRAY_BYTES + 1))
        if not isinstance(meta, dict):
            raise ValueError(f"a {type(meta).__name__}, not a JSON object")
    except (OSError, ValueError, RecursionError) as error:
        raise CorruptShardError(f"Cannot read {where}: {type(error).__name__}: {error}") from error
    for field, value in {"zarr_format": 2, "compressor": None, "filters": None, "order": "C"}.items():
        if meta.get(field, None if field == "filters" else "missing") != value:
            raise UnsupportedFormatError(
                f"{where}: {field}={meta.get(field)!r} cannot be read safely (only megatron-core's layout: "
                "zarr_format 2, no compressor, no filters, C order)"
            )
    dtype = ZARR_DTYPES.get(str(meta.get("dtype")))
    if dtype is None:
        raise UnsupportedFormatError(f"{where}: dtype {meta.get('dtype')!r}; readable: {', '.join(ZARR_DTYPES)}")
    separator = meta.get("dimension_separator") or "."
    shape, chunks = tuple(meta.get("shape") or ()), tuple(meta.get("chunks") or ())
    if (
        separator not in (".", "/")
        or len(shape) != len(chunks)
        or not all(type(n) is int and n >= 0 for n in shape)
        or not all(type(n) is int and n >= 1 for n in chunks)
    ):
        raise UnsupportedFormatError(f"{where}: shape {shape}, chunks {chunks}, separator {separator!r}")
    array = _Array(key, path, shape, chunks, dtype, separator)
    try:
        files = _chunk_inodes(array, {} if inodes is None else inodes)
    except OSError as error:
        raise CorruptShardError(f"Cannot list {where}: {error}") from error
    if array.chunk_count > files:
        raise CorruptShardError(
            f"{where}: shape {list(shape)} in chunks of {list(chunks)} needs {array.chunk_count} chunk files; the "
            f"directory holds {files} files"
        )
    return array


def read_zarr_metadata(weights_dir: Path) -> Metadata:
    """Describe the arrays of a zarr checkpoint as ``torch.distributed.checkpoint`` ``Metadata``.

    Args:
        weights_dir: the checkpoint's ``weights/`` directory (``metadata.json`` says ``"sharded_backend": "zarr"``).

    Returns:
        ``Metadata`` whose ``state_dict_metadata`` maps each array's key (its directory name) to its global shape,
        dtype and chunks; no ``storage_data``.

    Raises:
        UnsupportedFormatError: an array's ``.zarray`` describes something this reader does not understand.
        CorruptShardError: a ``.zarray`` cannot be read.
    """
    entries: Dict[str, Any] = {}
    inodes: Dict[Tuple[int, int], Path] = {}  # no chunk file of one array is the same file as another's
    for path in sorted(Path(weights_dir).iterdir()):
        if not (path.is_dir() and path.suffix != ".sync" and (path / _ARRAY_FILE).exists()):
            continue
        array = _parse_array(path.name, path, inodes)
        chunks = [
            ChunkStorageMetadata(
                offsets=torch.Size(i * c for i, c in zip(index, array.chunks)),
                sizes=torch.Size(min(c, s - i * c) for i, c, s in zip(index, array.chunks, array.shape)),
            )
            for index in array.chunk_indices()
        ]
        entries[path.name] = TensorStorageMetadata(TensorProperties(array.dtype), torch.Size(array.shape), chunks)
    return Metadata(state_dict_metadata=entries)


class ZarrRegionReader:
    """Reads tensors, or ``tensor[index]`` along the leading dimensions, from a zarr checkpoint (the interface of
    :class:`.dcp_reader.DCPRegionReader`; see the module docstring for the checks).

    Args:
        path: the checkpoint's ``weights/`` directory.
        metadata: its :func:`read_zarr_metadata`.
    """

    def __init__(self, path: Path, metadata: Metadata) -> None:
        self.path, self.metadata = Path(path), metadata
        self._arrays: Dict[str, _Array] = {}
        self._inodes: Dict[Tuple[int, int], Path] = {}  # every chunk file read: no two the same file

    def _array(self, key: str) -> _Array:
        if key not in self._arrays:
            self._arrays[key] = _parse_array(key, self.path / key)
        return self._arrays[key]

    def files_of(self, key: str) -> List[str]:
        """The chunk files of ``key``, relative to the checkpoint's ``weights/`` directory."""
        array = self._array(key)
        return [str(array.chunk_file(index).relative_to(self.path)) for index in array.chunk_indices()]

    def _chunk_rows(self, array: _Array, chunk: Tuple[int, ...], leading: Tuple[int, ...]) -> torch.Tensor:
        """The part of one chunk at the leading indices (a tensor of shape ``chunks[len(leading):]``), read from the
        chunk file opened without following a link, after checking it."""
        file = array.chunk_file(chunk)
        try:
            fd = _open_below(self.path, file.relative_to(self.path).parts)
        except FileNotFoundError:
            raise CorruptShardError(
                f"{file}: chunk file missing (the save did not finish, or the file was lost)"
            ) from None
        except OSError as error:
            raise CorruptShardError(f"{file}: cannot be opened: {error}") from error
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise CorruptShardError(f"{file}: not a regular file (a symlink, FIFO or device); refusing to read it")
            size = status.st_size
            if size != array.chunk_nbytes:
                what = "truncated" if size < array.chunk_nbytes else "longer than its chunk"
                raise CorruptShardError(f"{file}: {size} bytes, the chunk needs {array.chunk_nbytes} ({what})")
            other = self._inodes.setdefault((status.st_dev, status.st_ino), file)
            if other != file:
                raise CorruptShardError(
                    f"{file} is a hard link to the same file as {other}: each chunk holds its own bytes; refusing to "
                    "read it"
                )
            element, inner = array.dtype.itemsize, array.chunks[len(leading) :]
            position = 0  # the rows at the leading indices are contiguous in a C-order chunk
            for dim, index in enumerate(leading):
                position = position * array.chunks[dim] + (index - chunk[dim] * array.chunks[dim])
            position, wanted = position * math.prod(inner), math.prod(inner) * element
            data = bytearray(wanted)
            view, done = memoryview(data), 0
            while done < wanted:
                got = os.preadv(fd, [view[done:]], position * element + done)
                if got <= 0:
                    raise CorruptShardError(f"{file}: ended after {position * element + done} bytes while read")
                done += got
        finally:
            os.close(fd)
        if not wanted:
            return torch.empty(inner, dtype=array.dtype)
        return torch.frombuffer(data, dtype=array.dtype).reshape(inner)

    def read(
        self, key: str, index: Union[None, int, Tuple[int, ...]] = None, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Read tensor ``key``, or only ``key[index]``, after checking the chunk files it needs.

        Args:
            key: an array of the checkpoint.
            index: indices into the leading dimensions (layer, then expert), an ``int`` for dimension 0 alone, or
                ``None``/``()`` for all of it.
            out: a contiguous tensor of the result's shape and dtype to read into; new memory when ``None``.

        Returns:
            A CPU tensor of shape ``shape[len(index):]``, in the stored dtype, bit for bit.

        Raises:
            CorruptShardError: a chunk file the read needs is missing, has the wrong size, is not a regular file, is
                reached through a symbolic link, or is the same file as another chunk (named).
            UnsupportedFormatError: the array's ``.zarray`` is not megatron-core's layout (named).
            ValueError: ``out`` has the wrong shape or dtype.
        """
        array = self._array(key)
        leading = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        shape = array.shape[len(leading) :]
        if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != array.dtype):
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)}; {key} needs {array.dtype} {shape}")
        if len(leading) > len(array.shape) or any(not 0 <= i < n for i, n in zip(leading, array.shape)):
            raise IndexError(f"{key}: index {leading} out of range for shape {array.shape}")
        result = out if out is not None else torch.empty(shape, dtype=array.dtype)
        for chunk in array.chunk_indices(leading):
            rows = self._chunk_rows(array, chunk, leading)
            inner = zip(chunk[len(leading) :], array.chunks[len(leading) :], array.shape[len(leading) :])
            extents = [(i * n, min(n, size - i * n)) for i, n, size in inner]  # (origin, extent) of each inner dim
            result[tuple(slice(o, o + e) for o, e in extents)] = rows[tuple(slice(0, e) for _, e in extents)]
        return result
