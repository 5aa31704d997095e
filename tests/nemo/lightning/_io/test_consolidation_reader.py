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

"""Reading checkpoints from elsewhere one layer at a time: every tensor equals PyTorch's own reading of it, and what a
crafted checkpoint holds is refused, naming it, before it can run code, hang or leave a part unread."""

import os
import pickle
import subprocess
import zipfile

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata

from nemo_patch.engine.checkpoint_layout import inspect_checkpoint
from nemo_patch.engine.errors import ConsolidationError, CorruptShardError
from nemo_patch.engine.metadata_checks import read_dcp_metadata
from nemo_patch.engine.tensor_sources import open_sources

pytestmark = [pytest.mark.unit, pytest.mark.run_only_on("CPU")]


def _read_all(checkpoint):
    sources = open_sources(inspect_checkpoint(checkpoint))
    produce = sources.producer(reuse=False)
    return {output.spec.name: produce(output.spec) for output in sources.outputs}


def _copy(checkpoint, tmp_path):
    tmp_path.mkdir(exist_ok=True)
    subprocess.run(["cp", "-r", str(checkpoint), str(tmp_path / checkpoint.name)], check=True)
    return tmp_path / checkpoint.name


def _rewrite_metadata(copy, change):
    """Re-pickle ``.metadata`` as PyTorch's own ``Metadata`` (the allowlist's stand-ins are not what DCP writes)."""
    metadata = read_dcp_metadata(copy / "weights")
    fields = {name: getattr(metadata, name) for name in ("state_dict_metadata", "planner_data", "storage_data")}
    change(fields)
    (copy / "weights" / ".metadata").write_bytes(pickle.dumps(Metadata(**fields)))


def test_every_tensor_read_a_layer_and_an_expert_at_a_time_equals_pytorchs_reading(moe_checkpoint):
    checkpoint, expected = moe_checkpoint
    tensors = _read_all(checkpoint)
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[name], tensor) for name, tensor in expected.items())
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in tensors


def test_a_metadata_naming_a_callable_runs_nothing(moe_checkpoint, tmp_path):
    copy, marker = _copy(moe_checkpoint[0], tmp_path), tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (copy / "weights" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        read_dcp_metadata(copy / "weights")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../secret", "/etc/passwd", "fifo"])
def test_a_record_naming_a_path_out_of_weights_or_not_a_file_is_refused_without_hanging(
    moe_checkpoint, tmp_path, name
):
    copy = _copy(moe_checkpoint[0], tmp_path)
    os.mkfifo(copy / "weights" / "fifo")

    def rename(fields):
        for info in fields["storage_data"].values():
            info.relative_path = name

    _rewrite_metadata(copy, rename)
    with pytest.raises(CorruptShardError, match=name.split("/")[-1]):
        _read_all(copy)


def test_overlapping_chunks_and_a_missing_layer_are_refused_naming_the_entry(moe_checkpoint, tmp_path):
    copy = _copy(moe_checkpoint[0], tmp_path)
    key = "module.decoder.layers.input_layernorm.weight"

    def overlap(fields):
        fields["state_dict_metadata"][key].chunks[1] = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1, 32]))

    _rewrite_metadata(copy, overlap)
    with pytest.raises(CorruptShardError, match="overlap"):
        _read_all(copy)

    def drop_layer_1(fields):  # from every stacked entry, chunks and records: only the layer counts say it is missing
        stacked = [k for k in fields["state_dict_metadata"] if k.startswith("module.decoder.layers.")]
        for entry in stacked:
            item = fields["state_dict_metadata"][entry]
            item.chunks = [chunk for chunk in item.chunks if chunk.offsets[0] != 1]
        records = fields["storage_data"].items()
        fields["storage_data"] = {i: info for i, info in records if i.fqn not in stacked or i.offset[0] != 1}

    copy = _copy(moe_checkpoint[0], tmp_path / "second")
    _rewrite_metadata(copy, drop_layer_1)
    with pytest.raises(ConsolidationError, match="layer 1"):
        _read_all(copy)


def test_a_changed_byte_of_a_record_fails_its_crc(moe_checkpoint, tmp_path):
    copy = _copy(moe_checkpoint[0], tmp_path)
    shard = max((copy / "weights").glob("*.distcp"), key=lambda path: path.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor's data
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=shard.name) as error:
        _read_all(copy)
    assert isinstance(error.value.__cause__, (zipfile.BadZipFile, RuntimeError, ValueError))
