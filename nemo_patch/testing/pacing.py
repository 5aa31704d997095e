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

"""Let a tiny test run's consolidations keep up with its saves, as they do in a real run.

The tiny GPT trains a step in a fraction of a second while a consolidation process needs seconds to start, so in a
test every save lands while an earlier consolidation is still running. Real runs are the other way round (minutes
between saves). :class:`WaitForConsolidation` restores that order: at the end of each step it waits until the
consolidation process queue is idle, so each due checkpoint is consolidated before the next save (and before NeMo's
top-k retention can remove it).

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

from typing import Any

from lightning.pytorch.callbacks import Callback

from nemo_patch.training.callback import consolidation_of

__all__ = ["WaitForConsolidation"]


class WaitForConsolidation(Callback):
    """Waits (up to ``timeout`` seconds) at the end of each training step for queued and running consolidations.

    Lightning runs it before NeMo's ``ModelCheckpoint`` in a hook, so the consolidation of a checkpoint saved at step
    ``s`` (handed to the queue at the end of step ``s``) is waited for at the end of step ``s + 1``.
    """

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = timeout

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        """Wait for the consolidation queue to be idle (global rank 0; other ranks have none)."""
        consolidation = consolidation_of(trainer.strategy.checkpoint_io)
        if consolidation is not None and trainer.is_global_zero:
            consolidation.consolidate_finished()
            consolidation.wait(self.timeout)
