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

"""NeMo's ``MegatronCheckpointIO`` with checkpoint consolidation at a chosen cadence."""

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from lightning.fabric.utilities.types import _PATH
from nemo.lightning.io import pl as nemo_io_pl
from nemo.lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint
from nemo.lightning.pytorch.strategies.utils import ckpt_to_dir
from nemo.utils.get_rank import is_global_rank_zero

from nemo_patch.consolidate import DEFAULT_MAX_SHARD_SIZE, link_consolidated_output
from nemo_patch.consolidation_policy import (
    DEFAULT_FORMAT,
    ConsolidationPolicy,
    output_dirname,
    resolve_policy,
    validate_format,
    validate_max_pending,
    validate_max_shard_size,
)
from nemo_patch.consolidation_schedule import CheckpointSave, ConsolidationSchedule
from nemo_patch.consolidation_worker import DEFAULT_MAX_PENDING, ConsolidationQueue
from nemo_patch.latest_pointer import update_latest_pointer

__all__ = ["MegatronCheckpointIO"]

logger = logging.getLogger(__name__)


class MegatronCheckpointIO(nemo_io_pl.MegatronCheckpointIO):
    """NeMo's distributed-checkpoint IO that also consolidates finished checkpoints into safetensors.

    Saving and loading are NeMo's, unchanged. With consolidation on, global rank 0 records every save it issues;
    once a save is *finished* (written, async finalization done, and NeMo's ``<ckpt>-unfinished`` marker removed),
    :meth:`consolidate_finished` hands the saves due under the cadence to a separate consolidation process
    (:class:`nemo_patch.consolidation_worker.ConsolidationQueue`), which writes ``<ckpt>/consolidated/`` (see
    :func:`nemo_patch.consolidate.consolidate_checkpoint`); ``<root>/LATEST`` then points at the newest one.
    :class:`nemo_patch.MegatronStrategy` drives it from Lightning's hooks. A consolidation failure is logged and
    never raised into the training loop.

    Args:
        *args: forwarded to NeMo's ``MegatronCheckpointIO``.
        save_consolidated: ``None`` (default), ``True`` or ``False``; see
            :func:`nemo_patch.consolidation_policy.resolve_policy`.
        ckpt_consolidation_frequency: ``None`` (default), ``"each"``, ``"latest"`` or ``"every_n:<k>"``.
        consolidation_max_shard_size: most bytes of tensor data per output safetensors file (default 5 * 10**9).
        consolidation_max_pending: consolidation requests that may wait behind the running one (default 2).
        consolidation_format: ``"safetensors"`` (default, ``<ckpt>/consolidated``) or ``"hf"`` (``<ckpt>/hf``).
        **kwargs: forwarded to NeMo's ``MegatronCheckpointIO``.

    Raises:
        ValueError: for an invalid or contradictory consolidation setting (the message lists the accepted forms).
    """

    def __init__(
        self,
        *args: Any,
        save_consolidated: Optional[bool] = None,
        ckpt_consolidation_frequency: Optional[str] = None,
        consolidation_max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
        consolidation_max_pending: int = DEFAULT_MAX_PENDING,
        consolidation_format: str = DEFAULT_FORMAT,
        **kwargs: Any,
    ) -> None:
        policy = resolve_policy(save_consolidated, ckpt_consolidation_frequency)
        self.consolidation_max_shard_size = validate_max_shard_size(
            consolidation_max_shard_size, "consolidation_max_shard_size"
        )
        self.consolidation_max_pending = validate_max_pending(consolidation_max_pending, "consolidation_max_pending")
        self.consolidation_format = validate_format(consolidation_format, "consolidation_format")
        super().__init__(*args, **kwargs)
        self._set_policy(save_consolidated, ckpt_consolidation_frequency, policy)

    def _set_policy(
        self, save_consolidated: Optional[bool], frequency: Optional[str], policy: Optional[ConsolidationPolicy]
    ) -> None:
        self.save_consolidated = save_consolidated
        self.ckpt_consolidation_frequency = frequency
        self.consolidation: Optional[ConsolidationSchedule] = ConsolidationSchedule(policy) if policy else None
        self._queue: Optional[ConsolidationQueue] = None
        self._outputs: Dict[int, Path] = {}
        self._copies: Dict[int, List[CheckpointSave]] = {}

    @classmethod
    def from_checkpoint_io(
        cls,
        checkpoint_io: nemo_io_pl.MegatronCheckpointIO,
        save_consolidated: Optional[bool] = None,
        ckpt_consolidation_frequency: Optional[str] = None,
        max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
        max_pending: int = DEFAULT_MAX_PENDING,
        output_format: str = DEFAULT_FORMAT,
    ) -> "MegatronCheckpointIO":
        """Make a consolidating IO with the same settings as NeMo's ``checkpoint_io`` (which is left untouched).

        Raises:
            ValueError: for an invalid or contradictory consolidation setting.
        """
        policy = resolve_policy(save_consolidated, ckpt_consolidation_frequency)
        upgraded = cls.__new__(cls)
        upgraded.__dict__.update(vars(checkpoint_io))
        upgraded.consolidation_max_shard_size = max_shard_size
        upgraded.consolidation_max_pending = max_pending
        upgraded.consolidation_format = validate_format(output_format, "consolidation_format")
        upgraded._set_policy(save_consolidated, ckpt_consolidation_frequency, policy)
        return upgraded

    @property
    def consolidation_policy(self) -> Optional[ConsolidationPolicy]:
        """The cadence, or ``None`` when consolidation is off."""
        return self.consolidation.policy if self.consolidation else None

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> Any:
        """Save as NeMo does; with consolidation on, global rank 0 also records the save for consolidation.

        Returns:
            NeMo's return value (the async request for an async save, else ``None``).
        """
        request = super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        if self.consolidation is not None and is_global_rank_zero():
            save = self.consolidation.register(ckpt_to_dir(path), int(checkpoint.get("global_step", -1)))
            if request is None:
                save.written = True
            else:
                request.add_finalize_fn(save.mark_written)
        return request

    @staticmethod
    def is_checkpoint_gone(save: CheckpointSave) -> bool:
        """Whether a finished checkpoint has been removed or is being removed: its directory or DCP metadata is
        missing, or NeMo's ``<ckpt>-unfinished`` marker is back (NeMo sets it while deleting a checkpoint)."""
        return (
            ModelCheckpoint.is_checkpoint_unfinished(save.path) or not (save.path / "weights" / ".metadata").is_file()
        )

    @property
    def queue(self) -> ConsolidationQueue:
        """The consolidation process queue of this run (created on first use, on global rank 0)."""
        if self._queue is None:
            self._queue = ConsolidationQueue(
                self._on_consolidated,
                max_pending=self.consolidation_max_pending,
                max_shard_size=self.consolidation_max_shard_size,
                output_format=self.consolidation_format,
            )
        return self._queue

    def consolidate_finished(self) -> None:
        """Hand the saves that finished since the last call and are due under the cadence to the consolidation
        process, and reap/start consolidation processes. Returns at once (called from the training loop)."""
        if self.consolidation is None:
            return
        due, copies = self.consolidation.collect_finished(self.is_checkpoint_gone)
        for save in due:
            self.queue.submit(save)
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
        elif not newest.queued:
            self.queue.submit(newest)
        return True

    def finish_fit(self) -> None:
        """End of ``fit``: queue what is due and, in ``latest`` mode, the newest checkpoint; forget saves that never
        finished (each is logged). Does not wait: see :meth:`wait_for_consolidation`."""
        if self.consolidation is None:
            return
        self.consolidate_finished()
        if self.consolidation.policy.consolidates_at_fit_end:
            self.consolidate_newest()
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

    def remove_checkpoint_safely(self, checkpoint_dir: Path, remove: Callable[[], None]) -> None:
        """Run ``remove`` for a checkpoint without racing its consolidation (NeMo's top-k removal)."""
        if self._queue is None:
            remove()
        else:
            self._queue.remove_checkpoint(Path(checkpoint_dir), remove)

    def _on_consolidated(self, save: CheckpointSave, error: Optional[str]) -> None:
        if error is not None:
            logger.error(
                "Consolidation of checkpoint %s (global step %d) failed: %s", save.path, save.global_step, error
            )
            return
        save.consolidated = True
        self._point_latest(save.path)
        self._outputs[save.global_step] = save.path / output_dirname(self.consolidation_format)
        self._link_copies(save.global_step)

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

    def _point_latest(self, checkpoint_dir: Path) -> None:
        try:
            update_latest_pointer(checkpoint_dir)
        except OSError:
            logger.exception("Could not point LATEST at %s", checkpoint_dir)
