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

"""Writer processes and publishing: several writers write the bytes one writer writes; a killed consolidation's
temporary output is found by its lock and removed; an existing output is replaced atomically, nothing else is."""

import json
import subprocess
import sys

import pytest

from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.errors import OutputExistsError
from nemo_patch.engine.publish import TMP_PREFIX, remove_stale_tmp_dirs

pytestmark = [pytest.mark.unit, pytest.mark.run_only_on("CPU")]

#: Starts a consolidation in a child process and kills it (SIGKILL) once its temporary output holds its lock (a kill
#: between the directory's creation and its lock leaves a directory that only its age makes stale, after minutes).
KILLED = """
import os, signal, sys, threading, time
from pathlib import Path
from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.engine.publish import TMP_LOCK_NAME
def watch():
    while not list(Path(sys.argv[2]).parent.glob(".consolidated.tmp-*/" + TMP_LOCK_NAME)):
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
consolidate_checkpoint(sys.argv[1], sys.argv[2], max_shard_size=2_000)
"""


def _files(directory):
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def test_several_writers_write_the_bytes_one_writer_writes(moe_checkpoint, tmp_path):
    one = consolidate_checkpoint(moe_checkpoint[0], tmp_path / "one", max_shard_size=20_000).output_dir
    three = consolidate_checkpoint(moe_checkpoint[0], tmp_path / "three", max_shard_size=20_000, workers=3)
    assert _files(three.output_dir) == _files(one) and len(_files(one)) > 3


def test_a_killed_consolidation_leaves_temporary_output_that_is_removed_later(moe_checkpoint, tmp_path):
    out = tmp_path / "outputs" / "out"
    out.parent.mkdir()
    proc = subprocess.run([sys.executable, "-c", KILLED, str(moe_checkpoint[0]), str(out)], capture_output=True)
    assert proc.returncode == -9 and not out.exists()
    (left,) = out.parent.glob(f"{TMP_PREFIX}*")
    assert remove_stale_tmp_dirs(out.parent) == [left] and not left.exists()


#: Run in another process while outputs are replaced: it opens the output directory by its name again and again and
#: records what it finds there unless the name moved to another directory during the look (then nothing can be said:
#: a rename changes a directory's ctime, so a reused inode number is not taken for the same directory).
READER = """
import json, os, sys
out, stop = sys.argv[1], sys.argv[2]
expected = json.loads(sys.argv[3])
seen, wrong, directories = 0, [], set()
while not os.path.exists(stop):
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        wrong.append(f"no directory: {error}")
        continue
    before = os.fstat(fd)
    try:
        found = {name: os.stat(name, dir_fd=fd).st_size for name in os.listdir(fd)}
    except FileNotFoundError:
        found = None
    os.close(fd)
    try:
        after = os.stat(out)
    except OSError as error:
        wrong.append(f"no directory: {error}")
        continue
    if (after.st_ino, after.st_ctime_ns) != (before.st_ino, before.st_ctime_ns):  # renamed meanwhile (ctime)
        continue
    seen += 1
    directories.add((before.st_ino, before.st_ctime_ns))  # a new directory may reuse a removed one's inode number
    if found is None or sorted(found) != sorted(expected) or any(
            found[name] != size for name, size in expected.items() if name.endswith(".safetensors")):
        wrong.append(found)
print(json.dumps({"seen": seen, "wrong": wrong[:5], "directories": len(directories)}))
"""


def test_an_output_is_replaced_atomically_and_nothing_else_is(moe_checkpoint, tmp_path):
    first = consolidate_checkpoint(moe_checkpoint[0], tmp_path / "out", max_shard_size=20_000).output_dir
    expected = {path.name: path.stat().st_size for path in first.iterdir()}
    stop = tmp_path / "stop"
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(first), str(stop), json.dumps(expected)], stdout=subprocess.PIPE, text=True
    )
    try:
        for workers in (1, 2):  # several files, written by one and by two writer processes
            again = consolidate_checkpoint(
                moe_checkpoint[0], tmp_path / "out", max_shard_size=20_000, workers=workers, overwrite=True
            )
            assert again.output_dir == first
    finally:
        stop.touch()
        observed = json.loads(reader.communicate(timeout=60)[0])
    # the name always held a complete output, old or new, and the reader saw it across the replacements
    assert observed["wrong"] == [] and observed["seen"] > 10 and observed["directories"] >= 2, observed
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(OutputExistsError):
        consolidate_checkpoint(moe_checkpoint[0], tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
