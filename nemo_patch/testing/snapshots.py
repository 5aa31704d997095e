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
:class:`CheckpointSnapshots` hard-links the DCP files of each checkpoint into ``<dir>/<checkpoint name>/weights`` the
moment its save is complete (no data is copied; removal of the original only drops one name of each file).

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import os
import shutil
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

from nemo_patch.training.callback import find_base_checkpoint_io

__all__ = ["CheckpointSnapshots"]


class CheckpointSnapshots(Callback):
    """Hard-links each checkpoint's ``weights/`` into ``directory/<name>/weights`` when its save is complete.

    The checkpoint IO's ``save_checkpoint`` is wrapped when training starts (global rank 0): a sync save is taken as
    soon as it returns, an async one in its finalization (where the IO marks it written, before NeMo's removal of
    anything can start), so a snapshot never races a removal. A name saved again (a second ``fit``, a resumed run)
    keeps its first snapshot.

    Args:
        directory: where the snapshots go.
        copy: copy the files (``shutil.copy2``, times kept) instead of hard-linking them: a hard link changes the
            checkpoint files' change time (``st_ctime``) and shares their inodes, so a checkpoint rewritten in place
            would change its snapshot too, and the product's save identity (which counts inodes and change times)
            would see another save.
    """

    def __init__(self, directory: Path, copy: bool = False) -> None:
        self.directory = Path(directory)
        self.copy = copy

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Wrap the checkpoint IO's ``save_checkpoint`` (once)."""
        if not trainer.is_global_zero:
            return
        io = find_base_checkpoint_io(trainer.strategy.checkpoint_io)
        if getattr(io, "_snapshots_wrapped", False):
            return
        save_checkpoint = io.save_checkpoint

        def snapshotting_save(checkpoint: Any, path: Any, storage_options: Optional[Any] = None) -> Any:
            request = save_checkpoint(checkpoint, path, storage_options=storage_options)
            directory = Path(str(path).removesuffix(".ckpt"))
            if request is None:
                self._snapshot(directory)
            else:
                request.add_finalize_fn(lambda: self._snapshot(directory))
            return request

        io.save_checkpoint = snapshotting_save
        io._snapshots_wrapped = True

    def _snapshot(self, checkpoint: Path) -> None:
        weights = checkpoint / "weights"
        target = self.directory / checkpoint.name / "weights"
        if target.exists() or not weights.is_dir():  # taken by an earlier fit or an earlier run of a resumed training
            return
        target.mkdir(parents=True, exist_ok=True)
        for file in weights.rglob("*"):  # zarr: one directory per array
            if file.is_file():
                (target / file.relative_to(weights)).parent.mkdir(parents=True, exist_ok=True)
                if self.copy:
                    shutil.copy2(file, target / file.relative_to(weights))
                else:
                    os.link(file, target / file.relative_to(weights))
