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

"""``nemo-consolidate --watch`` attacked: planted links, FIFOs and files where the watcher writes or reads, odd names,
checkpoints saved again or removed while read, unreadable roots, a root of thousands of checkpoints, signals.

Each attack runs against real NeMo-layout checkpoints megatron-core saved (one, saved once for the module, copied or
hard-linked into each test's root). The promises checked (docs/sidecar.md): nothing outside the outputs, the hidden
staging entries in ``ROOT`` and ``ROOT/LATEST`` is changed; a failure is one log line and the watcher goes on; the
exit code is a documented one."""

import importlib.util
import io
import os
import shutil
import signal
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from safetensors.torch import load_file

import nemo_patch.engine.publish as publish
from nemo_patch.cli.watch import Watcher, output_is_complete
from nemo_patch.engine import digests
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.errors import ConsolidationError
from nemo_patch.runs.run_checkpoints import TRACKER_FILENAME, list_run_checkpoints, read_tracker
from nemo_patch.training.policy import parse_consolidation_frequency

REPO = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("lightning_checkpoints", REPO / "tests/nemo/lightning/conftest.py")
_CHECKPOINTS = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_CHECKPOINTS)
save_checkpoint = _CHECKPOINTS.save_checkpoint

STEP3 = "model--step=3-consumed_samples=8.0"
STEP5 = "model--step=5-consumed_samples=12.0"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Dict[str, object]:
    """Two saves megatron-core made (other weights, other ``.metadata``), outside any root, with their tensors."""
    where = tmp_path_factory.mktemp("saves")
    first, second = where / "first", where / "second"
    return {"first": first, "second": second, "tensors": save_checkpoint(first),
            "tensors2": save_checkpoint(second, scale=2.0)}  # fmt: skip


def copy_into(save: Path, target: Path, link: bool = False) -> Path:
    shutil.copytree(save, target, copy_function=os.link if link else shutil.copy2)
    return target


def make_root(saved, root: Path, names: List[str], link: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        copy_into(saved["first"], root / name, link)
    return root


def make_watcher(root: Path, frequency: str = "each", consolidate=None, **kwargs) -> Watcher:
    def default(checkpoint, output, staging, before_publish):
        result = consolidate_checkpoint(checkpoint.path, output, global_step=checkpoint.global_step, workers=1,
                                        staging_dir=staging, before_publish=before_publish, **kwargs)  # fmt: skip
        return result.tensor_count, result.total_bytes

    return Watcher(root, parse_consolidation_frequency(frequency), consolidate or default, until_idle=0.2,
                   poll_interval=0.05, out=io.StringIO())  # fmt: skip


def log_of(watcher: Watcher) -> List[str]:
    return watcher.out.getvalue().splitlines()


def snapshot(top: Path, skip=("consolidated", "hf", "LATEST")) -> Dict[str, object]:
    """Every entry under ``top`` (not following links) with what it is, its size and mtime; outputs left out."""
    found = {}
    for directory, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in dirs + [f for f in files if f not in skip]:
            path = Path(directory) / name
            info = os.lstat(path)
            found[str(path.relative_to(top))] = (info.st_mode, info.st_size if not path.is_dir() else 0,
                                                 info.st_mtime_ns if not path.is_dir() else 0)  # fmt: skip
    return found


def assert_matches(output: Path, tensors: Dict[str, torch.Tensor]) -> None:
    written = load_file(output / "model.safetensors")
    assert sorted(written) == sorted(tensors)
    assert all(torch.equal(written[name], tensor) for name, tensor in tensors.items())


# -- names and log lines ------------------------------------------------------------------------------------------


def test_a_checkpoint_name_with_a_newline_cannot_forge_log_lines(saved, tmp_path):
    name = "model--step=3-x\nConsolidated forged (step 99) -> elsewhere: 1 tensors"
    root = make_root(saved, tmp_path / "checkpoints", [name])
    watcher = make_watcher(root)
    assert watcher.run() == 0
    lines = log_of(watcher)
    assert (root / name / "consolidated" / "metadata.json").is_file()
    assert not [line for line in lines if line.startswith("Consolidated forged")], lines
    assert len([line for line in lines if line.startswith("Consolidated ")]) == 1, lines
    assert os.readlink(root / "LATEST") == name


def test_an_error_message_of_several_lines_is_one_log_line(saved, tmp_path):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3])

    def fail(checkpoint, output, staging, before_publish):
        raise ConsolidationError("first line\nsecond line")

    watcher = make_watcher(root, consolidate=fail)
    assert watcher.run() == 1
    errors = [line for line in log_of(watcher) if "first line" in line or "second line" in line]
    assert len(errors) == 1 and "second line" in errors[0], log_of(watcher)


