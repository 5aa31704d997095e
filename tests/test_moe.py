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

"""MoE models come out loadable: expert tensors split per expert under ``SequentialMLP``'s names (#11, first part).

Real megatron-core MoE GPTs (local spec, ``SequentialMLP``, 4 experts, top-2, allgather dispatcher, 2 layers,
hidden 32, world size 1, CPU) are saved with ``dist_checkpointing.save(model.sharded_state_dict(prefix="module."))``
in a subprocess, with every expert's weights filled with values that encode its expert id, so that a wrong expert
mapping cannot pass. The output must hold exactly the model's ``state_dict`` (minus ``_extra_state``) under the
canonical names, bit for bit, and ``load_consolidated_into`` a fresh model of the same architecture must give its
weights back.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.errors import UnknownLayoutError
from nemo_patch.engine.plan import plan_outputs

MODEL = textwrap.dedent(
    """
    import json, os, socket, sys, torch, torch.distributed as dist

    def build(variant, seed):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec, get_gpt_layer_local_spec, get_gpt_mtp_block_spec)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig

        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        extra = {}
        if variant == "shared-experts-expert-bias":
            extra = dict(moe_shared_expert_intermediate_size=48, moe_router_enable_expert_bias=True,
                         moe_router_score_function="sigmoid")
        if variant == "mixed-dense-mtp":  # MoE, dense, MoE layers and one multi-token-prediction layer (MoE)
            extra = dict(num_layers=3, moe_layer_freq=[1, 0, 1], mtp_num_layers=1)
        config = TransformerConfig(**{**dict(
            num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, use_cpu_initialization=True,
            num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
            add_bias_linear=False, bias_activation_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False), **extra})
        if variant == "mixed-dense-mtp":
            block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
            mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False)
            return GPTModel(config, block, vocab_size=64, max_sequence_length=16, mtp_block_spec=mtp)
        spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
        return GPTModel(config, spec, vocab_size=64, max_sequence_length=16)

    def main():
        mode, variant, path = sys.argv[1:4]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import dist_checkpointing, parallel_state
        from nemo_patch.engine.load import canonical_key_map, load_consolidated_into
        from nemo_patch.testing.cpu_harness import megatron_on_cpu

        parallel_state.initialize_model_parallel(1, 1)
        with megatron_on_cpu():
            if mode == "save":
                model = build(variant, seed=1)
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        if ".local_experts." in name:  # expert e holds values around e
                            expert = int(name.split(".local_experts.")[1].split(".")[0])
                            param.copy_(expert + 0.01 * torch.randn_like(param))
                os.makedirs(os.path.join(path, "weights"))
                dist_checkpointing.save(model.sharded_state_dict(prefix="module."), os.path.join(path, "weights"))
                state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
                torch.save(state, os.path.join(path, "state_dict.pt"))
                json.dump(canonical_key_map(model), open(os.path.join(path, "key_map.json"), "w"))
            else:  # load the consolidated output into a fresh model and compare with the saved weights
                model = build(variant, seed=2)
                load_consolidated_into(model, path + "/consolidated")
                saved = torch.load(os.path.join(path, "state_dict.pt"))
                loaded = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
                assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
        print("ok")

    if __name__ == "__main__":
        main()
    """
)


def _run(tmp_path, *args):
    script = tmp_path / "moe_model.py"
    script.write_text(MODEL)
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.fixture(scope="module", params=["sequential-mlp", "shared-experts-expert-bias", "mixed-dense-mtp"])
def moe_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    _run(path.parent, "save", request.param, path)
    return request.param, path


def test_moe_output_is_the_models_state_dict_under_canonical_names(moe_checkpoint):
    variant, checkpoint = moe_checkpoint
    result = consolidate_checkpoint(checkpoint, verify=True)
    output = load_file(str(result.output_dir / "model.safetensors"))
    state = torch.load(checkpoint / "state_dict.pt")
    key_map = json.loads((checkpoint / "key_map.json").read_text())
    expected = {key_map[name]: tensor for name, tensor in state.items()}
    assert sorted(output) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(output[name], tensor), name
    expert_names = [name for name in output if ".local_experts." in name]
    moe_layers = 3 if variant == "mixed-dense-mtp" else 2  # decoder and MTP layers with experts
    assert len(expert_names) == moe_layers * 4 * 2  # x experts x (fc1, fc2)
    for name in expert_names:  # each expert's tensor holds its own id's values
        expert = int(name.split(".local_experts.")[1].split(".")[0])
        assert abs(output[name].float().mean().item() - expert) < 0.05, name
    # The MoE layers' pre-MLP norm under the model's own name, not the local spec's fused name (no linear_fc1 there);
    # a dense layer among them keeps the fused name, as the dense rule says.
    if variant == "mixed-dense-mtp":
        assert "decoder.layers.0.pre_mlp_layernorm.weight" in output and "decoder.layers.2.mlp.router.weight" in output
        assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in output  # the dense layer
        assert (
            "decoder.layers.1.mlp.linear_fc1.weight" in output and "decoder.layers.1.mlp.router.weight" not in output
        )
        assert "mtp.layers.0.transformer_layer.pre_mlp_layernorm.weight" in output
        assert "mtp.layers.0.eh_proj.weight" in output and "mtp.layers.0.enorm.weight" in output
    else:
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in output
        assert not any("mlp.linear_fc1.layer_norm" in name for name in output)
    if variant == "shared-experts-expert-bias":
        assert "decoder.layers.0.mlp.router.expert_bias" in output
        assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in output


def test_load_consolidated_into_a_fresh_moe_model_gives_its_weights_back(moe_checkpoint, tmp_path):
    variant, checkpoint = moe_checkpoint
    consolidate_checkpoint(checkpoint)
    _run(tmp_path, "load", variant, checkpoint)


def _metadata(**entries):
    """DCP metadata with one entry per ``key=(size, [(offsets, sizes), ...])``."""
    items = {
        key.replace("__", "."): TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(size),
            chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
        )
        for key, (size, chunks) in entries.items()
    }
    return Metadata(state_dict_metadata=items)


def test_an_expert_entry_without_its_expert_axis_is_refused_naming_it():
    metadata = _metadata(module__decoder__layers__mlp__experts__experts__linear_fc1__weight=((2,), [((0,), (2,))]))
    with pytest.raises(UnknownLayoutError, match="module.decoder.layers.mlp.experts.experts.linear_fc1.weight"):
        plan_outputs(metadata)


def test_a_tensor_its_chunks_cover_in_part_is_refused_naming_it():
    metadata = _metadata(module__decoder__final_layernorm__weight=((8,), [((0,), (4,))]))
    with pytest.raises(UnknownLayoutError, match=r"module.decoder.final_layernorm.weight.*cover 4 of its 8"):
        plan_outputs(metadata)
    stacked = _metadata(
        module__decoder__layers__mlp__linear_fc1__weight=((2, 4), [((0, 0), (1, 4)), ((1, 0), (1, 2))])
    )
    with pytest.raises(UnknownLayoutError, match=r"linear_fc1.weight\[1\].*cover 2 of its 4"):
        plan_outputs(stacked)


def test_a_layer_of_another_kind_has_no_output_for_that_entry():
    """Layer 1 is dense: the experts entry has no chunk for it, the dense MLP entry none for layer 0."""
    metadata = _metadata(
        module__decoder__layers__mlp__experts__experts__linear_fc1__weight=((2, 2, 3), [((0, 0, 0), (1, 2, 3))]),
        module__decoder__layers__mlp__linear_fc1__weight=((2, 3), [((1, 0), (1, 3))]),
    )
    names = [output.spec.name for output in plan_outputs(metadata)]
    assert names == [
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
    ]


def test_the_cli_exits_11_on_a_layout_it_cannot_name(moe_checkpoint, tmp_path, capsys, monkeypatch):
    variant, checkpoint = moe_checkpoint
    from nemo_patch.engine import tensor_sources

    def refuse(metadata):
        raise UnknownLayoutError("module.x: cannot name it")

    monkeypatch.setattr(tensor_sources, "plan_outputs", refuse)
    assert main([str(checkpoint), "--out", str(tmp_path / "out")]) == 11
    assert "module.x" in capsys.readouterr().err and not (tmp_path / "out").exists()


EXPERT_PARALLEL = textwrap.dedent(
    """
    import os, sys, zlib, torch, torch.distributed as dist

    def fill(model, num_experts, ep_rank, ep_size):
        # Deterministic weights from each tensor's global name and global shape alone (expert e also offset by e);
        # a TP-split parameter takes its rank's slice of that global tensor. So any expert- and tensor-parallel layout
        # of the same model holds the same values.
        from megatron.core import parallel_state as ps

        local = num_experts // ep_size
        with torch.no_grad():
            for name, param in model.named_parameters():
                expert = None
                tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
                if ".local_experts." in name:
                    head, tail = name.split(".local_experts.")
                    number, rest = tail.split(".", 1)
                    expert = ep_rank * local + int(number)
                    name = f"{head}.local_experts.{expert}.{rest}"
                    tp_rank = ps.get_expert_tensor_parallel_rank()
                    tp_size = ps.get_expert_tensor_parallel_world_size()
                shape, dim = list(param.shape), getattr(param, "partition_dim", 0)
                split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
                if split:
                    shape[dim] *= tp_size
                seed = zlib.crc32(name.encode()) % 997
                numel = 1
                for size in shape:
                    numel *= size
                values = torch.sin(torch.arange(numel, dtype=torch.float32) * 0.37 + seed).view(shape)
                if split:
                    values = values.narrow(dim, tp_rank * param.shape[dim], param.shape[dim])
                param.copy_(values + (expert if expert is not None else 0))

    def main():
        ep, tp, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        dist.init_process_group("gloo")
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig
        from nemo_patch.testing.cpu_harness import megatron_on_cpu

        parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        # EP x TP asks for sequence parallelism, which the local spec's torch norms cannot do (TE or Apex can); it
        # changes no weight layout. megatron-core 0.15.3 then warns through a `warnings` module it never imported
        # (a NameError), so the module gets one.
        import warnings
        from megatron.core import model_parallel_config
        model_parallel_config.warnings = warnings
        with megatron_on_cpu():
            model_parallel_cuda_manual_seed(0)
            config = TransformerConfig(
                num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, use_cpu_initialization=True,
                num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                add_bias_linear=False, bias_activation_fusion=False, masked_softmax_fusion=False,
                persist_layer_norm=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                expert_model_parallel_size=ep, tensor_model_parallel_size=tp)
            model = GPTModel(config, get_gpt_layer_local_spec(num_experts=4), vocab_size=64, max_sequence_length=16)
            fill(model, 4, parallel_state.get_expert_model_parallel_rank(), ep)
            os.makedirs(os.path.join(path, "weights"), exist_ok=True)
            dist_checkpointing.save(model.sharded_state_dict(prefix="module."), os.path.join(path, "weights"))
        dist.barrier()
        print("ok")

    if __name__ == "__main__":
        main()
    """
)


def _save_expert_parallel(tmp_path, ep, tp=1):
    import socket

    script = tmp_path / "expert_parallel.py"
    script.write_text(EXPERT_PARALLEL)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    checkpoint = tmp_path / f"ep{ep}tp{tp}"
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ep * tp}", f"--master_port={port}"]
    proc = subprocess.run(
        [*launcher, str(script), str(ep), str(tp), str(checkpoint)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.count("ok") == ep * tp, proc.stderr[-4000:]
    return checkpoint


@pytest.mark.slow
def test_expert_parallel_checkpoint_consolidates_to_the_same_bytes_as_ep1(tmp_path):
    """EP=2 (2 gloo processes, 2 experts each), EP=2 x TP=2 (4 processes: experts and attention split over TP ranks
    too, sequence parallel) and EP=1 checkpoints of the same weights: identical output files."""
    outputs = []
    for ep, tp in ((1, 1), (2, 1), (2, 2)):
        checkpoint = _save_expert_parallel(tmp_path, ep, tp)
        result = consolidate_checkpoint(checkpoint, verify=True)
        outputs.append((result.output_dir / "model.safetensors").read_bytes())
    assert outputs[0] == outputs[1] == outputs[2]
    tensors = load_file(str(tmp_path / "ep2tp2" / "consolidated" / "model.safetensors"))
    for expert in range(4):  # global expert ids: rank 1's first local expert is expert 2
        name = f"decoder.layers.1.mlp.experts.local_experts.{expert}.linear_fc2.weight"
        assert abs(tensors[name].mean().item() - expert) < 0.3, name


@pytest.mark.parametrize("moe_checkpoint", ["sequential-mlp"], indirect=True)
def test_grouped_gemm_experts_load_the_same_file_under_their_own_names(moe_checkpoint, tmp_path):
    """``TEGroupedMLP`` (Transformer Engine's ``GroupedLinear``: one parameter per expert, ``linear_fc1.weight<e>``)
    cannot be built without Transformer Engine, so this stand-in module tree has exactly its parameter names and
    shapes: ``load_consolidated_into`` maps them to the output's per-expert names and loads every expert's tensor."""
    _, checkpoint = moe_checkpoint
    from nemo_patch.engine.load import canonical_key_map, load_consolidated_into

    result = consolidate_checkpoint(checkpoint, output_dir=tmp_path / "out")
    output = load_file(str(result.output_dir / "model.safetensors"))

    class GroupedLinear(torch.nn.Module):
        def __init__(self, linear: str, layer: int):
            super().__init__()
            for expert in range(4):
                shape = output[f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{linear}.weight"].shape
                self.register_parameter(f"weight{expert}", torch.nn.Parameter(torch.zeros(shape)))

    model = torch.nn.Module()
    for name in output:  # everything but the experts, as plain parameters under their own names
        if ".local_experts." not in name:
            module = model
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(output[name].shape)))
    for layer in range(2):
        experts = torch.nn.Module()
        model.decoder.layers.get_submodule(f"{layer}.mlp").add_module("experts", experts)
        for linear in ("linear_fc1", "linear_fc2"):
            experts.add_module(linear, GroupedLinear(linear, layer))
    key_map = canonical_key_map(model)
    assert key_map["decoder.layers.1.mlp.experts.linear_fc2.weight3"] == (
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    )
    load_consolidated_into(model, result.output_dir)
    state = model.state_dict()
    for layer in range(2):
        for expert in range(4):
            loaded = state[f"decoder.layers.{layer}.mlp.experts.linear_fc1.weight{expert}"]
            assert torch.equal(
                loaded, output[f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight"]
            )
            assert abs(loaded.mean().item() - expert) < 0.05  # expert e's values, not another's
