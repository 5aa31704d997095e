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

"""PEFT: a LoRA ``llm.finetune`` from a checkpoint consolidates its adapter checkpoints (NeMo's PEFT callback rebuilds
the checkpoint IO in its ``setup``; the consolidation settings survive that), and the adapters merged into the base
model are the base weights plus ``alpha / dim * B @ A``, as NeMo's ``LoRAMerge`` computes them."""

import json

import pytest
import torch
from nemo.lightning.io.consolidation.engine.consolidate import consolidate_checkpoint
from safetensors.torch import load_file
from tiny_fit import LORA_ALPHA, LORA_DIM, checkpoint_tensors, checkpoints, every_second, fit


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """``(base checkpoint, LoRA log dir)``: 2 LoRA steps at ``"each"``, restored from the knob's fit's last
    checkpoint."""
    base = checkpoints(every_second(tmp_path_factory) / "tiny_gpt" / "checkpoints")[-1]
    lora = fit("lora", 2, tmp_path_factory, ckpt_consolidation_frequency="each", lora_from=str(base))
    return base, lora


def test_a_lora_run_consolidates_its_adapter_checkpoints(lora_run, tmp_path):
    base, lora = lora_run
    saved = checkpoints(lora / "tiny_gpt" / "checkpoints")
    assert len(saved) == 2
    for checkpoint in saved:
        output = checkpoint / "consolidated"
        assert sorted(p.name for p in output.iterdir()) == ["adapter_model.safetensors", "metadata.json"]
        metadata = json.loads((output / "metadata.json").read_text())
        assert metadata["kind"] == "adapter" and metadata["base_checkpoint"] == str(base)
        assert metadata["peft"]["method"].endswith(".LoRA") and metadata["peft"]["dim"] == LORA_DIM
        adapters, expected = load_file(output / "adapter_model.safetensors"), checkpoint_tensors(
            checkpoint / "weights", tmp_path
        )
        assert set(adapters) == set(expected) and len(adapters) == 8  # 2 layers x (qkv, proj) x (linear_in, _out)
        assert all(torch.equal(adapters[name], tensor) for name, tensor in expected.items())


def test_merged_adapters_are_the_base_weights_plus_the_scaled_lora_product(lora_run, tmp_path):
    base, lora = lora_run
    newest = checkpoints(lora / "tiny_gpt" / "checkpoints")[-1]
    merged = load_file(consolidate_checkpoint(newest, tmp_path / "merged", merge_adapters=True).output_dir
                       / "model.safetensors")  # fmt: skip
    base_tensors = checkpoint_tensors(base / "weights", tmp_path)
    adapters = load_file(newest / "consolidated" / "adapter_model.safetensors")
    assert set(merged) == set(base_tensors)  # the base model's tensors, nothing of the adapters' names
    scale = LORA_ALPHA / LORA_DIM
    assert scale == 2.0  # alpha != dim: a merge that forgot the scale would be off by the delta
    wrapped = {name.split(".adapter.")[0] + ".weight" for name in adapters}
    assert len(wrapped) == 4
    for name, tensor in merged.items():
        if name in wrapped:
            prefix = name.removesuffix(".weight")
            lora_a, lora_b = (
                adapters[f"{prefix}.adapter.linear_in.weight"],
                adapters[f"{prefix}.adapter.linear_out.weight"],
            )
            assert (lora_b @ lora_a).abs().max() > 0, name  # training moved the adapter away from its zero init
            assert torch.equal(tensor, base_tensors[name] + scale * lora_b @ lora_a), name
        else:
            assert torch.equal(tensor, base_tensors[name]), name
    metadata = json.loads((tmp_path / "merged" / "metadata.json").read_text())
    assert metadata["kind"] == "model" and metadata["merged_adapters"]["alpha"] == LORA_ALPHA
