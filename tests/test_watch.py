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

"""``nemo-consolidate --watch``: the sidecar, on a Megatron-LM-layout save directory that megatron-core writes while
the watcher runs in another process, and on NeMo-layout roots; the offline CLI on a Megatron-LM checkpoint.

The oracle is PyTorch's ``dcp_to_torch_save`` of each checkpoint (model entries, layers split)."""

import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.cli.watch import Watcher, output_is_complete
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.runs.run_checkpoints import TRACKER_FILENAME, list_run_checkpoints
from nemo_patch.training.policy import parse_consolidation_frequency

REPO = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("io_checkpoints", REPO / "tests/nemo/lightning/conftest.py")
_IO_CHECKPOINTS = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_IO_CHECKPOINTS)
save_checkpoint = _IO_CHECKPOINTS.save_checkpoint  # NeMo-layout checkpoints that megatron-core saves

ITERATIONS = (100, 200, 300)


def expected_tensors(checkpoint: Path, scratch: Path) -> Dict[str, torch.Tensor]:
    """The model tensors of a Megatron-LM checkpoint as PyTorch's own conversion reads them, layers split."""
    target = scratch / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, target)
    expected = {}
    for key, value in torch.load(target, weights_only=False).items():
        if not isinstance(value, torch.Tensor) or key.startswith("optimizer.") or "_extra_state" in key:
            continue
        if key.startswith("decoder.layers."):
            expected.update({key.replace("layers.", f"layers.{i}.", 1): value[i] for i in range(value.shape[0])})
        else:
            expected[key] = value
    return expected


def assert_output_equals(checkpoint: Path, scratch: Path) -> None:
    written = load_file(checkpoint / "consolidated" / "model.safetensors")
    expected = expected_tensors(checkpoint, scratch)
    assert sorted(written) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name


def watch(root: Path, *flags: str) -> "tuple[int, str]":
    """Run ``nemo-consolidate --watch root --until-idle 0.3 --poll-interval 0.05 *flags`` here; (exit code, stdout)."""
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["--watch", str(root), "--until-idle", "0.3", "--poll-interval", "0.05", "--workers", "1", *flags])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory) -> Dict[str, object]:
    """A watcher started on an empty directory while megatron-core saves iterations 100, 200 and 300 into it (the
    tracker never reaches 300), stopped with SIGTERM once 100 and 200 are consolidated."""
    root = tmp_path_factory.mktemp("megatron") / "checkpoints"
    log = root.parent / "watch.log"
    with open(log, "w") as handle:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "nemo_patch", "--watch", str(root), "--poll-interval", "0.2", "--workers", "1"],
            stdout=handle, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
        writer = subprocess.run(
            [sys.executable, str(REPO / "tests" / "megatron_lm_checkpoints.py"), str(root), "29641",
             ",".join(map(str, ITERATIONS)), "--no-tracker-for", "300", "--pause", "1"],
            capture_output=True, text=True, timeout=600, cwd=REPO,
        )  # fmt: skip
        assert writer.returncode == 0, writer.stderr[-4000:]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
            (root / f"iter_{i:07d}" / "consolidated" / "metadata.json").is_file() for i in (100, 200)
        ):
            time.sleep(0.2)
        time.sleep(1)  # a scan after the tracker stopped moving
        watcher.send_signal(signal.SIGTERM)
        code = watcher.wait(timeout=60)
    return {"root": root, "code": code, "log": log.read_text()}


@pytest.fixture()
def megatron_copy(megatron_run, tmp_path) -> Path:
    """A private copy of the Megatron-LM save directory without outputs or ``LATEST``."""
    copy = tmp_path / "checkpoints"
    shutil.copytree(megatron_run["root"], copy, ignore=shutil.ignore_patterns("consolidated", "LATEST"))
    return copy


def test_a_watcher_consolidates_megatron_saves_as_they_finish(megatron_run, tmp_path):
    root, log = megatron_run["root"], megatron_run["log"]
    assert megatron_run["code"] == 0, log
    for iteration in (100, 200):
        assert_output_equals(root / f"iter_{iteration:07d}", tmp_path)
        assert f"Consolidated iter_{iteration:07d} (global step {iteration})" in log
    assert not (root / "iter_0000300" / "consolidated").exists(), "an iteration the tracker never reached"
    assert "iter_0000300" not in log
    assert os.readlink(root / "LATEST") == "iter_0000200"
    assert "Stopping on SIGTERM" in log and "2 consolidated" in log.splitlines()[-1]
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "temporary entries left in the root"
    assert not (root / "iter_0000100" / "common.pt.consolidated").exists()


