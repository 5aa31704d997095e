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

"""Trust, round 2: nothing outside the output is written, no small checkpoint takes unbounded memory or time, and no
URL is taken for a directory. One section per kind of attack, each a regression test of the whole kind, on a small
checkpoint ``torch.distributed.checkpoint.save`` writes (the CLI and the engine consolidate it as any other).

Memory is bounded for real: the attacks that used to take gigabytes run in a process whose address space is limited
(``RLIMIT_AS``), and must be refused there with their documented exit code, not fail allocating. Time is bounded by
counting the steps of the tiling proof, never by a clock.
"""

import contextlib
import errno
import io
import json
import math
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from nemo_patch.cli.nemo_consolidate import main as consolidate_main
from nemo_patch.engine import layout_checks
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.errors import CorruptShardError, UnknownLayoutError
from nemo_patch.engine.metadata_checks import read_dcp_metadata
from nemo_patch.engine.output_target import RemoteStorageError
from nemo_patch.engine.part_writer import OffsetWritesRefusedError
from nemo_patch.engine.record_checks import open_record
from nemo_patch.runs.post_command import run_post_command

EMBEDDING, NORM, OUTPUT = (
    "module.embedding.word_embeddings.weight",
    "module.decoder.final_layernorm.weight",
    ("module.output_layer.weight"),
)
#: The address space a process that consolidates (and verifies) this small checkpoint reaches is about 1.7 GB (Python,
#: torch and their threads); the attacks below took 1.7 to 8 GB more before they were refused.
ADDRESS_SPACE = 2560 << 20


# --- a small checkpoint, and running the CLI on it ----------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A ``dcp.save`` directory: an embedding and an output layer of one shape and dtype (so one's record could be
    read as the other's), and a norm."""
    path = tmp_path_factory.mktemp("trust") / "ckpt"
    generator = torch.Generator().manual_seed(0)
    state = {EMBEDDING: torch.randn(16, 8, generator=generator), NORM: torch.randn(8, generator=generator)}
    state[OUTPUT] = torch.randn(16, 8, generator=generator)
    dcp.save(state, checkpoint_id=str(path))
    return path


@pytest.fixture()
def ckpt(saved, tmp_path) -> Path:
    """A private copy of :func:`saved`."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    return copy


def expected(checkpoint: Path) -> Dict[str, torch.Tensor]:
    """The output of an undamaged ``checkpoint``, as PyTorch's own loader reads it."""
    metadata = read_dcp_metadata(checkpoint)
    state = {key: torch.empty(item.size, dtype=item.properties.dtype) for key, item in
             metadata.state_dict_metadata.items()}  # fmt: skip
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return {key.removeprefix("module."): tensor for key, tensor in state.items()}


def rewrite_metadata(checkpoint: Path, change: Callable[[Metadata], None]) -> None:
    """Change the metadata and write it back as PyTorch's own ``Metadata`` pickle."""
    metadata = read_dcp_metadata(checkpoint)
    change(metadata)
    fields = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    (checkpoint / ".metadata").write_bytes(
        pickle.dumps(Metadata(**{name: getattr(metadata, name) for name in fields}))
    )


def record_of(metadata: Metadata, key: str) -> Any:
    return next(info for index, info in metadata.storage_data.items() if index.fqn == key)


def append_record(checkpoint: Path, key: str, record: bytes) -> None:
    """Append ``record`` to the shard file of ``key`` and make it ``key``'s record."""
    metadata = read_dcp_metadata(checkpoint)
    shard = checkpoint / record_of(metadata, key).relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as handle:
        handle.write(record)

    def change(metadata: Metadata) -> None:
        info = record_of(metadata, key)
        info.offset, info.length = offset, len(record)

    rewrite_metadata(checkpoint, change)


def run_cli(args: List[str]) -> Tuple[int, List[str], List[str]]:
    """``nemo-consolidate`` in this process; returns (exit code, stdout lines, stderr lines)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        code = consolidate_main(args + ["--workers", "1"])
    lines = [line for line in stderr.getvalue().splitlines() if line.strip() and "pynvml" not in line]
    return code, stdout.getvalue().splitlines(), lines


def run_limited(args: List[str], cwd: Path) -> subprocess.CompletedProcess:
    """``nemo-consolidate`` in a process whose address space is limited to :data:`ADDRESS_SPACE`."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    command = [sys.executable, "-W", "ignore", "-m", "nemo_patch", *args, "--workers", "1", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, preexec_fn=limit)


