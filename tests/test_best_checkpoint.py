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

"""Picking a run's best checkpoint offline (``nemo-consolidate --best``), and the ``"best"`` cadence's fit-start
check and fit-end step."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_patch.cli.nemo_consolidate import main as nemo_consolidate
from nemo_patch.engine.errors import CheckpointNotFoundError, NotACheckpointError, UnfinishedCheckpointError
from nemo_patch.runs.best_checkpoint import NoMonitoredMetricError, find_best_checkpoint
from nemo_patch.training.best import check_best_has_a_metric, consolidate_best
from nemo_patch.training.policy import parse_consolidation_frequency


class Arbitrary:
    """A class ``torch.load(weights_only=True)`` does not know: unpickling it could run any code."""


STATE_KEY = "ModelCheckpoint{'monitor': 'val_loss', 'mode': '%s', 'every_n_train_steps': 0, 'every_n_epochs': 1}"


def _checkpoint(root: Path, step: int, val_loss: float = None, last: bool = False, finished: bool = True) -> Path:
    metric = "" if val_loss is None else f"val_loss={val_loss:.4f}-"
    path = root / f"m--{metric}step={step - 1}-consumed_samples={2.0 * step}{'-last' if last else ''}"
    (path / "weights").mkdir(parents=True)
    if finished:
        (path / "weights" / ".metadata").write_bytes(b"dcp")
    return path


def _state(checkpoint: Path, best: Path, score: float, mode: str = "min", monitor: str = "val_loss", **extra):
    state = {
        "monitor": monitor,
        "best_model_path": f"/where/the/run/was/{best.name}.ckpt",  # NeMo's path, from before the run moved
        "best_model_score": torch.tensor(score),
        "dirpath": Path("/where/the/run/was"),
        **extra,
    }
    torch.save({"callbacks": {STATE_KEY % mode: state}}, checkpoint / "weights" / "common.pt")


@pytest.fixture()
def run(tmp_path):
    """Checkpoints of steps 2, 4, 6 (val_loss 3.5, 3.2, 3.4) and step 6's -last copy (same value)."""
    root = tmp_path / "checkpoints"
    paths = {step: _checkpoint(root, step, value) for step, value in ((2, 3.5), (4, 3.2), (6, 3.4))}
    paths["6-last"] = _checkpoint(root, 6, 3.4, last=True)
    return root, paths


def test_the_checkpoint_callback_state_names_the_best(run):
    root, paths = run
    _state(paths["6-last"], paths[4], 3.2)
    best = find_best_checkpoint(root.parent)  # the run directory holding checkpoints/ works too
    assert best.checkpoint_dir == paths[4]
    assert best.record() == {"monitor": "val_loss", "value": pytest.approx(3.2), "mode": "min"}
    assert best.source == f"ModelCheckpoint state in {paths['6-last'].name}/weights/common.pt"


def test_the_state_of_the_newest_finished_checkpoint_wins_and_gives_the_mode(run):
    root, paths = run
    _state(paths[2], paths[2], 3.5)
    _state(paths["6-last"], paths[6], 3.4, mode="max")
    assert find_best_checkpoint(root).checkpoint_dir == paths[6]
    assert find_best_checkpoint(root).mode == "max"


def test_without_a_readable_state_the_names_decide_leaving_out_last_copies(run):
    root, paths = run
    _checkpoint(root, 8, 1.0, last=True)  # NeMo's -last copies are not ranked (nemo_topk_check_previous_run)
    _checkpoint(root, 9, 0.9, last=True).rename(root / "m--val_loss=0.9000-step=8-last-v1")  # a second fit's copy
    _checkpoint(root, 10, 0.5, finished=False)  # nor unfinished checkpoints
    best = find_best_checkpoint(root)
    assert (best.checkpoint_dir, best.value, best.source) == (paths[4], 3.2, "checkpoint names")
    assert find_best_checkpoint(root, mode="max").checkpoint_dir == paths[2]


def test_a_state_that_needs_unsafe_unpickling_is_not_loaded(run):
    root, paths = run
    _state(paths["6-last"], paths[6], 3.4, extra=Arbitrary())
    assert find_best_checkpoint(root).source == "checkpoint names"


def test_another_monitor_than_the_state_s_is_read_from_the_names(run):
    root, paths = run
    _state(paths["6-last"], paths[6], 3.4)
    with pytest.raises(NoMonitoredMetricError, match="no 'train_loss=<value>' in the names") as info:
        find_best_checkpoint(root, monitor="train_loss")
    assert info.value.exit_code == 14


@pytest.mark.parametrize("monitor", [None, "step"])
def test_a_run_that_recorded_no_metric_is_an_error_naming_what_is_needed(tmp_path, monitor):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        last = _checkpoint(root, step)
    _state(last, last, 3.0, monitor=monitor)
    with pytest.raises(NoMonitoredMetricError, match=r"ModelCheckpoint\(monitor='val_loss', mode='min'\)"):
        find_best_checkpoint(root)


def test_a_recorded_best_that_is_gone_or_unfinished_is_never_replaced(run):
    root, paths = run
    gone = root / "m--val_loss=0.1000-step=0-consumed_samples=2.0"
    _state(paths["6-last"], gone, 0.1)
    with pytest.raises(CheckpointNotFoundError, match="does not exist .* no other checkpoint is substituted"):
        find_best_checkpoint(root)
    unfinished = _checkpoint(root, 1, 0.1, finished=False)
    _state(paths["6-last"], unfinished, 0.1)
    with pytest.raises(UnfinishedCheckpointError, match=f"{unfinished.name}, is unfinished"):
        find_best_checkpoint(root)


