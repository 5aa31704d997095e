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

The cadence counts *finished checkpoints by global step* (NeMo's ``<name>-last`` copy of a step is not counted again:
it gets the step's output), stored in each checkpoint so that the count goes on across a resume. Extensions take part
through :class:`ConsolidationObserver`. Never imports torch, NeMo or Lightning.
"""

import enum
import importlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

from nemo_patch.engine.checkpoint_layout import is_marked_unfinished, weights_written
from nemo_patch.training.policy import ConsolidationPolicy

__all__ = ["OBSERVER_FACTORIES", "CheckpointSave", "ConsolidationObserver", "ConsolidationSchedule", "ObserverOf"]
__all__ += ["RequestState", "files_gone", "register_observer", "weights_identity"]

logger = logging.getLogger(__name__)


class RequestState(enum.Enum):
    """Where a save's consolidation request stands (only the queue changes it, under its lock); ``SKIPPED``: the
    queue was full; ``DROPPED``: its checkpoint was removed, or ``fit`` ended, before it could start."""

    NONE = "none"
    WAITING = "waiting"
    RUNNING = "running"
    PUBLISHED = "published"
    FAILED = "failed"
    SKIPPED = "skipped"
    DROPPED = "dropped"

    @property
    def outstanding(self) -> bool:
        """Waiting or running."""
        return self in (RequestState.WAITING, RequestState.RUNNING)


@dataclass(eq=False)
class CheckpointSave:
    """One checkpoint save issued by the run (identity: the object itself; NeMo saving into a directory again is a
    new save).

    Attributes:
        path, global_step: the checkpoint directory, and the trainer's global step when it was saved.
        written: whether the checkpoint IO finished writing it (at once for a sync save, when an async one is
            finalized).
        consolidated, output: whether an output of these weights exists, and where it is now.
        best: the ``"best"`` cadence's record, for ``metadata.json``, when it was the best checkpoint when saved.
        seconds: wall seconds its consolidation process ran.
        fit: which ``fit`` of this process saved it (a second ``fit`` starts its global steps again).
        state, due: its request's :class:`RequestState`, and whether the cadence made it due.
        copy_of, copies: for NeMo's ``-last`` copy, the save of the same step in the same ``fit`` (the same weights),
            whose output it receives; for that save, the copies waiting for it.
        identity: :func:`weights_identity` when it finished (a directory saved again since is not mistaken for it).
        post_command: what a post command did after the publish, as the consolidation process reported it.
        run: the id of the training run that saved it (recorded in its output's ``metadata.json``), if known.
    """

    path: Path
    global_step: int
    written: bool = False
    consolidated: bool = False
    best: Optional[Dict[str, Any]] = None
    seconds: Optional[float] = None
    fit: int = 0
    state: RequestState = RequestState.NONE
    due: bool = False
    copy_of: Optional["CheckpointSave"] = None
    copies: List["CheckpointSave"] = field(default_factory=list)
    identity: Optional[Tuple[int, ...]] = None
    output: Optional[Path] = None
    post_command: Optional[Dict[str, Any]] = None
    run: Optional[str] = None

    def mark_written(self) -> None:
        """Finalize callback for async saves."""
        self.written = True


@dataclass
class _Count:
    """Finished checkpoints counted by distinct global step: in all, and in the cadence phase of the last one."""

    total: int = 0
    last_step: Optional[int] = None
    phase_start: Optional[int] = None
    in_phase: int = 0

    def add(self, global_step: int, policy: ConsolidationPolicy) -> bool:
        """Count a checkpoint of ``global_step``; ``False`` (nothing counted) for a step already counted."""
        if global_step == self.last_step:
            return False
        self.total += 1
        self.last_step = global_step
        phase = policy.phase_at(global_step)
        start = phase.start_step if phase is not None else 0
        self.in_phase = self.in_phase + 1 if start == self.phase_start else 1
        self.phase_start = start
        return True


class ConsolidationSchedule:
    """Which finished checkpoint saves of a run are consolidated under ``policy``."""

    def __init__(self, policy: ConsolidationPolicy) -> None:
        self.policy = policy
        self.pending: List[CheckpointSave] = []
        #: Finished checkpoints of the run so far (by distinct global step, including those before a resume), and
        #: of the current cadence phase.
        self.finished = _Count()
        #: The same for issued saves (what a checkpoint saved now records for a resume from it).
        self._registered = _Count()
        #: The newest finished checkpoint (highest global step; a step's first finished copy wins over its ``-last``).
        self.newest_finished: Optional[CheckpointSave] = None
        #: Every finished save of this run (``-last`` copies included), oldest first.
        self.history: List[CheckpointSave] = []
        #: Saves that were due under the cadence but had been removed (NeMo's top-k) by the time they finished.
        self.removed_while_due: List[CheckpointSave] = []
        #: The last save counted (not a copy): a ``-last`` copy of its step in the same ``fit`` is a copy of it.
        self._counted: Optional[CheckpointSave] = None

    @property
    def finished_count(self) -> int:
        """Finished checkpoints of the run so far, counted by distinct global step (includes those before a resume)."""
        return self.finished.total

    def begin_fit(self) -> None:
        """A new ``fit`` starts: its global steps may start again, so its first save of a step is never taken for a
        copy of an earlier fit's save of that step. The counts go on."""
        self.finished.last_step = self._registered.last_step = None
        self._counted = None

    def register(self, path: Path, global_step: int, fit: int = 0) -> CheckpointSave:
        """Record a save that the checkpoint IO has just issued (not yet finished), by the ``fit``-th fit."""
        save = CheckpointSave(Path(path), int(global_step), fit=fit)
        self._registered.add(save.global_step, self.policy)
        self.pending.append(save)
        return save

    def collect_finished(
        self, is_gone: Callable[[CheckpointSave], bool]
    ) -> Tuple[List[CheckpointSave], List[CheckpointSave]]:
        """Move finished saves out of :attr:`pending`, in save order (up to the first not yet written).

        Args:
            is_gone: tells whether a finished checkpoint was removed since (it still counts, but is not consolidated).

        Returns:
            ``(due, copies)``: the saves to consolidate now, and the finished ``-last`` copies of a step already
            counted (each with its ``copy_of`` when both were saved by the same ``fit``, and due when that one was).
        """
        due, copies = [], []
        while self.pending and self.pending[0].written:
            save = self.pending.pop(0)
            gone = is_gone(save)
            if not gone:
                self.history.append(save)
            if not self.finished.add(save.global_step, self.policy):
                counted = self._counted
                if counted is not None and counted.fit == save.fit and counted.global_step == save.global_step:
                    save.copy_of, save.due = counted, counted.due
                if not gone:
                    copies.append(save)  # the -last copy of a step already counted
                continue
            is_due = self.policy.is_due(save.global_step, self.finished.in_phase, save.best is not None)
            save.due, self._counted = is_due, save
            if gone:
                logger.debug("Checkpoint %s was removed after it finished; nothing to consolidate.", save.path)
                if is_due:
                    self.removed_while_due.append(save)
                continue
            self.newest_finished = save
            if is_due:
                due.append(save)
        return due, copies

    def finished_save(self, path: Path) -> Optional[CheckpointSave]:
        """The finished save of this run (not a ``-last`` copy of another name) at ``path``, if any."""
        path = Path(path)
        return next((save for save in reversed(self.history) if save.path == path), None)

    def drop_pending(self) -> List[CheckpointSave]:
        """Forget saves that never finished (called when ``fit`` ends); returns them."""
        dropped, self.pending = self.pending, []
        return dropped

    def state_dict(self, global_step: int) -> Dict[str, Any]:
        """``{"finished_count", "global_step", "phase_start", "phase_count"}`` for a checkpoint saved at
        ``global_step`` (counting its own step: when a run resumes from it, every save up to it has finished)."""
        count = _Count(**vars(self._registered))
        count.add(int(global_step), self.policy)
        return {
            "finished_count": count.total,
            "global_step": int(global_step),
            "phase_start": count.phase_start,
            "phase_count": count.in_phase,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the counts from the checkpoint the run resumes from (a state of another cadence counts the run's
        finished checkpoints as its first phase's)."""
        step = int(state["global_step"])
        phase = self.policy.phase_at(step)
        start = phase.start_step if phase is not None else 0
        if state.get("phase_start") == start:
            in_phase = int(state["phase_count"])
        else:
            in_phase = int(state["finished_count"]) if start == 0 else 0
        for count in (self.finished, self._registered):
            count.total, count.last_step = int(state["finished_count"]), step
            count.phase_start, count.in_phase = start, in_phase


def weights_identity(checkpoint_dir: Path) -> Tuple[int, ...]:
    """Device, inode, size and modification time (ns) of the files a save writes last (DCP's ``.metadata``,
    megatron-core's ``metadata.json``; ``-1`` for one missing): a new save into the directory changes it."""
    parts: List[int] = []
    for name in (".metadata", "metadata.json"):
        try:
            stat = os.stat(Path(checkpoint_dir) / "weights" / name)
        except OSError:
            parts.append(-1)
            continue
        parts += [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns]
    return tuple(parts)


def files_gone(checkpoint_dir: Path) -> bool:
    """Whether a checkpoint is not (or no longer) a finished one on disk: NeMo's ``-unfinished`` marker is there (set
    while it saves or deletes it), or the file its format writes last is missing."""
    return is_marked_unfinished(checkpoint_dir) or not weights_written(checkpoint_dir / "weights")


class ConsolidationObserver:
    """A later feature's part in a run's consolidation (outputs kept past removals, ``BEST``, the journal, ...): the
    coordinator calls each method at the moment its name says (global rank 0 unless noted; those marked *locked* with
    the coordinator's lock held). Here they do nothing.

    Args:
        coordinator: the run's :class:`~nemo_patch.training.coordinator.ConsolidationCoordinator`.
    """

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    def on_fit_start(self, trainer: Any) -> None:
        """``fit`` starts (every rank, before any step); may refuse the run with ``ValueError``."""

    def on_train_start(self, root: Optional[Path]) -> None:
        """Training starts; ``root`` is the checkpoint root when it exists."""

    def on_register(self, save: CheckpointSave) -> None:
        """``save`` was issued (not finished yet)."""

    def before_removal(self, checkpoint_dir: Path) -> None:
        """*Locked*: NeMo removes ``checkpoint_dir`` now, or saves into it again (its output goes)."""

    def on_ended(self, save: CheckpointSave, record: Optional[Any], error: Optional[str]) -> None:
        """A consolidation ended: published (``record``) or not (``error``)."""

    def on_published(self, save: CheckpointSave) -> None:
        """``save``'s output was published (after :meth:`on_ended`)."""

    def on_newest(self, save: CheckpointSave) -> None:
        """On-demand or end-of-fit ``latest``: the newest finished checkpoint, ``save``, is consolidated already."""

    def on_fit_end(self) -> None:
        """``fit`` ends normally: queue what the feature consolidates then."""

    def on_exception(self) -> None:
        """``fit`` ends by an exception: queue what the feature consolidates then."""

    def on_changed(self) -> None:
        """The waiting or running consolidations changed."""

    def link_files(self, output: Path, copy: CheckpointSave) -> Dict[str, bytes]:
        """*Locked*: files to write instead of linking them when ``output`` is linked into the ``-last`` ``copy``."""
        return {}

    def report(self, trainer: Any) -> None:
        """What ended since the last call, reported in the training loop (never raises into it)."""


@dataclass(frozen=True)
class ObserverOf:
    """``<module>.Observer(coordinator)``, the module (a dotted name) imported on the first call: a factory for
    :func:`register_observer` that imports nothing until a coordinator is made."""

    module: str

    def __call__(self, coordinator: Any) -> ConsolidationObserver:
        return cast(ConsolidationObserver, importlib.import_module(self.module).Observer(coordinator))


#: Every new coordinator's observers are ``factory(coordinator)`` of these, in order (:func:`register_observer`).
OBSERVER_FACTORIES: List[Callable[[Any], ConsolidationObserver]] = []


def register_observer(factory: Callable[[Any], ConsolidationObserver]) -> None:
    """Give every coordinator made from now on the observer ``factory(coordinator)`` (once), after those before it."""
    if factory not in OBSERVER_FACTORIES:
        OBSERVER_FACTORIES.append(factory)
