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

The checkpoint IO registers saves; everything that follows from them (schedule, queue, outputs, pointers, retention,
journal, metrics) is the run's :class:`nemo_patch.training.coordinator.ConsolidationCoordinator`, which this IO
holds and exposes (its methods here delegate to it).

Imports NeMo, Lightning and the training side's settings and coordinator; never the overlay, the CLI or
``nemo_patch.testing``.
"""

import inspect
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import fiddle._src.experimental.dataclasses as fdl_dc
from lightning.fabric.utilities.types import _PATH
from nemo.lightning.io import pl as nemo_io_pl
from nemo.lightning.io.mixin import _io_transform_args
from nemo.lightning.pytorch.strategies.utils import ckpt_to_dir
from nemo.utils.get_rank import is_global_rank_zero

from nemo_patch.training.coordinator import ConsolidationCoordinator, ConsolidationRecord, best_record
from nemo_patch.training.hooks import ConsolidationOutcome
from nemo_patch.training.policy import ConsolidationPolicy
from nemo_patch.training.queue import ConsolidationQueue
from nemo_patch.training.schedule import CheckpointSave, ConsolidationSchedule
from nemo_patch.training.settings import (
    ConsolidationSettings,
    declare_arguments,
    deprecated_keywords,
    merge_deprecated_keywords,
    warn_deprecated,
)

__all__ = ["ConsolidationRecord", "MegatronCheckpointIO", "best_record"]

#: The deprecated flat keywords (``consolidation_dtype=``, ...) -> the config field each gives.
_DEPRECATED = deprecated_keywords("io")
#: The deprecated keywords for the cadence -> the :class:`ConsolidationSettings` field each gives.
_DEPRECATED_SWITCHES = {"save_consolidated": "save_consolidated", "ckpt_consolidation_frequency": "frequency"}


def _settings_from_deprecated_keywords(given: Dict[str, Any]) -> ConsolidationSettings:
    """The settings the deprecated flat keywords ``given`` (by keyword) make, with a ``DeprecationWarning`` naming
    them and the spelling that replaces them.

    Raises:
        ValueError: for an invalid value (naming its keyword) or a contradictory cadence.
    """
    switches = {_DEPRECATED_SWITCHES[name]: value for name, value in given.items() if name in _DEPRECATED_SWITCHES}
    fields = {_DEPRECATED[name]: value for name, value in given.items() if name in _DEPRECATED}
    arguments = [f"{name}=..." for name in switches]
    if fields:
        arguments.append(f"config=ConsolidationConfig({', '.join(f'{field}=...' for field in fields)})")
    warn_deprecated(
        f"MegatronCheckpointIO's {', '.join(given)} {'is' if len(given) == 1 else 'are'} deprecated and will be "
        "removed in the next minor release: pass consolidation_settings=ConsolidationSettings.from_arguments("
        f"{', '.join(arguments)}) instead."
    )
    names = {field: keyword for keyword, field in _DEPRECATED.items()}
    config = merge_deprecated_keywords(fields, names, None) if fields else None
    return ConsolidationSettings.from_arguments(switches.get("save_consolidated"), switches.get("frequency"), config)


class MegatronCheckpointIO(nemo_io_pl.MegatronCheckpointIO):
    """NeMo's distributed-checkpoint IO that also consolidates finished checkpoints into safetensors.

    Saving and loading are NeMo's, unchanged. With consolidation on, global rank 0 records every save it issues;
    once a save is *finished* (written, async finalization done, and NeMo's ``<ckpt>-unfinished`` marker removed),
    :meth:`consolidate_finished` hands the saves due under the cadence to a separate consolidation process
    (:class:`nemo_patch.training.queue.ConsolidationQueue`), which writes ``<ckpt>/consolidated/`` (see
    :func:`nemo_patch.engine.consolidate.consolidate_checkpoint`); ``<root>/LATEST`` then points at the newest one.
    :class:`nemo_patch.MegatronStrategy` drives it from Lightning's hooks. A consolidation failure is logged and
    never raised into the training loop.

    NeMo's own arguments (those before ``*`` in the signature) are passed on to NeMo's ``MegatronCheckpointIO``
    unchanged. The flat keywords this class took before (``save_consolidated``, ``ckpt_consolidation_frequency`` and
    ``consolidation_<field>`` for the :class:`~nemo_patch.ConsolidationConfig` fields it had, ``consolidation_dtype=``,
    ...) still work, with a ``DeprecationWarning``; they are removed in the next minor release.

    Args:
        consolidation_settings: the consolidation settings (what :class:`nemo_patch.MegatronStrategy` passes;
            ``ConsolidationSettings.from_arguments(frequency="each", config=ConsolidationConfig(...))`` when you build
            this IO yourself); ``None`` (default): no consolidation.

    Raises:
        ValueError: ``consolidation_settings`` that is not a :class:`~nemo_patch.ConsolidationSettings`, or given
            together with a deprecated flat keyword; an invalid or contradictory value given as a deprecated flat
            keyword (the message names it).
    """

    def __init__(
        self, *args: Any, consolidation_settings: Optional[ConsolidationSettings] = None, **kwargs: Any
    ) -> None:
        deprecated = {
            name: kwargs.pop(name) for name in list(kwargs) if name in _DEPRECATED or name in _DEPRECATED_SWITCHES
        }
        if consolidation_settings is not None and deprecated:
            raise ValueError(
                "Pass either consolidation_settings or the deprecated individual consolidation arguments "
                f"({', '.join(deprecated)}), not both."
            )
        if consolidation_settings is not None and not isinstance(consolidation_settings, ConsolidationSettings):
            raise ValueError(
                f"Invalid consolidation_settings {consolidation_settings!r}: expected None or a ConsolidationSettings "
                "(e.g. ConsolidationSettings.from_arguments(frequency=\"each\", config=ConsolidationConfig()))."
            )
        settings = _settings_from_deprecated_keywords(deprecated) if deprecated else consolidation_settings
        super().__init__(*args, **kwargs)
        # NeMo's IOMixin wraps the __init__ of the first class of the hierarchy it sees built: once NeMo's own
        # MegatronCheckpointIO was built in this process, it records the arguments from inside NeMo's __init__,
        # without ours. The context (io.json) must restore this IO as it was built: with its settings, as one value
        # (also when given as the deprecated keywords, which io_transform_args leaves out).
        io_config = getattr(self, "__io__", None)
        if io_config is not None and settings is not None:
            setattr(
                io_config,
                "consolidation_settings",
                fdl_dc.convert_dataclasses_to_configs(settings, allow_post_init=True),
            )
        self.set_consolidation_settings(settings or ConsolidationSettings())

    def io_transform_args(self, init_fn: Callable, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """Record the constructor arguments (NeMo's ``IOMixin`` hook) as NeMo records them for its own
        ``MegatronCheckpointIO``; the consolidation settings are added once they are resolved (in ``__init__``)."""
        for name in [*_DEPRECATED, *_DEPRECATED_SWITCHES, "consolidation_settings"]:
            kwargs.pop(name, None)
        return _io_transform_args(self, nemo_io_pl.MegatronCheckpointIO.__init__, *args, **kwargs)

    def set_consolidation_settings(self, settings: ConsolidationSettings) -> None:
        """Take ``settings`` (already validated) and start a new run's bookkeeping with them."""
        self.consolidation_settings = settings
        #: The run's coordinator (``None`` when consolidation is off).
        self.coordinator: Optional[ConsolidationCoordinator] = (
            ConsolidationCoordinator(settings) if settings.policy else None
        )
        self._checkpoint_callback: Optional[Any] = None
        #: Set while a ``fit`` runs (from its set-up to the strategy's teardown), on global rank 0.
        self.fitting = False

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
    def consolidation(self) -> Optional[ConsolidationSchedule]:
        """The run's schedule of saves (``None`` when consolidation is off)."""
        return self.coordinator.schedule if self.coordinator is not None else None

    @property
    def consolidation_policy(self) -> Optional[ConsolidationPolicy]:
        """The cadence, or ``None`` when consolidation is off."""
        return self.coordinator.schedule.policy if self.coordinator is not None else None

    @property
    def checkpoint_callback(self) -> Optional[Any]:
        """The trainer's ``ModelCheckpoint`` (set by the consolidation callback): its ``best_model_path`` tells which
        saves are the best so far, for ``"best"`` cadences."""
        return self.coordinator.checkpoint_callback if self.coordinator is not None else self._checkpoint_callback

    @checkpoint_callback.setter
    def checkpoint_callback(self, callback: Optional[Any]) -> None:
        self._checkpoint_callback = callback
        if self.coordinator is not None:
            self.coordinator.checkpoint_callback = callback

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> Any:
        """Save as NeMo does; with consolidation on, global rank 0 also records the save for consolidation (and
        first clears an output an earlier save left in that directory: see
        :meth:`ConsolidationCoordinator.before_save`).

        Returns:
            NeMo's return value (the async request for an async save, else ``None``).
        """
        coordinator = self.coordinator if is_global_rank_zero() else None
        if coordinator is not None:
            coordinator.before_save(Path(ckpt_to_dir(path)))
        request = super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        if coordinator is not None:
            best = (
                best_record(self.checkpoint_callback)
                if coordinator.schedule.policy.uses_best and self._names_best(path)
                else None
            )
            save = coordinator.register(Path(ckpt_to_dir(path)), int(checkpoint.get("global_step", -1)), best)
            if request is None:
                save.written = True
            else:
                request.add_finalize_fn(save.mark_written)
        return request

    def _names_best(self, path: _PATH) -> bool:
        """Whether ``ModelCheckpoint.best_model_path`` names ``path`` (it is set before the save is issued)."""
        best = getattr(self.checkpoint_callback, "best_model_path", None)
        return bool(best) and Path(ckpt_to_dir(best)) == Path(ckpt_to_dir(path))

    # --- what the coordinator does, as the strategy, the callback and user code call it -------------------------

    @property
    def queue(self) -> ConsolidationQueue:
        """The consolidation process queue of this run (created on first use, on global rank 0).

        Raises:
            RuntimeError: consolidation is off.
        """
        return self._coordinator().queue

    @property
    def _queue(self) -> Optional[ConsolidationQueue]:
        """The queue if one was created."""
        return self.coordinator._queue if self.coordinator is not None else None

    def _coordinator(self) -> ConsolidationCoordinator:
        if self.coordinator is None:
            raise RuntimeError("checkpoint consolidation is off for this checkpoint IO")
        return self.coordinator

    @property
    def dropped_by_removal(self) -> List[CheckpointSave]:
        """Due checkpoints whose consolidation did not happen because they were removed (or saved again) first."""
        return self.coordinator.dropped_by_removal if self.coordinator is not None else []

    @property
    def consolidation_records(self) -> List[ConsolidationRecord]:
        """One :class:`ConsolidationRecord` per published consolidation of this run, oldest first."""
        return self.coordinator.records if self.coordinator is not None else []

    def consolidation_outcomes(self, start: int = 0) -> List[ConsolidationOutcome]:
        """One :class:`~nemo_patch.training.hooks.ConsolidationOutcome` per consolidation of this run that ended
        (published or not), oldest first, from the ``start``-th on (:meth:`ConsolidationCoordinator.outcomes`)."""
        return self.coordinator.outcomes(start) if self.coordinator is not None else []

    @property
    def consolidations_ended(self) -> int:
        """How many consolidations of this run have ended (published or not)."""
        return self.coordinator.ended_count if self.coordinator is not None else 0

    @property
    def skipped_count(self) -> int:
        """Due consolidations of this run that did not happen (queue full, or their checkpoint removed first)."""
        return self.coordinator.skipped_count if self.coordinator is not None else 0

    def begin_fit(self) -> None:
        """A ``fit`` starts (its global steps may start again)."""
        if self.coordinator is not None:
            self.coordinator.begin_fit()

    def consolidate_finished(self, bounded: bool = True) -> None:
        """See :meth:`ConsolidationCoordinator.consolidate_finished`."""
        if self.coordinator is not None:
            self.coordinator.consolidate_finished(bounded)

    def consolidate_newest(self) -> bool:
        """See :meth:`ConsolidationCoordinator.consolidate_newest`."""
        return self.coordinator.consolidate_newest() if self.coordinator is not None else False

    def consolidate_best(self) -> Optional[CheckpointSave]:
        """See :meth:`ConsolidationCoordinator.consolidate_best`."""
        return self.coordinator.consolidate_best() if self.coordinator is not None else None

    def finish_fit(self) -> None:
        """See :meth:`ConsolidationCoordinator.finish_fit`."""
        if self.coordinator is not None:
            self.coordinator.finish_fit()

    def wait_for_consolidation(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for running and queued consolidations (see :meth:`ConsolidationQueue.wait`).

        Returns:
            ``True`` if none is left, ``False`` if the timeout ran out (logged; the running one is stopped).
        """
        return self.coordinator.wait(timeout) if self.coordinator is not None else True

    def start_consolidation_process(self) -> None:
        """Start the run's consolidation process now (training is starting), when this cadence consolidates during
        training, so that its start-up overlaps with training; ``"latest"`` alone waits for the end of ``fit``."""
        if self.coordinator is not None:
            self.coordinator.start_process()

    def close_consolidation_queue(self) -> None:
        """End the run's consolidation process, if any (after :meth:`wait_for_consolidation`, at teardown)."""
        self.fitting = False
        if self.coordinator is not None:
            self.coordinator.close()

    def end_consolidation_process_unless_fitting(self) -> None:
        """After an on-demand consolidation was waited for outside ``fit``: end the consolidation process it started
        (inside ``fit`` it keeps serving the run until teardown)."""
        queue = self._queue
        if not self.fitting and queue is not None and not queue.busy:
            queue.close()

    def remove_checkpoint_safely(self, checkpoint_dir: Path, remove: Callable[[], None]) -> None:
        """Run ``remove`` for a checkpoint (NeMo's removal, from any thread) without racing its consolidation, keeping
        its consolidated output as ``ConsolidationConfig.keep`` says and moving ``LATEST``/``BEST`` off it first (see
        :meth:`ConsolidationCoordinator.remove_checkpoint`)."""
        if self.coordinator is None:
            remove()
        else:
            self.coordinator.remove_checkpoint(Path(checkpoint_dir), remove)

    def reconcile(self, root: Path) -> None:
        """When training starts: see :meth:`ConsolidationCoordinator.reconcile`."""
        if self.coordinator is not None:
            self.coordinator.reconcile(Path(root))


_SETTINGS_PARAMETER = inspect.Parameter(
    "consolidation_settings",
    inspect.Parameter.KEYWORD_ONLY,
    default=None,
    annotation=Optional[ConsolidationSettings],
)
declare_arguments(MegatronCheckpointIO, "io", nemo_io_pl.MegatronCheckpointIO.__init__, [_SETTINGS_PARAMETER])