def assert_one_line(code: int, lines: List[str], expected_code: int, *words: str) -> None:
    assert code == expected_code, lines
    assert len(lines) == 1 and lines[0].startswith("nemo-consolidate: error: "), lines
    for word in words:
        assert word in lines[0], lines


# --- 1. writes through planted links -------------------------------------------------------------------------------


@pytest.fixture()
def published(ckpt) -> Path:
    """A published output of ``ckpt``."""
    assert run_cli([str(ckpt), "--quiet"])[0] == 0
    return ckpt / "consolidated"


@pytest.mark.parametrize("planted", ["symlink", "dangling-symlink", "fifo", "file", "hard-link"])
def test_what_is_planted_at_the_post_command_log_is_replaced_never_written_through(published, tmp_path, planted):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    log = published.parent / "consolidated.post-command.log"
    if planted == "symlink":
        log.symlink_to(victim)
    elif planted == "dangling-symlink":
        log.symlink_to(tmp_path / "created-through-the-link")
    elif planted == "fifo":
        os.mkfifo(log)
    elif planted == "file":
        log.write_text("an old log\n")
    else:
        os.link(victim, log)
    result = run_post_command("echo written", published, "safetensors", 1, published.parent, timeout=60)
    assert result.ok, result
    assert victim.read_text() == "the user's file\n" and not (tmp_path / "created-through-the-link").exists()
    assert not log.is_symlink() and log.read_text() == "written\n"
    assert [p.name for p in published.parent.iterdir() if ".tmp-" in p.name] == []  # no temporary file left
    assert json.loads((published / "metadata.json").read_text())["post_command"]["returncode"] == 0


def test_a_directory_at_the_post_command_log_is_reported_and_nothing_runs(published, tmp_path):
    (published.parent / "consolidated.post-command.log").mkdir()
    marker = tmp_path / "ran"
    result = run_post_command(f"touch {marker}", published, "safetensors", 1, published.parent, timeout=60)
    assert not result.ok and "Is a directory" in str(result.error) and not marker.exists()
    assert [p.name for p in published.parent.iterdir() if ".tmp-" in p.name] == []


class _Opens:
    """Records the files this process opens (the ``open`` audit event of ``open()`` and ``os.open``)."""

    active = False
    seen: List[Tuple[str, int]] = []

    @classmethod
    def hook(cls, event: str, args: Tuple[Any, ...]) -> None:
        if cls.active and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            cls.seen.append((os.fsdecode(args[0]), args[2] if isinstance(args[2], int) else -1))


sys.addaudithook(_Opens.hook)


def test_every_file_the_cli_writes_in_a_checkpoint_is_new_or_in_its_own_directory(ckpt, tmp_path):
    """The whole kind: every file opened for writing under the checkpoint is created with ``O_EXCL`` (so nothing
    planted is opened: ``O_CREAT | O_EXCL`` fails on a symbolic link) or lies in a temporary directory this run made;
    every file of the checkpoint opened for reading is opened without blocking (``O_NONBLOCK``), but for the files
    this run wrote itself (its temporary directory, made with ``mkdtemp``, and its own output). The run publishes the
    default output (inside the checkpoint), verifies it and runs a post command."""
    _Opens.seen, _Opens.active = [], True
    try:
        code, _, lines = run_cli([str(ckpt), "--verify", "--post-command", "echo done", "--quiet"])
        code_verify, _, _ = run_cli([str(ckpt), "--verify", "--quiet"])  # --verify of the existing output
    finally:
        _Opens.active = False
    assert code == code_verify == 0, lines
    root = str(ckpt.resolve())
    written = read = 0
    for path, flags in _Opens.seen:
        resolved = os.path.realpath(path)
        if not resolved.startswith(root + os.sep) or flags < 0:
            continue
        in_own = any(part.startswith(".consolidated.tmp-") for part in Path(resolved).relative_to(root).parts)
        if flags & (os.O_WRONLY | os.O_RDWR):
            written += 1
            assert in_own or (flags & os.O_CREAT and flags & os.O_EXCL), (path, oct(flags))
        elif not in_own and "consolidated" not in Path(resolved).relative_to(root).parts[:1]:  # the run's own files
            read += 1
            assert flags & os.O_NONBLOCK, (path, oct(flags))
    assert written >= 3 and read >= 3  # the weights file and metadata.json, the log; .metadata, shards, side files


# --- 2. memory bounded by the bytes the checkpoint holds -----------------------------------------------------------


