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

"""The Lightning callback that drives a run's checkpoint consolidation from the training loop's hooks.

Imports Lightning and the engine's publishing helpers only (the coordinator is reached through the checkpoint IO).
"""

import contextlib
import logging
import re
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

from nemo_patch.engine.publish import remove_stale_tmp_dirs

__all__ = ["ConsolidationCallback", "consolidation_of", "find_base_checkpoint_io"]

logger = logging.getLogger(__name__)
#: What a stored run id may be (it goes into ``metadata.json`` and log lines).
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def find_base_checkpoint_io(checkpoint_io: Any) -> Any:
    """The innermost checkpoint IO under any Lightning ``_WrappingCheckpointIO`` layers (e.g. NeMo's async one)."""
    while isinstance(checkpoint_io, _WrappingCheckpointIO):
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io


def consolidation_of(checkpoint_io: Any) -> Optional[Any]:
    """The coordinator of the checkpoint IO at the bottom of ``checkpoint_io``'s chain, if it consolidates."""
    return getattr(find_base_checkpoint_io(checkpoint_io), "consolidation", None) if checkpoint_io else None


@contextlib.contextmanager
def _never_fails_training(what: str) -> Iterator[None]:
    """A consolidation problem is logged, never raised into the training loop."""
    try:
        yield
    except Exception:
        logger.exception("Checkpoint consolidation: %s failed; training continues", what)


class ConsolidationCallback(Callback):
    """Consolidates finished checkpoints at the cadence of the trainer's checkpoint IO.

    ``MegatronStrategy`` appends it in ``setup``, so it runs after NeMo's ``ModelCheckpoint`` and
    ``AsyncFinalizerCallback`` in every hook: a save made or finalized in a hook is seen in the same hook. Global rank
    0 does the work; the other ranks only check what ``fit`` needs.

    Args:
        trainer: the trainer it is attached to (for :meth:`state_dict`).
    """

    def __init__(self, trainer: Optional["pl.Trainer"] = None) -> None:
        self._trainer = trainer
        #: Seconds the training loop spent in this callback's per-step hooks.
        self.blocked_seconds = 0.0

    def _consolidation(self, trainer: Optional["pl.Trainer"]) -> Optional[Any]:
        return consolidation_of(trainer.strategy.checkpoint_io) if trainer is not None else None

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """For ``fit``, start the run's consolidation process now, so that its start-up (``import torch``, seconds)
        overlaps with the model's set-up rather than with the first steps."""
        self._trainer = trainer
        consolidation = self._consolidation(trainer)
        if stage == "fit" and trainer.is_global_zero and consolidation is not None:
            with _never_fails_training("starting the consolidation process"):
                consolidation.fitting = True
                consolidation.start_process()

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A ``fit`` starts (every rank; its global steps may start again), with the trainer's ``ModelCheckpoint``; a
        later feature may refuse it here with ``ValueError``, before any training step."""
        consolidation = self._consolidation(trainer)
        if consolidation is not None:
            consolidation.notify("on_fit_start", trainer)
            consolidation.begin_fit(trainer.checkpoint_callback)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Start the consolidation process (unless running), remove the temporary output a killed one left in the
        run's checkpoints, then let the later features look at the checkpoint root (NeMo's own start-up clean-up in
        ``ModelCheckpoint.on_train_start`` has run)."""
        consolidation = self._consolidation(trainer)
        if consolidation is None or not trainer.is_global_zero:
            return
        with _never_fails_training("starting the consolidation process"):
            consolidation.start_process()
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        root = Path(dirpath) if dirpath and Path(dirpath).is_dir() else None
        with _never_fails_training("removing stale temporary output"):
            for checkpoint_dir in list(root.iterdir()) if root is not None else []:
                if checkpoint_dir.is_dir() and not checkpoint_dir.is_symlink():
                    remove_stale_tmp_dirs(checkpoint_dir)
        with _never_fails_training("checking the checkpoint root"):
            consolidation.notify("on_train_start", root)

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        """Have saves that finished in this step and are due handed to the consolidation process (by the
        coordinator's stepper thread), and report the consolidations that ended; returns at once."""
        start = time.perf_counter()
        consolidation = self._consolidation(trainer)
        if consolidation is not None:
            with _never_fails_training("handing finished checkpoints to the consolidation process"):
                consolidation.after_step()
            self.report_consolidations(trainer)
        self.blocked_seconds += time.perf_counter() - start

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Consolidate saves made on validation end (``ModelCheckpoint`` with a monitored metric)."""
        self.on_train_batch_end(trainer)

    def report_consolidations(self, trainer: "pl.Trainer") -> None:
        """On global rank 0, have the observers report the consolidations ended since the last call. Never raises."""
        consolidation = self._consolidation(trainer)
        for observer in consolidation.reporters if consolidation is not None and trainer.is_global_zero else []:
            try:
                observer.report(trainer)
            except Exception:
                logger.exception("Checkpoint consolidation: reporting consolidations failed; training continues")

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Queue what is still due and what ``fit``'s end consolidates (``latest``: the newest finished checkpoint)."""
        consolidation = self._consolidation(trainer)
        if consolidation is None:
            return
        # as NeMo's AsyncFinalizerCallback does in its own (idempotent): the last saves finish whichever runs first
        finalize = getattr(trainer.strategy.checkpoint_io, "maybe_finalize_save_checkpoint", None)
        if finalize is not None:
            finalize(blocking=True)
        with _never_fails_training("queueing the end-of-fit consolidation"):
            consolidation.finish_fit()
        self.report_consolidations(trainer)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        """``fit`` ends by an exception: still queue what its end consolidates (the teardown waits for it)."""
        consolidation = self._consolidation(trainer)
        if consolidation is not None:
            with _never_fails_training("queueing the end-of-fit consolidation"):
                if consolidation.policy.consolidates_at_fit_end:
                    consolidation.consolidate_newest()
                consolidation.notify("on_exception")

    def state_dict(self) -> Dict[str, Any]:
        """The counts of finished checkpoints and the run's id, for the checkpoint being saved (or ``{}``)."""
        consolidation = self._consolidation(self._trainer)
        if consolidation is None or self._trainer is None:
            return {}
        consolidation.sync(in_save=True)  # the count includes the saves that finished before this one
        return {**consolidation.schedule.state_dict(self._trainer.global_step), "run_id": consolidation.run_id}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the count of finished checkpoints from the checkpoint the run resumes from, and its run id: a resume
        goes on with the run it resumes (a checkpoint saved before run ids were stored leaves the new id)."""
        consolidation = self._consolidation(self._trainer)
        if consolidation is not None and state_dict:
            consolidation.schedule.load_state_dict(state_dict)
            run_id = state_dict.get("run_id")
            if isinstance(run_id, str) and _RUN_ID.fullmatch(run_id):
                consolidation.run_id = run_id
