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

"""Fixtures of the checkpoint consolidation tests: real ``torch_dist`` checkpoints, written on the CPU."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
#: The repository root (the converter scripts live under it).
ROOT = HERE.parents[2]


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def run_python(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run a Python script of this directory or the repository in a fresh interpreter, from the repository root."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="session")
def dist_checkpoint(tmp_path_factory):
    """``(checkpoint dir, reference tensors)``: a checkpoint written by megatron-core's ``dist_checkpointing.save``
    with tensor-parallel chunks and stacked layers (``write_checkpoint.py``), and its tensors as saved. Written once
    per session, or once into ``$NEMO_CONSOLIDATION_TEST_CACHE`` when that names a directory (and reused from
    there). Tests read it and write their outputs elsewhere."""
    cache = os.environ.get("NEMO_CONSOLIDATION_TEST_CACHE")
    checkpoint = (Path(cache) if cache else tmp_path_factory.mktemp("dist_checkpoint")) / "step=7"
    if not (checkpoint / "reference.pt").is_file():  # written last
        proc = run_python(str(HERE / "write_checkpoint.py"), str(checkpoint), free_port())
        assert proc.returncode == 0, proc.stderr[-4000:]
    return checkpoint, torch.load(checkpoint / "reference.pt", weights_only=True)
