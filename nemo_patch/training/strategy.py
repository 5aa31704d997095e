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

"""NeMo's ``MegatronStrategy`` with control over when checkpoints are consolidated.

Imports NeMo and Lightning. Does not apply the overlay itself: :mod:`nemo_patch.overlay` installs this class under
NeMo's public name once this module has been executed.
"""

import difflib
import importlib
import inspect
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Type, Union

import fiddle._src.experimental.dataclasses as fdl_dc
import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from nemo.lightning.io import pl as nemo_io_pl
from nemo.lightning.io.mixin import _io_transform_args
from nemo.lightning.pytorch.strategies.utils import ckpt_to_dir

from nemo_patch.training.config import DEFAULT_TIMEOUT, SETTINGS, ConsolidationConfig
from nemo_patch.training.fit_end import FitEnd
from nemo_patch.training.io_chain import find_base_checkpoint_io, replace_base_checkpoint_io
from nemo_patch.training.policy import ConsolidationPolicy
from nemo_patch.training.settings import (
    CONFIG_ARGUMENT,
    STRATEGY_ARGUMENTS,
    ConsolidationSettings,
    declare_arguments,
    deprecated_keywords,
    merge_deprecated_keywords,
    warn_deprecated,
)

__all__ = ["DEFAULT_TIMEOUT", "MegatronStrategy"]


def _consolidating_io_class() -> Type["MegatronCheckpointIO"]:
    # Imported on use, not at the top: the overlay may define this module while nemo_patch.training.checkpoint_io is
    # itself half-way through importing NeMo (NeMo's import is what triggers the overlay).
    from nemo_patch.training.checkpoint_io import MegatronCheckpointIO

    return MegatronCheckpointIO


#: The strategy's consolidation arguments, in the order of its signature.
_OWN_ARGS = [argument.name for argument in STRATEGY_ARGUMENTS]
#: The deprecated flat keywords (``ckpt_consolidation_dtype=``, ...) -> the config field each gives.
_DEPRECATED = deprecated_keywords("strategy")
#: ``ckpt_consolidation_<field>`` for every config field (those added since the flat keywords too) -> the field: what
#: a keyword that is not ours is compared with, to suggest the config's spelling.
_FLAT_SPELLINGS = {f"ckpt_consolidation_{spec.field}": spec.field for spec in SETTINGS}

logger = logging.getLogger(__name__)

# Looked up in sys.modules: the overlay hook imports this module while NeMo's strategies package is initialising.
_nemo_megatron_strategy = importlib.import_module("nemo.lightning.pytorch.strategies.megatron_strategy")
#: NeMo's own class (captured before the overlay replaces the public name; a reload finds the original again).
if TYPE_CHECKING:
    from nemo.lightning.pytorch.strategies.megatron_strategy import MegatronStrategy as NeMoMegatronStrategy

    from nemo_patch.training.checkpoint_io import MegatronCheckpointIO
else:
    NeMoMegatronStrategy = getattr(
        _nemo_megatron_strategy, "_NEMO_MEGATRON_STRATEGY", _nemo_megatron_strategy.MegatronStrategy
    )
setattr(_nemo_megatron_strategy, "_NEMO_MEGATRON_STRATEGY", NeMoMegatronStrategy)


def _io_chain_names(checkpoint_io: Any) -> List[str]:
    """Class names of a checkpoint IO chain, outermost first (Lightning's ``_WrappingCheckpointIO`` layers)."""
    names = []
    while checkpoint_io is not None:
        names.append(f"{type(checkpoint_io).__module__}.{type(checkpoint_io).__qualname__}")
        checkpoint_io = getattr(checkpoint_io, "_checkpoint_io", None)
    return names


