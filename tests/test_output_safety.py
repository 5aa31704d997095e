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

"""Nothing of the user's is lost: where an output may go and what ``--force`` replaces, which temporary output is
stale (its lock, not a process id), and an overwrite that leaves an output under its name at every moment."""

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.engine import publish
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.errors import OutputExistsError
from nemo_patch.engine.output_target import check_output_target, is_replaceable_output
from nemo_patch.engine.publish import (
    LOCKLESS_STALE_SECONDS,
    TMP_LOCK_NAME,
    TMP_PREFIX,
    make_tmp_dir,
    publish_dir,
    remove_stale_tmp_dirs,
)

# --- where an output may go, and what --force replaces ---------------------------------------------------------------


def _tree(path: Path) -> dict:
    """Every entry under ``path`` (symbolic links not followed) -> its kind and content digest."""
    entries = {}
    for directory, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            entry = Path(directory) / name
            key = str(entry.relative_to(path))
            if entry.is_symlink():
                entries[key] = ("link", os.readlink(entry))
            elif entry.is_dir():
                entries[key] = ("dir",)
            else:
                entries[key] = ("file", hashlib.sha256(entry.read_bytes()).hexdigest(), entry.stat().st_ino)
    return entries


@pytest.fixture()
def run_dir(checkpoint_copy, tmp_path) -> Path:
    """``tmp_path/run/checkpoints/<ckpt>`` (a real finished checkpoint), plus a user's directory, file and links."""
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    shutil.move(checkpoint_copy, root / "m--step=5-consumed_samples=12.0")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    (tmp_path / "report.txt").write_text("my report")
    (tmp_path / "alias").symlink_to(root / "m--step=5-consumed_samples=12.0")
    (tmp_path / "link-to-mine").symlink_to(tmp_path / "mine")
    return root / "m--step=5-consumed_samples=12.0"


REFUSED = {
    "the checkpoint": ("{ckpt}", "it is the checkpoint itself"),
    "weights/": ("{ckpt}/weights", "inside the checkpoint's weights/"),
    "context/": ("{ckpt}/context", "inside the checkpoint's context/"),
    "a file in weights/": ("{ckpt}/weights/.metadata", "inside the checkpoint's weights/"),
    "a new directory in weights/": ("{ckpt}/weights/new", "inside the checkpoint's weights/"),
    "the root": ("{root}", "a directory holding the checkpoint"),
    "the run directory above the root": ("{root}/..", "a directory holding the checkpoint"),
    "a symbolic link to the checkpoint": ("{tmp}/alias", "it is the checkpoint itself"),
    "weights/ through a symbolic link": ("{tmp}/alias/weights", "inside the checkpoint's weights/"),
    "a user's non-empty directory": ("{tmp}/mine", "not a consolidated output (it holds notes.txt)"),
    "a user's file": ("{tmp}/report.txt", "it is a file"),
    "a symbolic link of the user's": ("{tmp}/link-to-mine", "it is a symbolic link to"),
}


@pytest.mark.parametrize("target", list(REFUSED))
def test_a_refused_output_exits_7_and_changes_nothing(run_dir, tmp_path, capsys, target):
    pattern, reason = REFUSED[target]
    out = pattern.format(ckpt=run_dir, root=run_dir.parent, tmp=tmp_path)
    before = _tree(tmp_path)
    for path in (run_dir, run_dir.parent):  # given the checkpoint, or its root (LATEST, else the newest)
        code = main([str(path), "--out", out, "--force"])
        captured = capsys.readouterr()
        assert code == 7, captured.err
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
        assert captured.err.startswith("nemo-consolidate: error: ") and reason in captured.err, captured.err
        assert _tree(tmp_path) == before


def test_a_refused_output_names_the_resolved_path(run_dir, tmp_path, capsys):
    assert main([str(run_dir), "--out", str(tmp_path / "alias"), "--force", "--format", "hf"]) == 7
    err = capsys.readouterr().err
    assert f"{tmp_path / 'alias'} (resolved: {run_dir.resolve()})" in err, err


def test_the_api_and_the_hf_export_refuse_before_reading(run_dir, tmp_path):
    from nemo_patch.export.hf import export_hf_checkpoint

    before = _tree(tmp_path)
    for target in (run_dir, run_dir / "weights", run_dir.parent, tmp_path / "mine"):
        for function in (consolidate_checkpoint, export_hf_checkpoint):
            with pytest.raises(OutputExistsError):
                function(run_dir, target, overwrite=True)
    assert _tree(tmp_path) == before


