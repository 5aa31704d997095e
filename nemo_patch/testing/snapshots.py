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

"""Keep a copy of every finished checkpoint's weights, so that tests can compare outputs that outlive it.

NeMo's top-k retention removes checkpoints during a run; an output kept after its checkpoint is gone
(:mod:`nemo_patch.training.retention`) can then only be checked against a copy taken while the checkpoint existed.
:class:`CheckpointSnapshots` hard-links the DCP files of each finished checkpoint into ``<dir>/<checkpoint name>/
weights`` (no data is copied; removal of the original only drops one name of each file).

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import os
from pathlib import Path
from typing import Any, Set

from lightning.pytorch.callbacks import Callback

from nemo_patch.engine.checkpoint_layout import is_marked_unfinished, weights_written

__all__ = ["CheckpointSnapshots"]


class CheckpointSnapshots(Callback):
    """Hard-links each finished checkpoint's ``weights/`` into ``directory/<name>/weights`` once it is seen.

    Runs in ``on_train_batch_end`` (Lightning orders checkpoint callbacks last, so a checkpoint saved at step ``s`` is
    seen at step ``s + 1``, before a save at ``s + 2`` can remove it) and at the end of ``fit``. Global rank 0 only.

    Args:
        directory: where the snapshots go.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._seen: Set[str] = set()

    def _snapshot(self, trainer: Any) -> None:
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        if not trainer.is_global_zero or not dirpath or not Path(dirpath).is_dir():
            return
        for checkpoint in Path(dirpath).iterdir():
            weights = checkpoint / "weights"
            if checkpoint.name in self._seen or checkpoint.is_symlink() or not weights.is_dir():
                continue
            if not weights_written(weights):
                continue
            if is_marked_unfinished(checkpoint):
                continue
            target = self.directory / checkpoint.name / "weights"
            if target.exists():  # taken by an earlier run of a resumed training
                self._seen.add(checkpoint.name)
                continue
            target.mkdir(parents=True, exist_ok=True)
            for file in weights.rglob("*"):  # zarr: one directory per array
                if file.is_file():
                    (target / file.relative_to(weights)).parent.mkdir(parents=True, exist_ok=True)
                    os.link(file, target / file.relative_to(weights))
            self._seen.add(checkpoint.name)

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        """Snapshot the checkpoints that finished so far."""
        self._snapshot(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Snapshot the checkpoints saved at the end of ``fit``."""
        self._snapshot(trainer)
