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

"""The consolidation engine on a real ``torch_dist`` checkpoint: every tensor compared with the one that was saved."""

import json
import runpy
import shutil

import pytest
import torch
from conftest import ROOT, run_python
from nemo.lightning.io.consolidation.engine.consolidate import consolidate_checkpoint
from nemo.lightning.io.consolidation.engine.digests import verify_digests
from nemo.lightning.io.consolidation.engine.errors import (
    CorruptShardError,
    NotACheckpointError,
    UnsupportedFormatError,
    VerificationError,
)
from safetensors.torch import load_file

CONVERTER = ROOT / "scripts" / "checkpoint_converters" / "consolidate_nemo2_checkpoint.py"


def _output_tensors(directory):
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _assert_same_tensors(tensors, reference, dtype=None):
    assert set(tensors) == set(reference)
    for name, expected in reference.items():
        expected = expected if dtype is None else expected.to(dtype)
        assert tensors[name].dtype == expected.dtype, name
        assert torch.equal(tensors[name], expected), name


def test_consolidated_tensors_are_the_saved_ones(dist_checkpoint, tmp_path):
    checkpoint, reference = dist_checkpoint
    result = consolidate_checkpoint(checkpoint, tmp_path / "out", global_step=7, verify=True)
    assert result.tensor_count == len(reference)
    assert sorted(p.name for p in result.output_dir.iterdir()) == ["metadata.json", "model.safetensors"]
    _assert_same_tensors(_output_tensors(result.output_dir), reference)  # TP chunks joined, layers split
    metadata = json.loads((result.output_dir / "metadata.json").read_text())
    assert metadata["kind"] == "model" and metadata["global_step"] == 7 and metadata["dtype"] is None
    assert metadata["total_bytes"] == sum(t.numel() * t.element_size() for t in reference.values())
    assert verify_digests(result.output_dir) == len(reference)


def test_shards_and_dtype(dist_checkpoint, tmp_path):
    checkpoint, reference = dist_checkpoint
    out = tmp_path / "out"
    consolidate_checkpoint(checkpoint, out, max_shard_size=20_000, dtype=torch.bfloat16, verify=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    _assert_same_tensors(_output_tensors(out), reference, torch.bfloat16)


def test_a_changed_output_fails_its_digests(dist_checkpoint, tmp_path):
    checkpoint, _ = dist_checkpoint
    out = consolidate_checkpoint(checkpoint, tmp_path / "out").output_dir
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(VerificationError, match="differs"):
        verify_digests(out)


def test_a_corrupt_shard_fails_and_leaves_nothing(dist_checkpoint, tmp_path):
    checkpoint, _ = dist_checkpoint
    copy = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, copy)
    shard = max((copy / "weights").glob("*.distcp"), key=lambda path: path.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a save cut short
    with pytest.raises(CorruptShardError, match=shard.name):
        consolidate_checkpoint(copy)
    assert sorted(p.name for p in copy.iterdir()) == ["reference.pt", "weights"]  # no output, no temporary directory


def test_other_layouts_are_refused(tmp_path):
    with pytest.raises(NotACheckpointError):
        consolidate_checkpoint(tmp_path)
    weights = tmp_path / "zarr" / "weights"
    weights.mkdir(parents=True)
    (weights / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    with pytest.raises(UnsupportedFormatError, match="zarr"):
        consolidate_checkpoint(weights.parent)


#: Runs the converter in a fresh interpreter in which blake3 and zlib-ng cannot be imported (optional dependencies).
WITHOUT_OPTIONAL = (
    "import runpy, sys\n"
    "for name in ('blake3', 'zlib_ng', 'zlib_ng.zlib_ng'):\n"
    "    sys.modules[name] = None\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def test_converter_script_without_the_optional_dependencies(dist_checkpoint, tmp_path):
    checkpoint, reference = dist_checkpoint
    out = tmp_path / "converted"
    proc = run_python("-c", WITHOUT_OPTIONAL, str(CONVERTER), str(checkpoint), "--out", str(out), "--dtype", "fp16",
                      "--verify")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"-> {out}" in proc.stdout
    _assert_same_tensors(_output_tensors(out), reference, torch.float16)
    entry = json.loads((out / "metadata.json").read_text())["files"]["model.safetensors"]
    assert set(entry) == {"size", "header_sha256", "tensors_sha256", "sha256_tree"}  # hashlib's, named
    assert verify_digests(out) == len(reference)  # checked here, where blake3 is installed, as sha256
    converter = runpy.run_path(str(CONVERTER))  # the same command in this process: an existing output
    assert converter["main"]([str(checkpoint), "--out", str(out)]) == 7  # OutputExistsError's exit code
    assert converter["main"]([str(checkpoint), "--out", str(out), "--force"]) == 0
    entry = json.loads((out / "metadata.json").read_text())["files"]["model.safetensors"]
    assert "blake3_tree" in entry and verify_digests(out) == len(reference)