def _refuse_misspelt_arguments(kwargs: Dict[str, Any]) -> None:
    """NeMo's ``MegatronStrategy`` passes keyword arguments it does not know on to Lightning, which ignores some, so a
    misspelt ``ckpt_consolidaton_frequency=`` would silently leave consolidation off. A keyword that looks like one of
    ours (starts with ``ckpt_consolid`` or ``consolidat``, or is close to one) and is not NeMo's raises instead.

    Raises:
        TypeError: naming the keyword and the closest of this strategy's arguments (for one close to
            ``ckpt_consolidation_<field>`` of a config field, the field's spelling in the config).
    """
    nemo = set(inspect.signature(NeMoMegatronStrategy.__init__).parameters)
    candidates = [*_OWN_ARGS, *_FLAT_SPELLINGS]
    for name in kwargs:
        if name in nemo:
            continue
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.8)
        if close or name.startswith(("ckpt_consolid", "consolidat", "save_consol")):
            closest = close[0] if close else difflib.get_close_matches(name, candidates, n=1, cutoff=0.0)[0]
            if closest in _FLAT_SPELLINGS:
                closest = f"{CONFIG_ARGUMENT}=ConsolidationConfig({_FLAT_SPELLINGS[closest]}=...)"
            raise TypeError(
                f"MegatronStrategy got an unexpected keyword argument {name!r}; did you mean {closest!r}? "
                f"(consolidation arguments: {', '.join(_OWN_ARGS)})"
            )


def _config_with_deprecated_keywords(given: Dict[str, Any], config: Any) -> Any:
    """``config`` with the settings given as deprecated flat keywords (by keyword), with a ``DeprecationWarning``
    naming them and their spelling in the config; ``config`` itself when there are none.

    Raises:
        ValueError: an invalid value (naming its keyword), or a config that sets one of them to another value.
    """
    if not given:
        return config
    fields = {_DEPRECATED[keyword]: value for keyword, value in given.items()}
    spelling = ", ".join(f"{field}=..." for field in fields)
    warn_deprecated(
        f"MegatronStrategy's {', '.join(given)} {'is' if len(given) == 1 else 'are'} deprecated and will be removed "
        f"in the next minor release: pass {CONFIG_ARGUMENT}=ConsolidationConfig({spelling}) instead."
    )
    names = {field: keyword for keyword, field in _DEPRECATED.items()}
    return merge_deprecated_keywords(fields, names, config)


def _warn_without_effect(settings: ConsolidationSettings) -> None:
    """A config that changes a default while consolidation is off (no frequency, no ``save_consolidated=True``) does
    nothing; say so once, naming what it sets, instead of leaving the user to find out that nothing was
    consolidated."""
    changed = settings.config.changed()
    if changed and not settings.enabled:
        logger.warning(
            "%s=ConsolidationConfig(%s) given, but checkpoint consolidation is off: pass "
            "ckpt_consolidation_frequency (or save_consolidated=True) to consolidate checkpoints.",
            CONFIG_ARGUMENT,
            ", ".join(f"{field}={value!r}" for field, value in changed.items()),
        )


