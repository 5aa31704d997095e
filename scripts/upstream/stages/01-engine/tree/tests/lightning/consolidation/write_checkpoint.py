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

"""Write a small ``torch_dist`` checkpoint with megatron-core's ``dist_checkpointing.save``, on the CPU (a test aid).

Usage: ``python write_checkpoint.py <checkpoint dir> <port>``. ``<checkpoint dir>/weights`` gets a GPT-like model
whose tensors are stored as tensor-parallel chunks (2 per tensor, along the dimension megatron-core shards), with
the decoder layers stacked as ``[layers, ...]`` entries, as NeMo saves them; ``<checkpoint dir>/reference.pt`` holds
the full tensors, one per layer, named as a consolidation names them.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

LAYERS, HIDDEN, VOCAB = 2, 32, 64
#: Name -> (global shape, the dimension tensor parallelism splits, or None when replicated), as in a GPT model.
PARAMS = {
    "embedding.word_embeddings.weight": ((VOCAB, HIDDEN), 0),
    "decoder.layers.self_attention.linear_qkv.weight": ((LAYERS, 3 * HIDDEN, HIDDEN), 1),
    "decoder.layers.self_attention.linear_proj.weight": ((LAYERS, HIDDEN, HIDDEN), 2),
    "decoder.layers.mlp.linear_fc1.weight": ((LAYERS, 4 * HIDDEN, HIDDEN), 1),
    "decoder.layers.mlp.linear_fc2.weight": ((LAYERS, HIDDEN, 4 * HIDDEN), 2),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": ((LAYERS, HIDDEN), None),
    "decoder.final_layernorm.weight": ((HIDDEN,), None),
    "output_layer.weight": ((VOCAB, HIDDEN), 0),
}
TP = 2


def main(out: Path, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_harness import megatron_on_cpu

    generator = torch.Generator().manual_seed(0)
    state, reference = {}, {}
    for name, (shape, tp_dim) in PARAMS.items():
        full = torch.randn(shape, generator=generator)
        stacked = name.startswith("decoder.layers.")
        for layer in range(LAYERS) if stacked else [None]:
            local = full[layer] if stacked else full
            offsets = [(0, layer, LAYERS)] if stacked else []
            prepend = 1 if stacked else 0
            reference[name.replace("layers.", f"layers.{layer}.") if stacked else name] = local.clone()
            if tp_dim is None:
                chunks = [(local, [])]
            else:  # the chunks two tensor-parallel ranks hold, saved here by one process
                dim = tp_dim - prepend
                chunks = [(chunk.clone(), [(tp_dim, rank, TP)]) for rank, chunk in enumerate(local.chunk(TP, dim))]
            for rank, (chunk, tp_offsets) in enumerate(chunks):
                state[f"module.{name}/{layer}/{rank}"] = ShardedTensor.from_rank_offsets(
                    f"module.{name}", chunk, *offsets, *tp_offsets, replica_id=0, prepend_axis_num=prepend
                )
    (out / "weights").mkdir(parents=True, exist_ok=True)
    with megatron_on_cpu():  # megatron-core's writer synchronizes CUDA; there is none here
        dist_checkpointing.save(state, str(out / "weights"))
    torch.save(reference, out / "reference.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
