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

"""Run-level matching (#45): the sidecar links one checkpoint's output into another only when both hold one trainer
state, a restarted sidecar remakes a link made to another save's output, ``LATEST`` moves by the order of the saves
(run order, fit, global step; a stock NeMo save by when it finished) and never backwards, also when it names an output
under ``retained/``, never dangles after NeMo's top-k removal, and a killed sidecar's staging is removed at the next
start. The training side's ``LATEST`` follows run order too: an earlier run's save (a killed run's journal entry)
never holds it against the run that consolidated it.

The fast tests use real checkpoints megatron-core saved (two saves of other weights) and compare each output with
PyTorch's own reading of its checkpoint (``dcp_to_torch_save``); the slow ones run real stock NeMo fits and compare
with megatron-core's ``dist_checkpointing.load`` (``nemo_patch.testing.mcore_compare``) and ``--verify``."""

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Dict

import pytest
from conftest import REPO, run_fit, run_fit_process
from test_watch_attacks import STEP3, STEP5, assert_matches, log_of, make_watcher, save_checkpoint

from nemo_patch.cli.watch import output_is_complete
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.digests import source_fingerprint
from nemo_patch.engine.output_layout import RETAINED_DIRNAME
from nemo_patch.engine.publish import TMP_PREFIX
from nemo_patch.runs.run_checkpoints import list_run_checkpoints
from nemo_patch.testing.mcore_compare import compare
from nemo_patch.training.journal import JOURNAL_NAME
from nemo_patch.training.latest import LATEST_NAME, update_latest_pointer
from nemo_patch.training.retention import Observer
from nemo_patch.training.schedule import CheckpointSave


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Dict[str, object]:
    """Two saves megatron-core made one after the other (other weights), with their tensors as PyTorch reads them."""
    where = tmp_path_factory.mktemp("saves")
    first, second = where / "first", where / "second"
    return {"first": first, "tensors": save_checkpoint(first), "second": second,
            "tensors2": save_checkpoint(second, scale=2.0)}  # fmt: skip


def _copy(save: Path, target: Path) -> Path:
    """A save of the same weights under another name: other files (other inodes), the same bytes and times."""
    shutil.copytree(save, target, copy_function=shutil.copy2)
    return target


def _latest(root: Path) -> str:
    return os.readlink(root / LATEST_NAME)


def _dangling(root: Path) -> bool:
    link = root / LATEST_NAME
    return link.is_symlink() and not (root / os.readlink(link)).is_dir()


# -- linking ----------------------------------------------------------------------------------------------------------


