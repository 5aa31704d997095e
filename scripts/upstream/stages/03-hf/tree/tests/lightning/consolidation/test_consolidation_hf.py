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

"""The ``hf`` format: a NeMo checkpoint exported through the model's registered ``hf`` exporter, from its files on the
CPU, gives back the Hugging Face model it was imported from, tensor for tensor."""

import json
import runpy

import pytest
import torch
from conftest import HERE, ROOT, run_python
from nemo.lightning.io.consolidation.export.hf import export_hf_checkpoint

CONVERTER = ROOT / "scripts" / "checkpoint_converters" / "consolidate_nemo2_checkpoint.py"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """``hf/``: a random tiny Llama; ``nemo/``: its NeMo checkpoint, imported by NeMo's importer
    (``tiny_llama.py``)."""
    out = tmp_path_factory.mktemp("llama")
    proc = run_python(str(HERE / "tiny_llama.py"), str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _hf_state(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).state_dict()


def test_round_trip_gives_back_the_hugging_face_model(llama, tmp_path):
    result = export_hf_checkpoint(llama / "nemo", tmp_path / "hf", global_step=0)
    assert (result.output_dir / "config.json").is_file() and (result.output_dir / "metadata.json").is_file()
    exported, original = _hf_state(result.output_dir), _hf_state(llama / "hf")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((result.output_dir / "config.json").read_text())["num_key_value_heads"] == 2


def test_converter_script_exports_hf_only_for_a_trusted_context(llama, tmp_path):
    converter = runpy.run_path(str(CONVERTER))
    out = tmp_path / "converted"
    # The context names tiny_llama.CpuLlamaConfig, code outside NeMo's packages: loading it would run that code.
    assert converter["main"]([str(llama / "nemo"), "--format", "hf", "--out", str(out)]) == 16
    assert not out.exists()
    assert converter["main"]([str(llama / "nemo"), "--format", "hf", "--out", str(out), "--trust-context"]) == 0
    exported, original = _hf_state(out), _hf_state(llama / "hf")
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())
