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

"""Outputs that looked fine but were wrong: a layer missing from every entry, a ``--dtype fp16`` that overflows.

Every test starts from a private copy of the real TP=2 checkpoint of a NeMo fit (``tp2_checkpoint``) and damages it:

* the metadata loses layer 1's chunks and records in every layer-stacked entry while the declared sizes still say 2
  layers: the consolidation must refuse the hole (exit 8, naming the layer and an entry), not write a 1-layer model;
* ``decoder.final_layernorm.weight`` is stored again (a new ``torch.save`` record appended to its shard, as DCP writes
  one) holding values beyond ``fp16``'s range: ``--dtype fp16`` must refuse (exit 18, naming the tensor and the
  largest magnitude), ``--dtype bf16`` must still work, a value that only underflows to 0 is not refused, and
  ``--verify`` must see an output holding ``inf`` where the checkpoint is finite.

The oracle is torch's own: the damaged metadata read back with ``FileSystemReader.read_metadata`` and the damaged
tensor read with ``torch.distributed.checkpoint.load``.
"""

import contextlib
import io
import pickle
import shutil
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from nemo_patch.cli.nemo_consolidate import main as consolidate_main
from nemo_patch.engine.casting import DtypeOverflowError
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.metadata_checks import read_dcp_metadata
from nemo_patch.engine.verify import VerificationError, verify_consolidated

# Every test here starts from the real TP=2 fit of the tp2_checkpoint fixture.
pytestmark = pytest.mark.slow

NORM = "module.decoder.final_layernorm.weight"
STACKED = "module.decoder.layers."


@pytest.fixture()
def victim(tp2_checkpoint, tmp_path) -> Path:
    """A private copy of the TP=2 checkpoint."""
    copy = tmp_path / "ckpts" / tp2_checkpoint.name
    shutil.copytree(tp2_checkpoint, copy, ignore=shutil.ignore_patterns("consolidated"))
    return copy


def write_metadata(checkpoint: Path, metadata) -> None:
    """Write ``metadata`` as torch's own ``Metadata`` (the format ``FileSystemWriter`` writes: a pickle of it)."""
    fields = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    plain = Metadata(**{name: getattr(metadata, name) for name in fields})
    (checkpoint / "weights" / ".metadata").write_bytes(pickle.dumps(plain))


