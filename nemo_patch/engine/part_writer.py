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

"""Fill byte ranges of laid-out safetensors files: the unit of work that writers share.

Every tensor's file and byte range is fixed before any data is read, and parts are disjoint: their writers need no
locks, and the bytes do not depend on how many parts filled a file. Never imports NeMo, Lightning or megatron-core.
"""

import contextlib
import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Sequence, Tuple

import torch

from nemo_patch.engine.digests import new_digest
from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.safetensors_writer import WRITEBACK_BYTES, OutputFile, TensorSpec, write_blocks
from nemo_patch.engine.stage_times import stage_times

__all__ = ["OffsetWritesRefusedError", "Placement", "create_files", "placements_of", "split_parts", "write_part"]

#: Bytes written to a file between two writebacks: :mod:`.safetensors_writer`'s.
_WRITEBACK_BYTES = WRITEBACK_BYTES
#: What a filesystem that cannot write at offsets answers ``ftruncate``, ``pwrite`` or reopening a file with.
_REFUSED = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ESPIPE, errno.EINVAL, errno.EPERM)


class OffsetWritesRefusedError(ConsolidationError):
    """Several writers fill the output files at offsets, and the output's filesystem refuses it (write-once volumes
    such as Databricks volumes and some FUSE mounts); one writer, which writes each file front to back, works there."""

    exit_code, summary = 20, "an output filesystem that refuses writes at offsets (several writers)"


@contextlib.contextmanager
def _offsets_refused(path: Path, what: str) -> Iterator[None]:
    """Turn the refusal of ``what`` (an ``OSError`` of :data:`_REFUSED`) into :class:`OffsetWritesRefusedError`."""
    try:
        yield
    except OSError as error:
        if error.errno not in _REFUSED:
            raise
        raise OffsetWritesRefusedError(
            f"{path}: the filesystem refuses {what} ({error.strerror}): several writers fill the output's files at "
            "offsets, which a write-once filesystem (a Databricks volume, some FUSE mounts) does not allow; write "
            "with one writer (workers=1), which writes each file front to back, or to a local output directory and "
            "copy it from there"
        ) from error


@dataclass(frozen=True)
class Placement:
    """Where one output tensor's data goes.

    Attributes:
        name: the tensor's name.
        file: the output file's name.
        offset: absolute byte offset of the tensor's data in that file.
        nbytes: the data's size in bytes.
    """

    name: str
    file: str
    offset: int
    nbytes: int

    def to_dict(self) -> Dict[str, Any]:
        """As a JSON object."""
        return asdict(self)


def create_files(directory: Path, files: Sequence[OutputFile]) -> None:
    """Create each file in ``directory`` with its header written and its full size allocated, for writers to fill
    (:func:`write_part`); the data reads as zeros until then. Headers are fsynced.

    Raises:
        OffsetWritesRefusedError: the filesystem refuses to set a file's size.
        OSError: a file cannot be created.
    """
    for file in files:
        path = Path(directory) / file.name
        with open(path, "xb") as handle:
            handle.write(file.header)
            handle.flush()
            with _offsets_refused(path, "setting a file's size (ftruncate)"):
                os.ftruncate(handle.fileno(), file.size)
            os.fsync(handle.fileno())


def placements_of(files: Sequence[OutputFile]) -> List[Placement]:
    """Every tensor's placement, in file order."""
    return [Placement(spec.name, file.name, offset, spec.nbytes) for file in files for spec, offset in file.offsets()]


