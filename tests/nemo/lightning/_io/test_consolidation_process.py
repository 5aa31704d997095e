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

"""ConsolidationConfig (validated once, one normal form), the cadence, and the consolidation process: checkpoints
consolidated one at a time by one long-lived process, at a lower CPU priority, results reported to the caller."""

import dataclasses
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nemo_patch.training import queue as queue_module
from nemo_patch.training.config import ConsolidationConfig
from nemo_patch.training.policy import parse_consolidation_frequency
from nemo_patch.training.queue import ConsolidationQueue
from nemo_patch.training.schedule import CheckpointSave
from nemo_patch.training.settings import ConsolidationSettings

pytestmark = [pytest.mark.unit, pytest.mark.run_only_on("CPU")]


def test_a_config_is_validated_when_made_and_kept_in_one_normal_form():
    config = ConsolidationConfig(dtype=torch.bfloat16, max_shard_size="500MiB")
    assert (config.dtype, config.max_shard_size) == ("bf16", 500 * 2**20)
    assert config == ConsolidationConfig(dtype="bfloat16", max_shard_size=500 * 2**20)
    assert config.changed() == {"dtype": "bf16", "max_shard_size": 500 * 2**20}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype = "fp16"
    for field, value in (("dtype", "int8"), ("max_pending", -1), ("workers", 0), ("timeout", float("nan"))):
        with pytest.raises(ValueError, match=f"Invalid ConsolidationConfig.{field} "):
            ConsolidationConfig(**{field: value})


def test_the_cadence_and_the_settings_it_resolves_to():
    every_2nd = parse_consolidation_frequency("every_n:2")
    assert [every_2nd.is_due(step, index) for index, step in enumerate((10, 20, 30, 40), 1)] == [0, 1, 0, 1]
    assert not parse_consolidation_frequency("latest").is_due(5, 1)
    assert str(ConsolidationSettings(save_consolidated=True).policy) == "each"
    assert ConsolidationSettings().policy is None
    for frequency in ("every_n:0", "never", "sometimes"):
        with pytest.raises(ValueError, match="ckpt_consolidation_frequency"):
            ConsolidationSettings(frequency=frequency)
    with pytest.raises(ValueError, match="contradicts"):
        ConsolidationSettings(save_consolidated=False, frequency="each")
    settings = ConsolidationSettings(frequency="each", config=ConsolidationConfig(dtype="fp16", workers=2))
    assert ConsolidationSettings.from_json(settings.to_json()) == settings


def test_the_process_consolidates_checkpoints_one_at_a_time_and_reports_each(moe_checkpoint, tmp_path, monkeypatch):
    # an idle process exits by itself once its stdin closes; on a loaded CPU its interpreter's teardown can take longer
    # than the grace before a kill, which is not what this test is about
    monkeypatch.setattr(queue_module, "_CLOSE_GRACE_SECONDS", 120.0)
    source, expected = moe_checkpoint
    first, second, missing = tmp_path / "a--step=1", tmp_path / "b--step=2", tmp_path / "c--step=3"
    shutil.copytree(source, first)
    shutil.copytree(source, second)
    done = []
    settings = ConsolidationSettings(frequency="each", config=ConsolidationConfig(dtype="bf16", workers=1))
    queue = ConsolidationQueue(lambda save, error: done.append((save.global_step, error)), settings)
    queue.submit_all([CheckpointSave(path, step, written=True) for step, path in enumerate((first, second), 1)])
    queue.submit(CheckpointSave(missing, 3, written=True))
    assert queue.wait(timeout=120) and queue.processes_started == 1
    assert done[:2] == [(1, None), (2, None)] and done[2][1].startswith("ConsolidationError: ")
    for checkpoint in (first, second):
        tensors = load_file(checkpoint / "consolidated" / "model.safetensors")
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[name], expected[name].to(torch.bfloat16)) for name in expected)
    served = queue.process
    queue.close()
    assert served.returncode == 0 and queue.process is None


def _thread_niceness(pid):
    """The niceness of each thread of process ``pid`` (``/proc/<pid>/task/*/stat``, field 19), or of the process
    (``os.getpriority``) where there is no ``/proc``."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return [os.getpriority(os.PRIO_PROCESS, pid)]
    found = []
    for stat in tasks.glob("*/stat"):
        try:
            found.append(int(stat.read_text().rpartition(")")[2].split()[16]))
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            pass
    return found


def test_the_process_runs_at_a_lower_cpu_priority(monkeypatch):
    # the documented name, literally (the series renames it): not the default (10), so the process must read it
    monkeypatch.setenv("NEMO_PATCH_WORKER_NICENESS", "15")
    monkeypatch.setattr(queue_module, "_CLOSE_GRACE_SECONDS", 120.0)
    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 15)
    queue = ConsolidationQueue(lambda save, error: None, ConsolidationSettings(frequency="each"))
    queue.start_process()
    try:
        server, deadline = queue._server, time.monotonic() + 120
        while not server.ready and server.alive and time.monotonic() < deadline:  # torch imported, serving
            server.result()
            time.sleep(0.1)
        assert server.ready
        seen = _thread_niceness(queue.process.pid)
        assert seen and set(seen) == {expected}, seen  # every thread, those torch's import started included
    finally:
        queue.close()