def _amplifying_pickle(constructor: bytes, items: int, repeats: int) -> bytes:
    """A protocol-4 pickle applying an allowlisted ``constructor`` (``module\\nname\\n``) again and again to one
    memoised list of ``items`` ints: ``repeats * items`` elements from about ``3 * repeats`` bytes."""
    body = b"\x80\x04c" + constructor + b"\x94]\x94(" + b"K\x01" * items + b"e0"
    return body + b"h\x00h\x01\x85R0" * repeats + b"N."


@pytest.mark.parametrize("constructor", [b"torch\nSize\n", b"builtins\nfrozenset\n", b"builtins\nset\n"])
def test_a_metadata_that_builds_more_than_its_bytes_allow_is_refused(tmp_path, constructor):
    (tmp_path / ".metadata").write_bytes(_amplifying_pickle(constructor, 20_000, 50_000))  # 10**9 elements, 0.4 MB
    with pytest.raises(pickle.UnpicklingError, match=r"builds more than \d+ elements .* from its \d+ bytes"):
        read_dcp_metadata(tmp_path)


def test_the_metadata_element_bound_leaves_dcp_metadata_far_below_it(saved):
    from nemo_patch.engine.pickle_limits import prescan

    data = (saved / ".metadata").read_bytes()
    assert 0 < prescan(data) < len(data)  # DCP's metadata walks less than one element per byte; the bound is 4


