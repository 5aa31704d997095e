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

"""The offline converter on a checkpoint megatron-core saved, compared with PyTorch's ``dcp_to_torch_save`` of it."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from nemo_patch.engine.converter import Consolidation
from nemo_patch.engine.errors import CorruptShardError, OutputExistsError, UnsupportedFormatError

pytestmark = [pytest.mark.unit, pytest.mark.run_only_on("CPU")]

#: Saves a GPT-like model with megatron-core: 2 stacked layers, tensors in tensor-parallel chunks.
SAVE = """
import os, sys, torch, torch.distributed as dist
def main():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.synchronize, torch.cuda.current_device = (lambda: None), (lambda: "cpu")  # no GPU on this runner
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    g, state = torch.Generator().manual_seed(0), {}
    for name, shape, tp in (
        ("embedding.word_embeddings.weight", (64, 32), 0), ("decoder.final_layernorm.weight", (32,), None),
        ("decoder.layers.self_attention.linear_qkv.weight", (2, 96, 32), 1),
        ("decoder.layers.mlp.linear_fc2.weight", (2, 32, 128), 2),
        ("decoder.layers.input_layernorm.weight", (2, 32), None),
    ):
        full, stacked = torch.randn(shape, generator=g), name.startswith("decoder.layers.")
        for layer in range(2) if stacked else [None]:
            local = full[layer] if stacked else full
            for rank, chunk in enumerate(local.chunk(2, tp - stacked) if tp is not None else [local]):
                offsets = ([(0, layer, 2)] if stacked else []) + ([(tp, rank, 2)] if tp is not None else [])
                state[f"{name}/{layer}/{rank}"] = ShardedTensor.from_rank_offsets(
                    "module." + name, chunk.clone(), *offsets, replica_id=0, prepend_axis_num=int(stacked))
    dist_checkpointing.save(state, sys.argv[1])
if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint directory and its tensors as ``dcp_to_torch_save`` converts them, layers split."""
    directory = tmp_path_factory.mktemp("ckpt") / "model--step=9"
    (directory / "weights").mkdir(parents=True)
    port = str(29500 + hash(str(directory)) % 1000)
    subprocess.run([sys.executable, "-c", SAVE, str(directory / "weights"), port], check=True, capture_output=True)
    dcp_to_torch_save(directory / "weights", directory.parent / "reference.pt")
    expected = {}
    for key, tensor in torch.load(directory.parent / "reference.pt", weights_only=True).items():
        name = key.removeprefix("module.")
        if name.startswith("decoder.layers."):
            expected.update({name.replace("layers.", f"layers.{i}.", 1): layer for i, layer in enumerate(tensor)})
        else:
            expected[name] = tensor
    return directory, expected


def test_each_tensor_equals_pytorch_conversion_of_the_checkpoint(checkpoint, tmp_path):
    directory, expected = checkpoint
    assert len(Consolidation(directory, tmp_path / "out").run()) == len(expected)
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], tensor) for name, tensor in expected.items())


def test_shards_from_the_command_line(checkpoint, tmp_path):
    directory, expected = checkpoint
    command = [sys.executable, "-m", Consolidation.__module__, str(directory), "--out", str(tmp_path / "out")]
    assert subprocess.run(command + ["--max-shard-size", "10KB"], capture_output=True).returncode == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(expected)
    written = {n: t for f in set(index["weight_map"].values()) for n, t in load_file(tmp_path / "out" / f).items()}
    assert all(torch.equal(written[name], tensor) for name, tensor in expected.items())
    assert subprocess.run(command, capture_output=True).returncode == OutputExistsError.exit_code


def test_other_layouts_and_a_truncated_shard_are_refused_and_leave_nothing(checkpoint, tmp_path):
    copy = tmp_path / checkpoint[0].name
    subprocess.run(["cp", "-r", str(checkpoint[0]), str(copy)], check=True)
    shard = max((copy / "weights").glob("*.distcp"), key=lambda path: path.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CorruptShardError, match=shard.name):
        Consolidation(copy).run()
    assert sorted(p.name for p in copy.iterdir()) == ["weights"]
    (copy / "weights" / "adapter_metadata.json").write_text("{}")
    with pytest.raises(UnsupportedFormatError, match="adapters only"):
        Consolidation(copy).run()
    (copy / "weights" / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(UnsupportedFormatError):
        Consolidation(copy).run()


def test_a_crafted_metadata_runs_nothing(checkpoint, tmp_path):
    copy, marker = tmp_path / checkpoint[0].name, tmp_path / "ran"
    subprocess.run(["cp", "-r", str(checkpoint[0]), str(copy)], check=True)
    (copy / "weights" / ".metadata").write_bytes(f"cposix\nsystem\n(S'touch {marker}'\ntR.".encode())  # os.system
    with pytest.raises(CorruptShardError, match="refusing to load posix.system"):
        Consolidation(copy).run()
    assert not marker.exists() and sorted(p.name for p in copy.iterdir()) == ["weights"]
