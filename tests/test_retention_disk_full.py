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

"""Retention's move of an output to ``retained/`` on a really full disk (#38): a 64 KiB tmpfs, filled up.

The hard links need no room, the rewritten ``metadata.json`` does: keeping fails with ``ENOSPC``, leaves no entry and
no staging directory behind, the checkpoint's output is untouched, and ``LATEST`` then moves off the checkpoint or is
removed, never left dangling. (``keepfail`` in :mod:`nemo_patch.testing.faults` injects the same error into a fit.)
"""

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from nemo_patch.training.latest import LATEST_NAME, update_latest_pointer
from nemo_patch.training.retention import RETAINED_DIRNAME, repoint_latest, retain_output


def _checkpoint_with_output(root: Path, name: str, step: int) -> Path:
    checkpoint = root / name
    (checkpoint / "weights").mkdir(parents=True)
    (checkpoint / "weights" / ".metadata").write_bytes(b"dcp")
    output = checkpoint / "consolidated"
    output.mkdir()
    (output / "model.safetensors").write_bytes(b"\0" * 512)
    (output / "metadata.json").write_text(json.dumps({"global_step": step}))
    return checkpoint


def test_keeping_an_output_on_a_full_disk_fails_cleanly_and_latest_never_dangles(tmp_path):
    root = tmp_path / "small"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(root)]).returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here (CI runs as root and may)")
    try:
        checkpoint = _checkpoint_with_output(root, "ckpt-step=3", 3)
        update_latest_pointer(checkpoint)
        (root / RETAINED_DIRNAME).mkdir()
        before = sorted(os.listdir(checkpoint / "consolidated"))
        with pytest.raises(OSError), (root / "filler").open("wb") as filler:
            while True:
                filler.write(b"\0" * 4096)
                filler.flush()
        with pytest.raises(OSError) as raised:
            retain_output(checkpoint, "consolidated")
        assert raised.value.errno == errno.ENOSPC
        assert os.listdir(root / RETAINED_DIRNAME) == []  # no entry, no staging directory
        assert sorted(os.listdir(checkpoint / "consolidated")) == before
        assert json.loads((checkpoint / "consolidated" / "metadata.json").read_text()) == {"global_step": 3}
        try:
            repoint_latest(root, "consolidated", removing=checkpoint)
        except OSError:  # the retention observer then removes LATEST (move_pointer_off)
            (root / LATEST_NAME).unlink(missing_ok=True)
        latest = root / LATEST_NAME
        assert not os.path.lexists(latest) or (latest / "consolidated" / "metadata.json").is_file()
        assert os.path.realpath(latest) != str(checkpoint)
    finally:
        subprocess.run(["umount", str(root)], check=False)
