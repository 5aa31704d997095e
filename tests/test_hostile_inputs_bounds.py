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

"""Resources bounded by the input's bytes, as a property: Hypothesis crafts ``.metadata`` pickles that apply the
allowlisted constructors (``torch.Size``, ``set``, ``frozenset``, ``OrderedDict``) and containers again and again to
memoised values, hash memoised tuples as keys, and nest them, and for every example asserts that reading it
(:func:`~nemo_patch.engine.metadata_checks.read_dcp_metadata`) either fails with ``pickle.UnpicklingError`` or
returns, within

* memory: the peak of Python's allocations (``tracemalloc``) at most :data:`BYTES_PER_BYTE` times the file's bytes
  plus :data:`SPARE_BYTES`, and the process's address space limited (``RLIMIT_AS``) to what it had plus
  :data:`SPARE_ADDRESS_SPACE` while the example runs (an amplification fails allocating instead of taking the machine);
* time: the CPU time of the example at most :data:`SECONDS_PER_BYTE` times the bytes plus :data:`SPARE_SECONDS`.

So an amplification the examples of :mod:`test_trust_round2` do not show is caught by the property: unbounded, the
files drawn here build or walk up to 10**11 elements from at most about 60 KB.

The tiling proof gets the same property in steps: crafted layouts (staircases, spirals, grids, random boxes) are proved
or refused within ``8 n log2(n) dims`` steps plus a constant.
"""

import contextlib
import os
import struct
import time
import tracemalloc
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from nemo_patch.engine import layout_checks
from nemo_patch.engine.errors import CorruptShardError, UnknownLayoutError
from nemo_patch.engine.metadata_checks import read_dcp_metadata
from nemo_patch.testing.limits import LimitExceeded, address_space_limited, property_settings, run_limited

#: Peak Python allocation per byte of the file: 4 elements per byte, each a pointer in a container or a small object.
BYTES_PER_BYTE = 400
SPARE_BYTES = 32 << 20
SPARE_ADDRESS_SPACE = 1 << 30
#: CPU time per byte (the opcode prescan takes well under 1 microsecond per opcode), generous for a shared machine.
SECONDS_PER_BYTE = 40e-6
SPARE_SECONDS = 3.0
EXAMPLES = int(os.environ.get("NEMO_PATCH_BOUNDS_EXAMPLES", "15"))

CONSTRUCTORS = [b"torch\nSize\n", b"builtins\nset\n", b"builtins\nfrozenset\n", b"collections\nOrderedDict\n"]


