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

"""Retention of consolidated outputs when NeMo's top-k removes their checkpoints, and ``LATEST`` never dangling.

Unit level, on synthetic checkpoint roots (a checkpoint here is ``<name>/weights/.metadata`` plus a complete
``consolidated/`` with ``metadata.json``); the real training runs are in ``test_retention_e2e.py``.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import pytest

from nemo_patch.engine.errors import NotACheckpointError
from nemo_patch.training.latest import (
    BEST_NAME,
    LATEST_NAME,
    locate_checkpoint,
    read_latest_pointer,
    update_latest_pointer,
)
from nemo_patch.training.retention import (
    RETAINED_DIRNAME,
    consolidated_outputs,
    output_run,
    prune_retained,
    repair_best,
    repoint_best,
    repoint_latest,
    retain_output,
    retained_name,
)


def _checkpoint(
    root: Path,
    step: int,
    consolidated: bool = True,
    last: bool = False,
    linked_from: Optional[Path] = None,
    run: Optional[str] = None,
    version: str = "",
) -> Path:
    """A synthetic checkpoint; ``linked_from``: its output is hard links of that checkpoint's (a ``-last`` copy's);
    ``run``: the training run its output records; ``version``: NeMo's ``-v<N>`` of a reused name."""
    path = root / f"m--step={step - 1}-consumed_samples={2.0 * step}{version}{'-last' if last else ''}"
    (path / "weights").mkdir(parents=True)
    (path / "weights" / ".metadata").write_bytes(b"dcp")
    if linked_from is not None:
        (path / "consolidated").mkdir()
        for file in (linked_from / "consolidated").iterdir():
            os.link(file, path / "consolidated" / file.name)
    elif consolidated:
        (path / "consolidated").mkdir()
        (path / "consolidated" / "model.safetensors").write_bytes(
            b"weights of step %d of %s" % (step, str(run).encode())
        )
        metadata = {"format_version": 1, "global_step": step, "source_checkpoint": "../weights", "files": {}}
        if run is not None:
            metadata["run"] = run
        (path / "consolidated" / "metadata.json").write_text(json.dumps(metadata))
    return path


def _removing(path: Path) -> None:
    """What NeMo's ModelCheckpoint does before it asks the strategy to remove a checkpoint."""
    Path(f"{path}-unfinished").touch()


def test_retained_output_keeps_its_files_step_and_origin(tmp_path):
    checkpoint = _checkpoint(tmp_path, 4)
    _removing(checkpoint)
    entry = retain_output(checkpoint, "consolidated")
    assert entry == tmp_path / RETAINED_DIRNAME / checkpoint.name
    kept = entry / "consolidated"
    assert (kept / "model.safetensors").read_bytes() == b"weights of step 4 of None"
    assert os.stat(kept / "model.safetensors").st_ino == os.stat(checkpoint / "consolidated/model.safetensors").st_ino
    metadata = json.loads((kept / "metadata.json").read_text())
    assert metadata["global_step"] == 4 and metadata["retained_from"] == checkpoint.name
    assert (kept / metadata["source_checkpoint"]).resolve() == (checkpoint / "weights").resolve()
    # The original metadata.json is untouched (the retained one is a new file, not the hard link rewritten).
    assert "retained_from" not in json.loads((checkpoint / "consolidated" / "metadata.json").read_text())
    assert [p.name for p in (tmp_path / RETAINED_DIRNAME / checkpoint.name).iterdir()] == ["consolidated"]


def test_the_post_command_log_is_retained_beside_the_output_and_metadata_names_it(tmp_path):
    checkpoint = _checkpoint(tmp_path, 6)
    log = checkpoint / "consolidated.post-command.log"
    log.write_text("perplexity 12.3\n")
    metadata_path = checkpoint / "consolidated" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["post_command"] = {"command": "eval", "returncode": 0, "log": str(log)}
    metadata_path.write_text(json.dumps(metadata))
    _removing(checkpoint)
    entry = retain_output(checkpoint, "consolidated")
    kept_log = entry / "consolidated.post-command.log"
    assert kept_log.read_text() == "perplexity 12.3\n"
    kept = json.loads((entry / "consolidated" / "metadata.json").read_text())
    assert kept["post_command"]["log"] == str(kept_log)
    shutil.rmtree(checkpoint)  # what NeMo's removal does next: the retained log survives it
    assert kept_log.read_text() == "perplexity 12.3\n"


