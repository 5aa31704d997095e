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

"""Safetensors files written tensor by tensor, front to back, without holding the model in memory.

Every output file is laid out first from the tensors' names, dtypes and shapes (all in the checkpoint's metadata), so
its header is known before any tensor is read; :func:`write_file` then writes the header and each tensor's bytes in
order, asking for one tensor at a time (no seek and no reopen, so write-once filesystems work).
"""

import errno
import json
import os
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from nemo_patch.engine.errors import UnknownLayoutError
from nemo_patch.engine.layout_checks import SAFETENSORS_DTYPES as _DTYPES
from nemo_patch.engine.plan import TensorSpec
from nemo_patch.engine.stage_times import stage_times

__all__ = ["MAX_HEADER_BYTES", "OutputFile", "TensorSpec", "encode_header", "write_file"]

#: The largest header the ``safetensors`` library reads (its ``MAX_HEADER_SIZE``).
MAX_HEADER_BYTES = 100_000_000


def encode_header(specs: Sequence[TensorSpec], metadata: Dict[str, str]) -> bytes:
    """The bytes a safetensors file starts with, for tensors at consecutive offsets in the order of ``specs``.

    Raises:
        UnknownLayoutError: a dtype with no safetensors encoding, or a header larger than :data:`MAX_HEADER_BYTES`.
    """
    header: Dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        if spec.dtype not in _DTYPES:
            raise UnknownLayoutError(f"{spec.name}: dtype {spec.dtype} has no safetensors encoding")
        offsets = [offset, offset + spec.nbytes]
        header[spec.name] = {"dtype": _DTYPES[spec.dtype], "shape": list(spec.shape), "data_offsets": offsets}
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    if len(encoded) > MAX_HEADER_BYTES:
        raise UnknownLayoutError(
            f"the safetensors header of {len(specs)} tensors would be {len(encoded)} bytes; the safetensors library "
            f"reads at most {MAX_HEADER_BYTES}"
        )
    return struct.pack("<Q", len(encoded)) + encoded


@dataclass(frozen=True)
class OutputFile:
    """One output safetensors file, laid out before any tensor data is read: its name, header and tensors."""

    name: str
    header: bytes
    specs: Tuple[TensorSpec, ...]

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        return len(self.header) + sum(spec.nbytes for spec in self.specs)

    def offsets(self) -> Iterator[Tuple[TensorSpec, int]]:
        """Each tensor with the absolute byte offset of its data in the file."""
        offset = len(self.header)
        for spec in self.specs:
            yield spec, offset
            offset += spec.nbytes


#: Bytes :func:`write_file` writes between two ``fdatasync`` calls it starts in the background.
WRITEBACK_BYTES = 64 << 20
#: Bytes per ``write`` call, each hashed just before it is written, so that the write copies them from the CPU's cache
#: (one call per tensor made a writer of a 2.55 GB checkpoint about 20% slower).
WRITE_BLOCK = 1 << 18


def write_blocks(data: memoryview, write: Callable[[memoryview, int], int], digest: Optional[Any] = None) -> None:
    """Write ``data`` in blocks of :data:`WRITE_BLOCK` with ``write(bytes, their offset in data)``, which returns how
    many it wrote; each block is fed to ``digest`` first when one is given."""
    hashing = writing = 0.0
    for at in range(0, len(data), WRITE_BLOCK):
        block = data[at : at + WRITE_BLOCK]
        if digest is not None:
            start = time.perf_counter()
            digest.update(block)
            hashing += time.perf_counter() - start
        start = time.perf_counter()
        done = 0
        while done < len(block):
            done += write(block[done:], at + done)
        writing += time.perf_counter() - start
    stage_times.add("hashing", hashing)
    stage_times.add("write", writing)


def _writeback(fd: int) -> None:
    """``fdatasync`` what is written so far, beside the writes; a filesystem without it is left to the final
    ``fsync``."""
    with stage_times.timed("fsync"):
        try:
            getattr(os, "fdatasync", os.fsync)(fd)  # macOS and Windows have no fdatasync
        except OSError as error:
            if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise


def write_file(
    directory: Path,
    file: OutputFile,
    produce: Callable[[TensorSpec], torch.Tensor],
    on_tensor: Optional[Callable[[TensorSpec, memoryview], None]] = None,
    digest: Optional[Callable[[], Any]] = None,
) -> Dict[str, str]:
    """Create ``directory/file.name`` (it must not exist) and write it front to back, then ``fsync`` it.

    While one tensor's bytes are hashed (with ``digest``) and written, block by block, the next one is produced: at
    most two tensors are in memory. Every :data:`WRITEBACK_BYTES` written, an ``fdatasync`` starts in a thread of its
    own. The file is created with ``O_EXCL | O_NOFOLLOW`` and written with ``write`` only (a write-once filesystem
    takes it).

    Args:
        directory: where to create the file.
        file: its layout (header and tensors, from :func:`.plan.plan_shards`).
        produce: returns the tensor of a spec, of that dtype and shape.
        on_tensor: called with each tensor's spec and data bytes once they are written (in the writing thread).
        digest: makes a new hash object (``update``, ``hexdigest``: :func:`.digests.new_digest`) per tensor.

    Returns:
        Tensor name -> hex digest of its data bytes (empty without ``digest``).

    Raises:
        UnknownLayoutError: a produced tensor does not match its spec (names it).
        OSError: the file cannot be created, written or synced.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(Path(directory) / file.name, flags, 0o666)
    syncs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safetensors-writeback")
    digests: Dict[str, str] = {}

    def write(spec: TensorSpec, data: memoryview) -> None:
        hashed = None if digest is None else digest()
        write_blocks(data, lambda block, at: os.write(fd, block), hashed)
        if hashed is not None:
            digests[spec.name] = hashed.hexdigest()
        if on_tensor is not None:
            on_tensor(spec, data)

    try:
        synced: List[Future] = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="safetensors-writer") as pool:
            write_blocks(memoryview(file.header), lambda block, at: os.write(fd, block))
            pending: Optional[Future] = None
            unsynced, in_flight = 0, 0
            for spec in file.specs:
                tensor = produce(spec)
                if tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape):
                    raise UnknownLayoutError(f"{spec.name}: produced {tensor.dtype} {tuple(tensor.shape)}, not {spec}")
                data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
                if pending is not None:
                    pending.result()
                unsynced, in_flight = unsynced + in_flight, spec.nbytes
                if unsynced >= WRITEBACK_BYTES:
                    synced, unsynced = synced + [syncs.submit(_writeback, fd)], 0
                pending = pool.submit(write, spec, data)
                del tensor, data  # the future keeps the bytes alive until written
            if pending is not None:
                pending.result()
        for done in synced:
            done.result()
        with stage_times.timed("fsync"):
            os.fsync(fd)
    finally:
        syncs.shutdown(wait=True, cancel_futures=True)  # before the descriptor it syncs is closed
        os.close(fd)
    return digests