def test_a_metadata_over_the_element_bound_is_refused_before_anything_is_unpickled(tmp_path, monkeypatch):
    """The opcodes are checked first: the unpickler never runs, and refusing costs about the file's size (the
    element-counting unpickler kept each ``torch.Size`` of 20,000 elements until the bound: 6 MB)."""
    import tracemalloc

    from nemo_patch.engine import dcp_metadata

    monkeypatch.setattr(dcp_metadata, "_MetadataUnpickler", lambda *args: pytest.fail("the unpickler ran"))
    data = _amplifying_pickle(b"torch\nSize\n", 20_000, 0)[:-2] + b"(" + b"h\x00h\x01\x85R" * 50_000 + b"l."
    (tmp_path / ".metadata").write_bytes(data)  # 50,000 torch.Size of 20,000 elements each, kept in a list
    tracemalloc.start()
    try:
        with pytest.raises(pickle.UnpicklingError, match=r"builds more than \d+ elements"):
            read_dcp_metadata(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(data) + (1 << 20), (len(data), peak)


def _zip_aliasing(record: bytes, member: str, alias: str) -> bytes:
    """``record`` (a zip) with its central directory entry ``alias`` pointed at ``member``'s data."""
    data = bytearray(record)
    entries, at = {}, data.find(b"PK\x01\x02")
    while at >= 0:
        name_length = struct.unpack_from("<H", data, at + 28)[0]
        entries[bytes(data[at + 46 : at + 46 + name_length]).decode()] = at
        at = data.find(b"PK\x01\x02", at + 46)
    source, target = entries[member], entries[alias]
    data[target + 16 : target + 28] = data[source + 16 : source + 28]  # CRC-32, compressed and uncompressed sizes
    data[target + 42 : target + 46] = data[source + 42 : source + 46]  # the local header's offset
    return bytes(data)


def _record(*tensors: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors[0] if len(tensors) == 1 else list(tensors), buffer)
    return buffer.getvalue()


def _with_member_size(record: bytes, member: str, size: int) -> bytes:
    data = bytearray(record)
    at = data.find(b"PK\x01\x02")
    while data[at + 46 : at + 46 + len(member)] != member.encode():
        at = data.find(b"PK\x01\x02", at + 46)
    struct.pack_into("<II", data, at + 20, size, size)  # compressed, uncompressed
    return bytes(data)


@pytest.mark.parametrize("damage", ["aliased", "past-the-end"])
def test_record_members_that_share_data_or_lie_past_the_record_are_refused_before_torch_load(tmp_path, damage):
    """A central directory naming one stored member many times would make ``torch.load`` allocate it as often; a
    member declaring more bytes than the record has would make it allocate them."""
    record = _record(torch.zeros(4096), torch.ones(4096))
    names = [info.filename for info in zipfile.ZipFile(io.BytesIO(record)).infolist()]
    first, second = [name for name in names if "/data/" in name and not name.endswith(".pkl")][:2]
    crafted = (
        _zip_aliasing(record, first, second) if damage == "aliased" else _with_member_size(record, first, 1 << 31)
    )
    (tmp_path / "shard").write_bytes(crafted)
    with open(tmp_path / "shard", "rb") as handle:
        with pytest.raises(zipfile.BadZipFile, match="share data" if damage == "aliased" else "declares"):
            open_record(handle, 0, len(crafted), "shard, record at byte 0")


def test_an_aliased_record_exits_8_in_a_limited_address_space(ckpt, tmp_path):
    record = _record(torch.zeros(8))
    names = [info.filename for info in zipfile.ZipFile(io.BytesIO(record)).infolist()]
    data_member = next(name for name in names if name.endswith("/data/0"))
    version = next(name for name in names if name.endswith("/version"))
    append_record(ckpt, NORM, _zip_aliasing(record, data_member, version))
    proc = run_limited([str(ckpt), "--out", str(tmp_path / "out")], tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 8 and len(lines) == 1 and "share data" in lines[0], proc.stderr[-2000:]


@pytest.mark.parametrize("constructor", [b"torch\nSize\n", b"builtins\nfrozenset\n"])
def test_an_amplifying_metadata_exits_8_in_a_limited_address_space(ckpt, tmp_path, constructor):
    (ckpt / ".metadata").write_bytes(_amplifying_pickle(constructor, 20_000, 50_000))  # 8 GB of ints unbounded
    proc = run_limited([str(ckpt), "--out", str(tmp_path / "out")], tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 8 and len(lines) == 1 and "elements" in lines[0], proc.stderr[-2000:]


def test_side_files_an_output_names_are_read_in_blocks(published, tmp_path):
    """``--verify`` of an output whose ``metadata.json`` lists a 2 GiB sparse file (4 KB on disk), and a FIFO: the
    digests are checked in blocks, in a limited address space; the FIFO does not block."""
    manifest = json.loads((published / "metadata.json").read_text())
    (published / "sparse.json").touch()
    os.truncate(published / "sparse.json", 2 << 30)
    manifest["files"]["sparse.json"] = {"size": 2 << 30, "blake3": "0" * 64}
    (published / "metadata.json").write_text(json.dumps(manifest))
    proc = run_limited([str(published.parent), "--verify"], tmp_path)
    assert proc.returncode == 9 and "sparse.json differs from the BLAKE3 digest" in proc.stderr, proc.stderr[-2000:]
    (published / "sparse.json").unlink()
    os.mkfifo(published / "sparse.json")
    code, _, lines = run_cli([str(published.parent), "--verify"])
    assert_one_line(code, lines, 9, "sparse.json", "not a regular file")


def test_an_output_tensor_is_compared_by_its_headers_shape_before_it_is_read(published, monkeypatch):
    """A header may claim a tensor far larger than its source: the shape is compared first, and the data of a tensor
    whose shape differs is never read."""
    from safetensors import safe_open

    from nemo_patch.engine.verify import VerificationError, verify_consolidated

    tensors = load_file(str(published / "model.safetensors"))
    tensors["decoder.final_layernorm.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(published / "model.safetensors"), metadata={"format": "pt"})
    read: List[str] = []
    with safe_open(str(published / "model.safetensors"), framework="pt") as handle:
        get_tensor = type(handle).get_tensor
    monkeypatch.setattr(type(handle), "get_tensor", lambda self, name: read.append(name) or get_tensor(self, name))
    with pytest.raises(VerificationError, match=r"decoder.final_layernorm.weight .* has shape \[64, 64\]"):
        verify_consolidated(published.parent, published)
    assert "decoder.final_layernorm.weight" not in read


def test_common_pt_with_aliased_members_is_not_unpickled(tmp_path):
    from nemo_patch.runs.best_checkpoint import read_checkpoint_callback_state

    state = {"callbacks": {"ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}": {"best_model_score": 1.0}}}
    buffer = io.BytesIO()
    torch.save({**state, "a": torch.zeros(64), "b": torch.zeros(64)}, buffer)
    names = [info.filename for info in zipfile.ZipFile(io.BytesIO(buffer.getvalue())).infolist()]
    members = [name for name in names if "/data/" in name and not name.endswith(".pkl")]
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "common.pt").write_bytes(buffer.getvalue())
    assert read_checkpoint_callback_state(tmp_path) is not None  # as saved: read
    (tmp_path / "weights" / "common.pt").write_bytes(_zip_aliasing(buffer.getvalue(), members[0], members[1]))
    assert read_checkpoint_callback_state(tmp_path) is None  # not unpickled: the names are used instead


# --- 3. time: the tiling proof and the plan in O(n log n) ----------------------------------------------------------


def _chunks(boxes: List[Tuple[List[int], List[int]]]) -> List[ChunkStorageMetadata]:
    return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in boxes]


def _bound(n: int, dims: int) -> int:
    return 8 * n * (n.bit_length() + 1) * dims


@pytest.fixture()
def compared(monkeypatch) -> List[int]:
    """Counts the pairwise comparisons of chunks the tiling proof makes."""
    count = [0]
    overlap = layout_checks._overlap

    def counted(a: Any, b: Any) -> bool:
        count[0] += 1
        return overlap(a, b)

    monkeypatch.setattr(layout_checks, "_overlap", counted)
    return count


def test_a_staircase_of_30000_chunks_takes_n_log_n_steps_and_no_pairwise_comparison(compared):
    """Each chunk meets every later one along dimension 0 (the layout that took 50 minutes); a cut along dimension 1
    separates them all."""
    n = 30_000
    chunks = _chunks([([i, n - 1 - i], [n - i, 1]) for i in range(n)])
    steps = layout_checks.check_chunk_tiling("staircase", [2 * n, n], chunks)
    assert steps <= _bound(n, 2) and compared[0] == 0


@pytest.mark.parametrize(
    "shape, split",
    [([61, 256, 4096, 2048], [61, 256, 2, 1]), ([61, 64, 4096, 2048], [61, 16, 4, 8]), ([96, 8192, 4096], [96, 8, 1])],
    ids=["moe-61x256-etp2", "moe-tp8", "dense-96-layers-tp8"],
)
def test_parallelism_grids_take_n_log_n_steps(compared, shape, split):
    import itertools

    sizes = [size // k for size, k in zip(shape, split)]
    boxes = [([i * n for i, n in zip(index, sizes)], sizes) for index in itertools.product(*(range(k) for k in split))]
    steps = layout_checks.check_chunk_tiling("grid", shape, _chunks(boxes))
    assert steps <= _bound(len(boxes), len(shape)) and compared[0] == 0


def _spiral(n: int) -> List[Tuple[List[int], List[int]]]:
    """Strips peeled alternately off the left and the top of an n x n square: each cut separates one strip only."""
    boxes, (x0, y0) = [], (0, 0)
    while x0 < n and y0 < n:
        if len(boxes) % 2 == 0:
            boxes.append(([x0, y0], [1, n - y0]))
            x0 += 1
        else:
            boxes.append(([x0, y0], [n - x0, 1]))
            y0 += 1
    return boxes


def test_a_layout_the_proof_cannot_take_apart_in_n_log_n_steps_is_refused_within_them(compared, monkeypatch):
    steps = [0]
    cut = layout_checks._cut

    def counted(group: List[Any], dim: int) -> List[List[Any]]:
        steps[0] += len(group)
        return cut(group, dim)

    monkeypatch.setattr(layout_checks, "_cut", counted)
    boxes = _spiral(8000)
    with pytest.raises(UnknownLayoutError, match=r"spiral: proving that its 15999 chunks do not overlap would take"):
        layout_checks.check_chunk_tiling("spiral", [8000, 8000], _chunks(boxes))
    assert steps[0] + compared[0] <= _bound(len(boxes), 2)
    assert layout_checks.check_chunk_tiling("small spiral", [20, 20], _chunks(_spiral(20))) > 0  # still proved


def _brute_force_overlap(boxes: List[Tuple[List[int], List[int]]]) -> bool:
    for i, (a_offsets, a_sizes) in enumerate(boxes):
        for b_offsets, b_sizes in boxes[i + 1 :]:
            if a_offsets == b_offsets:
                return True
            if all(s > 0 for s in a_sizes + b_sizes) and all(
                ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_offsets, a_sizes, b_offsets, b_sizes)
            ):
                return True
    return False


def test_the_tiling_proof_finds_exactly_the_overlaps_pairwise_comparison_finds():
    from hypothesis import given
    from hypothesis import strategies as st

    from nemo_patch.testing.limits import property_settings

    box = st.tuples(
        st.lists(st.integers(0, 6), min_size=3, max_size=3), st.lists(st.integers(0, 4), min_size=3, max_size=3)
    )

    @property_settings(300)
    @given(st.lists(box, min_size=0, max_size=12))
    def check(boxes: List[Tuple[List[int], List[int]]]) -> None:
        overlapping = _brute_force_overlap(boxes)
        try:
            layout_checks.check_chunk_tiling("t", [10, 10, 10], _chunks(boxes))
        except CorruptShardError:
            assert overlapping, boxes
            return
        assert not overlapping, boxes

    check()


def test_layer_counts_and_zero_element_chunks_cost_nothing():
    """A chunk of 10**15 layers (and no element) is an interval, not 10**15 layers; as many zero-element chunks over
    2**19 layers each are refused by the plan's bound on (output, chunk) pairs, not enumerated."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    from nemo_patch.engine.plan import plan_outputs

    def entry(size: List[int], boxes: List[Tuple[List[int], List[int]]]) -> Any:
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), _chunks(boxes))

    stack = {"module.decoder.layers.x.weight": entry([10**15, 0], [([0, 0], [10**15, 0])])}
    layout_checks.check_no_missing_layer(Metadata(stack), list(stack))  # every layer held: no hole
    stack["module.decoder.layers.y.weight"] = entry([10**15, 2], [([0, 0], [5, 2]), ([6, 0], [10**15 - 6, 2])])
    with pytest.raises(CorruptShardError, match=r"module.decoder.layers.y.weight\[5\]: .* holds layer 5 of the"):
        layout_checks.check_no_missing_layer(Metadata(stack), ["module.decoder.layers.y.weight"])
    wide = entry([1 << 19, 4, 0], [([0, i, 0], [1 << 19, 1, 0]) for i in range(4)])
    with pytest.raises(UnknownLayoutError, match="too many output tensors"):
        plan_outputs(Metadata({"module.decoder.layers.y.weight": wide}))


def test_reading_each_layer_reads_only_the_chunks_that_hold_it(tmp_path, monkeypatch):
    """Each layer of a stacked entry is read from its own chunks: the chunks handed to PyTorch's read planner over
    all layers are the chunks in all, not layers times chunks."""
    from nemo_patch.engine import dcp_reader
    from nemo_patch.engine.checkpoint_layout import inspect_checkpoint
    from nemo_patch.engine.tensor_sources import open_sources

    layers = 24
    stacked = torch.randn(layers, 4, 6)
    state = {f"module.decoder.layers.mlp.w.{layer}": stacked[layer : layer + 1].clone() for layer in range(layers)}
    dcp.save(state, checkpoint_id=str(tmp_path / "flat"))

    def stack(metadata: Metadata) -> None:  # one entry of 24 layers, a chunk each (each saved record)
        from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

        key, records, chunks = "module.decoder.layers.mlp.w", {}, []
        for layer in range(layers):
            info = record_of(metadata, f"module.decoder.layers.mlp.w.{layer}")
            offsets = torch.Size([layer, 0, 0])
            chunks.append(ChunkStorageMetadata(offsets, torch.Size([1, 4, 6])))
            records[MetadataIndex(key, offsets)] = info
        metadata.state_dict_metadata = {key: TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                   torch.Size([layers, 4, 6]), chunks)}  # fmt: skip
        metadata.storage_data = records

    rewrite_metadata(tmp_path / "flat", stack)
    handed: List[int] = []
    planner = dcp_reader.create_read_items_for_chunk_list

    def counted(fqn: str, item: Any, wanted: Any) -> Any:
        handed.append(len(item.chunks))
        return planner(fqn, item, wanted)

    monkeypatch.setattr(dcp_reader, "create_read_items_for_chunk_list", counted)
    sources = open_sources(inspect_checkpoint(tmp_path / "flat"))
    produce = sources.producer(reuse=False)
    got = {output.spec.name: produce(output.spec) for output in sources.outputs}
    assert len(got) == layers and all(torch.equal(got[f"decoder.layers.{i}.mlp.w"], stacked[i]) for i in range(layers))
    assert handed == [1] * layers


# --- 5. records compared by file identity ----------------------------------------------------------------------------


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_link_in_weights_cannot_make_two_records_share_bytes(ckpt, tmp_path, link):
    """The output layer's record named through a link to the shard, at the embedding's bytes: layer 1 would be
    published with layer 0's bytes."""
    metadata = read_dcp_metadata(ckpt)
    shard = record_of(metadata, EMBEDDING).relative_path
    if link == "symlink":
        (ckpt / "alias.distcp").symlink_to(shard)
    else:
        os.link(ckpt / shard, ckpt / "alias.distcp")

    def alias(metadata: Metadata) -> None:
        source, target = record_of(metadata, EMBEDDING), record_of(metadata, OUTPUT)
        target.relative_path, target.offset, target.length = "alias.distcp", source.offset, source.length

    rewrite_metadata(ckpt, alias)
    code, _, lines = run_cli([str(ckpt), "--out", str(tmp_path / "out")])
    assert_one_line(code, lines, 8, "alias.distcp", "the same file as", "overlaps")
    assert not (tmp_path / "out").exists()


def test_a_hard_linked_shard_with_records_of_its_own_is_consolidated(ckpt, tmp_path):
    """Links are not refused: a checkpoint made of hard links (a snapshot) is read as usual."""
    metadata = read_dcp_metadata(ckpt)
    os.link(ckpt / record_of(metadata, OUTPUT).relative_path, ckpt / "alias.distcp")
    rewrite_metadata(ckpt, lambda metadata: setattr(record_of(metadata, OUTPUT), "relative_path", "alias.distcp"))
    code, _, lines = run_cli([str(ckpt), "--out", str(tmp_path / "out"), "--verify"])
    assert code == 0, lines
    got, want = load_file(str(tmp_path / "out" / "model.safetensors")), expected(ckpt)
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)


# --- 6. exit codes and one-line messages -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.qint8, torch.bits8, torch.uint1, torch.quint4x2, torch.complex64])
def test_a_dtype_without_a_safetensors_encoding_exits_8_naming_the_entry(ckpt, tmp_path, dtype):
    rewrite_metadata(ckpt, lambda metadata: setattr(metadata.state_dict_metadata[NORM].properties, "dtype", dtype))
    code, _, lines = run_cli([str(ckpt), "--out", str(tmp_path / "out")])
    assert_one_line(code, lines, 8, NORM, str(dtype), "no safetensors encoding")
    with pytest.raises(CorruptShardError, match="no safetensors encoding"):
        consolidate_checkpoint(ckpt, tmp_path / "api")


class _Payload:
    def __reduce__(self) -> Tuple[Any, ...]:
        return os.system, ("true",)


def test_a_record_naming_a_refused_global_prints_one_line(ckpt, tmp_path):
    append_record(ckpt, NORM, _record(_Payload()))
    code, _, lines = run_cli([str(ckpt), "--out", str(tmp_path / "out")])
    assert_one_line(code, lines, 8, "refused it", "system")


# --- 7. URLs -------------------------------------------------------------------------------------------------------

URLS = ["s3://bucket/out", "msc://profile/bucket/out", "gs://bucket/out", "https://host/out", "az+blob://c/out"]


@pytest.mark.parametrize("url", URLS)
def test_a_url_for_the_output_or_the_checkpoint_exits_19_and_writes_nothing(ckpt, tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    code, _, lines = run_cli([str(ckpt), "--out", url])
    assert_one_line(code, lines, RemoteStorageError.exit_code, url, "is a URL", "--post-command")
    code, _, lines = run_cli([url.replace("out", "ckpt")])
    assert_one_line(code, lines, 19, url.replace("out", "ckpt"), "is a URL")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no s3:/ or msc:/ directory made here
    with pytest.raises(RemoteStorageError, match="is a URL"):
        consolidate_checkpoint(ckpt, url)
    with pytest.raises(RemoteStorageError, match="is a URL"):
        consolidate_checkpoint(Path(url.replace("out", "ckpt")), tmp_path / "out")  # as pathlib leaves it: s3:/
    assert not (tmp_path / "out").exists()


def test_a_local_directory_named_like_a_scheme_is_given_as_a_relative_path(ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, lines = run_cli([str(ckpt), "--out", "./s3:/out", "--quiet"])
    assert code == 0 and (tmp_path / "s3:" / "out" / "model.safetensors").is_file(), lines


# --- 8. write-once filesystems ---------------------------------------------------------------------------------------


@pytest.fixture()
def write_once(monkeypatch) -> None:
    """A filesystem that takes a file written front to back only: writing at an offset, setting a size and opening
    an existing file for writing are refused as a Databricks volume refuses them."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR) and not flags & os.O_CREAT:
            refused()
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "pwrite", refused)
    monkeypatch.setattr(os, "ftruncate", refused)
    monkeypatch.setattr(os, "open", open_)


def test_one_writer_writes_front_to_back_on_a_write_once_filesystem(ckpt, tmp_path, write_once):
    result = consolidate_checkpoint(ckpt, tmp_path / "out", workers=1, verify=True)
    got, want = load_file(str(result.output_dir / "model.safetensors")), expected(ckpt)
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)


def test_several_writers_on_a_write_once_filesystem_say_to_use_one(ckpt, tmp_path, write_once):
    from nemo_patch.engine.parts import run_part

    def in_this_process(jobs: List[Any], sources: Any) -> List[Any]:
        return [run_part(job, sources) for job in jobs]

    with pytest.raises(OffsetWritesRefusedError, match=r"write-once filesystem .* one writer \(workers=1\)") as error:
        consolidate_checkpoint(ckpt, tmp_path / "out", parts=2, parts_runner=in_this_process)
    assert error.value.exit_code == 20 and not (tmp_path / "out").exists()


# --- 4. loading a context: files proven safe to open, off the network --------------------------------------------


def _context(tmp_path: Path, objects: Dict[str, Any]) -> Path:
    context = tmp_path / "context"
    context.mkdir()
    (context / "io.json").write_text(json.dumps({"root": {"type": "ref", "key": "x"}, "objects": objects}))
    return context


def test_context_files_nemo_would_open_are_proven_regular_and_bounded(tmp_path):
    from nemo_patch.export.context_trust import check_context_files
    from nemo_patch.export.errors import UntrustedContextError

    context = _context(tmp_path, {"a": {"items": [["IdentityElement()", "nemo_tokenizer"]]}})
    (context / "nemo_tokenizer").mkdir()
    (context / "nemo_tokenizer" / "tokenizer.json").write_text("{}")
    check_context_files(context)  # a directory and regular files
    os.mkfifo(context / "nemo_tokenizer" / "vocab.txt")
    with pytest.raises(UntrustedContextError, match="vocab.txt is not a regular file"):
        check_context_files(context)
    (context / "nemo_tokenizer" / "vocab.txt").unlink()
    (context / "nemo_tokenizer" / "merges.txt").symlink_to("/etc/hostname")
    with pytest.raises(UntrustedContextError, match="merges.txt is a symbolic link"):
        check_context_files(context)
    (context / "nemo_tokenizer" / "merges.txt").unlink()
    os.mkfifo(tmp_path / "elsewhere")
    for named in ("/dev/zero", str(tmp_path / "elsewhere"), "../elsewhere"):
        (context / "io.json").write_text(json.dumps({"objects": {"a": {"items": [["IdentityElement()", named]]}}}))
        with pytest.raises(UntrustedContextError, match="names .* which is not a regular file"):
            check_context_files(context)


def test_a_hub_artifact_is_refused_and_nothing_is_fetched(tmp_path):
    from nemo_patch.export.context_trust import check_context_files
    from nemo_patch.export.errors import UntrustedContextError

    artifact = {"type": "pyref", "module": "nemo.lightning.io.artifact.file", "name": "DirOrStringArtifact"}
    objects = {
        "meta": {"items": [["Attr(name='fn_or_cls')", artifact]], "metadata": None},
        "hub": {"type": {"type": "pyref", "module": "fiddle._src.config", "name": "Config"},
                "items": [["Attr(name='attr')", {"type": "leaf", "value": "meta-llama/Llama-3.1-8B"}]],
                "metadata": {"type": "ref", "key": "meta"}},
    }  # fmt: skip
    with pytest.raises(UntrustedContextError, match="'meta-llama/Llama-3.1-8B' as a hub artifact"):
        check_context_files(_context(tmp_path, objects))


def test_an_untrusted_context_is_loaded_off_the_network(monkeypatch):
    from nemo_patch.export.context_trust import offline

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    import huggingface_hub.constants

    with offline():
        assert os.environ["HF_HUB_OFFLINE"] == os.environ["TRANSFORMERS_OFFLINE"] == "1"
        assert huggingface_hub.constants.HF_HUB_OFFLINE is True
        for connect in (lambda: socket.getaddrinfo("huggingface.co", 443),
                        lambda: socket.create_connection(("127.0.0.1", 9), timeout=1)):  # fmt: skip
            with pytest.raises(OSError, match="network access .* refused"):
                connect()
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["TRANSFORMERS_OFFLINE"] == "0"
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False
    with contextlib.suppress(OSError):  # outside the block, sockets are this process's own business again
        socket.getaddrinfo("localhost", 9)


def test_the_tiling_bound_is_linear_in_chunks_times_their_logarithm():
    assert _bound(30_000, 2) / 30_000 < 300 and math.log2(30_000) < 15
