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

"""Several writers fill one consolidation: processes on one node, and torchrun/srun ranks offline.

The slow tests consolidate the real checkpoint of the ``each_run`` fit (NeMo ``llm.train`` on the CPU) and compare
the files, ``metadata.json`` included, byte for byte with a one-writer consolidation of the same checkpoint.
"""

import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from test_part_writer import plan_files

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.engine import parts as parts_module
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.digests import verify_digests
from nemo_patch.engine.errors import ConsolidationError, CorruptShardError
from nemo_patch.engine.part_writer import placements_of, split_parts
from nemo_patch.engine.publish import TMP_PREFIX
from nemo_patch.engine.safetensors_writer import TensorSpec
from nemo_patch.engine.verify import VerificationError


def _files(directory):
    """Every output file's bytes; ``metadata.json`` without ``source_checkpoint`` (relative to where it is)."""
    files = {path.name: path.read_bytes() for path in sorted(Path(directory).iterdir())}
    meta = json.loads(files["metadata.json"])
    meta.pop("source_checkpoint")
    files["metadata.json"] = json.dumps(meta, sort_keys=True).encode()
    return files


def _leftovers(directory):
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith(TMP_PREFIX))


@pytest.fixture(scope="module")
def reference(each_run, tmp_path_factory):
    """One writer's outputs of the each_run checkpoint at global step 6: single file, 3 shards, bf16, and the single
    file as the CLI writes it (the global step it reads from the checkpoint recorded)."""
    checkpoint = each_run["root"] / "LATEST"
    out = tmp_path_factory.mktemp("reference")
    return {
        "single": _files(consolidate_checkpoint(checkpoint, out / "single", workers=1).output_dir),
        "cli": _files(consolidate_checkpoint(checkpoint, out / "cli", workers=1, global_step=6).output_dir),
        "sharded": _files(consolidate_checkpoint(checkpoint, out / "sharded", max_shard_size=40_000).output_dir),
        "bf16": _files(consolidate_checkpoint(checkpoint, out / "bf16", dtype=torch.bfloat16).output_dir),
    }


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("variant", ["single", "sharded", "bf16"])
def test_any_number_of_writers_writes_the_same_bytes(each_run, reference, tmp_path, workers, variant):
    options = {"sharded": {"max_shard_size": 40_000}, "bf16": {"dtype": torch.bfloat16}}.get(variant, {})
    result = consolidate_checkpoint(each_run["root"] / "LATEST", tmp_path / "out", workers=workers, **options)
    assert _files(result.output_dir) == reference[variant]
    if variant == "sharded":
        assert len([name for name in reference[variant] if name.endswith(".safetensors")]) >= 3
    assert set(result.stage_seconds) >= {"metadata", "read_crc", "placement", "hashing", "write", "fsync"}
    assert verify_digests(result.output_dir) == result.tensor_count


def test_more_writers_than_tensors_start_one_per_tensor_and_write_the_same_bytes(
    each_run, reference, tmp_path, monkeypatch
):
    started = []
    real_run_parts = parts_module.run_parts

    def run_parts(jobs, *args, **kwargs):
        started.append(len(jobs))
        return real_run_parts(jobs, *args, **kwargs)

    monkeypatch.setattr(parts_module, "run_parts", run_parts)
    result = consolidate_checkpoint(each_run["root"] / "LATEST", tmp_path / "out", workers=10**9)
    assert _files(result.output_dir) == reference["single"]
    assert started == [result.tensor_count]


@pytest.mark.slow
def test_writers_from_a_forkserver_write_the_same_bytes(each_run, reference, tmp_path, monkeypatch):
    """A process that cannot fork safely (NeMo imported, a gloo group: ``--verify`` with a context, a torchrun rank)
    gets its writers from a forkserver."""
    monkeypatch.setattr(parts_module, "_fork_is_safe", lambda: False)
    assert parts_module._context().get_start_method() == "forkserver"
    result = consolidate_checkpoint(each_run["root"] / "LATEST", tmp_path / "out", workers=2)
    assert _files(result.output_dir) == reference["single"]


def test_parts_are_contiguous_disjoint_and_balanced():
    specs = [TensorSpec(f"t{i}", torch.float32, (n,)) for i, n in enumerate([10, 1000, 3, 3, 500, 500, 7, 2000])]
    files = plan_files(specs, max_shard_size=2500)
    everything = placements_of(files)
    for count in (1, 2, 3, 4, 20):
        parts = split_parts(files, count)
        assert len(parts) == count
        assert [p for part in parts for p in part] == everything  # in file order, each tensor once
        sizes = [sum(p.nbytes for p in part) for part in parts]
        if count <= 3:
            assert max(sizes) - min(sizes) <= 2 * 2000 * 4  # within about one large tensor
    ranges = sorted((p.file, p.offset, p.offset + p.nbytes) for p in everything)
    for (file_a, _, end_a), (file_b, start_b, _) in zip(ranges, ranges[1:]):
        assert file_a != file_b or end_a == start_b  # no gaps or overlaps within a file
    with pytest.raises(ValueError, match="number of parts must be >= 1"):
        split_parts(files, 0)


