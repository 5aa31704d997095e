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

"""The consolidation process queue: one child at a time, bounded, waited for with a timeout, safe removal."""

import logging
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from nemo_patch.training.config import ConsolidationConfig
from nemo_patch.training.queue import ConsolidationQueue
from nemo_patch.training.schedule import CheckpointSave
from nemo_patch.training.settings import ConsolidationSettings
from nemo_patch.training.worker import WORKER_NICENESS

pytestmark = pytest.mark.slow


@pytest.fixture()
def checkpoints(each_run, tmp_path):
    """Three private copies of a finished checkpoint, without consolidated output."""
    saves = []
    for step in (2, 4, 6):
        target = tmp_path / f"ckpt-{step}"
        shutil.copytree(each_run["root"] / "LATEST", target, ignore=shutil.ignore_patterns("consolidated"))
        saves.append(CheckpointSave(target, step, written=True))
    return saves


def test_runs_one_child_at_a_time_and_skips_the_oldest_waiting_request(checkpoints, caplog):
    done = []
    queue = ConsolidationQueue(
        lambda save, error: done.append((save.global_step, error)),
        ConsolidationSettings(config=ConsolidationConfig(max_pending=1)),
    )
    queue.start_process()  # the bound applies once the process is ready (its start is not falling behind)
    deadline = time.monotonic() + 120
    while not queue.process_ready and time.monotonic() < deadline:
        time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="nemo_patch.training.queue"):
        for save in checkpoints:
            queue.submit(save)
    assert queue._running.save is checkpoints[0]  # started at once
    assert [s.global_step for s in queue.skipped] == [4]  # 1 running + 1 waiting: step 4 was the oldest waiting
    assert caplog.text.count("skipping checkpoint") == 1
    assert queue.wait(timeout=120)
    assert done == [(2, None), (6, None)]
    assert (checkpoints[0].path / "consolidated" / "model.safetensors").is_file()
    assert not (checkpoints[1].path / "consolidated").exists()
    assert sorted(p.name for p in checkpoints[2].path.iterdir()) == ["consolidated", "context", "weights"]


