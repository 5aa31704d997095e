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

Each published consolidation is logged once, at the global step when the training loop saw it end:
``consolidation/seconds`` (wall seconds of the consolidation, a post command's excluded),
``consolidation/bytes_per_second`` (output bytes on disk per second) and ``consolidation/skipped`` (due consolidations
of the run that did not happen so far; cumulative, also logged alone when only it changes).
"""

from typing import Any, List, Optional

from nemo_patch.training.schedule import CheckpointSave, ConsolidationObserver

__all__ = ["Observer"]


class Observer(ConsolidationObserver):
    """Keeps a record of each published consolidation and logs the new ones (:meth:`report`)."""

    def __init__(self, coordinator: Any) -> None:
        super().__init__(coordinator)
        #: One ``ConsolidationRecord`` per published consolidation of this run, oldest first.
        self.records: List[Any] = []
        self._logged_records = 0
        self._logged_skipped = 0

    def on_ended(self, save: CheckpointSave, record: Optional[Any], error: Optional[str]) -> None:
        if record is not None:
            self.records.append(record)

    def report(self, trainer: Any) -> None:
        """Log the consolidations published since the last call at ``trainer.global_step``: one ``log_metrics`` call
        each, and one for ``consolidation/skipped`` alone when only that changed."""
        if not trainer.loggers:
            return
        new = self.records[self._logged_records :]
        skipped = self.coordinator.skipped_count
        metrics = [
            {
                "consolidation/seconds": record.seconds,
                "consolidation/bytes_per_second": record.bytes_per_second,
                "consolidation/skipped": float(skipped),
            }
            for record in new
        ]
        if not metrics and skipped != self._logged_skipped:
            metrics = [{"consolidation/skipped": float(skipped)}]
        for values in metrics:
            for trainer_logger in trainer.loggers:
                trainer_logger.log_metrics(values, step=trainer.global_step)
        self._logged_records += len(new)
        self._logged_skipped = skipped
