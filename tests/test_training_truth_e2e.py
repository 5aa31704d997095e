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

"""The training side tells the truth (#26): every output is its own checkpoint's weights and every pointer resolves,
through repeated fits, resumes, killed jobs and every way NeMo deletes checkpoints.

Each test is a real CPU fit (or two). Outputs, the kept ones under ``retained/`` included, are compared tensor by
tensor with the checkpoint they came from, or with a hard-link snapshot of it taken when its save completed
(``nemo_patch.testing.snapshots``); ``LATEST``/``BEST`` must name complete outputs. The windows in which NeMo's
threads and the training loop meet are forced with the test aids' hooks (``nemo_patch.testing.faults``), not sleeps.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Optional

import pytest
from conftest import REPO, run_fit

from nemo_patch.engine.publish import TMP_PREFIX
from nemo_patch.engine.verify import verify_consolidated
from nemo_patch.training.journal import JOURNAL_NAME
from nemo_patch.training.latest import LATEST_NAME, read_latest_pointer
from nemo_patch.training.retention import RETAINED_DIRNAME, consolidated_outputs

pytestmark = pytest.mark.slow


def _root(out: Path) -> Path:
    return out / "tiny_gpt" / "checkpoints"


def _log(out: Path) -> str:
    return (out / "fit.log").read_text()


def _errors(log: str) -> List[str]:
    return [line for line in log.splitlines() if re.search(r"^ERROR|\[NeMo E|Traceback|Errno", line)]


def _outputs(root: Path) -> List[Any]:
    return consolidated_outputs(root, "consolidated")


def _assert_outputs_are_their_checkpoints(root: Path, snapshots: Optional[Path] = None) -> int:
    """Every complete output (inside checkpoints and under ``retained/``) equals, tensor by tensor, the weights of the
    checkpoint it names: its own directory's, or for a kept one the snapshot of the checkpoint it was kept from."""
    compared = 0
    for output in _outputs(root):
        if output.retained:
            source = json.loads((output.output_dir / "metadata.json").read_text())["retained_from"]
            assert snapshots is not None, output.entry
            weights = snapshots / source / "weights"
        else:
            weights = output.entry / "weights"
        assert verify_consolidated(weights, output.output_dir) > 0, output.entry
        compared += 1
    return compared


def _assert_pointers_resolve(root: Path) -> None:
    for name in (LATEST_NAME, "BEST"):
        link = root / name
        if os.path.lexists(link):
            assert link.is_symlink(), f"{name} is not a symlink"
            assert (link / "consolidated" / "metadata.json").is_file(), f"{name} -> {os.readlink(link)} dangles"


def _assert_no_strays(root: Path) -> None:
    """No checkpoint directory without weights (a ``-last`` copy re-created or half-deleted), no empty kept entry,
    no temporary output."""
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink() and not entry.name.startswith(".") and entry.name != "retained":
            assert (entry / "weights").is_dir(), f"stray directory {entry.name}: {sorted(os.listdir(entry))}"
    retained = root / RETAINED_DIRNAME
    for entry in retained.iterdir() if retained.is_dir() else []:
        assert (entry / "consolidated" / "metadata.json").is_file(), f"incomplete kept entry {entry.name}"
    assert not list(root.rglob(f"{TMP_PREFIX}*")), list(root.rglob(f"{TMP_PREFIX}*"))


# --- 1. two fits on one trainer --------------------------------------------------------------------------------------


