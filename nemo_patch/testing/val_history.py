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

"""Record the validation loss a test run logs, by global step, to check what ``"best"`` consolidated.

Test aid: nothing in the product imports ``nemo_patch.testing`` (import-linter contract).
"""

from typing import Any, Dict

from lightning.pytorch.callbacks import Callback

__all__ = ["ValLossHistory"]


class ValLossHistory(Callback):
    """Records NeMo's logged ``val_loss`` after each validation: :attr:`values` maps global step -> value."""

    def __init__(self) -> None:
        self.values: Dict[int, float] = {}

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Take ``val_loss`` from the trainer's callback metrics (absent before NeMo logged one)."""
        value = trainer.callback_metrics.get("val_loss")
        if value is not None:
            self.values[int(trainer.global_step)] = float(value)
