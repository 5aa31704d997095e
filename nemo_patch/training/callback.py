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

"""Lightning callback that drives checkpoint consolidation from the training loop's hooks.

Imports Lightning and the training side's checkpoint IO; never the overlay, the CLI or ``nemo_patch.testing``.
"""

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from nemo_patch.engine.best_checkpoint import NOT_A_METRIC
from nemo_patch.engine.publish import remove_stale_tmp_dirs
from nemo_patch.training.checkpoint_io import MegatronCheckpointIO
from nemo_patch.training.hooks import HookCaller
from nemo_patch.training.io_chain import find_base_checkpoint_io
from nemo_patch.training.policy import ConsolidationPolicy
from nemo_patch.training.retention import RETAINED_DIRNAME

__all__ = ["ConsolidationCallback"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _never_fails_training(what: str) -> Iterator[None]:
    """A consolidation problem is logged, never raised into the training loop (failures of the consolidation itself
    are already reported by the queue; this catches anything unexpected around it, e.g. an unwritable directory)."""
    try:
        yield
    except Exception:
        logger.exception("Checkpoint consolidation: %s failed; training continues", what)


def _consolidating_io(trainer: Optional["pl.Trainer"]) -> Optional[MegatronCheckpointIO]:
    if trainer is None:
        return None
    base = find_base_checkpoint_io(trainer.strategy.checkpoint_io)
    if isinstance(base, MegatronCheckpointIO) and base.consolidation is not None:
        return base
    return None


def _warn_if_top_k_drops_consolidations(checkpoint_callback: Any, io: MegatronCheckpointIO) -> None:
    """One warning when NeMo's top-k retention keeps at most one checkpoint while checkpoints are consolidated during
    training: each checkpoint is then removed as soon as the next one is saved, so a due consolidation that has not
    started by then (the consolidation process still busy with an earlier one) is dropped."""
    policy = io.consolidation_policy
    save_top_k = getattr(checkpoint_callback, "save_top_k", -1)
    if policy is None or not policy.consolidates_periodically or not 0 <= save_top_k <= 1:
        return
    logger.warning(
        "ModelCheckpoint(save_top_k=%d) removes each checkpoint as soon as the next one is saved: a checkpoint due "
        "for consolidation (ckpt_consolidation_frequency=%r) is dropped whenever the consolidation process is still "
        "busy with an earlier one at that moment. Consolidated outputs themselves are kept under <root>/%s/ "
        "(ConsolidationConfig.keep). To consolidate every due checkpoint, keep more checkpoints (a larger save_top_k, "
        "or -1) or save less often than a consolidation takes; ckpt_consolidation_frequency='latest' consolidates "
        "only the final one.",
        save_top_k,
        str(policy),
        RETAINED_DIRNAME,
    )


def _route_nemo_deletions(checkpoint_callback: Any, io: MegatronCheckpointIO, global_zero: bool) -> None:
    """Route the checkpoints NeMo's ``ModelCheckpoint`` deletes by itself through the consolidating IO.

    When a run resumes with ``save_top_k >= 0``, ``nemo_topk_check_previous_run`` deletes the top-k checkpoints beyond
    ``save_top_k`` with ``_del_model_without_trainer`` (a plain ``rmtree``), not through
    ``strategy.remove_checkpoint``. Wrapped here (on this ``ModelCheckpoint`` instance, once), each deletion first
    keeps the checkpoint's output and moves ``LATEST``/``BEST`` off it, as a removal through the strategy does; the
    deletion itself (and NeMo's barrier in it) is NeMo's, on every rank."""
    original = getattr(checkpoint_callback, "_del_model_without_trainer", None)
    if original is None:
        return
    checkpoint_callback._nemo_patch_io = io  # the IO of this fit (a later fit may bring another)
    if getattr(original, "nemo_patch_routed", False):
        return

    def delete(filepath: Any) -> Any:
        routed_io = getattr(checkpoint_callback, "_nemo_patch_io", None)
        if global_zero and routed_io is not None:
            with _never_fails_training("keeping the output of a checkpoint NeMo deletes"):
                routed_io.remove_checkpoint_safely(Path(str(filepath).removesuffix(".ckpt")), lambda: None)
        return original(filepath)

    delete.nemo_patch_routed = True  # type: ignore[attr-defined]
    checkpoint_callback._del_model_without_trainer = delete


def check_best_has_a_metric(checkpoint_callback: Any, policy: ConsolidationPolicy) -> None:
    """A ``"best"`` cadence needs NeMo's ``ModelCheckpoint`` to monitor a metric.

    Raises:
        ValueError: ``policy`` uses ``"best"`` and there is no ``ModelCheckpoint``, or its ``monitor`` is one of
            :data:`nemo_patch.engine.best_checkpoint.NOT_A_METRIC`; the message says what to pass.
    """
    if not policy.uses_best:
        return
    monitor = getattr(checkpoint_callback, "monitor", None)
    if checkpoint_callback is not None and monitor not in NOT_A_METRIC:
        return
    what = (
        "the trainer has no ModelCheckpoint"
        if checkpoint_callback is None
        else f"ModelCheckpoint(monitor={monitor!r})"
    )
    raise ValueError(
        f"ckpt_consolidation_frequency={str(policy)!r} consolidates the best checkpoint by the metric NeMo's "
        f"ModelCheckpoint monitors, but {what} monitors none: pass ModelCheckpoint(monitor='val_loss', mode='min') "
        "(or another metric the model logs, e.g. in validation), or use a frequency without \"best\" (\"each\", "
        "\"every_n:<k>\", \"latest\")."
    )


class ConsolidationCallback(Callback):
    """Consolidates finished checkpoints at the cadence of the trainer's :class:`MegatronCheckpointIO`.

    :class:`nemo_patch.MegatronStrategy` appends it to ``trainer.callbacks`` in ``setup`` (as NeMo's strategy does
    with its ``AsyncFinalizerCallback``), so it runs after NeMo's ``ModelCheckpoint`` and ``AsyncFinalizerCallback``
    in every hook: a save made or finalized in a hook is seen in the same hook.

    * ``on_fit_start``: with a ``"best"`` cadence, check that ``ModelCheckpoint`` monitors a metric (else
      ``ValueError``, before any training step) and hand it to the checkpoint IO.
    * ``on_train_start``: start the consolidation process for the first request (cadences that consolidate during
      training; see :mod:`nemo_patch.training.queue`); warn when ``save_top_k`` <= 1 will drop due consolidations;
      remove temporary output left by consolidation processes that were killed.
    * ``on_train_batch_end`` / ``on_validation_end``: consolidate the saves that finished and are due.
    * ``on_train_end``: the same, then, with ``latest``, consolidate the newest finished checkpoint and, with
      ``best``, the best one (``on_exception`` too: a run ending by an exception or a preemption).
    * ``state_dict`` / ``load_state_dict``: the count of finished checkpoints, stored in each checkpoint by Lightning
      so that ``every_n`` keeps counting across a resume.

    Training metrics: in those hooks, and from the strategy's teardown for consolidations that end while ``fit`` is
    ending, each newly published consolidation is logged to the trainer's loggers on global rank 0, at the global step
    when it was reaped (:meth:`log_consolidation_metrics`): ``consolidation/seconds`` (wall seconds of the
    consolidation process), ``consolidation/bytes_per_second`` (output bytes on disk per second) and
    ``consolidation/skipped`` (due consolidations of the run that did not happen so far, cumulative).

    After each consolidation, reaped at the same moments (:meth:`report_consolidations`, global rank 0): the metrics
    its post command printed (``ConsolidationConfig.post_command``) are logged to the trainer's loggers at the
    checkpoint's global step, and every callback of the trainer that defines ``on_consolidation_end(trainer,
    pl_module, result)`` (a published output) or ``on_consolidation_failed(trainer, pl_module, result)`` (one that ran
    and published nothing) is called once with its :class:`~nemo_patch.training.hooks.ConsolidationOutcome`. The hooks
    run in the training loop: for quick work only. An exception in one is logged once and never fails training.

    Args:
        trainer: the trainer it is attached to (callbacks appended during ``strategy.setup`` miss Lightning's own
            ``setup`` hook, so the strategy passes it here).
    """

    def __init__(self, trainer: Optional["pl.Trainer"] = None) -> None:
        self._trainer = trainer
        #: Seconds the training loop spent in this callback's per-step hooks (bookkeeping, starting processes).
        self.blocked_seconds = 0.0
        self._logged_records = 0
        self._logged_skipped = 0
        self._reported_outcomes = 0
        self._call_hooks = HookCaller()

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Remember the trainer (for :meth:`state_dict`); for ``fit``, on global rank 0, start the run's consolidation
        process now, so that its start-up (``import torch``, seconds) overlaps with the model's set-up rather than
        with the first training steps (only for a cadence that consolidates during training)."""
        self._trainer = trainer
        if stage != "fit" or not trainer.is_global_zero:
            return
        with _never_fails_training("starting the consolidation process"):
            io = _consolidating_io(trainer)
            if io is not None:
                io.fitting = True
                io.start_consolidation_process()

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Hand the trainer's ``ModelCheckpoint`` to the checkpoint IO and tell it a ``fit`` starts (global steps may
        start again); route the checkpoints ``ModelCheckpoint`` deletes by itself through it
        (:func:`_route_nemo_deletions`). A ``"best"`` cadence without a monitored metric raises ``ValueError`` here,
        on every rank, before any training step."""
        io = _consolidating_io(trainer)
        if io is None or io.consolidation_policy is None:
            return
        check_best_has_a_metric(trainer.checkpoint_callback, io.consolidation_policy)
        io.checkpoint_callback = trainer.checkpoint_callback
        io.begin_fit()
        if trainer.checkpoint_callback is not None:
            _route_nemo_deletions(trainer.checkpoint_callback, io, trainer.is_global_zero)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """On global rank 0: warn once when ``ModelCheckpoint(save_top_k=...)`` will drop due consolidations, remove
        temporary output that a killed consolidation process left in the run's checkpoint directories and retained
        outputs (:func:`nemo_patch.engine.publish.remove_stale_tmp_dirs`), then repair ``LATEST``/``BEST`` and queue
        what an earlier, killed run of this root left due (:meth:`ConsolidationCoordinator.reconcile`; NeMo's own
        start-up clean-up, in ``ModelCheckpoint.on_train_start``, has run by then)."""
        io = _consolidating_io(trainer)
        if io is None or not trainer.is_global_zero:
            return
        _warn_if_top_k_drops_consolidations(trainer.checkpoint_callback, io)
        with _never_fails_training("starting the consolidation process"):
            io.start_consolidation_process()  # unless setup() did; one that died since is replaced
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        if not dirpath or not Path(dirpath).is_dir():
            return
        with _never_fails_training("removing stale temporary output"):
            retained = Path(dirpath) / RETAINED_DIRNAME
            entries = list(Path(dirpath).iterdir()) + (list(retained.iterdir()) if retained.is_dir() else [])
            for checkpoint_dir in entries:
                if checkpoint_dir.is_dir() and not checkpoint_dir.is_symlink():
                    remove_stale_tmp_dirs(checkpoint_dir)
        with _never_fails_training("checking LATEST, BEST and the consolidations an earlier run left due"):
            io.reconcile(Path(dirpath))

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        """Hand saves that finished in this step and are due to the consolidation process; returns at once."""
        start = time.perf_counter()
        io = _consolidating_io(trainer)
        if io is not None:
            with _never_fails_training("handing finished checkpoints to the consolidation process"):
                io.consolidate_finished()
            self.report_consolidations(trainer)
        self.blocked_seconds += time.perf_counter() - start

    def report_consolidations(self, trainer: "pl.Trainer") -> None:
        """On global rank 0, for the consolidations that ended since the last call: :meth:`log_consolidation_metrics`,
        then, for each in turn, its post command's metrics to ``trainer.loggers`` at its checkpoint's global step and
        the callbacks' ``on_consolidation_end``/``on_consolidation_failed`` hooks. Never raises."""
        with _never_fails_training("logging consolidation metrics"):
            self.log_consolidation_metrics(trainer)
        io = _consolidating_io(trainer)
        if io is None or not trainer.is_global_zero:
            return
        if self._reported_outcomes > io.consolidations_ended:  # a new run's bookkeeping (new settings on the IO)
            self._reported_outcomes = 0
        new = io.consolidation_outcomes(self._reported_outcomes)
        self._reported_outcomes += len(new)
        pl_module = getattr(trainer, "lightning_module", None)
        for outcome in new:
            if outcome.metrics:
                step = outcome.global_step if outcome.global_step >= 0 else trainer.global_step
                with _never_fails_training("logging the post command's metrics"):
                    for trainer_logger in trainer.loggers:
                        trainer_logger.log_metrics(outcome.metrics, step=step)
            self._call_hooks(trainer, pl_module, outcome)

    def log_consolidation_metrics(self, trainer: "pl.Trainer") -> None:
        """Log the consolidations published since the last call to ``trainer.loggers`` (global rank 0), at
        ``trainer.global_step``: one ``log_metrics`` call per consolidation, and one for ``consolidation/skipped``
        alone when only that changed."""
        io = _consolidating_io(trainer)
        if io is None or not trainer.is_global_zero or not trainer.loggers:
            return
        new = io.consolidation_records[self._logged_records :]
        skipped = io.skipped_count
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

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Consolidate saves made on validation end (``ModelCheckpoint`` with a monitored metric)."""
        self.on_train_batch_end(trainer)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Consolidate what is still due; in ``latest`` mode, consolidate the newest finished checkpoint once."""
        io = _consolidating_io(trainer)
        if io is None:
            return
        # NeMo's AsyncFinalizerCallback finalizes pending async saves in its own on_train_end; do it here too (it is
        # idempotent) so that the checkpoints saved last are finished whichever callback runs first.
        finalize = getattr(trainer.strategy.checkpoint_io, "maybe_finalize_save_checkpoint", None)
        if finalize is not None:
            finalize(blocking=True)
        with _never_fails_training("queueing the end-of-fit consolidation"):
            io.finish_fit()
        self.report_consolidations(trainer)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        """``fit`` is ending by an exception: with ``latest``, still queue the newest finished checkpoint, with
        ``best`` the best one (the strategy's teardown then waits for them, up to its timeout)."""
        io = _consolidating_io(trainer)
        policy = io.consolidation_policy if io is not None else None
        if io is None or policy is None:
            return
        with _never_fails_training("queueing the end-of-fit consolidation"):
            if policy.consolidates_at_fit_end:
                io.consolidate_newest()
            if policy.uses_best and io.checkpoint_callback is not None:
                io.consolidate_best()

    def state_dict(self) -> Dict[str, Any]:
        """The counts of finished checkpoints for the checkpoint being saved
        (:meth:`nemo_patch.training.schedule.ConsolidationSchedule.state_dict`), or ``{}``."""
        io = _consolidating_io(self._trainer)
        if io is None or io.consolidation is None or self._trainer is None:
            return {}
        return io.consolidation.state_dict(self._trainer.global_step)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the count of finished checkpoints from the checkpoint the run resumes from."""
        io = _consolidating_io(self._trainer)
        if io is not None and io.consolidation is not None and state_dict:
            io.consolidation.load_state_dict(state_dict)
