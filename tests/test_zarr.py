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

"""megatron-core ``zarr`` checkpoints: the tensors megatron-core was given (and the same bytes as a ``torch_dist`` save
of them), and every unsafe input refused.

The checkpoints are written by megatron-core's own ``dist_checkpointing.save`` (``zarr`` and ``torch_dist`` save
strategies) in a one-process gloo group, from the same tensors: fp32 and bf16, layer-stacked ones, one of them stored
as two chunks (as two TP ranks store it), and an int64 one.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.errors import CorruptShardError, UnfinishedCheckpointError, UnsupportedFormatError

SAVE = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    import socket
    with socket.socket() as probe:  # a free port for the one-process group
        probe.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from nemo_patch.testing.cpu_harness import megatron_on_cpu  # megatron-core's writers touch CUDA state
    generator = torch.Generator().manual_seed(0)
    stacked = torch.randn(3, 4, 6, generator=generator)
    embedding = torch.randn(10, 6, generator=generator).bfloat16()
    qkv = torch.randn(2, 8, 6, generator=generator)  # 2 layers, split in two along dim 1 as TP=2 stores it
    steps = torch.arange(5, dtype=torch.int64)

    def state():
        key = "module.decoder.layers.self_attention.linear_qkv.weight"
        return {
            "a": ShardedTensor.from_rank_offsets("module.decoder.layers.mlp.linear_fc1.weight", stacked, replica_id=0),
            "b": ShardedTensor.from_rank_offsets("module.embedding.word_embeddings.weight", embedding, replica_id=0),
            "c0": ShardedTensor.from_rank_offsets(key, qkv[:, :4], (1, 0, 2), replica_id=0),
            "c1": ShardedTensor.from_rank_offsets(key, qkv[:, 4:], (1, 1, 2), replica_id=0),
            "d": ShardedTensor.from_rank_offsets("module.decoder.final_layernorm.steps", steps, replica_id=0),
        }

    for backend, target in (("zarr", sys.argv[1]), ("torch_dist", sys.argv[2])):
        os.makedirs(target)
        with megatron_on_cpu():
            dist_checkpointing.save(state(), target, sharded_strategy=(backend, 1))
    torch.save({"stacked": stacked, "embedding": embedding, "qkv": qkv, "steps": steps}, sys.argv[3])  # the oracle
    print("saved")
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(zarr checkpoint, torch_dist checkpoint)`` of the same tensors, each as ``<ckpt>/weights``."""
    root = tmp_path_factory.mktemp("zarr")
    zarr_ckpt, dist_ckpt = root / "zarr-ckpt", root / "dist-ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", SAVE, str(zarr_ckpt / "weights"), str(dist_ckpt / "weights"), str(root / "source.pt")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0 and "saved" in proc.stdout, proc.stderr[-3000:]
    return zarr_ckpt, dist_ckpt


