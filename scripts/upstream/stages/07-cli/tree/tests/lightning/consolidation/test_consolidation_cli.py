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

"""The converter command on a real checkpoint: consolidate, verify an existing output, load it back."""

import json
import runpy

import pytest
import torch
from conftest import ROOT
from nemo.lightning.io.consolidation.cli.nemo_consolidate import main
from nemo.lightning.io.consolidation.engine.load import load_consolidated_state_dict


@pytest.fixture
def consolidated(dist_checkpoint, tmp_path):
    checkpoint, reference = dist_checkpoint
    out = tmp_path / "out"
    assert main([str(checkpoint), "--out", str(out), "--workers", "2", "--max-shard-size", "40KB", "--quiet"]) == 0
    return checkpoint, reference, out


def test_consolidated_output_loads_back(consolidated):
    _, reference, out = consolidated
    assert (out / "model.safetensors.index.json").is_file()  # shards, read through their index
    loaded = load_consolidated_state_dict(out)
    assert set(loaded) == set(reference)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in reference.items())


def test_verify_checks_an_existing_output_against_the_checkpoint(consolidated, capsys):
    checkpoint, reference, out = consolidated
    assert main([str(checkpoint), "--out", str(out), "--verify"]) == 0
    assert f"{len(reference)} tensors match" in capsys.readouterr().out
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    header = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    data = bytearray(shard.read_bytes())
    data[header] ^= 0x40  # the first byte of the first tensor's data
    shard.write_bytes(bytes(data))
    assert main([str(checkpoint), "--out", str(out), "--verify"]) == 9  # VerificationError
    assert "differs" in capsys.readouterr().err


def test_exit_codes_name_the_cause(dist_checkpoint, tmp_path, capsys):
    checkpoint, _ = dist_checkpoint
    assert main([str(tmp_path / "missing")]) == 3
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 4
    out = tmp_path / "out"
    assert main([str(checkpoint), "--out", str(out), "--quiet"]) == 0
    assert main([str(checkpoint), "--out", str(out), "--quiet"]) == 7  # an existing output; --force replaces it
    assert json.loads((out / "metadata.json").read_text())["kind"] == "model"
    with pytest.raises(SystemExit):  # argparse: the multi-node launch option is not part of this command
        main([str(checkpoint), "--timeout", "10"])


def test_the_converter_script_takes_the_options_of_the_earlier_patches(dist_checkpoint, tmp_path):
    checkpoint, reference = dist_checkpoint
    converter = runpy.run_path(str(ROOT / "scripts" / "checkpoint_converters" / "consolidate_nemo2_checkpoint.py"))
    out = tmp_path / "converted"
    assert (
        converter["main"]([str(checkpoint), "--out", str(out), "--dtype", "fp16", "--verify", "--workers", "2"]) == 0
    )
    assert json.loads((out / "metadata.json").read_text())["dtype"] == "float16"
    loaded = load_consolidated_state_dict(out)
    assert all(torch.equal(loaded[name], tensor.to(torch.float16)) for name, tensor in reference.items())
