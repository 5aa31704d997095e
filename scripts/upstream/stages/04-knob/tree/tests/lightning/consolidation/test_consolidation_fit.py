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

"""``MegatronStrategy(ckpt_consolidation_frequency=...)`` in a real fit: the checkpoints due under the cadence are
consolidated, off the training path, into exactly the tensors the checkpoint holds."""

import json

import pytest
import torch
from conftest import HERE, run_python
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _checkpoint_tensors(weights_dir, tmp_path):
    """The model tensors of a checkpoint according to PyTorch's own DCP converter, split per layer."""
    dcp_to_torch_save(str(weights_dir), str(tmp_path / "reference.pt"))
    full = torch.load(tmp_path / "reference.pt", weights_only=False)
    tensors = {}
    for key, value in full.items():
        if not key.startswith("module.") or "_extra_state" in key or not isinstance(value, torch.Tensor):
            continue
        name = key[len("module.") :]
        if ".layers." in name:
            head, tail = name.split(".layers.", 1)
            tensors.update({f"{head}.layers.{layer}.{tail}": value[layer] for layer in range(value.shape[0])})
        else:
            tensors[name] = value
    return tensors


@pytest.fixture(scope="module")
def every_second(tmp_path_factory):
    """A 4-step fit saving every step, consolidating every second finished checkpoint."""
    log_dir = tmp_path_factory.mktemp("fit")
    proc = run_python(
        str(HERE / "tiny_fit.py"),
        str(log_dir),
        "4",
        'ckpt_consolidation_frequency="every_n:2"',
        "ckpt_consolidation_workers=2",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return log_dir


def test_checkpoints_due_under_the_cadence_are_consolidated(every_second, tmp_path):
    root = every_second / "tiny_gpt" / "checkpoints"
    checkpoints = sorted(
        (p for p in root.iterdir() if (p / "weights").is_dir() and not p.is_symlink()),
        key=lambda p: float(p.name.rsplit("consumed_samples=", 1)[1]),  # in the order they were saved
    )
    consolidated = [p for p in checkpoints if (p / "consolidated").is_dir()]
    assert len(checkpoints) == 4 and consolidated == checkpoints[1::2]  # the 2nd and the 4th finished checkpoints
    assert (root / "LATEST").resolve() == checkpoints[-1].resolve()
    for checkpoint in checkpoints[1::2]:
        expected = _checkpoint_tensors(checkpoint / "weights", tmp_path)
        output = load_file(checkpoint / "consolidated" / "model.safetensors")
        assert set(output) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(output[name], tensor), name


def test_the_consolidation_process_starts_in_setup_and_the_loop_does_not_wait(every_second):
    report = json.loads((every_second / "report.json").read_text())
    assert report["process_started_before_training"]  # the callback's setup hook ran, though added in setup
    assert len(report["blocked_seconds"]) == 1 and report["blocked_seconds"][0] < 5.0


def test_a_lora_run_consolidates_its_adapter_checkpoints(every_second, tmp_path):
    """NeMo's PEFT callback rebuilds the checkpoint IO in its setup: consolidation must survive that."""
    base = sorted((every_second / "tiny_gpt" / "checkpoints").glob("*consumed_samples=8.0"))[0]
    log_dir = tmp_path / "lora"
    proc = run_python(
        str(HERE / "tiny_fit.py"),
        str(log_dir),
        "2",
        'ckpt_consolidation_frequency="each"',
        f"lora_from={json.dumps(str(base))}",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    root = log_dir / "tiny_gpt" / "checkpoints"
    checkpoints = [p for p in root.iterdir() if (p / "weights").is_dir() and not p.is_symlink()]
    assert len(checkpoints) == 2
    for checkpoint in checkpoints:
        metadata = json.loads((checkpoint / "consolidated" / "metadata.json").read_text())
        assert metadata["kind"] == "adapter" and metadata["peft"]["method"].endswith(".LoRA")
        adapters = load_file(checkpoint / "consolidated" / "adapter_model.safetensors")
        assert adapters and all("adapter" in name or "lora" in name for name in adapters), sorted(adapters)[:4]