def split_parts(files: Sequence[OutputFile], count: int) -> List[List[Placement]]:
    """Cut the tensors of ``files``, in file order, into ``count`` contiguous runs of about equal bytes.

    A tensor goes to the part its midpoint falls in, so parts differ by at most about one tensor's bytes; with more
    parts than tensors some parts are empty. The cut depends on the files alone (every node computes the same).

    Raises:
        ValueError: ``count`` < 1.
    """
    if count < 1:
        raise ValueError(f"the number of parts must be >= 1, got {count}")
    placements = placements_of(files)
    total = sum(placement.nbytes for placement in placements) or 1
    parts: List[List[Placement]] = [[] for _ in range(count)]
    done = 0
    for placement in placements:
        parts[min(count - 1, (2 * done + placement.nbytes) * count // (2 * total))].append(placement)
        done += placement.nbytes
    return parts


def _pwrite_all(fd: int, data: memoryview, offset: int, path: Path) -> str:
    """Write ``data`` at ``offset`` of ``fd``, each block hashed just before it is written (from the CPU's cache);
    return its digest (BLAKE3 where installed, else sha256)."""
    digest = new_digest()
    with _offsets_refused(path, "writing at an offset (pwrite)"):
        write_blocks(data, lambda block, at: os.pwrite(fd, block, offset + at), digest)
    return digest.hexdigest()


def _fdatasync(fd: int) -> None:
    with stage_times.timed("fsync"):
        getattr(os, "fdatasync", os.fsync)(fd)  # macOS and Windows have no fdatasync


class _Writeback:
    """Makes written bytes durable in the background, so that the final fsync finds little left to do: once
    :data:`_WRITEBACK_BYTES` more bytes of a file were written (few calls for many small tensors), an ``fdatasync``
    of it runs in a thread of its own while the next tensors are read and written."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="part-writeback")
        self._unsynced: Dict[int, int] = {}
        self._syncs: List[Future] = []

    def written(self, fd: int, nbytes: int) -> None:
        """Count ``nbytes`` written to ``fd``; start an ``fdatasync`` of it once enough are."""
        self._unsynced[fd] = self._unsynced.get(fd, 0) + nbytes
        if self._unsynced[fd] >= _WRITEBACK_BYTES:
            self._unsynced[fd] = 0
            self._syncs.append(self._pool.submit(_fdatasync, fd))

    def wait(self) -> None:
        """Wait for the ``fdatasync`` calls started so far; ``OSError`` if one failed (``EIO``: written data lost)."""
        for sync in self._syncs:
            sync.result()

    def close(self) -> None:
        """Stop: ``fdatasync`` calls not yet started are dropped, a running one is waited for (its fd stays open)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def write_part(
    directory: Path,
    part: Sequence[Placement],
    specs: Mapping[str, TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    progress: Callable[[int], None] = lambda nbytes: None,
) -> Dict[str, str]:
    """Fill ``part``'s byte ranges of the files in ``directory``, asking ``produce`` for each tensor in turn.

    While one tensor's bytes are hashed and written (:func:`_pwrite_all`), the next one is produced: at most two
    tensors are alive at a time. Every file written to is fsynced before returning.

    Args:
        directory: where the files are (created at full size by :func:`create_files`).
        part: the placements to fill (:func:`split_parts`).
        specs: tensor name -> spec (dtype and shape) for every placement.
        produce: returns the tensor for a spec.
        progress: called with each tensor's bytes once it is written.

    Returns:
        Tensor name -> BLAKE3 hex digest (256 bits) of its data bytes.

    Raises:
        ConsolidationError: a placement's size differs from its spec's (the two sides planned different outputs), or a
            produced tensor does not match its spec; the message names the tensor.
        OffsetWritesRefusedError: the filesystem refuses to reopen a file or to write at an offset.
        OSError: a file cannot be opened, written or synced.
    """
    directory = Path(directory)
    digests: Dict[str, str] = {}
    fds: Dict[str, int] = {}
    writeback = _Writeback()
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="part-writer") as pool:
            pending: List[Tuple[Placement, Future]] = []  # the tensor being written, at most one

            def settle() -> None:
                for placement, written in pending:
                    digests[placement.name] = written.result()
                    writeback.written(fds[placement.file], placement.nbytes)
                    progress(placement.nbytes)

            for placement in part:
                spec = specs.get(placement.name)
                if spec is None or spec.nbytes != placement.nbytes:
                    raise ConsolidationError(
                        f"{placement.name}: placed as {placement.nbytes} bytes in {placement.file}, but this process "
                        f"plans it as {'nothing' if spec is None else f'{spec.nbytes} bytes'}; the writers disagree "
                        "on the checkpoint (did it change?)"
                    )
                tensor = produce(spec)
                if tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape):
                    raise ConsolidationError(
                        f"{spec.name}: produced {tensor.dtype} {tuple(tensor.shape)}, expected {spec}"
                    )
                data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
                settle()
                path = directory / placement.file
                if placement.file not in fds:
                    with _offsets_refused(path, "reopening a file to write it"):
                        fds[placement.file] = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
                pending = [(placement, pool.submit(_pwrite_all, fds[placement.file], data, placement.offset, path))]
                del tensor, data  # the future keeps the buffer alive until written and hashed
            settle()
        writeback.wait()
        with stage_times.timed("fsync"):
            for fd in fds.values():
                os.fsync(fd)
    finally:
        writeback.close()  # before the fds it syncs are closed
        for fd in fds.values():
            os.close(fd)
    return digests