def _with_post_command_log(checkpoint: Path, text: str) -> Path:
    log = checkpoint / "consolidated.post-command.log"
    log.write_text(text)
    metadata_path = checkpoint / "consolidated" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["post_command"] = {"command": "eval", "returncode": 0, "log": str(log)}
    metadata_path.write_text(json.dumps(metadata))
    return log


@pytest.mark.parametrize("left_there", ["stale log", "dangling symlink", "symlink to a file"])
def test_a_file_or_link_left_where_the_log_is_kept_is_replaced_never_written_through(tmp_path, left_there):
    checkpoint = _checkpoint(tmp_path, 6)
    _with_post_command_log(checkpoint, "perplexity 12.3\n")
    kept_log = tmp_path / RETAINED_DIRNAME / checkpoint.name / "consolidated.post-command.log"
    kept_log.parent.mkdir(parents=True)  # an entry without its output: e.g. the output was deleted by hand
    outside = tmp_path / "outside.txt"
    if left_there == "stale log":
        kept_log.write_text("an older run's log\n")
    else:
        if left_there == "symlink to a file":
            outside.write_text("not the log\n")
        kept_log.symlink_to(outside)
    _removing(checkpoint)
    entry = retain_output(checkpoint, "consolidated")
    assert not kept_log.is_symlink() and kept_log.read_text() == "perplexity 12.3\n"
    assert not outside.exists() or outside.read_text() == "not the log\n"
    assert json.loads((entry / "consolidated" / "metadata.json").read_text())["post_command"]["log"] == str(kept_log)


def test_a_log_that_cannot_be_kept_is_not_named_in_the_retained_metadata(tmp_path, caplog):
    checkpoint = _checkpoint(tmp_path, 6)
    log = _with_post_command_log(checkpoint, "perplexity 12.3\n")
    kept_log = tmp_path / RETAINED_DIRNAME / checkpoint.name / "consolidated.post-command.log"
    kept_log.mkdir(parents=True)  # a directory of that name: the log cannot go there
    _removing(checkpoint)
    entry = retain_output(checkpoint, "consolidated")
    assert kept_log.is_dir() and "Could not keep the post command's log" in caplog.text
    assert json.loads((entry / "consolidated" / "metadata.json").read_text())["post_command"]["log"] == str(log)


def test_a_last_copy_is_retained_once_under_its_steps_name(tmp_path):
    own = _checkpoint(tmp_path, 10)
    last = _checkpoint(tmp_path, 10, last=True, linked_from=own)
    assert retain_output(own, "consolidated") is not None
    assert retain_output(last, "consolidated") is None  # same step, already retained
    assert sorted(p.name for p in (tmp_path / RETAINED_DIRNAME).iterdir()) == [own.name]


@pytest.mark.parametrize(
    "own", ["with its output", "retained", "without an output", "being removed", "absent", "another fit's output"]
)
def test_a_last_copy_is_retained_only_when_no_other_output_holds_its_files(tmp_path, own):
    """The copy's output is hard links of its step's output (the same weights). Another output of the same global
    step with other files (e.g. of a second ``fit``, whose steps started again) does not stand in for it."""
    source = _checkpoint(tmp_path / "elsewhere", 8)
    if own != "absent":
        checkpoint = _checkpoint(tmp_path, 8, consolidated=own != "without an output")
        if own in ("with its output", "retained", "being removed"):
            shutil.rmtree(checkpoint / "consolidated")
            source = _checkpoint(tmp_path / "own", 8)
            shutil.copytree(source / "consolidated", checkpoint / "consolidated", copy_function=os.link)
        if own == "being removed":
            _removing(checkpoint)
        if own == "retained":
            _removing(checkpoint)
            retain_output(checkpoint, "consolidated")
            shutil.rmtree(checkpoint)
    last = _checkpoint(tmp_path, 8, last=True, linked_from=source)
    _checkpoint(tmp_path, 6)  # another step's output changes nothing
    _removing(last)
    entry = retain_output(last, "consolidated")
    if own == "retained":
        assert entry is None and [p.name for p in (tmp_path / RETAINED_DIRNAME).iterdir()] == [checkpoint.name]
    elif own == "with its output":
        assert entry is None and not (tmp_path / RETAINED_DIRNAME).exists()  # its own output is retained later
    else:
        assert entry == tmp_path / RETAINED_DIRNAME / retained_name(last)
        assert json.loads((entry / "consolidated" / "metadata.json").read_text())["retained_from"] == last.name


