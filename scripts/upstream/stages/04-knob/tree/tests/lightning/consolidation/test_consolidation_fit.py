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
from safetensors.torch import load_file
from tiny_fit import checkpoint_tensors, checkpoints
from tiny_fit import every_second as every_second_fit


@pytest.fixture(scope="module")
def every_second(tmp_path_factory):
    """A 4-step fit saving every step, consolidating every second finished checkpoint with two writers."""
    return every_second_fit(tmp_path_factory)


def test_checkpoints_due_under_the_cadence_are_consolidated(every_second, tmp_path):
    saved = checkpoints(every_second / "tiny_gpt" / "checkpoints")
    consolidated = [p for p in saved if (p / "consolidated").is_dir()]
    assert len(saved) == 4 and consolidated == saved[1::2]  # the 2nd and the 4th finished checkpoints
    for checkpoint in consolidated:
        expected = checkpoint_tensors(checkpoint / "weights", tmp_path)
        output = load_file(checkpoint / "consolidated" / "model.safetensors")
        assert set(output) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(output[name], tensor), name


def test_the_consolidation_process_starts_in_setup_and_the_loop_does_not_wait(every_second):
    report = json.loads((every_second / "report.json").read_text())
    assert report["process_started_before_training"]  # the callback's setup hook ran, though added in setup
    assert len(report["blocked_seconds"]) == 1 and report["blocked_seconds"][0] < 5.0
