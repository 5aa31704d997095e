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

"""The coordinator and the queue's request states, at unit level (#26): the window between taking a request off the
queue and handing it to the process, removals that arrive in it, outputs an earlier save left in a directory NeMo
saves into again, pointers replaced by directories, keeping that fails, and a checkpoint that vanishes under its
consolidation. No training run and no consolidation process here (a process that cannot start fails its request at
once); the real runs are in ``test_training_truth_e2e.py``."""

import json
import os
import threading
from pathlib import Path

import pytest

from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.engine.publish import staged_output
from nemo_patch.training import retention
from nemo_patch.training.coordinator import ConsolidationCoordinator, weights_identity
from nemo_patch.training.latest import LATEST_NAME, update_latest_pointer
from nemo_patch.training.queue import ConsolidationQueue, _Running
from nemo_patch.training.schedule import CheckpointSave, RequestState
from nemo_patch.training.settings import ConsolidationSettings


def _checkpoint(root: Path, step: int, consolidated: bool = True) -> Path:
    path = root / f"m--step={step - 1}-consumed_samples={2.0 * step}"
    (path / "weights").mkdir(parents=True)
    (path / "weights" / ".metadata").write_bytes(b"dcp %d" % step)
    if consolidated:
        (path / "consolidated").mkdir()
        (path / "consolidated" / "model.safetensors").write_bytes(b"weights of step %d" % step)
        metadata = {"format_version": 1, "global_step": step, "source_checkpoint": "../weights", "files": {}}
        (path / "consolidated" / "metadata.json").write_text(json.dumps(metadata))
    return path


def _no_process(queue: ConsolidationQueue) -> None:
    """The queue's process cannot start: every request it hands over fails at once (no interpreter start)."""

    def spawn() -> None:
        raise OSError("no consolidation process in this test")

    queue._spawn = spawn  # type: ignore[method-assign]


def test_a_removal_in_the_hand_over_window_waits_for_the_request(tmp_path):
    """A request leaves the queue and is RUNNING in one locked step: a removal of its checkpoint that arrives (from
    NeMo's thread) while the request is being handed to the process is deferred until the request has ended, never
    run under it."""
    events = []
    queue = ConsolidationQueue(lambda save, error: events.append(("done", error is not None)))
    _no_process(queue)
    save = CheckpointSave(_checkpoint(tmp_path, 2, consolidated=False), 2, written=True)
    start, ran_now = queue._start, []

    def start_with_a_removal_arriving(save: CheckpointSave) -> None:
        assert save.state is RequestState.RUNNING  # already, before the hand-over
        removal = threading.Thread(
            target=lambda: ran_now.append(queue.remove_checkpoint(save.path, lambda: events.append(("removed",))))
        )
        removal.start()
        removal.join(10)
        assert not removal.is_alive()
        start(save)

    queue._start = start_with_a_removal_arriving  # type: ignore[method-assign]
    queue.submit(save)
    assert ran_now == [False]  # deferred
    assert events == [("done", True), ("removed",)]  # after the request ended
    assert save.state is RequestState.FAILED and not queue.busy


def test_a_waiting_request_whose_checkpoint_went_is_dropped_when_it_would_start(tmp_path):
    dropped, gone = [], set()
    queue = ConsolidationQueue(
        lambda save, error: None, on_dropped=dropped.append, is_gone=lambda save: save.path in gone
    )
    _no_process(queue)
    first, second = (CheckpointSave(_checkpoint(tmp_path, s, False), s, written=True) for s in (2, 4))
    queue._running = _Running(CheckpointSave(tmp_path / "other", 0))  # something runs: both wait
    queue.submit_all([first, second])
    assert [first.state, second.state] == [RequestState.WAITING, RequestState.WAITING]
    gone.add(first.path)
    queue._running = None
    queue.poll()
    assert dropped == [first] and first.state is RequestState.DROPPED
    assert second.state is RequestState.FAILED  # started (and failed: no process)
    with pytest.raises(RuntimeError, match="is no move"):
        queue._move(first, RequestState.PUBLISHED)


