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

A consolidation reads one output tensor at a time (DCP's ``load`` reads whole tensors), so memory is one region plus
one chunk; DCP's planner helper gives the overlaps of the chunks that hold the region's layer or expert. The read loop
is not ``FileSystemReader.read_data``: a record must lie in a plain, regular file of ``weights/`` and hold exactly the
dtype and shape its chunk declares (DCP would cast silently), and the chunks must cover the region.

A record is read in one pass: ``torch.load(weights_only=True, map_location="meta")`` reads what it holds without its
data, which is then read straight into its place in the output (row by row for a column block; into a reused buffer
when the chunk does not land whole), its CRC-32 checked on the same bytes. A record not laid out as ``torch.save``
writes a contiguous tensor is loaded whole with ``torch.load`` instead.
"""

import itertools
import math
import pickle
import re
import sys
from pathlib import Path
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from nemo_patch.engine.layout_checks import check_dcp_layout
from nemo_patch.engine.record_checks import RecordWindow, open_record
from nemo_patch.engine.safe_files import open_regular

__all__ = ["DCPRegionReader"]

#: The line of ``torch.load``'s message about what its ``weights_only`` unpickler refused.
_REFUSED = re.compile(r"(?:WeightsUnpickler error: |Trying to load )(?P<what>[^\n]*)")


def _refused_in_one_line(where: str, load: Callable[[], Any]) -> Any:
    """``load()``; torch's message of several lines for a refused global becomes one naming the record and what."""
    try:
        return load()
    except pickle.UnpicklingError as error:
        match = _REFUSED.search(str(error))
        what = (match.group("what") if match else " ".join(str(error).split())).split(". ")[0]
        raise pickle.UnpicklingError(f"{where}: torch.load(weights_only=True) refused it: {what}") from error


def _check_holds(tensor: Any, where: str, key: str, item: TensorStorageMetadata, sizes: Any) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != item.properties.dtype or tensor.shape != sizes:
        got = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        declared = f"{item.properties.dtype} {list(sizes or [])}"
        raise ValueError(f"{where}: holds {got}; the metadata declares this chunk of {key} as {declared}")


def _data_start(window: RecordWindow, meta: torch.Tensor) -> Optional[int]:
    """Where in the record the data of the tensor ``torch.load`` described (``meta``) starts, when it is laid out as
    ``torch.save`` writes a contiguous tensor in this machine's byte order: a member of exactly its bytes."""
    storage, nbytes = meta.untyped_storage(), meta.numel() * meta.element_size()
    start = getattr(storage, "_checkpoint_offset", None)
    member = window.member_at(start) if isinstance(start, int) else None
    if member is None or member[1] != nbytes or storage.nbytes() != nbytes or meta.storage_offset():
        return None
    order = next((m for m in window.members.values() if m[3].rsplit("/", 1)[-1] == "byteorder"), None)
    if order is not None:
        window.seek(order[0])
        if window.read(order[1]) != sys.byteorder.encode():
            return None
    return start if meta.is_contiguous() else None


def _pieces(target: torch.Tensor, whole: torch.Tensor) -> Optional[Iterator[memoryview]]:
    """``target`` (a view into the contiguous tensor ``whole``) as the ``memoryview`` pieces of ``whole``'s memory
    that hold its elements in order (a column block's rows), made as they are read; ``None`` for runs under 4 KiB."""
    size, strides, element, inner, run = list(target.shape), target.stride(), target.element_size(), target.dim(), 1
    while inner > 0 and (size[inner - 1] == 1 or strides[inner - 1] == run):
        run, inner = run * size[inner - 1], inner - 1
    begin, steps = target.data_ptr() - whole.data_ptr(), [stride * element for stride in strides[:inner]]
    end = begin + sum((n - 1) * step for n, step in zip(size, steps)) + run * element
    if run * element < 4096 or not whole.is_contiguous() or min(steps, default=0) < 0 or begin < 0 or end <= begin:
        return None
    memory = whole.reshape(-1).view(torch.uint8).numpy().data
    if end > len(memory):
        return None
    indices = itertools.product(*map(range, size[:inner]))
    starts = (begin + sum(i * step for i, step in zip(index, steps)) for index in indices)
    return (memory[at : at + run * element] for at in starts)


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
        self._by_leading: Dict[Tuple[str, int], Dict[Tuple[int, ...], List[ChunkStorageMetadata]]] = {}
        self._staging = torch.empty(0, dtype=torch.uint8)

    def _chunks_holding(self, key: str, item: TensorStorageMetadata, leading: Tuple[int, ...]) -> Any:
        """``item`` with only the chunks that hold ``key[leading]`` (all for no index), from an index by leading
        offsets made at the first read of ``key`` (one pass over its chunks: the pairs :mod:`.plan` bounds)."""
        if not leading:
            return item
        index = self._by_leading.get((key, len(leading)))
        if index is None:
            index = self._by_leading[(key, len(leading))] = {}
            for chunk in item.chunks:
                if all(chunk.sizes):  # a chunk of no element holds nothing to read
                    ranges = [range(o, o + s) for o, s in zip(chunk.offsets[: len(leading)], chunk.sizes)]
                    for at in itertools.product(*ranges):
                        index.setdefault(at, []).append(chunk)
        return TensorStorageMetadata(item.properties, item.size, index.get(leading, []))

    def _staged(self, like: torch.Tensor) -> torch.Tensor:
        """A reused buffer shaped as ``like`` (a chunk that does not land whole in the output)."""
        nbytes = like.numel() * like.element_size()
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[:nbytes].view(like.dtype).view(like.shape)

    def files_of(self, key: str) -> List[str]:
        """Names of the shard files that hold chunks of ``key``."""
        storage = self.metadata.storage_data or {}
        return sorted({info.relative_path for index, info in storage.items() if index.fqn == key})

    def _load(self, stream: Any, key: str, item: TensorStorageMetadata, storage_index: Any, place: Any) -> None:
        """Load one record and call ``place(tensor, read_into)``: ``read_into`` is ``None`` when ``tensor`` holds the
        data (loaded whole); else ``tensor`` is on the ``meta`` device and ``read_into(out)`` reads the data into
        ``out``, a ``memoryview`` of its bytes or pieces taking them in order (:meth:`.RecordWindow.read_member`)."""
        info = self.metadata.storage_data[storage_index]
        where = f"{info.relative_path}, record at byte {info.offset}"
        window, finish = open_record(stream, info.offset, info.length, where, self.verify_checksums)
        sizes = next((c.sizes for c in item.chunks if c.offsets == storage_index.offset), None)
        stored = cast(IO[bytes], window)
        meta = _refused_in_one_line(where, lambda: torch.load(stored, map_location="meta", weights_only=True))
        _check_holds(meta, where, key, item, sizes)
        start = _data_start(window, meta)
        if start is None:  # not laid out as torch.save writes a contiguous tensor: load it whole
            window.seek(0)
            tensor = _refused_in_one_line(where, lambda: torch.load(stored, map_location="cpu", weights_only=True))
            finish()
            _check_holds(tensor, where, key, item, sizes)
            place(tensor, None)
        else:
            place(meta, lambda out: window.read_member(start, out, meta.numel() * meta.element_size()))
            finish()

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
        if key not in self._checked:
            self._files.update(check_dcp_layout(self.path, self.metadata, [key]))
            self._checked.add(key)
        leading = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        if len(leading) > len(item.size) or any(not 0 <= i < n for i, n in zip(leading, item.size)):
            raise KeyError(f"{key}{list(leading)} is outside its size {list(item.size)}")
        shape = list(item.size[len(leading) :])
        destination = torch.empty(shape, dtype=item.properties.dtype) if out is None else out
        if list(destination.shape) != shape or destination.dtype != item.properties.dtype:
            raise ValueError(f"out is {destination.dtype} {list(destination.shape)}; {key} needs {shape}")
        region = destination.reshape([1] * len(leading) + shape)  # a view: the read lands in ``destination``
        wanted = ChunkStorageMetadata(offsets=torch.Size([*leading] + [0] * len(shape)), sizes=region.shape)
        requests = create_read_items_for_chunk_list(key, self._chunks_holding(key, item, leading), [wanted])
        if sum(math.prod(request.lengths) for request in requests) != region.numel():
            raise ValueError(f"the stored chunks of {key} do not cover the {region.numel()} elements read")
        records = self.metadata.storage_data
        requests.sort(key=lambda r: (records[r.storage_index].relative_path, records[r.storage_index].offset))
        for name in dict.fromkeys(records[request.storage_index].relative_path for request in requests):
            with open_regular(self._files[name][0]) as stream:
                for request in (r for r in requests if records[r.storage_index].relative_path == name):
                    target = narrow_tensor_by_index(region, request.dest_offsets, request.lengths)

                    def place(tensor: torch.Tensor, read_into: Optional[Callable[[Any], None]]) -> None:
                        whole = list(request.lengths) == list(tensor.shape) and not any(request.storage_offsets)
                        if read_into is not None and whole and target.is_contiguous():
                            read_into(target.reshape(-1).view(torch.uint8).numpy().data)  # straight into the output
                        elif read_into is not None and whole and (pieces := _pieces(target, destination)) is not None:
                            read_into(pieces)  # row by row into the output (a column block)
                        else:
                            if read_into is not None:  # into a reused buffer, then copied
                                tensor = self._staged(tensor)
                                read_into(tensor.reshape(-1).view(torch.uint8).numpy().data)
                            target.copy_(narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths))

                    self._load(stream, key, item, request.storage_index, place)
        return destination
