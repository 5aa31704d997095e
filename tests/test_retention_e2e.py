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

"""NeMo's top-k retention in real CPU training runs: consolidated outputs are kept, ``LATEST`` never dangles.

Each run snapshots every finished checkpoint's weights (hard links, ``nemo_patch.testing.snapshots``) so that an
output kept after NeMo removed its checkpoint can still be compared, tensor by tensor, with the checkpoint it came
from.
"""

import json
import re
import shutil
from pathlib import Path
from typing import Dict

import pytest
from conftest import run_fit

from nemo_patch.engine.verify import verify_consolidated
from nemo_patch.training.latest import read_latest_pointer
from nemo_patch.training.retention import RETAINED_DIRNAME, ConsolidatedOutput, consolidated_outputs

pytestmark = pytest.mark.slow

TOP_K_1 = dict(frequency="every_n:2", max_steps=10, save_every=2, save_top_k=1, monitor="step")


def _root(out: Path) -> Path:
    return out / "tiny_gpt" / "checkpoints"


def _global_step(name: str) -> int:
    """NeMo's ``step=<i>`` in a checkpoint name is the 0-based index of the last step: global step ``i + 1``."""
    return int(re.search(r"step=(\d+)", name).group(1)) + 1


def _outputs_by_step(root: Path) -> Dict[int, ConsolidatedOutput]:
    outputs: Dict[int, ConsolidatedOutput] = {}
    for output in consolidated_outputs(root, "consolidated"):
        outputs.setdefault(output.global_step, output)  # newest first: a checkpoint's own before a retained copy
    return outputs


def _assert_outputs_equal_their_checkpoints(out: Path, root: Path) -> None:
    for output in consolidated_outputs(root, "consolidated"):
        metadata = json.loads((output.output_dir / "metadata.json").read_text())
        source = metadata.get("retained_from", output.entry.name) if output.retained else output.entry.name
        assert verify_consolidated(out / "snapshots" / source / "weights", output.output_dir) > 0, output.entry


def _assert_latest_is_the_newest_output(root: Path) -> None:
    outputs = _outputs_by_step(root)
    latest = read_latest_pointer(root)
    assert latest is not None and (latest / "consolidated" / "model.safetensors").is_file()
    assert json.loads((latest / "consolidated" / "metadata.json").read_text())["global_step"] == max(outputs)


def _assert_clean_log(out: Path) -> str:
    log = (out / "fit.log").read_text()
    assert "Traceback" not in log and not re.search(r"^ERROR|\[NeMo E", log, re.MULTILINE), log[-3000:]
    return log


@pytest.fixture(scope="module")
def top_k_1_run(tmp_path_factory):
    """The run of the issue: save_top_k=1, every_n:2, a save every 2 steps, 10 steps (sync save). Top-k by recency
    through ``monitor="step"`` (mode max), which NeMo can resume; with ``monitor=None`` NeMo 2.7.3 itself cannot
    resume a run that has ``save_top_k >= 0`` (``TypeError`` in ``nemo_topk_check_previous_run``)."""
    out = tmp_path_factory.mktemp("topk1")
    report = run_fit(out, snapshot_checkpoints=True, **TOP_K_1)
    return out, report