def test_nothing_to_retain_without_a_complete_output(tmp_path):
    bare = _checkpoint(tmp_path, 2, consolidated=False)
    (bare / "consolidated").mkdir()  # e.g. half-made by hand: no metadata.json
    assert retain_output(bare, "consolidated") is None
    assert not (tmp_path / RETAINED_DIRNAME).exists()


def test_outputs_are_listed_newest_first_without_those_being_removed(tmp_path):
    a, b, c = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4), _checkpoint(tmp_path, 6, consolidated=False)
    _removing(a)
    retain_output(a, "consolidated")
    listed = [(o.entry.name, o.global_step, o.retained) for o in consolidated_outputs(tmp_path, "consolidated")]
    assert listed == [(b.name, 4, False), (a.name, 2, True)]
    assert c.name not in {name for name, _, _ in listed}


@pytest.mark.parametrize("keep, retained_steps", [(None, [2, 4, 6]), (3, [4, 6]), (2, [6]), (1, []), (0, [])])
def test_keep_bounds_the_retained_outputs_counting_living_ones(tmp_path, keep, retained_steps):
    checkpoints = [_checkpoint(tmp_path, step) for step in (2, 4, 6, 8)]
    for checkpoint in checkpoints[:3]:
        _removing(checkpoint)
        retain_output(checkpoint, "consolidated")
        shutil.rmtree(checkpoint)
    prune_retained(tmp_path, "consolidated", keep)
    # The living step-8 output counts towards N: keep=2 leaves it and the newest retained one.
    outputs = consolidated_outputs(tmp_path, "consolidated")
    assert sorted(o.global_step for o in outputs if o.retained) == retained_steps
    assert [o.global_step for o in outputs if not o.retained] == [8]


def test_latest_moves_to_the_retained_entry_then_to_the_newest_remaining_then_goes(tmp_path):
    old, new = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    update_latest_pointer(new)
    _removing(new)
    entry = retain_output(new, "consolidated")
    assert repoint_latest(tmp_path, "consolidated", removing=new) == entry
    assert os.readlink(tmp_path / LATEST_NAME) == f"{RETAINED_DIRNAME}/{new.name}"  # relative, inside the root
    assert read_latest_pointer(tmp_path) == entry.resolve()
    shutil.rmtree(entry)  # e.g. pruned by ConsolidationConfig.keep
    assert repoint_latest(tmp_path, "consolidated") == old
    _removing(old)
    assert repoint_latest(tmp_path, "consolidated", removing=old) is None
    assert not os.path.lexists(tmp_path / LATEST_NAME)


def test_latest_is_left_alone_while_it_names_a_complete_output(tmp_path):
    old, new = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    update_latest_pointer(old)
    assert repoint_latest(tmp_path, "consolidated", removing=new) == old
    assert os.readlink(tmp_path / LATEST_NAME) == old.name


def test_cli_root_lookup_skips_a_latest_that_names_a_retained_output(tmp_path):
    removed, newest = _checkpoint(tmp_path, 4), _checkpoint(tmp_path, 6, consolidated=False)
    entry = retain_output(removed, "consolidated")
    update_latest_pointer(entry, tmp_path)
    shutil.rmtree(removed)
    assert locate_checkpoint(tmp_path).checkpoint_dir == newest  # the newest finished checkpoint instead
    with pytest.raises(NotACheckpointError):
        locate_checkpoint(entry)  # a retained output alone has no distributed checkpoint to read


