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

"""Consolidation is layout-independent.

Real multi-rank checkpoints (2 CPU processes, gloo) written by NeMo's checkpoint IO and megatron-core consolidate to
exactly the tensors of the TP=1 checkpoint they were resharded from, as PyTorch's own DCP converter
(``dcp_to_torch_save``) reads that TP=1 checkpoint.

How the checkpoints are made: a TP=1 run trains 2 steps with ``lr=0`` and saves (so its weights are the initial
ones); the TP=2 and PP=2 runs restore those weights through NeMo's ``RestoreConfig`` (megatron-core reshards them),
train 2 steps with ``lr=0`` and save a checkpoint of the same weights in their own layout. Equal tensors also mean a
TP=1 model loaded from any of these outputs gives the same logits as from the TP=1 output, which the ``latest``
end-to-end test checks against the trained model itself.
"""

import pytest
import torch
from conftest import dcp_reference_tensors, run_fit
from safetensors.torch import load_file

from nemo_patch.engine.metadata_checks import read_dcp_metadata

pytestmark = pytest.mark.slow

QKV = "module.decoder.layers.self_attention.linear_qkv.weight"


def _consolidated(report_dir):
    root = report_dir / "tiny_gpt" / "checkpoints" / "LATEST"
    return load_file(str(root / "consolidated" / "model.safetensors")), read_dcp_metadata(root / "weights")


@pytest.fixture(scope="module", params=[True, False], ids=["tied-embeddings", "untied-embeddings"])
def source(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1")
    tied = request.param
    run_fit(out, frequency="each", max_steps=2, save_every=2, lr=0, untied_embeddings=not tied)
    tensors, metadata = _consolidated(out)
    assert ("output_layer.weight" in tensors) == (not tied)
    assert any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)  # optimizer state present
    assert not any(name.startswith("optimizer") or "_extra_state" in name for name in tensors)
    # The expected tensors are PyTorch's DCP converter's reading of the TP=1 checkpoint, not the product's output
    reference = dcp_reference_tensors(out / "tiny_gpt" / "checkpoints" / "LATEST" / "weights", out)
    _assert_same(tensors, reference)
    return {"dir": out, "tied": tied, "tensors": reference}


def _assert_same(tensors, expected):
    assert tensors.keys() == expected.keys()
    for name, value in expected.items():
        assert tensors[name].dtype == value.dtype and torch.equal(tensors[name], value), name


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["TP=2", "PP=2"])
def test_multi_rank_checkpoint_consolidates_to_the_tp1_tensors(source, layout, tmp_path):
    ckpt = source["dir"] / "tiny_gpt" / "checkpoints" / "LATEST"
    options = dict(frequency="each", max_steps=2, save_every=2, lr=0, untied_embeddings=not source["tied"])
    run_fit(tmp_path, restore_from=ckpt, **layout, **options)
    tensors, metadata = _consolidated(tmp_path)
    files = sorted(p.name for p in (tmp_path / "tiny_gpt" / "checkpoints" / "LATEST" / "weights").glob("*.distcp"))
    assert files == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]  # two ranks wrote shards
    if "tp" in layout:  # the QKV weight is stored in TP shards: 2 layers x 2 ranks
        assert len(metadata.state_dict_metadata[QKV].chunks) == 4
    _assert_same(tensors, source["tensors"])
    # and PyTorch's DCP converter reads the same tensors from the multi-rank checkpoint itself
    _assert_same(
        dcp_reference_tensors(tmp_path / "tiny_gpt" / "checkpoints" / "LATEST" / "weights", tmp_path), tensors
    )


def test_checkpoint_without_optimizer_state(source, tmp_path):
    ckpt = source["dir"] / "tiny_gpt" / "checkpoints" / "LATEST"
    options = dict(frequency="each", max_steps=2, save_every=2, lr=0, untied_embeddings=not source["tied"])
    run_fit(tmp_path, restore_from=ckpt, weights_only=True, **options)
    tensors, metadata = _consolidated(tmp_path)
    assert not any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)
    _assert_same(tensors, source["tensors"])


def test_distributed_optimizer_layout_is_skipped_and_weights_are_exact(tmp_path):
    """Fully-sharded (distributed-optimizer) optimizer state present: flattened per-DP-rank ranges of every
    parameter's Adam moments, saved by megatron-core in a 2-process group (see ``distributed_optimizer_checkpoint``).
    """
    import subprocess
    import sys

    from conftest import REPO

    from nemo_patch.engine.consolidate import consolidate_checkpoint

    weights = tmp_path / "ckpt" / "weights"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "distributed_optimizer_checkpoint.py"), str(weights), "29533"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metadata = read_dcp_metadata(weights)
    moments = [key for key in metadata.state_dict_metadata if key.startswith("optimizer.state.exp_avg")]
    assert len(moments) == 8  # 4 parameters x (exp_avg, exp_avg_sq), each stored as 2 flat DP-rank ranges
    result = consolidate_checkpoint(tmp_path / "ckpt", global_step=1)
    tensors = load_file(str(result.output_dir / "model.safetensors"))
    reference = torch.load(tmp_path / "ckpt" / "reference.pt")
    expected = {}
    for name, full in reference.items():
        if name.startswith("decoder.layers."):
            for layer in range(full.shape[0]):
                expected[name.replace("layers.", f"layers.{layer}.", 1)] = full[layer]
        else:
            expected[name] = full
    assert sorted(tensors) == sorted(expected)
    assert all(torch.equal(tensors[name], expected[name]) for name in expected)
