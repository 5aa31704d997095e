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

"""The run's consolidation process (``worker --serve``): its line protocol, and the queue restarting it.

Quick: no training run; each test starts a real consolidation process (``import torch``, a few seconds).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nemo_patch.training.config import ConsolidationConfig
from nemo_patch.training.queue import ConsolidationQueue
from nemo_patch.training.schedule import CheckpointSave
from nemo_patch.training.settings import ConsolidationSettings

WORKER = [sys.executable, "-m", "nemo_patch.training.worker", "--serve"]


@pytest.fixture()
def empty(tmp_path):
    """A directory that is not a checkpoint: its consolidation fails at once with a ``ConsolidationError``."""
    path = tmp_path / "empty"
    path.mkdir()
    return path


def _request(path, step=1):
    return json.dumps({"checkpoint": str(path), "global_step": step, "best": None}) + "\n"


def test_each_request_gets_one_result_line_and_nothing_else_reaches_stdout(empty, tmp_path):
    proc = subprocess.run(WORKER, input=_request(empty) + "\n" + _request(tmp_path / "missing", 2),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    ready, *results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert ready == {"ready": True}
    assert len(results) == 2 and all(r["error"].startswith("ConsolidationError: ") for r in results)
    assert "is not a NeMo 2 checkpoint" in results[0]["error"]


def test_an_unexpected_error_is_answered_then_ends_the_process(tmp_path):
    proc = subprocess.run(WORKER, input='{"global_step": 1}\n' + _request(tmp_path), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 1
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines == [{"ready": True}, {"error": "KeyError: 'checkpoint'"}]
    assert "Traceback" in proc.stderr  # the second request was never read: the queue gives it a new process


def test_the_queue_restarts_a_process_that_died_and_names_the_cause(empty):
    done = []
    queue = ConsolidationQueue(lambda save, error: done.append(error))
    queue.submit(CheckpointSave(empty, 1, written=True))
    queue._running.process.kill()  # mid-request, or while still importing: either way the request fails
    assert queue.wait(timeout=120) and done == ["consolidation process was killed by signal SIGKILL"]
    queue.submit(CheckpointSave(empty, 2, written=True))
    queue.submit(CheckpointSave(empty, 3, written=True))
    assert queue.wait(timeout=120) and queue.processes_started == 2  # one new process for both requests
    assert all(error.startswith("ConsolidationError: ") for error in done[1:]) and len(done) == 3
    served = queue.process
    queue.close()
    assert served.returncode == 0 and queue.process is None


def _wait_ready(queue):
    deadline = time.monotonic() + 120
    while not queue.process_ready and time.monotonic() < deadline:
        queue.poll()  # what the training loop does: reads the ready line and results
        time.sleep(0.05)
    assert queue.process_ready


def test_the_bound_skips_the_oldest_waiting_requests_but_not_bursts_or_the_ones_made_when_fit_ends(empty):
    done = []
    queue = ConsolidationQueue(
        lambda save, error: done.append(save.global_step),
        ConsolidationSettings(config=ConsolidationConfig(max_pending=1)),
    )
    queue.start_process()
    _wait_ready(queue)
    os.kill(queue.process.pid, signal.SIGSTOP)  # request 1 stays in flight however fast it would be
    try:
        for step in (1, 2, 3, 4):  # one at a time, while training: 2 and 3 are skipped as newer ones arrive
            queue.submit(CheckpointSave(empty, step, written=True))
        assert [save.global_step for save in queue.skipped] == [2, 3]
        queue.submit_all([CheckpointSave(empty, step, written=True) for step in (5, 6, 7)])  # finished together
        assert [save.global_step for save in queue.skipped] == [2, 3, 4]  # the burst is kept whole; 4 is older
        # finished when fit ends (NeMo finalizing outstanding async saves): all queued
        queue.submit_all([CheckpointSave(empty, step, written=True) for step in (8, 9)], bounded=False)
        assert len(queue.skipped) == 3
    finally:
        os.kill(queue.process.pid, signal.SIGCONT)
    assert queue.wait(timeout=120) and done == [1, 5, 6, 7, 8, 9]
    queue.close()


def test_requests_made_while_the_process_starts_are_not_skipped(empty):
    """Its start is paid once per run: requests that arrive meanwhile all wait; the bound applies once it is ready."""
    done = []
    queue = ConsolidationQueue(
        lambda save, error: done.append(save.global_step),
        ConsolidationSettings(config=ConsolidationConfig(max_pending=0)),
    )
    queue.start_process()
    for step in (1, 2, 3):  # submitted at once: the process is still importing torch
        queue.submit(CheckpointSave(empty, step, written=True))
    assert not queue.skipped  # (the previous test shows the bound at work once the process is ready)
    assert queue.wait(timeout=120) and done == [1, 2, 3] and queue.process_ready
    queue.close()


def test_closing_a_process_that_is_still_importing_kills_it_at_once():
    """A run that ends before its consolidation process is ready (a short fit) does not wait for ``import torch``."""
    queue = ConsolidationQueue(lambda save, error: None)
    queue.start_process()
    starting = queue.process
    queue.close()
    assert starting.returncode == -signal.SIGKILL and queue.process is None
