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

"""Read regions of tensors from a ``torch.distributed.checkpoint`` (DCP) directory, one region at a time.

``torch.distributed.checkpoint.load`` reads whole tensors into a state dict. Consolidating a large checkpoint needs
less: one output tensor at a time, i.e. one layer of megatron-core's layer-stacked ``[L, ...]`` tensors. This module
asks DCP's own planner helpers for exactly the chunk overlaps of a region (``create_read_items_for_chunk_list``) and
lets ``FileSystemReader.read_data`` copy them into a destination tensor, so peak memory is one region plus the saved
chunk being read (DCP loads a stored chunk whole, with ``torch.load(weights_only=True)``). No process group is used.

Imports the standard library and torch only; never NeMo, Lightning or megatron-core, and nothing outside the engine.
"""

import io
import os
import zipfile
from pathlib import Path
from typing import IO, Any, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["ChecksummedFileSystemReader", "DCPRegionReader"]


class _RegionLoadPlanner(LoadPlanner):
    """Loads one rectangular region of one tensor into a given destination tensor."""

    def __init__(self, key: str, offsets: Sequence[int], destination: torch.Tensor) -> None:
        self.key = key
        self.offsets = torch.Size(offsets)
        self.destination = destination
        self.metadata: Optional[Metadata] = None

    def set_up_planner(
        self, state_dict: Any, metadata: Optional[Metadata] = None, is_coordinator: bool = False
    ) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "set_up_planner() first"
        item = self.metadata.state_dict_metadata[self.key]
        assert isinstance(item, TensorStorageMetadata), f"{self.key} is not a tensor entry"
        region = ChunkStorageMetadata(offsets=self.offsets, sizes=self.destination.shape)
        return LoadPlan(create_read_items_for_chunk_list(self.key, item, [region]))

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise RuntimeError(f"{read_item.dest_index.fqn} is stored as bytes, not as a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return narrow_tensor_by_index(self.destination, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: the data is already in place


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of an open file from ``offset`` (what ``zipfile`` needs)."""

    def __init__(self, file: Any, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), self._length - self._pos)
        if size <= 0:
            return 0
        self._file.seek(self._offset + self._pos)
        got = self._file.readinto(memoryview(buffer)[:size])
        self._pos += got
        return got


class ChecksummedFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that checks each stored record's CRC-32 before ``torch.load`` reads it.

    Every tensor chunk in a ``.distcp`` file is a ``torch.save`` zip archive, whose records carry the CRC-32 of their
    data (written by ``torch.save`` unless ``torch.serialization.config.save.compute_crc32`` was turned off; a record
    with a stored CRC of 0 is not checked). ``torch.load`` does not check it, so a flipped bit in tensor data would be
    read silently; this reader streams each record once through ``zipfile`` (1 MiB at a time, so memory does not
    grow) and raises instead.

    Raises (from ``read_data``):
        EOFError: the shard file is shorter than the record (truncated); the message names the file.
        zipfile.BadZipFile: a record's data does not match its CRC-32, or the archive structure is damaged; the
            message names the file and the record's byte offset.
    """

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        where = f"{sinfo.relative_path}, record at byte {sinfo.offset}"
        size = os.fstat(file.fileno()).st_size
        if size < sinfo.offset + sinfo.length:
            raise EOFError(f"{where}: the file ends {sinfo.offset + sinfo.length - size} bytes early (truncated)")
        try:
            with zipfile.ZipFile(_Window(file, sinfo.offset, sinfo.length)) as archive:
                for info in archive.infolist():
                    if info.CRC == 0:
                        continue
                    with archive.open(info) as member:  # checks the CRC-32 when the member is read to its end
                        while member.read(1 << 20):
                            pass
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as error:
            raise zipfile.BadZipFile(f"{where}: corrupt data ({error})") from error
        return super()._slice_file(file, sinfo)


class DCPRegionReader:
    """Reads tensors, or regions of them, from a DCP directory written by ``torch_dist`` distributed checkpointing.

    Args:
        path: the DCP directory (NeMo's ``<ckpt>/weights``).
        metadata: its already-read ``.metadata`` (``FileSystemReader.read_metadata()``), to avoid unpickling it twice.
        verify_checksums: check the CRC-32 of every stored record read (:class:`ChecksummedFileSystemReader`), so
            a corrupted shard file fails instead of yielding wrong tensors. Costs one extra pass over the bytes read.
    """

    def __init__(self, path: Path, metadata: Metadata, verify_checksums: bool = True) -> None:
        self.path = Path(path)
        self.metadata = metadata
        self._reader = ChecksummedFileSystemReader(str(path)) if verify_checksums else FileSystemReader(str(path))
        self._reader.set_up_storage_reader(metadata, is_coordinator=True)

    def files_of(self, key: str) -> List[str]:
        """Names of the shard files that hold chunks of ``key``."""
        return sorted({info.relative_path for index, info in self.metadata.storage_data.items() if index.fqn == key})

    def read(
        self, key: str, index: Union[None, int, Tuple[int, ...]] = None, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Read tensor ``key`` (global shape and dtype from the metadata), or only ``key[index]``.

        Args:
            key: a tensor entry of the checkpoint.
            index: indices into the leading dimensions (a layer of a layer-stacked tensor, then an expert), an
                ``int`` for dimension 0 alone, or ``None``/``()`` for all of it.
            out: a contiguous tensor of the result's shape and dtype to read into (lets a caller reuse memory);
                a new one is allocated when ``None``.

        Returns:
            A new CPU tensor of shape ``size[len(index):]``, in the stored dtype.

        Raises:
            KeyError: if ``key`` is not a tensor entry.
            Exception: whatever ``torch.distributed.checkpoint`` raises for an unreadable shard
                (``CheckpointException`` derives from ``BaseException``).
        """
        item = self.metadata.state_dict_metadata[key]
        if not isinstance(item, TensorStorageMetadata):
            raise KeyError(f"{key} is not a tensor entry of {self.path}")
        size = list(item.size)
        leading = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        shape = size[len(leading) :]
        destination = torch.empty(shape, dtype=item.properties.dtype) if out is None else out
        if tuple(destination.shape) != tuple(shape) or destination.dtype != item.properties.dtype:
            raise ValueError(f"out is {destination.dtype} {tuple(destination.shape)}; {key} needs {shape}")
        region = destination.reshape([1] * len(leading) + shape)  # a view: the read lands in ``destination``
        planner = _RegionLoadPlanner(key, list(leading) + [0] * len(shape), region)
        planner.set_up_planner({}, self.metadata, True)
        plan = self._reader.prepare_local_plan(planner.create_local_plan())
        plan = planner.finish_plan(self._reader.prepare_global_plan([plan])[0])
        self._reader.read_data(plan, planner).wait()
        return destination