def test_top_k_1_keeps_every_consolidated_milestone_and_latest_resolves(top_k_1_run):
    out, report = top_k_1_run
    root = _root(out)
    log = _assert_clean_log(out)
    assert report["global_step"] == 10 and report["consolidation_errors"] == []
    # NeMo kept only the newest checkpoint (and its -last copy), as it decides.
    assert sorted(entry["name"] for entry in report["checkpoints"]) == [
        "tiny_gpt--step=9-consumed_samples=20.0",
        "tiny_gpt--step=9-consumed_samples=20.0-last",
    ]
    # Due: the 2nd and 4th checkpoints (global steps 4 and 8). Each was consolidated, or dropped and reported.
    dropped = {_global_step(name) for name in report["dropped_by_removal"]}
    assert set(report["completed_steps"]) | dropped == {4, 8} and not set(report["completed_steps"]) & dropped
    # Every consolidation made survives NeMo's removal of its checkpoint, under retained/<checkpoint name>.
    outputs = _outputs_by_step(root)
    assert set(outputs) == set(report["completed_steps"])
    assert all(output.retained for output in outputs.values())
    assert sorted(entry["global_step"] for entry in report["retained"]) == sorted(report["completed_steps"])
    assert not any(path.name.startswith(".") for path in (root / RETAINED_DIRNAME).rglob("*"))  # no staging left
    _assert_latest_is_the_newest_output(root)
    _assert_outputs_equal_their_checkpoints(out, root)
    # Told once, at fit start, that save_top_k=1 drops due consolidations; each drop logged (the first as a warning).
    assert log.count("ModelCheckpoint(save_top_k=1) removes each checkpoint") == 1
    if dropped:
        assert log.count("was due for consolidation, but NeMo's top-k retention removed it") == 1


def test_resume_finds_its_sharded_checkpoint_and_keeps_the_retained_outputs(top_k_1_run, tmp_path):
    first_out, first = top_k_1_run
    out = tmp_path / "resumed"
    shutil.copytree(first_out, out, symlinks=True)
    report = run_fit(out, snapshot_checkpoints=True, **dict(TOP_K_1, max_steps=14))
    root = _root(out)
    _assert_clean_log(out)
    assert report["global_step"] == 14
    assert report["resumed_from"] is not None and "step=9-consumed_samples=20.0-last" in report["resumed_from"]
    # The every_n count carried on: the first run finished 5 checkpoints (global steps 2-10); the resumed run's
    # global steps 12 and 14 are the 6th (due) and the 7th.
    due_after_resume = {12}
    dropped = {_global_step(name) for name in report["dropped_by_removal"]}
    assert set(report["completed_steps"]) | dropped == due_after_resume
    outputs = _outputs_by_step(root)
    assert set(outputs) == set(first["completed_steps"]) | set(report["completed_steps"])
    _assert_latest_is_the_newest_output(root)
    _assert_outputs_equal_their_checkpoints(out, root)


def test_monitored_metric_with_each_keeps_the_newest_n_of_what_top_k_removes(tmp_path):
    """save_top_k=2 by a monitored metric (lowest training loss), each checkpoint consolidated, at most 3 outputs
    kept (``ConsolidationConfig(keep=3)``). Top-k removes checkpoints out of order; each step waits for the running
    consolidation, as a real run's consolidations keep up with its saves, so every due checkpoint is consolidated."""
    keep = 3
    report = run_fit(
        tmp_path,
        frequency="each",
        max_steps=8,
        save_every=1,
        save_top_k=2,
        monitor="reduced_train_loss",
        keep=keep,
        wait_for_consolidation=True,
        snapshot_checkpoints=True,
    )
    root = _root(tmp_path)
    log = _assert_clean_log(tmp_path)
    assert report["global_step"] == 8 and report["consolidation_errors"] == []
    assert "removes each checkpoint" not in log  # save_top_k=2: no start-up warning
    assert report["dropped_by_removal"] == [] and sorted(report["completed_steps"]) == list(range(1, 9))
    living = {entry["name"] for entry in report["checkpoints"]}
    outputs = consolidated_outputs(root, "consolidated")
    steps = [output.global_step for output in outputs]  # newest first
    living_steps = {o.global_step for o in outputs if not o.retained}
    retained_steps = {o.global_step for o in outputs if o.retained}
    assert retained_steps and all(not o.retained or o.entry.name not in living for o in outputs)
    # The rule: an output whose checkpoint NeMo removed is kept exactly while it is among the newest `keep` outputs.
    for step in set(report["completed_steps"]) - living_steps:
        newer = len({s for s in steps if s > step})
        assert (step in retained_steps) == (newer < keep), (step, steps)
    _assert_latest_is_the_newest_output(root)
    _assert_outputs_equal_their_checkpoints(tmp_path, root)
