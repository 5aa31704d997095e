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

The CRC-32 of the stored records is computed with ``zlib-ng`` (the zip format's CRC-32, the same value as
``zlib.crc32``): about 30 GB/s with the CPU's carry-less multiply, against 4 GB/s for Debian 12's system zlib, which
made the check about 40% of the read stage.

Imports the standard library, torch, ``zlib-ng`` and the engine's stage times only; never NeMo, Lightning or
megatron-core, and nothing outside the engine.
"""

import io
import os
import time
import zipfile
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from zlib_ng.zlib_ng import crc32

from nemo_patch.engine.stage_times import stage_times

__all__ = ["ChecksummedFileSystemReader", "DCPRegionReader"]


class _RegionLoadPlanner(LoadPlanner):
    """Loads one rectangular region of one tensor into a given destination tensor."""

    def __init__(self, key: str, offsets: Sequence[int], destination: torch.Tensor) -> None:
        self.key = key
        self.offsets = torch.Size(offsets)
        self.destination = destination
        self.metadata: Optional[Metadata] = None
        self._placing = 0.0

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
        self._placing = time.perf_counter()  # DCP copies the loaded chunk into this view, then calls commit_tensor
        return narrow_tensor_by_index(self.destination, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        # resolve_tensor returned a view of the destination: the data is already in place
        stage_times.add("placement", time.perf_counter() - self._placing)


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


class _CheckedWindow(_Window):
    """A :class:`_Window` over one stored ``torch.save`` archive that checks each member's CRC-32 as it is read.

    ``torch.load`` reads every member of the archive (``data.pkl``, ``data/0``, ...) with one ``readinto`` of exactly
    the member's size; the CRC-32 is computed on those bytes right there, so the tensor data is not read a second
    time. A member read any other way (or compressed) is checked by streaming it through ``zipfile`` in
    :meth:`finish`.
    """

    def __init__(self, file: Any, offset: int, length: int, where: str) -> None:
        super().__init__(file, offset, length)
        self.where = where
        self.pending: Dict[int, Tuple[int, int, str]] = {}  # data offset -> (size, CRC-32, member name)
        self.unfused: List[str] = []
        self.failed: List[str] = []
        with zipfile.ZipFile(_Window(file, offset, length)) as archive:
            for info in archive.infolist():
                if info.CRC == 0 or info.file_size == 0:
                    continue
                if info.compress_type != zipfile.ZIP_STORED:
                    self.unfused.append(info.filename)
                    continue
                local = _Window(file, offset, length)
                local.seek(info.header_offset)
                header = local.read(30)
                if len(header) < 30 or header[:4] != b"PK\x03\x04":
                    raise zipfile.BadZipFile(f"bad local header of {info.filename}")
                start = info.header_offset + 30 + int.from_bytes(header[26:28], "little")
                start += int.from_bytes(header[28:30], "little")
                self.pending[start] = (info.file_size, info.CRC, info.filename)

    def readinto(self, buffer: Any) -> int:
        start = self._pos
        got = super().readinto(buffer)
        member = self.pending.get(start)
        if member is not None and member[0] == got:
            if crc32(memoryview(buffer)[:got]) != member[1]:
                self.failed.append(member[2])  # raised by finish(): an error raised here would reach torch.load
            del self.pending[start]
        return got

    def finish(self) -> None:
        """Check the members :meth:`readinto` did not see whole, by streaming them through ``zipfile``.

        Raises:
            zipfile.BadZipFile: a member's data does not match its CRC-32.
        """
        if self.failed:
            raise zipfile.BadZipFile(f"Bad CRC-32 for file {self.failed[0]!r}")
        names = set(self.unfused) | {name for _, _, name in self.pending.values()}
        if not names:
            return
        with zipfile.ZipFile(_Window(self._file, self._offset, self._length)) as archive:
            for name in sorted(names):
                with archive.open(name) as member:  # checks the CRC-32 when the member is read to its end
                    while member.read(1 << 20):
                        pass
        self.pending.clear()
        self.unfused.clear()


class ChecksummedFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that checks the CRC-32 of every stored record ``torch.load`` reads.

    Every tensor chunk in a ``.distcp`` file is a ``torch.save`` zip archive, whose records carry the CRC-32 of their
    data (written by ``torch.save`` unless ``torch.serialization.config.save.compute_crc32`` was turned off; a record
    with a stored CRC of 0 is not checked). ``torch.load`` does not check it, so a flipped bit in tensor data would be
    read silently; this reader computes it on the bytes as ``torch.load`` reads them (:class:`_CheckedWindow`), and
    :meth:`finish_checks`, after ``read_data``, checks whatever was not seen whole.

    Raises (from ``read_data`` or :meth:`finish_checks`):
        EOFError: the shard file is shorter than the record (truncated); the message names the file.
        zipfile.BadZipFile: a record's data does not match its CRC-32, or the archive structure is damaged; the
            message names the file and the record's byte offset.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._windows: List[_CheckedWindow] = []

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        where = f"{sinfo.relative_path}, record at byte {sinfo.offset}"
        size = os.fstat(file.fileno()).st_size
        if size < sinfo.offset + sinfo.length:
            raise EOFError(f"{where}: the file ends {sinfo.offset + sinfo.length - size} bytes early (truncated)")
        if getattr(sinfo, "transform_descriptors", None):  # a compressed or otherwise transformed record
            window = super()._slice_file(file, sinfo)
            self._check_whole(file, sinfo, where)
            return window
        try:
            checked = _CheckedWindow(file, sinfo.offset, sinfo.length, where)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as error:
            raise zipfile.BadZipFile(f"{where}: corrupt data ({error})") from error
        self._windows.append(checked)
        return cast(IO[bytes], checked)

    @staticmethod
    def _check_whole(file: Any, sinfo: Any, where: str) -> None:
        try:
            with zipfile.ZipFile(_Window(file, sinfo.offset, sinfo.length)) as archive:
                for info in archive.infolist():
                    if info.CRC != 0:
                        with archive.open(info) as member:
                            while member.read(1 << 20):
                                pass
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as error:
            raise zipfile.BadZipFile(f"{where}: corrupt data ({error})") from error

    def finish_checks(self, discard: bool = False) -> None:
        """Check the records of the last ``read_data`` that were not checked as they were read.

        Args:
            discard: forget them instead (the read failed anyway).

        Raises:
            zipfile.BadZipFile: naming the file and the record's byte offset.
        """
        windows, self._windows = self._windows, []
        if discard:
            return
        for window in windows:
            try:
                window.finish()
            except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as error:
                raise zipfile.BadZipFile(f"{window.where}: corrupt data ({error})") from error


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
        finish = getattr(self._reader, "finish_checks", None)
        try:
            self._reader.read_data(plan, planner).wait()
        except BaseException:
            if finish is not None:
                finish(discard=True)
            raise
        if finish is not None:
            finish()
        return destination