def test_an_output_of_an_earlier_save_is_cleared_before_nemo_saves_into_its_directory(tmp_path):
    """A second ``fit`` saves its ``-last`` copy into the first fit's ``-last`` directory: the output there was made
    from the old weights. It is kept (when it is the only copy of its files), LATEST moves off, and it is removed."""
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    older, resaved = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    update_latest_pointer(resaved)
    coordinator.before_save(resaved)
    assert not (resaved / "consolidated").exists() and (resaved / "weights").is_dir()
    kept = tmp_path / "retained" / resaved.name / "consolidated"
    assert (kept / "model.safetensors").read_bytes() == b"weights of step 4"
    assert os.readlink(tmp_path / LATEST_NAME) == f"retained/{resaved.name}"
    save = coordinator.register(resaved, 4)
    assert save.fit == 0 and save in coordinator.schedule.pending
    assert (older / "consolidated").is_dir()  # other checkpoints are not touched


def test_latest_replaced_by_a_directory_is_set_aside_when_it_is_next_moved(tmp_path, caplog):
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    checkpoint = _checkpoint(tmp_path, 4)
    (tmp_path / LATEST_NAME).mkdir()  # a sync tool's copy
    (tmp_path / LATEST_NAME / "consolidated").mkdir()
    with caplog.at_level("WARNING"):
        coordinator.observer(retention.Observer).point(checkpoint)
    assert os.readlink(tmp_path / LATEST_NAME) == checkpoint.name
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".LATEST.replaced-")]
    assert len(aside) == 1 and (aside[0] / "consolidated").is_dir()
    assert caplog.text.count("not the symlink this package keeps there") == 1


