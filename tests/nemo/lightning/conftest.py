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

"""Checkpoints megatron-core saves on a CPU, and what PyTorch's own conversion reads from them (the oracle)."""

import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

#: Saves a small MoE GPT with megatron-core: 2 stacked layers, tensor-parallel chunks, 4 experts in 2 expert-parallel
#: chunks, an ``_extra_state`` entry; ``sys.argv[3]`` scales the weights.
SAVE = """
import os, sys, torch, torch.distributed as dist
def main():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.synchronize, torch.cuda.current_device = (lambda: None), (lambda: "cpu")  # no GPU on this runner
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    g, state, scale = torch.Generator().manual_seed(0), {}, float(sys.argv[3])
    for name, shape, split in (
        ("embedding.word_embeddings.weight", (64, 32), 0), ("decoder.final_layernorm.weight", (32,), None),
        ("decoder.layers.self_attention.linear_qkv.weight", (2, 96, 32), 1),
        ("decoder.layers.input_layernorm.weight", (2, 32), None),
        ("decoder.layers.mlp.experts.experts.linear_fc1.weight", (2, 4, 64, 32), 1),
        ("decoder.layers.mlp.router.weight", (2, 4, 32), None),
    ):
        full, stacked = torch.randn(shape, generator=g) * scale, name.startswith("decoder.layers.")
        for layer in range(2) if stacked else [None]:
            local = full[layer] if stacked else full
            for rank, chunk in enumerate(local.chunk(2, split - stacked) if split is not None else [local]):
                offsets = ([(0, layer, 2)] if stacked else []) + ([(split, rank, 2)] if split is not None else [])
                if "experts" in name:  # the expert axis: each chunk is 2 whole experts, one per expert-parallel rank
                    for expert in range(2):
                        state[f"{name}/{layer}/{rank}/{expert}"] = ShardedTensor.from_rank_offsets(
                            "module." + name, chunk[expert].clone(), (0, layer, 2), (1, 2 * rank + expert, 4),
                            replica_id=0, prepend_axis_num=2)
                    continue
                state[f"{name}/{layer}/{rank}"] = ShardedTensor.from_rank_offsets(
                    "module." + name, chunk.clone(), *offsets, replica_id=0, prepend_axis_num=int(stacked))
    extra = "module.decoder.final_layernorm._extra_state"
    state["extra"] = ShardedObject(extra, b"te state", (1,), (0,), replica_id=0)
    dist_checkpointing.save(state, sys.argv[1])
if __name__ == "__main__":
    main()
"""


def save_checkpoint(directory: Path, scale: float = 1.0) -> Dict[str, torch.Tensor]:
    """Save the model into ``directory/weights``; returns its tensors as PyTorch's ``dcp_to_torch_save`` reads them,
    stacked entries split as a consolidation names them."""
    (directory / "weights").mkdir(parents=True)
    port = str(29000 + hash(str(directory)) % 2000)
    command = [sys.executable, "-c", SAVE, str(directory / "weights"), port, str(scale)]
    subprocess.run(command, check=True, capture_output=True)
    dcp_to_torch_save(directory / "weights", directory.parent / f"{directory.name}.pt")
    expected = {}
    for key, tensor in torch.load(directory.parent / f"{directory.name}.pt", weights_only=True).items():
        name = key.removeprefix("module.")
        if not isinstance(tensor, torch.Tensor) or "_extra_state" in name or not key.startswith("module."):
            continue
        for layer in range(tensor.shape[0]) if name.startswith("decoder.layers.") else [None]:
            local, at = (
                (tensor, name) if layer is None else (tensor[layer], name.replace("layers.", f"layers.{layer}.", 1))
            )
            if ".experts.experts." in at:
                expected.update(
                    {at.replace("experts.experts", f"experts.local_experts.{e}"): local[e] for e in range(4)}
                )
            else:
                expected[at] = local
    return expected


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory) -> Tuple[Path, Dict[str, torch.Tensor]]:
    """A checkpoint directory megatron-core saved, and its tensors as PyTorch reads them."""
    directory = tmp_path_factory.mktemp("moe") / "model--step=9"
    return directory, save_checkpoint(directory)


@pytest.fixture(scope="session")
def save_megatron_checkpoint():
    """:func:`save_checkpoint`, for tests that need another checkpoint (e.g. with large weights)."""
    return save_checkpoint
