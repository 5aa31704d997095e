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

"""A run's identity, unit level: a new id when a ``fit`` starts, stored in each checkpoint's callback state and
restored from it on resume, carried by every save to its consolidation request (the real runs are in
``test_run_identity_e2e.py``)."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from nemo_patch.training.callback import ConsolidationCallback
from nemo_patch.training.coordinator import ConsolidationCoordinator, new_run_id
from nemo_patch.training.settings import ConsolidationSettings


def _callback(coordinator: ConsolidationCoordinator, global_step: int = 6) -> ConsolidationCallback:
    io = SimpleNamespace(consolidation=coordinator)
    return ConsolidationCallback(SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=io), global_step=global_step))


def test_run_ids_are_new_at_each_fit_and_readable():
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    ids = {coordinator.run_id}
    for _ in range(3):
        coordinator.begin_fit()
        assert coordinator.run_id not in ids
        ids.add(coordinator.run_id)
    assert all(re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{8}", run_id) for run_id in ids | {new_run_id()})


def test_a_checkpoint_stores_the_run_and_a_resume_goes_on_with_it(tmp_path):
    saving = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    saving.begin_fit()
    state = _callback(saving).state_dict()
    assert state["run_id"] == saving.run_id and state["finished_count"] == 1
    state = json.loads(json.dumps(state))  # as it travels in the checkpoint
    resuming = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    resuming.begin_fit()  # Lightning calls on_fit_start before it restores the callbacks' state
    _callback(resuming).load_state_dict(state)
    assert resuming.run_id == saving.run_id
    save = resuming.register(tmp_path / "ckpt", 8)
    assert save.run == saving.run_id  # what the consolidation process is told to record in metadata.json


@pytest.mark.parametrize("stored", [None, "", 7, "../../etc", "x" * 65, "a\nb"])
def test_a_checkpoint_without_a_usable_run_id_leaves_the_new_one(stored):
    """A checkpoint saved before run ids were stored (or a state edited by hand) starts a run of its own."""
    state = {"finished_count": 3, "global_step": 6, "phase_start": 0, "phase_count": 3}
    if stored is not None:
        state["run_id"] = stored
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    coordinator.begin_fit()
    before = coordinator.run_id
    _callback(coordinator).load_state_dict(state)
    assert coordinator.run_id == before and coordinator.schedule.finished_count == 3


def test_the_consolidation_request_carries_the_run(tmp_path, monkeypatch):
    """The line the consolidation process reads names the run (``metadata.json``'s ``"run"``)."""
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    coordinator.begin_fit()
    save = coordinator.register(Path(tmp_path / "ckpt"), 2)
    sent = []

    class _Server:
        process = SimpleNamespace(pid=1)

        def send(self, data: bytes) -> bool:
            sent.append(json.loads(data))
            return True

    queue = coordinator.queue
    monkeypatch.setattr(queue, "_server", _Server())
    monkeypatch.setattr(queue, "_running", SimpleNamespace(save=save), raising=False)
    queue._start(save)
    assert sent and sent[0]["run"] == coordinator.run_id and sent[0]["global_step"] == 2