def test_an_unexpected_exception_is_one_line_exit_1_and_the_watcher_goes_on(saved, tmp_path):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3, STEP5])
    calls = []

    def flaky(checkpoint, output, staging, before_publish):
        calls.append(checkpoint.path.name)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")  # a raw ENOSPC from an export, not wrapped
        return make_watcher(root).consolidate(checkpoint, output, staging, before_publish)

    watcher = make_watcher(root, consolidate=flaky)
    assert watcher.run() == 1
    lines = log_of(watcher)
    assert len([line for line in lines if "No space left on device" in line]) == 1, lines
    assert (root / STEP5 / "consolidated").is_dir() and not (root / STEP3 / "consolidated").exists()
    assert "1 consolidated" in lines[-1] and "1 failed" in lines[-1]


# -- planted entries where the watcher writes -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["link-to-complete-output", "link-to-empty-dir", "fifo", "file"])
def test_a_planted_entry_at_the_output_is_neither_followed_nor_replaced(saved, tmp_path, kind):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3, STEP5])
    outside = tmp_path / "outside"
    outside.mkdir()
    output = root / STEP3 / "consolidated"
    if kind == "link-to-complete-output":  # a complete output of this very save, elsewhere
        elsewhere = make_root(saved, tmp_path / "elsewhere", [STEP3])
        assert make_watcher(elsewhere).run() == 0
        shutil.copytree(elsewhere / STEP3 / "consolidated", outside / "out")
        output.symlink_to(outside / "out")
    elif kind == "link-to-empty-dir":
        (outside / "out").mkdir()
        output.symlink_to(outside / "out")
    elif kind == "fifo":
        os.mkfifo(output)
    else:
        output.write_text("mine")
    before = snapshot(outside)
    watcher = make_watcher(root)
    code = watcher.run()
    lines = log_of(watcher)
    assert code == 7, lines  # OutputExistsError
    assert len([line for line in lines if line.startswith(f"error: {STEP3}")]) == 1, lines
    assert snapshot(outside) == before and os.listdir(outside / "out" if kind.startswith("link") else outside) == (
        os.listdir(outside / "out") if kind.startswith("link") else []
    )
    assert os.path.lexists(output) and (output.is_symlink() or kind in ("fifo", "file"))
    assert (root / STEP5 / "consolidated" / "metadata.json").is_file(), "the watcher goes on"
    assert os.readlink(root / "LATEST") == STEP5
    assert not [p for p in root.iterdir() if p.name.startswith(".consolidated")]


@pytest.mark.parametrize("kind", ["directory", "file", "dangling", "outside", "fifo"])
def test_a_planted_latest_is_replaced_by_the_link_and_nothing_it_names_changes(saved, tmp_path, kind):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    latest = root / "LATEST"
    if kind == "directory":
        latest.mkdir()
        (latest / "precious").write_text("keep")
    elif kind == "file":
        latest.write_text("keep")
    elif kind == "dangling":
        latest.symlink_to(tmp_path / "nothing")
    elif kind == "outside":
        latest.symlink_to(outside)
    else:
        os.mkfifo(latest)
    watcher = make_watcher(root)
    assert watcher.run() == 0, log_of(watcher)
    assert os.readlink(latest) == STEP3
    assert (outside / "precious").read_text() == "keep" and os.listdir(outside) == ["precious"]
    aside = [p for p in root.iterdir() if p.name.startswith(".LATEST.replaced-")]
    assert len(aside) == (1 if kind in ("directory", "file", "fifo") else 0)
    if kind == "directory":
        assert (aside[0] / "precious").read_text() == "keep"


