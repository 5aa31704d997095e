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

"""A save's identity (:mod:`nemo_patch.engine.save_identity`, issue #45): two saves under one name never share one,
a save re-written while it is read publishes nothing, a save visibly in progress is not consolidated until it ends,
and ``--verify`` tells an output of another save.

The checkpoints are written by megatron-core's own ``dist_checkpointing.save`` (``zarr`` and ``torch_dist``) in a
one-process gloo group, two saves of different tensors (seeds 0 and 1) of one layout; the oracle is PyTorch's
``dcp_to_torch_save`` of a save and, for zarr, the arrays read with the ``zarr`` package.
"""

import io
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
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.cli.watch import Watcher
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.digests import source_fingerprint
from nemo_patch.engine.errors import CorruptShardError, UnfinishedCheckpointError
from nemo_patch.engine.save_identity import is_save_changed, recorded_identity, save_identity
from nemo_patch.training.policy import parse_consolidation_frequency

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

    def state(seed):
        generator = torch.Generator().manual_seed(seed)
        stacked = torch.randn(3, 4, 6, generator=generator)
        embedding = torch.randn(10, 6, generator=generator)
        qkv = torch.randn(2, 8, 6, generator=generator)  # split in two along dim 1 as TP=2 stores it
        key = "module.decoder.layers.self_attention.linear_qkv.weight"
        return {
            "a": ShardedTensor.from_rank_offsets("module.decoder.layers.mlp.linear_fc1.weight", stacked, replica_id=0),
            "b": ShardedTensor.from_rank_offsets("module.embedding.word_embeddings.weight", embedding, replica_id=0),
            "c0": ShardedTensor.from_rank_offsets(key, qkv[:, :4], (1, 0, 2), replica_id=0),
            "c1": ShardedTensor.from_rank_offsets(key, qkv[:, 4:], (1, 1, 2), replica_id=0),
        }

    for spec in sys.argv[1:]:
        backend, seed, target = spec.split(":", 2)
        os.makedirs(target)
        with megatron_on_cpu():
            dist_checkpointing.save(state(int(seed)), target, sharded_strategy=(backend, 1))
    print("saved")
    """
)
NAME = "model--step=3-consumed_samples=8.0"  # a NeMo checkpoint name (global step 4)


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """``{(layout, seed): <ckpt>}``: two saves (seeds 0 and 1) of each of ``zarr`` and ``torch_dist``."""
    root = tmp_path_factory.mktemp("saves")
    paths = {(layout, seed): root / f"{layout}-{seed}" for layout in ("zarr", "torch_dist") for seed in (0, 1)}
    specs = [f"{layout}:{seed}:{path / 'weights'}" for (layout, seed), path in paths.items()]
    proc = subprocess.run(
        [sys.executable, "-c", SAVE, *specs], capture_output=True, text=True, cwd=REPO, timeout=300
    )  # fmt: skip
    assert proc.returncode == 0 and "saved" in proc.stdout, proc.stderr[-3000:]
    return paths


def _place(save: Path, checkpoint: Path) -> None:
    """Save ``save`` as ``checkpoint`` (new files under the name: what a second save under one name does)."""
    shutil.rmtree(checkpoint / "weights", ignore_errors=True)
    shutil.copytree(save / "weights", checkpoint / "weights")


def _oracle(save: Path, scratch: Path) -> dict:
    """The tensors of a save, read by PyTorch's ``dcp_to_torch_save`` (torch_dist) or the ``zarr`` package, with
    layer-stacked ones split per layer as the output names them."""
    if (save / "weights" / ".metadata").is_file():
        target = scratch / f"{save.name}.pt"
        dcp_to_torch_save(save / "weights", target)
        state = torch.load(target, weights_only=False)
    else:
        import zarr

        arrays = [path for path in (save / "weights").iterdir() if (path / ".zarray").is_file()]
        state = {path.name: torch.from_numpy(zarr.open(str(path), mode="r")[...]) for path in arrays}
    expected = {}
    for key, value in state.items():
        key = key.removeprefix("module.")
        if key.startswith("decoder.layers."):
            expected.update({key.replace("layers.", f"layers.{i}.", 1): value[i] for i in range(value.shape[0])})
        else:
            expected[key] = value
    return expected


def _assert_output_is(output: Path, save: Path, scratch: Path) -> None:
    written, expected = load_file(output / "model.safetensors"), _oracle(save, scratch)
    assert sorted(written) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name


@pytest.mark.parametrize("layout", ["zarr", "torch_dist"])
def test_two_saves_under_one_name_have_two_identities(saves, tmp_path, layout):
    checkpoint = tmp_path / NAME
    _place(saves[layout, 0], checkpoint)
    first = save_identity(checkpoint)
    assert (first.layout, first.global_step, first.run) == (layout, 4, None)
    _place(saves[layout, 1], checkpoint)
    second = save_identity(checkpoint)
    assert second.fingerprint != first.fingerprint and not second.same_save(first)
    if layout == "zarr":  # the old "which save" check could not tell them apart
        assert source_fingerprint(saves[layout, 0] / "weights") == source_fingerprint(saves[layout, 1] / "weights")
    # the same save read again is the same save; a file rewritten in place with its old times restored is not
    assert save_identity(checkpoint / "weights") == second
    weights = checkpoint / "weights"
    shard = next(p for p in sorted(weights.rglob("*")) if p.suffix == ".distcp" or p in _chunks(weights))
    times = shard.stat()
    shard.write_bytes(shard.read_bytes())
    os.utime(shard, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert save_identity(checkpoint).fingerprint != second.fingerprint


def test_a_zarr_checkpoint_saved_again_while_it_is_read_publishes_nothing(saves, tmp_path):
    checkpoint, output = tmp_path / NAME, tmp_path / "out"
    _place(saves["zarr", 0], checkpoint)
    swapped = []

    def progress(done: int, total: int) -> None:  # after the first tensor: the checkpoint is saved again
        if not swapped:
            swapped.append(done)
            _place(saves["zarr", 1], checkpoint)

    with pytest.raises(CorruptShardError, match="saved again while it was read") as info:
        consolidate_checkpoint(checkpoint, output, progress=progress)
    assert is_save_changed(info.value)
    assert swapped and not output.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    consolidate_checkpoint(checkpoint, output)  # the new save, whole
    _assert_output_is(output, saves["zarr", 1], tmp_path)
    assert recorded_identity(output) == save_identity(checkpoint)


def test_a_read_that_fails_because_the_checkpoint_is_saved_again_says_so(saves, tmp_path, monkeypatch):
    """A zarr checkpoint saved again while a tensor is read: the reader meets the window in which the old save's
    array is gone and the new one not yet there (forced here: the reader's open of an array is made to fall inside
    the new save's writing, which on CI happened by chance between the reader thread and the save). The landed code
    raised "Cannot read zarr array ...: FileNotFoundError", a failure a sidecar never retries; the error now says the
    save changed, and nothing is published."""
    import nemo_patch.engine.zarr_reader as zarr_reader

    checkpoint, output = tmp_path / NAME, tmp_path / "out"
    _place(saves["zarr", 0], checkpoint)
    open_below, opened = zarr_reader._open_below, []

    def open_during_a_new_save(root, parts):
        if len(opened) == 3:  # the first tensor's array and chunk read: now the checkpoint is saved again
            shutil.rmtree(checkpoint / "weights")
            try:
                return open_below(root, parts)
            finally:
                shutil.copytree(saves["zarr", 1] / "weights", checkpoint / "weights")
                opened.append("saved again")
        opened.append(parts)
        return open_below(root, parts)

    monkeypatch.setattr(zarr_reader, "_open_below", open_during_a_new_save)
    with pytest.raises(CorruptShardError, match="saved again while it was read") as info:
        consolidate_checkpoint(checkpoint, output, workers=1)
    assert "saved again" in opened and isinstance(info.value.__cause__, (CorruptShardError, OSError))
    assert is_save_changed(info.value)
    assert not output.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _rewrite_in_place(source: Path, target: Path) -> None:
    """Write ``source``'s bytes into ``target``'s existing file (same inode), as a save in place does."""
    with open(target, "r+b") as handle:
        handle.write(source.read_bytes())
        handle.truncate()


def _chunks(weights: Path) -> list:
    return sorted(p for p in weights.rglob("*") if p.is_file() and p.parent != weights and p.name != ".zarray")


def test_a_zarr_save_rewritten_in_place_is_consolidated_once_it_finishes(saves, tmp_path):
    """A zarr save that rewrites its chunks in place (no unfinished marker) while a watcher polls: nothing is
    published and it is not given up; once ``metadata.json`` is written again the new save is consolidated."""
    root = tmp_path / "checkpoints"
    checkpoint = root / NAME
    _place(saves["zarr", 0], checkpoint)
    new = saves["zarr", 1] / "weights"
    half = _chunks(checkpoint / "weights")
    for chunk in half[: len(half) // 2]:  # half of the chunks rewritten, metadata.json not yet
        _rewrite_in_place(new / chunk.relative_to(checkpoint / "weights"), chunk)
    with pytest.raises(UnfinishedCheckpointError, match="newer than 'metadata.json'"):
        save_identity(checkpoint)

    def consolidate(found, out, staging, before_publish):
        result = consolidate_checkpoint(found.path, out, global_step=found.global_step, staging_dir=staging,
                                        before_publish=before_publish)  # fmt: skip
        return result.tensor_count, result.total_bytes

    watcher = Watcher(root, parse_consolidation_frequency("each"), consolidate, until_idle=0.2, poll_interval=0.05,
                      out=io.StringIO())  # fmt: skip
    watcher.scan()
    assert not (checkpoint / "consolidated").exists(), watcher.out.getvalue()
    for chunk in half[len(half) // 2 :]:
        _rewrite_in_place(new / chunk.relative_to(checkpoint / "weights"), chunk)
    tmp = checkpoint / "weights" / "metadata.json.tmp"
    shutil.copy(new / "metadata.json", tmp)
    os.replace(tmp, checkpoint / "weights" / "metadata.json")  # written last: the save is finished
    watcher.scan()
    log = watcher.out.getvalue()
    assert (checkpoint / "consolidated" / "model.safetensors").is_file(), log
    _assert_output_is(checkpoint / "consolidated", saves["zarr", 1], tmp_path)
    assert watcher.tally.failed == 0, log


@pytest.mark.parametrize("layout", ["zarr", "torch_dist"])
def test_verify_fails_when_the_checkpoint_was_saved_again_after_its_output(saves, tmp_path, capsys, layout):
    checkpoint = tmp_path / NAME
    _place(saves[layout, 0], checkpoint)
    assert main([str(checkpoint)]) == 0
    assert main([str(checkpoint), "--verify"]) == 0
    _place(saves[layout, 0], checkpoint)  # saved again, with the very same tensors (the bitwise check passes)
    capsys.readouterr()
    assert main([str(checkpoint), "--verify"]) == 9
    assert "saved again" in capsys.readouterr().err


def _zarr_array(checkpoint: Path, name: str = "module.decoder.layers.mlp.linear_fc1.weight") -> Path:
    return checkpoint / "weights" / name


def test_zarr_chunks_that_are_hard_links_to_one_file_are_refused(saves, tmp_path):
    checkpoint = tmp_path / NAME
    _place(saves["zarr", 0], checkpoint)
    array = checkpoint / "weights" / "module.decoder.layers.self_attention.linear_qkv.weight"
    first, second = sorted(p for p in array.iterdir() if p.name != ".zarray")
    second.unlink()
    os.link(first, second)
    os.utime(checkpoint / "weights" / "metadata.json")  # the save's last file after it: only the link is wrong
    with pytest.raises(CorruptShardError, match="hard link"):
        consolidate_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_slash_separated_zarr_chunk_path_through_a_symlink_is_refused(saves, tmp_path):
    checkpoint = tmp_path / NAME
    _place(saves["zarr", 0], checkpoint)
    array = _zarr_array(checkpoint)
    meta = json.loads((array / ".zarray").read_text())
    (array / ".zarray").write_text(json.dumps({**meta, "dimension_separator": "/"}))
    chunk = (array / "0.0.0").read_bytes()
    (array / "0.0.0").unlink()
    outside = tmp_path / "outside"
    (outside / "0").mkdir(parents=True)
    (outside / "0" / "0").write_bytes(b"\x7f" * len(chunk))  # another file's bytes, of the chunk's size
    os.symlink(outside, array / "0")  # <array>/0 -> outside: the chunk <array>/0/0/0 is outside/0/0
    os.utime(checkpoint / "weights" / "metadata.json")
    with pytest.raises(CorruptShardError, match="symbolic link"):
        consolidate_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (array / "0").unlink()  # the same layout, in place: read
    (array / "0" / "0").mkdir(parents=True)
    (array / "0" / "0" / "0").write_bytes(chunk)
    os.utime(checkpoint / "weights" / "metadata.json")
    consolidate_checkpoint(checkpoint, tmp_path / "out")
    _assert_output_is(tmp_path / "out", saves["zarr", 0], tmp_path)


@pytest.fixture(scope="module")
def megatron_saves(tmp_path_factory):
    """A Megatron-LM save directory written by megatron-core (TP=2, two processes): iterations 3 and 5."""
    import socket

    root = tmp_path_factory.mktemp("megatron") / "checkpoints"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    writer = subprocess.run(
        [sys.executable, str(REPO / "tests" / "megatron_lm_checkpoints.py"), str(root), port, "3,5"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert writer.returncode == 0, writer.stderr[-4000:]
    return root


@pytest.mark.slow
def test_a_megatron_iteration_rewritten_in_place_is_unfinished_until_its_metadata_then_gives_the_new_save(
    megatron_saves, tmp_path, capsys
):
    """megatron-core saves ``iter_0000005`` again in place (a rollback with ``--ckpt-step``: it only warns
    "Overwriting"): the shards first, ``.metadata`` last, while the tracker already names 5. Half-way it is neither
    listed as finished nor consolidated; once ``.metadata`` is written the output holds the new save's tensors (the
    oracle: PyTorch's ``dcp_to_torch_save`` of that save)."""
    from test_watch import expected_tensors

    from nemo_patch.runs.run_checkpoints import TRACKER_FILENAME, list_run_checkpoints

    root = tmp_path / "checkpoints"
    checkpoint, new = root / "iter_0000005", megatron_saves / "iter_0000005"
    shutil.copytree(megatron_saves / "iter_0000003", checkpoint)  # the first save under the name (times kept)
    (root / TRACKER_FILENAME).write_text("5")
    first = save_identity(checkpoint)
    assert (first.layout, first.global_step, first.run) == ("megatron_lm", 5, None)
    shards = sorted(checkpoint.glob("*.distcp"))
    assert len(shards) > 1 and sorted(p.name for p in new.glob("*.distcp")) == [p.name for p in shards]
    _rewrite_in_place(new / shards[0].name, shards[0])  # the save in place has begun
    assert checkpoint in list_run_checkpoints(root).not_finished
    with pytest.raises(UnfinishedCheckpointError, match="newer than '.metadata'"):
        save_identity(checkpoint)
    capsys.readouterr()
    assert main([str(checkpoint)]) == 5, capsys.readouterr().err
    assert not (checkpoint / "consolidated").exists()
    for shard in shards[1:]:
        _rewrite_in_place(new / shard.name, shard)
    _rewrite_in_place(new / "common.pt", checkpoint / "common.pt")
    shutil.copy(new / ".metadata", checkpoint / ".metadata.tmp")
    os.replace(checkpoint / ".metadata.tmp", checkpoint / ".metadata")  # written last, as torch's writer does
    _rewrite_in_place(new / "metadata.json", checkpoint / "metadata.json")
    assert [c.path for c in list_run_checkpoints(root).finished] == [checkpoint]
    assert not save_identity(checkpoint).same_save(first)
    assert main([str(checkpoint)]) == 0
    written = load_file(checkpoint / "consolidated" / "model.safetensors")
    expected = expected_tensors(new, tmp_path)
    assert sorted(written) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
    assert recorded_identity(checkpoint / "consolidated") == save_identity(checkpoint)