def test_offline_megatron_checkpoint(megatron_copy, tmp_path, capsys):
    checkpoint = megatron_copy / "iter_0000300"  # the CLI consolidates what it is given; the tracker is for watchers
    assert main([str(checkpoint), "--workers", "2"]) == 0
    assert_output_equals(checkpoint, tmp_path)
    assert "29 tensors" in capsys.readouterr().out


def test_restart_redoes_nothing_and_goes_on_when_the_tracker_moves(megatron_copy, tmp_path):
    code, first = watch(megatron_copy)
    assert code == 0, first
    output = megatron_copy / "iter_0000200" / "consolidated" / "model.safetensors"
    before = output.stat().st_mtime_ns
    code, second = watch(megatron_copy)
    assert code == 0 and "Consolidated" not in second and "0 consolidated" in second.splitlines()[-1], second
    assert output.stat().st_mtime_ns == before
    (megatron_copy / TRACKER_FILENAME).write_text("300")
    code, third = watch(megatron_copy)
    assert code == 0 and "Consolidated iter_0000300" in third and "1 consolidated" in third.splitlines()[-1]
    assert os.readlink(megatron_copy / "LATEST") == "iter_0000300"
    assert_output_equals(megatron_copy / "iter_0000300", tmp_path)


@pytest.mark.parametrize(
    "frequency, consolidated", [("every_n:2", [200]), ("latest", [200]), ("each; every_n:5@150", [100])]
)
def test_frequencies_count_finished_checkpoints_in_step_order(megatron_copy, frequency, consolidated):
    code, log = watch(megatron_copy, "--frequency", frequency)
    assert code == 0, log
    done = [i for i in ITERATIONS if (megatron_copy / f"iter_{i:07d}" / "consolidated").is_dir()]
    assert done == consolidated, log


def test_an_iteration_the_tracker_passed_without_metadata_is_skipped_with_a_line(megatron_copy):
    (megatron_copy / "iter_0000200" / ".metadata").unlink()
    code, log = watch(megatron_copy)
    assert code == 0
    assert "skipped iter_0000200: no '.metadata' although the tracker names iteration 200" in log
    assert (megatron_copy / "iter_0000100" / "consolidated").is_dir()
    assert not (megatron_copy / "iter_0000200" / "consolidated").exists()


def test_no_tracker_means_nothing_is_finished(megatron_copy):
    (megatron_copy / TRACKER_FILENAME).unlink()
    code, log = watch(megatron_copy)
    assert code == 0 and "0 consolidated" in log.splitlines()[-1]
    assert not list(megatron_copy.glob("*/consolidated"))


def test_hf_and_best_are_refused_for_megatron_layouts(megatron_copy, capsys):
    assert main(["--watch", str(megatron_copy), "--format", "hf", "--until-idle", "1"]) == 6
    assert "Megatron-Bridge's AutoBridge" in capsys.readouterr().err
    assert main(["--watch", str(megatron_copy), "--frequency", "best", "--until-idle", "1"]) == 6


@pytest.mark.parametrize("url", ["s3://bucket/run/checkpoints", "msc://profile/run"])
def test_a_url_as_the_root_exits_19_and_writes_nothing(tmp_path, monkeypatch, capsys, url):
    monkeypatch.chdir(tmp_path)
    assert main([url, "--watch", "--until-idle", "0.1"]) == 19
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{url} is a URL" in err, err
    assert not list(tmp_path.iterdir()), "a local directory named like the URL was made"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--frequency", "each"], "--frequency only with --watch"),
        (["--watch", "--out", "x"], "--out cannot be used"),
        (["--watch", "--frequency", "sometimes"], "Invalid --frequency 'sometimes'"),
    ],
)
def test_usage_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