def test_a_second_fit_on_the_same_trainer_never_reuses_the_first_fits_outputs(tmp_path):
    """The second ``trainer.fit`` starts its global steps again, from the first fit's weights: its checkpoints are
    NeMo's ``-v1`` names for the same steps, and its final ``-last`` copy (global step 4, like the first fit's) must
    get the second fit's step-4 output, not the first fit's: a global step names no weights across fits."""
    report = run_fit(tmp_path, frequency="each", max_steps=4, save_every=2, fits=2, max_pending=8)
    root = _root(tmp_path)
    log = _log(tmp_path)
    assert _errors(log) == [] and report["consolidation_errors"] == [], _errors(log)
    names = sorted(entry["name"] for entry in report["checkpoints"])
    assert names == [
        "tiny_gpt--step=1-consumed_samples=4.0",
        "tiny_gpt--step=1-consumed_samples=4.0-v1",
        "tiny_gpt--step=3-consumed_samples=8.0",
        "tiny_gpt--step=3-consumed_samples=8.0-last",
        "tiny_gpt--step=3-consumed_samples=8.0-v1",
    ]
    assert all(entry["consolidated"] for entry in report["checkpoints"])
    # The -last copy holds the second fit's weights; its output is links of the second fit's step-4 output.
    last, own = root / names[3], root / names[4]
    assert os.path.samefile(last / "consolidated" / "model.safetensors", own / "consolidated" / "model.safetensors")
    assert _assert_outputs_are_their_checkpoints(root) == 5
    # An independent check of the copy: megatron-core's own load of its weights.
    compare = subprocess.run(
        [sys.executable, "-m", "nemo_patch.testing.mcore_compare", str(last / "weights"), str(last / "consolidated")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert compare.returncode == 0, compare.stdout + compare.stderr[-2000:]
    assert read_latest_pointer(root) == own.resolve()  # the newest consolidation: the second fit's last step
    _assert_pointers_resolve(root)
    assert not (root / JOURNAL_NAME).exists()


# --- 2. NeMo's removal thread under async save, with top-k 1 and a save every step ----------------------------------


def _step(name: str) -> int:
    """NeMo's ``step=<i>`` in a checkpoint name is the 0-based index of the last step: global step ``i + 1``."""
    return int(re.search(r"step=(\d+)", name).group(1)) + 1


def test_async_each_with_top_k_1_never_writes_into_a_checkpoint_nemo_is_removing(tmp_path):
    """Async save, ``each``, a save every step, ``save_top_k=1``: NeMo removes each checkpoint and each ``-last`` copy
    from its own thread as soon as the next one is finalized, while their consolidations wait or run.

    Forced windows: NeMo's first removal of a ``-last`` copy whose step's consolidation is still waiting or running
    is held in NeMo's thread, after the strategy took it and before any file goes, until the training loop has seen
    that consolidation end, i.e. exactly when the copy's link is due (``holdremoval:1``; the first consolidation is
    stopped until then, so such a removal comes whatever the machine's speed); nothing may appear in the copy's
    directory meanwhile. The first keeping of an output fails (``keepfail:1``, No space left on device): the
    pointers must still move and no empty entry stay. Throughout: no stray directory, no error but that one, every
    output (the kept ones too) equal to its own checkpoint's weights, every due step accounted for."""
    report = run_fit(
        tmp_path,
        frequency="each",
        async_save=True,
        save_every=1,
        max_steps=12,
        save_top_k=1,
        monitor="step",
        snapshot_checkpoints=True,
        fault=["holdremoval:1", "keepfail:1"],
        info_logs=True,
    )
    root = _root(tmp_path)
    log = _log(tmp_path)
    assert report["global_step"] == 12 and report["consolidation_errors"] == []
    # The held removal: released by the training loop once the copy's source had ended; nothing was written into it.
    assert len(report["fault_records"]) == 1, report["fault_records"]
    held = report["fault_records"][0]
    assert held["released_by_training_loop"] and held["appeared"] == [], held
    # The one error: the failed keeping, which left no entry and moved the pointers.
    errors = _errors(log)
    assert len(errors) == 1 and "Could not keep the consolidated output" in errors[0], errors
    assert "No space left on device" in errors[0]
    assert "Directory not empty" not in log and "Exception in thread" not in log
    _assert_no_strays(root)
    _assert_pointers_resolve(root)
    assert read_latest_pointer(root) is not None
    assert _assert_outputs_are_their_checkpoints(root, tmp_path / "snapshots") >= 2
    # Every due checkpoint (all 12 steps) was consolidated, skipped (queue full) or dropped for a removal, and the
    # metric counts the last two kinds.
    done = set(report["completed_steps"])
    lost = {_step(name) for name in report["skipped"] + report["dropped_by_removal"]}
    assert done | lost == set(range(1, 13)), (sorted(done), sorted(lost))
    assert not (root / JOURNAL_NAME).exists()


# --- 3. a job killed mid-consolidation, LATEST replaced by a directory, resumed with a smaller save_top_k -----------


def test_a_killed_job_is_resumed_truthfully_with_fewer_top_k_and_latest_made_a_directory(tmp_path):
    """Run A (``each``, a save every step, ``save_top_k=3``, each step waiting for its consolidation) is SIGKILLed,
    with its consolidation process, half-way through the consolidation of its 5th checkpoint (``jobkill:5``): the
    journal lists it. Before the resume, a sync tool that follows symlinks replaced ``LATEST`` by a directory.

    Run B resumes with ``save_top_k=1``: NeMo's own start-up clean-up deletes the two surplus top-k checkpoints
    (``nemo_topk_check_previous_run``, a plain ``rmtree``): their outputs must be kept all the same. ``LATEST`` is
    reported, set aside and made a symlink again; the cut-off consolidation is redone and said so once."""
    common = dict(frequency="each", save_every=1, monitor="step", wait_for_consolidation=True, info_logs=True)
    with pytest.raises(pytest.fail.Exception, match=r"rc=-9"):
        run_fit(tmp_path, max_steps=30, save_top_k=3, snapshot_checkpoints=True, fault="jobkill:5", **common)
    root = _root(tmp_path)
    cut_off = "tiny_gpt--step=4-consumed_samples=10.0"  # global step 5
    journal = json.loads((root / JOURNAL_NAME).read_text())
    assert [entry["checkpoint"] for entry in journal["due"]] == [cut_off]
    assert not (root / cut_off / "consolidated").exists() and list((root / cut_off).glob(f"{TMP_PREFIX}*"))
    before = {output.entry.name: output.global_step for output in _outputs(root)}
    assert set(before.values()) == {1, 2, 3, 4}, before
    # A sync tool that follows symlinks made LATEST a directory.
    latest = root / LATEST_NAME
    copy = tmp_path / "latest-copy"
    shutil.copytree(latest, copy, symlinks=False)
    latest.unlink()
    copy.rename(latest)

    report = run_fit(tmp_path, max_steps=7, save_top_k=1, snapshot_checkpoints=True, **common)
    log = _log(tmp_path)
    assert report["resumed_from"] is not None and f"{cut_off}-last" in report["resumed_from"]
    assert report["consolidation_errors"] == [] and _errors(log) == [], _errors(log)
    # LATEST: reported once, the directory set aside (kept, hidden), a symlink again on a complete output.
    assert log.count("was a directory or file, not the symlink this package keeps there") == 1
    aside = [p for p in root.iterdir() if p.name.startswith(f".{LATEST_NAME}.replaced-")]
    assert len(aside) == 1 and (aside[0] / "consolidated" / "metadata.json").is_file()
    _assert_pointers_resolve(root)
    assert json.loads((latest / "consolidated" / "metadata.json").read_text())["global_step"] == 7
    # The cut-off consolidation was redone, and said so once.
    assert log.count(f"Consolidating {cut_off} now: due when an earlier run") == 1
    assert 5 in report["completed_steps"]
    # NeMo's clean-up deleted the surplus top-k checkpoints directly; their outputs were kept all the same.
    assert "Removed distributed checkpoint" in log
    after = {output.global_step for output in _outputs(root)}
    assert set(before.values()) | {5, 6, 7} <= after, (before, after)
    for name in before:
        kept = name.removesuffix("-last")
        assert (root / name / "consolidated").is_dir() or (root / RETAINED_DIRNAME / kept / "consolidated").is_dir()
    _assert_no_strays(root)
    assert _assert_outputs_are_their_checkpoints(root, tmp_path / "snapshots") >= 7
    assert not (root / JOURNAL_NAME).exists()
