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

"""What the training process hears of each consolidation after it ended: the callbacks' ``on_consolidation_end`` /
``on_consolidation_failed`` hooks, and a post command's metrics in the trainer's loggers. Never imports NeMo."""

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from nemo_patch.engine.output_layout import OUTPUT_DIRNAMES, post_command_log_path
from nemo_patch.training.latest import read_output_metadata
from nemo_patch.training.schedule import CheckpointSave, ConsolidationObserver

__all__ = ["END_HOOK", "FAILED_HOOK", "ConsolidationOutcome", "HookCaller", "Observer", "POST_COMMAND_READERS"]

logger = logging.getLogger(__name__)

#: The hooks a callback may define.
END_HOOK = "on_consolidation_end"
FAILED_HOOK = "on_consolidation_failed"
#: What a post command did after a publish, for its outcome: ``read(settings, save, output_dir)`` of an extension that
#: runs one (the last registered answers; each is called once per published output with a ``save.post_command``).
POST_COMMAND_READERS: List[Callable[[Any, CheckpointSave, Path], Any]] = []


@dataclass(frozen=True)
class ConsolidationOutcome:
    """What one consolidation of a training run came to: the ``result`` that ``on_consolidation_end`` and
    ``on_consolidation_failed`` receive.

    Attributes:
        output_dir: the published output directory (``<ckpt>/consolidated`` or ``<ckpt>/hf``); for a failure, where
            it would have been.
        checkpoint_dir: the checkpoint it was made from.
        format: ``"safetensors"`` or ``"hf"``.
        global_step: the checkpoint's global step (``-1`` if unknown).
        bytes: bytes of the output's files on disk (0 for a failure).
        seconds: wall seconds the consolidation took in the consolidation process, its post command excluded.
        metadata: the output's ``metadata.json`` as it was when the result was reaped (its ``"post_command"`` entry
            included); ``{}`` for a failure.
        post_command: what the post command did (a ``PostCommandResult`` of :data:`POST_COMMAND_READERS`), or
            ``None`` without one (or for a failure: it runs only after a publish).
        error: ``None`` for a published output, else the one-line reason it failed.
    """

    output_dir: Path
    checkpoint_dir: Path
    format: str
    global_step: int
    bytes: int = 0
    seconds: float = 0.0
    metadata: Dict[str, Any] = field(default_factory=dict)
    post_command: Optional[Any] = None
    error: Optional[str] = None

    @property
    def published(self) -> bool:
        """Whether the output was published (``on_consolidation_end``), not failed."""
        return self.error is None

    @property
    def metrics(self) -> Dict[str, float]:
        """The post command's metrics (``{}`` without any)."""
        return dict(getattr(self.post_command, "metrics", None) or {})


class HookCaller:
    """Calls ``on_consolidation_end`` / ``on_consolidation_failed`` on the callbacks that define them, never letting
    an exception out: the first of each callback's hook is logged with its traceback, later ones at debug level."""

    def __init__(self) -> None:
        self._failed: Set[Tuple[int, str]] = set()

    @staticmethod
    def wanted(trainer: Any) -> bool:
        """Whether any of ``trainer``'s callbacks defines one of the hooks."""
        return any(
            callable(getattr(callback, END_HOOK, None)) or callable(getattr(callback, FAILED_HOOK, None))
            for callback in getattr(trainer, "callbacks", None) or []
        )

    def __call__(self, trainer: Any, pl_module: Any, outcome: ConsolidationOutcome) -> None:
        name = END_HOOK if outcome.published else FAILED_HOOK
        for callback in list(getattr(trainer, "callbacks", None) or []):
            hook = getattr(callback, name, None)
            if not callable(hook):
                continue
            try:
                hook(trainer, pl_module, outcome)
            except Exception:
                key = (id(callback), name)
                first = key not in self._failed
                self._failed.add(key)
                (logger.error if first else logger.debug)(
                    "%s.%s raised for %s (global step %d); training continues%s",
                    type(callback).__name__,
                    name,
                    outcome.output_dir,
                    outcome.global_step,
                    "; later exceptions of this hook are logged at debug level" if first else "",
                    exc_info=first,
                )


class Observer(ConsolidationObserver):
    """A run's consolidations that ended, reported in the training loop (:meth:`report`)."""

    def __init__(self, coordinator: Any) -> None:
        super().__init__(coordinator)
        self._ended: List[Tuple[CheckpointSave, Optional[Any], Optional[Any], Optional[str]]] = []
        self._reported = 0
        self._call_hooks = HookCaller()

    def on_ended(self, save: CheckpointSave, record: Optional[Any], error: Optional[str]) -> None:
        """Keep a request that ended for :meth:`outcomes`, with what its post command did."""
        post = None
        if error is None and save.post_command is not None:
            output = save.path / self.coordinator.settings.output_dirname
            for read in POST_COMMAND_READERS:
                post = read(self.coordinator.settings, save, output)
        with self.coordinator.lock:
            self._ended.append((save, record, post, error))

    def outcomes(self, start: int = 0) -> List[ConsolidationOutcome]:
        """A :class:`ConsolidationOutcome` for each consolidation that ended, from the ``start``-th on (oldest
        first), made now: an output is named where it is now (under ``retained/`` once NeMo removed its checkpoint)
        and its ``metadata.json`` read from there."""
        settings = self.coordinator.settings
        output_format = {name: key for key, name in OUTPUT_DIRNAMES.items()}.get(settings.output_dirname, "")
        with self.coordinator.lock:
            outcomes = []
            for save, record, post, error in self._ended[start:]:
                output = save.path / settings.output_dirname
                if error is None and save.output is not None and save.output.name == output.name:
                    output = save.output
                    kept_log = post_command_log_path(output)
                    if post is not None and kept_log.is_file():  # retention kept the command's log beside it
                        post = dataclasses.replace(post, log=str(kept_log))
                outcomes.append(
                    ConsolidationOutcome(
                        output_dir=output,
                        checkpoint_dir=save.path,
                        format=output_format,
                        global_step=save.global_step,
                        bytes=record.bytes if record is not None else 0,
                        seconds=record.seconds if record is not None else save.seconds or 0.0,
                        metadata=(read_output_metadata(output) or {}) if error is None else {},
                        post_command=post,
                        error=error,
                    )
                )
        return outcomes

    def report(self, trainer: Any) -> None:
        """For each consolidation that ended since the last call: its post command's metrics to ``trainer.loggers``
        at its checkpoint's global step, then the callbacks' hooks."""
        ended = self._ended[self._reported :]  # appended by the coordinator's stepper thread: no lock to look
        if not ended:  # most steps
            return
        if not self._call_hooks.wanted(trainer) and not any(getattr(post, "metrics", None) for _, _, post, _ in ended):
            self._reported += len(ended)  # nothing to log or call: no outcome (and no metadata.json) to make
            return
        new = self.outcomes(self._reported)
        self._reported += len(new)
        pl_module = getattr(trainer, "lightning_module", None)
        for outcome in new:
            if outcome.metrics:
                step = outcome.global_step if outcome.global_step >= 0 else trainer.global_step
                try:
                    for trainer_logger in trainer.loggers:
                        trainer_logger.log_metrics(outcome.metrics, step=step)
                except Exception:
                    logger.exception("Checkpoint consolidation: logging the post command's metrics failed")
            self._call_hooks(trainer, pl_module, outcome)