def test_force_replaces_a_previous_output_and_an_empty_directory(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(run_dir), "--out", str(out), "--quiet"]) == 0
    first = (out / "model.safetensors").stat().st_ino
    assert main([str(run_dir), "--out", str(out), "--quiet"]) == 7
    assert "exists (overwrite it with --force)" in capsys.readouterr().err
    assert main([str(run_dir), "--out", str(out), "--quiet", "--force"]) == 0
    assert (out / "model.safetensors").stat().st_ino != first
    assert sorted(p.name for p in out.iterdir()) == ["metadata.json", "model.safetensors"]  # no lock file
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(run_dir), "--out", str(empty), "--quiet"]) == 7  # without --force, nothing existing is replaced
    assert main([str(run_dir), "--out", str(empty), "--quiet", "--force"]) == 0
    assert (empty / "model.safetensors").is_file()
    assert main([str(run_dir), "--quiet", "--force"]) == 0  # the default, <ckpt>/consolidated
    assert sorted(p.name for p in run_dir.iterdir()) == ["consolidated", "context", "weights"]
    capsys.readouterr()


def test_a_bare_dcp_directory_gets_its_default_output(run_dir, tmp_path, capsys):
    dcp = tmp_path / "dcp"
    shutil.copytree(run_dir / "weights", dcp)
    assert main([str(dcp), "--quiet"]) == 0
    assert (dcp / "consolidated" / "model.safetensors").is_file()
    assert main([str(dcp), "--quiet", "--force", "--out", str(dcp)]) == 7
    capsys.readouterr()


def test_replaceable_outputs(tmp_path):
    hf = tmp_path / "hf"  # what the Hugging Face export writes: its metadata.json records format_version too
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "metadata.json").write_text(json.dumps({"format_version": 2, "format": "hf"}))
    assert is_replaceable_output(hf) and is_replaceable_output(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert is_replaceable_output(tmp_path / "empty")
    other = tmp_path / "other"  # a metadata.json of something else
    other.mkdir()
    (other / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    assert not is_replaceable_output(other)
    (hf / "weights").mkdir()  # a checkpoint directory that happens to hold such a file
    assert not is_replaceable_output(hf)
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    assert not is_replaceable_output(tmp_path / "link")
    with pytest.raises(OutputExistsError, match="symbolic link"):
        check_output_target(tmp_path / "ckpt", tmp_path / "link", overwrite=True)


# --- liveness: a temporary directory is stale when nobody holds its lock ---------------------------------------------


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)


def _tmp_entry(parent: Path, pid: int, lock: bool = True, age: float = 0.0) -> Path:
    path = parent / f"{TMP_PREFIX}{pid}-0123456789ab@{os.uname().nodename}"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"half")
    if lock:
        (path / TMP_LOCK_NAME).touch()
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_held_lock_is_never_removed_whatever_the_name_says(tmp_path):
    live = _tmp_entry(tmp_path, _dead_pid(), age=LOCKLESS_STALE_SECONDS * 10)  # a pid that looks dead, and old
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(live / TMP_LOCK_NAME)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        assert remove_stale_tmp_dirs(tmp_path) == [] and (live / "model.safetensors").is_file()
    finally:
        holder.communicate(b"\n", timeout=60)
    assert remove_stale_tmp_dirs(tmp_path) == [live] and not live.exists()


