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

"""A consolidation's outputs: ``metadata.json`` with per-tensor digests, verification against the checkpoint, the
dtype cast refusing overflow, sharded files written front to back; every tensor compared with PyTorch's reading."""

import json

import pytest
import torch
from safetensors import safe_open

from nemo_patch.engine.casting import DtypeOverflowError
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.digests import verify_digests
from nemo_patch.engine.verify import VerificationError, verify_consolidated

pytestmark = [pytest.mark.unit, pytest.mark.run_only_on("CPU")]


def _tensors(output_dir):
    tensors = {}
    for path in sorted(output_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def test_outputs_describe_themselves_and_verify(moe_checkpoint, tmp_path):
    checkpoint, expected = moe_checkpoint
    result = consolidate_checkpoint(checkpoint, tmp_path / "out", global_step=9, verify=True, max_shard_size=20_000)
    metadata = json.loads((result.output_dir / "metadata.json").read_text())
    assert metadata["global_step"] == 9 and metadata["tensor_count"] == len(expected) == result.tensor_count
    assert metadata["total_bytes"] == sum(tensor.numel() * tensor.element_size() for tensor in expected.values())
    index = json.loads((result.output_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(metadata["files"]) - 1 > 1
    tensors = _tensors(result.output_dir)
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[n], t) for n, t in expected.items())
    assert verify_digests(result.output_dir) == len(expected)
    assert verify_consolidated(checkpoint / "weights", result.output_dir) == len(expected)


def test_a_changed_output_byte_is_found(moe_checkpoint, tmp_path):
    output = consolidate_checkpoint(moe_checkpoint[0], tmp_path / "out").output_dir
    data = bytearray((output / "model.safetensors").read_bytes())
    data[-3] ^= 0x01
    (output / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(VerificationError, match="differs"):
        verify_digests(output)
    with pytest.raises(VerificationError):
        verify_consolidated(moe_checkpoint[0] / "weights", output)


def test_a_cast_output_equals_pytorchs_reading_cast(moe_checkpoint):
    from nemo_patch.engine.checkpoint_layout import inspect_checkpoint
    from nemo_patch.engine.tensor_sources import open_sources

    checkpoint, expected = moe_checkpoint
    sources = open_sources(inspect_checkpoint(checkpoint), torch.bfloat16)
    produce = sources.producer(reuse=False)
    cast = {output.spec.name: produce(output.spec) for output in sources.outputs}
    assert cast.keys() == expected.keys()
    assert all(torch.equal(cast[name], tensor.to(torch.bfloat16)) for name, tensor in expected.items())


def test_a_cast_to_a_narrower_dtype_refuses_overflow_and_publishes_nothing(
    moe_checkpoint, save_megatron_checkpoint, tmp_path
):
    checkpoint, expected = moe_checkpoint
    cast = consolidate_checkpoint(checkpoint, tmp_path / "bf16", dtype=torch.bfloat16, verify=True).output_dir
    assert all(torch.equal(_tensors(cast)[n], t.to(torch.bfloat16)) for n, t in expected.items())
    large = tmp_path / "large" / "model--step=1"
    save_megatron_checkpoint(large, scale=1e6)
    with pytest.raises(DtypeOverflowError, match="largest magnitude"):
        consolidate_checkpoint(large, tmp_path / "fp16", dtype=torch.float16)
    assert not (tmp_path / "fp16").exists() and not list(tmp_path.glob(".consolidated.tmp-*"))
