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

"""Write safetensors files one tensor at a time, split into shards the way Hugging Face does.

The ``safetensors`` library writes a file from a dict that holds every tensor at once. To keep a consolidation's
memory bounded by the largest single tensor, this module writes the same format incrementally: the header is built
up front from the tensors' names, dtypes and shapes, then each tensor's bytes are appended as it is produced. The
format (``safetensors`` specification, https://github.com/huggingface/safetensors): an 8-byte little-endian header
length N, N bytes of JSON header (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
offsets relative to the data section, padded with spaces to a multiple of 8), then the raw little-endian tensor
bytes in header order. Files are read back and checked with the ``safetensors`` library in the tests.

Sharding follows ``transformers``' ``save_pretrained``: files ``model-00001-of-0000N.safetensors`` of at most
``max_shard_size`` bytes of tensor data each (a tensor larger than that gets a file of its own), plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``); a single
``model.safetensors`` and no index when everything fits in one shard (the names are in
:mod:`nemo_patch.engine.output_layout`).

Imports the standard library and torch only; never NeMo, Lightning or megatron-core, and nothing outside the engine.
"""

import hashlib
import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Dict, Iterable, List, Sequence, Tuple

import torch

__all__ = ["TensorSpec", "plan_shards", "write_safetensors", "write_index"]

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


def _header(specs: Sequence[TensorSpec], metadata: Dict[str, str]) -> bytes:
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
    return encoded + b" " * (-len(encoded) % 8)


#: Bytes per ``write`` call. One call per tensor (tens to hundreds of MB) made a whole consolidation about 20% slower
#: than cache-sized pieces (in-process A/B on ``scripts/bench_consolidation.py``'s 2.55 GB checkpoint, 2 cores).
_WRITE_BLOCK = 1 << 18


def _write_in_blocks(handle: BinaryIO, data: memoryview) -> None:
    for start in range(0, len(data), _WRITE_BLOCK):
        handle.write(data[start : start + _WRITE_BLOCK])


def write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    metadata: Dict[str, str],
) -> str:
    """Write one safetensors file, asking ``produce`` for each tensor in turn (only one is held at a time).

    Args:
        path: the file to create.
        specs: the tensors, in file order.
        produce: returns the tensor for a spec (any layout; it must match the spec's dtype and shape).
        metadata: the header's ``__metadata__`` (string to string), e.g. ``{"format": "pt"}``.

    Returns:
        The sha256 hex digest of the bytes written.

    Raises:
        ValueError: if a produced tensor does not match its spec, or a dtype has no safetensors encoding.
        OSError: if the file cannot be written.
    """
    digest = hashlib.sha256()
    header = _header(specs, metadata)
    with open(path, "wb") as handle, ThreadPoolExecutor(max_workers=2, thread_name_prefix="safetensors") as pool:
        for chunk in (struct.pack("<Q", len(header)), header):
            handle.write(chunk)
            digest.update(chunk)
        # Two-stage pipeline: while one tensor's bytes are written and hashed (both release the GIL), the next one
        # is produced. At most two tensors are alive at a time.
        in_flight: List[Future] = []
        for spec in specs:
            tensor = produce(spec)
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape):
                raise ValueError(f"{spec.name}: produced {tensor.dtype} {tuple(tensor.shape)}, expected {spec}")
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            for future in in_flight:
                future.result()
            in_flight = [pool.submit(_write_in_blocks, handle, data.data), pool.submit(digest.update, data.data)]
            del tensor, data  # the futures keep the buffer alive until written and hashed
        for future in in_flight:
            future.result()
        handle.flush()
        os.fsync(handle.fileno())
    return digest.hexdigest()


def write_index(path: Path, shards: Iterable[Tuple[str, Sequence[TensorSpec]]]) -> str:
    """Write ``model.safetensors.index.json`` for ``(filename, specs)`` shards; returns its sha256 hex digest."""
    shards = list(shards)
    index = {
        "metadata": {"total_size": sum(spec.nbytes for _, specs in shards for spec in specs)},
        "weight_map": {spec.name: filename for filename, specs in shards for spec in specs},
    }
    data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()