# -- NeMo-layout roots, in this process -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nemo_checkpoint(tmp_path_factory) -> Path:
    """A NeMo-layout checkpoint (``weights/`` of ``module.*`` entries) megatron-core saved."""
    directory = tmp_path_factory.mktemp("nemo") / "model--step=3-consumed_samples=8.0"
    save_checkpoint(directory)
    return directory


def nemo_root(checkpoint: Path, root: Path, names: List[str]) -> Path:
    root.mkdir()
    for name in names:
        shutil.copytree(checkpoint, root / name)
    return root


def make_watcher(root: Path, frequency: str = "each", **kwargs) -> Watcher:
    def consolidate(checkpoint, output, staging, before_publish):
        result = consolidate_checkpoint(checkpoint.path, output, global_step=checkpoint.global_step,
                                        staging_dir=staging, before_publish=before_publish, **kwargs)  # fmt: skip
        return result.tensor_count, result.total_bytes

    return Watcher(root, parse_consolidation_frequency(frequency), consolidate, until_idle=0.2, poll_interval=0.05,
                   out=io.StringIO())  # fmt: skip


def test_last_copies_count_with_their_step_and_get_hard_links(nemo_checkpoint, tmp_path):
    names = ["model--step=3-consumed_samples=8.0", "model--step=3-consumed_samples=8.0-last-v1",
             "model--step=5-consumed_samples=12.0", "model--step=5-consumed_samples=12.0-last"]  # fmt: skip
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", names)
    shutil.rmtree(root / names[3])
    save_checkpoint(root / names[3])  # a save of its own, as NeMo's copy is: another .metadata (DCP's save id)
    assert (root / names[3] / "weights/.metadata").read_bytes() != (root / names[2] / "weights/.metadata").read_bytes()
    watcher = make_watcher(root, "every_n:2")
    assert watcher.run() == 0
    log = watcher.out.getvalue()
    assert not (root / names[0] / "consolidated").exists() and not (root / names[1] / "consolidated").exists(), log
    own, copy = root / names[2] / "consolidated", root / names[3] / "consolidated"
    assert output_is_complete(root / names[2], own) and output_is_complete(root / names[3], copy)
    assert (own / "model.safetensors").stat().st_ino == (copy / "model.safetensors").stat().st_ino
    assert os.readlink(root / "LATEST") == names[2]
    assert "1 consolidated" in log.splitlines()[-1] and "1 linked" in log.splitlines()[-1]
    assert json.loads((copy / "metadata.json").read_text())["linked_from"] == names[2]
    again = make_watcher(root, "every_n:2")  # a restarted watcher: both outputs are complete, nothing to do
    assert again.run() == 0
    assert (
        "0 consolidated (0 B), 1 already done, 0 linked" in again.out.getvalue().splitlines()[-1]
    ), again.out.getvalue()


def test_a_checkpoint_removed_while_read_publishes_nothing_and_the_watcher_goes_on(nemo_checkpoint, tmp_path):
    names = ["model--step=3-consumed_samples=8.0", "model--step=5-consumed_samples=12.0"]
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", names)
    victim = root / names[0]

    def remove_it(done, total):  # NeMo's removal: the unfinished marker, then rmtree
        if victim.exists():
            (root / f"{names[0]}-unfinished").touch()
            shutil.rmtree(victim)

    watcher = make_watcher(root, progress=remove_it)
    assert watcher.run() == 0
    log = watcher.out.getvalue()
    assert "removed or marked unfinished by the trainer" in log and "1 removed" in log.splitlines()[-1], log
    assert not victim.exists() and not list(root.glob(".*")), "nothing re-created, nothing left staged"


def test_a_checkpoint_marked_unfinished_before_publishing_gets_no_output(nemo_checkpoint, tmp_path):
    names = ["model--step=3-consumed_samples=8.0"]
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", names)

    def mark(done, total):  # NeMo marks a checkpoint before it removes it: nothing may be published into it then
        (root / f"{names[0]}-unfinished").touch()

    watcher = make_watcher(root, progress=mark)
    assert watcher.run() == 0
    assert not (root / names[0] / "consolidated").exists() and not list(root.glob(".*"))
    assert "1 removed" in watcher.out.getvalue().splitlines()[-1]


