"""The consolidation engine on real checkpoints written by a NeMo fit (see the ``each_run`` fixture)."""

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from nemo_patch.consolidate import (
    TMP_PREFIX,
    ConsolidationError,
    consolidate_checkpoint,
    consolidated_key,
    resolve_weights_dir,
)


def _reference_tensors(weights_dir, tmp_path):
    """The model tensors of a checkpoint according to PyTorch's own DCP converter, split per layer by hand."""
    dcp_to_torch_save(str(weights_dir), str(tmp_path / "reference.pt"))
    full = torch.load(tmp_path / "reference.pt", weights_only=False)
    reference = {}
    for key, value in full.items():
        if not key.startswith("module.") or "_extra_state" in key or not isinstance(value, torch.Tensor):
            continue
        name = key[len("module.") :]
        if ".layers." in name:
            head, tail = name.split(".layers.", 1)
            for layer in range(value.shape[0]):
                reference[f"{head}.layers.{layer}.{tail}"] = value[layer]
        else:
            reference[name] = value
    return reference


@pytest.mark.slow
def test_output_equals_pytorch_dcp_conversion_tensor_for_tensor(each_run, tmp_path):
    checkpoint = each_run["root"] / "LATEST"
    reference = _reference_tensors(checkpoint / "weights", tmp_path)
    with safe_open(str(checkpoint / "consolidated" / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
        assert names == set(reference), "every model tensor of the checkpoint, and nothing else"
        for name in names:
            tensor = handle.get_tensor(name)
            assert tensor.dtype == reference[name].dtype
            assert torch.equal(tensor, reference[name]), name
    assert not any(n.startswith("optimizer") or "_extra_state" in n for n in names)
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in names  # stacked [L, ...] split per layer


@pytest.mark.slow
def test_metadata_json_describes_the_output(each_run):
    out = each_run["root"] / "LATEST" / "consolidated"
    meta = json.loads((out / "metadata.json").read_text())
    data = (out / "model.safetensors").read_bytes()
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        assert handle.metadata() == {"format": "pt"}
    assert meta == {
        "format_version": 1,
        "global_step": 6,
        "source_checkpoint": "../weights",
        "tensor_count": len(tensors),
        "total_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "files": {"model.safetensors": {"sha256": hashlib.sha256(data).hexdigest()}},
    }
    assert (out / meta["source_checkpoint"] / ".metadata").is_file()


@pytest.fixture()
def checkpoint_copy(each_run, tmp_path):
    """A private copy of a finished checkpoint without its consolidated output."""
    source = each_run["root"] / "LATEST"
    copy = tmp_path / "ckpt"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("consolidated"))
    return copy


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(TMP_PREFIX))


@pytest.mark.slow
def test_consolidating_again_replaces_the_output_atomically(checkpoint_copy):
    first = consolidate_checkpoint(checkpoint_copy, global_step=6)
    second = consolidate_checkpoint(checkpoint_copy / "weights", global_step=6)
    assert first.files == second.files and first.output_dir == second.output_dir
    assert sorted(os.listdir(first.output_dir)) == ["metadata.json", "model.safetensors"]
    assert _leftovers(checkpoint_copy) == []


@pytest.mark.slow
def test_truncated_shard_fails_cleanly_and_leaves_nothing(checkpoint_copy):
    shard = checkpoint_copy / "weights" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ConsolidationError) as info:
        consolidate_checkpoint(checkpoint_copy)
    assert f"Cannot read shard file(s) __0_0.distcp of {checkpoint_copy / 'weights'}: EOFError" in str(info.value)
    assert not (checkpoint_copy / "consolidated").exists()
    assert _leftovers(checkpoint_copy) == []


def test_not_a_checkpoint_is_rejected_with_what_is_expected(tmp_path):
    (tmp_path / "weights").mkdir()
    with pytest.raises(
        ConsolidationError, match=r"is not a NeMo 2 torch_dist checkpoint: expected a 'weights/\.metadata'"
    ):
        consolidate_checkpoint(tmp_path)
    with pytest.raises(ConsolidationError):
        resolve_weights_dir(tmp_path / "missing")
    assert sorted(os.listdir(tmp_path)) == ["weights"]


@pytest.mark.parametrize(
    "key, layer, expected",
    [
        ("module.embedding.word_embeddings.weight", None, "embedding.word_embeddings.weight"),
        ("module.decoder.layers.mlp.linear_fc1.weight", 3, "decoder.layers.3.mlp.linear_fc1.weight"),
        (
            "module.decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            0,
            "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        ),
        ("module.decoder.final_layernorm.weight", None, "decoder.final_layernorm.weight"),
    ],
)
def test_consolidated_key(key, layer, expected):
    assert consolidated_key(key, layer) == expected


def test_consolidated_key_refuses_to_split_a_non_stacked_key():
    with pytest.raises(ValueError):
        consolidated_key("module.decoder.final_layernorm.weight", 0)
