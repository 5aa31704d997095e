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

"""Read tensors, or one layer of a layer-stacked tensor, from a ``torch_dist`` checkpoint without a process group.

``torch.distributed.checkpoint.load`` reads whole tensors (all layers of a stacked parameter); a consolidation reads
one output tensor at a time. DCP's planner helper gives the stored chunks' overlaps with the region, and each chunk is
loaded with ``torch.load(weights_only=True)`` from its record in a ``.distcp`` file, so memory is one region plus one
chunk. The read loop is not ``FileSystemReader.read_data``, because a checkpoint is not trusted: a record must lie in a
plain, regular file of ``weights/`` (never a path joined from the metadata) and hold exactly the dtype and shape its
chunk declares (DCP would narrow or cast silently), and the chunks must cover the region:
:mod:`.layout_checks` proves each key's layout first, :mod:`.record_checks` checks
each record's members and CRC-32.
"""

import math
from pathlib import Path
from typing import IO, Any, Dict, Iterable, List, Optional, Set, Tuple, Union, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from nemo_patch.engine.layout_checks import check_dcp_layout
from nemo_patch.engine.record_checks import open_record
from nemo_patch.engine.safe_files import open_regular

__all__ = ["DCPRegionReader"]


class DCPRegionReader:
    """Reads tensors, or regions of them, from a DCP directory (NeMo's ``<ckpt>/weights``).

    Args:
        path: the DCP directory.
        metadata: its metadata (:func:`read_dcp_metadata`).
        verify_checksums: check each record's CRC-32 (:mod:`.record_checks`).
        files: shard file name -> ``(path, size)`` of files checked already, for ``checked``, the keys they hold.
        checked: keys whose layout is checked already.
    """

    def __init__(
        self,
        path: Path,
        metadata: Metadata,
        verify_checksums: bool = True,
        files: Optional[Dict[str, Tuple[Path, int]]] = None,
        checked: Iterable[str] = (),
    ) -> None:
        self.path, self.metadata, self.verify_checksums = Path(path), metadata, verify_checksums
        self._files: Dict[str, Tuple[Path, int]] = dict(files or {})
        self._checked: Set[str] = set(checked)

    def files_of(self, key: str) -> List[str]:
        """Names of the shard files that hold chunks of ``key``."""
        storage = self.metadata.storage_data or {}
        return sorted({info.relative_path for index, info in storage.items() if index.fqn == key})

    def _check(self, key: str) -> None:
        """Check ``key``'s layout and files once (:func:`.layout_checks.check_dcp_layout`)."""
        if key not in self._checked:
            self._files.update(check_dcp_layout(self.path, self.metadata, [key]))
            self._checked.add(key)

    def _load(self, stream: Any, key: str, item: TensorStorageMetadata, storage_index: Any) -> torch.Tensor:
        info = self.metadata.storage_data[storage_index]
        where = f"{info.relative_path}, record at byte {info.offset}"
        window, finish = open_record(stream, info.offset, info.length, where, self.verify_checksums)
        tensor = torch.load(cast(IO[bytes], window), map_location="cpu", weights_only=True)
        finish()
        sizes = next((c.sizes for c in item.chunks if c.offsets == storage_index.offset), None)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != item.properties.dtype or tensor.shape != sizes:
            got = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{where}: holds {got}; the metadata declares this chunk of {key} as "
                             f"{item.properties.dtype} {list(sizes or [])}")  # fmt: skip
        return tensor

    def read(
        self, key: str, index: Union[None, int, Tuple[int, ...]] = None, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Read tensor ``key``, or ``key[index]`` (indices into its leading dimensions: a layer, then an expert).

        Args:
            key: a tensor entry of the checkpoint.
            index: the leading indices (an ``int`` for dimension 0 alone), or ``None`` for the whole tensor.
            out: a contiguous tensor of the result's shape and stored dtype to read into (allocated when ``None``).

        Returns:
            A CPU tensor of shape ``size[len(index):]`` in the stored dtype, every element read from a stored chunk.

        Raises:
            KeyError: ``key`` is not a tensor entry, or ``index`` lies outside it.
            ValueError: ``out`` does not fit; a record holds another dtype or shape than its chunk; the chunks do not
                cover the region.
            CorruptShardError: a record's file is not a plain, regular file of ``weights/``, or is too short.
            OSError, zipfile.BadZipFile, EOFError, RuntimeError, pickle.UnpicklingError: a record cannot be read.
        """
        item = self.metadata.state_dict_metadata.get(key)
        if not isinstance(item, TensorStorageMetadata):
            raise KeyError(f"{key} is not a tensor entry of {self.path}")
        self._check(key)
        leading = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        if len(leading) > len(item.size) or any(not 0 <= i < n for i, n in zip(leading, item.size)):
            raise KeyError(f"{key}{list(leading)} is outside its size {list(item.size)}")
        shape = list(item.size[len(leading) :])
        destination = torch.empty(shape, dtype=item.properties.dtype) if out is None else out
        if list(destination.shape) != shape or destination.dtype != item.properties.dtype:
            raise ValueError(f"out is {destination.dtype} {list(destination.shape)}; {key} needs {shape}")
        region = destination.reshape([1] * len(leading) + shape)  # a view: the read lands in ``destination``
        wanted = ChunkStorageMetadata(offsets=torch.Size([*leading] + [0] * len(shape)), sizes=region.shape)
        requests = create_read_items_for_chunk_list(key, item, [wanted])
        if sum(math.prod(request.lengths) for request in requests) != region.numel():
            raise ValueError(f"the stored chunks of {key} do not cover the {region.numel()} elements read")
        records = self.metadata.storage_data
        requests.sort(key=lambda r: (records[r.storage_index].relative_path, records[r.storage_index].offset))
        for name in dict.fromkeys(records[request.storage_index].relative_path for request in requests):
            with open_regular(self._files[name][0]) as stream:
                for request in (r for r in requests if records[r.storage_index].relative_path == name):
                    tensor = self._load(stream, key, item, request.storage_index)
                    target = narrow_tensor_by_index(region, request.dest_offsets, request.lengths)
                    target.copy_(narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths))
        return destination
