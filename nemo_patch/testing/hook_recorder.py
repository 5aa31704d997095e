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

"""Callbacks with ``on_consolidation_end``/``on_consolidation_failed`` hooks, for the tests of those hooks.

:class:`RecordConsolidationHooks` appends one JSON line per call to a file (``fit_run --record-hooks``:
``<out>/hooks.jsonl``); :class:`RaisingConsolidationHook` raises in every call (``fit_run --raising-hook``).

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

import json
from pathlib import Path
from typing import Any, Union

from lightning.pytorch.callbacks import Callback

__all__ = ["HOOK_ERROR", "RaisingConsolidationHook", "RecordConsolidationHooks"]

#: The message of :class:`RaisingConsolidationHook`'s exception.
HOOK_ERROR = "this hook raises on purpose"


class RecordConsolidationHooks(Callback):
    """Appends to ``path`` one JSON object per hook call: ``hook`` (``"end"`` or ``"failed"``), the trainer's global
    step then, whether ``on_train_end`` had run (``after_train_end``: reaped when ``fit`` ended), whether
    ``pl_module`` is the trainer's module, and the result's fields (``output_exists`` too)."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = str(path)
        self.train_ended = False

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.train_ended = True

    def on_consolidation_end(self, trainer: Any, pl_module: Any, result: Any) -> None:
        self._record("end", trainer, pl_module, result)

    def on_consolidation_failed(self, trainer: Any, pl_module: Any, result: Any) -> None:
        self._record("failed", trainer, pl_module, result)

    def _record(self, hook: str, trainer: Any, pl_module: Any, result: Any) -> None:
        entry = {
            "hook": hook,
            "trainer_global_step": int(trainer.global_step),
            "after_train_end": self.train_ended,
            "pl_module_is_the_model": pl_module is trainer.lightning_module,
            "output_dir": str(result.output_dir),
            "output_exists": Path(result.output_dir).is_dir(),
            "checkpoint_dir": str(result.checkpoint_dir),
            "format": result.format,
            "global_step": result.global_step,
            "bytes": result.bytes,
            "seconds": result.seconds,
            "metadata": result.metadata,
            "post_command": None if result.post_command is None else result.post_command.to_json(),
            "post_command_ok": None if result.post_command is None else result.post_command.ok,
            "metrics": result.metrics,
            "error": result.error,
        }
        with open(self.path, "a") as handle:
            handle.write(json.dumps(entry) + "\n")


class RaisingConsolidationHook(Callback):
    """Raises ``RuntimeError(HOOK_ERROR)`` from every ``on_consolidation_end`` call (counted in :attr:`calls`)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_consolidation_end(self, trainer: Any, pl_module: Any, result: Any) -> None:
        self.calls += 1
        raise RuntimeError(HOOK_ERROR)