@pytest.mark.parametrize("keep", [None, 0])
def test_checkpoint_io_keeps_the_output_and_moves_latest_before_nemo_removes(tmp_path, keep, caplog):
    """The consolidating checkpoint IO's part of NeMo's top-k removal: retain (unless keep=0), move LATEST, then let
    NeMo remove the checkpoint; a queued consolidation of it is dropped and logged once as a warning."""
    from nemo_patch import ConsolidationConfig, ConsolidationSettings, MegatronCheckpointIO
    from nemo_patch.training.schedule import CheckpointSave, RequestState

    settings = ConsolidationSettings.from_arguments(True, config=ConsolidationConfig(keep=keep))
    io = MegatronCheckpointIO(consolidation_settings=settings)
    old, new = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    update_latest_pointer(new)
    _removing(new)
    io.consolidation.remove_checkpoint(
        new, lambda: shutil.rmtree(new)
    )  # what MegatronStrategy.remove_checkpoint calls
    assert not new.exists()
    if keep is None:
        assert read_latest_pointer(tmp_path) == (tmp_path / RETAINED_DIRNAME / new.name).resolve()
    else:
        assert not (tmp_path / RETAINED_DIRNAME).exists() and read_latest_pointer(tmp_path) == old.resolve()
    # Two queued requests dropped by removal: one warning, then debug.
    queued = [CheckpointSave(_checkpoint(tmp_path, step, consolidated=False), step, written=True) for step in (6, 8)]
    for save in queued:  # waiting behind a running one (none is started here)
        save.state = RequestState.WAITING
        io.consolidation.queue._pending.append(save)
    with caplog.at_level("DEBUG", logger="nemo_patch.training.coordinator"):
        for save in queued:
            io.consolidation.remove_checkpoint(save.path, lambda path=save.path: shutil.rmtree(path))
    assert io.consolidation.dropped_by_removal == queued
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "was due for consolidation" in r.message]
    assert len(warnings) == 1


def test_cli_names_a_retained_entry_or_an_output_instead_of_calling_it_unfinished(tmp_path):
    removed = _checkpoint(tmp_path, 4)
    entry = retain_output(removed, "consolidated")
    with pytest.raises(NotACheckpointError, match="kept after NeMo's top-k retention removed its checkpoint"):
        locate_checkpoint(entry)
    with pytest.raises(NotACheckpointError, match="is a consolidated output"):
        locate_checkpoint(entry / "consolidated")


def test_a_log_dir_given_as_root_gets_a_hint(tmp_path):
    _checkpoint(tmp_path / "tiny_gpt" / "checkpoints", 2)
    with pytest.raises(NotACheckpointError, match=r"its checkpoint roots: .*tiny_gpt/checkpoints"):
        locate_checkpoint(tmp_path)


# --- several runs in one root: LATEST and BEST stay with the run that owns them ------------------------------------


def _two_runs(root: Path):
    """Run A saved global steps 2 and 10; run B, later in the same root, steps 2 (a reused name: ``-v1``) and 4."""
    a2, a10 = _checkpoint(root, 2, run="A"), _checkpoint(root, 10, run="A")
    b2, b4 = _checkpoint(root, 2, run="B", version="-v1"), _checkpoint(root, 4, run="B")
    update_latest_pointer(b4)
    return a2, a10, b2, b4


