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

"""The safetensors files of a consolidation: their layout, laid out before any data is read, and how they are created.

The ``safetensors`` library writes a file from a dict that holds every tensor at once. A consolidation instead lays
every output file out up front from the tensors' names, dtypes and shapes (all in the checkpoint's metadata): the
header, and so every tensor's byte range, is known before any tensor is read. :func:`create_files` writes the headers
and allocates the files at their final size; then any number of writers, in this process, in others or on other
nodes, fill disjoint byte ranges (:func:`nemo_patch.engine.part_writer.write_part`). The format (``safetensors``
specification, https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON
header (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets relative to the
data section, padded with spaces to a multiple of 8), then the raw little-endian tensor bytes in header order. Files
are read back and checked with the ``safetensors`` library in the tests.

Sharding follows ``transformers``' ``save_pretrained``: files ``model-00001-of-0000N.safetensors`` of at most
``max_shard_size`` bytes of tensor data each (a tensor larger than that gets a file of its own), plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``); a single
``model.safetensors`` and no index when everything fits in one shard (the names are in
:mod:`nemo_patch.engine.output_layout`).

Imports the standard library and torch only; never NeMo, Lightning or megatron-core, and nothing outside the engine.
"""

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from nemo_patch.engine.errors import UnknownLayoutError
from nemo_patch.engine.output_layout import MODEL_STEM, shard_filename, single_filename

#: The largest header the ``safetensors`` library reads (its ``MAX_HEADER_SIZE``).
MAX_HEADER_BYTES = 100_000_000

__all__ = ["OutputFile", "TensorSpec", "create_files", "encode_header", "plan_files", "plan_shards", "write_index"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one output tensor."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Data size in bytes."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(specs: Sequence[TensorSpec], max_shard_size: int) -> List[List[TensorSpec]]:
    """Split ``specs`` (kept in order) into shards of at most ``max_shard_size`` data bytes each.

    Raises:
        ValueError: if ``max_shard_size`` < 1.
    """
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}")
    shards: List[List[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def encode_header(specs: Sequence[TensorSpec], metadata: Dict[str, str]) -> bytes:
    """The bytes a safetensors file starts with: the 8-byte little-endian header length N, then N bytes of JSON header
    (padded with spaces to a multiple of 8), tensors at consecutive ``data_offsets`` in the order of ``specs``.

    Raises:
        ValueError: a dtype has no safetensors encoding (the message names the tensor).
        UnknownLayoutError: the header would be larger than :data:`MAX_HEADER_BYTES`, which the ``safetensors``
            library refuses to read (e.g. a checkpoint with very many tensors or very long names).
    """
    header: Dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        if spec.dtype not in _DTYPES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} has no safetensors encoding")
        header[spec.name] = {
            "dtype": _DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    if len(encoded) > MAX_HEADER_BYTES:
        raise UnknownLayoutError(
            f"the safetensors header of {len(specs)} tensors would be {len(encoded)} bytes; the safetensors library "
            f"reads at most {MAX_HEADER_BYTES} (first tensor {specs[0].name[:80]!r})"
        )
    return struct.pack("<Q", len(encoded)) + encoded


@dataclass(frozen=True)
class OutputFile:
    """One output safetensors file, laid out before any tensor data is read.

    Attributes:
        name: the file name (``model.safetensors``, ``model-00001-of-00003.safetensors``).
        header: the file's first bytes (:func:`encode_header`).
        specs: its tensors, in file order.
    """

    name: str
    header: bytes
    specs: Tuple[TensorSpec, ...]

    @property
    def size(self) -> int:
        """The file's size in bytes: header plus every tensor's data."""
        return len(self.header) + sum(spec.nbytes for spec in self.specs)

    def offsets(self) -> Iterator[Tuple[TensorSpec, int]]:
        """Each tensor with the absolute byte offset of its data in the file."""
        offset = len(self.header)
        for spec in self.specs:
            yield spec, offset
            offset += spec.nbytes


def plan_files(
    specs: Sequence[TensorSpec], max_shard_size: int, stem: str = MODEL_STEM, metadata: Optional[Dict[str, str]] = None
) -> List[OutputFile]:
    """The output files for ``specs`` (kept in order): one ``<stem>.safetensors`` when everything fits in
    ``max_shard_size`` bytes of tensor data, else ``<stem>-0000i-of-0000N.safetensors`` shards (:func:`plan_shards`).
    Every tensor's file and byte range follows from this alone, before any data is read.

    Args:
        specs: the output tensors.
        max_shard_size: most tensor-data bytes per file (>= 1).
        stem: :data:`~nemo_patch.engine.output_layout.MODEL_STEM` or ``ADAPTER_STEM``.
        metadata: the headers' ``__metadata__`` (default ``{"format": "pt"}``, as ``transformers`` writes it).

    Raises:
        ValueError: ``max_shard_size`` < 1, or a dtype has no safetensors encoding.
    """
    metadata = {"format": "pt"} if metadata is None else metadata
    shards = plan_shards(specs, max_shard_size)
    count = len(shards)
    names = [single_filename(stem)] if count == 1 else [shard_filename(i, count, stem) for i in range(count)]
    return [OutputFile(name, encode_header(group, metadata), tuple(group)) for name, group in zip(names, shards)]


def create_files(directory: Path, files: Sequence[OutputFile]) -> None:
    """Create each file in ``directory`` with its header written and its full size allocated; the data section reads
    as zeros until writers fill it (:func:`nemo_patch.engine.part_writer.write_part`). Headers are fsynced.

    Raises:
        OSError: a file cannot be created.
    """
    for file in files:
        with open(Path(directory) / file.name, "wb") as handle:
            handle.write(file.header)
            handle.truncate(file.size)
            handle.flush()
            os.fsync(handle.fileno())


def write_index(path: Path, shards: Iterable[Tuple[str, Sequence[TensorSpec]]]) -> None:
    """Write ``model.safetensors.index.json`` for ``(filename, specs)`` shards (Hugging Face's sharded layout)."""
    shards = list(shards)
    index = {
        "metadata": {"total_size": sum(spec.nbytes for _, specs in shards for spec in specs)},
        "weight_map": {spec.name: filename for filename, specs in shards for spec in specs},
    }
    data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")
    path.write_bytes(data)
