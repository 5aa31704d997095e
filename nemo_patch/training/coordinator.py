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

Every decision is taken under one lock, shared with the queue: a checkpoint whose removal has started is never queued,
started or linked into, and a running consolidation delays the removal. The per-step pass runs on a
:class:`~.background.PollingWorker` (the stepper); the training thread's other entry points first finish it
(:meth:`ConsolidationCoordinator.sync`). Extensions are observers (:class:`~.schedule.ConsolidationObserver`).
"""

import logging
import os
import shutil
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set

from nemo_patch.engine.checkpoint_layout import is_marked_unfinished
from nemo_patch.engine.output_layout import METADATA_FILENAME
from nemo_patch.engine.publish import link_output
from nemo_patch.runs.checkpoint_root import is_copy_name
from nemo_patch.training.background import PollingWorker
from nemo_patch.training.policy import ConsolidationPolicy
from nemo_patch.training.queue import ConsolidationQueue
from nemo_patch.training.schedule import (
    OBSERVER_FACTORIES,
    CheckpointSave,
    ConsolidationObserver,
    ConsolidationSchedule,
    ObserverOf,
    RequestState,
    files_gone,
    weights_identity,
)
from nemo_patch.training.settings import ConsolidationSettings

__all__ = ["CORE_OBSERVERS", "ConsolidationCoordinator", "ConsolidationRecord", "new_run_id", "weights_identity"]

#: The observers every coordinator has after those registered (:func:`~.schedule.register_observer`), unless
#: registered among them: retention and ``LATEST`` (:mod:`.retention`), then the callbacks' hooks (:mod:`.hooks`).
CORE_OBSERVERS = (ObserverOf("nemo_patch.training.retention"), ObserverOf("nemo_patch.training.hooks"))

logger = logging.getLogger(__name__)

#: NeMo's ``ModelCheckpoint`` -> the coordinator of the ``fit`` it serves (for the deletions it makes by itself).
_BY_CHECKPOINT_CALLBACK: "weakref.WeakKeyDictionary[Any, ConsolidationCoordinator]" = weakref.WeakKeyDictionary()


def new_run_id() -> str:
    """A new training run's id: when it started (UTC) and 8 random hex digits, e.g. ``20261202T162711Z-3f9a1c0d``."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ConsolidationRecord:
    """A published consolidation: output, global step, wall seconds (a post command's excluded), bytes on disk."""

    output_dir: Path
    global_step: int
    seconds: float
    bytes: int

    @property
    def bytes_per_second(self) -> float:
        """Output bytes per wall second (0 when no time was measured)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


class ConsolidationCoordinator:
    """Schedule, queue, outputs, ``-last`` copies and removals of one run (global rank 0).

    Args:
        settings: the run's validated settings (consolidation on).
        is_global_zero: tells whether this process is global rank 0, the one that records saves.
    """

    def __init__(self, settings: ConsolidationSettings, is_global_zero: Callable[[], bool] = lambda: True) -> None:
        if settings.policy is None:
            raise ValueError("a ConsolidationCoordinator needs a cadence (consolidation is off)")
        self.settings = settings
        self.is_global_zero = is_global_zero
        self.schedule = ConsolidationSchedule(settings.policy)
        #: Guards everything below; shared with the queue's request states.
        self.lock = threading.RLock()
        self._queue: Optional[ConsolidationQueue] = None
        #: Checkpoints whose removal was asked for (it may wait for their running consolidation), until saved again.
        self._removing: Set[Path] = set()
        #: Those whose removal proper has started (outputs kept, pointers moved, files being deleted).
        self.deleting: Set[Path] = set()
        #: The save whose output is in each checkpoint directory (published or linked).
        self._outputs: Dict[Path, CheckpointSave] = {}
        #: ``-last`` copies to consolidate themselves (their step's checkpoint was removed first).
        self._substitutes: List[CheckpointSave] = []
        #: Which ``fit`` of this process is running (1, 2, ...), and whether it is (set up to teardown).
        self.fit = 0
        self.fit_started_ns: Optional[int] = None
        self.fitting = False
        #: The training run its saves belong to (``"run"`` in their outputs' ``metadata.json``): a new id when a
        #: ``fit`` starts, then the one stored in the checkpoint it resumes from, if any (``ConsolidationCallback``).
        self.run_id: str = new_run_id()
        self.checkpoint_callback: Optional[Any] = None
        #: Due consolidations that did not happen because their checkpoint was removed (or saved again) first.
        self.dropped_by_removal: List[CheckpointSave] = []
        self._warned_drop = False
        #: Links a published output into its ``-last`` copies off the training thread (each under :attr:`lock`).
        self._linker = PollingWorker("consolidation-links")
        #: Does the training loop's per-step pass (:meth:`after_step`) off the training thread.
        self._stepper = PollingWorker("consolidation-steps")
        self._step_handed = False
        #: Seconds the training thread waited in a save for the stepper's pass (:meth:`sync`).
        self.synced_seconds = 0.0
        core = [make for make in CORE_OBSERVERS if make not in OBSERVER_FACTORIES]
        factories: List[Callable[[Any], ConsolidationObserver]] = [*OBSERVER_FACTORIES, *core]
        self.observers: List[ConsolidationObserver] = [make(self) for make in factories]
        #: The observers that report in the training loop (those whose ``report`` does something).
        self.reporters = [o for o in self.observers if type(o).report is not ConsolidationObserver.report]

    @property
    def policy(self) -> ConsolidationPolicy:
        """The cadence."""
        return self.schedule.policy

    def notify(self, event: str, *args: Any) -> None:
        """Call ``event`` (a :class:`ConsolidationObserver` method) of every observer."""
        for observer in self.observers:
            getattr(observer, event)(*args)

    def observer(self, kind: type) -> Any:
        """This run's observer of class ``kind`` (``None`` when that feature is not installed)."""
        return next((observer for observer in self.observers if isinstance(observer, kind)), None)

    @staticmethod
    def of_checkpoint_callback(checkpoint_callback: Any) -> Optional["ConsolidationCoordinator"]:
        """The coordinator of the ``fit`` that ``checkpoint_callback`` (NeMo's ``ModelCheckpoint``) last started."""
        return _BY_CHECKPOINT_CALLBACK.get(checkpoint_callback)

    @property
    def queue(self) -> ConsolidationQueue:
        """The consolidation process queue of this run (created on first use)."""
        if self._queue is None:
            self._queue = ConsolidationQueue(
                self._on_consolidated, self.settings, on_dropped=self._on_dropped, lock=self.lock, is_gone=self.is_gone
            )
        return self._queue

    def start_process(self) -> None:
        """Start the stepper's thread, and the consolidation process unless only the end of ``fit`` consolidates."""
        self._stepper.start()
        if self.policy.consolidates_periodically or self.policy.uses_best:
            self.queue.start_process()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for running and queued consolidations (:meth:`ConsolidationQueue.wait`)."""
        self.sync()
        self._submit_substitutes()
        done = True if self._queue is None else self._queue.wait(timeout)
        self._linker.drain()  # the links handed to the linker's thread
        self.notify("on_changed")
        return done

    def close(self) -> None:
        """End the consolidation process, if any (after :meth:`wait`)."""
        self.fitting = False
        self.sync()
        if self._queue is not None:
            self._queue.close()
        self._linker.drain()
        self.notify("on_changed")

    def end_process_unless_fitting(self) -> None:
        """After an on-demand consolidation outside ``fit``: end the process it started."""
        if not self.fitting and self._queue is not None and not self._queue.busy:
            self._queue.close()

    @property
    def skipped_count(self) -> int:
        """Due consolidations of this run that did not happen (queue full, or their checkpoint removed first)."""
        return len(self.dropped_by_removal) + (len(self._queue.skipped) if self._queue is not None else 0)

    def begin_fit(self, checkpoint_callback: Optional[Any] = None) -> None:
        """A ``fit`` starts (its global steps may start again), with NeMo's ``ModelCheckpoint``."""
        with self.lock:
            self.fit += 1
            self.run_id = new_run_id()
            self.fit_started_ns = time.time_ns()  # a save that finished before is older than every one of this fit
            self.schedule.begin_fit()
            if checkpoint_callback is not None:
                self.checkpoint_callback = checkpoint_callback
                _BY_CHECKPOINT_CALLBACK[checkpoint_callback] = self

    def before_save(self, checkpoint_dir: Path) -> None:
        """NeMo is about to save into ``checkpoint_dir`` (global rank 0): an output already there is an earlier save's;
        observers see it as removed, then it is deleted (it would pass for the new weights')."""
        if not self.is_global_zero():
            return
        self.sync(in_save=True)
        checkpoint_dir = Path(checkpoint_dir)
        output = checkpoint_dir / self.settings.output_dirname
        with self.lock:
            self._removing.discard(checkpoint_dir)
            self.deleting.discard(checkpoint_dir)
            if os.path.lexists(output):
                self.notify("before_removal", checkpoint_dir)
                shutil.rmtree(output, ignore_errors=True)
                logger.info(
                    "Removed %s: it was made from an earlier save of %s, and NeMo saves a new checkpoint there",
                    output,
                    checkpoint_dir.name,
                )
            earlier = self._outputs.pop(checkpoint_dir, None)
            if earlier is not None and earlier.output == output:
                earlier.output = None

    def register_save(self, checkpoint_dir: Path, checkpoint: Dict[str, Any], request: Any) -> None:
        """NeMo's checkpoint IO issued a save (global rank 0 records it): finished once written, at once for a sync
        save, in the async ``request``'s finalize step."""
        if not self.is_global_zero():
            return
        self.sync(in_save=True)
        save = self.register(Path(checkpoint_dir), int(checkpoint.get("global_step", -1)))
        if request is None:
            save.written = True
        else:
            request.add_finalize_fn(save.mark_written)

    def register(
        self, checkpoint_dir: Path, global_step: int, best: Optional[Dict[str, Any]] = None
    ) -> CheckpointSave:
        """Record a save that was just issued (not finished yet)."""
        with self.lock:
            save = self.schedule.register(Path(checkpoint_dir), global_step, self.fit)
            save.best, save.run = best, self.run_id
        self.notify("on_register", save)
        return save

    def is_gone(self, save: CheckpointSave) -> bool:
        """Whether ``save``'s checkpoint is removed or being removed, or was saved again since it finished."""
        with self.lock:
            removing = save.path in self._removing
        return removing or self._changed(save)

    def _changed(self, save: CheckpointSave) -> bool:
        """Whether the checkpoint's files are no longer those ``save`` finished with."""
        return files_gone(save.path) or (save.identity is not None and weights_identity(save.path) != save.identity)

    def after_step(self) -> None:
        """The training loop's per-step call: the stepper thread does :meth:`consolidate_finished`'s pass within
        50 ms (unless a pass handed over is still waiting); returns at once."""
        if not self._step_handed:
            self._step_handed = True
            self._stepper.hand(self._step_pass)

    def _step_pass(self) -> None:
        self._step_handed = False  # cleared first: a step ending from now on hands another pass
        self._pass(bounded=True)

    def sync(self, in_save: bool = False) -> None:
        """Finish the pass handed over by :meth:`after_step`, in this thread (never while holding :attr:`lock`).
        ``in_save``: the training thread waits in a save; the seconds count in :attr:`synced_seconds`."""
        start = time.perf_counter()
        self._stepper.drain()
        if in_save:
            self.synced_seconds += time.perf_counter() - start

    def consolidate_finished(self, bounded: bool = True) -> None:
        """Hand the due saves that finished since the last call to the consolidation process, give ``-last`` copies
        their step's output, reap and start consolidations; returns at once. ``bounded``: within ``max_pending``."""
        self.sync()
        self._pass(bounded)

    def _pass(self, bounded: bool) -> None:
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
        self.notify("on_changed")

    def consolidate_newest(self) -> bool:
        """Queue the newest finished checkpoint (unless consolidated already); ``False`` if there is none."""
        self.consolidate_finished()
        newest = self.schedule.newest_finished
        if newest is None:
            return False
        if newest.consolidated:
            self.notify("on_newest", newest)
        elif not newest.state.outstanding:
            self.queue.submit(newest)
            self.notify("on_changed")
        return True

    def finish_fit(self) -> None:
        """End of ``fit``: queue what is due (all of it), with ``latest`` the newest checkpoint, and what the features
        consolidate then; forget saves that never finished (each is logged)."""
        self.consolidate_finished(bounded=False)
        if self.policy.consolidates_at_fit_end:
            self.consolidate_newest()
        self.notify("on_fit_end")
        for save in self.schedule.drop_pending():
            logger.warning(
                "Checkpoint %s (global step %d) never finished; not consolidated.", save.path, save.global_step
            )

    def _place_copy(self, copy: CheckpointSave) -> None:
        """Give a finished ``-last`` copy its step's output (links, now or once published), or its own consolidation
        when that checkpoint was removed before it could be consolidated."""
        source = copy.copy_of
        if source is None or not is_copy_name(copy.path.name):
            return
        with self.lock:
            if source.output is not None and (source.output / METADATA_FILENAME).is_file():
                self._link_copy(copy, source)
            elif source.state.outstanding or (not copy.due and source.state is RequestState.NONE):
                source.copies.append(copy)
            elif not copy.due:
                return
            elif source.state in (RequestState.DROPPED, RequestState.NONE) or source.output is not None:
                self._substitute(source, copy)  # removed before it could start, or its output went with it

    def _substitute(self, source: CheckpointSave, copy: CheckpointSave) -> None:
        """``source`` was removed before its consolidation could start: consolidate its ``-last`` copy instead."""
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
        """Hard-link ``source``'s output into the ``-last`` copy (never into a copy whose removal has started), only
        when the copy is the same run, ``fit`` and global step as the save."""
        name = self.settings.output_dirname
        with self.lock:
            output = source.output
            if output is None or not (output / METADATA_FILENAME).is_file():
                return
            mine, its = (copy.run, copy.fit, copy.global_step), (source.run, source.fit, source.global_step)
            if mine != its:
                logger.warning(
                    "Not linking the output of %s into %s: another save (run %s, fit %d, global step %d; the output's "
                    "is run %s, fit %d, global step %d)",
                    source.path.name,
                    copy.path.name,
                    *mine,
                    *its,
                )
                return
            if self.is_gone(copy):
                logger.debug("Checkpoint %s is gone or being removed; not linking %s into it", copy.path, output)
                return
            replace: Dict[str, bytes] = {}
            for observer in self.observers:
                replace.update(observer.link_files(output, copy))
            try:
                link_output(output, copy.path / name, replace_files=replace)
            except OSError:
                logger.exception("Could not reuse %s for the copy %s", output, copy.path)
                return
            copy.consolidated, copy.output = True, copy.path / name
            self._outputs[copy.path] = copy

    def remove_checkpoint(self, checkpoint_dir: Path, remove: Callable[[], None]) -> None:
        """Run ``remove`` (NeMo's removal, any thread) without racing the checkpoint's consolidation: a waiting
        request is dropped, a running one delays it; observers see the removal just before ``remove`` runs."""
        checkpoint_dir = Path(checkpoint_dir)
        with self.lock:
            self._removing.add(checkpoint_dir)

        def removal() -> None:
            with self.lock:
                self.deleting.add(checkpoint_dir)
                self.notify("before_removal", checkpoint_dir)
            remove()

        if self._queue is None:
            removal()
        else:
            self._queue.remove_checkpoint(checkpoint_dir, removal)
        self.notify("on_changed")

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
        self.notify("on_changed")

    def _lost(self, save: CheckpointSave, reason: str) -> None:
        """Count a due consolidation lost to a removal, and log it (the first as a warning)."""
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
        """A request ended (from the queue's poll or wait: the stepper's thread, or the training thread's)."""
        output = save.path / self.settings.output_dirname
        if error is not None:
            if self._changed(save):  # its files went (or were saved again) under it, not through a removal it delays
                self._lost(save, f"its checkpoint was removed or saved again while it was consolidated ({error})")
            else:
                logger.error(
                    "Consolidation of checkpoint %s (global step %d) failed: %s", save.path, save.global_step, error
                )
        else:
            with self.lock:
                if self._changed(save):  # its directory was saved into again (or deleted) while it ran
                    if (save.path / "weights").is_dir():  # not being deleted: it would pass for the new weights'
                        shutil.rmtree(output, ignore_errors=True)
                    self._lost(save, "NeMo saved a new checkpoint into its directory (or removed it) while it ran")
                    error = "its checkpoint was saved again (or removed) while it was consolidated"
                else:
                    save.consolidated, save.output = True, output
                    self._outputs[save.path] = save
        self.notify("on_ended", save, None if error is not None else self._record(save), error)
        if error is None:
            self.notify("on_published", save)
            with self.lock:
                copies, save.copies = save.copies, []
                if copies:  # links and directory syncs (tens of ms on a busy disk): not in the training loop
                    self._linker.hand(lambda: self._link_copies(copies, save))
        self.notify("on_changed")

    def _link_copies(self, copies: List[CheckpointSave], save: CheckpointSave) -> None:
        """Link ``save``'s output into its ``-last`` copies (the linker's thread; never raises)."""
        for copy in copies:
            try:
                self._link_copy(copy, save)
            except Exception:  # noqa: BLE001 - a copy without its output is logged, the run goes on
                logger.exception("Could not reuse the output of %s for the copy %s", save.path, copy.path)

    def _record(self, save: CheckpointSave) -> ConsolidationRecord:
        """A :class:`ConsolidationRecord` of a published output, logged in one INFO line."""
        output = save.path / self.settings.output_dirname
        try:
            size = sum(entry.stat().st_size for entry in output.iterdir() if entry.is_file())
        except OSError:
            size = 0
        post_seconds = (save.post_command or {}).get("seconds")  # the time after publishing is not the consolidation's
        if not isinstance(post_seconds, (int, float)) or isinstance(post_seconds, bool):
            post_seconds = 0.0
        record = ConsolidationRecord(output, save.global_step, max((save.seconds or 0.0) - post_seconds, 0.0), size)
        logger.info(
            "Consolidated %s (global step %d): %.1f MB in %.1f s (%.1f MB/s)",
            output,
            save.global_step,
            size / 1e6,
            record.seconds,
            record.bytes_per_second / 1e6,
        )
        return record