@pytest.mark.parametrize("kept", [True, False])
def test_latest_moves_to_its_own_runs_output_never_to_another_runs_higher_step(tmp_path, kept, caplog):
    """Run B's LATEST checkpoint is removed: LATEST goes to its retained output, or to B's older output, never to run
    A's global step 10; when B has none left, LATEST is removed with one log line."""
    a2, a10, b2, b4 = _two_runs(tmp_path)
    assert [(o.entry.name, o.run) for o in consolidated_outputs(tmp_path, "consolidated")][:2] == [
        (a10.name, "A"),
        (b4.name, "B"),
    ]
    _removing(b4)
    if kept:
        entry = retain_output(b4, "consolidated")
        assert repoint_latest(tmp_path, "consolidated", removing=b4, run="B") == entry
        assert output_run(entry / "consolidated") == "B"  # the retained entry still names its run
        shutil.rmtree(b4)
        shutil.rmtree(entry)  # e.g. deleted by hand: LATEST dangles until B looks after it
        assert repoint_latest(tmp_path, "consolidated", run="B") == b2
    else:
        assert repoint_latest(tmp_path, "consolidated", removing=b4, run="B") == b2
        shutil.rmtree(b4)
    assert (read_latest_pointer(tmp_path) / "consolidated" / "model.safetensors").read_bytes() == (
        b"weights of step 2 of B"
    )
    _removing(b2)
    caplog.set_level("INFO", logger="nemo_patch.training.retention")
    caplog.clear()
    assert repoint_latest(tmp_path, "consolidated", removing=b2, run="B") is None
    assert not os.path.lexists(tmp_path / LATEST_NAME)  # not run A's step 10
    removed = [r.getMessage() for r in caplog.records if "LATEST" in r.getMessage()]
    assert len(removed) == 1 and removed[0].startswith("LATEST removed") and "run B" in removed[0], removed
    assert (a10 / "consolidated" / "metadata.json").is_file() and (a2 / "consolidated").is_dir()


def test_a_dangling_latest_is_taken_over_by_the_run_that_starts_or_removed(tmp_path):
    a2, a10, b2, b4 = _two_runs(tmp_path)
    shutil.rmtree(b4)  # deleted by hand while no run was there: whose output LATEST named cannot be read any more
    assert repoint_latest(tmp_path, "consolidated", run="C") is None  # a new run C has no output: not A's step 10
    update_latest_pointer(b4, tmp_path)
    assert repoint_latest(tmp_path, "consolidated", run="B") == b2  # run B resumed: its own newest


def test_after_a_rollback_latest_goes_below_the_step_it_named(tmp_path):
    """Run A resumed from its step-4 checkpoint (a rollback) and saved step 6 again (``-v1``): when that checkpoint
    goes, LATEST goes to step 4, not to the steps 6 and 8 that the rollback left behind."""
    a2, a4, a6, a8 = (_checkpoint(tmp_path, step, run="A") for step in (2, 4, 6, 8))
    again = _checkpoint(tmp_path, 6, run="A", version="-v1")
    update_latest_pointer(again)
    _removing(again)
    assert repoint_latest(tmp_path, "consolidated", removing=again, run="A") == a4


def test_outputs_that_record_no_run_are_one_run_of_their_own(tmp_path):
    """Outputs made before runs were recorded: LATEST naming one moves among them only, and a run's pruning and
    LATEST never take them."""
    old2, old4 = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    b6 = _checkpoint(tmp_path, 6, run="B")
    update_latest_pointer(old4)
    _removing(old4)
    assert repoint_latest(tmp_path, "consolidated", removing=old4, run="B") == old2
    _removing(old2)
    assert repoint_latest(tmp_path, "consolidated", removing=old2, run="B") is None
    update_latest_pointer(b6)
    _removing(b6)
    assert repoint_latest(tmp_path, "consolidated", removing=b6, run="B") is None  # not an output without a run


def test_keep_prunes_only_the_pruning_runs_outputs(tmp_path):
    runs = {"A": [2, 4, 6], "B": [2, 4, 6], None: [2, 4]}
    versions = {"A": "", "B": "-v1", None: "-v2"}
    for run, steps in runs.items():
        for step in steps:
            checkpoint = _checkpoint(tmp_path, step, run=run, version=versions[run])
            _removing(checkpoint)
            retain_output(checkpoint, "consolidated")
            shutil.rmtree(checkpoint)
    removed = prune_retained(tmp_path, "consolidated", 1, "B")
    assert sorted(entry.name for entry in removed) == [f"m--step={step - 1}-consumed_samples={2.0 * step}-v1"
                                                       for step in (2, 4)]  # fmt: skip
    left = [(o.run, o.global_step) for o in consolidated_outputs(tmp_path, "consolidated")]
    assert sorted(left, key=str) == sorted([("A", 2), ("A", 4), ("A", 6), ("B", 6), (None, 2), (None, 4)], key=str)


