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

"""The journal of due consolidations attacked (#38): corrupt, truncated, huge, a FIFO or a link in its place, entries
naming paths outside the root, a journal copied from another root or run, a newer version, a full disk and a SIGKILL
during its write, a SIGKILL while ``LATEST`` is replaced. Each must never fail training, never write outside the root,
log one line, and resume nothing that is not the save its entry names. And the journal is written off the training
thread, within a bounded delay.

No fit: the journal's observer runs against a stand-in coordinator (its lock, queue and settings) and checkpoints that
are directories with the files a save writes last; real processes are SIGKILLed, a real tmpfs fills up.
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List

import pytest
from conftest import REPO

from nemo_patch.training import journal
from nemo_patch.training.journal import JOURNAL_NAME, Observer, read_journal, write_journal
from nemo_patch.training.latest import LATEST_NAME, read_latest_pointer, update_latest_pointer
from nemo_patch.training.schedule import CheckpointSave, RequestState, weights_identity

OLD = time.time() - 3600  # a leftover's age


class _Queue:
    """The coordinator's queue, as the journal sees it: what is outstanding, and what was submitted."""

    def __init__(self) -> None:
        self.submitted: List[CheckpointSave] = []
        self.waiting: List[CheckpointSave] = []

    def outstanding(self) -> List[CheckpointSave]:
        return list(self.waiting)

    def submit_all(self, saves: Any, bounded: bool = True) -> None:
        self.submitted += list(saves)
        self.waiting += list(saves)


def _coordinator(run_id: str = "run-b", fitting: bool = True) -> Any:
    queue = _Queue()
    return SimpleNamespace(
        lock=threading.RLock(),
        _queue=queue,
        queue=queue,
        settings=SimpleNamespace(output_dirname="consolidated"),
        fit=1,
        fitting=fitting,
        run_id=run_id,
    )


def _checkpoint(root: Path, name: str) -> Path:
    """A finished checkpoint, as the journal sees one (the files a save writes last)."""
    weights = root / name / "weights"
    weights.mkdir(parents=True)
    (weights / ".metadata").write_bytes(b"dcp")
    (weights / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return root / name


def _save(path: Path, step: int) -> CheckpointSave:
    save = CheckpointSave(path, step, written=True, fit=1, due=True, state=RequestState.WAITING)
    save.identity = weights_identity(path)
    return save


def _journal_of(root: Path, saves: List[CheckpointSave], run_id: str = "run-a") -> Observer:
    """Write ``root``'s journal listing ``saves`` as a run ``run_id`` does (flushed)."""
    observer = Observer(_coordinator(run_id, fitting=False))
    observer.coordinator._queue.waiting = list(saves)
    observer.on_changed()
    assert (root / JOURNAL_NAME).is_file()
    return observer


def _warnings(caplog: Any) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name == journal.__name__ and r.levelno >= logging.WARNING]


def _resume(root: Path, caplog: Any, run_id: str = "run-b") -> Any:
    caplog.clear()
    coordinator = _coordinator(run_id)
    observer = Observer(coordinator)
    with caplog.at_level(logging.INFO, logger=journal.__name__):
        observer.on_train_start(root)
        assert observer.flush(10)
    return coordinator.queue.submitted


# --- the journal's file attacked --------------------------------------------------------------------------------


def _valid_journal_bytes(tmp_path: Path) -> bytes:
    root = tmp_path / "elsewhere"
    root.mkdir(exist_ok=True)
    write_journal(root, [{"checkpoint": "ckpt-a", "global_step": 3}])
    return (root / JOURNAL_NAME).read_bytes()


