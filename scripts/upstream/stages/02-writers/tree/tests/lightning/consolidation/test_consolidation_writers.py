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

"""Several writer processes fill one consolidation's files: the same bytes as one writer, from forked processes."""

import json
import runpy
import threading

import pytest
import torch
from conftest import ROOT
from nemo.lightning.io.consolidation.engine import parts
from nemo.lightning.io.consolidation.engine.consolidate import consolidate_checkpoint
from nemo.lightning.io.consolidation.engine.digests import verify_digests
from safetensors.torch import load_file

CONVERTER = ROOT / "scripts" / "checkpoint_converters" / "consolidate_nemo2_checkpoint.py"


def _files(directory):
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_three_writers_write_the_bytes_one_writer_writes(dist_checkpoint, tmp_path):
    checkpoint, reference = dist_checkpoint
    one = consolidate_checkpoint(checkpoint, tmp_path / "one", max_shard_size=40_000, workers=1).output_dir
    three = consolidate_checkpoint(checkpoint, tmp_path / "three", max_shard_size=40_000, workers=3, verify=True)
    assert _files(three.output_dir) == _files(one)  # metadata.json's per-tensor digests included
    assert len(json.loads((one / "metadata.json").read_text())["files"]) > 2  # shards and their index
    assert verify_digests(three.output_dir) == len(reference)
    tensors = {}
    for path in three.output_dir.glob("*.safetensors"):
        tensors.update(load_file(path))
    assert all(torch.equal(tensors[name], tensor) for name, tensor in reference.items())


def test_writers_are_forked_from_a_process_without_threads_or_process_groups():
    # This process imported NeMo (the package lives in it), which must not keep writers from being forked.
    if threading.active_count() != 1:
        pytest.skip("the test runner started a thread")
    assert parts._fork_is_safe() and parts._context().get_start_method() == "fork"
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:  # a thread's locks would be copied into the children without the thread: no fork then
        assert not parts._fork_is_safe() and parts._context().get_start_method() != "fork"
    finally:
        stop.set()
        other.join()


def test_a_failing_writer_fails_the_consolidation_and_leaves_nothing(dist_checkpoint, tmp_path):
    checkpoint, _ = dist_checkpoint
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="workers"):
        consolidate_checkpoint(checkpoint, out, workers=0)
    assert not out.exists()


def test_converter_script_with_writers(dist_checkpoint, tmp_path):
    checkpoint, _ = dist_checkpoint
    out = tmp_path / "converted"
    converter = runpy.run_path(str(CONVERTER))  # in this process: its writers are forked from it
    assert converter["main"]([str(checkpoint), "--out", str(out), "--workers", "2", "--max-shard-size", "40000"]) == 0
    reference = consolidate_checkpoint(checkpoint, tmp_path / "reference", max_shard_size=40_000).output_dir
    assert _files(out) == _files(reference)
