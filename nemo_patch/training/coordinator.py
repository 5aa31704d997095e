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

"""The one owner of a run's consolidation state on global rank 0: what happens to a checkpoint after its save.

The checkpoint IO only tells the coordinator about saves (:meth:`ConsolidationCoordinator.before_save`,
:meth:`ConsolidationCoordinator.register`). The coordinator owns the rest: the cadence's schedule, the queue of the
consolidation process, the outputs and the ``-last`` copies that receive them, ``LATEST``/``BEST``, the outputs kept
when NeMo removes their checkpoints, the journal of due consolidations and the metrics.

Threads. The training loop calls it from Lightning's hooks; NeMo removes checkpoints from its own thread under async
save (``strategy.remove_checkpoint``) and from the training thread otherwise. Every decision that reads or changes the
state below is taken under one lock (:attr:`ConsolidationCoordinator.lock`, shared with the queue), so that:

* a checkpoint whose removal has started (:meth:`ConsolidationCoordinator.remove_checkpoint` records it first) is
  never queued, started, linked into or pointed at any more; a consolidation already running delays the removal
  until it has ended (the queue's ``RUNNING`` state is taken in the same locked step that takes it off the queue);
* links into a ``-last`` copy and the keeping of an output before a removal never interleave.

What is only written, never read back, by a later step (the removal's ``rmtree``, the consolidation process's files)
runs outside the lock.

Identity. A save is the :class:`nemo_patch.training.schedule.CheckpointSave` object, not its global step: a second
``trainer.fit`` on the same trainer starts its global steps again, and NeMo may save a new checkpoint into a
directory that held an earlier one (the same ``-last`` name). A save remembers the identity of its weights when it
finished (:func:`weights_identity`); an output is published, kept or linked only while that identity holds. A
``-last`` copy receives links only from the output of its step's save in the same ``fit`` (no optimizer step between
the two saves: the same weights); without one (that checkpoint was removed first) it is consolidated itself.

Journal. ``<root>/.consolidation-due.json`` lists the consolidations that are waiting or running. A job killed
(SIGKILL, a node lost) leaves it behind; the next run of the same root consolidates what it lists when training
starts (:meth:`ConsolidationCoordinator.reconcile`), or says once that it cannot.

Imports the standard library, the engine's layout and publishing helpers and the training side's schedule, queue,
pointers and retention: never NeMo or Lightning.
"""

import dataclasses
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from nemo_patch.engine.checkpoint_layout import is_marked_unfinished, weights_written
from nemo_patch.engine.checkpoint_root import global_step_in_name
from nemo_patch.engine.output_layout import METADATA_FILENAME
from nemo_patch.engine.post_command import PostCommandResult, post_command_log_path, record_result
from nemo_patch.engine.publish import link_output
from nemo_patch.training.hooks import ConsolidationOutcome, read_metadata
from nemo_patch.training.latest import (
    BEST_NAME,
    LATEST_NAME,
    remove_latest_pointer,
    set_aside_non_link,
    update_latest_pointer,
)
from nemo_patch.training.queue import ConsolidationQueue
from nemo_patch.training.retention import (
    consolidated_outputs,
    prune_retained,
    repair_best,
    repoint_best,
    repoint_latest,
    retain_output,
)
from nemo_patch.training.schedule import CheckpointSave, ConsolidationSchedule, RequestState
from nemo_patch.training.settings import ConsolidationSettings

__all__ = ["JOURNAL_NAME", "ConsolidationCoordinator", "ConsolidationRecord", "best_record", "weights_identity"]

logger = logging.getLogger(__name__)

#: The journal of waiting and running consolidations, in the checkpoint root (hidden: no tool takes it for a
#: checkpoint).
JOURNAL_NAME = ".consolidation-due.json"
_JOURNAL_MAX_BYTES = 4 << 20
_LAST_SUFFIX = "-last"


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


def weights_identity(checkpoint_dir: Path) -> Tuple[int, ...]:
    """The identity of a checkpoint's weights as saved: device, inode, size and modification time (ns) of the files a
    save writes last (DCP's ``.metadata``, megatron-core's ``metadata.json``; ``-1`` for one that is missing). A new
    save into the same directory writes them anew, so the identity changes."""
    parts: List[int] = []
    for name in (".metadata", "metadata.json"):
        try:
            stat = os.stat(Path(checkpoint_dir) / "weights" / name)
        except OSError:
            parts.append(-1)
            continue
        parts += [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns]
    return tuple(parts)


