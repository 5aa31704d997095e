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
asks DCP's own planner helper for exactly the chunk overlaps of a region (``create_read_items_for_chunk_list``) and
copies them into a destination tensor, so peak memory is one region plus the stored chunk being read (a stored chunk
is loaded whole, with ``torch.load(weights_only=True)``). No process group is used.

The read loop is this module's own, not ``FileSystemReader.read_data``, because a checkpoint is not trusted:

* files are opened only by the paths :func:`nemo_patch.engine.layout_checks.check_dcp_layout` checked (a plain name,
  inside ``weights/``, a regular file, the record inside it), never by joining what the metadata says;
* each stored record must hold a tensor of exactly the dtype the metadata declares and the shape of its chunk (DCP
  would narrow a larger one and cast another dtype silently);
* the chunks read must cover the region exactly (they are proven not to overlap first), so no byte of the
  destination is left as it was allocated;
* the CRC-32 of the stored records is checked on the bytes ``torch.load`` reads (:class:`_CheckedWindow`).

The CRC-32 is computed with ``zlib-ng`` where it is installed (the zip format's CRC-32, the same value as
``zlib.crc32``): about 30 GB/s with the CPU's carry-less multiply, against 4 GB/s for Debian 12's system zlib,
which made the check about 40% of the read stage. Without it, ``zlib.crc32`` gives the same values, more slowly.

Imports the standard library, torch, ``zlib-ng`` (optional) and the engine only; never NeMo, Lightning or
megatron-core.
"""

import io
import math
import time
import zipfile
from pathlib import Path
from typing import IO, Any, Dict, Iterable, List, Optional, Set, Tuple, Union, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from nemo_patch.engine.layout_checks import check_dcp_layout
from nemo_patch.engine.safe_files import open_regular
from nemo_patch.engine.stage_times import stage_times

try:  # the same values as zlib's crc32, about 7 times faster
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is optional
    from zlib import crc32

__all__ = ["DCPRegionReader"]


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


def _refuse_compressed(archive: zipfile.ZipFile) -> None:
    """Refuse a record with a compressed member: ``torch.save`` stores every member uncompressed, and a deflated one
    would make ``torch.load`` allocate far more than the record's bytes (a thousandfold for zeros).

    Raises:
        zipfile.BadZipFile: naming the member.
    """
    for info in archive.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            raise zipfile.BadZipFile(
                f"member {info.filename} is compressed ({info.file_size} bytes from {info.compress_size}); "
                "torch.save stores records uncompressed"
            )


class _CheckedWindow(_Window):
    """A :class:`_Window` over one stored ``torch.save`` archive that checks each member's CRC-32 as it is read.

    ``torch.load`` reads every member of the archive (``data.pkl``, ``data/0``, ...) with one ``readinto`` of exactly
    the member's size; the CRC-32 is computed on those bytes right there, so the tensor data is not read a second
    time. A member read any other way is checked by streaming it through ``zipfile`` in :meth:`finish`. A compressed
    member (``torch.save`` never writes one) is refused when the window is made.
    """

    def __init__(self, file: Any, offset: int, length: int, where: str) -> None:
        super().__init__(file, offset, length)
        self.where = where
        self.pending: Dict[int, Tuple[int, int, str]] = {}  # data offset -> (size, CRC-32, member name)
        self.failed: List[str] = []
        with zipfile.ZipFile(_Window(file, offset, length)) as archive:
            _refuse_compressed(archive)
            for info in archive.infolist():
                if info.CRC == 0 or info.file_size == 0:
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
        names = {name for _, _, name in self.pending.values()}
        if not names:
            return
        with zipfile.ZipFile(_Window(self._file, self._offset, self._length)) as archive:
            for name in sorted(names):
                with archive.open(name) as member:  # checks the CRC-32 when the member is read to its end
                    while member.read(1 << 20):
                        pass
        self.pending.clear()


def _slice(file: Any, offset: int, length: int, where: str, checked: bool) -> Union[_Window, _CheckedWindow]:
    """A window on one stored record of an open shard file (checking its CRC-32 as it is read when ``checked``).

    Either way the record's members must be stored uncompressed, so that what ``torch.load`` allocates is bounded by
    the record's bytes (a deflated member of zeros would inflate a thousandfold)."""
    try:
        if not checked:
            with zipfile.ZipFile(_Window(file, offset, length)) as archive:
                _refuse_compressed(archive)
            return _Window(file, offset, length)
        return _CheckedWindow(file, offset, length, where)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as error:
        raise zipfile.BadZipFile(f"{where}: corrupt data ({error})") from error


