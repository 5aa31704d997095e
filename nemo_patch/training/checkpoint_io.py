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

"""NeMo's ``MegatronCheckpointIO`` with checkpoint consolidation at a chosen cadence.

Imports NeMo, Lightning, the engine and the training side's settings, schedule, queue and ``LATEST``; never the
overlay, the CLI or ``nemo_patch.testing``.
"""

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

from lightning.fabric.utilities.types import _PATH
from nemo.lightning.io import pl as nemo_io_pl
from nemo.lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint
from nemo.lightning.pytorch.strategies.utils import ckpt_to_dir
from nemo.utils.get_rank import is_global_rank_zero

from nemo_patch.engine.checkpoint_layout import global_step_in_name, weights_written
from nemo_patch.engine.output_layout import DEFAULT_MAX_SHARD_SIZE, METADATA_FILENAME
from nemo_patch.engine.publish import link_consolidated_output
from nemo_patch.training.latest import BEST_NAME, update_latest_pointer
from nemo_patch.training.policy import ConsolidationPolicy
from nemo_patch.training.queue import ConsolidationQueue
from nemo_patch.training.retention import prune_retained, repoint_best, repoint_latest, retain_output
from nemo_patch.training.schedule import CheckpointSave, ConsolidationSchedule
from nemo_patch.training.settings import (
    CHECKPOINT_IO_ARGUMENTS,
    DEFAULT_FORMAT,
    DEFAULT_MAX_PENDING,
    ConsolidationSettings,
    setting_view,
)

