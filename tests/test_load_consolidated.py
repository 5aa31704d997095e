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

"""Loading a consolidated file into models of either layer spec, and reading sharded outputs through their index
(hand-made files here; real sharded consolidations in ``tests/test_sharded_outputs.py``)."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from nemo_patch.engine.digests import json_file_entry, verify_digests
from nemo_patch.engine.load import canonical_key_map, load_consolidated_into, load_consolidated_state_dict
from nemo_patch.engine.output_files import InvalidOutputError, output_weight_map
from nemo_patch.engine.verify import VerificationError, output_shapes


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


def _sharded(tmp_path, index_text=None, weight_map=None):
    """A hand-made sharded output: two shards of the _Model(te_names=True) tensors and an index (``weight_map`` or
    the raw ``index_text`` overrides the correct one)."""
    tensors, files = {}, {}
    for i in range(2):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        files[shard] = {
            f"decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight": torch.full((4,), float(i)),
            f"decoder.layers.{i}.self_attention.linear_qkv.weight": torch.full((12, 4), float(i + 10)),
        }
        save_file(files[shard], str(tmp_path / shard))
        tensors.update(files[shard])
    correct = {name: shard for shard, content in files.items() for name in content}
    if index_text is None:
        index_text = json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map or correct})
    (tmp_path / "model.safetensors.index.json").write_text(index_text)
    return tensors


def test_a_sharded_output_loads_through_its_index(tmp_path):
    tensors = _sharded(tmp_path)
    for path in (tmp_path, tmp_path / "model.safetensors.index.json"):
        loaded = load_consolidated_state_dict(path)
        assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], tensors[n]) for n in tensors)
    model = _Model(te_names=True)
    load_consolidated_into(model, tmp_path)
    mapping = canonical_key_map(model)
    assert all(torch.equal(value, tensors[mapping[key]]) for key, value in model.state_dict().items())
    assert output_weight_map(tmp_path)["decoder.layers.1.self_attention.linear_qkv.weight"] == _SHARD2
    assert output_shapes(tmp_path) == {name: tuple(tensor.shape) for name, tensor in tensors.items()}


_QKV0 = "decoder.layers.0.self_attention.linear_qkv.weight"
_NORM0 = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
_SHARD1, _SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.mark.parametrize(
    "override, error, pattern",
    [
        ({_QKV0: "../model-00001-of-00002.safetensors"}, InvalidOutputError, f"{_QKV0} is mapped to '../model"),
        ({_QKV0: "/tmp/model-00001-of-00002.safetensors"}, InvalidOutputError, "not a plain file name"),
        ({_QKV0: "sub/model-00001-of-00002.safetensors"}, InvalidOutputError, "not a plain file name"),
        ({_QKV0: ".."}, InvalidOutputError, "not a plain file name"),
        ({_QKV0: ["a", "b"]}, InvalidOutputError, "not a plain file name"),
        ({_QKV0: _SHARD2}, InvalidOutputError, f"Tensor {_QKV0} is in .*{_SHARD1}, but .* maps it to {_SHARD2}"),
        ({_QKV0: None}, InvalidOutputError, "not a plain file name"),
        ({"absent.weight": _SHARD1}, InvalidOutputError, f"maps tensor absent.weight to {_SHARD1}, but .* not hold"),
        ({_NORM0: "model-00003-of-00002.safetensors"}, FileNotFoundError, "model-00003-of-00002.safetensors, which"),
    ],
    ids=["dotdot", "absolute", "subdir", "parent", "list", "other-file", "null", "absent-tensor", "missing-file"],
)
def test_an_index_that_contradicts_its_files_is_refused(tmp_path, override, error, pattern):
    tensors = _sharded(tmp_path)
    correct = {name: _SHARD1 if ".0." in name else _SHARD2 for name in tensors}
    _sharded(tmp_path, weight_map={**correct, **override})
    for call in (
        lambda: load_consolidated_state_dict(tmp_path),
        lambda: load_consolidated_into(_Model(True), tmp_path),
    ):
        with pytest.raises(error, match=pattern):
            call()
    with pytest.raises(VerificationError, match=pattern):
        output_shapes(tmp_path)


def test_a_tensor_the_index_leaves_out_or_names_twice_is_refused(tmp_path):
    tensors = _sharded(tmp_path)
    correct = {name: _SHARD1 if ".0." in name else _SHARD2 for name in tensors}
    _sharded(tmp_path, weight_map={n: f for n, f in correct.items() if n != _NORM0})
    with pytest.raises(InvalidOutputError, match=f"Tensor {_NORM0} in .*{_SHARD1} is not in the weight_map"):
        load_consolidated_state_dict(tmp_path)
    entries = [f'"{name}": "{shard}"' for name, shard in correct.items()] + [f'"{_QKV0}": "{_SHARD2}"']
    _sharded(tmp_path, index_text='{"weight_map": {' + ", ".join(entries) + "}}")
    with pytest.raises(InvalidOutputError, match=f"key '{_QKV0}' appears more than once"):
        load_consolidated_state_dict(tmp_path)
    for text, pattern in [("not json", "not UTF-8 JSON"), ('{"weight_map": {}}', "weight_map"), ("[]", "weight_map")]:
        _sharded(tmp_path, index_text=text)
        with pytest.raises(InvalidOutputError, match=pattern):
            load_consolidated_state_dict(tmp_path)


def test_a_single_file_and_an_index_together_are_refused(tmp_path):
    tensors = _sharded(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidOutputError, match="holds both model.safetensors and model.safetensors.index.json"):
        load_consolidated_state_dict(tmp_path)


def test_digests_require_every_weights_file_of_the_index(tmp_path):
    """``verify_digests`` refuses a ``metadata.json`` that leaves out a shard or names a file outside the output."""
    _sharded(tmp_path)
    recorded = {name: json_file_entry(tmp_path / name) for name in (_SHARD1, "model.safetensors.index.json")}
    (tmp_path / "metadata.json").write_text(json.dumps({"files": recorded}))
    with pytest.raises(VerificationError, match=f"{_SHARD2} is part of the output, but metadata.json records no"):
        verify_digests(tmp_path)
    (tmp_path / "metadata.json").write_text(json.dumps({"files": {**recorded, "../metadata.json": {"size": 1}}}))
    with pytest.raises(VerificationError, match="'../metadata.json', which is not a plain file name"):
        verify_digests(tmp_path)
