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

"""Write a 2-rank checkpoint with megatron-core's distributed-optimizer layout, on the CPU (a test helper).

megatron-core's ``DistributedOptimizer`` only accepts CUDA tensors, so it cannot run here. Its checkpoint layout can:
``fully_sharded_model_space`` optimizer state is saved as *flattened* ``ShardedTensor``s, each data-parallel rank
holding one contiguous flat range of every parameter's ``exp_avg`` / ``exp_avg_sq``
(``ShardedTensor.from_rank_offsets_flat``), next to the model weights (replicated over the 2 DP ranks). This script
saves exactly that with megatron-core's ``dist_checkpointing.save`` (``torch_dist``) in a real 2-process gloo group,
and writes the full model tensors to ``<out>/../reference.pt`` for comparison.

Usage: ``python tests/distributed_optimizer_checkpoint.py <out dir> <port>``
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, HIDDEN, VOCAB = 2, 16, 64
PARAMS = {
    "embedding.word_embeddings.weight": (VOCAB, HIDDEN),
    "decoder.layers.self_attention.linear_qkv.weight": (LAYERS, 3 * HIDDEN, HIDDEN),
    "decoder.layers.mlp.linear_fc1.weight": (LAYERS, 4 * HIDDEN, HIDDEN),
    "decoder.final_layernorm.weight": (HIDDEN,),
}


def _write(rank: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from nemo_patch.testing.cpu_harness import megatron_on_cpu

    generator = torch.Generator().manual_seed(0)  # the same on both ranks: replicated weights
    state, reference = {}, {}
    for name, shape in PARAMS.items():
        full = torch.randn(shape, generator=generator)
        reference[name] = full
        stacked = name.startswith("decoder.layers.")
        for layer in range(LAYERS) if stacked else [None]:
            local = full[layer] if stacked else full
            offsets = [(0, layer, LAYERS)] if stacked else []
            prepend = 1 if stacked else 0
            suffix = f"/{layer}" if stacked else ""
            state[f"module.{name}{suffix}"] = ShardedTensor.from_rank_offsets(
                f"module.{name}", local, *offsets, replica_id=rank, prepend_axis_num=prepend
            )
            numel, half = local.numel(), local.numel() // 2
            flat_range = slice(0, half) if rank == 0 else slice(half, numel)
            for moment in ("exp_avg", "exp_avg_sq"):
                values = torch.randn(numel, generator=generator)[flat_range].clone()
                state[f"optimizer.state.{moment}.module.{name}{suffix}"] = ShardedTensor.from_rank_offsets_flat(
                    f"optimizer.state.{moment}.module.{name}",
                    values,
                    tuple(local.shape),
                    *offsets,
                    flattened_range=flat_range,
                    replica_id=0,
                    prepend_axis_num=prepend,
                )
    with megatron_on_cpu():  # megatron-core's writer touches CUDA state; none here
        dist_checkpointing.save(state, out)
    if rank == 0:
        torch.save(reference, os.path.join(os.path.dirname(out), "reference.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    mp.spawn(_write, args=(sys.argv[1], sys.argv[2]), nprocs=2)