def run_cli(args: List[str]) -> Tuple[int, List[str]]:
    """``nemo-consolidate`` in-process; returns (exit code, stderr lines)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = consolidate_main(args + ["--quiet", "--workers", "1"])
    return code, [line for line in stderr.getvalue().splitlines() if line.strip() and "pynvml" not in line]


def assert_refused(code: int, lines: List[str], expected_code: int, out: Path, *words: str) -> None:
    assert code == expected_code, lines
    assert len(lines) == 1 and lines[0].startswith("nemo-consolidate: error: "), lines
    for word in words:
        assert word in lines[0], lines
    assert not out.exists()


# --- A. a layer no entry holds ---------------------------------------------------------------------------------------


def _is_stacked(key: str) -> bool:
    return key.startswith(STACKED) and not key[len(STACKED)].isdigit() and "_extra_state" not in key


def test_a_layer_missing_from_every_stacked_entry_is_a_hole_not_a_smaller_model(victim, tmp_path):
    metadata = read_dcp_metadata(victim / "weights")
    stacked = [key for key, item in metadata.state_dict_metadata.items() if _is_stacked(key) and item.chunks]
    assert len(stacked) >= 6
    for key in stacked:
        item = metadata.state_dict_metadata[key]
        item.chunks = [chunk for chunk in item.chunks if chunk.offsets[0] != 1]
    for index in list(metadata.storage_data):
        if index.fqn in stacked and index.offset is not None and index.offset[0] == 1:
            del metadata.storage_data[index]
    write_metadata(victim, metadata)

    # torch's own reader: every stacked entry still declares 2 layers, and no chunk of any of them holds layer 1
    damaged = FileSystemReader(str(victim / "weights")).read_metadata()
    for key in stacked:
        item = damaged.state_dict_metadata[key]
        assert item.size[0] == 2 and item.chunks
        assert all(chunk.offsets[0] + chunk.sizes[0] <= 1 for chunk in item.chunks), key
    assert not [index for index in damaged.storage_data if index.fqn in stacked and index.offset[0] == 1]

    out = tmp_path / "out"
    code, lines = run_cli([str(victim), "--out", str(out)])
    assert_refused(code, lines, 8, out, "layer 1", STACKED)
    assert any(key in lines[0] for key in stacked), lines


@pytest.mark.parametrize("how", ["chunk-dropped", "chunk-sized-zero"])
def test_a_layer_missing_from_one_entry_of_a_module_is_a_hole_not_a_missing_tensor(victim, tmp_path, how):
    """Layer 1 of one parameter (``linear_qkv.layer_norm_weight``) is gone while the module's other entries and the
    rest of the stack still hold layer 1: the output would lack one tensor of layer 1 and look complete."""
    metadata = read_dcp_metadata(victim / "weights")
    key = next(key for key in metadata.state_dict_metadata if _is_stacked(key) and key.endswith("layer_norm_weight"))
    item = metadata.state_dict_metadata[key]
    chunk = next(chunk for chunk in item.chunks if chunk.offsets[0] == 1)
    if how == "chunk-dropped":
        item.chunks = [other for other in item.chunks if other is not chunk]
        for index in list(metadata.storage_data):  # and its record, as if never saved
            if index.fqn == key and index.offset is not None and index.offset[0] == 1:
                del metadata.storage_data[index]
    else:
        chunk.sizes = torch.Size([0, *chunk.sizes[1:]])
    write_metadata(victim, metadata)

    out = tmp_path / "out"
    code, lines = run_cli([str(victim), "--out", str(out)])
    assert_refused(code, lines, 8, out, key, "same module", "hole")


# --- B. a cast that overflows ----------------------------------------------------------------------------------------


def store_norm(checkpoint: Path, head: List[float]) -> torch.Tensor:
    """Store ``decoder.final_layernorm.weight`` again as ``head`` followed by 0.5s: a new record
    (``torch.save`` of the tensor, as DCP's writer stores one) appended to its shard file; returns what torch's own
    ``torch.distributed.checkpoint.load`` reads back."""
    weights = checkpoint / "weights"
    metadata = read_dcp_metadata(weights)
    item = metadata.state_dict_metadata[NORM]
    assert len(item.chunks) == 1 and item.properties.dtype == torch.float32
    index = MetadataIndex(NORM, item.chunks[0].offsets)
    info = metadata.storage_data[index]
    values = torch.full(tuple(item.size), 0.5)
    values[: len(head)] = torch.tensor(head)
    blob = io.BytesIO()
    torch.save(values, blob)
    shard = weights / info.relative_path
    offset = shard.stat().st_size
    with shard.open("ab") as handle:
        handle.write(blob.getvalue())
    info.offset, info.length = offset, len(blob.getvalue())
    write_metadata(checkpoint, metadata)

    read = {NORM: torch.empty(tuple(item.size))}
    dcp.load(read, storage_reader=FileSystemReader(str(weights)), no_dist=True)
    assert torch.equal(read[NORM][: len(head)], torch.tensor(head)), read[NORM][: len(head)]
    return read[NORM]


def test_a_dtype_that_overflows_is_refused_naming_the_tensor_and_its_largest_magnitude(victim, tmp_path):
    source = store_norm(victim, [1e6, -7e4, 1.0, 1e-9])
    assert torch.isfinite(source).all() and not torch.isfinite(source.to(torch.float16)).all()

    out = tmp_path / "fp16"
    code, lines = run_cli([str(victim), "--out", str(out), "--dtype", "fp16", "--verify"])
    assert_refused(code, lines, 18, out, "decoder.final_layernorm.weight", "1e+06", "bf16")

    # the strategy's ckpt_consolidation_dtype takes the same engine call, here with two writer processes
    with pytest.raises(DtypeOverflowError, match=r"decoder\.final_layernorm\.weight.*1e\+06"):
        consolidate_checkpoint(victim, tmp_path / "api", dtype=torch.float16, workers=2)
    assert not (tmp_path / "api").exists()

    # bf16 has fp32's exponent range: the same checkpoint consolidates, and verifies
    out = tmp_path / "bf16"
    code, lines = run_cli([str(victim), "--out", str(out), "--dtype", "bf16", "--verify"])
    assert code == 0, lines
    got = load_file(str(out / "model.safetensors"))["decoder.final_layernorm.weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, source.to(torch.bfloat16))


def test_a_value_that_only_underflows_to_zero_is_not_refused(victim, tmp_path):
    source = store_norm(victim, [6e4, -6e4, 1.0, 1e-9])
    out = tmp_path / "fp16"
    code, lines = run_cli([str(victim), "--out", str(out), "--dtype", "fp16", "--verify"])
    assert code == 0, lines
    got = load_file(str(out / "model.safetensors"))["decoder.final_layernorm.weight"]
    assert got.dtype == torch.float16 and torch.equal(got, source.to(torch.float16))
    assert got[3] == 0 and torch.isfinite(got).all()

    # and 7e4 (above fp16's 65504) in the same place is refused
    store_norm(victim, [7e4])
    out = tmp_path / "fp16-again"
    code, lines = run_cli([str(victim), "--out", str(out), "--dtype", "fp16"])
    assert_refused(code, lines, 18, out, "decoder.final_layernorm.weight", "70000")


def test_verify_sees_an_output_holding_inf_where_the_checkpoint_is_finite(victim, tmp_path):
    source = store_norm(victim, [1e6, -7e4, 1.0, 1e-9])
    out = tmp_path / "out"
    consolidate_checkpoint(victim, out)  # as stored (fp32): nothing to refuse
    path = out / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata()
    # the fp16 output an unchecked cast writes: inf and -inf for 1e6 and -7e4
    tensors = {name: tensor.to(torch.float16) for name, tensor in load_file(str(path)).items()}
    assert tensors["decoder.final_layernorm.weight"][:2].isinf().all()
    assert torch.equal(tensors["decoder.final_layernorm.weight"], source.to(torch.float16))
    save_file(tensors, str(path), metadata=header)

    with pytest.raises(VerificationError, match=r"decoder\.final_layernorm\.weight.*inf.*1e\+06"):
        verify_consolidated(victim / "weights", out)