def _corrupt_last_stored_chunk(checkpoint):
    """Flip a bit in the stored data of the tensor written last (the last part's), every TP shard of it."""
    from nemo_patch.engine.metadata_checks import read_dcp_metadata
    from nemo_patch.engine.plan import plan_outputs

    metadata = read_dcp_metadata(checkpoint / "weights")
    last = plan_outputs(metadata)[-1]
    chunks = [
        info
        for index, info in metadata.storage_data.items()
        if index.fqn == last.key and tuple(index.offset[: len(last.index)]) == last.index
    ]
    for info in chunks:
        shard = checkpoint / "weights" / info.relative_path
        data = bytearray(shard.read_bytes())
        data[info.offset + info.length // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    return chunks[0].relative_path


@pytest.mark.slow
def test_a_failing_part_fails_the_whole_consolidation_and_leaves_nothing(checkpoint_copy, tmp_path):
    shard = _corrupt_last_stored_chunk(checkpoint_copy)
    with pytest.raises(CorruptShardError, match=shard):
        consolidate_checkpoint(checkpoint_copy, tmp_path / "out", workers=3)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)
    assert not multiprocessing.active_children()  # the other writers were stopped


@pytest.mark.slow
def test_a_killed_writer_names_its_part_and_the_others_are_stopped(checkpoint_copy, tmp_path, monkeypatch):
    real = parts_module.run_part

    def dies_in_part_1(job, *args, **kwargs):
        if job.index == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
        return real(job, *args, **kwargs)

    monkeypatch.setattr(parts_module, "_fork_is_safe", lambda: True)  # even after another test imported NeMo here
    monkeypatch.setattr(parts_module, "run_part", dies_in_part_1)  # forked writers inherit it
    with pytest.raises(ConsolidationError, match=r"writer process \d+ of part 1 was killed by SIGKILL"):
        consolidate_checkpoint(checkpoint_copy, tmp_path / "out", workers=3)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_verify_digests_names_a_changed_tensor_and_a_changed_header(reference, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name, data in reference["sharded"].items():
        (out / name).write_bytes(data)
    assert verify_digests(out) > 0
    meta = json.loads((out / "metadata.json").read_text())
    name, entry = next((n, e) for n, e in meta["files"].items() if "tensors_blake3" in e)
    tensor = sorted(entry["tensors_blake3"])[0]
    with open(out / name, "rb") as handle:
        header_size = 8 + int.from_bytes(handle.read(8), "little")
        begin = json.loads(handle.read(header_size - 8))[tensor]["data_offsets"][0]
    data = bytearray((out / name).read_bytes())
    data[header_size + begin] ^= 0x10
    (out / name).write_bytes(bytes(data))
    with pytest.raises(VerificationError, match=f"tensor {tensor} differs"):
        verify_digests(out)
    data[header_size + begin] ^= 0x10
    data[20] = ord(" ") if data[20] != ord(" ") else ord("x")
    (out / name).write_bytes(bytes(data))
    with pytest.raises(VerificationError, match="header differs"):
        verify_digests(out)


def test_shares_are_consecutive_and_equal_or_refused():
    from nemo_patch.engine.parts import split_shares

    assert split_shares(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_shares(list(range(4)), 1) == [[0, 1, 2, 3]]
    for jobs, count in ((list(range(5)), 2), (list(range(2)), 0)):
        with pytest.raises(ValueError, match="cannot be split into"):
            split_shares(jobs, count)


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_workers_must_be_a_whole_number_of_processes(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["/nonexistent", "--workers", value])
    assert exit_info.value.code == 2
    shown = value if value.isdigit() else repr(value)  # a whole number is shown as the number it parsed to
    assert f"argument --workers: Invalid --workers {shown}: expected a whole number of writer processes >= 1" in (
        capsys.readouterr().err
    )


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(nodes, *argv, module="nemo_patch", timeout=600):
    """``torchrun --nnodes N --nproc-per-node 1 --node-rank r -m <module>`` for each r, as separate launches (one per
    "node")."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NEMO_PATCH_DISABLE")}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                module,
                *map(str, argv),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )  # fmt: skip
        for rank in range(nodes)
    ]
    return [(proc.wait(timeout=timeout), *proc.communicate()) for proc in procs]


@pytest.mark.slow
@pytest.mark.parametrize("nodes, workers", [(2, 1), (3, 1), (2, 2)])
def test_torchrun_nodes_split_the_cli_work_and_write_the_same_bytes(each_run, reference, tmp_path, nodes, workers):
    results = _torchrun(nodes, each_run["root"] / "LATEST", "--out", tmp_path / "out", "--workers", workers)
    assert [code for code, _, _ in results] == [0] * nodes, results
    assert f"by {nodes} nodes" in results[0][1]
    assert _files(tmp_path / "out") == reference["cli"]


@pytest.mark.slow
def test_a_torchrun_node_whose_part_fails_fails_every_node_and_publishes_nothing(checkpoint_copy, tmp_path):
    shard = _corrupt_last_stored_chunk(checkpoint_copy)  # in the last rank's share
    results = _torchrun(2, checkpoint_copy, "--out", tmp_path / "out", "--workers", "1")
    assert all(code != 0 for code, _, _ in results), results
    for _, _, err in results:  # torchrun exits 1 and reports each process's own code: the corrupt shard's, 8
        assert re.search(r"exitcode\s*:\s*8", err), err[-3000:]
    assert f"rank 1 of 2 failed its part: Cannot read shard file(s) {shard}" in results[0][2]
    assert "nemo-consolidate: error" not in results[1][2]  # reported once, by rank 0
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_srun_without_a_rendezvous_address_is_refused(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert main(["/nonexistent"]) == 1
    assert "without MASTER_ADDR and MASTER_PORT" in capsys.readouterr().err
