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

"""The one-pass read paths keep every check: a record's data read straight into its place (whole, or row by row for
a column block of its tensor) has its CRC-32 checked on the same bytes, a file that ends early is named, and nothing
more or less than the member's bytes is read."""

import io
import pickle
import zipfile
from pathlib import Path
from typing import List

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from nemo_patch.engine import dcp_reader, record_checks
from nemo_patch.engine.dcp_reader import DCPRegionReader
from nemo_patch.engine.metadata_checks import read_dcp_metadata
from nemo_patch.engine.record_checks import open_record

KEY = "module.output_layer.weight"
ROWS, COLUMNS = 48, 2048  # a column block of half the columns: rows of 4 KiB (fp32)


def _stored(data: bytes) -> bytes:
    """A zip record of one stored member, ``archive/data/0``, holding ``data``."""
    record = io.BytesIO()
    with zipfile.ZipFile(record, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data/0", data)
    return record.getvalue()


def _rows(memory: bytearray, count: int, length: int, stride: int) -> List[memoryview]:
    return [memoryview(memory)[i * stride : i * stride + length] for i in range(count)]


def test_a_member_read_in_pieces_lands_in_order_and_its_crc_is_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(record_checks, "_BLOCK", 3000)  # blocks that cut rows apart
    monkeypatch.setattr(record_checks, "_PIECES", 3)  # and batches of a few pieces
    data = bytes(range(256)) * 64  # 16 KiB: 16 rows of 1 KiB
    record = _stored(data)
    (tmp_path / "shard").write_bytes(record)
    with open(tmp_path / "shard", "rb") as handle:
        window, finish = open_record(handle, 0, len(record), "shard, record at byte 0")
        start = next(iter(window.members))
        memory = bytearray(2 * len(data))  # every other KiB: the rows of a column block
        window.read_member(start, iter(_rows(memory, 16, 1024, 2048)), len(data))
        finish()
        assert b"".join(bytes(row) for row in _rows(memory, 16, 1024, 2048)) == data
        assert bytes(memory[1024:2048]) == bytes(1024)  # the other column block is untouched
        with pytest.raises(zipfile.BadZipFile, match="no member of"):
            window.read_member(start, iter(_rows(memory, 15, 1024, 2048)), len(data) - 1024)
        with pytest.raises(zipfile.BadZipFile, match="asked for"):  # pieces that do not add up to the size given
            window.read_member(start, iter(_rows(memory, 15, 1024, 2048)), len(data))
        with pytest.raises(zipfile.BadZipFile, match="more than"):
            window.read_member(start, iter(_rows(memory, 16, 1100, 2048)), len(data))
    damaged = bytearray(record)
    damaged[damaged.index(data[:64]) + 5000] ^= 1
    (tmp_path / "damaged").write_bytes(bytes(damaged))
    with open(tmp_path / "damaged", "rb") as handle:
        window, _ = open_record(handle, 0, len(damaged), "damaged")
        with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
            window.read_member(start, iter(_rows(memory, 16, 1024, 2048)), len(data))


def test_a_member_of_a_file_that_ends_early_is_named(tmp_path):
    data = bytes(range(256)) * 64
    record = _stored(data)
    (tmp_path / "shard").write_bytes(record)
    with open(tmp_path / "shard", "rb") as handle:
        window, _ = open_record(handle, 0, len(record), "shard, record at byte 0")
        start = next(iter(window.members))
        (tmp_path / "shard").write_bytes(record[: start + 100])  # truncated after the members were read
        with pytest.raises(zipfile.BadZipFile, match=r"member archive/data/0 ends \d+ bytes early"):
            window.read_member(start, memoryview(bytearray(len(data))))


def _column_blocks(path: Path) -> torch.Tensor:
    """Save a tensor with ``dcp.save``, then store it again as two column blocks (tensor parallelism's split along
    dimension 1), each a record of its own appended to the shard file; return the tensor."""
    full = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(0))
    dcp.save({KEY: full}, checkpoint_id=str(path))
    metadata = read_dcp_metadata(path)
    ((index, info),) = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == KEY]
    shard = path / info.relative_path
    half = COLUMNS // 2
    chunks, storage = [], {}
    for block in range(2):
        buffer = io.BytesIO()
        torch.save(full[:, block * half : (block + 1) * half].contiguous(), buffer)
        offset = shard.stat().st_size
        with open(shard, "ab") as handle:
            handle.write(buffer.getvalue())
        offsets = torch.Size([0, block * half])
        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([ROWS, half])))
        storage[MetadataIndex(KEY, offsets)] = type(info)(info.relative_path, offset, len(buffer.getvalue()))
    metadata.state_dict_metadata[KEY].chunks = chunks
    metadata.storage_data = storage
    fields = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    (path / ".metadata").write_bytes(pickle.dumps(Metadata(**{name: getattr(metadata, name) for name in fields})))
    return full


def test_a_column_block_is_read_row_by_row_into_its_place_with_its_crc_checked(tmp_path, monkeypatch):
    full = _column_blocks(tmp_path / "ckpt")
    pieces: List[int] = []
    real_pieces = dcp_reader._pieces

    def counted(target, whole):  # type: ignore[no-untyped-def]
        found = real_pieces(target, whole)
        pieces.append(found is not None)
        return found

    def no_staging(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a column block went through the staging buffer")

    monkeypatch.setattr(dcp_reader, "_pieces", counted)
    monkeypatch.setattr(DCPRegionReader, "_staged", no_staging)
    reader = DCPRegionReader(tmp_path / "ckpt", read_dcp_metadata(tmp_path / "ckpt"))
    out = torch.full((ROWS, COLUMNS), float("nan"))
    assert torch.equal(reader.read(KEY, out=out), full) and pieces == [True, True]
    metadata = read_dcp_metadata(tmp_path / "ckpt")
    second = metadata.storage_data[MetadataIndex(KEY, torch.Size([0, COLUMNS // 2]))]
    with open(tmp_path / "ckpt" / second.relative_path, "r+b") as handle:  # one bit of the second block's data
        handle.seek(second.offset + second.length - 4096)
        byte = handle.read(1)
        handle.seek(second.offset + second.length - 4096)
        handle.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
        DCPRegionReader(tmp_path / "ckpt", metadata).read(KEY)


def test_rows_shorter_than_a_page_go_through_the_buffer():
    whole = torch.zeros(8, 64)
    assert dcp_reader._pieces(whole[:, :32], whole) is None  # rows of 128 bytes
    wide = torch.zeros(4, 4096)
    rows = list(dcp_reader._pieces(wide[:, 1024:2048], wide))
    assert [len(row) for row in rows] == [4096] * 4
    assert all(row.obj is rows[0].obj for row in rows)  # views of the tensor's own memory, not copies
