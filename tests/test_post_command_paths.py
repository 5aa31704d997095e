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

"""Post commands that find their files (#38 items 5-7): absolute ``{output}``/``{checkpoint}`` and variables, the job's
working directory, the global step offline, and a command that ends with the process that runs it; in-process, with
the real CLI on a real checkpoint, and one real fit into a relative log directory."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

from nemo_patch.cli.nemo_consolidate import main
from nemo_patch.runs.post_command import run_post_command

#: A script a new user would write beside the job: it checks what it is given and prints one metrics line.
POST_SH = """set -e
test "$1" = "$NEMO_CONSOLIDATED_OUTPUT"
test "$2" = "$NEMO_CONSOLIDATED_CHECKPOINT"
case "$1" in /*) ;; *) echo "relative output: $1" >&2; exit 5 ;; esac
case "$2" in /*) ;; *) echo "relative checkpoint: $2" >&2; exit 6 ;; esac
test -f "$1/metadata.json"
test -d "$2/weights" || test -d "$2"
echo "{\\"post/step\\": ${NEMO_CONSOLIDATED_GLOBAL_STEP:--1}}"
echo "ran in $(pwd)" >&2
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie nobody reaps (PID 1 of a container may not) has ended


def test_relative_paths_become_absolute_and_the_command_runs_in_the_job_directory(tmp_path, monkeypatch):
    job = tmp_path / "job"
    output = job / "runs" / "x" / "ckpt" / "consolidated"
    output.mkdir(parents=True)
    (output / "metadata.json").write_text(json.dumps({"global_step": 4}))
    (job / "post.sh").write_text(POST_SH)
    monkeypatch.chdir(job)
    result = run_post_command("sh post.sh {output} {checkpoint}", Path("runs/x/ckpt/consolidated"), "safetensors", 4,
                              Path("runs/x/ckpt"), timeout=60)  # fmt: skip
    log = Path(result.log).read_text()
    assert result.ok, log
    assert result.metrics == {"post/step": 4.0}
    assert f"ran in {job}" in log  # the job's working directory, where post.sh is
    assert Path(result.log) == output.parent / "consolidated.post-command.log" and Path(result.log).is_absolute()


def test_the_command_and_its_children_end_when_the_process_running_it_is_sigkilled(tmp_path):
    output = tmp_path / "ckpt" / "consolidated"
    output.mkdir(parents=True)
    (output / "metadata.json").write_text("{}")
    pids = tmp_path / "pids"
    # a compound command (no shell can exec it) with a child that ignores SIGTERM: SIGKILL 2 s later ends it too
    command = (
        f"(trap '' TERM; sleep 120) & echo $! > {pids}.tmp; sleep 120 & echo $! >> {pids}.tmp; "
        f"mv {pids}.tmp {pids}; wait"
    )
    code = (
        "import sys; from nemo_patch.runs.post_command import run_post_command as r; "
        f"r(sys.argv[1], {str(output)!r}, 'safetensors', 2, {str(output.parent)!r}, timeout=600)"
    )
    runner = subprocess.Popen([sys.executable, "-c", code, command], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not pids.exists():
            assert time.monotonic() < deadline and runner.poll() is None, "the command never started"
            time.sleep(0.1)
        started = [int(line) for line in pids.read_text().split()]
        assert len(started) == 2 and all(_alive(pid) for pid in started)
        runner.send_signal(signal.SIGKILL)
        runner.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in started if _alive(pid)], "the command outlived its consolidation process"
    finally:
        runner.kill()
        for pid in [int(line) for line in pids.read_text().split()] if pids.exists() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _offline(checkpoint_copy, tmp_path, monkeypatch) -> Path:
    """``nemo-consolidate runs/x/ckpt --post-command "sh post.sh {output} {checkpoint}"`` run from the job's directory,
    where ``post.sh`` is; returns the output."""
    job = tmp_path / "job"
    (job / "runs" / "x").mkdir(parents=True)
    checkpoint_copy.rename(job / "runs" / "x" / checkpoint_copy.name)
    (job / "post.sh").write_text(POST_SH)
    monkeypatch.chdir(job)
    code = main(["runs/x/ckpt", "--quiet", "--workers", "1", "--post-command", "sh post.sh {output} {checkpoint}"])
    output = job / "runs" / "x" / "ckpt" / "consolidated"
    assert code == 0, (output.parent / "consolidated.post-command.log").read_text()
    return output


def test_offline_relative_checkpoint_and_a_script_beside_the_job(checkpoint_copy, each_run, tmp_path, monkeypatch):
    output = _offline(checkpoint_copy, tmp_path, monkeypatch)
    post = json.loads((output / "metadata.json").read_text())["post_command"]
    assert post["returncode"] == 0 and Path(post["log"]).is_absolute()
    # the output is the checkpoint's: tensor for tensor the training run's output of the same checkpoint
    ours = load_file(str(output / "model.safetensors"))
    theirs = load_file(str(each_run["root"] / "LATEST" / "consolidated" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
def test_a_fit_into_a_relative_log_dir_runs_every_post_command(tmp_path):
    """A real fit, started in the job's directory with ``--out runs/x`` (a relative ``log_dir``), whose post command
    is a script beside the job: every output's command succeeds. NeMo's top-k keeps one checkpoint: the output of the
    one it removes is retained, and its command's log moves with it (item 7)."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "post.sh").write_text(POST_SH)
    env = {k: v for k, v in os.environ.items() if k != "NEMO_PATCH_DISABLE"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    args = [sys.executable, "-m", "nemo_patch.testing.fit_run", "--out", "runs/x", "--json", "report.json",
            "--frequency", "each", "--max-steps", "4", "--save-every", "2", "--max-pending", "4",
            "--save-top-k", "1", "--monitor", "step", "--wait-for-consolidation",
            "--post-command", "sh post.sh {output} {checkpoint}"]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900, cwd=job)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    metadata = sorted(job.glob("runs/x/**/consolidated/metadata.json"))
    assert len(metadata) >= 2, (proc.stdout + proc.stderr)[-3000:]
    for path in metadata:
        recorded = json.loads(path.read_text())
        post = recorded["post_command"]
        assert post["returncode"] == 0 and post["error"] is None, Path(post["log"]).read_text()
        assert post["metrics"] == {"post/step": float(recorded["global_step"])}
        assert Path(post["log"]).is_absolute()
        assert "ran in " in Path(post["log"]).read_text()
        entry = path.parent.parent
        if not entry.is_symlink() and not re.search(r"-last(-v\d+)?$", entry.name):  # a copy's names its step's log
            assert Path(post["log"]) == entry / "consolidated.post-command.log"  # beside this very output
    retained = [path for path in metadata if path.parent.parent.parent.name == "retained"]
    assert retained, [str(path) for path in metadata]
    for path in retained:  # NeMo removed its checkpoint: the log lives on beside the retained output
        assert not (path.parent.parent.parent.parent / json.loads(path.read_text())["retained_from"]).exists()


