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

"""End-to-end: each finished consolidation shows up in the trainer's loggers (TensorBoard here) and in one INFO line.

The run saves every step with ``"each"`` and no room in the queue (``ConsolidationConfig(max_pending=0)``), so that
some due consolidations are skipped while another runs: ``consolidation/skipped`` must count them.
"""

import re

import pytest
from conftest import run_fit

pytestmark = pytest.mark.slow


def test_consolidation_metrics_reach_tensorboard_and_the_log(tmp_path):
    report = run_fit(
        tmp_path, frequency="each", max_steps=6, save_every=1, max_pending=0, tensorboard=True, info_logs=True,
        fault="pause:1",  # the first consolidation is held until training ends: later saves are skipped meanwhile
    )  # fmt: skip
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(report["tensorboard_dir"])
    events.Reload()
    seconds = events.Scalars("consolidation/seconds")
    rates = events.Scalars("consolidation/bytes_per_second")
    skipped = events.Scalars("consolidation/skipped")
    published = report["consolidations"] - len(report["consolidation_errors"])
    assert published >= 1 and len(seconds) == len(rates) == published  # how many depends on the machine's speed
    assert all(event.value > 0 for event in seconds + rates)
    # each at its checkpoint's own global step (before: the step when training saw it end, here the last one for the
    # consolidation held until training ended), as eval/* metrics are
    assert sorted(event.step for event in seconds) == sorted(report["completed_steps"])
    assert sorted(event.step for event in rates) == sorted(report["completed_steps"])
    # cumulative, ending at what the run skipped or dropped
    values = [event.value for event in skipped]
    assert values == sorted(values) and values[-1] == len(report["skipped"]) + len(report["dropped_by_removal"]) > 0
    lines = re.findall(r"Consolidated (\S+) \(global step (\d+)\): ([0-9.]+) MB in ([0-9.]+) s \(([0-9.]+) MB/s\)",
                       (tmp_path / "fit.log").read_text())  # fmt: skip
    assert len(lines) == published
    assert sorted(int(step) for _, step, *_ in lines) == sorted(report["completed_steps"])
