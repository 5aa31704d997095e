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

"""Loading a consolidated file into models of either layer spec."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from nemo_patch.engine.load import canonical_key_map, load_consolidated_into


class _LayerSpec:
    def __init__(self, keys_map):
        self.sharded_state_dict_keys_map = keys_map


class _Layer(nn.Module):
    """Stand-in for a megatron-core TransformerLayer: its parameter names and its ``submodules_config`` key map."""

    def __init__(self, te_names: bool):
        super().__init__()
        if te_names:  # Transformer Engine spec: the norm lives inside linear_qkv, no key map
            self.self_attention = nn.Module()
            self.self_attention.linear_qkv = nn.Module()
            self.self_attention.linear_qkv.layer_norm_weight = nn.Parameter(torch.randn(4))
            self.self_attention.linear_qkv.weight = nn.Parameter(torch.randn(12, 4))
            self.submodules_config = _LayerSpec({})
        else:  # local spec: a separate input_layernorm, mapped onto the TE name when saving
            self.input_layernorm = nn.Module()
            self.input_layernorm.weight = nn.Parameter(torch.randn(4))
            self.self_attention = nn.Module()
            self.self_attention.linear_qkv = nn.Module()
            self.self_attention.linear_qkv.weight = nn.Parameter(torch.randn(12, 4))
            self.submodules_config = _LayerSpec({"input_layernorm.": "self_attention.linear_qkv.layer_norm_"})


class _Model(nn.Module):
    def __init__(self, te_names: bool):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([_Layer(te_names) for _ in range(2)])


@pytest.mark.parametrize("te_names", [False, True], ids=["local-spec", "te-spec"])
def test_both_namings_load_the_same_file_strictly(tmp_path, te_names):
    """The TE spec needs Transformer Engine (CUDA), so its naming is represented by a plain module tree here;
    the local spec is exercised for real by the end-to-end logits test."""
    tensors = {}
    for i in range(2):
        tensors[f"decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight"] = torch.full((4,), float(i))
        tensors[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.full((12, 4), float(i + 10))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = _Model(te_names)
    load_consolidated_into(model, tmp_path)
    mapping = canonical_key_map(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, tensors[mapping[key]])


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    save_file(
        {"decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(12, 4), "extra.weight": torch.zeros(1)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(KeyError) as info:
        load_consolidated_into(_Model(te_names=False), tmp_path)
    assert "decoder.layers.0.input_layernorm.weight" in str(info.value) and "extra.weight" in str(info.value)


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="No consolidated model.safetensors"):
        load_consolidated_into(_Model(te_names=True), tmp_path)
