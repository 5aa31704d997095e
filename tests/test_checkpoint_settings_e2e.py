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

"""Every distributed-checkpoint setting of NeMo's 1.0 -> 2.0 checkpoint migration guide, with consolidation on.

Each is a real CPU training run (``ckpt_consolidation_frequency="every_n:2"``, a save every 2 steps, 4 steps, sync
save): the due checkpoint (global step 4) is consolidated, its tensors equal megatron-core's own load of that
checkpoint (``dist_checkpointing.load_plain_tensors``, :mod:`nemo_patch.testing.mcore_compare`), and the run resumes
from it to step 6 with the same settings. ``ckpt_load_on_device`` is not a NeMo 2.7.3 argument (see the README's
"Checkpoint settings"); its NeMo 2.x name, ``ckpt_load_directly_on_device``, is the one run here.
"""

import json
import subprocess
import sys

import pytest
from conftest import REPO, run_fit

pytestmark = pytest.mark.slow

#: Settings that do not exclude each other share a run (each run saves, consolidates, compares and resumes).
SETTINGS = [
    pytest.param(["save_ckpt_format=zarr"], 1, id="zarr"),
    pytest.param(
        ["ckpt_parallel_save=true", "ckpt_torch_dist_multiproc=2", "ckpt_assume_constant_structure=true"],
        1,
        id="parallel_save-on-multiproc-2-constant-structure",
    ),
    pytest.param(
        ["ckpt_parallel_save=false", "ckpt_load_directly_on_device=false", "ckpt_parallel_load=true"],
        1,
        id="parallel_save-off-load-settings",
    ),
    pytest.param(
        ["ckpt_parallel_save=true", "ckpt_parallel_save_within_dp=true", "ckpt_parallel_save_optim=true"],
        2,
        id="2-processes-fully-parallel-save",
    ),
]


def _due_checkpoint(report):
    consolidated = [entry["name"] for entry in report["checkpoints"] if entry["consolidated"]]
    assert consolidated and all("step=3-" in name for name in consolidated), consolidated
    return sorted(consolidated)[0]  # the step's own checkpoint (its -last copy shares the output)


@pytest.mark.parametrize("settings, devices", SETTINGS)
def test_guide_setting_consolidates_what_megatron_core_loads_and_resumes(tmp_path, settings, devices):
    options = dict(frequency="every_n:2", save_every=2, strategy_arg=settings, devices=devices, max_pending=8)
    report = run_fit(tmp_path, max_steps=4, **options)
    assert report["global_step"] == 4 and report["consolidation_errors"] == []
    root = tmp_path / "tiny_gpt" / "checkpoints"
    checkpoint = root / _due_checkpoint(report)
    backend = json.loads((checkpoint / "weights" / "metadata.json").read_text())["sharded_backend"]
    assert backend == ("zarr" if "save_ckpt_format=zarr" in settings else "torch_dist")
    compare = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_patch.testing.mcore_compare",
            str(checkpoint / "weights"),
            str(checkpoint / "consolidated"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert compare.returncode == 0, compare.stdout[-2000:] + compare.stderr[-3000:]
    assert json.loads(compare.stdout.strip().splitlines()[-1])["compared"] > 0
    resumed = run_fit(tmp_path, max_steps=6, **options)
    assert resumed["global_step"] == 6 and "step=3-consumed_samples" in (resumed["resumed_from"] or "")
    assert resumed["consolidation_errors"] == []


def test_zarr_and_torch_dist_runs_consolidate_to_the_same_bytes(tmp_path):
    """The same seeded CPU training saved as zarr and as torch_dist: the due checkpoint's consolidated files match."""
    outputs = []
    for backend in ("zarr", "torch_dist"):
        out = tmp_path / backend
        report = run_fit(
            out, frequency="every_n:2", max_steps=4, save_every=2, strategy_arg=[f"save_ckpt_format={backend}"]
        )
        checkpoint = out / "tiny_gpt" / "checkpoints" / _due_checkpoint(report)
        outputs.append((checkpoint / "consolidated" / "model.safetensors").read_bytes())
    assert outputs[0] == outputs[1]
