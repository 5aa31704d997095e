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

"""Runs that share a checkpoint root (#38 items 1 and 2): a checkpoint name reused by a second run whose output NeMo
removes is kept beside the first run's under ``retained/``, never dropped silently, and ``LATEST``/``BEST`` follow the
second run's output, not the first's; when the second run's ``LATEST`` checkpoint is removed, ``LATEST`` stays with
that run's weights (or is removed), never moves to the first run's higher global step. Real checkpoints and outputs of
a real fit, each output compared tensor for tensor with its own checkpoint (megatron-core's loader)."""

import json
import logging
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from nemo_patch.engine.output_layout import RETAINED_DIRNAME
from nemo_patch.testing.mcore_compare import compare
from nemo_patch.training.latest import BEST_NAME, LATEST_NAME, update_latest_pointer
from nemo_patch.training.retention import Observer, consolidated_outputs

NAME = "tiny_gpt--step=3-consumed_samples=8.0"


def _observer(keep=None, run_id="run-a") -> Observer:
    settings = SimpleNamespace(output_dirname="consolidated", config=SimpleNamespace(keep=keep))
    coordinator = SimpleNamespace(
        settings=settings, _outputs={}, lock=threading.RLock(), deleting=set(), run_id=run_id
    )
    return Observer(coordinator)


def _checkpoints(each_run):
    """Two different finished checkpoints of the fit with their outputs: run A's and run B's, to be saved under one
    name."""
    found = sorted(p for p in each_run["root"].iterdir() if (p / "consolidated" / "metadata.json").is_file()
                   and not p.is_symlink() and not p.name.endswith("-last"))  # fmt: skip
    assert len(found) >= 2
    return found[0], found[1]


def _save(source: Path, root: Path) -> Path:
    """``source`` saved in ``root`` under ``NAME`` (its own weights and output, hard links where possible)."""
    target = root / NAME
    shutil.copytree(source, target, copy_function=lambda a, b: shutil.copy2(a, b))
    return target


@pytest.mark.parametrize("pointer", [LATEST_NAME, BEST_NAME])
def test_a_reused_checkpoint_name_keeps_both_outputs_and_the_pointer_follows_the_new_run(
    each_run, tmp_path, caplog, pointer
):
    run_a, run_b = _checkpoints(each_run)
    root = tmp_path / "checkpoints"
    root.mkdir()
    observer = _observer()

    # run A saves NAME, it is consolidated, NeMo removes it: kept as retained/NAME
    checkpoint = _save(run_a, root)
    a_weights = tmp_path / "a_weights"
    shutil.copytree(checkpoint / "weights", a_weights)
    update_latest_pointer(checkpoint, root, name=pointer)
    observer.before_removal(checkpoint)
    shutil.rmtree(checkpoint)
    assert (root / RETAINED_DIRNAME / NAME / "consolidated").is_dir()

    # run B in the same root saves the same name with other weights; NeMo removes it too
    checkpoint = _save(run_b, root)
    b_weights = tmp_path / "b_weights"
    shutil.copytree(checkpoint / "weights", b_weights)
    update_latest_pointer(checkpoint, root, name=pointer)
    caplog.set_level(logging.INFO, logger="nemo_patch.training.retention")
    caplog.clear()  # run B's removal's records only (run A's are captured too where the logger was at INFO already)
    observer.before_removal(checkpoint)
    shutil.rmtree(checkpoint)

    entries = sorted(p.name for p in (root / RETAINED_DIRNAME).iterdir() if not p.name.startswith("."))
    assert entries == [NAME, f"{NAME}-v1"], entries
    kept = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Kept the consolidated output")]
    assert len(kept) == 1 and f"{NAME}-v1" in kept[0]
    # each entry is its own run's output, tensor for tensor with that run's checkpoint
    assert compare(a_weights, root / RETAINED_DIRNAME / NAME / "consolidated") > 0
    assert compare(b_weights, root / RETAINED_DIRNAME / f"{NAME}-v1" / "consolidated") > 0
    metadata = json.loads((root / RETAINED_DIRNAME / f"{NAME}-v1" / "consolidated" / "metadata.json").read_text())
    assert metadata["retained_from"] == NAME
    # the pointer names run B's output, not run A's older entry of the same name
    assert (root / pointer).resolve() == (root / RETAINED_DIRNAME / f"{NAME}-v1").resolve()
    # and the newest of the root's outputs of that step is run B's
    assert consolidated_outputs(root, "consolidated")[0].entry.name == f"{NAME}-v1"