__all__ = ["ConsolidationRecord", "MegatronCheckpointIO", "best_record"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsolidationRecord:
    """A published consolidation, for the training metrics (:class:`nemo_patch.training.callback.ConsolidationCallback`
    logs them).

    Attributes:
        output_dir: the published output directory.
        global_step: the checkpoint's global step.
        seconds: wall seconds the consolidation process ran.
        bytes: bytes of the output's files on disk.
    """

    output_dir: Path
    global_step: int
    seconds: float
    bytes: int

    @property
    def bytes_per_second(self) -> float:
        """Output bytes per wall second of the consolidation process (0 when no time was measured)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def best_record(checkpoint_callback: Any) -> Dict[str, Any]:
    """What ``metadata.json`` records of a best checkpoint: ``{"monitor": name, "value": float, "mode": mode}``,
    from ``ModelCheckpoint``'s ``monitor``, ``best_model_score`` (a 0-d tensor in Lightning) and ``mode``."""
    score = checkpoint_callback.best_model_score
    return {
        "monitor": checkpoint_callback.monitor,
        "value": None if score is None else float(score),
        "mode": checkpoint_callback.mode,
    }


class MegatronCheckpointIO(nemo_io_pl.MegatronCheckpointIO):
    """NeMo's distributed-checkpoint IO that also consolidates finished checkpoints into safetensors.

    Saving and loading are NeMo's, unchanged. With consolidation on, global rank 0 records every save it issues;
    once a save is *finished* (written, async finalization done, and NeMo's ``<ckpt>-unfinished`` marker removed),
    :meth:`consolidate_finished` hands the saves due under the cadence to a separate consolidation process
    (:class:`nemo_patch.training.queue.ConsolidationQueue`), which writes ``<ckpt>/consolidated/`` (see
    :func:`nemo_patch.engine.consolidate.consolidate_checkpoint`); ``<root>/LATEST`` then points at the newest one.
    :class:`nemo_patch.MegatronStrategy` drives it from Lightning's hooks. A consolidation failure is logged and
    never raised into the training loop.

    Args:
        *args: forwarded to NeMo's ``MegatronCheckpointIO``.
        save_consolidated: ``None`` (default), ``True`` or ``False``; see
            :func:`nemo_patch.training.policy.resolve_policy`.
        ckpt_consolidation_frequency: ``None`` (default), ``"each"``, ``"latest"``, ``"best"``, ``"every_n:<k>"`` or
            phases (:mod:`nemo_patch.training.policy`).
        consolidation_max_shard_size: most bytes of tensor data per output safetensors file (default 5 * 10**9).
        consolidation_max_pending: consolidation requests that may wait behind the running one (default 2).
        consolidation_format: ``"safetensors"`` (default, ``<ckpt>/consolidated``) or ``"hf"`` (``<ckpt>/hf``).
        consolidation_keep: consolidated outputs kept when NeMo's top-k removes their checkpoints (default ``None``:
            all; see :mod:`nemo_patch.training.retention`).
        consolidation_dtype: output dtype, ``"bf16"``, ``"fp16"`` or ``"fp32"`` (default ``None``: the checkpoint's).
        consolidation_merge_adapters: merge LoRA adapters into the base model (default ``False``: adapters alone).
        consolidation_workers: writer processes per writing node (default ``None``: a quarter of its cores, 1 to 8).
        consolidation_settings: all of the above as one already validated value (what
            :class:`nemo_patch.MegatronStrategy` passes); when given, the nine arguments above must not be.
        **kwargs: forwarded to NeMo's ``MegatronCheckpointIO``.

    Raises:
        ValueError: for an invalid or contradictory consolidation setting (the message lists the accepted forms), or
            ``consolidation_settings`` together with any of the individual settings.
    """

    def __init__(
        self,
        *args: Any,
        save_consolidated: Optional[bool] = None,
        ckpt_consolidation_frequency: Optional[str] = None,
        consolidation_max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
        consolidation_max_pending: int = DEFAULT_MAX_PENDING,
        consolidation_format: str = DEFAULT_FORMAT,
        consolidation_keep: Optional[int] = None,
        consolidation_dtype: Optional[Any] = None,
        consolidation_merge_adapters: bool = False,
        consolidation_workers: Optional[int] = None,
        consolidation_settings: Optional[ConsolidationSettings] = None,
        **kwargs: Any,
    ) -> None:
        given = ConsolidationSettings.from_arguments(
            save_consolidated,
            ckpt_consolidation_frequency,
            max_shard_size=consolidation_max_shard_size,
            max_pending=consolidation_max_pending,
            output_format=consolidation_format,
            keep=consolidation_keep,
            dtype=consolidation_dtype,
            merge_adapters=consolidation_merge_adapters,
            workers=consolidation_workers,
            names=CHECKPOINT_IO_ARGUMENTS,
        )
        if consolidation_settings is not None and given != ConsolidationSettings():
            raise ValueError(
                "Pass either consolidation_settings or the individual consolidation arguments "
                "(save_consolidated, ckpt_consolidation_frequency, consolidation_max_shard_size, "
                "consolidation_max_pending, consolidation_format, consolidation_keep, consolidation_dtype, "
                "consolidation_merge_adapters, consolidation_workers), not both."
            )
        super().__init__(*args, **kwargs)
        self.set_consolidation_settings(consolidation_settings or given)

    def set_consolidation_settings(self, settings: ConsolidationSettings) -> None:
        """Take ``settings`` (already validated) and start a new run's bookkeeping with them."""
        self.consolidation_settings = settings
        self.consolidation: Optional[ConsolidationSchedule] = (
            ConsolidationSchedule(settings.policy) if settings.policy else None
        )
        self._queue: Optional[ConsolidationQueue] = None
        self._outputs: Dict[int, Path] = {}
        self._copies: Dict[int, List[CheckpointSave]] = {}
        #: Due checkpoints that NeMo's top-k retention removed before their consolidation could start.
        self.dropped_by_removal: List[CheckpointSave] = []
        self._warned_drop = False
        # NeMo may remove checkpoints from its own thread (async save): LATEST and retained/ change under this lock.
        self._pointer_lock = threading.RLock()
        #: The trainer's ``ModelCheckpoint`` (set by the consolidation callback): its ``best_model_path`` tells which
        #: saves are the best so far, for ``"best"`` cadences.
        self.checkpoint_callback: Optional[Any] = None
        #: Set while a ``fit`` runs (from its set-up to the strategy's teardown), on global rank 0.
        self.fitting = False
        #: One :class:`ConsolidationRecord` per published consolidation of this run, oldest first.
        self.consolidation_records: List[ConsolidationRecord] = []

    @classmethod
    def from_checkpoint_io(
        cls, checkpoint_io: nemo_io_pl.MegatronCheckpointIO, settings: ConsolidationSettings
    ) -> "MegatronCheckpointIO":
        """Make a consolidating IO with the same settings as NeMo's ``checkpoint_io`` (which is left untouched),
        consolidating as ``settings`` say."""
        upgraded = cls.__new__(cls)
        upgraded.__dict__.update(vars(checkpoint_io))
        upgraded.set_consolidation_settings(settings)
        return upgraded

    @property
    def consolidation_policy(self) -> Optional[ConsolidationPolicy]:
        """The cadence, or ``None`` when consolidation is off."""
        return self.consolidation.policy if self.consolidation else None

    save_consolidated = setting_view("save_consolidated", "The ``save_consolidated`` value given.")
    ckpt_consolidation_frequency = setting_view("frequency", "The ``ckpt_consolidation_frequency`` value given.")
    consolidation_max_shard_size = setting_view("max_shard_size", "Most tensor bytes per output file.")
    consolidation_max_pending = setting_view("max_pending", "Requests that may wait behind the running one.")
    consolidation_format = setting_view("output_format", '``"safetensors"`` or ``"hf"``.')
    consolidation_dtype = setting_view("dtype", "Output dtype (``None``: the checkpoint's).")
    consolidation_merge_adapters = setting_view("merge_adapters", "Merge LoRA adapters into the base model.")
    consolidation_workers = setting_view("workers", "Writer processes per node (``None``: a quarter of cores).")

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> Any:
        """Save as NeMo does; with consolidation on, global rank 0 also records the save for consolidation.

        Returns:
            NeMo's return value (the async request for an async save, else ``None``).
        """
        request = super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        if self.consolidation is not None and is_global_rank_zero():
            save = self.consolidation.register(ckpt_to_dir(path), int(checkpoint.get("global_step", -1)))
            if self.consolidation.policy.uses_best and self._names_best(path):
                save.best = best_record(self.checkpoint_callback)
            if request is None:
                save.written = True
            else:
                request.add_finalize_fn(save.mark_written)
        return request

    def _names_best(self, path: _PATH) -> bool:
        """Whether ``ModelCheckpoint.best_model_path`` names ``path`` (it is set before the save is issued)."""
        best = getattr(self.checkpoint_callback, "best_model_path", None)
        return bool(best) and Path(ckpt_to_dir(best)) == Path(ckpt_to_dir(path))

    @staticmethod
    def is_checkpoint_gone(save: CheckpointSave) -> bool:
        """Whether a finished checkpoint has been removed or is being removed: its directory or the file its format
        writes last (``.metadata``; ``metadata.json`` for ``zarr``) is missing, or NeMo's ``<ckpt>-unfinished`` marker
        is back (NeMo sets it while deleting a checkpoint)."""
        return ModelCheckpoint.is_checkpoint_unfinished(save.path) or not weights_written(save.path / "weights")

    @property
    def queue(self) -> ConsolidationQueue:
        """The consolidation process queue of this run (created on first use, on global rank 0)."""
        if self._queue is None:
            self._queue = ConsolidationQueue(
                self._on_consolidated, self.consolidation_settings, on_dropped=self._on_dropped
            )
        return self._queue

    def consolidate_finished(self, bounded: bool = True) -> None:
        """Hand the saves that finished since the last call and are due under the cadence to the consolidation
        process, and reap/start consolidations. Returns at once (called from the training loop).

        Args:
            bounded: apply the queue's ``max_pending`` bound to them (while training runs); ``False`` when ``fit``
                ends (see :meth:`finish_fit`).
        """
        if self.consolidation is None:
            return
        removed_before = len(self.consolidation.removed_while_due)
        due, copies = self.consolidation.collect_finished(self.is_checkpoint_gone)
        for save in self.consolidation.removed_while_due[removed_before:]:
            self._on_dropped(save)
        if due:
            self.queue.submit_all(due, bounded=bounded)  # finished together: a burst is kept whole
        for copy in copies:
            self._copies.setdefault(copy.global_step, []).append(copy)
            self._link_copies(copy.global_step)
        if self._queue is not None:
            self._queue.poll()

    def consolidate_newest(self) -> bool:
        """Queue the newest finished checkpoint of the run for consolidation (unless it already is consolidated).

        Returns:
            ``True`` if there is a newest finished checkpoint (queued now, or already consolidated), else ``False``.
        """
        if self.consolidation is None:
            return False
        self.consolidate_finished()
        newest = self.consolidation.newest_finished
        if newest is None:
            return False
        if newest.consolidated:
            self._point_latest(newest.path)
        elif not self._in_queue(newest):
            self.queue.submit(newest)
        return True

    def consolidate_best(self) -> Optional[CheckpointSave]:
        """Make sure the run's best finished checkpoint (``ModelCheckpoint.best_model_path``) is consolidated, and
        point ``<root>/BEST`` at it: at once when its output exists (nothing is recomputed, also for a checkpoint
        saved before a resume), else once its consolidation, queued now, is published.

        When the best checkpoint never finished or was removed, nothing else is substituted: a warning names it and
        ``BEST`` is left as it is.

        Returns:
            The best checkpoint's save, or ``None`` (no best recorded, not finished or removed, consolidation off).
        """
        callback = self.checkpoint_callback
        if self.consolidation is None:
            return None
        self.consolidate_finished()
        best_path = getattr(callback, "best_model_path", None)
        if not best_path:
            logger.warning(
                "No best checkpoint to consolidate: ModelCheckpoint(monitor=%r) has ranked no finished checkpoint yet",
                getattr(callback, "monitor", None),
            )
            return None
        best_dir = Path(ckpt_to_dir(best_path))
        save = self.consolidation.finished_save(best_dir)
        if save is None:  # saved before a resume (or never finished)
            step = global_step_in_name(best_dir.name)
            save = CheckpointSave(best_dir, -1 if step is None else step, written=True)
        if self.is_checkpoint_gone(save):
            logger.warning(
                "The best checkpoint %s (%s) never finished or was removed: it is not consolidated and %s is left as "
                "it is",
                best_dir,
                best_record(callback),
                BEST_NAME,
            )
            return None
        save.best = best_record(callback)
        if save.consolidated or (save.path / self.consolidation_settings.output_dirname / METADATA_FILENAME).is_file():
            save.consolidated = True
            self._point_best(save.path)
        elif not self._in_queue(save):
            self.queue.submit(save)
        return save

    def _in_queue(self, save: CheckpointSave) -> bool:
        return self._queue is not None and self._queue.holds(save)

    def finish_fit(self) -> None:
        """End of ``fit``: queue what is due, with ``latest`` the newest checkpoint and with ``best`` the best one
        (:meth:`consolidate_best`); forget saves that never finished (each is logged). Does not wait: see
        :meth:`wait_for_consolidation`.

        The saves that finish now are all queued, whatever ``max_pending``: with async save NeMo finalizes every
        outstanding save when ``fit`` ends, often several at once, and such a burst is not a cadence the
        consolidation cannot keep up with; the end-of-``fit`` wait (``ckpt_consolidation_timeout``) bounds them.
        """
        if self.consolidation is None:
            return
        self.consolidate_finished(bounded=False)
        if self.consolidation.policy.consolidates_at_fit_end:
            self.consolidate_newest()
        if self.consolidation.policy.uses_best:
            self.consolidate_best()
        for save in self.consolidation.drop_pending():
            logger.warning(
                "Checkpoint %s (global step %d) never finished; not consolidated.", save.path, save.global_step
            )

    def wait_for_consolidation(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for running and queued consolidations (see :meth:`ConsolidationQueue.wait`).

        Returns:
            ``True`` if none is left, ``False`` if the timeout ran out (logged; the running one is stopped).
        """
        return True if self._queue is None else self._queue.wait(timeout)

    def start_consolidation_process(self) -> None:
        """Start the run's consolidation process now (training is starting), when this cadence consolidates during
        training, so that its start-up overlaps with training; ``"latest"`` alone waits for the end of ``fit``."""
        policy = self.consolidation_policy
        if policy is not None and (policy.consolidates_periodically or policy.uses_best):
            self.queue.start_process()

    def close_consolidation_queue(self) -> None:
        """End the run's consolidation process, if any (after :meth:`wait_for_consolidation`, at teardown)."""
        self.fitting = False
        if self._queue is not None:
            self._queue.close()

    def end_consolidation_process_unless_fitting(self) -> None:
        """After an on-demand consolidation was waited for outside ``fit``: end the consolidation process it started
        (inside ``fit`` it keeps serving the run until teardown)."""
        if not self.fitting and self._queue is not None and not self._queue.busy:
            self._queue.close()

    def remove_checkpoint_safely(self, checkpoint_dir: Path, remove: Callable[[], None]) -> None:
        """Run ``remove`` for a checkpoint (NeMo's top-k removal) without racing its consolidation, keeping its
        consolidated output as ``ckpt_consolidation_keep`` says and moving ``LATEST`` off it first.

        A queued consolidation of it is dropped (logged); a running one is waited for (``remove`` then runs when its
        process has ended). See :mod:`nemo_patch.training.retention`.
        """
        checkpoint_dir = Path(checkpoint_dir)
        if self.consolidation is None:
            remove()
            return

        def remove_keeping_outputs() -> None:
            self._before_removal(checkpoint_dir)
            remove()

        if self._queue is None:
            remove_keeping_outputs()
        else:
            self._queue.remove_checkpoint(checkpoint_dir, remove_keeping_outputs)

    def _before_removal(self, checkpoint_dir: Path) -> None:
        """Retain the checkpoint's output (within ``keep``) and move ``LATEST`` off it; never raises (logged)."""
        output_name = self.consolidation_settings.output_dirname
        keep = self.consolidation_settings.keep
        root = checkpoint_dir.parent
        with self._pointer_lock:
            try:
                if keep != 0:
                    entry = retain_output(checkpoint_dir, output_name)
                    if entry is not None:
                        logger.info(
                            "Kept the consolidated output of %s as %s: NeMo's top-k retention is removing the "
                            "checkpoint (ckpt_consolidation_keep=%s)",
                            checkpoint_dir.name,
                            entry,
                            keep,
                        )
                        for step, output in self._outputs.items():
                            if output == checkpoint_dir / output_name:
                                self._outputs[step] = entry / output_name
                self._prune_retained(root, removing=checkpoint_dir)
                repoint_best(root, output_name, checkpoint_dir)
            except OSError:
                logger.exception("Could not keep the consolidated output of %s before its removal", checkpoint_dir)

    def _prune_retained(self, root: Path, removing: Optional[Path] = None) -> None:
        """Hold the retained outputs to ``ckpt_consolidation_keep`` and keep ``LATEST`` on a complete output that is
        not ``removing`` (called with the pointer lock held).

        Raises:
            OSError: a retained output or ``LATEST`` cannot be changed.
        """
        output_name = self.consolidation_settings.output_dirname
        prune_retained(root, output_name, self.consolidation_settings.keep)
        repoint_latest(root, output_name, removing=removing)

    def _on_dropped(self, save: CheckpointSave) -> None:
        self.dropped_by_removal.append(save)
        log = logger.debug if self._warned_drop else logger.warning
        log(
            "Checkpoint %s (global step %d) was due for consolidation, but NeMo's top-k retention removed it before "
            "its consolidation could start: not consolidated%s",
            save.path,
            save.global_step,
            (
                ""
                if self._warned_drop
                else " (ModelCheckpoint(save_top_k=...) keeps too few checkpoints for this "
                "cadence; further drops are logged at debug level)"
            ),
        )
        self._warned_drop = True

    def _on_consolidated(self, save: CheckpointSave, error: Optional[str]) -> None:
        if error is not None:
            logger.error(
                "Consolidation of checkpoint %s (global step %d) failed: %s", save.path, save.global_step, error
            )
            return
        save.consolidated = True
        self._record(save)
        self._point_latest(save.path)
        if save.best is not None:
            self._point_best(save.path)
        if self.consolidation_settings.keep is not None:  # a new output may push a retained one out of the newest N
            with self._pointer_lock:
                try:
                    self._prune_retained(save.path.parent)
                except OSError:
                    logger.exception("Could not prune the retained outputs in %s", save.path.parent)
        self._outputs[save.global_step] = save.path / self.consolidation_settings.output_dirname
        self._link_copies(save.global_step)

    def _record(self, save: CheckpointSave) -> None:
        """Keep a :class:`ConsolidationRecord` and log one INFO line: path, size, time and rate."""
        output = save.path / self.consolidation_settings.output_dirname
        try:
            size = sum(entry.stat().st_size for entry in output.iterdir() if entry.is_file())
        except OSError:  # removed since (NeMo's top-k); the record still counts the consolidation
            size = 0
        record = ConsolidationRecord(output, save.global_step, save.seconds or 0.0, size)
        self.consolidation_records.append(record)
        logger.info(
            "Consolidated %s (global step %d): %.1f MB in %.1f s (%.1f MB/s)",
            output,
            save.global_step,
            size / 1e6,
            record.seconds,
            record.bytes_per_second / 1e6,
        )

    @property
    def skipped_count(self) -> int:
        """Due consolidations of this run that did not happen: skipped because the queue was full, or dropped because
        NeMo's top-k removed the checkpoint first."""
        return len(self.dropped_by_removal) + (len(self._queue.skipped) if self._queue is not None else 0)

    def _link_copies(self, global_step: int) -> None:
        output = self._outputs.get(global_step)
        if output is None or not output.is_dir():
            return
        for copy in self._copies.pop(global_step, []):
            if self.is_checkpoint_gone(copy):
                # NeMo replaced this -last copy by a newer one before the step's consolidation ended: nothing to do.
                logger.debug("Checkpoint %s is gone; not reusing %s for it", copy.path, output)
                continue
            try:
                link_consolidated_output(output, copy.path, output.name)
                copy.consolidated = True
            except OSError:
                if self.is_checkpoint_gone(copy):
                    logger.debug("Checkpoint %s was removed while %s was linked into it", copy.path, output)
                else:
                    logger.exception("Could not reuse %s for the copy %s", output, copy.path)

    def _point_latest(self, checkpoint_dir: Path, name: str = "LATEST") -> None:
        with self._pointer_lock:
            if self.is_checkpoint_gone(CheckpointSave(checkpoint_dir, -1)):
                return  # being removed (its output, if any, was kept and the pointer placed then)
            try:
                update_latest_pointer(checkpoint_dir, name=name)
            except OSError:
                logger.exception("Could not point %s at %s", name, checkpoint_dir)

    def _point_best(self, checkpoint_dir: Path) -> None:
        self._point_latest(checkpoint_dir, BEST_NAME)
        logger.info("%s -> %s", BEST_NAME, checkpoint_dir.name)