class DCPRegionReader:
    """Reads tensors, or regions of them, from a DCP directory written by ``torch_dist`` distributed checkpointing.

    Args:
        path: the DCP directory (NeMo's ``<ckpt>/weights``).
        metadata: its already-read, validated ``.metadata`` (:func:`nemo_patch.engine.dcp_metadata.read_dcp_metadata`).
        verify_checksums: check the CRC-32 of every stored record read, so a corrupted shard file fails instead of
            yielding wrong tensors. Costs one extra pass over the bytes read (at memory speed).
        files: the shard files :func:`nemo_patch.engine.layout_checks.check_dcp_layout` already checked.
        checked: the keys that check already covered; any other key is checked here when it is first read.
    """

    def __init__(
        self,
        path: Path,
        metadata: Metadata,
        verify_checksums: bool = True,
        files: Optional[Dict[str, Tuple[Path, int]]] = None,
        checked: Iterable[str] = (),
    ) -> None:
        self.path = Path(path)
        self.metadata = metadata
        self.verify_checksums = verify_checksums
        self._files: Dict[str, Tuple[Path, int]] = dict(files or {})
        self._checked: Set[str] = set(checked)
        self._chunk_sizes: Dict[str, Dict[Tuple[int, ...], Tuple[int, ...]]] = {}

    def files_of(self, key: str) -> List[str]:
        """Names of the shard files that hold chunks of ``key``."""
        storage = self.metadata.storage_data or {}
        return sorted({str(info.relative_path) for index, info in storage.items() if index.fqn == key})

    def _prepare(self, key: str, item: TensorStorageMetadata) -> None:
        if key not in self._checked:
            self._files.update(check_dcp_layout(self.path, self.metadata, [key]))
            self._checked.add(key)
        if key not in self._chunk_sizes:
            self._chunk_sizes[key] = {tuple(chunk.offsets): tuple(chunk.sizes) for chunk in item.chunks}

    def _load_record(self, stream: Any, key: str, item: TensorStorageMetadata, request: ReadItem) -> torch.Tensor:
        info = self.metadata.storage_data[request.storage_index]
        where = f"{info.relative_path}, record at byte {info.offset}"
        window = _slice(stream, info.offset, info.length, where, self.verify_checksums)
        tensor = torch.load(cast(IO[bytes], window), map_location="cpu", weights_only=True)
        if isinstance(window, _CheckedWindow):
            try:
                window.finish()
            except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as error:
                raise zipfile.BadZipFile(f"{where}: corrupt data ({error})") from error
        sizes = self._chunk_sizes[key][tuple(request.storage_index.offset or ())]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{where}: holds a {type(tensor).__name__}, not the tensor chunk of {key}")
        if tensor.dtype != item.properties.dtype or tuple(tensor.shape) != sizes:
            raise ValueError(
                f"{where}: holds a {tensor.dtype} tensor of shape {list(tensor.shape)}; the metadata declares this "
                f"chunk of {key} as {item.properties.dtype} {list(sizes)}"
            )
        return tensor

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
            A new CPU tensor of shape ``size[len(index):]``, in the stored dtype; every element was read from a
            stored chunk.

        Raises:
            KeyError: if ``key`` is not a tensor entry.
            ValueError: ``out`` has the wrong shape or dtype; a stored record holds another dtype or shape than its
                chunk declares; the chunks do not cover the region.
            CorruptShardError: the layout or a shard file fails the checks of
                :func:`nemo_patch.engine.layout_checks.check_dcp_layout`.
            zipfile.BadZipFile: a record's data does not match its CRC-32 (naming the file and the record's offset).
            EOFError, RuntimeError, pickle.UnpicklingError: ``torch.load`` cannot read a record.
        """
        item = self.metadata.state_dict_metadata.get(key)
        if not isinstance(item, TensorStorageMetadata):
            raise KeyError(f"{key} is not a tensor entry of {self.path}")
        self._prepare(key, item)
        size = list(item.size)
        leading = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        if len(leading) > len(size) or any(not 0 <= i < n for i, n in zip(leading, size)):
            raise KeyError(f"{key}{list(leading)} is outside its size {size}")
        shape = size[len(leading) :]
        destination = torch.empty(shape, dtype=item.properties.dtype) if out is None else out
        if tuple(destination.shape) != tuple(shape) or destination.dtype != item.properties.dtype:
            raise ValueError(f"out is {destination.dtype} {tuple(destination.shape)}; {key} needs {shape}")
        region = destination.reshape([1] * len(leading) + shape)  # a view: the read lands in ``destination``
        wanted = ChunkStorageMetadata(offsets=torch.Size(list(leading) + [0] * len(shape)), sizes=region.shape)
        requests = create_read_items_for_chunk_list(key, item, [wanted])
        covered = sum(math.prod(request.lengths) for request in requests)
        if covered != region.numel():
            raise ValueError(f"the stored chunks of {key} cover {covered} of the {region.numel()} elements read")
        by_file: Dict[str, List[ReadItem]] = {}
        for request in requests:
            by_file.setdefault(self.metadata.storage_data[request.storage_index].relative_path, []).append(request)
        for name, in_file in by_file.items():
            in_file.sort(key=lambda request: self.metadata.storage_data[request.storage_index].offset)
            with open_regular(self._files[name][0]) as stream:
                for request in in_file:
                    tensor = self._load_record(stream, key, item, request)
                    start = time.perf_counter()
                    target = narrow_tensor_by_index(region, request.dest_offsets, request.lengths)
                    target.copy_(narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths))
                    stage_times.add("placement", time.perf_counter() - start)
        return destination