def test_a_planted_staging_link_in_the_root_is_never_followed(saved, tmp_path):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    # names the watcher's own cleanup looks at: a dead process's on this host, a live one's, and a lock-file trap
    for pid in (2**22 + 7, os.getpid(), 1):
        (root / f"{publish.TMP_PREFIX}{pid}-0123456789ab@{publish._host()}").symlink_to(outside)
    old = root / f"{publish.TMP_PREFIX}{2**22 + 9}-0123456789ab@{publish._host()}"
    old.mkdir()
    (old / publish.TMP_LOCK_NAME).symlink_to(outside / "precious")
    watcher = make_watcher(root)
    assert watcher.run() == 0, log_of(watcher)
    assert os.listdir(outside) == ["precious"] and (outside / "precious").read_text() == "keep"
    assert (root / STEP3 / "consolidated" / "metadata.json").is_file()


# -- symlinked roots and checkpoints ----------------------------------------------------------------------------------


def test_a_symlinked_checkpoint_is_not_consolidated_and_its_target_is_untouched(saved, tmp_path):
    elsewhere = make_root(saved, tmp_path / "elsewhere", [STEP3])
    root = tmp_path / "checkpoints"
    root.mkdir()
    copy_into(saved["first"], root / STEP5)
    (root / STEP3).symlink_to(elsewhere / STEP3)
    before = snapshot(elsewhere, skip=())
    watcher = make_watcher(root)
    assert watcher.run() == 0
    assert snapshot(elsewhere, skip=()) == before
    assert (root / STEP5 / "consolidated").is_dir()


def test_a_symlinked_root_writes_only_in_its_target(saved, tmp_path):
    real = make_root(saved, tmp_path / "real", [STEP3])
    (tmp_path / "link").symlink_to(real)
    watcher = make_watcher(tmp_path / "link")
    assert watcher.run() == 0
    assert (real / STEP3 / "consolidated").is_dir() and os.readlink(real / "LATEST") == STEP3
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


# -- the -last copy's linked output -----------------------------------------------------------------------------------


def test_a_last_copy_is_linked_through_the_root_not_inside_the_checkpoint(saved, tmp_path, monkeypatch):
    names = [STEP3, f"{STEP3}-last"]
    root = make_root(saved, tmp_path / "checkpoints", names)
    made = []
    real = publish.make_tmp_dir
    monkeypatch.setattr(
        publish, "make_tmp_dir", lambda parent, kind="": made.append(Path(parent)) or real(parent, kind)
    )
    watcher = make_watcher(root)
    assert watcher.run() == 0, log_of(watcher)
    assert (root / names[1] / "consolidated" / "metadata.json").is_file()
    assert made and all(parent == root for parent in made), made


def test_a_last_copy_marked_unfinished_before_its_link_is_published_gets_none(saved, tmp_path, monkeypatch):
    names = [STEP3, f"{STEP3}-last"]
    root = make_root(saved, tmp_path / "checkpoints", names)
    real = os.link

    def mark_then_link(source, target, *args, **kwargs):  # NeMo marks the copy before it removes it
        (root / f"{names[1]}-unfinished").touch()
        return real(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "link", mark_then_link)
    watcher = make_watcher(root)
    assert watcher.run() == 0, log_of(watcher)
    assert not os.path.lexists(root / names[1] / "consolidated"), log_of(watcher)
    assert not [p for p in (root / names[1]).iterdir() if p.name.startswith(".")]


# -- checkpoints changing under the watcher ---------------------------------------------------------------------------


def test_a_checkpoint_saved_again_while_read_publishes_nothing_then_the_new_save(saved, tmp_path):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3])
    swapped = []

    def save_again(done, total):  # a rollback saves other weights under the same name while the old ones are read
        if not swapped:
            swapped.append(True)
            shutil.rmtree(root / STEP3 / "weights")
            shutil.copytree(saved["second"] / "weights", root / STEP3 / "weights")

    watcher = make_watcher(root, progress=save_again)
    assert watcher.run() == 0
    lines = log_of(watcher)
    assert len([line for line in lines if line.startswith("Consolidated")]) == 1, lines
    assert any("saved again while it was consolidated" in line for line in lines), lines
    assert output_is_complete(root / STEP3, root / STEP3 / "consolidated")
    assert_matches(root / STEP3 / "consolidated", saved["tensors2"])


