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

"""After a consolidation, at unit level: the callbacks' hooks (which one, an exception logged once), the outcome the
coordinator makes (where the output is when the hook runs, the post command's result and its log line), and the
queue's reading of a consolidation process that died in its post command. No training run here; the real runs are in
``test_after_consolidation_e2e.py``."""

import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from nemo_patch.training import hooks
from nemo_patch.training.config import ConsolidationConfig
from nemo_patch.training.coordinator import ConsolidationCoordinator, weights_identity
from nemo_patch.training.hooks import ConsolidationOutcome, HookCaller
from nemo_patch.training.queue import _Process
from nemo_patch.training.schedule import CheckpointSave
from nemo_patch.training.settings import ConsolidationSettings


class _Recorder:
    def __init__(self):
        self.calls = []

    def on_consolidation_end(self, trainer, pl_module, result):
        self.calls.append(("end", pl_module, result.global_step))

    def on_consolidation_failed(self, trainer, pl_module, result):
        self.calls.append(("failed", pl_module, result.error))


class _Raising:
    def on_consolidation_end(self, trainer, pl_module, result):
        raise RuntimeError(f"broken hook at {result.global_step}")


def _outcome(step, error=None):
    return ConsolidationOutcome(Path(f"/c{step}/consolidated"), Path(f"/c{step}"), "safetensors", step, error=error)


def test_each_hook_gets_its_outcomes_and_a_raising_one_is_logged_once(caplog):
    recorder, raising = _Recorder(), _Raising()
    trainer = SimpleNamespace(callbacks=[raising, object(), recorder])  # a callback without hooks is passed over
    call = HookCaller()
    with caplog.at_level(logging.DEBUG, logger="nemo_patch.training.hooks"):
        for outcome in (_outcome(2), _outcome(4, error="ConsolidationError: disk full"), _outcome(6)):
            call(trainer, "module", outcome)
    assert recorder.calls == [("end", "module", 2), ("failed", "module", "ConsolidationError: disk full"),
                              ("end", "module", 6)]  # fmt: skip
    errors = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info and "broken hook at 2" in str(errors[0].exc_info[1])
    assert "_Raising.on_consolidation_end raised for /c2/consolidated (global step 2)" in errors[0].getMessage()
    later = [
        record for record in caplog.records if record.levelno == logging.DEBUG and "raised" in record.getMessage()
    ]
    assert len(later) == 1 and "global step 6" in later[0].getMessage() and not later[0].exc_info


def _published(root: Path, step: int) -> CheckpointSave:
    path = root / f"m--step={step - 1}"
    (path / "weights").mkdir(parents=True)
    (path / "weights" / ".metadata").write_bytes(b"dcp")
    (path / "consolidated").mkdir()
    (path / "consolidated" / "model.safetensors").write_bytes(b"weights")
    metadata = {"format_version": 1, "global_step": step, "source_checkpoint": "../weights", "files": {}}
    (path / "consolidated" / "metadata.json").write_text(json.dumps(metadata))
    save = CheckpointSave(path, step, written=True, seconds=12.0)
    save.identity = weights_identity(path)
    return save


def test_an_outcome_names_the_output_where_it_is_when_the_hooks_run(tmp_path, caplog):
    coordinator = ConsolidationCoordinator(
        ConsolidationSettings(frequency="each", config=ConsolidationConfig(post_command="x"))
    )
    save = _published(tmp_path, 2)
    save.post_command = {"command": "x", "returncode": 0, "seconds": 10.0, "timed_out": False, "log": "l",
                         "metrics": {"eval/loss": 1.5}, "error": None, "stopped": False}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="nemo_patch.training.post_results"):
        coordinator._on_consolidated(save, None)
    assert "post command exited 0 after 10.0 s (log: l); metrics {'eval/loss': 1.5}" in caplog.text
    # NeMo's removal of the checkpoint waited for the consolidation and runs before the hooks: the output is kept
    coordinator.remove_checkpoint(save.path, lambda: shutil.rmtree(save.path))
    (outcome,) = coordinator.observer(hooks.Observer).outcomes()
    assert outcome.published and outcome.output_dir == tmp_path / "retained" / save.path.name / "consolidated"
    assert outcome.metadata["global_step"] == 2 and outcome.metrics == {"eval/loss": 1.5}
    assert outcome.seconds == 2.0  # the consolidation's own time: the command's 10 s are not in it
    assert coordinator.observer(hooks.Observer).outcomes(1) == []


def test_a_post_command_lost_with_its_process_is_a_warning_and_recorded(tmp_path, caplog):
    coordinator = ConsolidationCoordinator(
        ConsolidationSettings(frequency="each", config=ConsolidationConfig(post_command="cmd"))
    )
    save = _published(tmp_path, 4)
    save.post_command = {"stopped": True, "error": "the consolidation process ended: killed by signal SIGKILL"}
    coordinator._on_consolidated(save, None)
    (outcome,) = coordinator.observer(hooks.Observer).outcomes()
    assert outcome.published and outcome.post_command.stopped and outcome.post_command.command == "cmd"
    recorded = json.loads((save.path / "consolidated" / "metadata.json").read_text())["post_command"]
    assert recorded["stopped"] and "SIGKILL" in recorded["error"] and outcome.metadata["post_command"] == recorded
    (warning,) = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert "was stopped after 0.0 s (the consolidation process ended: killed by signal SIGKILL)" in warning.message
    assert "the output stays published" in warning.message


def test_a_failed_consolidation_has_a_failed_outcome_without_a_command(tmp_path):
    coordinator = ConsolidationCoordinator(
        ConsolidationSettings(frequency="each", config=ConsolidationConfig(post_command="cmd"))
    )
    save = _published(tmp_path, 6)
    shutil.rmtree(save.path / "consolidated")
    coordinator._on_consolidated(save, "ConsolidationError: no space")
    (outcome,) = coordinator.observer(hooks.Observer).outcomes()
    assert not outcome.published and outcome.error == "ConsolidationError: no space"
    assert outcome.post_command is None and outcome.metadata == {} and outcome.bytes == 0


def _dying_process(lines: str) -> _Process:
    code = f"import os, sys; sys.stdout.write({lines!r}); sys.stdout.flush(); os.kill(os.getpid(), 9)"
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    process.wait(60)
    return _Process(process, tempfile.TemporaryFile())


def test_a_process_that_dies_after_publishing_leaves_the_output_published_with_its_command_lost():
    server = _dying_process('{"ready": true}\n{"published": true}\n')
    assert server.result() is None and server.ready and server.published
    error, reply = server.lost_result()
    assert error is None and reply["post_command"]["stopped"] is True
    assert "killed by signal SIGKILL" in reply["post_command"]["error"]
    server.close()


def test_a_process_that_dies_before_publishing_fails_its_request():
    server = _dying_process('{"ready": true}\n')
    assert server.result() is None and server.lost_result() == (
        "consolidation process was killed by signal SIGKILL",
        {},
    )
    server.close()


def test_a_result_line_carries_the_post_command_and_ends_the_published_state():
    server = _dying_process(
        '{"ready": true}\n{"published": true}\n{"error": null, "post_command": {"command": "c"}}\n'
    )
    assert server.result() == (None, {"error": None, "post_command": {"command": "c"}}) and not server.published
    server.close()
