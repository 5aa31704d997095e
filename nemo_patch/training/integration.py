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

"""Where checkpoint consolidation plugs into NeMo: each edit of ``MegatronStrategy``, ``MegatronCheckpointIO`` and
``ModelCheckpoint`` is one call of a function here.

Imports Lightning and the training side at module level, NeMo only inside functions (NeMo's modules import this one).
"""

import difflib
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from nemo_patch.training.callback import ConsolidationCallback, consolidation_of, find_base_checkpoint_io
from nemo_patch.training.config import SETTINGS, ConsolidationConfig
from nemo_patch.training.coordinator import ConsolidationCoordinator
from nemo_patch.training.fit_end import FitEnd
from nemo_patch.training.settings import ConsolidationSettings

__all__ = ["ARGUMENTS", "before_deletion", "consolidate_latest_checkpoint", "consolidation_of", "coordinator"]
__all__ += ["ensure_consolidating_io", "find_base_checkpoint_io", "remove_checkpoint", "setup", "strategy_settings"]
__all__ += ["teardown", "with_consolidation"]

logger = logging.getLogger(__name__)


class _NeMoLogging(logging.Handler):
    """Hands the training side's log records to NeMo's logger, so that they read as NeMo's own lines; then to the
    root logger's handlers that do not write to the console. A warning of a rank NeMo silences goes to stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        from nemo.utils import logging as nemo_logging

        root = logging.getLogger().handlers
        done = list(logging.getLogger("nemo_patch.training").handlers)  # these had the record already
        target = getattr(nemo_logging, "_logger", None)
        if target is not None and target.isEnabledFor(record.levelno):
            for handler in target.handlers:  # NeMo's (pytest also attaches its capture to non-propagating loggers)
                if handler not in root and handler not in done and record.levelno >= handler.level:
                    handler.handle(record)
                    done.append(handler)
        nemo_took_it = len(done) > len(logging.getLogger("nemo_patch.training").handlers)
        for handler in root:
            console = getattr(handler, "stream", None) in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
            if not console and handler not in done and record.levelno >= handler.level:
                handler.handle(record)
        if not nemo_took_it and record.levelno >= logging.WARNING:
            # NeMo silences every rank but global rank 0 (unless NEMO_TESTING): a warning of another rank still shows
            (logging.lastResort or logging.StreamHandler()).handle(record)


def use_nemo_logging() -> None:
    """Route the loggers of ``nemo_patch.training``
    through NeMo's logger (:class:`_NeMoLogging`, once per process) instead of propagating; their level becomes
    ``INFO`` unless one was set, as NeMo's INFO lines show."""
    training = logging.getLogger("nemo_patch.training")
    if not any(type(handler).__name__ == "_NeMoLogging" for handler in training.handlers):  # also across reloads
        training.addHandler(_NeMoLogging())
        training.propagate = False
        if training.level == logging.NOTSET:
            training.setLevel(logging.INFO)


#: ``MegatronStrategy``'s consolidation arguments.
ARGUMENTS = ("save_consolidated", "ckpt_consolidation_frequency", "ckpt_consolidation")
#: ``ckpt_consolidation_<field>``, the spelling a user may guess for a config field, -> the field.
_FLAT_SPELLINGS = {f"ckpt_consolidation_{spec.field}": spec.field for spec in SETTINGS}


def strategy_settings(
    save_consolidated: Optional[bool],
    frequency: Optional[str],
    config: Optional[ConsolidationConfig],
    kwargs: Dict[str, Any],
) -> ConsolidationSettings:
    """``MegatronStrategy.__init__``: its consolidation arguments resolved, before NeMo sets anything up.

    Args:
        kwargs: the keywords NeMo passes on to Lightning, which ignores some: one that looks like a consolidation
            argument (a misspelling) is refused rather than leaving consolidation off silently.

    Raises:
        ValueError: an invalid or contradictory value, naming the argument and what is accepted.
        TypeError: a misspelt consolidation keyword, naming the closest argument.
    """
    use_nemo_logging()
    candidates = [*ARGUMENTS, *_FLAT_SPELLINGS]
    for name in kwargs:
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.8)
        if close or name.startswith(("ckpt_consolid", "consolidat", "save_consol")):
            closest = close[0] if close else difflib.get_close_matches(name, candidates, n=1, cutoff=0.0)[0]
            if closest in _FLAT_SPELLINGS:
                closest = f"ckpt_consolidation=ConsolidationConfig({_FLAT_SPELLINGS[closest]}=...)"
            raise TypeError(
                f"MegatronStrategy got an unexpected keyword argument {name!r}; did you mean {closest!r}? "
                f"(consolidation arguments: {', '.join(ARGUMENTS)})"
            )
    settings = ConsolidationSettings(save_consolidated, frequency, config)  # type: ignore[arg-type]
    changed = settings.config.changed()
    if changed and not settings.enabled:
        logger.warning(
            "ckpt_consolidation=ConsolidationConfig(%s) given, but checkpoint consolidation is off: pass "
            "ckpt_consolidation_frequency (or save_consolidated=True) to consolidate checkpoints.",
            ", ".join(f"{field}={value!r}" for field, value in changed.items()),
        )
    return settings


