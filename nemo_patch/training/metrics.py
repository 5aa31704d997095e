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

"""Consolidation metrics in the trainer's loggers (TensorBoard, W&B, ...), from global rank 0.

Each published consolidation is logged once, at its checkpoint's own global step: ``consolidation/seconds`` (a post
command's excluded), ``consolidation/bytes_per_second`` (output bytes on disk) and ``consolidation/skipped`` (due
consolidations of the run that did not happen so far; also logged alone when only it changes).
"""

from typing import Any, List, Optional, Tuple

from nemo_patch.training.schedule import CheckpointSave, ConsolidationObserver

__all__ = ["Observer"]


class Observer(ConsolidationObserver):
    """Keeps a record of each published consolidation and logs the new ones (:meth:`report`)."""

    def __init__(self, coordinator: Any) -> None:
        super().__init__(coordinator)
        #: ``(ConsolidationRecord, global step of its checkpoint)`` per published consolidation, oldest first.
        self.records: List[Tuple[Any, int]] = []
        self._logged_records = 0
        self._logged_skipped = 0

    def on_ended(self, save: CheckpointSave, record: Optional[Any], error: Optional[str]) -> None:
        if record is not None:
            self.records.append((record, save.global_step))

    def report(self, trainer: Any) -> None:
        """Log the consolidations published since the last call, each at its checkpoint's global step, and
        ``consolidation/skipped`` alone at ``trainer.global_step`` when only that changed."""
        if not trainer.loggers:
            return
        new = self.records[self._logged_records :]
        skipped = self.coordinator.skipped_count
        metrics = [
            (
                {
                    "consolidation/seconds": record.seconds,
                    "consolidation/bytes_per_second": record.bytes_per_second,
                    "consolidation/skipped": float(skipped),
                },
                step if step >= 0 else trainer.global_step,
            )
            for record, step in new
        ]
        if not metrics and skipped != self._logged_skipped:
            metrics = [({"consolidation/skipped": float(skipped)}, trainer.global_step)]
        for values, step in metrics:
            for trainer_logger in trainer.loggers:
                trainer_logger.log_metrics(values, step=step)
        self._logged_records += len(new)
        self._logged_skipped = skipped
