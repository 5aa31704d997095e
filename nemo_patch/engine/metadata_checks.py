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

"""Read a ``.metadata`` file of a checkpoint from elsewhere: bounded, checked before and after it is unpickled.

:func:`read_dcp_metadata` reads it bounded (:mod:`.safe_files`), checks its opcodes (:mod:`.pickle_limits`),
unpickles it with the allowlist (:mod:`.dcp_metadata`) and checks every field the engine reads
(:func:`validate_metadata`): an allowlisted file can still hold ``size="abc"``, ``chunks=None`` or an integer key.
"""

import gc
import pickle
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from nemo_patch.engine.dcp_metadata import load_dcp_metadata
from nemo_patch.engine.pickle_limits import prescan
from nemo_patch.engine.safe_files import read_regular_file

__all__ = ["MAX_METADATA_BYTES", "InvalidMetadataError", "read_dcp_metadata", "validate_metadata"]

#: The most bytes a ``.metadata`` file may have (a large MoE model's is tens of MB).
MAX_METADATA_BYTES = 512 << 20


class InvalidMetadataError(pickle.UnpicklingError):
    """A ``.metadata`` file unpickled, but its values are not valid DCP metadata; the message names the entry."""


def _check_size(value: Any, what: str, ndim: Optional[int] = None) -> None:
    if not isinstance(value, torch.Size) or not all(type(n) is int and n >= 0 for n in value):
        raise InvalidMetadataError(f"{what} is {value!r}, not a torch.Size of non-negative integers")
    if ndim is not None and len(value) != ndim:
        raise InvalidMetadataError(f"{what} has {len(value)} dimensions, the tensor {ndim}")


def validate_metadata(value: Any) -> Metadata:
    """Check that unpickled DCP metadata has the types the engine reads.

    ``state_dict_metadata`` maps ``str`` keys to ``TensorStorageMetadata`` (a ``torch.dtype``, a ``torch.Size`` of
    non-negative ints, chunks of the tensor's rank) or ``BytesStorageMetadata``; ``storage_data`` (if any) maps
    ``MetadataIndex`` to ``_StorageInfo`` (a ``str`` file name, non-negative ``int`` offset and length).

    Returns:
        ``value``, unchanged.

    Raises:
        InvalidMetadataError: naming the first entry and field that is wrong.
    """
    if not isinstance(value, Metadata) or not isinstance(value.state_dict_metadata, dict):
        raise InvalidMetadataError(f"DCP metadata holds a {type(value).__name__}, not a Metadata with a dict")
    for key, item in value.state_dict_metadata.items():
        if not isinstance(key, str):
            raise InvalidMetadataError(f"state_dict_metadata has a key {key!r} that is not a string")
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise InvalidMetadataError(f"entry {key}: a {type(item).__name__}, not tensor or bytes metadata")
        if not isinstance(item.properties, TensorProperties) or not isinstance(item.properties.dtype, torch.dtype):
            raise InvalidMetadataError(f"entry {key}: properties {item.properties!r} name no torch dtype")
        _check_size(item.size, f"entry {key}: size")
        if not isinstance(item.chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in item.chunks):
            raise InvalidMetadataError(f"entry {key}: chunks is not a list of ChunkStorageMetadata")
        for number, chunk in enumerate(item.chunks):
            _check_size(chunk.offsets, f"entry {key}: chunk {number} offsets", len(item.size))
            _check_size(chunk.sizes, f"entry {key}: chunk {number} sizes", len(item.size))
    storage = value.storage_data
    if storage is not None and not isinstance(storage, dict):
        raise InvalidMetadataError(f"storage_data is a {type(storage).__name__}, not a dict")
    for index, info in (storage or {}).items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise InvalidMetadataError(f"storage_data has a key {index!r} that is not a MetadataIndex")
        if index.offset is not None:
            _check_size(index.offset, f"storage_data[{index.fqn}]: offset")
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise InvalidMetadataError(f"storage_data[{index.fqn}] is not a _StorageInfo naming a file")
        if not all(type(n) is int and n >= 0 for n in (info.offset, info.length)):
            raise InvalidMetadataError(f"storage_data[{index.fqn}]: offset and length must be byte counts >= 0")
    return value


def read_dcp_metadata(dcp_dir: Path) -> Metadata:
    """Read and check ``<dcp_dir>/.metadata`` (see the module docstring).

    Raises:
        OSError: the file cannot be read, is not a regular file, or is larger than :data:`MAX_METADATA_BYTES`.
        pickle.UnpicklingError: a structure the unpickler must not build, more elements than the file's size allows,
            a name outside the allowlist, a corrupt file, or (:class:`~.errors.InvalidMetadataError`) values of the
            wrong types.
    """
    data = read_regular_file(Path(dcp_dir) / ".metadata", MAX_METADATA_BYTES)
    collecting = gc.isenabled()
    gc.disable()  # what is allocated here lives until the end: the cyclic collector would walk it again and again
    try:
        prescan(data)
        return validate_metadata(load_dcp_metadata(data))
    finally:
        if collecting:
            gc.enable()