def test_best_is_repaired_only_to_its_own_runs_retained_entry(tmp_path):
    """Run B's checkpoint was kept as retained/<name>; run A saved the same name later (kept as <name>-v1, the one
    kept last). BEST named B's checkpoint, deleted by hand: it goes to B's entry, never to A's."""
    b = _checkpoint(tmp_path, 4, run="B")
    _removing(b)
    b_entry = retain_output(b, "consolidated")
    shutil.rmtree(b)
    a = _checkpoint(tmp_path, 4, run="A")
    _removing(a)
    a_entry = retain_output(a, "consolidated")
    shutil.rmtree(a)
    assert a_entry.name == f"{b.name}-v1"
    update_latest_pointer(b, tmp_path, name=BEST_NAME)
    assert repair_best(tmp_path, "consolidated", "B") == b_entry
    update_latest_pointer(b, tmp_path, name=BEST_NAME)
    assert repair_best(tmp_path, "consolidated", "C") is None and not os.path.lexists(tmp_path / BEST_NAME)


def test_a_fifo_planted_as_a_retained_metadata_json_blocks_nothing(tmp_path):
    """``retained/`` entries are read as bounded regular files (as consolidated_outputs reads them): a FIFO planted at
    an entry's metadata.json is no output, and never blocks the training thread that looks for one."""
    import threading

    kept = _checkpoint(tmp_path, 4, run="A")
    planted = tmp_path / RETAINED_DIRNAME / "planted" / "consolidated"
    planted.mkdir(parents=True)
    os.mkfifo(planted / "metadata.json")
    _removing(kept)
    entry = retain_output(kept, "consolidated")
    update_latest_pointer(kept, tmp_path, name=BEST_NAME)
    found = []
    looking = threading.Thread(target=lambda: found.append(repoint_best(tmp_path, "consolidated", kept, "A")))
    looking.daemon = True
    looking.start()
    looking.join(timeout=20)
    assert not looking.is_alive() and found == [entry]


def test_best_follows_its_checkpoints_output_to_retained_or_is_removed_saying_why(tmp_path, caplog):
    kept, other = _checkpoint(tmp_path, 4, run="A"), _checkpoint(tmp_path, 6, run="A")
    update_latest_pointer(kept, tmp_path, name=BEST_NAME)
    assert repoint_best(tmp_path, "consolidated", other, "A") == kept  # not the one removed: BEST stays
    _removing(kept)
    entry = retain_output(kept, "consolidated")
    with caplog.at_level("INFO", logger="nemo_patch.training.retention"):
        assert repoint_best(tmp_path, "consolidated", kept, "A") == entry
    assert os.path.realpath(tmp_path / BEST_NAME) == str(entry.resolve())
    assert f"BEST moved from {kept.name} to retained/{kept.name} (checkpoint {kept.name} is being removed)" in (
        caplog.messages
    )
    update_latest_pointer(other, tmp_path, name=BEST_NAME)  # an output that is not kept (keep=0): BEST goes
    caplog.clear()
    assert repoint_best(tmp_path, "consolidated", other, "A") is None and not os.path.lexists(tmp_path / BEST_NAME)
    assert caplog.messages == [
        f"BEST removed: checkpoint {other.name} is being removed and its consolidated output is not kept"
    ]


def test_linking_a_retained_output_into_a_last_copy_reads_its_metadata_bounded(tmp_path):
    """A retained output's ``metadata.json`` replaced by a link to a huge file (256 MiB, sparse) is not read whole
    into the training process when the output is linked into a ``-last`` copy: the copy gets the files as they are."""
    from types import SimpleNamespace

    from nemo_patch.training import retention
    from nemo_patch.training.schedule import CheckpointSave

    output = tmp_path / "retained" / "ckpt--step=3" / "consolidated"
    output.mkdir(parents=True)
    with open(tmp_path / "huge", "wb") as huge:
        huge.truncate(256 << 20)
    (output / "metadata.json").symlink_to(tmp_path / "huge")
    observer = retention.Observer(SimpleNamespace(settings=SimpleNamespace(output_dirname="consolidated")))
    source = CheckpointSave(tmp_path / "ckpt--step=3", 4)
    copy = CheckpointSave(tmp_path / "ckpt--step=3-last", 4, copy_of=source)
    assert observer.link_files(output, copy) == {}
