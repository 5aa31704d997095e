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

"""The ``"best"`` cadence and ``<root>/BEST``: the checkpoints NeMo's ``ModelCheckpoint`` ranks best (its
``best_model_path`` when a save is issued), consolidated with their record in ``metadata.json``."""

import logging
from pathlib import Path
from typing import Any, Dict, Optional

from nemo_patch.engine.output_layout import METADATA_FILENAME
from nemo_patch.runs.best_checkpoint import NOT_A_METRIC
from nemo_patch.runs.checkpoint_root import global_step_in_name
from nemo_patch.training.callback import consolidation_of
from nemo_patch.training.latest import BEST_NAME
from nemo_patch.training.retention import Observer as Retention
from nemo_patch.training.schedule import CheckpointSave, ConsolidationObserver, weights_identity

__all__ = ["Observer", "best_record", "check_best_has_a_metric", "consolidate_best", "consolidate_best_checkpoint"]

logger = logging.getLogger(__name__)


def best_record(checkpoint_callback: Any) -> Dict[str, Any]:
    """What ``metadata.json`` records of a best checkpoint, from ``ModelCheckpoint``'s ``monitor``,
    ``best_model_score`` (a 0-d tensor in Lightning) and ``mode``."""
    score = checkpoint_callback.best_model_score
    value = None if score is None else float(score)
    return {"monitor": checkpoint_callback.monitor, "value": value, "mode": checkpoint_callback.mode}


def check_best_has_a_metric(checkpoint_callback: Any, policy: Any) -> None:
    """A ``"best"`` cadence needs NeMo's ``ModelCheckpoint`` to monitor a metric.

    Raises:
        ValueError: ``policy`` uses ``"best"`` and there is no ``ModelCheckpoint``, or its ``monitor`` is one of
            :data:`nemo_patch.runs.best_checkpoint.NOT_A_METRIC`; the message says what to pass.
    """
    monitor = getattr(checkpoint_callback, "monitor", None)
    if not policy.uses_best or (checkpoint_callback is not None and monitor not in NOT_A_METRIC):
        return
    what = f"ModelCheckpoint(monitor={monitor!r})"
    if checkpoint_callback is None:
        what = "the trainer has no ModelCheckpoint"
    raise ValueError(
        f"ckpt_consolidation_frequency={str(policy)!r} consolidates the best checkpoint by the metric NeMo's "
        f"ModelCheckpoint monitors, but {what} monitors none: pass ModelCheckpoint(monitor='val_loss', mode='min') "
        "(or another metric the model logs, e.g. in validation), or use a frequency without \"best\" (\"each\", "
        "\"every_n:<k>\", \"latest\")."
    )


def consolidate_best(coordinator: Any) -> Optional[CheckpointSave]:
    """Make sure the run's best finished checkpoint (``ModelCheckpoint.best_model_path``) is consolidated, and point
    ``BEST`` at it: at once when its output exists, else once its consolidation, queued now, is published. A best
    checkpoint that never finished or was removed is not substituted: a warning names it.

    Returns:
        The best checkpoint's save, or ``None`` (no best recorded, not finished or removed).
    """
    callback = coordinator.checkpoint_callback
    coordinator.consolidate_finished()
    best_path = getattr(callback, "best_model_path", None)
    if not best_path:
        logger.warning(
            "No best checkpoint to consolidate: ModelCheckpoint(monitor=%r) has ranked no finished checkpoint yet",
            getattr(callback, "monitor", None),
        )
        return None
    best_dir = Path(str(best_path).removesuffix(".ckpt"))
    save = coordinator.schedule.finished_save(best_dir)
    if save is None:  # saved before a resume (or never finished)
        step = global_step_in_name(best_dir.name)
        save = CheckpointSave(best_dir, -1 if step is None else step, written=True, fit=coordinator.fit)
        save.run = coordinator.run_id  # ModelCheckpoint's record of this run (resumed): its checkpoint
    if coordinator.is_gone(save):
        logger.warning(
            "The best checkpoint %s (%s) never finished or was removed: it is not consolidated and %s is left as it "
            "is",
            best_dir,
            best_record(callback),
            BEST_NAME,
        )
        return None
    save.best = best_record(callback)
    if save.consolidated or (save.path / coordinator.settings.output_dirname / METADATA_FILENAME).is_file():
        save.consolidated = True
        coordinator.observer(Retention).point(save.path, BEST_NAME)
    elif not save.state.outstanding:
        save.identity = weights_identity(save.path)
        coordinator.queue.submit(save)
        coordinator.notify("on_changed")
    return save


def consolidate_best_checkpoint(strategy: Any, wait: bool = True) -> Optional[Path]:
    """``MegatronStrategy.consolidate_best_checkpoint``: what a ``"best"`` cadence does when ``fit`` ends, on demand
    (global rank 0, once the trainer's ``ModelCheckpoint`` is known); the output directory once it exists."""
    coordinator = consolidation_of(strategy.checkpoint_io)
    if coordinator is None or not strategy.is_global_zero:
        return None
    trainer = getattr(strategy, "trainer", None)  # NeMo's MegatronStrategy.setup keeps it
    if coordinator.checkpoint_callback is None and trainer is not None:
        coordinator.checkpoint_callback = trainer.checkpoint_callback
    save = consolidate_best(coordinator)
    if save is None:
        return None
    if wait:
        coordinator.wait(coordinator.settings.config.timeout)
        coordinator.end_process_unless_fitting()
    return save.path / coordinator.settings.output_dirname if save.consolidated else None


class Observer(ConsolidationObserver):
    """A run's ``"best"`` cadence: the metric checked when ``fit`` starts, best saves marked as they are issued,
    ``BEST`` on each best output, and the best checkpoint consolidated when ``fit`` ends."""

    def on_fit_start(self, trainer: Any) -> None:
        check_best_has_a_metric(trainer.checkpoint_callback, self.coordinator.policy)

    def on_register(self, save: CheckpointSave) -> None:
        callback = self.coordinator.checkpoint_callback
        name = getattr(callback, "best_model_path", None)
        if save.best is None and self.coordinator.policy.uses_best and name:
            if Path(str(name).removesuffix(".ckpt")) == save.path:
                save.best = best_record(callback)

    def on_published(self, save: CheckpointSave) -> None:
        if save.best is not None:
            self.coordinator.observer(Retention).point(save.path, BEST_NAME)
            logger.info("%s -> %s", BEST_NAME, save.path.name)

    def on_fit_end(self) -> None:
        if self.coordinator.policy.uses_best:
            consolidate_best(self.coordinator)

    def on_exception(self) -> None:
        if self.coordinator.policy.uses_best and self.coordinator.checkpoint_callback is not None:
            consolidate_best(self.coordinator)