def coordinator(settings: Optional[ConsolidationSettings]) -> Optional[ConsolidationCoordinator]:
    """``MegatronCheckpointIO.__init__``: the run's coordinator, or ``None`` when ``settings`` do not consolidate.

    Raises:
        ValueError: ``settings`` that are neither ``None`` nor a ``ConsolidationSettings``.
    """
    if settings is not None and not isinstance(settings, ConsolidationSettings):
        raise ValueError(
            f"Invalid consolidation_settings {settings!r}: expected None or a ConsolidationSettings "
            "(e.g. ConsolidationSettings(frequency=\"each\", config=ConsolidationConfig()))."
        )
    if settings is None or not settings.enabled:
        return None
    from nemo.utils.get_rank import is_global_rank_zero

    return ConsolidationCoordinator(settings, is_global_zero=is_global_rank_zero)


def _with_settings(checkpoint_io: Any, settings: ConsolidationSettings) -> None:
    checkpoint_io.consolidation_settings = settings
    checkpoint_io.consolidation = coordinator(settings)


def with_consolidation(checkpoint_io: Any, settings: ConsolidationSettings) -> Any:
    """``MegatronStrategy``'s ``checkpoint_io`` argument and setter: ``checkpoint_io`` itself, whose NeMo
    ``MegatronCheckpointIO`` at the bottom of the chain takes the strategy's ``settings`` in place (no copy, no
    wrapper rebuilt). Any other checkpoint IO is kept, without consolidation (a warning says so)."""
    if checkpoint_io is None or not settings.requested:
        return checkpoint_io
    from nemo.lightning.io.pl import MegatronCheckpointIO

    base = find_base_checkpoint_io(checkpoint_io)
    configured = isinstance(base, MegatronCheckpointIO) and getattr(base, "consolidation_settings", None) is not None
    if configured or (settings.enabled and type(base) is MegatronCheckpointIO):
        _with_settings(base, settings)
    elif settings.enabled:
        logger.warning(
            "Checkpoint consolidation needs NeMo's MegatronCheckpointIO; the given %s is used as is and checkpoints "
            "will not be consolidated.",
            type(base).__name__,
        )
    return checkpoint_io


def ensure_consolidating_io(strategy: Any) -> None:
    """Give consolidation back to a checkpoint IO that replaced the strategy's after it was built (user code, or
    NeMo's PEFT callback without the strategy's settings): NeMo's ``MegatronCheckpointIO`` at the bottom of the new
    chain takes the settings in place; any other one cannot consolidate, and an error names the chain."""
    settings, checkpoint_io = strategy.consolidation_settings, strategy._checkpoint_io
    if not settings.enabled or not checkpoint_io or consolidation_of(checkpoint_io) is not None:
        return
    from nemo.lightning.io.pl import MegatronCheckpointIO

    names, layer = [], checkpoint_io
    while layer is not None:
        names.append(f"{type(layer).__module__}.{type(layer).__qualname__}")
        layer = getattr(layer, "_checkpoint_io", None)
    chain = " > ".join(names)
    base = find_base_checkpoint_io(checkpoint_io)
    if type(base) is MegatronCheckpointIO:
        _with_settings(base, settings)
        logger.info(
            "The checkpoint IO was replaced after MegatronStrategy was built (now %s, e.g. by NeMo's PEFT callback); "
            "checkpoint consolidation was re-installed inside it",
            chain,
        )
        return
    logger.error(
        "The checkpoint IO was replaced after MegatronStrategy was built by %s, which cannot consolidate: checkpoints "
        "of this run will NOT be consolidated (ckpt_consolidation_frequency=%r). Use NeMo's MegatronCheckpointIO at "
        "the bottom of the chain.",
        chain,
        str(settings.policy),
    )