def test_the_child_does_not_import_nemo_and_uses_no_process_group(checkpoints, tmp_path):
    """The worker entry point runs in a fresh interpreter; its module list must not contain NeMo or megatron, and it
    runs at a lower CPU priority than the process that started it."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import runpy, sys\n"
        "sys.argv = ['worker', sys.argv[1]]\n"
        "try:\n"
        "    runpy.run_module('nemo_patch.training.worker', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    import torch.distributed as dist\n"
        "    loaded = {m.split('.')[0] for m in sys.modules} & {'nemo', 'megatron', 'lightning'}\n"
        "    import os\n"
        "    print(e.code, dist.is_initialized(), sorted(loaded), os.nice(0))\n"
    )
    import subprocess

    out = subprocess.run([sys.executable, str(probe), str(checkpoints[0].path)], capture_output=True, text=True)
    niceness = min(os.nice(0) + WORKER_NICENESS, 19)
    assert out.stdout.strip().splitlines()[-1] == f"0 False [] {niceness}", out.stderr[-2000:]


def test_timeout_stops_the_child_and_leaves_no_partial_output(checkpoints, caplog):
    done = []
    queue = ConsolidationQueue(
        lambda save, error: done.append((save.global_step, error)),
        ConsolidationSettings(config=ConsolidationConfig(max_pending=2)),
    )
    for save in checkpoints:
        queue.submit(save)
    with caplog.at_level(logging.ERROR, logger="nemo_patch.training.queue"):
        assert not queue.wait(timeout=0.2)
    assert "did not finish within 0.2 s" in caplog.text and "dropping 2 queued" in caplog.text
    assert done and done[0][0] == 2 and "SIGTERM" in done[0][1]
    for save in checkpoints:
        leftovers = [p.name for p in save.path.iterdir() if p.name.startswith(".consolidated")]
        assert leftovers == [] and not (save.path / "consolidated").exists()
    assert not queue.busy


def test_removal_of_the_checkpoint_being_consolidated_waits_for_the_child(checkpoints):
    done = []
    queue = ConsolidationQueue(
        lambda save, error: done.append((save.global_step, error)),
        ConsolidationSettings(config=ConsolidationConfig(max_pending=2)),
    )
    queue.submit(checkpoints[0])
    queue.submit(checkpoints[1])
    removed = []

    def remove(path):
        return lambda: (shutil.rmtree(path), removed.append(path.name))

    assert queue.remove_checkpoint(checkpoints[1].path, remove(checkpoints[1].path))  # queued: dropped, removed now
    assert removed == ["ckpt-4"]
    assert not queue.remove_checkpoint(checkpoints[0].path, remove(checkpoints[0].path))  # running: deferred
    assert checkpoints[0].path.is_dir()
    assert queue.wait(timeout=120)
    assert removed == ["ckpt-4", "ckpt-2"] and not checkpoints[0].path.exists()
    assert done == [(2, None)]


def test_a_failing_child_reports_one_line(tmp_path):
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    done = []
    queue = ConsolidationQueue(lambda save, error: done.append(error))
    queue.submit(CheckpointSave(bad, 3, written=True))
    assert queue.wait(timeout=120)
    assert done[0].startswith("ConsolidationError: ") and "is not a NeMo 2 checkpoint" in done[0]
    assert sorted(os.listdir(bad)) == []
    assert Path(bad).is_dir()


def test_one_process_serves_every_request_of_the_run(checkpoints):
    done = []
    queue = ConsolidationQueue(lambda save, error: done.append((save.global_step, error)))
    queue.start_process()  # what the strategy does when training starts
    first = queue.process
    queue.submit(checkpoints[0])
    assert queue._running.process is first and queue.warm_requests == 1  # no interpreter start for this request
    assert queue.wait(timeout=120)
    queue.submit(checkpoints[1])
    queue.submit(checkpoints[2])
    assert queue.wait(timeout=120)
    assert done == [(2, None), (4, None), (6, None)]
    assert queue.process is first and queue.processes_started == 1 and queue.warm_requests == 3
    assert all((save.path / "consolidated" / "model.safetensors").is_file() for save in checkpoints)
    queue.close()  # teardown: the idle process ends at the end of its input
    assert first.returncode == 0 and queue.process is None


def test_a_process_that_died_while_idle_is_replaced(checkpoints):
    done = []
    queue = ConsolidationQueue(lambda save, error: done.append((save.global_step, error)))
    queue.start_process()
    idle = queue.process
    idle.kill()  # e.g. the out-of-memory killer, between two requests
    idle.wait()
    queue.submit(checkpoints[0])
    assert queue.warm_requests == 0 and queue.wait(timeout=120)
    assert done == [(2, None)] and queue.processes_started == 2
    queue.close()


def test_a_failed_request_leaves_the_process_serving_the_next(checkpoints, tmp_path):
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    done = []
    queue = ConsolidationQueue(lambda save, error: done.append((save.global_step, error)))
    queue.submit(CheckpointSave(bad, 1, written=True))
    queue.submit(checkpoints[0])
    assert queue.wait(timeout=120)
    assert done[0][1].startswith("ConsolidationError: ") and done[1] == (2, None)
    assert queue.processes_started == 1 and sorted(os.listdir(bad)) == []
    queue.close()


def test_the_serving_worker_exits_quietly_at_end_of_input():
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "nemo_patch.training.worker", "--serve"], input="", capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout == '{"ready": true}\n' and "Error" not in proc.stderr
    usage = subprocess.run([sys.executable, "-m", "nemo_patch.training.worker"], capture_output=True, text=True)
    assert usage.returncode == 2 and "give either a checkpoint or --serve" in usage.stderr