def _files_gone(checkpoint_dir: Path) -> bool:
    """Whether a checkpoint is not (or no longer) a finished one on disk: NeMo's ``-unfinished`` marker is there (set
    while it saves or deletes it), or the file its format writes last is missing."""
    return is_marked_unfinished(checkpoint_dir) or not weights_written(checkpoint_dir / "weights")


class ConsolidationCoordinator:
    """Schedule, queue, outputs, ``-last`` links, pointers, retention, journal and metrics of one run (global rank 0).

    Args:
        settings: the run's validated settings (consolidation on: ``settings.policy`` is set).
    """

    def __init__(self, settings: ConsolidationSettings) -> None:
        if settings.policy is None:
            raise ValueError("a ConsolidationCoordinator needs a cadence (consolidation is off)")
        self.settings = settings
        self.schedule = ConsolidationSchedule(settings.policy)
        #: Guards everything below; shared with the queue's request states.
        self.lock = threading.RLock()
        self._queue: Optional[ConsolidationQueue] = None
        #: Checkpoints whose removal was asked for (it may wait for their running consolidation), until NeMo saves
        #: into the directory again.
        self._removing: Set[Path] = set()
        #: Those whose removal proper has started (outputs kept, pointers moved, files being deleted).
        self._deleting: Set[Path] = set()
        #: The save whose output is in each checkpoint directory (published or linked).
        self._outputs: Dict[Path, CheckpointSave] = {}
        #: ``-last`` copies to consolidate themselves (their step's checkpoint was removed first); submitted by the
        #: training thread.
        self._substitutes: List[CheckpointSave] = []
        #: Which ``fit`` of this process is running (1, 2, ...).
        self.fit = 0
        #: The trainer's ``ModelCheckpoint``: its ``best_model_path`` tells which saves are the best so far.
        self.checkpoint_callback: Optional[Any] = None
        #: Due consolidations that did not happen because their checkpoint was removed (or saved again) first.
        self.dropped_by_removal: List[CheckpointSave] = []
        #: One :class:`ConsolidationRecord` per published consolidation of this run, oldest first.
        self.records: List[ConsolidationRecord] = []
        #: Each consolidation of this run that ended (published or not), oldest first, as ``(save, record, post
        #: command result, error)``: what :meth:`outcomes` makes the hooks' results from.
        self._ended_requests: List[
            Tuple[CheckpointSave, Optional[ConsolidationRecord], Optional[PostCommandResult], Optional[str]]
        ] = []
        self._warned_drop = False
        self._journals: Dict[Path, List[Dict[str, Any]]] = {}
        self._warned_journal = False

    # --- the queue ----------------------------------------------------------------------------------------------

    @property
    def queue(self) -> ConsolidationQueue:
        """The consolidation process queue of this run (created on first use)."""
        if self._queue is None:
            self._queue = ConsolidationQueue(
                self._on_consolidated,
                self.settings,
                on_dropped=self._on_dropped,
                lock=self.lock,
                is_gone=self.is_gone,
            )
        return self._queue

    def start_process(self) -> None:
        """Start the consolidation process now when the cadence consolidates during training (``"latest"`` alone waits
        for the end of ``fit``), so that its start-up overlaps with training."""
        policy = self.schedule.policy
        if policy.consolidates_periodically or policy.uses_best:
            self.queue.start_process()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for running and queued consolidations (see :meth:`ConsolidationQueue.wait`).

        Returns:
            ``True`` if none is left, ``False`` if the timeout ran out (logged; the running one is stopped).
        """
        self._submit_substitutes()
        done = True if self._queue is None else self._queue.wait(timeout)
        self._sync_journal()
        return done

    def close(self) -> None:
        """End the consolidation process, if any (after :meth:`wait`)."""
        if self._queue is not None:
            self._queue.close()
        self._sync_journal()

    @property
    def skipped_count(self) -> int:
        """Due consolidations of this run that did not happen: skipped because the queue was full, or dropped because
        their checkpoint was removed (or saved again) before or while they ran."""
        return len(self.dropped_by_removal) + (len(self._queue.skipped) if self._queue is not None else 0)

    # --- saves --------------------------------------------------------------------------------------------------

    def begin_fit(self) -> None:
        """A ``fit`` starts (see :meth:`ConsolidationSchedule.begin_fit`)."""
        with self.lock:
            self.fit += 1
            self.schedule.begin_fit()

    def before_save(self, checkpoint_dir: Path) -> None:
        """NeMo is about to save a checkpoint into ``checkpoint_dir`` (training thread, before any file is written).

        An output already there belongs to an earlier save of that directory (e.g. the ``-last`` copy of a first
        ``fit``, saved again by a second one): it is kept as a removal would keep it, the pointers move off it, and
        it is deleted, so that it is never taken for the new weights' output. A request of that earlier save is
        dropped when it would start (its weights changed)."""
        checkpoint_dir = Path(checkpoint_dir)
        output = checkpoint_dir / self.settings.output_dirname
        with self.lock:
            self._removing.discard(checkpoint_dir)
            self._deleting.discard(checkpoint_dir)
            if os.path.lexists(output):
                self._keep_outputs_and_move_pointers(checkpoint_dir)  # moves the earlier save's output if kept
                shutil.rmtree(output, ignore_errors=True)
                logger.info(
                    "Removed %s: it was made from an earlier save of %s, and NeMo saves a new checkpoint there",
                    output,
                    checkpoint_dir.name,
                )
            earlier = self._outputs.pop(checkpoint_dir, None)
            if earlier is not None and earlier.output == output:
                earlier.output = None

    def register(
        self, checkpoint_dir: Path, global_step: int, best: Optional[Dict[str, Any]] = None
    ) -> CheckpointSave:
        """Record a save that the checkpoint IO has just issued (not finished yet)."""
        with self.lock:
            save = self.schedule.register(Path(checkpoint_dir), global_step, self.fit)
            save.best = best
        return save

    def is_gone(self, save: CheckpointSave) -> bool:
        """Whether ``save``'s checkpoint is removed or being removed (its removal asked for, NeMo's marker back, its
        last-written file missing), or was saved again since it finished (its weights' identity changed)."""
        with self.lock:
            if save.path in self._removing:
                return True
        if _files_gone(save.path):
            return True
        return save.identity is not None and weights_identity(save.path) != save.identity

    def _changed(self, save: CheckpointSave) -> bool:
        """Whether the checkpoint's files are no longer those ``save`` finished with (removal bookkeeping aside)."""
        return _files_gone(save.path) or (save.identity is not None and weights_identity(save.path) != save.identity)

    # --- the training loop's steps -----------------------------------------------------------------------------

    def consolidate_finished(self, bounded: bool = True) -> None:
        """Hand the saves that finished since the last call and are due to the consolidation process, give ``-last``
        copies their step's output, and reap/start consolidations. Returns at once (called from the training loop).

        Args:
            bounded: apply the queue's ``max_pending`` bound (while training runs); ``False`` when ``fit`` ends.
        """
        removed_before = len(self.schedule.removed_while_due)
        due, copies = self.schedule.collect_finished(self.is_gone)
        for save in due + copies:
            save.identity = weights_identity(save.path)
        for save in self.schedule.removed_while_due[removed_before:]:
            self._lost(save, "NeMo's top-k retention removed it before its consolidation could start")
        if due:
            self.queue.submit_all(due, bounded=bounded)  # finished together: a burst is kept whole
        for copy in copies:
            self._place_copy(copy)
        self._submit_substitutes(bounded)
        if self._queue is not None:
            self._queue.poll()
        self._sync_journal()

    def consolidate_newest(self) -> bool:
        """Queue the newest finished checkpoint of the run for consolidation (unless it already is consolidated).

        Returns:
            ``True`` if there is a newest finished checkpoint (queued now, or already consolidated), else ``False``.
        """
        self.consolidate_finished()
        newest = self.schedule.newest_finished
        if newest is None:
            return False
        if newest.consolidated:
            self._point(newest.path)
        elif not newest.state.outstanding:
            self.queue.submit(newest)
            self._sync_journal()
        return True

    def consolidate_best(self) -> Optional[CheckpointSave]:
        """Make sure the run's best finished checkpoint (``ModelCheckpoint.best_model_path``) is consolidated, and
        point ``<root>/BEST`` at it: at once when its output exists, else once its consolidation, queued now, is
        published. A best checkpoint that never finished or was removed is not substituted: a warning names it.

        Returns:
            The best checkpoint's save, or ``None`` (no best recorded, not finished or removed).
        """
        callback = self.checkpoint_callback
        self.consolidate_finished()
        best_path = getattr(callback, "best_model_path", None)
        if not best_path:
            logger.warning(
                "No best checkpoint to consolidate: ModelCheckpoint(monitor=%r) has ranked no finished checkpoint yet",
                getattr(callback, "monitor", None),
            )
            return None
        best_dir = Path(str(best_path).removesuffix(".ckpt"))
        save = self.schedule.finished_save(best_dir)
        if save is None:  # saved before a resume (or never finished)
            step = global_step_in_name(best_dir.name)
            save = CheckpointSave(best_dir, -1 if step is None else step, written=True, fit=self.fit)
        if self.is_gone(save):
            logger.warning(
                "The best checkpoint %s (%s) never finished or was removed: it is not consolidated and %s is left as "
                "it is",
                best_dir,
                best_record(callback),
                BEST_NAME,
            )
            return None
        save.best = best_record(callback)
        if save.consolidated or (save.path / self.settings.output_dirname / METADATA_FILENAME).is_file():
            save.consolidated = True
            self._point(save.path, BEST_NAME)
        elif not save.state.outstanding:
            save.identity = weights_identity(save.path)
            self.queue.submit(save)
            self._sync_journal()
        return save

    def finish_fit(self) -> None:
        """End of ``fit``: queue what is due (all of it: see the queue's ``bounded``), with ``latest`` the newest
        checkpoint and with ``best`` the best one; forget saves that never finished (each is logged)."""
        self.consolidate_finished(bounded=False)
        if self.schedule.policy.consolidates_at_fit_end:
            self.consolidate_newest()
        if self.schedule.policy.uses_best:
            self.consolidate_best()
        for save in self.schedule.drop_pending():
            logger.warning(
                "Checkpoint %s (global step %d) never finished; not consolidated.", save.path, save.global_step
            )

    # --- -last copies -------------------------------------------------------------------------------------------

    def _place_copy(self, copy: CheckpointSave) -> None:
        """Give a finished ``-last`` copy its output: links of its step's output when that exists (or once it is
        published), else, when that checkpoint was removed before it could be consolidated, its own consolidation.

        A copy of a step the cadence did not make due (yet) waits on its step's save too: ``fit``'s end may still
        consolidate that save (``latest``'s newest checkpoint, ``best``'s best one), and its output is then linked
        into the copy (or, should the save be dropped first, the copy is consolidated itself)."""
        source = copy.copy_of
        if source is None or not copy.path.name.endswith(_LAST_SUFFIX):
            return
        with self.lock:
            if source.output is not None and (source.output / METADATA_FILENAME).is_file():
                self._link_copy(copy, source)
            elif source.state.outstanding or (not copy.due and source.state is RequestState.NONE):
                source.copies.append(copy)
            elif not copy.due:
                return
            elif source.state in (RequestState.DROPPED, RequestState.NONE) or source.output is not None:
                self._substitute(source, copy)  # removed before it could start, or its output went with it (keep=0)

    def _substitute(self, source: CheckpointSave, copy: CheckpointSave) -> None:
        """``source`` was removed before its consolidation could start: consolidate its ``-last`` copy (the same
        weights) instead, from the training thread (called with the lock held)."""
        if self.is_gone(copy) or copy in self._substitutes:
            return
        if source in self.dropped_by_removal:
            self.dropped_by_removal.remove(source)
        self._substitutes.append(copy)
        logger.info(
            "Checkpoint %s (global step %d) was removed before its consolidation could start; consolidating its copy "
            "%s (the same weights) instead",
            source.path.name,
            source.global_step,
            copy.path.name,
        )

    def _submit_substitutes(self, bounded: bool = True) -> None:
        with self.lock:
            substitutes, self._substitutes = self._substitutes, []
        if substitutes:
            self.queue.submit_all(substitutes, bounded=bounded)

    def _link_copy(self, copy: CheckpointSave, source: CheckpointSave) -> None:
        """Hard-link ``source``'s output into the ``-last`` copy (under the lock: never into a copy whose removal has
        started, and a removal that starts meanwhile waits for the link to be complete)."""
        name = self.settings.output_dirname
        with self.lock:
            output = source.output
            if output is None or not (output / METADATA_FILENAME).is_file():
                return
            if self.is_gone(copy):
                logger.debug("Checkpoint %s is gone or being removed; not linking %s into it", copy.path, output)
                return
            replace: Dict[str, bytes] = {}
            if output != source.path / name:  # kept under retained/: its metadata.json was rewritten for that place
                metadata = json.loads((output / METADATA_FILENAME).read_text())
                metadata.pop("retained_from", None)
                if isinstance(metadata.get("source_checkpoint"), str):
                    metadata["source_checkpoint"] = os.path.relpath(copy.path / "weights", copy.path / name)
                replace[METADATA_FILENAME] = (json.dumps(metadata, indent=2, sort_keys=True) + "\n").encode()
            try:
                link_output(output, copy.path / name, replace_files=replace)
            except OSError:
                logger.exception("Could not reuse %s for the copy %s", output, copy.path)
                return
            copy.consolidated, copy.output = True, copy.path / name
            self._outputs[copy.path] = copy

    # --- removals -----------------------------------------------------------------------------------------------

    def remove_checkpoint(self, checkpoint_dir: Path, remove: Callable[[], None]) -> None:
        """Run ``remove`` for a checkpoint (NeMo's removal, from any thread) without racing its consolidation: from
        this call on, nothing queues, starts, links into or points at it; a waiting request of it is dropped
        (logged); a running one delays ``remove`` until it has ended. Then its output is kept as
        ``ConsolidationConfig.keep`` says and ``LATEST``/``BEST`` move off it, and ``remove`` runs."""
        checkpoint_dir = Path(checkpoint_dir)
        with self.lock:
            self._removing.add(checkpoint_dir)

        def removal() -> None:
            with self.lock:
                self._deleting.add(checkpoint_dir)
                self._keep_outputs_and_move_pointers(checkpoint_dir)
            remove()

        if self._queue is None:
            removal()
        else:
            self._queue.remove_checkpoint(checkpoint_dir, removal)
        self._sync_journal()

    def _keep_outputs_and_move_pointers(self, checkpoint_dir: Path) -> None:
        """Keep the checkpoint's output (within ``keep``) and move ``LATEST``/``BEST`` off it, each step on its own:
        a failure to keep (disk full, a link limit) is logged, leaves no entry behind, and the pointers still move
        (to a surviving output, or they are removed). Called with the lock held; never raises."""
        name, keep, root = self.settings.output_dirname, self.settings.config.keep, checkpoint_dir.parent
        if keep != 0:
            try:
                entry = retain_output(checkpoint_dir, name)
            except OSError as error:
                entry = None
                logger.error(
                    "Could not keep the consolidated output of %s before its removal (%s): it goes with the "
                    "checkpoint; LATEST and BEST move to a remaining output",
                    checkpoint_dir,
                    error,
                )
            if entry is not None:
                logger.info(
                    "Kept the consolidated output of %s as %s: NeMo is removing the checkpoint "
                    "(ConsolidationConfig.keep=%s)",
                    checkpoint_dir.name,
                    entry,
                    keep,
                )
                save = self._outputs.get(checkpoint_dir)
                if save is not None and save.output == checkpoint_dir / name:
                    save.output = entry / name
        try:
            prune_retained(root, name, keep)
        except OSError:
            logger.exception("Could not prune the retained outputs in %s", root)
        self._move_pointer_off(root, LATEST_NAME, checkpoint_dir)
        self._move_pointer_off(root, BEST_NAME, checkpoint_dir)

    def _move_pointer_off(self, root: Path, pointer: str, removing: Optional[Path]) -> None:
        """Keep ``pointer`` off ``removing`` (and off a gone output); if it cannot be moved, remove it (logged)."""
        name = self.settings.output_dirname
        try:
            if pointer == LATEST_NAME:
                repoint_latest(root, name, removing=removing)
            elif removing is not None:
                repoint_best(root, name, removing)
            else:
                repair_best(root, name)
        except OSError as error:
            try:
                remove_latest_pointer(root, pointer)
                logger.error("Could not move %s (%s): removed it, so that it does not dangle", pointer, error)
            except OSError:
                logger.exception("Could not move or remove %s in %s", pointer, root)

    # --- results ------------------------------------------------------------------------------------------------

    def _on_dropped(self, save: CheckpointSave) -> None:
        """The queue dropped a waiting request: its checkpoint was removed, or saved again, first."""
        with self.lock:
            copy = next((copy for copy in save.copies if not self.is_gone(copy)), None)
            save.copies = []
            if copy is not None:
                self._substitute(save, copy)
                return
        if not save.path.exists() or save.path in self._removing or is_marked_unfinished(save.path):
            reason = "NeMo's top-k retention removed it before its consolidation could start"
        else:
            reason = "NeMo saved a new checkpoint into its directory before its consolidation could start"
        self._lost(save, reason)
        self._sync_journal()

    def _lost(self, save: CheckpointSave, reason: str) -> None:
        """Count a due consolidation that did not happen because of a removal (``consolidation/skipped``) and log it:
        the first as a warning, later ones at debug level."""
        with self.lock:
            if save in self.dropped_by_removal:
                return
            self.dropped_by_removal.append(save)
            warned, self._warned_drop = self._warned_drop, True
        (logger.debug if warned else logger.warning)(
            "Checkpoint %s (global step %d) was due for consolidation, but %s: not consolidated%s",
            save.path,
            save.global_step,
            reason,
            (
                ""
                if warned
                else " (ModelCheckpoint(save_top_k=...) keeps too few checkpoints for this cadence; further drops are "
                "logged at debug level)"
            ),
        )

    def _on_consolidated(self, save: CheckpointSave, error: Optional[str]) -> None:
        """A request ended (training thread, from the queue's poll or wait)."""
        output = save.path / self.settings.output_dirname
        if error is not None:
            if self._changed(save):  # its files went (or were saved again) under it, not through a removal it delays
                self._lost(save, f"its checkpoint was removed or saved again while it was consolidated ({error})")
            else:
                logger.error(
                    "Consolidation of checkpoint %s (global step %d) failed: %s", save.path, save.global_step, error
                )
            self._ended(save, error=error)
            self._sync_journal()
            return
        with self.lock:
            if self._changed(save):  # its directory was saved into again (or deleted) while it ran
                if (save.path / "weights").is_dir():  # not being deleted: the output would pass for the new weights'
                    shutil.rmtree(output, ignore_errors=True)
                self._lost(save, "NeMo saved a new checkpoint into its directory (or removed it) while it ran")
                self._ended(save, error="its checkpoint was saved again (or removed) while it was consolidated")
                self._sync_journal()
                return
            save.consolidated, save.output = True, output
            self._outputs[save.path] = save
        self._ended(save, record=self._record(save))
        self._point(save.path)
        if save.best is not None:
            self._point(save.path, BEST_NAME)
            logger.info("%s -> %s", BEST_NAME, save.path.name)
        if self.settings.config.keep is not None:  # a new output may push a retained one out of the newest N
            with self.lock:
                try:
                    prune_retained(save.path.parent, self.settings.output_dirname, self.settings.config.keep)
                except OSError:
                    logger.exception("Could not prune the retained outputs in %s", save.path.parent)
                self._move_pointer_off(save.path.parent, LATEST_NAME, None)
        with self.lock:
            copies, save.copies = save.copies, []
        for copy in copies:
            self._link_copy(copy, save)
        self._sync_journal()

    def _record(self, save: CheckpointSave) -> ConsolidationRecord:
        """Keep a :class:`ConsolidationRecord` and log one INFO line: path, size, time and rate (the post command's
        time is not the consolidation's)."""
        output = save.path / self.settings.output_dirname
        try:
            size = sum(entry.stat().st_size for entry in output.iterdir() if entry.is_file())
        except OSError:
            size = 0
        post_seconds = (save.post_command or {}).get("seconds")
        if not isinstance(post_seconds, (int, float)) or isinstance(post_seconds, bool):
            post_seconds = 0.0
        record = ConsolidationRecord(output, save.global_step, max((save.seconds or 0.0) - post_seconds, 0.0), size)
        self.records.append(record)
        logger.info(
            "Consolidated %s (global step %d): %.1f MB in %.1f s (%.1f MB/s)",
            output,
            save.global_step,
            size / 1e6,
            record.seconds,
            record.bytes_per_second / 1e6,
        )
        return record

    def _ended(
        self, save: CheckpointSave, record: Optional[ConsolidationRecord] = None, error: Optional[str] = None
    ) -> None:
        """Keep a request that ended (``record`` when it published, else ``error``) for :meth:`outcomes` and log its
        post command's result: one INFO line, or a WARNING when it failed, timed out or was stopped (the output stays
        published either way). A post command whose result was lost with the consolidation process is recorded in
        ``metadata.json`` here."""
        output = save.path / self.settings.output_dirname
        post: Optional[PostCommandResult] = None
        if error is None and save.post_command is not None:
            post = PostCommandResult.from_json(save.post_command)
            if not post.command:  # lost with the process (queue.py): record what is known
                command = self.settings.config.post_command or ""
                post = PostCommandResult.from_json({**save.post_command, "command": command})
                try:
                    record_result(output, post)
                except OSError:
                    logger.debug("Could not record the post command's loss in %s", output, exc_info=True)
            (logger.info if post.ok else logger.warning)(
                "After publishing %s (global step %d): %s%s%s",
                output,
                save.global_step,
                post.describe(),
                f"; metrics {post.metrics}" if post.metrics else "",
                "" if post.ok else "; the output stays published, training goes on",
            )
        with self.lock:
            self._ended_requests.append((save, record, post, error))

    @property
    def ended_count(self) -> int:
        """How many consolidations of this run have ended (published or not)."""
        return len(self._ended_requests)

    def outcomes(self, start: int = 0) -> List[ConsolidationOutcome]:
        """A :class:`ConsolidationOutcome` for each consolidation of this run that ended, from the ``start``-th on
        (oldest first), made now: an output is named where it is now (under ``retained/`` once NeMo removed its
        checkpoint, e.g. a removal that waited for that consolidation) and its ``metadata.json`` read from there."""
        with self.lock:
            ended = self._ended_requests[start:]
            outcomes = []
            for save, record, post, error in ended:
                output = save.path / self.settings.output_dirname
                if error is None and save.output is not None and save.output.name == output.name:
                    output = save.output
                    kept_log = post_command_log_path(output)
                    if post is not None and kept_log.is_file():  # retention kept the command's log beside it
                        post = dataclasses.replace(post, log=str(kept_log))
                outcomes.append(
                    ConsolidationOutcome(
                        output_dir=output,
                        checkpoint_dir=save.path,
                        format=self.settings.config.format,
                        global_step=save.global_step,
                        bytes=record.bytes if record is not None else 0,
                        seconds=record.seconds if record is not None else save.seconds or 0.0,
                        metadata=read_metadata(output) if error is None else {},
                        post_command=post,
                        error=error,
                    )
                )
        return outcomes

    # --- pointers -----------------------------------------------------------------------------------------------

    def _point(self, checkpoint_dir: Path, pointer: str = LATEST_NAME) -> None:
        """Point ``LATEST`` (or ``BEST``) at a checkpoint whose output was published, unless its removal has started
        (its output was kept and the pointer placed then). Something that took the pointer's place (a directory a
        sync tool made by following the link) is moved aside first (a warning)."""
        with self.lock:
            if checkpoint_dir in self._deleting or _files_gone(checkpoint_dir):
                return
            try:
                update_latest_pointer(checkpoint_dir, name=pointer)
                return
            except OSError:
                if not self._set_aside(checkpoint_dir.parent, pointer):
                    logger.exception("Could not point %s at %s", pointer, checkpoint_dir)
                    return
            try:
                update_latest_pointer(checkpoint_dir, name=pointer)
            except OSError:
                logger.exception("Could not point %s at %s", pointer, checkpoint_dir)

    def _set_aside(self, root: Path, pointer: str) -> bool:
        """Move aside what took ``<root>/<pointer>``'s place (not a symlink); ``True`` if something was moved."""
        try:
            aside = set_aside_non_link(root, pointer)
        except OSError as error:
            logger.error("%s in %s is not a symlink and cannot be moved aside: %s", pointer, root, error)
            return False
        if aside is not None:
            logger.warning(
                "%s in %s was a directory or file, not the symlink this package keeps there (e.g. a copy made by a "
                "tool that follows symlinks): moved it to %s and made %s a symlink again",
                pointer,
                root,
                aside.name,
                pointer,
            )
        return aside is not None

    def reconcile(self, root: Path) -> None:
        """When training starts (global rank 0, after NeMo's own start-up clean-up): repair the pointers (moved
        aside when something replaced them, moved off outputs that are gone, ``LATEST`` re-created on the newest
        output when it was missing after a repair) and consolidate what the journal of an earlier run of this root
        lists as due but never finished (that run was killed), or say once that it cannot."""
        root = Path(root)
        name = self.settings.output_dirname
        with self.lock:
            for pointer in (LATEST_NAME, BEST_NAME):
                repaired = self._set_aside(root, pointer)
                if repaired and pointer == LATEST_NAME:
                    outputs = consolidated_outputs(root, name)
                    if outputs:
                        try:
                            update_latest_pointer(outputs[0].entry, root)
                        except OSError:
                            logger.exception("Could not point LATEST at %s", outputs[0].entry)
                self._move_pointer_off(root, pointer, None)
        self._resume_journal(root)

    # --- the journal --------------------------------------------------------------------------------------------

    def _journal_entries(self) -> Dict[Path, List[Dict[str, Any]]]:
        entries: Dict[Path, List[Dict[str, Any]]] = {}
        for save in self._queue.outstanding() if self._queue is not None else []:
            entry: Dict[str, Any] = {"checkpoint": save.path.name, "global_step": save.global_step}
            if save.best is not None:
                entry["best"] = save.best
            copies = [{"checkpoint": c.path.name, "identity": list(c.identity or ())} for c in save.copies]
            if copies:
                entry["copies"] = copies
            entries.setdefault(save.path.parent, []).append(entry)
        return entries

    def _sync_journal(self) -> None:
        """Write the journal of each root whose waiting/running consolidations changed (removed when none is left).
        A journal that cannot be written is logged once at debug level (the run goes on)."""
        with self.lock:
            entries = self._journal_entries()
            for root in set(entries) | set(self._journals):
                now = entries.get(root, [])
                if self._journals.get(root, []) == now:
                    continue
                path = root / JOURNAL_NAME
                try:
                    if now:
                        tmp = root / f"{JOURNAL_NAME}.tmp-{os.getpid()}"
                        tmp.write_text(json.dumps({"version": 1, "due": now}, indent=1) + "\n")
                        os.replace(tmp, path)
                    else:
                        path.unlink(missing_ok=True)
                except OSError as error:
                    if not self._warned_journal:
                        logger.debug("Could not write %s: %s", path, error)
                    self._warned_journal = True
                    continue
                if now:
                    self._journals[root] = now
                else:
                    self._journals.pop(root, None)

    def _resume_journal(self, root: Path) -> None:
        """Queue the consolidations an earlier run of ``root`` left due (its journal), or say why it cannot."""
        path = root / JOURNAL_NAME
        try:
            if not path.is_file() or path.stat().st_size > _JOURNAL_MAX_BYTES:
                return
            listed = json.loads(path.read_text()).get("due", [])
        except (OSError, ValueError, AttributeError):
            logger.warning("Ignoring an unreadable %s", path)
            return
        name = self.settings.output_dirname
        resumed: List[CheckpointSave] = []
        gone: List[str] = []
        for entry in listed if isinstance(listed, list) else []:
            checkpoint = _entry_path(root, entry)
            if checkpoint is None or (checkpoint / name / METADATA_FILENAME).is_file():
                continue  # unreadable entry, or finished since (e.g. by a consolidation process that outlived it)
            if _files_gone(checkpoint):
                gone.append(checkpoint.name)
                continue
            step = entry.get("global_step")
            save = CheckpointSave(checkpoint, step if isinstance(step, int) else -1, written=True, fit=self.fit)
            save.best = entry.get("best") if isinstance(entry.get("best"), dict) else None
            save.due, save.identity = True, weights_identity(checkpoint)
            for listed_copy in entry.get("copies", []) if isinstance(entry.get("copies"), list) else []:
                copy_path = _entry_path(root, listed_copy)
                identity = listed_copy.get("identity") if isinstance(listed_copy, dict) else None
                if copy_path is None or not isinstance(identity, list):
                    continue
                if not _files_gone(copy_path) and list(weights_identity(copy_path)) == identity:  # not saved since
                    copy = CheckpointSave(copy_path, save.global_step, written=True, fit=self.fit, due=True)
                    copy.copy_of, copy.identity = save, tuple(identity)
                    save.copies.append(copy)
            resumed.append(save)
        if gone:
            logger.warning(
                "The consolidation of %s was due when an earlier run of %s ended without finishing it (the job was "
                "killed?), and cannot be done now: the checkpoint is gone or unfinished",
                ", ".join(gone),
                root,
            )
        if resumed:
            logger.warning(
                "Consolidating %s now: due when an earlier run of %s ended without finishing it (the job was killed?)",
                ", ".join(save.path.name for save in resumed),
                root,
            )
            self.queue.submit_all(resumed, bounded=False)
        with self.lock:
            self._journals[root] = [{"stale": True}]  # rewritten (or removed) by the sync below
        self._sync_journal()


def _entry_path(root: Path, entry: Any) -> Optional[Path]:
    """The checkpoint a journal entry names: a plain directory name inside ``root``, else ``None``."""
    name = entry.get("checkpoint") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
        return None
    return root / name
