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

"""``--verify`` compares the output's names and shapes with the model the checkpoint's ``context/`` describes, built
on the meta device; a mismatch exits 9 naming the first differing key and publishes nothing."""

import shutil
import subprocess
import sys

import pytest

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.export.context_model import context_model_shapes

FFN = "[\"Attr(name='ffn_hidden_size')\", {\"type\": \"leaf\", \"value\": 128"


@pytest.fixture()
def llama_copy(imported_llama, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(imported_llama / "nemo", copy)
    return copy


def test_the_context_model_is_built_on_the_meta_device_with_consolidated_names(llama_copy):
    shapes = context_model_shapes(llama_copy, trust_context=True)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (256, 64)  # gated: 2 x ffn_hidden_size
    assert shapes["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] == (64,)  # the canonical name
    assert shapes["embedding.word_embeddings.weight"] == (128, 64)


def test_an_output_that_does_not_match_the_context_exits_9_naming_the_key(llama_copy, tmp_path, capsys):
    assert (
        main([str(llama_copy), "--verify", "--trust-context", "--quiet"]) == 0
    )  # matches: names, shapes and every tensor
    io_json = llama_copy / "context" / "io.json"
    assert FFN in io_json.read_text()
    io_json.write_text(io_json.read_text().replace(FFN, FFN.replace("128", "96")))
    capsys.readouterr()

    code = main(
        [str(llama_copy), "--verify", "--trust-context", "--out", str(tmp_path / "new")]
    )  # a new consolidation
    err = capsys.readouterr().err
    assert code == 9, err
    assert "first differing key decoder.layers.0.mlp.linear_fc1.weight is shape [256, 64] in the output and " in err
    assert "shape [192, 64] in the model" in err
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".*tmp*"))  # nothing published

    code = main([str(llama_copy), "--verify", "--trust-context"])  # the existing output, checked in place
    assert code == 9 and "first differing key decoder.layers.0.mlp.linear_fc1.weight" in capsys.readouterr().err


def test_a_context_that_cannot_be_built_is_reported_and_the_tensors_still_compared(llama_copy, capsys):
    shutil.rmtree(llama_copy / "context")
    (llama_copy / "context").mkdir()
    (llama_copy / "context" / "io.json").write_text("{}")
    assert main([str(llama_copy), "--verify", "--trust-context", "--quiet"]) == 0
    assert "warning: names and shapes not compared with the checkpoint's context: Cannot read the model" in (
        capsys.readouterr().err
    )


def test_verify_with_a_context_prints_one_summary_line(llama_copy):
    """Building the context's model makes NeMo log on stdout; the command's output stays its summary line (a real
    process: in-process, NeMo's logging handler writes to whatever stream pytest gave it at import)."""
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_patch", str(llama_copy), "--verify"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Consolidated ") and lines[0].endswith("verified"), proc.stdout
