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

"""Which finished saves are due, in what order, and what happens to NeMo's -last copies and removed checkpoints."""

from pathlib import Path

from nemo_patch.training.policy import parse_consolidation_frequency
from nemo_patch.training.schedule import ConsolidationSchedule


def _schedule(frequency):
    return ConsolidationSchedule(parse_consolidation_frequency(frequency))


def _save(schedule, name, step, written=True):
    save = schedule.register(Path("/ckpts") / name, step)
    save.written = written
    return save


def test_each_with_last_copies():
    schedule = _schedule("each")
    _save(schedule, "s2", 2)
    _save(schedule, "s2-last", 2)
    _save(schedule, "s4", 4)
    due, copies = schedule.collect_finished(lambda save: False)
    assert [s.path.name for s in due] == ["s2", "s4"]
    assert [s.path.name for s in copies] == ["s2-last"]
    assert schedule.finished_count == 2 and schedule.newest_finished.path.name == "s4"


def test_collection_stops_at_the_first_save_not_yet_written():
    schedule = _schedule("each")
    _save(schedule, "s2", 2)
    _save(schedule, "s4", 4, written=False)
    later = _save(schedule, "s6", 6)
    assert [s.path.name for s in schedule.collect_finished(lambda save: False)[0]] == ["s2"]
    schedule.pending[0].written = True
    assert [s.path.name for s in schedule.collect_finished(lambda save: False)[0]] == ["s4", "s6"]
    assert later.global_step == 6


def test_a_checkpoint_removed_after_it_finished_counts_but_is_not_consolidated():
    """NeMo deletes its previous -last copy (and top-k losers) after they finished, sometimes before we look."""
    schedule = _schedule("every_n:2")
    _save(schedule, "s2", 2)
    _save(schedule, "s2-last", 2)
    _save(schedule, "s4", 4)
    _save(schedule, "s6", 6)
    gone = {"s2-last", "s4"}
    due, copies = schedule.collect_finished(lambda save: save.path.name in gone)
    assert due == [] and copies == []  # s4 was the 2nd finished checkpoint, but it is gone
    assert schedule.finished_count == 3 and schedule.newest_finished.path.name == "s6"
    assert [s.path.name for s in schedule.history] == ["s2", "s6"]


def test_count_survives_resume_through_state_dict():
    first = _schedule("every_n:2")
    for step in (2, 4, 6):
        state = first.state_dict(step)  # Lightning dumps callback state before the save is issued
        _save(first, f"s{step}", step)
    _save(first, "s6-last", 6)
    assert first.state_dict(6) == state == {"finished_count": 3, "global_step": 6, "phase_start": 0, "phase_count": 3}

    resumed = _schedule("every_n:2")
    resumed.load_state_dict(state)
    _save(resumed, "s8", 8)
    _save(resumed, "s10", 10)
    due, _ = resumed.collect_finished(lambda save: False)
    assert [s.path.name for s in due] == ["s8"] and resumed.finished_count == 5


def test_a_state_saved_before_phases_existed_counts_as_the_first_phase():
    resumed = _schedule("every_n:2")
    resumed.load_state_dict({"finished_count": 3, "global_step": 6})
    for step in (8, 10):
        _save(resumed, f"s{step}", step)
    assert [s.path.name for s in resumed.collect_finished(lambda save: False)[0]] == ["s8"]


def _due_steps(schedule, steps, best=()):
    for step in steps:
        save = _save(schedule, f"s{step}", step)
        save.best = {"monitor": "val_loss", "value": 0.0, "mode": "min"} if step in best else None
    return [s.global_step for s in schedule.collect_finished(lambda save: False)[0]]


def test_every_n_counts_per_phase_and_the_phase_starts_at_its_step():
    schedule = _schedule("every_n:3; every_n:2@10; each@20")
    # phase 1: steps 2..8 (4 checkpoints: the 3rd is due); phase 2: 10..18 (5: 2nd and 4th); phase 3: all
    assert _due_steps(schedule, range(2, 25, 2)) == [6, 12, 16, 20, 22, 24]
    assert schedule.finished_count == 12


def test_phase_counts_survive_a_resume_in_the_middle_of_a_phase():
    frequency = "every_n:3; every_n:2@10; each@20"
    first = _schedule(frequency)
    states = {}
    for step in range(2, 15, 2):
        states[step] = first.state_dict(step)
        _save(first, f"s{step}", step)
    assert states[12] == {"finished_count": 6, "global_step": 12, "phase_start": 10, "phase_count": 2}
    for resume_at in (8, 10, 12):  # last checkpoint of phase 1, first and second of phase 2
        resumed = _schedule(frequency)
        resumed.load_state_dict(states[resume_at])
        expected = [step for step in [6, 12, 16, 20, 22, 24] if step > resume_at]
        assert _due_steps(resumed, range(resume_at + 2, 25, 2)) == expected, resume_at


def test_a_changed_cadence_on_resume_starts_the_new_phase_count_from_zero():
    first = _schedule("every_n:2")
    state = first.state_dict(6)
    resumed = _schedule("each; every_n:2@4")  # step 6 is now in a phase that starts at 4, not 0
    resumed.load_state_dict(state)
    assert _due_steps(resumed, (8, 10, 12)) == [10]


def test_best_consolidates_the_saves_marked_best_when_they_were_saved():
    schedule = _schedule("best; each@100")
    assert _due_steps(schedule, (10, 20, 30, 40, 100, 110), best={10, 20, 40}) == [10, 20, 40, 100, 110]
