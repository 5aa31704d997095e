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

"""A job SIGKILLed between a removal's record and its delete, with async save on 2 ranks (#38), then resumed.

Real CPU fits of 2 processes on gloo (``ckpt_async_save=True``: NeMo finalizes saves and removes checkpoints from its
own thread). Every output is compared tensor for tensor with the snapshot of the checkpoint it was made from, and
every pointer checked, after the kill and after the resume.
"""

import json
import os
import re
from pathlib import Path

import pytest
from conftest import run_fit
from test_training_truth_e2e import (
    _assert_no_strays,
    _assert_outputs_are_their_checkpoints,
    _assert_pointers_resolve,
    _errors,
)

from nemo_patch.testing.faults import KILLED_AT_REMOVAL
from nemo_patch.training.journal import JOURNAL_NAME
from nemo_patch.training.retention import RETAINED_DIRNAME, consolidated_outputs

pytestmark = pytest.mark.slow


def test_a_job_killed_between_a_removals_record_and_its_delete_resumes_consistently(tmp_path):
    """Run A (2 ranks, async save, ``each``, a save every step, ``save_top_k=2``) is SIGKILLed with its consolidation
    process at NeMo's 2nd removal of a consolidated checkpoint, after the coordinator kept its output under
    ``retained/`` and moved ``LATEST`` off it, before NeMo deleted a file. The root is consistent as it is left (no
    visible partial output, ``LATEST`` on a complete output, a readable journal naming existing checkpoints); run B
    resumes it (2 ranks, async save) without an error, and every output is its own checkpoint's weights."""
    common = dict(frequency="each", save_every=1, monitor="step", save_top_k=2, devices=2, async_save=True,
                  wait_for_consolidation=True, snapshot_checkpoints=True, info_logs=True)  # fmt: skip
    with pytest.raises(pytest.fail.Exception, match=r"rc=-9"):
        run_fit(tmp_path, max_steps=20, fault="killremoval:2", **common)
    root = tmp_path / "tiny_gpt" / "checkpoints"
    kept = [json.loads((o.output_dir / "metadata.json").read_text())["retained_from"]
            for o in consolidated_outputs(root, "consolidated") if o.retained]  # fmt: skip
    # The checkpoint whose removal was cut off: not a file deleted yet, its output kept (a -last copy's: held by its
    # step's checkpoint or kept from it).
    removing = Path(json.loads((root.parent / KILLED_AT_REMOVAL).read_text())["checkpoint"])
    assert (removing / "weights" / ".metadata").is_file() and (removing / "consolidated" / "metadata.json").is_file()
    own = removing.name.split("-last")[0]
    assert own in kept or (root / own / "consolidated" / "metadata.json").is_file(), (removing.name, kept)
    _assert_pointers_resolve(root)
    assert os.path.realpath(root / "LATEST") != str(removing.resolve())
    if (root / JOURNAL_NAME).exists():
        for entry in json.loads((root / JOURNAL_NAME).read_text())["due"]:
            assert (root / entry["checkpoint"] / "weights").is_dir(), entry
    assert _assert_outputs_are_their_checkpoints(root, tmp_path / "snapshots") >= 2

    last_step = max(int(m.group(1)) for m in (re.search(r"step=(\d+)", p.name) for p in root.iterdir()) if m)
    max_steps = last_step + 3
    report = run_fit(tmp_path, max_steps=max_steps, **common)
    log = (tmp_path / "fit.log").read_text()
    assert report["resumed_from"] is not None
    assert report["consolidation_errors"] == [] and _errors(log) == [], _errors(log)
    assert not any(re.search(r"WARNING .*(journal|not kept)", line) for line in log.splitlines()), log[-4000:]
    _assert_pointers_resolve(root)
    _assert_no_strays(root)
    assert not (root / JOURNAL_NAME).exists()
    steps = {o.global_step for o in consolidated_outputs(root, "consolidated")}
    assert {max_steps - 1, max_steps} <= steps, steps
    assert (root / RETAINED_DIRNAME).is_dir()
    assert _assert_outputs_are_their_checkpoints(root, tmp_path / "snapshots") >= 4
    assert json.loads((root / "LATEST" / "consolidated" / "metadata.json").read_text())["global_step"] == max_steps
