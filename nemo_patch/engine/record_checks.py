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

"""Checks on the stored records of a checkpoint's shard files as they are read: the archive's members, and CRC-32.

Each tensor chunk of a ``torch_dist`` checkpoint is one ``torch.save`` record (a zip archive) inside a ``.distcp``
file. :func:`open_record` gives a view of one record that refuses a compressed member, a member past the record's
end and members that share data (so what ``torch.load`` allocates is bounded by the record's bytes), and checks
each member's CRC-32 on the bytes as they are read: straight into the caller's memory
(:meth:`RecordWindow.read_member`), or by ``torch.load`` (one ``readinto`` of the member); a member read any other
way is streamed through ``zipfile`` by the returned ``finish``. The CRC-32 is ``zlib-ng``'s where installed.
"""

import io
import os
import zipfile
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

try:  # the same values as zlib's crc32, about 7 times faster
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is optional
    from zlib import crc32

__all__ = ["RecordWindow", "open_record"]

#: Bytes read (and checked) at a time by :meth:`RecordWindow.read_member`: small enough to stay in the CPU's cache.
_BLOCK = 1 << 20
_PIECES = 512  # the most pieces of memory one preadv call fills (Linux's IOV_MAX is 1024)
_Member = Tuple[int, int, int, str]  # data offset in the record, size, CRC-32, name


