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

"""The ``"best"`` cadence, ``LATEST``/``BEST`` and outputs kept past NeMo's top-k removal, in a real fit: every
checkpoint ``ModelCheckpoint`` ranked best when it was saved is consolidated, the outputs of those that top-k then
removed live on under ``<root>/retained/``, and each output holds exactly the tensors its checkpoint held."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file
from tiny_fit import checkpoint_tensors, checkpoints, fit

METRIC = "reduced_train_loss"


@pytest.fixture(scope="module")
def best_run(tmp_path_factory):
    """4 steps, a checkpoint each, ``ModelCheckpoint(monitor="reduced_train_loss", mode="min", save_top_k=2)``,
    ``ckpt_consolidation_frequency="best"``; every checkpoint's weights hard-linked aside when saved (``snapshots/``).
    """
    options = dict(ckpt_consolidation_frequency="best", monitor=METRIC, save_top_k=2, snapshots=True)
    return fit("best", 4, tmp_path_factory, **options)


def _metric(name):
    return float(re.search(rf"{METRIC}=([0-9.]+)", name).group(1))


def test_best_checkpoints_are_consolidated_and_kept_past_top_k(best_run, tmp_path):
    root = best_run / "tiny_gpt" / "checkpoints"
    # every checkpoint of the run, in save order (top-k saves none that would not enter the top 2)
    saved = [p.name for p in checkpoints(best_run / "snapshots")]
    assert len(saved) >= 3
    improving = [name for i, name in enumerate(saved) if all(_metric(name) < _metric(e) for e in saved[:i])]
    remaining = {p.name for p in checkpoints(root)}
    assert remaining == set(sorted(saved, key=_metric)[:2])  # NeMo's top-2 by the metric
    retained = {p.name for p in (root / "retained").iterdir()} if (root / "retained").is_dir() else set()
    assert retained == set(improving) - remaining and retained, (saved, improving, remaining)
    for name in saved:  # consolidated exactly when it was the best so far; the output of a removed one is kept
        output = (root / name if name in remaining else root / "retained" / name) / "consolidated"
        assert output.is_dir() == (name in improving), name
        if name not in improving:
            continue
        expected = checkpoint_tensors(best_run / "snapshots" / name / "weights", tmp_path)
        tensors = load_file(output / "model.safetensors")
        assert set(tensors) == set(expected) and all(torch.equal(tensors[n], t) for n, t in expected.items()), name
        metadata = json.loads((output / "metadata.json").read_text())
        assert metadata["best"]["monitor"] == METRIC and metadata["best"]["mode"] == "min"
        assert metadata.get("retained_from") == (None if name in remaining else name)


def test_best_and_latest_name_consolidated_outputs(best_run):
    root = best_run / "tiny_gpt" / "checkpoints"
    saved = [p.name for p in checkpoints(best_run / "snapshots")]
    best = min(saved, key=_metric)
    assert os.readlink(root / "BEST") == best  # relative links, inside the root
    assert os.readlink(root / "LATEST") == best  # the newest consolidated checkpoint is the best one here
    assert (root / "BEST" / "consolidated" / "metadata.json").is_file()