def test_a_checkpoint_removed_before_its_lock_publishes_nothing(saved, tmp_path, monkeypatch):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3, STEP5])
    import nemo_patch.cli.watch as watch_module

    real = watch_module._held

    def held_after_removal(path):
        if path.name == STEP3 and path.exists():
            (root / f"{STEP3}-unfinished").touch()
            shutil.rmtree(path)
        return real(path)

    monkeypatch.setattr(watch_module, "_held", held_after_removal)
    watcher = make_watcher(root)
    assert watcher.run() == 0, log_of(watcher)
    assert not (root / STEP3).exists(), "never re-created"
    assert (root / STEP5 / "consolidated").is_dir() and "1 removed" in log_of(watcher)[-1]
    assert not [p for p in root.iterdir() if p.name.startswith(".consolidated")]


# -- the root ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("errno_", [13, 116, 5])  # EACCES, ESTALE, EIO
def test_a_root_that_cannot_be_listed_is_one_line_and_the_watcher_goes_on(saved, tmp_path, monkeypatch, errno_):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3])
    real, failures = os.scandir, [0]

    def scandir(path="."):
        if Path(path) == root and failures[0] < 3:
            failures[0] += 1
            raise OSError(errno_, os.strerror(errno_), str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    watcher = make_watcher(root)
    watcher.until_idle = 0.5
    assert watcher.run() == 0
    lines = log_of(watcher)
    assert len([line for line in lines if os.strerror(errno_) in line]) == 1, lines
    assert (root / STEP3 / "consolidated").is_dir(), lines


def test_a_root_where_nothing_can_be_staged_fails_each_checkpoint_once(saved, tmp_path, monkeypatch):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3, STEP5])

    def full(parent, kind=""):
        raise OSError(28, "No space left on device", str(parent))

    monkeypatch.setattr(publish, "make_tmp_dir", full)
    watcher = make_watcher(root)
    watcher.until_idle = 0.4
    code = watcher.run()
    lines = log_of(watcher)
    assert code == 1, lines
    assert len([line for line in lines if line.startswith("error: ")]) == 2, lines
    assert "2 failed" in lines[-1] and not list(root.glob("*/consolidated")) and not (root / "LATEST").exists()


def test_thousands_of_consolidated_checkpoints_cost_no_metadata_reads_per_poll(saved, tmp_path, monkeypatch):
    names = [f"model--step={step}-consumed_samples={step}.0" for step in range(1, 1001)]
    # hard links made first (a new link changes the files' ctime, which a save's identity records): one save under
    # a thousand names, then the one output linked into each, a complete output each
    root = make_root(saved, tmp_path / "checkpoints", names, link=True)
    consolidate_checkpoint(root / names[0], root / names[0] / "consolidated", global_step=1, workers=1)
    for name in names[1:]:
        shutil.copytree(root / names[0] / "consolidated", root / name / "consolidated", copy_function=os.link)
    reads = []
    real = digests.source_fingerprint
    monkeypatch.setattr(digests, "source_fingerprint", lambda weights: reads.append(weights) or real(weights))
    watcher = make_watcher(root)
    watcher.scan()
    first = len(reads)
    for _ in range(3):
        watcher.scan()
    assert len(reads) == first, f"{len(reads) - first} .metadata reads in 3 idle polls of {len(names)} checkpoints"


def test_a_tracker_file_dropped_into_a_nemo_root_does_not_change_its_layout(saved, tmp_path):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3])
    watcher = make_watcher(root)
    watcher.scan()
    (root / TRACKER_FILENAME).write_text("100")
    copy_into(saved["first"], root / STEP5)
    assert watcher.run() == 0, log_of(watcher)
    assert (root / STEP5 / "consolidated").is_dir(), log_of(watcher)


# -- Megatron-LM layouts: names and the tracker -----------------------------------------------------------------------


def megatron_dirs(root: Path, names: List[str], tracker: bytes = b"100") -> Path:
    root.mkdir()
    for name in names:
        (root / name).mkdir()
        (root / name / ".metadata").write_bytes(b"x")
    (root / TRACKER_FILENAME).write_bytes(tracker)
    return root


