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


"""Property-based fuzzing of ``nemo-consolidate`` over a real checkpoint that something has damaged or crafted.

Hypothesis draws one to three mutations of a real TP=2 checkpoint of a NeMo fit (the ``tp2_checkpoint`` fixture):
fields of the DCP metadata (tensor sizes, chunk offsets and sizes, dropped and repeated
chunks, dtypes, storage records' offsets, lengths and paths), the kinds of its files (a shard replaced by a FIFO, a
directory, a symlink out of ``weights/`` or to ``/dev/zero``, a truncated or bit-flipped shard, a truncated
``.metadata``), and megatron-core's ``metadata.json``. For every example it asserts:

* the exit code is a documented one (:mod:`nemo_patch.engine.errors`) and a failure prints exactly one line;
* nothing is published unless the run succeeded, and what is published equals the reference output tensor for tensor
  (no mutation drawn here can make a different output valid: chunks move without their storage records, record
  offsets move by a few bytes, paths are hostile);
* no file outside the output directory changed, no temporary directory is left;
* no code ran: an audit hook (``sys.addaudithook``) active during the run fails on process creation (``os.system``,
  ``subprocess.Popen``, ``os.exec*``, ``os.posix_spawn``, ``os.fork``), on ``exec``/``compile`` of source, and on the
  import of any module that was not already imported by an undamaged run;
* memory and time stay linear in the checkpoint's bytes: each run is a forked child
  (:func:`nemo_patch.testing.limits.run_limited`) whose address space may grow by :data:`SPARE_ADDRESS_SPACE` plus
  :data:`ADDRESS_SPACE_PER_BYTE` times the bytes of the checkpoint's files at most (``RLIMIT_AS``: an amplification
  fails allocating, and the example fails, instead of taking the machine), that is ended past a time budget, and whose
  peak resident memory beyond what it inherited and CPU seconds must stay within :data:`BYTES_PER_BYTE` and
  :data:`SECONDS_PER_BYTE` times those bytes plus :data:`SPARE_BYTES` and :data:`SPARE_SECONDS`. So an amplification
  no example of the round-2 tests shows is caught by the property.

The quick profile (CI) draws ``NEMO_PATCH_FUZZ_EXAMPLES`` examples, 40 by default (about a minute here); a long run is
``NEMO_PATCH_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_checkpoints.py``.
"""

import contextlib
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_untrusted_checkpoints import DOCUMENTED_EXIT_CODES, reference, tree_state, write_metadata

from nemo_patch.cli.nemo_consolidate import main as consolidate_main
from nemo_patch.engine.metadata_checks import read_dcp_metadata
from nemo_patch.engine.plan import model_tensor_keys
from nemo_patch.testing.limits import property_settings, run_limited

# Every test here starts from the real TP=2 fit of the tp2_checkpoint fixture.
pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("NEMO_PATCH_FUZZ_EXAMPLES", "40"))
FORBIDDEN_EVENTS = ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "exec",
                    "compile", "ctypes.dlopen")  # fmt: skip
HOSTILE_PATHS = ["../../outside.distcp", "/etc/passwd", "a/../../b", "..", ".", "", "missing.distcp", "\0x"]
#: Peak resident memory a run may add per byte of the checkpoint's files: the two output buffers and a chunk.
BYTES_PER_BYTE = 8
SPARE_BYTES = 256 << 20
#: Address space a run may add per byte, and beyond it (threads' stacks and malloc arenas are reserved, not used).
ADDRESS_SPACE_PER_BYTE = 16
SPARE_ADDRESS_SPACE = 2 << 30
#: CPU seconds per byte (a run reads, checks, hashes and writes each byte a few times) and beyond it (the plan, the
#: checks of the metadata, the CLI's set-up), generous for a shared machine; a run is ended at 4 times that wall time.
SECONDS_PER_BYTE = 2e-6
SPARE_SECONDS = 20.0


