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

"""LoRA fine-tuning through NeMo's own ``llm.finetune`` on the CPU (issue #12): the PEFT callback rebuilds the
checkpoint IO and saves adapter-only checkpoints; consolidation stays on and writes ``adapter_model.safetensors``.

NeMo 2.7.3's LoRA needs two Transformer-Engine-absent fixes on this machine, in the CPU harness only (stub 9 of
``nemo_patch.testing.cpu_harness``)."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, run_fit

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.testing.fit_run import LORA_ALPHA, LORA_DIM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_run(imported_llama, tmp_path_factory):
    """4 LoRA steps from the imported Llama, a checkpoint every 2, NeMo's default async save, ``"each"``."""
    out = tmp_path_factory.mktemp("lora")
    report = run_fit(
        out, model_from=imported_llama / "nemo", peft="lora", frequency="each", max_steps=4, save_every=2,
        async_save=True,
    )  # fmt: skip
    report["root"] = out / "tiny_gpt" / "checkpoints"
    return report


def test_lora_checkpoints_are_consolidated_as_adapters(lora_run, imported_llama):
    assert lora_run["consolidation_errors"] == [] and lora_run["consolidations"] == 2
    root = lora_run["root"]
    assert lora_run["latest"] == lora_run["latest_target"] == "tiny_gpt--step=3-consumed_samples=8.0"
    for entry in lora_run["checkpoints"]:  # both saves and the -last copy
        output = root / entry["name"] / "consolidated"
        assert sorted(p.name for p in output.iterdir()) == ["adapter_model.safetensors", "metadata.json"], entry
        meta = json.loads((output / "metadata.json").read_text())
        assert meta["kind"] == "adapter" and meta["base_checkpoint"] == str(imported_llama / "nemo")
        assert meta["tensor_count"] == 8  # 2 layers x (linear_qkv, linear_proj) x (linear_in, linear_out)
        peft = meta["peft"]
        assert peft["method"] == "nemo.collections.llm.peft.lora.LoRA"
        assert (peft["dim"], peft["alpha"], peft["target_modules"]) == (
            LORA_DIM,
            LORA_ALPHA,
            ["linear_qkv", "linear_proj"],
        )
    # Every adapter tensor equals megatron-core's own reading of the distributed checkpoint, bit for bit.
    newest = root / lora_run["latest"]
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_patch.testing.mcore_compare", newest / "weights", newest / "consolidated"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and json.loads(proc.stdout.strip().splitlines()[-1]) == {"compared": 8}, proc.stderr


def test_the_cli_writes_adapters_and_says_so(lora_run, tmp_path, capsys):
    newest = lora_run["root"] / lora_run["latest"]
    assert main([str(newest), "--out", str(tmp_path / "out"), "--verify"]) == 0
    assert ": 8 adapter tensors, " in capsys.readouterr().out
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == (
        newest / "consolidated" / "adapter_model.safetensors"
    ).read_bytes()
    assert main([str(newest), "--format", "hf", "--out", str(tmp_path / "hf")]) == 12
    assert "hf-peft" in capsys.readouterr().err and not (tmp_path / "hf").exists()