def test_only_megatrons_own_iteration_names_are_checkpoints(tmp_path):
    root = megatron_dirs(tmp_path / "save", ["iter_0000100", "iter_100", "iter_\u0661\u0660\u0660", "iter_00000100"])
    listing = list_run_checkpoints(root)
    assert [c.path.name for c in listing.finished] == ["iter_0000100"]


@pytest.mark.parametrize(
    "content, expected",
    [(b"100", 100), (b" 100\n", 100), (b"-5", None), (b"release", None), (b"\xff\xfe", None),
     ("\u0661\u0660\u0660".encode(), None), (b"1" * 5000, None), (b"1e3", None)],
)  # fmt: skip
def test_a_damaged_tracker_names_no_iteration(tmp_path, content, expected):
    root = megatron_dirs(tmp_path / "save", ["iter_0000100"], content)
    assert read_tracker(root) == expected


def test_a_fifo_or_directory_tracker_does_not_block(tmp_path):
    root = megatron_dirs(tmp_path / "save", ["iter_0000100"])
    (root / TRACKER_FILENAME).unlink()
    os.mkfifo(root / TRACKER_FILENAME)
    assert read_tracker(root) is None and list_run_checkpoints(root).finished == []
    (root / TRACKER_FILENAME).unlink()
    (root / TRACKER_FILENAME).mkdir()
    assert read_tracker(root) is None


# -- hostile files the watcher reads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["weights/common.pt", "weights/.metadata", "consolidated/metadata.json"])
def test_a_fifo_where_the_watcher_reads_does_not_block_it(saved, tmp_path, where):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3, "model-no-step-in-name"])
    target = root / "model-no-step-in-name" / where
    target.parent.mkdir(exist_ok=True)
    target.unlink(missing_ok=True)
    os.mkfifo(target)
    watcher = make_watcher(root, "each")
    watcher.run()  # returns: nothing blocks on the FIFO
    assert (root / STEP3 / "consolidated").is_dir(), log_of(watcher)


@pytest.mark.parametrize("content", [b"\x80\x04\x95garbage", b"PK\x03\x04" + b"\x00" * 100, b""])
def test_best_with_a_hostile_common_pt_goes_on(saved, tmp_path, content):
    root = make_root(saved, tmp_path / "checkpoints", [STEP3, STEP5])
    (root / STEP5 / "weights" / "common.pt").write_bytes(content)
    watcher = make_watcher(root, "best")
    assert watcher.run() == 14  # these saves record no monitored metric: exit 14 as --best (issue #47), no traceback
    assert all(line.count("\n") == 0 for line in log_of(watcher))


# -- signals ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("moment", ["link", "latest", "listing"])
def test_sigterm_at_odd_moments_leaves_nothing_half_written(saved, tmp_path, monkeypatch, moment):
    names = [STEP3, f"{STEP3}-last", STEP5]
    root = make_root(saved, tmp_path / "checkpoints", names)
    import nemo_patch.cli.watch as watch_module
    import nemo_patch.training.latest as latest

    fired = []

    def fire():
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    if moment == "link":
        real_link = os.link
        monkeypatch.setattr(os, "link", lambda *a, **k: (fire(), real_link(*a, **k))[1])
    elif moment == "latest":
        real_update = latest.update_latest_pointer
        monkeypatch.setattr(latest, "update_latest_pointer", lambda *a, **k: (fire(), real_update(*a, **k))[1])
    else:
        real_list = watch_module.list_run_checkpoints
        monkeypatch.setattr(
            watch_module, "list_run_checkpoints", lambda root, layout=None: (fire(), real_list(root, layout))[1]
        )
    watcher = make_watcher(root)
    watcher.until_idle = None
    assert watcher.run() == 0, log_of(watcher)
    assert "Stopping on SIGTERM" in watcher.out.getvalue()
    assert not [p for p in root.iterdir() if p.name.startswith(".") and not p.name.startswith(".LATEST.replaced")]
    for name in names:
        output = root / name / "consolidated"
        assert not os.path.lexists(output) or output_is_complete(root / name, output), name
        assert not [p for p in (root / name).iterdir() if p.name.startswith(".")]