class _Guard:
    """An audit hook, installed once per process, that records forbidden events while :attr:`active`."""

    active = False
    known_modules: set = set()
    events: List[str] = []

    @classmethod
    def hook(cls, event: str, args: Tuple[Any, ...]) -> None:
        if not cls.active:
            return
        if event.startswith(FORBIDDEN_EVENTS):
            cls.events.append(f"{event} {args!r:.200}")
        elif event == "import" and args and args[0] not in sys.modules and args[0] not in cls.known_modules:
            cls.events.append(f"import {args[0]}")


sys.addaudithook(_Guard.hook)


def _mutate_metadata(weights: Path, change: Callable[[Any, List[str]], None]) -> None:
    """Apply ``change`` to the metadata; nothing when an earlier mutation left none to change (a truncated
    ``.metadata``, a tensor with no chunk left)."""
    try:
        metadata = read_dcp_metadata(weights)
    except Exception:  # noqa: B902 - damaged by an earlier mutation: this one has nothing to apply to
        return
    with contextlib.suppress(ZeroDivisionError):  # _pick from an empty list
        change(metadata, model_tensor_keys(metadata))
    write_metadata(weights.parent, metadata)


def _pick(items: List[Any], n: int) -> Any:
    return items[n % len(items)]


def apply(checkpoint: Path, outside: Path, kind: str, n: int, delta: int) -> None:
    """Apply one mutation to ``checkpoint`` (``n`` and ``delta`` choose where and how much)."""
    weights = checkpoint / "weights"
    shards = sorted(weights.glob("*.distcp"))

    def chunk_field(field: str) -> Callable[[Any, List[str]], None]:
        def change(metadata: Any, keys: List[str]) -> None:
            item = metadata.state_dict_metadata[_pick(keys, n)]
            chunk = _pick(item.chunks, n // 7)
            values = list(getattr(chunk, field))
            dim = (n // 3) % len(values)
            values[dim] = max(0, values[dim] + (delta or 1))
            setattr(chunk, field, torch.Size(values))

        return change

    def tensor_size(metadata: Any, keys: List[str]) -> None:
        item = metadata.state_dict_metadata[_pick(keys, n)]
        values = list(item.size)
        dim = (n // 3) % len(values)
        values[dim] = max(0, values[dim] + (delta or 1))
        item.size = torch.Size(values)

    def chunk_list(metadata: Any, keys: List[str]) -> None:
        chunks = metadata.state_dict_metadata[_pick(keys, n)].chunks
        if delta % 2:
            chunks.append(_pick(chunks, n // 7))
        elif len(chunks) > 0:
            del chunks[(n // 7) % len(chunks)]

    def dtype(metadata: Any, keys: List[str]) -> None:
        wrong = [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8]
        metadata.state_dict_metadata[_pick(keys, n)].properties.dtype = _pick(wrong, delta)

    def record(field: str) -> Callable[[Any, List[str]], None]:
        def change(metadata: Any, keys: List[str]) -> None:
            key = _pick(keys, n)
            info = _pick([i for index, i in metadata.storage_data.items() if index.fqn == key], n // 7)
            if field == "relative_path":
                info.relative_path = _pick(HOSTILE_PATHS, delta)
            else:
                setattr(info, field, max(0, getattr(info, field) + (delta or 1)))

        return change

    metadata_changes = {
        "chunk_offsets": chunk_field("offsets"),
        "chunk_sizes": chunk_field("sizes"),
        "tensor_size": tensor_size,
        "chunk_list": chunk_list,
        "dtype": dtype,
        "record_offset": record("offset"),
        "record_length": record("length"),
        "record_path": record("relative_path"),
    }
    if kind in metadata_changes:
        _mutate_metadata(weights, metadata_changes[kind])
        return
    shard = _pick(shards, n)
    if shard.is_symlink() or not shard.is_file():  # an earlier mutation made it a FIFO, directory or link
        return
    if kind == "shard_kind":
        shutil.copy(shard, outside)
        shard.unlink()
        choice = delta % 4
        if choice == 0:
            os.mkfifo(shard)
        elif choice == 1:
            shard.mkdir()
        elif choice == 2:
            shard.symlink_to(outside)
        else:
            shard.symlink_to("/dev/zero")
    elif kind == "shard_bytes":
        data = bytearray(shard.read_bytes())
        if delta % 2:
            del data[(n * 131) % len(data) :]  # truncated
        else:
            data[(n * 131) % len(data)] ^= 1 << (delta % 8)  # one bit flipped
        shard.write_bytes(bytes(data))
    elif kind == "metadata_truncated":
        data = (weights / ".metadata").read_bytes()
        (weights / ".metadata").write_bytes(data[: (n * 17) % len(data)])
    elif kind == "megatron_json":
        side = weights / "metadata.json"
        side.unlink()
        choice = delta % 3
        if choice == 0:
            os.mkfifo(side)
        elif choice == 1:
            side.write_text('{"sharded_backend": ')
        else:
            side.symlink_to("/dev/zero")


KINDS = ["chunk_offsets", "chunk_sizes", "tensor_size", "chunk_list", "dtype", "record_offset", "record_length",
         "record_path", "shard_kind", "shard_bytes", "metadata_truncated", "megatron_json"]  # fmt: skip
MUTATIONS = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 10**6), st.integers(-3, 3)), min_size=1, max_size=3
)


def _run(args: List[str]) -> Tuple[int, List[str]]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = consolidate_main(args + ["--quiet", "--workers", "1"])
    return code, [line for line in stderr.getvalue().splitlines() if line.strip()]


def _guarded_run(args: List[str]) -> Tuple[int, List[str], List[str]]:
    """:func:`_run` with the audit hook active; also the forbidden events it recorded."""
    _Guard.events, _Guard.active = [], True
    try:
        code, lines = _run(args)
    finally:
        _Guard.active = False
    return code, lines, list(_Guard.events)


def _file_bytes(root: Path) -> int:
    """The bytes of the regular files under ``root`` (links are not followed: one to ``/dev/zero`` holds none)."""
    return sum(os.lstat(path).st_size for path in root.rglob("*") if path.is_file() and not path.is_symlink())


@pytest.fixture(scope="module")
def warmed(tp2_checkpoint) -> Dict[str, torch.Tensor]:
    """The reference output; one undamaged run first, so that every module a run needs is already imported."""
    with tempfile.TemporaryDirectory() as scratch:
        assert _run([str(tp2_checkpoint), "--out", str(Path(scratch) / "out")])[0] == 0
    _Guard.known_modules = set(sys.modules)
    return reference(tp2_checkpoint)


@property_settings(EXAMPLES)
@given(mutations=MUTATIONS)
def test_damaged_checkpoints_fail_cleanly_or_give_the_reference_output(tp2_checkpoint, warmed, mutations):
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        checkpoint = root / "ckpts" / tp2_checkpoint.name
        shutil.copytree(tp2_checkpoint, checkpoint, ignore=shutil.ignore_patterns("consolidated"))
        outside = root / "outside.distcp"
        for kind, n, delta in mutations:
            apply(checkpoint, outside, kind, n, delta)
        output = root / "out"
        before = tree_state(root, output)
        size = _file_bytes(checkpoint)
        seconds = SECONDS_PER_BYTE * size + SPARE_SECONDS
        (code, lines, events), usage = run_limited(
            lambda: _guarded_run([str(checkpoint), "--out", str(output)]),
            ADDRESS_SPACE_PER_BYTE * size + SPARE_ADDRESS_SPACE,
            4 * seconds,
        )
        assert usage.peak_bytes <= BYTES_PER_BYTE * size + SPARE_BYTES, (size, usage, mutations)
        assert usage.cpu_seconds <= seconds, (size, usage, mutations)
        assert events == [], f"code ran during the consolidation: {events}"
        assert code in DOCUMENTED_EXIT_CODES, (code, lines)
        assert tree_state(root, output) == before, "a file outside the output changed"
        assert not [p for p in root.rglob(".consolidated*")], "a temporary directory was left"
        if code != 0:
            assert len(lines) == 1 and lines[0].startswith("nemo-consolidate: error: "), lines
            assert not output.exists()
            return
        got = load_file(str(output / "model.safetensors"))
        assert got.keys() == warmed.keys(), mutations
        assert all(torch.equal(got[name], warmed[name]) for name in warmed), mutations
