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

"""End-to-end: ``"best"`` and phased cadences in real NeMo fine-tunes with validation on the CPU, across a resume.

The tiny GPT first trains on the very samples it is validated on, then on other ones (``--val-minimum-at 6``), so
NeMo's logged ``val_loss`` goes down until global step 6 and up after it. ``ModelCheckpoint(monitor="val_loss",
mode="min", save_top_k=2)`` saves at the end of each validation (every 2 steps), with the metric in the checkpoint
names; worse checkpoints are not kept by top-k, only NeMo's ``-last`` copy of each step. The cadence
``"best; every_n:3@10"`` consolidates the checkpoints that improved ``val_loss`` until global step 10, then every 3rd
finished checkpoint of that phase, counted across the resume (the run stops at step 12 and resumes to step 20).
"""

import json
import os

import pytest
from conftest import run_fit, run_fit_process

from nemo_patch.cli.nemo_consolidate import main as nemo_consolidate

pytestmark = pytest.mark.slow

FREQUENCY = "best; every_n:3@10"
OPTIONS = dict(
    frequency=FREQUENCY,
    monitor="val_loss",
    save_top_k=2,
    validate_every=2,
    val_minimum_at=6,
    lr=5e-3,
    wait_for_consolidation=True,
)


def _improving(val_loss):
    """The global steps whose val_loss is lower than every earlier one (what ModelCheckpoint ranks best then)."""
    steps, best = [], float("inf")
    for step, value in sorted((int(step), value) for step, value in val_loss.items()):
        if value < best:
            steps.append(step)
            best = value
    return steps


@pytest.fixture(scope="module")
def best_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("best-cadence")
    root = out / "tiny_gpt" / "checkpoints"
    first = run_fit(out, max_steps=12, **OPTIONS)
    first["best_metadata"] = json.loads((root / "BEST" / "consolidated" / "metadata.json").read_text())
    # The tiny data module does not carry its position over a resume (NeMo's own data modules do, through their
    # state), so the resumed run is told that the rehearsal is over.
    second = run_fit(out, max_steps=20, **{**OPTIONS, "val_minimum_at": 0})
    second["best_metadata"] = json.loads((root / "BEST" / "consolidated" / "metadata.json").read_text())
    return root, first, second


def test_best_then_every_n_consolidates_exactly_the_expected_checkpoints_across_a_resume(best_runs):
    root, first, second = best_runs
    val_loss = {int(step): value for step, value in {**first["val_loss"], **second["val_loss"]}.items()}
    assert sorted(val_loss) == list(range(2, 21, 2))
    improving = _improving(val_loss)
    assert improving == [2, 4, 6] and val_loss[8] > val_loss[6]  # the data puts the minimum at step 6
    # Phase "best" (steps < 10): exactly the checkpoints that improved val_loss; step 8 (worse) is not.
    assert first["completed_steps"] == [step for step in improving if step < 10]
    # Phase "every_n:3@10": 10 and 12 are its 1st and 2nd finished checkpoints (before the resume), so 14 (3rd) and
    # 20 (6th) are due; a count restarted at the resume would pick 16, a run-wide count 12 and 18.
    assert second["completed_steps"] == [14, 20]
    assert first["finished_count"] == 6 and second["finished_count"] == 10
    assert first["consolidation_errors"] == second["consolidation_errors"] == []


def test_best_names_the_lowest_val_loss_and_latest_the_newest(best_runs):
    root, first, second = best_runs
    best_name = "tiny_gpt--val_loss={:.4f}-step=5-consumed_samples=12.0"
    val_6 = {**first["val_loss"]}["6"]
    assert first["best_target"] == second["best_target"] == best_name.format(val_6)
    assert first["latest_target"] == best_name.format(val_6)  # the newest consolidated checkpoint of run 1
    assert second["latest_target"].startswith("tiny_gpt--val_loss=") and "-step=19-" in second["latest_target"]
    # The best was consolidated once, in run 1: neither fit end recomputed it.
    assert 6 not in second["completed_steps"]
    for metadata in (first["best_metadata"], second["best_metadata"]):
        assert metadata["global_step"] == 6
        assert metadata["best"] == {"monitor": "val_loss", "value": pytest.approx(val_6, abs=1e-6), "mode": "min"}
    # Step 14's -last checkpoint was replaced by NeMo; its output was kept under retained/.
    assert 14 in [entry["global_step"] for entry in second["retained"]]


def test_nemo_consolidate_best_picks_the_same_checkpoint(best_runs, tmp_path, capsys):
    root, _, second = best_runs
    assert nemo_consolidate([str(root.parent), "--best", "--out", str(tmp_path / "best")]) == 0
    message = capsys.readouterr().err
    assert f"Best checkpoint by val_loss (min): {second['best_target']}" in message
    assert "ModelCheckpoint state in" in message
    produced = (tmp_path / "best" / "model.safetensors").read_bytes()
    assert produced == (root / "BEST" / "consolidated" / "model.safetensors").read_bytes()
    metadata = json.loads((tmp_path / "best" / "metadata.json").read_text())
    # After a resume NeMo re-reads its top-k scores from the checkpoint names (4 decimals with this filename).
    assert metadata["best"] == {**second["best_metadata"]["best"], "value": pytest.approx(metadata["best"]["value"])}
    assert metadata["best"]["value"] == pytest.approx(second["best_metadata"]["best"]["value"], abs=1e-4)


def test_best_without_a_monitored_metric_fails_at_fit_start(tmp_path):
    proc = run_fit_process(tmp_path, frequency="best", monitor="step", max_steps=4, save_every=2)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "ValueError: ckpt_consolidation_frequency='best' consolidates the best checkpoint" in output
    assert "ModelCheckpoint(monitor='step') monitors none" in output
    root = tmp_path / "tiny_gpt" / "checkpoints"
    assert not root.is_dir() or os.listdir(root) == []  # no training step ran, nothing was saved


def test_the_phased_frequency_round_trips_through_the_checkpoint_context(best_runs):
    from nemo.lightning import io

    root, _, _ = best_runs
    strategy = io.load_context(str(root / "BEST" / "context"), subpath="trainer.strategy")
    assert str(strategy.consolidation_settings.policy) == FREQUENCY


def test_a_preempted_run_consolidates_its_best_checkpoint_before_it_exits(tmp_path):
    """``best`` only from step 1000 on, so nothing is consolidated during these 7 steps: the best checkpoint (step 6,
    the lowest val_loss) is consolidated when NeMo's PreemptionCallback ends fit (SIGTERM after step 7)."""
    options = {**OPTIONS, "frequency": "every_n:100; best@1000", "max_steps": 12, "fault": ["sigterm:7"]}
    report = run_fit(tmp_path, **options)
    assert report["system_exit"] == 0 and report["global_step"] == 7
    assert report["completed_steps"] == [6]
    assert "-step=5-" in report["best_target"]  # global step 6
    metadata = json.loads(
        (tmp_path / "tiny_gpt" / "checkpoints" / "BEST" / "consolidated" / "metadata.json").read_text()
    )
    assert metadata["best"]["value"] == pytest.approx(report["val_loss"]["6"])