class RecordWindow(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of an open file from ``offset`` (a record in a shard file), and
    the record's ``members`` (``(data offset, size, CRC-32, name)``) once checked."""

    def __init__(self, file: Any, offset: int, length: int, members: Sequence[_Member] = (), where: str = "") -> None:
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0
        self.members, self.where = {member[0]: member for member in members}, where

    def member_at(self, start: int) -> Optional[_Member]:
        """The member whose data starts at byte ``start`` of the record, if any."""
        return self.members.get(start)

    def read_member(self, start: int, out: Union[memoryview, Iterable[memoryview]], size: int = -1) -> None:
        """Read the data of the member at ``start`` (:meth:`member_at`) into ``out``, one ``memoryview`` of its size
        or pieces that take its ``size`` bytes in order (the rows of a column block), with ``preadv`` in blocks of
        :data:`_BLOCK`, each block's CRC-32 taken (in a checked view) while it is in the CPU's cache.

        Raises:
            zipfile.BadZipFile: no such member, a size that differs, the record ends early, or (in a checked view) a
                CRC-32 that differs; naming the record.
        """
        pieces, size = ([out], len(out)) if isinstance(out, memoryview) else (out, size)
        member = self.members.get(start)
        if member is None or member[1] != size:
            raise zipfile.BadZipFile(f"{self.where}: no member of {size} bytes at byte {start}")
        crc, done, batch, batched = 0, 0, [], 0
        for block in (piece[at : at + _BLOCK] for piece in pieces for at in range(0, len(piece), _BLOCK)):
            batch.append(block)
            batched += len(block)
            if done + batched > size:
                raise zipfile.BadZipFile(f"{self.where}: more than the {size} bytes of member {member[3]} asked for")
            if batched >= _BLOCK or len(batch) >= _PIECES:
                crc, done, batch, batched = self._fill(member, batch, start + done, crc), done + batched, [], 0
        crc, done = self._fill(member, batch, start + done, crc), done + batched
        if done != size:
            raise zipfile.BadZipFile(f"{self.where}: {done} of the {size} bytes of member {member[3]} asked for")
        self._checked(member, crc)

    def _fill(self, member: _Member, batch: List[memoryview], pos: int, crc: int) -> int:
        """Fill ``batch`` with the record's bytes from ``pos`` on; return ``crc`` carried over them."""
        views, first = list(batch), 0
        while first < len(views):
            got = os.preadv(self._file.fileno(), views[first:], self._offset + pos)
            if got <= 0:
                left = sum(len(view) for view in views[first:])
                raise zipfile.BadZipFile(f"{self.where}: member {member[3]} ends {left} bytes early")
            pos += got
            while first < len(views) and got >= len(views[first]):
                got, first = got - len(views[first]), first + 1
            if got:
                views[first] = views[first][got:]
        for block in batch:
            crc = self._check(crc, block)
        return crc

    def _check(self, crc: int, data: memoryview) -> int:
        return crc

    def _checked(self, member: _Member, crc: int) -> None:
        pass

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


def _members(file: Any, offset: int, length: int) -> List[_Member]:
    """The record's members; ``zipfile.BadZipFile`` naming one that is compressed, past the end or sharing data."""
    members: List[_Member] = []
    with zipfile.ZipFile(RecordWindow(file, offset, length)) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise zipfile.BadZipFile(
                    f"member {info.filename} is compressed ({info.file_size} bytes from {info.compress_size}); "
                    "torch.save stores records uncompressed"
                )
            local = RecordWindow(file, offset, length)
            local.seek(info.header_offset)
            header = local.read(30)
            if len(header) < 30 or header[:4] != b"PK\x03\x04":
                raise zipfile.BadZipFile(f"bad local header of {info.filename}")
            start = info.header_offset + 30 + int.from_bytes(header[26:28], "little")
            start += int.from_bytes(header[28:30], "little")
            if start + info.file_size > length:
                raise zipfile.BadZipFile(
                    f"member {info.filename} declares {info.file_size} bytes from byte {start} of a {length}-byte "
                    "record"
                )
            members.append((start, info.file_size, info.CRC, info.filename))
    ordered = sorted(members)
    for (start, size, _, name), (other, _, _, other_name) in zip(ordered, ordered[1:]):
        if start + size > other:
            raise zipfile.BadZipFile(f"members {name} and {other_name} share data; torch.save writes each once")
    return members


class _CheckedWindow(RecordWindow):
    """A :class:`RecordWindow` that checks each member's CRC-32 on the bytes of a ``readinto`` of its whole data, or
    of a :meth:`read_member`."""

    def __init__(self, file: Any, offset: int, length: int, members: List[_Member], where: str) -> None:
        super().__init__(file, offset, length, members, where)
        self.pending: Dict[int, Tuple[int, int, str]] = {s: (n, c, name) for s, n, c, name in members if c and n}
        self.failed: List[str] = []

    def _check(self, crc: int, data: memoryview) -> int:
        return crc32(data, crc)

    def _checked(self, member: _Member, crc: int) -> None:
        if member[0] in self.pending and crc != member[2]:
            raise zipfile.BadZipFile(f"{self.where}: corrupt data (Bad CRC-32 for file {member[3]!r})")
        self.pending.pop(member[0], None)

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
        """Raise ``zipfile.BadZipFile`` for a bad CRC-32 seen, then check the members not read whole by streaming
        them through ``zipfile``."""
        if self.failed:
            raise zipfile.BadZipFile(f"Bad CRC-32 for file {self.failed[0]!r}")
        names = sorted({name for _, _, name in self.pending.values()})
        if names:
            with zipfile.ZipFile(RecordWindow(self._file, self._offset, self._length)) as archive:
                for name in names:
                    with archive.open(name) as member:  # checks the CRC-32 when read to its end
                        while member.read(1 << 20):
                            pass
        self.pending.clear()


def open_record(
    file: Any, offset: int, length: int, where: str, verify_checksums: bool = True
) -> Tuple[RecordWindow, Callable[[], None]]:
    """A view of one stored record of an open shard file, and the function to call once ``torch.load`` has read it.

    Args:
        file: the open shard file.
        offset: the record's first byte in the file; ``length``: its bytes.
        where: the file and record, for messages.
        verify_checksums: check the members' CRC-32 (the members' layout is checked either way).

    Raises:
        zipfile.BadZipFile: (from either) a compressed member, a member past the record's end, members sharing
            data, a bad CRC-32 or a corrupt archive, naming ``where``.
    """
    try:
        members = _members(file, offset, length)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as error:
        raise zipfile.BadZipFile(f"{where}: corrupt data ({error})") from error
    if not verify_checksums:
        return RecordWindow(file, offset, length, members, where), lambda: None
    window = _CheckedWindow(file, offset, length, members, where)

    def finish() -> None:
        try:
            window.finish()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as error:
            raise zipfile.BadZipFile(f"{where}: corrupt data ({error})") from error

    return window, finish