@pytest.fixture()
def zarr_copy(saved, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(saved[0], copy)
    return copy


def test_zarr_consolidates_to_the_same_bytes_as_torch_dist(saved, tmp_path):
    zarr_ckpt, dist_ckpt = saved
    assert json.loads((zarr_ckpt / "weights" / "metadata.json").read_text())["sharded_backend"] == "zarr"
    a = consolidate_checkpoint(zarr_ckpt, tmp_path / "from-zarr", global_step=3, verify=True)
    b = consolidate_checkpoint(dist_ckpt, tmp_path / "from-dist", global_step=3, verify=True)
    assert (
        (a.tensor_count, a.total_bytes)
        == (b.tensor_count, b.total_bytes)
        == (7, 3 * 4 * 6 * 4 + 120 + 2 * 8 * 6 * 4 + 40)
    )
    assert (tmp_path / "from-zarr/model.safetensors").read_bytes() == (
        tmp_path / "from-dist/model.safetensors"
    ).read_bytes()
    assert a.files["model.safetensors"] == b.files["model.safetensors"]
    # the oracle: the tensors megatron-core was given to save, layers split by hand
    source = torch.load(zarr_ckpt.parent / "source.pt", weights_only=True)
    expected = {
        "embedding.word_embeddings.weight": source["embedding"],
        "decoder.final_layernorm.steps": source["steps"],
    }
    expected.update({f"decoder.layers.{i}.mlp.linear_fc1.weight": t for i, t in enumerate(source["stacked"])})
    expected.update({f"decoder.layers.{i}.self_attention.linear_qkv.weight": t for i, t in enumerate(source["qkv"])})
    written = load_file(tmp_path / "from-zarr/model.safetensors")
    assert written.keys() == expected.keys()
    assert all(written[k].dtype == v.dtype and torch.equal(written[k], v) for k, v in expected.items())


def test_cli_verifies_an_existing_zarr_output(zarr_copy, capsys):
    assert main([str(zarr_copy), "--quiet"]) == 0
    assert main([str(zarr_copy), "--verify"]) == 0
    assert "7 tensors match" in capsys.readouterr().out


def _qkv(checkpoint: Path) -> Path:
    return checkpoint / "weights" / "module.decoder.layers.self_attention.linear_qkv.weight"


@pytest.mark.parametrize(
    "damage, error, names",
    [
        (lambda c: (_qkv(c) / "0.1.0").unlink(), CorruptShardError, ["0.1.0", "chunk file missing"]),
        (lambda c: os.truncate(_qkv(c) / "0.0.0", 10), CorruptShardError, ["0.0.0", "10 bytes", "truncated"]),
        (lambda c: (_qkv(c) / "0.0.0").write_bytes(b"x" * 200), CorruptShardError, ["0.0.0", "longer than its chunk"]),
    ],
)
def test_a_missing_or_wrongly_sized_chunk_fails_naming_the_file(zarr_copy, tmp_path, damage, error, names):
    damage(zarr_copy)
    with pytest.raises(error) as info:
        consolidate_checkpoint(zarr_copy, tmp_path / "out")
    assert all(name in str(info.value) for name in names), str(info.value)
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


@pytest.mark.parametrize(
    "field, value", [("compressor", {"id": "blosc"}), ("order", "F"), ("filters", [{"id": "delta"}]), ("dtype", ">f4")]
)
def test_a_zarr_layout_that_cannot_be_read_safely_is_refused_naming_it(zarr_copy, tmp_path, field, value):
    meta_file = _qkv(zarr_copy) / ".zarray"
    meta = json.loads(meta_file.read_text())
    meta[field] = value
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(UnsupportedFormatError) as info:
        consolidate_checkpoint(zarr_copy, tmp_path / "out")
    assert "module.decoder.layers.self_attention.linear_qkv.weight" in str(info.value) and field in str(info.value)
    assert main([str(zarr_copy), "--out", str(tmp_path / "cli")]) == 6


def test_a_zarr_save_that_never_finished_is_refused(zarr_copy, tmp_path):
    (zarr_copy / "weights" / "metadata.json").unlink()  # megatron-core writes it last
    with pytest.raises(UnfinishedCheckpointError, match="unfinished checkpoint"):
        consolidate_checkpoint(zarr_copy, tmp_path / "out")
    assert main([str(zarr_copy), "--out", str(tmp_path / "cli")]) == 5


@pytest.mark.parametrize("kind", ["symlink-to-secret", "fifo", "symlinked-array"])
def test_zarr_chunks_and_arrays_that_are_not_regular_files_inside_weights_are_refused(zarr_copy, tmp_path, kind):
    chunk = _qkv(zarr_copy) / "0.0.0"
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"password" * (chunk.stat().st_size // 8 + 1))
    secret.write_bytes(secret.read_bytes()[: chunk.stat().st_size])  # exactly the chunk's size: only its kind is wrong
    if kind == "symlinked-array":
        moved = tmp_path / "elsewhere"
        shutil.move(_qkv(zarr_copy), moved)
        _qkv(zarr_copy).symlink_to(moved)
    else:
        chunk.unlink()
        chunk.symlink_to(secret) if kind == "symlink-to-secret" else os.mkfifo(chunk)
    with pytest.raises(CorruptShardError) as info:
        consolidate_checkpoint(zarr_copy, tmp_path / "out")
    assert "linear_qkv" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_zarr_shape_beyond_its_chunk_files_is_refused_before_planning(zarr_copy, tmp_path):
    meta_file = _qkv(zarr_copy) / ".zarray"
    meta = json.loads(meta_file.read_text())
    meta["shape"] = [10**15] + meta["shape"][1:]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CorruptShardError, match="chunk files; the directory holds"):
        consolidate_checkpoint(zarr_copy, tmp_path / "out")
    assert main([str(zarr_copy), "--out", str(tmp_path / "cli")]) == 8