def setup(strategy: Any, trainer: Any) -> None:
    """``MegatronStrategy.setup``, after NeMo's own callbacks were added: :func:`ensure_consolidating_io`, then the
    :class:`ConsolidationCallback` is appended (it runs after NeMo's ``ModelCheckpoint`` and
    ``AsyncFinalizerCallback`` in every hook) and set up (Lightning set the callbacks up before the strategy)."""
    use_nemo_logging()
    ensure_consolidating_io(strategy)
    if consolidation_of(strategy.checkpoint_io) is None:
        return
    if not any(isinstance(callback, ConsolidationCallback) for callback in trainer.callbacks):
        callback = ConsolidationCallback(trainer)
        trainer.callbacks.append(callback)
        callback.setup(trainer, trainer.lightning_module, trainer.state.fn)


def teardown(strategy: Any) -> None:
    """``MegatronStrategy.teardown`` (the end of ``fit``, normally or by an exception), before NeMo's: global rank 0
    waits for its consolidations (up to ``ConsolidationConfig.timeout``) and reports the last ones; the other ranks
    wait until it is done (:mod:`.fit_end`). Never raises."""
    settings = strategy.consolidation_settings
    fit_end = FitEnd(settings.config.timeout) if settings.enabled else None
    try:
        if fit_end is not None and not strategy.is_global_zero:
            fit_end.wait()
        consolidation = consolidation_of(strategy._checkpoint_io)  # not the property, which would make an IO
        if consolidation is not None:
            consolidation.wait(consolidation.settings.config.timeout)
            consolidation.close()
            trainer: Any = getattr(strategy, "trainer", None)
            for callback in getattr(trainer, "callbacks", None) or []:
                if isinstance(callback, ConsolidationCallback):
                    callback.report_consolidations(trainer)
                    for trainer_logger in trainer.loggers:
                        trainer_logger.save()
    except Exception:  # a consolidation problem never fails the run; NeMo's teardown still runs
        logger.exception("Waiting for checkpoint consolidation failed; continuing teardown")
    finally:
        if fit_end is not None and strategy.is_global_zero:
            fit_end.release()


def remove_checkpoint(strategy: Any, checkpoint_dir: Any, remove: Callable[[], None]) -> None:
    """``MegatronStrategy.remove_checkpoint`` (NeMo's top-k removal, global rank 0, from any thread): ``remove`` runs
    now, or once a consolidation of that checkpoint that is running has ended; a waiting one is dropped. A
    consolidation never reads a vanishing checkpoint."""
    consolidation = consolidation_of(strategy.checkpoint_io)
    if consolidation is None:
        remove()
    else:
        consolidation.remove_checkpoint(Path(checkpoint_dir), remove)


def before_deletion(checkpoint_callback: Any, checkpoint_dir: Any) -> None:
    """``ModelCheckpoint._del_model_without_trainer`` (global rank 0), before NeMo deletes a checkpoint by itself (its
    resume clean-up of top-k checkpoints beyond ``save_top_k``): the removal is recorded as one through the strategy
    is. Never raises."""
    consolidation = ConsolidationCoordinator.of_checkpoint_callback(checkpoint_callback)
    if consolidation is not None:
        try:
            consolidation.remove_checkpoint(Path(checkpoint_dir), lambda: None)
        except Exception:  # noqa: BLE001 - NeMo's deletion goes on
            logger.exception("Checkpoint consolidation: recording the removal of %s failed", checkpoint_dir)


def consolidate_latest_checkpoint(strategy: Any, wait: bool = True) -> Optional[Path]:
    """``MegatronStrategy.consolidate_latest_checkpoint``: what ``"latest"`` does when ``fit`` ends, on demand."""
    consolidation = consolidation_of(strategy.checkpoint_io)
    if consolidation is None or not consolidation.consolidate_newest():
        return None
    if wait:
        consolidation.wait(consolidation.settings.config.timeout)
        consolidation.end_process_unless_fitting()
    newest = consolidation.schedule.newest_finished
    return newest.path / consolidation.settings.output_dirname if newest and newest.consolidated else None
