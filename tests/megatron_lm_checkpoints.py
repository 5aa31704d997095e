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

"""Write a Megatron-LM-layout save directory on the CPU (a test helper): ``iter_<N>/`` per save and
``latest_checkpointed_iteration.txt`` rewritten after each, as Megatron-LM's and Megatron-Bridge's ``save_checkpoint``
do.

A tiny megatron-core ``GPTModel`` (local layer spec, 2 layers, untied output layer) is built with tensor parallelism 2
in a 2-process gloo group; before each save an Adam step with random gradients changes every weight. Each save is
megatron-core's ``dist_checkpointing.save`` of the state dict Megatron-LM builds: ``model`` (the model's
``sharded_state_dict()``), ``optimizer`` (Adam's state as ``optimizer.state.exp_avg.<key>`` sharded tensors),
``rng_state`` (a ``ShardedObject``), and ``args`` (an ``argparse.Namespace``, which lands in ``common.pt``),
``iteration`` and ``checkpoint_version``. With ``--no-tracker-for N`` the tracker is not moved to iteration ``N`` (a
save that has not been finalized). ``--pause SECONDS`` waits between saves.

Usage: ``python tests/megatron_lm_checkpoints.py <root> <port> <iteration>[,<iteration>...] [--no-tracker-for N]
[--pause SECONDS]``
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TRACKER = "latest_checkpointed_iteration.txt"


def _save(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.cuda.synchronize, torch.cuda.current_device = (lambda: None), (lambda: "cpu")  # no GPU on this runner
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False,
    )  # fmt: skip
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                     share_embeddings_and_output_weights=False)  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    for iteration in args.iterations:
        for parameter in model.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator)
        optimizer.step()
        model_state = model.sharded_state_dict()
        optimizer_state = optimizer.state_dict()
        id_map = get_param_id_to_sharded_param_map(
            model_state, [p for g in optimizer.param_groups for p in g["params"]]
        )
        optim_state_to_sharding_state(optimizer_state, id_map, exclude_keys=("step",))
        state = {
            "model": model_state,
            "optimizer": optimizer_state,
            "rng_state": ShardedObject("rng_state", [torch.get_rng_state()], (2,), (rank,), replica_id=0),
            "args": argparse.Namespace(iteration=iteration, tensor_model_parallel_size=2),
            "iteration": iteration,
            "checkpoint_version": 3.0,
        }
        directory = os.path.join(args.root, f"iter_{iteration:07d}")
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(state, directory)
        dist.barrier()
        if rank == 0 and iteration != args.no_tracker_for:
            with open(os.path.join(args.root, TRACKER), "w") as tracker:
                tracker.write(str(iteration))
        time.sleep(args.pause)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("port")
    parser.add_argument("iterations", type=lambda text: [int(item) for item in text.split(",")])
    parser.add_argument("--no-tracker-for", type=int, default=None)
    parser.add_argument("--pause", type=float, default=0.0)
    args = parser.parse_args()
    os.makedirs(args.root, exist_ok=True)
    mp.spawn(_save, args=(args,), nprocs=2)


if __name__ == "__main__":
    sys.exit(main())