def test_sigterm_while_consolidating_abandons_the_output(nemo_checkpoint, tmp_path):
    names = ["model--step=3-consumed_samples=8.0", "model--step=5-consumed_samples=12.0"]
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", names)
    watcher = make_watcher(root, progress=lambda done, total: os.kill(os.getpid(), signal.SIGTERM))
    watcher.until_idle = None  # only the signal ends it
    assert watcher.run() == 0
    log = watcher.out.getvalue()
    assert "Stopping on SIGTERM" in log and "abandoned" in log and "0 consolidated" in log.splitlines()[-1]
    assert not list(root.glob("*/consolidated")) and not list(root.glob(".*")) and not (root / "LATEST").exists()


def test_a_failed_consolidation_is_logged_not_retried_and_sets_the_exit_code(nemo_checkpoint, tmp_path):
    names = ["model--step=3-consumed_samples=8.0", "model--step=5-consumed_samples=12.0"]
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", names)
    shard = sorted((root / names[0] / "weights").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    watcher = make_watcher(root)
    assert watcher.run() == 8  # CorruptShardError
    log = watcher.out.getvalue()
    assert log.count(f"error: {names[0]}") == 1 and (root / names[1] / "consolidated").is_dir()
    assert "1 consolidated" in log.splitlines()[-1] and "1 failed" in log.splitlines()[-1]


def test_two_watchers_never_write_one_output_twice(nemo_checkpoint, tmp_path):
    names = [f"model--step={s}-consumed_samples={s}.0" for s in (1, 3, 5, 7)]
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", names)
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nemo_patch",
                "--watch",
                str(root),
                "--until-idle",
                "2",
                "--poll-interval",
                "0.05",
                "--workers",
                "1",
            ],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )  # fmt: skip
        for log in logs
    ]
    assert [proc.wait(timeout=300) for proc in procs] == [0, 0]
    text = "".join(log.read_text() for log in logs)
    assert sorted(line.split()[1] for line in text.splitlines() if line.startswith("Consolidated")) == names, text
    for name in names:
        assert output_is_complete(root / name, root / name / "consolidated")


def test_a_checkpoint_saved_again_under_its_name_is_consolidated_again(nemo_checkpoint, tmp_path):
    names = ["model--step=3-consumed_samples=8.0"]
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", names)
    assert make_watcher(root).run() == 0
    shutil.rmtree(root / names[0])  # a rollback, or a new run, saves other weights under the same name
    expected = save_checkpoint(root / names[0], scale=2.0)
    watcher = make_watcher(root)
    assert watcher.run() == 0
    assert "1 consolidated" in watcher.out.getvalue().splitlines()[-1]
    written = load_file(root / names[0] / "consolidated" / "model.safetensors")
    assert sorted(written) == sorted(expected) and all(torch.equal(written[k], v) for k, v in expected.items())


def test_listing_orders_by_step_and_names_copies(nemo_checkpoint, tmp_path):
    names = ["model--step=9-consumed_samples=1.0-last", "model--step=10-consumed_samples=2.0",
             "model--step=9-consumed_samples=1.0", "model--step=11-consumed_samples=3.0"]  # fmt: skip
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", names)
    (root / f"{names[3]}-unfinished").touch()
    listing = list_run_checkpoints(root)
    assert [(c.path.name, c.global_step, c.copy) for c in listing.finished] == [
        (names[2], 10, False), (names[0], 10, True), (names[1], 11, False)]  # fmt: skip
    assert listing.not_finished == {root / names[3]: "unfinished"}


# -- how a watch ends (issue #47) -------------------------------------------------------------------------------------


def test_a_root_that_never_appears_exits_3_after_until_idle(tmp_path):
    code, log = watch(tmp_path / "chekpoints")  # mistyped
    lines = log.splitlines()
    assert code == 3, log
    assert lines[0] == f"Waiting for {tmp_path / 'chekpoints'} to appear"
    assert lines[-2].startswith(f"error: {tmp_path / 'chekpoints'} never appeared in 0.3 s") and "(exit code 3)" in log
    assert "0 consolidated" in lines[-1] and not (tmp_path / "chekpoints").exists()