def test_a_lock_held_in_this_process_protects_an_entry_named_for_another(tmp_path):
    live = _tmp_entry(tmp_path, _dead_pid())
    fd = os.open(live / TMP_LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert remove_stale_tmp_dirs(tmp_path) == [] and live.is_dir()
    finally:
        os.close(fd)
    assert remove_stale_tmp_dirs(tmp_path) == [live]


def test_an_unheld_lock_is_stale_even_if_the_pid_runs(tmp_path):
    stale = _tmp_entry(tmp_path, os.getppid())  # a process that runs (e.g. after a restart in another PID namespace)
    assert remove_stale_tmp_dirs(tmp_path) == [stale] and not stale.exists()


def test_an_entry_without_a_lock_file_is_stale_only_when_old_and_its_process_gone(tmp_path):
    fresh = _tmp_entry(tmp_path, _dead_pid(), lock=False)
    live_pid = _tmp_entry(tmp_path, os.getppid(), lock=False, age=LOCKLESS_STALE_SECONDS + 60)
    assert remove_stale_tmp_dirs(tmp_path) == [] and fresh.is_dir() and live_pid.is_dir()
    os.utime(fresh, (time.time() - LOCKLESS_STALE_SECONDS - 60,) * 2)
    assert remove_stale_tmp_dirs(tmp_path) == [fresh] and live_pid.is_dir()


_LIVE_RUN = """
import os, sys
from pathlib import Path
from nemo_patch.engine.publish import make_tmp_dir
path = make_tmp_dir(Path(sys.argv[1]))
(path / "model.safetensors").write_bytes(b"half")
print(path, flush=True)
sys.stdin.readline()
os._exit(0)  # as if killed: nothing cleans up
"""


def test_a_live_consolidation_in_another_pid_namespace_keeps_its_output(tmp_path):
    """The process that made the temporary directory holds its lock; renaming the directory to a dead process's id
    (what another PID namespace looks like from here) changes nothing."""
    run = subprocess.Popen(
        [sys.executable, "-c", _LIVE_RUN, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO
    )
    try:
        made = Path(run.stdout.readline().decode().strip())
        assert (made / TMP_LOCK_NAME).is_file()
        live = made.with_name(made.name.replace(f"-{run.pid}-", f"-{_dead_pid()}-"))
        made.rename(live)
        assert remove_stale_tmp_dirs(tmp_path) == [] and (live / "model.safetensors").read_bytes() == b"half"
    finally:
        run.communicate(b"\n", timeout=60)
    assert remove_stale_tmp_dirs(tmp_path) == [live]  # its process ended without publishing: stale now


def test_own_temporary_directories_hold_their_lock_until_published(tmp_path):
    tmp = make_tmp_dir(tmp_path)
    probe = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)"
    )
    held = subprocess.run([sys.executable, "-c", probe, str(tmp / TMP_LOCK_NAME)], capture_output=True, text=True)
    assert held.returncode != 0 and "BlockingIOError" in held.stderr
    (tmp / "metadata.json").write_text(json.dumps({"format_version": 2}))
    publish_dir(tmp, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["metadata.json"] and str(tmp) not in publish._held


# --- an overwrite leaves an output under the name at every moment ----------------------------------------------------


def _staged(parent: Path, generation: int) -> Path:
    tmp = make_tmp_dir(parent)
    (tmp / "metadata.json").write_text(json.dumps({"format_version": 2, "generation": generation}))
    return tmp


def _generation(output: Path) -> int:
    return json.loads((output / "metadata.json").read_text())["generation"]


def test_replacement_exchanges_the_names_atomically(tmp_path, monkeypatch):
    if publish._libc_renameat2() is None:
        pytest.skip("this libc has no renameat2")
    output = tmp_path / "consolidated"
    publish_dir(_staged(tmp_path, 0), output)
    exchanged = []
    real = publish._libc_renameat2()

    def renameat2(*args):
        before = _generation(output)
        result = real(*args)
        exchanged.append((before, _generation(output)))  # an output under the name before and after the one step
        return result

    monkeypatch.setattr(publish, "_libc_renameat2", lambda: renameat2)
    monkeypatch.setattr(os, "replace", lambda *args: pytest.fail("moved aside instead of exchanged"))
    publish_dir(_staged(tmp_path, 1), output)
    if not exchanged or exchanged[-1] != (0, 1):
        pytest.fail(f"renameat2 did not exchange the names: {exchanged}")
    monkeypatch.undo()

    missing, stop = [], threading.Event()

    def read() -> None:
        while not stop.is_set():
            if not output.is_dir():  # (a file in it may vanish under a reader that entered the old one just before)
                missing.append(time.monotonic())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for generation in range(2, 200):
            publish_dir(_staged(tmp_path, generation), output)
    finally:
        stop.set()
        reader.join()
    assert missing == [] and _generation(output) == 199
    assert sorted(os.listdir(tmp_path)) == ["consolidated"]


def _fake_renameat2(code: int):
    def renameat2(*args):
        ctypes.set_errno(code)
        return -1

    return renameat2


@pytest.mark.parametrize("unavailable", ["no symbol", "EINVAL", "ENOSYS"])
def test_replacement_falls_back_to_moving_aside(tmp_path, monkeypatch, unavailable):
    function = None if unavailable == "no symbol" else _fake_renameat2(getattr(errno, unavailable))
    monkeypatch.setattr(publish, "_libc_renameat2", lambda: function)
    output = tmp_path / "consolidated"
    publish_dir(_staged(tmp_path, 0), output)
    steps, replace = [], os.replace

    def recording_replace(source, target):
        replace(source, target)
        steps.append(output.is_dir())

    monkeypatch.setattr(os, "replace", recording_replace)
    publish_dir(_staged(tmp_path, 1), output)
    assert steps == [False, True]  # the documented moment: moved aside, then the new one renamed into place
    assert _generation(output) == 1 and sorted(os.listdir(tmp_path)) == ["consolidated"]


def test_a_failed_fallback_puts_the_previous_output_back(tmp_path, monkeypatch):
    monkeypatch.setattr(publish, "_libc_renameat2", lambda: None)
    output = tmp_path / "consolidated"
    publish_dir(_staged(tmp_path, 0), output)
    replace, calls = os.replace, []

    def failing_second_replace(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise OSError(errno.EIO, "disk on fire")
        replace(source, target)

    monkeypatch.setattr(os, "replace", failing_second_replace)
    staged = _staged(tmp_path, 1)
    with pytest.raises(OSError, match="disk on fire"):
        publish_dir(staged, output)
    assert _generation(output) == 0
    publish.remove_tmp_dir(staged)  # what staged_output does on failure
    assert sorted(os.listdir(tmp_path)) == ["consolidated"]


def test_publishing_refuses_to_replace_what_is_not_an_output(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    staged = _staged(tmp_path, 0)
    with pytest.raises(FileExistsError, match="only a previous output or an empty directory is replaced"):
        publish_dir(staged, mine)
    assert (mine / "notes.txt").read_text() == "mine"
    publish.remove_tmp_dir(staged)
