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

"""``scripts/gpu_check.py``, the check users (and we) run on a GPU node: its command line, and its whole flow on the
CPU (``--cpu``: the test harness instead of CUDA, no distributed optimizer). The GPU run itself is not a test: CI has
no GPU."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO


def _gpu_check(*args, timeout=900):
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


@pytest.mark.parametrize("steps", ["3", "0", "10"])
def test_steps_must_be_a_positive_multiple_of_4(steps):
    proc = _gpu_check("--steps", steps, "--cpu")
    assert proc.returncode == 2 and "--steps must be a multiple of 4" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run for real")
def test_without_a_gpu_it_says_how_to_check_the_script():
    proc = _gpu_check("--steps", "4")
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and "--cpu" in proc.stderr


@pytest.mark.slow
def test_the_whole_check_passes_on_the_cpu(tmp_path):
    proc = _gpu_check("--cpu", "--steps", "4", "--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {name: status for status, name, _ in json.loads((tmp_path / "r.json").read_text())["checks"]}
    assert results == {
        "cadence": "PASS",
        "tensors": "PASS",
        "logits": "PASS",
        "optimizer": "SKIP",
        "blocked": "PASS",
        "te": "SKIP",
        "tp2": "SKIP",
    }
    assert "gpu_check: PASS" in proc.stdout
