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

"""Several runs into one log directory, in real CPU fits (#38, a run's identity): a new run and a second ``fit`` in
the same process, a resume, a rollback (a resume from an older checkpoint) and a new run with
``resume_if_exists=False``. After each, every output records the run that made it (a resume goes on with the run it
resumes), every new output is compared tensor for tensor with its own checkpoint, and ``LATEST`` names the newest
output of the run that just trained."""

import json
import re
from pathlib import Path
from typing import Any, Dict, Set, Tuple

import pytest
from conftest import run_fit

from nemo_patch.testing.mcore_compare import compare
from nemo_patch.training.latest import read_latest_pointer

pytestmark = pytest.mark.slow

OPTIONS: Dict[str, Any] = dict(frequency="each", save_every=2, max_pending=8)


def _outputs(root: Path) -> Dict[str, Dict[str, Any]]:
    """Checkpoint name -> its output's ``metadata.json``, for every checkpoint of the root holding an output."""
    return {
        path.name: json.loads((path / "consolidated" / "metadata.json").read_text())
        for path in sorted(root.iterdir())
        if not path.is_symlink() and (path / "consolidated" / "metadata.json").is_file()
    }


def _steps_by_run(outputs: Dict[str, Dict[str, Any]]) -> Dict[str, list]:
    """Run -> the global steps of its outputs (``-last`` copies left out)."""
    runs: Dict[str, list] = {}
    for name, metadata in outputs.items():
        if not re.search(r"-last(-v\d+)?$", name):
            runs.setdefault(metadata["run"], []).append(metadata["global_step"])
    return {run: sorted(steps) for run, steps in runs.items()}


def _compare_new(root: Path, compared: Set[Tuple[str, int]]) -> None:
    """Compare every output not compared yet (a checkpoint saved again is new) with its own checkpoint's weights."""
    for path in sorted(root.iterdir()):
        output = path / "consolidated"
        if path.is_symlink() or not (output / "metadata.json").is_file():
            continue
        key = (path.name, (output / "metadata.json").stat().st_ino)
        if key not in compared:
            assert compare(path / "weights", output) > 0, path
            compared.add(key)


def _latest(root: Path) -> Tuple[str, Dict[str, Any]]:
    latest = read_latest_pointer(root)
    assert latest is not None and (latest / "consolidated" / "model.safetensors").is_file()
    return latest.name, json.loads((latest / "consolidated" / "metadata.json").read_text())


def _assert_clean(out: Path, report: Dict[str, Any]) -> None:
    log = (out / "fit.log").read_text()
    assert "Traceback" not in log and not re.search(r"^ERROR|\[NeMo E", log, re.MULTILINE), log[-3000:]
    assert report["consolidation_errors"] == [] and report["skipped"] == []


def test_runs_sharing_a_log_dir_keep_their_ids_outputs_and_latest(tmp_path):
    out = tmp_path / "shared"
    root = out / "tiny_gpt" / "checkpoints"
    compared: Set[Tuple[str, int]] = set()

    # 1. A new run, then a second fit on the same trainer (its global steps start again: a run of its own).
    first = run_fit(out, max_steps=4, fits=2, **OPTIONS)
    _assert_clean(out, first)
    fit2 = first["run_id"]
    runs = _steps_by_run(_outputs(root))
    assert set(runs) >= {fit2} and len(runs) == 2, runs
    fit1 = next(run for run in runs if run != fit2)
    assert runs == {fit1: [2, 4], fit2: [2, 4]}
    _compare_new(root, compared)
    name, latest = _latest(root)
    assert (latest["run"], latest["global_step"]) == (fit2, 4), name

    # 2. A resume: AutoResume picks the newest -last checkpoint (the second fit's) and goes on with its run.
    second = run_fit(out, max_steps=6, **OPTIONS)
    _assert_clean(out, second)
    assert second["run_id"] == fit2 and "-last" in second["resumed_from"]
    assert _steps_by_run(_outputs(root)) == {fit1: [2, 4], fit2: [2, 4, 6]}
    _compare_new(root, compared)
    name, latest = _latest(root)
    assert (latest["run"], latest["global_step"]) == (fit2, 6), name

    # 3. A rollback: resume the first fit's global-step-2 checkpoint; its run goes on, from there.
    older = next(n for n, m in _outputs(root).items() if m["run"] == fit1 and m["global_step"] == 2)
    before = set(_outputs(root))
    third = run_fit(out, max_steps=4, resume_from=root / older, **OPTIONS)
    _assert_clean(out, third)
    assert third["run_id"] == fit1 and older in third["resumed_from"]
    outputs = _outputs(root)
    assert _steps_by_run(outputs) == {fit1: [2, 4, 4], fit2: [2, 4, 6]}
    _compare_new(root, compared)
    name, latest = _latest(root)
    assert (latest["run"], latest["global_step"]) == (fit1, 4) and name not in before, name  # the new step 4

    # 4. A new run in the same log directory (resume_if_exists=False): a new id, LATEST its own output.
    fourth = run_fit(out, max_steps=2, new_run=True, **OPTIONS)
    _assert_clean(out, fourth)
    assert fourth["run_id"] not in (fit1, fit2) and fourth["resumed_from"] is None
    assert _steps_by_run(_outputs(root)) == {fit1: [2, 4, 4], fit2: [2, 4, 6], fourth["run_id"]: [2]}
    _compare_new(root, compared)
    name, latest = _latest(root)
    assert (latest["run"], latest["global_step"]) == (fourth["run_id"], 2), name
    current = {(name, (root / name / "consolidated" / "metadata.json").stat().st_ino) for name in _outputs(root)}
    assert current <= compared and len(current) == 10  # every output there is, -last copies included