def _binget(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


@st.composite
def amplifying_pickles(draw: st.DrawFn) -> bytes:
    """A protocol-4 pickle: a constructor (memo 0), a list of ``items`` (memo 1), a tuple of ``items`` (memo 2), a
    tuple holding that one ``nest`` times (memo 3) and one holding memo 3 ``nest`` times (memo 4), then ``repeats``
    uses of them, each a few bytes."""
    constructor = draw(st.sampled_from(CONSTRUCTORS))
    items = draw(st.integers(1, 5_000))
    nest = draw(st.integers(1, 64))
    value = draw(st.sampled_from([b"K\x01", b"K\x07", b"N", b"\x88"]))
    body = b"\x80\x04c" + constructor + b"\x94"  # memo 0
    body += b"]\x94(" + value * items + b"e"  # memo 1: a list
    body += b"(" + value * items + b"t\x94"  # memo 2: a tuple
    body += b"(" + _binget(2) * nest + b"t\x94"  # memo 3: a tuple of tuples
    body += b"(" + _binget(3) * nest + b"t\x94"  # memo 4: a tuple of those (hashing it walks nest**2 * items)
    uses = {
        "apply-list": _binget(0) + _binget(1) + b"\x85R0",  # constructor(list)
        "apply-tuple": _binget(0) + _binget(4) + b"\x85R0",  # constructor(nested tuples)
        "key": b"}" + _binget(4) + b"Ns0",  # {nested tuples: None}: the key is hashed
        "set-of-keys": b"\x8f(" + _binget(2) + _binget(4) + b"\x90" + b"0",  # set().update(...): hashed
        "frozen": b"(" + _binget(4) + _binget(2) + b"\x91" + b"0",  # frozenset of them
        "list-of-refs": b"(" + _binget(1) * 8 + b"l0",  # a list of 8 references
    }
    chosen = draw(st.lists(st.sampled_from(sorted(uses)), min_size=1, max_size=3))
    repeats = draw(st.integers(1, 5_000))
    pattern = b"".join(uses[name] for name in chosen)
    return body + pattern * repeats + b"N."


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
@property_settings(EXAMPLES)
@given(data=amplifying_pickles())
def test_reading_a_crafted_metadata_costs_memory_and_time_linear_in_its_bytes(tmp_path_factory, data):
    import pickle

    directory = Path(tmp_path_factory.mktemp("bounds"))
    (directory / ".metadata").write_bytes(data)
    tracemalloc.start()
    started = time.process_time()
    try:
        with address_space_limited(SPARE_ADDRESS_SPACE):
            try:
                read_dcp_metadata(directory)
            except pickle.UnpicklingError:
                pass  # refused (the element bound, or not a Metadata): either way within the bounds below
        seconds = time.process_time() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= BYTES_PER_BYTE * len(data) + SPARE_BYTES, (len(data), peak)
    assert seconds <= SECONDS_PER_BYTE * len(data) + SPARE_SECONDS, (len(data), seconds)


# --- the tiling proof: steps linear in n log n -----------------------------------------------------------------------


def _bound(n: int, dims: int) -> int:
    return 8 * n * (n.bit_length() + 1) * dims + layout_checks._SPARE_STEPS


@st.composite
def layouts(draw: st.DrawFn) -> Tuple[List[int], List[Tuple[List[int], List[int]]]]:
    kind = draw(st.sampled_from(["staircase", "spiral", "grid", "random"]))
    n = draw(st.integers(1, 3000))
    if kind == "staircase":
        return [2 * n, n], [([i, n - 1 - i], [n - i, 1]) for i in range(n)]
    if kind == "spiral":
        boxes, x0, y0 = [], 0, 0
        while x0 < n and y0 < n:  # strips peeled alternately off the left and the top: each cut takes one
            if len(boxes) % 2 == 0:
                boxes.append(([x0, y0], [1, n - y0]))
                x0 += 1
            else:
                boxes.append(([x0, y0], [n - x0, 1]))
                y0 += 1
        return [n, n], boxes
    if kind == "grid":
        split = [draw(st.integers(1, 16)) for _ in range(3)]
        sizes = [4, 4, 4]
        shape = [k * s for k, s in zip(split, sizes)]
        return shape, [([a * 4, b * 4, c * 4], sizes) for a in range(split[0]) for b in range(split[1])
                       for c in range(split[2])]  # fmt: skip
    box = st.tuples(st.lists(st.integers(0, 50), min_size=2, max_size=2),
                    st.lists(st.integers(0, 10), min_size=2, max_size=2))  # fmt: skip
    return [60, 60], [(list(o), list(s)) for o, s in draw(st.lists(box, max_size=200))]


@property_settings(EXAMPLES)
@given(layout=layouts())
def test_the_tiling_proof_takes_at_most_n_log_n_steps_on_any_layout(layout):
    shape, boxes = layout
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
    count = [0]
    overlap, cut = layout_checks._overlap, layout_checks._cut

    def counted_overlap(a, b):  # type: ignore[no-untyped-def]
        count[0] += 1
        return overlap(a, b)

    def counted_cut(group, dim):  # type: ignore[no-untyped-def]
        count[0] += len(group)
        return cut(group, dim)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layout_checks, "_overlap", counted_overlap)
        patch.setattr(layout_checks, "_cut", counted_cut)
        with contextlib.suppress(CorruptShardError, UnknownLayoutError):
            layout_checks.check_chunk_tiling("t", shape, chunks)
    assert count[0] <= _bound(len(chunks), len(shape)), (len(chunks), count[0])


# --- the limits themselves -------------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_a_limited_child_reports_its_usage_and_fails_past_its_limits():
    """:func:`~nemo_patch.testing.limits.run_limited`, which the checkpoint fuzz runs every example in: the child's
    own peak memory and CPU time are reported, an allocation past its address space fails in the child, and a child
    past its time budget is ended."""
    value, usage = run_limited(lambda: len(bytearray(64 << 20)), SPARE_ADDRESS_SPACE, 60)
    assert value == 64 << 20 and 48 << 20 <= usage.peak_bytes < 256 << 20 and usage.cpu_seconds < 30
    with pytest.raises(AssertionError, match="MemoryError"):
        run_limited(lambda: len(bytearray(2 * SPARE_ADDRESS_SPACE)), SPARE_ADDRESS_SPACE, 60)
    with pytest.raises(LimitExceeded, match="time budget of 0.5 s"):
        run_limited(lambda: time.sleep(30), SPARE_ADDRESS_SPACE, 0.5)