ATTACKS = {
    "corrupt": lambda path, tmp: path.write_bytes(b"\x00\xff not json at all"),
    "truncated": lambda path, tmp: path.write_bytes(_valid_journal_bytes(tmp)[:25]),
    "empty": lambda path, tmp: path.write_bytes(b""),
    "huge": lambda path, tmp: os.truncate(path.open("wb").name, 64 << 20),
    "deep": lambda path, tmp: path.write_text('{"version": 1, "due": ' + "[" * 100000 + "]" * 100000 + "}"),
    "fifo": lambda path, tmp: os.mkfifo(path),
    "symlink": lambda path, tmp: os.symlink(tmp / "elsewhere" / JOURNAL_NAME, path),
    "directory": lambda path, tmp: path.mkdir(),
    "newer": lambda path, tmp: path.write_text(json.dumps({"version": 2, "due": [{"checkpoint": "ckpt-a"}]})),
    "no-version": lambda path, tmp: path.write_text(json.dumps({"due": [{"checkpoint": "ckpt-a"}]})),
    "not-a-list": lambda path, tmp: path.write_text(json.dumps({"version": 1, "due": {"checkpoint": "ckpt-a"}})),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_an_unusable_journal_is_one_warning_and_resumes_nothing(tmp_path, caplog, attack):
    """Each: training starts (no exception), one WARNING naming the journal, nothing queued; the journal is then
    replaced by this run's (removed: nothing is due), never written through a link; a directory stays."""
    root = tmp_path / "root"
    _checkpoint(root, "ckpt-a")
    elsewhere = _valid_journal_bytes(tmp_path)
    path = root / JOURNAL_NAME
    ATTACKS[attack](path, tmp_path)
    assert _resume(root, caplog) == []
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(path) in warnings[0] and "Not resuming" in warnings[0], warnings
    assert "\n" not in warnings[0]
    if attack == "newer":
        assert "newer nemo-patch" in warnings[0]
    assert (tmp_path / "elsewhere" / JOURNAL_NAME).read_bytes() == elsewhere  # a link's target is untouched
    if attack == "directory":
        assert path.is_dir() and "keep a journal while it is there)" in warnings[0]  # the message was cut short
    else:
        assert not os.path.lexists(path)
    assert not (root / "ckpt-a" / "consolidated").exists()


def test_entries_naming_paths_outside_the_root_are_refused(tmp_path, caplog):
    """``../``, absolute paths, nested paths, hidden names, ``retained``/pointers, a symlinked checkpoint directory
    (its output would be written where it points), a file, overlong and NUL names, non-objects: one WARNING for all,
    nothing queued, nothing written outside the root. A valid entry beside them is still resumed."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    ok = _checkpoint(root, "ckpt-ok")
    target = _checkpoint(outside, "ckpt-elsewhere")
    os.symlink(target, root / "ckpt-linked")
    (root / "a-file").write_text("x")
    (root / "retained").mkdir()
    names = ["../outside/ckpt-elsewhere", str(target), "sub/ckpt", ".hidden", "retained", "LATEST", "ckpt-linked",
             "a-file", "x" * 300, "nul\0name", "", ".", ".."]  # fmt: skip
    due = [{"checkpoint": name, "global_step": 1} for name in names] + [7, None, ["ckpt-ok"]]
    due.append({"checkpoint": "ckpt-ok", "global_step": 5, "identity": list(weights_identity(ok))})
    (root / JOURNAL_NAME).write_text(json.dumps({"version": 1, "due": due}))
    submitted = _resume(root, caplog)
    assert [save.path for save in submitted] == [ok] and submitted[0].global_step == 5
    warnings = [w for w in _warnings(caplog) if "Not resuming" in w]
    assert len(warnings) == 1 and f"Not resuming {len(names) + 3} entries" in warnings[0], warnings
    assert "\n" not in warnings[0] and "\0" not in warnings[0]
    assert sorted(p.name for p in target.iterdir()) == ["weights"]
    assert sorted(p.name for p in outside.iterdir()) == ["ckpt-elsewhere"]


def test_a_journal_copied_from_another_root_resumes_nothing(tmp_path, caplog):
    """A root copied with its journal (``cp -r``, a sync tool): the same names, other files: not resumed, one line."""
    root = tmp_path / "a"
    save = _save(_checkpoint(root, "ckpt-a"), 4)
    _journal_of(root, [save])
    copy = tmp_path / "b"
    shutil.copytree(root, copy)
    assert _resume(copy, caplog) == []
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "not the save the journal names" in warnings[0], warnings


def test_a_checkpoint_saved_again_since_is_not_resumed(tmp_path, caplog):
    """Another run (or tool) saved into the directory after the journal was written: its entry's step and "best"
    record would label other weights; it is not resumed."""
    root = tmp_path / "root"
    checkpoint = _checkpoint(root, "ckpt-a")
    save = _save(checkpoint, 4)
    save.best = {"monitor": "val_loss", "score": 0.5}
    _journal_of(root, [save])
    (checkpoint / "weights" / ".metadata").unlink()
    (checkpoint / "weights" / ".metadata").write_bytes(b"a new save")
    assert _resume(root, caplog) == []
    assert len(_warnings(caplog)) == 1 and "not the save the journal names" in _warnings(caplog)[0]


def test_another_runs_journal_is_resumed_and_its_run_recorded(tmp_path, caplog):
    """The killed job's journal, resumed by the next run of the root: queued with its step, "best" record and run; the
    log line names the run that saved it; the journal now lists it under that run."""
    root = tmp_path / "root"
    save = _save(_checkpoint(root, "ckpt-a"), 4)
    save.best = {"monitor": "val_loss", "score": 0.5}
    copy = _save(_checkpoint(root, "ckpt-a-last"), 4)
    save.copies = [copy]
    _journal_of(root, [save], run_id="run-a")
    listed = json.loads((root / JOURNAL_NAME).read_text())
    assert listed["run"] == "run-a" and listed["due"][0]["run"] == "run-a"
    submitted = _resume(root, caplog, run_id="run-b")
    assert len(submitted) == 1
    resumed = submitted[0]
    assert (resumed.path, resumed.global_step, resumed.best) == (save.path, 4, save.best)
    assert [c.path for c in resumed.copies] == [copy.path]
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "Consolidating ckpt-a now" in warnings[0] and "run 'run-a'" in warnings[0]
    assert json.loads((root / JOURNAL_NAME).read_text())["due"][0]["checkpoint"] == "ckpt-a"


def test_an_older_journal_without_identities_is_resumed_only_for_files_not_newer_than_it(tmp_path, caplog):
    """A journal of the release before identities were recorded: an entry whose weights are older than the journal is
    resumed, one saved after it is not."""
    root = tmp_path / "root"
    old = _checkpoint(root, "ckpt-old")
    _checkpoint(root, "ckpt-new")
    for name in (".metadata", "metadata.json"):
        os.utime(old / "weights" / name, (OLD, OLD))
    due = [{"checkpoint": "ckpt-old", "global_step": 2}, {"checkpoint": "ckpt-new", "global_step": 4}]
    (root / JOURNAL_NAME).write_text(json.dumps({"version": 1, "due": due}))
    os.utime(root / JOURNAL_NAME, (OLD + 10, OLD + 10))
    assert [save.path for save in _resume(root, caplog)] == [old]
    assert any("ckpt-new" in w and "not the save" in w for w in _warnings(caplog))


# --- writing it -------------------------------------------------------------------------------------------------


def test_the_journal_is_written_off_the_training_thread_latest_state_wins(tmp_path, monkeypatch):
    """While ``fit`` runs, ``on_changed`` stores the state and returns; the writer thread (not this one) writes the
    newest state within a bounded delay (states handed over meanwhile collapse); when the coordinator closes,
    ``on_changed`` returns once it is on disk."""
    root = tmp_path / "root"
    saves = [_save(_checkpoint(root, f"ckpt-{i}"), i) for i in range(5)]
    threads, real_write = [], journal.write_journal

    def recording_write(*args: Any) -> None:
        threads.append(threading.current_thread())
        time.sleep(0.05)  # a slow disk: states handed meanwhile collapse into one write
        real_write(*args)

    monkeypatch.setattr(journal, "write_journal", recording_write)
    coordinator = _coordinator()
    observer = Observer(coordinator)
    for i in range(5):
        coordinator._queue.waiting = saves[: i + 1]
        start = time.perf_counter()
        observer.on_changed()
        assert time.perf_counter() - start < 0.04  # never waits for the write
    deadline = time.monotonic() + 2.0  # journal.WRITE_INTERVAL plus a write, with a loaded CI host's slack
    while time.monotonic() < deadline:
        if (root / JOURNAL_NAME).is_file() and len(json.loads((root / JOURNAL_NAME).read_text())["due"]) == 5:
            break
        time.sleep(0.01)
    assert len(json.loads((root / JOURNAL_NAME).read_text())["due"]) == 5
    assert threads and threading.main_thread() not in threads and len(threads) < 5
    coordinator._queue.waiting, coordinator.fitting = [], False
    observer.on_changed()  # closed: returns once the journal is gone
    assert not os.path.lexists(root / JOURNAL_NAME)


def test_a_link_planted_at_the_journal_is_replaced_never_written_through(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside.json"
    root.mkdir()
    outside.write_text("precious")
    os.symlink(outside, root / JOURNAL_NAME)
    write_journal(root, [{"checkpoint": "ckpt-a", "global_step": 1}])
    assert outside.read_text() == "precious"
    assert not (root / JOURNAL_NAME).is_symlink() and read_journal(root)[0] == [{"checkpoint": "ckpt-a",
                                                                                 "global_step": 1}]  # fmt: skip
    os.unlink(root / JOURNAL_NAME)
    os.symlink(outside, root / JOURNAL_NAME)
    write_journal(root, [])  # nothing due: the link goes, its target stays
    assert outside.read_text() == "precious" and not os.path.lexists(root / JOURNAL_NAME)


def test_a_journal_that_cannot_be_written_is_one_warning_and_retried(tmp_path, caplog):
    """A directory in the journal's place: one WARNING, training goes on; once it is gone, the next change writes the
    journal (one INFO line)."""
    root = tmp_path / "root"
    saves = [_save(_checkpoint(root, f"ckpt-{i}"), i) for i in range(3)]
    (root / JOURNAL_NAME).mkdir()
    coordinator = _coordinator(fitting=False)
    observer = Observer(coordinator)
    with caplog.at_level(logging.INFO, logger=journal.__name__):
        for i in range(2):
            coordinator._queue.waiting = saves[: i + 1]
            observer.on_changed()
        assert len(_warnings(caplog)) == 1 and "Could not write the consolidation journal" in _warnings(caplog)[0]
        (root / JOURNAL_NAME).rmdir()
        observer.on_changed()  # nothing changed, but the failed state is retried
    assert len(json.loads((root / JOURNAL_NAME).read_text())["due"]) == 2
    assert "is written again" in caplog.text
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == [JOURNAL_NAME]


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here (CI runs as root and may)")


def test_a_full_disk_during_the_journal_write_keeps_the_previous_journal(tmp_path, caplog):
    """A real full file system (a 64 KiB tmpfs filled up): the write fails with ENOSPC, one WARNING, no temporary file
    is left, the previous journal is whole; once there is room, the next change writes it."""
    root = tmp_path / "small"
    _mount_tmpfs(root, "64k")
    try:
        saves = [_save(_checkpoint(root, f"ckpt-{i}"), i) for i in range(2)]
        coordinator = _coordinator(fitting=False)
        observer = Observer(coordinator)
        coordinator._queue.waiting = saves[:1]
        observer.on_changed()
        before = (root / JOURNAL_NAME).read_bytes()
        filler = root / "filler"
        with pytest.raises(OSError), filler.open("wb") as file:
            while True:
                file.write(b"\0" * 4096)
                file.flush()
        coordinator._queue.waiting = saves
        with caplog.at_level(logging.INFO, logger=journal.__name__):
            observer.on_changed()
            warnings = _warnings(caplog)
            assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
            assert (root / JOURNAL_NAME).read_bytes() == before
            assert not [p for p in root.iterdir() if ".tmp-" in p.name]
            filler.unlink()
            observer.on_changed()
        assert len(json.loads((root / JOURNAL_NAME).read_text())["due"]) == 2
    finally:
        subprocess.run(["umount", str(root)], check=False)


# --- SIGKILL at chosen points -------------------------------------------------------------------------------------

KILLED_WRITER = r"""
import os, signal, sys
from pathlib import Path
from nemo_patch.training import journal

root, where = Path(sys.argv[1]), sys.argv[2]
journal.write_journal(root, [{"checkpoint": "ckpt-0", "global_step": 0}])
if where == "mid-write":
    real_write = os.write
    def write(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        os.kill(os.getpid(), signal.SIGKILL)
    journal.os.write = write
else:
    journal.os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
journal.write_journal(root, [{"checkpoint": "ckpt-0", "global_step": 0}, {"checkpoint": "ckpt-1", "global_step": 1}])
"""


@pytest.mark.parametrize("where", ["mid-write", "before-rename"])
def test_a_sigkill_during_the_journal_write_leaves_the_previous_journal(tmp_path, caplog, where):
    """The job is SIGKILLed half-way through writing the journal's new state, or just before the rename: the journal
    is the previous state, whole; the next run resumes it and removes the temporary file left behind."""
    root = tmp_path / "root"
    checkpoint = _checkpoint(root, "ckpt-0")
    _checkpoint(root, "ckpt-1")
    for name in (".metadata", "metadata.json"):
        os.utime(checkpoint / "weights" / name, (OLD, OLD))
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(root), where], cwd=REPO)
    assert proc.returncode == -signal.SIGKILL
    assert json.loads((root / JOURNAL_NAME).read_text())["due"] == [{"checkpoint": "ckpt-0", "global_step": 0}]
    leftovers = [p for p in root.iterdir() if p.name.startswith(f"{JOURNAL_NAME}.tmp-")]
    assert len(leftovers) == 1
    os.utime(leftovers[0], (OLD, OLD))
    assert [save.path for save in _resume(root, caplog)] == [checkpoint]
    assert not leftovers[0].exists()


KILLED_POINTER = r"""
import os, signal, sys
from nemo_patch.training import latest

latest.os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
latest.update_latest_pointer(sys.argv[1])
"""


def test_a_sigkill_while_latest_is_replaced_leaves_the_previous_latest(tmp_path, caplog):
    """Killed between making the new link and renaming it over ``LATEST``: ``LATEST`` still names the complete output
    it named; the next run removes the stray temporary link."""
    root = tmp_path / "root"
    old, new = _checkpoint(root, "ckpt-old"), _checkpoint(root, "ckpt-new")
    update_latest_pointer(old)
    proc = subprocess.run([sys.executable, "-c", KILLED_POINTER, str(new)], cwd=REPO)
    assert proc.returncode == -signal.SIGKILL
    assert read_latest_pointer(root) == old.resolve()
    strays = [p for p in root.iterdir() if p.name.startswith(f".{LATEST_NAME}.tmp-")]
    assert len(strays) == 1 and strays[0].is_symlink()
    os.utime(strays[0], (OLD, OLD), follow_symlinks=False)
    assert _resume(root, caplog) == []
    assert not os.path.lexists(strays[0]) and read_latest_pointer(root) == old.resolve()
    assert new.is_dir()  # the link's target is untouched


def test_a_forged_run_id_is_not_taken(tmp_path, caplog):
    """An entry's run that could forge a log line (or ``metadata.json``'s ``"run"``) is replaced by the journal's."""
    root = tmp_path / "root"
    save = _save(_checkpoint(root, "ckpt-a"), 4)
    _journal_of(root, [save], run_id="run-a")
    listed = json.loads((root / JOURNAL_NAME).read_text())
    listed["due"][0]["run"] = "x\n[NeMo E 2026-12-02 12:00:00] forged"
    (root / JOURNAL_NAME).write_text(json.dumps(listed))
    submitted = _resume(root, caplog)
    assert len(submitted) == 1 and getattr(submitted[0], "run", "run-a") == "run-a"
    assert "[NeMo E" not in caplog.text and "run 'run-a'" in caplog.text
