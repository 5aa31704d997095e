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

"""Until the PEFT patch, a PEFT adapter checkpoint is refused rather than consolidated as a model (the PEFT patch
consolidates adapters, and removes this test)."""

import json
import shutil

import pytest
from nemo.lightning.io.consolidation.engine.consolidate import consolidate_checkpoint
from nemo.lightning.io.consolidation.engine.errors import AdapterCheckpointError


def test_an_adapter_checkpoint_is_refused(dist_checkpoint, tmp_path):
    checkpoint, _ = dist_checkpoint
    copy = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, copy)
    (copy / "weights" / "adapter_metadata.json").write_text(json.dumps({"model_ckpt_path": str(checkpoint)}))
    with pytest.raises(AdapterCheckpointError, match="adapter"):  # never written as a model
        consolidate_checkpoint(copy)
    assert not (copy / "consolidated").exists()