def test_another_runs_save_of_a_step_gets_its_own_output_never_a_link(saves, tmp_path):
    """A second run (resume off) saved into the same log directory: ``step=3-v1`` and ``step=3-last-v1`` are its
    saves of global step 4, of other weights than the first run's ``step=3`` and ``step=3-last``. Each ``-last`` copy
    gets its own save's output as hard links; no checkpoint gets another save's weights (the landed watcher linked
    the first run's output into all four)."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    _copy(saves["first"], root / STEP3)
    _copy(saves["first"], root / f"{STEP3}-last")
    _copy(saves["second"], root / f"{STEP3}-v1")
    _copy(saves["second"], root / f"{STEP3}-last-v1")
    watcher = make_watcher(root)
    assert watcher.run() == 0, log_of(watcher)
    for name, tensors in ((STEP3, "tensors"), (f"{STEP3}-last", "tensors"), (f"{STEP3}-v1", "tensors2"),
                          (f"{STEP3}-last-v1", "tensors2")):  # fmt: skip
        assert output_is_complete(root / name, root / name / "consolidated"), (name, log_of(watcher))
        assert_matches(root / name / "consolidated", saves[tensors])
    inode = {name: (root / name / "consolidated" / "model.safetensors").stat().st_ino for name in os.listdir(root)
             if name.startswith(STEP3)}  # fmt: skip
    assert inode[STEP3] == inode[f"{STEP3}-last"] and inode[f"{STEP3}-v1"] == inode[f"{STEP3}-last-v1"]
    assert inode[STEP3] != inode[f"{STEP3}-v1"]
    assert _latest(root) in (f"{STEP3}-v1", f"{STEP3}-last-v1"), log_of(watcher)  # the second run's: newer
    from nemo_patch.cli.watch import same_state

    assert same_state(root / STEP3, root / f"{STEP3}-last") == "bytes"
    assert same_state(root / STEP3, root / f"{STEP3}-v1") is None


def test_a_restarted_watcher_remakes_a_link_to_another_saves_output(saves, tmp_path):
    """The landed watcher linked the first run's output into the second run's ``-v1`` with a ``metadata.json`` that
    records the ``-v1``'s own ``.metadata``, so a restart took it for complete. A restarted watcher now remakes it
    from the ``-v1``'s own weights."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    _copy(saves["first"], root / STEP3)
    _copy(saves["second"], root / f"{STEP3}-v1")
    consolidate_checkpoint(root / STEP3, root / STEP3 / "consolidated", global_step=4, workers=1)
    planted = root / f"{STEP3}-v1" / "consolidated"  # what the landed watcher's link made
    planted.mkdir()
    for path in (root / STEP3 / "consolidated").iterdir():
        if path.name != "metadata.json":
            os.link(path, planted / path.name)
    manifest = json.loads((root / STEP3 / "consolidated" / "metadata.json").read_text())
    manifest.pop("save", None)
    manifest.update(source_metadata=source_fingerprint(root / f"{STEP3}-v1" / "weights"), linked_from=STEP3)
    (planted / "metadata.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    assert not output_is_complete(root / f"{STEP3}-v1", planted)
    watcher = make_watcher(root)
    assert watcher.run() == 0, log_of(watcher)
    assert_matches(planted, saves["tensors2"])
    assert_matches(root / STEP3 / "consolidated", saves["tensors"])
    assert any(line.startswith(f"Consolidated {STEP3}-v1") for line in log_of(watcher)), log_of(watcher)


# -- LATEST -----------------------------------------------------------------------------------------------------------


def test_latest_follows_the_newest_save_not_the_highest_step(saves, tmp_path):
    """Run 1 left global step 6 (``step=5``); run 2, started later in the same log directory, saved global step 4
    (``step=3``): ``LATEST`` names run 2's output, the newest save, whatever the steps (the landed watcher kept it on
    the highest step)."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    _copy(saves["first"], root / STEP5)
    _copy(saves["second"], root / STEP3)
    watcher = make_watcher(root)
    assert watcher.run() == 0, log_of(watcher)
    assert _latest(root) == STEP3, log_of(watcher)
    watcher = make_watcher(root)  # a restart does not move it back
    assert watcher.run() == 0 and _latest(root) == STEP3, log_of(watcher)


@pytest.mark.parametrize("records", ["save", "step only"])
def test_latest_in_retained_is_never_moved_backwards(saves, tmp_path, records):
    """``LATEST`` names an output kept under ``retained/`` (its checkpoint removed) of a newer save at global step 8.
    A watcher starting then consolidates an older save of global step 4: ``LATEST`` stays, read from the retained
    output's own ``metadata.json`` (its recorded save, or for an output written before saves were recorded, its
    step). The landed watcher could not tell the retained output's step, and moved ``LATEST`` back."""
    root = tmp_path / "checkpoints"
    entry = root / RETAINED_DIRNAME / "model--step=7-consumed_samples=16.0"
    consolidate_checkpoint(saves["second"], entry / "consolidated", global_step=8, workers=1)
    if records == "step only":
        path = entry / "consolidated" / "metadata.json"
        manifest = json.loads(path.read_text())
        manifest.pop("save")
        path.write_text(json.dumps(manifest))
    update_latest_pointer(entry, root)
    _copy(saves["first"], root / STEP3)
    watcher = make_watcher(root)
    assert watcher.run() == 0, log_of(watcher)
    assert (root / STEP3 / "consolidated").is_dir(), log_of(watcher)
    assert _latest(root) == f"{RETAINED_DIRNAME}/{entry.name}", log_of(watcher)