class MegatronStrategy(NeMoMegatronStrategy):
    """NeMo's ``MegatronStrategy`` plus a choice of when finished checkpoints are consolidated.

    A consolidated checkpoint is ``<ckpt>/consolidated/model.safetensors`` (the full, unsharded model weights; above
    the shard size, ``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``) plus
    ``metadata.json``, next to the distributed checkpoint; ``<checkpoint root>/LATEST`` names the newest one. See
    :mod:`nemo_patch.engine.consolidate`. The consolidation arguments are resolved here, once, into
    :attr:`consolidation_settings` (a frozen :class:`~nemo_patch.ConsolidationSettings`), which the checkpoint IO, the
    queue and the consolidation process receive as one value.

    NeMo's own arguments (those before ``*`` in the signature) are NeMo's ``MegatronStrategy``'s, passed on unchanged.
    The flat keywords this strategy took before ``ckpt_consolidation`` (``ckpt_consolidation_dtype=...``,
    ``ckpt_consolidation_keep=...``, ...) still work, with a ``DeprecationWarning``; they are removed in the next minor
    release.

    Args:
        {consolidation arguments}
        **kwargs: NeMo's ``MegatronStrategy`` keyword arguments, unchanged.

    Raises:
        ValueError: for an invalid frequency, a ``save_consolidated`` that is not ``None``/``True``/``False``,
            ``save_consolidated=False`` together with a frequency, a ``ckpt_consolidation`` that is not a
            ``ConsolidationConfig``, an invalid value given as a deprecated flat keyword, or such a keyword together
            with a ``ConsolidationConfig`` that sets the same field to another value. Raised before anything else is
            set up (a ``ConsolidationConfig`` validates its own fields when it is made).
        TypeError: a keyword that is neither NeMo's nor one of these but looks like one (a misspelling), naming the
            closest.

    Checkpoints are consolidated only once *finished*: written, async save finalized, and NeMo's
    ``<ckpt>-unfinished`` marker removed. Global rank 0 hands them to a separate consolidation process, one at a time
    (:mod:`nemo_patch.training.worker`); the training loop never waits for it, other ranks do nothing. A failed
    consolidation is logged and training continues. NeMo's ``-last`` copy of a step is counted with that step and
    gets the step's consolidated files (hard links), not a second consolidation.
    """

    def __init__(
        self,
        *args: Any,
        save_consolidated: Optional[bool] = None,
        ckpt_consolidation_frequency: Optional[str] = None,
        ckpt_consolidation: Optional[ConsolidationConfig] = None,
        **kwargs: Any,
    ) -> None:
        # The consolidation arguments are declared in nemo_patch.training.settings (STRATEGY_ARGUMENTS; this method's
        # __signature__ lists them); they are resolved before NeMo sets anything up.
        deprecated = {keyword: kwargs.pop(keyword) for keyword in list(kwargs) if keyword in _DEPRECATED}
        _refuse_misspelt_arguments(kwargs)
        config = _config_with_deprecated_keywords(deprecated, ckpt_consolidation)
        self.consolidation_settings = ConsolidationSettings.from_arguments(
            save_consolidated, ckpt_consolidation_frequency, config
        )
        _warn_without_effect(self.consolidation_settings)
        super().__init__(*args, **kwargs)
        # NeMo's IOMixin may have recorded the init arguments from inside NeMo's own __init__ (without ours).
        io_config = getattr(self, "__io__", None)
        if io_config is not None:
            for name, value in self._own_io_args().items():
                setattr(io_config, name, value)
        checkpoint_io: Optional[CheckpointIO] = getattr(self, "_checkpoint_io", None)
        if checkpoint_io is not None:
            self._checkpoint_io = self._with_consolidation(checkpoint_io)

    def _own_io_args(self) -> Dict[str, Any]:
        """The consolidation arguments NeMo's context should record to rebuild this strategy: those given, with the
        config (deprecated flat keywords included) as one ``ckpt_consolidation`` when it is not the default, as a
        fiddle config (what NeMo's ``IOMixin`` makes of a dataclass argument)."""
        settings = self.consolidation_settings
        own: Dict[str, Any] = {}
        if settings.save_consolidated is not None:
            own["save_consolidated"] = settings.save_consolidated
        if settings.frequency is not None:
            own["ckpt_consolidation_frequency"] = settings.frequency
        if settings.config != ConsolidationConfig():
            own[CONFIG_ARGUMENT] = fdl_dc.convert_dataclasses_to_configs(settings.config, allow_post_init=True)
        return own

    def io_transform_args(self, init_fn: Callable, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """Record the constructor arguments (NeMo's ``IOMixin`` hook) exactly as NeMo records them for its own
        ``MegatronStrategy``; the consolidation arguments are added once they are resolved (:meth:`_own_io_args`).
        With none given, the checkpoint's ``context/io.json`` is the same as stock NeMo's."""
        for name in [*_OWN_ARGS, *_DEPRECATED]:
            kwargs.pop(name, None)
        return _io_transform_args(self, NeMoMegatronStrategy.__init__, *args, **kwargs)

    def _with_consolidation(self, checkpoint_io: CheckpointIO) -> CheckpointIO:
        """Give ``checkpoint_io`` this strategy's consolidation settings.

        NeMo's stock ``MegatronCheckpointIO`` is replaced (inside any wrappers, e.g. the async one) by
        :class:`nemo_patch.MegatronCheckpointIO` with the same settings; a :class:`nemo_patch.MegatronCheckpointIO`
        takes the strategy's settings when the strategy has any and keeps its own otherwise; any other checkpoint IO is
        kept as it is, without consolidation (a warning says so if consolidation was asked for).
        """
        settings = self.consolidation_settings
        if not settings.requested:
            return checkpoint_io
        base = find_base_checkpoint_io(checkpoint_io)
        if isinstance(base, _consolidating_io_class()):
            base.set_consolidation_settings(settings)
            return checkpoint_io
        if not settings.enabled:
            return checkpoint_io  # e.g. save_consolidated=False: NeMo's checkpoint IO as it is
        if type(base) is nemo_io_pl.MegatronCheckpointIO:
            return replace_base_checkpoint_io(
                checkpoint_io, lambda io: _consolidating_io_class().from_checkpoint_io(io, settings)
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
        return base.consolidation_policy if isinstance(base, _consolidating_io_class()) else None

    def _ensure_consolidating_io(self) -> None:
        """With consolidation on, make sure the consolidating checkpoint IO is still in the chain.

        Something may have replaced the checkpoint IO after this strategy was built: NeMo's PEFT callback rebuilds it
        with ``create_checkpoint_io`` in its ``setup`` (assigning ``_checkpoint_io`` directly), and user code may do
        the same. NeMo's stock ``MegatronCheckpointIO`` found at the bottom of the new chain is replaced by the
        consolidating one with this strategy's settings, inside whatever wrappers are there (the wrapper objects stay
        the same, so references to them stay valid). Any other checkpoint IO cannot consolidate: an error names the
        chain, and the run goes on without consolidation.
        """
        settings = self.consolidation_settings
        if not settings.enabled or not self._checkpoint_io:
            return
        base = find_base_checkpoint_io(self._checkpoint_io)
        if isinstance(base, _consolidating_io_class()):
            return
        chain = " > ".join(_io_chain_names(self._checkpoint_io))
        if type(base) is nemo_io_pl.MegatronCheckpointIO:
            self._checkpoint_io = replace_base_checkpoint_io(
                self._checkpoint_io, lambda io: _consolidating_io_class().from_checkpoint_io(io, settings)
            )
            logger.info(
                "The checkpoint IO was replaced after MegatronStrategy was built (now %s, e.g. by NeMo's PEFT "
                "callback); checkpoint consolidation was re-installed inside it",
                chain,
            )
            return
        logger.error(
            "The checkpoint IO was replaced after MegatronStrategy was built by %s, which cannot consolidate: "
            "checkpoints of this run will NOT be consolidated (ckpt_consolidation_frequency=%r). Use NeMo's "
            "MegatronCheckpointIO or nemo_patch.MegatronCheckpointIO at the bottom of the chain.",
            chain,
            str(settings.policy),
        )

    def setup(self, trainer: pl.Trainer) -> None:
        """Re-install consolidation if a callback replaced the checkpoint IO (see :meth:`_ensure_consolidating_io`;
        Lightning runs every callback's ``setup`` before this), NeMo's set-up, then attach a
        :class:`ConsolidationCallback` when consolidation is on."""
        self._ensure_consolidating_io()
        super().setup(trainer)
        from nemo_patch.training.callback import ConsolidationCallback

        if self.consolidation_policy is not None and not any(
            isinstance(callback, ConsolidationCallback) for callback in trainer.callbacks  # type: ignore[attr-defined]
        ):
            trainer.callbacks.append(ConsolidationCallback(trainer))  # type: ignore[attr-defined]

    def consolidate_latest_checkpoint(self, wait: bool = True) -> Optional[Path]:
        """Consolidate the newest finished checkpoint of this run now and point ``LATEST`` at it.

        What ``latest`` mode does when ``fit`` ends, on demand (any mode with consolidation on). The work runs in the
        consolidation process like any other; on global rank 0 only.

        Args:
            wait: wait for it (up to ``ConsolidationConfig.timeout`` seconds) before returning.

        Returns:
            The ``consolidated/`` directory once it exists, else ``None`` (nothing finished yet, consolidation off,
            another rank, not waited for, timed out or failed; failures are logged).
        """
        base = find_base_checkpoint_io(self.checkpoint_io)
        if not isinstance(base, _consolidating_io_class()) or not base.consolidate_newest():
            return None
        if wait:
            base.wait_for_consolidation(self.consolidation_settings.config.timeout)
            base.end_consolidation_process_unless_fitting()
        newest = base.consolidation.newest_finished if base.consolidation is not None else None
        if newest is None:
            return None
        return newest.path / base.consolidation_settings.output_dirname if newest.consolidated else None

    def consolidate_best_checkpoint(self, wait: bool = True) -> Optional[Path]:
        """Consolidate the run's best finished checkpoint by ``ModelCheckpoint``'s monitored metric now (unless its
        output exists) and point ``<root>/BEST`` at it.

        What a ``"best"`` cadence does when ``fit`` ends, on demand (any cadence with consolidation on, once ``fit``
        has started, so that the trainer's ``ModelCheckpoint`` is known). Global rank 0 only.

        Args:
            wait: wait for it (up to ``ConsolidationConfig.timeout`` seconds) before returning.

        Returns:
            The output directory once it exists, else ``None`` (no best checkpoint recorded, not finished or removed,
            consolidation off, another rank, not waited for, timed out or failed; each is logged).
        """
        base = find_base_checkpoint_io(self.checkpoint_io)
        if not isinstance(base, _consolidating_io_class()) or not self.is_global_zero:
            return None
        trainer = getattr(self, "trainer", None)  # NeMo's MegatronStrategy.setup keeps it
        if base.checkpoint_callback is None and trainer is not None:
            base.checkpoint_callback = trainer.checkpoint_callback
        best = base.consolidate_best()
        if best is None:
            return None
        if wait:
            base.wait_for_consolidation(self.consolidation_settings.config.timeout)
            base.end_consolidation_process_unless_fitting()
        return best.path / base.consolidation_settings.output_dirname if best.consolidated else None

    def _log_final_consolidation_metrics(self) -> None:
        """Report the consolidations that ended while ``fit`` was ending (after the callbacks' last hook): their
        metrics, and the callbacks' ``on_consolidation_end``/``on_consolidation_failed`` hooks
        (:meth:`ConsolidationCallback.report_consolidations`)."""
        from nemo_patch.training.callback import ConsolidationCallback

        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return
        for callback in trainer.callbacks:
            if isinstance(callback, ConsolidationCallback):
                callback.report_consolidations(trainer)
                for trainer_logger in trainer.loggers:
                    trainer_logger.save()

    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        """NeMo's checkpoint removal (top-k), deferred while that checkpoint is being consolidated and dropping a
        queued consolidation of it, so a consolidation never reads a vanishing checkpoint."""
        base = find_base_checkpoint_io(self.checkpoint_io)
        if isinstance(base, _consolidating_io_class()) and self.is_global_zero:
            base.remove_checkpoint_safely(
                ckpt_to_dir(filepath), lambda: super(MegatronStrategy, self).remove_checkpoint(filepath)
            )
        else:
            super().remove_checkpoint(filepath)

    def teardown(self) -> None:
        """Wait (up to ``ConsolidationConfig.timeout`` seconds) for running and queued consolidations, then NeMo's
        teardown. Runs when ``fit`` ends, normally or by an exception.

        With consolidation on and several ranks, the other ranks wait here too, until global rank 0 is done (on the
        job's rendezvous store, not in a collective: :mod:`nemo_patch.training.fit_end`), so that every rank leaves
        ``fit`` together and a collective right after it does not time out on rank 0."""
        fit_end = FitEnd(self.consolidation_settings.config.timeout) if self.consolidation_settings.enabled else None
        try:
            if fit_end is not None and not self.is_global_zero:
                fit_end.wait()
            base = find_base_checkpoint_io(self._checkpoint_io) if self._checkpoint_io else None
            if isinstance(base, _consolidating_io_class()):
                base.wait_for_consolidation(self.consolidation_settings.config.timeout)
                base.close_consolidation_queue()
                self._log_final_consolidation_metrics()
        except Exception:  # a consolidation problem never fails the run; NeMo's teardown still runs
            logger.exception("Waiting for checkpoint consolidation failed; continuing teardown")
        finally:
            if fit_end is not None and self.is_global_zero:
                fit_end.release()
            super().teardown()


declare_arguments(
    MegatronStrategy,
    "strategy",
    NeMoMegatronStrategy.__init__,
    [argument.parameter for argument in STRATEGY_ARGUMENTS],
)