def test_an_output_that_cannot_be_kept_is_logged(each_run, tmp_path, caplog, monkeypatch):
    run_a, _ = _checkpoints(each_run)
    root = tmp_path / "checkpoints"
    root.mkdir()
    checkpoint = _save(run_a, root)
    caplog.set_level(logging.INFO, logger="nemo_patch.training.retention")
    _observer(keep=0).before_removal(checkpoint)
    assert any("goes with its checkpoint" in r.getMessage() and NAME in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setattr("nemo_patch.training.retention.retain_output", lambda *args: None)
    _observer().before_removal(checkpoint)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "was not kept" in r.getMessage()]
    assert len(warned) == 1 and NAME in warned[0].getMessage()


def test_versioned_last_copies_are_copies(each_run, tmp_path):
    """NeMo names a ``-last`` copy ``-last-v1``, ``-last-v2`` when the name exists: retained under the step's name, and
    a copy whose files its step's output holds is not kept twice (#38 item 3, retention's part)."""
    from nemo_patch.training.retention import retain_output, retained_name

    assert retained_name(Path(f"{NAME}-last-v2")) == retained_name(Path(f"{NAME}-last")) == NAME
    assert retained_name(Path(f"{NAME}-v1")) == f"{NAME}-v1"  # a versioned checkpoint, not a copy
    run_a, _ = _checkpoints(each_run)
    root = tmp_path / "checkpoints"
    root.mkdir()
    own = _save(run_a, root)
    copy = root / f"{NAME}-last-v1"
    copy.mkdir()
    shutil.copytree(own / "consolidated", copy / "consolidated", copy_function=os.link)  # the step's output, linked
    assert retain_output(copy, "consolidated") is None  # its step's own checkpoint holds the same files
    assert consolidated_outputs(root, "consolidated")[0].entry == own  # the step's own before its copy
    shutil.rmtree(own)
    entry = retain_output(copy, "consolidated")
    assert entry == root / RETAINED_DIRNAME / NAME
    assert compare(each_run["root"] / run_a.name / "weights", entry / "consolidated") > 0


def _save_as_run(source: Path, root: Path, run: str) -> Path:
    """``source`` saved in ``root`` under its own name, its output recorded as ``run``'s (as that run's consolidation
    records it in ``metadata.json``)."""
    target = root / source.name
    shutil.copytree(source, target, copy_function=lambda a, b: shutil.copy2(a, b))
    metadata_path = target / "consolidated" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["run"] = run
    metadata_path.write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    return target


@pytest.mark.parametrize("keep", [None, 0])
def test_latest_never_moves_to_another_runs_weights(each_run, tmp_path, caplog, keep):
    """#38 item 2: run A left global steps 4 and 6 in the root; run B, started there later, has one output (global
    step 2) and LATEST names it. NeMo removes B's checkpoint: LATEST follows B's output to retained/ (``keep=None``),
    or is removed with one log line (``keep=0``); it never moves to run A's step 6."""
    found = sorted(p for p in each_run["root"].iterdir() if (p / "consolidated" / "metadata.json").is_file()
                   and not p.is_symlink() and not p.name.endswith("-last"))  # fmt: skip
    step2, step4, step6 = found
    root = tmp_path / "checkpoints"
    root.mkdir()
    a4, a6 = _save_as_run(step4, root, "run-a"), _save_as_run(step6, root, "run-a")
    b2 = _save_as_run(step2, root, "run-b")
    update_latest_pointer(b2)
    caplog.set_level(logging.INFO, logger="nemo_patch.training.retention")
    _observer(keep=keep, run_id="run-b").before_removal(b2)
    shutil.rmtree(b2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LATEST")]
    if keep is None:
        latest = (root / LATEST_NAME).resolve()
        assert latest == (root / RETAINED_DIRNAME / step2.name).resolve(), lines
        assert json.loads((latest / "consolidated" / "metadata.json").read_text())["run"] == "run-b"
        assert compare(step2 / "weights", latest / "consolidated") > 0  # run B's weights, tensor for tensor
    else:
        assert not os.path.lexists(root / LATEST_NAME), lines
        assert len(lines) == 1 and lines[0].startswith("LATEST removed") and "run run-b" in lines[0], lines
    # run A's outputs are left as they were, each its own checkpoint's weights
    for checkpoint in (a4, a6):
        assert compare(checkpoint / "weights", checkpoint / "consolidated") > 0
