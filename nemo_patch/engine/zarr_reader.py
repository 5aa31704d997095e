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

megatron-core's ``zarr`` save strategy (deprecated by megatron-core, still written by NeMo's
``save_ckpt_format='zarr'``) writes one Zarr v2 array per tensor into the checkpoint's ``weights/`` directory:
``<key>/.zarray`` (JSON: ``shape``, ``chunks`` = the TP/PP shard's shape, ``dtype``, ``compressor: null``,
``order: "C"``) and one file per chunk, ``<key>/<i>.<j>...``, holding that chunk's raw bytes in C order. bf16 is stored
as dtype ``"bfloat16"`` (numpy's bfloat16 from ``ml_dtypes``). ``common.pt``, ``metadata.json`` and objects that
are not tensors (``_extra_state``) are not arrays and are never read.

What is checked, since Zarr stores no checksum: before a tensor is read, its ``.zarray`` must describe what this reader
understands (Zarr format 2, no compressor, no filters, C order, a known little-endian dtype, ``.`` or ``/`` as the
dimension separator), else :class:`~.errors.UnsupportedFormatError` names the key and the field;
and every chunk file the read needs must exist with exactly its size in bytes, else
:class:`~.errors.CorruptShardError` names the file (zarr itself silently returns the fill value for a
missing chunk, which would be wrong weights that look fine). A flipped bit inside a chunk of the right size cannot be
detected: the format has nothing to check it against. Reading goes through the ``zarr`` library (``zarr<3``).

:func:`read_zarr_metadata` describes the arrays as ``torch.distributed.checkpoint`` ``Metadata`` (global shape, dtype
and chunks per key), so output planning is the same for both formats; :class:`ZarrRegionReader` has the interface of
:class:`.dcp_reader.DCPRegionReader`.

Imports the standard library, torch, and ``zarr`` and ``ml_dtypes`` when a zarr checkpoint is read; never NeMo,
Lightning or megatron-core, and nothing outside the engine.
"""

import itertools
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
from nemo_patch.engine.safe_files import UnsafeFileError, read_json_file

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
        """How many chunk files the array's shape needs."""
        return math.prod(math.ceil(size / chunk) for size, chunk in zip(self.shape, self.chunks))

    def chunk_file(self, index: Tuple[int, ...]) -> Path:
        return self.path / (self.separator.join(str(i) for i in index) if index else "0")

    def chunk_indices(self, leading: Tuple[int, ...] = ()) -> List[Tuple[int, ...]]:
        """The chunk grid indices (all of them, or those covering ``[leading]`` along the leading dimensions)."""
        grids = [range(math.ceil(size / chunk)) for size, chunk in zip(self.shape, self.chunks)]
        for dim, position in enumerate(leading):
            grids[dim] = range(position // self.chunks[dim], position // self.chunks[dim] + 1)
        return list(itertools.product(*grids))


def _parse_array(key: str, path: Path) -> _Array:
    """The ``.zarray`` of one array, checked field by field."""
    where = f"zarr array {key} ({path / _ARRAY_FILE})"
    try:
        if path.is_symlink():
            raise UnsafeFileError(f"{path} is a symlink; an array directory must lie in weights/ itself")
        meta = read_json_file(path / _ARRAY_FILE)
        if not isinstance(meta, dict):
            raise ValueError(f"a {type(meta).__name__}, not a JSON object")
    except (OSError, ValueError) as error:
        raise CorruptShardError(f"Cannot read {where}: {type(error).__name__}: {error}") from error
    expected: Dict[str, Any] = {"zarr_format": 2, "compressor": None, "filters": None, "order": "C"}
    for field, value in expected.items():
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
        files = sum(1 for _ in path.rglob("*")) if separator == "/" else len(os.listdir(path))
    except OSError as error:
        raise CorruptShardError(f"Cannot list {where}: {error}") from error
    if array.chunk_count > files:
        raise CorruptShardError(
            f"{where}: shape {list(shape)} in chunks of {list(chunks)} needs {array.chunk_count} chunk files; the "
            f"directory holds {files} files"
        )
    return array


def _arrays(weights_dir: Path) -> Dict[str, _Array]:
    arrays = {}
    for path in sorted(weights_dir.iterdir()):
        if path.is_dir() and path.suffix != ".sync" and (path / _ARRAY_FILE).exists():
            arrays[path.name] = _parse_array(path.name, path)
    return arrays


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
    for key, array in _arrays(Path(weights_dir)).items():
        chunks = [
            ChunkStorageMetadata(
                offsets=torch.Size(i * c for i, c in zip(index, array.chunks)),
                sizes=torch.Size(min(c, s - i * c) for i, c, s in zip(index, array.chunks, array.shape)),
            )
            for index in array.chunk_indices()
        ]
        properties = TensorProperties(dtype=array.dtype)
        entries[key] = TensorStorageMetadata(properties=properties, size=torch.Size(array.shape), chunks=chunks)
    return Metadata(state_dict_metadata=entries)


def _numpy_bfloat16() -> None:
    """Make numpy understand dtype ``"bfloat16"`` (as megatron-core does when it writes one)."""
    try:
        import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
    except ImportError as error:
        raise UnsupportedFormatError(
            "reading a bf16 zarr checkpoint needs the ml_dtypes package (pip install ml_dtypes)"
        ) from error


class ZarrRegionReader:
    """Reads tensors, or ``tensor[index]`` along dimension 0, from a zarr checkpoint (the interface of
    :class:`.dcp_reader.DCPRegionReader`).

    Args:
        path: the checkpoint's ``weights/`` directory.
        metadata: its :func:`read_zarr_metadata`.

    Raises:
        UnsupportedFormatError: the ``zarr`` package (``zarr<3``) is not installed.
    """

    def __init__(self, path: Path, metadata: Metadata) -> None:
        try:
            import zarr
        except ImportError as error:
            raise UnsupportedFormatError(
                f"{path} is a 'zarr' checkpoint; reading it needs the zarr package (pip install 'zarr<3')"
            ) from error
        self._zarr = zarr
        self.path = Path(path)
        self.metadata = metadata
        self._arrays: Dict[str, _Array] = {}

    def _array(self, key: str) -> _Array:
        if key not in self._arrays:
            self._arrays[key] = _parse_array(key, self.path / key)
        return self._arrays[key]

    def files_of(self, key: str) -> List[str]:
        """The chunk files of ``key``, relative to the checkpoint's ``weights/`` directory."""
        array = self._array(key)
        return [str(array.chunk_file(index).relative_to(self.path)) for index in array.chunk_indices()]

    def _check_chunks(self, array: _Array, leading: Tuple[int, ...]) -> None:
        for chunk in array.chunk_indices(leading):
            file = array.chunk_file(chunk)
            try:
                status = file.lstat()
            except FileNotFoundError:
                raise CorruptShardError(
                    f"{file}: chunk file missing (the save did not finish, or the file was lost)"
                ) from None
            if not stat.S_ISREG(status.st_mode):
                raise CorruptShardError(f"{file}: not a regular file (a symlink, FIFO or device); refusing to read it")
            size = status.st_size
            if size != array.chunk_nbytes:
                what = "truncated" if size < array.chunk_nbytes else "longer than its chunk"
                raise CorruptShardError(f"{file}: {size} bytes, the chunk needs {array.chunk_nbytes} ({what})")

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
            CorruptShardError: a chunk file the read needs is missing or has the wrong size (named).
            UnsupportedFormatError: the array's ``.zarray`` is not megatron-core's layout (named).
            ValueError: ``out`` has the wrong shape or dtype.
        """
        array = self._array(key)
        leading = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        shape = array.shape[len(leading) :]
        if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != array.dtype):
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)}; {key} needs {array.dtype} {shape}")
        self._check_chunks(array, leading)
        if array.dtype == torch.bfloat16:
            _numpy_bfloat16()
        values = self._zarr.open(str(array.path), mode="r")[leading if leading else ...]
        if array.dtype == torch.bfloat16:
            values = values.view("<u2")  # numpy's bfloat16 -> the same 16 bits, which torch can take
        tensor = torch.from_numpy(values.copy()).reshape(shape)
        if array.dtype in (torch.bfloat16,):
            tensor = tensor.view(torch.bfloat16)
        if out is None:
            return tensor
        return out.copy_(tensor)
