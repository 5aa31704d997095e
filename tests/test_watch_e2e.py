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

"""The sidecar beside a real training run: stock NeMo (the overlay off) trains on the CPU with async saves, NeMo's
top-k removal and ``-last`` copies, while ``nemo-consolidate --watch`` runs in another process on its checkpoint root.
Every output is compared with megatron-core's own reading of its checkpoint (``nemo_patch.testing.mcore_compare``)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, run_fit_process

from nemo_patch.cli.watch import output_is_complete
from nemo_patch.runs.run_checkpoints import list_run_checkpoints
from nemo_patch.testing.mcore_compare import compare

pytestmark = pytest.mark.slow


def test_a_watcher_beside_a_stock_nemo_fit(tmp_path):
    out = tmp_path / "run"
    root = out / "tiny_gpt" / "checkpoints"
    log = tmp_path / "watch.log"
    with open(log, "w") as handle:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "nemo_patch", "--watch", str(root), "--poll-interval", "0.2", "--workers", "1"],
            stdout=handle, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
        try:
            fit = run_fit_process(out, stock=True, max_steps=8, save_every=2, save_top_k=2, async_save=True,
                                  monitor="reduced_train_loss")  # fmt: skip
            assert fit.returncode == 0, (fit.stdout + fit.stderr)[-6000:]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                finished = list_run_checkpoints(root).finished
                if finished and all(output_is_complete(c.path, c.path / "consolidated") for c in finished):
                    break
                time.sleep(0.5)
        finally:
            watcher.send_signal(signal.SIGTERM)
            code = watcher.wait(timeout=120)
    text = log.read_text()
    assert code == 0, text
    assert "Error removing checkpoint" not in fit.stdout + fit.stderr, "the watcher got in the way of NeMo's removal"
    finished = list_run_checkpoints(root).finished
    assert {c.global_step for c in finished if not c.copy} and any(c.copy for c in finished), [
        c.path for c in finished
    ]
    for checkpoint in finished:
        output = checkpoint.path / "consolidated"
        assert output_is_complete(checkpoint.path, output), (checkpoint.path.name, text)
        assert compare(checkpoint.path / "weights", output) > 0
    for copy in (c for c in finished if c.copy):
        own = [c for c in finished if c.global_step == copy.global_step and not c.copy]
        if own:  # the copy's output is its step's, hard-linked
            files = (
                own[0].path / "consolidated" / "model.safetensors",
                copy.path / "consolidated" / "model.safetensors",
            )
            assert files[0].stat().st_ino == files[1].stat().st_ino
    newest = max(c.global_step for c in finished)
    assert os.readlink(root / "LATEST") in {c.path.name for c in finished if c.global_step == newest}
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "temporary entries left in the root"
    assert not list(root.glob("*/.consolidated.tmp-*")), "nothing staged inside a checkpoint"
    consolidated = [line for line in text.splitlines() if line.startswith("Consolidated ")]
    assert consolidated and all(" tensors, " in line for line in consolidated), text
    assert text.splitlines()[-1].startswith(f"Watched {root} for ")
