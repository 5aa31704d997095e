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

"""Progress in job logs: with stderr a file, ``nemo-consolidate`` and ``--watch`` print progress lines at a bounded
rate (``--progress-interval``), fed by the consolidation's byte counters; on the session's real checkpoint."""

import io
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO

from nemo_patch.cli.progress import LogProgress
from nemo_patch.cli.watch import human_size

LINE = re.compile(
    r"^nemo-consolidate: progress(?: (?P<label>\S+))?: (?P<done>[\d.]+ [KMG]?B) of (?P<total>[\d.]+ [KMG]?B)"
    r" \((?P<percent>\d+)%\), (?P<rate>[\d.]+ [KMG]?B)/s, (?:about (?P<left>\d+) s left|time left unknown)$"
)


def test_lines_are_bounded_by_the_interval_and_say_done_total_rate_and_time_left():
    now = [0.0]
    out = io.StringIO()
    progress = LogProgress(out, human_size, interval=10.0, label="ckpt", clock=lambda: now[0])
    total = 100_000_000
    for second in range(1, 101):  # 1 MB/s for 100 s, one call every 0.5 s
        for half in (0.5, 1.0):
            now[0] = second - 1 + half
            progress(int(now[0] * 1_000_000), total)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 == progress.lines  # t = 10, 20, ..., 100
    first = LINE.match(lines[0])
    assert first and first["label"] == "ckpt" and first["done"] == "10.0 MB" and first["total"] == "100.0 MB"
    assert first["percent"] == "10" and first["rate"] == "1.0 MB" and first["left"] == "90", lines[0]
    assert LINE.match(lines[-1])["left"] == "0"


def _progress_lines(stderr: str) -> "list[str]":
    lines = [line for line in stderr.splitlines() if line.startswith("nemo-consolidate: progress")]
    assert all(LINE.match(line) for line in lines), lines
    return lines


def test_the_cli_prints_bounded_progress_lines_when_stderr_is_a_file(checkpoint_copy, tmp_path):
    log = tmp_path / "job.log"
    command = [sys.executable, "-m", "nemo_patch", str(checkpoint_copy), "--workers", "1", "--progress-interval"]
    started = time.monotonic()
    with open(log, "w") as stderr:
        proc = subprocess.run(command + ["0.001"], stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO)
    wall = time.monotonic() - started
    assert proc.returncode == 0, log.read_text()
    lines = _progress_lines(log.read_text())
    assert 1 <= len(lines) <= wall / 0.001 + 1, log.read_text()
    units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    done = [float(size.split()[0]) * units[size.split()[1]] for size in (LINE.match(line)["done"] for line in lines)]
    assert done == sorted(done)
    summary = re.search(r"tensors, ([\d.]+ [KMG]?B) in ", proc.stdout)
    assert summary and {LINE.match(line)["total"] for line in lines} == {summary.group(1)}, proc.stdout
    shutil.rmtree(checkpoint_copy / "consolidated")
    with open(log, "w") as stderr:  # the default interval (30 s): a short run prints no progress line
        proc = subprocess.run(command[:-1], stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO)
    assert proc.returncode == 0 and not _progress_lines(log.read_text()), log.read_text()


def test_the_watcher_prints_progress_lines_naming_the_checkpoint(checkpoint_copy, tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    checkpoint = Path(shutil.move(str(checkpoint_copy), str(root / "tiny_gpt--step=5-consumed_samples=12.0")))
    log = tmp_path / "watch.err"
    command = [sys.executable, "-m", "nemo_patch", "--watch", str(root), "--until-idle", "0.5", "--poll-interval",
               "0.1", "--workers", "1", "--progress-interval", "0.001"]  # fmt: skip
    with open(log, "w") as stderr:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0 and (checkpoint / "consolidated").is_dir(), proc.stdout + log.read_text()
    lines = _progress_lines(log.read_text())
    assert lines and {LINE.match(line)["label"] for line in lines} == {checkpoint.name}, log.read_text()
