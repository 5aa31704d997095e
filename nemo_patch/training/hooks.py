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

"""What the training process hears of each consolidation after it ended: its outcome, the callbacks' hooks, and the
post command's metrics.

When the consolidation process answers a request (global rank 0, reaped in the training loop's hooks or, for those
still running when ``fit`` ends, in the strategy's teardown), the coordinator makes a :class:`ConsolidationOutcome`;
:class:`nemo_patch.training.callback.ConsolidationCallback` then logs the post command's metrics to the trainer's
loggers at the checkpoint's global step and calls, on every callback of the trainer that defines it,

* ``on_consolidation_end(trainer, pl_module, result)`` once per published output, and
* ``on_consolidation_failed(trainer, pl_module, result)`` once per consolidation that ran and published nothing
  (failed, stopped, or its checkpoint was removed or saved again while it ran);

``result`` is the :class:`ConsolidationOutcome`. A hook runs in the training loop: it is for quick work (log a line,
record a path, start something that runs elsewhere); evaluations and uploads belong in the post command
(``ConsolidationConfig.post_command``), which runs in the consolidation process. An exception in a hook is logged
(the first of each hook with its traceback, later ones at debug level) and never fails training.

Standard library and the engine's post command result only: never NeMo or Lightning (the trainer is duck-typed).
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Set, Tuple

from nemo_patch.engine.post_command import PostCommandResult

__all__ = ["END_HOOK", "FAILED_HOOK", "ConsolidationOutcome", "HookCaller", "read_metadata"]

logger = logging.getLogger(__name__)

#: The hooks a callback may define.
END_HOOK = "on_consolidation_end"
FAILED_HOOK = "on_consolidation_failed"
_METADATA_MAX_BYTES = 16 << 20


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
        post_command: what the post command did (:class:`nemo_patch.engine.post_command.PostCommandResult`), or
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


def read_metadata(output_dir: Path) -> Dict[str, Any]:
    """An output's ``metadata.json`` as a dict; ``{}`` when it is missing, too large or not a JSON object."""
    path = Path(output_dir) / "metadata.json"
    try:
        if path.stat().st_size > _METADATA_MAX_BYTES:
            return {}
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class HookCaller:
    """Calls ``on_consolidation_end`` / ``on_consolidation_failed`` on the callbacks that define them, never letting
    an exception out: the first of each callback's hook is logged with its traceback, later ones at debug level."""

    def __init__(self) -> None:
        self._failed: Set[Tuple[int, str]] = set()

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
