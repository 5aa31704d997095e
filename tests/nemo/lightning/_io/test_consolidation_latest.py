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

"""``<root>/LATEST``, outputs kept past NeMo's top-k removal and the callbacks' hooks, on outputs consolidated from
checkpoints megatron-core saves; their weights are checked against PyTorch's own ``dcp_to_torch_save``. A real fit
that writes ``LATEST`` and calls ``on_consolidation_end`` is the strategy's test
(``test_megatron_strategy_consolidation.py``)."""

import logging
import os
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file

from nemo_patch.engine.consolidate import consolidate_checkpoint
from nemo_patch.training.config import ConsolidationConfig
from nemo_patch.training.hooks import ConsolidationOutcome, HookCaller
from nemo_patch.training.latest import locate_checkpoint, moves_forward, output_order, update_latest_pointer
from nemo_patch.training.retention import prune_retained, retain_output

pytestmark = [pytest.mark.unit, pytest.mark.run_only_on("CPU")]


@pytest.fixture
def root(tmp_path, moe_checkpoint):
    """A checkpoint root with two consolidated checkpoints of one run's saves, global steps 4 and 6."""
    for name in ("model--step=3", "model--step=5"):
        shutil.copytree(moe_checkpoint[0], tmp_path / name)
        consolidate_checkpoint(tmp_path / name, run="run-a")
    return tmp_path


def _equal(output: Path, expected) -> bool:
    tensors = load_file(output / "model.safetensors")
    return tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in expected)


def test_latest_names_the_newest_output_and_never_moves_back(root, moe_checkpoint):
    older, newer = root / "model--step=3", root / "model--step=5"
    update_latest_pointer(newer)
    assert os.readlink(root / "LATEST") == "model--step=5"  # relative: the run directory can be moved
    assert locate_checkpoint(root).checkpoint_dir == newer
    assert _equal(root / "LATEST" / "consolidated", moe_checkpoint[1])
    older_order, newer_order = output_order(older / "consolidated"), output_order(newer / "consolidated")
    assert newer_order.run == "run-a" and newer_order.key is not None
    assert moves_forward(newer_order, older_order) and not moves_forward(older_order, newer_order)


def test_an_output_outlives_its_removed_checkpoint_up_to_keep(root, moe_checkpoint):
    older = root / "model--step=3"
    entry = retain_output(older, "consolidated")
    assert entry == root / "retained" / "model--step=3"
    shutil.rmtree(older)  # what NeMo's top-k removal does next
    assert _equal(entry / "consolidated", moe_checkpoint[1])
    assert prune_retained(root, "consolidated", keep=2, run="run-a") == []
    assert prune_retained(root, "consolidated", keep=1, run="run-a") == [entry] and not entry.exists()
    assert (root / "model--step=5" / "consolidated" / "model.safetensors").is_file()  # inside a checkpoint: kept
    with pytest.raises(ValueError, match="keep"):
        ConsolidationConfig(keep=-1)


def test_a_raising_hook_is_logged_once_and_the_others_still_run(caplog):
    calls = []

    class Raising(pl.Callback):
        def on_consolidation_end(self, trainer, pl_module, result):
            raise RuntimeError("broken hook")

    class Recording(pl.Callback):
        def on_consolidation_end(self, trainer, pl_module, result):
            calls.append(("end", result.global_step))

        def on_consolidation_failed(self, trainer, pl_module, result):
            calls.append(("failed", result.error))

    trainer = pl.Trainer(callbacks=[Raising(), Recording()], logger=False, enable_checkpointing=False)
    call = HookCaller()
    with caplog.at_level(logging.DEBUG):
        for step, error in ((2, None), (4, "ConsolidationError: no space left"), (6, None)):
            call(
                trainer,
                None,
                ConsolidationOutcome(Path(f"c{step}/out"), Path(f"c{step}"), "safetensors", step, error=error),
            )
    assert calls == [("end", 2), ("failed", "ConsolidationError: no space left"), ("end", 6)]
    errors = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 1 and "Raising.on_consolidation_end raised" in errors[0].getMessage()