def test_a_root_that_appears_late_is_watched(nemo_checkpoint, tmp_path):
    root = tmp_path / "checkpoints"
    watcher = make_watcher(root)
    watcher.until_idle = 1.0
    # the root and its checkpoint appear at once, as a finished save does (DCP renames .metadata into place): a copy
    # made in place could be seen half-written and fail its first read
    staged = nemo_root(nemo_checkpoint, tmp_path / "staged", [nemo_checkpoint.name])
    appear = threading.Timer(0.3, lambda: staged.rename(root))
    appear.start()
    try:
        assert watcher.run() == 0, watcher.out.getvalue()
    finally:
        appear.join()
    assert output_is_complete(root / nemo_checkpoint.name, root / nemo_checkpoint.name / "consolidated")


def test_best_for_a_run_without_a_monitored_metric_exits_14_as_best_does(nemo_checkpoint, tmp_path, capsys):
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", [nemo_checkpoint.name])
    assert main([str(root), "--best"]) == 14
    assert "recorded no monitored metric" in capsys.readouterr().err
    code, log = watch(root, "--frequency", "best")
    assert code == 14, log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "recorded no monitored metric" in errors[0] and errors[0].endswith("(exit code 14)")
    assert "0 consolidated" in log.splitlines()[-1] and not (root / nemo_checkpoint.name / "consolidated").exists()


def test_best_that_never_ranks_a_checkpoint_waits_then_exits_14(nemo_checkpoint, tmp_path, monkeypatch):
    """A run that monitors a metric but has ranked no checkpoint yet (``best_model_path`` empty in its state; stubbed:
    NeMo writes it only after validation): the watcher waits; at --until-idle it exits 14."""
    import nemo_patch.runs.best_checkpoint as best_checkpoint

    def not_yet(*args, **kwargs):
        error = best_checkpoint.NoMonitoredMetricError(
            "ModelCheckpoint(monitor='val_loss') has ranked no checkpoint yet"
        )
        error.transient = True
        raise error

    monkeypatch.setattr(best_checkpoint, "find_best_checkpoint", not_yet)
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", [nemo_checkpoint.name])
    watcher = make_watcher(root, "best")
    assert watcher.run() == 14
    log = watcher.out.getvalue().splitlines()
    assert any(line.startswith("no best checkpoint yet:") for line in log), log
    assert log[-2].startswith("error: ModelCheckpoint(monitor='val_loss') has ranked no checkpoint yet"), log


def test_a_restarted_watcher_counts_the_outputs_it_found_done(nemo_checkpoint, tmp_path):
    names = ["model--step=3-consumed_samples=8.0", "model--step=5-consumed_samples=12.0"]
    root = nemo_root(nemo_checkpoint, tmp_path / "checkpoints", names)
    first = make_watcher(root)
    assert first.run() == 0
    assert "2 consolidated" in first.out.getvalue().splitlines()[-1] and "0 already done" in first.out.getvalue()
    shutil.copytree(nemo_checkpoint, root / "model--step=7-consumed_samples=16.0")
    again = make_watcher(root)
    assert again.run() == 0
    summary = again.out.getvalue().splitlines()[-1]
    assert "1 consolidated" in summary and "2 already done" in summary, again.out.getvalue()


def test_list_of_a_megatron_save_directory(megatron_copy):
    """``--list --json`` of a Megatron-LM save directory after a watch: every iter_N with its iteration as the global
    step, the one the tracker has not reached unfinished, the consolidated ones complete and LATEST marked."""
    code, log = watch(megatron_copy)
    assert code == 0, log
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([str(megatron_copy), "--list", "--json"]) == 0
    listing = json.loads(out.getvalue())
    assert listing["layout"] == "megatron" and listing["latest"] == os.readlink(megatron_copy / "LATEST")
    rows = {entry["name"]: entry for entry in listing["checkpoints"]}
    assert sorted(rows) == [f"iter_{i:07d}" for i in ITERATIONS]
    assert [rows[f"iter_{i:07d}"]["global_step"] for i in ITERATIONS] == list(ITERATIONS)
    assert [rows[f"iter_{i:07d}"]["finished"] for i in ITERATIONS] == [True, True, False]
    for i in (100, 200):
        (output,) = rows[f"iter_{i:07d}"]["outputs"]
        assert output["complete"] and output["format"] == "safetensors" and output["digests"] == "recorded"
    assert rows["iter_0000200"]["marks"] == ["LATEST"] and not rows["iter_0000300"]["outputs"]
