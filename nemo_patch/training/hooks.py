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

"""What the training process hears of each consolidation after it ended: its outcome, the post command's result
and metrics, and the callbacks' hooks.

For each consolidation that ended (global rank 0, reaped in the training loop), :class:`Observer` logs the post
command's result, logs its metrics to the trainer's loggers at the checkpoint's global step and calls the callbacks'
``on_consolidation_end`` / ``on_consolidation_failed`` with a :class:`ConsolidationOutcome`
(docs/after-consolidation.md). An exception in a hook is logged (:class:`HookCaller`) and never fails training.

Standard library, the engine's post command and ``latest``'s metadata reader only: never NeMo or Lightning.
"""

import dataclasses
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from nemo_patch.runs.post_command import PostCommandResult, post_command_log_path, record_result
from nemo_patch.runs.post_command import run_post_command as run_command
from nemo_patch.training.latest import read_output_metadata
from nemo_patch.training.schedule import CheckpointSave, ConsolidationObserver

__all__ = [
    "END_HOOK",
    "FAILED_HOOK",
    "ConsolidationOutcome",
    "HookCaller",
    "Observer",
    "run_post_command",
]

logger = logging.getLogger(__name__)

#: The hooks a callback may define.
END_HOOK = "on_consolidation_end"
FAILED_HOOK = "on_consolidation_failed"


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
        post_command: what the post command did (:class:`nemo_patch.runs.post_command.PostCommandResult`), or
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
    post_command: Optional[PostCommandResult] = None
    error: Optional[str] = None

    @property
    def published(self) -> bool:
        """Whether the output was published (``on_consolidation_end``), not failed."""
        return self.error is None

    @property
    def metrics(self) -> Dict[str, float]:
        """The post command's metrics (``{}`` without any)."""
        return dict(self.post_command.metrics) if self.post_command is not None else {}


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
    """A run's consolidations that ended: the post command's result logged (and recorded in ``metadata.json`` when
    the consolidation process was lost with it), then reported in the training loop (:meth:`report`)."""

    def __init__(self, coordinator: Any) -> None:
        super().__init__(coordinator)
        self._ended: List[Tuple[CheckpointSave, Optional[Any], Optional[PostCommandResult], Optional[str]]] = []
        self._reported = 0
        self._call_hooks = HookCaller()

    def on_ended(self, save: CheckpointSave, record: Optional[Any], error: Optional[str]) -> None:
        """Keep a request that ended for :meth:`outcomes` and log its post command's result: one INFO line, or a
        WARNING when it failed, timed out or was stopped (the output stays published either way)."""
        settings = self.coordinator.settings
        output = save.path / settings.output_dirname
        post: Optional[PostCommandResult] = None
        if error is None and save.post_command is not None:
            post = PostCommandResult.from_json(save.post_command)
            if not post.command:  # lost with the consolidation process: record what is known
                post = PostCommandResult.from_json(
                    {**save.post_command, "command": settings.config.post_command or ""}
                )
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
        with self.coordinator.lock:
            self._ended.append((save, record, post, error))

    def outcomes(self, start: int = 0) -> List[ConsolidationOutcome]:
        """A :class:`ConsolidationOutcome` for each consolidation that ended, from the ``start``-th on (oldest
        first), made now: an output is named where it is now (under ``retained/`` once NeMo removed its checkpoint)
        and its ``metadata.json`` read from there."""
        settings = self.coordinator.settings
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
                        format=settings.config.format,
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
        if not self._call_hooks.wanted(trainer) and not any(
            post is not None and post.metrics for _, _, post, _ in ended
        ):
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


def run_post_command(settings: Any, checkpoint: Path, global_step: Optional[int]) -> Tuple[PostCommandResult, bool]:
    """Run the post command on ``checkpoint``'s published output; returns its result and whether a SIGTERM asked this
    process to end meanwhile (the command was then stopped: this process answers before it ends, rather than dying
    with the command's result unsaid). Never raises for anything the command does."""
    asked: List[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))
    try:
        result = run_command(
            settings.config.post_command,
            checkpoint / settings.output_dirname,
            settings.config.format,
            global_step if isinstance(global_step, int) and global_step >= 0 else None,
            checkpoint,
            timeout=settings.config.post_command_timeout,
            should_stop=lambda: bool(asked),
        )
    except Exception as error:  # noqa: BLE001 - e.g. an unwritable log file: reported, the output stays published
        result = PostCommandResult(
            settings.config.post_command, None, 0.0, False, "", error=f"{type(error).__name__}: {error}"
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    return result, bool(asked)