def test_latest_moves_off_a_checkpoint_top_k_removed_and_never_dangles(saves, tmp_path):
    """NeMo's top-k retention marks a checkpoint unfinished and removes it, output and all. The watcher's next poll
    moves ``LATEST`` to the newest output left (one line), and removes it when none is left (one line); the landed
    watcher left it dangling without a word."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    _copy(saves["first"], root / STEP3)
    _copy(saves["second"], root / STEP5)
    watcher = make_watcher(root)
    assert watcher.run() == 0 and _latest(root) == STEP5, log_of(watcher)
    (root / f"{STEP5}-unfinished").touch()  # as NeMo's removal: marked, then deleted
    watcher.scan()
    assert _latest(root) == STEP3, log_of(watcher)
    shutil.rmtree(root / STEP5)
    (root / f"{STEP5}-unfinished").unlink()
    shutil.rmtree(root / STEP3)
    watcher.scan()
    assert not os.path.lexists(root / LATEST_NAME), log_of(watcher)
    lines = [line for line in log_of(watcher) if line.startswith("LATEST")]
    assert len(lines) == 2 and lines[0].startswith(f"LATEST moved from {STEP5} to {STEP3}"), lines
    assert lines[1].startswith(f"LATEST removed: {STEP3} was removed"), lines


def test_a_killed_watchers_staging_is_removed_at_the_next_start(saves, tmp_path):
    """A watcher SIGKILLed while it wrote an output leaves its staging directory (with a lock nobody holds now) in
    the root; the next watcher removes it at its start, even with nothing due (the landed one never did), and leaves
    a live process's staging alone."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    _copy(saves["first"], root / STEP3)
    consolidate_checkpoint(root / STEP3, root / STEP3 / "consolidated", global_step=4, workers=1)
    killed = subprocess.run(
        [sys.executable, "-c", "import os, signal, sys; from pathlib import Path; "
         "from nemo_patch.engine.publish import make_tmp_dir; d = make_tmp_dir(Path(sys.argv[1])); "
         "(d / 'model.safetensors').write_bytes(bytes(1 << 20)); os.kill(os.getpid(), signal.SIGKILL)", str(root)],
        cwd=REPO, capture_output=True,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    left = list(root.glob(f"{TMP_PREFIX}*"))
    assert len(left) == 1
    watcher = make_watcher(root)
    assert watcher.run() == 0, log_of(watcher)
    assert not list(root.glob(f"{TMP_PREFIX}*")), log_of(watcher)
    assert any(line.startswith(f"Removed {left[0].name}") for line in log_of(watcher)), log_of(watcher)


# -- the training side's LATEST: run order ---------------------------------------------------------------------------


def _as_run(source: Path, root: Path, run: str) -> Path:
    """``source`` (a checkpoint with its output) saved in ``root``, its output recorded as ``run``'s."""
    target = root / source.name
    shutil.copytree(source, target, copy_function=shutil.copy2)
    path = target / "consolidated" / "metadata.json"
    manifest = json.loads(path.read_text())
    manifest["run"] = run
    if isinstance(manifest.get("save"), dict):
        manifest["save"]["run"] = run
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return target


def test_an_earlier_runs_save_published_by_a_later_run_never_holds_latest(each_run, tmp_path, caplog):
    """Run B consolidates run A's global step 6 (a journal entry A left when it was killed): ``LATEST`` moves to it
    in A's order (from A's older output), then B's own global step 2 moves it (a newer run), and a late output of A
    never moves it back. The landed observer compared (fit, global step) only: B's outputs never moved ``LATEST``."""
    found = sorted(p for p in each_run["root"].iterdir() if (p / "consolidated" / "metadata.json").is_file()
                   and not p.is_symlink() and not p.name.endswith("-last"))  # fmt: skip
    step2, step4, step6 = found
    root = tmp_path / "checkpoints"
    root.mkdir()
    a4, a6 = _as_run(step4, root, "20260101T000000Z-aaaaaaaa"), _as_run(step6, root, "20260101T000000Z-aaaaaaaa")
    b2 = _as_run(step2, root, "20260102T000000Z-bbbbbbbb")
    update_latest_pointer(a4)
    settings = SimpleNamespace(output_dirname="consolidated", config=SimpleNamespace(keep=None))
    coordinator = SimpleNamespace(settings=settings, _outputs={}, lock=threading.RLock(), deleting=set(),
                                  run_id="20260102T000000Z-bbbbbbbb")  # fmt: skip
    observer = Observer(coordinator)
    caplog.set_level(logging.DEBUG, logger="nemo_patch.training.retention")

    def published(path: Path, step: int, run: str) -> str:
        save = CheckpointSave(path, step, written=True, consolidated=True, fit=1, run=run)
        save.output = path / "consolidated"
        observer.on_published(save)
        return _latest(root)

    assert published(a6, 6, "20260101T000000Z-aaaaaaaa") == a6.name
    assert published(b2, 2, "20260102T000000Z-bbbbbbbb") == b2.name
    assert published(a4, 4, "20260101T000000Z-aaaaaaaa") == b2.name
    assert compare(step2 / "weights", root / LATEST_NAME / "consolidated") > 0


# -- real fits (slow) ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_stock_runs_in_one_log_dir_each_output_is_its_own_saves(tmp_path):
    """Two stock NeMo fits (the overlay off) into one log directory, the second a new run (resume off, another
    learning rate): NeMo names its checkpoints ``-v1``, ``-last-v1``. The watcher's outputs are each its own
    checkpoint's weights by megatron-core's loader and pass ``nemo-consolidate <ckpt> --verify`` (the landed watcher
    linked the first run's outputs into the second run's checkpoints: exit 9 there); ``LATEST`` names the second
    run's newest output."""
    out = tmp_path / "run"
    first = run_fit_process(out, stock=True, max_steps=4, save_every=2)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    second = run_fit_process(out, stock=True, max_steps=4, save_every=2, new_run=True, lr=3e-3)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    root = out / "tiny_gpt" / "checkpoints"
    finished = list_run_checkpoints(root).finished
    assert any(c.path.name.endswith("-v1") for c in finished) and any(c.copy for c in finished), finished
    watcher = subprocess.run(
        [sys.executable, "-m", "nemo_patch", "--watch", str(root), "--until-idle", "1", "--poll-interval", "0.2",
         "--workers", "1"], capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert watcher.returncode == 0, watcher.stdout + watcher.stderr
    for checkpoint in finished:
        assert compare(checkpoint.path / "weights", checkpoint.path / "consolidated") > 0, checkpoint.path.name
        verify = subprocess.run([sys.executable, "-m", "nemo_patch", str(checkpoint.path), "--verify"],
                                capture_output=True, text=True, cwd=REPO, timeout=600)  # fmt: skip
        assert verify.returncode == 0, (checkpoint.path.name, verify.stderr[-2000:])
    assert _latest(root) in {f"{c.path.name}" for c in finished if c.path.name.endswith(("-v1", "-last-v1"))
                             and c.global_step == 4}, watcher.stdout  # fmt: skip
    assert any(line.startswith("Linked ") and "-last-v1" in line and "-v1's output" in line
               for line in watcher.stdout.splitlines()), watcher.stdout  # fmt: skip


@pytest.mark.slow
def test_a_killed_runs_journal_entry_does_not_hold_latest_against_the_next_run(tmp_path):
    """Run A is SIGKILLed with its consolidation process half-way through its 5th consolidation (``jobkill:5``): the
    journal lists that checkpoint. Run B starts in the same log directory with resume off: it consolidates A's entry
    (in A's order, recorded as A's), and ``LATEST`` ends on B's own newest output (the landed code left it on A's
    global step 5: B's steps 1-3 never moved it)."""
    common = dict(frequency="each", save_every=1, monitor="step", info_logs=True)
    with pytest.raises(pytest.fail.Exception, match=r"rc=-9"):
        run_fit(tmp_path, max_steps=6, wait_for_consolidation=True, fault="jobkill:5", **common)
    root = tmp_path / "tiny_gpt" / "checkpoints"
    journal = json.loads((root / JOURNAL_NAME).read_text())
    [entry] = journal["due"]
    killed_run = entry["run"]
    report = run_fit(tmp_path, max_steps=3, new_run=True, **common)
    assert report["consolidation_errors"] == []
    latest = (root / LATEST_NAME).resolve()
    manifest = json.loads((latest / "consolidated" / "metadata.json").read_text())
    assert manifest["global_step"] == 3 and manifest["run"] != killed_run, (latest.name, manifest)
    assert compare(latest / "weights", latest / "consolidated") > 0
    resumed = root / entry["checkpoint"] / "consolidated" / "metadata.json"
    assert json.loads(resumed.read_text())["run"] == killed_run  # published as A's, not B's
    assert not (root / JOURNAL_NAME).exists()