def test_a_pointer_that_cannot_be_written_is_one_error_after_at_most_one_set_aside(tmp_path, monkeypatch, caplog):
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    checkpoint = _checkpoint(tmp_path, 4)
    calls = []

    def unwritable(*args, **kwargs):
        calls.append(args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(retention, "update_latest_pointer", unwritable)
    (tmp_path / LATEST_NAME).mkdir()  # set aside once, then the second write fails too
    with caplog.at_level("WARNING"):
        coordinator.observer(retention.Observer).point(checkpoint)
    assert len(calls) == 2 and caplog.text.count("Could not point LATEST at") == 1
    caplog.clear()
    calls.clear()
    with caplog.at_level("WARNING"):  # nothing in the pointer's place: one attempt
        coordinator.observer(retention.Observer).point(checkpoint)
    assert len(calls) == 1 and caplog.text.count("Could not point LATEST at") == 1


def test_keeping_that_fails_leaves_no_entry_and_still_moves_the_pointers(tmp_path, monkeypatch, caplog):
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    older, removed = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    update_latest_pointer(removed)
    update_latest_pointer(removed, name="BEST")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(retention, "link_output", full_disk)
    with caplog.at_level("WARNING"):
        coordinator.remove_checkpoint(removed, lambda: None)
    assert not (tmp_path / "retained" / removed.name).exists()  # no empty entry
    assert os.readlink(tmp_path / LATEST_NAME) == older.name  # moved to the surviving output
    assert not os.path.lexists(tmp_path / "BEST")  # its output is not kept: removed, never dangling
    assert "Could not keep the consolidated output" in caplog.text and "No space left on device" in caplog.text


def test_a_consolidation_that_loses_its_checkpoint_is_counted_as_skipped_not_failed(tmp_path, caplog):
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    save = CheckpointSave(_checkpoint(tmp_path, 2, consolidated=False), 2, written=True)
    save.identity = weights_identity(save.path)
    (save.path / "weights" / ".metadata").unlink()  # deleted under it (not through the strategy)
    with caplog.at_level("WARNING"):
        coordinator._on_consolidated(save, "ConsolidationError: Cannot write the output: the checkpoint is gone")
    assert coordinator.dropped_by_removal == [save] and coordinator.skipped_count == 1
    assert "was due for consolidation, but its checkpoint was removed or saved again" in caplog.text
    assert "ERROR" not in [record.levelname for record in caplog.records]


def test_staged_output_never_recreates_a_checkpoint_directory_that_went(tmp_path):
    gone = tmp_path / "m--step=3"
    with pytest.raises(ConsolidationError, match="the checkpoint directory is gone"):
        with staged_output(gone, gone / "consolidated", False, "Consolidating"):
            pass
    assert not gone.exists()
    with staged_output(gone, tmp_path / "elsewhere" / "out", False, "Consolidating") as staging:
        (staging / "metadata.json").write_text("{}")  # an output outside the checkpoint: its parents are made
    assert (tmp_path / "elsewhere" / "out" / "metadata.json").is_file()


@pytest.mark.parametrize("suffix", ["-last", "-last-v1", "-last-v12"])
def test_every_name_nemo_gives_a_last_copy_receives_its_steps_output(tmp_path, suffix):
    """NeMo names a step's last copy ``-last``, or ``-last-v<N>`` when that name exists (#38)."""
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    own = _checkpoint(tmp_path, 4)
    copy_dir = own.with_name(own.name + suffix)
    (copy_dir / "weights").mkdir(parents=True)
    (copy_dir / "weights" / ".metadata").write_bytes(b"dcp 4, saved again")
    source = CheckpointSave(own, 4, written=True, consolidated=True, output=own / "consolidated")
    copy = CheckpointSave(copy_dir, 4, written=True, copy_of=source)
    coordinator._place_copy(copy)
    linked = copy_dir / "consolidated" / "model.safetensors"
    assert linked.stat().st_ino == (own / "consolidated" / "model.safetensors").stat().st_ino
    assert copy.consolidated and copy.output == copy_dir / "consolidated"


def test_latest_only_moves_forward_within_a_run(tmp_path):
    """A late output of an older checkpoint (the end-of-fit redo of a failed one) does not move LATEST back; a second
    ``fit``'s outputs do move it, though its global steps start again (#38)."""
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    observer = coordinator.observer(retention.Observer)
    old, new = _checkpoint(tmp_path, 4), _checkpoint(tmp_path, 10)
    observer.on_published(CheckpointSave(new, 10, written=True, consolidated=True))
    observer.on_published(CheckpointSave(old, 4, written=True, consolidated=True))
    assert os.readlink(tmp_path / LATEST_NAME) == new.name
    second_fit = _checkpoint(tmp_path, 2)
    observer.on_published(CheckpointSave(second_fit, 2, written=True, consolidated=True, fit=1))
    assert os.readlink(tmp_path / LATEST_NAME) == second_fit.name


def test_the_steps_pass_runs_off_the_training_thread_and_a_save_waits_for_it(tmp_path):
    """The training loop's per-step pass runs on the coordinator's stepper thread; a save (``before_save``,
    ``register_save``) arriving while that pass runs waits for it to end, so the schedule is never used by two threads
    at once; steps ending meanwhile hand one more pass, not one each."""
    coordinator = ConsolidationCoordinator(ConsolidationSettings.from_arguments(True))
    checkpoint = _checkpoint(tmp_path, 4, consolidated=False)
    running, release, events = threading.Event(), threading.Event(), []
    real_pass = coordinator._pass

    def blocked_pass(bounded):
        events.append(("pass", threading.current_thread().name))
        running.set()
        release.wait(10)
        real_pass(bounded)
        events.append(("pass ended", None))

    coordinator._pass = blocked_pass  # type: ignore[method-assign]
    coordinator.after_step()
    assert running.wait(5)
    for _ in range(5):  # steps ending while the pass runs
        coordinator.after_step()

    def save():
        coordinator.before_save(checkpoint)
        coordinator.register_save(checkpoint, {"global_step": 4}, None)
        events.append(("saved", None))

    saving = threading.Thread(target=save)
    saving.start()
    saving.join(0.3)
    assert saving.is_alive()  # waits for the pass in progress
    release.set()
    saving.join(10)
    assert not saving.is_alive()
    assert events[0] == ("pass", "consolidation-steps") and events[1] == ("pass ended", None)
    assert events.count(("pass ended", None)) == 2 and events[-1] == ("saved", None)  # the one more pass ran first
    assert coordinator.synced_seconds > 0.2
    assert [save.path for save in coordinator.schedule.pending] == [checkpoint]
    coordinator.close()
