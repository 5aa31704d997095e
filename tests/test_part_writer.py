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

"""``write_part`` on its own: what it writes, its digests, and every failure of its background work."""

import os
import threading

import pytest
import torch
from blake3 import blake3
from safetensors.torch import load_file

from nemo_patch.engine import part_writer
from nemo_patch.engine.digests import file_entry, verify_digests
from nemo_patch.engine.part_writer import create_files, split_parts, write_part
from nemo_patch.engine.plan import plan_shards
from nemo_patch.engine.safetensors_writer import OutputFile, TensorSpec, encode_header


def plan_files(specs, max_shard_size):
    """The output files of ``specs`` as the consolidation lays them out (``plan_shards``, then each file's header)."""
    return [
        OutputFile(name, encode_header(group, {"format": "pt"}), tuple(group))
        for name, group in plan_shards(specs, max_shard_size).items()
    ]


SIZES = [(1000,), (257, 3), (1,), (4096,), (33, 33)]


@pytest.fixture()
def layout(tmp_path):
    """Laid-out files (several) for five fp32 tensors (filled by ``write_part``), their specs and their values."""
    specs = [TensorSpec(f"layer.{i}.weight", torch.float32, shape) for i, shape in enumerate(SIZES)]
    files = plan_files(specs, max_shard_size=20_000)
    assert len(files) > 1
    create_files(tmp_path, files)
    values = {spec.name: torch.randn(spec.shape, generator=torch.Generator().manual_seed(i)) for i, spec in
              enumerate(specs)}  # fmt: skip
    return tmp_path, files, {spec.name: spec for spec in specs}, values


def _background_threads():
    return [t for t in threading.enumerate() if t.name.startswith(("part-writer", "part-writeback"))]


@pytest.mark.parametrize("parts", [1, 3])
def test_parts_fill_the_files_and_digest_every_tensor(layout, parts, monkeypatch):
    directory, files, specs, values = layout
    syncs = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(part_writer, "_WRITEBACK_BYTES", 5000)  # a writeback every few tensors of this tiny layout
    monkeypatch.setattr(part_writer.os, "fdatasync", lambda fd: syncs.append(fd) or real_fdatasync(fd))
    digests = {}
    for part in split_parts(files, parts):
        digests.update(write_part(directory, part, specs, lambda spec: values[spec.name]))
    assert digests == {name: blake3(value.numpy().tobytes()).hexdigest() for name, value in values.items()}
    loaded = {}
    for file in files:
        loaded.update(load_file(directory / file.name))
    assert loaded.keys() == values.keys() and all(torch.equal(loaded[n], values[n]) for n in values)
    total = sum(spec.nbytes for spec in specs.values())
    assert 1 <= len(syncs) <= total // 5000  # coalesced: not one fdatasync per tensor
    entries = {file.name: file_entry(file, digests) for file in files}
    assert all(entry["size"] == (directory / name).stat().st_size for name, entry in entries.items())
    assert not _background_threads()


def _fail(*args, **kwargs):
    raise OSError(5, "Input/output error (injected)")


@pytest.mark.parametrize("step", ["_pwrite_all", "new_digest", "_fdatasync", "produce"])
def test_a_failure_of_any_step_fails_the_part_and_leaves_no_thread(layout, step, monkeypatch):
    """Reading, writing, hashing and the background writeback each fail the part with their own error."""
    directory, files, specs, values = layout
    monkeypatch.setattr(part_writer, "_WRITEBACK_BYTES", 1)  # a writeback after every tensor
    produce = lambda spec: values[spec.name]  # noqa: E731
    if step == "produce":
        produce = _fail
    else:
        monkeypatch.setattr(part_writer, step, _fail)
    with pytest.raises(OSError, match="injected"):
        write_part(directory, split_parts(files, 1)[0], specs, produce)
    assert not _background_threads()


def test_a_tensor_that_does_not_match_its_spec_is_named(layout):
    directory, files, specs, values = layout
    wrong = dict(values, **{"layer.1.weight": values["layer.1.weight"].double()})
    with pytest.raises(Exception, match=r"layer\.1\.weight: produced torch\.float64"):
        write_part(directory, split_parts(files, 1)[0], specs, lambda spec: wrong[spec.name])
    assert not _background_threads()


def test_verify_digests_checks_a_part_written_output(layout):
    """``metadata.json`` built from the writers' digests checks out, and a flipped byte is named by tensor."""
    import json

    directory, files, specs, values = layout
    digests = write_part(directory, split_parts(files, 1)[0], specs, lambda spec: values[spec.name])
    entries = {file.name: file_entry(file, digests) for file in files}
    (directory / "metadata.json").write_text(json.dumps({"files": entries}))
    assert verify_digests(directory) == len(SIZES)
    target = files[0]
    spec, offset = next(iter(target.offsets()))
    with open(directory / target.name, "r+b") as handle:
        handle.seek(offset + 3)
        byte = handle.read(1)
        handle.seek(offset + 3)
        handle.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(Exception, match=rf"tensor {spec.name} differs from the BLAKE3 digest"):
        verify_digests(directory)