def test_offline_global_step_is_the_training_runs_from_common_pt(checkpoint_copy, each_run, tmp_path, monkeypatch):
    """Offline, ``metadata.json``'s ``global_step``, ``{global_step}`` and ``NEMO_CONSOLIDATED_GLOBAL_STEP`` are the
    global step the training run recorded for the same checkpoint (its own output's ``metadata.json``), read from
    Lightning's ``common.pt``: the copy is named ``ckpt``, so the name cannot give it."""
    trained = json.loads((each_run["root"] / "LATEST" / "consolidated" / "metadata.json").read_text())
    assert isinstance(trained["global_step"], int) and trained["global_step"] > 0
    output = _offline(checkpoint_copy, tmp_path, monkeypatch)
    metadata = json.loads((output / "metadata.json").read_text())
    assert metadata["global_step"] == trained["global_step"]
    assert metadata["post_command"]["metrics"] == {"post/step": float(trained["global_step"])}  # from the variable


def test_global_step_without_common_pt_comes_from_the_name(checkpoint_copy, each_run, tmp_path):
    """NeMo's ``step=N`` names the step before Lightning's global step: checked on every checkpoint of a real run
    (name against ``common.pt``), then the name is what a checkpoint without a readable ``common.pt`` gets."""
    from nemo_patch.engine.save_identity import global_step_of as checkpoint_global_step

    checked = 0
    for path in sorted(each_run["root"].iterdir()):
        if (path / "weights" / "common.pt").is_file() and "step=" in path.name:
            common = torch.load(path / "weights" / "common.pt", map_location="cpu", weights_only=False)
            assert checkpoint_global_step(path) == common["global_step"]
            name_step = int(path.name.split("step=")[1].split("-")[0])
            assert common["global_step"] == name_step + 1
            checked += 1
    assert checked >= 3
    renamed = tmp_path / "tiny_gpt--step=11-consumed_samples=48.0"
    checkpoint_copy.rename(renamed)
    (renamed / "weights" / "common.pt").write_bytes(b"not a torch file")
    assert checkpoint_global_step(renamed) == 12
    assert checkpoint_global_step(tmp_path / "no-step-here") is None
