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
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from nemo.lightning.io import pl as nemo_io_pl
from nemo.lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint
from nemo.lightning.pytorch.strategies.utils import ckpt_to_dir
from nemo.utils.get_rank import is_global_rank_zero

from nemo_patch.consolidate import CONSOLIDATED_DIRNAME, consolidate_checkpoint
from nemo_patch.consolidation_policy import ConsolidationPolicy, resolve_policy
from nemo_patch.consolidation_schedule import CheckpointSave, ConsolidationSchedule
from nemo_patch.latest_pointer import update_latest_pointer

__all__ = ["MegatronCheckpointIO", "find_base_checkpoint_io", "replace_base_checkpoint_io"]

logger = logging.getLogger(__name__)


class MegatronCheckpointIO(nemo_io_pl.MegatronCheckpointIO):
    """NeMo's distributed-checkpoint IO that also consolidates finished checkpoints into safetensors.

    Saving and loading are NeMo's, unchanged. With consolidation on, global rank 0 records every save it issues;
    once a save is *finished* (written, async finalization done, and NeMo's ``<ckpt>-unfinished`` marker removed),
    :meth:`consolidate_finished` turns the saves due under the cadence into ``<ckpt>/consolidated/`` (see
    :func:`nemo_patch.consolidate.consolidate_checkpoint`) and points ``<root>/LATEST`` at the newest one.
    :class:`nemo_patch.MegatronStrategy` drives it from Lightning's hooks. A consolidation failure is logged and
    never raised into the training loop.

    Args:
        *args: forwarded to NeMo's ``MegatronCheckpointIO``.
        save_consolidated: ``None`` (default), ``True`` or ``False``; see
            :func:`nemo_patch.consolidation_policy.resolve_policy`.
        ckpt_consolidation_frequency: ``None`` (default), ``"each"``, ``"latest"`` or ``"every_n:<k>"``.
        **kwargs: forwarded to NeMo's ``MegatronCheckpointIO``.

    Raises:
        ValueError: for an invalid or contradictory consolidation setting (the message lists the accepted forms).
    """

    def __init__(
        self,
        *args: Any,
        save_consolidated: Optional[bool] = None,
        ckpt_consolidation_frequency: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        policy = resolve_policy(save_consolidated, ckpt_consolidation_frequency)
        super().__init__(*args, **kwargs)
        self._set_policy(save_consolidated, ckpt_consolidation_frequency, policy)

    def _set_policy(
        self, save_consolidated: Optional[bool], frequency: Optional[str], policy: Optional[ConsolidationPolicy]
    ) -> None:
        self.save_consolidated = save_consolidated
        self.ckpt_consolidation_frequency = frequency
        self.consolidation: Optional[ConsolidationSchedule] = ConsolidationSchedule(policy) if policy else None

    @classmethod
    def from_checkpoint_io(
        cls,
        checkpoint_io: nemo_io_pl.MegatronCheckpointIO,
        save_consolidated: Optional[bool] = None,
        ckpt_consolidation_frequency: Optional[str] = None,
    ) -> "MegatronCheckpointIO":
        """Make a consolidating IO with the same settings as NeMo's ``checkpoint_io`` (which is left untouched).

        Raises:
            ValueError: for an invalid or contradictory consolidation setting.
        """
        policy = resolve_policy(save_consolidated, ckpt_consolidation_frequency)
        upgraded = cls.__new__(cls)
        upgraded.__dict__.update(vars(checkpoint_io))
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
    def is_save_finished(save: CheckpointSave) -> bool:
        """Whether a written save is finished: NeMo's unfinished marker is gone and the DCP metadata exists."""
        return (
            not ModelCheckpoint.is_checkpoint_unfinished(save.path) and (save.path / "weights" / ".metadata").is_file()
        )

    def consolidate_finished(self) -> List[Path]:
        """Consolidate the saves that have finished since the last call and are due under the cadence.

        Returns:
            The ``consolidated/`` directories written (empty off rank 0 or with consolidation off).
        """
        if self.consolidation is None:
            return []
        written = []
        for save in self.consolidation.collect_finished(self.is_save_finished):
            output = self._consolidate(save)
            if output is not None:
                written.append(output)
        return written

    def consolidate_newest(self) -> Optional[Path]:
        """Consolidate the newest finished checkpoint of the run and point ``LATEST`` at it.

        A checkpoint that already holds ``consolidated/`` is not consolidated again; ``LATEST`` is pointed at it.

        Returns:
            The ``consolidated/`` directory, or ``None`` if the run finished no checkpoint, consolidation is off, or
            consolidation failed (logged).
        """
        if self.consolidation is None:
            return None
        self.consolidate_finished()
        newest = self.consolidation.newest_finished
        if newest is None:
            return None
        if newest.consolidated and (newest.path / CONSOLIDATED_DIRNAME).is_dir():
            return self._point_latest(newest.path)
        return self._consolidate(newest)

    def finish_fit(self) -> None:
        """End-of-``fit`` step: consolidate what is due, in ``latest`` mode the newest checkpoint, and forget saves
        that never finished (each is logged)."""
        if self.consolidation is None:
            return
        self.consolidate_finished()
        if self.consolidation.policy.consolidates_at_fit_end:
            self.consolidate_newest()
        for save in self.consolidation.drop_pending():
            logger.warning(
                "Checkpoint %s (global step %d) never finished; not consolidated.", save.path, save.global_step
            )

    def _point_latest(self, checkpoint_dir: Path) -> Optional[Path]:
        try:
            update_latest_pointer(checkpoint_dir)
        except OSError:
            logger.exception("Could not point LATEST at %s", checkpoint_dir)
        return checkpoint_dir / CONSOLIDATED_DIRNAME

    def _consolidate(self, save: CheckpointSave) -> Optional[Path]:
        try:
            consolidate_checkpoint(save.path, global_step=save.global_step)
        except Exception:  # a consolidation failure must never kill the training run
            logger.exception("Consolidation of checkpoint %s (global step %d) failed", save.path, save.global_step)
            return None
        save.consolidated = True
        return self._point_latest(save.path)


def find_base_checkpoint_io(checkpoint_io: Any) -> Any:
    """The innermost checkpoint IO under any Lightning ``_WrappingCheckpointIO`` layers (e.g. NeMo's async one)."""
    while isinstance(checkpoint_io, _WrappingCheckpointIO):
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io


def replace_base_checkpoint_io(checkpoint_io: Any, make: Callable[[Any], Any]) -> Any:
    """Replace the innermost checkpoint IO of a wrapper chain by ``make(innermost)``; wrappers are kept.

    Returns:
        The new outermost checkpoint IO (``make(checkpoint_io)`` when there are no wrappers).
    """
    if not isinstance(checkpoint_io, _WrappingCheckpointIO):
        return make(checkpoint_io)
    wrapper = checkpoint_io
    while isinstance(wrapper.checkpoint_io, _WrappingCheckpointIO):
        wrapper = wrapper.checkpoint_io
    # Lightning's setter refuses to replace a configured base IO; assign the attribute it guards.
    wrapper._checkpoint_io = make(wrapper.checkpoint_io)
    return checkpoint_io
