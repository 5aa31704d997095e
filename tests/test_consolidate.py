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

"""The consolidation engine on real checkpoints written by a NeMo fit (see the ``each_run`` fixture)."""

import hashlib
import json
import os
import re

import pytest
import torch
from blake3 import blake3
from conftest import dcp_reference_tensors
from safetensors import safe_open

from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.errors import (
    CheckpointNotFoundError,
    ConsolidationError,
    CorruptShardError,
    NotACheckpointError,
    UnfinishedCheckpointError,
)
from nemo_patch.engine.plan import consolidated_key
from nemo_patch.engine.publish import TMP_PREFIX


@pytest.mark.slow
def test_output_equals_pytorch_dcp_conversion_tensor_for_tensor(each_run, tmp_path):
    checkpoint = each_run["root"] / "LATEST"
    reference = dcp_reference_tensors(checkpoint / "weights", tmp_path)
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
        "format_version": 2,
        "kind": "model",
        "global_step": 6,
        "source_checkpoint": "../weights",
        "tensor_count": len(tensors),
        "total_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "dtype": None,
        "vocab_size": {"padded": 128, "tokenizer": None},  # the tiny GPT trains without a tokenizer
        "files": {"model.safetensors": _digests_of(data)},
        "source_metadata": _source_metadata_of(out / "../weights/.metadata"),
        "run": meta["run"],  # the training run that wrote it: checked below
        "save": {  # which save it was made from (issue #45): the run's id is in its common.pt
            "layout": "torch_dist",
            "run": meta["run"],
            "global_step": 6,
            "fingerprint": meta["save"]["fingerprint"],
            "finished_ns": (out / "../weights/.metadata").stat().st_mtime_ns,
        },
    }
    assert re.fullmatch(r"[0-9a-f]{64}", meta["save"]["fingerprint"])
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{8}", meta["run"])
    assert (out / meta["source_checkpoint"] / ".metadata").is_file()


def _source_metadata_of(path):
    """metadata.json's ``source_metadata``: which save of the checkpoint the output was made from, computed here."""
    data = path.read_bytes()
    return {"file": ".metadata", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _digests_of(data):
    """metadata.json's entry for a safetensors file, computed here from its bytes alone."""
    header_size = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:header_size])
    header.pop("__metadata__")
    tensors = {
        name: blake3(data[header_size + entry["data_offsets"][0] : header_size + entry["data_offsets"][1]])
        for name, entry in header.items()
    }
    tree = blake3(blake3(data[:header_size]).digest())
    for name in sorted(header, key=lambda name: header[name]["data_offsets"][0]):
        tree.update(tensors[name].digest())
    return {
        "size": len(data),
        "header_blake3": blake3(data[:header_size]).hexdigest(),
        "tensors_blake3": {name: digest.hexdigest() for name, digest in tensors.items()},
        "blake3_tree": tree.hexdigest(),
    }


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
    message = str(info.value)
    assert isinstance(info.value, CorruptShardError)  # found from the file sizes, before any output is allocated
    assert re.fullmatch(
        r"module\.\S+: chunk offsets \[.*\] sizes \[.*\]: its record ends at byte \d+ of __0_0\.distcp, which has "
        r"1000 bytes \(truncated\)",
        message,
    )
    assert not (checkpoint_copy / "consolidated").exists()
    assert _leftovers(checkpoint_copy) == []


def test_not_a_checkpoint_is_rejected_with_what_is_expected(tmp_path):
    with pytest.raises(NotACheckpointError, match=r"is not a NeMo 2 checkpoint: expected a 'weights/' directory"):
        consolidate_checkpoint(tmp_path)
    (tmp_path / "weights").mkdir()  # a save that never wrote DCP's .metadata
    with pytest.raises(UnfinishedCheckpointError, match=r"unfinished checkpoint \(no '\.metadata'\)"):
        consolidate_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        consolidate_checkpoint(tmp_path / "missing")
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


@pytest.mark.slow
def test_sharded_output_matches_the_single_file(each_run, checkpoint_copy):
    """With a small max_shard_size the output is split the way Hugging Face splits it, with the same tensors."""
    single = each_run["root"] / "LATEST" / "consolidated"
    result = consolidate_checkpoint(checkpoint_copy, global_step=6, max_shard_size=100_000)
    out = result.output_dir
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(os.listdir(out)) == sorted(shards + ["metadata.json", "model.safetensors.index.json"])
    with safe_open(str(single / "model.safetensors"), "pt") as handle:
        expected = {name: handle.get_tensor(name) for name in handle.keys()}
    seen = {}
    for shard in shards:
        with safe_open(str(out / shard), "pt") as handle:
            data_bytes = sum(handle.get_tensor(n).numel() * handle.get_tensor(n).element_size() for n in handle.keys())
            assert len(list(handle.keys())) == 1 or data_bytes <= 100_000  # one oversized tensor gets its own file
            for name in handle.keys():
                assert index["weight_map"][name] == shard
                seen[name] = handle.get_tensor(name)
    assert seen.keys() == expected.keys() and all(torch.equal(seen[n], expected[n]) for n in seen)
    assert index["metadata"]["total_size"] == result.total_bytes
    meta = json.loads((out / "metadata.json").read_text())
    assert sorted(meta["files"]) == sorted(shards + ["model.safetensors.index.json"])
    for name, entry in meta["files"].items():
        data = (out / name).read_bytes()
        if name.endswith(".json"):
            assert entry == {"size": len(data), "blake3": blake3(data).hexdigest()}
        else:
            assert entry == _digests_of(data)


@pytest.mark.slow
def test_output_files_follow_the_umask(checkpoint_copy):
    out = consolidate_checkpoint(checkpoint_copy).output_dir
    umask = os.umask(0)
    os.umask(umask)
    for path in [out, *out.iterdir()]:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert path.stat().st_mode & 0o777 == expected, path


@pytest.mark.slow
def test_metadata_is_read_without_importing_megatron_and_foreign_globals_are_refused(each_run, tmp_path):
    import pickle
    import subprocess
    import sys

    from nemo_patch.engine.metadata_checks import read_dcp_metadata

    weights = each_run["root"] / "LATEST" / "weights"
    code = (
        "import sys; from nemo_patch.engine.metadata_checks import read_dcp_metadata; "
        f"m = read_dcp_metadata({str(weights)!r}); "
        "print(type(m).__name__, len(m.state_dict_metadata) > 0, "
        "sorted({k.split('.')[0] for k in sys.modules} & {'megatron', 'lightning'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "MCoreMetadata True []", out.stderr[-2000:]

    (tmp_path / ".metadata").write_bytes(pickle.dumps(os.system))  # a pickle that would call a function
    with pytest.raises(pickle.UnpicklingError, match="refusing to load posix.system"):
        read_dcp_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes((weights / ".metadata").read_bytes()[:100])
    with pytest.raises(pickle.UnpicklingError):
        read_dcp_metadata(tmp_path)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("disk on fire")])
def test_staged_output_leaves_nothing_whatever_interrupts_it(tmp_path, error):
    from nemo_patch.engine.publish import staged_output

    output = tmp_path / "consolidated"
    with pytest.raises((KeyboardInterrupt, ConsolidationError)) as info:
        with staged_output(tmp_path, output, overwrite=False, failure=f"Consolidating {tmp_path}") as staging:
            (staging / "model.safetensors").write_bytes(b"half")
            raise error
    assert os.listdir(tmp_path) == []
    if isinstance(error, RuntimeError):
        assert str(info.value) == f"Consolidating {tmp_path} failed: RuntimeError: disk on fire"
