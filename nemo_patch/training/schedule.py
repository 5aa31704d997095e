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

"""Book-keeping of a run's checkpoint saves: which are finished, and which of those to consolidate.

Counting rule: the cadence counts *finished checkpoints by global step*. NeMo's ``ModelCheckpoint`` with
``save_last=True`` writes a second, full ``<name>-last`` copy of a step it has just saved; that copy is the same
global step and is not counted again, and it is not consolidated again: once the step's own checkpoint is
consolidated, the copy gets the same files (hard links where the filesystem allows). A ``-last``
checkpoint of a step that has no other checkpoint (e.g. the final step when ``max_steps`` is not a multiple of the
save interval) is a finished checkpoint like any other.

The count is part of the Lightning checkpoint (as callback state), so it survives a resume: a run resumed after its
3rd finished checkpoint with ``every_n:2`` consolidates its 4th.

Standard library and the cadence policy only: never torch, NeMo or Lightning.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from nemo_patch.training.policy import ConsolidationPolicy

__all__ = ["CheckpointSave", "ConsolidationSchedule"]

logger = logging.getLogger(__name__)


@dataclass
class CheckpointSave:
    """One checkpoint save issued by the run.

    Attributes:
        path: the checkpoint directory (``<root>/<name>``, holding ``weights/`` and ``context/``).
        global_step: the trainer's global step when it was saved.
        written: ``True`` once the checkpoint IO has finished writing it (immediately for a sync save, in the
            async request's finalize step for an async save).
        queued: ``True`` once handed to the consolidation process queue.
        consolidated: ``True`` once ``consolidated/`` was published for it.
    """

    path: Path
    global_step: int
    written: bool = False
    queued: bool = False
    consolidated: bool = False

    def mark_written(self) -> None:
        """Finalize callback for async saves."""
        self.written = True


class ConsolidationSchedule:
    """Decides which finished checkpoint saves of a run get consolidated, following a :class:`ConsolidationPolicy`.

    Args:
        policy: the cadence.
    """

    def __init__(self, policy: ConsolidationPolicy) -> None:
        self.policy = policy
        self.pending: List[CheckpointSave] = []
        #: Finished checkpoints of the run so far, counted by distinct global step (includes those before a resume).
        self.finished_count = 0
        #: The newest finished checkpoint (highest global step; a step's first finished copy wins over its ``-last``).
        self.newest_finished: Optional[CheckpointSave] = None
        #: Every finished save of this run (``-last`` copies included), oldest first.
        self.history: List[CheckpointSave] = []
        #: Saves that were due under the cadence but had been removed (NeMo's top-k) by the time they finished.
        self.removed_while_due: List[CheckpointSave] = []
        self._registered_count = 0
        self._last_registered_step: Optional[int] = None
        self._last_finished_step: Optional[int] = None

    def register(self, path: Path, global_step: int) -> CheckpointSave:
        """Record a save that the checkpoint IO has just issued (not yet finished)."""
        save = CheckpointSave(Path(path), int(global_step))
        if save.global_step != self._last_registered_step:
            self._registered_count += 1
            self._last_registered_step = save.global_step
        self.pending.append(save)
        return save

    def collect_finished(
        self, is_gone: Callable[[CheckpointSave], bool]
    ) -> Tuple[List[CheckpointSave], List[CheckpointSave]]:
        """Move finished saves out of :attr:`pending`, in save order.

        A save is finished once the checkpoint IO has written it (:attr:`CheckpointSave.written`: set when
        ``save_checkpoint`` returns for a sync save, by the async request's finalize step, in the training thread,
        for an async save). NeMo removes its ``<ckpt>-unfinished`` marker in that same sequence, before this is
        called from a later hook. Saves finish in the order they were issued, so collection stops at the first
        save not yet written.

        Args:
            is_gone: tells whether a finished checkpoint has been removed, or is being removed, since (NeMo replaces
                its previous ``-last`` copy, and top-k removal marks a checkpoint unfinished while deleting it). Such
                a save still counts but is not consolidated.

        Returns:
            ``(due, copies)``: the saves to consolidate now, and the finished saves of a step already counted (NeMo's
            ``-last`` copies), oldest first.
        """
        due, copies = [], []
        while self.pending and self.pending[0].written:
            save = self.pending.pop(0)
            gone = is_gone(save)
            if not gone:
                self.history.append(save)
            if save.global_step == self._last_finished_step:
                if not gone:
                    copies.append(save)  # the -last copy of a step already counted
                continue
            self._last_finished_step = save.global_step
            self.finished_count += 1
            if gone:
                logger.debug("Checkpoint %s was removed after it finished; nothing to consolidate.", save.path)
                if self.policy.consolidates_during_training(self.finished_count):
                    self.removed_while_due.append(save)
                continue
            self.newest_finished = save
            if self.policy.consolidates_during_training(self.finished_count):
                due.append(save)
        return due, copies

    def drop_pending(self) -> List[CheckpointSave]:
        """Forget saves that never finished (called when ``fit`` ends); returns them."""
        dropped, self.pending = self.pending, []
        return dropped

    def state_dict(self, global_step: int) -> Dict[str, Any]:
        """State to store in a checkpoint saved at ``global_step`` (called just before the save is issued).

        Returns:
            ``{"finished_count": n, "global_step": s}`` where ``n`` counts this checkpoint's own step: when a run is
            resumed from this checkpoint, every save up to it has finished.
        """
        count = self._registered_count + (0 if global_step == self._last_registered_step else 1)
        return {"finished_count": count, "global_step": int(global_step)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the count from a checkpoint the run resumes from."""
        self.finished_count = self._registered_count = int(state["finished_count"])
        self._last_finished_step = self._last_registered_step = int(state["global_step"])
