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

"""NeMo's ``MegatronStrategy`` with control over when checkpoints are consolidated."""

import importlib
import logging
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from nemo.lightning.io import pl as nemo_io_pl
from nemo.lightning.io.mixin import _io_transform_args

from nemo_patch.checkpoint_io import MegatronCheckpointIO, find_base_checkpoint_io, replace_base_checkpoint_io
from nemo_patch.consolidation_callback import ConsolidationCallback
from nemo_patch.consolidation_policy import ConsolidationPolicy, resolve_policy

__all__ = ["MegatronStrategy"]

logger = logging.getLogger(__name__)

# Looked up in sys.modules: the overlay hook imports this module while NeMo's strategies package is initialising.
_nemo_megatron_strategy = importlib.import_module("nemo.lightning.pytorch.strategies.megatron_strategy")
#: NeMo's own class (captured before the overlay replaces the public name; a reload finds the original again).
NeMoMegatronStrategy = getattr(
    _nemo_megatron_strategy, "_NEMO_MEGATRON_STRATEGY", _nemo_megatron_strategy.MegatronStrategy
)
_nemo_megatron_strategy._NEMO_MEGATRON_STRATEGY = NeMoMegatronStrategy


class MegatronStrategy(NeMoMegatronStrategy):
    """NeMo's ``MegatronStrategy`` plus a choice of when finished checkpoints are consolidated.

    A consolidated checkpoint is ``<ckpt>/consolidated/model.safetensors`` (the full, unsharded model weights) plus
    ``metadata.json``, next to the distributed checkpoint; ``<checkpoint root>/LATEST`` names the newest one. See
    :mod:`nemo_patch.consolidate`.

    Args:
        *args: NeMo's ``MegatronStrategy`` arguments, unchanged.
        save_consolidated: ``None`` (default) or ``False``: no consolidation, exactly NeMo's behaviour, unless a
            frequency is given. ``True``: consolidate, at ``"each"`` unless a frequency is given.
        ckpt_consolidation_frequency: ``None`` (default), ``"each"`` (every finished checkpoint), ``"latest"`` (none
            during training; the newest finished checkpoint once when ``fit`` ends) or ``"every_n:<k>"`` (the k-th,
            2k-th, ... finished checkpoint of the run, counted across resumes; k an integer >= 1). Giving a
            frequency turns consolidation on.
        **kwargs: NeMo's ``MegatronStrategy`` keyword arguments, unchanged.

    Raises:
        ValueError: for an invalid frequency, a ``save_consolidated`` that is not ``None``/``True``/``False``, or
            ``save_consolidated=False`` together with a frequency. Raised before anything else is set up.

    Checkpoints are consolidated only once *finished*: written, async save finalized, and NeMo's
    ``<ckpt>-unfinished`` marker removed. Global rank 0 consolidates; other ranks do nothing. A failed consolidation
    is logged and training continues. NeMo's ``-last`` copy of a step is counted with that step and not
    consolidated separately.
    """

    def __init__(
        self,
        *args: Any,
        save_consolidated: Optional[bool] = None,
        ckpt_consolidation_frequency: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        resolve_policy(save_consolidated, ckpt_consolidation_frequency)  # validate before NeMo sets anything up
        self.save_consolidated = save_consolidated
        self.ckpt_consolidation_frequency = ckpt_consolidation_frequency
        super().__init__(*args, **kwargs)
        # NeMo's IOMixin may have recorded the init arguments from inside NeMo's own __init__ (without ours).
        io_config = getattr(self, "__io__", None)
        if io_config is not None:
            for name, value in self._own_io_args().items():
                setattr(io_config, name, value)
        if self._checkpoint_io is not None:
            self._checkpoint_io = self._with_consolidation(self._checkpoint_io)

    def _own_io_args(self) -> Dict[str, Any]:
        own = {
            "save_consolidated": self.save_consolidated,
            "ckpt_consolidation_frequency": self.ckpt_consolidation_frequency,
        }
        return {name: value for name, value in own.items() if value is not None}

    def io_transform_args(self, init_fn: Callable, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """Record the constructor arguments (NeMo's ``IOMixin`` hook) exactly as NeMo records them for its own
        ``MegatronStrategy``, plus the consolidation arguments when they are given. With neither given, the
        checkpoint's ``context/io.json`` is the same as stock NeMo's."""
        own = {
            name: kwargs.pop(name) for name in ("save_consolidated", "ckpt_consolidation_frequency") if name in kwargs
        }
        config = _io_transform_args(self, NeMoMegatronStrategy.__init__, *args, **kwargs)
        config.update({name: value for name, value in own.items() if value is not None})
        return config

    @property
    def _consolidation_requested(self) -> bool:
        return self.save_consolidated is not None or self.ckpt_consolidation_frequency is not None

    def _with_consolidation(self, checkpoint_io: CheckpointIO) -> CheckpointIO:
        """Give ``checkpoint_io`` this strategy's consolidation settings.

        NeMo's stock ``MegatronCheckpointIO`` is replaced (inside any wrappers, e.g. the async one) by
        :class:`nemo_patch.MegatronCheckpointIO` with the same settings; a :class:`nemo_patch.MegatronCheckpointIO`
        takes the strategy's settings when the strategy has any and keeps its own otherwise; any other checkpoint IO is
        kept as it is, without consolidation (a warning says so if consolidation was asked for).
        """
        if not self._consolidation_requested:
            return checkpoint_io
        policy = resolve_policy(self.save_consolidated, self.ckpt_consolidation_frequency)
        base = find_base_checkpoint_io(checkpoint_io)
        if isinstance(base, MegatronCheckpointIO):
            base._set_policy(self.save_consolidated, self.ckpt_consolidation_frequency, policy)
            return checkpoint_io
        if policy is None:
            return checkpoint_io  # e.g. save_consolidated=False: NeMo's checkpoint IO as it is
        if type(base) is nemo_io_pl.MegatronCheckpointIO:
            return replace_base_checkpoint_io(
                checkpoint_io,
                lambda io: MegatronCheckpointIO.from_checkpoint_io(
                    io, self.save_consolidated, self.ckpt_consolidation_frequency
                ),
            )
        logger.warning(
            "Checkpoint consolidation needs nemo_patch.MegatronCheckpointIO (or NeMo's MegatronCheckpointIO, which is "
            "upgraded automatically); the given %s is used as is and checkpoints will not be consolidated.",
            type(base).__name__,
        )
        return checkpoint_io

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """NeMo's checkpoint IO (built by NeMo's ``create_checkpoint_io``), consolidating when asked to."""
        if not self._checkpoint_io:
            self._checkpoint_io = self._with_consolidation(super().checkpoint_io)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = self._with_consolidation(io) if io is not None else io

    @property
    def consolidation_policy(self) -> Optional[ConsolidationPolicy]:
        """The cadence in effect (``None`` when checkpoints are not consolidated)."""
        base = find_base_checkpoint_io(self.checkpoint_io)
        return base.consolidation_policy if isinstance(base, MegatronCheckpointIO) else None

    def setup(self, trainer: pl.Trainer) -> None:
        """NeMo's set-up, then attach a :class:`ConsolidationCallback` when consolidation is on."""
        super().setup(trainer)
        if self.consolidation_policy is not None and not any(
            isinstance(callback, ConsolidationCallback) for callback in trainer.callbacks
        ):
            trainer.callbacks.append(ConsolidationCallback(trainer))

    def consolidate_latest_checkpoint(self) -> Optional[Path]:
        """Consolidate the newest finished checkpoint of this run now and point ``LATEST`` at it.

        What ``latest`` mode does when ``fit`` ends, on demand (any mode). Runs on global rank 0; returns ``None``
        on other ranks.

        Returns:
            The ``consolidated/`` directory, or ``None`` if nothing was consolidated (no finished checkpoint yet,
            consolidation off, another rank, or a failure, which is logged).
        """
        base = find_base_checkpoint_io(self.checkpoint_io)
        if not isinstance(base, MegatronCheckpointIO):
            return None
        return base.consolidate_newest()


# Importing this module means the overlay is wanted (NEMO_PATCH_DISABLE=1 still turns it off). When it is imported
# before NeMo, NeMo's strategy module is first executed from inside the imports above, before this class exists; the
# start-up hook then leaves the overlay to this line.
importlib.import_module("nemo_patch.overlay").apply_overlay()