def test_a_directory_without_checkpoints_is_not_a_run(tmp_path):
    with pytest.raises(NotACheckpointError):
        find_best_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        find_best_checkpoint(tmp_path / "missing")


def test_cli_best_exits_14_without_a_metric_and_monitor_needs_best(tmp_path, capsys):
    _checkpoint(tmp_path, 2)
    assert nemo_consolidate([str(tmp_path), "--best"]) == 14
    assert "recorded no monitored metric" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        nemo_consolidate([str(tmp_path), "--monitor", "val_loss"])
    assert info.value.code == 2


@pytest.mark.parametrize(
    "callback",
    [None, SimpleNamespace(monitor=None), SimpleNamespace(monitor="step"), SimpleNamespace(monitor="epoch")],
)
@pytest.mark.parametrize("frequency", ["best", "each; best@100"])
def test_best_needs_a_monitored_metric(callback, frequency):
    with pytest.raises(ValueError, match="monitors none: pass ModelCheckpoint") as info:
        check_best_has_a_metric(callback, parse_consolidation_frequency(frequency))
    assert repr(frequency) in str(info.value)


def test_other_cadences_and_a_monitored_metric_pass_the_check():
    check_best_has_a_metric(SimpleNamespace(monitor="val_loss"), parse_consolidation_frequency("best"))
    check_best_has_a_metric(None, parse_consolidation_frequency("every_n:2; latest"))


def _coordinator_with_best(root: Path, best: Path):
    from nemo_patch import MegatronCheckpointIO
    from nemo_patch.training.settings import ConsolidationSettings

    coordinator = MegatronCheckpointIO(consolidation_settings=ConsolidationSettings(frequency="best")).consolidation
    coordinator.checkpoint_callback = SimpleNamespace(
        best_model_path=f"{best}.ckpt", best_model_score=torch.tensor(3.2), monitor="val_loss", mode="min"
    )
    return coordinator


@pytest.mark.parametrize("state", ["missing", "unfinished", "being-removed"])
def test_at_fit_end_a_best_that_never_finished_or_is_gone_is_logged_and_best_left_alone(tmp_path, caplog, state):
    root = tmp_path / "checkpoints"
    newest = _checkpoint(root, 6, 3.4)
    best = root / "m--val_loss=3.2000-step=3-consumed_samples=8.0"
    if state != "missing":
        _checkpoint(root, 4, 3.2, finished=state != "unfinished")
    if state == "being-removed":
        Path(f"{best}-unfinished").touch()  # NeMo's marker while it deletes a checkpoint
    (root / "BEST").symlink_to(newest.name)
    coordinator = _coordinator_with_best(root, best)
    with caplog.at_level("WARNING"):
        assert consolidate_best(coordinator) is None
    assert f"The best checkpoint {best}" in caplog.text and "never finished or was removed" in caplog.text
    assert (root / "BEST").resolve() == newest and coordinator._queue is None  # nothing substituted, nothing queued


def test_at_fit_end_a_best_already_consolidated_is_pointed_at_not_recomputed(tmp_path):
    root = tmp_path / "checkpoints"
    best = _checkpoint(root, 4, 3.2)
    (best / "consolidated").mkdir()
    (best / "consolidated" / "metadata.json").write_text('{"global_step": 4}')
    coordinator = _coordinator_with_best(root, best)
    save = consolidate_best(coordinator)
    assert save.path == best and save.global_step == 4 and save.consolidated
    assert save.best == {"monitor": "val_loss", "value": pytest.approx(3.2), "mode": "min"}
    assert os.readlink(root / "BEST") == best.name and coordinator._queue is None


def test_strategy_consolidate_best_checkpoint_on_demand_points_best_without_recomputing(tmp_path):
    from nemo_patch import MegatronStrategy

    root = tmp_path / "checkpoints"
    best = _checkpoint(root, 4, 3.2)
    (best / "consolidated").mkdir()
    (best / "consolidated" / "metadata.json").write_text('{"global_step": 4}')
    strategy = MegatronStrategy(ckpt_consolidation_frequency="every_n:2")  # any cadence: on demand
    strategy.trainer = SimpleNamespace(
        checkpoint_callback=SimpleNamespace(
            best_model_path=str(best), best_model_score=torch.tensor(3.2), monitor="val_loss", mode="min"
        )
    )
    assert strategy.consolidate_best_checkpoint() == best / "consolidated"
    assert os.readlink(root / "BEST") == best.name


def test_an_on_demand_consolidation_outside_fit_ends_the_process_it_started(tmp_path):
    from nemo_patch import MegatronStrategy
    from nemo_patch.training.callback import consolidation_of

    root = tmp_path / "checkpoints"
    best = _checkpoint(root, 4, 3.2)  # a bare stand-in: its consolidation fails, which is enough here
    strategy = MegatronStrategy(ckpt_consolidation_frequency="every_n:2")
    strategy.trainer = SimpleNamespace(
        checkpoint_callback=SimpleNamespace(
            best_model_path=str(best), best_model_score=torch.tensor(3.2), monitor="val_loss", mode="min"
        )
    )
    assert strategy.consolidate_best_checkpoint() is None  # failed (logged)
    queue = consolidation_of(strategy.checkpoint_io).queue
    assert queue.processes_started == 1 and queue.process is None  # no idle process left behind
    assert len(queue.completed) == 1 and queue.completed[0][2].startswith("ConsolidationError: ")
